'use strict'
// The Node worker of the chaos soak (driven by soak.py; same protocol as worker.py and
// the Rust worker, soak/src/main.rs).
//   node worker.js NAME REDIS_URL PREFIX LEASE_MS LEDGER_PATH
// With ONCELY_SOAK_CLUSTER=1, REDIS_URL is a Redis Cluster's node URLs (space-separated);
// ONCELY_SOAK_MIN_REPLICAS sets the store's minReplicas.
// Each job is one caller: `retry` around `RedisStore.execute`, aborted after
// `cancel_ms` if set. Every execution of the action appends `start` and `end` lines to
// the ledger. The addon is loaded from bindings-node (ONCELY_NODE_DIR overrides).
const crypto = require('node:crypto')
const fs = require('node:fs')
const path = require('node:path')
const readline = require('node:readline')

const dir = process.env.ONCELY_NODE_DIR || path.join(__dirname, '..', '..', 'bindings-node')
const { RedisStore, scope, fingerprint, retry, RetryPolicy } = require(dir)

const [NAME, URL, PREFIX, LEASE_MS, LEDGER] = process.argv.slice(2)
const ledgerFd = fs.openSync(LEDGER, 'a')
let execs = 0
const calls = { led: 0, joined: 0, replayed: 0 }
const pending = new Set()

class Flaky extends Error {}
class Permanent extends Error {}
class DeadlineExceeded extends Error {}
const classify = (err) => (err instanceof Flaky
  ? 'UNAVAILABLE'
  : err instanceof Permanent ? 'INVALID_ARGUMENT' : err instanceof DeadlineExceeded ? 'DEADLINE_EXCEEDED' : undefined)

const emit = (obj) => process.stdout.write(JSON.stringify(obj) + '\n')
const ledger = (obj) => fs.writeSync(ledgerFd, JSON.stringify(obj) + '\n')
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))
const coin = (seed) => Number(crypto.createHash('sha256').update(seed).digest().readBigUInt64BE(0) >> 11n) / 2 ** 53

function summary (v) {
  if (v === undefined || v === null) return 'none'
  if (Buffer.isBuffer(v)) v = v.toString('utf8')
  if (typeof v === 'string') return `big:${v.split('|', 1)[0]}:${Buffer.byteLength(v)}`
  if (typeof v === 'object') return `x:${v.x}`
  return `unexpected:${String(v)}`
}

function action (job) {
  return async () => {
    const key = job.key
    const x = `${NAME}-${execs++}`
    ledger({ ev: 'start', k: key, w: NAME, x, t: Date.now() })
    let status = 'cancel'
    try {
      if (job.dur_ms) await sleep(job.dur_ms)
      const kind = job.kind || 'ok'
      if (kind === 'perm') { status = 'fail'; throw new Permanent(key) }
      if (kind === 'flaky' && coin(x) < (job.pfail ?? 0.5)) { status = 'fail'; throw new Flaky(key) }
      status = 'ok'
      if (kind === 'none') return undefined
      if (kind === 'big') {
        const head = Buffer.from(`${x}|`)
        const out = Buffer.alloc(Math.max(head.length, job.size || 1 << 20), 'z')
        head.copy(out)
        return out
      }
      return { k: key, x }
    } finally {
      ledger({ ev: 'end', k: key, x, st: status, t: Date.now() })
    }
  }
}

// ONCELY_SOAK_CLUSTER=1: URL is a Redis Cluster's node URLs, space-separated.
const cluster = process.env.ONCELY_SOAK_CLUSTER === '1'
const store = new RedisStore({
  ...(cluster ? { urls: URL.split(' ').filter(Boolean), cluster } : { url: URL }),
  leaseMs: Number(LEASE_MS),
  prefix: PREFIX,
  minReplicas: Number(process.env.ONCELY_SOAK_MIN_REPLICAS || 0),
})
const policy = new RetryPolicy({ maxAttempts: 1000, baseDelayMs: 50, maxDelayMs: 1000 })

async function runJob (job) {
  const scoped = scope('soak', 'Soak', job.key)
  const fp = fingerprint(job.payload)
  const ac = new AbortController()
  const timer = job.cancel_ms != null ? setTimeout(() => ac.abort(), job.cancel_ms) : undefined
  const fn = action(job)
  try {
    // The time left is this attempt's timeout, as a client forwards it: a waiter stops
    // at the caller's deadline (a leader's action runs on, its outcome stored).
    const attempt = async (n, info) => {
      // remainingMs has a fraction; AbortSignal.timeout takes whole milliseconds.
      const timeout = AbortSignal.timeout(Math.max(1, Math.ceil(Math.min(info.remainingMs, 60000))))
      try {
        return await store.execute(scoped, fp, fn, { signal: AbortSignal.any([ac.signal, timeout]) })
      } catch (err) {
        if (timeout.aborted && !ac.signal.aborted) throw new DeadlineExceeded(job.key)
        // Each failed attempt's store error, for a failure report (the checker skips it).
        if (err && err.kind) ledger({ ev: 'err', k: job.key, x: '', t: Date.now(), err: `${err.kind} ${err.code}: ${err.message}` })
        throw err
      }
    }
    const done = await retry(attempt,
      { policy, safe: true, classify, signal: ac.signal, deadline: job.deadline_ms || 20000 })
    calls[done.source]++
    emit({ id: job.id, w: NAME, ok: true, v: summary(done.value), src: done.source })
  } catch (err) {
    if (ac.signal.aborted) {
      emit({ id: job.id, w: NAME, cancelled: true })
    } else {
      const code = classify(err) || String(err && err.code)
      emit({ id: job.id, w: NAME, ok: false, code, err: String(err && err.message) })
    }
  } finally {
    clearTimeout(timer)
  }
}

const rl = readline.createInterface({ input: process.stdin })
rl.on('line', (line) => {
  if (!line.trim()) return
  const p = runJob(JSON.parse(line))
  pending.add(p)
  p.finally(() => pending.delete(p))
})
rl.on('close', async () => {
  while (pending.size) await Promise.all([...pending])
  const c = store.counters()
  emit({
    end: NAME,
    counters: { claims: c.claims, leads: c.leads, takeovers: c.takeovers, replays: c.replays, remote_waits: c.remoteWaits, leases_lost: c.leasesLost, abandoned: c.abandoned, completions_unreplicated: c.completionsUnreplicated },
    calls,
  })
  process.exit(0)
})
emit({ ready: NAME })
