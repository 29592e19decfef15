'use strict'
// oncely/express: the server contract (SPEC §8) as Express 4/5 middleware.

const { ServerResponse, OutgoingMessage } = require('node:http')

const {
  Unstored,
  Released,
  settings,
  keyValues,
  declaredOver,
  takeOnce,
  tooLarge,
  isEventStream,
  outcomeOf,
  answerOf,
  setAnswerHeaders,
  requestOf,
  scopeOf,
  scopedIn,
  fingerprintIn,
  dedup,
  goneOf,
  replayed,
  clientGone,
  watchSocket,
  hookDestroy,
  whenCut,
  http,
} = require('./adapter.js')

/** Reads the request body whole, up to `cap` bytes: the bytes, or `null` when over. */
function readBody(req, cap) {
  return new Promise((resolve, reject) => {
    const chunks = []
    let size = 0
    let over = false
    req.on('data', (c) => {
      if (over) return
      size += c.length
      if (size > cap) {
        over = true
        chunks.length = 0
        return
      }
      chunks.push(c)
    })
    req.on('end', () => resolve(over ? null : Buffer.concat(chunks, size)))
    req.on('error', reject)
  })
}

/**
 * The raw body of a request a body parser has already read: its bytes, or the text of a
 * parsed body (a parsed JSON body as JSON text: its canonical form is the same as the
 * bytes', SPEC §8).
 */
function parsedBody(req) {
  // An own property (as a body parser's `verify` sets it): a read that misses walks the
  // request's whole prototype chain, uncached (no two Express requests share a hidden class).
  if (Object.hasOwn(req, 'rawBody') && Buffer.isBuffer(req.rawBody)) return req.rawBody
  const b = req.body
  if (b === undefined || b === null) return ''
  if (Buffer.isBuffer(b) || typeof b === 'string') return b
  return JSON.stringify(b)
}

function noop() {}

function sendProblem(res, p) {
  if (res.writableEnded) return
  if (!res.headersSent) {
    res.statusCode = p.status
    for (const [n, v] of p.headers) res.setHeader(n, v)
  }
  res.end(p.body)
}

/**
 * Express middleware making covered requests idempotent by their Idempotency-Key.
 * See index.d.ts (`oncely/express`) for the options.
 */
function idempotency(options) {
  const s = settings(options)
  const cap = s.config.bodyCap
  hookResponses()
  hookDestroy()

  // Not an async function: a first call whose handler answers at once, with the
  // in-process store, runs without a Promise (each one costs the Promise hooks of
  // whatever else in the process uses them). Anything asynchronous continues in a
  // Promise whose failure goes to `next`.
  function handler(req, res, next) {
    let p
    try {
      p = middleware(req, res, next)
    } catch (e) {
      return next(e)
    }
    if (p !== undefined) p.catch(next)
  }

  function middleware(req, res, next) {
    const method = req.method
    const key = s.readKey(method, keyValues(req))
    if (key === null) {
      s.counters.passedThrough++
      next()
      return
    }
    if (typeof key !== 'string') {
      s.counters.refused++
      sendProblem(res, key)
      return
    }
    if (req._body || req.readableEnded) return covered(req, res, next, method, key, parsedBody(req))
    const headers = req.headers
    if (declaredOver(s, headers)) {
      s.counters.refused++
      // The body is not read: the connection ends with this answer.
      res.setHeader('connection', 'close')
      sendProblem(res, tooLarge(s))
      return
    }
    return readBody(req, s.requestCap).then((body) => {
      if (body === null) {
        s.counters.refused++
        return sendProblem(res, tooLarge(s))
      }
      req.rawBody = body
      const ct = headers['content-type']
      if (body.length > 0) {
        if (ct && http.isJson(ct)) {
          try {
            req.body = JSON.parse(body.toString('utf8'))
          } catch {
            req.body = undefined
          }
        } else {
          req.body = body
        }
      }
      // Body parsers mounted after this middleware see the body as read.
      req._body = true
      return covered(req, res, next, method, key, body)
    })
  }

  /** A covered request with its key and body: scoped, fingerprinted, run through the store. */
  function covered(req, res, next, method, key, body) {
    const url = req.originalUrl
    const template = req.route
    const route = String((s.route && s.route(req)) ?? (template ? req.baseUrl + template.path : url.split('?')[0]))
    const own = s.fingerprint !== undefined
    const r = own ? scopeOf(s, req, method, route, key) : requestOf(s, req, method, route, key, url, req.headers['content-type'], body)
    if (typeof r !== 'string') {
      s.counters.refused++
      return sendProblem(res, r)
    }
    const scoped = own ? r : scopedIn(r)
    if (!takeOnce(req, s.store, scoped)) {
      // Here again with the same store and key (mounted twice): its first pass leads it,
      // and captures the answer given now.
      s.counters.passedThrough++
      return next()
    }
    const fp = own ? s.fingerprint(req, typeof body === 'string' ? Buffer.from(body, 'utf8') : body) : fingerprintIn(r)
    const capture = new Capture(s, req, res, next, method, cap)
    let outcome
    try {
      outcome = dedup(s, scoped, fp, capture.lead, capture.gone, answerOf)
    } catch (e) {
      return failed(capture, res, next, e)
    }
    if (outcome instanceof Promise) {
      return outcome.then(
        (o) => answer(capture, req, res, scoped, o),
        (e) => failed(capture, res, next, e),
      )
    }
    answer(capture, req, res, scoped, outcome)
  }

  function failed(capture, res, next, e) {
    if (capture.finish) return capture.finish()
    // The client has gone (the response closed unfinished), or the answer began.
    if ((res.closed && !res.writableFinished) || res.headersSent) return
    return next(e)
  }

  function answer(capture, req, res, scoped, outcome) {
    // The handler ran (whatever the store said after): its answer is the one to send.
    if (outcome.led || capture.finish) return capture.finish?.()
    if (outcome.problem) return sendProblem(res, outcome.problem)
    const a = outcome.replay
    // Answered already (the app's own timeout while this request waited; a middleware
    // that ended the response and went on): nothing more may be written.
    if (res.writableEnded) return
    replayed(s, req, scoped)
    // Headers a middleware further out sent early (`flushHeaders()`) cannot be set
    // again: the stored body goes after them.
    if (!res.headersSent) {
      res.statusCode = a.status
      setAnswerHeaders(res, a.fields)
    }
    res.end(a.body)
  }

  /** What the middleware has done so far. */
  handler.counters = () => ({ ...s.counters })
  return handler
}

// ---------------------------------------------------------------------------------------
// The capture of a led answer. `write`, `end` and `writeHead` of Node's ServerResponse are
// wrapped once per process (`hookResponses`); a response under capture is found in
// `capturing` and goes through its Capture, any other goes straight on.
//
// Why not wrappers set on each response: no two Express responses share a hidden class,
// so each property added to one copies its ~50 descriptors, and each read of it is an
// uncached look-up (the wrappers were the largest part of the middleware's own cost on a
// first call). Why not Express's prototypes: an Express sub-app (or another copy of
// Express) sets the response's prototype to its own while it runs, and an answer sent
// there would not be captured (its key released, its retry run again). A response whose
// methods a middleware further out has already wrapped (compression, an envelope) is
// captured above those wrappers, as before: the answer is stored as the handler wrote
// it, and its replay goes through them again (their own content negotiation included).
// ---------------------------------------------------------------------------------------

/** A response's innermost Capture at the prototype (one further out is its `outer`). */
const capturing = new WeakMap()

/** The response methods a capture sees. */
const METHODS = ['write', 'end', 'writeHead']

/** The wrappers `hookResponses` set on ServerResponse.prototype, by name (null: not yet). */
let hooks = null

/**
 * ServerResponse's own methods from before `hookResponses`, by name (`undefined`:
 * inherited, looked up at each call, so that a tool that patches OutgoingMessage's
 * methods later is still called).
 */
const plain = {}

function hookResponses() {
  if (hooks !== null) return
  const P = ServerResponse.prototype
  hooks = {}
  for (const name of METHODS) {
    plain[name] = Object.hasOwn(P, name) ? P[name] : undefined
    hooks[name] = P[name] = function (a, b, c) {
      const capture = capturing.get(this)
      return capture === undefined ? plainCall(name, this, a, b, c) : capture[name](a, b, c)
    }
  }
  // Node's alias of writeHead.
  P.writeHeader = P.writeHead
}

/** Node's own `name` method of `res`, called with up to three arguments. */
function plainCall(name, res, a, b, c) {
  return (plain[name] ?? OutgoingMessage.prototype[name]).call(res, a, b, c)
}

/**
 * Whether `res` is captured with wrappers of its own: its `write`, `end` or `writeHead`
 * is not the one wrapped once per process (a middleware further out set its own, a
 * subclass overrides it, or it is not a Node ServerResponse at all).
 */
function wrappedBefore(res) {
  if (Object.hasOwn(res, 'write') || Object.hasOwn(res, 'end') || Object.hasOwn(res, 'writeHead')) return true
  // Read on the prototype, not on `res`: a prototype keeps its hidden class from request
  // to request, so these reads are cached, where each read on an Express response is an
  // uncached look-up walking its prototype chain (see above). Read at every request: a
  // prototype patched later is seen.
  const proto = Object.getPrototypeOf(res)
  return proto === null || proto.write !== hooks.write || proto.end !== hooks.end || proto.writeHead !== hooks.writeHead
}

/** The handler runs; what it writes is kept. */
const CAPTURING = 0
/** The answer is whole and waits for the store: anything more written is dropped. */
const HOLDING = 1
/** Calls go on as without the capture. */
const PASSING = 2

/**
 * The capture of one covered request's response: `lead(owner)` runs the handler and
 * gives the outcome to store (see `dedup`); `gone()` is asked for only by a request that
 * waits for another.
 */
class Capture {
  constructor(s, req, res, next, method, cap) {
    this.s = s
    this.req = req
    this.res = res
    this.next = next
    this.method = method
    this.cap = cap
    this.state = CAPTURING
    /** The capture of a middleware further out on the same response, if any. */
    this.outer = undefined
    /**
     * The response's own methods a middleware further out set, when this capture wraps
     * them (see `wrappedBefore`): calls go on to them; else to `outer` or Node's.
     */
    this.own = null
    this.owner = null
    this.chunks = []
    this.size = 0
    this.over = false
    /** The client went away while the answer was being sent. */
    this.away = false
    /** The socket's record (see `watchSocket`), and its timeouts when this capture began. */
    this.socketWatch = null
    this.seen = 0
    this.lateSeen = 0
    // The outcome once known: record bytes, or an error (Unstored, Released).
    this.known = false
    this.outcome = undefined
    this.resolve = null
    this.reject = null
    /** Set once the led response has ended: sends it (when it was held), or does nothing. */
    this.finish = null
    this.goneOnce = undefined
    this.lead = (owner) => this.run(owner)
    this.gone = () => (this.goneOnce ??= goneOf(res, 'close', () => res.writableFinished))
  }

  /**
   * Runs the handler (`next()`) as the leader `owner`. Returns the outcome at once when
   * the handler answered within `next()` (the in-process store then settles the key
   * without a Promise), else a Promise of it.
   */
  run(owner) {
    const res = this.res
    // Answered while it waited (a timeout of the app's own ended its response): its
    // handler must not run, since its answer could not be sent and its client will
    // retry. The key is released at once for the next duplicate. Headers sent early (a
    // middleware's `flushHeaders()`) are no answer: the handler runs.
    if (res.writableEnded) throw new Released(owner, 'the request was answered while it waited')
    this.s.counters.led++
    this.owner = owner
    if (wrappedBefore(res)) {
      this.own = {}
      for (const name of METHODS) {
        this.own[name] = res[name]
        res[name] = (a, b, c) => this[name](a, b, c)
      }
      res.writeHeader = res.writeHead
    } else {
      this.outer = capturing.get(res)
      capturing.set(res, this)
    }
    try {
      this.next()
    } catch (e) {
      this.next(e)
    }
    // A client that goes away mid-response (a stream under way): the handler still runs,
    // so it keeps the key until it ends its response; that response is then not stored
    // (it was not sent whole) and the key is released. One that goes away before the
    // answer began leaves the answer, once given, kept as usual. A response cut by the
    // server instead (Express destroys the socket when a handler fails after its headers
    // were sent; a handler may destroy it before answering) means the handler has
    // stopped: the key is released now.
    // Listened for only when the handler has not ended its response within `next()`:
    // 'close' is emitted in a later tick, and an ended response ignores it.
    if (this.state === CAPTURING) {
      res.once('close', () => this.closed())
      this.socketWatch = watchSocket(this.req.socket)
      this.seen = this.socketWatch.fired
      this.lateSeen = this.socketWatch.late
    }
    if (this.known) {
      if (this.outcome instanceof Error) throw this.outcome
      return this.outcome
    }
    return new Promise((resolve, reject) => {
      this.resolve = resolve
      this.reject = reject
    })
  }

  closed() {
    if (this.state !== CAPTURING) return
    if (clientGone(this.req.socket, this.res, this.seen)) {
      if (this.res.headersSent) {
        this.away = true
        this.watchFailure()
      }
      return
    }
    this.release()
    this.s.counters.notStored++
    this.done(new Released(this.owner, 'the response was not sent whole'))
  }

  /**
   * The client went away (or a timeout cut the connection) after the answer began: the
   * key is held until the handler ends its answer. One that stops instead ends nothing:
   * a handler that fails (`next(err)`: Express's final handler, finding the headers sent,
   * destroys the socket, already closed), or a stream torn down (`res.destroy()` from
   * `pipeline`). Such a cut, a late one of the socket (`watchSocket`) or the response's
   * (`whenCut`), before this close or after it, releases the key: the answer can no
   * longer be stored.
   */
  watchFailure() {
    const w = this.socketWatch
    if (w === null) return
    const failed = () => {
      if (this.state !== CAPTURING) return
      this.release()
      this.s.counters.notStored++
      this.done(new Released(this.owner, 'the answer stopped after its client left'))
    }
    if (w.late > this.lateSeen) return failed()
    if (w.onLate === null) w.onLate = []
    w.onLate.push(failed)
    whenCut(this.res, failed)
  }

  done(o) {
    if (this.known) return
    this.known = true
    this.outcome = o
    if (this.resolve === null) return
    if (o instanceof Error) this.reject(o)
    else this.resolve(o)
  }

  /** Stops capturing: later calls go on as without this capture. */
  release() {
    this.state = PASSING
    // Own wrappers stay in place: from now on they pass calls on.
    if (this.own !== null) return
    const res = this.res
    let c = capturing.get(res)
    if (c === this) {
      if (this.outer === undefined) capturing.delete(res)
      else capturing.set(res, this.outer)
      return
    }
    while (c !== undefined && c.outer !== this) c = c.outer
    if (c !== undefined) c.outer = this.outer
  }

  write(chunk, encoding, cb) {
    if (this.state === HOLDING) return true
    if (this.state === CAPTURING) this.keep(chunk, encoding, false)
    return this.pass('write', chunk, encoding, cb)
  }

  end(chunk, encoding, cb) {
    if (this.state === HOLDING) return this.res
    if (this.state === PASSING) return this.pass('end', chunk, encoding, cb)
    if (typeof chunk === 'function') {
      cb = chunk
      chunk = undefined
    } else if (typeof encoding === 'function') {
      cb = encoding
      encoding = undefined
    }
    this.keep(chunk, encoding, true)
    let outcome
    try {
      outcome = this.settle()
    } catch {
      // The core refused to record the answer (a status or header it cannot take): it is
      // not stored, and the key is released.
      this.s.counters.notStored++
      outcome = new Released(this.owner, 'the response could not be recorded')
    }
    if (this.s.settlesAtOnce) {
      // The store settles the key in this tick, before the server reads another
      // request: the response goes out now, as without the middleware.
      this.release()
      this.finish = noop
      try {
        this.pass('end', chunk, encoding, cb)
      } catch (e) {
        // Node refused the answer (an invalid status or header): it was not sent, so
        // it is not stored, and the key is released.
        this.s.counters.notStored++
        this.done(new Released(this.owner, 'the response could not be sent'))
        throw e
      }
    } else {
      this.hold(chunk, encoding, cb)
    }
    this.done(outcome)
    return this.res
  }

  /**
   * Passes a call of the response's method `name` on: to the methods this capture
   * wrapped on the response itself, to the capture further out, or to Node's.
   */
  pass(name, a, b, c) {
    if (this.own !== null) return this.own[name].call(this.res, a, b, c)
    if (this.outer !== undefined) return this.outer[name](a, b, c)
    return plainCall(name, this.res, a, b, c)
  }

  writeHead(status, reason, headers) {
    if (this.state === HOLDING) return this.res
    if (this.state === CAPTURING) {
      if (typeof reason === 'object' && reason !== null) {
        headers = reason
        reason = undefined
      }
      // Headers given to `writeHead` reach `getHeaders()` only when a header was set
      // with `setHeader` before (Node merges them then; else they go straight to the
      // socket): merged here, as Node would.
      if (headers && this.res.getHeaderNames().length === 0) {
        const res = this.res
        if (Array.isArray(headers)) {
          for (let i = 0; i < headers.length; i += 2) res.removeHeader(headers[i])
          for (let i = 0; i < headers.length; i += 2) res.appendHeader(headers[i], headers[i + 1])
        } else {
          for (const [n, v] of Object.entries(headers)) res.setHeader(n, v)
        }
        headers = undefined
      }
    }
    return this.pass('writeHead', status, reason, headers)
  }

  // `last`: the chunk given to `end`, read into the record before `end` returns, so
  // kept without a copy (an answer that is not stored copies its body in `settle`).
  // A chunk given to `write` is copied unless it is new bytes of a string: the caller
  // may reuse its buffer.
  keep(chunk, encoding, last) {
    if (this.over || chunk === undefined || chunk === null) return
    let b
    if (typeof chunk === 'string') {
      b = Buffer.from(chunk, typeof encoding === 'string' ? encoding : 'utf8')
    } else {
      b = Buffer.isBuffer(chunk) ? chunk : Buffer.from(chunk.buffer, chunk.byteOffset, chunk.byteLength)
      if (!last) b = Buffer.from(b)
    }
    this.size += b.length
    if (this.size > this.cap) {
      this.over = true
      this.chunks.length = 0
    } else {
      this.chunks.push(b)
    }
  }

  // The end of the response, held until the store has settled the key (a store that
  // settles later, e.g. a RedisStore): a retry sent once the client has the whole
  // answer finds the key stored or released. Until it is sent, nothing after it (an
  // error handler answering a late `next(err)`, a stray write) may change or replace it.
  hold(chunk, encoding, cb) {
    this.state = HOLDING
    const res = this.res
    const status = res.statusCode
    const reason = res.statusMessage
    const headers = res.getHeaders()
    // Sent later: the handler may reuse its buffer meanwhile.
    if (chunk !== null && typeof chunk === 'object') chunk = Buffer.from(new Uint8Array(chunk.buffer, chunk.byteOffset, chunk.byteLength))
    this.finish = () => {
      this.release()
      if (!res.headersSent) {
        res.statusCode = status
        res.statusMessage = reason
        for (const n of res.getHeaderNames()) if (!(n in headers)) res.removeHeader(n)
        for (const [n, v] of Object.entries(headers)) res.setHeader(n, v)
      }
      this.pass('end', chunk, encoding, cb)
    }
  }

  // What the whole response leaves in the store: record bytes, or the error that tells
  // the store (and its waiters) it is not stored.
  settle() {
    const { s, res, owner } = this
    if (this.away) {
      s.counters.notStored++
      return new Released(owner, 'the response was not sent whole')
    }
    if (this.over) {
      s.counters.notStored++
      return new Released(owner, 'the body is over the cap')
    }
    const headers = res.getHeaders()
    if (isEventStream(s, headers['content-type'])) {
      // Sent as produced; the key was held until its end and is released now.
      s.counters.notStored++
      return new Released(owner, 'an event stream is not stored')
    }
    // Trailers (`res.addTrailers`, which Node keeps as `_trailer`) are sent after the
    // body and are not in the record: the answer is not stored, as in oncely.asgi.
    if (res._trailer) {
      s.counters.notStored++
      return new Released(owner, 'an answer with trailers is not stored')
    }
    const chunks = this.chunks
    const body = chunks.length === 1 ? chunks[0] : Buffer.concat(chunks, this.size)
    const outcome = outcomeOf(s, owner, this.method, res.statusCode, headers, body)
    if (outcome instanceof Unstored) s.counters.notStored++
    return outcome
  }
}

module.exports = { idempotency }
