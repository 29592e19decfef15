'use strict'
// The retry loop: JavaScript drives the core's RetryState. The success path never
// enters Rust (the state is made at the first failure, unless a budget must count the
// call); zero delays retry at once, without a timer.

const { Deadline, ManualClock, ReasonCodes, RetryBudget, RetryPolicy, RetryState } = require('../native.js')
const { mustBe, isSignal } = require('./errors.js')
const { extract, fromUser } = require('./extract.js')
const { abortable } = require('./store.js')

let defaultPolicy
const MAX_TIMER_MS = 2 ** 31 - 1

function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    let timer
    const onAbort = () => {
      clearTimeout(timer)
      reject(signal.reason)
    }
    const arm = (left) => {
      timer = setTimeout(() => {
        if (left > MAX_TIMER_MS) return arm(left - MAX_TIMER_MS)
        if (signal !== undefined) signal.removeEventListener('abort', onAbort)
        resolve()
      }, Math.min(left, MAX_TIMER_MS))
    }
    if (signal !== undefined) {
      if (signal.aborted) return reject(signal.reason)
      signal.addEventListener('abort', onAbort, { once: true })
    }
    arm(ms)
  })
}

/**
 * What the action is told about its attempt, the same shape as Rust's `Attempt` and
 * Python's `Attempt`: `number` (1 for the first), `remainingMs` before the deadline in whole
 * milliseconds (`Infinity` without one) and `previousAttempts`; also the caller's `signal` and the
 * `deadline`. It converts to its number (`attempt < 3`, `` `${attempt}` ``), and is also
 * passed as the second argument, where earlier versions gave the attempt's details.
 */
class Attempt {
  constructor(number, signal, deadline) {
    this.number = number
    this.signal = signal
    this.deadline = deadline
  }
  /** Milliseconds left before the deadline (Infinity without one): forward it as a per-attempt timeout. */
  get remainingMs() {
    // Whole milliseconds (rounded down, never past the deadline), so it can be handed to
    // timers and `AbortSignal.timeout` as is.
    return this.deadline === undefined ? Infinity : Math.floor(this.deadline.remainingMs)
  }
  /** Attempts made before this one (for a `grpc-previous-rpc-attempts` header). */
  get previousAttempts() {
    return this.number - 1
  }
  /** @deprecated The same as `number`. */
  get attempt() {
    return this.number
  }
  valueOf() {
    return this.number
  }
  toString() {
    return String(this.number)
  }
  [Symbol.toPrimitive]() {
    return this.number
  }
}

function annotate(error, attempt, reason, why) {
  if (error !== null && (typeof error === 'object' || typeof error === 'function')) {
    try {
      error.attempts = attempt
      error.stopReason = reason
      error.whyStopped = `oncely: gave up after ${attempt} attempt${attempt === 1 ? '' : 's'} (${why})`
      // The name before `attempts` (deprecated).
      error.attemptNumber = attempt
    } catch {
      // a frozen error is rethrown as it is
    }
  }
}

function retryOptions(options) {
  if (options === null || typeof options !== 'object') throw mustBe('an object', 'options', options)
  let { policy, deadline, budget, signal, onRetry, classify, reasons, safe, rereads, transientInternal, _clock: clock } = options
  if (clock !== undefined && !(clock instanceof ManualClock)) throw mustBe('a ManualClock', '_clock', clock)
  if (policy !== undefined && !(policy instanceof RetryPolicy)) {
    if (policy === null || typeof policy !== 'object') throw mustBe('a RetryPolicy or its options', 'policy', policy)
    policy = new RetryPolicy(policy)
  }
  if (typeof deadline === 'number') deadline = new Deadline(deadline, clock)
  else if (deadline !== undefined && !(deadline instanceof Deadline)) throw mustBe('a Deadline or a number of ms', 'deadline', deadline)
  if (budget !== undefined && !(budget instanceof RetryBudget)) throw mustBe('a RetryBudget', 'budget', budget)
  if (signal !== undefined && !isSignal(signal)) throw mustBe('an AbortSignal', 'signal', signal)
  if (onRetry !== undefined && typeof onRetry !== 'function') throw mustBe('a function', 'onRetry', onRetry)
  if (classify !== undefined && typeof classify !== 'function') throw mustBe('a function', 'classify', classify)
  if (reasons !== undefined && !(reasons instanceof ReasonCodes)) throw mustBe('a ReasonCodes', 'reasons', reasons)
  if (safe !== undefined && typeof safe !== 'boolean') throw mustBe('a boolean', 'safe', safe)
  if (rereads !== undefined && typeof rereads !== 'boolean') throw mustBe('a boolean', 'rereads', rereads)
  if (transientInternal !== undefined && typeof transientInternal !== 'boolean') throw mustBe('a boolean', 'transientInternal', transientInternal)
  return { policy, deadline, budget, signal, onRetry, classify, reasons, clock, safe: safe === true, rereads: rereads === true, transientInternal: transientInternal === true }
}

const NO_OPTIONS = Object.freeze({ safe: false, rereads: false, transientInternal: false })

/**
 * Calls `fn(attempt)` (an `Attempt`) until it succeeds or the core says stop (SPEC §4); the
 * last error is rethrown unchanged, with `attempts` and `stopReason` added.
 */
async function retry(fn, options) {
  if (typeof fn !== 'function') throw mustBe('a function', 'fn', fn)
  const o = options === undefined ? NO_OPTIONS : retryOptions(options)
  const signal = o.signal
  if (signal !== undefined && signal.aborted) throw signal.reason
  let state = o.budget === undefined ? null : newState(o)
  let attempt = 1
  for (;;) {
    try {
      const a = new Attempt(attempt, signal, o.deadline)
      if (signal === undefined) return await fn(a, a)
      // With a signal, an abort ends the call at once, even while an attempt runs.
      return await abortable(Promise.resolve(fn(a, a)), signal)
    } catch (error) {
      if (signal !== undefined && signal.aborted) throw signal.reason
      if (state === null) state = newState(o)
      const f = o.classify === undefined ? extract(error, o.reasons) : fromUser(o.classify(error), error, o.reasons)
      const delay = state.onFailure(f.code, f.delayMs, f.doNotRetry, f.pushback, f.retryAfter)
      if (delay < 0) {
        annotate(error, attempt, state.stopReason, state.whyStopped)
        throw error
      }
      if (o.onRetry !== undefined) o.onRetry({ attempt, delayMs: delay, error, rule: state.rule, reason: state.rule, code: f.code })
      if (o.clock !== undefined) o.clock.advance(delay) // test hook: time passes, no timer
      else if (delay > 0) await sleep(delay, signal)
      if (signal !== undefined && signal.aborted) throw signal.reason
      attempt = state.attempt
    }
  }
}

function newState(o) {
  return new RetryState(o.policy ?? (defaultPolicy ??= new RetryPolicy()), o.safe, o.rereads, o.transientInternal, o.deadline, o.budget, o.clock)
}

module.exports = { defaultPolicy, MAX_TIMER_MS, sleep, Attempt, annotate, retryOptions, NO_OPTIONS, retry, newState }
