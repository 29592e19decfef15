'use strict'
// oncely/express on a real Express server (4 and 5) on 127.0.0.1, with fetch: the
// sequences of tests/vectors/http_server.json and the adapter's own cases.
const test = require('node:test')
const assert = require('node:assert/strict')
const http = require('node:http')
const net = require('node:net')

const { IdempotencyStore, RedisStore, newKey, http: oncelyHttp } = require('oncely')
const { idempotency } = require('oncely/express')
const { sequences, adapterOptions, answer, runSequence, send } = require('./http-sequences.js')

const EXPRESSES = { 'express 5': require('express'), 'express 4': require('express4') }
const REDIS = process.env.ONCELY_REDIS_URL

function listen(app) {
  // The default error handler then answers 500 without logging the test's own errors.
  app.set('env', 'test')
  return new Promise((resolve) => {
    const server = app.listen(0, '127.0.0.1', () => resolve(server))
  })
}

/**
 * Sends the head of a covered POST declaring `length` body bytes and only 10 of them:
 * resolves with the answer given before the rest (a hang here fails the test).
 */
function oversized(url, length) {
  const { port } = new URL(url)
  return new Promise((resolve, reject) => {
    const req = http.request({ host: '127.0.0.1', port, method: 'POST', path: '/orders', headers: { 'idempotency-key': 'order-big01', 'content-length': length } })
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

/** A POST whose client goes away once the first part of the answer has come. */
function leaveAfterFirstPart(port, path, key) {
  return new Promise((resolve, reject) => {
    const req = http.request({ host: '127.0.0.1', port, method: 'POST', path, headers: { 'idempotency-key': key } })
    req.on('response', (res) => {
      res.once('data', () => {
        req.destroy()
        resolve()
      })
    })
    req.on('error', () => {})
    req.end('x')
    setTimeout(() => reject(new Error('no first part')), 5_000)
  })
}

async function start(express, options, extra = () => {}) {
  const app = express()
  let calls = 0
  const mw = idempotency(options)
  const handler = async (req, res) => {
    const a = await answer(++calls, req.headers['x-respond'])
    res.status(a.status).set(a.headers).send(a.body)
  }
  extra(app, mw, () => ++calls)
  for (const p of ['/orders', '/orders/:id', '/payments']) {
    for (const m of ['post', 'patch', 'put', 'get']) app[m](p, mw, handler)
  }
  const server = await listen(app)
  return {
    url: `http://127.0.0.1:${server.address().port}`,
    calls: () => calls,
    middleware: mw,
    server,
    close: () => new Promise((r) => server.close(r)),
  }
}

for (const [name, express] of Object.entries(EXPRESSES)) {
  test(`${name}: http_server.json sequences`, async (t) => {
    for (const c of sequences) {
      await t.test(c.comment, () =>
        runSequence(c, (config) => start(express, adapterOptions(config, new IdempotencyStore()))),
      )
    }
  })

  test(`${name}: http_server.json sequences on a RedisStore`, { skip: !REDIS && 'ONCELY_REDIS_URL not set' }, async (t) => {
    for (const c of sequences) {
      const prefix = `oncely-express-test-${newKey()}`
      await t.test(c.comment, () =>
        runSequence(c, (config) =>
          start(express, adapterOptions(config, new RedisStore({ url: REDIS, prefix, leaseMs: 3_000 }))),
        ),
      )
    }
  })

  test(`${name}: 200 concurrent requests with one key run the handler once`, async () => {
    const s = await start(express, { store: new IdempotencyStore() })
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
        assert.equal(r.headers.get('etag'), '"call-1"')
      }
      assert.equal(all.filter((r) => r.headers.get('idempotent-replayed') === 'true').length, 199)
      const n = s.middleware.counters()
      assert.equal(n.led, 1)
      assert.equal(n.stored, 1)
      assert.equal(n.replayed, 199)
    } finally {
      await s.close()
    }
  })

  test(`${name}: a handler that fails is not stored and the retry runs again`, async () => {
    const s = await start(express, { store: new IdempotencyStore() }, (app, mw, call) => {
      app.post('/fail', mw, (req, res, next) => {
        if (call() === 1) return next(new Error('boom'))
        res.status(201).json({ ok: true })
      })
    })
    try {
      const req = { method: 'POST', path: '/fail', headers: { 'idempotency-key': 'order-fail1' }, body: 'x' }
      assert.equal((await send(s.url, req)).status, 500)
      const second = await send(s.url, req)
      assert.equal(second.status, 201)
      assert.equal(second.headers.get('idempotent-replayed'), null)
      const third = await send(s.url, req)
      assert.equal(third.headers.get('idempotent-replayed'), 'true')
      assert.equal(s.calls(), 2)
    } finally {
      await s.close()
    }
  })

  test(`${name}: a client that goes away mid-response: the key is held until the handler ends, then released`, async () => {
    let release
    let ended
    const firstEnded = new Promise((r) => (ended = r))
    const s = await start(express, { store: new IdempotencyStore() }, (app, mw, call) => {
      app.post('/stream', mw, async (req, res) => {
        const n = call()
        res.status(200).type('text/plain')
        res.write(`part-1 of call ${n}\n`)
        if (n === 1) {
          // Still running (and writing) after the client has gone.
          await new Promise((r) => (release = r))
          res.write('part-2, nobody reads it\n')
          res.end('never seen\n')
          ended()
          return
        }
        res.end('done\n')
      })
    })
    try {
      const port = new URL(s.url).port
      await leaveAfterFirstPart(port, '/stream', 'order-gone1')
      // The first handler still runs: a retry waits for it and does not run the handler.
      const again = send(s.url, { method: 'POST', path: '/stream', headers: { 'idempotency-key': 'order-gone1' }, body: 'x' })
      await new Promise((r) => setTimeout(r, 200))
      assert.equal(s.calls(), 1)
      release()
      await firstEnded
      // Its response was not sent whole: not stored, and the retry runs the handler.
      const r = await again
      assert.equal(r.status, 200)
      assert.equal(r.body.toString(), 'part-1 of call 2\ndone\n')
      assert.equal(r.headers.get('idempotent-replayed'), null)
      assert.equal(s.calls(), 2)
    } finally {
      await s.close()
    }
  })

  test(`${name}: a client that goes away mid-response, then a handler that fails: the key is released (the retry does not wait for good)`, async () => {
    let fail
    const s = await start(express, { store: new IdempotencyStore() }, (app, mw, call) => {
      app.post('/gone-fail', mw, async (req, res, next) => {
        const n = call()
        res.status(200).type('text/plain')
        res.write(`part-1 of call ${n}\n`)
        if (n === 1) {
          await new Promise((r) => (fail = r))
          return next(new Error('the stream broke after the client left'))
        }
        res.end('done\n')
      })
    })
    try {
      const port = new URL(s.url).port
      await leaveAfterFirstPart(port, '/gone-fail', 'order-gonef')
      const again = send(s.url, { method: 'POST', path: '/gone-fail', headers: { 'idempotency-key': 'order-gonef' }, body: 'x' })
      await new Promise((r) => setTimeout(r, 200))
      // The first handler still runs: the retry waits.
      assert.equal(s.calls(), 1)
      fail()
      const r = await Promise.race([again, new Promise((r) => setTimeout(() => r('no answer'), 3_000))])
      assert.notEqual(r, 'no answer', 'the retry waited for good')
      assert.equal(r.status, 200)
      assert.equal(r.body.toString(), 'part-1 of call 2\ndone\n')
      assert.equal(s.calls(), 2)
    } finally {
      await s.close()
    }
  })

  for (const clientError of [false, true]) {
  test(`${name}: a client that resets the connection mid-response${clientError ? ' (a clientError listener destroys the socket)' : ''}: the key is held until the handler ends`, async () => {
    const c = { calls: 0, running: 0, overlaps: 0 }
    const s = await start(express, { store: new IdempotencyStore() }, (app, mw) => {
      app.post('/reset', mw, async (req, res) => {
        const n = ++c.calls
        if (++c.running > 1) c.overlaps++
        res.status(200).type('text/plain')
        res.write(`part-1 of call ${n}\n`)
        await new Promise((r) => setTimeout(r, 300))
        c.running--
        res.end('done\n')
      })
    })
    if (clientError) s.server.on('clientError', (e, socket) => socket.destroy())
    try {
      const port = new URL(s.url).port
      await new Promise((resolve, reject) => {
        const socket = net.connect(port, '127.0.0.1', () =>
          socket.write('POST /reset HTTP/1.1\r\nHost: x\r\nIdempotency-Key: order-reset1\r\nContent-Length: 1\r\n\r\nx'),
        )
        socket.once('data', () => {
          socket.resetAndDestroy()
          resolve()
        })
        socket.on('error', () => {})
        setTimeout(() => reject(new Error('no first part')), 5_000)
      })
      await new Promise((r) => setTimeout(r, 50))
      const again = await send(s.url, { method: 'POST', path: '/reset', headers: { 'idempotency-key': 'order-reset1' }, body: 'x' })
      assert.equal(c.overlaps, 0, 'the handler ran twice at once for one key')
      assert.equal(again.body.toString(), 'part-1 of call 2\ndone\n')
    } finally {
      await s.close()
    }
  })
  }

  test(`${name}: a handler that fails mid-response releases the key at once; the retry runs it`, async () => {
    const s = await start(express, { store: new IdempotencyStore() }, (app, mw, call) => {
      app.post('/broken', mw, async (req, res, next) => {
        const n = call()
        res.status(200).type('text/plain')
        res.write(`part-1 of call ${n}\n`)
        if (n === 1) return setTimeout(() => next(new Error('the stream broke')), 20)
        res.end('done\n')
      })
    })
    try {
      const req = { method: 'POST', path: '/broken', headers: { 'idempotency-key': 'order-broke' }, body: 'x' }
      await assert.rejects(send(s.url, req))
      const again = await send(s.url, req)
      assert.equal(again.body.toString(), 'part-1 of call 2\ndone\n')
      assert.equal(again.headers.get('idempotent-replayed'), null)
      assert.equal(s.calls(), 2)
    } finally {
      await s.close()
    }
  })

  test(`${name}: a handler that destroys the connection before answering releases the key; the retry runs it`, async () => {
    const s = await start(express, { store: new IdempotencyStore() }, (app, mw, call) => {
      app.post('/refused', mw, (req, res) => {
        const n = call()
        if (n === 1) return setTimeout(() => res.destroy(), 20)
        res.status(201).send(`call ${n}`)
      })
    })
    try {
      const req = { method: 'POST', path: '/refused', headers: { 'idempotency-key': 'order-cut01' }, body: 'x' }
      await assert.rejects(send(s.url, req))
      // A key still held would leave this retry waiting: the bound detects that hang.
      const again = await fetch(`${s.url}/refused`, { method: 'POST', headers: { 'idempotency-key': 'order-cut01' }, body: 'x', signal: AbortSignal.timeout(5_000) })
      assert.equal(again.status, 201)
      assert.equal(await again.text(), 'call 2')
      assert.equal(again.headers.get('idempotent-replayed'), null)
      assert.equal(s.calls(), 2)
    } finally {
      await s.close()
    }
  })

  test(`${name}: a declared Content-Length over the request cap: 413 at once, before the body arrives; the handler not run`, async () => {
    const s = await start(express, { store: new IdempotencyStore(), requestCap: 1_000 })
    try {
      const r = await oversized(s.url, 10_000_000)
      assert.equal(r.status, 413)
      assert.equal(JSON.parse(r.body).type, 'urn:oncely:problem:request-too-large')
      assert.equal(s.calls(), 0)
      assert.equal(s.middleware.counters().refused, 1)
    } finally {
      await s.close()
    }
  })

  test(`${name}: a body parser before or after the middleware sees the body; the fingerprint is the same`, async () => {
    const store = new IdempotencyStore()
    const app = express()
    const mw = idempotency({ store })
    const seen = []
    app.post('/before', express.json(), mw, (req, res) => {
      seen.push(req.body)
      res.status(201).json({ n: seen.length })
    })
    app.post('/after', mw, express.json(), (req, res) => {
      seen.push(req.body)
      res.status(201).json({ n: seen.length })
    })
    const server = await listen(app)
    const url = `http://127.0.0.1:${server.address().port}`
    try {
      for (const p of ['/before', '/after']) {
        for (const body of ['{"sku":"A1","qty":1}', '{ "qty": 1, "sku": "A1" }']) {
          const r = await send(url, { method: 'POST', path: p, headers: { 'idempotency-key': 'order-body1', 'content-type': 'application/json' }, body })
          assert.equal(r.status, 201)
        }
      }
      assert.deepEqual(seen, [{ sku: 'A1', qty: 1 }, { sku: 'A1', qty: 1 }])
    } finally {
      await new Promise((r) => server.close(r))
    }
  })
}

test('a streaming response over the cap is sent whole and not stored', async () => {
  const express = EXPRESSES['express 5']
  const s = await start(express, { store: new IdempotencyStore(), bodyCap: 1024 }, (app, mw, call) => {
    app.post('/events', mw, async (req, res) => {
      call()
      res.status(200).type('text/event-stream')
      for (let i = 0; i < 100; i++) {
        res.write(`data: ${'y'.repeat(30)} ${i}\n\n`)
        await new Promise((r) => setImmediate(r))
      }
      res.end()
    })
  })
  try {
    const req = { method: 'POST', path: '/events', headers: { 'idempotency-key': 'order-sse01' }, body: '' }
    const first = await send(s.url, req)
    assert.equal(first.body.toString().split('\n\n').length, 101)
    const second = await send(s.url, req)
    assert.equal(second.headers.get('idempotent-replayed'), null)
    assert.deepEqual(second.body, first.body)
    assert.equal(s.calls(), 2)
    assert.equal(s.middleware.counters().notStored, 2)
  } finally {
    await s.close()
  }
})

test('bad options are refused when the middleware is made', () => {
  assert.throws(() => idempotency(), TypeError)
  assert.throws(() => idempotency({ store: {} }), TypeError)
  assert.throws(() => idempotency({ store: new IdempotencyStore(), methods: ['PO ST'] }), { code: 'INVALID_ARGUMENT' })
  assert.throws(() => idempotency({ store: new IdempotencyStore(), tenant: 3 }), TypeError)
  // Each bad option is named, with the oncely code, when the middleware is made (not at
  // its first request); a lone string is not read as a list of methods.
  const store = new IdempotencyStore()
  const bad = [
    [{ store: null }, 'store', TypeError],
    [{ methods: 'POST' }, 'methods', TypeError],
    [{ methods: ['POST', 1] }, 'methods', TypeError],
    [{ storedHeaders: 'etag' }, 'storedHeaders', TypeError],
    [{ required: 'yes' }, 'required', TypeError],
    [{ wait: 0 }, 'wait', TypeError],
    [{ bodyCap: '1MiB' }, 'bodyCap', TypeError],
    [{ bodyCap: -1 }, 'bodyCap', RangeError],
    [{ requestCap: 1.5 }, 'requestCap', RangeError],
    [{ onReplay: 'log' }, 'onReplay', TypeError],
    [{ route: 4 }, 'route', TypeError],
  ]
  for (const [options, field, Kind] of bad) {
    assert.throws(() => idempotency({ store, ...options }), (e) => e instanceof Kind && e.code === 'INVALID_ARGUMENT' && e.field === field, JSON.stringify(options))
  }
})

test('on a RedisStore, a retry sent once an unstored answer arrived runs the handler again', { skip: !REDIS && 'ONCELY_REDIS_URL not set' }, async () => {
  // The answer's end is held until the key is released in Redis: 30 rounds, each a
  // 429 then at once its retry, which must be a new call (never a replay of the 429).
  const express = EXPRESSES['express 5']
  for (let round = 0; round < 30; round++) {
    const store = new RedisStore({ url: REDIS, prefix: `oncely-express-test-${newKey()}`, leaseMs: 3_000 })
    const s = await start(express, { store }, (app, mw, call) => {
      app.post('/limited', mw, (req, res) => {
        const n = call()
        res.status(n === 1 ? 429 : 201).json({ call: n })
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

test('two server processes on one Redis run one request once', { skip: !REDIS && 'ONCELY_REDIS_URL not set' }, async () => {
  const { spawn } = require('node:child_process')
  const path = require('node:path')
  const prefix = `oncely-express-test-${newKey()}`
  const children = []
  try {
    const urls = []
    for (let i = 0; i < 2; i++) {
      const child = spawn(process.execPath, [path.join(__dirname, '..', 'fixtures', 'express-redis-server.js')], {
        env: { ...process.env, PREFIX: prefix },
        stdio: ['ignore', 'pipe', 'inherit'],
      })
      children.push(child)
      const port = await new Promise((resolve, reject) => {
        child.stdout.once('data', (d) => resolve(String(d).trim()))
        child.once('exit', (code) => reject(new Error(`server exited ${code}`)))
      })
      urls.push(`http://127.0.0.1:${port}`)
    }
    const req = { method: 'POST', path: '/orders', headers: { 'idempotency-key': 'order-2proc' }, body: 'x' }
    const all = await Promise.all(Array.from({ length: 60 }, (_, i) => send(urls[i % 2], req)))
    for (const r of all) {
      assert.equal(r.status, 201)
      assert.deepEqual(r.body, all[0].body)
    }
    assert.equal(all.filter((r) => r.headers.get('idempotent-replayed') === 'true').length, 59)
    let calls = 0
    for (const u of urls) calls += (await (await fetch(`${u}/count`)).json()).calls
    assert.equal(calls, 1)
  } finally {
    for (const c of children) c.kill('SIGTERM')
  }
})

test('a store that fails after the handler ran: the handler\'s answer is sent, not a problem', async () => {
  // As a RedisStore does when the result cannot be written or the lease was lost.
  const store = {
    async execute(scoped, fingerprint, fn) {
      await fn({ signal: new AbortController().signal })
      throw Object.assign(new Error('the idempotency store is unavailable: write failed'), { kind: 'unavailable', code: 'UNAVAILABLE' })
    },
  }
  const s = await start(EXPRESSES['express 5'], { store })
  try {
    const r = await send(s.url, { method: 'POST', path: '/orders', headers: { 'idempotency-key': 'order-lost1', 'content-type': 'application/json' }, body: '{}' })
    assert.equal(r.status, 201)
    assert.deepEqual(JSON.parse(r.body.toString()), { call: 1 })
    assert.equal(s.calls(), 1)
  } finally {
    await s.close()
  }
})

test('concurrent duplicates, half of them aborted at random moments: one run, every other caller its answer', async () => {
  for (const [name, makeStore] of [
    ['memory', () => new IdempotencyStore()],
    ...(REDIS ? [['redis', () => new RedisStore({ url: REDIS, prefix: `oncely-express-test-${newKey()}`, leaseMs: 3_000 })]] : []),
  ]) {
    const s = await start(EXPRESSES['express 5'], { store: makeStore() })
    try {
      const key = newKey()
      const one = (abortAfterMs) => {
        const c = new AbortController()
        if (abortAfterMs !== undefined) setTimeout(() => c.abort(), abortAfterMs)
        return fetch(`${s.url}/orders`, {
          method: 'POST',
          headers: { 'idempotency-key': key, 'content-type': 'application/json', 'x-respond': '{"delay_ms":150}' },
          body: '{"sku":"A1"}',
          signal: c.signal,
        }).then(
          async (r) => ({ status: r.status, body: await r.text() }),
          (e) => ({ aborted: e.name === 'AbortError' }),
        )
      }
      const all = await Promise.all(Array.from({ length: 80 }, (_, i) => one(i % 2 ? Math.floor(Math.random() * 200) : undefined)))
      const answered = all.filter((r) => !r.aborted)
      assert.ok(answered.length >= 40, name)
      const bodies = new Set(answered.map((r) => r.body))
      assert.equal(bodies.size, 1, `${name}: every caller got one answer`)
      const after = await send(s.url, { method: 'POST', path: '/orders', headers: { 'idempotency-key': key, 'content-type': 'application/json' }, body: '{"sku":"A1"}' })
      // The first leader may have been aborted before it answered (its key released, a
      // waiter led): the handler ran at most twice, and the stored answer is the last run's.
      assert.equal(after.headers.get('idempotent-replayed'), 'true', name)
      assert.ok(s.calls() >= 1 && s.calls() <= 2, `${name}: ${s.calls()} runs`)
      assert.ok(bodies.has(after.body.toString()) || s.calls() === 2, name)
    } finally {
      await s.close()
    }
  }
})

test('a client gone before the answer began: the handler finishes, its answer is kept, the retry is a replay', async () => {
  for (const express of Object.values(EXPRESSES)) {
    let started
    const running = new Promise((r) => (started = r))
    const s = await start(express, { store: new IdempotencyStore() }, (app, mw, call) => {
      app.post('/slow', mw, async (req, res) => {
        const n = call()
        started()
        await new Promise((r) => setTimeout(r, 200))
        res.status(201).json({ call: n })
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
  }
})

test('an event stream is sent as it is produced, holds the key until it ends, and is not stored', async () => {
  const express = EXPRESSES['express 5']
  let release
  const s = await start(express, { store: new IdempotencyStore() }, (app, mw, call) => {
    app.post('/events', mw, async (req, res) => {
      const n = call()
      res.status(200).type('text/event-stream')
      res.write(`data: first ${n}\n\n`)
      if (n === 1) await new Promise((r) => (release = r))
      res.end(`data: last ${n}\n\n`)
    })
  })
  try {
    const req = { method: 'POST', path: '/events', headers: { 'idempotency-key': 'order-sse02' }, body: '' }
    const res = await fetch(s.url + req.path, { method: 'POST', headers: req.headers, body: '' })
    const reader = res.body.getReader()
    // The first event arrives while the handler still runs (a hang here fails the test).
    assert.equal(Buffer.from((await reader.read()).value).toString(), 'data: first 1\n\n')
    // A duplicate during the stream waits for its end: the key is held.
    const dup = send(s.url, req)
    await new Promise((r) => setTimeout(r, 100))
    assert.equal(s.calls(), 1)
    release()
    let rest = ''
    for (let r = await reader.read(); !r.done; r = await reader.read()) rest += Buffer.from(r.value).toString()
    assert.equal(rest, 'data: last 1\n\n')
    const second = await dup
    assert.equal(second.headers.get('idempotent-replayed'), null)
    assert.equal(second.body.toString(), 'data: first 2\n\ndata: last 2\n\n')
    const third = await send(s.url, req)
    assert.equal(third.headers.get('idempotent-replayed'), null)
    assert.equal(s.calls(), 3)
  } finally {
    await s.close()
  }
})

for (const [name, storeOf] of [
  ['memory', () => new IdempotencyStore()],
  ['redis', () => new RedisStore({ url: REDIS, prefix: `oncely-express-test-${newKey()}`, leaseMs: 3_000 })],
]) {
  test(`duplicates that waited for an unstored 503 get its shared headers (${name})`, { skip: name === 'redis' && !REDIS && 'ONCELY_REDIS_URL not set' }, async () => {
    const s = await start(EXPRESSES['express 5'], { store: storeOf() })
    try {
      const req = {
        method: 'POST',
        path: '/orders',
        headers: { 'idempotency-key': 'order-503s1', 'content-type': 'application/json' },
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

test('a handler that reuses its buffer once it has ended the response: duplicates and replays get the bytes it sent', async () => {
  const app = require('express')()
  let calls = 0
  app.post('/orders', idempotency({ store: new IdempotencyStore() }), async (req, res) => {
    calls++
    await new Promise((resolve) => setTimeout(resolve, 200))
    const buf = Buffer.from(`answer ${req.headers['x-status']}`)
    res.status(Number(req.headers['x-status'])).end(buf)
    buf.fill('x')
  })
  const server = await listen(app)
  const url = `http://127.0.0.1:${server.address().port}/orders`
  try {
    for (const status of ['201', '503']) {
      const post = () => fetch(url, { method: 'POST', headers: { 'idempotency-key': `order-reuse-${status}`, 'x-status': status } })
      const all = await Promise.all(Array.from({ length: 6 }, post))
      if (status === '201') all.push(await post())
      const bodies = await Promise.all(all.map((r) => r.text()))
      assert.ok(all.some((r) => r.headers.get('idempotent-replayed') === 'true'), 'nothing was replayed')
      for (const [i, r] of all.entries()) {
        assert.equal(r.status, Number(status))
        assert.equal(bodies[i], `answer ${status}`)
      }
    }
    assert.equal(calls, 2)
  } finally {
    server.close()
  }
})

test('a handler that fails after its whole response was sent: the response is the answer, and stored', async () => {
  const s = await start(EXPRESSES['express 5'], { store: new IdempotencyStore() }, (app, mw, call) => {
    app.post('/late', mw, (req, res, next) => {
      res.status(201).json({ call: call() })
      next(new Error('late failure'))
    })
  })
  try {
    const req = { method: 'POST', path: '/late', headers: { 'idempotency-key': 'order-late1' }, body: '' }
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

test('a response that has no body on the wire (204, HEAD) is stored without the body the handler wrote', async () => {
  const store = new IdempotencyStore()
  const options = { store, methods: ['POST', 'HEAD'], fingerprint: () => 'fp' }
  const s = await start(EXPRESSES['express 5'], options, (app, mw, call) => {
    app.post('/nobody/:status', mw, (req, res) => {
      call()
      res.statusCode = Number(req.params.status)
      res.end('not sent')
    })
    app.head('/nobody/:status', mw, (req, res) => {
      call()
      res.statusCode = 200
      res.end('not sent')
    })
  })
  try {
    for (const [method, status] of [['POST', 204], ['HEAD', 200]]) {
      const key = `order-nobody-${method}-${status}`
      const req = { method, path: `/nobody/${status}`, headers: { 'idempotency-key': key }, body: '' }
      assert.equal((await send(s.url, req)).status, status)
      const r = await store.execute(oncelyHttp.scope('default', method, '/nobody/:status', key), 'fp', () => {
        throw new Error('the first request was not stored')
      })
      assert.equal(oncelyHttp.decodeResponse(Buffer.from(r.value)).body.length, 0, `${method} ${status}`)
    }
  } finally {
    await s.close()
  }
})

test('a tenant function that gives no string, or an unusable one: 500 tenant-unusable, the handler not run', async () => {
  for (const tenant of [undefined, null, 42, '', 'x'.repeat(2000)]) {
    const s = await start(EXPRESSES['express 5'], { store: new IdempotencyStore(), tenant: () => tenant })
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

test('a stored value that is not a response record: 503 problem for express and fastify, the handler not run', async () => {
  const store = new IdempotencyStore()
  // Another program's value under the key a request scopes to.
  const fp = oncelyHttp.requestFingerprint('POST', '/orders', 'application/json', '{}')
  await store.execute(oncelyHttp.scope('default', 'POST', '/orders', 'order-alien'), fp, () => 'not a record')
  const e = await start(EXPRESSES['express 5'], { store })
  const fastify = require('fastify')()
  let fastifyCalls = 0
  await fastify.register(require('oncely/fastify').idempotency, { store })
  fastify.post('/orders', async () => {
    fastifyCalls++
    return {}
  })
  await fastify.listen({ port: 0, host: '127.0.0.1' })
  try {
    for (const url of [e.url, `http://127.0.0.1:${fastify.server.address().port}`]) {
      const r = await send(url, { method: 'POST', path: '/orders', headers: { 'idempotency-key': 'order-alien', 'content-type': 'application/json' }, body: '{}' })
      assert.equal(r.status, 503, url)
      assert.equal(JSON.parse(r.body.toString()).code, 'UNAVAILABLE')
    }
    assert.equal(e.calls(), 0)
    assert.equal(fastifyCalls, 0)
  } finally {
    await e.close()
    await fastify.close()
  }
})
