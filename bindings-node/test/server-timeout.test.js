'use strict'
// A server timeout (Node's server.setTimeout, Fastify's connectionTimeout) cuts a led
// request's connection while its handler still runs: the handler goes on, so its key
// stays held until it answers; a retry never runs it a second time, and a later one
// replays its answer.
const test = require('node:test')
const assert = require('node:assert/strict')
const net = require('node:net')
const nodeHttp = require('node:http')
const express = require('express')

const { IdempotencyStore } = require('oncely')
const { idempotency: forExpress } = require('oncely/express')
const { idempotency: forFastify } = require('oncely/fastify')
const FASTIFIES = { 'fastify 5': require('fastify'), 'fastify 4': require('fastify4') }

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

/**
 * One POST /r: `{ status, headers, body }`, `error CODE` when the connection is cut, or
 * `no answer` after 3 s.
 */
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

/** What a client gets from a request the timeout cut: an error, or the timeout callback's 408. */
const cutAnswer = (got) => (typeof got === 'string' ? got : got.status)

async function check(port, c, cut = 'error ECONNRESET') {
  const key = `order-${Date.now()}-timeout`
  const first = await post(port, key)
  assert.equal(cutAnswer(first), cut, 'the server cut the first request')
  // Sent while the first handler still runs: it waits, and is cut in turn.
  assert.equal(cutAnswer(await post(port, key)), cut)
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

/**
 * Timeout callbacks of the app's own that cut the connection themselves, later than
 * Node would: what the client gets from each.
 */
const CUTS = {
  'a deferred destroy': [(socket) => setImmediate(() => socket.destroy()), 'error ECONNRESET'],
  'a 408 written on the socket': [(socket) => socket.end('HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n'), 408],
}

for (const [what, [onTimeout, cut]] of Object.entries(CUTS)) {
  test(`express: a timeout callback that cuts the connection itself (${what}) does not free the key`, async () => {
    const c = slowHandler()
    const app = express()
    app.post('/r', express.text(), forExpress({ store: new IdempotencyStore() }), async (req, res) => {
      res.status(201).send(await c.run())
    })
    const server = await new Promise((r) => {
      const s = app.listen(0, '127.0.0.1', () => r(s))
    })
    server.setTimeout(100, onTimeout)
    try {
      await check(server.address().port, c, cut)
    } finally {
      server.closeAllConnections()
      server.close()
    }
  })

  for (const [major, Fastify] of Object.entries(FASTIFIES)) {
    test(`${major}: a timeout callback that cuts the connection itself (${what}) does not free the key`, async () => {
      const c = slowHandler()
      const app = Fastify({ connectionTimeout: 100 })
      await app.register(forFastify, { store: new IdempotencyStore() })
      app.post('/r', async (req, reply) => reply.code(201).send(await c.run()))
      await app.listen({ port: 0, host: '127.0.0.1' })
      app.server.on('timeout', onTimeout)
      try {
        await check(app.server.address().port, c, cut)
      } finally {
        app.server.closeAllConnections()
        await app.close()
      }
    })
  }
}

/** Writes `count` covered requests at once on one connection (pipelined) and reads for `ms`. */
function pipelined(port, count, ms) {
  const one = (i) => `POST /r HTTP/1.1\r\nHost: x\r\nIdempotency-Key: order-pipe-${i}-${Date.now()}\r\nContent-Type: text/plain\r\nContent-Length: 1\r\n\r\nx`
  return new Promise((resolve) => {
    const socket = net.connect(port, '127.0.0.1', () => socket.write(Array.from({ length: count }, (_, i) => one(i)).join('')))
    let got = ''
    socket.on('data', (d) => {
      got += d
    })
    socket.on('error', () => {})
    setTimeout(() => {
      socket.destroy()
      resolve(got)
    }, ms)
  })
}

test('express: a timeout the server keeps is no cut: a handler that then destroys the connection releases its key', async () => {
  let calls = 0
  const app = express()
  app.post('/r', forExpress({ store: new IdempotencyStore() }), (req, res) => {
    const n = ++calls
    if (n === 1) return setTimeout(() => res.destroy(), 300)
    res.status(201).send(`call ${n}`)
  })
  const server = await new Promise((r) => {
    const s = app.listen(0, '127.0.0.1', () => r(s))
  })
  server.setTimeout(100)
  server.on('timeout', () => {}) // kept: Node does not destroy the socket
  try {
    const port = server.address().port
    assert.equal(await post(port, 'order-kept-001'), 'error ECONNRESET')
    const again = await post(port, 'order-kept-001')
    assert.equal(again.status, 201, String(again))
    assert.equal(calls, 2)
  } finally {
    server.closeAllConnections()
    server.close()
  }
})

for (const [major, Fastify] of Object.entries(FASTIFIES)) {
  test(`${major}: a timeout the server keeps is no cut: a handler that then destroys the connection releases its key`, async () => {
    let calls = 0
    const app = Fastify({ connectionTimeout: 100 })
    await app.register(forFastify, { store: new IdempotencyStore() })
    app.post('/r', async (req, reply) => {
      const n = ++calls
      if (n === 1) {
        await sleep(300)
        reply.raw.destroy()
        return reply
      }
      return reply.code(201).send(`call ${n}`)
    })
    await app.listen({ port: 0, host: '127.0.0.1' })
    app.server.on('timeout', () => {})
    try {
      const port = app.server.address().port
      assert.equal(await post(port, 'order-kept-002'), 'error ECONNRESET')
      const again = await post(port, 'order-kept-002')
      assert.equal(again.status, 201, String(again))
      assert.equal(again.headers['idempotent-replayed'], undefined)
      assert.equal(calls, 2)
    } finally {
      app.server.closeAllConnections()
      await app.close()
    }
  })
}

test('pipelined requests on one connection add one timeout listener to it, not one each', async () => {
  const most = { express: 0, fastify: 0 }
  const app = express()
  app.post('/r', forExpress({ store: new IdempotencyStore() }), async (req, res) => {
    await sleep(20)
    most.express = Math.max(most.express, req.socket.listenerCount('timeout'))
    res.status(201).send('ok')
  })
  const server = await new Promise((r) => {
    const s = app.listen(0, '127.0.0.1', () => r(s))
  })
  server.setTimeout(5_000)
  const fastify = FASTIFIES['fastify 5']({ connectionTimeout: 5_000 })
  await fastify.register(forFastify, { store: new IdempotencyStore() })
  fastify.post('/r', async (req, reply) => {
    await sleep(20)
    most.fastify = Math.max(most.fastify, req.raw.socket.listenerCount('timeout'))
    return reply.code(201).send('ok')
  })
  await fastify.listen({ port: 0, host: '127.0.0.1' })
  try {
    const a = await pipelined(server.address().port, 12, 1_000)
    const b = await pipelined(fastify.server.address().port, 12, 1_000)
    assert.equal(a.match(/HTTP\/1.1 201/g)?.length, 12)
    assert.equal(b.match(/HTTP\/1.1 201/g)?.length, 12)
    // Node's own listener and the adapters' one.
    assert.deepEqual(most, { express: 2, fastify: 2 })
  } finally {
    server.closeAllConnections()
    server.close()
    await fastify.close()
  }
})
