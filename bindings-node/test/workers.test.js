'use strict'
// The addon in worker threads: each worker has its own environment, stores and retry
// loops; terminating a worker with flights still running (references, deferreds and
// the store's threadsafe function alive) must not crash the process. A hang fails
// through the timeout.
const test = require('node:test')
const assert = require('node:assert/strict')
const { Worker } = require('node:worker_threads')

const body = `
const { parentPort, workerData } = require('node:worker_threads')
const o = require(workerData.pkg)
;(async () => {
  const store = new o.IdempotencyStore()
  const k = o.scope('a', 'b', o.newKey())
  const calls = []
  const rs = await Promise.all(Array.from({ length: 100 }, () => store.execute(k, 'fp', async () => { calls.push(1); await new Promise((r) => setTimeout(r, 5)); return { v: 1 } })))
  const v = await o.retry(async (a) => { if (a.number < 2) throw Object.assign(new Error(), { code: 'ECONNRESET' }); return a.number }, { safe: true, policy: { baseDelayMs: 0, maxDelayMs: 0 } })
  if (workerData.leavePending) {
    for (let i = 0; i < 50; i++) {
      const p = o.scope('a', 'b', o.newKey())
      store.execute(p, 'fp', () => new Promise(() => {}))
      store.execute(p, 'fp', async () => 2)
    }
  }
  parentPort.postMessage({ same: rs.every((r) => r.value === rs[0].value), calls: calls.length, v })
})()
`

function runWorker(leavePending) {
  return new Promise((resolve, reject) => {
    const w = new Worker(body, { eval: true, workerData: { pkg: require.resolve('oncely'), leavePending } })
    w.once('message', async (m) => {
      await w.terminate()
      resolve(m)
    })
    w.once('error', reject)
  })
}

test('stores and retry loops in 4 concurrent workers', { timeout: 60_000 }, async () => {
  const results = await Promise.all([1, 2, 3, 4].map(() => runWorker(false)))
  for (const r of results) assert.deepEqual(r, { same: true, calls: 1, v: 2 })
})

test('terminating workers with flights still running', { timeout: 60_000 }, async () => {
  for (let i = 0; i < 10; i++) assert.equal((await runWorker(true)).same, true)
})
