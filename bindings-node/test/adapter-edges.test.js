'use strict'
// oncely/express and oncely/fastify on real servers, at the edges a review found: a
// response the server cuts with an error releases its key (it is not taken for a client
// gone away, which would hold it), an onReplay hook that fails (async too) leaves the
// replay and the process alone, Fastify's `reply.callNotFound()` answers for its lead, an
// answer with trailers is not stored, and a client gone before its response was cut by
// the app's own close listener keeps its key held.
const test = require('node:test')
const assert = require('node:assert/strict')
const { pipeline, Readable } = require('node:stream')

const { IdempotencyStore, newKey } = require('oncely')
const { idempotency: expressIdempotency } = require('oncely/express')
const { EXPRESSES, serve, post } = require('./express-helpers.js')
const { FASTIFIES, idempotency: fastifyIdempotency, within, listen, post: fastifyPost } = require('./fastify-helpers.js')

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

/** A keyed POST that the server cuts: 'cut', or 'hang' when nothing comes within 2 s. */
function cutPost(url, key) {
  return post(url, key, { ms: 2000 }).then(
    (r) => (r === 'hang' ? r : `answered ${r.status}`),
    (e) => (e.name === 'TypeError' ? 'cut' : Promise.reject(e)),
  )
}

/** Three requests with one key, each cut by the handler: each must run it again. */
async function cutThenRetried(url, key, calls) {
  for (let i = 0; i < 3; i++) {
    assert.equal(await cutPost(url, key), 'cut', `attempt ${i}: the key was held after the server cut the response`)
  }
  assert.equal(calls(), 3)
}

for (const [name, express] of Object.entries(EXPRESSES)) {
  test(`${name}: a response the handler cuts with an error releases its key`, async () => {
    const app = express()
    app.use(expressIdempotency({ store: new IdempotencyStore() }))
    const calls = { destroy: 0, pipeline: 0 }
    app.post('/destroy', (req, res) => {
      calls.destroy++
      setTimeout(() => res.destroy(new Error('upstream failed')), 10)
    })
    // A stream piped into the response whose source fails before its first byte.
    app.post('/pipeline', (req, res) => {
      calls.pipeline++
      const source = new Readable({
        read() {
          this.destroy(new Error('cursor failed'))
        },
      })
      res.type('text/csv')
      pipeline(source, res, () => {})
    })
    await serve(app, async (url) => {
      await cutThenRetried(`${url}/destroy`, newKey(), () => calls.destroy)
      await cutThenRetried(`${url}/pipeline`, newKey(), () => calls.pipeline)
    })
  })

  test(`${name}: an onReplay hook that throws or rejects: the replay is sent, the server lives on`, async () => {
    const warnings = []
    const onWarning = (w) => warnings.push(w)
    process.on('warning', onWarning)
    try {
      for (const onReplay of [
        () => {
          throw new Error('metrics down')
        },
        async () => {
          throw new Error('metrics down')
        },
      ]) {
        const app = express()
        let calls = 0
        app.post('/orders', expressIdempotency({ store: new IdempotencyStore(), onReplay }), (req, res) => {
          calls++
          res.status(201).json({ id: calls })
        })
        await serve(app, async (url) => {
          const key = newKey()
          const first = await post(`${url}/orders`, key)
          const again = await post(`${url}/orders`, key, { replayed: true })
          assert.deepEqual(again, { ...first, replayed: true })
          await sleep(20)
          // The server still answers.
          assert.equal((await post(`${url}/orders`, newKey())).status, 201)
        })
      }
    } finally {
      process.off('warning', onWarning)
    }
    assert.equal(warnings.filter((w) => w.code === 'ONCELY_ON_REPLAY').length, 2)
  })
}

for (const [name, Fastify] of Object.entries(FASTIFIES)) {
  test(`${name}: a response the handler cuts with an error releases its key, and nothing is stored`, async () => {
    const app = Fastify()
    await app.register(fastifyIdempotency, { store: new IdempotencyStore() })
    const calls = { async: 0, callback: 0 }
    app.post('/async', async (req, reply) => {
      calls.async++
      await sleep(10)
      reply.raw.destroy(new Error('upstream failed'))
    })
    app.post('/callback', (req, reply) => {
      calls.callback++
      setTimeout(() => reply.raw.destroy(new Error('upstream failed')), 10)
    })
    const url = await listen(app)
    try {
      for (const path of ['/async', '/callback']) {
        const key = newKey()
        for (let i = 0; i < 3; i++) {
          const r = await within(
            fastifyPost(url, path, key).then(
              (a) => a,
              () => 'cut',
            ),
            2000,
          )
          assert.equal(r, 'cut', `${path}: attempt ${i} was answered or hung instead of cut (${r?.status ?? r})`)
        }
        assert.equal(calls[path.slice(1)], 3, `${path}: every attempt ran the handler`)
      }
    } finally {
      await app.close()
    }
  })

  test(`${name}: an async onReplay hook that rejects: the replay is sent, the server lives on`, async () => {
    const warnings = []
    const onWarning = (w) => warnings.push(w)
    process.on('warning', onWarning)
    const app = Fastify()
    await app.register(fastifyIdempotency, {
      store: new IdempotencyStore(),
      onReplay: async () => {
        throw new Error('metrics down')
      },
    })
    let calls = 0
    app.post('/orders', async (req, reply) => reply.code(201).send({ id: ++calls }))
    const url = await listen(app)
    try {
      const key = newKey()
      const first = await fastifyPost(url, '/orders', key)
      const again = await fastifyPost(url, '/orders', key)
      assert.equal(again.text, first.text)
      assert.equal(again.headers.get('idempotent-replayed'), 'true')
      await sleep(20)
      assert.equal((await fastifyPost(url, '/orders', newKey())).status, 201)
      assert.equal(calls, 2)
    } finally {
      process.off('warning', onWarning)
      await app.close()
    }
    assert.equal(warnings.filter((w) => w.code === 'ONCELY_ON_REPLAY').length, 1)
  })

  test(`${name}: reply.callNotFound() answers for its lead: stored, replayed, no key left held`, async () => {
    const app = Fastify()
    await app.register(fastifyIdempotency, { store: new IdempotencyStore() })
    let calls = 0
    app.post('/orders/:id', async (req, reply) => {
      calls++
      return reply.callNotFound()
    })
    app.post('/sync/:id', (req, reply) => {
      calls++
      reply.callNotFound()
    })
    const url = await listen(app)
    try {
      for (const path of ['/orders/7', '/sync/7']) {
        const key = newKey()
        const first = await within(fastifyPost(url, path, key), 2000)
        const retry = await within(fastifyPost(url, path, key), 2000)
        assert.notEqual(first, 'hang')
        assert.notEqual(retry, 'hang', `${path}: the retry hung`)
        assert.equal(first.status, 404)
        assert.equal(retry.status, 404)
        assert.equal(retry.headers.get('idempotent-replayed'), 'true')
      }
      assert.equal(calls, 2)
    } finally {
      await app.close()
    }
  })
}

/** A keyed POST read with node:http: `{ status, headers, body, trailers }`. */
function postWithTrailers(url, key) {
  const http = require('node:http')
  return new Promise((resolve, reject) => {
    const req = http.request(url, { method: 'POST', headers: { 'idempotency-key': key, te: 'trailers', 'content-length': 0 } }, (res) => {
      const chunks = []
      res.on('data', (c) => chunks.push(c))
      res.on('end', () => resolve({ status: res.statusCode, headers: res.headers, body: Buffer.concat(chunks).toString(), trailers: res.trailers }))
    })
    req.on('error', reject)
    req.end()
  })
}

for (const [name, express] of Object.entries(EXPRESSES)) {
  test(`${name}: an answer with trailers is sent with them and not stored (its replay would lack them)`, async () => {
    const app = express()
    app.use(expressIdempotency({ store: new IdempotencyStore() }))
    let calls = 0
    app.post('/report', (req, res) => {
      calls++
      res.status(201).setHeader('trailer', 'x-sum')
      res.setHeader('content-type', 'text/plain')
      res.write('body')
      res.addTrailers({ 'x-sum': `s${calls}` })
      res.end()
    })
    await serve(app, async (url) => {
      const key = newKey()
      const first = await postWithTrailers(`${url}/report`, key)
      const again = await postWithTrailers(`${url}/report`, key)
      assert.deepEqual([first.status, first.body, first.trailers], [201, 'body', { 'x-sum': 's1' }])
      assert.deepEqual([again.status, again.body, again.trailers], [201, 'body', { 'x-sum': 's2' }])
      assert.equal(again.headers['idempotent-replayed'], undefined)
      assert.equal(calls, 2)
    })
  })
}

for (const [name, Fastify] of Object.entries(FASTIFIES)) {
  test(`${name}: an answer with trailers is sent with them and not stored; an empty answer replays without a content type`, async () => {
    const app = Fastify()
    await app.register(fastifyIdempotency, { store: new IdempotencyStore() })
    const calls = { report: 0, empty: 0 }
    app.post('/report', (req, reply) => {
      const n = ++calls.report
      reply.trailer('x-sum', async () => `s${n}`)
      reply.code(201).send('body')
    })
    app.post('/empty', async (req, reply) => {
      calls.empty++
      reply.code(201).send()
    })
    const url = await listen(app)
    try {
      const key = newKey()
      const first = await postWithTrailers(`${url}/report`, key)
      const again = await postWithTrailers(`${url}/report`, key)
      assert.deepEqual([first.status, first.body, first.trailers], [201, 'body', { 'x-sum': 's1' }])
      assert.deepEqual([again.status, again.body, again.trailers], [201, 'body', { 'x-sum': 's2' }])
      assert.equal(calls.report, 2)

      const emptyKey = newKey()
      const a = await postWithTrailers(`${url}/empty`, emptyKey)
      const b = await postWithTrailers(`${url}/empty`, emptyKey)
      assert.equal(b.headers['idempotent-replayed'], 'true')
      assert.equal(a.headers['content-type'], undefined)
      assert.equal(b.headers['content-type'], undefined)
      assert.equal(calls.empty, 1)
    } finally {
      await app.close()
    }
  })
}

/**
 * Sends a keyed POST on a raw socket and leaves after 100 ms (`rst`: a reset, else a FIN),
 * then sends the same key again with fetch at 150 ms: its answer, as text.
 */
async function leaveThenRetry(url, path, key, mode) {
  const net = require('node:net')
  const { port } = new URL(url)
  const body = '{"a":1}'
  const s = net.connect(Number(port), '127.0.0.1', () =>
    s.write(`POST ${path} HTTP/1.1\r\nHost: x\r\nIdempotency-Key: ${key}\r\nContent-Type: application/json\r\nContent-Length: ${body.length}\r\n\r\n${body}`),
  )
  s.on('error', () => {})
  await sleep(100)
  if (mode === 'rst') s.resetAndDestroy()
  else s.end()
  await sleep(50)
  const r = await fetch(url + path, {
    method: 'POST',
    headers: { 'idempotency-key': key, 'content-type': 'application/json' },
    body,
    signal: AbortSignal.timeout(3000),
  })
  return `${r.status} ${r.headers.get('idempotent-replayed')} ${await r.text()}`
}

for (const [name, express] of Object.entries(EXPRESSES)) {
  test(`${name}: a client gone, then its response destroyed by the app's close listener: the key stays held`, async () => {
    for (const mode of ['rst', 'fin']) {
      const app = express()
      app.use(expressIdempotency({ store: new IdempotencyStore() }))
      let runs = 0
      app.post('/x', async (req, res) => {
        runs++
        res.on('close', () => {
          if (!res.writableEnded) res.destroy()
        })
        await sleep(400)
        res.status(201).json({ n: runs })
      })
      await serve(app, async (url) => {
        assert.equal(await leaveThenRetry(url, '/x', newKey(), mode), '201 true {"n":1}', mode)
        assert.equal(runs, 1, `${mode}: the handler ran again while it still ran`)
      })
    }
  })
}

for (const [name, Fastify] of Object.entries(FASTIFIES)) {
  test(`${name}: a client gone, then its response destroyed by a close listener: the key stays held`, async () => {
    for (const mode of ['rst', 'fin']) {
      const app = Fastify()
      app.addHook('onRequest', async (req, reply) => {
        reply.raw.on('close', () => {
          if (!reply.raw.writableEnded) reply.raw.destroy()
        })
      })
      await app.register(fastifyIdempotency, { store: new IdempotencyStore() })
      let runs = 0
      app.post('/x', async (req, reply) => {
        runs++
        await sleep(400)
        return reply.code(201).send({ n: runs })
      })
      const url = await listen(app)
      try {
        assert.equal(await leaveThenRetry(url, '/x', newKey(), mode), '201 true {"n":1}', mode)
        assert.equal(runs, 1, `${mode}: the handler ran again while it still ran`)
      } finally {
        await app.close()
      }
    }
  })
}

for (const [name, Fastify] of Object.entries(FASTIFIES)) {
  test(`${name}: a duplicate answered while it waited (the app's own timeout) does not hold the key when it comes to lead`, async () => {
    const app = Fastify()
    // The app's own per-request timeout: 503 after x-timeout ms.
    app.addHook('onRequest', async (request, reply) => {
      const t = setTimeout(() => {
        if (!reply.sent) reply.code(503).send({ timeout: true })
      }, Number(request.headers['x-timeout']))
      reply.raw.once('close', () => clearTimeout(t))
    })
    await app.register(fastifyIdempotency, { store: new IdempotencyStore() })
    let calls = 0
    app.post('/r', async (request, reply) => {
      const n = ++calls
      await sleep(200)
      // A stream is not stored: the key is released once it ends, and the duplicate
      // that waited for it comes to lead.
      return reply.type('text/plain').send(Readable.from([`streamed ${n}`]))
    })
    const url = await listen(app)
    try {
      const key = newKey()
      const timeout = (ms) => ({ headers: { 'x-timeout': String(ms) } })
      const first = fastifyPost(url, '/r', key, '{}', timeout(5000))
      await sleep(30)
      const waiter = await fastifyPost(url, '/r', key, '{}', timeout(50))
      assert.equal(waiter.status, 503)
      assert.equal((await first).text, 'streamed 1')
      await sleep(50)
      // Before, the waiter came to lead with its reply sent, Fastify never ran the
      // handler, and every later request with the key waited for good.
      const retry = await within(fastifyPost(url, '/r', key, '{}', timeout(5000)), 2000)
      assert.notEqual(retry, 'hang', 'the key was left held')
      assert.equal(retry.text, 'streamed 2')
      assert.equal(calls, 2)
    } finally {
      await app.close()
    }
  })
}

// Fastify 5 only: Fastify 4 has no `request.signal` (nor `handlerTimeout`).
{
  const Fastify = FASTIFIES['fastify 5']
  test('fastify 5: a request without a body is left unread: request.signal is live when the handler runs', async () => {
    const app = Fastify()
    await app.register(fastifyIdempotency, { store: new IdempotencyStore() })
    let aborted
    // With a handler timeout, Fastify makes the signal as the request comes in.
    app.post('/r', { handlerTimeout: 5000 }, async (request) => {
      await sleep(10)
      aborted = request.signal.aborted
      return { ok: true }
    })
    const url = await listen(app)
    try {
      const r = await fetch(`${url}/r`, { method: 'POST', headers: { 'idempotency-key': newKey() } })
      assert.equal(r.status, 200)
      assert.equal(aborted, false, 'reading the empty body closed the request and aborted its signal')
    } finally {
      await app.close()
    }
  })
}

for (const [name, express] of Object.entries(EXPRESSES)) {
  test(`${name}: a duplicate answered while it waited (the app's own timeout) does not run the handler or hold the key`, async () => {
    const app = express()
    let waiterTimeout = 5000
    // The app's own per-request timeout, mounted before the middleware: 503.
    app.use((req, res, next) => {
      const t = setTimeout(() => {
        if (!res.headersSent) res.status(503).end('timeout')
      }, waiterTimeout)
      res.once('close', () => clearTimeout(t))
      next()
    })
    app.use(expressIdempotency({ store: new IdempotencyStore() }))
    let calls = 0
    app.post('/r', async (req, res) => {
      const n = ++calls
      await sleep(200)
      // An event stream is not stored: the key is released once it ends, and the
      // duplicate that waited for it comes to lead.
      res.setHeader('content-type', 'text/event-stream')
      res.write(`data: ${n}\n\n`)
      res.end()
    })
    await serve(app, async (url) => {
      const key = newKey()
      const first = post(`${url}/r`, key)
      await sleep(30)
      waiterTimeout = 50
      const waiter = await post(`${url}/r`, key)
      waiterTimeout = 5000
      assert.deepEqual(waiter, { status: 503, body: 'timeout' })
      assert.equal((await first).body, 'data: 1\n\n')
      await sleep(100)
      // The waiter, answered already, must not have run the handler when it came to
      // lead (its answer could not be sent), nor left the key held.
      assert.equal(calls, 1)
      const retry = await post(`${url}/r`, key, { ms: 2000 })
      assert.notEqual(retry, 'hang', 'the key was left held')
      assert.equal(retry.body, 'data: 2\n\n')
      assert.equal(calls, 2)
    })
  })
}

for (const [name, express] of Object.entries(EXPRESSES)) {
  test(`${name}: headers flushed early by a middleware are no answer: the handler runs and its answer ends`, async () => {
    const app = express()
    app.use((req, res, next) => {
      res.flushHeaders() // a heartbeat middleware for slow endpoints
      next()
    })
    app.use(expressIdempotency({ store: new IdempotencyStore() }))
    let runs = 0
    app.post('/r', (req, res) => {
      runs++
      res.end(JSON.stringify({ run: runs }))
    })
    await serve(app, async (url) => {
      const key = newKey()
      assert.deepEqual(await post(`${url}/r`, key, { ms: 2000 }), { status: 200, body: '{"run":1}' })
      assert.deepEqual(await post(`${url}/r`, key, { ms: 2000 }), { status: 200, body: '{"run":1}' })
      assert.equal(runs, 1)
    })
  })
}

for (const [name, Fastify] of Object.entries(FASTIFIES)) {
  test(`${name}: over HTTP/2 a body without a content-length is in the fingerprint`, async () => {
    const http2 = require('node:http2')
    const app = Fastify({ http2: true })
    await app.register(fastifyIdempotency, { store: new IdempotencyStore() })
    let runs = 0
    app.post('/pay', async (req) => ({ charged: req.body.amount, run: ++runs }))
    await app.listen({ port: 0, host: '127.0.0.1' })
    const client = http2.connect(`http://127.0.0.1:${app.server.address().port}`)
    // No content-length: HTTP/2 needs none, and has no transfer coding.
    const pay = (key, body) =>
      new Promise((resolve, reject) => {
        const req = client.request({ ':method': 'POST', ':path': '/pay', 'content-type': 'application/json', 'idempotency-key': key })
        let status
        req.on('response', (h) => {
          status = h[':status']
        })
        let data = ''
        req.setEncoding('utf8')
        req.on('data', (c) => {
          data += c
        })
        req.on('end', () => resolve({ status, data }))
        req.on('error', reject)
        req.end(body)
      })
    try {
      const key = newKey()
      assert.equal((await pay(key, '{"amount":10}')).status, 200)
      assert.equal((await pay(key, '{"amount":99999}')).status, 422)
      const again = await pay(key, '{"amount":10}')
      assert.deepEqual([again.status, JSON.parse(again.data)], [200, { charged: 10, run: 1 }])
      assert.equal(runs, 1)
    } finally {
      client.close()
      await app.close()
    }
  })
}

for (const [name, Fastify] of Object.entries(FASTIFIES)) {
  test(`${name}: a duplicate the app answers while it waits gets that answer alone, even while it is in an async onSend hook`, async () => {
    const app = Fastify()
    // The app's own per-request timeout, and an onSend hook that takes a while: the
    // timeout's answer is on its way, not yet sent, when the first request's fails.
    app.addHook('onRequest', async (request, reply) => {
      request.timer = setTimeout(() => {
        if (!reply.sent) reply.code(503).send({ error: 'timeout' })
      }, Number(request.headers['x-timeout'] ?? 5000))
    })
    app.addHook('onResponse', async (request) => clearTimeout(request.timer))
    app.addHook('onSend', async (request, reply, payload) => {
      await sleep(200)
      return payload
    })
    await app.register(fastifyIdempotency, { store: new IdempotencyStore() })
    let runs = 0
    app.post('/r', async () => {
      runs++
      await sleep(70)
      throw new Error('boom') // a 500: not stored, shared with the duplicate waiting
    })
    const url = await listen(app)
    try {
      const key = newKey()
      const first = fastifyPost(url, '/r', key)
      await sleep(10)
      const dup = await within(fastifyPost(url, '/r', key, '{"a":1}', { headers: { 'x-timeout': '120' } }), 3000)
      assert.notEqual(dup, 'hang')
      // Before, the first request's 500 went out over the timeout's answer on its way:
      // a 500 status with the timeout's body, marked replayed (Fastify 4: a crash).
      assert.equal(dup.status, 503)
      assert.equal(dup.text, '{"error":"timeout"}')
      assert.equal(dup.headers.get('idempotent-replayed'), null)
      assert.equal((await first).status, 500)
      assert.equal(runs, 1)
    } finally {
      await app.close()
    }
  })

  test(`${name}: an injected request whose body has no length is fingerprinted with its body`, async () => {
    const app = Fastify()
    await app.register(fastifyIdempotency, { store: new IdempotencyStore() })
    let runs = 0
    app.post('/pay', async (req) => ({ charged: req.body.amount, run: ++runs }))
    await app.ready()
    const pay = (key, body) =>
      app.inject({ method: 'POST', url: '/pay', headers: { 'content-type': 'application/json', 'idempotency-key': key }, payload: Readable.from([body]) })
    try {
      const key = newKey()
      assert.equal((await pay(key, '{"amount":10}')).statusCode, 200)
      assert.equal((await pay(key, '{"amount":99999}')).statusCode, 422)
      assert.equal(runs, 1)
    } finally {
      await app.close()
    }
  })
}

for (const [name, express] of Object.entries(EXPRESSES)) {
  test(`${name}: a replay due to a response a middleware ended already writes nothing, and the server lives on`, async () => {
    const net = require('node:net')
    const app = express()
    app.get('/slow', async (req, res) => {
      await sleep(300)
      res.end('slow done')
    })
    // A middleware that ends the response and still goes on.
    app.use((req, res, next) => {
      if (req.headers['x-early']) res.status(202).end('early')
      next()
    })
    app.use(expressIdempotency({ store: new IdempotencyStore() }))
    let runs = 0
    app.post('/r', (req, res) => res.status(201).json({ n: ++runs }))
    await serve(app, async (url) => {
      const key = newKey()
      assert.deepEqual(await post(`${url}/r`, key), { status: 201, body: '{"n":1}' })
      // Pipelined behind a slow request: the ended answer is still queued when the
      // replay comes (before, writing it after the end was an uncaught error).
      const port = new URL(url).port
      const bytes = await new Promise((resolve, reject) => {
        let got = ''
        const s = net.connect(port, '127.0.0.1', () =>
          s.write(`GET /slow HTTP/1.1\r\nhost: x\r\n\r\nPOST /r HTTP/1.1\r\nhost: x\r\nidempotency-key: ${key}\r\nx-early: 1\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}`),
        )
        s.on('data', (d) => {
          got += d.toString('latin1')
        })
        s.on('error', reject)
        setTimeout(() => {
          s.destroy()
          resolve(got)
        }, 700)
      })
      assert.match(bytes, /slow done/)
      assert.match(bytes, /HTTP\/1.1 202[\s\S]*early/)
      assert.equal(runs, 1)
      assert.deepEqual(await post(`${url}/r`, key), { status: 201, body: '{"n":1}' })
    })
  })
}

for (const [major, Fastify] of Object.entries(FASTIFIES)) {
  test(`${major}: an injected request is judged by its declared length too`, async () => {
    // The length given as a number, as tests often do: light-my-request makes it a string.
    const app = Fastify()
    await app.register(fastifyIdempotency, { store: new IdempotencyStore(), requestCap: 100 })
    let calls = 0
    app.post('/r', async () => ({ n: ++calls }))
    const over = await app.inject({ method: 'POST', url: '/r', headers: { 'idempotency-key': 'order-inj-0001', 'content-type': 'text/plain', 'content-length': 500 }, payload: 'x'.repeat(500) })
    assert.equal(over.statusCode, 413, over.body)
    const under = await app.inject({ method: 'POST', url: '/r', headers: { 'idempotency-key': 'order-inj-0002', 'content-type': 'text/plain', 'content-length': 5 }, payload: 'xxxxx' })
    assert.equal(under.statusCode, 200, under.body)
    assert.equal(calls, 1)
    await app.close()
  })
}

for (const [major, express] of Object.entries(EXPRESSES)) {
  test(`${major}: a Content-Length set as a number by a middleware is read as the length`, async () => {
    // A middleware (or a serverless shim) that rewrites the header as a number: it is
    // judged like the string (it was a TypeError from the core: 500 for every request).
    const app = express()
    let runs = 0
    app.use((req, _res, next) => {
      if (req.headers['content-length'] !== undefined) req.headers['content-length'] = Number(req.headers['content-length'])
      next()
    })
    app.post('/orders', expressIdempotency({ store: new IdempotencyStore(), requestCap: 100 }), (req, res) => {
      runs++
      res.status(201).json({ runs })
    })
    await serve(app, async (url) => {
      const ok = await post(`${url}/orders`, 'order-num-0001', { body: '{}' })
      assert.equal(ok.status, 201, ok.body)
      const over = await post(`${url}/orders`, 'order-num-0002', { body: JSON.stringify({ pad: 'x'.repeat(500) }) })
      assert.equal(over.status, 413, over.body)
      assert.equal(runs, 1)
    })
  })
}

for (const [major, Fastify] of Object.entries(FASTIFIES)) {
  test(`${major}: a replayed HEAD answer declares no length of its own`, async () => {
    // Its record has no body (a HEAD's answer has none): the replay must not say
    // `content-length: 0`, which would tell the client its GET's body is empty.
    const app = Fastify()
    await app.register(fastifyIdempotency, { store: new IdempotencyStore(), methods: ['HEAD'] })
    let runs = 0
    app.head('/r', async (_request, reply) => {
      runs++
      reply.header('etag', '"1"').send('hello')
    })
    const url = await listen(app)
    try {
      const heads = []
      for (let i = 0; i < 2; i++) {
        const r = await fetch(`${url}/r`, { method: 'HEAD', headers: { 'idempotency-key': 'order-head-0001' } })
        heads.push(r.headers)
      }
      assert.equal(runs, 1)
      assert.equal(heads[1].get('idempotent-replayed'), 'true')
      assert.equal(heads[1].get('etag'), '"1"')
      assert.equal(heads[1].get('content-length'), null)
    } finally {
      await app.close()
    }
  })
}

for (const [major, Fastify] of Object.entries(FASTIFIES)) {
  test(`${major}: a replayed 204 has the headers the first one was sent with`, async () => {
    // Fastify sends a 204 that has a payload without its content type: the record holds
    // the answer as sent, so the replay has none either (it had Fastify's JSON type).
    // A 204 sent with a type of its own and no payload keeps it in both.
    const app = Fastify()
    await app.register(fastifyIdempotency, { store: new IdempotencyStore() })
    let runs = 0
    app.post('/with-payload', async (_request, reply) => {
      runs++
      reply.code(204).header('etag', '"1"').send({ a: 1 })
    })
    app.post('/typed', async (_request, reply) => {
      runs++
      reply.code(204).type('application/json').send()
    })
    const url = await listen(app)
    try {
      for (const [path, key] of [
        ['/with-payload', 'order-204-0001'],
        ['/typed', 'order-204-0002'],
      ]) {
        const answers = []
        for (let i = 0; i < 2; i++) {
          const r = await fetch(url + path, { method: 'POST', headers: { 'idempotency-key': key, 'content-type': 'application/json' }, body: '{}' })
          answers.push({ status: r.status, type: r.headers.get('content-type'), length: r.headers.get('content-length'), body: await r.text(), replayed: r.headers.get('idempotent-replayed') })
        }
        assert.deepEqual(answers[1], { ...answers[0], replayed: 'true' }, path)
        assert.equal(answers[0].replayed, null)
      }
      assert.equal(runs, 2)
    } finally {
      await app.close()
    }
  })
}
