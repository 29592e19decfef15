'use strict'
// The promise under edge cases, for both stores: the action that holds a key keeps it
// until it settles (an aborted caller stops waiting, the action is not run again), the
// action's own `{ signal }` fires once every caller has gone, an action that calls
// `execute` on its own key fails fast, a leader's unreadable error still reaches every
// waiter, and a claim won by a caller that already left is released at once.
//
// The Redis-backed tests read ONCELY_REDIS_URL and are skipped without it.
const test = require('node:test')
const assert = require('node:assert/strict')
const { performance } = require('node:perf_hooks')

const { IdempotencyStore, RedisStore, scope, newKey, fingerprint } = require('oncely')

const URL = process.env.ONCELY_REDIS_URL
const needsRedis = URL ? {} : { skip: 'needs a Redis: run scripts/test-redis' }

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

/** `promise`, or a rejection naming `what` when it has not settled within `ms` (a hang). */
function within(promise, ms, what) {
  let timer
  const hang = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`hung: ${what} did not settle within ${ms} ms`)), ms)
  })
  return Promise.race([promise, hang]).finally(() => clearTimeout(timer))
}

/** An action that counts its concurrent copies; each run waits for `gate` (or `ms`). */
function counted() {
  const c = { runs: 0, live: 0, max: 0, gates: [] }
  c.action = async () => {
    c.runs += 1
    c.live += 1
    c.max = Math.max(c.max, c.live)
    const gate = deferred()
    c.gates.push(gate)
    try {
      return await gate.promise
    } finally {
      c.live -= 1
    }
  }
  return c
}

const redisPrefix = () => `nodetest-${newKey()}`

/** The two stores of a test: the in-process store, or two Redis "processes" on one Redis. */
const kinds = [
  { name: 'IdempotencyStore', opts: {}, make: () => [new IdempotencyStore(), null] },
  {
    name: 'RedisStore',
    opts: needsRedis,
    make: (options) => {
      const prefix = redisPrefix()
      return [new RedisStore({ url: URL, prefix, ...options }), new RedisStore({ url: URL, prefix, ...options })]
    },
  },
]

// The moments at which a caller aborts, relative to the start of its call.
const moments = [
  ['synchronously', () => undefined],
  ['after a microtask', () => Promise.resolve()],
  ['after a macrotask', () => tick()],
  ['after 5 ms', () => delay(5)],
  ['after 30 ms', () => delay(30)],
]

// ---------------------------------------------------------------------------------------
// An aborted leader: the action keeps the key until it settles
// ---------------------------------------------------------------------------------------

for (const kind of kinds) {
  test(`${kind.name}: an aborted leader rejects at once, its action keeps the key: one copy runs, every waiter gets its value`, kind.opts, async () => {
    // A short lease: the running action's lease must be renewed while its caller is gone.
    const [s, other] = kind.make({ leaseMs: 300 })
    for (const [when, wait] of moments) {
      const k = key()
      const c = counted()
      const ac = new AbortController()
      const leader = s.execute(k, fp, c.action, { signal: ac.signal })
      const leaderOutcome = leader.then(
        () => 'resolved',
        (e) => ({ e, liveAtRejection: c.live }),
      )
      // Waiters here, one that aborts too, and (Redis) waiters of another instance.
      const waiters = Array.from({ length: 5 }, () => s.execute(k, fp, c.action))
      const quitter = new AbortController()
      const leaving = s.execute(k, fp, c.action, { signal: quitter.signal })
      if (other !== null) waiters.push(other.execute(k, fp, c.action), other.execute(k, fp, c.action))
      await wait()
      if (other !== null) await within((async () => { while (c.runs === 0) await delay(2) })(), 5_000, 'the first run')
      ac.abort(new Error('caller went away'))
      quitter.abort(new Error('waiter went away'))
      const out = await within(leaderOutcome, 1_000, `the aborted leader (${when})`)
      assert.notEqual(out, 'resolved')
      assert.equal(out.e.message, 'caller went away', when)
      assert.equal(out.liveAtRejection, 1, `${when}: rejected while its action still ran`)
      await assert.rejects(leaving, { message: 'waiter went away' })
      // Longer than the lease: nobody may take the key over while the action runs.
      await delay(other !== null ? 700 : 20)
      assert.equal(c.runs, 1, `${when}: no second copy started`)
      c.gates[0].resolve(`value ${when}`)
      const got = await within(Promise.all(waiters), 5_000, 'the waiters')
      for (const g of got) assert.deepEqual(g.value, `value ${when}`, when)
      assert.equal(c.max, 1, `${when}: at most one copy at a time`)
      assert.equal(c.runs, 1, when)
      const replay = await s.execute(k, fp, c.action)
      assert.deepEqual(replay.value, `value ${when}`)
      assert.equal(replay.source, 'replayed')
      assert.equal(c.runs, 1)
    }
  })

  test(`${kind.name}: an aborted leader's failure is given to the waiters and releases the key`, kind.opts, async () => {
    const [s] = kind.make()
    const k = key()
    const c = counted()
    const ac = new AbortController()
    const leader = s.execute(k, fp, c.action, { signal: ac.signal })
    const waiter = s.execute(k, fp, c.action)
    await delay(20)
    ac.abort()
    await assert.rejects(leader, { name: 'AbortError' })
    const boom = new Error('boom')
    c.gates[0].reject(boom)
    await assert.rejects(within(waiter, 5_000, 'the waiter'), (e) => e === boom)
    c.gates.length = 0
    const again = s.execute(k, fp, c.action)
    await within((async () => { while (c.gates.length === 0) await delay(1) })(), 5_000, 'the second run')
    c.gates[0].resolve('second')
    assert.equal((await again).source, 'led')
    assert.equal(c.runs, 2)
    assert.equal(c.max, 1)
  })

  test(`${kind.name}: the action's { signal } fires only once every caller of its flight has gone`, kind.opts, async () => {
    const [s, other] = kind.make()
    const k = key()
    let runs = 0
    let actionSignal
    const started = deferred()
    const action = async ({ signal }) => {
      runs += 1
      actionSignal = signal
      started.resolve()
      await new Promise((resolve, reject) => {
        signal.addEventListener('abort', () => reject(signal.reason), { once: true })
      })
    }
    const a = new AbortController()
    const b = new AbortController()
    const c = new AbortController()
    const leader = s.execute(k, fp, action, { signal: a.signal })
    await started.promise
    const w1 = s.execute(k, fp, action, { signal: b.signal })
    const w2 = s.execute(k, fp, action, { signal: c.signal })
    // A waiter of another instance is not a caller of this process's flight.
    const remote = other === null ? null : other.execute(k, fp, async () => 'remote run')
    await delay(10)
    assert.ok(actionSignal instanceof AbortSignal)
    a.abort()
    await assert.rejects(leader, { name: 'AbortError' })
    await tick()
    assert.equal(actionSignal.aborted, false, 'two waiters are still there')
    b.abort()
    await assert.rejects(w1, { name: 'AbortError' })
    await tick()
    assert.equal(actionSignal.aborted, false, 'one waiter is still there')
    c.abort()
    await assert.rejects(w2, { name: 'AbortError' })
    assert.equal(actionSignal.aborted, true, 'every caller has gone')
    assert.equal(actionSignal.reason.name, 'AbortError')
    // The action stopped (rejected): the key is released, the next caller runs anew.
    if (remote !== null) {
      assert.deepEqual(await within(remote, 5_000, 'the remote waiter'), { value: 'remote run', replayed: false, source: 'led' })
    } else {
      const next = await within(s.execute(k, fp, async () => 'next run'), 5_000, 'the next call')
      assert.deepEqual(next, { value: 'next run', replayed: false, source: 'led' })
    }
    assert.equal(runs, 1)
  })

  test(`${kind.name}: a waiter without a signal keeps the action's { signal } quiet`, kind.opts, async () => {
    const [s] = kind.make()
    const k = key()
    let actionSignal
    const gate = deferred()
    const action = async ({ signal }) => {
      actionSignal = signal
      return gate.promise
    }
    const ac = new AbortController()
    const leader = s.execute(k, fp, action, { signal: ac.signal })
    await delay(20)
    const waiter = s.execute(k, fp, action)
    await delay(10)
    ac.abort()
    await assert.rejects(leader, { name: 'AbortError' })
    await delay(10)
    assert.equal(actionSignal.aborted, false)
    gate.resolve('kept')
    assert.equal((await within(waiter, 5_000, 'the waiter')).value, 'kept')
    assert.equal(actionSignal.aborted, false, 'a settled action is never aborted')
  })

  test(`${kind.name}: many callers aborting at random moments never run two copies`, kind.opts, async () => {
    const [s, other] = kind.make({ leaseMs: 300 })
    const stores = other === null ? [s] : [s, other]
    let runs = 0
    const keys = Array.from({ length: 20 }, key)
    const action = async ({ signal }) => {
      runs += 1
      await delay(5 + Math.floor(Math.random() * 30))
      if (signal.aborted) throw signal.reason
      return 'done'
    }
    // Copies of the action running now, and the most at once, per key.
    const perKey = new Map(keys.map((k) => [k, { live: 0, max: 0 }]))
    const calls = []
    for (let i = 0; i < 400; i++) {
      const k = keys[i % keys.length]
      const st = stores[i % stores.length]
      const ac = new AbortController()
      const at = Math.random()
      if (at < 0.3) setTimeout(() => ac.abort(), Math.floor(at * 60))
      const m = perKey.get(k)
      const guarded = async (info) => {
        m.live += 1
        m.max = Math.max(m.max, m.live)
        try {
          return await action(info)
        } finally {
          m.live -= 1
        }
      }
      calls.push(st.execute(k, fp, guarded, { signal: ac.signal }).catch((e) => e))
      if (i % 20 === 0) await tick()
    }
    const out = await within(Promise.all(calls), 20_000, 'the calls')
    for (const [k, m] of perKey) assert.equal(m.max, 1, `${k}: two copies ran at once`)
    assert.ok(runs >= keys.length)
    for (const r of out) {
      if (r instanceof Error) assert.equal(r.name, 'AbortError')
      else assert.equal(r.value, 'done')
    }
  })
}

for (const kind of kinds) {
  test(`${kind.name}: an abort at any point of a call (claim, action, completion) never runs the action twice`, kind.opts, async () => {
    // A short lease bounds a remote waiter that misses the release's notification (it
    // then polls until the lease's end).
    const [s, other] = kind.make({ leaseMs: 1_000 })
    const stores = other === null ? [s] : [s, other]
    // Abort after n turns of the event loop (n microtask hops first, then macrotasks).
    for (let n = 0; n < 40; n++) {
      const k = key()
      let runs = 0
      const action = async () => {
        runs += 1
        await Promise.resolve()
        return `v${runs}`
      }
      const ac = new AbortController()
      const first = s.execute(k, fp, action, { signal: ac.signal }).then(
        (r) => r,
        (e) => e,
      )
      const joiner = stores[n % stores.length].execute(k, fp, action)
      for (let i = 0; i < n; i++) {
        if (i < 10) await Promise.resolve()
        else await tick()
      }
      ac.abort()
      const a = await within(first, 5_000, `the aborted call (n = ${n})`)
      const j = await within(joiner, 5_000, `the joiner (n = ${n})`)
      const after = await within(s.execute(k, fp, action), 5_000, `the later call (n = ${n})`)
      assert.equal(runs, 1, `n = ${n}: the action ran ${runs} times`)
      assert.equal(j.value, 'v1')
      assert.equal(after.value, 'v1')
      if (!(a instanceof Error)) assert.equal(a.value, 'v1')
    }
  })
}

// ---------------------------------------------------------------------------------------
// Re-entrancy: an action that calls execute with its own key fails fast
// ---------------------------------------------------------------------------------------

for (const kind of kinds) {
  test(`${kind.name}: an action that calls execute with its own key gets kind 'reentrant' at once`, kind.opts, async (t) => {
    const [s] = kind.make()
    const k = key()
    let inner
    let took
    const led = await within(
      s.execute(k, fp, async () => {
        await delay(1)
        const t0 = performance.now()
        inner = await s.execute(k, fp, async () => assert.fail('must not run')).catch((e) => e)
        took = performance.now() - t0
        return 'outer'
      }),
      5_000,
      'the re-entrant call',
    )
    assert.equal(led.value, 'outer')
    assert.ok(inner instanceof Error)
    assert.equal(inner.code, 'FAILED_PRECONDITION')
    assert.equal(inner.kind, 'reentrant')
    assert.equal(inner.key, k)
    assert.match(inner.message, /re-entrant execute/)
    t.diagnostic(`time to fail fast: ${took.toFixed(3)} ms`)
    // Synchronously, before any await, and with wait: false too.
    const k2 = key()
    await s.execute(k2, fp, () => {
      const sync = s.execute(k2, fp, () => 1)
      const noWait = s.execute(k2, fp, () => 1, { wait: false })
      return Promise.all([sync, noWait].map((p) => p.catch((e) => e))).then((es) => {
        for (const e of es) assert.equal(e.kind, 'reentrant')
        return 'checked'
      })
    })
  })

  test(`${kind.name}: a cycle over several keys is re-entrant too`, kind.opts, async () => {
    const [s] = kind.make()
    const [a, b] = [key(), key()]
    let innerError
    const out = await within(
      s.execute(a, fp, async () => {
        const viaB = await s.execute(b, fp, async () => {
          innerError = await s.execute(a, fp, async () => 'never').catch((e) => e)
          return 'b'
        })
        return `a+${viaB.value}`
      }),
      5_000,
      'the cycle',
    )
    assert.equal(out.value, 'a+b')
    assert.equal(innerError.kind, 'reentrant')
    assert.equal(innerError.key, a)
  })

  test(`${kind.name}: no false positives: other keys, other stores, independent callers, later calls`, kind.opts, async () => {
    const [s, other] = kind.make()
    const k = key()
    const gate = deferred()
    const started = deferred()
    let nested
    const later = deferred()
    const leader = s.execute(k, fp, async () => {
      // Another key from inside the action: runs.
      nested = await s.execute(key(), fp, async () => 'nested')
      // The same key on another store: an independent operation.
      const elsewhere = other === null ? new IdempotencyStore() : new RedisStore({ url: URL, prefix: redisPrefix() })
      assert.equal((await elsewhere.execute(k, fp, async () => 'elsewhere')).value, 'elsewhere')
      // A different fingerprint is a fingerprint mismatch, not re-entrancy.
      await assert.rejects(s.execute(k, otherFp, async () => 'x'), { kind: 'fingerprint_mismatch' })
      // Work scheduled by the action that calls after it settled: a replay.
      setTimeout(() => {
        s.execute(k, fp, async () => 'must not run').then(later.resolve, later.reject)
      }, 30)
      started.resolve()
      return gate.promise
    })
    await started.promise
    // Concurrent independent callers of the same key join.
    const joiners = Array.from({ length: 10 }, () => s.execute(k, fp, async () => 'must not run'))
    gate.resolve('v')
    assert.equal((await leader).value, 'v')
    for (const j of await Promise.all(joiners)) assert.equal(j.value, 'v')
    assert.equal(nested.value, 'nested')
    const l = await within(later.promise, 5_000, 'the later call')
    assert.equal(l.value, 'v')
    assert.equal(l.source, 'replayed')
  })
}

// ---------------------------------------------------------------------------------------
// A leader's error that cannot be read still settles every waiter
// ---------------------------------------------------------------------------------------

function hostileValues() {
  const thrower = () => {
    throw new Error('getter threw')
  }
  const getters = (names) => {
    const o = new Error('hostile')
    for (const n of names) Object.defineProperty(o, n, { get: thrower, configurable: true })
    return o
  }
  const revoked = Proxy.revocable(new Error('revoked'), {})
  revoked.revoke()
  const revokedFn = Proxy.revocable(function f() {}, {})
  revokedFn.revoke()
  const trapsThrow = new Proxy(
    {},
    {
      get: thrower,
      has: thrower,
      getPrototypeOf: thrower,
      getOwnPropertyDescriptor: thrower,
      ownKeys: thrower,
    },
  )
  return [
    ['a throwing code getter', getters(['code'])],
    ['a throwing status getter', getters(['status'])],
    ['throwing code, status, message, name, cause, response, headers getters', getters(['code', 'status', 'message', 'name', 'cause', 'response', 'headers', 'statusCode', 'metadata', 'retryAfterMs'])],
    ['a revoked Proxy', revoked.proxy],
    ['a revoked function Proxy', revokedFn.proxy],
    ['a Proxy whose traps throw', trapsThrow],
    ['null', null],
    ['undefined', undefined],
    ['0', 0],
    ['a string', 'failed'],
    ['a symbol', Symbol('failed')],
    ['a BigInt', 12n],
  ]
}

for (const kind of kinds) {
  test(`${kind.name}: a leader's unreadable error still reaches every waiter promptly`, kind.opts, async () => {
    // cachePermanentFailures makes the store read the error's code.
    const [s] = kind.name === 'IdempotencyStore' ? [new IdempotencyStore({ cachePermanentFailures: true })] : kind.make()
    for (const [what, thrown] of hostileValues()) {
      const k = key()
      const gate = deferred()
      const leader = s.execute(k, fp, async () => {
        await gate.promise
        throw thrown
      })
      await delay(5)
      const waiters = Array.from({ length: 5 }, () => s.execute(k, fp, async () => 'never'))
      gate.resolve()
      for (const p of [leader, ...waiters]) {
        const got = await within(
          p.then(
            () => ({ ok: true }),
            (e) => ({ e }),
          ),
          2_000,
          `a caller after ${what}`,
        )
        assert.ok(!got.ok, what)
        assert.ok(Object.is(got.e, thrown), `${what}: the leader's own value`)
      }
      if (s instanceof IdempotencyStore) {
        assert.equal(s.pendingWaiters, 0, what)
        // A code that cannot be read is UNKNOWN, as for an error without one: cached
        // as a permanent failure.
        const cached = await s.execute(k, fp, async () => 'again').then(
          () => ({ ok: true }),
          (e) => ({ e }),
        )
        assert.ok(!cached.ok && Object.is(cached.e, thrown), what)
        assert.equal(s.remove(k), true)
      }
      assert.equal((await within(s.execute(k, fp, async () => 'again'), 2_000, 'the next call')).source, 'led', what)
    }
  })
}

// ---------------------------------------------------------------------------------------
// A claim won by a caller that already left is released at once
// ---------------------------------------------------------------------------------------

/** Another instance can lead `k` at once (within 2 s, long before the 30 s lease). */
async function leadsSoon(other, k) {
  const t0 = Date.now()
  let led
  while (led === undefined && Date.now() - t0 < 2_000) {
    led = await other.execute(k, fp, async () => 'taken', { wait: false }).catch((e) => {
      assert.equal(e.kind, 'in_progress')
      return undefined
    })
    if (led === undefined) await delay(10)
  }
  assert.ok(led !== undefined, 'the claim was still held after 2 s')
  assert.deepEqual(led, { value: 'taken', replayed: false, source: 'led' })
}

const blockEventLoop = (ms) => Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, ms)

test('RedisStore: a caller aborted when its claim reply had arrived, unread, releases the claim at once', needsRedis, async () => {
  const s = new RedisStore({ url: URL, prefix: redisPrefix(), workers: 1 })
  const other = new RedisStore({ url: URL, prefix: s.prefix })
  await s.execute(key(), fp, async () => 'connected')
  for (let round = 0; round < 3; round++) {
    const k = key()
    const ac = new AbortController()
    let ran = false
    const leader = s.execute(
      k,
      fp,
      () => {
        ran = true
        return 'never'
      },
      { signal: ac.signal },
    )
    // The claim's reply arrives while the event loop is blocked: nothing has read it.
    blockEventLoop(300)
    ac.abort()
    await assert.rejects(leader, { name: 'AbortError' })
    assert.equal(ran, false)
    await leadsSoon(other, k)
  }
})

test('RedisStore: a caller aborted after its claim reply arrived releases the claim at once', needsRedis, async () => {
  const s = new RedisStore({ url: URL, prefix: redisPrefix(), workers: 1 })
  const other = new RedisStore({ url: URL, prefix: s.prefix })
  await s.execute(key(), fp, async () => 'connected')
  for (let round = 0; round < 3; round++) {
    const k = key()
    const ac = new AbortController()
    let ran = false
    const leader = s.execute(
      k,
      fp,
      () => {
        ran = true
        return 'never'
      },
      { signal: ac.signal },
    )
    // Block the event loop while the claim's reply arrives (its wake-up is queued)...
    blockEventLoop(300)
    // ...then a call on the same store settles the queued claim (this caller leads),
    // and the caller aborts before it reads the answer.
    const unrelated = s.execute(key(), fp, async () => 'unrelated')
    ac.abort()
    await assert.rejects(leader, { name: 'AbortError' })
    await unrelated
    assert.equal(ran, false)
    await leadsSoon(other, k)
  }
})

// ---------------------------------------------------------------------------------------
// Memory: what tracks the callers of a key goes away with them
// ---------------------------------------------------------------------------------------

test('IdempotencyStore: aborted callers, stopped actions and re-entrant calls keep the heap flat', async () => {
  const v8 = require('node:v8')
  const vm = require('node:vm')
  v8.setFlagsFromString('--expose-gc')
  const gc = vm.runInNewContext('gc')
  const { ManualClock } = require('oncely')
  const clock = new ManualClock()
  const s = new IdempotencyStore({ ttlMs: 5, _clock: clock })
  const cooperative = ({ signal }) => new Promise((_, reject) => signal.addEventListener('abort', () => reject(signal.reason), { once: true }))
  const round = async (n) => {
    for (let i = 0; i < n; i++) {
      const k = key()
      const a = new AbortController()
      const b = new AbortController()
      if (i % 2 === 0) {
        // Both callers leave: the action stops on its signal.
        const leader = s.execute(k, fp, cooperative, { signal: a.signal }).catch(() => {})
        const waiter = s.execute(k, fp, cooperative, { signal: b.signal }).catch(() => {})
        a.abort()
        b.abort()
        await Promise.all([leader, waiter])
      } else {
        // The leader leaves; its action settles later for the waiter; it re-enters once.
        const gate = deferred()
        const leader = s
          .execute(
            k,
            fp,
            async () => {
              await s.execute(k, fp, async () => 0).catch(() => {})
              return gate.promise
            },
            { signal: a.signal },
          )
          .catch(() => {})
        const waiter = s.execute(k, fp, async () => 0)
        a.abort()
        gate.resolve({ payload: 'x'.repeat(200) + i })
        await Promise.all([leader, waiter])
      }
      clock.advance(5)
    }
  }
  await round(2_000)
  gc()
  await tick()
  gc()
  const before = process.memoryUsage().heapUsed
  await round(40_000) // ~400 B per run of tracking records if they leaked: ~16 MB
  gc()
  await tick()
  gc()
  const grown = process.memoryUsage().heapUsed - before
  assert.ok(grown < 4_000_000, `heap grew by ${grown} bytes`)
  assert.equal(s.pendingWaiters, 0)
})

for (const kind of kinds) {
  test(`${kind.name}: an action that aborts its own caller and then fails leaves no unhandled rejection`, kind.opts, async () => {
    const [store] = kind.make({ leaseMs: 3000, ioTimeoutMs: 500 })
    const unhandled = []
    const onUnhandled = (reason) => unhandled.push(reason)
    process.on('unhandledRejection', onUnhandled)
    try {
      const k = key()
      const ac = new AbortController()
      const failure = new Error('the action failed after its caller left')
      const call = store.execute(
        k,
        fp,
        () => {
          ac.abort() // e.g. one controller shared by a group of calls, aborted from inside
          return Promise.reject(failure)
        },
        { signal: ac.signal },
      )
      await assert.rejects(within(call, 5000, 'the aborted call'), { name: 'AbortError' })
      // The failure releases the key: the next call runs (one that joined the failing
      // action first gets its failure).
      let next
      for (let i = 0; next === undefined; i++) {
        try {
          next = await within(store.execute(k, fp, async () => 'ran'), 5000, 'the next call')
        } catch (e) {
          if (e !== failure || i > 100) throw e
          await delay(10)
        }
      }
      assert.deepEqual([next.value, next.source], ['ran', 'led'])
      await delay(20)
      await tick()
      assert.deepEqual(unhandled, [])
    } finally {
      process.off('unhandledRejection', onUnhandled)
    }
  })
}

test('RedisStore: an action calling another instance on its Redis and prefix with its own key fails fast', needsRedis, async () => {
  const prefix = redisPrefix()
  const a = new RedisStore({ url: URL, prefix })
  const b = new RedisStore({ url: URL, prefix })
  const elsewhere = new RedisStore({ url: URL, prefix: `${prefix}-other` })
  const k = key()
  const out = await within(
    a.execute(k, fp, async () => {
      const inner = await b.execute(k, fp, async () => 'x').then(
        () => 'ran',
        (e) => e.kind,
      )
      const other = await elsewhere.execute(k, fp, async () => 'y')
      return [inner, other.source]
    }),
    10_000,
    'the outer call',
  )
  assert.deepEqual(out.value, ['reentrant', 'led'])
})
