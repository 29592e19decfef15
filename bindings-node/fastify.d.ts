// Types of oncely/fastify: the server contract (SPEC §8) as a Fastify plugin.
import type { IncomingMessage } from 'node:http'
import type { IdempotencyStore, RedisStore } from './index'
import type { IdempotencyCounters } from './express'

export type { IdempotencyCounters }

/** The request the plugin's functions get (a Fastify request). */
export interface FastifyRequestLike {
  method: string
  url: string
  headers: IncomingMessage['headers']
  raw: IncomingMessage
  routeOptions?: { url?: string; config?: unknown }
}

/** The options of the plugin. */
export interface IdempotencyPluginOptions<Req extends FastifyRequestLike = any> {
  /** The dedup store; the stored values are stored-response records (bytes). */
  store: IdempotencyStore | RedisStore
  /**
   * Every route (`true`, the default; a route opts out with `config: { idempotency: false }`)
   * or only the routes with `config: { idempotency: true }` (`false`).
   */
  global?: boolean
  /**
   * The tenant of a request (e.g. the authenticated principal), or one tenant for all.
   * Default `'default'`: every caller shares one key space, so give one whenever callers
   * are not one party.
   */
  tenant?: string | ((req: Req) => string)
  /** The route for the scope; default the route template (`/orders/:id`). */
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

/**
 * The Fastify plugin (fastify-plugin conventions: not encapsulated). Registers
 * `onRequest`, `preParsing`, `preHandler` and `onSend` hooks and decorates the instance
 * with `idempotencyCounters()`.
 */
export declare function idempotency(fastify: any, options: IdempotencyPluginOptions): Promise<void>
export default idempotency
