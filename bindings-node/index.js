'use strict'
// oncely for Node.js: the hand-written layer over the native addon (native.js, generated
// by `napi build`). It only translates: it extracts codes from JavaScript errors, reads
// milliseconds as numbers, and hosts the waiting (timers, Promises) in the event loop.
// Every rule — backoff, classification, the retry decision, budgets, keys,
// fingerprints, the dedup store — is the Rust core's.

const { AsyncLocalStorage } = require('node:async_hooks')

const native = require('./native.js')

const {
  Deadline,
  ManualClock,
  NativeRedisStore,
  NativeStore,
  ReasonCodes,
  RetryBudget,
  RetryPolicy,
  RetryState,
} = native

// ---------------------------------------------------------------------------------------
// Codes and protocol constants (from the core)
// ---------------------------------------------------------------------------------------

/** The 17 gRPC codes, both ways: `Code.UNAVAILABLE === 14`, `Code[14] === 'UNAVAILABLE'`. */
const Code = {}
native.codeNames().forEach((name, n) => {
  Code[name] = n
  Code[n] = name
})
Object.freeze(Code)

/** Header and metadata names of the protocol. */
const headers = Object.freeze(native.protocolHeaders())
/** HTTP statuses of the server side of the protocol (400, 422, 409). */
const httpStatus = Object.freeze(native.protocolHttpStatus())

// ---------------------------------------------------------------------------------------
// Errors raised in this file (bad input to the JavaScript-only functions)
// ---------------------------------------------------------------------------------------

const JS_ERROR_STATUS = Object.freeze(native.jsErrorStatus())

function invalid(Ctor, field, message) {
  const e = new Ctor(message)
  e.code = 'INVALID_ARGUMENT'
  e.kind = 'invalid_argument'
  e.httpStatus = JS_ERROR_STATUS.invalidArgument
  e.field = field
  return e
}

function typeName(v) {
  if (v === null) return 'null'
  if (Array.isArray(v)) return 'an array'
  const t = typeof v
  return t === 'undefined' ? 'undefined' : t === 'object' ? 'an object' : `a ${t}`
}

function mustBe(what, field, v) {
  return invalid(TypeError, field, `${field} must be ${what}, got ${typeName(v)}`)
}

function isSignal(s) {
  return s !== null && typeof s === 'object' && typeof s.aborted === 'boolean' && typeof s.addEventListener === 'function'
}

// ---------------------------------------------------------------------------------------
// Fingerprints: JSON.stringify gives JavaScript's JSON form (toJSON, undefined members
// dropped); the core canonicalizes (RFC 8785) and hashes it.
// ---------------------------------------------------------------------------------------

function rejectNonFinite(key, v) {
  if (typeof v === 'number' && !Number.isFinite(v)) {
    throw invalid(RangeError, 'value', `value has no JSON form: ${v}${key === '' ? '' : ` at key ${JSON.stringify(key)}`} (JSON has no NaN or Infinity)`)
  }
  return v
}

function jsonText(value) {
  let text
  try {
    text = JSON.stringify(value, rejectNonFinite)
  } catch (e) {
    if (e && e.code === 'INVALID_ARGUMENT') throw e
    const err = invalid(TypeError, 'value', `value has no JSON form: ${e && e.message}`)
    err.cause = e
    throw err
  }
  if (text === undefined) {
    throw invalid(TypeError, 'value', `value has no JSON form: got ${typeName(value)}`)
  }
  return text
}

/** SHA-256 (hex) over the canonical JSON (RFC 8785) of `value`: the same in Rust, Python and Node. */
function fingerprint(value) {
  return native.fingerprintText(jsonText(value))
}

/** The canonical JSON (RFC 8785) of `value`, as a string. */
function canonicalJson(value) {
  return native.canonicalJsonText(jsonText(value))
}

// ---------------------------------------------------------------------------------------
// Error extraction: which gRPC code (and server delay) a JavaScript error stands for
// ---------------------------------------------------------------------------------------

// This part only reads: it walks a JavaScript error (its `code`, `status`, `statusCode`,
// `name` and constructors, a fetch Response or `response`, @grpc/grpc-js metadata, the
// `cause` chain) and hands the raw facts to the core, whose rules decide the code and
// the server's delay (SPEC §3, "Extraction"), the same rules Rust and Python apply.

const { UNKNOWN } = Code
const EXTRACT_HEADERS = native.extractHeaders()
// The core reads the error and at most four causes.
const MAX_CHAIN = 5

/** A failure in the core's terms: `code` and the server's delay, if any. */
class Failure {
  constructor(code) {
    this.code = code
    this.delayMs = undefined
    this.doNotRetry = undefined
    this.pushback = undefined
    this.retryAfter = undefined
  }
}

function rawValue(v) {
  if (typeof v === 'string') return v.length <= 256 ? v : undefined
  if (typeof v === 'number' && Number.isInteger(v)) return v
  return undefined
}

// A header or metadata value as text; binary (`-bin`) values in base64, as on the wire.
function headerText(name, v) {
  if (Array.isArray(v)) v = v[0]
  if (typeof v === 'string') return v
  if (typeof v === 'number' && Number.isFinite(v)) return String(v)
  if (v instanceof Uint8Array) return Buffer.from(v.buffer, v.byteOffset, v.byteLength).toString(name.toLowerCase().endsWith('-bin') ? 'base64' : 'latin1')
  return undefined
}

// The pairs the core reads, from a Headers object, grpc-js Metadata or a plain object.
function collect(h, out) {
  if (h === null || typeof h !== 'object') return
  if (typeof h.get === 'function') {
    for (const name of EXTRACT_HEADERS) {
      const v = headerText(name, h.get(name))
      if (v !== undefined) out.push([name, v])
    }
    return
  }
  for (const key of Object.keys(h)) {
    if (!EXTRACT_HEADERS.includes(key.toLowerCase())) continue
    const v = headerText(key, h[key])
    if (v !== undefined) out.push([key, v])
  }
}

function typeNames(err) {
  const names = []
  if (typeof err.name === 'string') names.push(err.name)
  let p = Object.getPrototypeOf(err)
  for (let i = 0; p !== null && i < 16; i++) {
    const c = Object.hasOwn(p, 'constructor') ? p.constructor : undefined
    if (typeof c === 'function' && typeof c.name === 'string' && c.name !== '' && !names.includes(c.name)) names.push(c.name)
    p = Object.getPrototypeOf(p)
  }
  return names
}

function level(err) {
  const res = err.response
  const hasRes = res !== null && typeof res === 'object'
  const headers = []
  collect(err.headers, headers)
  if (hasRes) collect(res.headers, headers)
  collect(err.metadata, headers)
  let status = rawValue(err.status)
  if (status === undefined && hasRes) status = rawValue(res.status)
  let statusCode = rawValue(err.statusCode)
  if (statusCode === undefined && hasRes) statusCode = rawValue(res.statusCode)
  const d = err.retryAfterMs
  return {
    code: rawValue(err.code),
    status,
    statusCode,
    typeNames: typeNames(err),
    headers,
    delayMs: typeof d === 'number' && Number.isFinite(d) && d >= 0 ? d : undefined,
  }
}

function extract(err, reasons) {
  const levels = []
  try {
    for (let e = err; levels.length < MAX_CHAIN && e !== null && (typeof e === 'object' || typeof e === 'function'); e = e.cause) {
      levels.push(level(e))
    }
  } catch {
    // an error whose properties throw is read as far as it could be
  }
  const x = native.extractFailure(levels, reasons)
  const f = new Failure(x.code)
  if (x.delayMs !== undefined && x.delayMs !== null) f.delayMs = x.delayMs
  if (x.doNotRetry) f.doNotRetry = true
  return f
}

function fromUser(out, err, reasons) {
  if (out === undefined || out === null) return extract(err, reasons)
  if (typeof out === 'number' || typeof out === 'string') return new Failure(toCode(out, 'classify() result', reasons))
  if (typeof out !== 'object') throw mustBe('a code, an object or undefined', 'classify() result', out)
  const f = new Failure(toCode(out.code, 'classify() result code', reasons))
  if (out.retryAfterMs !== undefined) {
    if (typeof out.retryAfterMs !== 'number') throw mustBe('a number', 'retryAfterMs', out.retryAfterMs)
    f.delayMs = out.retryAfterMs
  }
  if (out.doNotRetry !== undefined) f.doNotRetry = out.doNotRetry === true
  return f
}

const defaultReasons = new ReasonCodes()

// A code a user's `classify` returned: a gRPC code (number or name) or a reason.
function toCode(c, field, reasons) {
  if (typeof c === 'number' && Number.isInteger(c) && c >= 0 && c <= 16) return c
  if (typeof c === 'string' && Object.hasOwn(Code, c) && typeof Code[c] === 'number') return Code[c]
  if (typeof c === 'string') {
    const r = (reasons ?? defaultReasons).resolve(c)
    if (r !== null) return r
  }
  throw invalid(typeof c === 'number' || typeof c === 'string' ? RangeError : TypeError, field, `${field} must be a gRPC code (0..16 or a name such as 'UNAVAILABLE'), got ${typeof c === 'string' ? JSON.stringify(c) : typeName(c)}`)
}

/**
 * The failure an error stands for: `{ code, delayMs?, doNotRetry?, pushback?, retryAfter? }`.
 * Understands fetch Responses (and errors carrying one), Node and undici system errors,
 * @grpc/grpc-js errors, oncely's own errors and objects with `code`/`status`/`statusCode`.
 */
function failureOf(err, options) {
  const reasons = options?.reasons
  const classify = options?.classify
  return classify === undefined ? extract(err, reasons) : fromUser(classify(err), err, reasons)
}

/** The gRPC code an error stands for (see `failureOf`). */
function codeOf(err, options) {
  return extract(err, options?.reasons).code
}

// ---------------------------------------------------------------------------------------
// The retry loop: JavaScript drives the core's RetryState. The success path never
// enters Rust (the state is made at the first failure, unless a budget must count the
// call); zero delays retry at once, without a timer.
// ---------------------------------------------------------------------------------------

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

/** What the action is told about its attempt. */
class AttemptInfo {
  constructor(attempt, signal, deadline) {
    this.attempt = attempt
    this.signal = signal
    this.deadline = deadline
  }
  /** Milliseconds left before the deadline (Infinity without one): forward it as a per-attempt timeout. */
  get remainingMs() {
    return this.deadline === undefined ? Infinity : this.deadline.remainingMs
  }
}

function annotate(error, attempt, reason) {
  if (error !== null && (typeof error === 'object' || typeof error === 'function')) {
    try {
      error.attempts = attempt
      error.stopReason = reason
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
 * Calls `fn(attempt, info)` until it succeeds or the core says stop (SPEC §4); the
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
      if (signal === undefined) return await fn(attempt, new AttemptInfo(attempt, signal, o.deadline))
      // With a signal, an abort ends the call at once, even while an attempt runs.
      return await abortable(Promise.resolve(fn(attempt, new AttemptInfo(attempt, signal, o.deadline))), signal)
    } catch (error) {
      if (signal !== undefined && signal.aborted) throw signal.reason
      if (state === null) state = newState(o)
      const f = o.classify === undefined ? extract(error, o.reasons) : fromUser(o.classify(error), error, o.reasons)
      const delay = state.onFailure(f.code, f.delayMs, f.doNotRetry, f.pushback, f.retryAfter)
      if (delay < 0) {
        annotate(error, attempt, state.stopReason)
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

// ---------------------------------------------------------------------------------------
// The dedup store
// ---------------------------------------------------------------------------------------

/** What a joiner's Promise resolves to when its leader went away: begin again. */
const ABANDONED = Object.freeze({ oncelyAbandoned: true })
/** What `begin` returns to a leader (its lease is then in the store's slot). */
const LEAD = Object.freeze({ oncelyLead: true })

function abortable(promise, signal) {
  if (signal.aborted) {
    // Nobody waits for `promise` any more (an action can abort its own caller before it
    // fails): its rejection must not become an unhandled one, which ends the process.
    promise.then(noop, noop)
    return Promise.reject(signal.reason)
  }
  return new Promise((resolve, reject) => {
    const onAbort = () => reject(signal.reason)
    signal.addEventListener('abort', onAbort, { once: true })
    promise.then(
      (v) => {
        signal.removeEventListener('abort', onAbort)
        resolve(v)
      },
      (e) => {
        signal.removeEventListener('abort', onAbort)
        reject(e)
      },
    )
  })
}

const LED = 'led'
const JOINED = 'joined'
const REPLAYED = 'replayed'

function noop() {}

/**
 * `promise` for one caller: rejects with `signal.reason` once `signal` aborts. `leave`
 * runs once, when this caller stops waiting (settled or aborted).
 */
function waitFor(promise, signal, leave) {
  if (signal === undefined) {
    return promise.then(
      (v) => {
        leave()
        return v
      },
      (e) => {
        leave()
        throw e
      },
    )
  }
  return new Promise((resolve, reject) => {
    let waiting = true
    const stop = () => {
      if (!waiting) return false
      waiting = false
      leave()
      return true
    }
    const onAbort = () => {
      if (stop()) reject(signal.reason)
    }
    promise.then(
      (v) => {
        signal.removeEventListener('abort', onAbort)
        if (stop()) resolve(v)
      },
      (e) => {
        signal.removeEventListener('abort', onAbort)
        if (stop()) reject(e)
      },
    )
    if (signal.aborted) onAbort()
    else signal.addEventListener('abort', onAbort, { once: true })
  })
}

// ---------------------------------------------------------------------------------------
// Flights: an action keeps its key until it settles (SPEC §6, Node). JavaScript cannot
// stop a running Promise, so a caller that aborts only stops waiting: the lease stays
// with the action, whose outcome is stored and given to the waiters as usual. The action
// gets `{ signal }`, aborted once every caller of its key in this process has gone.
// ---------------------------------------------------------------------------------------

/** The flight whose action runs in the current async context (see `Flight.parent`). */
const acting = new AsyncLocalStorage()

/** The callers of one key in this process that wait for its outcome (leader included). */
class Callers {
  constructor(map, key) {
    this.map = map
    this.key = key
    this.n = 0
    /** The running flight of the key, if this process leads it. */
    this.flight = undefined
  }
}

function enter(map, key) {
  let c = map.get(key)
  if (c === undefined) {
    c = new Callers(map, key)
    map.set(key, c)
  }
  c.n += 1
  return c
}

function leave(c) {
  c.n -= 1
  if (c.n > 0) return
  if (c.flight !== undefined) c.flight.allGone()
  else if (c.map.get(c.key) === c) c.map.delete(c.key)
}

function goneReason() {
  return new DOMException('every caller of this operation stopped waiting', 'AbortError')
}

/** One run of an action, from its lead until it settles (or its lease is collected). */
class Flight {
  #controller = undefined
  #gone = false

  constructor(store, callers, fingerprint) {
    /** The store (a RedisStore: the string naming its records, shared by instances). */
    this.store = store
    this.callers = callers
    this.key = callers.key
    this.fp = fingerprint
    /** The flight whose action started this one: a cycle of keys is re-entrant too. */
    this.parent = acting.getStore()
    this.running = true
    /** The leader's caller still waits (it counts in `callers`). */
    this.leaderIn = true
    this.info = new ActionInfo(this)
    // A flight still recorded is over (its leader was collected unsettled, releasing the
    // key): it no longer counts.
    if (callers.flight !== undefined) callers.flight.collected()
    callers.flight = this
  }

  get signal() {
    if (this.#controller === undefined) {
      this.#controller = new AbortController()
      if (this.#gone) this.#controller.abort(goneReason())
    }
    return this.#controller.signal
  }

  /** Every caller has gone while the action runs: its signal fires (once). */
  allGone() {
    if (!this.running || this.#gone) return
    this.#gone = true
    if (this.#controller !== undefined) this.#controller.abort(goneReason())
  }

  /** The action settled (or its lease was collected unsettled): the flight is over. */
  end() {
    if (!this.running) return
    this.running = false
    const c = this.callers
    if (c.flight === this) c.flight = undefined
    if (c.n === 0 && c.map.get(c.key) === c) c.map.delete(c.key)
  }

  leaderLeaves() {
    if (!this.leaderIn) return
    this.leaderIn = false
    leave(this.callers)
  }

  /** The leader's lease was collected with its never-settling action. */
  collected() {
    this.end()
    this.leaderLeaves()
  }
}

/** What an action is given: `signal` fires when every caller of its key has gone. */
class ActionInfo {
  #flight
  constructor(flight) {
    this.#flight = flight
  }
  /** An AbortSignal, aborted (an AbortError) once every caller of this run has stopped waiting. */
  get signal() {
    return this.#flight.signal
  }
}

/** Runs `fn` as the action of `flight`: always a Promise, never a synchronous throw. */
function act(flight, fn) {
  try {
    return Promise.resolve(acting.run(flight, fn, flight.info))
  } catch (e) {
    return Promise.reject(e)
  }
}

/**
 * The error for a call made, directly or through other keys, by the action that holds
 * its key (it would wait for itself forever), or `undefined`.
 */
function reentry(store, key, fingerprint) {
  for (let f = acting.getStore(); f !== undefined; f = f.parent) {
    if (f.running && f.store === store && f.key === key && f.fp === fingerprint) return native.reentrantError(key)
  }
  return undefined
}

/** The code of a leader's error for the cache decision; UNKNOWN when it cannot be read. */
function cacheCode(error) {
  try {
    return codeOf(error)
  } catch {
    return UNKNOWN
  }
}

/**
 * Runs an action at most once per scoped key within the TTL and gives every caller its
 * result (SPEC §6), over the core's in-process store.
 */
class IdempotencyStore {
  #native
  /** `native.begin` bound to the store: `(wait, key?, fingerprint?)`. */
  #begin
  /** `[0]`: a leader's lease, handed over by `begin`; `[1..]`: the stored values. */
  #slot = [undefined]
  #cacheFailures
  /** The callers of each key waiting here (leaders and joiners), by scoped key. */
  #callers = new Map()
  /** The key and fingerprint text the native store holds from the last `begin`. */
  #key = undefined
  #fp = undefined

  /** `{ ttlMs = 86_400_000, maxEntries, inProgressRetryAfterMs = 1000, cachePermanentFailures = false }` */
  constructor(options) {
    this.#native = new NativeStore(options, ABANDONED, LEAD, this.#slot)
    this.#begin = this.#native.beginFunction()
    this.#cacheFailures = options != null && options.cachePermanentFailures === true
  }

  /**
   * `fn` runs only if this caller leads. Resolves to `{ value, replayed, source }`: the
   * leader's value (the same object for every caller), whether this caller got it from
   * another call, and how (`'led'`, `'joined'`, `'replayed'`).
   */
  execute(scoped, fingerprint, fn, options) {
    // Not an async function: a replay or a join costs no async frame of its own (a
    // replay resolves at once, a join chains on the flight's one shared Promise). Every
    // error still comes back as a rejection.
    try {
      if (typeof scoped !== 'string') throw mustBe('a scoped key (a string from scope())', 'scoped', scoped)
      if (typeof fingerprint !== 'string') throw mustBe('a string', 'fingerprint', fingerprint)
      if (typeof fn !== 'function') throw mustBe('a function', 'fn', fn)
      let wait = true
      let signal
      if (options !== undefined) {
        if (options === null || typeof options !== 'object') throw mustBe('an object', 'options', options)
        signal = options.signal
        if (signal !== undefined && !isSignal(signal)) throw mustBe('an AbortSignal', 'signal', signal)
        if (options.wait !== undefined) {
          if (typeof options.wait !== 'boolean') throw mustBe('a boolean', 'wait', options.wait)
          wait = options.wait
        }
        if (signal !== undefined && signal.aborted) throw signal.reason
      }
      const reentrant = reentry(this, scoped, fingerprint)
      if (reentrant !== undefined) throw reentrant
      // The strings cross into Rust only when they differ from the last call's.
      let r
      try {
        r = scoped === this.#key && fingerprint === this.#fp ? this.#begin(wait) : this.#begin(wait, scoped === this.#key ? undefined : scoped, fingerprint === this.#fp ? undefined : fingerprint)
      } catch (e) {
        this.#key = this.#fp = undefined
        throw e
      }
      this.#key = scoped
      this.#fp = fingerprint
      // A replay: the index of the stored value in the slot array.
      if (typeof r === 'number') return Promise.resolve({ value: this.#slot[r], replayed: true, source: REPLAYED })
      if (r === LEAD) return this.#lead(scoped, fingerprint, fn, signal)
      if (r instanceof Promise) {
        // The leader went away (ABANDONED): begin again, one waiter leads.
        const c = enter(this.#callers, scoped)
        const flight = c.flight
        const joined = (v) => {
          if (v !== ABANDONED) return { value: v, replayed: true, source: JOINED }
          // The leader was collected unsettled: its flight is over.
          if (flight !== undefined) flight.collected()
          return this.execute(scoped, fingerprint, fn, options)
        }
        if (signal !== undefined) return waitFor(r, signal, () => leave(c)).then(joined)
        return r.then(
          (v) => {
            leave(c)
            return joined(v)
          },
          (e) => {
            leave(c)
            throw e
          },
        )
      }
      throw new Error('oncely: unexpected answer from the native store')
    } catch (e) {
      return Promise.reject(e)
    }
  }

  /**
   * This caller leads: its lease is in the slot. Runs `fn` and settles the lease with its
   * outcome, whether or not this caller still waits (an abort only stops the waiting).
   */
  #lead(scoped, fingerprint, fn, signal) {
    const lease = this.#slot[0]
    this.#slot[0] = undefined
    const flight = new Flight(this, enter(this.#callers, scoped), fingerprint)
    const done = act(flight, fn).then(
      (value) => {
        flight.end()
        if (signal === undefined) flight.leaderLeaves()
        this.#native.complete(lease, value)
        return { value, replayed: false, source: LED }
      },
      (error) => {
        flight.end()
        if (signal === undefined) flight.leaderLeaves()
        this.#native.fail(lease, error, this.#cacheFailures ? cacheCode(error) : UNKNOWN)
        throw error
      },
    )
    return signal === undefined ? done : waitFor(done, signal, () => flight.leaderLeaves())
  }

  /** Counts since the store was made: leads, joins, replays, conflicts, expirations, evictions. */
  counters() {
    return this.#native.counters()
  }

  /** Entries held now (running and completed; expired ones not yet swept included). */
  get size() {
    return this.#native.size
  }

  /** The TTL of completed entries, ms. */
  get ttlMs() {
    return this.#native.ttlMs
  }

  /** Waiters not yet woken (for tests and metrics). */
  get pendingWaiters() {
    return this.#native.pendingWaiters
  }

  /** Clears a completed entry (e.g. a cached failure) so the next call runs again. */
  remove(scoped) {
    if (typeof scoped !== 'string') throw mustBe('a scoped key (a string from scope())', 'scoped', scoped)
    return this.#native.remove(scoped)
  }
}

/**
 * The HTTP status a server answers with an error of oncely (`err.httpStatus`: 400
 * invalid or missing key, 422 fingerprint mismatch, 409 in progress, 503 store
 * unavailable, …), or `undefined` for any other error.
 */
function httpStatusOf(err) {
  if (err === null || typeof err !== 'object') return undefined
  const s = err.httpStatus
  return typeof s === 'number' && typeof err.kind === 'string' ? s : undefined
}

// ---------------------------------------------------------------------------------------
// The Redis store: the same execute, state shared by every process (and language) on
// one Redis. Results cross as records of the one result encoding of oncely-redis
// (redis/README.md, "Result encoding"): this file decides what a value is (JSON data,
// bytes, no value, not storable, or the user codec's output) and turns JSON text and
// bytes back into values; the native side lays the records out and reads them.
// ---------------------------------------------------------------------------------------

// The `[tag, payload]` tags of a stored result coming back from the native side.
const T_JSON = 0
const T_BYTES = 1
const T_NO_VALUE = 2
const T_VALUE = 3 // the leader's own value (a joiner of a leader in this process)
const T_USER_BYTES = 4
const T_USER_TEXT = 5

function valueTypeName(v) {
  if (v === null) return 'null'
  const t = typeof v
  if (t !== 'object' && t !== 'function') return t
  try {
    if (Array.isArray(v)) return 'Array'
    const proto = Object.getPrototypeOf(v)
    const ctor = proto !== null && Object.prototype.hasOwnProperty.call(proto, 'constructor') ? proto.constructor : undefined
    return typeof ctor === 'function' && typeof ctor.name === 'string' && ctor.name !== '' ? ctor.name : 'Object'
  } catch {
    return 'Object' // a revoked Proxy
  }
}

/**
 * The type name of the first part of `value` that JSON would drop or change (Map, Set,
 * Date, class instances, BigInt, NaN, cycles, functions, sparse arrays, undefined in an
 * array, toJSON), or undefined when `JSON.parse(JSON.stringify(value))` gives it back
 * (object members that are undefined are left out, as JSON does).
 */
function notJson(value) {
  const ancestors = new Set()
  const walk = (v, inArray) => {
    switch (typeof v) {
      case 'string':
      case 'boolean':
        return undefined
      case 'number':
        return Number.isFinite(v) ? undefined : `number (${v})`
      case 'undefined':
        return inArray ? 'undefined (in an array)' : undefined
      case 'object':
        break
      default:
        return typeof v
    }
    if (v === null) return undefined
    if (ancestors.has(v)) return `${valueTypeName(v)} (cyclic)`
    const proto = Object.getPrototypeOf(v)
    let bad
    ancestors.add(v)
    if (Array.isArray(v)) {
      if (proto !== Array.prototype) bad = valueTypeName(v)
      for (let i = 0; bad === undefined && i < v.length; i++) {
        bad = i in v ? walk(v[i], true) : 'Array (sparse)'
      }
    } else if (proto !== Object.prototype && proto !== null) {
      bad = valueTypeName(v)
    } else if (typeof v.toJSON === 'function') {
      bad = 'Object (toJSON)'
    } else {
      for (const k of Object.keys(v)) {
        bad = walk(v[k], false)
        if (bad !== undefined) break
      }
    }
    ancestors.delete(v)
    return bad
  }
  try {
    return walk(value, false)
  } catch (e) {
    // Too deep for the stack, or a getter / Proxy that throws: JSON would fail too.
    return e instanceof RangeError ? `${valueTypeName(value)} (nested too deeply)` : valueTypeName(value)
  }
}

function asBuffer(bytes) {
  return Buffer.isBuffer(bytes) ? bytes : Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength)
}

/**
 * The stored form of a result (redis/README.md, "Result encoding"): "no value" for
 * `undefined`; with `encode`, its output (a Buffer/Uint8Array or a string); otherwise
 * bytes for a Buffer/Uint8Array and JSON for JSON data; anything JSON would change, or
 * an `encode` that throws, is a "not storable" record naming the type. Never throws for
 * a value that cannot be stored.
 */
function encodeResult(value, encode) {
  if (value === undefined) return native.encodeRecord('no_value')
  if (encode !== undefined) {
    let out
    try {
      out = encode(value)
    } catch {
      return native.encodeRecord('not_storable', valueTypeName(value))
    }
    if (out instanceof Uint8Array) return native.encodeRecord('user_bytes', asBuffer(out))
    if (typeof out === 'string' && out.isWellFormed()) return native.encodeRecord('user_text', out)
    return native.encodeRecord('not_storable', valueTypeName(value))
  }
  if (value instanceof Uint8Array) return native.encodeRecord('bytes', asBuffer(value))
  let bad = notJson(value)
  let text
  if (bad === undefined) {
    try {
      text = JSON.stringify(value)
    } catch {
      bad = valueTypeName(value)
    }
  }
  if (bad !== undefined) return native.encodeRecord('not_storable', bad)
  return native.encodeRecord('json', text)
}

function unavailable(message, props) {
  const e = new Error(message)
  e.code = 'UNAVAILABLE'
  e.kind = 'unavailable'
  e.httpStatus = JS_ERROR_STATUS.unavailable
  return Object.assign(e, props)
}

/** The value of a stored result `[tag, payload]`; `decode` reads a user codec's records. */
function resultValue(tag, payload, decode, key) {
  switch (tag) {
    case T_JSON:
      return JSON.parse(payload)
    case T_BYTES:
    case T_VALUE:
      return payload
    case T_NO_VALUE:
      return undefined
    default: {
      const what = key === undefined ? 'the stored result' : `the stored result of ${key}`
      if (decode === undefined) {
        throw unavailable(`${what} was written by a user codec (encode); give this store the matching decode to read it`, key === undefined ? {} : { key })
      }
      try {
        return decode(payload)
      } catch (cause) {
        throw unavailable(`decode could not read ${what} (${cause && cause.message}); the action is not run again`, key === undefined ? { cause } : { key, cause })
      }
    }
  }
}

/**
 * Reads a stored result back: JSON → a fresh value, bytes → a Buffer, no value →
 * undefined, a user codec's record → `decode(buffer or string)`. A "not storable" record
 * throws `result_not_stored` (DATA_LOSS); an unknown tag fails closed (UNAVAILABLE).
 */
function decodeResult(data, decode) {
  const [tag, payload] = native.decodeRecord(data)
  return resultValue(tag, payload, decode)
}

const R_REPLAYED = 0
const R_JOINED = 1
const R_LEAD = 2

class RedisStore {
  #native
  #encode
  #decode
  /** What the re-entrancy check compares (see `reentry`). */
  #identity
  /** The callers of each key waiting here, by scoped key. */
  #callers = new Map()

  /**
   * `{ url, leaseMs = 30_000, ttlMs = 86_400_000, prefix = 'oncely', connectTimeoutMs = 1000,
   * ioTimeoutMs = min(1000, leaseMs / 3), workers = 4, inProgressRetryAfterMs = 1000, encode, decode,
   * connect = false }`
   */
  constructor(options) {
    if (options === null || typeof options !== 'object') throw mustBe('an object with a url', 'options', options)
    const { encode, decode } = options
    if (encode !== undefined && typeof encode !== 'function') throw mustBe('a function', 'encode', encode)
    if (decode !== undefined && typeof decode !== 'function') throw mustBe('a function', 'decode', decode)
    if ((encode === undefined) !== (decode === undefined)) {
      throw invalid(TypeError, encode === undefined ? 'encode' : 'decode', 'encode and decode go together: give both or neither')
    }
    this.#native = new NativeRedisStore(options)
    this.#encode = encode
    this.#decode = decode
    // Instances on one Redis and prefix share their records: for the re-entrancy check
    // they are one store.
    this.#identity = `redis\n${options.url}\n${this.#native.prefix}`
  }

  /**
   * `fn` runs only if this caller leads, across every process sharing the Redis.
   * Resolves to `{ value, replayed, source }`; the leader gets its own value, the others
   * a decoded copy (JSON round trip, a Buffer for bytes, undefined for no value). A
   * result that cannot be stored: the leader and the joiners of this process get the
   * value itself, later callers `result_not_stored`.
   */
  async execute(scoped, fingerprint, fn, options) {
    if (typeof scoped !== 'string') throw mustBe('a scoped key (a string from scope())', 'scoped', scoped)
    if (typeof fingerprint !== 'string') throw mustBe('a string', 'fingerprint', fingerprint)
    if (typeof fn !== 'function') throw mustBe('a function', 'fn', fn)
    let wait = true
    let signal
    if (options !== undefined) {
      if (options === null || typeof options !== 'object') throw mustBe('an object', 'options', options)
      signal = options.signal
      if (signal !== undefined && !isSignal(signal)) throw mustBe('an AbortSignal', 'signal', signal)
      if (options.wait !== undefined) {
        if (typeof options.wait !== 'boolean') throw mustBe('a boolean', 'wait', options.wait)
        wait = options.wait
      }
    }
    if (signal !== undefined && signal.aborted) throw signal.reason
    const reentrant = reentry(this.#identity, scoped, fingerprint)
    if (reentrant !== undefined) throw reentrant
    // Every caller here counts until it leaves: one that waits on another process's
    // leader may join this process's flight when that leader goes and this one leads.
    const c = enter(this.#callers, scoped)
    let flight
    try {
      for (;;) {
        if (signal !== undefined && signal.aborted) throw signal.reason
        const [p, id] = this.#native.begin(scoped, fingerprint, wait)
        let r
        if (signal === undefined) {
          r = await p
        } else {
          try {
            r = await abortable(p, signal)
          } catch (e) {
            if (signal.aborted) {
              this.#native.cancel(id)
              // The claim's answer may have arrived already: a lead no one will use is
              // released at once.
              p.then((out) => out[0] === R_LEAD && this.#native.abandon(out[1]), noop)
            }
            throw e
          }
        }
        switch (r[0]) {
          case R_REPLAYED:
            return { value: resultValue(r[1], r[2], this.#decode, scoped), replayed: true, source: REPLAYED }
          case R_JOINED:
            return { value: resultValue(r[1], r[2], this.#decode, scoped), replayed: true, source: JOINED }
          case R_LEAD:
            if (signal !== undefined && signal.aborted) {
              this.#native.abandon(r[1]) // the action has not started
              throw signal.reason
            }
            flight = new Flight(this.#identity, c, fingerprint)
            return await this.#lead(flight, r[1], fn, signal)
          default:
            continue // the leader went away: claim again
        }
      }
    } finally {
      if (flight === undefined) leave(c)
      else flight.leaderLeaves()
    }
  }

  /**
   * Runs `fn` and settles the lease with its outcome, whether or not the caller still
   * waits (an abort only stops the waiting; the lease is renewed until `fn` settles).
   */
  #lead(flight, lease, fn, signal) {
    const done = act(flight, fn).then(
      async (value) => {
        flight.end()
        // Never throws: a value that cannot be stored becomes a "not storable" record.
        const data = encodeResult(value, this.#encode)
        await this.#native.complete(lease, data, value)
        return { value, replayed: false, source: LED }
      },
      async (error) => {
        flight.end()
        await this.#native.fail(lease, error)
        throw error
      },
    )
    return signal === undefined ? done : abortable(done, signal)
  }

  /**
   * Counts since the store was made: claims, leads, takeovers, replays, remoteWaits,
   * leasesLost, unavailable.
   */
  counters() {
    return this.#native.counters()
  }

  /** The record of `scoped` in Redis: `{ state, fingerprint, generation, leaseLeftMs, data }` or null. */
  async get(scoped) {
    if (typeof scoped !== 'string') throw mustBe('a scoped key (a string from scope())', 'scoped', scoped)
    const r = await this.#native.get(scoped)
    if (r === null) return null
    const record = { state: r[0], fingerprint: r[1], generation: r[2], leaseLeftMs: r[3] }
    if (r[4] !== undefined) record.data = r[4]
    return record
  }

  /** Deletes the record of `scoped` unless it runs under a live lease; resolves to whether one was deleted. */
  async remove(scoped) {
    if (typeof scoped !== 'string') throw mustBe('a scoped key (a string from scope())', 'scoped', scoped)
    return this.#native.remove(scoped)
  }

  /** Health check: PING within the I/O timeout; rejects with UNAVAILABLE. */
  async ping() {
    return this.#native.ping()
  }

  /** The lease of this store's claims, ms. */
  get leaseMs() {
    return this.#native.leaseMs
  }

  /** How long completed results are kept, ms. */
  get ttlMs() {
    return this.#native.ttlMs
  }

  /** The Redis key prefix. */
  get prefix() {
    return this.#native.prefix
  }

  /** The Redis key holding `scoped`'s record: `{<prefix>:<scoped>}`. */
  recordKey(scoped) {
    if (typeof scoped !== 'string') throw mustBe('a scoped key (a string from scope())', 'scoped', scoped)
    return this.#native.recordKey(scoped)
  }
}

module.exports = {
  // backoff, classification, the retry loop
  RetryPolicy,
  Deadline,
  RetryBudget,
  ManualClock,
  ReasonCodes,
  Code,
  codeFromHttp: native.codeFromHttp,
  classify: native.classify,
  parseRetryAfter: native.parseRetryAfter,
  parsePushbackMs: native.parsePushbackMs,
  failureOf,
  codeOf,
  retry,
  // keys and fingerprints
  newKey: native.newKey,
  deriveKey: native.deriveKey,
  validateKey: native.validateKey,
  scope: native.scope,
  fingerprint,
  canonicalJson,
  fingerprintBytes: native.fingerprintBytes,
  headers,
  httpStatus,
  httpStatusOf,
  // the dedup store
  IdempotencyStore,
  RedisStore,
  encodeResult,
  decodeResult,
  // the server contract (SPEC §8) the adapters (oncely/express, oncely/fastify) share
  http: Object.freeze({
    HttpConfig: native.HttpConfig,
    scope: native.httpScope,
    requestFingerprint: native.httpRequestFingerprint,
    storableStatus: native.httpStorableStatus,
    storableGrpcStatus: native.httpStorableGrpcStatus,
    isJson: native.httpIsJson,
    isGrpc: native.httpIsGrpc,
    isEventStream: native.httpIsEventStream,
    encodeResponse: native.httpEncodeResponse,
    decodeResponse: native.httpDecodeResponse,
    problem: native.httpProblem,
    KEY_HEADER: 'idempotency-key',
    GRPC_KEY_METADATA: 'x-idempotency-key',
    REPLAYED_HEADER: 'idempotent-replayed',
    DEFAULT_TENANT: 'default',
    DEFAULT_REQUEST_CAP: 1 << 20,
  }),
}
