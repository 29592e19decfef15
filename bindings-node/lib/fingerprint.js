'use strict'
// Fingerprints: JSON.stringify gives JavaScript's JSON form (toJSON, undefined members
// dropped); the core canonicalizes (RFC 8785) and hashes it.

const native = require('../native.js')
const { invalid, typeName } = require('./errors.js')

function rejectNonFinite(key, v) {
  if (typeof v === 'number' && !Number.isFinite(v)) {
    throw invalid(RangeError, 'value', `value has no JSON form: ${v}${key === '' ? '' : ` at key ${JSON.stringify(key)}`} (JSON has no NaN or Infinity)`)
  }
  return v
}

function jsonText(value) {
  let text
  try {
    text = JSON.stringify(value, rejectNonFinite)
  } catch (e) {
    if (e && e.code === 'INVALID_ARGUMENT') throw e
    const err = invalid(TypeError, 'value', `value has no JSON form: ${e && e.message}`)
    err.cause = e
    throw err
  }
  if (text === undefined) {
    throw invalid(TypeError, 'value', `value has no JSON form: got ${typeName(value)}`)
  }
  return text
}

/** SHA-256 (hex) over the canonical JSON (RFC 8785) of `value`: the same in Rust, Python and Node. */
function fingerprint(value) {
  return native.fingerprintText(jsonText(value))
}

/** The canonical JSON (RFC 8785) of `value`, as a string. */
function canonicalJson(value) {
  return native.canonicalJsonText(jsonText(value))
}

module.exports = { rejectNonFinite, jsonText, fingerprint, canonicalJson }
