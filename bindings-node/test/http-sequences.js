'use strict'
// Runs the "sequence" cases of tests/vectors/http_server.json (see tests/vectors/README.md)
// against a real server on 127.0.0.1 with fetch. `start(config)` starts a server
// configured by the case and resolves with `{ url, calls(), close() }`.
const assert = require('node:assert/strict')
const fs = require('node:fs')
const path = require('node:path')

const cases = JSON.parse(
  fs.readFileSync(path.join(__dirname, '..', '..', 'tests', 'vectors', 'http_server.json'), 'utf8'),
)
const sequences = cases.filter((c) => c.op === 'sequence')

/** The options of the adapter for a case's `config`; the tenant from `x-tenant`. */
function adapterOptions(config, store) {
  return {
    store,
    tenant: (req) => req.headers['x-tenant'] ?? 'default',
    methods: config.methods,
    required: config.required,
    wait: config.wait,
    bodyCap: config.body_cap,
    storedHeaders: config.stored_headers,
  }
}

/** The test handler's answer to call `n` (status, headers, body) for a request. */
async function answer(n, respondHeader) {
  const respond = respondHeader ? JSON.parse(respondHeader) : {}
  if (respond.delay_ms) await new Promise((r) => setTimeout(r, respond.delay_ms))
  const headers = { etag: `"call-${n}"`, 'x-call': String(n), 'set-cookie': `call=${n}` }
  let body
  if (respond.bytes !== undefined) {
    headers['content-type'] = 'text/plain'
    body = Buffer.alloc(respond.bytes, 'x')
  } else {
    headers['content-type'] = 'application/json'
    body = Buffer.from(JSON.stringify({ call: n }))
  }
  return { status: respond.status ?? 201, headers, body }
}

async function send(url, r) {
  const headers = { ...r.headers }
  if (r.respond) headers['x-respond'] = JSON.stringify(r.respond)
  const res = await fetch(url + r.path, {
    method: r.method,
    headers,
    body: r.method === 'GET' || r.method === 'HEAD' ? undefined : r.body,
  })
  return { status: res.status, headers: res.headers, body: Buffer.from(await res.arrayBuffer()) }
}

function check(got, e, what) {
  assert.equal(got.status, e.status, `${what}: status`)
  if (e.replayed !== undefined) {
    assert.equal(got.headers.get('idempotent-replayed'), e.replayed ? 'true' : null, `${what}: replayed`)
  }
  if (e.call !== undefined) {
    if (e.body_len !== undefined) {
      assert.equal(got.body.length, e.body_len, `${what}: body length`)
      assert.equal(got.headers.get('etag'), `"call-${e.call}"`, `${what}: etag`)
    } else {
      assert.deepEqual(JSON.parse(got.body.toString()), { call: e.call }, `${what}: call`)
    }
  }
  if (e.problem !== undefined) {
    assert.match(got.headers.get('content-type'), /^application\/problem\+json/, `${what}: problem type`)
    const p = JSON.parse(got.body.toString())
    assert.equal(p.type, e.problem, `${what}: problem`)
    assert.equal(p.status, e.status, `${what}: problem status`)
  }
  for (const [name, value] of Object.entries(e.headers ?? {})) {
    assert.equal(got.headers.get(name), value, `${what}: header ${name}`)
  }
}

async function runSequence(c, start) {
  const server = await start(c.config)
  try {
    let background
    for (const [i, step] of c.steps.entries()) {
      const what = `${c.comment}, step ${i}`
      if (step.concurrent) {
        const all = await Promise.all(Array.from({ length: step.concurrent }, () => send(server.url, step.request)))
        let replays = 0
        for (const got of all) {
          const { replayed_count: _n, ...e } = step.expect
          check(got, e, what)
          if (got.headers.get('idempotent-replayed') === 'true') replays++
        }
        assert.equal(replays, step.expect.replayed_count, `${what}: replayed count`)
      } else if (step.background) {
        background = send(server.url, step.background)
      } else if (step.await_background) {
        check(await background, step.expect, what)
      } else if (step.wait_handler_calls !== undefined) {
        const until = Date.now() + 10_000
        while (server.calls() < step.wait_handler_calls) {
          assert.ok(Date.now() < until, `${what}: the handler was not called ${step.wait_handler_calls} times`)
          await new Promise((r) => setTimeout(r, 5))
        }
      } else {
        check(await send(server.url, step.request), step.expect, what)
      }
    }
    assert.equal(server.calls(), c.handler_calls, `${c.comment}: handler calls`)
  } finally {
    await server.close()
  }
}

module.exports = { sequences, adapterOptions, answer, runSequence, send }
