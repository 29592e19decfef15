'use strict'
// oncely for Node.js: the hand-written layer over the native addon (native.js, generated
// by `napi build`). It only translates: it extracts codes from JavaScript errors, reads
// milliseconds as numbers, and hosts the waiting (timers, Promises) in the event loop.
// Every rule — backoff, classification, the retry decision, budgets, keys,
// fingerprints, the dedup store — is the Rust core's.
//
// This file gathers the public names; the code is in lib/, one file a concern: codes.js
// (codes and protocol constants), errors.js (the error classes and argument checks),
// fingerprint.js, extract.js (what a JavaScript error stands for), retry.js (the retry
// loop), store.js (flights and the in-process store), redis-store.js (the result
// encoding and the Redis store).

const native = require('./native.js')
const CONSTANTS = native.httpConstants()

const { Deadline, ManualClock, ReasonCodes, RetryBudget, RetryPolicy } = native
const { Code, headers, httpStatus } = require('./lib/codes.js')
const { OncelyError, InvalidArgumentError, InvalidKeyError, MissingKeyError, FingerprintMismatchError, InProgressError, LeaseLostError, CapacityError, StoreUnavailableError, LeaderPanickedError, ReentrantCallError, ResultNotStoredError } = require('./lib/errors.js')
const { fingerprint, canonicalJson } = require('./lib/fingerprint.js')
const { failureOf, codeOf } = require('./lib/extract.js')
const { Attempt, retry } = require('./lib/retry.js')
const { IdempotencyStore, httpStatusOf } = require('./lib/store.js')
const { encodeResult, decodeResult, RedisStore } = require('./lib/redis-store.js')

// `http.encodeRecord` has the core write a record into this Buffer, then copies it into
// Node's shared Buffer pool: a Buffer made by the addon has a memory block of its own,
// which V8 allocates and sweeps one by one (≈ 0.3 µs more per record, measured; a server
// stores one record per first call). A record too large for the pool comes from the
// addon as before, without the extra copy.
const SCRATCH = Buffer.allocUnsafeSlow((Buffer.poolSize >>> 1) - 1)

/** `http.encodeRecord`: see index.d.ts. */
function encodeRecord(status, fields, body, trailers) {
  const r = native.httpEncodeRecordInto(SCRATCH, status, fields, body, trailers)
  if (typeof r !== 'number') return r
  const out = Buffer.allocUnsafe(r)
  SCRATCH.copy(out, 0, 0, r)
  return out
}

module.exports = {
  // backoff, classification, the retry loop
  RetryPolicy,
  Deadline,
  RetryBudget,
  ManualClock,
  ReasonCodes,
  Code,
  codeFromHttp: native.codeFromHttp,
  classify: native.classify,
  parseRetryAfter: native.parseRetryAfter,
  parsePushbackMs: native.parsePushbackMs,
  failureOf,
  codeOf,
  retry,
  Attempt,
  // keys and fingerprints
  newKey: native.newKey,
  deriveKey: native.deriveKey,
  validateKey: native.validateKey,
  scope: native.scope,
  fingerprint,
  canonicalJson,
  fingerprintBytes: native.fingerprintBytes,
  headers,
  httpStatus,
  httpStatusOf,
  // the errors
  OncelyError,
  InvalidArgumentError,
  InvalidKeyError,
  MissingKeyError,
  FingerprintMismatchError,
  InProgressError,
  LeaseLostError,
  CapacityError,
  StoreUnavailableError,
  LeaderPanickedError,
  ReentrantCallError,
  ResultNotStoredError,
  // the dedup store
  IdempotencyStore,
  RedisStore,
  encodeResult,
  decodeResult,
  // the server contract (SPEC §8) the adapters (oncely/express, oncely/fastify) share
  http: Object.freeze({
    HttpConfig: native.HttpConfig,
    scope: native.httpScope,
    requestFingerprint: native.httpRequestFingerprint,
    request: native.httpRequest,
    storableStatus: native.httpStorableStatus,
    hasContent: native.httpHasContent,
    storableGrpcStatus: native.httpStorableGrpcStatus,
    isJson: native.httpIsJson,
    isGrpc: native.httpIsGrpc,
    isEventStream: native.httpIsEventStream,
    encodeResponse: native.httpEncodeResponse,
    decodeResponse: native.httpDecodeResponse,
    encodeRecord,
    decodeRecord: native.httpDecodeRecord,
    problem: native.httpProblem,
    // The core's, not copies.
    KEY_HEADER: CONSTANTS.keyHeader,
    GRPC_KEY_METADATA: CONSTANTS.grpcKeyMetadata,
    REPLAYED_HEADER: CONSTANTS.replayedHeader,
    DEFAULT_TENANT: CONSTANTS.defaultTenant,
    DEFAULT_REQUEST_CAP: CONSTANTS.defaultRequestCap,
  }),
}
