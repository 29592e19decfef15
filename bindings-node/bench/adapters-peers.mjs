// oncely/express beside express-idempotency and @node-idempotency/core (wired into Express
// as its README shows) on the same Express app, in one run: 200 concurrent requests with
// one key (handler calls, statuses, replays) and the added time per request on a first
// call and on a replay. `node bench/adapters-peers.mjs [--quick]`.
import http from 'node:http'
import express from 'express'
import { IdempotencyStore, newKey } from 'oncely'
import { idempotency as oncely } from 'oncely/express'
import expressIdempotency from 'express-idempotency'
import { Idempotency } from '@node-idempotency/core'
import { MemoryStorageAdapter } from '@node-idempotency/storage-adapter-memory'
import { paired } from './paired.mjs'

const quick = process.argv.includes('--quick')

// Each app: POST /orders, express.json(), the peer's middleware, a handler that counts its
// calls and answers 201 after `delay` ms.
function makeApps(delay) {
  const apps = {}
  const handler = (counter) => async (req, res) => {
    counter.calls++
    if (delay) await new Promise((r) => setTimeout(r, delay))
    res.status(201).json({ id: counter.calls, sku: req.body?.sku })
  }
  {
    const a = express()
    const c = { calls: 0 }
    a.post('/orders', express.json(), handler(c))
    apps.none = { app: a, c }
  }
  {
    const a = express()
    const c = { calls: 0 }
    a.post('/orders', express.json(), oncely({ store: new IdempotencyStore({ ttlMs: 600_000 }) }), handler(c))
    apps['oncely/express'] = { app: a, c }
  }
  {
    const a = express()
    const c = { calls: 0 }
    const h = handler(c)
    a.post('/orders', express.json(), expressIdempotency.idempotency(), (req, res) => {
      if (expressIdempotency.getSharedIdempotencyService().isHit(req)) return
      return h(req, res)
    })
    apps['express-idempotency'] = { app: a, c }
  }
  {
    const a = express()
    const c = { calls: 0 }
    const idem = new Idempotency(new MemoryStorageAdapter(), {})
    const h = handler(c)
    a.post('/orders', express.json(), async (req, res) => {
      const r = { method: req.method, headers: req.headers, body: req.body, path: req.path }
      try {
        const stored = await idem.onRequest(r)
        if (stored) return res.status(stored.additional?.status ?? 200).set('idempotent-replayed', 'true').json(stored.body)
      } catch (e) {
        return res.status(409).json({ error: String(e.code ?? e.message) })
      }
      const json = res.json.bind(res)
      res.json = (body) => {
        idem.onResponse(r, { body, additional: { status: res.statusCode } }).catch(() => {})
        return json(body)
      }
      return h(req, res)
    })
    apps['@node-idempotency/core'] = { app: a, c }
  }
  return apps
}

const listen = (app) => new Promise((r) => { const s = app.listen(0, '127.0.0.1', () => r(s)) })

function post(port, key, agent) {
  return new Promise((resolve, reject) => {
    const req = http.request(
      { host: '127.0.0.1', port, method: 'POST', path: '/orders', agent, headers: { 'idempotency-key': key, 'content-type': 'application/json', 'content-length': 12 } },
      (res) => {
        const chunks = []
        res.on('data', (d) => chunks.push(d))
        res.on('end', () => resolve({ status: res.statusCode, replayed: res.headers['idempotent-replayed'] === 'true', body: Buffer.concat(chunks).toString() }))
      },
    )
    req.on('error', reject)
    req.end('{"sku":"A1"}')
  })
}

// 1. 200 concurrent requests, one key, a handler taking 50 ms.
console.log('| middleware | handler calls (200 concurrent, one key) | statuses | distinct bodies | marked replayed |')
console.log('|---|---|---|---|---|')
for (const [name, { app, c }] of Object.entries(makeApps(50))) {
  const s = await listen(app)
  const agent = new http.Agent({ keepAlive: true, maxSockets: 200 })
  const key = newKey()
  const all = await Promise.all(Array.from({ length: 200 }, () => post(s.address().port, key, agent)))
  const statuses = {}
  for (const r of all) statuses[r.status] = (statuses[r.status] ?? 0) + 1
  console.log(`| ${name} | ${c.calls} | ${Object.entries(statuses).map(([k, v]) => `${v}× ${k}`).join(', ')} | ${new Set(all.map((r) => r.body)).size} | ${all.filter((r) => r.replayed).length} |`)
  agent.destroy()
  s.close()
}

// 2. Time per request, one at a time on one keep-alive connection, every (middleware,
// scenario) pair in batches taking turns (see paired.mjs).
const apps = makeApps(0)
const servers = {}
for (const [name, { app }] of Object.entries(apps)) servers[name] = await listen(app)
const agent = new http.Agent({ keepAlive: true, maxSockets: 1 })
const CYCLES = quick ? 10 : 50
const BATCH = 200
const scenarios = {}
for (const [name, s] of Object.entries(servers)) {
  const port = s.address().port
  const k = newKey()
  scenarios[`${name} first`] = () => post(port, newKey(), agent)
  scenarios[`${name} replay`] = () => post(port, k, agent)
}
const out = await paired(scenarios, { base: 'none first', cycles: CYCLES, batch: BATCH })
console.log(`\n| middleware | first call, µs (added) | replay, µs (added) | CPU first call, µs (added) | CPU replay, µs (added) |  (medians over ${CYCLES} cycles of ${BATCH} requests per scenario; added: to the bare app's first call in the same cycle)`)
console.log('|---|---|---|---|---|')
const cell = (v, added) => `${v.toFixed(1)} (${added >= 0 ? '+' : ''}${added.toFixed(1)})`
for (const name of Object.keys(servers)) {
  const f = out[`${name} first`]
  const r = out[`${name} replay`]
  console.log(`| ${name} | ${cell(f.us, f.added)} | ${cell(r.us, r.added)} | ${cell(f.cpu, f.addedCpu)} | ${cell(r.cpu, r.addedCpu)} |`)
}
agent.destroy()
for (const s of Object.values(servers)) s.close()
