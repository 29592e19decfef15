// oncely (Node) side by side with its peers, in one run:
//   retry:  p-retry, cockatiel, async-retry and a bare loop
//           (success-path overhead; fail twice then succeed with zero delays)
//   store:  a hand-written Map-of-Promises single-flight
//           (hot replay; 10,000 waiters on one key; 1,000,000 keys with memory per entry)
// Prints absolute numbers, ratios to the peers and the targets of issue 4.
//
//   node bench/run.mjs [--quick] [--store] [--markdown FILE]
//
// --store runs the store scenarios only (no table).
//
// Run it with --expose-gc for the memory numbers (npm run bench does).
import { createRequire } from 'node:module'
import { writeFileSync } from 'node:fs'
import os from 'node:os'

const require = createRequire(import.meta.url)
const oncely = require('../index.js')
const pRetry = (await import('p-retry')).default
const cockatiel = await import('cockatiel')
const asyncRetry = require('async-retry')

const args = process.argv.slice(2)
const quick = args.includes('--quick')
const storeOnly = args.includes('--store')
const mdIndex = args.indexOf('--markdown')
const markdownFile = mdIndex >= 0 ? args[mdIndex + 1] : undefined
const gc = globalThis.gc ?? (() => {})

// ---------------------------------------------------------------------------------------

/** Runs `op` (async) `n` times per sample; returns the best ns/op of `samples` samples. */
async function measure(op, n, samples = quick ? 3 : 7) {
  for (let i = 0; i < Math.min(n, 20_000); i++) await op() // warm up
  let best = Infinity
  for (let s = 0; s < samples; s++) {
    const t0 = process.hrtime.bigint()
    for (let i = 0; i < n; i++) await op()
    const ns = Number(process.hrtime.bigint() - t0) / n
    if (ns < best) best = ns
  }
  return best
}

const rows = []
function row(group, name, value, unit, note = '') {
  rows.push({ group, name, value, unit, note })
  console.log(`${group.padEnd(28)} ${name.padEnd(34)} ${fmt(value).padStart(10)} ${unit.padEnd(6)} ${note}`)
}
const fmt = (v) => (v >= 100 ? v.toFixed(0) : v.toFixed(1))

// ---------------------------------------------------------------------------------------
// 1. retry: success-path overhead (net of calling the action directly)
// ---------------------------------------------------------------------------------------

const ok = async () => 1
let base, succ, ffs
if (!storeOnly) {
const N = quick ? 100_000 : 500_000

const cockatielPolicy = cockatiel.retry(cockatiel.handleAll, { maxAttempts: 2, backoff: new cockatiel.ConstantBackoff(0) })
const oncelyPolicy = new oncely.RetryPolicy({ maxAttempts: 3 })
const oncelyOptions = { policy: oncelyPolicy, safe: true }

base = await measure(() => ok(), N)
row('retry success path', 'baseline: await fn()', base, 'ns')
succ = {
  oncely: await measure(() => oncely.retry(ok, oncelyOptions), N),
  cockatiel: await measure(() => cockatielPolicy.execute(ok), N),
  'p-retry': await measure(() => pRetry(ok, { retries: 2 }), quick ? 20_000 : 100_000),
  'async-retry': await measure(() => asyncRetry(ok, { retries: 2 }), quick ? 20_000 : 100_000),
}
for (const [name, ns] of Object.entries(succ)) row('retry success path', `${name} (net)`, ns - base, 'ns')

// ---------------------------------------------------------------------------------------
// 2. retry: fail, fail, succeed with zero delays
// ---------------------------------------------------------------------------------------

function flaky() {
  let n = 0
  return async () => {
    if (n++ < 2) {
      const e = new Error('connection reset')
      e.code = 'ECONNRESET'
      throw e
    }
    return n
  }
}
const zero = new oncely.RetryPolicy({ baseDelayMs: 0, maxDelayMs: 0, maxAttempts: 3 })
const zeroOptions = { policy: zero, safe: true }
const cockatielZero = cockatiel.retry(cockatiel.handleAll, { maxAttempts: 2, backoff: new cockatiel.ConstantBackoff(0) })
const M = quick ? 5_000 : 30_000
ffs = {
  'bare loop': await measure(async () => {
    const fn = flaky()
    for (;;) {
      try {
        return await fn()
      } catch {}
    }
  }, M),
  oncely: await measure(() => oncely.retry(flaky(), zeroOptions), M),
  // The peers sleep through Node's 1 ms clamp of setTimeout(0) per retry: fewer rounds.
  cockatiel: await measure(() => cockatielZero.execute(flaky()), quick ? 300 : 1_000, 3),
  'p-retry': await measure(() => pRetry(flaky(), { retries: 2, minTimeout: 0, maxTimeout: 0 }), quick ? 300 : 1_000, 3),
  'async-retry': await measure(() => asyncRetry(flaky(), { retries: 2, minTimeout: 0, maxTimeout: 0 }), quick ? 300 : 1_000, 3),
}
for (const [name, ns] of Object.entries(ffs)) row('retry fail-fail-succeed (0 ms)', name, ns / 1000, 'µs')

}

// ---------------------------------------------------------------------------------------
// 3. store: hot replay, 10,000 waiters, 1,000,000 keys
// ---------------------------------------------------------------------------------------

/** The hand-written single-flight: a Map of Promises. */
class MapSingleFlight {
  constructor() {
    this.map = new Map()
  }
  execute(key, fn) {
    let p = this.map.get(key)
    if (p === undefined) {
      p = fn()
      this.map.set(key, p)
      p.catch(() => this.map.delete(key))
    }
    return p
  }
}

const fp = oncely.fingerprint({ sku: 'A1', qty: 1 })
{
  const store = new oncely.IdempotencyStore()
  const scoped = oncely.scope('acme', 'CreateOrder', oncely.newKey())
  const value = { order: 'o-1' }
  await store.execute(scoped, fp, async () => value)
  const hw = new MapSingleFlight()
  await hw.execute('acme/CreateOrder/k', async () => value)
  const R = quick ? 200_000 : 1_000_000
  const hot = {
    oncely: await measure(() => store.execute(scoped, fp, ok), R),
    'hand-written Map': await measure(() => hw.execute('acme/CreateOrder/k', ok), R),
  }
  for (const [name, ns] of Object.entries(hot)) row('store hot replay', name, ns, 'ns')
  var hotReplay = hot
}

async function coalesce(makeCall, waiters) {
  let release
  const gate = new Promise((r) => (release = r))
  const t0 = process.hrtime.bigint()
  const calls = new Array(waiters)
  for (let i = 0; i < waiters; i++) calls[i] = makeCall(() => gate)
  release({ order: 'o-1' })
  await Promise.all(calls)
  return Number(process.hrtime.bigint() - t0) / waiters
}
{
  const W = 10_000
  const rounds = quick ? 5 : 20
  let o = Infinity
  let h = Infinity
  for (let r = 0; r < rounds + 3; r++) {
    const store = new oncely.IdempotencyStore()
    const scoped = oncely.scope('acme', 'CreateOrder', oncely.newKey())
    const a = await coalesce((fn) => store.execute(scoped, fp, fn), W)
    const hw = new MapSingleFlight()
    const b = await coalesce((fn) => hw.execute('k', fn), W)
    if (r >= 3) {
      o = Math.min(o, a)
      h = Math.min(h, b)
    }
  }
  row('store 10,000 waiters', 'oncely', o, 'ns/w')
  row('store 10,000 waiters', 'hand-written Map', h, 'ns/w')
  var waiters = { oncely: o, 'hand-written Map': h }
}

async function manyKeys(name, insert) {
  const K = quick ? 200_000 : 1_000_000
  gc()
  await new Promise((r) => setTimeout(r, 50))
  gc()
  const before = process.memoryUsage()
  const t0 = process.hrtime.bigint()
  const keep = insert(K)
  await keep.done
  const ns = Number(process.hrtime.bigint() - t0) / K
  gc()
  await new Promise((r) => setTimeout(r, 50))
  gc()
  const after = process.memoryUsage()
  const perEntry = (after.rss - before.rss) / K
  row('store 1,000,000 keys', `${name} time`, ns, 'ns/key')
  row('store 1,000,000 keys', `${name} memory (RSS)`, perEntry, 'B/key', `heap ${((after.heapUsed - before.heapUsed) / K).toFixed(0)} B/key`)
  return { ns, perEntry, keep }
}
{
  const hwResult = await manyKeys('hand-written Map', (K) => {
    const hw = new MapSingleFlight()
    const ps = []
    for (let i = 0; i < K; i++) ps.push(hw.execute(`v1:acme:CreateOrder:key-${String(i).padStart(8, '0')}`, async () => ({ i })))
    return { hw, done: Promise.all(ps) }
  })
  hwResult.keep = null
  gc()
  const oResult = await manyKeys('oncely', (K) => {
    const store = new oncely.IdempotencyStore()
    const ps = []
    for (let i = 0; i < K; i++) ps.push(store.execute(oncely.scope('acme', 'CreateOrder', `key-${String(i).padStart(8, '0')}`), fp, async () => ({ i })))
    return { store, done: Promise.all(ps) }
  })
  var keys = { oncely: oResult, 'hand-written Map': hwResult }
}

// ---------------------------------------------------------------------------------------
// Summary: ratios and targets
// ---------------------------------------------------------------------------------------

if (storeOnly) process.exit(0)
const lines = []
const add = (what, value, unit, target, peers) => {
  const met = value <= target ? 'yes' : 'no'
  const ratios = Object.entries(peers)
    .map(([n, v]) => `${n} ${fmt(v)} (${(value / v).toFixed(2)}×)`)
    .join(', ')
  lines.push(`| ${what} | ${fmt(value)} ${unit} | ≤ ${target} | ${met} | ${ratios} |`)
}
add('retry success-path overhead (net)', succ.oncely - base, 'ns', 150, {
  cockatiel: succ.cockatiel - base,
  'p-retry': succ['p-retry'] - base,
  'async-retry': succ['async-retry'] - base,
})
add('retry fail-fail-succeed, 0 ms delays', ffs.oncely / 1000, 'µs', 15, {
  'bare loop': ffs['bare loop'] / 1000,
  cockatiel: ffs.cockatiel / 1000,
  'p-retry': ffs['p-retry'] / 1000,
  'async-retry': ffs['async-retry'] / 1000,
})
add('store hot replay', hotReplay.oncely, 'ns', 150, { 'hand-written Map': hotReplay['hand-written Map'] })
add('store 10,000 waiters, per waiter', waiters.oncely, 'ns', 250, { 'hand-written Map': waiters['hand-written Map'] })
add('store 1,000,000 keys, per key', keys.oncely.ns, 'ns', 1500, { 'hand-written Map': keys['hand-written Map'].ns })
add('store 1,000,000 keys, memory per entry (RSS)', keys.oncely.perEntry, 'B', 217, { 'hand-written Map': keys['hand-written Map'].perEntry })

const header = [
  `Node ${process.version}, ${os.cpus().length} × ${os.cpus()[0]?.model ?? 'cpu'}, ${os.platform()} ${os.arch()}${quick ? ' (--quick)' : ''}; ratios are oncely ÷ peer (< 1: oncely is faster / smaller).`,
  '',
  '| scenario | oncely | target | met | peers (ratio) |',
  '|---|---|---|---|---|',
]
console.log('\n' + [...header, ...lines].join('\n'))
if (markdownFile) writeFileSync(markdownFile, [...header, ...lines].join('\n') + '\n')
