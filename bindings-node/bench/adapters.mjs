// The Express middleware's overhead per request, against the same app without it (both
// behind express.json()), in one run: real HTTP on 127.0.0.1 (keep-alive, one request at a time), so the difference of
// the means is what oncely/express adds. `node bench/adapters.mjs [--quick]`.
import http from 'node:http'
import express from 'express'
import { IdempotencyStore, newKey } from 'oncely'
import { idempotency } from 'oncely/express'

const quick = process.argv.includes('--quick')
const N = quick ? 2_000 : 20_000
const ROUNDS = quick ? 2 : 5
const agent = new http.Agent({ keepAlive: true, maxSockets: 1 })

function app(withMiddleware) {
  const a = express()
  const handler = (req, res) => res.status(201).json({ id: 1, sku: req.body.sku })
  // Both read and parse the body, as an endpoint taking JSON does.
  if (withMiddleware) a.post('/orders', express.json(), idempotency({ store: new IdempotencyStore({ ttlMs: 600_000 }) }), handler)
  else a.post('/orders', express.json(), handler)
  return new Promise((resolve) => {
    const s = a.listen(0, '127.0.0.1', () => resolve(s))
  })
}

function post(port, key) {
  return new Promise((resolve, reject) => {
    const req = http.request(
      { host: '127.0.0.1', port, method: 'POST', path: '/orders', agent, headers: { 'idempotency-key': key, 'content-type': 'application/json', 'content-length': 12 } },
      (res) => {
        res.resume()
        res.on('end', resolve)
      },
    )
    req.on('error', reject)
    req.end('{"sku":"A1"}')
  })
}

async function time(port, keyOf) {
  for (let i = 0; i < 500; i++) await post(port, keyOf(i))
  const each = new Float64Array(N)
  for (let i = 0; i < N; i++) {
    const t = process.hrtime.bigint()
    await post(port, keyOf(i))
    each[i] = Number(process.hrtime.bigint() - t) / 1000
  }
  // The median request: robust to the stalls of a shared machine.
  return [...each].sort((a, b) => a - b)[N >> 1]
}

const bare = await app(false)
const guarded = await app(true)
const replayKey = newKey()
const results = { bare: [], first: [], replay: [] }
// The scenarios take turns, in another order each round, so that load from outside
// the run weighs on all of them alike.
const runs = {
  bare: () => time(bare.address().port, () => replayKey),
  first: () => time(guarded.address().port, () => newKey()),
  replay: () => time(guarded.address().port, () => replayKey),
}
const orders = [['bare', 'first', 'replay'], ['first', 'replay', 'bare'], ['replay', 'bare', 'first']]
for (let r = 0; r < ROUNDS; r++) {
  for (const k of orders[r % 3]) results[k].push(await runs[k]())
}
const median = (xs) => [...xs].sort((a, b) => a - b)[xs.length >> 1]
const b = median(results.bare)
console.log(`| scenario | median µs per request (median of ${ROUNDS} runs × ${N}) | added by oncely/express |`)
console.log('|---|---|---|')
console.log(`| without the middleware | ${b.toFixed(1)} | |`)
for (const k of ['first', 'replay']) {
  const m = median(results[k])
  console.log(`| ${k === 'first' ? 'first call (new key)' : 'replay (same key)'} | ${m.toFixed(1)} | ${(m - b).toFixed(1)} |`)
}
bare.close()
guarded.close()
agent.destroy()
