// The overhead per request of oncely/express and oncely/fastify, each against the same
// app without it (Express behind express.json(), Fastify with its JSON parser), in one
// run: real HTTP on 127.0.0.1 (keep-alive, one request at a time), the scenarios taking
// turns in batches (paired.mjs), so the difference to the bare app is what the adapter
// adds. `node bench/adapters.mjs [--quick]`.
import http from 'node:http'
import express from 'express'
import Fastify from 'fastify'
import { IdempotencyStore, newKey } from 'oncely'
import { idempotency } from 'oncely/express'
import { idempotency as fastifyIdempotency } from 'oncely/fastify'
import { paired } from './paired.mjs'

const quick = process.argv.includes('--quick')
const CYCLES = quick ? 10 : 50
const BATCH = 200
const agent = new http.Agent({ keepAlive: true, maxSockets: 1 })

function app(withMiddleware) {
  const a = express()
  const handler = (req, res) => res.status(201).json({ id: 1, sku: req.body.sku })
  // Both read and parse the body, as an endpoint taking JSON does.
  if (withMiddleware) a.post('/orders', express.json(), idempotency({ store: new IdempotencyStore({ ttlMs: 600_000 }) }), handler)
  else a.post('/orders', express.json(), handler)
  return new Promise((resolve) => {
    const s = a.listen(0, '127.0.0.1', () => resolve(s))
  })
}

function post(port, key) {
  return new Promise((resolve, reject) => {
    const req = http.request(
      { host: '127.0.0.1', port, method: 'POST', path: '/orders', agent, headers: { 'idempotency-key': key, 'content-type': 'application/json', 'content-length': 12 } },
      (res) => {
        res.resume()
        res.on('end', resolve)
      },
    )
    req.on('error', reject)
    req.end('{"sku":"A1"}')
  })
}

async function fastifyApp(withPlugin) {
  const f = Fastify()
  if (withPlugin) await f.register(fastifyIdempotency, { store: new IdempotencyStore({ ttlMs: 600_000 }) })
  f.post('/orders', async (req, reply) => reply.code(201).send({ id: 1, sku: req.body.sku }))
  await f.listen({ port: 0, host: '127.0.0.1' })
  return f.server
}

const servers = {
  express: { bare: await app(false), guarded: await app(true) },
  fastify: { bare: await fastifyApp(false), guarded: await fastifyApp(true) },
}
const replayKey = newKey()
const scenarios = {}
for (const [name, { bare, guarded }] of Object.entries(servers)) {
  scenarios[`${name} bare`] = () => post(bare.address().port, replayKey)
  scenarios[`${name} first`] = () => post(guarded.address().port, newKey())
  scenarios[`${name} replay`] = () => post(guarded.address().port, replayKey)
}
// The scenarios take turns in batches (see paired.mjs): load from outside the run weighs
// on each scenario and its baseline alike.
const out = await paired(scenarios, { base: (n) => `${n.split(' ')[0]} bare`, cycles: CYCLES, batch: BATCH, warm: 500 })
console.log(`| adapter | scenario | µs per request | added | CPU µs per request | added |  (medians over ${CYCLES} cycles of ${BATCH} requests per scenario)`)
console.log('|---|---|---|---|---|---|')
const signed = (v) => `${v >= 0 ? '+' : ''}${v.toFixed(1)}`
for (const name of Object.keys(servers)) {
  const b = out[`${name} bare`]
  console.log(`| ${name} | without the adapter | ${b.us.toFixed(1)} | | ${b.cpu.toFixed(1)} | |`)
  for (const k of ['first', 'replay']) {
    const r = out[`${name} ${k}`]
    console.log(`| oncely/${name} | ${k === 'first' ? 'first call (new key)' : 'replay (same key)'} | ${r.us.toFixed(1)} | ${signed(r.added)} | ${r.cpu.toFixed(1)} | ${signed(r.addedCpu)} |`)
  }
}
for (const { bare, guarded } of Object.values(servers)) {
  bare.close()
  guarded.close()
}
agent.destroy()
