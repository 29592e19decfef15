'use strict'
// Every subpath export (oncely, oncely/express, /fastify, /grpc, /fetch) points at files
// the published package holds, loads as CommonJS and as an ES module, and loads without
// its framework (the frameworks are optional peer dependencies).
const test = require('node:test')
const assert = require('node:assert/strict')
const path = require('node:path')
const { spawnSync } = require('node:child_process')

const pkg = path.join(__dirname, '..')
const manifest = require('../package.json')

test('npm pack holds every file the exports name', () => {
  const npm = process.platform === 'win32' ? 'npm.cmd' : 'npm'
  const r = spawnSync(npm, ['pack', '--dry-run', '--json', '--ignore-scripts', '--loglevel=error'], { cwd: pkg, encoding: 'utf8' })
  assert.equal(r.status, 0, r.stderr)
  const files = new Set(JSON.parse(r.stdout)[0].files.map((f) => f.path))
  for (const [sub, target] of Object.entries(manifest.exports)) {
    for (const file of typeof target === 'string' ? [target] : Object.values(target)) {
      assert.ok(files.has(file.replace(/^\.\//, '')), `${sub}: ${file} is not in the package`)
    }
  }
  assert.ok(files.has('adapter.js'))
})

test('the adapters load as CommonJS and ES modules without their frameworks', () => {
  // A resolver hook that hides the frameworks, as in a project that does not install them.
  const hide = "const M = require('node:module'); const r = M._resolveFilename; M._resolveFilename = function (req, ...a) { if (/^(express|express4|fastify|@grpc\\/grpc-js)$/.test(req)) throw Object.assign(new Error('not installed: ' + req), { code: 'MODULE_NOT_FOUND' }); return r.call(this, req, ...a) };"
  const names = { 'oncely/express': 'idempotency', 'oncely/fastify': 'idempotency', 'oncely/grpc': 'withIdempotency', 'oncely/fetch': 'idempotentFetch' }
  for (const [sub, name] of Object.entries(names)) {
    const cjs = spawnSync(process.execPath, ['-e', `${hide} console.log(typeof require('${sub}').${name})`], { cwd: pkg, encoding: 'utf8' })
    assert.equal(cjs.status, 0, cjs.stderr)
    assert.equal(cjs.stdout.trim(), 'function', sub)
    const esm = spawnSync(process.execPath, ['--input-type=module', '-e', `import { ${name} } from '${sub}'; console.log(typeof ${name})`], { cwd: pkg, encoding: 'utf8' })
    assert.equal(esm.status, 0, esm.stderr)
    assert.equal(esm.stdout.trim(), 'function', sub)
  }
})

test('each ES module entry exports exactly the names of its CommonJS module', async () => {
  for (const entry of ['index', 'express', 'fastify', 'grpc', 'fetch']) {
    const cjs = require(`../${entry}.js`)
    const esm = await import(path.join(pkg, `${entry}.mjs`))
    // `default`: the whole module for index, the plugin for fastify (as `cjs.default`).
    const named = Object.keys(esm).filter((k) => k !== 'default').sort()
    const own = Object.keys(cjs).filter((k) => k !== 'default').sort()
    assert.deepEqual(named, own, `${entry}.mjs and ${entry}.js export different names`)
    for (const k of named) assert.equal(esm[k], cjs[k], `${entry}.mjs: ${k} is not the CommonJS object`)
    if ('default' in cjs) assert.equal(esm.default, cjs.default, `${entry}.mjs: default`)
  }
})
