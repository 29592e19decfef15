'use strict'
// Bad input from JavaScript — wrong types, NaN, Infinity, negative numbers, huge
// strings, missing arguments — is a thrown TypeError/RangeError with a `code` and the
// `field` it concerns; never a crash of the process.
const test = require('node:test')
const assert = require('node:assert/strict')

const oncely = require('oncely')
const { RetryPolicy, RetryBudget, Deadline, ManualClock, ReasonCodes } = oncely

const huge = 'k'.repeat(10_000_000)

function throwsField(fn, name, field) {
  assert.throws(fn, (e) => {
    assert.equal(e.name, name, `${e.name}: ${e.message}`)
    assert.equal(e.code, 'INVALID_ARGUMENT')
    assert.equal(e.field, field, e.message)
    assert.ok(e.message.includes(field), `the message names the field: ${e.message}`)
    return true
  })
}

test('RetryPolicy: every field checked, named in the error', () => {
  for (const [opts, name, field] of [
    [{ maxAttempts: 0 }, 'RangeError', 'maxAttempts'],
    [{ maxAttempts: 2.5 }, 'RangeError', 'maxAttempts'],
    [{ maxAttempts: -1 }, 'RangeError', 'maxAttempts'],
    [{ maxAttempts: NaN }, 'RangeError', 'maxAttempts'],
    [{ maxAttempts: 2 ** 40 }, 'RangeError', 'maxAttempts'],
    [{ maxAttempts: '3' }, 'TypeError', 'maxAttempts'],
    [{ baseDelayMs: -1 }, 'RangeError', 'baseDelayMs'],
    [{ baseDelayMs: NaN }, 'RangeError', 'baseDelayMs'],
    [{ baseDelayMs: Infinity }, 'RangeError', 'baseDelayMs'],
    [{ baseDelayMs: 2000 }, 'RangeError', 'baseDelayMs'],
    [{ maxDelayMs: -Infinity }, 'RangeError', 'maxDelayMs'],
    [{ maxDelayMs: 1e300 }, 'RangeError', 'maxDelayMs'],
    [{ maxDelayMs: null }, 'TypeError', 'maxDelayMs'],
    [{ multiplier: 0.5 }, 'RangeError', 'multiplier'],
    [{ multiplier: NaN }, 'RangeError', 'multiplier'],
    [{ multiplier: Infinity }, 'RangeError', 'multiplier'],
    [{ jitter: 1 }, 'RangeError', 'jitter'],
    [{ jitter: -0.1 }, 'RangeError', 'jitter'],
    [{ jitter: NaN }, 'RangeError', 'jitter'],
    [{ jitter: {} }, 'TypeError', 'jitter'],
    [{ seed: -1 }, 'RangeError', 'seed'],
    [{ seed: 1.5 }, 'RangeError', 'seed'],
    [{ seed: 2 ** 64 }, 'RangeError', 'seed'],
    [{ seed: 2n ** 64n }, 'RangeError', 'seed'],
    [{ seed: 'x' }, 'TypeError', 'seed'],
    [{ minAttemptMs: -5 }, 'RangeError', 'minAttemptMs'],
    [{ maxAtempts: 3 }, 'TypeError', 'maxAtempts'],
    [7, 'TypeError', 'options'],
  ]) {
    throwsField(() => new RetryPolicy(opts), name, field)
  }
  assert.equal(new RetryPolicy({ seed: 2n ** 64n - 1n }).seed, 2n ** 64n - 1n)
  assert.equal(new RetryPolicy(undefined).maxAttempts, 3)
  assert.equal(new RetryPolicy(null).maxAttempts, 3)
  const p = new RetryPolicy()
  throwsField(() => p.delayAfter(-1), 'RangeError', 'failedAttempt')
  const seeded = new RetryPolicy({ seed: 1 })
  assert.equal(seeded.delayAfter(0), seeded.delayAfter(1)) // 0 is taken as 1, as in Rust and Python
  throwsField(() => p.delayAfter(NaN), 'RangeError', 'failedAttempt')
  throwsField(() => p.delayAfter(), 'TypeError', 'failedAttempt')
  assert.equal(p.delayAfter(4294967295) <= 1200, true)
})

test('Deadline, RetryBudget, ManualClock', () => {
  throwsField(() => new Deadline(), 'TypeError', 'deadline')
  throwsField(() => new Deadline(-1), 'RangeError', 'deadline')
  throwsField(() => new Deadline(NaN), 'RangeError', 'deadline')
  throwsField(() => new Deadline(Infinity), 'RangeError', 'deadline')
  throwsField(() => new Deadline(10, {}), 'TypeError', '_clock')
  assert.ok(new Deadline(1e12).remainingMs > 0)
  throwsField(() => new RetryBudget({ ratio: -0.1 }), 'RangeError', 'ratio')
  throwsField(() => new RetryBudget({ ratio: NaN }), 'RangeError', 'ratio')
  throwsField(() => new RetryBudget({ windowMs: 5 }), 'RangeError', 'windowMs')
  throwsField(() => new RetryBudget({ minPerSec: -1 }), 'RangeError', 'minPerSec')
  throwsField(() => new RetryBudget({ minPerSec: 'many' }), 'TypeError', 'minPerSec')
  const clock = new ManualClock()
  throwsField(() => clock.advance(-1), 'RangeError', 'ms')
  throwsField(() => clock.advance(NaN), 'RangeError', 'ms')
  throwsField(() => clock.set('1'), 'TypeError', 'ms')
  clock.advance(1e12)
  assert.equal(clock.nowMs, 1e12)
  clock.advance(1e15) // saturates (the core's clock counts u64 nanoseconds)
  assert.ok(clock.nowMs > 1e12)
  throwsField(() => clock.advance(1e300), 'RangeError', 'ms')
})

test('codes and classification', () => {
  throwsField(() => oncely.codeFromHttp(-1), 'RangeError', 'status')
  throwsField(() => oncely.codeFromHttp(70000), 'RangeError', 'status')
  throwsField(() => oncely.codeFromHttp(200.5), 'RangeError', 'status')
  throwsField(() => oncely.codeFromHttp('503'), 'TypeError', 'status')
  throwsField(() => oncely.classify(17), 'RangeError', 'code')
  throwsField(() => oncely.classify('NOPE'), 'RangeError', 'code')
  throwsField(() => oncely.classify(null), 'TypeError', 'code')
  throwsField(() => oncely.classify(14, { safe: 1 }), 'TypeError', 'safe')
  throwsField(() => oncely.classify(14, { sfe: true }), 'TypeError', 'sfe')
  throwsField(() => oncely.parseRetryAfter(5), 'TypeError', 'retryAfter')
  throwsField(() => oncely.parseRetryAfter('soon'), 'RangeError', 'retryAfter')
  throwsField(() => oncely.parseRetryAfter(huge), 'RangeError', 'retryAfter')
  throwsField(() => oncely.parseRetryAfter('5', NaN), 'RangeError', 'nowMs')
  throwsField(() => oncely.parsePushbackMs('1.5'), 'RangeError', 'grpc-retry-pushback-ms')
  const reasons = new ReasonCodes()
  throwsField(() => reasons.register('lower', 'UNAVAILABLE'), 'RangeError', 'reason')
  throwsField(() => reasons.register('OK_NAME', 99), 'RangeError', 'code')
})

test('keys and fingerprints, huge strings included', () => {
  throwsField(() => oncely.validateKey(huge), 'RangeError', 'idempotencyKey')
  throwsField(() => oncely.validateKey(42), 'TypeError', 'idempotencyKey')
  throwsField(() => oncely.validateKey(), 'TypeError', 'idempotencyKey')
  assert.throws(() => oncely.validateKey(''), { name: 'RangeError', code: 'INVALID_ARGUMENT', kind: 'missing_key' })
  throwsField(() => oncely.scope(huge, 'm', 'key-12345'), 'RangeError', 'tenant')
  throwsField(() => oncely.scope('t', 'x'.repeat(1025), 'key-12345'), 'RangeError', 'method')
  throwsField(() => oncely.scope('', 'm', 'key-12345'), 'RangeError', 'tenant')
  throwsField(() => oncely.scope('t', 'm', 'short'), 'RangeError', 'idempotencyKey')
  throwsField(() => oncely.scope('t', 'm'), 'TypeError', 'idempotencyKey')
  throwsField(() => oncely.scope(1, 'm', 'key-12345'), 'TypeError', 'tenant')
  throwsField(() => oncely.deriveKey('', 'op'), 'RangeError', 'businessId')
  throwsField(() => oncely.deriveKey('id', null), 'TypeError', 'operation')
  assert.equal(oncely.deriveKey(huge, 'op').length, 36, 'long business ids are hashed')
  throwsField(() => oncely.fingerprint(undefined), 'TypeError', 'value')
  throwsField(() => oncely.fingerprint(() => 1), 'TypeError', 'value')
  throwsField(() => oncely.fingerprint({ a: 1n }), 'TypeError', 'value')
  throwsField(() => oncely.fingerprint({ a: NaN }), 'RangeError', 'value')
  throwsField(() => oncely.fingerprint([Infinity]), 'RangeError', 'value')
  const cyclic = {}
  cyclic.self = cyclic
  throwsField(() => oncely.fingerprint(cyclic), 'TypeError', 'value')
  throwsField(() => oncely.fingerprintBytes(42), 'TypeError', 'data')
  throwsField(() => oncely.fingerprintBytes(new Uint16Array(2)), 'TypeError', 'data')
  assert.equal(oncely.fingerprint({ s: huge }).length, 64)
  // JSON semantics of JavaScript: toJSON, undefined members dropped.
  assert.equal(oncely.canonicalJson({ d: new Date(0), u: undefined }), '{"d":"1970-01-01T00:00:00.000Z"}')
})

test('internal classes refuse misuse without crashing', async () => {
  const native = require('../native.js')
  assert.throws(() => new native.RetryState({}, true, false, false))
  const LEAD = {}
  const slot = []
  const store = new native.NativeStore(undefined, {}, LEAD, slot)
  const other = new native.NativeStore(undefined, {}, {}, [])
  throwsField(() => store.begin('not a key', 'fp', true), 'RangeError', 'scoped')
  throwsField(() => store.begin(42, 'fp', true), 'TypeError', 'scoped')
  throwsField(() => store.begin(oncely.scope('t', 'm', oncely.newKey()), null, true), 'TypeError', 'fingerprint')
  assert.equal(store.begin(oncely.scope('t', 'm', oncely.newKey()), 'fp', true), LEAD)
  const lease = slot[0]
  for (const bad of [{}, 1, undefined, null]) throwsField(() => store.complete(bad, 1), 'TypeError', 'lease')
  throwsField(() => other.complete(lease, 1), 'TypeError', 'lease')
  store.complete(lease, 1)
  assert.throws(() => store.complete(lease, 2), { code: 'FAILED_PRECONDITION', kind: 'lease_settled' })
  assert.throws(() => store.fail(lease, new Error('x'), 2), { code: 'FAILED_PRECONDITION' })
  store.abandon(lease)
})

test('scoped keys: only the exact form scope() makes is accepted', async () => {
  const store = new oncely.IdempotencyStore()
  const k = oncely.newKey()
  const scoped = oncely.scope('a:b', 'c d', k)
  assert.equal(typeof scoped, 'string')
  assert.equal((await store.execute(scoped, 'fp', async () => 1)).value, 1)
  for (const bad of ['', 'x', `a:b:${k}`, `v1:a%3ab:c%20d:${k}`, `v1:%61:c:${k}`, `v1:a:b:c:${k}`, 'v1:' + 'x'.repeat(70_000)]) {
    await assert.rejects(store.execute(bad, 'fp', async () => 1), { name: 'RangeError', code: 'INVALID_ARGUMENT' }, bad.slice(0, 40))
  }
  await assert.rejects(store.execute('x', 'fp', async () => 1), { field: 'scoped' })
  assert.throws(() => store.remove('nope'), { name: 'RangeError', field: 'scoped' })
})

test('strings around the native stack buffer (256 bytes) are read whole, multi-byte characters too', async () => {
  const store = new oncely.IdempotencyStore()
  for (const ch of ['a', 'é', '€', '😀']) {
    for (let n = 60; n <= 270; n += 1) {
      const base = ch.repeat(Math.ceil(n / Buffer.byteLength(ch))).slice(0, n)
      const fp = base + 'X'
      const other = base + 'Y' // differs only in its last character
      const k = oncely.scope('t', 'm', oncely.newKey())
      await store.execute(k, fp, async () => 1)
      assert.equal((await store.execute(k, fp, async () => 2)).value, 1, `${ch} × ${n}: replay`)
      await assert.rejects(store.execute(k, other, async () => 3), { code: 'FAILED_PRECONDITION' }, `${ch} × ${n}: the last character counts`)
    }
    for (let n = 200; n <= 300; n += 7) {
      const tenant = ch.repeat(Math.ceil(n / Buffer.byteLength(ch)))
      const scoped = oncely.scope(tenant, 'm', 'key-12345')
      assert.ok(scoped.endsWith(':m:key-12345'), `${ch} × ${n}`)
      assert.equal(scoped, oncely.scope(tenant, 'm', 'key-12345'))
      // One character less (a whole one: half a surrogate pair is refused).
      assert.notEqual(scoped, oncely.scope(Array.from(tenant).slice(0, -1).join(''), 'm', 'key-12345'))
    }
  }
})

test('a revoked proxy or a non-string reason is refused with the field named', async () => {
  const { proxy, revoke } = Proxy.revocable({}, {})
  revoke()
  const store = new oncely.IdempotencyStore()
  await assert.rejects(store.execute(proxy, 'fp', () => 1), { name: 'TypeError', code: 'INVALID_ARGUMENT', field: 'scoped' })
  await assert.rejects(store.execute('k', proxy, () => 1), { name: 'TypeError', code: 'INVALID_ARGUMENT', field: 'fingerprint' })
  for (const bad of [0, 1n, null, undefined, {}, Symbol('s')]) {
    throwsField(() => new ReasonCodes().resolve(bad), 'TypeError', 'reason')
  }
  assert.equal(new ReasonCodes().resolve('RATE_LIMITED'), oncely.Code.RESOURCE_EXHAUSTED)
})

test('every error oncely throws is an OncelyError and of its kind\'s class; httpStatusOf gives its status', async () => {
  const caught = (fn) => {
    try {
      fn()
    } catch (e) {
      return e
    }
    throw new Error('no error')
  }
  const store = new oncely.IdempotencyStore()
  const k = oncely.scope('acme', 'Charge', oncely.newKey())
  await store.execute(k, 'fp', () => 1)
  const mismatch = await store.execute(k, 'other', () => 2).catch((e) => e)
  const k2 = oncely.scope('acme', 'Charge', oncely.newKey())
  let release
  const running = store.execute(k2, 'fp', () => new Promise((r) => (release = r)))
  const busy = await store.execute(k2, 'fp', () => 3, { wait: false }).catch((e) => e)
  release()
  await running
  const cases = [
    [caught(() => oncely.validateKey('short')), 'InvalidKeyError', 400],
    [caught(() => oncely.validateKey('bad key!')), 'InvalidKeyError', 400],
    [caught(() => oncely.validateKey('')), 'MissingKeyError', 400],
    [caught(() => oncely.scope('acme', 'Charge', 7)), 'InvalidArgumentError', 400],
    [caught(() => new RetryPolicy({ jitter: 2 })), 'InvalidArgumentError', 400],
    [mismatch, 'FingerprintMismatchError', 422],
    [busy, 'InProgressError', 409],
  ]
  for (const [e, cls, status] of cases) {
    assert.ok(e instanceof oncely.OncelyError, `${e.message} is an OncelyError`)
    assert.ok(e instanceof oncely[cls], `${e.message} is a ${cls}`)
    assert.ok(e instanceof Error)
    assert.equal(oncely.httpStatusOf(e), status, e.message)
  }
  // Bad arguments stay TypeError / RangeError.
  assert.ok(cases[3][0] instanceof TypeError && cases[4][0] instanceof RangeError)
  assert.ok(!(mismatch instanceof oncely.InProgressError) && !(busy instanceof oncely.InvalidArgumentError))
  assert.ok(!(cases[4][0] instanceof oncely.InvalidKeyError), 'a bad policy is not a bad key')
  // Other errors are not oncely's.
  for (const other of [new Error('x'), Object.assign(new Error('y'), { code: 'ECONNRESET' }), Object.assign(new Error('z'), { kind: 'capacity', code: 'X' }), null, 'text']) {
    assert.ok(!(other instanceof oncely.OncelyError))
    assert.equal(oncely.httpStatusOf(other), undefined)
  }
  // Made by hand: the class's kind, code and status.
  const made = new oncely.StoreUnavailableError('down', { key: 'k' })
  assert.deepEqual([made.kind, made.code, made.httpStatus, made.name, made.key], ['unavailable', 'UNAVAILABLE', 503, 'StoreUnavailableError', 'k'])
  assert.ok(made instanceof oncely.OncelyError && made instanceof oncely.StoreUnavailableError)
  for (const [cls, status] of [['LeaseLostError', 409], ['CapacityError', 503], ['LeaderPanickedError', 500], ['ReentrantCallError', 500], ['ResultNotStoredError', 500]]) {
    assert.equal(oncely.httpStatusOf(new oncely[cls]('x')), status, cls)
  }
})

test('messages use the option name and unit of Node, with an example of a valid value', () => {
  const message = (fn) => {
    try {
      fn()
    } catch (e) {
      return [e.field, e.message]
    }
    throw new Error('no error')
  }
  const url = 'redis://127.0.0.1:1/0'
  assert.deepEqual(message(() => new oncely.RedisStore({ url, leaseMs: 0 })), ['leaseMs', 'invalid leaseMs: must be at least 30 (milliseconds), e.g. 30000, got 0'])
  assert.deepEqual(message(() => new oncely.RedisStore({ url, leaseMs: 60, ioTimeoutMs: 1000 })), [
    'leaseMs',
    'invalid leaseMs: must be at least 3 × ioTimeoutMs (1000 (milliseconds)), got 60: a renewal that times out must leave time for another before the lease runs out (raise leaseMs or lower ioTimeoutMs)',
  ])
  assert.deepEqual(message(() => new oncely.IdempotencyStore({ ttlMs: 0 })), ['ttlMs', 'invalid ttlMs: must be greater than 0 (milliseconds), e.g. 86400000 (a day), got 0'])
  assert.deepEqual(message(() => new RetryPolicy({ baseDelayMs: 2000, maxDelayMs: 1000 })), ['baseDelayMs', 'invalid baseDelayMs: must not exceed maxDelayMs (1000 (milliseconds)), got 2000'])
  assert.deepEqual(message(() => new RetryBudget({ windowMs: 1 })), ['windowMs', 'invalid windowMs: must be at least 10 (milliseconds), e.g. 10000, got 1'])
  const [field, text] = message(() => new oncely.RedisStore({ url: 'localhost:6379' }))
  assert.equal(field, 'url')
  assert.match(text, /expected redis:\/\/host:6379\/0/)
})

test('http rules refuse arguments of the wrong type or range with INVALID_ARGUMENT, naming them', () => {
  const { http } = require('oncely')
  const refused = (f, Ctor, field) => assert.throws(f, (e) => e instanceof Ctor && e.code === 'INVALID_ARGUMENT' && e.message.includes(field))
  refused(() => http.storableStatus('200'), TypeError, 'status')
  refused(() => http.storableStatus(200.5), RangeError, 'status')
  refused(() => http.storableStatus(-1), RangeError, 'status')
  refused(() => http.storableStatus(70_000), RangeError, 'status')
  assert.equal(http.storableStatus(1000), false)
  assert.equal(http.storableStatus(201), true)
  for (const f of ['isJson', 'isEventStream', 'isGrpc']) {
    refused(() => http[f](5), TypeError, 'contentType')
    refused(() => http[f](null), TypeError, 'contentType')
  }
  refused(() => http.storableGrpcStatus(0), TypeError, 'value')
  refused(() => http.problem(5), TypeError, 'error')
  refused(() => http.problem(null), TypeError, 'error')
  refused(() => http.problem({}), TypeError, 'kind')
  refused(() => http.problem({ kind: 7 }), TypeError, 'kind')
  assert.equal(http.problem({ kind: 'missing_key' }).status, 400)
})

