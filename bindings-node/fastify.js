'use strict'
// oncely/fastify: the server contract (SPEC §8) as a Fastify plugin.

const { Readable, finished } = require('node:stream')
const {
  Released,
  settings,
  keyValues,
  declaredOver,
  tooLarge,
  isEventStream,
  outcomeOf,
  hasContent,
  answerOf,
  requestOf,
  scopeOf,
  scopedIn,
  fingerprintIn,
  dedupAsync,
  goneOf,
  replayed,
  clientGone,
  clientLeft,
  watchSocket,
  hookDestroy,
  http,
} = require('./adapter.js')

const { acting } = require('./lib/store.js')

const STATE = Symbol('oncely.idempotency')
const WATCHED = Symbol('oncely.watched')
const EMPTY = Buffer.alloc(0)
/** The state of a request replaying a record without a content type (see the replay). */
const BARE_REPLAY = Object.freeze({ bare: true })

function noop() {}

/**
 * Reads a request payload whole, up to `cap` bytes: the bytes, or `null` when over (the
 * rest is then read and dropped, not destroyed: destroying the request cuts the socket
 * before the 413 is sent). Listeners, not `for await`: its iterator costs more than the
 * rest of reading a small body.
 */
function readAll(stream, cap) {
  return new Promise((resolve, reject) => {
    const chunks = []
    let size = 0
    let done = false
    const onData = (c) => {
      if (done) return
      size += c.length
      if (size > cap) {
        done = true
        chunks.length = 0
        stream.removeListener('data', onData)
        stream.resume()
        resolve(null)
        return
      }
      chunks.push(c)
    }
    stream.on('data', onData)
    stream.once('end', () => {
      if (done) return
      done = true
      resolve(Buffer.concat(chunks, size))
    })
    stream.on('error', (e) => {
      if (done) return
      done = true
      reject(e)
    })
  })
}

/**
 * The request's bytes again, for the body parsers after this plugin has read them: a
 * Readable with the bytes already pushed. Timed against a PassThrough ended with them
 * (which builds a Writable side too) in one run: ~3 µs less per request. `read` is the
 * stream they came from: the length it received on the wire, when a hook before this
 * plugin decoded it (a gunzip stream sets `receivedEncodedLength`), is kept for
 * Fastify's check against Content-Length.
 */
function bodyStream(body, read) {
  const stream = new Readable({ read: noop })
  if (body.length > 0) stream.push(body)
  stream.push(null)
  stream.receivedEncodedLength = read?.receivedEncodedLength || body.length
  return stream
}

/**
 * `reply.send` of a led request: notes that an answer is on its way (`st.sending`),
 * then sends with the `send` the reply had (Fastify's, or a hook's own wrapper).
 */
function markedSend(payload) {
  const st = this.request[STATE]
  if (st === undefined) return Object.getPrototypeOf(this).send.call(this, payload)
  st.sending = true
  return st.replySend.call(this, payload)
}

/**
 * `reply.then` of a led request (`await reply`, `return reply`: the answer is sent
 * later): notes that the handler's end is no sign that it has answered (`st.deferred`).
 */
function markedThen(fulfilled, rejected) {
  const st = this.request[STATE]
  if (st === undefined) return Object.getPrototypeOf(this).then.call(this, fulfilled, rejected)
  st.deferred = true
  return st.replyThen.call(this, fulfilled, rejected)
}

/**
 * A led handler has ended (its Promise settled with `value`, or `failed`), and every
 * Promise reaction of that turn has run (Fastify's send of its value, a wrapper of the
 * handler's). Fastify sends nothing for a hijacked reply, nor for a handler resolving
 * with nothing once its connection is gone: without this the key would wait for an
 * `onSend` that never comes (a retry would wait for good), or, for an answer written
 * around Fastify, be released while the handler still ran.
 */
function handlerEnded(st, request, reply, value, failed) {
  st.ended = true
  if (st.settled || st.sending) return
  if (reply.sent || reply.raw.headersSent) {
    // Answered around Fastify (hijacked, or written on the raw response): not stored;
    // released once the response has closed (the close listener, or now).
    if (st.closed) st.settle(new Released(st.owner, 'the response was not sent whole'))
    return
  }
  // An answer Fastify sends (a value, an error, or an empty answer on a live
  // connection): onSend settles it.
  if (failed || value !== undefined) return
  const socket = request.raw.socket
  if (socket && !socket.destroyed) return
  // An answer the handler sends later (`await reply`, which resolves once the connection
  // has closed) is kept when it comes, unless the server cut the connection.
  if (st.deferred && clientGone(socket, reply.raw, st.seen)) return
  if (clientLeft(socket, st.seen, reply.raw)) {
    // Fastify did not send the empty answer only because the client has gone: that
    // answer is the handler's, kept as any other answer of a client gone away, so a
    // retry replays it instead of running the handler again.
    st.whole(st, request, reply.statusCode, reply.getHeaders(), EMPTY)
  } else {
    // The connection was cut on the server's side (the handler's `reply.raw.destroy()`,
    // the socket's `destroy`) and the handler ended without an answer: the key is released.
    st.settle(new Released(st.owner, 'the connection was cut before an answer'))
  }
}

/**
 * The route's handler, watched for a led request: `reply.send` notes that an answer
 * is on its way (through hooks that may take time), `reply.then` that it comes later,
 * and a handler that returns a native Promise is seen to end (`handlerEnded`). Another
 * thenable is not watched: its `then` may run the work again (a query builder). Other
 * requests call the handler alone.
 */
function watchHandler(handler) {
  return function watched(request, reply) {
    const st = request[STATE]
    if (st === undefined || st.settle === undefined) return handler.call(this, request, reply)
    st.replySend = reply.send
    st.replyThen = reply.then
    reply.send = markedSend
    // biome-ignore lint/suspicious/noThenProperty: the reply is a thenable (Fastify's own); this keeps it one
    reply.then = markedThen
    const result = handler.call(this, request, reply)
    if (result instanceof Promise) {
      st.watching = true
      // After every reaction of the turn it settles in: Fastify's own (a send of its
      // value or error) may come a few Promises later, through wrappers of the handler.
      result.then(
        (value) => {
          // Before Fastify's reaction: Fastify 4 then sends an empty answer of its own.
          if (value === undefined) st.resolvedEmpty = true
          setImmediate(handlerEnded, st, request, reply, value, false)
        },
        () => setImmediate(handlerEnded, st, request, reply, undefined, true),
      )
    }
    return result
  }
}

/**
 * Fastify's own key for a reply's trailers (`reply.trailer`), found on first use and
 * again for another copy of Fastify (each has a symbol of its own).
 */
let trailersKey

/** Whether the handler gave the reply trailers (`reply.trailer(name, fn)`). */
function hasTrailers(reply) {
  if (trailersKey === undefined || !Object.hasOwn(reply, trailersKey)) {
    trailersKey = Object.getOwnPropertySymbols(reply).find((k) => k.description === 'fastify.reply.trailers')
    if (trailersKey === undefined) return false
  }
  const t = reply[trailersKey]
  if (t === null || t === undefined) return false
  for (const name in t) if (t[name] !== undefined) return true
  return false
}

function sendProblem(reply, p) {
  return reply.code(p.status).headers(Object.fromEntries(p.headers)).send(p.body)
}

/**
 * The Fastify plugin: covered requests of every route (`global: true`, the default) or
 * of the routes with `config: { idempotency: true }` are made idempotent by their
 * Idempotency-Key. A route opts out with `config: { idempotency: false }`.
 */
async function idempotency(fastify, options) {
  const s = settings(options)
  hookDestroy()
  const global = options.global ?? true
  const cap = s.config.bodyCap

  if (!fastify.hasDecorator('idempotencyCounters')) {
    fastify.decorate('idempotencyCounters', () => ({ ...s.counters }))
  }

  const enabled = (request) => {
    const flag = request.routeOptions?.config?.idempotency
    return flag === undefined ? global : flag === true
  }

  fastify.addHook('onRequest', async (request, reply) => {
    if (!enabled(request)) return
    const key = s.readKey(request.method, keyValues(request.raw))
    if (key === null) {
      s.counters.passedThrough++
      return
    }
    if (typeof key !== 'string') {
      s.counters.refused++
      return sendProblem(reply, key)
    }
    if (declaredOver(s, request.headers)) {
      s.counters.refused++
      // The body is not read: the connection ends with this answer.
      reply.header('connection', 'close')
      return sendProblem(reply, tooLarge(s))
    }
    // The async context the request arrived in: the store is called in it from
    // preHandler, which may run in another request's context (a plugin that parks
    // requests and resumes them from inside another request's hooks).
    request[STATE] = { s, key, body: EMPTY, context: acting.getStore(), whole: settleWhole }
  })

  fastify.addHook('preParsing', async (request, reply, payload) => {
    const st = request[STATE]
    // Not this registration's request: the plugin registered again in a context nearer
    // the route has taken it (its onRequest runs later and replaces the state).
    if (!st || st.s !== s) return payload
    // A request Fastify does not read (a GET, HEAD or TRACE; no content type, no
    // transfer coding, a length of 0 or none, over HTTP/1: RFC 9112 §6.3) is left unread too: reading it to its end
    // closes it, which aborts `request.signal` before the handler runs (and clears
    // Fastify 5's `handlerTimeout`). With a content type Fastify's parser reads it (an
    // injected stream has a body with neither header); an HTTP/2 request may carry one.
    const h = request.headers
    const m = request.method
    if (m === 'GET' || m === 'HEAD' || m === 'TRACE') return payload
    if (
      h['content-type'] === undefined &&
      h['transfer-encoding'] === undefined &&
      (h['content-length'] === undefined || h['content-length'] === '0') &&
      request.raw.httpVersionMajor === 1
    ) {
      return payload
    }
    const body = await readAll(payload, s.requestCap)
    if (body === null) {
      s.counters.refused++
      request[STATE] = undefined
      // The rest of the body is not read past this answer: the connection ends with it.
      reply.header('connection', 'close')
      sendProblem(reply, tooLarge(s))
      return bodyStream(EMPTY)
    }
    st.body = body
    // The parsers get a copy: one that changes its chunk in place must not change the
    // bytes the fingerprint is taken from (a retry with another body would be replayed).
    return bodyStream(Buffer.from(body), payload)
  })

  // Callback-style: the leader goes on to the handler from inside the store's call, so
  // the handler runs in its lead's async context (a request it injects with its own key
  // is refused as re-entrant instead of waiting for itself). Any other answer is sent
  // from here and the handler is not reached.
  fastify.addHook('preHandler', (request, reply, done) => {
    const st = request[STATE]
    // `st.run`: led already, and here again for the answer `reply.callNotFound()` sends
    // (the not-found handler's hooks): that answer is this lead's.
    if (!st || st.s !== s || reply.sent || st.run !== undefined) return done()
    const route = String((s.route && s.route(request)) ?? request.routeOptions?.url ?? request.url.split('?')[0])
    const own = s.fingerprint !== undefined
    const r = own
      ? scopeOf(s, request, request.method, route, st.key)
      : requestOf(s, request, request.method, route, st.key, request.url, request.headers['content-type'], st.body)
    if (typeof r !== 'string') {
      s.counters.refused++
      request[STATE] = undefined
      sendProblem(reply, r)
      return
    }
    const scoped = own ? r : scopedIn(r)
    const fp = own ? s.fingerprint(request, st.body) : fingerprintIn(r)

    // Asked for only by a request that waits for another. While it waits, an answer the
    // app sends itself (its own timeout) is noted as it starts: it may spend a while in
    // async onSend hooks before `reply.sent`, and nothing else may be sent meanwhile.
    let goneOnce
    let answeredAside = false
    let plainSend
    const gone = () => {
      if (goneOnce === undefined) {
        const send = (plainSend = reply.send)
        reply.send = function sendAside(payload) {
          answeredAside = true
          return send.call(this, payload)
        }
        goneOnce = goneOf(reply.raw, 'close', () => reply.raw.writableFinished)
      }
      return goneOnce
    }
    /** The reply's `send` as it was before this request waited (see `gone`). */
    const unwatchSend = () => {
      if (plainSend !== undefined) reply.send = plainSend
    }
    let led = false
    const lead = (owner) =>
      new Promise((resolve, reject) => {
        if (reply.sent || answeredAside) {
          // Answered while it waited (a timeout of the app's own): Fastify would not go on
          // to the handler, and nothing would settle the key. Released at once: the next
          // duplicate leads.
          led = true
          reject(new Released(owner, 'the request was answered while it waited'))
          return
        }
        unwatchSend()
        s.counters.led++
        st.owner = owner
        st.settle = (outcome) => {
          if (st.settled) return
          st.settled = true
          if (outcome instanceof Error) {
            s.counters.notStored++
            reject(outcome)
          } else {
            resolve(outcome)
          }
        }
        // As in oncely/express: a client gone before the answer began leaves the handler
        // running, and its answer is settled in onSend as usual. A response closed and not
        // settled in onSend otherwise was cut by the server (a handler that destroys the
        // connection), or written on the raw response around Fastify (`reply.hijack()`):
        // it is not stored, and the key is released.
        // Every answered response closes too: one settled already makes no Released (an
        // Error, whose stack trace cost ~20 µs per first call, profiled).
        reply.raw.once('close', () => {
          st.closed = true
          if (st.streaming || st.settled) return
          // A watched handler still running decides when it ends (`handlerEnded`): it may
          // still be answering around Fastify, or send an answer to keep.
          if (st.watching && !st.ended && !st.sending) return
          // Held while the handler may still answer through Fastify: it runs, or its
          // answer is on its way (`reply.send` called, in the hooks). A handler known to
          // have ended without either (see `watchHandler`) answered around Fastify.
          if (!reply.raw.headersSent && clientGone(request.raw.socket, reply.raw, st.seen) && !(st.ended && !st.sending && !st.deferred)) return
          st.settle(new Released(owner, 'the response was not sent whole'))
        })
        // Not an HTTP/2 stream: its `socket` is a proxy of the session's, one per stream.
        if (request.raw.stream === undefined) st.seen = watchSocket(request.raw.socket).fired
        led = true
        // In a microtask (which keeps the async context): `st.run`, which onSend waits
        // for, is set once the store's call has returned.
        queueMicrotask(done)
      })
    st.run = acting.run(st.context, dedupAsync, s, scoped, fp, lead, gone, answerOf)
    st.run.then(
      (first) => {
        if (led) return
        request[STATE] = undefined
        // Answered while it waited (see `lead`): nothing more to send.
        if (reply.sent || answeredAside) return
        unwatchSend()
        if (first.problem) return sendProblem(reply, first.problem)
        const a = first.replay
        replayed(s, request, scoped)
        // Grouped by name: Fastify's `header` replaces a value (and appends a set-cookie).
        const headers = {}
        const fields = a.fields
        for (let i = 0; i < fields.length; i += 2) {
          const name = fields[i]
          const v = fields[i + 1]
          headers[name] = headers[name] === undefined ? v : [].concat(headers[name], v)
        }
        headers[http.REPLAYED_HEADER] = 'true'
        // Fastify gives a Buffer payload a content type of its own when it has none;
        // the record's answer had none (an empty body): onSend takes it off again.
        if (headers['content-type'] === undefined) request[STATE] = BARE_REPLAY
        // An answer without content goes without a payload: Fastify then declares no
        // length (an empty Buffer would be `content-length: 0`, which to a HEAD says its
        // GET's body is empty), except on its automatic HEAD route of a GET, whose own
        // hook still says 0 (a known limit, SPEC §8).
        reply
          .code(a.status)
          .headers(headers)
          .send(a.body.length === 0 && !hasContent(request.method, a.status) ? undefined : a.body)
      },
      (e) => {
        if (!led && !reply.sent && !answeredAside) done(e)
      },
    )
  })

  /** Settles a whole answer of this plugin's request: its record, or why it is not stored. */
  function settleWhole(st, request, status, headers, body) {
    // The cap weighs the body as sent (none to a HEAD, a 1xx, 204 or 304).
    if (hasContent(request.method, status) && body.length > cap) {
      st.settle(new Released(st.owner, 'the body is over the cap'))
    } else {
      st.settle(outcomeOf(s, st.owner, request.method, status, headers, body))
    }
  }

  // Routes registered after the plugin (in its context and those under it) have their
  // handler watched; earlier ones keep the close rule alone.
  fastify.addHook('onRoute', (route) => {
    if (typeof route.handler === 'function' && !route.handler[WATCHED]) {
      route.handler = watchHandler(route.handler)
      route.handler[WATCHED] = true
    }
  })

  fastify.addHook('onSend', async (request, reply, payload) => {
    const st = request[STATE]
    if (st === BARE_REPLAY) {
      reply.removeHeader('content-type')
      return payload
    }
    if (!st || st.s !== s || !st.settle) return payload
    // A send while this answer waits for the store below: `reply.sent` is still false,
    // so Fastify sends again when an async handler that called `reply.send` resolves
    // with undefined (or with a value, or rejects). That send is dropped (its hooks never
    // go on), as Fastify drops one once the answer is out; a fresh Promise each time, so
    // nothing keeps it.
    if (st.holding) {
      st.dropped = true
      return new Promise(noop)
    }
    if (st.settled) return payload
    const socket = request.raw.socket
    // An empty answer of Fastify's own (Fastify 4, the handler resolved with nothing) is
    // kept only when the client surely left (not after a kept timeout's unknown cut).
    const empty = st.resolvedEmpty && (payload === undefined || payload === null || payload.length === 0)
    if (socket && socket.destroyed && !(empty ? clientLeft(socket, st.seen, reply.raw) : clientGone(socket, reply.raw, st.seen))) {
      // The server cut the connection before this answer (the handler's own cut, after
      // which Fastify 4 sends an empty answer): it stopped, and the key is released.
      st.settle(new Released(st.owner, 'the connection was cut before the answer'))
      return payload
    }
    let body
    if (payload === null || payload === undefined) body = EMPTY
    else if (Buffer.isBuffer(payload)) body = payload
    else if (typeof payload === 'string') body = Buffer.from(payload, 'utf8')
    const eventStream = isEventStream(s, reply.getHeader('content-type'))
    // An answer with trailers (`reply.trailer`, computed after the body) is sent as it
    // comes and not stored, as a stream: the record would replay it without them.
    if (eventStream || body === undefined || hasTrailers(reply)) {
      // A stream or an event stream is sent as it comes and not stored; the key is
      // released once it ends. A Node stream keeps it until its producer has stopped
      // (Fastify destroys it when the client goes away; it closes once its producer has
      // finished): the handler's work may still run after the client has gone.
      const release = () => st.settle(new Released(st.owner, 'a streamed body is not stored'))
      st.streaming = true
      if (payload !== null && typeof payload === 'object' && typeof payload.pipe === 'function') {
        finished(payload, release)
      } else {
        reply.raw.once('finish', release)
        reply.raw.once('close', release)
      }
      return payload
    }
    const status = reply.statusCode
    // Fastify sends a 1xx or 204 that has a payload without its content type and length
    // (and without the payload): taken off here first, so that the record holds the
    // answer as sent and its replay (sent with no payload) has no content type either.
    if (payload !== null && payload !== undefined && ((status >= 100 && status < 200) || status === 204)) {
      reply.removeHeader('content-type')
      reply.removeHeader('content-length')
    }
    const headers = reply.getHeaders()
    st.whole(st, request, status, headers, body)
    // The answer is sent once the store has settled the key: a retry sent after it
    // finds the key stored or released.
    st.holding = true
    await st.run.catch(noop)
    st.holding = false
    if (st.dropped) {
      // The error handler of a handler that threw after `reply.send` set its own status
      // and headers meanwhile: the answer sent is the one settled.
      for (const name in reply.getHeaders()) reply.removeHeader(name)
      reply.code(status).headers(headers)
    }
    return payload
  })
}

idempotency[Symbol.for('skip-override')] = true
idempotency[Symbol.for('fastify.display-name')] = 'oncely-idempotency'
idempotency[Symbol.for('plugin-meta')] = { name: 'oncely-idempotency', fastify: '4.x || 5.x' }

module.exports = { idempotency, default: idempotency }
