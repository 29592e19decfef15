'use strict'
// A first call over the in-process store is answered in the call when the handler
// answers at once (IdempotencyStore[RUN]): errors and answers at every point, and many
// duplicates.
const test = require('node:test')
const assert = require('node:assert/strict')
const { IdempotencyStore } = require('oncely')
const { idempotency } = require('oncely/express')

const { EXPRESSES, serve, post: postKeyed } = require('./express-helpers.js')

/**
 * The answer with its `replayed` flag, 'hang' after `ms` (4 s unless told), or, where the
 * connection fails (a handler that throws after its answer may cut it), 'error: CODE'.
 */
async function post(url, key, options = {}) {
  try {
    return await postKeyed(url, key, { ms: 4000, replayed: true, ...options })
  } catch (e) {
    return `error: ${e.cause?.code ?? e.message}`
  }
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

async function withApp(express, setup, run, options = {}) {
  const store = options.store ?? new IdempotencyStore()
  const app = express()
  const mw = idempotency({ store, ...options.mw })
  app.use(mw)
  const state = { calls: 0 }
  setup(app, state)
  app.use((err, req, res, next) => {
    if (res.headersSent) return next(err)
    res.status(err.status ?? 500).json({ error: err.message })
  })
  await serve(app, (url) => run(url, state, store, mw))
}

let k = 0
const key = () => `sync-key-${process.pid}-${k++}`

for (const [major, express] of Object.entries(EXPRESSES)) {
  test(`${major}: a handler that throws synchronously before writing: an error answer, then the retry runs again or replays, never hangs`, () =>
    withApp(express, (app, st) => {
      app.post('/o', () => {
        st.calls++
        const e = new Error('boom')
        e.status = st.calls === 1 ? 422 : 500
        throw e
      })
    }, async (u, st) => {
      const id = key()
      const a = await post(`${u}/o`, id)
      assert.equal(a.status, 422)
      const b = await post(`${u}/o`, id)
      assert.deepEqual(b, { ...a, replayed: true }, 'a 422 is stored and replayed')
      assert.equal(st.calls, 1)
    }))

  test(`${major}: a handler that throws synchronously after res.end: the answer stays stored, the retry is a replay`, () =>
    withApp(express, (app, st) => {
      app.post('/o', (req, res) => {
        st.calls++
        res.status(201).json({ n: st.calls })
        throw new Error('after the answer')
      })
    }, async (u, st) => {
      const id = key()
      const a = await post(`${u}/o`, id)
      const b = await post(`${u}/o`, id)
      assert.equal(st.calls, 1)
      if (typeof a === 'object') assert.deepEqual(b, { ...a, replayed: true })
      else assert.deepEqual(b, { status: 201, body: '{"n":1}', replayed: true })
    }))

  test(`${major}: next(err) synchronously, and after an await, with 300 duplicates waiting: one handler run, every duplicate gets its answer`, () =>
    withApp(express, (app, st) => {
      app.post('/sync', (req, res, next) => {
        st.calls++
        const e = new Error('sync'); e.status = 422; next(e)
      })
      app.post('/late', async (req, res, next) => {
        st.calls++
        await sleep(100)
        const e = new Error('late'); e.status = 400; next(e)
      })
    }, async (u, st) => {
      const id = key()
      const all = await Promise.all(Array.from({ length: 300 }, () => post(`${u}/late`, id)))
      assert.equal(st.calls, 1, 'the handler ran more than once for one key')
      for (const r of all) assert.equal(r.status, 400, JSON.stringify(r))
      const id2 = key()
      const s = await Promise.all(Array.from({ length: 50 }, () => post(`${u}/sync`, id2)))
      for (const r of s) assert.equal(r.status, 422)
      assert.equal(st.calls, 2)
    }))

  test(`${major}: 300 duplicates while the leader answers after an await, or synchronously: one run, identical bodies`, () =>
    withApp(express, (app, st) => {
      app.post('/late', async (req, res) => {
        st.calls++
        await sleep(100)
        res.status(201).set('etag', '"e1"').json({ n: st.calls, pad: 'x'.repeat(5000) })
      })
      app.post('/now', (req, res) => {
        st.calls++
        res.status(200).json({ n: st.calls })
      })
    }, async (u, st) => {
      const id = key()
      const all = await Promise.all(Array.from({ length: 300 }, () => post(`${u}/late`, id)))
      assert.equal(st.calls, 1)
      for (const r of all) assert.deepEqual({ ...r, replayed: undefined }, { ...all[0], replayed: undefined })
      assert.equal(all.filter((r) => !r.replayed).length, 1)
      const id2 = key()
      const now = await Promise.all(Array.from({ length: 300 }, () => post(`${u}/now`, id2)))
      assert.equal(st.calls, 2)
      for (const r of now) assert.deepEqual({ ...r, replayed: undefined }, { status: 200, body: '{"n":2}', replayed: undefined })
    }))

  test(`${major}: duplicates of a leader whose answer is released (over the body cap): none hangs, no two handler runs overlap`, () =>
    withApp(express, (app, st) => {
      let running = 0
      st.overlap = 0
      app.post('/big', async (req, res) => {
        st.calls++
        running++
        if (running > 1) st.overlap++
        await sleep(20)
        running--
        res.status(200).send('y'.repeat(64))
      })
    }, async (u, st) => {
      const id = key()
      const all = await Promise.all(Array.from({ length: 20 }, () => post(`${u}/big`, id)))
      for (const r of all) assert.equal(r.status, 200, JSON.stringify(r))
      assert.equal(st.overlap, 0)
    }, { mw: { bodyCap: 16 } }))

  test(`${major}: duplicates of an event stream leader (released) and of a 5xx leader (unstored): answers, no hang`, () =>
    withApp(express, (app, st) => {
      app.post('/sse', async (req, res) => {
        st.calls++
        res.setHeader('content-type', 'text/event-stream')
        res.write('data: 1\n\n')
        await sleep(30)
        res.end('data: 2\n\n')
      })
    }, async (u, st) => {
      const id = key()
      const all = await Promise.all(Array.from({ length: 10 }, () => post(`${u}/sse`, id)))
      for (const r of all) assert.equal(r.status, 200, JSON.stringify(r))
    }))

  test(`${major}: wait:false and a fingerprint mismatch while the leader runs are problems at once; after it, a mismatch is 422`, () =>
    withApp(express, (app, st) => {
      app.post('/o', async (req, res) => {
        st.calls++
        await sleep(150)
        res.status(201).json({ ok: 1 })
      })
    }, async (u, st) => {
      const id = key()
      const leader = post(`${u}/o`, id)
      await sleep(30)
      const busy = await post(`${u}/o`, id, { ms: 1000 })
      const other = await post(`${u}/o`, id, { body: '{"item":2}', ms: 1000 })
      assert.equal(busy.status, 409, JSON.stringify(busy))
      assert.equal(other.status, 422, JSON.stringify(other))
      assert.equal((await leader).status, 201)
      assert.equal((await post(`${u}/o`, id, { body: '{"item":2}' })).status, 422)
      assert.equal(st.calls, 1)
    }, { mw: { wait: false } }))

  test(`${major}: HEAD, 204 and 304 answers are replayed without a body; a streamed body (write after awaits) byte for byte`, () =>
    withApp(express, (app, st) => {
      app.post('/204', (req, res) => { st.calls++; res.status(204).end() })
      app.post('/304', (req, res) => { st.calls++; res.status(304).end() })
      app.post('/stream', async (req, res) => {
        st.calls++
        res.setHeader('content-type', 'application/octet-stream')
        const b = Buffer.alloc(3)
        for (let i = 0; i < 5; i++) {
          b.fill(i)
          res.write(b) // the same buffer, reused
          await sleep(2)
        }
        res.end(new Uint8Array([9, 9]))
      })
    }, async (u, st) => {
      for (const p of ['/204', '/304', '/stream']) {
        const id = key()
        const a = await post(`${u}${p}`, id)
        const b = await post(`${u}${p}`, id)
        assert.deepEqual({ ...b, replayed: undefined }, { ...a, replayed: undefined }, p)
      }
      assert.equal(st.calls, 4, '304 is not stored: it runs again')
    }, { mw: { storedHeaders: ['content-type'] } }))
}
