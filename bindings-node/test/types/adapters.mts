// Type-checked usage of oncely/express (ES module resolution).
import { http, RedisStore } from 'oncely'
import { idempotency } from 'oncely/express'

export const mw = idempotency({ store: new RedisStore({ url: 'redis://127.0.0.1:6379' }), tenant: 'acme', bodyCap: 4096 })
export const storable: boolean = http.storableStatus(201)
import { idempotency as plugin } from 'oncely/fastify'
export const registered: Promise<void> = plugin({}, { store: new RedisStore({ url: 'redis://127.0.0.1:6379' }) })
import { idempotentFetch, ResponseError } from 'oncely/fetch'
export const f: Promise<Response> = idempotentFetch(new URL('http://127.0.0.1/'), undefined, { signal: AbortSignal.timeout(1000) })
export const isResponseError = (e: unknown): boolean => e instanceof ResponseError
import { withIdempotency } from 'oncely/grpc'
export const w: object = withIdempotency({}, {}, { store: new RedisStore({ url: 'redis://127.0.0.1:6379' }) })
