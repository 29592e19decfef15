'use strict'
// The shared cross-language test vectors (tests/vectors/*.json, described in
// tests/vectors/README.md), run through the public API of the Node package: the same
// results as the Rust and Python suites.
const test = require('node:test')
const assert = require('node:assert/strict')
const fs = require('node:fs')
const path = require('node:path')

const oncely = require('oncely')
const native = require('../native.js')
const { Code, RetryPolicy, ManualClock } = oncely

const dir = path.join(__dirname, '..', '..', 'tests', 'vectors')
const load = (name) => JSON.parse(fs.readFileSync(path.join(dir, name), 'utf8'))

// Field names in the vectors are the core's; the Node API names them as options.
const JS_FIELD = {
  max_attempts: 'maxAttempts',
  base_delay: 'baseDelayMs',
  max_delay: 'maxDelayMs',
  min_attempt: 'minAttemptMs',
  idempotency_key: 'idempotencyKey',
  business_id: 'businessId',
  retry_after: 'retryAfter',
  window: 'windowMs',
}

function expectError(fn, want, what) {
  let err
  try {
    fn()
  } catch (e) {
    err = e
  }
  assert.ok(err, `${what}: expected an error ${JSON.stringify(want)}, got none`)
  assert.ok(err instanceof Error, `${what}: ${err} is an Error`)
  assert.equal(err.code, 'INVALID_ARGUMENT', `${what}: code`)
  assert.equal(err.kind, want.kind, `${what}: kind (${err.message})`)
  if (want.field !== undefined) assert.equal(err.field, JS_FIELD[want.field] ?? want.field, `${what}: field (${err.message})`)
}

function policyOf(p) {
  const opts = {
    maxAttempts: p.max_attempts,
    baseDelayMs: p.base_delay_ms,
    maxDelayMs: p.max_delay_ms,
    multiplier: p.multiplier,
    jitter: p.jitter,
    seed: p.seed,
  }
  if (p.min_attempt_ms !== undefined) opts.minAttemptMs = p.min_attempt_ms
  return new RetryPolicy(opts)
}

const label = (i, c) => `#${i}${c.comment ? ` (${c.comment})` : ''}`

test('backoff.json: delays and validation', () => {
  const cases = load('backoff.json')
  assert.ok(cases.length > 0)
  cases.forEach((c, i) => {
    if (c.error) return expectError(() => policyOf(c.policy), c.error, label(i, c))
    const policy = policyOf(c.policy)
    for (const d of c.delays) {
      assert.equal(policy.delayAfter(d.failed_attempt), d.delay_ms, `${label(i, c)} failed_attempt ${d.failed_attempt}`)
    }
    if (c.sequence_ms) assert.deepEqual(policy.delays(), c.sequence_ms, `${label(i, c)} sequence`)
  })
})

test('classification.json: all codes x all call facts', () => {
  const cases = load('classification.json')
  assert.equal(cases.filter((c) => c.server_delay === undefined).length, 136)
  cases.forEach((c, i) => {
    const facts = { safe: c.safe, rereads: c.rereads, transientInternal: c.transient_internal }
    const sd = c.server_delay
    const server = sd === undefined || sd === null ? undefined : sd === 'do_not_retry' ? { doNotRetry: true } : { delayMs: sd.after_ms }
    const got = oncely.classify(c.code, facts, server)
    assert.deepEqual(got, { retryable: c.retryable, rule: c.rule }, label(i, c))
    // The same through the code's number.
    assert.deepEqual(oncely.classify(Code[c.code], facts, server), got)
  })
})

test('http.json: HTTP status to code', () => {
  const cases = load('http.json')
  cases.forEach((c) => assert.equal(Code[oncely.codeFromHttp(c.status)], c.code, `status ${c.status}`))
})

test('retry_after.json: Retry-After and grpc-retry-pushback-ms', () => {
  const cases = load('retry_after.json')
  cases.forEach((c, i) => {
    const what = label(i, c)
    if (c.delay_ms_at_least !== undefined) {
      // Saturated: a delay longer than any deadline.
      const got = c.header === 'Retry-After' ? oncely.parseRetryAfter(c.value, c.now * 1000) : oncely.parsePushbackMs(c.value).delayMs
      return assert.ok(got >= c.delay_ms_at_least, `${what}: ${got}`)
    }
    if (c.header === 'Retry-After') {
      const parse = () => oncely.parseRetryAfter(c.value, c.now * 1000)
      if (c.error) return expectError(parse, c.error, what)
      assert.equal(parse(), c.delay_ms, what)
    } else {
      assert.equal(c.header, 'grpc-retry-pushback-ms')
      const parse = () => oncely.parsePushbackMs(c.value)
      if (c.error) return expectError(parse, c.error, what)
      if (c.do_not_retry) assert.deepEqual(parse(), { doNotRetry: true }, what)
      else assert.deepEqual(parse(), { delayMs: c.delay_ms, doNotRetry: false }, what)
    }
  })
})

// A string field, given as text or as UTF-16 code units (`<name>_utf16`, which may hold
// a lone surrogate: a JavaScript string can).
const text = (c, name) => (name in c ? c[name] : String.fromCharCode(...c[`${name}_utf16`]))

test('keys.json: parse, derive, scope', () => {
  const cases = load('keys.json')
  const scopedSeen = new Map()
  cases.forEach((c, i) => {
    const what = label(i, c)
    if (c.op === 'parse') {
      const key = text(c, 'key')
      if (c.error) return expectError(() => oncely.validateKey(key), c.error, what)
      assert.equal(oncely.validateKey(key), key, what)
    } else if (c.op === 'derive') {
      const derive = () => oncely.deriveKey(text(c, 'business_id'), text(c, 'operation'))
      if (c.error) return expectError(derive, c.error, what)
      assert.equal(derive(), c.key, what)
    } else if (c.op === 'scope') {
      const triple = [text(c, 'tenant'), text(c, 'method'), text(c, 'key')]
      const make = () => oncely.scope(...triple)
      if (c.error) return expectError(make, c.error, what)
      const s = make()
      assert.equal(s, c.scoped, what)
      const id = JSON.stringify(triple)
      if (scopedSeen.has(c.scoped)) assert.equal(scopedSeen.get(c.scoped), id, `${what}: injective`)
      scopedSeen.set(c.scoped, id)
    } else if (c.op !== 'parse_scoped') {
      // parse_scoped: Rust's ScopedKey::parse, which the Node package does not offer.
      assert.fail(`unknown op ${c.op}`)
    }
  })
})

// The value of a fingerprints.json case: `value`, `value_json` (read by JSON.parse), a
// NaN or infinite number, a string of UTF-16 code units, or `nested` arrays/objects.
function fingerprintInput(c) {
  if ('value' in c) return c.value
  if ('value_json' in c) return JSON.parse(c.value_json)
  if ('value_special' in c) {
    const x = Number(c.value_special.float)
    return { top: x, array: [x], object: { x } }[c.value_special.in]
  }
  if ('value_utf16' in c) {
    const s = text(c.value_utf16, 'string')
    return c.value_utf16.in === 'top' ? s : { [s]: 0 }
  }
  let v = c.nested.kind === 'array' ? [] : {}
  for (let d = 1; d < c.nested.depth; d++) v = c.nested.kind === 'array' ? [v] : { a: v }
  return v
}

test('fingerprints.json: canonical JSON and SHA-256', () => {
  const cases = load('fingerprints.json')
  cases.forEach((c, i) => {
    const what = label(i, c)
    const value = fingerprintInput(c)
    if (c.error) {
      expectError(() => oncely.canonicalJson(value), c.error, `${what}: canonicalJson`)
      return expectError(() => oncely.fingerprint(value), c.error, `${what}: fingerprint`)
    }
    assert.equal(oncely.canonicalJson(value), c.canonical, what)
    assert.equal(oncely.fingerprint(value), c.sha256, what)
    assert.equal(oncely.fingerprintBytes(Buffer.from(c.canonical, 'utf8')), c.sha256, what)
    assert.equal(oncely.fingerprintBytes(c.canonical), c.sha256, what)
  })
})

test('retry_decisions.json: the JavaScript retry loop on a manual clock', async () => {
  const cases = load('retry_decisions.json')
  for (const [i, c] of cases.entries()) {
    const what = label(i, c)
    const clock = new ManualClock()
    const delays = []
    let calls = 0
    const numbers = []
    let result = 'ok'
    try {
      await oncely.retry(
        async (attempt) => {
          numbers.push(attempt.number)
          const step = c.script[Math.min(calls, c.script.length - 1)]
          calls += 1
          clock.advance(step.takes_ms)
          if (step.outcome === 'ok') return 'ok'
          throw { scripted: step }
        },
        {
          policy: policyOf(c.policy),
          safe: c.safe,
          rereads: c.rereads,
          transientInternal: c.transient_internal,
          deadline: c.deadline_ms === null ? undefined : c.deadline_ms,
          _clock: clock,
          onRetry: (e) => delays.push(e.delayMs),
          // The classify override: the scripted code and server delay.
          classify: ({ scripted }) => {
            const d = scripted.server_delay
            if (d === null) return scripted.outcome
            if (d === 'do_not_retry') return { code: scripted.outcome, doNotRetry: true }
            return { code: scripted.outcome, retryAfterMs: d.after_ms }
          },
        },
      )
    } catch (e) {
      assert.ok(e.scripted, `${what}: unexpected error ${e && e.stack}`)
      assert.equal(e.attemptNumber, calls, `${what}: attemptNumber`)
      result = e.stopReason
    }
    assert.deepEqual(
      { attempts: calls, delays_ms: delays, result, elapsed_ms: clock.nowMs },
      c.expect,
      what,
    )
    assert.deepEqual(numbers, Array.from({ length: calls }, (_, k) => k + 1), `${what}: attempt numbers`)
  }
})

test('result_codec.json: the stored form of a RedisStore result', () => {
  const cases = load('result_codec.json')
  const T = { json: 0, bytes: 1, no_value: 2, user_bytes: 4, user_text: 5 }
  for (const c of cases) {
    const record = Buffer.from(c.record_hex, 'hex')
    if (c.error) {
      assert.deepEqual(c.error, { kind: 'unavailable' })
      assert.throws(() => oncely.decodeResult(record), { code: 'UNAVAILABLE' }, c.comment)
      continue
    }
    const payload = c.kind === 'json' || c.kind === 'user_text' ? c.text : c.kind === 'not_storable' ? c.type_name : c.hex === undefined ? undefined : Buffer.from(c.hex, 'hex')
    assert.deepEqual(native.encodeRecord(c.kind, payload), record, c.comment)
    if (c.kind === 'not_storable') {
      assert.throws(() => oncely.decodeResult(record), { kind: 'result_not_stored', typeName: c.type_name }, c.comment)
      continue
    }
    const [tag] = native.decodeRecord(record)
    assert.equal(tag, T[c.kind], c.comment)
    if (c.kind === 'json') assert.deepEqual(oncely.decodeResult(record), c.value, c.comment)
    else if (c.kind === 'no_value') assert.equal(oncely.decodeResult(record), undefined)
    else if (c.kind === 'bytes') assert.deepEqual(oncely.decodeResult(record), payload, c.comment)
    else assert.deepEqual(oncely.decodeResult(record, (body) => ['decoded', body]), ['decoded', payload], c.comment)
  }
})

// A JavaScript error of the shape an extraction vector describes.
function foreign(shape) {
  const names = shape.names ?? []
  let Cls = Error
  for (const name of [...names].reverse()) {
    const Base = Cls
    Cls = { [name]: class extends Base {} }[name]
  }
  const err = new Cls('a foreign error')
  if (names.length > 0) err.name = names[0]
  if ('code' in shape) err.code = shape.code
  if ('status' in shape) err.status = shape.status
  if ('status_code' in shape) err.statusCode = shape.status_code
  if ('headers' in shape) err.headers = shape.headers
  if ('response' in shape) {
    const r = shape.response
    err.response = { status: r.status, statusCode: r.status_code, headers: r.headers === undefined ? undefined : new Headers(r.headers) }
  }
  if ('metadata' in shape) {
    // @grpc/grpc-js Metadata: get(key) gives every value, binary ones as Buffers.
    const md = new Map(Object.entries(shape.metadata).map(([k, v]) => [k.toLowerCase(), k.endsWith('-bin') && /^[A-Za-z0-9+/]*=*$/.test(v) ? Buffer.from(v, 'base64') : v]))
    err.metadata = { get: (k) => (md.has(k) ? [md.get(k)] : []) }
  }
  if ('cause' in shape) err.cause = foreign(shape.cause)
  return err
}

test('extraction.json: foreign errors read by the core', async () => {
  const cases = load('extraction.json')
  assert.ok(cases.length > 100)
  for (const [i, c] of cases.entries()) {
    const reasons = new oncely.ReasonCodes()
    for (const [name, code] of Object.entries(c.reasons ?? {})) reasons.register(name, code)
    const f = oncely.failureOf(foreign(c.error), { reasons })
    assert.deepEqual(
      { code: Code[f.code], delayMs: f.delayMs ?? null, doNotRetry: f.doNotRetry === true },
      { code: c.code, delayMs: c.delay_ms, doNotRetry: c.do_not_retry },
      label(i, c),
    )
    assert.deepEqual(oncely.classify(f.code, { safe: true }), { retryable: c.retryable, rule: c.rule }, label(i, c))
    // Retried with safe and 2 attempts: the second attempt happens exactly when the
    // code is retryable and the server did not say no.
    let calls = 0
    await assert.rejects(
      oncely.retry(
        () => {
          calls++
          throw foreign(c.error)
        },
        { safe: true, reasons, policy: { maxAttempts: 2, baseDelayMs: 1, jitter: 0 }, _clock: new ManualClock() },
      ),
      /a foreign error/,
      label(i, c),
    )
    assert.equal(calls, c.retryable && !c.do_not_retry ? 2 : 1, label(i, c))
  }
})

test('budget.json: the retry budget on a manual clock', () => {
  const cases = load('budget.json')
  cases.forEach((c, i) => {
    const what = label(i, c)
    const clock = new ManualClock()
    const make = () => new oncely.RetryBudget({ ratio: c.budget.ratio, windowMs: c.budget.window_ms, minPerSec: c.budget.min_per_sec, _clock: clock })
    if (c.error) return expectError(make, c.error, what)
    const budget = make()
    for (const step of c.steps) {
      clock.set(step.at_ms)
      if (step.requests !== undefined) {
        for (let k = 0; k < step.requests; k++) budget.recordRequest()
        budget.snapshot() // places the requests in the window now
      } else if (step.withdraw !== undefined) {
        const results = Array.from({ length: step.withdraw }, () => budget.tryWithdraw())
        const want = Array.from({ length: step.withdraw }, (_, k) => k < step.granted)
        assert.deepEqual(results, want, `${what}: withdraw at ${step.at_ms}`)
      } else {
        assert.deepEqual({ ...budget.snapshot() }, step.snapshot, `${what}: snapshot at ${step.at_ms}`)
      }
    }
  })
})
