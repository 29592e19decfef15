'use strict'
// A response prototype (app.response) patched after the first covered request: the
// answer is still captured above the patch, as the handler wrote it. Below it, a
// body-transforming wrapper would be stored transformed and replayed transformed again;
// a wrapper that calls Node's own `end` would bypass the capture, release the key and
// let the retry run the handler again.
const test = require('node:test')
const assert = require('node:assert/strict')
const http = require('node:http')
const express = require('express')
const { IdempotencyStore } = require('oncely')
const { idempotency } = require('oncely/express')
const { serve, post } = require('./express-helpers.js')

/** Swaps the case of ASCII letters (same length, so Content-Length still holds). */
function swapCase(b) {
  const out = Buffer.from(b)
  for (let i = 0; i < out.length; i++) if ((out[i] | 32) >= 97 && (out[i] | 32) <= 122) out[i] ^= 32
  return out
}

function app(calls) {
  const a = express()
  a.use(express.json())
  a.use(idempotency({ store: new IdempotencyStore() }))
  a.post('/orders', (req, res) => {
    calls.n++
    res.status(201).json({ order: calls.n, note: 'paid' })
  })
  return a
}

test('express: a body-transforming end set on app.response after the first request: the replay equals the answer sent', async () => {
  const calls = { n: 0 }
  const a = app(calls)
  await serve(a, async (url) => {
    const warm = await post(url + '/orders', 'review-proto-warm1')
    assert.equal(warm.status, 201)
    // Installed later (a plugin loaded lazily): wraps end on the app's response prototype.
    const inner = a.response.end
    a.response.end = function (chunk, encoding, cb) {
      if (typeof chunk === 'string') chunk = Buffer.from(chunk, encoding)
      if (Buffer.isBuffer(chunk)) chunk = swapCase(chunk)
      return inner.call(this, chunk, encoding, cb)
    }
    const first = await post(url + '/orders', 'review-proto-key01')
    const retry = await post(url + '/orders', 'review-proto-key01', { replayed: true })
    assert.equal(calls.n, 2)
    assert.equal(retry.replayed, true)
    assert.equal(retry.body, first.body)
  })
})

test('express: an end set on app.response after the first request that calls Node\'s own end: the handler runs once per key', async () => {
  const calls = { n: 0 }
  const a = app(calls)
  const nodeEnd = http.OutgoingMessage.prototype.end
  await serve(a, async (url) => {
    const warm = await post(url + '/orders', 'review-proto-warm2')
    assert.equal(warm.status, 201)
    a.response.end = function (chunk, encoding, cb) {
      // e.g. an instrumentation that kept Node's end from before it was wrapped
      return nodeEnd.call(this, chunk, encoding, cb)
    }
    const first = await post(url + '/orders', 'review-proto-key02')
    assert.equal(first.status, 201)
    const retry = await post(url + '/orders', 'review-proto-key02', { replayed: true })
    assert.equal(calls.n, 2, 'the handler ran again for the same key')
    assert.equal(retry.replayed, true)
  })
})
