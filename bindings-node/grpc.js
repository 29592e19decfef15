'use strict'
// oncely/grpc: the server contract (SPEC §8) for @grpc/grpc-js unary handlers. The
// record of an answer is the one the tower adapter stores for gRPC: content-type
// application/grpc, the length-prefixed message as the body, grpc-status and
// grpc-message as trailers.

const { Unstored, Released, settings, requestOf, scopeOf, scopedIn, fingerprintIn, dedupAsync, goneOf, replayed, takeOnce, http } = require('./adapter.js')

// A cancelled call leaves its handler running: the key stays held until the handler
// answers, and that answer is kept as usual, so a retry does not run the handler again.

const OK = 0
const UNKNOWN = 2

function frame(message) {
  const head = Buffer.alloc(5)
  head.writeUInt32BE(message.length, 1)
  return Buffer.concat([head, message])
}

function unframe(body) {
  return body.length >= 5 ? body.subarray(5, 5 + body.readUInt32BE(1)) : Buffer.alloc(0)
}

// Trailers the record writes itself, or that a replay adds.
const OWN = new Set(['grpc-status', 'grpc-message', http.REPLAYED_HEADER])

/**
 * Appends the trailing metadata the handler gave (with its answer or its error), kept with
 * the answer, to `out` as `name, value` (the values as bytes).
 */
function pushTrailers(out, md) {
  if (!md || typeof md.toJSON !== 'function') return out
  for (const [name, values] of Object.entries(md.toJSON())) {
    const n = name.toLowerCase()
    if (OWN.has(n)) continue
    for (const v of values) out.push(n, Buffer.isBuffer(v) ? v : Buffer.from(String(v), 'utf8'))
  }
  return out
}

/**
 * Fields given flat (`name, value, ...`, the values bytes or Latin-1 strings) as
 * `{ name, value }` objects, the values Buffers: the answer form of this adapter.
 */
function fieldObjects(flat) {
  const out = []
  for (let i = 0; i < flat.length; i += 2) {
    const v = flat[i + 1]
    out.push({ name: flat[i], value: typeof v === 'string' ? Buffer.from(v, 'latin1') : v })
  }
  return out
}

/** The headers of every gRPC record, flat. */
const GRPC_HEADERS = ['content-type', 'application/grpc']

/** `grpc-message` as sent on the wire (and stored by every adapter): percent-encoded UTF-8. */
function percentEncode(text) {
  const parts = []
  for (const b of Buffer.from(String(text), 'utf8')) {
    parts.push(b >= 0x20 && b <= 0x7e && b !== 0x25 ? String.fromCharCode(b) : `%${b.toString(16).toUpperCase().padStart(2, '0')}`)
  }
  return Buffer.from(parts.join(''), 'latin1')
}

function percentDecode(raw) {
  const out = []
  for (let i = 0; i < raw.length; i++) {
    const hex = raw[i] === 0x25 && i + 2 < raw.length ? raw.subarray(i + 1, i + 3).toString('latin1') : ''
    if (/^[0-9a-fA-F]{2}$/.test(hex)) {
      out.push(parseInt(hex, 16))
      i += 2
    } else {
      out.push(raw[i])
    }
  }
  return Buffer.from(out).toString('utf8')
}

/**
 * Wraps the unary handlers of `implementation` (for `service`, a grpc-js service
 * definition) so that a call with `x-idempotency-key` metadata runs once per key: a
 * retry gets the first answer again, with `idempotent-replayed: true` in its trailing
 * metadata. Streaming methods pass through unchanged. `options` are the HTTP adapters'
 * (`store` required); `tenant` gets the call.
 */
function withIdempotency(service, implementation, options) {
  if (service === null || typeof service !== 'object') throw new TypeError('service must be a grpc-js service definition')
  if (implementation === null || typeof implementation !== 'object') throw new TypeError('implementation must be an object of handlers')
  const s = settings(options)
  // `readGrpcKey` as a plain function: no class-method dispatch, no decision object.
  s.readGrpcKey = s.config.grpcKeyReader()
  const grpc = options.grpc ?? require('@grpc/grpc-js')
  // grpc-js looks a handler up by the method's name, then by its `originalName` (a
  // proto-loader service names `CreateOrder` what the implementation calls
  // `createOrder`), and calls it bound to the implementation: the handlers are found the
  // same way, on an instance's prototype too, and keep their `this`.
  const out = {}
  for (const [name, def] of Object.entries(service)) {
    let handler = implementation[name]
    if (handler === undefined && typeof def?.originalName === 'string') handler = implementation[def.originalName]
    if (typeof handler !== 'function') continue
    if (def.requestStream || def.responseStream) {
      out[name] = handler.bind(implementation)
      continue
    }
    // The request is fingerprinted as serialized, the answer stored as serialized and a
    // replay read back from it: a definition without a codec could answer once and never
    // replay (a server-only definition needs no responseDeserialize for grpc-js).
    for (const fn of ['requestSerialize', 'responseSerialize', 'responseDeserialize']) {
      if (typeof def?.[fn] !== 'function') {
        throw new TypeError(`oncely/grpc: ${name} has no ${fn}: the stored answer could not be replayed (give the full service definition)`)
      }
    }
    out[name] = wrap(s, grpc, def, handler, implementation)
  }
  return out
}

/**
 * Stored record bytes as the answer form of this adapter (that of its Unstored records):
 * read with `http.decodeRecord` (one flat array, no object per field), the body a view
 * of the record.
 */
function decodeRecord(bytes) {
  const record = Buffer.isBuffer(bytes) ? bytes : Buffer.from(bytes)
  const flat = http.decodeRecord(record)
  const headers = []
  const trailers = []
  for (let i = 4; i < flat.length; i += 2) {
    const f = { name: flat[i], value: Buffer.from(flat[i + 1], 'latin1') }
    if (i < 4 + 2 * flat[3]) headers.push(f)
    else trailers.push(f)
  }
  return { status: flat[0], headers, body: record.subarray(flat[1], flat[2]), trailers }
}

function trailer(grpc, extra) {
  const m = new grpc.Metadata()
  for (const [n, v] of extra) m.set(n, v)
  return m
}

/**
 * The status grpc-js sends for an error given to a unary callback (its
 * `serverErrorToStatus`): the code when it is an integer other than OK (else UNKNOWN), the details
 * when they are a string (else the message, else 'Unknown Error'), and the trailers given
 * with the error, else the error's own. Anything thrown or passed that is not an object
 * is UNKNOWN with its text (grpc-js itself would fail on it).
 */
function statusOf(grpc, err, trailerMd) {
  let status
  if (err === null || (typeof err !== 'object' && typeof err !== 'function')) {
    status = { code: UNKNOWN, details: String(err), metadata: trailerMd ?? null }
  } else {
    status = { code: UNKNOWN, details: 'message' in err ? err.message : 'Unknown Error', metadata: trailerMd ?? err.metadata ?? null }
    // An error that says OK is still an error: grpc-js would end the call OK with no
    // message (which its client reads as UNIMPLEMENTED), and it would be stored as a
    // success that a replay reads as an empty message. UNKNOWN instead, not stored.
    if ('code' in err && typeof err.code === 'number' && Number.isInteger(err.code)) {
      if (err.code !== OK) status.code = err.code
      if ('details' in err && typeof err.details === 'string') status.details = err.details
    }
  }
  return sendable(grpc, status)
}

/**
 * `status` as grpc-js can send it, so that what is stored is what is sent: details that
 * are not well-formed Unicode (a lone surrogate, which grpc-js's percent-encoding throws
 * on) get U+FFFD in its place, and trailers that are not a `grpc.Metadata` (on which
 * grpc-js throws) make the answer UNKNOWN.
 */
function sendable(grpc, status) {
  if (typeof status.details !== 'string') status.details = String(status.details)
  status.details = status.details.toWellFormed()
  if (status.metadata !== null && status.metadata !== undefined && !(status.metadata instanceof grpc.Metadata)) {
    return { code: UNKNOWN, details: 'the trailing metadata given is not a grpc.Metadata', metadata: null }
  }
  return status
}

function wrap(s, grpc, def, handler, implementation) {
  const path = def.path
  return function idempotentUnary(call, callback) {
    const key = s.readGrpcKey(path, call.metadata.get(http.GRPC_KEY_METADATA))
    if (key === null) {
      s.counters.passedThrough++
      return handler.call(implementation, call, callback)
    }
    const refuse = (p) => {
      s.counters.refused++
      const m = Object.fromEntries(p.grpcMetadata)
      const md = trailer(grpc, m['grpc-retry-pushback-ms'] ? [['grpc-retry-pushback-ms', m['grpc-retry-pushback-ms']]] : [])
      callback({ code: Number(m['grpc-status']), details: p.detail, metadata: md })
    }
    if (typeof key !== 'string') return refuse(key)
    const message = def.requestSerialize(call.request)
    // The scoped key and the fingerprint in one call into the core; the fingerprint over
    // the framed message, as every adapter computes it (SPEC §8).
    const r = s.fingerprint ? scopeOf(s, call, 'POST', path, key) : requestOf(s, call, 'POST', path, key, path, 'application/grpc', frame(message))
    if (typeof r !== 'string') return refuse(r)
    const scoped = s.fingerprint ? r : scopedIn(r)
    if (!takeOnce(call, s.store, scoped)) {
      // Wrapped twice with one store: the outer wrapper leads this call.
      s.counters.passedThrough++
      return handler.call(implementation, call, callback)
    }
    const fp = s.fingerprint ? s.fingerprint(call, message) : fingerprintIn(r)

    let cancelled = false
    call.once('cancelled', () => {
      cancelled = true
    })
    // Asked for only by a call that waits for another.
    let goneOnce
    const gone = () => (goneOnce ??= goneOf(call, 'cancelled'))
    // The answer is sent once the store has settled the key (see oncely/express).
    let finish = null
    const lead = (owner) =>
      new Promise((resolve, reject) => {
        s.counters.led++
        const answer = (err, value, trailerMd, flags) => {
          if (finish) return
          let code = OK
          let detail = ''
          let body = Buffer.alloc(0)
          let trailerSource = trailerMd
          const bad = !err && trailerMd !== null && trailerMd !== undefined && !(trailerMd instanceof grpc.Metadata)
          if (err || bad) {
            // The status grpc-js would send, sent as it is and stored as it is.
            const status = bad ? sendable(grpc, { code: OK, details: '', metadata: trailerMd }) : statusOf(grpc, err, trailerMd)
            code = status.code
            detail = status.details
            trailerSource = status.metadata
            if (status.metadata instanceof grpc.Metadata) status.metadata = status.metadata.clone()
            finish = () => callback(status)
          } else {
            let message
            try {
              message = def.responseSerialize(value)
            } catch (e) {
              s.counters.notStored++
              finish = () => callback({ code: 13, details: `Error serializing response: ${e?.message ?? e}` })
              return reject(new Released(owner, 'the response could not be serialized'))
            }
            body = frame(message)
            // Sent as a replay sends it, read back from the bytes stored: the handler may
            // change its value after answering, and a codec that loses something on the
            // way back (proto-loader's `longs: Number`) must lose it for the first
            // caller too, or a retry would get another answer.
            // A codec that cannot read its own bytes back (one that checks what it reads,
            // not what it writes): the first caller gets the handler's value, and the
            // answer is stored all the same, since the handler has run.
            let sent = value
            try {
              sent = def.responseDeserialize(message)
            } catch {}
            // Sent as they were when answered, as they are stored.
            const md = trailerMd instanceof grpc.Metadata ? trailerMd.clone() : trailerMd
            finish = () => callback(null, sent, md, flags)
          }
          // The trailers flat, `name, value, ...` (the form `http.encodeRecord` takes).
          const trailers = ['grpc-status', String(code)]
          if (detail) trailers.push('grpc-message', percentEncode(detail))
          pushTrailers(trailers, trailerSource)
          if (http.storableGrpcStatus(String(code)) && body.length <= s.config.bodyCap) {
            return resolve(http.encodeRecord(200, GRPC_HEADERS, body, trailers))
          }
          // Not stored (a status that is not final, or a body over the cap): the key is
          // released, and the duplicates waiting now get this answer.
          s.counters.notStored++
          reject(new Unstored(owner, { status: 200, headers: fieldObjects(GRPC_HEADERS), body, trailers: fieldObjects(trailers) }))
        }
        try {
          const r = handler.call(implementation, call, answer)
          if (r && typeof r.then === 'function') r.then(undefined, (e) => answer(e))
        } catch (e) {
          answer(e)
        }
      })

    dedupAsync(s, scoped, fp, lead, gone, decodeRecord).then(
      (outcome) => {
        // The handler ran (whatever the store said after): its answer is the one to send.
        if (outcome.led || finish) return finish?.()
        if (outcome.problem) return refuse(outcome.problem)
        const r = outcome.replay
        replayed(s, call, scoped)
        const t = Object.fromEntries([...r.headers, ...r.trailers].map((f) => [f.name, f.value]))
        const md = new grpc.Metadata()
        for (const { name, value } of r.trailers) {
          if (!OWN.has(name)) md.add(name, name.endsWith('-bin') ? value : value.toString('utf8'))
        }
        md.set(http.REPLAYED_HEADER, 'true')
        const code = Number(t['grpc-status']?.toString('latin1') ?? OK)
        if (code !== OK) {
          return callback({ code, details: percentDecode(t['grpc-message'] ?? Buffer.alloc(0)), metadata: md })
        }
        let value
        try {
          value = def.responseDeserialize(unframe(r.body))
        } catch (e) {
          // The codec refuses what it wrote: a fault of the server that a retry cannot mend.
          return callback({ code: 13, details: `the stored response cannot be read: ${e?.message ?? e}` })
        }
        callback(null, value, md)
      },
      (e) => {
        if (finish) return finish()
        if (cancelled) return
        callback({ code: UNKNOWN, details: String(e?.message ?? e) })
      },
    ).catch((e) => {
      // Sending the answer threw (grpc-js refused what it was given): the call ends with
      // INTERNAL instead of staying open, and the process goes on.
      try {
        callback({ code: 13, details: `the answer could not be sent: ${e?.message ?? e}` })
      } catch {}
    })
  }
}

module.exports = { withIdempotency }
