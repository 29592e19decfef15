'use strict'
// A request that reaches the idempotency middleware a second time (mounted twice on a
// path, or dispatched again by its handler) calls the store with its own scoped key and
// fingerprint from inside its own flight: it must fail at once, not wait for itself.
const test = require('node:test')
const assert = require('node:assert/strict')

const { IdempotencyStore } = require('oncely')
const { idempotency } = require('oncely/express')
const { EXPRESSES, serve, post } = require('./express-helpers.js')

/**
 * One POST with `key` to `path` of an app with the middleware on it (one store) and the
 * routes `mount(app, store, orders)` adds, `orders` the handler that answers 201: the
 * request is answered (it does not wait for its own flight), and `orders` runs once at most.
 */
async function assertNoHang(express, path, key, mount) {
  const store = new IdempotencyStore()
  const app = express()
  let calls = 0
  const orders = (req, res) => {
    calls++
    res.status(201).json({ ok: true })
  }
  app.use(idempotency({ store }))
  mount(app, store, orders)
  await serve(app, async (url) => {
    const r = await post(url + path, key)
    assert.notEqual(r, 'hang', 'the request waits for its own flight forever')
    assert.ok(calls <= 1)
  })
}

for (const [major, express] of Object.entries(EXPRESSES)) {
  test(`${major}: the middleware mounted on the app and on the route (one store) does not hang the request`, () =>
    assertNoHang(express, '/orders', 'order-twice-1', (app, store, orders) => {
      app.post('/orders', idempotency({ store }), orders)
    }))

  test(`${major}: a handler that dispatches its request again (a rewrite through app.handle) does not hang`, () =>
    assertNoHang(express, '/v1/orders', 'order-rewrite-1', (app, store, orders) => {
      app.post('/v1/orders', (req, res, next) => {
        req.url = '/v2/orders'
        app.handle(req, res, next)
      })
      app.post('/v2/orders', orders)
    }))
}

for (const [major, express] of Object.entries(EXPRESSES)) {
  test(`${major}: a request through two middleware with two stores leads in both; the retry is replayed by the first`, async () => {
    const outer = new IdempotencyStore()
    const inner = new IdempotencyStore()
    const app = express()
    let calls = 0
    app.use(idempotency({ store: outer }))
    app.post('/orders', idempotency({ store: inner }), (req, res) => {
      calls++
      res.status(201).json({ n: calls })
    })
    await serve(app, async (base) => {
      const url = `${base}/orders`
      const first = await post(url, 'order-two-stores-1')
      assert.deepEqual(first, { status: 201, body: '{"n":1}' })
      const again = await post(url, 'order-two-stores-1')
      assert.deepEqual(again, first)
      assert.equal(calls, 1)
      // Both stores hold the key once; neither lead is left behind on the request.
      assert.equal(outer.size, 1)
      assert.equal(inner.size, 1)
      assert.equal(outer.pendingWaiters + inner.pendingWaiters, 0)
    })
  })

  test(`${major}: a handler that re-dispatches its request after an await is refused, not left waiting`, () =>
    assertNoHang(express, '/v1/orders', 'order-rewrite-late-1', (app, store, orders) => {
      app.post('/v1/orders', async (req, res, next) => {
        await new Promise((r) => setTimeout(r, 5))
        req.url = '/v2/orders'
        app.handle(req, res, next)
      })
      app.post('/v2/orders', orders)
    }))
}

test('grpc: an implementation wrapped twice with one store does not hang the call', async () => {
  const grpc = require('@grpc/grpc-js')
  const { withIdempotency } = require('oncely/grpc')
  const json = {
    requestSerialize: (v) => Buffer.from(JSON.stringify(v)),
    requestDeserialize: (b) => JSON.parse(b.toString()),
    responseSerialize: (v) => Buffer.from(JSON.stringify(v)),
    responseDeserialize: (b) => JSON.parse(b.toString()),
  }
  const service = { create: { path: '/shop.Orders/Create', requestStream: false, responseStream: false, ...json } }
  const Client = grpc.makeGenericClientConstructor(service, 'Orders')
  const store = new IdempotencyStore()
  let calls = 0
  const impl = { create: (call, callback) => callback(null, { id: ++calls }) }
  const server = new grpc.Server()
  server.addService(service, withIdempotency(service, withIdempotency(service, impl, { store }), { store }))
  const port = await new Promise((resolve, reject) =>
    server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (e, p) => (e ? reject(e) : resolve(p))),
  )
  const client = new Client(`127.0.0.1:${port}`, grpc.credentials.createInsecure())
  try {
    const md = new grpc.Metadata()
    md.set('x-idempotency-key', 'order-grpc-twice-1')
    const r = await new Promise((resolve) => {
      client.create({ sku: 'A1' }, md, { deadline: Date.now() + 3000 }, (error, value) => resolve({ error, value }))
    })
    assert.notEqual(r.error?.code, grpc.status.DEADLINE_EXCEEDED, 'the call waits for its own flight forever')
  } finally {
    client.close()
    server.forceShutdown()
  }
})

for (const [major, express] of Object.entries(EXPRESSES)) {
  test(`${major}: mounted on the app and on the route with one store, the first mount leads: answered, then replayed`, async () => {
    const store = new IdempotencyStore()
    const app = express()
    let calls = 0
    app.use(idempotency({ store }))
    app.post('/orders', idempotency({ store }), (req, res) => {
      calls++
      res.status(201).json({ n: calls })
    })
    // A rewrite through app.handle reaches the app's middleware again with its key.
    app.post('/v1/orders', (req, res, next) => {
      req.url = '/orders'
      app.handle(req, res, next)
    })
    await serve(app, async (base) => {
      for (const path of ['/orders', '/v1/orders']) {
        const key = `order-${path.length}-once`
        const first = await post(base + path, key, { replayed: true })
        assert.deepEqual(first, { status: 201, body: `{"n":${calls}}`, replayed: false })
        assert.deepEqual(await post(base + path, key, { replayed: true }), { ...first, replayed: true })
      }
      assert.equal(calls, 2)
      // POST /orders once; POST /v1/orders, and the route's own key (POST /orders, another
      // key) that the rewritten request leads inside it.
      assert.equal(store.size, 3)
    })
  })
}
