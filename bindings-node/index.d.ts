// Types of the oncely package. The native classes and functions are declared in
// native.d.ts, generated from the Rust sources by `napi build`; this file adds what the
// JavaScript layer (index.js) defines: Code, retry, IdempotencyStore, fingerprint, the
// error shapes and the protocol constants.

import type {
  ProtocolHeaders,
  ProtocolHttpStatus,
  RetryBudget,
  RetryPolicy,
  RetryPolicyOptions,
  Deadline,
  ReasonCodes,
  StoreCounters,
  RedisStoreCounters,
  ManualClock,
  HttpConfig,
  HttpConfigOptions,
  HttpKeyDecision,
  HttpProblem,
  HttpProblemSource,
  HttpStoredResponse,
  HttpField,
} from './native'

export {
  RetryPolicy,
  RetryPolicyOptions,
  Deadline,
  RetryBudget,
  RetryBudgetOptions,
  BudgetSnapshot,
  ManualClock,
  ReasonCodes,
  Classification,
  CallFactsOptions,
  ServerDelayOptions,
  Pushback,
  StoreCounters,
  RedisStoreCounters,
  ProtocolHeaders,
  ProtocolHttpStatus,
  classify,
  codeFromHttp,
  parseRetryAfter,
  parsePushbackMs,
  newKey,
  deriveKey,
  validateKey,
  scope,
  fingerprintBytes,
} from './native'

/** The 17 gRPC status codes; at run time a frozen object mapping both ways. */
export declare enum Code {
  OK = 0,
  CANCELLED = 1,
  UNKNOWN = 2,
  INVALID_ARGUMENT = 3,
  DEADLINE_EXCEEDED = 4,
  NOT_FOUND = 5,
  ALREADY_EXISTS = 6,
  PERMISSION_DENIED = 7,
  RESOURCE_EXHAUSTED = 8,
  FAILED_PRECONDITION = 9,
  ABORTED = 10,
  OUT_OF_RANGE = 11,
  UNIMPLEMENTED = 12,
  INTERNAL = 13,
  UNAVAILABLE = 14,
  DATA_LOSS = 15,
  UNAUTHENTICATED = 16,
}

/**
 * A scoped key, as made by `scope(tenant, method, key)`: `v1:` + the percent-encoded
 * tenant and method + the key. `execute` accepts only this exact form.
 */
export type ScopedKey = string

/** A gRPC code name: `'UNAVAILABLE'`, `'RESOURCE_EXHAUSTED'`, … */
export type CodeName = keyof typeof Code

/** Why the retry loop stopped (SPEC §4). */
export type StopReason = 'not_retryable' | 'attempts_exhausted' | 'deadline' | 'budget' | 'server_said_no'

/** The classification rule that decided (SPEC §3). */
export type Rule =
  | 'transient_safe'
  | 'unsafe_to_resend'
  | 'rate_limited'
  | 'attempt_timed_out'
  | 'conflict_rereads'
  | 'conflict_needs_reread'
  | 'in_progress_keyed'
  | 'declared_transient'
  | 'server_error'
  | 'permanent'
  | 'data_loss'
  | 'not_an_error'

/** The variant of an error raised by oncely itself. */
export type OncelyErrorKind =
  | 'invalid_argument'
  | 'missing_key'
  | 'fingerprint_mismatch'
  | 'in_progress'
  | 'lease_lost'
  | 'capacity'
  | 'unavailable'
  | 'leader_panicked'
  | 'reentrant'
  | 'result_not_stored'
  | 'lease_settled'
  | 'other'

/**
 * An error raised by oncely itself: an `Error` (a `TypeError` or `RangeError` for bad
 * input) whose `code` names its gRPC code. Every one is `instanceof OncelyError` and of
 * the class of its kind (`InProgressError`, …); the check reads `kind`, `code` and
 * `httpStatus`, so bad arguments stay `TypeError`s / `RangeError`s too.
 */
export interface OncelyError extends Error {
  code: CodeName
  kind: OncelyErrorKind
  /** The HTTP status a server answers with this error: 400 invalid or missing key, 422 fingerprint mismatch, 409 in progress or lease lost, 503 store unavailable or full, 500 otherwise (Rust `Error::http_status`, Python `exc.http_status`). */
  httpStatus?: number
  /** The offending argument or option (`'maxAttempts'`, `'baseDelayMs'`, …), for bad input. */
  field?: string
  /** For `kind: 'in_progress'` (ABORTED): how long to wait before retrying (HTTP `Retry-After`). */
  retryAfterMs?: number
  /** For `kind: 'capacity'` (RESOURCE_EXHAUSTED): the configured bound. */
  maxEntries?: number
  /** For `kind: 'reentrant'` and `'result_not_stored'`: the scoped key. */
  key?: string
  /** For `kind: 'result_not_stored'` (DATA_LOSS): the type of the result that could not be stored. */
  typeName?: string
}

/** An error class of oncely: `instanceof` checks the error's `kind`. */
export interface OncelyErrorClass<K extends OncelyErrorKind = OncelyErrorKind> {
  new (message: string, props?: Record<string, unknown>): OncelyError & { kind: K }
  /** The kinds this class stands for. */
  readonly kinds: readonly K[]
  [Symbol.hasInstance](value: unknown): value is OncelyError & { kind: K }
}
/** The root class: every error oncely throws (Python `oncely.OncelyError`). */
export declare const OncelyError: OncelyErrorClass
/** `invalid_argument` or `missing_key`: a bad setting or argument (`field` names it). */
export declare const InvalidArgumentError: OncelyErrorClass<'invalid_argument' | 'missing_key'>
/** An idempotency key that is malformed or missing. */
export declare const InvalidKeyError: OncelyErrorClass<'invalid_argument' | 'missing_key'>
/** `missing_key`. */
export declare const MissingKeyError: OncelyErrorClass<'missing_key'>
/** `fingerprint_mismatch` (422). */
export declare const FingerprintMismatchError: OncelyErrorClass<'fingerprint_mismatch'>
/** `in_progress` (409 + Retry-After; `retryAfterMs`). */
export declare const InProgressError: OncelyErrorClass<'in_progress'>
/** `lease_lost` (409). */
export declare const LeaseLostError: OncelyErrorClass<'lease_lost'>
/** `capacity` (503; `maxEntries`). */
export declare const CapacityError: OncelyErrorClass<'capacity'>
/** `unavailable` (503). */
export declare const StoreUnavailableError: OncelyErrorClass<'unavailable'>
/** `leader_panicked` (500). */
export declare const LeaderPanickedError: OncelyErrorClass<'leader_panicked'>
/** `reentrant` (500; `key`). */
export declare const ReentrantCallError: OncelyErrorClass<'reentrant'>
/** `result_not_stored` (500; `key`, `typeName`). */
export declare const ResultNotStoredError: OncelyErrorClass<'result_not_stored'>

/** Properties `retry` adds to the last error (when it is an object) before rethrowing it. */
export interface RetryErrorInfo {
  /** How many attempts were made (Rust `RetryError::attempts`, Python `exc.attempts`). */
  attempts: number
  /** @deprecated Use `attempts`. */
  attemptNumber: number
  /** Why the loop stopped. */
  stopReason: StopReason
  /** Why the loop stopped, in words: `oncely: gave up after 1 attempt (not_retryable: … (rule conflict_needs_reread))` (Python: the exception's note; Rust: `RetryError`'s Display). */
  whyStopped: string
}

/** A failure in the core's terms: the code, and the server's delay if any. */
export interface Failure {
  code: Code
  /** The server's delay in ms (Retry-After, grpc-retry-pushback-ms, RetryInfo, a `retryAfterMs` the error carried, or a user `classify`'s). */
  delayMs?: number
  /** The server said not to retry. */
  doNotRetry?: boolean
  /** @deprecated Always `undefined`: the pushback is parsed into `delayMs` / `doNotRetry`. */
  pushback?: string
  /** @deprecated Always `undefined`: `Retry-After` is parsed into `delayMs`. */
  retryAfter?: string
}

/** What a user `classify` may return: a code, a code with a server delay, or `undefined` for the default extraction. */
export type ClassifyResult =
  | Code
  | CodeName
  | { code: Code | CodeName; retryAfterMs?: number; doNotRetry?: boolean }
  | undefined
  | null

/**
 * What `retry` tells the action about its attempt: the same shape as Rust's `Attempt`
 * and Python's `Attempt` (`number`, the remaining time, `previousAttempts`). It converts
 * to its number (`attempt < 3`), but is an object: compare `attempt.number`.
 */
export declare class Attempt {
  private constructor()
  /** 1 for the first attempt, 2 for the first retry, … */
  readonly number: number
  /** Milliseconds left before the deadline (`Infinity` without one): a per-attempt timeout to forward. */
  readonly remainingMs: number
  /** Attempts made before this one (a `grpc-previous-rpc-attempts` header). */
  readonly previousAttempts: number
  /** The caller's signal, to forward (e.g. to `fetch`). */
  readonly signal: AbortSignal | undefined
  /** The deadline of the whole call, if any. */
  readonly deadline: Deadline | undefined
  /** @deprecated Use `number`. */
  readonly attempt: number
  valueOf(): number
}

/** @deprecated The second argument of the action is the same `Attempt`. */
export type AttemptInfo = Attempt

/** What `onRetry` sees before each retry. */
export interface RetryEvent {
  /** The attempt that failed. */
  attempt: number
  /** The delay before the next attempt. */
  delayMs: number
  /** The failed attempt's error. */
  error: unknown
  /** The rule that allowed the retry (Rust `RetryEvent::rule`, Python `RetryEvent.rule`). */
  rule: Rule
  /** @deprecated Use `rule`. */
  reason: Rule
  /** The code the error was classified as. */
  code: Code
}

export interface RetryOptions {
  /**
   * Backoff and attempts (a `RetryPolicy` or its options); default: the SPEC defaults.
   * Pass a `RetryPolicy` made once: options are turned into one on every call.
   */
  policy?: RetryPolicy | RetryPolicyOptions
  /** A deadline for the whole call (a `Deadline` or ms from now, which makes one at the call's start). */
  deadline?: Deadline | number
  /** The call is idempotent or carries an idempotency key (required to retry UNAVAILABLE). */
  safe?: boolean
  /** Each attempt re-reads state before writing (ABORTED may be retried). */
  rereads?: boolean
  /** INTERNAL/UNKNOWN are transient for this (safe) call. */
  transientInternal?: boolean
  /** A budget shared by the calls of a client (retry storms); every call is counted in it, successes too. */
  budget?: RetryBudget
  /** Cancels the loop at once, during a sleep too; the rejection is `signal.reason`. */
  signal?: AbortSignal
  /** Sees each retry, for logging and metrics. */
  onRetry?: (event: RetryEvent) => void
  /** Says which code an error stands for, overriding the built-in extraction. */
  classify?: (error: unknown) => ClassifyResult
  /** Domain reason codes for errors whose `code` is a reason (`'RATE_LIMITED'`). */
  reasons?: ReasonCodes
  /** Test hook: measure time on a `ManualClock`, and advance it instead of sleeping. */
  _clock?: ManualClock
}

/**
 * Calls `fn(attempt)` (an `Attempt`) until it succeeds or the core says stop (SPEC §4): the
 * error must be retryable, attempts left, the deadline room for another attempt after
 * the delay, the budget room. The last error is rethrown unchanged, with
 * `attempts` and `stopReason` added when it is an object.
 */
export declare function retry<T>(fn: (attempt: Attempt, info: Attempt) => T | PromiseLike<T>, options?: RetryOptions): Promise<T>

/**
 * The failure an error stands for, by the core's extraction rules (SPEC §3): fetch
 * Responses and errors carrying one, Node and undici system errors, grpc-js errors
 * (pushback, RetryInfo), objects with `code`/`status`/`statusCode`, the `cause` chain.
 * The server's delay is parsed: `delayMs` or `doNotRetry`.
 */
export declare function failureOf(
  error: unknown,
  options?: { classify?: (error: unknown) => ClassifyResult; reasons?: ReasonCodes },
): Failure

/** The gRPC code an error stands for (see `failureOf`). */
export declare function codeOf(error: unknown, options?: { reasons?: ReasonCodes }): Code

/** SHA-256 (hex) over the canonical JSON (RFC 8785) of `value`: the same in Rust, Python and Node. */
export declare function fingerprint(value: unknown): string

/** The canonical JSON (RFC 8785) of `value`. */
export declare function canonicalJson(value: unknown): string

/** Header and metadata names of the protocol. */
export declare const headers: Readonly<ProtocolHeaders>

/** HTTP statuses of the server side of the protocol (400, 422, 409). */
export declare const httpStatus: Readonly<ProtocolHttpStatus>

/** The HTTP status of an error of oncely (its `httpStatus`: 400, 422, 409, 503, …), or `undefined` for any other error. */
export declare function httpStatusOf(error: unknown): number | undefined

export interface IdempotencyStoreOptions {
  /** How long a completed result is kept (default 86_400_000, 24 h; must exceed the longest retry window). */
  ttlMs?: number
  /**
   * Bounds the entries (default 1_000_000); past it the oldest completed ones are evicted
   * and counted in `counters().evictions` (running ones never are). A server sets it to its
   * peak completions per second × the TTL in seconds.
   */
  maxEntries?: number
  /** The `retryAfterMs` given to a caller that does not wait (default 1000). */
  inProgressRetryAfterMs?: number
  /** Caches failures whose code is permanent, like successes (opt-in; clear with `remove`). */
  cachePermanentFailures?: boolean
  /** Test hook: read time from a `ManualClock`. */
  _clock?: ManualClock
}

export interface ExecuteOptions {
  /**
   * Aborts this caller: it stops waiting at once (rejected with `signal.reason`). A
   * leader's action keeps the key until it settles (its outcome is stored and given to
   * the waiters as usual); the action's own `signal` fires once every caller has gone.
   */
  signal?: AbortSignal
  /** Wait for a running call with the same key (default); `false` throws ABORTED with `retryAfterMs`. */
  wait?: boolean
}

/** What `execute` gives the action it runs. */
export interface ActionInfo {
  /**
   * Aborted (an `AbortError`) once every caller waiting for this run in this process has
   * stopped waiting: a cooperative action stops then (e.g. forwards it to `fetch`). If the
   * action rejects, the key is released as for any failure; if it completes anyway, its
   * result is stored.
   */
  readonly signal: AbortSignal
}

export interface Executed<T> {
  /** The leader's value: the same object for every caller. */
  value: T
  /** True when this caller did not run the action (joined or replayed): answer with `Idempotent-Replayed: true`. */
  replayed: boolean
  /** How this caller got the value. */
  source: 'led' | 'joined' | 'replayed'
}

/**
 * Runs an action at most once per scoped key within the TTL and gives every caller its
 * result (SPEC §6), over the core's in-process store.
 */
export declare class IdempotencyStore {
  constructor(options?: IdempotencyStoreOptions)
  /**
   * Runs `fn` if this caller leads; otherwise waits for the running call or replays the
   * stored result. A differing fingerprint throws FAILED_PRECONDITION; `fn`'s error
   * reaches every waiter unchanged and is not cached. A call made from inside the action
   * that holds its key (directly or through other keys) throws FAILED_PRECONDITION
   * (`kind: 'reentrant'`, `key`) at once instead of waiting for itself.
   */
  execute<T>(scoped: ScopedKey, fingerprint: string, fn: (info: ActionInfo) => T | PromiseLike<T>, options?: ExecuteOptions): Promise<Executed<T>>
  /** Counts since the store was made. */
  counters(): StoreCounters
  /** Entries held now. */
  readonly size: number
  /** The TTL of completed entries, ms. */
  readonly ttlMs: number
  /** Waiters not yet woken. */
  readonly pendingWaiters: number
  /** Clears a completed entry so the next call runs again; returns whether one was removed. */
  remove(scoped: ScopedKey): boolean
}

/** Where the Redis is: one URL, or several (`urls`). */
export type RedisStoreAddress =
  | {
      /**
       * `redis://[user:password@]host:port/db` (`rediss://` for TLS); with `cluster: true`
       * a seed node of a Redis Cluster; with `sentinel`, a Sentinel; or
       * `redis+sentinel://[user:password@]host:port[,host:port...]/master[/db]`.
       */
      url: string
      urls?: undefined
    }
  | {
      /** Several addresses: a Cluster's seed nodes (`cluster: true`), or the Sentinels (`sentinel`). */
      urls: string[]
      url?: undefined
    }

export type RedisStoreOptions = RedisStoreAddress & RedisStoreSettings

export interface RedisStoreSettings {
  /**
   * A Redis Cluster (default false): slots are learned from the seeds and followed as they
   * move (resharding, failover).
   */
  cluster?: boolean
  /** The master name the Sentinels at `url`/`urls` monitor: the store follows its failovers. */
  sentinel?: string
  /**
   * Replicas that must acknowledge every claim and completion (`WAIT`; default 0). A claim
   * they did not acknowledge is released and the call fails UNAVAILABLE before `fn` runs;
   * a completion they did not acknowledge is counted (`completionsUnreplicated`).
   */
  minReplicas?: number
  /** How long `WAIT` waits for them (default ioTimeoutMs / 2; below ioTimeoutMs). */
  minReplicasTimeoutMs?: number
  /** How long a claim lasts without renewal (default 30_000; renewed every lease/3 while `fn` runs). */
  leaseMs?: number
  /** How long a completed result is kept (default 86_400_000, 24 h). */
  ttlMs?: number
  /** The Redis key prefix (default `'oncely'`): records are `{<prefix>:<scoped key>}`. */
  prefix?: string
  /** Connecting to Redis (default 1000). */
  connectTimeoutMs?: number
  /**
   * Each Redis call, from the moment it is made (queue wait, connect and reply): one not
   * started in time fails `UNAVAILABLE` unsent. Default min(1000, leaseMs / 3); at most
   * leaseMs / 3, so a lease is renewed before it can lapse.
   */
  ioTimeoutMs?: number
  /** Connections/threads talking to Redis (default 4). */
  workers?: number
  /** The `retryAfterMs` given to a caller that does not wait (default 1000). */
  inProgressRetryAfterMs?: number
  /**
   * Stores your own types: `encode(value)` returns a `Buffer`/`Uint8Array` or a string,
   * and `decode` gets back the same kind (give both or neither). `undefined` is still
   * "no value". An `encode` that throws makes the result "not storable"; a `decode` that
   * throws fails the replay with UNAVAILABLE (its error as `cause`), never a re-run.
   */
  encode?: (value: any) => Buffer | Uint8Array | string
  /** Reads what `encode` wrote. */
  decode?: (data: any) => unknown
  /**
   * Connect in the constructor (default false): it opens a connection and sends PING
   * (blocking up to the connect and I/O timeouts, once, at startup), so a wrong URL,
   * password or TLS setting throws UNAVAILABLE there instead of at the first request.
   * `await store.ping()` checks the same without blocking.
   */
  connect?: boolean
  /**
   * The largest result stored, in bytes as encoded (default 67_108_864, 64 MiB; 1 to
   * 536_870_912; keep it at or below the server's `proto-max-bulk-len`, which Redis
   * enforces by dropping the connection). A larger result is recorded as "not storable":
   * the leader and the joiners of this process get the value, later callers
   * `RESULT_NOT_STORED` (DATA_LOSS); `fn` is not run again.
   */
  maxResultBytes?: number
}

/** A record as stored in Redis, read by `RedisStore.get`. */
export interface RedisRecord {
  /** `'running'`: a leader holds (or held) the claim; `'done'`: the result is stored. */
  state: 'running' | 'done'
  /** The request fingerprint the record was claimed with. */
  fingerprint: string
  /** 1 for the first claim, +1 for each takeover. */
  generation: number
  /** Ms left on the leader's lease (running); 0 once it ran out (the next claim takes over). */
  leaseLeftMs: number
  /**
   * The stored result record (done): `decodeResult(data, decode)` gives the value, or
   * throws `result_not_stored` for a result that was not stored (not storable, or over
   * `maxResultBytes`).
   */
  data?: Buffer
}

/**
 * The dedup store shared by every process (Node, Python, Rust) on one Redis: runs an
 * action at most once per scoped key within the TTL (SPEC §6), with the same `execute`
 * as `IdempotencyStore`. Values are stored as tagged bytes (redis/README.md, "Result
 * encoding"): `undefined` as "no value", a `Buffer`/`Uint8Array` as bytes (replayed as a
 * `Buffer`), JSON data as JSON (replayed as a fresh value), or through the `encode` /
 * `decode` options. A value JSON would change (Map, Set, Date, class instances, BigInt,
 * NaN, cycles) is not stored: the leader and this process's joiners get it, later
 * callers `result_not_stored` (DATA_LOSS), and `fn` is not run again. `fn`'s errors are
 * never stored.
 */
export declare class RedisStore {
  constructor(options: RedisStoreOptions)
  /**
   * Runs `fn` if this caller leads; otherwise waits for the running call (here or in
   * another process) or replays the stored result. Redis unreachable → UNAVAILABLE and
   * `fn` does not run; a differing fingerprint → FAILED_PRECONDITION; `wait: false` on a
   * running call → ABORTED with `retryAfterMs`; the lease taken over before completing →
   * ABORTED (`kind: 'lease_lost'`); a call from inside the action that holds its key →
   * FAILED_PRECONDITION (`kind: 'reentrant'`) at once.
   */
  execute<T>(scoped: ScopedKey, fingerprint: string, fn: (info: ActionInfo) => T | PromiseLike<T>, options?: ExecuteOptions): Promise<Executed<T>>
  /**
   * Counts since the store was made (this process's instance): claims, leads,
   * takeovers, replays, remoteWaits, leasesLost, abandoned (leads given up without an
   * outcome), unavailable (calls that failed with UNAVAILABLE).
   */
  counters(): RedisStoreCounters
  /** The record of `scoped` in Redis (for an operator), or null. */
  get(scoped: ScopedKey): Promise<RedisRecord | null>
  /**
   * Deletes the record of `scoped` (a bad stored result, say) so that the next call runs
   * again. Resolves to true once the record it found is gone; false when there was none,
   * when a live lease holds it (its leader may still be running, and a second leader must
   * not start meanwhile; once the lease ran out it can be removed), or when a new claim
   * replaced it meanwhile (left alone: look at it with `get` before removing again).
   * With `minReplicas`, a deletion fewer replicas acknowledged rejects with UNAVAILABLE
   * (gone from the primary, but a failover could bring it back: remove it again); a
   * removal that finds no record waits for the replicas too, and rejects so until they
   * acknowledged the deletion.
   */
  remove(scoped: ScopedKey): Promise<boolean>
  /** Health check: PING within the I/O timeout; rejects with UNAVAILABLE. */
  ping(): Promise<void>
  /** The lease of this store's claims, ms. */
  readonly leaseMs: number
  /** How long completed results are kept, ms. */
  readonly ttlMs: number
  /** The Redis key prefix. */
  readonly prefix: string
  /** The largest result stored, in bytes (see `maxResultBytes` in the options). */
  readonly maxResultBytes: number
  /** The Redis key holding `scoped`'s record. */
  recordKey(scoped: ScopedKey): string
}

/**
 * The stored form of a result (redis/README.md, "Result encoding"): `n` for `undefined`,
 * `b` + bytes for a `Buffer`/`Uint8Array`, `j` + JSON text for JSON data, `u`/`t` + the
 * output of `encode` when given, and `x` + the type name for a value JSON would change
 * (Map, Set, Date, class instances, BigInt, NaN, cycles, ...). Never throws.
 */
export declare function encodeResult(value: unknown, encode?: (value: any) => Buffer | Uint8Array | string): Buffer
/**
 * Reads a stored result back: JSON → a fresh value, bytes → a `Buffer`, no value →
 * `undefined`, a user codec's record → `decode(...)`. A "not storable" record throws
 * `kind: 'result_not_stored'` (DATA_LOSS); an unknown tag throws UNAVAILABLE.
 */
export declare function decodeResult(data: Buffer, decode?: (data: any) => unknown): unknown

/**
 * The server contract (SPEC §8, the core's `oncely::http`) that the adapters
 * `oncely/express` and `oncely/fastify` are built on: which requests are covered, the
 * key, the scope, the request fingerprint, which responses are stored, the
 * stored-response record shared by every adapter and language, and the RFC 9457 bodies.
 */
export declare const http: {
  readonly HttpConfig: typeof HttpConfig
  /** The scoped key of a request: tenant, `method + ' ' + route`, key; an invalid key throws INVALID_ARGUMENT. */
  scope(tenant: string, method: string, route: string, key: string): string
  /** SHA-256 (hex) of method, target (path and query), and the body (canonical JSON when the content type is JSON). */
  requestFingerprint(method: string, target: string, contentType: string | null | undefined, body: string | Buffer): string
  /**
   * `scope` and `requestFingerprint` of one request in one call: `[scoped, fingerprint]`
   * (`[scoped]` when `target` is null or undefined), or the problem to answer when the
   * parts cannot scope a key (a tenant: 500 tenant-unusable; a method or key: 400).
   * Arguments of the wrong type throw a TypeError (INVALID_ARGUMENT).
   */
  request(
    tenant: string,
    method: string,
    route: string,
    key: string,
    target?: string | null,
    contentType?: string | null,
    body?: string | Buffer,
  ): [string, string] | [string] | HttpProblem
  /** 2xx, and 4xx except 408/409/425/429. A status that is not an integer in 0..=65535 throws a RangeError (INVALID_ARGUMENT). */
  storableStatus(status: number): boolean
  /**
   * Whether a response to `method` with `status` carries content (RFC 9110 §6.4.1): not
   * one to a HEAD, nor a 1xx, 204 or 304. The record of such an answer keeps no body.
   */
  hasContent(method: string, status: number): boolean
  /** Whether a gRPC answer with this `grpc-status` value is stored. */
  storableGrpcStatus(value: string): boolean
  /** `application/json` or any `+json` type. */
  isJson(contentType: string): boolean
  /** `application/grpc` or `application/grpc+<codec>`. */
  isGrpc(contentType: string): boolean
  /** `text/event-stream` (parameters and case ignored): sent as produced, never stored. */
  isEventStream(contentType: string): boolean
  /** The record bytes of a stored response (`OHR1`). */
  encodeResponse(response: HttpStoredResponse): Buffer
  /** Reads record bytes back; anything else throws UNAVAILABLE. */
  decodeResponse(record: Buffer): HttpStoredResponse
  /**
   * The record bytes of an HTTP response from its status, its stored headers as one flat
   * list `[name, value, ...]` (values as Latin-1 strings, as Node keeps them, or Buffers),
   * its body and, optionally, its trailers in the same flat form (a gRPC answer's
   * `grpc-status`): the bytes `encodeResponse` makes of the same response. `fields` may
   * also be one string with each name and each value followed by a newline
   * (`'etag\n"1"\n'`), the form the adapters pass; one that does not split into whole
   * pairs throws a RangeError (INVALID_ARGUMENT).
   */
  encodeRecord(status: number, fields: Array<string | Buffer> | string, body: Buffer, trailers?: Array<string | Buffer> | null): Buffer
  /**
   * Record bytes read back flat: `[status, bodyStart, bodyEnd, headerCount, name, value,
   * ...]` (headers, then trailers; values as Latin-1 strings); the body is
   * `record.subarray(bodyStart, bodyEnd)`. Anything else throws UNAVAILABLE.
   */
  decodeRecord(record: Buffer): Array<number | string>
  /**
   * The problem answer for an error of oncely, by its `kind`; also `'request_too_large'`
   * (the request cap in bytes as `message`, else a TypeError), `'body_unreadable'` and
   * `'tenant_unusable'` (500: the tenant function gave a tenant that cannot scope a key),
   * with the detail as `message`.
   */
  problem(error: HttpProblemSource): HttpProblem
  readonly KEY_HEADER: 'idempotency-key'
  readonly GRPC_KEY_METADATA: 'x-idempotency-key'
  readonly REPLAYED_HEADER: 'idempotent-replayed'
  readonly DEFAULT_TENANT: 'default'
  readonly DEFAULT_REQUEST_CAP: number
}
export { HttpConfig, HttpConfigOptions, HttpKeyDecision, HttpProblem, HttpProblemSource, HttpStoredResponse, HttpField }
