'use strict'
// Errors raised in this file (bad input to the JavaScript-only functions)

const native = require('../native.js')

const JS_ERROR_STATUS = Object.freeze(native.jsErrorStatus())

function invalid(Ctor, field, message) {
  const e = new Ctor(message)
  e.code = 'INVALID_ARGUMENT'
  e.kind = 'invalid_argument'
  e.httpStatus = JS_ERROR_STATUS.invalidArgument
  e.field = field
  return e
}

// ---------------------------------------------------------------------------------------
// Error classes. Every error oncely throws is an `OncelyError` (`err instanceof
// OncelyError`), and an instance of the class of its kind (`InProgressError`, …). Bad
// arguments stay `TypeError`s / `RangeError`s as well, so membership is decided by the
// error's `kind` (the one name of an error in Rust, Python and Node) together with its
// `code` and `httpStatus`, not by its prototype: errors made by the native side, by this
// file and by another copy of the package all answer alike.
// ---------------------------------------------------------------------------------------

const ERROR_KINDS = new Map(native.errorKinds().map((k) => [k.kind, k]))

function isOncelyError(v) {
  return v instanceof Error && typeof v.kind === 'string' && ERROR_KINDS.has(v.kind) && typeof v.code === 'string' && typeof v.httpStatus === 'number'
}

/** The root of every error oncely throws: `code` (gRPC code name), `kind`, `httpStatus`. */
class OncelyError extends Error {
  /** The kinds this class stands for. */
  static kinds = [...ERROR_KINDS.keys()]
  constructor(message, props) {
    super(message)
    const kind = new.target.kinds[0]
    const facts = ERROR_KINDS.get(kind)
    this.name = new.target.name
    this.code = facts.code
    this.kind = kind
    this.httpStatus = facts.httpStatus
    if (props !== undefined) Object.assign(this, props)
  }
  static [Symbol.hasInstance](v) {
    return isOncelyError(v) && this.kinds.includes(v.kind) && (this.matches === undefined || this.matches(v))
  }
}
/** A setting or argument out of range or of the wrong type (also a `TypeError` or `RangeError`); `field` names it. */
class InvalidArgumentError extends OncelyError {
  static kinds = ['invalid_argument', 'missing_key']
}
/** An idempotency key that is not `[A-Za-z0-9_-]{8,64}`, or missing. */
class InvalidKeyError extends InvalidArgumentError {
  static kinds = ['invalid_argument', 'missing_key']
  static matches(v) {
    return v.kind === 'missing_key' || v.field === 'idempotencyKey'
  }
  constructor(message, props) {
    super(message, { field: 'idempotencyKey', ...props })
  }
}
/** A write without an idempotency key. */
class MissingKeyError extends InvalidKeyError {
  static kinds = ['missing_key']
}
/** One key reused with different request parameters (422). */
class FingerprintMismatchError extends OncelyError {
  static kinds = ['fingerprint_mismatch']
}
/** A call with this key is still running (409 + Retry-After); `retryAfterMs`. */
class InProgressError extends OncelyError {
  static kinds = ['in_progress']
}
/** The leader's claim on a key was taken over; its result was not stored (409). */
class LeaseLostError extends OncelyError {
  static kinds = ['lease_lost']
}
/** The store is full of running operations (503); `maxEntries`. */
class CapacityError extends OncelyError {
  static kinds = ['capacity']
}
/** The store could not be reached; nothing was executed (503). */
class StoreUnavailableError extends OncelyError {
  static kinds = ['unavailable']
}
/** The call this one waited for failed without an error to share (500). */
class LeaderPanickedError extends OncelyError {
  static kinds = ['leader_panicked']
}
/** An action called `execute` with the key it is leading (500); `key`. */
class ReentrantCallError extends OncelyError {
  static kinds = ['reentrant']
}
/** The operation ran, but its result could not be stored (500); `key`, `typeName`. */
class ResultNotStoredError extends OncelyError {
  static kinds = ['result_not_stored']
}

function typeName(v) {
  if (v === null) return 'null'
  try {
    if (Array.isArray(v)) return 'an array'
  } catch {
    return 'a revoked proxy' // Array.isArray throws on one
  }
  const t = typeof v
  return t === 'undefined' ? 'undefined' : t === 'object' ? 'an object' : `a ${t}`
}

function mustBe(what, field, v) {
  return invalid(TypeError, field, `${field} must be ${what}, got ${typeName(v)}`)
}

function isSignal(s) {
  return s !== null && typeof s === 'object' && typeof s.aborted === 'boolean' && typeof s.addEventListener === 'function'
}

module.exports = { JS_ERROR_STATUS, invalid, ERROR_KINDS, isOncelyError, OncelyError, InvalidArgumentError, InvalidKeyError, MissingKeyError, FingerprintMismatchError, InProgressError, LeaseLostError, CapacityError, StoreUnavailableError, LeaderPanickedError, ReentrantCallError, ResultNotStoredError, typeName, mustBe, isSignal }
