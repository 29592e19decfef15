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

const quick = process.argv.includes('--quick')
const N = quick ? 2_000 : 10_000

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

// 2. Time per request, one at a time on one keep-alive connection.
// `[median µs per request, CPU µs per request (client and server, user + system)]`.
async function time(port, keyOf, agent) {
  for (let i = 0; i < 300; i++) await post(port, keyOf(), agent)
  const each = new Float64Array(N)
  const cpu = process.cpuUsage()
  for (let i = 0; i < N; i++) {
    const t = process.hrtime.bigint()
    await post(port, keyOf(), agent)
    each[i] = Number(process.hrtime.bigint() - t) / 1000
  }
  const used = process.cpuUsage(cpu)
  return [[...each].sort((a, b) => a - b)[N >> 1], (used.user + used.system) / N]
}
const apps = makeApps(0)
const servers = {}
for (const [name, { app }] of Object.entries(apps)) servers[name] = await listen(app)
const agent = new http.Agent({ keepAlive: true, maxSockets: 1 })
// Every (middleware, scenario) pair runs once per round, in a rotated order each round,
// so that load from outside the run weighs on all alike; the median over rounds is kept.
const ROUNDS = quick ? 3 : 5
const jobs = []
for (const [name, s] of Object.entries(servers)) {
  const k = newKey()
  jobs.push([name, 'first', () => time(s.address().port, () => newKey(), agent)])
  jobs.push([name, 'replay', () => time(s.address().port, () => k, agent)])
}
const runs = {}
for (let r = 0; r < ROUNDS; r++) {
  for (let j = 0; j < jobs.length; j++) {
    const [name, kind, run] = jobs[(j + r * 3) % jobs.length]
    ;((runs[name] ??= { first: [], replay: [] })[kind]).push(await run())
  }
}
const med = (xs) => [...xs].sort((a, b) => a - b)[xs.length >> 1]
const at = (xs, i) => med(xs.map((x) => x[i]))
const out = Object.fromEntries(Object.entries(runs).map(([n, r]) => [n, { first: at(r.first, 0), replay: at(r.replay, 0), firstCpu: at(r.first, 1), replayCpu: at(r.replay, 1) }]))
const base = out.none.first
const baseCpu = out.none.firstCpu
console.log(`\n| middleware | first call, µs (added) | replay, µs (added) | CPU first call, µs (added) | CPU replay, µs (added) |  (median request, median of ${ROUNDS} rounds × ${N})`)
console.log('|---|---|---|---|---|')
const cell = (v, b) => `${v.toFixed(1)} (${(v - b).toFixed(1)})`
for (const [name, r] of Object.entries(out)) {
  console.log(`| ${name} | ${cell(r.first, base)} | ${cell(r.replay, base)} | ${cell(r.firstCpu, baseCpu)} | ${cell(r.replayCpu, baseCpu)} |`)
}
agent.destroy()
for (const s of Object.values(servers)) s.close()
