'use strict'
// The README's Node example is executed as written (CommonJS) and as an ES module
// (its `require` turned into `import`); a failed console.assert fails the test.
const test = require('node:test')
const assert = require('node:assert/strict')
const fs = require('node:fs')
const path = require('node:path')
const { spawnSync } = require('node:child_process')

const pkg = path.join(__dirname, '..')
const readme = fs.readFileSync(path.join(pkg, '..', 'README.md'), 'utf8')

function nodeSection() {
  const start = readme.indexOf('\n## Node\n')
  assert.ok(start >= 0, 'README.md has a "## Node" section')
  const rest = readme.slice(start + 1)
  const end = rest.indexOf('\n## ', 4)
  return end < 0 ? rest : rest.slice(0, end)
}

function blocks() {
  const out = []
  const re = /```(js|javascript|mjs|cjs)\n([\s\S]*?)```/g
  for (let m; (m = re.exec(nodeSection())); ) out.push({ lang: m[1], code: m[2] })
  assert.ok(out.length > 0, 'the Node section has a JavaScript example')
  return out
}

const isEsm = (code) => /^\s*import\s/m.test(code)

function toEsm(code) {
  return code.replace(
    /const\s+(\{[^}]*\})\s*=\s*require\((['"])oncely\2\);?/g,
    (_, names, q) => `import ${names} from ${q}oncely${q};`,
  )
}

function run(code, type) {
  // Run from inside the package: `oncely` resolves to it by its own name ("exports").
  const r = spawnSync(process.execPath, [`--input-type=${type}`, '-e', code], { cwd: pkg, encoding: 'utf8', timeout: 60_000 })
  assert.equal(r.status, 0, `exit ${r.status}\n${r.stdout}\n${r.stderr}`)
  assert.ok(!/Assertion failed/.test(r.stderr), r.stderr)
  return r
}

test('README Node example, CommonJS', () => {
  for (const b of blocks()) if (!isEsm(b.code)) run(b.code, 'commonjs')
})

test('README Node example, ES module', () => {
  for (const b of blocks()) run(isEsm(b.code) ? b.code : toEsm(b.code), 'module')
})

test('an example that fails is caught (the harness works)', () => {
  const bad = "const { Code } = require('oncely');\nconsole.assert(Code.OK === 1, 'wrong');\n"
  const r = spawnSync(process.execPath, ['-e', bad], { cwd: pkg, encoding: 'utf8' })
  assert.match(r.stderr, /Assertion failed/)
})
