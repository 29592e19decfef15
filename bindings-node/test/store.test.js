'use strict'
// IdempotencyStore: every rule of SPEC §6, over the core's MemoryStore.
const test = require('node:test')
const assert = require('node:assert/strict')
const v8 = require('node:v8')
const vm = require('node:vm')

const { IdempotencyStore, ManualClock, scope, newKey, fingerprint, Code } = require('oncely')

v8.setFlagsFromString('--expose-gc')
const gc = vm.runInNewContext('gc')

const fp = fingerprint({ sku: 'A1', qty: 1 })
const otherFp = fingerprint({ sku: 'A1', qty: 2 })
const key = () => scope('acme', 'CreateOrder', newKey())
const tick = () => new Promise((resolve) => setImmediate(resolve))
const delay = (ms) => new Promise((resolve) => setTimeout(resolve, ms))

function deferred() {
  let resolve, reject
  const promise = new Promise((res, rej) => {
    resolve = res
    reject = rej
  })
  return { promise, resolve, reject }
}

test('10,000 concurrent calls with one key run the action once and share one object', async () => {
  const store = new IdempotencyStore()
  const k = key()
  let calls = 0
  const gate = deferred()
  const results = []
  for (let i = 0; i < 10_000; i++) {
    results.push(
      store.execute(k, fp, async () => {
        calls += 1
        await gate.promise
        return { order: 'o-1' }
      }),
    )
  }
  assert.equal(calls, 1)
  assert.equal(store.pendingWaiters, 9_999)
  gate.resolve()
  const all = await Promise.all(results)
  assert.equal(calls, 1)
  const value = all[0].value
  assert.deepEqual(value, { order: 'o-1' })
  assert.ok(all.every((r) => r.value === value), 'every caller gets the same object')
  assert.deepEqual(all[0], { value, replayed: false, source: 'led' })
  assert.ok(all.slice(1).every((r) => r.replayed && r.source === 'joined'))
  assert.equal(store.pendingWaiters, 0)
  const c = store.counters()
  assert.equal(c.leads, 1)
  assert.equal(c.joins, 9_999)
})

test('a completed entry is replayed: the same object, the action not run again', async () => {
  const store = new IdempotencyStore()
  const k = key()
  const first = await store.execute(k, fp, async () => ({ order: 'o-1' }))
  assert.equal(first.source, 'led')
  assert.equal(first.replayed, false)
  let ran = false
  const again = await store.execute(k, fp, async () => {
    ran = true
  })
  assert.equal(ran, false)
  assert.equal(again.value, first.value)
  assert.equal(again.source, 'replayed')
  assert.equal(again.replayed, true)
  assert.deepEqual(store.counters(), { leads: 1, joins: 0, replays: 1, conflicts: 0, expirations: 0, evictions: 0 })
})

test('an action that returns at once settles its key before execute returns: the next call replays', async () => {
  const store = new IdempotencyStore()
  const k = key()
  const value = { order: 'o-1' }
  const led = store.execute(k, fp, () => value)
  // Not awaited: the key is already stored, so this call replays instead of joining.
  const again = store.execute(k, fp, () => assert.fail('the action ran twice'))
  assert.equal(store.pendingWaiters, 0)
  const [a, b] = await Promise.all([led, again])
  assert.equal(a.source, 'led')
  assert.equal(a.value, value)
  assert.equal(b.source, 'replayed')
  assert.equal(b.value, value)
  // A thenable (not a Promise) is still awaited, and a synchronous throw still fails.
  const k2 = key()
  // biome-ignore lint/suspicious/noThenProperty: a thenable that is not a Promise, on purpose
  const t = await store.execute(k2, fp, () => ({ then: (resolve) => resolve('from a thenable') }))
  assert.equal(t.value, 'from a thenable')
  const boom = new Error('boom')
  await assert.rejects(
    store.execute(key(), fp, () => {
      throw boom
    }),
    (e) => e === boom,
  )
  assert.deepEqual(store.counters(), { leads: 3, joins: 0, replays: 1, conflicts: 0, expirations: 0, evictions: 0 })
})

test('any value is kept as is: primitives, undefined, functions, symbols', async () => {
  const store = new IdempotencyStore()
  const fn = () => 1
  const sym = Symbol('s')
  for (const v of [undefined, null, 0, -0, NaN, 'text', '', true, 12n, fn, sym, [1, 2]]) {
    const k = key()
    const led = await store.execute(k, fp, async () => v)
    const replay = await store.execute(k, fp, async () => 'other')
    assert.ok(Object.is(led.value, v), `led ${String(v)}`)
    assert.ok(Object.is(replay.value, v), `replayed ${String(v)}`)
  }
})

test('a different fingerprint is FAILED_PRECONDITION, for a completed and for a running entry', async () => {
  const store = new IdempotencyStore()
  const k = key()
  await store.execute(k, fp, async () => 'done')
  await assert.rejects(store.execute(k, otherFp, async () => assert.fail('must not run')), {
    code: 'FAILED_PRECONDITION',
    kind: 'fingerprint_mismatch',
  })
  const running = key()
  const gate = deferred()
  const leader = store.execute(running, fp, () => gate.promise)
  await assert.rejects(store.execute(running, otherFp, async () => assert.fail('must not run')), (e) => {
    assert.ok(e instanceof Error)
    assert.equal(e.code, 'FAILED_PRECONDITION')
    return true
  })
  gate.resolve('ok')
  assert.equal((await leader).value, 'ok')
  assert.equal(store.counters().conflicts, 2)
})

test('TTL: a result expires after ttlMs (manual clock), then the action runs again', async () => {
  const clock = new ManualClock()
  const store = new IdempotencyStore({ ttlMs: 1_000, _clock: clock })
  assert.equal(store.ttlMs, 1_000)
  const k = key()
  let runs = 0
  const action = async () => ({ run: ++runs })
  const first = await store.execute(k, fp, action)
  clock.advance(999)
  assert.equal((await store.execute(k, fp, action)).value, first.value, 'still stored at 999 ms')
  clock.advance(1)
  const after = await store.execute(k, fp, action)
  assert.equal(after.source, 'led', 'expired at 1000 ms')
  assert.deepEqual(after.value, { run: 2 })
  assert.equal(store.counters().expirations, 1)
})

test('expired entries are swept on use: memory does not grow with keys ever seen', async () => {
  const clock = new ManualClock()
  const store = new IdempotencyStore({ ttlMs: 10, _clock: clock })
  for (let i = 0; i < 2_000; i++) {
    await store.execute(key(), fp, async () => i)
    clock.advance(10)
  }
  assert.ok(store.size < 10, `size ${store.size}`)
})

test('a failure is not cached: every waiter gets the same error, the next call runs again', async () => {
  const store = new IdempotencyStore()
  const k = key()
  const boom = new Error('boom')
  const gate = deferred()
  const leader = store.execute(k, fp, async () => {
    await gate.promise
    throw boom
  })
  // A waiter that retries at once, inside its catch, must lead a new run: the failed
  // entry is removed before waiters wake.
  const retried = store.execute(k, fp, async () => 'never').catch((e) => {
    assert.equal(e, boom)
    return store.execute(k, fp, async () => 'second run')
  })
  const waiters = Array.from({ length: 10 }, () => store.execute(k, fp, async () => 'never'))
  gate.resolve()
  await assert.rejects(leader, (e) => e === boom)
  for (const w of waiters) await assert.rejects(w, (e) => e === boom)
  const second = await retried
  assert.equal(second.value, 'second run')
  assert.equal(second.source, 'led')
  assert.equal((await store.execute(k, fp, async () => 'x')).value, 'second run')
})

test('an error passes through unchanged: non-Error values too', async () => {
  const store = new IdempotencyStore()
  for (const thrown of ['a string', 42, undefined, { custom: true }]) {
    const k = key()
    const gate = deferred()
    const leader = store.execute(k, fp, async () => {
      await gate.promise
      throw thrown
    })
    const waiter = store.execute(k, fp, async () => 'never')
    gate.resolve()
    for (const p of [leader, waiter]) {
      await p.then(
        () => assert.fail('must reject'),
        (e) => assert.ok(Object.is(e, thrown)),
      )
    }
  }
  // A synchronous throw in fn is the same.
  const sync = new TypeError('sync')
  await assert.rejects(
    store.execute(key(), fp, () => {
      throw sync
    }),
    (e) => e === sync,
  )
})

test('an aborted leader stops waiting; its action keeps the key, and a cooperative one stops when every caller has gone', async () => {
  const store = new IdempotencyStore()
  const k = key()
  const ac = new AbortController()
  let actionSignal
  const leader = store.execute(
    k,
    fp,
    ({ signal }) =>
      new Promise((resolve, reject) => {
        actionSignal = signal
        signal.addEventListener('abort', () => reject(signal.reason), { once: true })
      }),
    { signal: ac.signal },
  )
  const waiterAc = new AbortController()
  const waiter = store.execute(k, fp, async () => 'never', { signal: waiterAc.signal })
  await tick()
  ac.abort(new Error('client went away'))
  await assert.rejects(leader, { message: 'client went away' })
  assert.equal(actionSignal.aborted, false, 'a waiter is still there')
  assert.equal(store.counters().leads, 1, 'the waiter did not start a second copy')
  waiterAc.abort()
  await assert.rejects(waiter, { name: 'AbortError' })
  assert.equal(actionSignal.aborted, true)
  // The action rejected with its signal's reason: the key is free again.
  await tick()
  const next = await store.execute(k, fp, async () => 'next')
  assert.deepEqual(next, { value: 'next', replayed: false, source: 'led' })
  assert.equal(store.counters().leads, 2)
})

test('a leader collected by the garbage collector unsettled lets a waiter take over', async () => {
  const store = new IdempotencyStore()
  const k = key()
  // The leader awaits a promise that never settles and nothing references: the whole
  // chain, its lease included, becomes garbage.
  ;(() => {
    store.execute(k, fp, () => new Promise(() => {}))
  })()
  const waiter = store.execute(k, fp, async () => 'taken over')
  let settled = false
  waiter.then(() => (settled = true))
  for (let i = 0; i < 50 && !settled; i++) {
    gc()
    await delay(5)
  }
  const w = await waiter
  assert.equal(w.value, 'taken over')
  assert.equal(w.source, 'led')
})

test('a waiter aborted by its signal stops waiting; the leader is not affected', async () => {
  const store = new IdempotencyStore()
  const k = key()
  const gate = deferred()
  const leader = store.execute(k, fp, () => gate.promise)
  const ac = new AbortController()
  const waiter = store.execute(k, fp, async () => 'never', { signal: ac.signal })
  ac.abort()
  await assert.rejects(waiter, { name: 'AbortError' })
  gate.resolve('done')
  assert.equal((await leader).value, 'done')
  await assert.rejects(store.execute(k, fp, async () => 1, { signal: AbortSignal.abort() }), { name: 'AbortError' })
})

test('not waiting: ABORTED at once with retryAfterMs (409 + Retry-After)', async () => {
  const store = new IdempotencyStore({ inProgressRetryAfterMs: 2_500 })
  const k = key()
  const gate = deferred()
  const leader = store.execute(k, fp, () => gate.promise)
  await assert.rejects(store.execute(k, fp, async () => 'never', { wait: false }), (e) => {
    assert.ok(e instanceof Error)
    assert.equal(e.code, 'ABORTED')
    assert.equal(e.kind, 'in_progress')
    assert.equal(e.retryAfterMs, 2_500)
    return true
  })
  gate.resolve('v')
  await leader
  assert.equal((await store.execute(k, fp, async () => 'x', { wait: false })).value, 'v')
})

test('maxEntries: the oldest completed entries are evicted; all running is RESOURCE_EXHAUSTED', async () => {
  const store = new IdempotencyStore({ maxEntries: 2 })
  const [a, b, c] = [key(), key(), key()]
  await store.execute(a, fp, async () => 'a')
  await store.execute(b, fp, async () => 'b')
  await store.execute(c, fp, async () => 'c')
  assert.equal(store.counters().evictions, 1)
  assert.equal((await store.execute(a, fp, async () => 'a again')).source, 'led', 'a was evicted')
  const full = new IdempotencyStore({ maxEntries: 1 })
  const gate = deferred()
  const running = full.execute(key(), fp, () => gate.promise)
  await assert.rejects(full.execute(key(), fp, async () => 1), { code: 'RESOURCE_EXHAUSTED', kind: 'capacity', maxEntries: 1 })
  gate.resolve()
  await running
})

test('cachePermanentFailures: a permanent failure is replayed (the same error) until removed', async () => {
  const store = new IdempotencyStore({ cachePermanentFailures: true })
  const k = key()
  const invalid = Object.assign(new Error('bad sku'), { code: 'INVALID_ARGUMENT' })
  await assert.rejects(store.execute(k, fp, async () => Promise.reject(invalid)), (e) => e === invalid)
  await assert.rejects(store.execute(k, fp, async () => 'never'), (e) => e === invalid)
  assert.equal(store.remove(k), true)
  assert.equal((await store.execute(k, fp, async () => 'fixed')).value, 'fixed')
  // A transient failure is never cached.
  const t = key()
  const unavailable = Object.assign(new Error('down'), { code: Code.UNAVAILABLE })
  await assert.rejects(store.execute(t, fp, async () => Promise.reject(unavailable)))
  assert.equal((await store.execute(t, fp, async () => 'up')).value, 'up')
})

test('remove() clears a completed entry; a running one is left alone', async () => {
  const store = new IdempotencyStore()
  const k = key()
  await store.execute(k, fp, async () => 1)
  assert.equal(store.remove(k), true)
  assert.equal(store.remove(k), false)
  const gate = deferred()
  const running = store.execute(k, fp, () => gate.promise)
  assert.equal(store.remove(k), false)
  gate.resolve(2)
  assert.equal((await running).value, 2)
})

test('no leaked references: a long loop of leads, joins, failures and expiries keeps the heap flat', async () => {
  const clock = new ManualClock()
  const store = new IdempotencyStore({ ttlMs: 5, _clock: clock })
  const round = async (n) => {
    for (let i = 0; i < n; i++) {
      const k = key()
      const big = { payload: 'x'.repeat(1_000) + i }
      const gate = deferred()
      const leader = store.execute(k, fp, () => gate.promise)
      const waiters = [store.execute(k, fp, async () => 0), store.execute(k, fp, async () => 0)]
      if (i % 3 === 0) gate.reject(new Error('fail ' + 'y'.repeat(1_000)))
      else gate.resolve(big)
      await Promise.allSettled([leader, ...waiters])
      await store.execute(k, fp, async () => 0).catch(() => {})
      clock.advance(5)
    }
  }
  await round(2_000) // warm up
  gc()
  await tick()
  gc()
  const before = process.memoryUsage().heapUsed
  await round(20_000) // 20,000 results of 1 kB: ~20 MB if they leaked
  gc()
  await tick()
  gc()
  const grown = process.memoryUsage().heapUsed - before
  assert.ok(grown < 5_000_000, `heap grew by ${grown} bytes`)
  assert.equal(store.pendingWaiters, 0)
  assert.ok(store.size < 10, `entries left: ${store.size}`)
})

test('bad input to execute throws TypeError naming the argument', async () => {
  const store = new IdempotencyStore()
  const k = key()
  await assert.rejects(store.execute({ scoped: 'v1:a:b:key12345' }, fp, async () => 1), { name: 'TypeError', field: 'scoped' })
  await assert.rejects(store.execute(k, 42, async () => 1), { name: 'TypeError', field: 'fingerprint' })
  await assert.rejects(store.execute(k, fp, 'not a function'), { name: 'TypeError', field: 'fn' })
  await assert.rejects(store.execute(k, fp, async () => 1, { wait: 'no' }), { name: 'TypeError', field: 'wait' })
  await assert.rejects(store.execute(k, fp, async () => 1, { signal: {} }), { name: 'TypeError', field: 'signal' })
  await assert.rejects(store.execute(k, '', async () => 1), { name: 'RangeError', code: 'INVALID_ARGUMENT', field: 'fingerprint' })
  await assert.rejects(store.execute(k, 'f'.repeat(2_000), async () => 1), { code: 'INVALID_ARGUMENT', field: 'fingerprint' })
  assert.throws(() => new IdempotencyStore({ ttlMs: 0 }), { name: 'RangeError', field: 'ttlMs' })
  assert.throws(() => new IdempotencyStore({ ttlMs: -1 }), { name: 'RangeError', field: 'ttlMs' })
  assert.throws(() => new IdempotencyStore({ ttlMs: NaN }), { name: 'RangeError', field: 'ttlMs' })
  assert.throws(() => new IdempotencyStore({ ttlMs: Infinity }), { name: 'RangeError', field: 'ttlMs' })
  assert.throws(() => new IdempotencyStore({ ttlMs: '1000' }), { name: 'TypeError', field: 'ttlMs' })
  assert.throws(() => new IdempotencyStore({ maxEntries: 0 }), { name: 'RangeError', field: 'maxEntries' })
  assert.throws(() => new IdempotencyStore({ maxEntries: 1.5 }), { name: 'RangeError', field: 'maxEntries' })
  assert.throws(() => new IdempotencyStore({ ttl: 1000 }), { name: 'TypeError', field: 'ttl' })
  assert.throws(() => new IdempotencyStore({ _clock: {} }), { name: 'TypeError', field: '_clock' })
  assert.throws(() => new IdempotencyStore(5), { name: 'TypeError', field: 'options' })
  assert.equal(store.size, 0)
})
