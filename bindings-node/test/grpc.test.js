'use strict'
// oncely/grpc on a real @grpc/grpc-js server on 127.0.0.1 with a grpc-js client.
const test = require('node:test')
const assert = require('node:assert/strict')

const grpc = require('@grpc/grpc-js')
const { IdempotencyStore, RedisStore, newKey, http } = require('oncely')
const { withIdempotency } = require('oncely/grpc')

const REDIS = process.env.ONCELY_REDIS_URL
const json = {
  requestSerialize: (v) => Buffer.from(JSON.stringify(v)),
  requestDeserialize: (b) => JSON.parse(b.toString()),
  responseSerialize: (v) => Buffer.from(JSON.stringify(v)),
  responseDeserialize: (b) => JSON.parse(b.toString()),
}
const service = {
  create: { path: '/shop.Orders/Create', requestStream: false, responseStream: false, ...json },
}
const Client = grpc.makeGenericClientConstructor(service, 'Orders')

async function start(options, behave = async () => undefined) {
  let calls = 0
  const server = new grpc.Server()
  const impl = {
    create: async (call, callback) => {
      const n = ++calls
      const err = await behave(n, call)
      if (err) return callback(err)
      callback(null, { id: n, sku: call.request.sku })
    },
  }
  server.addService(service, withIdempotency(service, impl, options))
  const port = await new Promise((resolve, reject) =>
    server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (e, p) => (e ? reject(e) : resolve(p))),
  )
  const client = new Client(`127.0.0.1:${port}`, grpc.credentials.createInsecure())
  const create = (request, key) =>
    new Promise((resolve) => {
      const md = new grpc.Metadata()
      if (key !== undefined) md.set('x-idempotency-key', key)
      let out
      const call = client.create(request, md, (error, value) => {
        out = { error, value }
      })
      call.on('status', (status) => resolve({ ...out, status }))
    })
  return {
    create,
    address: `127.0.0.1:${port}`,
    calls: () => calls,
    close: () => {
      client.close()
      return new Promise((r) => server.tryShutdown(r))
    },
  }
}

const replayedOf = (r) => r.status.metadata.get('idempotent-replayed')[0] ?? null

for (const [name, store] of [
  ['IdempotencyStore', () => new IdempotencyStore()],
  ['RedisStore', () => new RedisStore({ url: REDIS, prefix: `oncely-grpc-test-${newKey()}`, leaseMs: 3_000 })],
]) {
  const skip = name === 'RedisStore' && !REDIS && 'ONCELY_REDIS_URL not set'
  test(`grpc on ${name}: a retry is replayed; missing, invalid and reused keys are refused`, { skip }, async () => {
    const s = await start({ store: store() })
    try {
      const first = await s.create({ sku: 'A1' }, 'order-0001')
      assert.deepEqual(first.value, { id: 1, sku: 'A1' })
      assert.equal(replayedOf(first), null)
      const again = await s.create({ sku: 'A1' }, 'order-0001')
      assert.deepEqual(again.value, { id: 1, sku: 'A1' })
      assert.equal(replayedOf(again), 'true')
      const missing = (await s.create({ sku: 'A1' })).error
      assert.equal(missing.code, grpc.status.INVALID_ARGUMENT)
      // A gRPC server names its key: the metadata, not the HTTP header.
      assert.match(missing.details, /^write operations require x-idempotency-key metadata/)
      assert.doesNotMatch(missing.details, /Idempotency-Key header/)
      assert.equal((await s.create({ sku: 'A1' }, 'bad key!')).error.code, grpc.status.INVALID_ARGUMENT)
      assert.equal((await s.create({ sku: 'B2' }, 'order-0001')).error.code, grpc.status.FAILED_PRECONDITION)
      assert.equal(s.calls(), 1)
    } finally {
      await s.close()
    }
  })

  test(`grpc on ${name}: UNAVAILABLE is not stored (the retry runs again); INVALID_ARGUMENT is`, { skip }, async () => {
    const s = await start({ store: store() }, async (n, call) => {
      if (call.request.sku === 'down' && n === 1) return { code: grpc.status.UNAVAILABLE, details: 'down' }
      if (call.request.sku === 'bad') return { code: grpc.status.INVALID_ARGUMENT, details: `bad ${n}` }
      return undefined
    })
    try {
      assert.equal((await s.create({ sku: 'down' }, 'order-down1')).error.code, grpc.status.UNAVAILABLE)
      const retry = await s.create({ sku: 'down' }, 'order-down1')
      assert.deepEqual(retry.value, { id: 2, sku: 'down' })
      assert.equal(replayedOf(retry), null)
      const bad = await s.create({ sku: 'bad' }, 'order-bad01')
      assert.equal(bad.error.details, 'bad 3')
      const badAgain = await s.create({ sku: 'bad' }, 'order-bad01')
      assert.equal(badAgain.error.code, grpc.status.INVALID_ARGUMENT)
      assert.equal(badAgain.error.details, 'bad 3')
      assert.equal(replayedOf(badAgain), 'true')
      assert.equal(s.calls(), 3)
    } finally {
      await s.close()
    }
  })
}

test('grpc: 200 concurrent calls with one key run the handler once', async () => {
  const s = await start({ store: new IdempotencyStore() }, () => new Promise((r) => setTimeout(() => r(undefined), 50)))
  try {
    const all = await Promise.all(Array.from({ length: 200 }, () => s.create({ sku: 'A1' }, 'order-0200')))
    assert.equal(s.calls(), 1)
    for (const r of all) assert.deepEqual(r.value, { id: 1, sku: 'A1' })
    assert.equal(all.filter((r) => replayedOf(r) === 'true').length, 199)
  } finally {
    await s.close()
  }
})

test('grpc: wait false: a duplicate of a running call gets ABORTED with pushback', async () => {
  let release
  const s = await start({ store: new IdempotencyStore(), wait: false }, (n) =>
    n === 1 ? new Promise((r) => (release = () => r(undefined))) : undefined,
  )
  try {
    const first = s.create({ sku: 'A1' }, 'order-busy1')
    while (s.calls() < 1) await new Promise((r) => setTimeout(r, 5))
    const dup = await s.create({ sku: 'A1' }, 'order-busy1')
    assert.equal(dup.error.code, grpc.status.ABORTED)
    assert.ok(Number(dup.status.metadata.get('grpc-retry-pushback-ms')[0]) > 0)
    release()
    assert.deepEqual((await first).value, { id: 1, sku: 'A1' })
  } finally {
    await s.close()
  }
})

test('grpc: a store that fails after the handler ran: the handler\'s answer is sent', async () => {
  const store = {
    async execute(scoped, fingerprint, fn) {
      await fn({ signal: new AbortController().signal })
      throw Object.assign(new Error('the idempotency store is unavailable: write failed'), { kind: 'unavailable', code: 'UNAVAILABLE' })
    },
  }
  const s = await start({ store })
  try {
    const r = await s.create({ sku: 'A1' }, 'order-lost1')
    assert.equal(r.error, null)
    assert.deepEqual(r.value, { id: 1, sku: 'A1' })
  } finally {
    await s.close()
  }
})

test('grpc: a call cancelled while its handler runs: the answer is kept, the retry is a replay', async () => {
  let started
  const running = new Promise((r) => (started = r))
  const s = await start({ store: new IdempotencyStore() }, async () => {
    started()
    await new Promise((r) => setTimeout(r, 200))
    return undefined
  })
  try {
    const client = new Client(s.address, grpc.credentials.createInsecure())
    const md = new grpc.Metadata()
    md.set('x-idempotency-key', 'order-left1')
    const call = client.create({ sku: 'A1' }, md, () => {})
    await running
    call.cancel()
    client.close()
    const retry = await s.create({ sku: 'A1' }, 'order-left1')
    assert.deepEqual(retry.value, { id: 1, sku: 'A1' })
    assert.equal(replayedOf(retry), 'true')
    assert.equal(s.calls(), 1)
  } finally {
    await s.close()
  }
})

test('grpc: the trailing metadata the handler gave is stored with the answer and replayed', async () => {
  const s = await start({ store: new IdempotencyStore() }, async (n, call) => {
    if (call.request.sku === 'bad') {
      const metadata = new grpc.Metadata()
      metadata.set('x-field', 'sku')
      metadata.set('details-bin', Buffer.from([0, 1, 2]))
      return { code: grpc.status.INVALID_ARGUMENT, details: 'no sku: 100% café', metadata }
    }
    return undefined
  })
  try {
    const first = await s.create({ sku: 'bad' }, 'order-trl01')
    const again = await s.create({ sku: 'bad' }, 'order-trl01')
    for (const r of [first, again]) {
      assert.equal(r.error.code, grpc.status.INVALID_ARGUMENT)
      assert.equal(r.error.details, 'no sku: 100% café')
      assert.deepEqual(r.status.metadata.get('x-field'), ['sku'])
      assert.deepEqual(r.status.metadata.get('details-bin'), [Buffer.from([0, 1, 2])])
    }
    assert.equal(replayedOf(again), 'true')
    assert.equal(s.calls(), 1)
  } finally {
    await s.close()
  }
})

test('grpc: an answer stored by another adapter (framed-message fingerprint, encoded grpc-message) is replayed', async () => {
  const store = new IdempotencyStore()
  const path = service.create.path
  const message = Buffer.from(JSON.stringify({ sku: 'A1' }))
  const head = Buffer.alloc(5)
  head.writeUInt32BE(message.length, 1)
  const fp = http.requestFingerprint('POST', path, 'application/grpc', Buffer.concat([head, message]))
  const record = http.encodeResponse({
    status: 200,
    headers: [{ name: 'content-type', value: Buffer.from('application/grpc') }],
    body: Buffer.alloc(0),
    trailers: [
      { name: 'grpc-status', value: Buffer.from('5') },
      { name: 'grpc-message', value: Buffer.from('no such sku: 100%25 caf%C3%A9') },
    ],
  })
  await store.execute(http.scope('default', 'POST', path, 'order-xlang'), fp, () => record)
  const s = await start({ store })
  try {
    const r = await s.create({ sku: 'A1' }, 'order-xlang')
    assert.equal(r.error.code, grpc.status.NOT_FOUND)
    assert.equal(r.error.details, 'no such sku: 100% café')
    assert.equal(replayedOf(r), 'true')
    assert.equal(s.calls(), 0)
  } finally {
    await s.close()
  }
})

test('grpc: an empty tenant from the tenant function is INTERNAL (tenant-unusable), the handler not run', async () => {
  const s = await start({ store: new IdempotencyStore(), tenant: () => '' })
  try {
    const r = await s.create({ sku: 'A1' }, 'order-0001')
    assert.equal(r.error.code, grpc.status.INTERNAL)
    assert.match(r.error.details, /tenant/)
    assert.equal(s.calls(), 0)
  } finally {
    await s.close()
  }
})
