'use strict'
// oncely/fastify records the stored headers in onSend, before Node has checked them
// (Fastify's reply.header does not; Node does in writeHead). A header value holding a
// newline must be stored as it is, never split into other headers: no header the handler
// never set is replayed, and the key is not released by it (the handler runs once).
const test = require('node:test')
const assert = require('node:assert/strict')
const { IdempotencyStore } = require('oncely')
const { idempotency, within, listen, post } = require('./fastify-helpers.js')
const Fastify = require('fastify')

test('fastify: a stored header value with a newline does not forge another stored header', async () => {
  const app = Fastify()
  await app.register(idempotency, { store: new IdempotencyStore() })
  let calls = 0
  app.post('/items', async (req, reply) => {
    calls++
    // e.g. a Location built from request data
    reply.code(201).header('location', `/items/${req.body.name}`)
    return { n: calls }
  })
  const url = await listen(app)
  try {
    const body = JSON.stringify({ name: 'a\netag\n"forged"' })
    const first = await within(post(url, '/items', 'review-newline-1', body), 3000)
    const retry = await within(post(url, '/items', 'review-newline-1', body), 3000)
    assert.notEqual(first, 'hang')
    assert.notEqual(retry, 'hang')
    // Node refused to send the first answer (ERR_INVALID_CHAR): a 500 went out.
    assert.equal(first.status, 500)
    // The retry must not get an answer with a header the handler never set.
    assert.equal(retry.headers.get('etag'), null, `replayed ${retry.status} with etag ${retry.headers.get('etag')}`)
    assert.equal(retry.status, first.status, 'the retry got an answer that was never sent')
  } finally {
    await app.close()
  }
})

test('fastify: a stored header value with one newline does not release the key (the handler runs once per key)', async () => {
  const app = Fastify()
  await app.register(idempotency, { store: new IdempotencyStore() })
  let calls = 0
  app.post('/charge', async (req, reply) => {
    calls++
    reply.code(201).header('etag', `"${req.body.tag}"`)
    return { charged: calls }
  })
  const url = await listen(app)
  try {
    const body = JSON.stringify({ tag: 'v1\nx' })
    const first = await within(post(url, '/charge', 'review-newline-2', body), 3000)
    const retry = await within(post(url, '/charge', 'review-newline-2', body), 3000)
    assert.notEqual(first, 'hang')
    assert.notEqual(retry, 'hang')
    assert.equal(calls, 1, 'the handler ran again for the same key')
  } finally {
    await app.close()
  }
})
