'use strict'
// RedisStore on a Redis Cluster (3 masters, 3 replicas).
//
// The cluster tests read ONCELY_REDIS_CLUSTER_URLS and are skipped without it: run them
// with scripts/test-redis, which starts a throwaway cluster (scripts/with-redis-cluster).
// The checks of the settings need no Redis.
const test = require('node:test')
const assert = require('node:assert/strict')

const { RedisStore, scope, newKey } = require('oncely')

const URLS = (process.env.ONCELY_REDIS_CLUSTER_URLS || '').split(/\s+/).filter(Boolean)
const needsCluster = URLS.length ? {} : { skip: 'needs a Redis Cluster: run scripts/test-redis' }

const key = () => scope('acme', 'CreateOrder', newKey())
const clusterStore = (prefix, options) => new RedisStore({ urls: URLS.slice(0, 3), cluster: true, prefix, ...options })

test('every key runs once across instances and slots', needsCluster, async () => {
  const prefix = `nodetest-${newKey()}`
  const stores = [clusterStore(prefix), clusterStore(prefix), clusterStore(prefix)]
  const keys = Array.from({ length: 30 }, key)
  const runs = keys.map(() => 0)
  const calls = []
  for (let t = 0; t < 6; t++) {
    for (let j = 0; j < keys.length; j++) {
      const i = (j * 7 + t * 11) % keys.length
      calls.push(
        stores[t % stores.length].execute(keys[i], 'fp', async () => {
          runs[i]++
          await new Promise((r) => setTimeout(r, 2))
          return { i }
        }).then((done) => assert.deepEqual(done.value, { i })),
      )
    }
  }
  await Promise.all(calls)
  assert.deepEqual(runs, keys.map(() => 1))
  // Reached through any one seed, each record is replayed from its slot's master.
  const oneSeed = new RedisStore({ url: URLS[2], cluster: true, prefix })
  for (const [i, k] of keys.entries()) {
    const done = await oneSeed.execute(k, 'fp', () => 'again')
    assert.deepEqual([done.value, done.source], [{ i }, 'replayed'])
  }
})

test('minReplicas waits for the replicas; a claim they cannot acknowledge runs nothing', needsCluster, async () => {
  const prefix = `nodetest-${newKey()}`
  // A generous window: a loaded machine may take a while to acknowledge (the test
  // checks that the acknowledgement comes, not how fast).
  const one = clusterStore(prefix, { minReplicas: 1, minReplicasTimeoutMs: 800 })
  let runs = 0
  const action = () => {
    runs++
    return 'v'
  }
  const got = await Promise.all(Array.from({ length: 5 }, () => one.execute(key(), 'fp', action)))
  assert.deepEqual(got.map((g) => g.value), ['v', 'v', 'v', 'v', 'v'])
  assert.equal(one.counters().completionsUnreplicated, 0)
  const two = clusterStore(prefix, { minReplicas: 2, minReplicasTimeoutMs: 200 })
  await assert.rejects(two.execute(key(), 'fp', action), (e) => e.code === 'UNAVAILABLE')
  assert.equal(runs, 5)
  assert.equal(two.counters().claimsUnreplicated, 1)
})

test('topology settings are checked', () => {
  assert.throws(() => new RedisStore({ urls: ['redis://127.0.0.1:1', 'redis://127.0.0.1:2'] }), (e) => e.code === 'INVALID_ARGUMENT')
  assert.throws(() => new RedisStore({ url: 'redis+sentinel://127.0.0.1:1/m', cluster: true }), (e) => e.code === 'INVALID_ARGUMENT')
  assert.throws(() => new RedisStore({ urls: [] }), TypeError)
  assert.throws(() => new RedisStore({ url: 'redis://127.0.0.1:1', urls: ['redis://127.0.0.1:2'] }), TypeError)
  assert.throws(() => new RedisStore({ url: 'redis://127.0.0.1:1', minReplicas: 1, minReplicasTimeoutMs: 5000 }), (e) => e.code === 'INVALID_ARGUMENT')
  new RedisStore({ url: 'redis+sentinel://127.0.0.1:1,127.0.0.1:2/m' })
  new RedisStore({ urls: ['redis://127.0.0.1:1', 'redis://127.0.0.1:2'], sentinel: 'm' })
  new RedisStore({ urls: ['redis://127.0.0.1:1', 'redis://127.0.0.1:2'], cluster: true })
})
