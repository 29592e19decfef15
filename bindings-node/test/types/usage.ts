// Type-checked by `tsc --noEmit -p test/types` (scripts/test-node): every public name
// with its intended use, so the typings (generated native.d.ts + hand-written
// index.d.ts) cannot drift from what the package exports.
import {
  Code,
  CodeName,
  Deadline,
  IdempotencyStore,
  ManualClock,
  OncelyError,
  InProgressError,
  InvalidArgumentError,
  Attempt,
  ReasonCodes,
  RedisStore,
  RedisStoreCounters,
  RedisStoreOptions,
  RedisRecord,
  ActionInfo,
  RetryBudget,
  RetryErrorInfo,
  RetryPolicy,
  ScopedKey,
  StopReason,
  canonicalJson,
  classify,
  codeFromHttp,
  codeOf,
  decodeResult,
  encodeResult,
  deriveKey,
  failureOf,
  fingerprint,
  fingerprintBytes,
  headers,
  httpStatus,
  httpStatusOf,
  newKey,
  parsePushbackMs,
  parseRetryAfter,
  retry,
  scope,
  validateKey,
} from 'oncely'

const policy = new RetryPolicy({ maxAttempts: 5, baseDelayMs: 20, maxDelayMs: 1000, multiplier: 2, jitter: 0.2, seed: 42 })
const delays: number[] = policy.delays()
const first: number = policy.delayAfter(1)
const seed: bigint | null = policy.seed
const budget = new RetryBudget({ ratio: 0.1, windowMs: 10_000, minPerSec: 10 })
const snapshot: { requests: number; retries: number; allowed: number } = budget.snapshot()
const deadline = new Deadline(2_000)
const left: number = deadline.remainingMs

const unavailable: Code = Code.UNAVAILABLE
const name: CodeName = 'RESOURCE_EXHAUSTED'
const fromHttp: Code = codeFromHttp(503)
const c = classify(name, { safe: true, rereads: false })
const retryable: boolean = c.retryable
const reasons = new ReasonCodes()
reasons.register('PAYMENT_PENDING', Code.UNAVAILABLE)
const r: Code | null = reasons.resolve('RATE_LIMITED')
const afterMs: number = parseRetryAfter('120')
const pushback = parsePushbackMs('250')
const pushbackMs: number | undefined = pushback.delayMs

async function client(signal: AbortSignal): Promise<string> {
  const key = newKey()
  const derived: string = deriveKey('order-42', 'charge')
  validateKey(derived)
  const order: { id: string } = await retry(
    async (attempt, info) => {
      const res = await fetch('http://127.0.0.1:1/orders', {
        method: 'POST',
        headers: { [headers.idempotencyKey]: key, 'grpc-previous-rpc-attempts': String(attempt.previousAttempts) },
        signal: info.signal,
      })
      if (!res.ok) throw res
      return (await res.json()) as { id: string }
    },
    {
      policy,
      deadline,
      budget,
      signal,
      safe: true,
      reasons,
      onRetry: (e) => console.log(e.attempt, e.delayMs, e.reason, e.code),
      classify: (e) => (e instanceof TypeError ? 'UNAVAILABLE' : undefined),
    },
  )
  return order.id
}

async function server(): Promise<void> {
  const store = new IdempotencyStore({ ttlMs: 86_400_000, maxEntries: 100_000, _clock: new ManualClock() })
  const scoped: ScopedKey = scope('acme', 'POST /orders', newKey())
  const fp: string = fingerprint({ sku: 'A1', qty: 1 })
  try {
    const { value, replayed, source } = await store.execute(scoped, fp, async () => ({ id: 'o-1' }), { wait: false })
    const id: string = value.id
    const how: 'led' | 'joined' | 'replayed' = source
    console.log(id, replayed, how, store.counters().leads, store.size, store.ttlMs, store.remove(scoped))
  } catch (e) {
    const status: number | undefined = httpStatusOf(e)
    const err = e as OncelyError & Partial<RetryErrorInfo>
    const code: CodeName = err.code
    const wait: number | undefined = err.retryAfterMs
    const reason: StopReason | undefined = err.stopReason
    const why: string | undefined = err.whyStopped
    if (e instanceof InProgressError) {
      const ms: number | undefined = e.retryAfterMs
      console.log(ms, e.kind === 'in_progress')
    } else if (e instanceof InvalidArgumentError || e instanceof OncelyError) {
      console.log(e.field, e.httpStatus)
    }
    console.log(status, code, wait, reason, why, httpStatus.inProgress, codeOf(e), failureOf(e).code)
  }
}

const attemptNumber = (a: Attempt): number => a.number + a.previousAttempts + a.remainingMs
console.log(attemptNumber, classify('ABORTED', { safe: true }, { delayMs: 1000 }).rule)
console.log(delays, first, seed, snapshot, left, unavailable, fromHttp, retryable, r, afterMs, pushbackMs)
console.log(canonicalJson([1, 2]), fingerprintBytes(new Uint8Array([1])), client, server)

// @ts-expect-error maxAttempts is a number
new RetryPolicy({ maxAttempts: '3' })
// @ts-expect-error execute needs a scoped key (a string), not an object
void new IdempotencyStore().execute({ key: 'k' }, 'fp', async () => 1)

// The Redis store: the same execute, options with a url.
async function redisUsage(scoped: ScopedKey): Promise<void> {
  const options: RedisStoreOptions = { url: 'redis://127.0.0.1:6379/0', leaseMs: 30_000, ttlMs: 60_000, prefix: 'app' }
  const redis = new RedisStore(options)
  const { value, replayed, source } = await redis.execute(scoped, fingerprint({ a: 1 }), async () => ({ id: 'x' }), { wait: false })
  const bytes = await redis.execute(scoped, 'fp', () => Buffer.from('hi'))
  // The action's own signal: aborted once every caller has gone.
  const info = (i: ActionInfo): AbortSignal => i.signal
  const stopped = await redis.execute(scoped, 'fp', async ({ signal }) => (await fetch('http://127.0.0.1/', { signal })).status)
  const status: number = stopped.value
  console.log(info, status)
  const counters: RedisStoreCounters = redis.counters()
  const data: Buffer = encodeResult(value)
  console.log(value.id, replayed, source, bytes.value.length, counters.claims, counters.remoteWaits, decodeResult(data))
  console.log(redis.leaseMs, redis.ttlMs, redis.prefix, redis.recordKey(scoped))
  const own = new RedisStore({ url: 'redis://127.0.0.1:6379/0', encode: (v) => JSON.stringify(v), decode: (t) => JSON.parse(t) })
  const record: Buffer = encodeResult(new Map(), (v) => Buffer.from(String(v)))
  console.log(own.prefix, decodeResult(record, (b: Buffer) => b.toString()))
  // Operations: read and remove a record, health check, connect at construction.
  const checked = new RedisStore({ url: 'redis://127.0.0.1:6379/0', connect: true })
  const found: RedisRecord | null = await checked.get(scoped)
  if (found !== null) {
    const state: 'running' | 'done' = found.state
    const left: number = found.leaseLeftMs
    const stored: Buffer | undefined = found.data
    console.log(state, left, stored, found.fingerprint, found.generation)
  }
  const removed: boolean = await checked.remove(scoped)
  await checked.ping()
  const unavailable: number = checked.counters().unavailable
  console.log(removed, unavailable)
}
void redisUsage
// @ts-expect-error RedisStore needs its options (a url)
new RedisStore()
// One URL or several: a Cluster's seeds, or Sentinels; with replica-acknowledged writes.
new RedisStore({ urls: ['redis://10.0.0.1:6379', 'redis://10.0.0.2:6379'], cluster: true, minReplicas: 1, minReplicasTimeoutMs: 100 })
new RedisStore({ url: 'redis+sentinel://10.0.0.1:26379/mymaster' })
new RedisStore({ urls: ['redis://10.0.0.1:26379'], sentinel: 'mymaster' }).counters().completionsUnreplicated.toFixed()
// @ts-expect-error url or urls, not both
new RedisStore({ url: 'redis://10.0.0.1:6379', urls: ['redis://10.0.0.2:6379'] })
