'use strict'
// Raw POST /r requests with an Idempotency-Key (node:http), for tests that cut or leave
// connections: what `fetch` hides (a reset, a cut mid-answer) is part of the answer here.
const nodeHttp = require('node:http')

function request(port, key, agent) {
  return nodeHttp.request({ host: '127.0.0.1', port, method: 'POST', path: '/r', agent, headers: { 'idempotency-key': key, 'content-type': 'text/plain' } })
}

/**
 * One POST /r (a fresh connection, unless `agent`): `{ status, headers, body }`, `error CODE`
 * when the connection is cut, or `no answer` after 3 s.
 */
function post(port, key, agent = false) {
  return new Promise((resolve) => {
    const req = request(port, key, agent)
    const timer = setTimeout(() => {
      resolve('no answer')
      req.destroy()
    }, 3_000)
    req.on('close', () => clearTimeout(timer))
    req.on('response', (res) => {
      const got = []
      res.on('data', (d) => got.push(d))
      res.on('end', () => resolve({ status: res.statusCode, headers: res.headers, body: Buffer.concat(got).toString() }))
      // Cut after the answer began.
      res.on('error', (e) => resolve(`error ${e.code} after ${JSON.stringify(Buffer.concat(got).toString())}`))
    })
    req.on('error', (e) => resolve(`error ${e.code}`))
    req.end('x')
  })
}

/** A POST /r whose client goes away after 50 ms, before the answer. */
function postAndLeave(port, key) {
  return new Promise((resolve) => {
    const req = request(port, key, false)
    req.on('error', () => {})
    req.on('close', resolve)
    req.end('x')
    setTimeout(() => req.destroy(), 50)
  })
}

module.exports = { post, postAndLeave }
