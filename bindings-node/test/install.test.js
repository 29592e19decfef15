'use strict'
// A new user's path: `npm install ./bindings-node` from another folder, then
// require('oncely') and import 'oncely' there.
const test = require('node:test')
const assert = require('node:assert/strict')
const fs = require('node:fs')
const os = require('node:os')
const path = require('node:path')
const { spawnSync } = require('node:child_process')

const pkg = path.join(__dirname, '..')

test('npm install <folder> from another folder; CommonJS and ESM both load', { timeout: 600_000 }, (t) => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'oncely-install-'))
  t.after(() => fs.rmSync(dir, { recursive: true, force: true }))
  const npm = process.platform === 'win32' ? 'npm.cmd' : 'npm'
  const r = spawnSync(npm, ['install', pkg, '--no-audit', '--no-fund', '--loglevel=error'], { cwd: dir, encoding: 'utf8' })
  assert.equal(r.status, 0, `${r.stdout}\n${r.stderr}`)
  const cjs = spawnSync(process.execPath, ['-e', "const o = require('oncely'); console.log(o.validateKey(o.newKey()).length)"], { cwd: dir, encoding: 'utf8' })
  assert.equal(cjs.status, 0, cjs.stderr)
  assert.equal(cjs.stdout.trim(), '36')
  const esm = spawnSync(
    process.execPath,
    ['--input-type=module', '-e', "import oncely, { retry, Code } from 'oncely'; console.log(await retry(async () => Code.UNAVAILABLE), typeof oncely.IdempotencyStore)"],
    { cwd: dir, encoding: 'utf8' },
  )
  assert.equal(esm.status, 0, esm.stderr)
  assert.equal(esm.stdout.trim(), '14 function')
})
