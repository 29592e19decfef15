'use strict'
// A real client and server on the loopback interface: a node:http server whose
// POST /orders is guarded by IdempotencyStore and the Idempotency-Key header, and a
// fetch client retrying through oncely with one key.
const test = require('node:test')
const assert = require('node:assert/strict')
const http = require('node:http')

const { IdempotencyStore, retry, newKey, scope, fingerprint, validateKey, headers, httpStatusOf } = require('oncely')

function startServer({ dropFirstResponse = false, orderDelayMs = 0 } = {}) {
  const store = new IdempotencyStore({ ttlMs: 60_000, inProgressRetryAfterMs: 1_000 })
  const orders = []
  let dropped = false
  const server = http.createServer(async (req, res) => {
    if (req.method !== 'POST' || !req.url.startsWith('/orders')) {
      res.writeHead(404).end()
      return
    }
    const chunks = []
    for await (const c of req) chunks.push(c)
    const send = (status, body, extra = {}) => {
      res.writeHead(status, { 'content-type': 'application/json', ...extra })
      res.end(JSON.stringify(body))
    }
    let body
    try {
      body = JSON.parse(Buffer.concat(chunks).toString('utf8'))
    } catch {
      return send(400, { error: 'body must be JSON' })
    }
    const wait = !req.url.includes('wait=false')
    let executed = false
    try {
      const key = validateKey(req.headers[headers.idempotencyKey.toLowerCase()] ?? '')
      const scoped = scope('acme', 'POST /orders', key)
      const result = await store.execute(
        scoped,
        fingerprint(body),
        async () => {
          executed = true
          if (orderDelayMs) await new Promise((r) => setTimeout(r, orderDelayMs))
          const order = { id: `o-${orders.length + 1}`, ...body }
          orders.push(order)
          return order
        },
        { wait },
      )
      if (dropFirstResponse && executed && !dropped) {
        // The order was placed, then the connection drops before the response: the
        // client cannot know whether it happened.
        dropped = true
        req.socket.destroy()
        return
      }
      send(201, result.value, result.replayed ? { [headers.idempotentReplayed]: 'true' } : {})
    } catch (e) {
      const status = httpStatusOf(e) ?? (e.code === 'INVALID_ARGUMENT' ? 400 : 500)
      const extra = e.retryAfterMs !== undefined ? { [headers.retryAfter]: String(Math.ceil(e.retryAfterMs / 1000)) } : {}
      send(status, { error: e.message, code: e.code }, extra)
    }
  })
  return new Promise((resolve) => {
    server.listen(0, '127.0.0.1', () => {
      const url = `http://127.0.0.1:${server.address().port}/orders`
      resolve({
        url,
        orders,
        store,
        close: () =>
          new Promise((r) => {
            server.closeAllConnections()
            server.close(r)
          }),
      })
    })
  })
}

const post = (url, key, body) =>
  fetch(url, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...(key === undefined ? {} : { [headers.idempotencyKey]: key }) },
    body: JSON.stringify(body),
  })

test('a fetch client retrying with one key through a dropped response: exactly one order', async () => {
  const srv = await startServer({ dropFirstResponse: true })
  try {
    const key = newKey() // once per intent, before the first attempt
    const attempts = []
    const retries = []
    const result = await retry(
      async (attempt, info) => {
        attempts.push(attempt.number)
        const res = await fetch(srv.url, {
          method: 'POST',
          headers: { 'content-type': 'application/json', [headers.idempotencyKey]: key },
          body: JSON.stringify({ sku: 'A1', qty: 2 }),
          signal: info.signal,
        })
        if (!res.ok) throw res
        return { order: await res.json(), replayed: res.headers.get(headers.idempotentReplayed) === 'true' }
      },
      { safe: true, policy: { baseDelayMs: 5, maxDelayMs: 20 }, onRetry: (e) => retries.push(e) },
    )
    assert.deepEqual(attempts, [1, 2])
    assert.equal(retries.length, 1)
    assert.equal(retries[0].reason, 'transient_safe', 'the dropped connection is an unknown outcome: UNAVAILABLE')
    assert.equal(srv.orders.length, 1, 'exactly one order')
    assert.deepEqual(result.order, { id: 'o-1', sku: 'A1', qty: 2 })
    assert.equal(result.replayed, true, 'the retry got the stored result')
    assert.equal(srv.store.counters().leads, 1)
    assert.equal(srv.store.counters().replays, 1)
  } finally {
    await srv.close()
  }
})

test('a keyless write is refused (400); a call not declared safe is not resent after a dropped response', async () => {
  const srv = await startServer({ dropFirstResponse: true })
  try {
    // The server refuses a keyless write.
    const res = await post(srv.url, undefined, { sku: 'A1' })
    assert.equal(res.status, 400)
    assert.equal((await res.json()).code, 'INVALID_ARGUMENT')
    // Without `safe`, an unknown outcome is not resent: at-most-once.
    const key = newKey()
    await assert.rejects(
      retry(async () => {
        const r = await post(srv.url, key, { sku: 'A1' })
        if (!r.ok) throw r
        return r.json()
      }),
      (e) => e.stopReason === 'not_retryable' && e.attemptNumber === 1,
    )
    assert.equal(srv.orders.length, 1)
  } finally {
    await srv.close()
  }
})

test('protocol statuses: 400 missing or bad key, 422 mismatch, 409 + Retry-After in progress, Idempotent-Replayed', async () => {
  const srv = await startServer({ orderDelayMs: 100 })
  try {
    assert.equal((await post(srv.url, undefined, { sku: 'A1' })).status, 400)
    assert.equal((await post(srv.url, 'bad key!', { sku: 'A1' })).status, 400)
    const key = newKey()
    // Two concurrent requests with one key: the second does not wait → 409.
    const first = post(srv.url, key, { sku: 'A1' })
    await new Promise((r) => setTimeout(r, 30))
    const busy = await post(`${srv.url}?wait=false`, key, { sku: 'A1' })
    assert.equal(busy.status, 409)
    assert.equal(busy.headers.get('retry-after'), '1')
    assert.equal((await busy.json()).code, 'ABORTED')
    // A waiting one shares the leader's result.
    const joined = await post(srv.url, key, { sku: 'A1' })
    const led = await first
    assert.equal(led.status, 201)
    assert.equal(led.headers.get(headers.idempotentReplayed), null)
    assert.equal(joined.status, 201)
    assert.equal(joined.headers.get(headers.idempotentReplayed), 'true')
    assert.deepEqual(await joined.json(), await led.json())
    // The same key with other parameters → 422.
    const mismatch = await post(srv.url, key, { sku: 'B2' })
    assert.equal(mismatch.status, 422)
    assert.equal((await mismatch.json()).code, 'FAILED_PRECONDITION')
    // A later retry is a replay.
    const replay = await post(srv.url, key, { sku: 'A1' })
    assert.equal(replay.status, 201)
    assert.equal(replay.headers.get(headers.idempotentReplayed), 'true')
    assert.equal(srv.orders.length, 1)
  } finally {
    await srv.close()
  }
})

test('many clients, each retrying through dropped connections: one order per intent', async () => {
  const srv = await startServer({ dropFirstResponse: true })
  try {
    const intents = Array.from({ length: 50 }, (_, i) => ({ key: newKey(), body: { sku: `S${i}`, qty: 1 } }))
    const results = await Promise.all(
      intents.map(({ key, body }) =>
        retry(
          async () => {
            const r = await post(srv.url, key, body)
            if (!r.ok) throw r
            return r.json()
          },
          { safe: true, policy: { baseDelayMs: 5, maxDelayMs: 20, maxAttempts: 5 } },
        ),
      ),
    )
    assert.equal(srv.orders.length, 50)
    assert.equal(new Set(results.map((o) => o.id)).size, 50)
  } finally {
    await srv.close()
  }
})
