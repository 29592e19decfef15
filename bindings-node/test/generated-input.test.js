'use strict'
// Generated bad input (fast-check) for every public function and constructor: BigInts,
// Symbols, Proxies, getters that throw, revoked proxies, cyclic objects, typed arrays.
// Only the documented errors come out (a TypeError or RangeError with a gRPC `code`, or
// oncely's own errors), or the caller's own exception unchanged; never a crash, never a
// hang (each store call is bounded), never a leaked lease (after an execute that failed,
// the key is free). ONCELY_FASTCHECK_RUNS sets the runs per property (default 100).
const test = require('node:test')
const assert = require('node:assert/strict')
const fc = require('fast-check')

const oncely = require('oncely')
const { Code } = oncely

const RUNS = Number(process.env.ONCELY_FASTCHECK_RUNS || 100)
const params = { numRuns: RUNS, includeErrorInReport: true }
// A store call that has not settled after this long is a hang.
const HANG_MS = 20_000

/** What a hostile getter or trap throws: the caller's own exception. */
class Boom extends Error {}

function isDocumented(e) {
  try {
    if (e instanceof Boom) return true
  } catch {
    return false // a revoked proxy
  }
  // What JavaScript throws for any use of a revoked proxy the caller passed: like a
  // trap's own exception, it is the caller's object's answer, passed on unchanged.
  if (e instanceof TypeError && e.code === undefined && /proxy that has been revoked/.test(e.message)) return true
  return (
    e instanceof Error &&
    typeof e.code === 'string' &&
    Object.hasOwn(Code, e.code) &&
    (e.name === 'TypeError' || e.name === 'RangeError' || typeof e.kind === 'string')
  )
}

function assertDocumented(e) {
  if (!isDocumented(e)) assert.fail(`undocumented error: ${describe(e)}`)
}

function describe(e) {
  try {
    return `${e?.name}: ${e?.message} (code ${String(e?.code)})`
  } catch {
    return 'an unreadable value'
  }
}

/** fn(), or undefined if it threw a documented error. */
function documented(fn) {
  try {
    return fn()
  } catch (e) {
    assertDocumented(e)
    return undefined
  }
}

function bounded(promise) {
  let timer
  const hang = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`hung for ${HANG_MS} ms`)), HANG_MS)
  })
  return Promise.race([promise, hang]).finally(() => clearTimeout(timer))
}

// ---- hostile values ---------------------------------------------------------------------
// A hostile value is generated as a Recipe and made inside the property (`real`), so that
// fast-check, which prints the values it generated, never touches its traps.

class Recipe {
  constructor(label, make) {
    this.label = label
    this.make = make
  }

  [fc.toStringMethod]() {
    return `<${this.label}>`
  }
}

/** The value a generated input stands for (a Recipe made, anything else as is). */
function real(v) {
  return v instanceof Recipe ? v.make() : v
}

/** `real`, through the arrays and plain objects fast-check built around Recipes. */
function realDeep(v) {
  if (v instanceof Recipe) return v.make()
  if (Array.isArray(v)) return v.map(realDeep)
  if (v !== null && typeof v === 'object' && Object.getPrototypeOf(v) === Object.prototype) {
    return Object.fromEntries(Object.entries(v).map(([k, x]) => [k, realDeep(x)]))
  }
  return v
}

/** fc.property over the real values. */
function prop(...args) {
  const fn = args.pop()
  return fc.property(...args, (...xs) => fn(...xs.map(realDeep)))
}

function asyncProp(...args) {
  const fn = args.pop()
  return fc.asyncProperty(...args, (...xs) => fn(...xs.map(realDeep)))
}

function throwingGetters(keys) {
  const o = {}
  for (const k of keys) {
    Object.defineProperty(o, k, {
      enumerable: true,
      get() {
        throw new Boom(`cannot read ${k}`)
      },
    })
  }
  return o
}

function trapEverything() {
  const fail = () => {
    throw new Boom('trap')
  }
  return new Proxy({}, { get: fail, has: fail, ownKeys: fail, getOwnPropertyDescriptor: fail, getPrototypeOf: fail })
}

function revoked() {
  const { proxy, revoke } = Proxy.revocable({}, {})
  revoke()
  return proxy
}

function cyclic() {
  const a = { x: 1 }
  a.self = a
  return a
}

function deep(n) {
  let v = 0
  for (let i = 0; i < n; i++) v = i % 2 ? [v] : { k: v }
  return v
}

const loneSurrogates = fc.integer({ min: 0xd800, max: 0xdfff }).map((c) => String.fromCharCode(c))
const texts = fc.oneof(
  fc.string(),
  fc.string({ unit: 'binary' }),
  fc.string({ unit: fc.oneof(fc.constantFrom('a', 'Z', '0', '_', '-', ':', '%', '{', ' ', 'é'), loneSurrogates), maxLength: 70 }),
  fc.stringMatching(/^[A-Za-z0-9_-]{6,66}$/),
)
const numbers = fc.oneof(
  fc.double(),
  fc.integer(),
  fc.constantFrom(NaN, Infinity, -Infinity, -0, 5e-324, 2 ** 53 + 1, 2 ** 64, 1e19, -1e19, 1e300, Number.MAX_SAFE_INTEGER),
)
const hostile = fc.oneof(
  fc.constantFrom(
    new Recipe('a proxy whose every trap throws', trapEverything),
    new Recipe('a revoked proxy', revoked),
    new Recipe('a cyclic object', cyclic),
    new Recipe('a symbol', () => Symbol('s')),
    new Recipe('a function', () => () => 1),
    new Recipe('a class', () => class {}),
    new Recipe('an invalid date', () => new Date(NaN)),
  ),
  fc.integer({ min: 0, max: 20_000 }).map((n) => new Recipe(`${n} levels deep`, () => deep(n))),
  fc
    .uniqueArray(fc.constantFrom('code', 'status', 'url', 'leaseMs', 'ttlMs', 'maxAttempts', 'toJSON', 'then'), { maxLength: 3 })
    .map((keys) => new Recipe(`getters that throw: ${keys}`, () => throwingGetters(keys))),
)
const anything = fc.oneof(
  { weight: 3, arbitrary: fc.anything({ withBigInt: true, withTypedArray: true, withMap: true, withSet: true, withDate: true, withBoxedValues: true, withNullPrototype: true, withSparseArray: true, maxDepth: 3 }) },
  { weight: 2, arbitrary: numbers },
  { weight: 2, arbitrary: texts },
  { weight: 1, arbitrary: fc.bigInt() },
  { weight: 2, arbitrary: hostile },
)

function optionsOf(keys) {
  return fc.oneof(
    fc.dictionary(fc.constantFrom(...keys), anything, { maxKeys: 4 }),
    anything,
    fc.constantFrom(...keys).map((k) => new Recipe(`a getter of ${k} that throws`, () => throwingGetters([k]))),
  )
}

// ---- policies, deadlines, budgets, clocks ---------------------------------------------

test('RetryPolicy: any options', () => {
  const keys = ['maxAttempts', 'baseDelayMs', 'maxDelayMs', 'multiplier', 'jitter', 'seed', 'minAttemptMs']
  fc.assert(
    prop(optionsOf(keys), anything, (opts, n) => {
      const p = documented(() => new oncely.RetryPolicy(opts))
      if (p === undefined) return
      for (let i = 1; i < Math.min(p.maxAttempts, 64); i++) {
        const d = p.delayAfter(i)
        assert.ok(Number.isFinite(d) && d >= 0 && d <= p.maxDelayMs * (1 + p.jitter) + 1, `${d}`)
      }
      const d = documented(() => p.delayAfter(n))
      assert.ok(d === undefined || (Number.isFinite(d) && d >= 0))
    }),
    params,
  )
})

test('Deadline, ManualClock, RetryBudget: any input', () => {
  fc.assert(
    prop(anything, anything, optionsOf(['ratio', 'windowMs', 'minPerSec']), (ms, step, budget) => {
      const clock = new oncely.ManualClock()
      documented(() => clock.advance(step))
      documented(() => clock.set(step))
      assert.ok(Number.isFinite(clock.nowMs) && clock.nowMs >= 0)
      for (const d of [documented(() => new oncely.Deadline(ms)), documented(() => new oncely.Deadline(ms, clock))]) {
        if (d !== undefined) assert.ok(d.remainingMs >= 0 && typeof d.expired === 'boolean')
      }
      const b = documented(() => new oncely.RetryBudget(budget))
      if (b !== undefined) assert.ok(b.snapshot().requests >= 0)
    }),
    params,
  )
})

// ---- keys, scopes, fingerprints -----------------------------------------------------------

test('keys and scopes: any text, any value', () => {
  fc.assert(
    prop(fc.oneof(texts, anything), fc.oneof(texts, anything), fc.oneof(texts, anything), (tenant, method, key) => {
      const valid = documented(() => oncely.validateKey(key))
      if (valid !== undefined) assert.equal(valid, key)
      const derived = documented(() => oncely.deriveKey(tenant, method))
      if (derived !== undefined) assert.equal(oncely.validateKey(derived), derived)
      const scoped = documented(() => oncely.scope(tenant, method, key))
      if (scoped !== undefined) {
        assert.equal(valid, key)
        assert.ok(scoped.startsWith('v1:') && /^[\x21-\x7e]+$/.test(scoped), scoped)
        assert.equal(oncely.scope(tenant, method, key), scoped)
      }
    }),
    params,
  )
})

test('fingerprints: any value, JSON data canonical and stable', () => {
  fc.assert(
    prop(fc.oneof(anything, fc.jsonValue()), (value) => {
      const fp = documented(() => oncely.fingerprint(value))
      const canonical = documented(() => oncely.canonicalJson(value))
      assert.equal(fp === undefined, canonical === undefined)
      if (canonical === undefined) return
      assert.match(fp, /^[0-9a-f]{64}$/)
      assert.equal(oncely.fingerprintBytes(Buffer.from(canonical)), fp)
      assert.equal(oncely.canonicalJson(JSON.parse(canonical)), canonical)
    }),
    params,
  )
  fc.assert(
    prop(fc.jsonValue(), (value) => {
      // Plain JSON data always has a fingerprint, whatever its key order.
      const fp = oncely.fingerprint(value)
      if (value !== null && typeof value === 'object' && !Array.isArray(value)) {
        const reversed = Object.fromEntries(Object.entries(value).reverse())
        assert.equal(oncely.fingerprint(reversed), fp)
      }
    }),
    params,
  )
  fc.assert(
    prop(anything, (data) => {
      const fp = documented(() => oncely.fingerprintBytes(data))
      let bytes = false
      try {
        bytes = Buffer.isBuffer(data)
      } catch {} // a proxy whose traps throw
      if (bytes) assert.match(fp, /^[0-9a-f]{64}$/)
    }),
    params,
  )
})

// ---- server delays, codes, classification --------------------------------------------------

test('server delay parsers and codes: any input', () => {
  fc.assert(
    prop(fc.oneof(texts, anything), anything, anything, (value, now, code) => {
      const d = documented(() => oncely.parseRetryAfter(value, now))
      assert.ok(d === undefined || d >= 0)
      documented(() => oncely.parsePushbackMs(value))
      documented(() => oncely.classify(code))
      documented(() => oncely.classify(code, value))
      documented(() => oncely.codeFromHttp(code))
      const reasons = new oncely.ReasonCodes()
      documented(() => reasons.register(value, code))
      const r = documented(() => reasons.resolve(value))
      assert.ok(r === undefined || r === null || (r >= 0 && r <= 16))
    }),
    params,
  )
})

// ---- foreign errors ----------------------------------------------------------------------------

const headerNames = fc.constantFrom('retry-after', 'Retry-After', 'grpc-retry-pushback-ms', 'grpc-status-details-bin', 'x')
const headerValues = fc.oneof(texts, anything, fc.uint8Array({ maxLength: 20 }), fc.constantFrom('-0', '1', 'Sun, 06 Nov 1994 08:49:37 GMT'))
const headerBags = fc.oneof(
  fc.dictionary(headerNames, headerValues, { maxKeys: 3 }),
  fc.dictionary(headerNames, headerValues, { maxKeys: 3 }).map((o) => new Headers(Object.entries(o).filter(([, v]) => typeof v === 'string' && !/[^\t\x20-\x7e\x80-\xff]/.test(v)))),
  fc.constant(new Recipe('headers whose get throws', () => ({ get() { throw new Boom('get') } }))),
  hostile,
)

const foreignError = fc.letrec((tie) => ({
  error: fc.record(
    {
      base: fc.constantFrom(Error, TypeError, RangeError, Object, null),
      name: fc.oneof(texts, fc.constantFrom('AbortError', 'TimeoutError', 'FetchError')),
      code: fc.oneof(anything, fc.integer({ min: 0, max: 16 }), fc.constantFrom('ECONNRESET', 'UNAVAILABLE', 'RATE_LIMITED', 'UND_ERR_SOCKET')),
      status: anything,
      statusCode: anything,
      retryAfterMs: anything,
      headers: headerBags,
      response: fc.oneof(anything, fc.record({ status: anything, headers: headerBags })),
      metadata: headerBags,
      throwing: fc.uniqueArray(fc.constantFrom('code', 'status', 'headers', 'response', 'cause', 'name', 'metadata'), { maxLength: 3 }),
      cause: fc.oneof({ depthSize: 'small' }, fc.constant(undefined), anything, tie('error')),
    },
    { requiredKeys: ['base'] },
  ).map((spec) => new Recipe(`an error ${fc.stringify(spec)}`, () => build(spec))),
}))

function build(spec) {
  const e = spec.base === null ? Object.create(null) : spec.base === Object ? {} : new spec.base('generated')
  for (const k of ['name', 'code', 'status', 'statusCode', 'retryAfterMs', 'headers', 'response', 'metadata', 'cause']) {
    if (k in spec) {
      const raw = spec[k]
      const v =
        k === 'response' && raw !== null && typeof raw === 'object' && Object.getPrototypeOf(raw) === Object.prototype
          ? { status: real(raw.status), headers: real(raw.headers) }
          : real(raw)
      Object.defineProperty(e, k, { value: v, configurable: true, enumerable: true, writable: true })
    }
  }
  for (const k of spec.throwing ?? []) {
    Object.defineProperty(e, k, {
      configurable: true,
      get() {
        throw new Boom(k)
      },
    })
  }
  return e
}

test('failureOf / codeOf: never throw, whatever the error is', () => {
  fc.assert(
    prop(fc.oneof(foreignError.error, anything), fc.boolean(), (err, withReasons) => {
      const reasons = withReasons ? new oncely.ReasonCodes() : undefined
      const f = oncely.failureOf(err, { reasons })
      const code = oncely.codeOf(err, { reasons })
      assert.ok(Number.isInteger(code) && code >= 0 && code <= 16)
      assert.equal(f.code, code)
      if (f.delayMs !== undefined) assert.ok(f.delayMs >= 0)
    }),
    params,
  )
})

test('a readable code is read whatever else the error carries', () => {
  fc.assert(
    prop(fc.integer({ min: 0, max: 16 }), fc.dictionary(headerNames, fc.oneof(texts, fc.uint8Array({ maxLength: 20 }))), anything, (code, headers, retryAfterMs) => {
      const e = Object.assign(new Error('x'), { code, headers, retryAfterMs })
      assert.equal(oncely.codeOf(e), code)
    }),
    params,
  )
})

test('retry gives back the error the caller threw, whatever it is', async () => {
  await fc.assert(
    asyncProp(fc.array(fc.oneof(foreignError.error, anything), { minLength: 1, maxLength: 3 }), fc.boolean(), async (errors, safe) => {
      let i = 0
      const policy = { maxAttempts: errors.length, baseDelayMs: 0, maxDelayMs: 0 }
      try {
        // A deadline bounds the server's delays (an error may ask for years).
        await bounded(oncely.retry(() => { throw errors[Math.min(i++, errors.length - 1)] }, { policy, safe, deadline: 1000 }))
      } catch (e) {
        if (!errors.some((x) => Object.is(x, e))) assert.fail(`retry threw something else: ${describe(e)}`)
        return
      }
      assert.fail('retry resolved')
    }),
    params,
  )
})

// ---- stores --------------------------------------------------------------------------------------

test('IdempotencyStore and RedisStore: any options', async () => {
  fc.assert(
    prop(optionsOf(['ttlMs', 'maxEntries', 'inProgressRetryAfterMs', 'cachePermanentFailures']), (opts) => {
      documented(() => new oncely.IdempotencyStore(opts))
    }),
    params,
  )
  const redisKeys = ['url', 'leaseMs', 'ttlMs', 'prefix', 'connectTimeoutMs', 'ioTimeoutMs', 'workers', 'inProgressRetryAfterMs', 'maxResultBytes', 'encode', 'decode']
  const urls = fc.oneof(texts, anything, fc.constantFrom('redis://127.0.0.1:1/0', 'redis://', 'redis://h:99999', 'rediss://x', 'unix:///nope', 'redis://[::1/'))
  await fc.assert(
    asyncProp(urls, fc.dictionary(fc.constantFrom(...redisKeys), fc.oneof(anything, texts), { maxKeys: 4 }), async (url, rest) => {
      const store = documented(() => new oncely.RedisStore({ ...rest, url }))
      if (store !== undefined && url === 'redis://127.0.0.1:1/0') {
        const k = oncely.scope('t', 'm', oncely.newKey())
        await assert.rejects(bounded(store.execute(k, 'fp', () => 1)), (e) => {
          assertDocumented(e)
          return e.kind === 'unavailable' || e.name === 'TypeError' || e.name === 'RangeError'
        })
      }
    }),
    { ...params, numRuns: Math.max(10, Math.floor(RUNS / 2)) },
  )
})

const actions = fc.oneof(
  fc.record({ kind: fc.constant('return'), payload: fc.oneof(anything, fc.jsonValue()) }),
  fc.record({ kind: fc.constant('throw'), payload: fc.oneof(foreignError.error, anything) }),
)

/** Runs the action under a fresh key, then a second call: it replays or runs anew. */
async function checkExecute(store, action) {
  const k = oncely.scope('tenant', 'Method', oncely.newKey())
  const ran = []
  let failed = false
  try {
    const out = await bounded(
      store.execute(k, 'fp', () => {
        ran.push(1)
        if (action.kind === 'throw') throw action.payload
        return action.payload
      }),
    )
    assert.equal(out.source, 'led')
  } catch (e) {
    // The action's own error, or its value's (a thenable whose `then` throws).
    failed = true
    if (!Object.is(e, action.payload) && !(e instanceof Boom)) {
      assertDocumented(e)
      assert.notEqual(e.kind, 'unavailable', e.message)
    }
  }
  assert.deepEqual(ran, [1])
  let again
  try {
    again = await bounded(
      store.execute(k, 'fp', () => {
        ran.push(2)
        return 'second'
      }),
    )
  } catch (e) {
    // A failure cached as permanent, or a result that could not be stored, replays as
    // its error; the action does not run again.
    assert.deepEqual(ran, [1])
    assert.ok(failed || e?.kind === 'result_not_stored', describe(e))
    return
  }
  if (ran.length === 2) {
    assert.ok(failed, 'a completed key ran again')
    assert.equal(again.value, 'second')
  } else {
    assert.ok(again.replayed, 'a completed key replays')
  }
}

test('IdempotencyStore.execute: any action outcome, never a leaked lease', async () => {
  await fc.assert(
    asyncProp(actions, fc.boolean(), async (action, cache) => {
      const store = new oncely.IdempotencyStore({ cachePermanentFailures: cache })
      await checkExecute(store, action)
    }),
    params,
  )
})

const URL = process.env.ONCELY_REDIS_URL
const needsRedis = URL ? {} : { skip: 'needs a Redis: run scripts/test-redis' }

test('RedisStore.execute: any action outcome, never a leaked lease', needsRedis, async () => {
  const store = new oncely.RedisStore({ url: URL, leaseMs: 5000, prefix: 'oncely-generated' })
  await fc.assert(
    asyncProp(actions, (action) => checkExecute(store, action)),
    { ...params, numRuns: Math.max(10, Math.floor(RUNS / 2)) },
  )
})

test('execute: any fingerprint, any key; refused ones never run the action', async () => {
  const store = new oncely.IdempotencyStore()
  await fc.assert(
    asyncProp(fc.oneof(texts, anything), fc.oneof(texts, anything), fc.boolean(), async (fp, scoped, fresh) => {
      const key = fresh ? oncely.scope('t', 'm', oncely.newKey()) : scoped
      let ran = 0
      try {
        await bounded(store.execute(key, fp, () => ++ran))
        assert.equal(ran, 1)
        assert.equal((await store.execute(key, fp, () => ++ran)).replayed, true)
      } catch (e) {
        assertDocumented(e)
        assert.equal(ran, 0)
      }
    }),
    params,
  )
})
