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
  if (Buffer.isBuffer(req.rawBody)) return req.rawBody
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

  async function middleware(req, res, next) {
    const key = s.readKey(req.method, keyValues(req))
    if (key === null) {
      s.counters.passedThrough++
      return next()
    }
    if (typeof key !== 'string') {
      s.counters.refused++
      return sendProblem(res, key)
    }
    let body
    if (req._body || req.readableEnded) {
      body = parsedBody(req)
    } else {
      if (declaredOver(req.headers, s.requestCap)) {
        s.counters.refused++
        // The body is not read: the connection ends with this answer.
        res.setHeader('connection', 'close')
        return sendProblem(res, tooLarge(s))
      }
      body = await readBody(req, s.requestCap)
      if (body === null) {
        s.counters.refused++
        return sendProblem(res, tooLarge(s))
      }
      req.rawBody = body
      const ct = req.headers['content-type']
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
    }
    const route = String((s.route && s.route(req)) ?? (req.route ? req.baseUrl + req.route.path : req.originalUrl.split('?')[0]))
    const own = s.fingerprint !== undefined
    const r = own
      ? requestOf(s, req, req.method, route, key)
      : requestOf(s, req, req.method, route, key, req.originalUrl, req.headers['content-type'], body)
    if (!Array.isArray(r)) {
      s.counters.refused++
      return sendProblem(res, r)
    }
    const scoped = r[0]
    const fp = own ? s.fingerprint(req, typeof body === 'string' ? Buffer.from(body, 'utf8') : body) : r[1]

    // Asked for only by a request that waits for another.
    let goneOnce
    const gone = () => (goneOnce ??= goneOf(res, 'close', () => res.writableFinished))

    // Set once the led response has ended: sends it (when it was held), or does nothing.
    let finish = null
    // Returns the outcome at once when the handler answered within `next()` (the store
    // then settles the key without a Promise hop), else a Promise of it.
    const lead = (owner) => {
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
      const restore = () => {
        res.write = write
        res.end = end
        res.writeHead = writeHead
      }
      res.writeHead = function (status, reason, headers) {
        if (typeof reason === 'object' && reason !== null) {
          headers = reason
          reason = undefined
        }
        if (headers && !Array.isArray(headers)) {
          for (const [n, v] of Object.entries(headers)) this.setHeader(n, v)
          headers = undefined
        }
        return writeHead.call(this, status, reason, headers)
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
          finish = noop
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
        finish = () => {
          restore()
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
        if (isEventStream(s, res.getHeader('content-type'))) {
          // Sent as produced; the key was held until its end and is released now.
          s.counters.notStored++
          return new Released(owner, 'an event stream is not stored')
        }
        const status = res.statusCode
        const stored = http.storableStatus(status)
        const fields = recordFields(s, res.getHeaders(), stored)
        // What was sent: no body goes with a HEAD answer, a 1xx, 204 or 304.
        const body = bodyless(req.method, status) ? EMPTY : chunks.length === 1 ? chunks[0] : Buffer.concat(chunks, size)
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

    let outcome
    try {
      outcome = await dedup(s, scoped, fp, lead, gone, answerOf)
    } catch (e) {
      if (finish) return finish()
      // The client has gone (the response closed unfinished), or the answer began.
      if ((res.closed && !res.writableFinished) || res.headersSent) return
      return next(e)
    }
    // The handler ran (whatever the store said after): its answer is the one to send.
    if (outcome.led || finish) return finish?.()
    if (outcome.problem) return sendProblem(res, outcome.problem)
    const a = outcome.replay
    replayed(s, req, scoped)
    res.statusCode = a.status
    setAnswerHeaders(res, a.fields)
    res.end(a.body)
  }

  function handler(req, res, next) {
    middleware(req, res, next).catch(next)
  }
  /** What the middleware has done so far. */
  handler.counters = () => ({ ...s.counters })
  return handler
}

module.exports = { idempotency }
