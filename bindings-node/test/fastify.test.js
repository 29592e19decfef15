'use strict'
// oncely/fastify on a real Fastify server listening on 127.0.0.1, with fetch: the
// sequences of tests/vectors/http_server.json and the adapter's own cases.
const test = require('node:test')
const assert = require('node:assert/strict')
const { Readable } = require('node:stream')
const nodeHttp = require('node:http')

// Both majors the plugin supports, each against the same cases.
const FASTIFIES = { 'fastify 5': require('fastify'), 'fastify 4': require('fastify4') }
const { IdempotencyStore, RedisStore, newKey, http } = require('oncely')
const { idempotency } = require('oncely/fastify')
const { sequences, adapterOptions, answer, runSequence, send } = require('./http-sequences.js')

const REDIS = process.env.ONCELY_REDIS_URL

/**
 * Sends the head of a covered POST declaring `length` body bytes and only 10 of them:
 * resolves with the answer given before the rest (a hang here fails the test).
 */
function oversized(url, length) {
  const { port } = new URL(url)
  return new Promise((resolve, reject) => {
    const req = nodeHttp.request({ host: '127.0.0.1', port, method: 'POST', path: '/orders', headers: { 'idempotency-key': 'order-big01', 'content-length': length } })
    const timer = setTimeout(() => {
      req.destroy()
      reject(new Error('no answer before the body was sent'))
    }, 5_000)
    req.on('response', (res) => {
      const chunks = []
      res.on('data', (c) => chunks.push(c))
      res.on('end', () => {
        clearTimeout(timer)
        req.destroy()
        resolve({ status: res.statusCode, body: Buffer.concat(chunks).toString() })
      })
    })
    req.on('error', () => {})
    req.write('x'.repeat(10))
  })
}

for (const [major, Fastify] of Object.entries(FASTIFIES)) {
  async function start(options, extra = () => {}) {
    const app = Fastify()
    let calls = 0
    await app.register(idempotency, options)
    // Any body is accepted as bytes, as the vectors' handler does not read it.
    app.removeAllContentTypeParsers()
    app.addContentTypeParser('*', { parseAs: 'buffer' }, (req, body, done) => done(null, body))
    const handler = async (req, reply) => {
      const a = await answer(++calls, req.headers['x-respond'])
      return reply.code(a.status).headers(a.headers).send(a.body)
    }
    extra(app, () => ++calls)
    for (const url of ['/orders', '/orders/:id', '/payments']) {
      app.route({ method: ['POST', 'PATCH', 'PUT', 'GET'], url, handler })
    }
    await app.listen({ port: 0, host: '127.0.0.1' })
    return {
      url: `http://127.0.0.1:${app.server.address().port}`,
      calls: () => calls,
      app,
      close: () => app.close(),
    }
  }

  test(`${major}: http_server.json sequences`, async (t) => {
    for (const c of sequences) {
      await t.test(c.comment, () => runSequence(c, (config) => start(adapterOptions(config, new IdempotencyStore()))))
    }
  })

  test(`${major}: http_server.json sequences on a RedisStore`, { skip: !REDIS && 'ONCELY_REDIS_URL not set' }, async (t) => {
    for (const c of sequences) {
      const prefix = `oncely-fastify-test-${newKey()}`
      await t.test(c.comment, () =>
        runSequence(c, (config) => start(adapterOptions(config, new RedisStore({ url: REDIS, prefix, leaseMs: 3_000 })))),
      )
    }
  })

  test(`${major}: 200 concurrent requests with one key run the handler once`, async () => {
    const s = await start({ store: new IdempotencyStore() })
    try {
      const req = {
        method: 'POST',
        path: '/orders',
        headers: { 'idempotency-key': 'order-0200', 'content-type': 'application/json' },
        body: '{"sku":"A1"}',
        respond: { delay_ms: 50 },
      }
      const all = await Promise.all(Array.from({ length: 200 }, () => send(s.url, req)))
      assert.equal(s.calls(), 1)
      for (const r of all) {
        assert.equal(r.status, 201)
        assert.deepEqual(r.body, all[0].body)
      }
      assert.equal(all.filter((r) => r.headers.get('idempotent-replayed') === 'true').length, 199)
      const n = s.app.idempotencyCounters()
      assert.equal(n.led, 1)
      assert.equal(n.replayed, 199)
    } finally {
      await s.close()
    }
  })

  test(`${major}: a handler that throws is not stored and the retry runs again`, async () => {
    const s = await start({ store: new IdempotencyStore() }, (app, call) => {
      app.post('/fail', async () => {
        if (call() === 1) throw new Error('boom')
        return { ok: true }
      })
    })
    try {
      const req = { method: 'POST', path: '/fail', headers: { 'idempotency-key': 'order-fail1' }, body: 'x' }
      assert.equal((await send(s.url, req)).status, 500)
      const second = await send(s.url, req)
      assert.equal(second.status, 200)
      assert.equal(second.headers.get('idempotent-replayed'), null)
      assert.equal((await send(s.url, req)).headers.get('idempotent-replayed'), 'true')
      assert.equal(s.calls(), 2)
    } finally {
      await s.close()
    }
  })

  test(`${major}: a streamed body is sent and not stored; a route can opt out`, async () => {
    const s = await start({ store: new IdempotencyStore() }, (app, call) => {
      app.post('/stream', async (req, reply) => {
        call()
        reply.type('text/plain')
        return reply.send(Readable.from(['a', 'b', 'c']))
      })
      app.post('/free', { config: { idempotency: false } }, async () => ({ n: call() }))
    })
    try {
      const req = { method: 'POST', path: '/stream', headers: { 'idempotency-key': 'order-strm1' }, body: 'x' }
      for (let i = 0; i < 2; i++) {
        const r = await send(s.url, req)
        assert.equal(r.body.toString(), 'abc')
        assert.equal(r.headers.get('idempotent-replayed'), null)
      }
      const free = { method: 'POST', path: '/free', headers: { 'idempotency-key': 'order-free1' }, body: 'x' }
      await send(s.url, free)
      assert.equal((await send(s.url, free)).headers.get('idempotent-replayed'), null)
      assert.equal(s.calls(), 4)
    } finally {
      await s.close()
    }
  })

  test(`${major}: with global false only the routes that opt in are covered; JSON bodies still parse`, async () => {
    const app = Fastify()
    await app.register(idempotency, { store: new IdempotencyStore(), global: false })
    let calls = 0
    app.post('/on', { config: { idempotency: true } }, async (req) => ({ n: ++calls, sku: req.body.sku }))
    app.post('/off', async (req) => ({ n: ++calls, sku: req.body.sku }))
    await app.listen({ port: 0, host: '127.0.0.1' })
    const url = `http://127.0.0.1:${app.server.address().port}`
    try {
      const r = (p) =>
        send(url, { method: 'POST', path: p, headers: { 'idempotency-key': 'order-glob1', 'content-type': 'application/json' }, body: '{"sku":"A1"}' })
      assert.deepEqual(JSON.parse((await r('/on')).body), { n: 1, sku: 'A1' })
      const again = await r('/on')
      assert.equal(again.headers.get('idempotent-replayed'), 'true')
      assert.deepEqual(JSON.parse(again.body), { n: 1, sku: 'A1' })
      await r('/off')
      assert.equal((await r('/off')).headers.get('idempotent-replayed'), null)
      assert.equal(calls, 3)
    } finally {
      await app.close()
    }
  })

  test(`${major}: body parsers that read the stream themselves get the whole body, empty ones too`, async () => {
    const app = Fastify()
    await app.register(idempotency, { store: new IdempotencyStore() })
    // Parsers given the stream (no parseAs): one iterates it, one listens to 'data', one pipes it.
    app.addContentTypeParser('text/iterated', async (req, payload) => {
      const chunks = []
      for await (const c of payload) chunks.push(c)
      return Buffer.concat(chunks).toString()
    })
    app.addContentTypeParser('text/listened', (req, payload, done) => {
      let text = ''
      payload.on('data', (c) => {
        text += c
      })
      payload.on('end', () => done(null, text))
    })
    app.addContentTypeParser('text/piped', (req, payload, done) => {
      const chunks = []
      const sink = new (require('node:stream').Writable)({
        write(c, _e, cb) {
          chunks.push(c)
          cb()
        },
      })
      payload.pipe(sink).on('finish', () => done(null, Buffer.concat(chunks).toString()))
    })
    let calls = 0
    app.post('/echo', async (req) => ({ n: ++calls, body: req.body }))
    await app.listen({ port: 0, host: '127.0.0.1' })
    const url = `http://127.0.0.1:${app.server.address().port}`
    try {
      const big = 'x'.repeat(200_000)
      for (const type of ['text/iterated', 'text/listened', 'text/piped']) {
        for (const body of [big, '']) {
          const key = `order-${newKey()}`
          const r = () => send(url, { method: 'POST', path: '/echo', headers: { 'idempotency-key': key, 'content-type': type }, body })
          const first = await r()
          assert.equal(first.status, 200, first.body)
          const n = calls
          assert.deepEqual(JSON.parse(first.body), { n, body }, type)
          const again = await r()
          assert.equal(again.headers.get('idempotent-replayed'), 'true')
          assert.deepEqual(again.body, first.body)
          assert.equal(calls, n)
        }
      }
    } finally {
      await app.close()
    }
  })

  test(`${major}: on a RedisStore, a retry sent once an unstored answer arrived runs the handler again`, { skip: !REDIS && 'ONCELY_REDIS_URL not set' }, async () => {
    for (let round = 0; round < 30; round++) {
      const store = new RedisStore({ url: REDIS, prefix: `oncely-fastify-test-${newKey()}`, leaseMs: 3_000 })
      const s = await start({ store }, (app, call) => {
        app.post('/limited', async (req, reply) => {
          const n = call()
          return reply.code(n === 1 ? 429 : 201).send({ call: n })
        })
      })
      try {
        const req = { method: 'POST', path: '/limited', headers: { 'idempotency-key': 'order-0429' }, body: 'x' }
        assert.equal((await send(s.url, req)).status, 429)
        const retry = await send(s.url, req)
        assert.equal(retry.status, 201, `round ${round}`)
        assert.equal(retry.headers.get('idempotent-replayed'), null)
      } finally {
        await s.close()
      }
    }
  })

  test(`${major}: a store that fails after the handler ran: the handler's answer is sent`, async () => {
    const store = {
      async execute(scoped, fingerprint, fn) {
        await fn({ signal: new AbortController().signal })
        throw Object.assign(new Error('the idempotency store is unavailable: write failed'), { kind: 'unavailable', code: 'UNAVAILABLE' })
      },
    }
    const s = await start({ store })
    try {
      const r = await send(s.url, { method: 'POST', path: '/orders', headers: { 'idempotency-key': 'order-lost1' }, body: 'x' })
      assert.equal(r.status, 201)
      assert.deepEqual(JSON.parse(r.body.toString()), { call: 1 })
    } finally {
      await s.close()
    }
  })

  test(`${major}: a client gone before the answer began: the handler finishes, the retry is a replay`, async () => {
    let started
    const running = new Promise((r) => (started = r))
    const s = await start({ store: new IdempotencyStore() }, (app, call) => {
      app.post('/slow', async (req, reply) => {
        const n = call()
        started()
        await new Promise((r) => setTimeout(r, 200))
        return reply.code(201).send({ call: n })
      })
    })
    try {
      const c = new AbortController()
      const first = fetch(`${s.url}/slow`, { method: 'POST', headers: { 'idempotency-key': 'order-left1' }, body: 'x', signal: c.signal })
      await running
      c.abort()
      await assert.rejects(first)
      const retry = await send(s.url, { method: 'POST', path: '/slow', headers: { 'idempotency-key': 'order-left1' }, body: 'x' })
      assert.equal(retry.status, 201)
      assert.deepEqual(JSON.parse(retry.body.toString()), { call: 1 })
      assert.equal(retry.headers.get('idempotent-replayed'), 'true')
      assert.equal(s.calls(), 1)
    } finally {
      await s.close()
    }
  })

  test(`${major}: a hijacked reply (answered on the raw response) is not stored and releases its key`, async () => {
    const s = await start({ store: new IdempotencyStore() }, (app, call) => {
      app.post('/raw', (req, reply) => {
        const n = call()
        reply.hijack()
        reply.raw.writeHead(200, { 'content-type': 'text/plain' })
        reply.raw.end(`raw ${n}`)
      })
    })
    try {
      for (const n of [1, 2]) {
        // A key still held would leave this retry waiting: the bound detects that hang.
        const r = await fetch(`${s.url}/raw`, { method: 'POST', headers: { 'idempotency-key': 'order-raw01' }, body: 'x', signal: AbortSignal.timeout(5_000) })
        assert.equal(r.status, 200)
        assert.equal(await r.text(), `raw ${n}`)
        assert.equal(r.headers.get('idempotent-replayed'), null)
      }
      assert.equal(s.calls(), 2)
    } finally {
      await s.close()
    }
  })

  test(`${major}: a handler that destroys the connection before answering (hijacked or not) releases the key; the retry runs it`, async () => {
    for (const hijack of [false, true]) {
      const path = hijack ? '/cut-raw' : '/cut'
      const s = await start({ store: new IdempotencyStore() }, (app, call) => {
        app.post(path, async (req, reply) => {
          const n = call()
          if (n === 1) {
            if (hijack) reply.hijack()
            reply.raw.destroy()
            return reply
          }
          return reply.code(201).send(`call ${n}`)
        })
      })
      try {
        const headers = { 'idempotency-key': 'order-cut01' }
        await assert.rejects(fetch(`${s.url}${path}`, { method: 'POST', headers, body: 'x' }))
        // A key still held would leave this retry waiting: the bound detects that hang.
        const again = await fetch(`${s.url}${path}`, { method: 'POST', headers, body: 'x', signal: AbortSignal.timeout(5_000) })
        assert.equal(again.status, 201, path)
        assert.equal(await again.text(), 'call 2')
        assert.equal(again.headers.get('idempotent-replayed'), null)
        assert.equal(s.calls(), 2)
      } finally {
        await s.close()
      }
    }
  })

  test(`${major}: a client gone mid-stream: the key is held until the stream's producer stops, then released`, async () => {
    let release
    let stopped
    const producerStopped = new Promise((r) => (stopped = r))
    const s = await start({ store: new IdempotencyStore() }, (app, call) => {
      app.post('/stream', async (req, reply) => {
        const n = call()
        async function* parts() {
          try {
            yield `part-1 of call ${n}\n`
            // Still producing after the client has gone.
            if (n === 1) await new Promise((r) => (release = r))
            yield 'done\n'
          } finally {
            if (n === 1) stopped()
          }
        }
        return reply.code(200).type('text/plain').send(Readable.from(parts()))
      })
    })
    try {
      await new Promise((resolve, reject) => {
        const port = new URL(s.url).port
        const req = nodeHttp.request({ host: '127.0.0.1', port, method: 'POST', path: '/stream', headers: { 'idempotency-key': 'order-gone1' } })
        req.on('response', (res) => {
          res.once('data', (d) => {
            assert.equal(d.toString(), 'part-1 of call 1\n')
            req.destroy()
            resolve()
          })
        })
        req.on('error', () => {})
        req.end('x')
        setTimeout(() => reject(new Error('no first part')), 5_000)
      })
      // The producer still runs: a retry waits for it and does not run the handler.
      const again = send(s.url, { method: 'POST', path: '/stream', headers: { 'idempotency-key': 'order-gone1' }, body: 'x' })
      await new Promise((r) => setTimeout(r, 200))
      assert.equal(s.calls(), 1)
      release()
      await producerStopped
      const r = await again
      assert.equal(r.body.toString(), 'part-1 of call 2\ndone\n')
      assert.equal(r.headers.get('idempotent-replayed'), null)
      assert.equal(s.calls(), 2)
    } finally {
      await s.close()
    }
  })

  test(`${major}: a declared Content-Length over the request cap: 413 at once, before the body arrives; the handler not run`, async () => {
    const s = await start({ store: new IdempotencyStore(), requestCap: 1_000 })
    try {
      const r = await oversized(s.url, 10_000_000)
      assert.equal(r.status, 413)
      assert.equal(JSON.parse(r.body).type, 'urn:oncely:problem:request-too-large')
      assert.equal(s.calls(), 0)
      assert.equal(s.app.idempotencyCounters().refused, 1)
    } finally {
      await s.close()
    }
  })

  test(`${major}: an event stream is sent as it comes and not stored, even under the cap`, async () => {
    const s = await start({ store: new IdempotencyStore() }, (app, call) => {
      app.post('/events', async (req, reply) => {
        const n = call()
        reply.type('text/event-stream')
        return reply.send(`data: ${n}\n\n`)
      })
      app.post('/events-stream', async (req, reply) => {
        const n = call()
        reply.type('text/event-stream; charset=utf-8')
        return reply.send(Readable.from([`data: a${n}\n\n`, `data: b${n}\n\n`]))
      })
    })
    try {
      for (const path of ['/events', '/events-stream']) {
        const req = { method: 'POST', path, headers: { 'idempotency-key': 'order-sse03' }, body: 'x' }
        const first = await send(s.url, req)
        const second = await send(s.url, req)
        assert.equal(second.headers.get('idempotent-replayed'), null)
        assert.notDeepEqual(second.body, first.body)
      }
      assert.equal(s.calls(), 4)
    } finally {
      await s.close()
    }
  })

  for (const [name, storeOf] of [
    ['memory', () => new IdempotencyStore()],
    ['redis', () => new RedisStore({ url: REDIS, prefix: `oncely-fastify-test-${newKey()}`, leaseMs: 3_000 })],
  ]) {
    test(`${major}: duplicates that waited for an unstored 503 get its shared headers (${name})`, { skip: name === 'redis' && !REDIS && 'ONCELY_REDIS_URL not set' }, async () => {
      const s = await start({ store: storeOf() })
      try {
        const req = {
          method: 'POST',
          path: '/orders',
          headers: { 'idempotency-key': 'order-503s2', 'content-type': 'application/json' },
          body: '{}',
          respond: { status: 503, delay_ms: 300 },
        }
        const all = await Promise.all(Array.from({ length: 8 }, () => send(s.url, req)))
        let waiters = 0
        for (const r of all) {
          assert.equal(r.status, 503)
          if (r.headers.get('idempotent-replayed') !== 'true') continue
          waiters++
          assert.equal(r.headers.get('x-call'), r.headers.get('etag').slice(6, -1))
          assert.equal(r.headers.get('set-cookie'), null)
        }
        assert.ok(waiters > 0, 'no duplicate waited')
      } finally {
        await s.close()
      }
    })
  }

  test(`${major}: a handler that fails after its whole response was sent: the response is the answer, and stored`, async () => {
    const s = await start({ store: new IdempotencyStore() }, (app, call) => {
      app.post('/late', async (req, reply) => {
        reply.code(201).send({ call: call() })
        await new Promise((r) => setImmediate(r))
        throw new Error('late failure')
      })
    })
    try {
      const req = { method: 'POST', path: '/late', headers: { 'idempotency-key': 'order-late2' }, body: 'x' }
      const first = await send(s.url, req)
      assert.equal(first.status, 201)
      assert.deepEqual(JSON.parse(first.body.toString()), { call: 1 })
      const second = await send(s.url, req)
      assert.equal(second.status, 201)
      assert.equal(second.headers.get('idempotent-replayed'), 'true')
      assert.equal(s.calls(), 1)
    } finally {
      await s.close()
    }
  })

  test(`${major}: a 204 or HEAD answer is stored without the body the handler gave`, async () => {
    const store = new IdempotencyStore()
    const s = await start({ store, methods: ['POST', 'HEAD'], fingerprint: () => 'fp' }, (app, call) => {
      app.post('/nobody', async (req, reply) => {
        call()
        return reply.code(204).send('not sent')
      })
      app.head('/nobody', async (req, reply) => {
        call()
        return reply.code(200).send('not sent')
      })
    })
    try {
      for (const method of ['POST', 'HEAD']) {
        const key = `order-nobody-${method}`
        await send(s.url, { method, path: '/nobody', headers: { 'idempotency-key': key }, body: '' })
        const r = await store.execute(http.scope('default', method, '/nobody', key), 'fp', () => {
          throw new Error('the first request was not stored')
        })
        assert.equal(http.decodeResponse(Buffer.from(r.value)).body.length, 0, method)
      }
    } finally {
      await s.close()
    }
  })

  test(`${major}: a tenant function that gives no string, or an unusable one: 500 tenant-unusable, the handler not run`, async () => {
    for (const tenant of [undefined, null, 42, '', 'x'.repeat(2000)]) {
      const s = await start({ store: new IdempotencyStore(), tenant: () => tenant })
      try {
        const r = await send(s.url, { method: 'POST', path: '/orders', headers: { 'idempotency-key': 'order-0001' }, body: '{}' })
        assert.equal(r.status, 500, String(tenant))
        assert.equal(JSON.parse(r.body.toString()).type, 'urn:oncely:problem:tenant-unusable')
        assert.equal(s.calls(), 0)
      } finally {
        await s.close()
      }
    }
  })
}
