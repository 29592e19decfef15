'use strict'
// Shared by the fastify-*.test.js suites: Fastify 5 and 4, a listening app, fetch.
const FASTIFIES = { 'fastify 5': require('fastify'), 'fastify 4': require('fastify4') }
const { idempotency } = require('oncely/fastify')

function within(p, ms) {
  let t
  return Promise.race([p, new Promise((r) => { t = setTimeout(() => r('hang'), ms) })]).finally(() => clearTimeout(t))
}

async function listen(app) {
  await app.listen({ port: 0, host: '127.0.0.1' })
  return `http://127.0.0.1:${app.server.address().port}`
}

async function post(url, path, key, body = '{"a":1}', extra = {}) {
  const r = await fetch(url + path, {
    method: extra.method ?? 'POST',
    headers: { 'idempotency-key': key, 'content-type': 'application/json', ...(extra.headers ?? {}) },
    body: extra.method === 'HEAD' || extra.method === 'GET' ? undefined : body,
    signal: extra.signal,
  })
  const buf = Buffer.from(await r.arrayBuffer())
  return { status: r.status, headers: r.headers, body: buf, text: buf.toString() }
}

module.exports = { FASTIFIES, idempotency, within, listen, post }
