'use strict'
// Results that are "no value" in the in-process store: `undefined` is a result like any
// other (run once, replayed as undefined).
const test = require('node:test')
const assert = require('node:assert/strict')

const { IdempotencyStore, scope, newKey, fingerprint } = require('oncely')

test('undefined is a result in the memory store: run once, replayed as undefined', async () => {
  const store = new IdempotencyStore()
  const k = scope('acme', 'Notify', newKey())
  const fp = fingerprint({ op: 'notify' })
  let runs = 0
  const action = async () => {
    runs++
    await new Promise((r) => setTimeout(r, 20))
  }
  const done = await Promise.all([1, 2, 3].map(() => store.execute(k, fp, action)))
  assert.deepEqual(done.map((d) => d.value), [undefined, undefined, undefined])
  const again = await store.execute(k, fp, action)
  assert.equal(again.source, 'replayed')
  assert.equal(again.value, undefined)
  assert.equal(runs, 1)
})
