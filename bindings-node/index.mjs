// The ES module entry of oncely: the same objects as the CommonJS entry (index.js).
import { createRequire } from 'node:module'

const require = createRequire(import.meta.url)
const oncely = require('./index.js')

export const {
  RetryPolicy,
  Deadline,
  RetryBudget,
  ManualClock,
  ReasonCodes,
  Code,
  codeFromHttp,
  classify,
  parseRetryAfter,
  parsePushbackMs,
  failureOf,
  codeOf,
  retry,
  Attempt,
  newKey,
  deriveKey,
  validateKey,
  scope,
  fingerprint,
  canonicalJson,
  fingerprintBytes,
  headers,
  httpStatus,
  httpStatusOf,
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
  IdempotencyStore,
  RedisStore,
  encodeResult,
  decodeResult,
  http,
} = oncely

export default oncely
