'use strict'
// oncely/fastify: the server contract (SPEC §8) as a Fastify plugin.

const { Readable, finished } = require('node:stream')
const {
  Unstored,
  Released,
  settings,
  keyValues,
  declaredOver,
  tooLarge,
  storedFields,
  headerObject,
  scopeOf,
  dedup,
  goneOf,
  replayed,
  http,
} = require('./adapter.js')

const STATE = Symbol('oncely.idempotency')

/** Reads a request payload whole, up to `cap` bytes: the bytes, or `null` when over. */
async function readAll(stream, cap) {
  const chunks = []
  let size = 0
  for await (const c of stream) {
    size += c.length
    if (size > cap) {
      stream.resume?.()
      return null
    }
    chunks.push(c)
  }
  return Buffer.concat(chunks, size)
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
    const decision = s.config.readKey(request.method, keyValues(request.raw))
    if (decision.passThrough) {
      s.counters.passedThrough++
      return
    }
    if (decision.problem) {
      s.counters.refused++
      return sendProblem(reply, decision.problem)
    }
    if (declaredOver(request.headers, s.requestCap)) {
      s.counters.refused++
      // The body is not read: the connection ends with this answer.
      reply.header('connection', 'close')
      return sendProblem(reply, tooLarge(s))
    }
    request[STATE] = { key: decision.key, body: Buffer.alloc(0) }
  })

  fastify.addHook('preParsing', async (request, reply, payload) => {
    const st = request[STATE]
    if (!st) return payload
    const body = await readAll(payload, s.requestCap)
    if (body === null) {
      s.counters.refused++
      request[STATE] = undefined
      sendProblem(reply, tooLarge(s))
      return Readable.from([])
    }
    st.body = body
    // The body parsers read the same bytes.
    const again = Readable.from(body.length ? [body] : [])
    again.receivedEncodedLength = body.length
    return again
  })

  fastify.addHook('preHandler', async (request, reply) => {
    const st = request[STATE]
    if (!st || reply.sent) return
    const route = (s.route && s.route(request)) ?? request.routeOptions?.url ?? request.url.split('?')[0]
    const sc = scopeOf(s, request, request.method, String(route), st.key)
    if (sc.problem) {
      s.counters.refused++
      request[STATE] = undefined
      return sendProblem(reply, sc.problem)
    }
    const scoped = sc.scoped
    const fp = s.fingerprint
      ? s.fingerprint(request, st.body)
      : http.requestFingerprint(request.method, request.url, request.headers['content-type'], st.body)

    const gone = goneOf(reply.raw, 'close', () => reply.raw.writableFinished)
    let started
    const leading = new Promise((resolve) => {
      started = resolve
    })
    const lead = (owner) =>
      new Promise((resolve, reject) => {
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
        reply.raw.once('close', () => {
          if (st.streaming) return
          const socket = request.raw.socket
          if (!reply.raw.headersSent && socket && (socket.readableEnded || socket.errored)) return
          st.settle(new Released(owner, 'the response was not sent whole'))
        })
        started('lead')
      })
    st.run = dedup(s, scoped, fp, lead, gone)
    st.run.catch(() => {})
    const first = await Promise.race([leading, st.run])
    if (first === 'lead') return
    request[STATE] = undefined
    if (first.problem) return sendProblem(reply, first.problem)
    const r = first.replay
    replayed(s, request, scoped)
    return reply
      .code(r.status)
      .headers({ ...headerObject(r.headers), [http.REPLAYED_HEADER]: 'true' })
      .send(r.body)
  })

  fastify.addHook('onSend', async (request, reply, payload) => {
    const st = request[STATE]
    if (!st || !st.settle || st.settled) return payload
    let body
    if (payload === null || payload === undefined) body = Buffer.alloc(0)
    else if (Buffer.isBuffer(payload)) body = payload
    else if (typeof payload === 'string') body = Buffer.from(payload, 'utf8')
    const ct = reply.getHeader('content-type')
    const eventStream = ct !== undefined && http.isEventStream(String(ct))
    if (eventStream || body === undefined) {
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
    // What is sent: no body goes with a HEAD answer, a 1xx, 204 or 304.
    const status = reply.statusCode
    if (request.method === 'HEAD' || status < 200 || status === 204 || status === 304) body = Buffer.alloc(0)
    if (body.length > cap) {
      st.settle(new Released(st.owner, 'the body is over the cap'))
    } else {
      const stored = http.storableStatus(reply.statusCode)
      const record = {
        status: reply.statusCode,
        headers: storedFields(s, reply.getHeaders(), stored),
        body,
        trailers: [],
      }
      st.settle(stored ? http.encodeResponse(record) : new Unstored(st.owner, record))
    }
    // The answer is sent once the store has settled the key: a retry sent after it
    // finds the key stored or released.
    await st.run.catch(() => {})
    return payload
  })
}

idempotency[Symbol.for('skip-override')] = true
idempotency[Symbol.for('fastify.display-name')] = 'oncely-idempotency'
idempotency[Symbol.for('plugin-meta')] = { name: 'oncely-idempotency', fastify: '4.x || 5.x' }

module.exports = { idempotency, default: idempotency }
