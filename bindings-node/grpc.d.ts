// Types of oncely/grpc: idempotent @grpc/grpc-js unary handlers.
import type { IdempotencyOptions } from './express'

/** A method of a grpc-js service definition (what `withIdempotency` reads). */
export interface GrpcMethodDefinition {
  path: string
  requestStream: boolean
  responseStream: boolean
  requestSerialize: (value: any) => Buffer
  responseSerialize: (value: any) => Buffer
  responseDeserialize: (data: Buffer) => any
}

/** The options: those of the HTTP adapters (`tenant` etc. get the grpc-js call), plus the grpc-js module to use. */
export interface GrpcIdempotencyOptions extends Omit<IdempotencyOptions<any>, 'route' | 'methods' | 'requestCap'> {
  /** The `@grpc/grpc-js` module (default: `require('@grpc/grpc-js')`). */
  grpc?: unknown
}

/**
 * Wraps the unary handlers of `implementation` for `service`: a call with
 * `x-idempotency-key` metadata runs once per key and a retry gets the first answer
 * (a value, or a final error status) with `idempotent-replayed: true` in its trailing
 * metadata. Missing or invalid key → INVALID_ARGUMENT, reused with another request →
 * FAILED_PRECONDITION, running with `wait: false` → ABORTED + `grpc-retry-pushback-ms`.
 * Streaming methods pass through. A unary method whose definition lacks
 * `requestSerialize`, `responseSerialize` or `responseDeserialize` throws a `TypeError`
 * here (its answer could be stored but never replayed). The first caller gets the answer
 * as a replay does: its value read back from the stored bytes, its trailers as they were
 * when given.
 */
export declare function withIdempotency<Impl extends Record<string, any>>(
  service: Record<string, GrpcMethodDefinition>,
  implementation: Impl,
  options: GrpcIdempotencyOptions,
): Impl
