'use strict'
// What the server adapters (oncely/express, oncely/fastify) share: their settings, the
// key decision, the scope and fingerprint of a request, and the dedup loop over a store.
// Every rule is the core's (`oncely.http`); this file only drives it.

const { ServerResponse, OutgoingMessage } = require('node:http')
const { http, IdempotencyStore, OncelyError } = require('./index.js')
const native = require('./native.js')
const { RUN } = require('./lib/store.js')
const { mustBe } = require('./lib/errors.js')

const KEY = http.KEY_HEADER

/** A response the leader sent whole but that is not stored: waiters replay it. */
class Unstored extends Error {
  constructor(owner, record) {
    super('the response is not stored (its status)')
    this.owner = owner
    this.record = record
  }
}

/** A response not sent whole, not stored, or a failed handler: the key is released. */
class Released extends Error {
  constructor(owner, why) {
    super(`the key was released: ${why}`)
    this.owner = owner
  }
}

/** The adapters' options, checked when the adapter is built: each bad one is an
 * INVALID_ARGUMENT `TypeError`/`RangeError` naming it, not a failure at the first request. */
function settings(options) {
  if (options === null || typeof options !== 'object') {
    throw mustBe('an object with a `store` (an IdempotencyStore or a RedisStore)', 'options', options)
  }
  const { store } = options
  if (!store || typeof store.execute !== 'function') {
    throw mustBe('an IdempotencyStore or a RedisStore', 'store', store)
  }
  const { tenant, route, fingerprint, onReplay } = options
  for (const [name, f] of Object.entries({ route, fingerprint, onReplay })) {
    if (f !== undefined && typeof f !== 'function') throw mustBe('a function', name, f)
  }
  if (tenant !== undefined && typeof tenant !== 'function' && typeof tenant !== 'string') {
    throw mustBe('a string or a function of the request', 'tenant', tenant)
  }
  for (const name of ['methods', 'storedHeaders']) {
    const v = options[name]
    if (v !== undefined && !(Array.isArray(v) && v.every((m) => typeof m === 'string'))) {
      throw mustBe('an array of strings', name, v)
    }
  }
  for (const name of ['required', 'wait']) {
    const v = options[name]
    if (v !== undefined && typeof v !== 'boolean') throw mustBe('a boolean', name, v)
  }
  for (const name of ['bodyCap', 'requestCap']) {
    const v = options[name]
    // Their range is checked by the core's config below (a RangeError).
    if (v !== undefined && typeof v !== 'number') throw mustBe('a whole number of bytes', name, v)
  }
  const config = new http.HttpConfig({
    methods: options.methods,
    required: options.required,
    wait: options.wait,
    bodyCap: options.bodyCap,
    requestCap: options.requestCap,
    storedHeaders: options.storedHeaders,
  })
  return {
    store,
    config,
    // The in-process store settles a key within the tick that settles its action (no
    // I/O): nothing needs to wait for it before the answer is sent.
    settlesAtOnce: store instanceof IdempotencyStore,
    // The store's call: the in-process store's entry for adapters (see `dedup`), else
    // `execute`. The config's `wait` read once: a getter of the native config costs a
    // call into Rust per request.
    run: storeCall(store, config.wait),
    // `readKey` as a plain function: no class-method dispatch, no decision object.
    readKey: config.keyReader(),
    // The core's header decisions by name, remembered: a handler sets the same few
    // headers on every response, and each decision is otherwise a call into Rust.
    headerRules: new Map(),
    // The core's event-stream decision by content type, remembered likewise.
    eventStreams: new Map(),
    // The core's status decision by status (100..=999).
    storableStatuses: new Uint8Array(1000),
    requestCap: config.requestCap,
    tenant: typeof tenant === 'function' ? tenant : () => tenant ?? http.DEFAULT_TENANT,
    route,
    fingerprint,
    onReplay,
    counters: { passedThrough: 0, refused: 0, led: 0, stored: 0, notStored: 0, replayed: 0 },
  }
}

/** `(scoped, fingerprint, fn)` → the store's answer (see `dedup`). */
function storeCall(store, wait) {
  if (store instanceof IdempotencyStore) return (scoped, fingerprint, fn) => store[RUN](scoped, fingerprint, fn, wait)
  const options = { wait }
  return (scoped, fingerprint, fn) => store.execute(scoped, fingerprint, fn, options)
}

/**
 * The values of the request's Idempotency-Key header, repeats kept: read from
 * `rawHeaders`, since `headersDistinct` builds an object of every header on first use.
 */
function keyValues(req) {
  const raw = req.rawHeaders
  if (!Array.isArray(raw)) {
    const v = req.headers[KEY]
    return v === undefined ? [] : [v]
  }
  const out = []
  for (let i = 0; i < raw.length; i += 2) {
    const name = raw[i]
    if (name.length === KEY.length && name.toLowerCase() === KEY) out.push(raw[i + 1])
  }
  return out
}

/**
 * Whether a request declares (Content-Length) a body over the request cap: it is
 * answered 413 at once, without reading a body it could not fingerprint (SPEC §8).
 */
function declaredOver(s, headers) {
  const v = headers['content-length']
  // A string from Node's parser; a request made by hand (a test, a serverless shim) may
  // carry a number.
  return v !== undefined && s.config.declaresTooLarge(typeof v === 'string' ? v : String(v))
}

/**
 * The leads each request (or gRPC call) has been taken through, by the request: a store
 * and a scoped key, flat. A request that reaches an adapter of the same store again with
 * the same scoped key (the middleware mounted on the app and on the route, a gRPC
 * implementation wrapped twice) goes straight on to the handler, under the lead it is
 * already in: asking the store again from inside that lead would be refused as
 * re-entrant. Another scoped key (a rewrite to another route) leads a key of its own.
 */
const takenBy = new WeakMap()

/** Notes that `req` leads `scoped` in `store`: false when it did already. */
function takeOnce(req, store, scoped) {
  const t = takenBy.get(req)
  if (t === undefined) {
    takenBy.set(req, [store, scoped])
    return true
  }
  for (let i = 0; i < t.length; i += 2) if (t[i] === store && t[i + 1] === scoped) return false
  t.push(store, scoped)
  return true
}

/** The 413 problem for a request over the cap. */
function tooLarge(s) {
  return s.config.tooLarge()
}

/** The most header names whose decisions are remembered (the names a handler sets). */
const HEADER_RULES_MAX = 256

/** Whether the header `name` is kept: stored (`stored`), or shared with the waiters. */
function keepsHeader(s, name, stored) {
  let rule = s.headerRules.get(name)
  if (rule === undefined) {
    // Bit 1: stored with the body; bit 2: shared with a response that is not stored.
    rule = (s.config.storesHeader(name) ? 1 : 0) | (s.config.sharesHeader(name) ? 2 : 0)
    if (s.headerRules.size < HEADER_RULES_MAX) s.headerRules.set(name, rule)
  }
  return (rule & (stored ? 1 : 2)) !== 0
}

/**
 * The headers a stored response keeps, in the form `http.encodeRecord` takes: one
 * string, each name and each value followed by a newline (one string read by the core
 * instead of an array element per name and value). A value holding a newline (one Node
 * has not checked yet: Fastify's `reply.header` does not check, Node refuses it later)
 * must not be split: the list is then given flat, `[name, value, ...]`. Nothing is done
 * for a header that is not stored.
 */
function storedFields(s, headers) {
  let out = ''
  for (const name in headers) {
    const value = headers[name]
    if (value === undefined || !keepsHeader(s, name, true)) continue
    if (Array.isArray(value)) {
      for (const v of value) {
        const text = String(v)
        if (text.includes('\n')) return keptFields(s, headers, true)
        out += `${name}\n${text}\n`
      }
    } else {
      const text = String(value)
      if (text.includes('\n')) return keptFields(s, headers, true)
      out += `${name}\n${text}\n`
    }
  }
  return out
}

/**
 * The headers of a response that is not stored, as a flat list `[name, value, ...]`:
 * every header it shares with the duplicates waiting now (they replay it).
 */
function sharedFields(s, headers) {
  return keptFields(s, headers, false)
}

/** The headers kept (`stored`: in a record; else shared), flat: `[name, value, ...]`. */
function keptFields(s, headers, stored) {
  const out = []
  for (const name in headers) {
    const value = headers[name]
    if (value === undefined || !keepsHeader(s, name, stored)) continue
    if (Array.isArray(value)) {
      for (const v of value) out.push(name, String(v))
    } else {
      out.push(name, String(value))
    }
  }
  return out
}

/** Whether a response with this content type is an event stream (the core's decision, remembered). */
function isEventStream(s, contentType) {
  if (contentType === undefined) return false
  const ct = String(contentType)
  let rule = s.eventStreams.get(ct)
  if (rule === undefined) {
    rule = http.isEventStream(ct)
    if (s.eventStreams.size < HEADER_RULES_MAX) s.eventStreams.set(ct, rule)
  }
  return rule
}

/** Whether a response with this status is stored (the core's decision, remembered by status). */
function storableStatus(s, status) {
  const known = s.storableStatuses
  // 0: not asked yet; 1: not stored; 2: stored. Statuses outside 100..=999 are the core's to refuse.
  if (!(status >= 100 && status <= 999 && Number.isInteger(status))) return http.storableStatus(status)
  let rule = known[status]
  if (rule === 0) known[status] = rule = http.storableStatus(status) ? 2 : 1
  return rule === 2
}

const EMPTY = Buffer.alloc(0)

/** The most methods whose content decisions are remembered. */
const CONTENT_RULES_MAX = 64

/** The core's content decisions by method, then status (they depend on no setting). */
const contentRules = new Map()

/**
 * Whether an answer to `method` with `status` carries content (the core's
 * `has_content`: none to a HEAD, nor with a 1xx, 204 or 304, which Node sends without a
 * body), remembered by method and status.
 */
function hasContent(method, status) {
  let rules = contentRules.get(method)
  if (rules === undefined) {
    if (contentRules.size >= CONTENT_RULES_MAX) return http.hasContent(method, status)
    rules = new Uint8Array(1000)
    contentRules.set(method, rules)
  }
  // 0: not asked yet; 1: no content; 2: content. Statuses outside 100..=999 are the core's.
  if (!(status >= 100 && status <= 999 && Number.isInteger(status))) return http.hasContent(method, status)
  let rule = rules[status]
  if (rule === 0) rules[status] = rule = http.hasContent(method, status) ? 2 : 1
  return rule === 2
}

/**
 * What a whole answer leaves in the store, its body as sent (see `hasContent`): its record
 * (a stored status), or, not stored, an Unstored the duplicates waiting now replay (with
 * a copy of the body: the handler may reuse its buffer).
 */
function outcomeOf(s, owner, method, status, headers, body) {
  if (!hasContent(method, status)) body = EMPTY
  if (storableStatus(s, status)) return http.encodeRecord(status, storedFields(s, headers), body)
  return new Unstored(owner, { status, fields: sharedFields(s, headers), body: Buffer.from(body) })
}

/**
 * An answer to replay, from the record bytes a store gave (`http.decodeRecord`: the
 * body is a view of the record, not a copy): `{ status, fields, body }`, `fields` flat.
 */
function answerOf(bytes) {
  const record = Buffer.isBuffer(bytes)
    ? bytes
    : ArrayBuffer.isView(bytes)
      ? Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength)
      : Buffer.from(bytes)
  const flat = http.decodeRecord(record)
  return { status: flat[0], fields: flat.slice(4, 4 + 2 * flat[3]), body: record.subarray(flat[1], flat[2]) }
}

/**
 * Sets the headers of a replayed answer (repeated names kept, in order) and the
 * replay mark on `res`, a Node ServerResponse.
 */
function setAnswerHeaders(res, fields) {
  for (let i = 0; i < fields.length; i += 2) {
    const name = fields[i]
    let again = false
    for (let j = 0; j < i; j += 2) {
      if (fields[j] === name) {
        again = true
        break
      }
    }
    if (again) res.appendHeader(name, fields[i + 1])
    else res.setHeader(name, fields[i + 1])
  }
  res.setHeader(http.REPLAYED_HEADER, 'true')
}

/** The length of a request fingerprint (SHA-256 in hex), at the start of `requestOf`'s text. */
const FINGERPRINT_LENGTH = 64

/**
 * The scoped key and the fingerprint of a request in one call into the core, as one
 * string: the fingerprint then the scoped key (read them with `fingerprintIn` and
 * `scopedIn`), or the problem to answer (an object). `target` (the path and query) must
 * be a string. The tenant comes from the tenant function; one that is not a string is
 * the server's fault (500 tenant-unusable).
 */
function requestOf(s, req, method, route, key, target, contentType, body) {
  // A missing target would give the scoped key alone, to be misread as both parts.
  if (typeof target !== 'string') throw mustBe('a string (the path and query)', 'target', target)
  const tenant = tenantOf(s, req)
  if (typeof tenant !== 'string') return tenant
  return native.httpRequestText(tenant, method, route, key, target, contentType, body)
}

/**
 * The scoped key of a request (for an adapter given its own fingerprint function), or
 * the problem to answer (an object).
 */
function scopeOf(s, req, method, route, key) {
  const tenant = tenantOf(s, req)
  if (typeof tenant !== 'string') return tenant
  return native.httpRequestText(tenant, method, route, key)
}

/** The tenant from the tenant function, or the problem when it is not a string. */
function tenantOf(s, req) {
  const tenant = s.tenant(req)
  if (typeof tenant === 'string') return tenant
  const what = tenant === null ? 'null' : typeof tenant
  return http.problem({ kind: 'tenant_unusable', message: `the tenant is ${what}, not a string` })
}

/** The scoped key in `requestOf`'s text. */
function scopedIn(text) {
  return text.slice(FINGERPRINT_LENGTH)
}

/** The fingerprint in `requestOf`'s text. */
function fingerprintIn(text) {
  return text.slice(0, FINGERPRINT_LENGTH)
}

function isOncelyError(e) {
  return e instanceof OncelyError
}

/**
 * Runs a covered request through the store. `lead(owner)` calls the handler and gives the record bytes to store,
 * or throws Unstored / Released (carrying `owner`), or a Promise of either. `gone()`
 * makes the Promise that resolves with GONE once the client has gone away; it is asked
 * for only when this caller waits for another (a leader's own answer settles its wait).
 * `decode` reads stored record bytes into the adapter's answer form (that of its
 * Unstored records). Gives what the caller must answer: `{ led: true }` (the handler
 * answered), `{ replay: answer }`, or `{ problem }`; at once when the store knows it at
 * once (a replay; a handler that answered within the call, with the in-process store),
 * else in a Promise. Throws (or rejects with) a foreign error.
 */
function dedup(s, scoped, fingerprint, lead, gone, decode) {
  const owner = { leads: false }
  let r
  try {
    r = s.run(scoped, fingerprint, () => {
      owner.leads = true
      return lead(owner)
    })
  } catch (e) {
    return answerOfError(s, e, owner, scoped, fingerprint, lead, gone, decode)
  }
  if (r instanceof Promise) return settled(s, r, owner, scoped, fingerprint, lead, gone, decode)
  return answerOfRun(s, r, decode)
}

/** `dedup` for an adapter that awaits its outcome: always a Promise. */
function dedupAsync(s, scoped, fingerprint, lead, gone, decode) {
  try {
    return Promise.resolve(dedup(s, scoped, fingerprint, lead, gone, decode))
  } catch (e) {
    return Promise.reject(e)
  }
}

/** What to answer once the store has answered `r` (`{ value, source }`). */
function answerOfRun(s, r, decode) {
  if (r.source === 'led') {
    s.counters.stored++
    return LED
  }
  try {
    return { replay: decode(r.value) }
  } catch (e) {
    // A stored value that is not a record of this adapter (UNAVAILABLE).
    if (!isOncelyError(e)) throw e
    s.counters.refused++
    return { problem: http.problem(e) }
  }
}

/**
 * What to answer when the store's call failed with `e`: the leader's own response (led
 * or shared), a problem, or, when the first request ended without an answer to share,
 * another round (lead or wait again). Throws a foreign error.
 */
function answerOfError(s, e, owner, scoped, fingerprint, lead, gone, decode) {
  if (e instanceof Unstored) {
    if (e.owner === owner) return LED
    return { replay: e.record }
  }
  if (e instanceof Released) {
    if (e.owner === owner) return LED
    return dedup(s, scoped, fingerprint, lead, gone, decode)
  }
  if (isOncelyError(e)) {
    s.counters.refused++
    return { problem: http.problem(e) }
  }
  throw e
}

async function settled(s, run, owner, scoped, fingerprint, lead, gone, decode) {
  let r
  try {
    // Not the store's `signal`: an AbortSignal and its listener cost more than the rest
    // of a first call in the store. A caller whose client has gone stops waiting here;
    // the store's waiter goes on until the first request ends (a leader keeps the key
    // until its handler settles either way).
    if (gone === undefined || owner.leads) {
      r = await run
    } else {
      run.catch(noop)
      r = await Promise.race([run, gone()])
      if (r === GONE) throw new Error('the client went away')
    }
  } catch (e) {
    return answerOfError(s, e, owner, scoped, fingerprint, lead, gone, decode)
  }
  return answerOfRun(s, r, decode)
}

const LED = Object.freeze({ led: true })

function noop() {}

/** What `gone` (see `goneOf`) resolves with. */
const GONE = Symbol('gone')

/** A Promise resolving with GONE once `emitter` emits `event` (the client went away). */
function goneOf(emitter, event, unless = () => false) {
  return new Promise((resolve) => {
    emitter.once(event, () => {
      if (!unless()) resolve(GONE)
    })
  })
}

/**
 * The server timeouts (`server.setTimeout`, Fastify's `connectionTimeout`, a response's
 * `res.setTimeout`) each socket has seen: `{ fired, cut }`, `cut` when the last one's
 * dispatch (Node's listener and the app's callbacks) left the socket destroyed. A timeout
 * cuts the connection while the handler goes on (a timeout stops nothing): a close after
 * it is no sign that the handler stopped, so it is taken as a client gone away (the key
 * stays held until the handler answers), not as a cut that releases the key (a retry
 * would run the handler again while it still runs). See `clientGone`.
 */
const timeouts = new WeakMap()

/** Sockets in a timeout's dispatch: a `res.destroy()` there is the timeout's cut. */
const dispatching = new WeakSet()

/**
 * Watches `socket` (once, however many requests it serves) and gives its record
 * `{ fired, cut, late, onLate }`: its timeouts (two listeners, one before Node's, one
 * after; a led request keeps `fired` from its start, so that only a timeout during its
 * own run counts for it), and its late cuts: `destroy()` called without an error on it
 * once it was already destroyed, outside its 'error' event: the server cutting a
 * connection its client had left (Express's final handler after a failure). `onLate`:
 * functions called at the next late cut.
 */
function watchSocket(socket) {
  // A socket it cannot watch (none, or no `on`): a record of its own, never updated.
  if (!socket || typeof socket.on !== 'function') return { fired: 0, cut: false, late: 0, onLate: null }
  let w = timeouts.get(socket)
  if (w !== undefined) return w
  w = { fired: 0, cut: false, late: 0, onLate: null, erring: false }
  timeouts.set(socket, w)
  socket.prependListener('timeout', () => dispatching.add(socket))
  socket.on('timeout', () => {
    dispatching.delete(socket)
    w.fired++
    w.cut = socket.destroyed
  })
  // While the socket's 'error' is emitted (a reset), its listeners cut it again: Node's
  // own (with the error) and an app's (`server.on('clientError', (e, s) => s.destroy())`):
  // no late cut, the handler may still run.
  socket.prependListener('error', () => {
    w.erring = true
  })
  socket.on('error', () => {
    w.erring = false
  })
  const destroy = socket.destroy
  if (typeof destroy === 'function') {
    socket.destroy = function (error) {
      // With an error: Node's own, or a response's `destroy(err)` passed on (see
      // `whenCut`); not counted.
      if (this.destroyed && error === undefined && !w.erring) {
        w.late++
        const waiting = w.onLate
        if (waiting !== null) {
          w.onLate = null
          for (const f of waiting) f()
        }
      }
      return destroy.call(this, error)
    }
  }
  return w
}

/**
 * Responses cut with `res.destroy()` outside a timeout's dispatch: by a handler, or by
 * the framework for a handler that failed. Node's own cuts (a timeout, a client's
 * reset) destroy the socket, not the response. `destroy` of Node's ServerResponse is
 * wrapped once per process (`hookDestroy`): the wrapper notes the response and calls on;
 * nothing else is done for a response that is not destroyed.
 */
const cutResponses = new WeakSet()

/**
 * The responses the server cut while their connection was still up (`res.destroy(err)`,
 * a `pipeline` into them whose source failed): a connection closed with such a cut is
 * not the client's leaving (see `clientLeft`).
 */
const serverCuts = new WeakSet()

let destroyHooked = false

function hookDestroy() {
  if (destroyHooked) return
  destroyHooked = true
  const P = ServerResponse.prototype
  const own = Object.hasOwn(P, 'destroy') ? P.destroy : undefined
  P.destroy = function destroy(error) {
    const socket = this.socket
    // Cut while its connection was still up: the server's own cut (not a reaction to the
    // client having left, as an app's 'close' listener that destroys the response is).
    if (socket && !socket.destroyed && !socket.readableEnded && !socket.errored && !dispatching.has(socket)) {
      serverCuts.add(this)
    }
    if (!(socket && dispatching.has(socket))) {
      cutResponses.add(this)
      const waiting = onCut.get(this)
      if (waiting !== undefined) {
        onCut.delete(this)
        for (const f of waiting) f()
      }
    }
    return (own ?? OutgoingMessage.prototype.destroy).call(this, error)
  }
}

/** Functions called when each response is next cut with `res.destroy()` (see `whenCut`). */
const onCut = new WeakMap()

/**
 * Calls `f` at once when `res` was cut with `res.destroy()` (outside a timeout's
 * dispatch), else when it next is.
 */
function whenCut(res, f) {
  if (cutResponses.has(res)) return f()
  const waiting = onCut.get(res)
  if (waiting === undefined) onCut.set(res, [f])
  else waiting.push(f)
}

/**
 * Whether a led request's connection, closed before its answer was whole, closed
 * because its client went away (it ended or reset the connection) or a server timeout
 * cut it: either way the handler goes on, so its key stays held until it answers. Any
 * other close is the server cutting a request whose handler has stopped (a handler's
 * `res.destroy()`, Express destroying the socket of a handler that failed after its
 * answer began), which releases the key. `seen`: the socket's timeouts when the request
 * began to lead (`watchSocket`).
 * A timeout whose dispatch cut the connection is a cut. A timeout the app kept (Node
 * did not cut) may still be cut by the app's own callback later (`setImmediate(() =>
 * s.destroy())`, `s.end('HTTP/1.1 408 …')`): a close after it, the answer not begun and
 * not by `res.destroy()`, is taken as that cut; one after the answer began is the server
 * cutting a handler that failed (the key is released: a handler still sending it would
 * not have its answer stored either way).
 */
function clientGone(socket, res, seen) {
  if (clientLeft(socket, seen, res)) return true
  const t = socket && timeouts.get(socket)
  return t !== undefined && t.fired !== seen && !res.headersSent && !cutResponses.has(res)
}

/**
 * Whether the client itself left (it ended or reset the connection) or a timeout during
 * the request cut it (see `clientGone`): not a kept timeout's later, unknown cut. A
 * response the server cut while its connection was up (`res.destroy(err)`, a `pipeline`
 * into it whose source failed: `serverCuts`) puts its error on the socket too: that is
 * not the client leaving (the handler has stopped, and the key is released). Any other
 * error on the socket is taken as the client's (a reset, a broken pipe, a TLS failure):
 * the handler may still run, so the key stays held.
 */
function clientLeft(socket, seen, res) {
  if (!socket) return false
  if (res !== undefined && serverCuts.has(res)) return false
  if (socket.readableEnded || socket.errored) return true
  const t = timeouts.get(socket)
  return t !== undefined && t.fired !== seen && t.cut
}

/** `on_replay` and the counter, for every replayed answer. */
function replayed(s, req, scoped) {
  s.counters.replayed++
  if (s.onReplay) {
    // A failing hook (throwing, or an async one rejecting) must not turn a replay into
    // an error, nor end the process: it is reported as a warning and the replay is sent.
    try {
      const r = s.onReplay(req, scoped)
      if (r !== null && typeof r === 'object' && typeof r.then === 'function') r.then(undefined, onReplayFailed)
    } catch (e) {
      onReplayFailed(e)
    }
  }
}

function onReplayFailed(e) {
  process.emitWarning(`onReplay failed: ${e?.stack ?? e}`, { code: 'ONCELY_ON_REPLAY' })
}

module.exports = {
  Unstored,
  Released,
  settings,
  keyValues,
  declaredOver,
  takeOnce,
  tooLarge,
  storedFields,
  sharedFields,
  isEventStream,
  storableStatus,
  hasContent,
  outcomeOf,
  answerOf,
  setAnswerHeaders,
  requestOf,
  scopeOf,
  scopedIn,
  fingerprintIn,
  dedup,
  dedupAsync,
  goneOf,
  replayed,
  clientGone,
  clientLeft,
  watchSocket,
  hookDestroy,
  whenCut,
  http,
}
