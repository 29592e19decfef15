// The ES module entry has the same types.
import oncely, { retry, IdempotencyStore, Code } from 'oncely'

const n: number = await retry(async (attempt) => attempt, { safe: true })
const store: IdempotencyStore = new oncely.IdempotencyStore()
const code: Code = oncely.Code.UNAVAILABLE
console.log(n, store, code, Code.OK)
