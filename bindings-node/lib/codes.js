'use strict'
// Codes and protocol constants (from the core)

const native = require('../native.js')

/** The 17 gRPC codes, both ways: `Code.UNAVAILABLE === 14`, `Code[14] === 'UNAVAILABLE'`. */
const Code = {}
native.codeNames().forEach((name, n) => {
  Code[name] = n
  Code[n] = name
})
Object.freeze(Code)

/** Header and metadata names of the protocol. */
const headers = Object.freeze(native.protocolHeaders())
/** HTTP statuses of the server side of the protocol (400, 422, 409). */
const httpStatus = Object.freeze(native.protocolHttpStatus())

module.exports = { Code, headers, httpStatus }
