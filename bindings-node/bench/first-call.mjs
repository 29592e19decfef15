// One app per process, for counting instructions per request with callgrind (latency on a
// shared machine moves more than a single cut): POST /orders with express.json(), bare
// (`none`), under oncely/express (`oncely`) or under @node-idempotency/core as its README
// wires it (`peer`); $WARM requests (default 2,000), then N timed ones, one at a time on one
// keep-alive connection, first calls (or replays of one key with --replay); --als turns on
// an AsyncLocalStorage first (its Promise hooks, for the bare app). The per-request count is
// the difference of two runs, V8 on one thread and seeded (see README.md, "This pass"):
//   WARM=3000 valgrind --tool=callgrind node --predictable --hash-seed=42 --random-seed=42 bench/first-call.mjs oncely 500
//   WARM=3000 valgrind --tool=callgrind node --predictable --hash-seed=42 --random-seed=42 bench/first-call.mjs oncely 2500
//   node bench/first-call.mjs <none|oncely|peer> [N] [--replay] [--als] [--async]
// With ONCELY_DIR=/path/to/a/copy/of/bindings-node, `oncely` is that copy's.
import http from 'node:http'
import { PerformanceObserver } from 'node:perf_hooks'
import express from 'express'
import { createRequire } from 'node:module'
// ONCELY_DIR: another copy of the package (e.g. a previous commit's), to count both in one session.
const from = process.env.ONCELY_DIR ? createRequire(`${process.env.ONCELY_DIR}/`) : createRequire(import.meta.url)
const { IdempotencyStore, newKey } = from(process.env.ONCELY_DIR ? './index.js' : 'oncely')
const { idempotency: oncely } = from(process.env.ONCELY_DIR ? './express.js' : 'oncely/express')
import { Idempotency } from '@node-idempotency/core'
import { MemoryStorageAdapter } from '@node-idempotency/storage-adapter-memory'
const variant = process.argv[2]
if (process.argv.includes('--als')) { const { AsyncLocalStorage } = await import('node:async_hooks'); new AsyncLocalStorage().run(1, () => {}) }
const WARM = Number(process.env.WARM ?? 2000)
const N = Number(process.argv[3] ?? 5000)
const replay = process.argv.includes('--replay')
const c = { calls: 0 }
const sync = (req, res) => { c.calls++; res.status(201).json({ id: c.calls, sku: req.body?.sku }) }
// --async: the handler is an async function (as most are), so the lead runs on past `next()`.
const h = process.argv.includes('--async') ? async (req, res) => sync(req, res) : sync
const a = express()
if (variant === 'none') a.post('/orders', express.json(), h)
else if (variant === 'oncely') a.post('/orders', express.json(), oncely({ store: new IdempotencyStore({ ttlMs: 600_000 }) }), h)
else if (variant === 'peer') {
  const idem = new Idempotency(new MemoryStorageAdapter(), {})
  a.post('/orders', express.json(), async (req, res) => {
    const r = { method: req.method, headers: req.headers, body: req.body, path: req.path }
    try {
      const stored = await idem.onRequest(r)
      if (stored) return res.status(stored.additional?.status ?? 200).set('idempotent-replayed', 'true').json(stored.body)
    } catch (e) { return res.status(409).json({ error: String(e.code ?? e.message) }) }
    const json = res.json.bind(res)
    res.json = (body) => { idem.onResponse(r, { body, additional: { status: res.statusCode } }).catch(() => {}); return json(body) }
    return h(req, res)
  })
}
const s = await new Promise((r) => { const s = a.listen(0, '127.0.0.1', () => r(s)) })
const port = s.address().port
const agent = new http.Agent({ keepAlive: true, maxSockets: 1 })
function post(key) {
  return new Promise((resolve, reject) => {
    const req = http.request({ host: '127.0.0.1', port, method: 'POST', path: '/orders', agent, headers: { 'idempotency-key': key, 'content-type': 'application/json', 'content-length': 12 } }, (res) => { res.on('data', () => {}); res.on('end', resolve) })
    req.on('error', reject); req.end('{"sku":"A1"}')
  })
}
let gcMs = 0, gcs = 0
new PerformanceObserver((l) => { for (const e of l.getEntries()) { gcMs += e.duration; gcs++ } }).observe({ entryTypes: ['gc'] })
const k = newKey()
for (let i = 0; i < WARM; i++) await post(replay ? k : newKey())
gcMs = 0; gcs = 0
const each = new Float64Array(N)
const cpu = process.cpuUsage(); const t0 = process.hrtime.bigint()
for (let i = 0; i < N; i++) { const t = process.hrtime.bigint(); await post(replay ? k : newKey()); each[i] = Number(process.hrtime.bigint() - t) / 1000 }
const wall = Number(process.hrtime.bigint() - t0) / 1000 / N
const u = process.cpuUsage(cpu)
each.sort()
console.log(JSON.stringify({ variant, replay, median: +each[N >> 1].toFixed(1), mean: +wall.toFixed(1), cpu: +((u.user + u.system) / N).toFixed(1), user: +(u.user / N).toFixed(1), gcMsPerK: +(gcMs / N * 1000).toFixed(2), gcs }))
agent.destroy(); s.close()
