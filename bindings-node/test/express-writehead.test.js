'use strict'
// oncely/express wraps res.writeHead only when no header was set before the lead (Node
// merges writeHead's headers into getHeaders() once one was). Each variant: the first
// answer's stored headers, status and body against the replay's.
const test = require('node:test')
const assert = require('node:assert/strict')
const http = require('node:http')
const { IdempotencyStore } = require('oncely')
const { idempotency } = require('oncely/express')

const EXPRESSES = { 'express 5': require('express'), 'express 4': require('express4') }
const STORED = ['content-type', 'x-a', 'x-b', 'x-list', 'location', 'etag']

function listen(app) {
  app.set('env', 'test')
  return new Promise((resolve) => {
    const server = app.listen(0, '127.0.0.1', () => resolve(server))
  })
}

function send(port, path, key, method = 'POST') {
  return new Promise((resolve, reject) => {
    const req = http.request({ host: '127.0.0.1', port, path, method, headers: { 'idempotency-key': key, 'content-type': 'application/json' }, timeout: 3000 }, (res) => {
      const chunks = []
      res.on('data', (c) => chunks.push(c))
      res.on('end', () => {
        const fields = []
        for (let i = 0; i < res.rawHeaders.length; i += 2) {
          const n = res.rawHeaders[i].toLowerCase()
          if (STORED.includes(n)) fields.push(`${n}: ${res.rawHeaders[i + 1]}`)
        }
        resolve({ status: res.statusCode, fields: fields.sort(), body: Buffer.concat(chunks).toString('latin1'), replayed: res.headers['idempotent-replayed'] })
      })
    })
    req.on('timeout', () => req.destroy(new Error('hang')))
    req.on('error', reject)
    req.end(method === 'POST' ? '{"a":1}' : undefined)
  })
}

const VARIANTS = {
  'writeHead(status, object)': (res) => {
    res.writeHead(201, { 'x-a': '1', 'content-type': 'text/plain' })
    res.end('hi')
  },
  'writeHead(status, reason, object)': (res) => {
    res.writeHead(201, 'Made', { 'x-a': '1', 'content-type': 'text/plain' })
    res.end('hi')
  },
  'writeHead(status, flat array with a repeated name)': (res) => {
    res.writeHead(201, ['x-a', '1', 'x-a', '2', 'content-type', 'text/plain'])
    res.end('hi')
  },
  'writeHead(status, object with an array value)': (res) => {
    res.writeHead(201, { 'x-list': ['1', '2'], 'content-type': 'text/plain' })
    res.end('hi')
  },
  'setHeader then writeHead overriding it (object)': (res) => {
    res.setHeader('x-a', '0')
    res.setHeader('x-b', 'kept')
    res.writeHead(201, { 'x-a': '1', 'content-type': 'text/plain' })
    res.end('hi')
  },
  'setHeader then writeHead overriding it (array)': (res) => {
    res.setHeader('x-a', '0')
    res.writeHead(201, ['x-a', '1', 'x-a', '2', 'content-type', 'text/plain'])
    res.end('hi')
  },
  'removeHeader(x-powered-by) then writeHead(object)': (res) => {
    res.removeHeader('x-powered-by')
    res.writeHead(201, { 'x-a': '1', 'content-type': 'text/plain' })
    res.end('hi')
  },
  'writeHead(object) then write() then end() after an await': async (res) => {
    await new Promise((r) => setTimeout(r, 5))
    res.writeHead(201, { 'x-a': '1', 'content-type': 'text/plain' })
    res.write('h')
    res.end(Buffer.from('i'))
  },
  'writeHead(201, object) with location and etag': (res) => {
    res.writeHead(201, { location: '/o/1', etag: '"v1"' })
    res.end()
  },
  'statusCode then writeHead(headers only as 2nd arg undefined)': (res) => {
    res.statusCode = 202
    res.setHeader('content-type', 'text/plain')
    res.writeHead(202)
    res.end('x')
  },
}

let n = 0
for (const [major, express] of Object.entries(EXPRESSES)) {
  for (const powered of [true, false]) {
    for (const [name, handle] of Object.entries(VARIANTS)) {
      test(`${major}, x-powered-by ${powered ? 'on' : 'off'}: ${name}: the replay has the first answer's status, stored headers and body`, async () => {
        const store = new IdempotencyStore()
        const app = express()
        if (!powered) app.disable('x-powered-by')
        let calls = 0
        app.use(idempotency({ store, storedHeaders: STORED }))
        app.post('/h', (req, res) => {
          calls++
          return handle(res)
        })
        const server = await listen(app)
        try {
          const port = server.address().port
          const key = `writehead-key-${n++}`
          const first = await send(port, '/h', key)
          const again = await send(port, '/h', key)
          assert.equal(calls, 1)
          assert.equal(again.replayed, 'true')
          assert.deepEqual({ ...again, replayed: undefined }, { ...first, replayed: undefined })
        } finally {
          server.closeAllConnections()
          server.close()
        }
      })
    }
  }
}
