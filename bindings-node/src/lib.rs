//! The Node.js binding of oncely: the npm package `oncely`.
//!
//! A thin layer: JavaScript arguments are checked and converted (milliseconds as
//! `number`), core errors become JavaScript `Error`s with a string `code`, and JavaScript
//! values are kept by napi references. Every rule — backoff, classification, the retry
//! decision, budgets, keys, fingerprints, the dedup store's state machine — is the
//! core's (`oncely`). The retry loop and `IdempotencyStore.execute` are driven from
//! JavaScript (`index.js`) over the classes here, with waiting hosted by the Node event
//! loop: no tokio, no thread.
#![deny(unsafe_op_in_unsafe_fn)]
// Under `cargo test` napi-derive registers nothing, so the exported items look unused.
#![cfg_attr(test, allow(dead_code))]

mod convert;
mod errors;
mod http;
mod hub;
mod keys;
mod policy;
mod redis_store;
mod store;
