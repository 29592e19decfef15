// Type-checked usage of oncely.http and oncely/express (CommonJS resolution).
import { http, IdempotencyStore, HttpStoredResponse } from 'oncely'
import { idempotency, IdempotencyCounters } from 'oncely/express'
import type { IncomingMessage } from 'node:http'

const config = new http.HttpConfig({ methods: ['POST'], bodyCap: 1024, storedHeaders: ['content-type'] })
const decision = config.readKey('POST', ['order-0001'])
const key: string | undefined = decision.key
const status: number | undefined = decision.problem?.status
const scoped: string = http.scope('acme', 'POST', '/orders', key ?? 'order-0001')
const fp: string = http.requestFingerprint('POST', '/orders', 'application/json', Buffer.from('{}'))
const record: Buffer = http.encodeResponse({ status: 201, headers: [{ name: 'etag', value: Buffer.from('"1"') }], body: Buffer.alloc(0) })
const back: HttpStoredResponse = http.decodeResponse(record)
const problemBody: Buffer = http.problem({ kind: 'in_progress', retryAfterMs: 1000 }).body
const readKey = config.keyReader()
const read: string | null | { status: number } = readKey('POST', ['order-0001'])
const req = http.request('acme', 'POST', '/orders', 'order-0001', '/orders', 'application/json', Buffer.from('{}'))
const scopedFp: string | undefined = Array.isArray(req) ? req[1] : undefined
const flatRecord: Buffer = http.encodeRecord(201, ['etag', '"1"'], Buffer.alloc(0))
const flat: Array<number | string> = http.decodeRecord(flatRecord)
export { read, scopedFp, flat }

const mw = idempotency({
  store: new IdempotencyStore(),
  tenant: (req: IncomingMessage) => String(req.headers['x-tenant'] ?? 'default'),
  onReplay: (_req, k: string) => void k,
  wait: false,
})
const n: IdempotencyCounters = mw.counters()
export { status, scoped, fp, back, problemBody, n }

import { idempotency as fastifyIdempotency, IdempotencyPluginOptions } from 'oncely/fastify'
const pluginOptions: IdempotencyPluginOptions = { store: new IdempotencyStore(), global: false, tenant: (r) => String(r.headers['x-tenant']) }
export const plugin: (fastify: any, options: IdempotencyPluginOptions) => Promise<void> = fastifyIdempotency
export { pluginOptions }

import { idempotentFetch } from 'oncely/fetch'
export const fetched: Promise<Response> = idempotentFetch('http://127.0.0.1/orders', { method: 'POST', body: '{}' }, { key: 'order-0001', deadline: 5_000, policy: { maxAttempts: 3 } })

import { withIdempotency } from 'oncely/grpc'
const svc = {
  create: {
    path: '/shop.Orders/Create',
    requestStream: false,
    responseStream: false,
    requestSerialize: (v: unknown) => Buffer.from(JSON.stringify(v)),
    responseSerialize: (v: unknown) => Buffer.from(JSON.stringify(v)),
    responseDeserialize: (b: Buffer) => JSON.parse(b.toString()),
  },
}
export const wrapped: { create: (call: unknown, cb: (e: null, v: object) => void) => void } = withIdempotency(
  svc,
  { create: (_call: unknown, cb: (e: null, v: object) => void) => cb(null, {}) },
  { store: new IdempotencyStore(), wait: false },
)
