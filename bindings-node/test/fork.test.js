'use strict'
// RedisStore across Node processes (child_process) and worker threads: each has its
// own store (Node never forks a running process), and a shared key runs once across all
// of them while the parent's store keeps working. A hang fails through the timeout.
//
// Reads ONCELY_REDIS_URL and is skipped without it: run it with scripts/test-redis,
// which starts a throwaway redis-server.
const test = require('node:test')
const assert = require('node:assert/strict')
const { spawn } = require('node:child_process')
const { Worker } = require('node:worker_threads')

const { RedisStore, scope, newKey, fingerprint } = require('oncely')

const URL = process.env.ONCELY_REDIS_URL
const needsRedis = URL ? {} : { skip: 'needs a Redis: run scripts/test-redis' }

// One caller's work, in the parent, a child process or a worker (its source is sent to
// them): every shared key (three concurrent calls each) and one own key.
async function work(pkg, url, prefix, shared, name) {
  const o = require(pkg)
  const store = new o.RedisStore({ url, prefix })
  const fp = o.fingerprint({ sku: 'A1' })
  const calls = []
  for (const k of shared) {
    for (let i = 0; i < 3; i++) {
      calls.push(
        store
          .execute(o.scope('acme', 'Shared', k), fp, async () => {
            await new Promise((r) => setTimeout(r, 20))
            return { by: name, key: k }
          })
          .then((r) => ({ k, value: r.value, source: r.source })),
      )
    }
  }
  const own = await store.execute(o.scope('acme', 'Own', o.newKey()), fp, async () => name)
  const results = await Promise.all(calls)
  return { own: own.source, results }
}

const PKG = require.resolve('oncely')

function workHere(prefix, shared, name) {
  return work(PKG, URL, prefix, shared, name)
}

function inChildProcess(prefix, shared, name) {
  const script = `${work}
process.once('message', async (m) => {
  process.send(await work(m.pkg, m.url, m.prefix, m.shared, m.name))
  process.disconnect()
})`
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, ['-e', script], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] })
    let result
    child.once('error', reject)
    child.once('message', (m) => { result = m })
    child.once('exit', (code) => (code === 0 && result ? resolve(result) : reject(new Error(`child exited with ${code}`))))
    child.send({ pkg: PKG, url: URL, prefix, shared, name })
  })
}

function inWorker(prefix, shared, name) {
  const script = `${work}
const { parentPort, workerData: d } = require('node:worker_threads')
work(d.pkg, d.url, d.prefix, d.shared, d.name).then((r) => parentPort.postMessage(r))`
  return new Promise((resolve, reject) => {
    const w = new Worker(script, { eval: true, workerData: { pkg: PKG, url: URL, prefix, shared, name } })
    w.once('message', async (m) => {
      await w.terminate()
      resolve(m)
    })
    w.once('error', reject)
  })
}

/** Each shared key led exactly once across everyone, and everyone got one value. */
function checkOnce(all, shared) {
  for (const k of shared) {
    const calls = all.flatMap((r) => r.results.filter((x) => x.k === k))
    assert.equal(calls.length, 3 * all.length)
    assert.equal(calls.filter((x) => x.source === 'led').length, 1, `${k} ran more than once`)
    assert.equal(new Set(calls.map((x) => JSON.stringify(x.value))).size, 1)
  }
  for (const r of all) assert.equal(r.own, 'led')
}

test('child_process.fork: children and the parent share keys, each runs once', { ...needsRedis, timeout: 60_000 }, async () => {
  const prefix = `nodetest-${newKey()}`
  const shared = Array.from({ length: 5 }, () => newKey())
  const parent = new RedisStore({ url: URL, prefix })
  const warm = await parent.execute(scope('acme', 'Warm', newKey()), fingerprint({}), async () => 'warm')
  assert.equal(warm.source, 'led')
  const all = await Promise.all([
    workHere(prefix, shared, 'parent'),
    ...[1, 2, 3].map((n) => inChildProcess(prefix, shared, `child-${n}`)),
  ])
  checkOnce(all, shared)
  const again = await parent.execute(scope('acme', 'Shared', shared[0]), fingerprint({ sku: 'A1' }), async () => 'again')
  assert.equal(again.source, 'replayed')
})

test('worker_threads: workers and the main thread share keys, each runs once', { ...needsRedis, timeout: 60_000 }, async () => {
  const prefix = `nodetest-${newKey()}`
  const shared = Array.from({ length: 5 }, () => newKey())
  const all = await Promise.all([
    workHere(prefix, shared, 'main'),
    ...[1, 2, 3, 4].map((n) => inWorker(prefix, shared, `worker-${n}`)),
  ])
  checkOnce(all, shared)
})
