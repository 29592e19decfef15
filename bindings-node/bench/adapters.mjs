// The overhead per request of oncely/express and oncely/fastify, each against the same
// app without it (Express behind express.json(), Fastify with its JSON parser), in one
// run: real HTTP on 127.0.0.1 (keep-alive, one request at a time), so the difference of
// the medians is what the adapter adds. `node bench/adapters.mjs [--quick]`.
import http from 'node:http'
import express from 'express'
import Fastify from 'fastify'
import { IdempotencyStore, newKey } from 'oncely'
import { idempotency } from 'oncely/express'
import { idempotency as fastifyIdempotency } from 'oncely/fastify'

const quick = process.argv.includes('--quick')
const N = quick ? 2_000 : 20_000
const ROUNDS = quick ? 3 : 5
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

// `[median µs per request, CPU µs per request]`: the CPU time (user + system) the process
// spent per request, client and server, is the second view of the same cost, less
// sensitive to the scheduling of a shared machine than the latency.
async function time(port, keyOf) {
  for (let i = 0; i < 500; i++) await post(port, keyOf(i))
  const each = new Float64Array(N)
  const cpu = process.cpuUsage()
  for (let i = 0; i < N; i++) {
    const t = process.hrtime.bigint()
    await post(port, keyOf(i))
    each[i] = Number(process.hrtime.bigint() - t) / 1000
  }
  const used = process.cpuUsage(cpu)
  // The median request: robust to the stalls of a shared machine.
  return [[...each].sort((a, b) => a - b)[N >> 1], (used.user + used.system) / N]
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
const runs = {}
for (const [name, { bare, guarded }] of Object.entries(servers)) {
  runs[`${name} bare`] = () => time(bare.address().port, () => replayKey)
  runs[`${name} first`] = () => time(guarded.address().port, () => newKey())
  runs[`${name} replay`] = () => time(guarded.address().port, () => replayKey)
}
const names = Object.keys(runs)
const results = Object.fromEntries(names.map((k) => [k, []]))
// The scenarios take turns, in a rotated order each round, so that load from outside
// the run weighs on all of them alike.
for (let r = 0; r < ROUNDS; r++) {
  for (let j = 0; j < names.length; j++) {
    const k = names[(j + r) % names.length]
    results[k].push(await runs[k]())
  }
}
const median = (xs) => [...xs].sort((a, b) => a - b)[xs.length >> 1]
const of = (k, i) => median(results[k].map((r) => r[i]))
console.log(`| adapter | scenario | median µs per request (median of ${ROUNDS} runs × ${N}) | added | CPU µs per request | added |`)
console.log('|---|---|---|---|---|---|')
for (const name of Object.keys(servers)) {
  const b = of(`${name} bare`, 0)
  const bc = of(`${name} bare`, 1)
  console.log(`| ${name} | without the adapter | ${b.toFixed(1)} | | ${bc.toFixed(1)} | |`)
  for (const k of ['first', 'replay']) {
    const m = of(`${name} ${k}`, 0)
    const c = of(`${name} ${k}`, 1)
    console.log(`| oncely/${name} | ${k === 'first' ? 'first call (new key)' : 'replay (same key)'} | ${m.toFixed(1)} | ${(m - b).toFixed(1)} | ${c.toFixed(1)} | ${(c - bc).toFixed(1)} |`)
  }
}
for (const { bare, guarded } of Object.values(servers)) {
  bare.close()
  guarded.close()
}
agent.destroy()
