'use strict'
// Other plugins' hooks around oncely's callback-style preHandler.
const test = require('node:test')
const assert = require('node:assert/strict')
const { IdempotencyStore } = require('oncely')
const { FASTIFIES, idempotency, within, listen, post } = require('./fastify-helpers.js')

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
const tag = ''

async function app3(Fastify, setup, route, options = {}) {
  const app = Fastify()
  let calls = 0
  await setup(app, 'before')
  await app.register(idempotency, { store: new IdempotencyStore(), ...options })
  await setup(app, 'after')
  app.post('/r', route.opts ?? {}, route.h ?? (async (req, reply) => { calls++; await sleep(40); reply.code(201); return { ok: calls } }))
  const url = await listen(app)
  return { app, url, calls: () => calls }
}

async function trio(url, key, body) {
  const a = post(url, '/r', key, body)
  await sleep(10)
  const b = post(url, '/r', key, body)
  const r = await within(Promise.all([a, b]), 3000)
  assert.notEqual(r, 'hang', 'hung')
  const c = await within(post(url, '/r', key, body), 3000)
  assert.notEqual(c, 'hang', 'hung')
  return [...r, c]
}

const NEIGHBOURS = {
  'callback preHandler before': (app, w) => w === 'before' && app.addHook('preHandler', (q, r, done) => setImmediate(done)),
  'async preHandler before': (app, w) => w === 'before' && app.addHook('preHandler', async () => { await sleep(1) }),
  'callback preHandler after': (app, w) => w === 'after' && app.addHook('preHandler', (q, r, done) => setImmediate(done)),
  'async preHandler after': (app, w) => w === 'after' && app.addHook('preHandler', async () => { await sleep(1) }),
  'preHandler after replies 401 (callback)': (app, w) => w === 'after' && app.addHook('preHandler', (q, r, done) => { setTimeout(() => r.code(401).send({ no: 1 }), 30) }),
  'preHandler after replies 401 (async)': (app, w) => w === 'after' && app.addHook('preHandler', async (q, r) => { await sleep(30); return r.code(401).send({ no: 1 }) }),
  'preHandler after throws sync': (app, w) => w === 'after' && app.addHook('preHandler', (q, r, done) => { throw new Error('sync hook') }),
  'preHandler after done(err)': (app, w) => w === 'after' && app.addHook('preHandler', (q, r, done) => setTimeout(() => done(new Error('cb hook')), 30)),
  'onRequest after replies early': (app, w) => w === 'after' && app.addHook('onRequest', async (q, r) => r.code(403).send({ early: 1 })),
  'preValidation replies early': (app, w) => w === 'after' && app.addHook('preValidation', (q, r, done) => r.code(418).send({ tea: 1 })),
  'setErrorHandler replies 422': (app, w) => w === 'before' && app.setErrorHandler((e, q, r) => r.code(422).send({ handled: e.message })),
}

for (const [major, Fastify] of Object.entries(FASTIFIES)) {
  for (const [name, setup] of Object.entries(NEIGHBOURS)) {
    test(`${major}${tag}: ${name}`, async () => {
      const route = name.startsWith('setErrorHandler') ? { h: async () => { await sleep(40); throw new Error('handler') } } : {}
      const s = await app3(Fastify, setup, route)
      try {
        const [a, b, c] = await trio(s.url, `hook-${name.replace(/\W/g, '')}`)
        assert.ok(s.calls() <= 1, `handler ran ${s.calls()} times`)
        // Whatever the first answer, a duplicate during and a retry after see the same status and body
        // when it was stored, or their own fresh answer when it was not.
        for (const x of [b, c]) {
          if (x.headers.get('idempotent-replayed') === 'true') {
            assert.equal(x.status, a.status)
            assert.deepEqual(x.body, a.body)
          } else {
            assert.equal(x.status, a.status, `${x.status} ${x.text} vs ${a.status} ${a.text}`)
          }
        }
      } finally {
        await s.app.close()
      }
    })
  }

  test(`${major}${tag}: schema validation failure (400 before preHandler) does not take the key; HEAD and GET pass through`, async () => {
    const s = await app3(Fastify, (app, w) => w === 'before' && app.get('/g', async () => ({ g: 1 })), { opts: { schema: { body: { type: 'object', required: ['x'], properties: { x: { type: 'integer' } } } } } })
    try {
      const bad = await within(post(s.url, '/r', 'schema-key-1', '{"a":1}'), 2000)
      assert.equal(bad.status, 400)
      const good = await within(post(s.url, '/r', 'schema-key-2', '{"x":1}'), 2000)
      assert.equal(good.status, 201)
      const again = await within(post(s.url, '/r', 'schema-key-2', '{"x":1}'), 2000)
      assert.equal(again.headers.get('idempotent-replayed'), 'true')
      const bad2 = await within(post(s.url, '/r', 'schema-key-1', '{"x":1}'), 2000)
      assert.equal(bad2.status, 201, 'a key refused by validation is free')
      const head = await within(post(s.url, '/g', 'head-key-1', undefined, { method: 'HEAD' }), 2000)
      assert.equal(head.status, 200)
    } finally {
      await s.app.close()
    }
  })

  test(`${major}${tag}: a tenant function that throws is a 500, not a hang or crash; a later request works`, async () => {
    let boom = true
    const s = await app3(Fastify, () => {}, {}, { tenant: () => { if (boom) throw new Error('tenant'); return 't' } })
    try {
      const r = await within(post(s.url, '/r', 'tenant-key-1'), 2000)
      assert.equal(r.status, 500)
      boom = false
      const ok = await within(post(s.url, '/r', 'tenant-key-1'), 2000)
      assert.equal(ok.status, 201)
    } finally {
      await s.app.close()
    }
  })
}
