'use strict'
// oncely/express captures a led answer through ServerResponse's own methods, wrapped once
// per process: the answer is captured wherever it is sent (a sub-app of this or another
// copy of Express sets the response's prototype to its own), and responses that are not
// led go on untouched.
const test = require('node:test')
const assert = require('node:assert/strict')
const http = require('node:http')
const { IdempotencyStore } = require('oncely')
const { idempotency } = require('oncely/express')
const { EXPRESSES, serve, post } = require('./express-helpers.js')

for (const [outerName, outer] of Object.entries(EXPRESSES)) {
  for (const [innerName, inner] of Object.entries(EXPRESSES)) {
    test(`${outerName} app, the handler in a mounted ${innerName} sub-app: the answer is captured and replayed, the handler runs once`, async () => {
      const app = outer()
      const sub = inner()
      let calls = 0
      sub.post('/orders', (req, res) => {
        calls++
        res.status(201).set('location', `/orders/${calls}`).send(`order ${calls}`)
      })
      app.use(idempotency({ store: new IdempotencyStore() }))
      app.use('/shop', sub)
      await serve(app, async (url) => {
        const first = await post(`${url}/shop/orders`, 'sub-app-key-1', { replayed: true })
        const again = await post(`${url}/shop/orders`, 'sub-app-key-1', { replayed: true })
        assert.deepEqual(first, { status: 201, body: 'order 1', replayed: false })
        assert.deepEqual(again, { status: 201, body: 'order 1', replayed: true })
        assert.equal(calls, 1)
      })
    })
  }
}

test('a plain http server in the same process answers as without oncely (writeHead with a header array, writes, end)', async () => {
  idempotency({ store: new IdempotencyStore() }) // the wrappers are in place
  const server = http.createServer((req, res) => {
    res.writeHead(202, ['x-one', '1', 'x-two', 'a', 'x-two', 'b', 'content-type', 'text/plain'])
    res.write('al')
    res.write(Buffer.from('pha'))
    res.end(' beta', 'utf8', () => {})
  })
  await new Promise((r) => server.listen(0, '127.0.0.1', r))
  try {
    const r = await fetch(`http://127.0.0.1:${server.address().port}/`, { method: 'POST', headers: { 'idempotency-key': 'plain-server-key' } })
    assert.equal(r.status, 202)
    assert.equal(r.headers.get('x-one'), '1')
    assert.equal(r.headers.get('x-two'), 'a, b')
    assert.equal(r.headers.get('idempotent-replayed'), null)
    assert.equal(await r.text(), 'alpha beta')
  } finally {
    server.closeAllConnections()
    server.close()
  }
})
