'use strict'
// The unit-level cases of tests/vectors/http_server.json (the server contract, SPEC §8)
// through `oncely.http`: the same answers as the Rust and Python suites.
const test = require('node:test')
const assert = require('node:assert/strict')
const fs = require('node:fs')
const path = require('node:path')

const { http, Code } = require('oncely')

const cases = JSON.parse(
  fs.readFileSync(path.join(__dirname, '..', '..', 'tests', 'vectors', 'http_server.json'), 'utf8'),
)
const bodyOf = (c) => (c.body_hex !== undefined ? Buffer.from(c.body_hex, 'hex') : Buffer.from(c.body, 'utf8'))
const errorSource = (e) => ({ kind: e.kind, field: e.field, retryAfterMs: e.retry_after_ms, message: 'from the vectors' })
const config = (c) =>
  new http.HttpConfig({
    methods: c.methods ?? undefined,
    grpcMethods: c.grpc_methods ?? undefined,
    storedHeaders: c.stored_headers ?? undefined,
    required: c.required,
  })

const run = {
  covers: (c) => assert.equal(config(c).covers(c.method), c.covered),
  covers_grpc: (c) => assert.equal(config(c).coversGrpc(c.full_method), c.covered),
  read_key: (c) => {
    const d = config(c).readKey(c.method, c.values)
    if (c.expect.pass_through) {
      assert.deepEqual(d, { passThrough: true })
    } else if (c.expect.dedup) {
      assert.deepEqual(d, { passThrough: false, key: c.expect.dedup })
    } else {
      assert.equal(d.passThrough, false)
      assert.equal(d.key, undefined)
      assert.equal(d.problem.status, c.expect.problem.status)
      assert.equal(d.problem.type, c.expect.problem.type)
      assert.equal(d.problem.code, c.expect.problem.code)
    }
  },
  scope: (c) => assert.equal(http.scope(c.tenant, c.method, c.route, c.key), c.scoped),
  fingerprint: (c) => {
    assert.equal(http.requestFingerprint(c.method, c.target, c.content_type, bodyOf(c)), c.fingerprint)
    if (c.body !== undefined) {
      assert.equal(http.requestFingerprint(c.method, c.target, c.content_type, c.body), c.fingerprint)
    }
  },
  status: (c) => assert.equal(http.storableStatus(c.status), c.storable),
  header: (c) => {
    assert.equal(config(c).storesHeader(c.name), c.stored)
    assert.equal(config(c).sharesHeader(c.name), c.shared)
  },
  record: (c) => {
    const field = ([name, value]) => ({ name, value: Buffer.from(value, 'utf8') })
    const response = {
      status: c.response.status,
      headers: c.response.headers.map(field),
      body: Buffer.from(c.response.body_hex, 'hex'),
      trailers: c.response.trailers.map(field),
    }
    assert.equal(http.encodeResponse(response).toString('hex'), c.hex)
    assert.deepEqual(http.decodeResponse(Buffer.from(c.hex, 'hex')), response)
  },
  record_decode: (c) => {
    assert.throws(() => http.decodeResponse(Buffer.from(c.hex, 'hex')), (e) => e.code === Code[c.error] || e.code === c.error)
  },
  problem: (c) => {
    const p = http.problem(errorSource(c.error))
    assert.equal(p.status, c.status)
    assert.equal(p.type, c.type)
    assert.equal(p.code, c.code)
    assert.deepEqual(Object.fromEntries(p.headers), c.headers)
    const body = JSON.parse(p.body.toString('utf8'))
    assert.deepEqual(Object.keys(body).sort(), ['code', 'detail', 'status', 'title', 'type'])
    assert.equal(body.type, c.type)
    assert.equal(body.status, c.status)
    assert.equal(body.code, c.code)
  },
  grpc_problem: (c) => {
    const m = Object.fromEntries(http.problem(errorSource(c.error)).grpcMetadata)
    assert.equal(m['grpc-status'], c.grpc_status)
    assert.equal(m['grpc-retry-pushback-ms'], c.grpc_retry_pushback_ms ?? undefined)
  },
  grpc_status: (c) => assert.equal(http.storableGrpcStatus(c.value), c.storable),
  is_grpc: (c) => assert.equal(http.isGrpc(c.content_type), c.grpc),
  is_event_stream: (c) => assert.equal(http.isEventStream(c.content_type), c.event_stream),
}

test('http_server.json: every unit-level case', () => {
  let n = 0
  for (const [i, c] of cases.entries()) {
    if (c.op === 'sequence') continue
    const f = run[c.op]
    assert.ok(f, `case ${i}: unknown op ${c.op}`)
    try {
      f(c)
    } catch (e) {
      e.message = `case ${i} (${c.op}${c.comment ? `: ${c.comment}` : ''}): ${e.message}`
      throw e
    }
    n++
  }
  assert.ok(n > 100, `only ${n} unit cases ran`)
})

test('an error thrown by a store maps to its problem', () => {
  const p = http.problem({ kind: 'in_progress', retryAfterMs: 1500 })
  assert.deepEqual(p.headers, [['content-type', 'application/problem+json'], ['retry-after', '2']])
  assert.throws(() => http.problem({ kind: 'nonsense' }), /not an error kind/)
  assert.equal(http.problem({ kind: 'request_too_large', message: '100' }).status, 413)
  const t = http.problem({ kind: 'tenant_unusable', message: 'empty' })
  assert.equal(t.status, 500)
  assert.equal(t.type, 'urn:oncely:problem:tenant-unusable')
  assert.equal(t.code, 'INTERNAL')
})

test('bad settings and records are refused by the core', () => {
  assert.throws(() => new http.HttpConfig({ methods: ['PO ST'] }), { code: 'INVALID_ARGUMENT' })
  assert.throws(() => new http.HttpConfig({ storedHeaders: [''] }), { code: 'INVALID_ARGUMENT' })
  assert.throws(() => http.encodeResponse({ status: 70, headers: [], body: Buffer.alloc(0) }), { code: 'INVALID_ARGUMENT' })
  assert.throws(() => http.scope('t', 'POST', '/x', 'bad key!'), { code: 'INVALID_ARGUMENT' })
})
