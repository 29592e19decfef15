'use strict'
// oncely/fastify: a led response that closes after its answer was settled makes no
// Released (an Error: its stack trace was most of a first call's cost, profiled).
const test = require('node:test')
const assert = require('node:assert/strict')
const Fastify = require('fastify')
const { IdempotencyStore, newKey } = require('oncely')
const { idempotency } = require('oncely/fastify')
const { Released } = require('../adapter.js')
const { send } = require('./http-sequences.js')

/** Counts the Released made while `fn` runs (each sets its `owner` once). */
async function countReleased(fn) {
  let n = 0
  Object.defineProperty(Released.prototype, 'owner', {
    configurable: true,
    set(v) {
      n++
      Object.defineProperty(this, 'owner', { value: v, writable: true, enumerable: true, configurable: true })
    },
  })
  try {
    await fn()
  } finally {
    delete Released.prototype.owner
  }
  return n
}

test('first calls answered and stored make no Released; a streamed answer still does', async () => {
  const app = Fastify()
  await app.register(idempotency, { store: new IdempotencyStore() })
  let calls = 0
  app.post('/orders', async (req) => ({ n: ++calls, sku: req.body.sku }))
  app.post('/stream', async (req, reply) => {
    calls++
    reply.type('text/plain')
    return require('node:stream').Readable.from(['a', 'b'])
  })
  await app.listen({ port: 0, host: '127.0.0.1' })
  const url = `http://127.0.0.1:${app.server.address().port}`
  const post = (path, key) =>
    send(url, { method: 'POST', path, headers: { 'idempotency-key': key, 'content-type': 'application/json' }, body: '{"sku":"A1"}' })
  try {
    const keys = Array.from({ length: 20 }, () => `order-${newKey()}`)
    const made = await countReleased(async () => {
      for (const k of keys) assert.equal((await post('/orders', k)).status, 200)
      // The responses' 'close' comes after the answer: let it pass.
      await new Promise((r) => setTimeout(r, 50))
    })
    assert.equal(made, 0)
    assert.equal(calls, 20)
    const replay = await post('/orders', keys[0])
    assert.equal(replay.headers.get('idempotent-replayed'), 'true')
    assert.equal(calls, 20)
    // The counter sees a Released when one is made: a streamed body releases its key.
    const streamed = await countReleased(async () => {
      assert.equal((await post('/stream', `order-${newKey()}`)).body.toString(), 'ab')
      await new Promise((r) => setTimeout(r, 50))
    })
    assert.ok(streamed >= 1, `streamed: ${streamed}`)
  } finally {
    await app.close()
  }
})
