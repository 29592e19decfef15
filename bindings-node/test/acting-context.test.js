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

test('a global setTimeout whose handles have no unref (jsdom, fake timers): every lead still settles its key', async () => {
  await contextOff()
  const realSetTimeout = globalThis.setTimeout
  const store = new IdempotencyStore()
  let runs = 0
  globalThis.setTimeout = (fn, ms, ...args) => {
    realSetTimeout(fn, ms, ...args)
    return 7
  }
  let first
  try {
    first = await store.execute(key('nounref'), 'fp', async () => {
      runs++
      await null
      return 'charged'
    })
  } finally {
    globalThis.setTimeout = realSetTimeout
  }
  assert.equal(first.value, 'charged')
  const again = await within(store.execute(key('nounref'), 'fp', () => runs++), 1000)
  assert.notEqual(again, 'hang')
  assert.equal(again.source, 'replayed')
  assert.equal(runs, 1)
})

test('a lead started from a finished lead\'s work does not keep it as its parent: the chain stays short', async () => {
  const { acting } = require('../lib/store.js')
  const store = new IdempotencyStore()
  const depths = []
  await new Promise((resolve) => {
    const job = (i) =>
      store.execute(key(`chain${i}`), 'fp', () => {
        let d = 0
        for (let f = acting.getStore(); f !== undefined; f = f.parent) d++
        depths.push(d)
        if (i < 100) setTimeout(() => job(i + 1), 1)
        else setImmediate(resolve)
        return i
      })
    job(0)
  })
  assert.equal(Math.max(...depths), 1)
})

test('the idle check keeps no request\'s async context alive', async () => {
  const { AsyncLocalStorage } = require('node:async_hooks')
  const v8 = require('node:v8')
  const vm = require('node:vm')
  await contextOff()
  const requestContext = new AsyncLocalStorage()
  const store = new IdempotencyStore()
  let held
  await requestContext.run({ body: Buffer.alloc(1 << 20) }, async () => {
    held = new WeakRef(requestContext.getStore())
    // The last lead to end arms the idle check here.
    await store.execute(key('ctx-first'), 'fp', async () => 1)
  })
  const until = Date.now() + 1.5 * CONTEXT_IDLE_MS
  for (let i = 0; Date.now() < until; i++) {
    await store.execute(key(`ctx${i}`), 'fp', () => i)
    await sleep(CONTEXT_IDLE_MS / 5)
  }
  v8.setFlagsFromString('--expose-gc')
  const gc = vm.runInNewContext('gc')
  gc()
  await sleep(10)
  gc()
  assert.equal(held.deref(), undefined, 'the request context is still held')
})
