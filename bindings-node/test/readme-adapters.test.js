'use strict'
// The server adapter and fetch examples of bindings-node/README.md are executed as written; a
// failed console.assert fails the test.
const test = require('node:test')
const assert = require('node:assert/strict')
const fs = require('node:fs')
const path = require('node:path')
const { spawnSync } = require('node:child_process')

const pkg = path.join(__dirname, '..')
const readme = fs.readFileSync(path.join(pkg, 'README.md'), 'utf8')

function section() {
  const start = readme.indexOf('\n## Server adapters')
  assert.ok(start >= 0, 'README.md has a "## Server adapters" section')
  const rest = readme.slice(start + 1)
  return rest.slice(0, rest.indexOf('\n## ', 4))
}

const blocks = [...section().matchAll(/```js\n([\s\S]*?)```/g)].map((m) => m[1])

test('the README has the Express, Fastify, grpc-js and fetch examples', () => {
  assert.equal(blocks.length, 4)
  assert.match(blocks[0], /oncely\/express/)
  assert.match(blocks[1], /oncely\/fastify/)
  assert.match(blocks[2], /oncely\/grpc/)
  assert.match(blocks[3], /oncely\/fetch/)
})

for (const [i, code] of blocks.entries()) {
  test(`README server adapter example ${i + 1}`, () => {
    const r = spawnSync(process.execPath, ['-e', code], { cwd: pkg, encoding: 'utf8', timeout: 60_000 })
    assert.equal(r.status, 0, `exit ${r.status}\n${r.stdout}\n${r.stderr}`)
    assert.ok(!/Assertion failed/.test(r.stderr), r.stderr)
  })
}
