'use strict'
// The Redis store: the same execute, state shared by every process (and language) on
// one Redis. Results cross as records of the one result encoding of oncely-redis
// (redis/README.md, "Result encoding"): this file decides what a value is (JSON data,
// bytes, no value, not storable, or the user codec's output) and turns JSON text and
// bytes back into values; the native side lays the records out and reads them.

const native = require('../native.js')
const { NativeRedisStore } = require('../native.js')
const { JS_ERROR_STATUS, invalid, mustBe } = require('./errors.js')
const { abortable, LED, JOINED, REPLAYED, noop, enter, leave, Flight, act, reentry, executeArgs } = require('./store.js')

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
    const ctor = proto !== null && Object.hasOwn(proto, 'constructor') ? proto.constructor : undefined
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
  try {
    return encodeValue(value, encode)
  } catch {
    // A Proxy whose traps throw (even `instanceof` runs one): the action has run, so its
    // key must still be settled, as "not storable".
    return native.encodeRecord('not_storable', valueTypeName(value))
  }
}

function encodeValue(value, encode) {
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
   * `{ url | urls, cluster = false, sentinel, minReplicas = 0, minReplicasTimeoutMs = ioTimeoutMs / 2,
   * leaseMs = 30_000, ttlMs = 86_400_000, prefix = 'oncely', connectTimeoutMs = 1000,
   * ioTimeoutMs = min(1000, leaseMs / 3), workers = 4, inProgressRetryAfterMs = 1000, encode, decode,
   * connect = false, maxResultBytes = 64 MiB }`
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
    this.#identity = `redis\n${options.url ?? options.urls.join(' ')}\n${this.#native.prefix}`
  }

  /**
   * `fn` runs only if this caller leads, across every process sharing the Redis.
   * Resolves to `{ value, replayed, source }`; the leader gets its own value, the others
   * a decoded copy (JSON round trip, a Buffer for bytes, undefined for no value). A
   * result that cannot be stored: the leader and the joiners of this process get the
   * value itself, later callers `result_not_stored`.
   */
  async execute(scoped, fingerprint, fn, options) {
    const { wait, signal } = executeArgs(scoped, fingerprint, fn, options)
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
   * leasesLost, abandoned, unavailable, claimsUnreplicated, completionsUnreplicated.
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

  /** The largest result stored, in bytes (encoded): a larger one is recorded as not storable. */
  get maxResultBytes() {
    return this.#native.maxResultBytes
  }

  /** The Redis key holding `scoped`'s record: `{<prefix>:<scoped>}`. */
  recordKey(scoped) {
    if (typeof scoped !== 'string') throw mustBe('a scoped key (a string from scope())', 'scoped', scoped)
    return this.#native.recordKey(scoped)
  }
}

module.exports = { T_JSON, T_BYTES, T_NO_VALUE, T_VALUE, T_USER_BYTES, T_USER_TEXT, valueTypeName, notJson, asBuffer, encodeResult, unavailable, resultValue, decodeResult, R_REPLAYED, R_JOINED, R_LEAD, RedisStore }
