// The ES module entry has the same types.
import oncely, { retry, IdempotencyStore, RedisStore, Code } from 'oncely'

const n: number = await retry(async (attempt) => attempt.number, { safe: true })
const store: IdempotencyStore = new oncely.IdempotencyStore()
const code: Code = oncely.Code.UNAVAILABLE
const RS: typeof RedisStore = oncely.RedisStore
console.log(n, store, code, Code.OK, RS)
