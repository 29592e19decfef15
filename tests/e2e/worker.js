'use strict'
// An oncely fleet worker (Node): reads jobs as JSON lines on stdin, runs each through one
// shared RedisStore, writes one JSON line per job on stdout. Same protocol as worker.py.
//   node worker.js NAME REDIS_URL PREFIX LEASE_S
// The store is on REDIS_URL, or on the Redis Cluster whose node URLs (space-separated)
// are in ONCELY_E2E_CLUSTER_URLS (cluster: true); the effect counters stay on REDIS_URL.
// Run from anywhere; the addon is loaded from bindings-node (ONCELY_NODE_DIR overrides).
const net = require('node:net')
const path = require('node:path')
const readline = require('node:readline')

const dir = process.env.ONCELY_NODE_DIR || path.join(__dirname, '..', '..', 'bindings-node')
const { RedisStore, scope, fingerprint } = require(dir)

const [NAME, REDIS_URL, PREFIX, LEASE] = process.argv.slice(2)
const u = new URL(REDIS_URL)
const HOST = u.hostname || '127.0.0.1'
const PORT = Number(u.port || 6379)

function incr (counter) {
  return new Promise((resolve, reject) => {
    const sock = net.createConnection({ host: HOST, port: PORT })
    let buf = ''
    sock.setEncoding('utf8')
    sock.on('connect', () => {
      const c = Buffer.from(counter)
      sock.write(`*2\r\n$4\r\nINCR\r\n$${c.length}\r\n${counter}\r\n`)
    })
    sock.on('data', (d) => {
      buf += d
      const i = buf.indexOf('\r\n')
      if (i < 0) return
      sock.destroy()
      const line = buf.slice(0, i)
      if (line[0] !== ':') reject(new Error(`INCR ${counter}: ${line}`))
      else resolve(Number(line.slice(1)))
    })
    sock.on('error', reject)
  })
}

const emit = (obj) => process.stdout.write(JSON.stringify(obj) + '\n')
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))

const CLUSTER_URLS = (process.env.ONCELY_E2E_CLUSTER_URLS || '').split(' ').filter(Boolean)
const leaseMs = Math.round(Number(LEASE) * 1000)
const store = CLUSTER_URLS.length
  ? new RedisStore({ urls: CLUSTER_URLS, cluster: true, leaseMs, prefix: PREFIX })
  : new RedisStore({ url: REDIS_URL, leaseMs, prefix: PREFIX })

async function runJob (job) {
  const action = async () => {
    const n = await incr(job.effect)
    if (job.hold_ms) await sleep(job.hold_ms)
    return { key: job.key, by: NAME, n }
  }
  try {
    const done = await store.execute(scope('e2e', 'Fleet', job.key), fingerprint(job.payload), action,
      { wait: job.wait !== false })
    emit({ id: job.id, worker: NAME, ok: true, value: done.value, source: done.source })
  } catch (err) {
    emit({ id: job.id, worker: NAME, ok: false, error: err && err.kind, code: err && err.code, message: String(err && err.message) })
  }
}

const rl = readline.createInterface({ input: process.stdin })
rl.on('line', (line) => { if (line.trim()) runJob(JSON.parse(line)) })
emit({ ready: NAME })
