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
const { post } = require('./raw-post.js')

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

/** Listens on 127.0.0.1, runs `run(server)`, then closes the server and its connections. */
async function serveExpress(app, run) {
  const server = await new Promise((r) => {
    const s = app.listen(0, '127.0.0.1', () => r(s))
  })
  try {
    await run(server)
  } finally {
    server.closeAllConnections()
    server.close()
  }
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
  await serveExpress(app, async (server) => {
    server.setTimeout(100)
    await check(server.address().port, c)
  })
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
    await serveExpress(app, async (server) => {
      server.setTimeout(100, onTimeout)
      await check(server.address().port, c, cut)
    })
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

test('express: a server timeout after the answer began, then a handler that fails: the key is released once it failed', async () => {
  let calls = 0
  const app = express()
  app.post('/r', forExpress({ store: new IdempotencyStore() }), async (req, res, next) => {
    const n = ++calls
    res.status(200).type('text/plain')
    res.write(`part-1 of call ${n}\n`)
    if (n === 1) {
      await sleep(300)
      return next(new Error('failed after the timeout'))
    }
    res.end('done\n')
  })
  await serveExpress(app, async (server) => {
    server.setTimeout(100)
    const port = server.address().port
    const first = await post(port, 'order-tofail01')
    assert.equal(first, 'error ECONNRESET after "part-1 of call 1\\n"')
    // Sent while the first handler still runs: it waits, and is cut in turn.
    assert.equal(await post(port, 'order-tofail01'), 'error ECONNRESET')
    assert.equal(calls, 1)
    await sleep(400)
    // The first handler has failed: the key is free, and a retry runs the handler.
    const retry = await post(port, 'order-tofail01')
    assert.equal(retry.body, 'part-1 of call 2\ndone\n', String(retry))
    assert.equal(calls, 2)
  })
})

/** The same, for a timeout of the led response alone: the retry waits, and replays. */
async function checkResponseTimeout(port, c) {
  const key = `order-${Date.now()}-restimeout`
  assert.equal(await post(port, key), 'error ECONNRESET', 'the timeout cut the first request')
  const retry = await post(port, key)
  assert.deepEqual([retry.status, retry.body, retry.headers['idempotent-replayed']], [201, 'charged 1', 'true'], String(retry))
  assert.equal(c.calls, 1, 'the handler ran again for one key')
  assert.equal(c.overlaps, 0)
}

test('express: a response timeout that cuts with res.destroy() does not free a running handler\'s key', async () => {
  const c = slowHandler()
  const app = express()
  app.post('/r', express.text(), forExpress({ store: new IdempotencyStore() }), async (req, res) => {
    res.setTimeout(100, () => res.destroy())
    res.status(201).send(await c.run())
  })
  await serveExpress(app, async (server) => {
    await checkResponseTimeout(server.address().port, c)
  })
})

for (const [major, Fastify] of Object.entries(FASTIFIES)) {
  test(`${major}: a response timeout that cuts with reply.raw.destroy() does not free a running handler's key`, async () => {
    const c = slowHandler()
    const app = Fastify()
    await app.register(forFastify, { store: new IdempotencyStore() })
    app.post('/r', async (req, reply) => {
      reply.raw.setTimeout(100, () => reply.raw.destroy())
      return reply.code(201).send(await c.run())
    })
    await app.listen({ port: 0, host: '127.0.0.1' })
    try {
      await checkResponseTimeout(app.server.address().port, c)
    } finally {
      await app.close()
    }
  })
}

/** A handler failing after its answer began (Express then destroys the socket), behind a kept timeout. */
async function keptTimeoutApp(handler) {
  const app = express()
  app.post('/r', forExpress({ store: new IdempotencyStore() }), handler)
  const server = await new Promise((r) => {
    const s = app.listen(0, '127.0.0.1', () => r(s))
  })
  server.setTimeout(100, () => {}) // kept: the app only notes a slow request
  return server
}

test('express: a kept timeout, then a handler failing after its answer began: the key is released', async () => {
  let calls = 0
  const server = await keptTimeoutApp(async (req, res, next) => {
    const n = ++calls
    if (n === 1) {
      res.writeHead(200, { 'content-type': 'text/plain' })
      res.write('working...')
      await sleep(200)
      return next(new Error('upstream failed'))
    }
    res.status(201).send(`call ${n}`)
  })
  try {
    const port = server.address().port
    assert.match(String(await post(port, 'order-kept-fail1')), /^error /)
    const retry = await post(port, 'order-kept-fail1')
    assert.deepEqual([retry.status, retry.body], [201, 'call 2'], String(retry))
  } finally {
    server.closeAllConnections()
    server.close()
  }
})

test('express: keep-alive: a timeout kept during an earlier request does not count for a later one', async () => {
  let calls = 0
  const server = await keptTimeoutApp(async (req, res, next) => {
    const n = ++calls
    if (req.headers['idempotency-key'] === 'order-early-0001') {
      await sleep(200) // the kept timeout fires on this connection
      return res.status(201).send('early done')
    }
    if (n === 2) {
      res.writeHead(200, { 'content-type': 'text/plain' })
      res.write('working...')
      await sleep(10)
      return next(new Error('upstream failed'))
    }
    res.status(201).send(`call ${n}`)
  })
  const agent = new nodeHttp.Agent({ keepAlive: true, maxSockets: 1 })
  try {
    const port = server.address().port
    const early = await post(port, 'order-early-0001', agent)
    assert.equal(early.body, 'early done')
    assert.match(String(await post(port, 'order-later-0001', agent)), /^error /)
    const retry = await post(port, 'order-later-0001')
    assert.deepEqual([retry.status, retry.body], [201, 'call 3'], String(retry))
  } finally {
    agent.destroy()
    server.closeAllConnections()
    server.close()
  }
})

for (const [major, Fastify] of Object.entries(FASTIFIES)) {
  test(`${major}: a kept timeout, then a handler that destroys the socket and returns: the key is released, no empty answer stored`, async () => {
    let calls = 0
    const app = Fastify()
    await app.register(forFastify, { store: new IdempotencyStore() })
    app.post('/r', async (request, reply) => {
      const n = ++calls
      if (n === 1) {
        await sleep(250) // the kept timeout fires meanwhile
        request.raw.socket.destroy()
        return
      }
      return reply.code(201).send(`call ${n}`)
    })
    await app.listen({ port: 0, host: '127.0.0.1' })
    app.server.setTimeout(100, () => {}) // kept: the app only notes a slow request
    try {
      const port = app.server.address().port
      assert.match(String(await post(port, 'order-kept-cut1')), /^error /)
      const retry = await post(port, 'order-kept-cut1')
      assert.deepEqual([retry.status, retry.body, retry.headers['idempotent-replayed']], [201, 'call 2', undefined], String(retry))
    } finally {
      await app.close()
    }
  })
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
  await serveExpress(app, async (server) => {
    server.setTimeout(100)
    server.on('timeout', () => {}) // kept: Node does not destroy the socket
    const port = server.address().port
    assert.equal(await post(port, 'order-kept-001'), 'error ECONNRESET')
    const again = await post(port, 'order-kept-001')
    assert.equal(again.status, 201, String(again))
    assert.equal(calls, 2)
  })
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

test('pipelined requests on one connection add the timeout listeners to it once, not once each', async () => {
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
    // Node's own listener and the adapters' two (before and after it).
    assert.deepEqual(most, { express: 3, fastify: 3 })
  } finally {
    server.closeAllConnections()
    server.close()
    await fastify.close()
  }
})
