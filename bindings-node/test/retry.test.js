'use strict'
// The retry loop: stop reasons, cancellation, hooks, classification and the extraction
// of codes from JavaScript errors.
const test = require('node:test')
const assert = require('node:assert/strict')

const oncely = require('oncely')
const { retry, RetryPolicy, RetryBudget, Deadline, ManualClock, ReasonCodes, Code, failureOf, codeOf } = oncely

const instant = new RetryPolicy({ baseDelayMs: 0, maxDelayMs: 0, maxAttempts: 3 })
const sysErr = (code) => Object.assign(new Error(code), { code })
const failing = (make) => async () => {
  throw make()
}

test('success at the first attempt: the value, one call, attempt 1', async () => {
  const seen = []
  const v = await retry(async (attempt, info) => {
    seen.push([attempt.number, attempt.previousAttempts, attempt.remainingMs, attempt.signal, info === attempt, info.attempt])
    return 'ok'
  })
  assert.equal(v, 'ok')
  assert.deepEqual(seen, [[1, 0, Infinity, undefined, true, 1]])
  assert.equal(await retry(() => 'not a promise'), 'not a promise')
})

test('retries a safe UNAVAILABLE, then succeeds; the action is told its attempt', async () => {
  const attempts = []
  const v = await retry(
    async (attempt) => {
      attempts.push(attempt.number)
      // An Attempt converts to its number where a number was used before.
      if (attempt < 3) throw sysErr('ECONNRESET')
      return `${attempt}`
    },
    { safe: true, policy: instant },
  )
  assert.equal(v, '3')
  assert.deepEqual(attempts, [1, 2, 3])
})

test('stop reason not_retryable: the last error itself, with attemptNumber and stopReason', async () => {
  const err = sysErr('ECONNRESET')
  let calls = 0
  await assert.rejects(
    retry(async () => {
      calls++
      throw err
    }), // not safe: an unknown outcome is not resent
    (e) => e === err && e.attemptNumber === 1 && e.stopReason === 'not_retryable',
  )
  assert.equal(calls, 1)
  const invalid = Object.assign(new Error('bad'), { code: 'INVALID_ARGUMENT' })
  await assert.rejects(retry(failing(() => invalid), { safe: true }), (e) => e === invalid && e.stopReason === 'not_retryable')
})

test('stop reason attempts_exhausted', async () => {
  let calls = 0
  await assert.rejects(
    retry(
      async () => {
        calls++
        throw sysErr('ECONNREFUSED')
      },
      { safe: true, policy: instant },
    ),
    { stopReason: 'attempts_exhausted', attemptNumber: 3 },
  )
  assert.equal(calls, 3)
})

test('stop reason deadline: no sleep into an attempt that cannot finish', async () => {
  const clock = new ManualClock()
  const policy = new RetryPolicy({ baseDelayMs: 100, maxDelayMs: 100, jitter: 0, maxAttempts: 10, minAttemptMs: 50 })
  let calls = 0
  await assert.rejects(
    retry(
      async () => {
        calls++
        clock.advance(10)
        throw sysErr('ECONNRESET')
      },
      { safe: true, policy, deadline: 300, _clock: clock },
    ),
    { stopReason: 'deadline' },
  )
  // 10 | sleep 100 | 10 (at 120) | sleep 100 | 10 (at 230): 100 + 50 > 70 left.
  assert.equal(calls, 3)
  assert.equal(clock.nowMs, 230)
  // On the real clock too, with a Deadline object.
  await assert.rejects(retry(failing(() => sysErr('ECONNRESET')), { safe: true, deadline: new Deadline(10) }), {
    stopReason: 'deadline',
    attemptNumber: 1,
  })
})

test('stop reason budget: an exhausted retry budget fails at once', async () => {
  const budget = new RetryBudget({ ratio: 0, minPerSec: 0 })
  await assert.rejects(retry(failing(() => sysErr('ECONNRESET')), { safe: true, budget, policy: instant }), {
    stopReason: 'budget',
    attemptNumber: 1,
  })
  const snap = budget.snapshot()
  assert.equal(snap.requests, 1, 'the call was counted')
  assert.equal(snap.retries, 0)
  // A budget with room allows the retry; successes are counted as requests too.
  const roomy = new RetryBudget({ ratio: 0.5, minPerSec: 0 })
  for (let i = 0; i < 4; i++) await retry(async () => 1, { budget: roomy })
  let n = 0
  assert.equal(
    await retry(
      async () => {
        if (n++ === 0) throw sysErr('ECONNRESET')
        return 'second'
      },
      { safe: true, budget: roomy, policy: instant },
    ),
    'second',
  )
  assert.deepEqual(roomy.snapshot(), { requests: 5, retries: 1, allowed: 2.5 })
})

test('stop reason server_said_no: a negative grpc-retry-pushback-ms', async () => {
  const grpcError = Object.assign(new Error('14 UNAVAILABLE: overloaded'), {
    code: 14,
    details: 'overloaded',
    metadata: { get: (k) => (k === 'grpc-retry-pushback-ms' ? ['-1'] : []) },
  })
  await assert.rejects(retry(failing(() => grpcError), { safe: true }), { stopReason: 'server_said_no', attemptNumber: 1 })
})

test('abort during a sleep stops the loop at once with signal.reason', async () => {
  const ac = new AbortController()
  const started = Date.now()
  let calls = 0
  const p = retry(
    async () => {
      calls++
      throw sysErr('ECONNRESET')
    },
    { safe: true, signal: ac.signal, policy: { baseDelayMs: 60_000, maxDelayMs: 60_000 } },
  )
  setTimeout(() => ac.abort(new Error('user cancelled')), 20)
  await assert.rejects(p, { message: 'user cancelled' })
  assert.ok(Date.now() - started < 5_000, 'did not wait for the 60 s delay')
  assert.equal(calls, 1)
  // Already aborted: no attempt at all.
  await assert.rejects(
    retry(() => assert.fail('must not run'), { signal: AbortSignal.abort() }),
    { name: 'AbortError' },
  )
  // An abort while an attempt runs ends the call at once too.
  const ac3 = new AbortController()
  const running = retry(() => new Promise(() => {}), { signal: ac3.signal })
  setTimeout(() => ac3.abort(new Error('stop now')), 5)
  await assert.rejects(running, { message: 'stop now' })
  // The action gets the signal to forward.
  const ac2 = new AbortController()
  await retry(async (_, info) => assert.equal(info.signal, ac2.signal), { signal: ac2.signal })
})

test('onRetry sees each retry: attempt, delay, error, rule, code', async () => {
  const events = []
  const errors = [sysErr('ECONNRESET'), Object.assign(new Error('slow down'), { status: 429, headers: { 'retry-after': '0' } })]
  let n = 0
  const v = await retry(
    async () => {
      if (n < errors.length) throw errors[n++]
      return 'done'
    },
    { safe: true, policy: new RetryPolicy({ baseDelayMs: 1, maxDelayMs: 1, jitter: 0 }), onRetry: (e) => events.push(e) },
  )
  assert.equal(v, 'done')
  assert.deepEqual(events, [
    { attempt: 1, delayMs: 1, error: errors[0], rule: 'transient_safe', reason: 'transient_safe', code: Code.UNAVAILABLE },
    { attempt: 2, delayMs: 0, error: errors[1], rule: 'rate_limited', reason: 'rate_limited', code: Code.RESOURCE_EXHAUSTED },
  ])
})

test('a user classify overrides the extraction; undefined falls back to it', async () => {
  let n = 0
  const v = await retry(
    async () => {
      if (n++ < 2) throw new Error('my transient error')
      return n
    },
    { safe: true, policy: instant, classify: (e) => (e.message.includes('transient') ? 'UNAVAILABLE' : undefined) },
  )
  assert.equal(v, 3)
  // It can name a server delay; it can say do not retry.
  const events = []
  await assert.rejects(
    retry(failing(() => new Error('x')), {
      safe: true,
      policy: instant,
      classify: () => ({ code: Code.RESOURCE_EXHAUSTED, retryAfterMs: 0 }),
      onRetry: (e) => events.push(e.delayMs),
    }),
    { stopReason: 'attempts_exhausted' },
  )
  assert.deepEqual(events, [0, 0])
  await assert.rejects(retry(failing(() => new Error('x')), { classify: () => ({ code: 'UNAVAILABLE', doNotRetry: true }), safe: true }), {
    stopReason: 'server_said_no',
  })
  // A bad answer from classify is a clear error.
  await assert.rejects(retry(failing(() => new Error('x')), { classify: () => 'NOT_A_CODE' }), { name: 'RangeError', code: 'INVALID_ARGUMENT' })
})

test('zero delays retry at once, without a timer (never setTimeout(0))', async () => {
  const realSetTimeout = global.setTimeout
  let timers = 0
  global.setTimeout = (...args) => {
    timers++
    return realSetTimeout(...args)
  }
  try {
    const started = process.hrtime.bigint()
    for (let i = 0; i < 200; i++) {
      let n = 0
      await retry(
        async () => {
          if (n++ < 2) throw sysErr('ECONNRESET')
          return n
        },
        { safe: true, policy: instant },
      )
    }
    const ms = Number(process.hrtime.bigint() - started) / 1e6
    assert.equal(timers, 0)
    assert.ok(ms < 200, `400 zero-delay retries took ${ms} ms (a 1 ms timer each would be ≥ 400)`)
  } finally {
    global.setTimeout = realSetTimeout
  }
})

test('seeded jitter: the same delays as RetryPolicy.delayAfter (the core decides)', async () => {
  const policy = new RetryPolicy({ seed: 7, maxAttempts: 4, baseDelayMs: 1, maxDelayMs: 4 })
  const clock = new ManualClock()
  const delays = []
  await assert.rejects(
    retry(failing(() => sysErr('ECONNRESET')), { safe: true, policy, _clock: clock, onRetry: (e) => delays.push(e.delayMs) }),
  )
  assert.deepEqual(delays, [policy.delayAfter(1), policy.delayAfter(2), policy.delayAfter(3)])
  assert.deepEqual(delays, policy.delays())
})

test('error extraction: fetch Responses, system and undici errors, grpc-js, objects with codes', () => {
  const response = new Response('busy', { status: 503, headers: { 'Retry-After': '2' } })
  assert.deepEqual({ ...failureOf(response) }, { code: Code.UNAVAILABLE, delayMs: 2000, doNotRetry: undefined, pushback: undefined, retryAfter: undefined })
  const carrying = Object.assign(new Error('HTTP 429'), { response: new Response('', { status: 429, headers: { 'retry-after': '1' } }) })
  assert.equal(failureOf(carrying).code, Code.RESOURCE_EXHAUSTED)
  assert.equal(failureOf(carrying).delayMs, 1000)
  const axiosLike = Object.assign(new Error('x'), { response: { status: 502, headers: { 'retry-after': '3' } } })
  assert.deepEqual([failureOf(axiosLike).code, failureOf(axiosLike).delayMs], [Code.UNAVAILABLE, 3000])
  for (const [code, want] of [
    ['ECONNRESET', 'UNAVAILABLE'],
    ['EPIPE', 'UNAVAILABLE'],
    ['ECONNREFUSED', 'UNAVAILABLE'],
    ['ETIMEDOUT', 'DEADLINE_EXCEEDED'],
    ['UND_ERR_SOCKET', 'UNAVAILABLE'],
    ['UND_ERR_HEADERS_TIMEOUT', 'DEADLINE_EXCEEDED'],
    ['UND_ERR_SOMETHING_NEW', 'UNAVAILABLE'],
    ['ABORT_ERR', 'CANCELLED'],
    ['NOT_FOUND', 'NOT_FOUND'],
    ['RATE_LIMITED', 'RESOURCE_EXHAUSTED'],
    ['STOCK_CONFLICT', 'ABORTED'],
    ['EWHATEVER', 'UNKNOWN'],
  ]) {
    assert.equal(Code[codeOf(sysErr(code))], want, code)
  }
  // fetch() wraps the socket error: TypeError('fetch failed', { cause }).
  assert.equal(codeOf(new TypeError('fetch failed', { cause: sysErr('ECONNRESET') })), Code.UNAVAILABLE)
  // @grpc/grpc-js: numeric code, pushback in metadata (as a Buffer or a string).
  const md = { get: (k) => (k === 'grpc-retry-pushback-ms' ? [Buffer.from('250')] : []) }
  const g = failureOf(Object.assign(new Error('8 RESOURCE_EXHAUSTED'), { code: 8, metadata: md }))
  assert.deepEqual([g.code, g.delayMs], [Code.RESOURCE_EXHAUSTED, 250])
  // oncely's own in-progress error carries retryAfterMs.
  const inProgress = Object.assign(new Error('in progress'), { code: 'ABORTED', kind: 'in_progress', retryAfterMs: 1000 })
  assert.deepEqual([failureOf(inProgress).code, failureOf(inProgress).delayMs], [Code.ABORTED, 1000])
  // status / statusCode.
  assert.equal(codeOf({ status: 404 }), Code.NOT_FOUND)
  assert.equal(codeOf({ statusCode: 500 }), Code.INTERNAL)
  assert.equal(codeOf(Object.assign(new Error('t'), { name: 'TimeoutError' })), Code.DEADLINE_EXCEEDED)
  // Nothing recognizable: UNKNOWN (not retried unless declared transient).
  for (const e of [new Error('plain'), 'a string', undefined, null, 42]) assert.equal(codeOf(e), Code.UNKNOWN)
  // Custom reason codes.
  const reasons = new ReasonCodes()
  reasons.register('PAYMENT_PENDING', 'UNAVAILABLE')
  assert.equal(failureOf(sysErr('PAYMENT_PENDING'), { reasons }).code, Code.UNAVAILABLE)
  assert.equal(failureOf(sysErr('PAYMENT_PENDING')).code, Code.UNKNOWN)
  assert.throws(() => reasons.register('RATE_LIMITED', 'UNAVAILABLE'), { code: 'INVALID_ARGUMENT', field: 'reason' })
})

test('a Retry-After from a thrown fetch Response is the delay', async () => {
  const clock = new ManualClock()
  let n = 0
  const delays = []
  await retry(
    async () => {
      if (n++ === 0) throw new Response('', { status: 503, headers: { 'Retry-After': '7' } })
      return 'ok'
    },
    { safe: true, _clock: clock, onRetry: (e) => delays.push(e.delayMs) },
  )
  assert.deepEqual(delays, [7_000])
})

test('transientInternal: INTERNAL/UNKNOWN are retried only when declared and safe', async () => {
  let n = 0
  const v = await retry(
    async () => {
      if (n++ === 0) throw new Error('unknown failure')
      return 'ok'
    },
    { safe: true, transientInternal: true, policy: instant },
  )
  assert.equal(v, 'ok')
  await assert.rejects(retry(failing(() => new Error('x')), { transientInternal: true }), { stopReason: 'not_retryable' })
})

test('bad options are TypeErrors naming the field', async () => {
  await assert.rejects(retry('nope'), { name: 'TypeError', field: 'fn', code: 'INVALID_ARGUMENT' })
  await assert.rejects(retry(async () => 1, 5), { name: 'TypeError', field: 'options' })
  await assert.rejects(retry(async () => 1, { safe: 'yes' }), { name: 'TypeError', field: 'safe' })
  await assert.rejects(retry(async () => 1, { policy: 3 }), { name: 'TypeError', field: 'policy' })
  await assert.rejects(retry(async () => 1, { policy: { maxAttempts: 0 } }), { name: 'RangeError', field: 'maxAttempts' })
  await assert.rejects(retry(async () => 1, { deadline: 'soon' }), { name: 'TypeError', field: 'deadline' })
  await assert.rejects(retry(async () => 1, { deadline: -5 }), { name: 'RangeError', field: 'deadline' })
  await assert.rejects(retry(async () => 1, { deadline: NaN }), { name: 'RangeError', field: 'deadline' })
  await assert.rejects(retry(async () => 1, { budget: {} }), { name: 'TypeError', field: 'budget' })
  await assert.rejects(retry(async () => 1, { signal: 'x' }), { name: 'TypeError', field: 'signal' })
  await assert.rejects(retry(async () => 1, { onRetry: 1 }), { name: 'TypeError', field: 'onRetry' })
  await assert.rejects(retry(async () => 1, { classify: {} }), { name: 'TypeError', field: 'classify' })
  await assert.rejects(retry(async () => 1, { _clock: {} }), { name: 'TypeError', field: '_clock' })
})

test('errors of oncely carry kind and httpStatus from the core', async () => {
  const bad = (fn) => {
    try {
      fn()
    } catch (e) {
      return e
    }
    assert.fail('no error')
  }
  const short = bad(() => oncely.validateKey('short'))
  assert.deepEqual([short.kind, short.httpStatus, oncely.httpStatusOf(short)], ['invalid_argument', 400, 400])
  const missing = bad(() => oncely.validateKey(''))
  assert.deepEqual([missing.kind, missing.httpStatus], ['missing_key', 400])
  const badOption = bad(() => new oncely.RetryPolicy({ maxAttempts: 0 }))
  assert.deepEqual([badOption.kind, badOption.httpStatus], ['invalid_argument', 400])
  const jsSide = await oncely.retry('not a function').catch((e) => e)
  assert.deepEqual([jsSide.kind, jsSide.httpStatus], ['invalid_argument', 400])

  const store = new oncely.IdempotencyStore()
  const key = oncely.scope('acme', 'Charge', oncely.newKey())
  await store.execute(key, oncely.fingerprint({ a: 1 }), async () => 'done')
  const mismatch = await store.execute(key, oncely.fingerprint({ a: 2 }), async () => 'never').catch((e) => e)
  assert.deepEqual([mismatch.kind, mismatch.httpStatus, oncely.httpStatusOf(mismatch)], ['fingerprint_mismatch', 422, 422])
  const key2 = oncely.scope('acme', 'Charge', oncely.newKey())
  let release
  const running = store.execute(key2, oncely.fingerprint({ a: 1 }), () => new Promise((r) => (release = r)))
  const busy = await store.execute(key2, oncely.fingerprint({ a: 1 }), async () => 'x', { wait: false }).catch((e) => e)
  assert.deepEqual([busy.kind, busy.httpStatus], ['in_progress', 409])
  release('done')
  await running
  assert.equal(oncely.httpStatusOf(new Error('not ours')), undefined)
  assert.equal(oncely.httpStatusOf({ httpStatus: 400 }), undefined)
})

test('one name per fact: err.attempts, err.stopReason, event.rule (old names kept)', async () => {
  const events = []
  const err = Object.assign(new Error('down'), { code: 'UNAVAILABLE' })
  await assert.rejects(
    oncely.retry(
      () => {
        throw err
      },
      { safe: true, policy: { maxAttempts: 2, baseDelayMs: 1, jitter: 0 }, _clock: new ManualClock(), onRetry: (e) => events.push(e) },
    ),
    (e) => e === err && e.attempts === 2 && e.attemptNumber === 2 && e.stopReason === 'attempts_exhausted',
  )
  assert.equal(events.length, 1)
  assert.deepEqual([events[0].attempt, events[0].rule, events[0].reason], [1, 'transient_safe', 'transient_safe'])
})

test('an in-progress answer is resent by a keyed (safe) call after its delay; the store replays the first result', async () => {
  const store = new oncely.IdempotencyStore({ inProgressRetryAfterMs: 20 })
  const k = oncely.scope('acme', 'Charge', oncely.newKey())
  let release
  const leader = store.execute(k, 'fp', () => new Promise((r) => (release = r)))
  const rules = []
  const client = retry(() => store.execute(k, 'fp', () => 'never', { wait: false }), {
    safe: true,
    policy: { maxAttempts: 50, baseDelayMs: 0, maxDelayMs: 0 },
    onRetry: (e) => rules.push(e.rule),
  })
  setTimeout(() => release('charged'), 60)
  const [first, replay] = await Promise.all([leader, client])
  assert.deepEqual([first.value, replay.value, replay.replayed], ['charged', 'charged', true])
  assert.ok(rules.length >= 1 && rules.every((r) => r === 'in_progress_keyed'), rules.join())
})

test('an in-progress answer is not resent by a call that is not safe; whyStopped says why', async () => {
  const busy = Object.assign(new Error('busy'), { code: 'ABORTED', retryAfterMs: 10 })
  let calls = 0
  const err = await retry(async () => {
    calls++
    throw busy
  }, { policy: instant }).catch((e) => e)
  assert.equal(err, busy)
  assert.equal(calls, 1)
  assert.equal(err.stopReason, 'not_retryable')
  assert.match(err.whyStopped, /^oncely: gave up after 1 attempt \(not_retryable: a conflict \(ABORTED\)/)
  assert.match(err.whyStopped, /\(rule conflict_needs_reread\)\)$/)
  const spent = await retry(failing(() => sysErr('ECONNRESET')), { safe: true, policy: instant }).catch((e) => e)
  assert.match(spent.whyStopped, /^oncely: gave up after 3 attempts \(attempts_exhausted: /)
  // classify counts the server's delay: ABORTED with one is the in-progress answer.
  assert.equal(oncely.classify('ABORTED', { safe: true }, { delayMs: 1000 }).rule, 'in_progress_keyed')
  assert.equal(oncely.classify('ABORTED', { safe: true }).rule, 'conflict_needs_reread')
})

test('the action gets one Attempt: number, remainingMs and previousAttempts, as in Rust and Python', async () => {
  const clock = new ManualClock()
  const seen = []
  await retry(
    async (attempt) => {
      assert.ok(attempt instanceof oncely.Attempt)
      seen.push([attempt.number, attempt.previousAttempts, attempt.remainingMs])
      clock.advance(100)
      if (attempt.number < 3) throw sysErr('ECONNRESET')
    },
    { safe: true, policy: instant, deadline: new Deadline(1000, clock), _clock: clock },
  )
  assert.deepEqual(seen, [
    [1, 0, 1000],
    [2, 1, 900],
    [3, 2, 800],
  ])
})

test('an attempt\'s remainingMs is whole milliseconds that AbortSignal.timeout takes', async () => {
  let seen
  await oncely.retry(
    (attempt) => {
      seen = attempt.remainingMs
      AbortSignal.timeout(attempt.remainingMs) // throws ERR_OUT_OF_RANGE on a fraction
      return 'ok'
    },
    { deadline: new oncely.Deadline(1234.5) },
  )
  assert.ok(Number.isInteger(seen) && seen > 0 && seen <= 1234, String(seen))
})
