'use strict'
// oncely/express at the edges of its capture: middlewares further out that wrap the
// response (compression, envelopes), answers Node refuses to send, a store that settles
// later (the answer held meanwhile), Node's writeHeader alias, two stores on one request.
const test = require('node:test')
const assert = require('node:assert/strict')
const http = require('node:http')
const zlib = require('node:zlib')
const { setTimeout: sleep } = require('node:timers/promises')
const { IdempotencyStore } = require('oncely')
const { idempotency } = require('oncely/express')
const { EXPRESSES, serve, post } = require('./express-helpers.js')

const express5 = EXPRESSES['express 5']

/** A store that settles later, as a RedisStore does: the led answer is held meanwhile. */
class SlowStore {
  constructor(ms = 30) {
    this.inner = new IdempotencyStore()
    this.ms = ms
  }
  async execute(scoped, fp, fn, options) {
    await sleep(this.ms)
    const r = await this.inner.execute(scoped, fp, fn, options)
    await sleep(this.ms)
    return r
  }
}

/** A POST on a connection of its own: `{ status, message, headers, body }`, or `{ cut }`. */
function raw(port, key, headers = {}) {
  return new Promise((resolve) => {
    const req = http.request(
      { host: '127.0.0.1', port, path: '/x', method: 'POST', agent: false, timeout: 3000, headers: { 'idempotency-key': key, 'content-type': 'application/json', ...headers } },
      (res) => {
        const chunks = []
        res.on('data', (c) => chunks.push(c))
        res.on('end', () => resolve({ status: res.statusCode, message: res.statusMessage, headers: res.headers, body: Buffer.concat(chunks) }))
        res.on('error', (e) => resolve({ cut: e.code }))
      },
    )
    req.on('timeout', () => req.destroy(Object.assign(new Error('hang'), { code: 'hang' })))
    req.on('error', (e) => resolve({ cut: e.code }))
    req.end('{}')
  })
}

async function listening(app, run) {
  app.set('env', 'test')
  const server = await new Promise((r) => {
    const s = app.listen(0, '127.0.0.1', () => r(s))
  })
  try {
    return await run(server.address().port)
  } finally {
    server.closeAllConnections()
    server.close()
  }
}

for (const [major, express] of Object.entries(EXPRESSES)) {
  test(`${major}: a middleware further out that rewrites the body through its own res.end: the replay is the first answer, not rewritten twice`, async () => {
    const app = express()
    app.use((req, res, next) => {
      const end = res.end
      res.end = function (chunk, encoding, cb) {
        if (!this.headersSent) this.removeHeader('content-length')
        return end.call(this, chunk === undefined ? chunk : `<${chunk}>`, encoding, cb)
      }
      next()
    })
    app.use(idempotency({ store: new IdempotencyStore() }))
    let calls = 0
    app.post('/x', (req, res) => {
      calls++
      res.status(201).type('text/plain').send('made')
    })
    await serve(app, async (url) => {
      const first = await post(`${url}/x`, 'envelope-key-1', { replayed: true })
      const again = await post(`${url}/x`, 'envelope-key-1', { replayed: true })
      assert.deepEqual(first, { status: 201, body: '<made>', replayed: false })
      assert.deepEqual(again, { status: 201, body: '<made>', replayed: true })
      assert.equal(calls, 1)
    })
  })
}

test('compression mounted before oncely: the answer is stored as written, and a retry is encoded for its own client', async () => {
  // As `compression` does: res.write/res.end wrapped as own properties, the encoding
  // negotiated per request, the compressed bytes written later.
  const compressing = (req, res, next) => {
    const gzip = /\bgzip\b/.test(req.headers['accept-encoding'] || '')
    const { write, end } = res
    const chunks = []
    res.write = (chunk, encoding) => {
      chunks.push(Buffer.from(chunk, encoding))
      return true
    }
    res.end = (chunk, encoding) => {
      if (chunk) chunks.push(Buffer.from(chunk, encoding))
      const body = Buffer.concat(chunks)
      res.setHeader('vary', 'Accept-Encoding')
      if (!gzip) return end.call(res, body)
      setImmediate(() => {
        res.setHeader('content-encoding', 'gzip')
        res.removeHeader('content-length')
        write.call(res, zlib.gzipSync(body))
        end.call(res)
      })
      return res
    }
    next()
  }
  const app = express5()
  app.use(compressing)
  app.use(idempotency({ store: new IdempotencyStore() }))
  let calls = 0
  app.post('/x', (req, res) => {
    calls++
    res.type('text/plain').send('x'.repeat(2000))
  })
  await listening(app, async (port) => {
    const first = await raw(port, 'compress-key-1', { 'accept-encoding': 'gzip' })
    assert.equal(first.headers['content-encoding'], 'gzip')
    assert.equal(zlib.gunzipSync(first.body).toString(), 'x'.repeat(2000))
    const plainRetry = await raw(port, 'compress-key-1', { 'accept-encoding': 'identity' })
    assert.equal(plainRetry.headers['idempotent-replayed'], 'true')
    assert.equal(plainRetry.headers['content-encoding'], undefined)
    assert.equal(plainRetry.body.toString(), 'x'.repeat(2000))
    const gzipRetry = await raw(port, 'compress-key-1', { 'accept-encoding': 'gzip' })
    assert.equal(zlib.gunzipSync(gzipRetry.body).toString(), 'x'.repeat(2000))
    assert.equal(calls, 1)
  })
})

const REFUSED = {
  'express 4, a status Node refuses': [EXPRESSES['express 4'], (req, res) => res.status(1000).send('x')],
  'express 5, a reason phrase with a newline': [express5, (req, res) => {
    res.statusMessage = 'bad\nreason'
    res.send('x')
  }],
  'express 5, a status that is not an integer': [express5, (req, res) => {
    res.statusCode = 200.5
    res.end('x')
  }],
  'express 5, a body shorter than its strict content-length': [express5, (req, res) => {
    res.strictContentLength = true
    res.setHeader('content-length', '10')
    res.end('abc')
  }],
}

for (const [name, [express, handler]] of Object.entries(REFUSED)) {
  test(`${name}: an answer Node refuses is not stored, the key is released (the retry runs, it does not wait forever)`, async () => {
    const app = express()
    app.use(idempotency({ store: new IdempotencyStore() }))
    let calls = 0
    app.post('/x', (req, res) => {
      calls++
      handler(req, res)
    })
    await listening(app, async (port) => {
      await raw(port, 'refused-key-1')
      const again = await raw(port, 'refused-key-1')
      assert.notEqual(again.cut, 'hang', 'the retry waits for a key no one holds')
      assert.equal(calls, 2)
    })
  })
}

test('a store that settles later: the answer sent keeps its reason phrase when the handler throws after it', async () => {
  const app = express5()
  app.use(idempotency({ store: new SlowStore() }))
  app.post('/x', (req, res) => {
    res.status(201).send('made')
    throw new Error('after the answer')
  })
  await listening(app, async (port) => {
    const a = await raw(port, 'held-reason-key-1')
    assert.equal(a.status, 201)
    assert.equal(a.message, 'Created')
    assert.equal(a.body.toString(), 'made')
  })
})

test('a store that settles later: a buffer the handler reuses after res.end is sent as it was given (and as stored)', async () => {
  const app = express5()
  app.use(idempotency({ store: new SlowStore() }))
  app.post('/x', (req, res) => {
    const b = Buffer.from('AAAA')
    res.end(b)
    b.fill('B')
  })
  await serve(app, async (url) => {
    const a = await post(`${url}/x`, 'held-buffer-key-1', { replayed: true })
    const b = await post(`${url}/x`, 'held-buffer-key-1', { replayed: true })
    assert.deepEqual(a, { status: 200, body: 'AAAA', replayed: false })
    assert.deepEqual(b, { status: 200, body: 'AAAA', replayed: true })
  })
})

for (const store of ['IdempotencyStore', 'a store that settles later']) {
  test(`writeHeader (Node's alias of writeHead) with headers and none set before, ${store}: the replay has them`, async () => {
    const app = express5()
    app.disable('x-powered-by')
    app.use(idempotency({ store: store === 'IdempotencyStore' ? new IdempotencyStore() : new SlowStore() }))
    app.post('/x', (req, res) => {
      res.writeHeader(201, { location: '/orders/1', 'content-type': 'text/plain' })
      res.end('made')
    })
    await listening(app, async (port) => {
      const a = await raw(port, 'alias-key-1')
      const b = await raw(port, 'alias-key-1')
      assert.equal(b.headers['idempotent-replayed'], 'true')
      assert.equal(a.headers.location, '/orders/1')
      assert.equal(b.headers.location, '/orders/1')
      assert.equal(b.status, 201)
    })
  })
}

for (const [outerSlow, innerSlow] of [[false, false], [true, false], [false, true], [true, true]]) {
  test(`two stores on one request (app-level ${outerSlow ? 'later' : 'at once'}, route-level ${innerSlow ? 'later' : 'at once'}): a streamed answer is captured by both, the handler runs once`, async () => {
    const app = EXPRESSES['express 4']()
    const store = (slow) => (slow ? new SlowStore(10) : new IdempotencyStore())
    app.use(idempotency({ store: store(outerSlow) }))
    let calls = 0
    app.post('/x', idempotency({ store: store(innerSlow) }), async (req, res) => {
      calls++
      res.writeHead(201, { 'content-type': 'text/plain', location: '/o/1' })
      for (let i = 0; i < 4; i++) {
        res.write(`c${i}-`)
        await sleep(2)
      }
      res.end('end')
    })
    await serve(app, async (url) => {
      const a = await post(`${url}/x`, 'two-stores-key-1', { replayed: true })
      const b = await post(`${url}/x`, 'two-stores-key-1', { replayed: true })
      assert.deepEqual(a, { status: 201, body: 'c0-c1-c2-c3-end', replayed: false })
      assert.deepEqual(b, { status: 201, body: 'c0-c1-c2-c3-end', replayed: true })
      assert.equal(calls, 1)
    })
  })
}

test('a request without originalUrl is refused with an error (the handler does not run), not scoped with a fingerprint it does not have', async () => {
  for (const [name, express] of Object.entries(EXPRESSES)) {
    const app = express()
    let calls = 0
    app.use(express.json())
    app.use((req, res, next) => {
      delete req.originalUrl
      next()
    })
    // On the route: its template is the scope's route, so only the target is missing.
    app.post('/orders', idempotency({ store: new IdempotencyStore() }), (req, res) => {
      calls++
      res.status(201).json({ calls })
    })
    let errors = 0
    app.use((err, req, res, next) => {
      errors += err.code === 'INVALID_ARGUMENT' ? 1 : 0
      res.status(500).end()
    })
    await serve(app, async (url) => {
      const r = await post(`${url}/orders`, 'no-original-url-1')
      assert.equal(r.status, 500, name)
    })
    assert.equal(calls, 0, name)
    assert.equal(errors, 1, name)
  }
})
