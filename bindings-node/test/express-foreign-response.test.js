'use strict'
// oncely/express over a response that is not a Node ServerResponse (a framework's or a
// test double's own response object): its answer is captured with wrappers of its own,
// stored, and replayed; the handler runs once.
const test = require('node:test')
const assert = require('node:assert/strict')
const { EventEmitter } = require('node:events')
const { IdempotencyStore } = require('oncely')
const { idempotency } = require('oncely/express')

/** A response with Node's header and body methods, not a ServerResponse. */
class FakeResponse extends EventEmitter {
  constructor() {
    super()
    this.statusCode = 200
    this.headers = {}
    this.sent = []
    this.headersSent = false
    this.writableFinished = false
  }
  setHeader(n, v) {
    this.headers[n.toLowerCase()] = v
  }
  appendHeader(n, v) {
    this.setHeader(n, v)
  }
  getHeader(n) {
    return this.headers[n.toLowerCase()]
  }
  removeHeader(n) {
    delete this.headers[n.toLowerCase()]
  }
  getHeaders() {
    return { ...this.headers }
  }
  getHeaderNames() {
    return Object.keys(this.headers)
  }
  writeHead(status) {
    this.statusCode = status
    this.headersSent = true
    return this
  }
  write(chunk) {
    this.headersSent = true
    this.sent.push(Buffer.from(chunk))
    return true
  }
  end(chunk) {
    if (chunk !== undefined) this.sent.push(Buffer.from(chunk))
    this.headersSent = true
    this.writableFinished = true
    this.emit('finish')
    return this
  }
  get body() {
    return Buffer.concat(this.sent).toString()
  }
}

function request() {
  return {
    method: 'POST',
    rawHeaders: ['Idempotency-Key', 'foreign-response-key', 'Content-Type', 'application/json'],
    headers: { 'idempotency-key': 'foreign-response-key', 'content-type': 'application/json' },
    originalUrl: '/orders',
    baseUrl: '',
    _body: true,
    body: { sku: 'A1' },
    socket: new EventEmitter(),
  }
}

test('a response that is not a ServerResponse: captured, stored and replayed, the handler run once', async () => {
  const middleware = idempotency({ store: new IdempotencyStore() })
  let calls = 0
  const serve = () =>
    new Promise((resolve, reject) => {
      const res = new FakeResponse()
      res.on('finish', () => resolve(res))
      middleware(request(), res, (e) => {
        if (e) return reject(e)
        calls++
        res.statusCode = 201
        res.setHeader('content-type', 'text/plain')
        res.write('order ')
        res.end(String(calls))
      })
    })
  const first = await serve()
  const again = await serve()
  assert.equal(first.statusCode, 201)
  assert.equal(first.body, 'order 1')
  assert.equal(again.statusCode, 201)
  assert.equal(again.body, 'order 1')
  assert.equal(again.getHeader('idempotent-replayed'), 'true')
  assert.equal(calls, 1)
})

test('a tool that replaces ServerResponse.prototype.end after oncely (without calling it): answers are still captured', async (t) => {
  const http = require('node:http')
  const express = require('express')
  idempotency({ store: new IdempotencyStore() }) // the wrappers are in place first
  const P = http.ServerResponse.prototype
  const before = P.end
  // An instrumentation that swaps `end` for its own and calls OutgoingMessage's directly.
  P.end = function (chunk, encoding, cb) {
    return http.OutgoingMessage.prototype.end.call(this, chunk, encoding, cb)
  }
  t.after(() => {
    P.end = before
  })
  const app = express()
  app.set('env', 'test')
  app.use(idempotency({ store: new IdempotencyStore() }))
  let calls = 0
  app.post('/orders', (req, res) => {
    calls++
    res.status(201).send(`order ${calls}`)
  })
  const server = await new Promise((r) => {
    const s = app.listen(0, '127.0.0.1', () => r(s))
  })
  try {
    const post = () =>
      fetch(`http://127.0.0.1:${server.address().port}/orders`, {
        method: 'POST',
        headers: { 'idempotency-key': 'replaced-end-key', 'content-type': 'application/json' },
        body: '{}',
        signal: AbortSignal.timeout(3000),
      }).then(async (r) => [r.status, await r.text(), r.headers.get('idempotent-replayed')])
    assert.deepEqual(await post(), [201, 'order 1', null])
    assert.deepEqual(await post(), [201, 'order 1', 'true'])
    assert.equal(calls, 1)
  } finally {
    server.closeAllConnections()
    server.close()
  }
})
