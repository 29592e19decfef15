//! # oncely — remote calls that happen effectively once
//!
//! Clients retry; retries duplicate side effects. oncely puts three parts together so
//! a business effect happens once even though messages arrive more than once:
//!
//! - **backoff** — [`RetryPolicy`]: exponential, capped, jittered delays (3 attempts,
//!   20 ms, ×2, 1 s cap, ±20 % by default), deterministic when seeded;
//! - **classification** — [`classify`], [`Code`], [`Failure`]: which failures may be
//!   retried, under a [`Deadline`] and a [`RetryBudget`], with server-provided delays;
//!   [`extract`] reads a foreign error's raw facts ([`RawFailure`]) into a [`Failure`]
//!   by the one set of rules every binding uses;
//!   driven by the sans-IO [`RetryState`] behind [`retry`], [`retry_blocking`] and
//!   [`simulate`];
//! - **dedup** — [`IdempotencyKey`], [`ScopedKey`], [`fingerprint`] and the
//!   [`MemoryStore`], which runs an action once per key (single-flight for concurrent
//!   calls, a TTL cache of results, fingerprint checks).
//!
//! The crate needs no async runtime: it sleeps with `futures-timer` and waiters are
//! woken through their own wakers, so it runs on tokio, smol, async-std or
//! `futures::executor` alike.
//!
//! ```
//! use oncely::{retry, Code, IdempotencyKey, MemoryStore, RetryPolicy, ScopedKey};
//!
//! # futures::executor::block_on(async {
//! // Server side: dedup by scoped key.
//! let store: MemoryStore<String, Code> = MemoryStore::new();
//! let key = IdempotencyKey::random();               // made once per intent by the client
//! let scoped = ScopedKey::new("acme", "CreateOrder", &key).unwrap();
//! let fp = oncely::fingerprint(&serde_json::json!({"sku": "A1", "qty": 1})).unwrap();
//!
//! // Client side: retry with the same key; the server runs the order once.
//! let order = retry(|_attempt| {
//!     let store = store.clone();
//!     let (scoped, fp) = (scoped.clone(), fp.clone());
//!     async move {
//!         store
//!             .execute(&scoped, &fp, || async { Ok("order-1".to_string()) })
//!             .await
//!             .map(|done| done.value)
//!             .map_err(|e| oncely::Classify::code(&e))
//!     }
//! })
//! .policy(RetryPolicy::new())
//! .safe(true) // the call carries an idempotency key
//! .await
//! .unwrap();
//! assert_eq!(order, "order-1");
//! # });
//! ```
#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod backoff;
mod budget;
mod canonical;
mod classify;
mod clock;
mod code;
mod error;
mod extract;
mod finite;
pub mod http;
mod http_date;
mod key;
mod naming;
mod rand;
mod retry;
mod store;
mod sync;

/// The README's Rust example, compiled and run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;

pub use backoff::{duration_from_millis_f64, duration_from_secs_f64, Backoff, RetryPolicy};
pub use budget::{BudgetSnapshot, RetryBudget};
pub use classify::{
    classify, classify_failure, parse_pushback_ms, parse_retry_after, CallFacts, Classification,
    Classify, Failure, Rule, ServerDelay,
};
pub use clock::{Clock, Deadline, ManualClock, SharedClock, SystemClock};
pub use code::{Code, ReasonCodes};
pub use error::Error;
pub use extract::{extract, RawFailure, RawValue};
pub use key::{
    canonical_json, fingerprint, fingerprint_bytes, headers, http_status, IdempotencyKey,
    ScopedKey, CANONICAL_JSON_MAX_DEPTH, KEY_MAX_LEN, KEY_MIN_LEN, SCOPE_PART_MAX_LEN,
};
pub use naming::{DurationUnit, Naming};
pub use retry::{
    retry, retry_blocking, simulate, Attempt, Decision, NoHook, OnRetry, Retry, RetryError,
    RetryEvent, RetryFuture, RetryState, Scripted, Simulation, Sleeper, Step, StopReason, Timeline,
    TimerSleeper,
};
pub use store::{
    execute, panic_message, Begin, Counters, DedupStore, ExecuteError, ExecuteOptions, Executed,
    Join, Joined, LeaderLease, Lease, MemoryBegin, MemoryStore, MemoryStoreBuilder, Source,
    DEFAULT_IN_PROGRESS_RETRY_AFTER, DEFAULT_MAX_ENTRIES, DEFAULT_TTL,
};
