'use strict'
// The common handler shapes and hook neighbours, each with a lead, a concurrent
// duplicate and a later retry over a real listen + fetch.
const test = require('node:test')
const assert = require('node:assert/strict')
const { Readable } = require('node:stream')
const { IdempotencyStore } = require('oncely')
const { FASTIFIES, idempotency, within, listen, post } = require('./fastify-helpers.js')

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
const tag = ''

// name → [route options, handler(calls) factory, expectation]
const CASES = {
  'sync handler reply.send object': { h: (n) => (req, reply) => { setTimeout(() => reply.code(201).header('x-n', String(n())).send({ n: 1 }), 40) }, stored: true },
  'sync handler immediate reply.send string': { h: (n) => (req, reply) => { n(); reply.code(201).header('x-a', 'b').type('text/plain').send('plain') }, stored: true, noDup: true },
  'async handler returning object': { h: (n) => async (req, reply) => { n(); await sleep(40); reply.code(201); return { ok: true } }, stored: true },
  'reply.send Buffer': { h: (n) => async (req, reply) => { n(); await sleep(40); reply.type('application/octet-stream').send(Buffer.from([0, 1, 2, 255, 254])); return reply }, stored: true },
  'reply.send set-cookie x2': { h: (n) => async (req, reply) => { n(); await sleep(40); reply.header('set-cookie', ['a=1', 'b=2']).header('x-multi', 'q'); return 'ok' }, stored: true },
  'sync throw': { h: (n) => (req, reply) => { n(); throw new Error('boom') }, stored: false, noDup: true },
  'async throw': { h: (n) => async () => { n(); await sleep(40); throw new Error('boom') }, stored: false },
  'stream body': { h: (n) => async (req, reply) => { n(); await sleep(40); reply.type('text/plain'); return reply.send(Readable.from(['a', 'b'])) }, stored: false },
  '204': { h: (n) => async (req, reply) => { n(); await sleep(40); reply.code(204).send(); return reply }, stored: true },
  '304': { h: (n) => async (req, reply) => { n(); await sleep(40); reply.code(304).send(); return reply }, stored: false },
  'hijack': { h: (n) => async (req, reply) => { n(); reply.hijack(); await sleep(40); reply.raw.writeHead(200, { 'content-type': 'text/plain' }); reply.raw.end('raw') }, stored: false },
  'opt out': { opts: { config: { idempotency: false } }, h: (n) => async () => { n(); await sleep(40); return { ok: 1 } }, stored: false, optOut: true },
}

/**
 * Runs `run(url, st)` against a listening app with the plugin (a fresh store, and
 * `plugin` options) and POST /r (`route` options, `handler(st)`, st.calls counting its
 * runs); closes the app after.
 */
async function withApp(Fastify, { plugin, route = {}, handler }, run) {
  const app = Fastify()
  await app.register(idempotency, { store: new IdempotencyStore(), ...plugin })
  const st = { calls: 0 }
  app.post('/r', route, handler(st))
  const url = await listen(app)
  try {
    await run(url, st)
  } finally {
    await app.close()
  }
}

for (const [major, Fastify] of Object.entries(FASTIFIES)) {
  for (const [name, c] of Object.entries(CASES)) {
    test(`${major}${tag}: ${name}: lead + concurrent duplicate + retry`, () =>
      withApp(Fastify, { route: c.opts, handler: (st) => c.h(() => ++st.calls) }, async (url, st) => {
        const key = `matrix-${name.replace(/\W/g, '')}-${major.slice(-1)}`
        const a = post(url, '/r', key)
        await sleep(10)
        const b = post(url, '/r', key)
        const r = await within(Promise.all([a, b]), 4000)
        assert.notEqual(r, 'hang', 'a request hung')
        const [ra, rb] = r
        const rc = await within(post(url, '/r', key), 4000)
        assert.notEqual(rc, 'hang')
        if (c.optOut) {
          assert.equal(st.calls, 3)
          return
        }
        if (c.stored) {
          assert.equal(st.calls, 1, 'handler ran more than once')
          for (const x of [rb, rc]) {
            assert.equal(x.status, ra.status)
            assert.deepEqual(x.body, ra.body)
            assert.equal(x.headers.get('idempotent-replayed'), 'true')
            assert.equal(x.headers.get('content-type'), ra.headers.get('content-type'))
            assert.equal(x.headers.get('set-cookie'), null)
          }
        } else {
          // Not stored: the retry after runs again; a concurrent duplicate replays (shared) or runs again.
          assert.ok(st.calls >= 2 && st.calls <= 3, `calls ${st.calls}`)
          assert.equal(rc.headers.get('idempotent-replayed'), null)
        }
        if (name === 'hijack') assert.equal(ra.text, 'raw')
        if (name === 'stream body') assert.equal(ra.text, 'ab')
      }))
  }

  test(`${major}${tag}: 200 concurrent duplicates, sync handler, one run, identical replays`, () =>
    withApp(Fastify, {
      handler: (st) => (req, reply) => { st.calls++; setTimeout(() => reply.code(201).header('x-q', 'z').send({ n: st.calls, big: 'x'.repeat(3000) }), 60) },
    }, async (url, st) => {
      const all = await within(Promise.all(Array.from({ length: 200 }, () => post(url, '/r', 'conc-200-key'))), 10000)
      assert.notEqual(all, 'hang')
      assert.equal(st.calls, 1)
      for (const r of all) {
        assert.equal(r.status, 201)
        assert.deepEqual(r.body, all[0].body)
      }
      assert.equal(all.filter((r) => r.headers.get('idempotent-replayed') === 'true').length, 199)
    }))

  test(`${major}${tag}: wait:false duplicate gets 409 at once; fingerprint mismatch 422; leader intact`, () =>
    withApp(Fastify, {
      plugin: { wait: false },
      handler: (st) => async () => { st.calls++; await sleep(80); return { ok: 1 } },
    }, async (url, st) => {
      const a = post(url, '/r', 'nowait-key-1')
      await sleep(15)
      const b = await within(post(url, '/r', 'nowait-key-1'), 2000)
      const m = await within(post(url, '/r', 'nowait-key-1', '{"a":2}'), 2000)
      const ra = await within(a, 2000)
      assert.equal(ra.status, 200)
      assert.equal(b.status, 409, b.text)
      assert.ok([409, 422].includes(m.status), `${m.status}`)
      const after = await post(url, '/r', 'nowait-key-1', '{"a":2}')
      assert.equal(after.status, 422, after.text)
      assert.equal(st.calls, 1)
    }))

  test(`${major}${tag}: a waiter whose client aborts does not hang or run the handler; others replay`, () =>
    withApp(Fastify, {
      handler: (st) => async () => { st.calls++; await sleep(150); return { ok: 1 } },
    }, async (url, st) => {
      const a = post(url, '/r', 'abort-key-1')
      await sleep(20)
      const ac = new AbortController()
      const b = post(url, '/r', 'abort-key-1', '{"a":1}', { signal: ac.signal }).catch((e) => e.name)
      await sleep(20)
      ac.abort()
      const c = post(url, '/r', 'abort-key-1')
      const r = await within(Promise.all([a, b, c]), 3000)
      assert.notEqual(r, 'hang')
      assert.equal(r[1], 'AbortError')
      assert.equal(r[2].headers.get('idempotent-replayed'), 'true')
      assert.equal(st.calls, 1)
    }))
}
