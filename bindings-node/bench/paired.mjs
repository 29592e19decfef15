// Times scenarios side by side on a shared machine whose speed drifts (other builds, the
// hypervisor): each scenario runs a batch of requests in turn, cycle after cycle in a
// rotated order, and what a scenario adds to the baseline is the median over cycles of
// its batch mean minus the baseline's batch mean in the same cycle. A drift slower than a
// cycle weighs on both sides of each difference alike; a batch mean (not a median
// request) keeps the garbage collector's share of each scenario in it.

const median = (xs) => [...xs].sort((a, b) => a - b)[xs.length >> 1]

/**
 * `scenarios`: `{ name: () => Promise }` (one request each); `base`: the baseline's name,
 * or a function giving each scenario's baseline by its name.
 * Gives `{ name: { us, cpu, added, addedCpu } }`: medians over cycles of the batch mean
 * (µs per request), of the process's CPU time per request (user + system, all threads),
 * and of their differences to the baseline's.
 */
export async function paired(scenarios, { base, cycles, batch, warm = 300 }) {
  const names = Object.keys(scenarios)
  for (const n of names) for (let i = 0; i < warm; i++) await scenarios[n]()
  const us = Object.fromEntries(names.map((n) => [n, []]))
  const cpu = Object.fromEntries(names.map((n) => [n, []]))
  for (let c = 0; c < cycles; c++) {
    for (let j = 0; j < names.length; j++) {
      const n = names[(j + c) % names.length]
      const one = scenarios[n]
      const u = process.cpuUsage()
      const t = process.hrtime.bigint()
      for (let i = 0; i < batch; i++) await one()
      us[n].push(Number(process.hrtime.bigint() - t) / 1000 / batch)
      const d = process.cpuUsage(u)
      cpu[n].push((d.user + d.system) / batch)
    }
  }
  const diff = (xs, b) => median(xs.map((x, c) => x - b[c]))
  const baseOf = typeof base === 'function' ? base : () => base
  return Object.fromEntries(
    names.map((n) => {
      const b = baseOf(n)
      return [n, { us: median(us[n]), cpu: median(cpu[n]), added: diff(us[n], us[b]), addedCpu: diff(cpu[n], cpu[b]) }]
    }),
  )
}
