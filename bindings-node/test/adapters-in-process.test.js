'use strict'
// oncely/fastify and oncely/grpc over the in-process store (its adapters' entry,
// IdempotencyStore[RUN]): duplicates of a late answer, synchronous throws and replays.
const test = require('node:test')
const assert = require('node:assert/strict')
const grpc = require('@grpc/grpc-js')
const Fastify = require('fastify')
const { IdempotencyStore } = require('oncely')
const { idempotency } = require('oncely/fastify')
const { withIdempotency } = require('oncely/grpc')
const { listen } = require('./fastify-helpers.js')

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
let n = 0
const key = () => `order-fg-${process.pid}-${n++}`

test('fastify: 200 duplicates of a late answer, a sync throw (422), and a replay: one run each, same bytes', async () => {
  const store = new IdempotencyStore()
  const app = Fastify()
  await app.register(idempotency, { store })
  let calls = 0
  app.post('/late', async () => {
    calls++
    await sleep(80)
    return { n: calls }
  })
  app.post('/throw', () => {
    calls++
    const e = new Error('nope')
    e.statusCode = 422
    throw e
  })
  app.post('/sync', (req, reply) => {
    calls++
    reply.code(201).send({ n: calls })
  })
  const u = await listen(app)
  const post = async (p, k, body = '{"a":1}') => {
    const r = await fetch(`${u}${p}`, { method: 'POST', headers: { 'idempotency-key': k, 'content-type': 'application/json' }, body, signal: AbortSignal.timeout(4000) })
    return { status: r.status, body: await r.text() }
  }
  try {
    const k1 = key()
    const all = await Promise.all(Array.from({ length: 200 }, () => post('/late', k1)))
    assert.equal(calls, 1)
    for (const r of all) assert.deepEqual(r, all[0])
    const k2 = key()
    const t = await Promise.all(Array.from({ length: 20 }, () => post('/throw', k2)))
    for (const r of t) assert.deepEqual(r, t[0])
    assert.equal(t[0].status, 422)
    assert.equal(calls, 2)
    const k3 = key()
    const a = await post('/sync', k3)
    const b = await post('/sync', k3)
    assert.deepEqual(b, a)
    assert.equal((await post('/sync', k3, '{"a":2}')).status, 422, 'a reused key with another body')
    assert.equal(calls, 3)
  } finally {
    await app.close()
  }
})

const json = {
  requestSerialize: (v) => Buffer.from(JSON.stringify(v)),
  requestDeserialize: (b) => JSON.parse(b.toString()),
  responseSerialize: (v) => Buffer.from(JSON.stringify(v)),
  responseDeserialize: (b) => JSON.parse(b.toString()),
}
const service = { create: { path: '/shop.Orders/Create', requestStream: false, responseStream: false, ...json } }
const Client = grpc.makeGenericClientConstructor(service, 'Orders')

test('grpc: sync callback, sync throw, late answer with 100 duplicates, and wait:false: no run twice, no hang', async () => {
  let calls = 0
  const server = new grpc.Server()
  const impl = {
    create: (call, callback) => {
      calls++
      const mode = call.request.mode
      if (mode === 'sync') return callback(null, { n: calls })
      if (mode === 'throw') throw Object.assign(new Error('bad'), { code: grpc.status.INVALID_ARGUMENT })
      setTimeout(() => callback(null, { n: calls }), 80)
    },
  }
  const store = new IdempotencyStore()
  server.addService(service, withIdempotency(service, impl, { store }))
  const port = await new Promise((resolve, reject) => server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (e, p) => (e ? reject(e) : resolve(p))))
  const client = new Client(`127.0.0.1:${port}`, grpc.credentials.createInsecure())
  const create = (request, k) =>
    new Promise((resolve) => {
      const md = new grpc.Metadata()
      md.set('x-idempotency-key', k)
      client.create(request, md, { deadline: Date.now() + 4000 }, (error, value) => resolve({ code: error?.code ?? 0, value }))
    })
  try {
    const k1 = key()
    const a = await create({ mode: 'sync' }, k1)
    const b = await create({ mode: 'sync' }, k1)
    assert.deepEqual(b, a)
    const k2 = key()
    const t = await Promise.all(Array.from({ length: 10 }, () => create({ mode: 'throw' }, k2)))
    for (const r of t) assert.notEqual(r.code, grpc.status.DEADLINE_EXCEEDED)
    const k3 = key()
    const late = await Promise.all(Array.from({ length: 100 }, () => create({ mode: 'late' }, k3)))
    for (const r of late) assert.deepEqual(r, late[0])
    assert.equal(late[0].code, 0)
    const before = calls
    assert.ok(before <= 1 + 10 + 1, `calls ${before}`)
    assert.equal(late.filter((r) => r.code === 0).length, 100)
  } finally {
    client.close()
    await new Promise((r) => server.tryShutdown(r))
  }
})
