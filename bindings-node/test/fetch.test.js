'use strict'
// oncely/fetch against real servers on 127.0.0.1: one key kept across retries, the
// retry rules of `retry`, and with oncely/express on the server one effect per call.
const test = require('node:test')
const assert = require('node:assert/strict')
const http = require('node:http')

const express = require('express')
const { IdempotencyStore, RetryPolicy } = require('oncely')
const { idempotency } = require('oncely/express')
const { idempotentFetch } = require('oncely/fetch')

const fast = new RetryPolicy({ maxAttempts: 4, baseDelayMs: 1, maxDelayMs: 5 })

function listen(server) {
  return new Promise((resolve) => server.listen(0, '127.0.0.1', () => resolve(`http://127.0.0.1:${server.address().port}`)))
}
const close = (server) => new Promise((r) => server.close(r))

test('a connection dropped after the handler ran: the retry is replayed, one effect', async () => {
  const app = express()
  app.set('env', 'test')
  let effects = 0
  app.post('/orders', idempotency({ store: new IdempotencyStore() }), express.json(), (req, res) => {
    effects++
    res.status(201).json({ id: effects, sku: req.body.sku })
  })
  const upstream = http.createServer(app)
  const upstreamUrl = await listen(upstream)
  // A proxy that forwards each request, reads the whole answer, and drops the client's
  // connection instead of answering the first time (as a failing load balancer does).
  let dropped = 0
  const proxy = http.createServer(async (req, res) => {
    const chunks = []
    for await (const c of req) chunks.push(c)
    const up = await fetch(upstreamUrl + req.url, { method: req.method, headers: req.headers, body: Buffer.concat(chunks) })
    const body = Buffer.from(await up.arrayBuffer())
    if (dropped++ === 0) return req.socket.destroy()
    const headers = Object.fromEntries(up.headers)
    delete headers['content-length']
    delete headers['transfer-encoding']
    res.writeHead(up.status, headers).end(body)
  })
  const url = await listen(proxy)
  try {
    const retries = []
    const res = await idempotentFetch(
      `${url}/orders`,
      { method: 'POST', headers: { 'content-type': 'application/json' }, body: '{"sku":"A1"}' },
      { policy: fast, onRetry: (e) => retries.push(e.code) },
    )
    assert.equal(res.status, 201)
    assert.equal(res.headers.get('idempotent-replayed'), 'true')
    assert.deepEqual(await res.json(), { id: 1, sku: 'A1' })
    assert.equal(effects, 1)
    assert.equal(retries.length, 1)
  } finally {
    proxy.closeAllConnections()
    await close(proxy)
    upstream.closeAllConnections()
    await close(upstream)
  }
})

test('one key on every attempt; a 503 with Retry-After is retried after it; a 400 is returned', async () => {
  const keys = []
  const server = http.createServer((req, res) => {
    keys.push(req.headers['idempotency-key'])
    if (req.url === '/bad') return res.writeHead(400).end('bad')
    if (keys.length === 1) return res.writeHead(503, { 'retry-after': '1' }).end()
    res.writeHead(201).end('ok')
  })
  const url = await listen(server)
  try {
    const delays = []
    const res = await idempotentFetch(`${url}/x`, { method: 'POST', body: 'a' }, { policy: fast, onRetry: (e) => delays.push(e.delayMs) })
    assert.equal(res.status, 201)
    assert.equal(await res.text(), 'ok')
    assert.equal(keys.length, 2)
    assert.equal(keys[0], keys[1])
    assert.match(keys[0], /^[A-Za-z0-9_-]{8,64}$/)
    assert.deepEqual(delays, [1000])

    keys.length = 0
    const bad = await idempotentFetch(`${url}/bad`, { method: 'POST', headers: { 'Idempotency-Key': 'order-0400' } }, { policy: fast })
    assert.equal(bad.status, 400)
    assert.deepEqual(keys, ['order-0400'])
  } finally {
    server.closeAllConnections()
    await close(server)
  }
})

test('a 5xx on every attempt: the last answer once the attempts are spent', async () => {
  let n = 0
  const server = http.createServer((req, res) => {
    n++
    res.writeHead(500).end(`attempt ${n}`)
  })
  const url = await listen(server)
  try {
    const res = await idempotentFetch(url, { method: 'POST', body: 'x' }, { policy: fast, transientInternal: true })
    assert.equal(res.status, 500)
    assert.equal(await res.text(), 'attempt 4')
    assert.equal(n, 4)
  } finally {
    server.closeAllConnections()
    await close(server)
  }
})

test('an abort ends the call during a wait; a stream body is refused', async () => {
  const server = http.createServer((req, res) => res.writeHead(503, { 'retry-after': '30' }).end())
  const url = await listen(server)
  try {
    const c = new AbortController()
    const p = idempotentFetch(url, { method: 'POST', body: 'x', signal: c.signal }, { policy: fast })
    setTimeout(() => c.abort(new Error('stop')), 50)
    await assert.rejects(p, /stop/)
    await assert.rejects(
      idempotentFetch(url, { method: 'POST', body: new ReadableStream(), duplex: 'half' }),
      TypeError,
    )
    await assert.rejects(idempotentFetch(url, { method: 'POST', headers: { 'idempotency-key': 'bad key!' } }), { code: 'INVALID_ARGUMENT' })
  } finally {
    server.closeAllConnections()
    await close(server)
  }
})

test('a Request as input: its headers and its body go with every attempt, under one key', async () => {
  const seen = []
  const server = http.createServer(async (req, res) => {
    const chunks = []
    for await (const c of req) chunks.push(c)
    seen.push({ key: req.headers['idempotency-key'], auth: req.headers['x-auth'], type: req.headers['content-type'], body: Buffer.concat(chunks).toString() })
    res.writeHead(seen.length === 1 ? 503 : 201).end()
  })
  const url = await listen(server)
  try {
    const request = new Request(`${url}/orders`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', 'x-auth': 'token-1' },
      body: '{"sku":"A1"}',
    })
    const res = await idempotentFetch(request, {}, { policy: fast })
    assert.equal(res.status, 201)
    assert.equal(seen.length, 2)
    for (const s of seen) {
      assert.deepEqual({ ...s, key: undefined }, { key: undefined, auth: 'token-1', type: 'application/json', body: '{"sku":"A1"}' })
      assert.equal(s.key, seen[0].key)
    }
    assert.ok(seen[0].key)
    const used = new Request(`${url}/orders`, { method: 'POST', body: 'x' })
    await used.text()
    await assert.rejects(idempotentFetch(used, {}, { policy: fast }), TypeError)
  } finally {
    await close(server)
  }
})

test('409 in progress (with Retry-After) is retried under the same key; a 409 without it is final', async () => {
  const seen = []
  let conflict = 'in-progress'
  const server = http.createServer(async (req, res) => {
    for await (const _ of req);
    seen.push(req.headers['idempotency-key'])
    if (seen.length === 1 || conflict === 'final') {
      const headers = { 'content-type': 'application/problem+json' }
      if (conflict === 'in-progress') headers['retry-after'] = '0'
      return res.writeHead(409, headers).end('{}')
    }
    res.writeHead(201).end('done')
  })
  const url = await listen(server)
  try {
    const res = await idempotentFetch(`${url}/orders`, { method: 'POST', body: 'x' }, { policy: fast })
    assert.equal(res.status, 201)
    assert.equal(await res.text(), 'done')
    assert.equal(seen.length, 2)
    assert.equal(seen[0], seen[1])
    conflict = 'final'
    seen.length = 0
    const final = await idempotentFetch(`${url}/orders`, { method: 'POST', body: 'x' }, { policy: fast })
    assert.equal(final.status, 409)
    assert.equal(seen.length, 1)
  } finally {
    await close(server)
  }
})

test('every signal given ends the call: a Request\'s own, init.signal beside options.signal, during a wait too', async () => {
  const seen = []
  const server = http.createServer((req, res) => {
    seen.push(req.headers['idempotency-key'])
    req.resume()
    res.writeHead(503, { 'retry-after': '3' }).end()
  })
  const url = await listen(server)
  try {
    // Already aborted: nothing is sent.
    await assert.rejects(idempotentFetch(new Request(url, { method: 'POST', body: 'x', signal: AbortSignal.abort() }), {}, { deadline: 5000 }), {
      name: 'AbortError',
    })
    await assert.rejects(
      idempotentFetch(url, { method: 'POST', body: 'x', signal: AbortSignal.abort() }, { signal: new AbortController().signal }),
      { name: 'AbortError' },
    )
    assert.equal(seen.length, 0)
    // Aborted while waiting the 3 s the server asked for: the call ends at once.
    for (const make of [
      (signal) => idempotentFetch(new Request(url, { method: 'POST', body: 'x', signal })),
      (signal) => idempotentFetch(url, { method: 'POST', body: 'x', signal }, { signal: new AbortController().signal }),
    ]) {
      const controller = new AbortController()
      const started = Date.now()
      setTimeout(() => controller.abort(), 200)
      await assert.rejects(make(controller.signal), { name: 'AbortError' })
      assert.ok(Date.now() - started < 2000, `ended ${Date.now() - started} ms after it began`)
    }
  } finally {
    await close(server)
  }
})

test('a typed array or DataView body is sent again on a retry', async () => {
  const bodies = []
  const server = http.createServer(async (req, res) => {
    const chunks = []
    for await (const c of req) chunks.push(c)
    bodies.push(Buffer.concat(chunks).toString('hex'))
    res.writeHead(bodies.length === 1 ? 503 : 201).end()
  })
  const url = await listen(server)
  try {
    const bytes = new Uint8Array([1, 2, 3, 4])
    for (const body of [new DataView(bytes.buffer), new Int16Array(bytes.buffer), new Float32Array(bytes.buffer)]) {
      bodies.length = 0
      const res = await idempotentFetch(url, { method: 'POST', body }, { policy: fast })
      assert.equal(res.status, 201)
      assert.deepEqual(bodies, ['01020304', '01020304'])
    }
  } finally {
    await close(server)
  }
})

test('a Retry-After too long for the platform stops the call at its deadline with the last answer', async () => {
  let requests = 0
  const server = http.createServer((req, res) => {
    requests++
    req.resume()
    res.writeHead(503, { 'retry-after': '99999999999999999999' }).end()
  })
  const url = await listen(server)
  try {
    const res = await idempotentFetch(url, { method: 'POST', body: 'x' }, { deadline: 2000 })
    assert.equal(res.status, 503)
    assert.equal(requests, 1)
  } finally {
    await close(server)
  }
})
