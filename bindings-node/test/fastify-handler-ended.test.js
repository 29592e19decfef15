'use strict'
// Fastify sends nothing for a led handler whose client has gone when the handler
// resolves with nothing (or hijacks its reply): the key must not wait for an answer
// that never comes, and a send that is on its way must not be taken for none.
const test = require('node:test')
const assert = require('node:assert/strict')
const nodeHttp = require('node:http')

const { IdempotencyStore } = require('oncely')
const { idempotency } = require('oncely/fastify')
const FASTIFIES = { 'fastify 5': require('fastify'), 'fastify 4': require('fastify4') }

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

/** One POST /r: `{ status, headers, body }`, or `no answer` after 3 s. */
function post(port, key) {
  return new Promise((resolve) => {
    const req = nodeHttp.request({ host: '127.0.0.1', port, method: 'POST', path: '/r', agent: false, headers: { 'idempotency-key': key, 'content-type': 'text/plain' } })
    const timer = setTimeout(() => {
      resolve('no answer')
      req.destroy()
    }, 3_000)
    req.on('close', () => clearTimeout(timer))
    req.on('response', (res) => {
      const got = []
      res.on('data', (d) => got.push(d))
      res.on('end', () => resolve({ status: res.statusCode, headers: res.headers, body: Buffer.concat(got).toString() }))
    })
    req.on('error', (e) => resolve(`error ${e.code}`))
    req.end('x')
  })
}

/** A POST /r whose client goes away after 50 ms, before the answer. */
function postAndLeave(port, key) {
  return new Promise((resolve) => {
    const req = nodeHttp.request({ host: '127.0.0.1', port, method: 'POST', path: '/r', agent: false, headers: { 'idempotency-key': key, 'content-type': 'text/plain' } })
    req.on('error', () => {})
    req.on('close', resolve)
    req.end('x')
    setTimeout(() => req.destroy(), 50)
  })
}

async function serve(Fastify, route, before) {
  const app = Fastify()
  if (before) before(app)
  await app.register(idempotency, { store: new IdempotencyStore() })
  app.post('/r', route)
  await app.listen({ port: 0, host: '127.0.0.1' })
  return app
}

for (const [major, Fastify] of Object.entries(FASTIFIES)) {
  test(`${major}: a client gone, then a handler resolving with nothing: its empty answer is kept and replayed`, async () => {
    let calls = 0
    const app = await serve(Fastify, async (req, reply) => {
      calls++
      await sleep(250)
      reply.code(201).header('location', '/orders/1')
    })
    try {
      const port = app.server.address().port
      await postAndLeave(port, 'order-ended-001')
      // Sent while the first handler runs: it waits for the first answer.
      const retry = await post(port, 'order-ended-001')
      assert.notEqual(retry, 'no answer', 'the retry waited for good')
      assert.equal(retry.status, 201)
      assert.equal(retry.body, '')
      assert.equal(retry.headers.location, '/orders/1')
      assert.equal(retry.headers['idempotent-replayed'], 'true')
      assert.equal(calls, 1)
    } finally {
      await app.close()
    }
  })

  test(`${major}: a client gone, then a hijacked reply: the key is released once the handler has ended`, async () => {
    let calls = 0
    const app = await serve(Fastify, async (req, reply) => {
      const n = ++calls
      await sleep(250)
      reply.hijack()
      reply.raw.writeHead(200, { 'content-type': 'text/plain' })
      reply.raw.end(`raw ${n}`)
    })
    try {
      const port = app.server.address().port
      await postAndLeave(port, 'order-ended-002')
      const retry = await post(port, 'order-ended-002')
      assert.notEqual(retry, 'no answer', 'the retry waited for good')
      assert.equal(retry.body, 'raw 2')
      assert.equal(calls, 2)
    } finally {
      await app.close()
    }
  })

  // Fastify 5 only: Fastify 4 itself fails (ERR_HTTP_HEADERS_SENT, thrown from its
  // onSendEnd) when the client leaves while an answer waits in an onSend hook, with or
  // without this plugin.
  test(`${major}: a client gone while the handler's send is held up in an onSend hook: the send is kept, not taken for none`, { skip: major === 'fastify 4' }, async () => {
    let calls = 0
    const app = await serve(
      Fastify,
      async (req, reply) => {
        const n = ++calls
        await sleep(100)
        // The handler resolves while its answer is still in the hooks.
        return reply.code(201).send(`charged ${n}`)
      },
      (app) =>
        app.addHook('onSend', async (req, reply, payload) => {
          await sleep(200)
          return payload
        }),
    )
    try {
      const port = app.server.address().port
      await postAndLeave(port, 'order-ended-003')
      const retry = await post(port, 'order-ended-003')
      assert.equal(retry.status, 201, String(retry))
      assert.equal(retry.body, 'charged 1')
      assert.equal(retry.headers['idempotent-replayed'], 'true')
      assert.equal(calls, 1)
    } finally {
      await app.close()
    }
  })

  test(`${major}: routes registered before the plugin keep working (their handler is not watched)`, async () => {
    const app = Fastify()
    app.post('/early', async (req, reply) => reply.code(201).send('early'))
    await app.register(idempotency, { store: new IdempotencyStore() })
    await app.listen({ port: 0, host: '127.0.0.1' })
    try {
      const url = `http://127.0.0.1:${app.server.address().port}/early`
      const init = { method: 'POST', headers: { 'idempotency-key': 'order-early-001' }, body: 'x' }
      const a = await fetch(url, init)
      const b = await fetch(url, init)
      assert.deepEqual([a.status, await a.text(), b.status, await b.text()], [201, 'early', 201, 'early'])
      assert.equal(b.headers.get('idempotent-replayed'), 'true')
    } finally {
      await app.close()
    }
  })
}
