'use strict'
// A plugin registered before oncely that queues requests with callback-style hooks (a
// concurrency limiter: take in preHandler, give back in onSend) resumes the next queued
// request by calling its `done` from inside the request that finishes, i.e. in that
// request's async context. The leader's handler runs in its lead's async context, so the resumed request
// must not inherit the other request's lead: the store is called in the context the
// request arrived in.
const test = require('node:test')
const assert = require('node:assert/strict')
const { IdempotencyStore } = require('oncely')
const { acting } = require('../lib/store.js')
const { FASTIFIES, idempotency, within, listen, post } = require('./fastify-helpers.js')

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

/** A callback-style limiter of `n` concurrent requests (no AsyncResource.bind, like many). */
function limiter(app, n) {
  let active = 0
  const queue = []
  app.addHook('preHandler', (request, reply, done) => {
    if (active < n) {
      active++
      done()
    } else queue.push(done)
  })
  app.addHook('onSend', (request, reply, payload, done) => {
    const next = queue.shift()
    if (next) next()
    else active--
    done(null, payload)
  })
}

function depth() {
  let d = 0
  for (let f = acting.getStore(); f !== undefined; f = f.parent) d++
  return d
}

for (const [major, Fastify] of Object.entries(FASTIFIES)) {
  test(`${major}: a duplicate resumed by a callback-style limiter from inside the leader waits and replays (not refused reentrant)`, async () => {
    const app = Fastify()
    limiter(app, 1)
    await app.register(idempotency, { store: new IdempotencyStore() })
    let calls = 0
    app.post('/orders', async (request, reply) => {
      calls++
      await sleep(100)
      reply.code(201)
      return { n: calls }
    })
    const url = await listen(app)
    try {
      const a = post(url, '/orders', 'limit-k1')
      await sleep(30)
      const b = post(url, '/orders', 'limit-k1')
      const [ra, rb] = await within(Promise.all([a, b]), 4000)
      assert.equal(ra.status, 201)
      assert.equal(calls, 1)
      assert.equal(rb.status, 201, `duplicate got ${rb.status} ${rb.text}`)
      assert.equal(rb.headers.get('idempotent-replayed'), 'true')
      assert.deepEqual(rb.text, ra.text)
    } finally {
      await app.close()
    }
  })

  test(`${major}: requests resumed by a callback-style limiter do not pile up Leading records (parent chain stays 1 deep)`, async () => {
    const app = Fastify()
    limiter(app, 1)
    await app.register(idempotency, { store: new IdempotencyStore() })
    const depths = []
    app.post('/orders', async (request, reply) => {
      depths.push(depth())
      await sleep(1)
      return { ok: true }
    })
    const url = await listen(app)
    try {
      const all = await within(Promise.all(Array.from({ length: 60 }, (_, i) => post(url, '/orders', `chain-key-${i}`))), 8000)
      assert.notEqual(all, 'hang')
      for (const r of all) assert.equal(r.status, 200, r.text)
      const max = Math.max(...depths)
      assert.ok(max <= 1, `the async-context chain of Leading records grew to ${max} (one per request resumed by the previous one): retained and walked by reentry() on every lead`)
    } finally {
      await app.close()
    }
  })

  test(`${major}: a warm-up gate opened by the leader's handler lets a duplicate in that replays`, async () => {
    const app = Fastify()
    let open = false
    const waiting = []
    // Requests wait until the app is warm; the first request (x-first) warms it up.
    app.addHook('preHandler', (request, reply, done) => (open || request.headers['x-first'] ? done() : waiting.push(done)))
    await app.register(idempotency, { store: new IdempotencyStore() })
    let calls = 0
    app.post('/orders', (request, reply) => {
      calls++
      open = true
      for (const d of waiting.splice(0)) d()
      setTimeout(() => reply.code(201).send({ n: calls }), 50)
    })
    const url = await listen(app)
    try {
      const b = post(url, '/orders', 'gate-key-1')
      await sleep(30)
      const a = post(url, '/orders', 'gate-key-1', '{"a":1}', { headers: { 'x-first': '1' } })
      const both = await within(Promise.all([a, b]), 4000)
      assert.notEqual(both, 'hang')
      const [ra, rb] = both
      assert.equal(calls, 1)
      assert.equal(ra.status, 201)
      assert.equal(rb.status, 201, `duplicate got ${rb.status} ${rb.text}`)
      assert.equal(rb.headers.get('idempotent-replayed'), 'true')
    } finally {
      await app.close()
    }
  })
}
