'use strict'
// Error extraction: which gRPC code (and server delay) a JavaScript error stands for

const native = require('../native.js')
const { ReasonCodes } = require('../native.js')
const { Code } = require('./codes.js')
const { invalid, typeName, mustBe } = require('./errors.js')

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

module.exports = { UNKNOWN, EXTRACT_HEADERS, MAX_CHAIN, Failure, rawValue, headerText, collect, typeNames, level, extract, fromUser, defaultReasons, toCode, failureOf, codeOf }
