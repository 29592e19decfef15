// Types of oncely/fetch: idempotentFetch.
import type { RetryOptions } from './index'

/** The options of `idempotentFetch`: the options of `retry` (`safe` is always `true`), plus the key and the fetch to use. */
export interface IdempotentFetchOptions extends Omit<RetryOptions, 'safe'> {
  /** The key when `init.headers` has no `Idempotency-Key` (default: a new random key). */
  key?: string
  /** The fetch to call (default `globalThis.fetch`). */
  fetch?: typeof globalThis.fetch
}

/** What an attempt throws for an answer of 400 or more (the retry loop classifies it by `response`). */
export declare class ResponseError extends Error {
  readonly response: Response
}

/**
 * `fetch(input, init)` with one `Idempotency-Key` (from `init.headers`, else
 * `options.key`, else a new one) sent on every attempt, retried by `retry` (network
 * errors, retryable statuses and a 409 with `Retry-After` (in progress), `Retry-After`
 * honoured, `signal` and `deadline`; a user `classify` is asked first).
 * Resolves with the last Response, an error status too once retries stop; rejects with
 * the last network error or the abort reason. `init.body` must be sendable again (not a
 * stream).
 */
export declare function idempotentFetch(
  input: string | URL | Request,
  init?: RequestInit,
  options?: IdempotentFetchOptions,
): Promise<Response>
