'use strict'
// A handler that injects a new request in-process (light-my-request, fastify.inject)
// with its own key and body: re-entry, refused at once through the lead's async context,
// not a sub-request waiting for the lead that waits for it.
const test = require('node:test')
const assert = require('node:assert/strict')
const { IdempotencyStore } = require('oncely')
const { idempotency } = require('oncely/express')
const inject = require('light-my-request')

const EXPRESSES = { 'express 5': require('express'), 'express 4': require('express4') }

function within(p, ms) {
  let t
  return Promise.race([p, new Promise((r) => { t = setTimeout(() => r('hang'), ms) })]).finally(() => clearTimeout(t))
}

for (const [major, express] of Object.entries(EXPRESSES)) {
  test(`${major}: a handler that injects a sub-request with its own key (new req object) is refused, not left waiting for itself`, async () => {
    const store = new IdempotencyStore()
    const app = express()
    app.set('env', 'test')
    let calls = 0
    app.use(express.json())
    app.use(idempotency({ store }))
    app.post('/orders', async (req, res) => {
      calls++
      if (req.headers['x-inner']) return res.status(201).json({ inner: true })
      // Forward in-process to the same route, same key and body (a proxy-style handler).
      const r = await within(
        inject(app, { method: 'POST', url: '/orders', headers: { 'idempotency-key': req.headers['idempotency-key'], 'content-type': 'application/json' }, payload: '{"item":1}' }),
        2000,
      )
      res.status(201).json({ inner: r === 'hang' ? 'hang' : r.statusCode })
    })
    const outer = await within(
      inject(app, { method: 'POST', url: '/orders', headers: { 'idempotency-key': 'inject-1', 'content-type': 'application/json' }, payload: '{"item":1}' }),
      4000,
    )
    assert.notEqual(outer, 'hang')
    const body = JSON.parse(outer.payload)
    assert.notEqual(body.inner, 'hang', 'the in-process sub-request with the same key waits for its own lead forever')
    // Refused as re-entrant (a 500 problem: the server's own request), the handler run once.
    assert.equal(body.inner, 500)
    assert.equal(calls, 1)
  })
}

test('fastify: a handler that injects a sub-request with its own key is refused, not left waiting for itself', async () => {
  const Fastify = require('fastify')
  const { idempotency: plugin } = require('oncely/fastify')
  const store = new IdempotencyStore()
  const app = Fastify()
  await app.register(plugin, { store })
  app.post('/orders', async (request, reply) => {
    const r = await within(
      app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': request.headers['idempotency-key'], 'content-type': 'application/json' }, payload: '{"item":1}' }),
      2000,
    )
    reply.code(201)
    return { inner: r === 'hang' ? 'hang' : r.statusCode }
  })
  await app.ready()
  const outer = await within(app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': 'inject-f-1', 'content-type': 'application/json' }, payload: '{"item":1}' }), 4000)
  assert.notEqual(outer, 'hang')
  assert.notEqual(JSON.parse(outer.payload).inner, 'hang', 'the in-process sub-request waits for its own lead forever')
  assert.equal(JSON.parse(outer.payload).inner, 500)
  await app.close()
})

