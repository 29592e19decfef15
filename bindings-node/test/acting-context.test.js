'use strict'
// The async context that tells a lead's own calls apart (re-entry) is switched off while
// no lead runs and on again by the next lead: a lead's async continuations still know
// it, whatever ended meanwhile, and nothing waits for itself.
const test = require('node:test')
const assert = require('node:assert/strict')
const { setTimeout: sleep } = require('node:timers/promises')
const { IdempotencyStore, scope } = require('oncely')
const { idempotency } = require('oncely/express')
const { contextOn } = require('../lib/store.js')
const inject = require('light-my-request')
const express = require('express')

const key = (k) => scope('t', 'M', `context-key-${k}`)

function within(p, ms) {
  let t
  return Promise.race([p, new Promise((r) => { t = setTimeout(() => r('hang'), ms) })]).finally(() => clearTimeout(t))
}

/** Calls its own key after `ms`: the call must be refused as re-entrant. */
function reentering(store, k, ms) {
  return async () => {
    await sleep(ms)
    const r = await within(store.execute(k, 'fp', async () => 'inner').then(() => 'ran', (e) => e.kind), 2000)
    return r
  }
}

test('the context is off between leads and on while one runs', async () => {
  const store = new IdempotencyStore()
  await store.execute(key('a'), 'fp', () => 1)
  assert.equal(contextOn(), false)
  let during
  await store.execute(key('b'), 'fp', async () => {
    await sleep(1)
    during = contextOn()
  })
  assert.equal(during, true)
  assert.equal(contextOn(), false)
})

test('a lead that starts after every other lead ended (context off) still refuses its own call', async () => {
  const store = new IdempotencyStore()
  for (let i = 0; i < 3; i++) await store.execute(key(`s${i}`), 'fp', () => i)
  assert.equal(contextOn(), false)
  const r = await store.execute(key('x'), 'fp', reentering(store, key('x'), 5))
  assert.equal(r.value, 'reentrant')
})

test('a lead whose neighbours end while it waits keeps its context', async () => {
  const store = new IdempotencyStore()
  // The neighbour ends first (the count falls, not to zero), then the long lead re-enters.
  const long = store.execute(key('long'), 'fp', reentering(store, key('long'), 30))
  const short = store.execute(key('short'), 'fp', async () => { await sleep(1); return 's' })
  assert.equal((await short).value, 's')
  assert.equal((await long).value, 'reentrant')
  assert.equal(contextOn(), false)
})

test('many leads ending in any order: every one refuses its own call, none hangs, the context ends off', async () => {
  const store = new IdempotencyStore()
  let seed = 7
  const rand = () => ((seed = (seed * 1103515245 + 12345) % 2147483648) % 20)
  const runs = []
  for (let i = 0; i < 60; i++) {
    runs.push(store.execute(key(`m${i}`), 'fp', reentering(store, key(`m${i}`), rand())))
    // Synchronous leads in between: each one ends at once.
    if (i % 3 === 0) runs.push(store.execute(key(`q${i}`), 'fp', () => 'reentrant'))
    if (i % 7 === 0) await sleep(rand())
  }
  for (const r of await Promise.all(runs)) assert.equal(r.value, 'reentrant')
  assert.equal(contextOn(), false)
})

test('a failed lead and a thrown lead count as ended', async () => {
  const store = new IdempotencyStore()
  await assert.rejects(store.execute(key('f1'), 'fp', async () => { throw new Error('x') }))
  await assert.rejects(store.execute(key('f2'), 'fp', () => { throw new Error('y') }))
  assert.equal(contextOn(), false)
})

test('express: after synchronous first calls (each switching the context off), a handler that injects its own key after an await is refused', async () => {
  const store = new IdempotencyStore()
  const app = express()
  app.set('env', 'test')
  let calls = 0
  app.use(express.json())
  app.use(idempotency({ store }))
  app.post('/sync', (req, res) => res.status(201).json({ ok: true }))
  app.post('/orders', async (req, res) => {
    calls++
    await sleep(2)
    const r = await within(
      inject(app, { method: 'POST', url: '/orders', headers: { 'idempotency-key': req.headers['idempotency-key'], 'content-type': 'application/json' }, payload: '{"item":1}' }),
      2000,
    )
    res.status(201).json({ inner: r === 'hang' ? 'hang' : r.statusCode })
  })
  for (let i = 0; i < 5; i++) {
    const r = await inject(app, { method: 'POST', url: '/sync', headers: { 'idempotency-key': `sync-key-${i}`, 'content-type': 'application/json' }, payload: '{}' })
    assert.equal(r.statusCode, 201)
    assert.equal(contextOn(), false)
  }
  const outer = await within(
    inject(app, { method: 'POST', url: '/orders', headers: { 'idempotency-key': 'context-key-1', 'content-type': 'application/json' }, payload: '{"item":1}' }),
    4000,
  )
  assert.notEqual(outer, 'hang')
  assert.equal(JSON.parse(outer.payload).inner, 500)
  assert.equal(calls, 1)
  assert.equal(contextOn(), false)
})
