'use strict'
// Leads nested on one request (a re-dispatch to another route, two stores) settle in any
// order: neither a later, different lead is refused nor a re-entry left waiting.
const test = require('node:test')
const assert = require('node:assert/strict')
const { IdempotencyStore } = require('oncely')
const { idempotency } = require('oncely/express')
const { EXPRESSES, serve, post } = require('./express-helpers.js')

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

for (const [major, express] of Object.entries(EXPRESSES)) {
  test(`${major}: a route re-dispatched after an await to another route with the same store leads both keys; 50 duplicates, one run, nothing left waiting`, async () => {
    const store = new IdempotencyStore()
    const app = express()
    let calls = 0
    const mw = idempotency({ store })
    app.post('/v1/orders', mw, async (req, res, next) => {
      await sleep(20)
      req.url = '/v2/orders'
      app.handle(req, res, next)
    })
    app.post('/v2/orders', mw, async (req, res) => {
      calls++
      await sleep(20)
      res.status(201).json({ n: calls })
    })
    await serve(app, async (u) => {
      const all = await Promise.all(Array.from({ length: 50 }, () => post(`${u}/v1/orders`, 'nested-1')))
      assert.ok(!all.includes('hang'))
      for (const r of all) assert.deepEqual(r, { status: 201, body: '{"n":1}' })
      assert.equal(calls, 1)
      // A direct call of /v2 with the same key: the /v2 key was led with target /v1/orders
      // (the fingerprint covers the original URL): a reuse with other parameters.
      assert.equal((await post(`${u}/v2/orders`, 'nested-1')).status, 422)
      assert.equal(store.pendingWaiters, 0)
    })
  })

  test(`${major}: inner lead (route, store B) settles before the outer one (app, store A, held by a slow stored answer) and vice versa`, async () => {
    const a = new IdempotencyStore()
    const b = new IdempotencyStore()
    const app = express()
    let calls = 0
    app.use(idempotency({ store: a }))
    app.post('/x', idempotency({ store: b }), async (req, res) => {
      calls++
      await sleep(10)
      res.write('a')
      await sleep(10)
      res.end('b')
    })
    app.post('/y', idempotency({ store: b }), idempotency({ store: a, route: () => '/y-inner' }), (req, res) => {
      calls++
      res.status(200).send('y')
    })
    await serve(app, async (u) => {
      const xs = await Promise.all(Array.from({ length: 30 }, () => post(`${u}/x`, 'nested-2')))
      for (const r of xs) assert.deepEqual(r, { status: 200, body: 'ab' })
      const ys = await Promise.all(Array.from({ length: 30 }, () => post(`${u}/y`, 'nested-3')))
      for (const r of ys) assert.deepEqual(r, { status: 200, body: 'y' })
      assert.equal(calls, 2)
      assert.equal(a.pendingWaiters + b.pendingWaiters, 0)
    })
  })
}
