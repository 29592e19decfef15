'use strict'
// The dedup store

const { AsyncLocalStorage } = require('node:async_hooks')

const native = require('../native.js')
const { NativeStore } = require('../native.js')
const { isOncelyError, mustBe, isSignal } = require('./errors.js')
const { UNKNOWN, codeOf } = require('./extract.js')

/** The server adapters' entry into a store (`IdempotencyStore[RUN]`). */
const RUN = Symbol('oncely.run')

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

/**
 * Leads whose action is running (flights and adapter leads, of either store). `acting`
 * is on exactly while one runs: on Node 20 an enabled AsyncLocalStorage hooks every
 * Promise and async resource of the process, and with no lead running nothing needs it
 * (`reentry` only looks for running leads); the next lead's `acting.run` enables it
 * again. Counted with callgrind over oncely/express's first calls: switched off when the
 * last lead ends, the context costs ~6,000 instructions per request (the `run`, the
 * switch on and off); kept on while leads keep coming, ~17,000 (the hooks on every
 * Promise and async resource between leads). A lead whose action never settles keeps it on.
 */
let leadsRunning = 0

function leadStarts() {
  leadsRunning += 1
}

function leadStops() {
  leadsRunning -= 1
  if (leadsRunning === 0) acting.disable()
}

/**
 * The running lead in `record`'s chain nearest to it (itself included), or undefined: a
 * finished lead never runs again, so a new lead's parent skips those (a chain of
 * finished leads would otherwise grow with every lead started from another's work).
 */
function runningLead(record) {
  let f = record
  while (f !== undefined && !f.running) f = f.parent
  return f
}

/** Whether a lead runs, so that `acting` is on (for tests). */
function contextOn() {
  return leadsRunning > 0
}

/** How many leads run now (for tests). */
function runningLeads() {
  return leadsRunning
}

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

/**
 * A running lead as `reentry` reads it in its async context: an action led through
 * `IdempotencyStore[RUN]` (a server adapter's handler) is this alone; a Flight adds its
 * callers and signal.
 */
class Leading {
  constructor(store, key, fingerprint) {
    /** The store (a RedisStore: the string naming its records, shared by instances). */
    this.store = store
    this.key = key
    this.fp = fingerprint
    /** The lead whose action started this one: a cycle of keys is re-entrant too. */
    this.parent = runningLead(acting.getStore())
    this.running = true
    leadStarts()
  }

  /** The action settled (or its lease was collected unsettled). */
  end() {
    if (!this.running) return
    this.running = false
    leadStops()
  }

  /** The leader's lease was collected with its never-settling action. */
  collected() {
    this.end()
  }
}

/**
 * Ends the lead whose lease handle was collected unsettled (its action can never settle;
 * the store has released the key): a lead nobody joins would otherwise count as running
 * for good, and keep `acting` on.
 */
const collectedLeads = new FinalizationRegistry((lead) => lead.collected())

/** One run of an action, from its lead until it settles (or its lease is collected). */
class Flight extends Leading {
  #controller = undefined
  #gone = false

  constructor(store, callers, fingerprint) {
    super(store, callers.key, fingerprint)
    this.callers = callers
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
    super.end()
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

/** Whether `v` is a Promise or another thenable (an action's value to wait for). */
function isThenable(v) {
  return v !== null && (typeof v === 'object' || typeof v === 'function') && typeof v.then === 'function'
}

/**
 * A Promise of an action's `value` (a thenable) that never throws: whatever the value's
 * `constructor` or `then` does (a getter that throws, an own `then` that throws when
 * called), the Promise rejects with it (the action failed) instead of a synchronous
 * throw that would leave the action's lease unsettled. (`Promise.resolve` checks the
 * constructor, and `.then` on the value calls its own `then`, both synchronously.)
 */
function promiseOf(value) {
  return new Promise((resolve) => resolve(value))
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
const EXECUTE_DEFAULTS = Object.freeze({ wait: true, signal: undefined })
const EXECUTE_NO_WAIT = Object.freeze({ wait: false, signal: undefined })

/**
 * Checks the arguments of either store's `execute` and reads its options once:
 * `{ wait, signal }`. Throws the caller's own abort reason when the signal has already
 * aborted (nothing has started).
 */
function executeArgs(scoped, fingerprint, fn, options) {
  if (typeof scoped !== 'string') throw mustBe('a scoped key (a string from scope())', 'scoped', scoped)
  if (typeof fingerprint !== 'string') throw mustBe('a string', 'fingerprint', fingerprint)
  if (typeof fn !== 'function') throw mustBe('a function', 'fn', fn)
  if (options === undefined) return EXECUTE_DEFAULTS
  if (options === null || typeof options !== 'object') throw mustBe('an object', 'options', options)
  const signal = options.signal
  if (signal !== undefined && !isSignal(signal)) throw mustBe('an AbortSignal', 'signal', signal)
  let wait = options.wait
  if (wait === undefined) wait = true
  else if (typeof wait !== 'boolean') throw mustBe('a boolean', 'wait', wait)
  if (signal === undefined) return wait ? EXECUTE_DEFAULTS : EXECUTE_NO_WAIT
  if (signal.aborted) throw signal.reason
  return { wait, signal }
}

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
  /** The same, for `[RUN]`: a lead's lease is held in the store (see `[RUN]`). */
  #beginHeld
  /**
   * `[RUN]` leads running now, each with its lease held in the store (nested leads hold
   * theirs inside): counted here, so that the store gives up any lease held beyond them
   * (left by a call that ended without settling it) at the next begin.
   */
  #held = 0
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
    this.#beginHeld = this.#native.beginHeldFunction()
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
      const { wait, signal } = executeArgs(scoped, fingerprint, fn, options)
      const reentrant = reentry(this, scoped, fingerprint)
      if (reentrant !== undefined) throw reentrant
      const r = this.#beginOf(scoped, fingerprint, wait)
      // A replay: the index of the stored value in the slot array.
      if (typeof r === 'number') return Promise.resolve({ value: this.#slot[r], replayed: true, source: REPLAYED })
      if (r === LEAD) return this.#lead(scoped, fingerprint, fn, signal)
      if (r instanceof Promise) return this.#join(scoped, r, signal, () => this.execute(scoped, fingerprint, fn, options))
      throw new Error('oncely: unexpected answer from the native store')
    } catch (e) {
      return Promise.reject(e)
    }
  }

  /**
   * The native `begin`: a number (a replay: the index of the stored value in the slot),
   * LEAD (this caller leads: its lease is in the slot) or a Promise (a join). The strings
   * cross into Rust only when they differ from the last call's.
   */
  #beginOf(scoped, fingerprint, wait, held = false) {
    let r
    try {
      if (held) {
        r = this.#beginHeld(wait, scoped === this.#key ? undefined : scoped, fingerprint === this.#fp ? undefined : fingerprint, this.#held)
      } else {
        r = scoped === this.#key && fingerprint === this.#fp ? this.#begin(wait) : this.#begin(wait, scoped === this.#key ? undefined : scoped, fingerprint === this.#fp ? undefined : fingerprint)
      }
    } catch (e) {
      this.#key = this.#fp = undefined
      throw e
    }
    this.#key = scoped
    this.#fp = fingerprint
    return r
  }

  /**
   * `execute` for the server adapters (adapter.js), without what only other callers
   * need: the action (a request's handler) gets no signal, so it runs without a flight
   * (only a record of what it leads, for the re-entrancy check, in the async context);
   * and an outcome known at once (a replay, an action that returned or threw at once)
   * comes back as it is, or is thrown, not put in a Promise. Else a Promise of
   * `{ value, replayed, source }`. Arguments as `execute` checks them (the adapters pass
   * a string key and fingerprint, a function and a boolean).
   */
  [RUN](scoped, fingerprint, fn, wait) {
    const reentrant = reentry(this, scoped, fingerprint)
    if (reentrant !== undefined) throw reentrant
    const r = this.#beginOf(scoped, fingerprint, wait, true)
    if (typeof r === 'number') return { value: this.#slot[r], replayed: true, source: REPLAYED }
    if (r === LEAD) return this.#leadHeld(scoped, fingerprint, fn)
    if (r instanceof Promise) return this.#join(scoped, r, undefined, () => this[RUN](scoped, fingerprint, fn, wait))
    throw new Error('oncely: unexpected answer from the native store')
  }

  /**
   * `[RUN]`'s lead: the lease stays in the store (no External, no finalizer) while the
   * action runs, and is settled before this call returns when the action returns or
   * throws at once (a lead nested inside settles its own first). An action that goes on
   * asynchronously takes its lease out as a handle. Whatever else happens before the
   * lease is settled (a `then` getter that throws), it is given up, so that a waiter
   * takes over; and should this call end without even that (a stack overflow in its
   * last steps), the store gives the lease up at the next begin or settle (`#held` is
   * kept with plain statements, which cannot fail, before any call).
   */
  #leadHeld(scoped, fingerprint, fn) {
    const depth = ++this.#held
    let holding = true
    let leading
    try {
      leading = new Leading(this, scoped, fingerprint)
      let out
      try {
        out = acting.run(leading, fn)
      } catch (e) {
        // Read before this lease stops counting: reading the code may run the error's
        // getters, which may lead other keys of this store (nested above this lease).
        const code = this.#cacheFailures ? cacheCode(e) : UNKNOWN
        // Nothing runs between the count and the settle (ending the lead can run user
        // code: `acting.disable` reads `Array[Symbol.species]`).
        holding = false
        this.#held--
        try {
          this.#native.failHeld(depth, e, code)
        } finally {
          leading.end()
        }
        throw e
      }
      if (!isThenable(out)) {
        holding = false
        this.#held--
        try {
          this.#native.completeHeld(depth, out)
        } finally {
          leading.end()
        }
        return { value: out, replayed: false, source: LED }
      }
      holding = false
      this.#held--
      const lease = this.#native.releaseHeld(depth)
      collectedLeads.register(lease, leading)
      return promiseOf(out).then(
        (value) => {
          leading.end()
          this.#native.complete(lease, value)
          return { value, replayed: false, source: LED }
        },
        (error) => {
          leading.end()
          this.#native.fail(lease, error, this.#cacheFailures ? cacheCode(error) : UNKNOWN)
          throw error
        },
      )
    } finally {
      if (holding) {
        holding = false
        this.#held--
        this.#native.abandonHeld(depth)
        leading?.end()
      }
    }
  }

  /**
   * This caller waits for the running call of `scoped` (`r`, the flight's Promise): its
   * value, given as joined, or, when the leader went away unsettled (ABANDONED), `again()`
   * (the callers begin again and one of them leads).
   */
  #join(scoped, r, signal, again) {
    const c = enter(this.#callers, scoped)
    const flight = c.flight
    const joined = (v) => {
      if (v !== ABANDONED) return { value: v, replayed: true, source: JOINED }
      // The leader was collected unsettled: its flight is over.
      if (flight !== undefined) flight.collected()
      return again()
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

  /**
   * This caller leads: its lease is in the slot. Runs `fn` and settles the lease with its
   * outcome, whether or not this caller still waits (an abort only stops the waiting).
   */
  #lead(scoped, fingerprint, fn, signal) {
    const lease = this.#slot[0]
    this.#slot[0] = undefined
    const flight = new Flight(this, enter(this.#callers, scoped), fingerprint)
    let out
    try {
      out = acting.run(flight, fn, flight.info)
    } catch (e) {
      out = Promise.reject(e)
    }
    if (!isThenable(out)) {
      // An action that answered synchronously settles its key now: no Promise hop
      // between its value and the store (a server adapter whose handler answered at
      // once stores the record before the server reads the next request).
      flight.end()
      if (signal === undefined) flight.leaderLeaves()
      this.#native.complete(lease, out)
      const led = Promise.resolve({ value: out, replayed: false, source: LED })
      return signal === undefined ? led : waitFor(led, signal, () => flight.leaderLeaves())
    }
    const done = promiseOf(out).then(
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
  return isOncelyError(err) ? err.httpStatus : undefined
}

module.exports = { contextOn, runningLeads, RUN, ABANDONED, LEAD, abortable, LED, JOINED, REPLAYED, noop, waitFor, acting, Callers, enter, leave, goneReason, Flight, ActionInfo, act, isThenable, reentry, EXECUTE_DEFAULTS, executeArgs, cacheCode, IdempotencyStore, httpStatusOf }
