'use strict'
// The async context that tells a lead's own calls apart (re-entry) is on exactly while a
// lead runs: switched off when the last running lead ends and on again by the next lead.
// A lead's async continuations still know it, whatever ended meanwhile, and nothing waits
// for itself.
const test = require('node:test')
const assert = require('node:assert/strict')
const { setTimeout: sleep } = require('node:timers/promises')
const { IdempotencyStore, scope } = require('oncely')
const { idempotency } = require('oncely/express')
const { contextOn, acting } = require('../lib/store.js')
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

/** The context is off: no lead runs, and a continuation made during a finished lead no longer sees it. */
async function contextOff() {
  assert.equal(contextOn(), false, 'a lead still counts as running')
  assert.equal(acting.getStore(), undefined)
}

test('the context is on while a lead runs and off once the last running lead ends', async () => {
  const store = new IdempotencyStore()
  await contextOff()
  let during
  let later
  const seen = new Promise((resolve) => {
    later = resolve
  })
  await store.execute(key('b'), 'fp', async () => {
    await sleep(1)
    during = [contextOn(), acting.getStore()?.key]
    // Runs after the lead has ended, in its async context.
    setTimeout(() => later(acting.getStore()), 20)
  })
  assert.deepEqual(during, [true, key('b')])
  await contextOff()
  // The context was switched off: the lead's continuation no longer sees the (ended) lead.
  assert.equal(await seen, undefined)
  // Two overlapping leads: on until the second ends.
  let release
  const slow = store.execute(key('slow'), 'fp', () => new Promise((r) => { release = r }))
  await store.execute(key('quick'), 'fp', async () => 'q')
  assert.equal(contextOn(), true)
  release('s')
  assert.equal((await slow).value, 's')
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

test('a finished lead keeps no request\'s async context alive', async () => {
  const { AsyncLocalStorage } = require('node:async_hooks')
  const v8 = require('node:v8')
  const vm = require('node:vm')
  await contextOff()
  const requestContext = new AsyncLocalStorage()
  const store = new IdempotencyStore()
  let held
  await requestContext.run({ body: Buffer.alloc(1 << 20) }, async () => {
    held = new WeakRef(requestContext.getStore())
    await store.execute(key('ctx-first'), 'fp', async () => 1)
  })
  for (let i = 0; i < 5; i++) await store.execute(key(`ctx${i}`), 'fp', () => i)
  v8.setFlagsFromString('--expose-gc')
  const gc = vm.runInNewContext('gc')
  gc()
  await sleep(10)
  gc()
  assert.equal(held.deref(), undefined, 'the request context is still held')
})
