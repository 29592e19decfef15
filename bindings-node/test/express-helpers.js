'use strict'
// Shared by the Express adapter suites (adapters-*.test.js, reentry-adapters.test.js):
// Express 5 and 4, a listening app, and a keyed POST that tells a hang from an answer.
const EXPRESSES = { 'express 5': require('express'), 'express 4': require('express4') }

/** The app listening on a free port of 127.0.0.1: resolves with its server. */
function listen(app) {
  // The default error handler then answers 500 without logging the test's own errors.
  app.set('env', 'test')
  return new Promise((resolve) => {
    const server = app.listen(0, '127.0.0.1', () => resolve(server))
  })
}

/** Runs `run(url)` with the app listening (url without a path), then closes the server and its connections. */
async function serve(app, run) {
  const server = await listen(app)
  try {
    return await run(`http://127.0.0.1:${server.address().port}`)
  } finally {
    server.closeAllConnections()
    server.close()
  }
}

/**
 * A request with an idempotency key and a JSON body (POST only): its answer as
 * { status, body }, with `replayed` (the idempotent-replayed header) when asked for, or
 * 'hang' when none comes within `ms`. Any other failure is thrown.
 */
async function post(url, key, { method = 'POST', body = '{"item":1}', ms = 3000, replayed = false } = {}) {
  try {
    const r = await fetch(url, {
      method,
      headers: { 'idempotency-key': key, 'content-type': 'application/json' },
      body: method === 'POST' ? body : undefined,
      signal: AbortSignal.timeout(ms),
    })
    const answer = { status: r.status, body: await r.text() }
    if (replayed) answer.replayed = r.headers.get('idempotent-replayed') === 'true'
    return answer
  } catch (e) {
    if (e.name === 'TimeoutError') return 'hang'
    throw e
  }
}

module.exports = { EXPRESSES, serve, post }
