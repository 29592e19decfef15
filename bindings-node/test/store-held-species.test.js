'use strict'
// A lead's end may run user code (Node's AsyncLocalStorage.disable reads Array[Symbol.species]):
// a call of the same key from there joins the lead, whose value is already being stored;
// it never leads the key again. In a file of its own: it needs no other lead running.
const test = require('node:test')
const assert = require('node:assert/strict')
const { IdempotencyStore, http } = require('oncely')
const { RUN } = require('../lib/store.js')

let n = 0
const key = () => http.scope('t', 'POST', '/r', `rv-key-${n++}`)
const fp = 'f'.repeat(64)

test('RUN: user code run by a lead\'s end (Array[Symbol.species], read by acting.disable) calling the same key does not run the action again', () => {
  const store = new IdempotencyStore()
  const k = key()
  let runs = 0
  let armed = false
  let second
  const action = () => {
    runs++
    armed = runs === 1 // the next species read is the one in leadStops -> acting.disable
    return `v${runs}`
  }
  const desc = Object.getOwnPropertyDescriptor(Array, Symbol.species)
  Object.defineProperty(Array, Symbol.species, {
    configurable: true,
    get() {
      if (armed) {
        armed = false
        try {
          second = store[RUN](k, fp, action, true)
        } catch (e) {
          second = e
        }
      }
      return Array
    },
  })
  let first
  try {
    first = store[RUN](k, fp, action, true)
  } catch (e) {
    first = e
  } finally {
    Object.defineProperty(Array, Symbol.species, desc)
  }
  const show = (r) => (r instanceof Error ? `threw ${r.code}: ${r.message}` : r && `${r.source} ${r.value}`)
  assert.deepEqual({ runs, first: show(first) }, { runs: 1, first: 'led v1' })
  // The call from the getter replays the stored value (or joins the lead): it never leads.
  assert.ok(second instanceof Promise || show(second) === 'replayed v1', show(second))
})
