'use strict'
// The unit-level cases of tests/vectors/http_server.json (the server contract, SPEC §8)
// through `oncely.http`: the same answers as the Rust and Python suites.
const test = require('node:test')
const native = require('../native.js')
const assert = require('node:assert/strict')
const fs = require('node:fs')
const path = require('node:path')

const { once } = require('node:events')
const { http, Code, IdempotencyStore } = require('oncely')

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
    // The hot-path form: null, the key, or the problem.
    const fast = config(c).keyReader()(c.method, c.values)
    if (c.expect.pass_through) assert.equal(fast, null)
    else if (c.expect.dedup) assert.equal(fast, c.expect.dedup)
    else assert.deepEqual([fast.status, fast.type, fast.code], [c.expect.problem.status, c.expect.problem.type, c.expect.problem.code])
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
  scope: (c) => {
    assert.equal(http.scope(c.tenant, c.method, c.route, c.key), c.scoped)
    assert.deepEqual(http.request(c.tenant, c.method, c.route, c.key), [c.scoped])
    // The adapters' one-string form: the scoped key alone without a target.
    assert.equal(native.httpRequestText(c.tenant, c.method, c.route, c.key), c.scoped)
  },
  fingerprint: (c) => {
    assert.equal(http.requestFingerprint(c.method, c.target, c.content_type, bodyOf(c)), c.fingerprint)
    const [, fp] = http.request('t', c.method, '/r', 'order-0001', c.target, c.content_type, bodyOf(c))
    assert.equal(fp, c.fingerprint)
    // The adapters' one-string form: the fingerprint, then the scoped key.
    const text = native.httpRequestText('t', c.method, '/r', 'order-0001', c.target, c.content_type, bodyOf(c))
    assert.equal(text, fp + http.request('t', c.method, '/r', 'order-0001')[0])
    if (c.body !== undefined) {
      assert.equal(http.requestFingerprint(c.method, c.target, c.content_type, c.body), c.fingerprint)
    }
  },
  status: (c) => assert.equal(http.storableStatus(c.status), c.storable),
  content: (c) => assert.equal(http.hasContent(c.method, c.status), c.has_content),
  declared_length: (c) => {
    const config = new http.HttpConfig({ requestCap: c.request_cap })
    assert.equal(config.declaresTooLarge(c.value), c.too_large)
    assert.equal(config.requestCap, c.request_cap)
  },
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
    // The flat forms: header values as Latin-1 strings, the body a view of the record.
    const latin1 = ([name, value]) => [name, Buffer.from(value, 'utf8').toString('latin1')]
    const fields = c.response.headers.flatMap(latin1)
    const trailers = c.response.trailers.flatMap(latin1)
    if (trailers.length === 0) {
      assert.equal(http.encodeRecord(c.response.status, fields, response.body).toString('hex'), c.hex)
    }
    assert.equal(http.encodeRecord(c.response.status, fields, response.body, trailers).toString('hex'), c.hex)
    // The adapters' one-string form of the fields: each name and value ended by a newline.
    const text = fields.map((f) => `${f}\n`).join('')
    assert.equal(http.encodeRecord(c.response.status, text, response.body, trailers).toString('hex'), c.hex)
    const record = Buffer.from(c.hex, 'hex')
    const flat = http.decodeRecord(record)
    assert.deepEqual(flat.slice(0, 1), [c.response.status])
    assert.deepEqual(record.subarray(flat[1], flat[2]), response.body)
    assert.equal(flat[3], c.response.headers.length)
    assert.deepEqual(flat.slice(4), [...fields, ...c.response.trailers.flatMap(latin1)])
  },
  record_decode: (c) => {
    assert.throws(() => http.decodeResponse(Buffer.from(c.hex, 'hex')), (e) => e.code === Code[c.error] || e.code === c.error)
    assert.throws(() => http.decodeRecord(Buffer.from(c.hex, 'hex')), (e) => e.code === Code[c.error] || e.code === c.error)
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

test('the hot-path forms: problems the client or the server caused, and bad arguments', () => {
  const read = new http.HttpConfig({}).keyReader()
  assert.equal(read('GET', ['order-0001']), null)
  assert.equal(read('POST', [Buffer.from('order-0001')]), 'order-0001')
  assert.equal(read('POST', []).status, 400)
  assert.equal(read('POST', ['order-0001', 'order-0001']).status, 400)
  assert.equal(read('POST', ['bad key!']).type, new http.HttpConfig({}).readKey('POST', ['bad key!']).problem.type)
  assert.throws(() => read('POST', 'order-0001'), { name: 'TypeError', code: 'INVALID_ARGUMENT' })
  assert.throws(() => read(7, []), { name: 'TypeError', code: 'INVALID_ARGUMENT' })
  assert.throws(() => read('POST', [7]), { name: 'TypeError', code: 'INVALID_ARGUMENT' })

  // The gRPC reader gives what readGrpcKey decides, as the HTTP one does for readKey.
  const config = new http.HttpConfig({})
  const readGrpc = config.grpcKeyReader()
  const method = '/orders.Orders/Create'
  assert.equal(readGrpc(method, ['order-0001']), 'order-0001')
  assert.equal(readGrpc(method, [Buffer.from('order-0001')]), 'order-0001')
  for (const values of [[], ['order-0001', 'order-0002'], ['bad key!']]) {
    const p = readGrpc(method, values)
    const expected = config.readGrpcKey(method, values).problem
    assert.equal(p.status, 400)
    assert.deepEqual([p.type, p.grpcMetadata], [expected.type, expected.grpcMetadata])
  }
  assert.equal(new http.HttpConfig({ required: false }).grpcKeyReader()(method, []), null)
  assert.throws(() => readGrpc(method, 'order-0001'), { name: 'TypeError', code: 'INVALID_ARGUMENT' })
  assert.throws(() => readGrpc(7, []), { name: 'TypeError', code: 'INVALID_ARGUMENT', message: /fullMethod/ })
  assert.throws(() => readGrpc(method, [7]), { name: 'TypeError', code: 'INVALID_ARGUMENT' })

  // A tenant that cannot scope a key is the server's fault; a method or key the client's.
  for (const tenant of ['', 'x'.repeat(2000)]) {
    const p = http.request(tenant, 'POST', '/orders', 'order-0001', '/orders', null, '')
    assert.equal(p.status, 500)
    assert.equal(p.type, 'urn:oncely:problem:tenant-unusable')
    assert.match(p.detail, /tenant/)
  }
  assert.equal(http.request('t', 'POST', '/orders', 'bad key!').status, 400)
  assert.equal(http.request('t', 'POST', '/orders', '').status, 400)
  assert.equal(http.request('t', 'POST', 'x'.repeat(2000), 'order-0001').status, 400)
  const [scoped, fp] = http.request('t', 'POST', '/orders', 'order-0001', '/orders?a=1', 'application/json', '{"b":1, "a":2}')
  assert.equal(scoped, http.scope('t', 'POST', '/orders', 'order-0001'))
  assert.equal(fp, http.requestFingerprint('POST', '/orders?a=1', 'application/json', Buffer.from('{"a":2,"b":1}')))
  for (const args of [
    [1, 'POST', '/orders', 'order-0001'],
    ['t', null, '/orders', 'order-0001'],
    ['t', 'POST', '/orders', 42],
    ['t', 'POST', '/orders', 'order-0001', '/orders', 'application/json'],
    ['t', 'POST', '/orders', 'order-0001', '/orders', 'application/json', 12],
    ['t', 'POST', '/orders', 'order-0001', {}, null, ''],
  ]) {
    assert.throws(() => http.request(...args), { name: 'TypeError', code: 'INVALID_ARGUMENT' }, String(args))
  }

  const body = Buffer.from('{}')
  assert.throws(() => http.encodeRecord(70, [], body), { code: 'INVALID_ARGUMENT' })
  assert.throws(() => http.encodeRecord(200.5, [], body), { code: 'INVALID_ARGUMENT' })
  assert.throws(() => http.encodeRecord('200', [], body), { name: 'TypeError', code: 'INVALID_ARGUMENT' })
  assert.throws(() => http.encodeRecord(200, ['etag'], body), { name: 'RangeError', code: 'INVALID_ARGUMENT' })
  assert.throws(() => http.encodeRecord(200, ['etag', 1], body), { name: 'TypeError', code: 'INVALID_ARGUMENT' })
  assert.throws(() => http.encodeRecord(200, {}, body), { name: 'TypeError', code: 'INVALID_ARGUMENT' })
  assert.throws(() => http.encodeRecord(200, [], '{}'), { name: 'TypeError', code: 'INVALID_ARGUMENT' })
  assert.throws(() => http.encodeRecord(200, [], body, ['grpc-status']), { name: 'RangeError', code: 'INVALID_ARGUMENT' })
  assert.throws(() => http.encodeRecord(200, [], body, ['grpc-status', 0]), { name: 'TypeError', code: 'INVALID_ARGUMENT' })
  assert.throws(() => http.encodeRecord(200, [], body, 'grpc-status: 0'), { name: 'TypeError', code: 'INVALID_ARGUMENT' })
  assert.equal(http.encodeRecord(200, [], body, null).toString('hex'), http.encodeRecord(200, [], body).toString('hex'))
  // Fields as one string: every name and value ends with a newline, in whole pairs.
  assert.equal(http.encodeRecord(200, '', body).toString('hex'), http.encodeRecord(200, [], body).toString('hex'))
  assert.equal(http.encodeRecord(200, 'ETag\n"1"\n', body).toString('hex'), http.encodeRecord(200, ['etag', '"1"'], body).toString('hex'))
  // Split on newline characters only: one above U+00FF whose low byte is a newline's is
  // a character of the value (taken as one byte, as in the flat form).
  assert.equal(
    http.encodeRecord(200, 'etag\n"\u010a"\nlink\n<a>\n', body).toString('hex'),
    http.encodeRecord(200, ['etag', '"\u010a"', 'link', '<a>'], body).toString('hex'),
  )
  for (const text of ['etag\n', 'etag\n"1"', 'etag', 'etag\n"1"\nlink\n', '\n']) {
    assert.throws(() => http.encodeRecord(200, text, body), { name: 'RangeError', code: 'INVALID_ARGUMENT' }, JSON.stringify(text))
  }
  assert.throws(() => http.decodeRecord('OHR1'), { name: 'TypeError', code: 'INVALID_ARGUMENT' })
  assert.throws(() => http.decodeRecord(Buffer.from('OHR1')), { code: 'UNAVAILABLE' })
  // Names any case (stored lower-case), values one byte per character, repeats kept.
  const fields = ['ETag', '"\xe9"', 'link', '<a>', 'link', Buffer.from('<b>')]
  const record = http.encodeRecord(201, fields, body)
  assert.deepEqual(
    http.decodeResponse(record).headers.map((f) => [f.name, f.value.toString('latin1')]),
    [['etag', '"\xe9"'], ['link', '<a>'], ['link', '<b>']],
  )
  assert.deepEqual(http.decodeRecord(record).slice(3), [3, 'etag', '"\xe9"', 'link', '<a>', 'link', '<b>'])
})

test('encodeRecord: every record is a Buffer of its own, whatever its size', () => {
  // Small records are copied out of a buffer the encoder reuses, large ones made whole:
  // each result keeps its bytes after the next call, and both ways encode alike.
  const fields = ['content-type', 'application/json']
  const made = []
  for (const size of [0, 1, 100, 4095, 4096, 16 * 1024, 64 * 1024]) {
    const body = Buffer.alloc(size, size % 251)
    const record = http.encodeRecord(201, fields, body)
    made.push([record, Buffer.from(record), body])
  }
  for (const [record, copy, body] of made) {
    assert.ok(record.equals(copy))
    const flat = http.decodeRecord(record)
    assert.equal(flat[0], 201)
    assert.ok(record.subarray(flat[1], flat[2]).equals(body))
    assert.deepEqual(http.encodeResponse({ status: 201, headers: [{ name: 'content-type', value: Buffer.from('application/json') }], body }), record)
  }
})

test('the caps are the core config: sizes past 32 bits kept, bad ones a RangeError, the 413 its problem', () => {
  // napi's own u32 conversion kept only the low 32 bits: a cap of 4 GiB + 16 was 16 bytes.
  const big = 2 ** 32 + 16
  const config = new http.HttpConfig({ bodyCap: big, requestCap: big })
  assert.equal(config.bodyCap, big)
  assert.equal(config.requestCap, big)
  assert.equal(config.bodyFits(1000), true)
  // Numbers in the messages as JavaScript prints them.
  assert.throws(() => new http.HttpConfig({ bodyCap: 1e21 }), { message: /got 1e\+21$/ })
  assert.throws(() => new http.HttpConfig({ bodyCap: 5e-324 }), { message: /got 5e-324$/ })
  for (const bad of [-1, 1.5, Number.NaN, 2 ** 53]) {
    for (const field of ['bodyCap', 'requestCap']) {
      assert.throws(() => new http.HttpConfig({ [field]: bad }), { name: 'RangeError', code: 'INVALID_ARGUMENT', field })
    }
  }
  const small = new http.HttpConfig({ requestCap: 10 })
  assert.equal(small.declaresTooLarge('11'), true)
  assert.equal(small.declaresTooLarge(' 10 '), false)
  assert.equal(small.tooLarge().status, 413)
  assert.match(small.tooLarge().detail, /at most 10 bytes/)
  assert.throws(() => small.declaresTooLarge(11), { name: 'TypeError', code: 'INVALID_ARGUMENT' })
  // The problem by kind takes the cap as its message; anything else is refused, not a default.
  assert.equal(http.problem({ kind: 'request_too_large', message: '10' }).detail, small.tooLarge().detail)
  assert.throws(() => http.problem({ kind: 'request_too_large', message: 'big' }), { name: 'TypeError' })
  assert.equal(http.hasContent('HEAD', 200), false)
  assert.throws(() => http.hasContent('POST', 1.5), { name: 'RangeError', code: 'INVALID_ARGUMENT' })
})

test('an adapter whose body cap is past 32 bits stores what fits under it', async () => {
  const express = require('express')
  const { idempotency } = require('oncely/express')
  const app = express()
  let runs = 0
  app.post('/orders', express.json(), idempotency({ store: new IdempotencyStore(), bodyCap: 2 ** 32 + 16 }), (req, res) => {
    runs++
    res.status(201).json({ pad: 'x'.repeat(100) })
  })
  const server = app.listen(0, '127.0.0.1')
  await once(server, 'listening')
  try {
    const url = `http://127.0.0.1:${server.address().port}/orders`
    const post = () => fetch(url, { method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': 'order-cap-0001' }, body: '{}' })
    await (await post()).text()
    const again = await post()
    await again.text()
    assert.equal(again.headers.get('idempotent-replayed'), 'true')
    assert.equal(runs, 1)
  } finally {
    server.close()
  }
})

test("the contract's names and defaults are the core's, as index.d.ts types them", () => {
  assert.deepEqual(
    [http.KEY_HEADER, http.GRPC_KEY_METADATA, http.REPLAYED_HEADER, http.DEFAULT_TENANT, http.DEFAULT_REQUEST_CAP],
    ['idempotency-key', 'x-idempotency-key', 'idempotent-replayed', 'default', 1 << 20],
  )
  assert.deepEqual(http.problem({ kind: 'request_too_large', message: String(http.DEFAULT_REQUEST_CAP) }).detail, new http.HttpConfig({}).tooLarge().detail)
})
