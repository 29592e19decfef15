'use strict'
// IdempotencyStore[RUN], the server adapters' entry into the in-process store, and the
// scoped key http.request leaves for the next begin.
const test = require('node:test')
const assert = require('node:assert/strict')
const v8 = require('node:v8')
const vm = require('node:vm')
const { IdempotencyStore, http } = require('oncely')
const { RUN } = require('../lib/store.js')

v8.setFlagsFromString('--expose-gc')
const gc = vm.runInNewContext('gc')
const delay = (ms) => new Promise((r) => setTimeout(r, ms))
let n = 0
const key = () => http.scope('t', 'POST', '/r', `run-key-${n++}`)
const fp = 'f'.repeat(64)

test('RUN: a leader that returns at once settles the key before RUN returns; the next RUN replays synchronously', () => {
  const store = new IdempotencyStore()
  const k = key()
  const value = new Uint8Array([1, 2, 3])
  const a = store[RUN](k, fp, () => value, true)
  assert.deepEqual(a, { value, replayed: false, source: 'led' })
  const b = store[RUN](k, fp, () => assert.fail('ran twice'), true)
  assert.equal(b.value, value)
  assert.equal(b.source, 'replayed')
})

test('RUN: a leader that throws at once releases the key (the next caller leads); waiters of an async failure are rejected', async () => {
  const store = new IdempotencyStore()
  const k = key()
  assert.throws(() => store[RUN](k, fp, () => { throw new Error('sync') }, true), /sync/)
  assert.equal(store[RUN](k, fp, () => 'second', true).source, 'led')
  const k2 = key()
  let fail
  const leader = store[RUN](k2, fp, () => new Promise((_, rej) => { fail = rej }), true)
  const waiters = Array.from({ length: 100 }, () => store[RUN](k2, fp, () => assert.fail('joined ran'), true))
  fail(new Error('late'))
  await assert.rejects(leader, /late/)
  for (const w of waiters) await assert.rejects(w, /late/)
  assert.equal(store.pendingWaiters, 0)
})

test('RUN: a RUN leader collected unsettled lets a RUN waiter and an execute waiter take over (one of them leads)', async () => {
  const store = new IdempotencyStore()
  const k = key()
  ;(() => {
    store[RUN](k, fp, () => new Promise(() => {}), true)
  })()
  let runs = 0
  const w1 = store[RUN](k, fp, () => { runs++; return 'by RUN waiter' }, true)
  const w2 = store.execute(k, fp, async () => { runs++; return 'by execute waiter' })
  let settled = 0
  w1.then(() => settled++, () => settled++)
  w2.then(() => settled++, () => settled++)
  for (let i = 0; i < 100 && settled < 2; i++) {
    gc()
    await delay(5)
  }
  assert.equal(settled, 2, 'a waiter of a collected leader hangs')
  const [a, b] = [await w1, await w2]
  assert.equal(runs, 1)
  assert.equal(a.value, b.value)
})

test('RUN: an execute leader collected unsettled lets RUN waiters take over', async () => {
  const store = new IdempotencyStore()
  const k = key()
  ;(() => {
    store.execute(k, fp, () => new Promise(() => {}))
  })()
  let runs = 0
  const ws = Array.from({ length: 10 }, () => store[RUN](k, fp, () => { runs++; return 'taken' }, true))
  let settled = 0
  for (const w of ws) w.then(() => settled++, () => settled++)
  for (let i = 0; i < 100 && settled < ws.length; i++) {
    gc()
    await delay(5)
  }
  assert.equal(settled, ws.length, 'a waiter of a collected leader hangs')
  assert.equal(runs, 1)
})

test('RUN: wait=false while in progress throws at once; a fingerprint mismatch throws at once', async () => {
  const store = new IdempotencyStore()
  const k = key()
  let done
  const leader = store[RUN](k, fp, () => new Promise((r) => { done = r }), true)
  assert.throws(() => store[RUN](k, fp, () => 1, false), { code: 'ABORTED' })
  assert.throws(() => store[RUN](k, 'e'.repeat(64), () => 1, true), (e) => e.httpStatus === 422)
  done('v')
  assert.equal((await leader).value, 'v')
  assert.equal(store[RUN](k, fp, () => 1, false).value, 'v')
})

test('the scoped key http.request stashes is taken only by a begin of the same text, on any store', () => {
  const a = new IdempotencyStore()
  const b = new IdempotencyStore()
  const cfg = new http.HttpConfig({})
  const made = http.request('tenant:a', 'POST', '/r', 'order-stash-0001', '/r', 'application/json', '{}')
  assert.ok(Array.isArray(made))
  const [scoped] = made
  // Another key's begin first: the stash must not be given to it.
  const other = http.scope('tenant:a', 'POST', '/r', 'order-stash-0002')
  assert.equal(a[RUN](other, fp, () => 'other', true).value, 'other')
  assert.equal(b[RUN](scoped, fp, () => 'b', true).value, 'b')
  assert.equal(a[RUN](scoped, fp, () => 'a', true).value, 'a', 'store a has its own entry for the key')
  assert.equal(a[RUN](other, fp, () => 'x', true).value, 'other')
  assert.equal(b[RUN](scoped, fp, () => 'x', true).value, 'b')
  void cfg
})

test('RUN: leads nested in a lead that answers at once (sync in sync, async in sync) each settle their own key', async () => {
  const store = new IdempotencyStore()
  const [outer, inner, late] = [key(), key(), key()]
  let release
  const r = store[RUN](outer, fp, () => {
    const a = store[RUN](inner, fp, () => 'inner', true)
    const b = store[RUN](late, fp, () => new Promise((res) => { release = res }), true)
    return { a: a.value, b: b instanceof Promise }
  }, true)
  assert.deepEqual(r.value, { a: 'inner', b: true })
  assert.equal(store[RUN](outer, fp, () => assert.fail('ran twice'), true).source, 'replayed')
  assert.equal(store[RUN](inner, fp, () => assert.fail('ran twice'), true).value, 'inner')
  const waiter = store[RUN](late, fp, () => assert.fail('joined ran'), true)
  release('late')
  assert.equal((await waiter).value, 'late')
  assert.equal(store[RUN](late, fp, () => assert.fail('ran twice'), true).source, 'replayed')
})

test('RUN: whatever throws before a lead that answered at once is settled (a `then` getter), the key is given up at once: the next caller leads', async () => {
  const store = new IdempotencyStore()
  const k = key()
  const poisoned = {
    // biome-ignore lint/suspicious/noThenProperty: a value whose `then` throws when read, on purpose
    get then() {
      throw new Error('then getter')
    },
  }
  assert.throws(() => store[RUN](k, fp, () => poisoned, true), /then getter/)
  assert.equal(store[RUN](k, fp, () => 'second', true).source, 'led')
  // Nested: the inner lead's poisoned value does not disturb the outer lead's lease.
  const [outer, inner] = [key(), key()]
  const r = store[RUN](outer, fp, () => {
    assert.throws(() => store[RUN](inner, fp, () => poisoned, true), /then getter/)
    return 'outer'
  }, true)
  assert.equal(r.value, 'outer')
  assert.equal(store[RUN](outer, fp, () => assert.fail('ran twice'), true).value, 'outer')
  assert.equal(store[RUN](inner, fp, () => 'again', true).source, 'led')
})

test('RUN: random nesting of leads that return, throw, fail later or succeed later: every key settles once, none is left held', async () => {
  const store = new IdempotencyStore()
  let seed = 11
  const rand = (m) => (seed = (seed * 1103515245 + 12345) % 2147483648) % m
  const pending = []
  const outcome = new Map()
  const lead = (depth) => {
    const k = key()
    const kind = rand(4)
    let r
    try {
      r = store[RUN](k, fp, () => {
        if (depth < 4) for (let i = rand(3); i > 0; i--) lead(depth + 1)
        if (kind === 0) return `v-${k}`
        if (kind === 1) throw new Error(`e-${k}`)
        return delay(rand(5)).then(() => {
          if (kind === 2) return `v-${k}`
          throw new Error(`e-${k}`)
        })
      }, true)
    } catch {
      outcome.set(k, 'failed')
      return
    }
    if (r instanceof Promise) {
      pending.push(r.then(() => outcome.set(k, 'stored'), () => outcome.set(k, 'failed')))
    } else {
      outcome.set(k, 'stored')
    }
  }
  for (let i = 0; i < 200; i++) lead(0)
  await Promise.all(pending)
  assert.ok(outcome.size > 200)
  for (const [k, o] of outcome) {
    let ran = false
    const again = store[RUN](k, fp, () => {
      ran = true
      return 'again'
    }, true)
    // A stored value replays; a failed lead left the key free (not held).
    assert.equal(ran, o === 'failed', `${k}: ${o}`)
    assert.equal(again.source, o === 'failed' ? 'led' : 'replayed')
  }
})

test('RUN: an error code getter that leads another key of the same store while the failed lead is settled: every key settles as it should', async () => {
  const store = new IdempotencyStore({ cachePermanentFailures: true })
  const [outer, inGetter, later] = [key(), key(), key()]
  const err = new Error('outer failed')
  Object.defineProperty(err, 'code', {
    get() {
      store[RUN](inGetter, fp, () => 'from getter', true)
      return undefined
    },
  })
  assert.throws(() => store[RUN](outer, fp, () => { throw err }, true), /outer failed/)
  // Cached (cachePermanentFailures): the next caller gets the failure, the action does not run.
  assert.throws(() => store[RUN](outer, fp, () => assert.fail('ran twice'), false), /outer failed/)
  assert.equal(store[RUN](inGetter, fp, () => assert.fail('ran twice'), false).value, 'from getter')
  assert.equal(store[RUN](later, fp, () => 'later', true).source, 'led')
  assert.equal(store[RUN](later, fp, () => assert.fail('ran twice'), false).source, 'replayed')
})

test('RUN and execute: an action returning a Promise whose constructor getter throws fails (the key is free at once) and its lead ends', async () => {
  const { runningLeads } = require('../lib/store.js')
  for (const via of ['RUN', 'execute']) {
    const before = runningLeads()
    const store = new IdempotencyStore()
    const k = key()
    let runs = 0
    const action = () => {
      runs++
      const p = delay(5).then(() => 'value')
      Object.defineProperty(p, 'constructor', {
        get() {
          throw new Error('constructor getter')
        },
      })
      return p
    }
    const first = via === 'RUN' ? store[RUN](k, fp, action, true) : store.execute(k, fp, action)
    await assert.rejects(first, /constructor getter/, via)
    assert.equal(runningLeads(), before, via)
    assert.equal(store[RUN](k, fp, () => 'again', false).source, 'led', via)
    assert.equal(runs, 1, via)
  }
})

for (const via of ['RUN', 'execute']) {
  test(`${via}: an action's native Promise whose own then throws: the action fails, its key is free once that is known, and the lead ends`, async () => {
    const { runningLeads } = require('../lib/store.js')
    const before = runningLeads()
    const store = new IdempotencyStore()
    const k = key()
    let runs = 0
    const action = () => {
      runs++
      const p = delay(5).then(() => 'value')
      // biome-ignore lint/suspicious/noThenProperty: a Promise whose own then throws, on purpose
      p.then = () => {
        throw new Error('then call')
      }
      return p
    }
    const first = via === 'RUN' ? store[RUN](k, fp, action, true) : store.execute(k, fp, action)
    await assert.rejects(first, /then call/)
    // At once, not when the garbage collector frees a lease nobody holds.
    const r = store[RUN](k, fp, () => 'again', false)
    assert.deepEqual({ next: r.source, leadsLeft: runningLeads() - before, runs }, { next: 'led', leadsLeft: 0, runs: 1 })
  })
}

test('the held begin given no count of running leads gives up no held lease', () => {
  const { NativeStore } = require('../native.js')
  const { ABANDONED, LEAD } = require('../lib/store.js')
  const native = new NativeStore(undefined, ABANDONED, LEAD, [undefined])
  const begin = native.beginHeldFunction()
  const [a, b] = [key(), key()]
  assert.equal(begin(true, a, fp, 0), LEAD)
  // Without a count, the lease of `a` (whose call still runs) stays held.
  assert.equal(begin(true, b, fp), LEAD)
  native.completeHeld(2, 'b')
  native.completeHeld(1, 'a')
  // Both stored: each begins again as a replay (the index of its value).
  assert.equal(typeof begin(true, a, fp, 0), 'number')
  assert.equal(typeof begin(true, b, fp, 0), 'number')
})

test('RUN: a lead whose action never settles, its lease collected, stops counting as running (the context can go off)', async () => {
  const { runningLeads } = require('../lib/store.js')
  const before = runningLeads()
  const store = new IdempotencyStore()
  const k = key()
  ;(() => {
    store[RUN](k, fp, () => new Promise(() => {}), true)
  })()
  const waiter = store[RUN](k, fp, () => 'v', true)
  // The collected lease wakes the waiter through an unref'd callback: the timers keep the
  // process up until it has (on a loaded machine the finalizer can take a while).
  let settled = false
  waiter.then(
    () => {
      settled = true
    },
    () => {
      settled = true
    },
  )
  for (let i = 0; i < 2_000 && !(settled && runningLeads() === before); i++) {
    gc()
    await delay(5)
  }
  // The waiter took over and led.
  assert.equal((await waiter).value, 'v')
  assert.equal(runningLeads(), before)
})

// Last in this file: the overflowed calls' leads never end, so the re-entrancy context
// stays on for the rest of the process.
test('RUN: a stack overflow inside nested leads: the leases their calls could not settle are given up at the next begin; later leads run once and replay', async () => {
  const store = new IdempotencyStore()
  const keys = []
  const rec = () => {
    const k = key()
    keys.push(k)
    return store[RUN](k, fp, () => {
      try {
        rec()
      } catch {}
      return 'v'
    }, true)
  }
  try {
    rec()
  } catch {}
  const fresh = key()
  let runs = 0
  const first = store[RUN](fresh, fp, () => ++runs, true)
  assert.equal(first.source, 'led')
  assert.equal(store[RUN](fresh, fp, () => ++runs, true).source, 'replayed')
  assert.equal(runs, 1)
  // Every key of the overflow settled or was given up: none is held.
  for (const k of keys) {
    const r = store[RUN](k, fp, () => 'again', false)
    assert.ok(r.source === 'replayed' || r.source === 'led', `${k}: ${r.source}`)
  }
})
