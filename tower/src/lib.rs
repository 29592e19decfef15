//! # oncely-tower — idempotency keys for tower services
//!
//! [`IdempotencyLayer`] puts oncely's dedup store in front of any
//! `tower::Service<http::Request<B>>` (an axum `Router`, a hyper service), following the
//! server contract of SPEC §8, whose decisions live in [`oncely::http`]:
//!
//! - POST and PATCH requests (configurable) carry an `Idempotency-Key` header; a missing
//!   key is 400 (or passed through when not required), an invalid one 400, as RFC 9457
//!   `application/problem+json`;
//! - the key is scoped by tenant (a function of the request) and method + route; the
//!   request is fingerprinted (method, path, body — canonical JSON for JSON bodies);
//!   a reused key with another request is 422;
//! - the first request runs the handler; its response (2xx and 4xx except 408, 409,
//!   425, 429, body up to 1 MiB) is stored — status, the headers that describe the
//!   body, the body and trailers — and replayed byte for byte to retries with
//!   `Idempotent-Replayed: true`; a concurrent duplicate waits for it (or gets 409 +
//!   `Retry-After` with [`wait(false)`](IdempotencyLayer::wait));
//! - 5xx and over-cap responses are sent but not stored: the key is released once the
//!   response has been sent, so a retry runs the handler again.
//!
//! On the client side, [`RetryLayer`] retries calls by SPEC §4 and sends one
//! idempotency key with every attempt of a logical call ([`BufferBodyLayer`] above it
//! for bodies that are not `Clone`, such as a tonic client's).
//!
//! The store is a [`Store`]: [`oncely::MemoryStore`] for one process, or (feature
//! `redis`) `oncely_redis::RedisStore` for a fleet. No async runtime is needed.
//!
//! ```
//! use oncely::MemoryStore;
//! use oncely_tower::{IdempotencyLayer, Unstored};
//!
//! let store: MemoryStore<Vec<u8>, Unstored> = MemoryStore::new();
//! let layer = IdempotencyLayer::new(store)
//!     .tenant(|req| {
//!         req.headers
//!             .get("x-account")
//!             .and_then(|v| v.to_str().ok())
//!             .unwrap_or("anonymous")
//!             .to_owned()
//!     })
//!     .on_replay(|req, key| eprintln!("replayed {} {} ({key})", req.method, req.uri));
//! # let _ = layer;
//! ```
#![deny(missing_docs)]
#![forbid(unsafe_code)]

/// The README's example, compiled as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

mod body;
mod buffer;
mod layer;
mod retry;
mod store;

pub use body::Body;
pub use buffer::{BoxError, BufferBody, BufferBodyLayer};
pub use layer::{Counters, Idempotency, IdempotencyLayer};
pub use retry::{RetryError, RetryLayer, Retrying};
pub use store::{BoxFuture, Store, StoreBegin, Unstored};
