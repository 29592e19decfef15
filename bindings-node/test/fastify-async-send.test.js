'use strict'
// An async handler that calls reply.send and does not return the reply: Fastify sends
// again when its promise settles and `reply.sent` is still false, which it is while
// oncely's onSend waits for the store. The answer goes out once, as settled, is stored
// and replayed, on Fastify 5 and 4, with no ERR_HTTP_HEADERS_SENT and no unhandled
// rejection.
const test = require('node:test')
const assert = require('node:assert/strict')
const { Writable } = require('node:stream')
const { IdempotencyStore } = require('oncely')
const { FASTIFIES, idempotency, within, listen, post } = require('./fastify-helpers.js')

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

const rejections = []
process.on('unhandledRejection', (e) => rejections.push(e))

/** A pino destination keeping the lines at warn level (40) and above. */
function logSink() {
  const lines = []
  const stream = new Writable({
    write(chunk, _enc, cb) {
      for (const line of chunk.toString().split('\n')) {
        if (!line) continue
        const o = JSON.parse(line)
        if (o.level >= 40) lines.push(o.err?.code ?? o.msg)
      }
      cb()
    },
  })
  return { lines, stream }
}

const STORES = {
  'in-process store': () => new IdempotencyStore(),
  // A store that answers 20 ms late, as one over a network does.
  'slow store': () => {
    const inner = new IdempotencyStore()
    return {
      async execute(...args) {
        try {
          return await inner.execute(...args)
        } finally {
          await sleep(20)
        }
      },
    }
  },
}

// name → { h: handler(calls) factory, status, text, logged: the warn/error lines expected (unchecked when absent) }
const CASES = {
  'reply.send at once': {
    h: (n) => async (req, reply) => {
      n()
      reply.code(201).header('x-a', 'b').send({ ok: true, n: 1 })
    },
    status: 201,
    text: '{"ok":true,"n":1}',
    logged: [],
  },
  'reply.send after an await': {
    h: (n) => async (req, reply) => {
      n()
      await sleep(30)
      reply.code(201).header('x-a', 'b').send({ ok: true, n: 2 })
    },
    status: 201,
    text: '{"ok":true,"n":2}',
    logged: [],
  },
  'reply.send of a string after an await': {
    h: (n) => async (req, reply) => {
      n()
      await sleep(30)
      reply.type('text/plain').send('plain text')
    },
    status: 200,
    text: 'plain text',
    logged: [],
  },
  'reply.send, then a value returned': {
    h: (n) => async (req, reply) => {
      n()
      reply.code(201).send({ first: true })
      return { second: true }
    },
    status: 201,
    text: '{"first":true}',
  },
  // Fastify logs the error and keeps the answer sent; its error handler's status and
  // headers must not reach the leader's answer.
  'reply.send, then a throw': {
    h: (n) => async (req, reply) => {
      n()
      reply.code(201).type('text/plain').send('first')
      throw new Error('thrown after reply.send')
    },
    status: 201,
    text: 'first',
    logged: ['thrown after reply.send'],
  },
}

for (const [major, Fastify] of Object.entries(FASTIFIES)) {
  for (const [storeName, store] of Object.entries(STORES)) {
    for (const [name, c] of Object.entries(CASES)) {
      test(`${major}, ${storeName}: async handler, ${name}, no return: sent once, stored, replayed`, async () => {
        const before = rejections.length
        const log = logSink()
        const app = Fastify({ logger: { level: 'warn', stream: log.stream } })
        await app.register(idempotency, { store: store() })
        let calls = 0
        app.post('/r', c.h(() => ++calls))
        const url = await listen(app)
        try {
          const key = `async-send-${name.replace(/\W/g, '')}-${storeName[0]}${major.slice(-1)}`
          const a = post(url, '/r', key)
          await sleep(5)
          const b = post(url, '/r', key)
          const r = await within(Promise.all([a, b]), 4000)
          assert.notEqual(r, 'hang', 'a request hung')
          const [ra, rb] = r
          const rc = await within(post(url, '/r', key), 4000)
          assert.notEqual(rc, 'hang', 'the retry hung')
          // A second send, if any, happens by now.
          await sleep(50)

          assert.equal(calls, 1, 'the handler ran more than once')
          assert.equal(ra.status, c.status)
          assert.equal(ra.text, c.text)
          assert.equal(ra.headers.get('idempotent-replayed'), null)
          for (const x of [rb, rc]) {
            assert.equal(x.status, ra.status)
            assert.deepEqual(x.body, ra.body)
            assert.equal(x.headers.get('idempotent-replayed'), 'true')
            assert.equal(x.headers.get('content-type'), ra.headers.get('content-type'))
          }
          assert.deepEqual(rejections.slice(before), [], 'an unhandled rejection')
          assert.ok(!log.lines.some((l) => /ERR_HTTP_HEADERS_SENT|already sent/i.test(l)), `logged: ${log.lines}`)
          if (c.logged) assert.deepEqual(log.lines, c.logged)
        } finally {
          await app.close()
        }
      })
    }
  }

  test(`${major}: async handler calling reply.send without return, without a key: untouched`, async () => {
    const log = logSink()
    const app = Fastify({ logger: { level: 'warn', stream: log.stream } })
    await app.register(idempotency, { store: new IdempotencyStore(), required: false })
    app.post('/r', async (req, reply) => {
      await sleep(10)
      reply.send({ plain: true })
    })
    const url = await listen(app)
    try {
      const r = await fetch(`${url}/r`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: '{}' })
      assert.equal(r.status, 200)
      assert.deepEqual(await r.json(), { plain: true })
      await sleep(20)
      assert.deepEqual(log.lines, [])
    } finally {
      await app.close()
    }
  })
}
