'use strict'
// The async context that tells a lead's own calls apart (re-entry) is switched off once no
// lead has run for a while and on again by the next lead: a lead's async continuations
// still know it, whatever ended meanwhile, and nothing waits for itself.
const test = require('node:test')
const assert = require('node:assert/strict')
const { setTimeout: sleep } = require('node:timers/promises')
const { IdempotencyStore, scope } = require('oncely')
const { idempotency } = require('oncely/express')
const { contextOn, CONTEXT_IDLE_MS } = require('../lib/store.js')
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

/** Resolves once the context is off (no lead for CONTEXT_IDLE_MS, checked each CONTEXT_IDLE_MS). */
async function contextOff() {
  const until = Date.now() + 3 * CONTEXT_IDLE_MS
  while (contextOn()) {
    assert.ok(Date.now() < until, 'the context stays on with no lead running')
    await sleep(50)
  }
}

test('the context is on while a lead runs, stays on while leads keep coming, and goes off once none has run for a while', async () => {
  const store = new IdempotencyStore()
  await contextOff()
  let during
  await store.execute(key('b'), 'fp', async () => {
    await sleep(1)
    during = contextOn()
  })
  assert.equal(during, true)
  // Leads keep coming for longer than the idle time: it stays on.
  const until = Date.now() + CONTEXT_IDLE_MS * 1.5
  for (let i = 0; Date.now() < until; i++) {
    await store.execute(key(`busy${i}`), 'fp', () => i)
    assert.equal(contextOn(), true)
    await sleep(CONTEXT_IDLE_MS / 10)
  }
  // Off within two idle periods of the last lead.
  await contextOff()
})

test('a lead that starts after every other lead ended (context off) still refuses its own call', async () => {
  const store = new IdempotencyStore()
  for (let i = 0; i < 3; i++) await store.execute(key(`s${i}`), 'fp', () => i)
  await contextOff()
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
  await contextOff()
})

test('a failed lead and a thrown lead count as ended', async () => {
  const store = new IdempotencyStore()
  await assert.rejects(store.execute(key('f1'), 'fp', async () => { throw new Error('x') }))
  await assert.rejects(store.execute(key('f2'), 'fp', () => { throw new Error('y') }))
  await contextOff()
})

test('express: after synchronous first calls and the context switched off, a handler that injects its own key after an await is refused', async () => {
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
  }
  await contextOff()
  const outer = await within(
    inject(app, { method: 'POST', url: '/orders', headers: { 'idempotency-key': 'context-key-1', 'content-type': 'application/json' }, payload: '{"item":1}' }),
    4000,
  )
  assert.notEqual(outer, 'hang')
  assert.equal(JSON.parse(outer.payload).inner, 500)
  assert.equal(calls, 1)
  await contextOff()
})
