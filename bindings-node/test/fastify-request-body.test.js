'use strict'
// oncely/fastify reads a covered request's body itself (for the fingerprint) and hands
// the bytes on: what Fastify checks about that body must come out as without the plugin.
const test = require('node:test')
const assert = require('node:assert/strict')
const nodeHttp = require('node:http')
const zlib = require('node:zlib')

const FASTIFIES = { 'fastify 5': require('fastify'), 'fastify 4': require('fastify4') }
const { IdempotencyStore } = require('oncely')
const { idempotency } = require('oncely/fastify')

/** One POST /r with `chunks` written: `{ status, body }`, or `error CODE`. */
function post(url, headers, chunks) {
  const { port } = new URL(url)
  return new Promise((resolve) => {
    const req = nodeHttp.request({ host: '127.0.0.1', port, method: 'POST', path: '/r', headers })
    const timer = setTimeout(() => {
      req.destroy()
      resolve('no answer')
    }, 5_000)
    req.on('response', (res) => {
      const got = []
      res.on('data', (d) => got.push(d))
      res.on('end', () => {
        clearTimeout(timer)
        resolve({ status: res.statusCode, headers: res.headers, body: Buffer.concat(got).toString() })
      })
    })
    req.on('error', (e) => {
      clearTimeout(timer)
      resolve(`error ${e.code}`)
    })
    for (const c of chunks) req.write(c)
    req.end()
  })
}

async function listen(app) {
  await app.listen({ port: 0, host: '127.0.0.1' })
  return `http://127.0.0.1:${app.server.address().port}`
}

for (const [major, Fastify] of Object.entries(FASTIFIES)) {
  test(`${major}: a body decoded by a preParsing hook before the plugin passes Fastify's length check`, async () => {
    const app = Fastify()
    // Fastify's documented pattern: the decoded stream carries the length received.
    app.addHook('preParsing', async (req, reply, payload) => {
      if (req.headers['content-encoding'] !== 'gzip') return payload
      const out = payload.pipe(zlib.createGunzip())
      out.receivedEncodedLength = Number(req.headers['content-length'])
      return out
    })
    await app.register(idempotency, { store: new IdempotencyStore() })
    let calls = 0
    app.post('/r', async (req) => ({ n: ++calls, len: req.body.a.length }))
    const url = await listen(app)
    try {
      const body = zlib.gzipSync(JSON.stringify({ a: 'x'.repeat(5000) }))
      const headers = { 'idempotency-key': 'order-gzip0001', 'content-type': 'application/json', 'content-encoding': 'gzip', 'content-length': body.length }
      const first = await post(url, headers, [body])
      assert.equal(first.status, 200, first.body)
      assert.deepEqual(JSON.parse(first.body), { n: 1, len: 5000 })
      const again = await post(url, headers, [body])
      assert.equal(again.headers['idempotent-replayed'], 'true')
      assert.equal(again.body, first.body)
      assert.equal(calls, 1)
    } finally {
      await app.close()
    }
  })

  test(`${major}: a chunked body over the request cap gets its 413 (the connection is not cut first)`, async () => {
    const app = Fastify()
    await app.register(idempotency, { store: new IdempotencyStore(), requestCap: 100 })
    let calls = 0
    app.post('/r', async () => ({ n: ++calls }))
    const url = await listen(app)
    try {
      const headers = { 'idempotency-key': 'order-big00001', 'content-type': 'text/plain', 'transfer-encoding': 'chunked' }
      const r = await post(url, headers, ['x'.repeat(60), 'x'.repeat(60), 'x'.repeat(1000)])
      assert.equal(typeof r, 'object', String(r))
      assert.equal(r.status, 413, r.body)
      assert.equal(r.headers.connection, 'close')
      assert.equal(calls, 0)
      // The key was not taken: a request under the cap runs.
      const ok = await post(url, { ...headers }, ['x'.repeat(50)])
      assert.equal(ok.status, 200, ok.body)
      assert.equal(calls, 1)
    } finally {
      await app.close()
    }
  })
}

for (const [major, Fastify] of Object.entries(FASTIFIES)) {
  test(`${major}: a body parser that changes its chunk in place does not change the fingerprint`, async () => {
    const app = Fastify()
    await app.register(idempotency, { store: new IdempotencyStore() })
    // Reads the stream and upper-cases the bytes where they are.
    app.addContentTypeParser('text/x-shout', (req, payload, done) => {
      const got = []
      payload.on('data', (c) => got.push(c))
      payload.on('end', () => {
        for (const c of got) for (let i = 0; i < c.length; i++) if (c[i] >= 97 && c[i] <= 122) c[i] -= 32
        done(null, Buffer.concat(got).toString())
      })
    })
    let calls = 0
    app.post('/r', async (req, reply) => reply.code(201).send(`${++calls} ${req.body}`))
    const url = await listen(app)
    try {
      const headers = { 'idempotency-key': 'order-shout001', 'content-type': 'text/x-shout' }
      const first = await post(url, headers, ['hello'])
      assert.deepEqual([first.status, first.body], [201, '1 HELLO'])
      // The same key with the body the parser made of the first: another request.
      const other = await post(url, headers, ['HELLO'])
      assert.equal(other.status, 422, JSON.stringify(other))
      const again = await post(url, headers, ['hello'])
      assert.deepEqual([again.status, again.body, again.headers['idempotent-replayed']], [201, '1 HELLO', 'true'])
      assert.equal(calls, 1)
    } finally {
      await app.close()
    }
  })
}
