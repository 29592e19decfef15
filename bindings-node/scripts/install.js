#!/usr/bin/env node
// npm's `install` step: makes sure a native addon for this machine is there, building
// it from the Rust sources (cargo must be installed) when it is missing. With the
// package's devDependencies present (a checkout), it runs `npm run build` (the napi
// CLI, which also regenerates native.js and native.d.ts); installed as a dependency
// (`npm install ./bindings-node`), where devDependencies are absent, it runs cargo
// directly and copies the library to the file name native.js loads.
'use strict'
const { execFileSync, spawnSync } = require('node:child_process')
const fs = require('node:fs')
const path = require('node:path')

const root = path.resolve(__dirname, '..')

function loadable() {
  try {
    require(path.join(root, 'native.js'))
    return true
  } catch {
    return false
  }
}

function run(cmd, args) {
  const r = spawnSync(cmd, args, { cwd: root, stdio: 'inherit', shell: process.platform === 'win32' })
  if (r.error) throw r.error
  if (r.status !== 0) throw new Error(`${cmd} ${args.join(' ')} exited with ${r.status}`)
}

// The napi CLI's name for this platform (`linux-x64-gnu`, `darwin-arm64`, …).
function platformName(hostTriple) {
  const [archPart, ...rest] = hostTriple.split('-')
  const arch = { x86_64: 'x64', aarch64: 'arm64', i686: 'ia32', armv7: 'arm', riscv64gc: 'riscv64', s390x: 's390x', powerpc64le: 'ppc64' }[archPart] ?? archPart
  const sys = rest.join('-')
  if (sys.includes('darwin')) return `darwin-${arch}`
  if (sys.includes('windows')) return `win32-${arch}-${sys.endsWith('gnu') ? 'gnu' : 'msvc'}`
  if (sys.includes('freebsd')) return `freebsd-${arch}`
  if (sys.includes('android')) return `android-${arch}`
  const abi = sys.split('-').pop()
  return `linux-${arch}-${abi === 'gnueabihf' ? 'gnueabihf' : abi.startsWith('musl') ? 'musl' : 'gnu'}`
}

function buildWithCargo() {
  const host = /host: (\S+)/.exec(execFileSync('rustc', ['-vV'], { encoding: 'utf8' }))[1]
  const out = execFileSync(
    'cargo',
    ['build', '--release', '--lib', '--message-format=json-render-diagnostics', '--manifest-path', path.join(root, 'Cargo.toml')],
    { cwd: root, encoding: 'utf8', stdio: ['ignore', 'pipe', 'inherit'], maxBuffer: 256 << 20 },
  )
  let lib
  for (const line of out.split('\n')) {
    if (!line.startsWith('{')) continue
    const msg = JSON.parse(line)
    if (msg.reason === 'compiler-artifact' && msg.target.name === 'oncely_node' && msg.target.kind.includes('cdylib')) {
      lib = msg.filenames.find((f) => /\.(so|dylib|dll)$/.test(f))
    }
  }
  if (!lib) throw new Error('cargo did not report the oncely_node library')
  fs.copyFileSync(lib, path.join(root, `oncely.${platformName(host)}.node`))
}

if (loadable()) process.exit(0)
let hasCli = false
try {
  require.resolve('@napi-rs/cli/package.json', { paths: [root] })
  hasCli = true
} catch {}
console.error(`oncely: no native addon for ${process.platform}-${process.arch}; building it with ${hasCli ? 'the napi CLI' : 'cargo'} (needs a Rust toolchain)`)
try {
  if (hasCli) run('npm', ['run', 'build'])
  else buildWithCargo()
} catch (e) {
  console.error(`oncely: building the native addon failed: ${e.message}`)
  process.exit(1)
}
if (!loadable()) {
  console.error('oncely: the native addon was built but cannot be loaded')
  process.exit(1)
}
