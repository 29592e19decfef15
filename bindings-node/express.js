'use strict'
// oncely/express: the server contract (SPEC §8) as Express 4/5 middleware.

const {
  Unstored,
  Released,
  settings,
  keyValues,
  declaredOver,
  tooLarge,
  recordFields,
  isEventStream,
  storableStatus,
  answerOf,
  setAnswerHeaders,
  requestOf,
  dedup,
  goneOf,
  replayed,
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

const EMPTY = Buffer.alloc(0)

function bodyless(method, status) {
  return method === 'HEAD' || status < 200 || status === 204 || status === 304
}

function sendProblem(res, p) {
  res.statusCode = p.status
  for (const [n, v] of p.headers) res.setHeader(n, v)
  res.end(p.body)
}

/**
 * Express middleware making covered requests idempotent by their Idempotency-Key.
 * See index.d.ts (`oncely/express`) for the options.
 */
function idempotency(options) {
  const s = settings(options)
  const cap = s.config.bodyCap

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
    if (declaredOver(headers, s.requestCap)) {
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
    const r = own
      ? requestOf(s, req, method, route, key)
      : requestOf(s, req, method, route, key, url, req.headers['content-type'], body)
    if (!Array.isArray(r)) {
      s.counters.refused++
      return sendProblem(res, r)
    }
    const scoped = r[0]
    const fp = own ? s.fingerprint(req, typeof body === 'string' ? Buffer.from(body, 'utf8') : body) : r[1]
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
    replayed(s, req, scoped)
    res.statusCode = a.status
    setAnswerHeaders(res, a.fields)
    res.end(a.body)
  }

  /** What the middleware has done so far. */
  handler.counters = () => ({ ...s.counters })
  return handler
}

/**
 * The capture of one covered request's response: `lead(owner)` runs the handler with
 * `res.write`, `res.end` (and, when needed, `res.writeHead`) wrapped, and gives the
 * outcome to store (see `dedup`); `gone()` is asked for only by a request that waits
 * for another.
 */
class Capture {
  constructor(s, req, res, next, method, cap) {
    this.s = s
    this.req = req
    this.res = res
    this.next = next
    this.method = method
    this.cap = cap
    /** Set once the led response has ended: sends it (when it was held), or does nothing. */
    this.finish = null
    this.goneOnce = undefined
    this.lead = (owner) => lead(this, owner)
    this.gone = () => (this.goneOnce ??= goneOf(res, 'close', () => res.writableFinished))
  }
}

/**
 * Runs the handler (`next()`) as the leader `owner`. Returns the outcome at once when
 * the handler answered within `next()` (the in-process store then settles the key
 * without a Promise), else a Promise of it.
 */
function lead(capture, owner) {
  const { s, req, res, next, cap } = capture
  s.counters.led++
  // The outcome once known: record bytes, or an error (Unstored, Released).
  let outcome
  let known = false
  let resolve = null
  let reject = null
  const done = (o) => {
    if (known) return
    known = true
    outcome = o
    if (resolve === null) return
    if (o instanceof Error) reject(o)
    else resolve(o)
  }
  const chunks = []
  let size = 0
  let over = false
  let ended = false
  let away = false
  // `last`: the chunk given to `end`, read into the record before `end` returns, so
  // kept without a copy (an answer that is not stored copies its body in `settle`).
  // A chunk given to `write` is copied unless it is new bytes of a string: the
  // caller may reuse its buffer.
  const keep = (chunk, encoding, last) => {
    if (over || chunk === undefined || chunk === null) return
    let b
    if (typeof chunk === 'string') {
      b = Buffer.from(chunk, typeof encoding === 'string' ? encoding : 'utf8')
    } else {
      b = Buffer.isBuffer(chunk) ? chunk : Buffer.from(chunk.buffer, chunk.byteOffset, chunk.byteLength)
      if (!last) b = Buffer.from(b)
    }
    size += b.length
    if (size > cap) {
      over = true
      chunks.length = 0
    } else {
      chunks.push(b)
    }
  }
  const { write, end, writeHead } = res
  // Headers given to `writeHead` reach `getHeaders()` only once a header was set with
  // `setHeader` (Node merges them then; without one they go straight to the socket).
  // Express sets X-Powered-By on every response unless told not to: then `writeHead`
  // needs no wrapper (each property added to an Express response copies its hidden
  // class: no two share one).
  const headWrapped = res.getHeaderNames().length === 0
  const restore = () => {
    res.write = write
    res.end = end
    if (headWrapped) res.writeHead = writeHead
  }
  if (headWrapped) {
    res.writeHead = function (status, reason, headers) {
      if (typeof reason === 'object' && reason !== null) {
        headers = reason
        reason = undefined
      }
      if (Array.isArray(headers)) {
        for (let i = 0; i < headers.length; i += 2) this.removeHeader(headers[i])
        for (let i = 0; i < headers.length; i += 2) this.appendHeader(headers[i], headers[i + 1])
        headers = undefined
      } else if (headers) {
        for (const [n, v] of Object.entries(headers)) this.setHeader(n, v)
        headers = undefined
      }
      return writeHead.call(this, status, reason, headers)
    }
  }
  res.write = function (chunk, encoding, cb) {
    if (!ended) keep(chunk, encoding)
    return write.call(this, chunk, encoding, cb)
  }
  res.end = function (chunk, encoding, cb) {
    // Ended already (the wrappers stay in place once the answer is out): as without us.
    if (ended) return end.call(this, chunk, encoding, cb)
    if (typeof chunk === 'function') {
      cb = chunk
      chunk = undefined
    } else if (typeof encoding === 'function') {
      cb = encoding
      encoding = undefined
    }
    keep(chunk, encoding, true)
    ended = true
    const outcome = settle()
    if (s.settlesAtOnce) {
      // The store settles the key in this tick, before the server reads another
      // request: the response goes out now, as without the middleware. The wrappers
      // are not taken off: they pass calls through from now on, and each store to a
      // property of an Express response is a slow lookup (every response has a
      // hidden class of its own, so no property access on it is cached).
      capture.finish = noop
      end.call(res, chunk, encoding, cb)
    } else {
      hold(chunk, encoding, cb)
    }
    done(outcome)
    return this
  }
  // The end of the response, held until the store has settled the key (a store
  // that settles later, e.g. a RedisStore): a retry sent once the client has the
  // whole answer finds the key stored or released.
  const hold = (chunk, encoding, cb) => {
    // The response is whole: until it is sent, nothing after it (an error handler
    // answering a late `next(err)`, a stray write) may change or replace it.
    const status = res.statusCode
    const headers = res.getHeaders()
    res.write = () => true
    res.end = function () {
      return this
    }
    res.writeHead = function () {
      return this
    }
    capture.finish = () => {
      res.write = write
      res.end = end
      res.writeHead = writeHead
      if (!res.headersSent) {
        res.statusCode = status
        for (const n of res.getHeaderNames()) if (!(n in headers)) res.removeHeader(n)
        for (const [n, v] of Object.entries(headers)) res.setHeader(n, v)
      }
      end.call(res, chunk, encoding, cb)
    }
  }
  // What the whole response leaves in the store: record bytes, or the error that
  // tells the store (and its waiters) it is not stored.
  const settle = () => {
    if (away) {
      s.counters.notStored++
      return new Released(owner, 'the response was not sent whole')
    }
    if (over) {
      s.counters.notStored++
      return new Released(owner, 'the body is over the cap')
    }
    const headers = res.getHeaders()
    if (isEventStream(s, headers['content-type'])) {
      // Sent as produced; the key was held until its end and is released now.
      s.counters.notStored++
      return new Released(owner, 'an event stream is not stored')
    }
    const status = res.statusCode
    const stored = storableStatus(s, status)
    const fields = recordFields(s, headers, stored)
    // What was sent: no body goes with a HEAD answer, a 1xx, 204 or 304.
    const body = bodyless(capture.method, status) ? EMPTY : chunks.length === 1 ? chunks[0] : Buffer.concat(chunks, size)
    if (stored) return http.encodeRecord(status, fields, body)
    s.counters.notStored++
    // Replayed later by the waiters: not the handler's own buffer.
    return new Unstored(owner, { status, fields, body: Buffer.from(body) })
  }
  try {
    next()
  } catch (e) {
    next(e)
  }
  // A client that goes away mid-response (a stream under way): the handler still
  // runs, so it keeps the key until it ends its response; that response is then not
  // stored (it was not sent whole) and the key is released. One that goes away before
  // the answer began leaves the answer, once given, kept as usual. A response cut by
  // the server instead (Express destroys the socket when a handler fails after its
  // headers were sent; a handler may destroy it before answering) means the handler
  // has stopped: the key is released now.
  // Listened for only when the handler has not ended its response within `next()`:
  // 'close' is emitted in a later tick, and an ended response ignores it.
  if (!ended) {
    res.once('close', () => {
      if (ended) return
      const socket = req.socket
      if (socket && (socket.readableEnded || socket.errored)) {
        if (res.headersSent) away = true
        return
      }
      restore()
      s.counters.notStored++
      done(new Released(owner, 'the response was not sent whole'))
    })
  }
  if (known) {
    if (outcome instanceof Error) throw outcome
    return outcome
  }
  return new Promise((res, rej) => {
    resolve = res
    reject = rej
  })
}

module.exports = { idempotency }
