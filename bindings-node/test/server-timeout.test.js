'use strict'
// A server timeout (Node's server.setTimeout, Fastify's connectionTimeout) cuts a led
// request's connection while its handler still runs: the handler goes on, so its key
// stays held until it answers; a retry never runs it a second time, and a later one
// replays its answer.
const test = require('node:test')
const assert = require('node:assert/strict')
const nodeHttp = require('node:http')
const express = require('express')

const { IdempotencyStore } = require('oncely')
const { idempotency: forExpress } = require('oncely/express')
const { idempotency: forFastify } = require('oncely/fastify')
const FASTIFIES = { 'fastify 5': require('fastify'), 'fastify 4': require('fastify4') }

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

/** One POST /r: `{ status, headers, body }`, or `error CODE` when the connection is cut. */
function post(port, key) {
  return new Promise((resolve) => {
    const req = nodeHttp.request({ host: '127.0.0.1', port, method: 'POST', path: '/r', agent: false, headers: { 'idempotency-key': key, 'content-type': 'text/plain' } })
    req.on('response', (res) => {
      const got = []
      res.on('data', (d) => got.push(d))
      res.on('end', () => resolve({ status: res.statusCode, headers: res.headers, body: Buffer.concat(got).toString() }))
    })
    req.on('error', (e) => resolve(`error ${e.code}`))
    req.end('x')
  })
}

/** A handler that takes 400 ms (over the 100 ms timeout), counting its runs and overlaps. */
function slowHandler() {
  const c = { calls: 0, running: 0, overlaps: 0 }
  c.run = async () => {
    c.calls++
    c.running++
    if (c.running > 1) c.overlaps++
    await sleep(400)
    c.running--
    return `charged ${c.calls}`
  }
  return c
}

async function check(port, c) {
  const key = `order-${Date.now()}-timeout`
  const first = await post(port, key)
  assert.equal(first, 'error ECONNRESET', 'the server cut the first request')
  // Sent while the first handler still runs: it waits, and is cut in turn.
  await post(port, key)
  await sleep(500)
  const later = await post(port, key)
  assert.equal(c.calls, 1, 'the handler ran again for one key')
  assert.equal(c.overlaps, 0)
  assert.equal(later.status, 201, JSON.stringify(later))
  assert.equal(later.body, 'charged 1')
  assert.equal(later.headers['idempotent-replayed'], 'true')
}

test('express: a server timeout during the handler does not free its key', async () => {
  const c = slowHandler()
  const app = express()
  app.post('/r', express.text(), forExpress({ store: new IdempotencyStore() }), async (req, res) => {
    res.status(201).send(await c.run())
  })
  const server = await new Promise((r) => {
    const s = app.listen(0, '127.0.0.1', () => r(s))
  })
  server.setTimeout(100)
  try {
    await check(server.address().port, c)
  } finally {
    server.closeAllConnections()
    server.close()
  }
})

for (const [major, Fastify] of Object.entries(FASTIFIES)) {
  test(`${major}: a connectionTimeout during the handler does not free its key`, async () => {
    const c = slowHandler()
    const app = Fastify({ connectionTimeout: 100 })
    await app.register(forFastify, { store: new IdempotencyStore() })
    app.post('/r', async (req, reply) => reply.code(201).send(await c.run()))
    await app.listen({ port: 0, host: '127.0.0.1' })
    try {
      await check(app.server.address().port, c)
    } finally {
      await app.close()
    }
  })
}
