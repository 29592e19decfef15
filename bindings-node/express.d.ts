// Types of oncely/express: the server contract (SPEC §8) as Express 4/5 middleware.
import type { IncomingMessage, ServerResponse } from 'node:http'
import type { IdempotencyStore, RedisStore } from './index'

/** What the middleware has done so far. */
export interface IdempotencyCounters {
  /** Requests passed to the handler untouched (not covered, or no key and none required). */
  passedThrough: number
  /** Requests refused with a problem before the handler ran. */
  refused: number
  /** Requests whose handler ran under a key. */
  led: number
  /** Responses stored. */
  stored: number
  /** Responses not stored (status, size, a client gone). */
  notStored: number
  /** Requests answered with another request's response (`Idempotent-Replayed: true`). */
  replayed: number
}

/** The options of `idempotency`. */
export interface IdempotencyOptions<Req extends IncomingMessage = any> {
  /** The dedup store; the stored values are stored-response records (bytes). */
  store: IdempotencyStore | RedisStore
  /**
   * The tenant of a request (e.g. the authenticated principal), or one tenant for all.
   * Default `'default'`: every caller shares one key space, so give one whenever callers
   * are not one party.
   */
  tenant?: string | ((req: Req) => string)
  /** The route for the scope; default the Express route template (`/orders/:id`), else the path. */
  route?: (req: Req) => string | undefined
  /** Replaces the request fingerprint (method, URL, body); a reused key with another gets 422. */
  fingerprint?: (req: Req, body: Buffer) => string
  /** Called for every replayed answer, so business metrics are not counted twice. */
  onReplay?: (req: Req, scoped: string) => void
  /** Covered methods (default POST and PATCH). */
  methods?: string[]
  /** A covered request without a key gets 400 (default `true`), else passes through. */
  required?: boolean
  /** A duplicate of a running request waits and replays (default `true`), else 409 + Retry-After. */
  wait?: boolean
  /** The largest response body stored, bytes (default 1 MiB); larger ones are sent, not stored. */
  bodyCap?: number
  /** The largest request body of a covered request, bytes (default 1 MiB); larger ones get 413. */
  requestCap?: number
  /** The response headers stored (default content-type, content-encoding, location, etag). */
  storedHeaders?: string[]
}

/** The middleware, with its counters. */
export interface IdempotencyMiddleware {
  (req: IncomingMessage, res: ServerResponse, next: (err?: unknown) => void): void
  /** What the middleware has done so far. */
  counters(): IdempotencyCounters
}

/**
 * Express middleware (4 and 5) making covered requests idempotent by their
 * `Idempotency-Key` header: a retry gets the first response replayed byte for byte
 * with `Idempotent-Replayed: true` instead of running the handler again.
 */
export declare function idempotency<Req extends IncomingMessage = any>(options: IdempotencyOptions<Req>): IdempotencyMiddleware
