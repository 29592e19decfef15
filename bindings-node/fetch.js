'use strict'
// oncely/fetch: one idempotency key per logical call, kept across its retries, with the
// retry loop of `retry` (SPEC §4) deciding every retry.

const { retry, newKey, validateKey, http } = require('./index.js')

/** The error an attempt throws for an answer of 400 or more: `retry` classifies it by its `response`. */
class ResponseError extends Error {
  constructor(response) {
    super(`HTTP ${response.status}`)
    this.name = 'ResponseError'
    this.response = response
  }
}

const REPLAYABLE = (b) =>
  b === undefined ||
  b === null ||
  typeof b === 'string' ||
  ArrayBuffer.isView(b) ||
  b instanceof ArrayBuffer ||
  b instanceof URLSearchParams ||
  (typeof Blob !== 'undefined' && b instanceof Blob) ||
  (typeof FormData !== 'undefined' && b instanceof FormData)

/**
 * `fetch(input, init)` with an `Idempotency-Key` (the one in `init.headers`, else
 * `options.key`, else a new one) sent on every attempt, retried by `retry` with
 * `safe: true` (the key makes the call safe to repeat): network errors and retryable
 * statuses (408, 425, 429, 5xx per SPEC §3, and a 409 with Retry-After: in progress), with
 * `Retry-After` honoured, `options.signal` / `init.signal` and `options.deadline`.
 * Resolves with the last Response (also an error status once retries stop); rejects
 * with the last network error.
 */
async function idempotentFetch(input, init = {}, options = {}) {
  if (init === null || typeof init !== 'object') throw new TypeError('init must be an object')
  if (options === null || typeof options !== 'object') throw new TypeError('options must be an object')
  const { key: givenKey, fetch: fetchImpl = globalThis.fetch, ...retryOptions } = options
  if (typeof fetchImpl !== 'function') throw new TypeError('options.fetch must be a function')
  if (!REPLAYABLE(init.body)) {
    throw new TypeError('init.body must be sendable again on a retry (a string, bytes, Blob, FormData or URLSearchParams), not a stream')
  }
  const isRequest = typeof Request !== 'undefined' && input instanceof Request
  if (isRequest && input.bodyUsed) throw new TypeError('input is a Request whose body was already read')
  // fetch(request, init) sends init.headers instead of the request's own: start from them.
  const headers = new Headers(init.headers ?? (isRequest ? input.headers : undefined))
  const key = validateKey(headers.get(http.KEY_HEADER) ?? givenKey ?? newKey())
  headers.set(http.KEY_HEADER, key)
  // Every signal the caller gave ends the call: each attempt is sent with `init.signal`
  // replaced, which would otherwise drop the others (a Request's own among them).
  const signals = [retryOptions.signal, init.signal, isRequest ? input.signal : undefined].filter((x) => x != null)
  const signal = signals.length > 1 ? AbortSignal.any(signals) : signals[0]
  const userOnRetry = retryOptions.onRetry
  // A 409 with Retry-After ("in progress": an earlier attempt of this call, whose answer
  // was lost, still runs there) is resent after the delay by the core's rules: the key
  // makes the call safe, and sending it again gets that attempt's answer.
  try {
    return await retry(
      async (attempt) => {
        let attemptSignal = signal
        if (Number.isFinite(attempt.remainingMs)) {
          const t = AbortSignal.timeout(Math.max(1, Math.ceil(attempt.remainingMs)))
          attemptSignal = attemptSignal ? AbortSignal.any([attemptSignal, t]) : t
        }
        // A Request's body is read by the attempt that sends it: each attempt sends a copy.
        const target = isRequest && init.body === undefined && input.body !== null ? input.clone() : input
        const res = await fetchImpl(target, { ...init, headers, signal: attemptSignal })
        if (res.status >= 400) throw new ResponseError(res)
        return res
      },
      {
        ...retryOptions,
        signal,
        safe: true,
        onRetry: (event) => {
          // A discarded answer's body is not read: free its connection.
          if (event.error instanceof ResponseError) event.error.response.body?.cancel().catch(() => {})
          if (userOnRetry) userOnRetry(event)
        },
      },
    )
  } catch (e) {
    if (e instanceof ResponseError) return e.response
    throw e
  }
}

module.exports = { idempotentFetch, ResponseError }
