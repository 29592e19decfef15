'use strict'
// oncely/grpc at the edges of what grpc-js accepts: implementations found by a method's
// original name or on a class's prototype, answers over the body cap with a duplicate
// waiting, answers the handler changes after giving them, the status grpc-js derives
// from an error, errors that are not objects, and a refusal of a nested wrapper. Real
// @grpc/grpc-js servers on 127.0.0.1 with grpc-js clients.
const test = require('node:test')
const assert = require('node:assert/strict')

const grpc = require('@grpc/grpc-js')
const { IdempotencyStore, newKey } = require('oncely')
const { withIdempotency } = require('oncely/grpc')

const json = {
  requestSerialize: (v) => Buffer.from(JSON.stringify(v)),
  requestDeserialize: (b) => JSON.parse(b.toString()),
  responseSerialize: (v) => Buffer.from(JSON.stringify(v)),
  responseDeserialize: (b) => JSON.parse(b.toString()),
}
const service = {
  create: { path: '/shop.Orders/Create', requestStream: false, responseStream: false, ...json },
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

async function serve(svc, impl) {
  const server = new grpc.Server()
  server.addService(svc, impl)
  const port = await new Promise((resolve, reject) =>
    server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (e, p) => (e ? reject(e) : resolve(p))),
  )
  const client = new (grpc.makeGenericClientConstructor(svc, 'Orders'))(`127.0.0.1:${port}`, grpc.credentials.createInsecure())
  return {
    client,
    port,
    close: () => {
      client.close()
      return new Promise((r) => server.tryShutdown(r))
    },
  }
}

/** A unary call with the key (when given): `{ error, value, status, trailers }`. */
function call(client, method, request, key) {
  return new Promise((resolve) => {
    const md = new grpc.Metadata()
    if (key !== undefined) md.set('x-idempotency-key', key)
    let out
    const c = client[method](request, md, (error, value) => {
      out = { error, value }
    })
    c.on('status', (status) => resolve({ ...out, status, trailers: status.metadata.getMap() }))
  })
}

test('grpc: a handler found by the method\'s original name (a proto-loader service) is wrapped', async () => {
  // The shape @grpc/proto-loader gives: methods named as in the .proto, with the
  // camelCase name an implementation may use as `originalName`.
  const svc = { CreateOrder: { ...service.create, originalName: 'createOrder' } }
  let runs = 0
  const impl = { createOrder: (c, cb) => cb(null, { id: ++runs }) }
  const s = await serve(svc, withIdempotency(svc, impl, { store: new IdempotencyStore() }))
  try {
    const key = newKey()
    const a = await call(s.client, 'CreateOrder', { sku: 'A' }, key)
    const b = await call(s.client, 'CreateOrder', { sku: 'A' }, key)
    assert.deepEqual([a.value, b.value], [{ id: 1 }, { id: 1 }])
    assert.equal(b.trailers['idempotent-replayed'], 'true')
    const missing = await call(s.client, 'CreateOrder', { sku: 'A' })
    assert.equal(missing.status.code, grpc.status.INVALID_ARGUMENT)
    assert.equal(runs, 1)
  } finally {
    await s.close()
  }
})

test('grpc: an implementation that is a class instance keeps its prototype\'s methods and its `this`', async () => {
  const svc = {
    ...service,
    watch: { path: '/shop.Orders/Watch', requestStream: false, responseStream: true, ...json },
  }
  class Orders {
    constructor() {
      this.n = 0
    }
    next() {
      return ++this.n
    }
    create(c, cb) {
      cb(null, { id: this.next() })
    }
    watch(c) {
      c.write({ id: this.n })
      c.end()
    }
  }
  const impl = new Orders()
  const s = await serve(svc, withIdempotency(svc, impl, { store: new IdempotencyStore() }))
  try {
    const key = newKey()
    assert.deepEqual((await call(s.client, 'create', {}, key)).value, { id: 1 })
    assert.deepEqual((await call(s.client, 'create', {}, key)).value, { id: 1 })
    assert.deepEqual((await call(s.client, 'create', {}, newKey())).value, { id: 2 })
    assert.equal(impl.n, 2, 'the handlers ran on the instance itself')
    const streamed = await new Promise((resolve, reject) => {
      const out = []
      const c = s.client.watch({})
      c.on('data', (d) => out.push(d))
      c.on('error', reject)
      c.on('end', () => resolve(out))
    })
    assert.deepEqual(streamed, [{ id: 2 }])
  } finally {
    await s.close()
  }
})

test('grpc: an answer over the body cap is not stored, and the duplicate waiting for it gets it', async () => {
  let runs = 0
  const impl = {
    create: async (c, cb) => {
      const n = ++runs
      await sleep(200)
      cb(null, { id: n, pad: 'x'.repeat(2000) })
    },
  }
  const s = await serve(service, withIdempotency(service, impl, { store: new IdempotencyStore(), bodyCap: 1000 }))
  try {
    const key = newKey()
    const first = call(s.client, 'create', {}, key)
    await sleep(50)
    const duplicate = call(s.client, 'create', {}, key)
    const [a, b] = await Promise.all([first, duplicate])
    assert.equal(runs, 1, 'the duplicate waiting did not run the handler again')
    assert.deepEqual(b.value, a.value)
    // Not stored: a retry after it runs the handler.
    assert.equal((await call(s.client, 'create', {}, key)).value.id, 2)
  } finally {
    await s.close()
  }
})

test('grpc: the first caller gets the answer as it was given, not as the handler changed it after', async () => {
  const impl = {
    create: (c, cb) => {
      const order = { id: 1, state: 'created' }
      cb(null, order)
      order.state = 'audited'
    },
  }
  const s = await serve(service, withIdempotency(service, impl, { store: new IdempotencyStore() }))
  try {
    const key = newKey()
    const a = await call(s.client, 'create', {}, key)
    const b = await call(s.client, 'create', {}, key)
    assert.deepEqual(a.value, { id: 1, state: 'created' })
    assert.deepEqual(b.value, a.value)
  } finally {
    await s.close()
  }
})

test('grpc: an error answer is stored as grpc-js sends it: its trailers, and its details as grpc-js reads them', async () => {
  const answers = [
    // The trailers given with the error replace the error's own, as grpc-js sends them.
    (cb) => {
      const own = new grpc.Metadata()
      own.set('x-own', 'error')
      const given = new grpc.Metadata()
      given.set('x-reason', 'out-of-stock')
      cb({ code: grpc.status.NOT_FOUND, details: 'gone', metadata: own }, null, given)
    },
    // No details and no message.
    (cb) => cb({ code: grpc.status.NOT_FOUND }),
    // Details that are not a string: the message.
    (cb) => cb(Object.assign(new Error('the message'), { code: grpc.status.NOT_FOUND, details: 42 })),
  ]
  for (const [i, answer] of answers.entries()) {
    let runs = 0
    const impl = {
      create: (c, cb) => {
        runs++
        answer(cb)
      },
    }
    const s = await serve(service, withIdempotency(service, impl, { store: new IdempotencyStore() }))
    try {
      const key = newKey()
      const a = await call(s.client, 'create', {}, key)
      const b = await call(s.client, 'create', {}, key)
      assert.equal(runs, 1, `answer ${i}: stored`)
      assert.equal(a.status.code, grpc.status.NOT_FOUND)
      assert.equal(b.status.code, a.status.code)
      assert.equal(b.status.details, a.status.details, `answer ${i}: the same details`)
      const { 'idempotent-replayed': replayed, ...rest } = b.trailers
      assert.equal(replayed, 'true')
      assert.deepEqual(rest, a.trailers, `answer ${i}: the same trailers`)
    } finally {
      await s.close()
    }
  }
})

test('grpc: a handler failing with something that is not an object is UNKNOWN, and the server lives on', async () => {
  const handlers = [(c, cb) => cb('boom'), () => {
    throw 'boom'
  }, async () => {
    throw 7
  }]
  for (const create of handlers) {
    const s = await serve(service, withIdempotency(service, { create }, { store: new IdempotencyStore() }))
    try {
      const r = await call(s.client, 'create', {}, newKey())
      assert.equal(r.status.code, grpc.status.UNKNOWN)
      // The server still answers.
      assert.equal((await call(s.client, 'create', {}, newKey())).status.code, grpc.status.UNKNOWN)
    } finally {
      await s.close()
    }
  }
})

test('grpc: an implementation wrapped twice with one store: the outer wrapper leads, the call is answered and replayed', async () => {
  let runs = 0
  const impl = { create: (c, cb) => cb(null, { id: ++runs }) }
  const store = new IdempotencyStore()
  const s = await serve(service, withIdempotency(service, withIdempotency(service, impl, { store }), { store }))
  try {
    const key = newKey()
    const a = await call(s.client, 'create', {}, key)
    const b = await call(s.client, 'create', {}, key)
    assert.deepEqual([a.value, b.value], [{ id: 1 }, { id: 1 }])
    assert.equal(b.trailers['idempotent-replayed'], 'true')
    assert.equal(runs, 1)
  } finally {
    await s.close()
  }
})

test('grpc: what grpc-js cannot send is not stored as if it were sent: a lone surrogate in the details, plain-object trailers', async () => {
  const answers = {
    surrogate: (cb) => cb({ code: grpc.status.INVALID_ARGUMENT, details: 'bad sku 😀'.slice(0, 9) }),
    plainTrailers: (cb) => cb({ code: grpc.status.NOT_FOUND, details: 'gone', metadata: { a: '1' } }),
    plainTrailersOk: (cb) => cb(null, { id: 1 }, { a: '1' }),
  }
  for (const [name, answer] of Object.entries(answers)) {
    let runs = 0
    const impl = {
      create: (c, cb) => {
        runs++
        answer(cb)
      },
    }
    const s = await serve(service, withIdempotency(service, impl, { store: new IdempotencyStore() }))
    try {
      const key = newKey()
      const a = await call(s.client, 'create', {}, key)
      const b = await call(s.client, 'create', {}, key)
      assert.equal(b.status.code, a.status.code, `${name}: one status`)
      assert.equal(b.status.details, a.status.details, `${name}: one details`)
      assert.notEqual(a.status.code, grpc.status.INTERNAL, `${name}: the answer was sent`)
      if (name === 'surrogate') {
        assert.equal(a.status.details, 'bad sku \uFFFD')
        assert.equal(runs, 1)
        assert.equal(b.trailers['idempotent-replayed'], 'true')
      } else {
        assert.equal(a.status.code, grpc.status.UNKNOWN)
      }
    } finally {
      await s.close()
    }
  }
})

test('grpc: the first answer and its replay are one answer, even through a codec that loses something reading back', async () => {
  // The server's codec reads numbers back rounded (as proto-loader's `longs: Number`
  // reads a 64-bit integer); the client's reads them as they are. A replay can only
  // send what it reads back from the stored bytes: the first caller gets that too.
  const server = { create: { ...service.create, responseDeserialize: (b) => ({ id: Math.round(JSON.parse(b.toString()).id) }) } }
  let runs = 0
  const impl = {
    create: (c, cb) => {
      runs++
      cb(null, { id: 1.5 })
    },
  }
  const s = await serve(server, withIdempotency(server, impl, { store: new IdempotencyStore() }))
  const client = new (grpc.makeGenericClientConstructor(service, 'Orders'))(`127.0.0.1:${s.port}`, grpc.credentials.createInsecure())
  try {
    const key = newKey()
    const a = await call(client, 'create', {}, key)
    const b = await call(client, 'create', {}, key)
    assert.equal(b.trailers['idempotent-replayed'], 'true')
    assert.deepEqual(a.value, b.value)
    assert.equal(runs, 1)
  } finally {
    client.close()
    await s.close()
  }
})

test('grpc: an error whose code is OK is UNKNOWN and not stored, not an empty success on replay', async () => {
  let runs = 0
  const impl = {
    create: (c, cb) => {
      runs++
      cb({ code: grpc.status.OK, details: 'half done' })
    },
  }
  const s = await serve(service, withIdempotency(service, impl, { store: new IdempotencyStore() }))
  try {
    const key = newKey()
    const a = await call(s.client, 'create', {}, key)
    const b = await call(s.client, 'create', {}, key)
    assert.equal(a.status.code, grpc.status.UNKNOWN)
    assert.equal(a.status.details, 'half done')
    // Not stored: the retry runs the handler again and gets the same error.
    assert.equal(b.status.code, grpc.status.UNKNOWN)
    assert.equal(b.value, undefined)
    assert.equal(runs, 2)
  } finally {
    await s.close()
  }
})

test('grpc: a codec that cannot read its answer back: the handler runs once, the first caller gets its value', async () => {
  // Checks what it reads (as a schema-checked codec would), not what it writes.
  const server = {
    create: {
      ...service.create,
      responseDeserialize: () => {
        throw new Error('unexpected shape')
      },
    },
  }
  let runs = 0
  const impl = {
    create: (c, cb) => {
      runs++
      setTimeout(() => cb(null, { id: 7 }), 30)
    },
  }
  const s = await serve(server, withIdempotency(server, impl, { store: new IdempotencyStore() }))
  const client = new (grpc.makeGenericClientConstructor(service, 'Orders'))(`127.0.0.1:${s.port}`, grpc.credentials.createInsecure())
  try {
    const key = newKey()
    // Two at once (the second waits for the first), then a retry.
    const [a, b] = await Promise.all([call(client, 'create', {}, key), sleep(5).then(() => call(client, 'create', {}, key))])
    const c = await call(client, 'create', {}, key)
    assert.deepEqual(a.value, { id: 7 })
    assert.equal(runs, 1)
    // A replay cannot be read back: INTERNAL, never a second run.
    for (const r of [b, c]) assert.equal(r.status.code, grpc.status.INTERNAL)
  } finally {
    client.close()
    await s.close()
  }
})

test('grpc: a unary method without a codec is refused when wrapped, not answered once and never replayed', () => {
  const { responseDeserialize, ...serverOnly } = service.create
  assert.throws(
    () => withIdempotency({ create: serverOnly }, { create: (c, cb) => cb(null, {}) }, { store: new IdempotencyStore() }),
    (e) => e instanceof TypeError && /create has no responseDeserialize/.test(e.message),
  )
})

test('grpc: trailers the handler changes after answering: the first caller gets them as stored', async () => {
  const answers = {
    ok: (cb, md) => cb(null, { id: 1 }, md),
    notFound: (cb, md) => cb({ code: grpc.status.NOT_FOUND, details: 'no such order', metadata: md }),
  }
  for (const [name, answer] of Object.entries(answers)) {
    let runs = 0
    const impl = {
      create: (c, cb) => {
        runs++
        const md = new grpc.Metadata()
        md.set('x-version', 'v1')
        answer(cb, md)
        md.set('x-version', 'v2')
      },
    }
    const s = await serve(service, withIdempotency(service, impl, { store: new IdempotencyStore() }))
    try {
      const key = newKey()
      const a = await call(s.client, 'create', {}, key)
      const b = await call(s.client, 'create', {}, key)
      assert.equal(runs, 1, name)
      assert.equal(b.trailers['idempotent-replayed'], 'true', name)
      assert.equal(a.trailers['x-version'], 'v1', name)
      assert.equal(b.trailers['x-version'], 'v1', name)
    } finally {
      await s.close()
    }
  }
})
