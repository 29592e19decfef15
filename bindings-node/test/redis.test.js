'use strict'
// RedisStore against a real Redis (SPEC §6 across processes and languages).
//
// The Redis-backed tests read ONCELY_REDIS_URL and are skipped without it: run them with
// scripts/test-redis (or scripts/test redis), which starts a throwaway redis-server. The
// encoding tests need no Redis.
const test = require('node:test')
const assert = require('node:assert/strict')
const fs = require('node:fs')
const net = require('node:net')
const path = require('node:path')
const { execFile } = require('node:child_process')

const { RedisStore, encodeResult, decodeResult, scope, newKey, fingerprint } = require('oncely')

const URL = process.env.ONCELY_REDIS_URL
const needsRedis = URL ? {} : { skip: 'needs a Redis: run scripts/test-redis' }

const fp = fingerprint({ sku: 'A1', qty: 1 })
const otherFp = fingerprint({ sku: 'A1', qty: 2 })
const key = () => scope('acme', 'CreateOrder', newKey())
const prefix = () => `nodetest-${newKey()}`
const store = (options) => new RedisStore({ url: URL, prefix: prefix(), ...options })

const root = path.resolve(__dirname, '..', '..')
const venv = process.env.ONCELY_VENV || path.join(root, '.venv')
const python = path.join(venv, 'bin', 'python')

function deferred() {
  let resolve
  let reject
  const promise = new Promise((res, rej) => {
    resolve = res
    reject = rej
  })
  return { promise, resolve, reject }
}

/** Resolves once `cond()` holds (checked every 5 ms, up to 10 s). */
async function until(cond, what) {
  const t0 = Date.now()
  while (!cond()) {
    if (Date.now() - t0 > 10_000) throw new Error(`timed out waiting for ${what}`)
    await new Promise((r) => setTimeout(r, 5))
  }
}

// ---------------------------------------------------------------------------------------
// Result encoding (redis/README.md, "Result encoding"): no Redis needed
// ---------------------------------------------------------------------------------------

test('encoding: j + compact JSON, b + raw bytes, unknown tags refused', () => {
  assert.deepEqual(encodeResult({ b: [1, 2.5, null, true], a: 'é' }), Buffer.from('j{"b":[1,2.5,null,true],"a":"é"}', 'utf8'))
  assert.deepEqual(encodeResult(Buffer.from([0, 255])), Buffer.from([0x62, 0, 255]))
  assert.deepEqual(encodeResult(new Uint8Array([1, 2])), Buffer.from([0x62, 1, 2]))
  assert.deepEqual(encodeResult('text'), Buffer.from('j"text"'))
  assert.deepEqual(encodeResult(null), Buffer.from('jnull'))
  assert.deepEqual(encodeResult({ a: 1, gone: undefined }), Buffer.from('j{"a":1}'))
  assert.deepEqual(decodeResult(Buffer.from('j{"a":[1,"é"]}', 'utf8')), { a: [1, 'é'] })
  const bytes = decodeResult(Buffer.from([0x62, 0, 255]))
  assert.ok(Buffer.isBuffer(bytes))
  assert.deepEqual([...bytes], [0, 255])
  assert.equal(decodeResult(Buffer.from('b')).length, 0)
  assert.throws(() => decodeResult(Buffer.from('Q123')), { code: 'UNAVAILABLE', message: /unknown encoding tag/ })
  assert.throws(() => decodeResult(Buffer.alloc(0)), { code: 'UNAVAILABLE' })
})

test('encoding: shared parts are not cycles', () => {
  const part = [1, { a: 'b' }]
  assert.deepEqual(encodeResult({ x: part, y: [part, part] }), Buffer.from('j{"x":[1,{"a":"b"}],"y":[[1,{"a":"b"}],[1,{"a":"b"}]]}'))
})

test('encoding: undefined is no value', () => {
  assert.deepEqual(encodeResult(undefined), Buffer.from('n'))
  assert.equal(decodeResult(Buffer.from('n')), undefined)
  assert.equal(decodeResult(Buffer.from('jnull')), null)
})

class Order {
  constructor(id) {
    this.id = id
  }
}

function cyclic() {
  const o = { a: 1 }
  o.self = o
  return o
}

// A value JSON would drop or change, and the type name its record keeps.
const UNSTORABLE = [
  [() => new Map([['a', 1]]), 'Map'],
  [() => new Set([1]), 'Set'],
  [() => 10n, 'bigint'],
  [() => cyclic(), 'Object (cyclic)'],
  [() => new Order(7), 'Order'],
  [() => new Date(0), 'Date'],
  [() => Number.NaN, 'number (NaN)'],
  [() => ({ total: Number.POSITIVE_INFINITY }), 'number (Infinity)'],
  [() => ({ items: [new Map()] }), 'Map'],
  [() => [1, undefined], 'undefined (in an array)'],
  // biome-ignore lint/suspicious/noSparseArray: a sparse array is the input under test
  [() => [1, , 3], 'Array (sparse)'],
  [() => ({ f: () => 1 }), 'function'],
  [() => ({ toJSON: () => 'x' }), 'Object (toJSON)'],
  [() => ({ nested: Buffer.from('a') }), 'Buffer'],
]

test('encoding: a value JSON would change is not storable, named by its type', () => {
  for (const [make, typeName] of UNSTORABLE) {
    const record = encodeResult(make())
    assert.deepEqual(record, Buffer.from(`x${typeName}`), typeName)
    assert.throws(() => decodeResult(record), { code: 'DATA_LOSS', kind: 'result_not_stored', typeName })
  }
})

/**
 * A value whose prototype and key traps throw: even `instanceof` on it throws. (Its `get`
 * passes through: a `then` that throws would make the action itself fail.)
 */
function trapped() {
  const boom = () => {
    throw new Error('trap')
  }
  return new Proxy({}, { getPrototypeOf: boom, ownKeys: boom, has: boom, getOwnPropertyDescriptor: boom })
}

test('encoding: a Proxy whose traps throw is not storable (never a throw), as a value or as encode output', () => {
  assert.deepEqual(encodeResult(trapped()), Buffer.from('xObject'))
  assert.deepEqual(encodeResult({ a: [trapped()] }), Buffer.from('xObject'))
  assert.deepEqual(
    encodeResult(1, () => trapped()),
    Buffer.from('xnumber'),
  )
})

test('encoding: user codec records', () => {
  const encode = (v) => JSON.stringify(v, (k, x) => (x instanceof Map ? { map: [...x] } : x))
  const record = encodeResult(new Map([['a', 1]]), encode)
  assert.deepEqual(record, Buffer.from('t{"map":[["a",1]]}'))
  assert.deepEqual(decodeResult(record, (t) => new Map(JSON.parse(t).map)), new Map([['a', 1]]))
  const b = encodeResult(10n, (v) => Buffer.from(v.toString()))
  assert.deepEqual(b, Buffer.from('u10'))
  assert.equal(decodeResult(b, (buf) => BigInt(buf.toString())), 10n)
  assert.deepEqual(encodeResult(undefined, encode), Buffer.from('n'))
  assert.deepEqual(encodeResult(10n, () => { throw new Error('no') }), Buffer.from('xbigint'))
  assert.deepEqual(encodeResult(10n, () => 42), Buffer.from('xbigint'))
  assert.throws(() => decodeResult(Buffer.from('u10')), { code: 'UNAVAILABLE', message: /user codec/ })
  const e = assert.throws(() => decodeResult(Buffer.from('tnot json'), JSON.parse), { code: 'UNAVAILABLE', message: /decode could not read/ })
  void e
})

test('options are checked', () => {
  assert.throws(() => new RedisStore(), { code: 'INVALID_ARGUMENT' })
  assert.throws(() => new RedisStore({}), { code: 'INVALID_ARGUMENT' })
  assert.throws(() => new RedisStore({ url: 'redis://127.0.0.1:1/0', lease: 5 }), { code: 'INVALID_ARGUMENT' })
  const s = new RedisStore({ url: 'redis://127.0.0.1:1/0', leaseMs: 5000, ttlMs: 60_000, prefix: 'p' })
  assert.equal(s.leaseMs, 5000)
  assert.equal(s.ttlMs, 60_000)
  assert.equal(s.prefix, 'p')
  const k = key()
  assert.equal(s.recordKey(k), `{p:${k}}`)
  assert.throws(() => new RedisStore({ url: 'redis://127.0.0.1:1/0', encode: JSON.stringify }), { code: 'INVALID_ARGUMENT', field: 'decode' })
  assert.throws(() => new RedisStore({ url: 'redis://127.0.0.1:1/0', encode: 1, decode: JSON.parse }), { code: 'INVALID_ARGUMENT', field: 'encode' })
  assert.ok(new RedisStore({ url: 'redis://127.0.0.1:1/0', encode: JSON.stringify, decode: JSON.parse }))
  assert.equal(s.maxResultBytes, 64 * 2 ** 20)
  assert.equal(new RedisStore({ url: 'redis://127.0.0.1:1/0', maxResultBytes: 512 * 2 ** 20 }).maxResultBytes, 512 * 2 ** 20)
  for (const bad of [0, -1, 512 * 2 ** 20 + 1, 1.5, NaN]) {
    assert.throws(() => new RedisStore({ url: 'redis://127.0.0.1:1/0', maxResultBytes: bad }), { name: 'RangeError', field: 'maxResultBytes' })
  }
  assert.throws(() => new RedisStore({ url: 'redis://127.0.0.1:1/0', maxResultBytes: '1' }), { name: 'TypeError', field: 'maxResultBytes' })
})

// ---------------------------------------------------------------------------------------
// Against Redis
// ---------------------------------------------------------------------------------------

test('1,000 concurrent same-key callers: one run, every caller gets the value', needsRedis, async () => {
  const s = store()
  const k = key()
  let calls = 0
  const gate = deferred()
  const action = async () => {
    calls++
    await gate.promise
    return { order: 'o-1', items: [1, 2, 3] }
  }
  const all = Array.from({ length: 1000 }, () => s.execute(k, fp, action))
  await new Promise((r) => setTimeout(r, 50))
  gate.resolve()
  const results = await Promise.all(all)
  assert.equal(calls, 1)
  const sources = results.map((r) => r.source)
  assert.equal(sources.filter((x) => x === 'led').length, 1)
  assert.equal(sources.filter((x) => x === 'joined').length, 999)
  for (const r of results) assert.deepEqual(r.value, { order: 'o-1', items: [1, 2, 3] })
  assert.equal(s.counters().claims, 1)
  // And a replay afterwards, from another instance: still no second run.
  const again = await new RedisStore({ url: URL, prefix: s.prefix }).execute(k, fp, action)
  assert.equal(calls, 1)
  assert.equal(again.source, 'replayed')
})

test('replay returns an equal value; Buffers stay bytes', needsRedis, async () => {
  const s = store()
  const k = key()
  const value = { id: 'x', n: [1, 2.5, null], nested: { ok: true, s: 'ünïcode' } }
  const first = await s.execute(k, fp, async () => value)
  assert.equal(first.value, value) // the leader gets its own object
  assert.deepEqual(first, { value, replayed: false, source: 'led' })
  const replay = await s.execute(k, fp, () => assert.fail('must not run'))
  assert.deepEqual(replay, { value, replayed: true, source: 'replayed' })
  assert.notEqual(replay.value, value) // a fresh value

  const kb = key()
  const bytes = Buffer.from([0, 1, 2, 254, 255])
  const led = await s.execute(kb, fp, () => bytes)
  assert.equal(led.value, bytes)
  const back = await s.execute(kb, fp, () => assert.fail('must not run'))
  assert.ok(Buffer.isBuffer(back.value))
  assert.deepEqual([...back.value], [...bytes])
  assert.equal(back.source, 'replayed')

  const ku = key()
  await s.execute(ku, fp, () => new Uint8Array([7, 8]))
  const u = await s.execute(ku, fp, () => assert.fail('must not run'))
  assert.ok(Buffer.isBuffer(u.value))
  assert.deepEqual([...u.value], [7, 8])
})

test('a different fingerprint is FAILED_PRECONDITION', needsRedis, async () => {
  const s = store()
  const k = key()
  await s.execute(k, fp, () => 1)
  await assert.rejects(s.execute(k, otherFp, () => assert.fail('must not run')), {
    code: 'FAILED_PRECONDITION',
    kind: 'fingerprint_mismatch',
  })
})

test('a failure is not cached: waiters get the error itself, the next call runs again', needsRedis, async () => {
  const s = store()
  const k = key()
  const boom = Object.assign(new Error('boom'), { code: 'UNAVAILABLE' })
  let calls = 0
  const gate = deferred()
  const failing = async () => {
    calls++
    await gate.promise
    throw boom
  }
  const a = s.execute(k, fp, failing)
  const b = s.execute(k, fp, failing)
  gate.resolve()
  const [ra, rb] = await Promise.allSettled([a, b])
  assert.equal(ra.status, 'rejected')
  assert.equal(ra.reason, boom)
  // The waiter of this process got the leader's error (or ran itself after the release).
  assert.equal(rb.status, 'rejected')
  assert.equal(rb.reason, boom)
  const ok = await s.execute(k, fp, async () => {
    calls++
    return 'second'
  })
  assert.deepEqual(ok, { value: 'second', replayed: false, source: 'led' })
  assert.ok(calls >= 2)
})

test('wait: false on a running call is ABORTED with retryAfterMs', needsRedis, async () => {
  const s = store({ inProgressRetryAfterMs: 250 })
  const other = new RedisStore({ url: URL, prefix: s.prefix, inProgressRetryAfterMs: 250 })
  const k = key()
  const gate = deferred()
  const started = deferred()
  const leader = s.execute(k, fp, async () => {
    started.resolve()
    await gate.promise
    return 'done'
  })
  await started.promise
  // Another instance (another process, as far as Redis can tell).
  await assert.rejects(other.execute(k, fp, () => assert.fail('must not run'), { wait: false }), (e) => {
    assert.equal(e.code, 'ABORTED')
    assert.equal(e.kind, 'in_progress')
    assert.equal(e.retryAfterMs, 250)
    return true
  })
  // The same instance (its in-process tier).
  await assert.rejects(s.execute(k, fp, () => assert.fail('must not run'), { wait: false }), { code: 'ABORTED' })
  // Waiting on the other instance: woken when the leader completes.
  const waiter = other.execute(k, fp, () => assert.fail('must not run'))
  await until(() => other.counters().remoteWaits === 1, 'the remote wait')
  gate.resolve()
  assert.equal((await leader).value, 'done')
  assert.deepEqual(await waiter, { value: 'done', replayed: true, source: 'joined' })
})

test('an aborted leader whose action stops on its signal releases the claim: a waiter of another instance takes over', needsRedis, async () => {
  const s = store()
  const other = new RedisStore({ url: URL, prefix: s.prefix })
  const k = key()
  const ac = new AbortController()
  const started = deferred()
  const leader = s.execute(
    k,
    fp,
    ({ signal }) => {
      started.resolve()
      return new Promise((resolve, reject) => signal.addEventListener('abort', () => reject(signal.reason), { once: true }))
    },
    { signal: ac.signal },
  )
  await started.promise
  const waiter = other.execute(k, fp, async () => 'taken over')
  await new Promise((r) => setTimeout(r, 20))
  ac.abort(new Error('stop'))
  await assert.rejects(leader, { message: 'stop' })
  assert.deepEqual(await waiter, { value: 'taken over', replayed: false, source: 'led' })
})

test('an unreachable Redis is UNAVAILABLE and fn does not run', async () => {
  // A closed port on 127.0.0.1: bound by the kernel, then released.
  const port = await new Promise((resolve) => {
    const srv = net.createServer()
    srv.listen(0, '127.0.0.1', () => {
      const p = srv.address().port
      srv.close(() => resolve(p))
    })
  })
  const s = new RedisStore({ url: `redis://127.0.0.1:${port}/0`, connectTimeoutMs: 500, ioTimeoutMs: 500 })
  let ran = false
  await assert.rejects(
    s.execute(key(), fp, () => {
      ran = true
      return 1
    }),
    { code: 'UNAVAILABLE' },
  )
  assert.equal(ran, false)
})

/** One command over a raw RESP connection to ONCELY_REDIS_URL; resolves to the first reply line. */
function redisCommand(...args) {
  const [host, port] = URL.replace(/^redis:\/\//, '').split('/')[0].split(':')
  const parts = args.map((a) => (Buffer.isBuffer(a) ? a : Buffer.from(String(a))))
  const msg = Buffer.concat([Buffer.from(`*${parts.length}\r\n`), ...parts.flatMap((p) => [Buffer.from(`$${p.length}\r\n`), p, Buffer.from('\r\n')])])
  return new Promise((resolve, reject) => {
    const sock = net.createConnection({ host, port: Number(port) }, () => sock.write(msg))
    let got = ''
    sock.on('data', (d) => {
      got += d.toString('latin1')
      const i = got.indexOf('\r\n')
      if (i >= 0) {
        sock.destroy()
        resolve(got.slice(0, i))
      }
    })
    sock.on('error', reject)
  })
}

test('a leader whose record was taken gets ABORTED (lease_lost); nothing is written', needsRedis, async () => {
  const s = store()
  const k = key()
  const record = s.recordKey(k)
  await assert.rejects(
    s.execute(k, fp, async () => {
      // Another leader took over (simulated: the record is gone).
      assert.equal(await redisCommand('DEL', record), ':1')
      return 'late'
    }),
    { code: 'ABORTED', kind: 'lease_lost' },
  )
  assert.equal(await redisCommand('EXISTS', record), ':0')
  assert.equal(s.counters().leasesLost, 1)
})

/** The raw `result` field of a record. */
function hgetResult(record) {
  const [host, port] = URL.replace(/^redis:\/\//, '').split('/')[0].split(':')
  const parts = ['HGET', record, 'result'].map((a) => Buffer.from(a))
  const msg = Buffer.concat([Buffer.from(`*${parts.length}\r\n`), ...parts.flatMap((p) => [Buffer.from(`$${p.length}\r\n`), p, Buffer.from('\r\n')])])
  return new Promise((resolve, reject) => {
    const sock = net.createConnection({ host, port: Number(port) }, () => sock.write(msg))
    let got = Buffer.alloc(0)
    sock.on('data', (d) => {
      got = Buffer.concat([got, d])
      const i = got.indexOf('\r\n')
      if (i < 0) return
      const n = Number(got.subarray(1, i).toString())
      if (got.length >= i + 2 + n) {
        sock.destroy()
        resolve(got.subarray(i + 2, i + 2 + n))
      }
    })
    sock.on('error', reject)
  })
}

test('undefined is stored as no value: one run, replayed as undefined everywhere', needsRedis, async () => {
  const s = store()
  const k = key()
  let runs = 0
  const action = async () => {
    runs++
    await new Promise((r) => setTimeout(r, 50))
  }
  const done = await Promise.all([1, 2, 3, 4].map(() => s.execute(k, fp, action)))
  assert.deepEqual(done.map((d) => d.value), [undefined, undefined, undefined, undefined])
  assert.deepEqual(done.map((d) => d.source).sort(), ['joined', 'joined', 'joined', 'led'])
  const again = await s.execute(k, fp, action)
  assert.equal(again.source, 'replayed')
  assert.equal(again.value, undefined)
  assert.ok('value' in again)
  const other = new RedisStore({ url: URL, prefix: s.prefix })
  assert.equal((await other.execute(k, fp, action)).value, undefined)
  assert.equal(runs, 1)
  assert.deepEqual(await hgetResult(s.recordKey(k)), Buffer.from('n'))
})

test('a result over maxResultBytes is not stored: joiners get it, later callers result_not_stored, one run', needsRedis, async () => {
  const s = store({ maxResultBytes: 1000 })
  const other = new RedisStore({ url: URL, prefix: s.prefix })
  const [k, small] = [key(), key()]
  const value = Buffer.alloc(5000, 7)
  let runs = 0
  const action = async () => {
    runs++
    await new Promise((r) => setTimeout(r, 30))
    return value
  }
  const done = await Promise.all([1, 2, 3].map(() => s.execute(k, fp, action)))
  for (const d of done) assert.deepEqual(d.value, value)
  assert.deepEqual((await s.execute(small, fp, () => Buffer.alloc(999, 1))).value, Buffer.alloc(999, 1))
  for (const later of [s, other]) {
    await assert.rejects(later.execute(k, fp, action), (e) => {
      assert.equal(e.code, 'DATA_LOSS')
      assert.equal(e.kind, 'result_not_stored')
      assert.match(e.message, /5001 bytes/)
      return true
    })
    assert.deepEqual((await later.execute(small, fp, action)).value, Buffer.alloc(999, 1))
  }
  assert.equal(runs, 1)
})

test('a result over maxResultBytes: waiters on another instance, woken by the completion, get result_not_stored; get shows it', needsRedis, async () => {
  const s = store({ maxResultBytes: 1000 })
  const other = new RedisStore({ url: URL, prefix: s.prefix })
  const k = key()
  const value = Buffer.alloc(5000, 7)
  const gate = deferred()
  let runs = 0
  const led = s.execute(k, fp, async () => {
    runs++
    await gate.promise
    return value
  })
  await until(() => runs === 1, 'the leader')
  const again = async () => {
    runs++
    return Buffer.from('again')
  }
  const waiters = [1, 2, 3, 4].map(() => other.execute(k, fp, again))
  await until(() => other.counters().remoteWaits >= 1, 'the remote wait')
  gate.resolve()
  assert.deepEqual((await led).value, value)
  for (const w of waiters) {
    await assert.rejects(w, (e) => {
      assert.equal(e.code, 'DATA_LOSS')
      assert.equal(e.kind, 'result_not_stored')
      assert.equal(e.key, k)
      assert.match(e.typeName, /5001 bytes.*1000/)
      return true
    })
  }
  assert.equal(runs, 1)
  const record = await other.get(k)
  assert.equal(record.state, 'done')
  assert.throws(() => decodeResult(record.data), (e) => {
    assert.equal(e.kind, 'result_not_stored')
    assert.match(e.typeName, /5001 bytes/)
    return true
  })
})

test('a result that cannot be stored runs once: joiners get it, later callers result_not_stored', needsRedis, async () => {
  for (const [make, typeName] of UNSTORABLE.slice(0, 7)) {
    const s = store()
    const other = new RedisStore({ url: URL, prefix: s.prefix })
    const k = key()
    const value = make()
    let runs = 0
    const action = async () => {
      runs++
      await new Promise((r) => setTimeout(r, 30))
      return value
    }
    const done = await Promise.all([1, 2, 3, 4].map(() => s.execute(k, fp, action)))
    assert.ok(done.every((d) => d.value === value || (Number.isNaN(d.value) && Number.isNaN(value))), typeName)
    assert.deepEqual(done.map((d) => d.source).sort(), ['joined', 'joined', 'joined', 'led'])
    for (const later of [s, other]) {
      await assert.rejects(later.execute(k, fp, action), (e) => {
        assert.equal(e.code, 'DATA_LOSS')
        assert.equal(e.kind, 'result_not_stored')
        assert.equal(e.key, k)
        assert.equal(e.typeName, typeName)
        return true
      })
    }
    assert.equal(runs, 1, typeName)
    assert.deepEqual(await hgetResult(s.recordKey(k)), Buffer.from(`x${typeName}`))
  }
})

test('a result whose Proxy traps throw settles its key: one run, later callers result_not_stored', { ...needsRedis, timeout: 30_000 }, async () => {
  for (const options of [{}, { encode: () => trapped(), decode: (b) => b }]) {
    const s = store(options)
    const k = key()
    let runs = 0
    const value = trapped()
    const action = async () => {
      runs++
      await new Promise((r) => setTimeout(r, 20))
      return value
    }
    const done = await Promise.all([1, 2, 3].map(() => s.execute(k, fp, action)))
    for (const d of done) assert.deepEqual(d.value, value)
    await assert.rejects(s.execute(k, fp, action), { code: 'DATA_LOSS', kind: 'result_not_stored' })
    assert.equal(runs, 1)
  }
})

test('a result that cannot be stored: many callers, aborted joiners, another instance: one run', needsRedis, async () => {
  const s = store()
  const other = new RedisStore({ url: URL, prefix: s.prefix })
  for (let round = 0; round < 5; round++) {
    const k = key()
    const value = new Map([['round', round]])
    const gate = deferred()
    let runs = 0
    const action = async () => {
      runs++
      await gate.promise
      return value
    }
    const aborts = Array.from({ length: 10 }, () => new AbortController())
    const calls = Array.from({ length: 30 }, () => s.execute(k, fp, action))
    const outcome = (p) => p.then((d) => d, (e) => e)
    const aborted = aborts.map((c) => outcome(s.execute(k, fp, action, { signal: c.signal })))
    await until(() => runs === 1, 'the leader of this instance') // before the other instance claims
    const remote = Array.from({ length: 5 }, () => outcome(other.execute(k, fp, action)))
    await new Promise((r) => setTimeout(r, 50))
    for (const c of aborts) c.abort()
    gate.resolve()
    const done = await Promise.all(calls)
    for (const d of done) assert.deepEqual(d.value, value)
    for (const e of await Promise.all(aborted)) assert.equal(e.name, 'AbortError')
    for (const e of await Promise.all(remote)) {
      assert.equal(e.kind, 'result_not_stored')
      assert.equal(e.typeName, 'Map')
    }
    await assert.rejects(s.execute(k, fp, action), { kind: 'result_not_stored' })
    assert.equal(runs, 1)
  }
})

test('user codec: round trip across instances; a throwing decode is a clear error and no re-run', needsRedis, async () => {
  const encode = (v) => JSON.stringify(v, (k, x) => (x instanceof Map ? { $map: [...x] } : typeof x === 'bigint' ? { $big: String(x) } : x))
  const decode = (t) => JSON.parse(t, (k, x) => (x && x.$map ? new Map(x.$map) : x && x.$big ? BigInt(x.$big) : x))
  const s = store({ encode, decode })
  const k = key()
  const value = { m: new Map([['a', 1]]), n: 12345678901234567890n }
  let runs = 0
  const action = () => {
    runs++
    return value
  }
  assert.equal((await s.execute(k, fp, action)).value, value)
  const back = await new RedisStore({ url: URL, prefix: s.prefix, encode, decode }).execute(k, fp, action)
  assert.equal(back.source, 'replayed')
  assert.deepEqual(back.value, value)
  const broken = new RedisStore({ url: URL, prefix: s.prefix, encode, decode: () => { throw new Error('corrupt') } })
  await assert.rejects(broken.execute(k, fp, action), (e) => e.code === 'UNAVAILABLE' && e.key === k && e.cause.message === 'corrupt')
  await assert.rejects(new RedisStore({ url: URL, prefix: s.prefix }).execute(k, fp, action), { code: 'UNAVAILABLE', message: /user codec/ })
  assert.equal(runs, 1)

  const refusing = store({ encode: () => { throw new Error('not mine') }, decode })
  const k2 = key()
  assert.equal((await refusing.execute(k2, fp, action)).value, value)
  await assert.rejects(refusing.execute(k2, fp, action), { kind: 'result_not_stored', typeName: 'Object' })
  assert.equal(runs, 2)
})

test('a result with an unknown encoding tag is refused (UNAVAILABLE), fn does not run', needsRedis, async () => {
  const s = store()
  const k = key()
  const record = s.recordKey(k)
  const reply = await redisCommand('HSET', record, 'v', '1', 'state', 'done', 'fp', fp, 'token', 't', 'gen', '1', 'result', 'raw-from-elsewhere', 'done_at', '1')
  assert.equal(reply, ':7')
  let ran = false
  const fn = () => {
    ran = true
    return 1
  }
  await assert.rejects(s.execute(k, fp, fn), { code: 'UNAVAILABLE', message: /unknown encoding tag/ })
  assert.equal(ran, false)
  await redisCommand('HSET', record, 'result', 'j{"ok":true}')
  assert.deepEqual((await s.execute(k, fp, fn)).value, { ok: true })
  assert.equal(ran, false)
})

test('a waiter that aborts stops waiting; the leader is unaffected', needsRedis, async () => {
  const s = store()
  const other = new RedisStore({ url: URL, prefix: s.prefix })
  const k = key()
  const gate = deferred()
  const started = deferred()
  const leader = s.execute(k, fp, async () => {
    started.resolve()
    await gate.promise
    return 7
  })
  await started.promise
  const ac = new AbortController()
  const local = s.execute(k, fp, () => assert.fail('must not run'), { signal: ac.signal })
  const remote = other.execute(k, fp, () => assert.fail('must not run'), { signal: ac.signal })
  await new Promise((r) => setTimeout(r, 20))
  ac.abort(new Error('gave up'))
  await assert.rejects(local, { message: 'gave up' })
  await assert.rejects(remote, { message: 'gave up' })
  gate.resolve()
  assert.equal((await leader).value, 7)
  assert.equal((await other.execute(k, fp, () => assert.fail('must not run'))).source, 'replayed')
})

test('waiting does not block the event loop', needsRedis, async () => {
  const s = store()
  const other = new RedisStore({ url: URL, prefix: s.prefix })
  const k = key()
  const gate = deferred()
  const started = deferred()
  const leader = s.execute(k, fp, async () => {
    started.resolve()
    await gate.promise
    return 'v'
  })
  await started.promise
  const waiter = other.execute(k, fp, () => assert.fail('must not run'))
  await until(() => other.counters().remoteWaits === 1, 'the remote wait')
  let ticks = 0
  const timer = setInterval(() => ticks++, 5)
  await new Promise((r) => setTimeout(r, 200))
  clearInterval(timer)
  assert.ok(ticks >= 10, `the event loop ran ${ticks} ticks while waiting`)
  gate.resolve()
  await leader
  assert.equal((await waiter).source, 'joined')
})

const CRASHING = `
const { RedisStore, scope } = require('oncely')
const [url, pfx, k, fp] = process.argv.slice(1)
const store = new RedisStore({ url, prefix: pfx, leaseMs: 500 })
store.execute(scope('acme', 'CreateOrder', k), fp, () => {
  console.log('STARTED')
  return new Promise(() => setInterval(() => {}, 1000))
})
`

test('a killed leader process is taken over after its lease', needsRedis, async () => {
  const pfx = prefix()
  const k = newKey()
  const child = require('node:child_process').spawn(process.execPath, ['-e', CRASHING, URL, pfx, k, fp], {
    cwd: path.join(__dirname, '..'),
    stdio: ['ignore', 'pipe', 'inherit'],
  })
  try {
    await new Promise((resolve, reject) => {
      child.stdout.on('data', (d) => d.toString().includes('STARTED') && resolve())
      child.on('exit', (code) => reject(new Error(`child exited with ${code}`)))
    })
    child.kill('SIGKILL') // no release: the lease (0.5 s) has to run out
    const s = new RedisStore({ url: URL, prefix: pfx })
    const t0 = Date.now()
    const done = await s.execute(scope('acme', 'CreateOrder', k), fp, async () => 'mine')
    assert.deepEqual(done, { value: 'mine', replayed: false, source: 'led' })
    assert.ok(Date.now() - t0 < 10_000)
    assert.equal(s.counters().takeovers, 1)
  } finally {
    child.kill('SIGKILL')
  }
})

// ---------------------------------------------------------------------------------------
// Across languages: Node and Python share one Redis
// ---------------------------------------------------------------------------------------

const PY = `
import decimal, json, sys
import oncely
url, pfx, tenant, method, k, fp, kind = sys.argv[1:8]
store = oncely.RedisStore(url, prefix=pfx)
values = {"bytes": b"\\x00py\\xff", "none": None, "decimal": decimal.Decimal("1.10")}
value = values.get(kind, {"from": "python", "n": [1, 2.5], "s": "\\u00fcn\\u00efcode"})
try:
    done = store.execute_sync(oncely.scope(tenant, method, k), fp, lambda: value)
except oncely.ResultNotStoredError as e:
    print(json.dumps({"error": "result_not_stored", "key": e.key, "type_name": e.type_name}))
    sys.exit(0)
v = done.value
if isinstance(v, decimal.Decimal):
    v = str(v)
print(json.dumps({"value": v.hex() if isinstance(v, bytes) else v, "bytes": isinstance(v, bytes), "source": done.source}))
`

function runPython(args) {
  if (!fs.existsSync(python)) {
    throw new Error(`${python} does not exist: run scripts/test-python first (it makes the venv with the oncely wheel), or set ONCELY_VENV`)
  }
  return new Promise((resolve, reject) => {
    execFile(python, ['-c', PY, ...args], { timeout: 60_000 }, (err, stdout, stderr) => {
      if (err) reject(new Error(`python failed: ${err.message}\n${stderr}`))
      else resolve(JSON.parse(stdout))
    })
  })
}

test('cross-language: a value stored by Node is replayed by Python, and back', needsRedis, async () => {
  const s = store()
  const pfx = s.prefix
  const k1 = newKey()
  const value = { order: 'o-42', amount: [1, 2.5], note: 'ünïcode', ok: true, none: null }
  assert.equal((await s.execute(scope('acme', 'CreateOrder', k1), fp, async () => value)).source, 'led')
  const got = await runPython([URL, pfx, 'acme', 'CreateOrder', k1, fp, 'json'])
  assert.deepEqual(got, { value, bytes: false, source: 'replayed' })

  // Bytes stay bytes across languages.
  const k2 = newKey()
  await s.execute(scope('acme', 'CreateOrder', k2), fp, () => Buffer.from([0, 110, 255]))
  const gotBytes = await runPython([URL, pfx, 'acme', 'CreateOrder', k2, fp, 'bytes'])
  assert.deepEqual(gotBytes, { value: '006eff', bytes: true, source: 'replayed' })

  // Python stores, Node replays.
  const k3 = newKey()
  const led = await runPython([URL, pfx, 'acme', 'CreateOrder', k3, fp, 'json'])
  assert.equal(led.source, 'led')
  const back = await s.execute(scope('acme', 'CreateOrder', k3), fp, () => assert.fail('must not run'))
  assert.deepEqual(back, { value: { from: 'python', n: [1, 2.5], s: 'ünïcode' }, replayed: true, source: 'replayed' })

  const k4 = newKey()
  assert.equal((await runPython([URL, pfx, 'acme', 'CreateOrder', k4, fp, 'bytes'])).source, 'led')
  const backBytes = await s.execute(scope('acme', 'CreateOrder', k4), fp, () => assert.fail('must not run'))
  assert.ok(Buffer.isBuffer(backBytes.value))
  assert.deepEqual([...backBytes.value], [0, 0x70, 0x79, 0xff])
})

test('cross-language: no value and not-storable records read the same in Node and Python', needsRedis, async () => {
  const s = store()
  const pfx = s.prefix
  const never = () => assert.fail('must not run')

  // Node's undefined → Python's None, and back.
  const k1 = newKey()
  await s.execute(scope('acme', 'Notify', k1), fp, () => undefined)
  assert.deepEqual(await runPython([URL, pfx, 'acme', 'Notify', k1, fp, 'json']), { value: null, bytes: false, source: 'replayed' })
  const k2 = newKey()
  assert.equal((await runPython([URL, pfx, 'acme', 'Notify', k2, fp, 'none'])).source, 'led')
  const none = await s.execute(scope('acme', 'Notify', k2), fp, never)
  assert.deepEqual([none.value, none.source], [undefined, 'replayed'])

  // A Node Map is not stored: Python gets ResultNotStoredError, not a second run.
  const k3 = newKey()
  const map = new Map([['a', 1]])
  assert.equal((await s.execute(scope('acme', 'Pay', k3), fp, () => map)).value, map)
  const py = await runPython([URL, pfx, 'acme', 'Pay', k3, fp, 'json'])
  assert.deepEqual(py, { error: 'result_not_stored', key: scope('acme', 'Pay', k3), type_name: 'Map' })

  // A Python Decimal is not stored: Node gets result_not_stored.
  const k4 = newKey()
  assert.deepEqual(await runPython([URL, pfx, 'acme', 'Pay', k4, fp, 'decimal']), { value: '1.10', bytes: false, source: 'led' })
  await assert.rejects(s.execute(scope('acme', 'Pay', k4), fp, never), { kind: 'result_not_stored', typeName: 'decimal.Decimal', code: 'DATA_LOSS' })
})

/** Spawns a server process and resolves with it and the port it prints first. */
function serverProcess(command, args, env) {
  const { spawn } = require('node:child_process')
  const child = spawn(command, args, { env: { ...process.env, ...env }, stdio: ['pipe', 'pipe', 'inherit'] })
  return new Promise((resolve, reject) => {
    child.stdout.once('data', (d) => resolve({ child, url: `http://127.0.0.1:${String(d).trim()}` }))
    child.once('exit', (code) => reject(new Error(`${command} exited ${code}`)))
  })
}

test('cross-language: a Python (ASGI, uvicorn) server and a Node (Express) server on one Redis run one request once', needsRedis, async () => {
  if (!fs.existsSync(python)) {
    throw new Error(`${python} does not exist: run scripts/test-python first (it makes the venv with the oncely wheel), or set ONCELY_VENV`)
  }
  const pfx = prefix()
  const effects = path.join(require('node:os').tmpdir(), `oncely-effects-${newKey()}`)
  fs.writeFileSync(effects, '')
  const servers = []
  try {
    // Both: POST /orders, tenant "acme", a handler that records its call and answers 201.
    servers.push(
      await serverProcess(python, [path.join(root, 'bindings-python', 'tests', 'asgi_process_app.py')], {
        ONCELY_REDIS_URL: URL,
        PREFIX: pfx,
        EFFECTS: effects,
      }),
    )
    servers.push(
      await serverProcess(process.execPath, [path.join(__dirname, '..', 'fixtures', 'express-redis-server.js')], {
        PREFIX: pfx,
        TENANT: 'acme',
      }),
    )
    const send = (url) =>
      fetch(`${url}/orders`, {
        method: 'POST',
        headers: { 'idempotency-key': 'order-xlang1', 'content-type': 'application/json' },
        body: '{"sku":"A1","qty":1}',
      }).then(async (r) => ({ status: r.status, replayed: r.headers.get('idempotent-replayed'), body: await r.text() }))
    const all = await Promise.all(Array.from({ length: 40 }, (_, i) => send(servers[i % 2].url)))
    for (const r of all) {
      assert.equal(r.status, 201)
      assert.equal(r.body, all[0].body)
    }
    assert.equal(all.filter((r) => r.replayed === 'true').length, 39)
    const pythonCalls = fs.readFileSync(effects, 'utf8').split('\n').filter(Boolean).length
    const nodeCalls = (await (await fetch(`${servers[1].url}/count`)).json()).calls
    assert.equal(pythonCalls + nodeCalls, 1)
    // A later retry to either server is a replay of the same answer.
    for (const { url } of servers) {
      const again = await send(url)
      assert.equal(again.replayed, 'true')
      assert.equal(again.body, all[0].body)
    }
  } finally {
    for (const { child } of servers) {
      child.stdin.end()
      child.kill('SIGTERM')
    }
    fs.rmSync(effects, { force: true })
  }
})

// Operability: get / remove by scoped key, ping, connect at construction, counters

function closedPortUrl() {
  return new Promise((resolve) => {
    const srv = net.createServer()
    srv.listen(0, '127.0.0.1', () => {
      const { port } = srv.address()
      srv.close(() => resolve(`redis://127.0.0.1:${port}`))
    })
  })
}

test('connect: true fails a closed port in the constructor; ping and get report UNAVAILABLE', async () => {
  const bad = await closedPortUrl()
  assert.throws(
    () => new RedisStore({ url: bad, connect: true, connectTimeoutMs: 500, ioTimeoutMs: 500 }),
    (e) => e.code === 'UNAVAILABLE',
  )
  const lazy = new RedisStore({ url: bad, connectTimeoutMs: 500, ioTimeoutMs: 500 })
  await assert.rejects(lazy.ping(), (e) => e.code === 'UNAVAILABLE')
  await assert.rejects(lazy.get(key()), (e) => e.code === 'UNAVAILABLE')
  assert.equal(lazy.counters().unavailable, 2)
})

test('get, remove and ping on a record by its scoped key', needsRedis, async () => {
  new RedisStore({ url: URL, connect: true })
  const s = store()
  await s.ping()
  const k = key()
  assert.equal(await s.get(k), null)
  assert.equal(await s.remove(k), false)
  await s.execute(k, fp, () => ({ bad: true }))
  const rec = await s.get(k)
  assert.equal(rec.state, 'done')
  assert.equal(rec.fingerprint, fp)
  assert.equal(rec.generation, 1)
  assert.equal(rec.leaseLeftMs, 0)
  assert.deepEqual(decodeResult(rec.data), { bad: true })
  assert.equal(await s.remove(k), true)
  assert.equal(await s.get(k), null)
  const again = await s.execute(k, fp, () => ({ good: true }))
  assert.deepEqual([again.value, again.source], [{ good: true }, 'led'])
  const c = s.counters()
  assert.deepEqual([c.claims, c.leads, c.unavailable], [2, 2, 0])
})

test('a running record with a live lease is not removed', needsRedis, async () => {
  const pfx = prefix()
  const a = new RedisStore({ url: URL, prefix: pfx })
  const b = new RedisStore({ url: URL, prefix: pfx })
  const k = key()
  const started = deferred()
  const release = deferred()
  const first = a.execute(k, fp, async () => {
    started.resolve()
    await release.promise
    return 'first'
  })
  await started.promise
  const rec = await b.get(k)
  assert.equal(rec.state, 'running')
  assert.equal(rec.data, undefined)
  assert.ok(rec.leaseLeftMs > 0 && rec.leaseLeftMs <= a.leaseMs, String(rec.leaseLeftMs))
  assert.equal(await b.remove(k), false)
  await assert.rejects(b.execute(k, fp, () => 'second', { wait: false }), (e) => e.code === 'ABORTED')
  release.resolve()
  assert.equal((await first).value, 'first')
  assert.equal((await b.execute(k, fp, () => 'third')).value, 'first')
})

test('a lead given up before its action starts is counted as abandoned, and its key is free', needsRedis, async () => {
  // What execute does when its caller's signal aborts as the claim answers `lead`.
  const { NativeRedisStore } = require('../native.js')
  const pfx = prefix()
  const native = new NativeRedisStore({ url: URL, prefix: pfx })
  const k = key()
  const [p] = native.begin(k, fp, true)
  const [kind, lease] = await p
  assert.equal(kind, 2)
  native.abandon(lease)
  native.abandon(lease) // a settled lease is left alone: counted once
  await new Promise((r) => setImmediate(r))
  const c = native.counters()
  assert.deepEqual([c.leads, c.abandoned], [1, 1])
  const other = store({ prefix: pfx })
  assert.equal((await other.execute(k, fp, () => 'second')).source, 'led')
  assert.equal(other.counters().abandoned, 0)
})
