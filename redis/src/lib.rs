//! # oncely-redis — the shared dedup store for a fleet of instances
//!
//! [`RedisStore`] implements [`oncely::DedupStore`] on Redis (6+ / Valkey), so
//! [`oncely::execute`] runs an action once per scoped key across every instance that
//! shares the Redis, with the same rules as the in-process
//! [`MemoryStore`](oncely::MemoryStore) (SPEC §6, multi-instance part):
//!
//! - one hash-tagged Redis key per scoped operation holding a versioned record
//!   (see the README for the format, which Python and Node read and write too);
//! - claim (with takeover of an expired lease), renew, complete and release are one
//!   Lua script each, checked against the lease token; lease deadlines come from
//!   Redis `TIME`;
//! - the leader's lease is renewed every lease/3 while its action runs; a leader that
//!   lost its lease gets [`Error::LeaseLost`] and writes nothing;
//! - waiters on other instances are woken by pub/sub, with polling under backoff as
//!   the fallback;
//! - Redis unreachable or slow → [`Error::Unavailable`] within about one I/O timeout
//!   (each call's deadline, waiting for a free connection included) and the action does
//!   not run;
//! - two tiers: an in-process single-flight sits in front, so N same-key callers in
//!   one process make one claim.
//!
//! Results are bytes (`Vec<u8>`), so instances in any language can replay them.
//!
//! No async runtime is needed: the redis crate's blocking client runs on the store's
//! own threads and results come back through `futures-channel`, so the futures run on
//! tokio, smol, async-std or `futures::executor` alike.
//!
//! ```no_run
//! use oncely::{IdempotencyKey, ScopedKey};
//! use oncely_redis::RedisStore;
//!
//! let store: RedisStore<std::io::Error> = RedisStore::builder("redis://127.0.0.1:6379")
//!     .prefix("shop")
//!     .build()
//!     .unwrap();
//! let key = ScopedKey::new("acme", "CreateOrder", &IdempotencyKey::random()).unwrap();
//! let fp = oncely::fingerprint(&serde_json::json!({"sku": "A1"})).unwrap();
//! let done = futures::executor::block_on(
//!     store.execute(&key, &fp, || async { Ok(b"order-1".to_vec()) }),
//! )
//! .unwrap();
//! assert_eq!(done.value, b"order-1");
//! ```
#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod batch;
mod builder;
mod cluster;
pub mod codec;
mod conn;
mod counters;
mod join;
mod lease;
mod notifier;
mod pipeline;
mod pool;
mod renewer;
mod request;
mod runtime;
mod scripts;
#[cfg(test)]
mod testing;
mod topology;

/// The README's example, compiled as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

use std::fmt;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use oncely::{Begin, DedupStore, Error, ExecuteError, ExecuteOptions, Executed, Lease, ScopedKey};

use batch::Acked;
use builder::Config;
pub use builder::{
    RedisStoreBuilder, DEFAULT_CONNECT_TIMEOUT, DEFAULT_IO_TIMEOUT, DEFAULT_LEASE,
    DEFAULT_MAX_RESULT_BYTES, DEFAULT_POLL_MAX, DEFAULT_POLL_MIN, DEFAULT_PREFIX, DEFAULT_WORKERS,
    MAX_RESULT_BYTES_LIMIT,
};
use conn::Link;
pub use counters::RedisCounters;
use counters::{bump, AtomicCounters};
use join::wait_remote;
pub use join::RedisJoin;
pub use lease::RedisLease;
use request::{Failure, Request};
use runtime::{PerProcess, Runtime};
pub use scripts::RECORD_VERSION;
use scripts::{Claim, Got, Identity, Removal, Scripts};

/// Locks a mutex, going on after a panic elsewhere: every critical section leaves its
/// state whole, so a poisoned lock holds nothing half-done.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The shared dedup store on Redis: [`oncely::DedupStore`] for `Vec<u8>` results.
///
/// `E` is the action's error type; it never leaves the process (errors are not
/// stored in Redis: a failed leader releases its claim and a waiter on another
/// instance then runs its own action). Clones share one store (threads, connections
/// and the in-process tier).
pub struct RedisStore<E> {
    inner: Arc<Inner<E>>,
}

impl<E> Clone for RedisStore<E> {
    fn clone(&self) -> Self {
        RedisStore {
            inner: self.inner.clone(),
        }
    }
}

/// A record as stored in Redis, read by [`RedisStore::get`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisRecord {
    /// The request fingerprint the record was claimed with.
    pub fingerprint: String,
    /// 1 for the first claim, +1 for each takeover.
    pub generation: u64,
    /// Running or done.
    pub state: RecordState,
}

/// The state of a [`RedisRecord`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordState {
    /// A leader holds (or held) the claim. `lease_left` is zero when its lease ran
    /// out: the leader is gone and the next claim takes over.
    Running {
        /// Time left on the leader's lease (by Redis' clock).
        lease_left: Duration,
    },
    /// Completed: the stored result, replayed to every later call.
    Done {
        /// The result bytes (see the README's result encoding).
        value: Vec<u8>,
    },
    /// Completed, but its result was not stored (it was over
    /// [`RedisStoreBuilder::max_result_bytes`]): every later call gets
    /// [`Error::ResultNotStored`] with this `type_name`, and the action is not run
    /// again.
    NotStored {
        /// What the result was, e.g. `result of N bytes, over the store's
        /// max_result_bytes of M`.
        type_name: String,
    },
}

impl RecordState {
    /// The result as a reader of codec-framed results (the Python and Node stores, see
    /// [`codec`]) sees it: a done record's bytes; for a result that was not stored,
    /// the codec's not-storable record, which decodes to [`Error::ResultNotStored`];
    /// `None` while running.
    pub fn into_codec_result(self) -> Option<Vec<u8>> {
        match self {
            RecordState::Running { .. } => None,
            RecordState::Done { value } => Some(value),
            RecordState::NotStored { type_name } => Some(
                codec::StoredResult::NotStorable {
                    type_name: &type_name,
                }
                .encode(),
            ),
        }
    }
}

struct Inner<E> {
    /// [`DedupStore::identity`]: the same for every instance on one URL and prefix.
    identity: usize,
    counters: AtomicCounters,
    config: Config,
    link: Link,
    /// Threads and the in-process tier, made again in a child after `fork()`.
    runtime: PerProcess<E>,
    scripts: Arc<Scripts>,
}

/// What a completion did.
enum Completed {
    /// Stored (and acknowledged by the replicas wanted, if any).
    Stored,
    /// Stored on the primary, but fewer replicas than wanted acknowledged it.
    Unreplicated(String),
    /// The lease was taken over: nothing written.
    Lost,
}

impl From<i64> for Completed {
    fn from(script_reply: i64) -> Self {
        if script_reply == 1 {
            Completed::Stored
        } else {
            Completed::Lost
        }
    }
}

/// The release script's call: 1 deleted, 0 not ours (left alone).
fn release(scripts: &Scripts, record: &str, token: &str) -> Request {
    scripts
        .release
        .on(record)
        .arg(token)
        .arg(channel(record))
        .arg(scripts.publish)
}

/// The notification channel of a record.
fn channel(record_key: &str) -> String {
    format!("{record_key}:done")
}

/// Deletes `record` if `token` still holds it, without waiting, on `rt`'s workers.
fn release_in_background<E>(
    rt: &Runtime<E>,
    scripts: &Arc<Scripts>,
    record: String,
    token: String,
) {
    if !rt.is_current() {
        return; // a copy left by fork(): the claim stays the parent's
    }
    rt.pool.spawn(release(scripts, &record, &token));
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl<E> Inner<E> {
    fn record_key(&self, key: &ScopedKey) -> String {
        format!("{{{}:{}}}", self.config.prefix, key.as_str())
    }
    fn channel(record_key: &str) -> String {
        channel(record_key)
    }
    fn version_error(v: &str) -> Error {
        Error::Unavailable(format!(
            "the Redis record has format version {v:?}; this oncely-redis reads version \
             {RECORD_VERSION} (upgrade every instance to one version)"
        ))
    }
}

impl<E: Send + Sync + 'static> RedisStore<E> {
    /// A store on `url` with the defaults (see [`RedisStore::builder`]).
    pub fn new(url: impl Into<String>) -> Result<Self, Error> {
        RedisStore::builder(url).build()
    }

    /// The Redis key holding `key`'s record: `{<prefix>:<scoped key>}`.
    pub fn record_key(&self, key: &ScopedKey) -> String {
        self.inner.record_key(key)
    }

    /// The lease of this store's claims.
    pub fn lease(&self) -> Duration {
        self.inner.config.lease
    }

    /// How long completed results are kept.
    pub fn ttl(&self) -> Duration {
        self.inner.config.ttl
    }

    /// The largest result stored, in bytes (see
    /// [`RedisStoreBuilder::max_result_bytes`]).
    pub fn max_result_bytes(&self) -> usize {
        self.inner.config.max_result_bytes
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.inner.config.prefix
    }

    /// What this store (this process's instance) has done so far.
    pub fn counters(&self) -> RedisCounters {
        let c = &self.inner.counters;
        RedisCounters {
            claims: c.claims.load(Ordering::Relaxed),
            leads: c.leads.load(Ordering::Relaxed),
            takeovers: c.takeovers.load(Ordering::Relaxed),
            replays: c.replays.load(Ordering::Relaxed),
            remote_waits: c.remote_waits.load(Ordering::Relaxed),
            leases_lost: c.leases_lost.load(Ordering::Relaxed),
            abandoned: c.abandoned.load(Ordering::Relaxed),
            claims_unreplicated: c.claims_unreplicated.load(Ordering::Relaxed),
            completions_unreplicated: c.completions_unreplicated.load(Ordering::Relaxed),
            unavailable: c.unavailable.load(Ordering::Relaxed),
        }
    }

    /// Counts an UNAVAILABLE answer in [`RedisCounters::unavailable`].
    fn counted<T>(&self, r: Result<T, Error>) -> Result<T, Error> {
        if let Err(Error::Unavailable(_)) = &r {
            bump(&self.inner.counters.unavailable);
        }
        r
    }

    /// Reads `key`'s record from Redis, for an operator (None when there is none).
    /// Records of another format version are [`Error::Unavailable`], as in a claim. A
    /// hash at the key without a `state` field (foreign or damaged data) is not a
    /// record: None, as a claim sees it (and takes it over).
    pub async fn get(&self, key: &ScopedKey) -> Result<Option<RedisRecord>, Error> {
        let rt = self.inner.runtime.get()?;
        let record = self.inner.record_key(key);
        let got = rt
            .pool
            .call::<Got>(self.inner.scripts.get.on(&record))
            .await;
        Ok(match self.counted(got)? {
            Got::Absent => None,
            Got::Version(v) => return Err(Inner::<E>::version_error(&v)),
            Got::Record {
                done,
                fingerprint,
                generation,
                result,
                left_ms,
                not_stored,
            } => Some(RedisRecord {
                fingerprint,
                generation,
                state: if let (true, Some(type_name)) = (done, not_stored) {
                    RecordState::NotStored { type_name }
                } else if done {
                    RecordState::Done { value: result }
                } else {
                    RecordState::Running {
                        lease_left: Duration::from_millis(left_ms),
                    }
                },
            }),
        })
    }

    /// Deletes `key`'s record, for an operator (a bad stored result, a record in the
    /// way): the next call runs the action again. Returns true once the record it
    /// found is gone (this call deleted it, or expiry or another remover did at the
    /// same moment); false when there was none, when a live lease holds it, or when a
    /// new claim replaced it meanwhile (that newer record is left alone: look at it
    /// with [`get`](Self::get) before removing again).
    ///
    /// A running record whose lease is live is left alone (false): its leader may
    /// still be running the action, and deleting its claim would let a second
    /// leader run it at the same time. Once that lease runs out (the leader is gone)
    /// the record can be removed; a leader that is only slow then finds its claim
    /// gone when completing and stores nothing ([`Error::LeaseLost`]). Waiters on
    /// other instances are woken and claim again. Records of another format version
    /// (a `v` field other than this crate's, with or without a `state`) are
    /// [`Error::Unavailable`] and left alone; any other hash without a `state` field
    /// (not a record, see [`get`](Self::get)) is deleted. A running record without a
    /// lease deadline (damaged data) is given one lease from now and left alone (false)
    /// until it ran out, as a claim does.
    ///
    /// It takes two steps: the record's identity (the lease token of the claim that
    /// wrote it) is read, then the record is deleted only if it still has that token.
    /// The deletion may be sent again after a lost reply; the resend finds the record
    /// gone (true) or a record a new claim made since, which it leaves alone (false).
    /// A removal that fails with [`Error::Unavailable`] may still have deleted the
    /// record. With [`min_replicas`](RedisStoreBuilder::min_replicas), a deletion is
    /// followed by `WAIT`, and one that fewer replicas acknowledged is
    /// [`Error::Unavailable`]: gone from the primary, but a failover could bring the
    /// record back; remove it again. A removal that finds no record waits for the
    /// replicas too (a deletion before it, by a removal that failed so or another
    /// remover, may not have reached them): false once they acknowledged,
    /// [`Error::Unavailable`] while too few do.
    pub async fn remove(&self, key: &ScopedKey) -> Result<bool, Error> {
        let rt = self.inner.runtime.get()?;
        let record = self.inner.record_key(key);
        let scripts = &self.inner.scripts;
        let min_replicas = self.inner.config.min_replicas;
        // What the replicas acknowledged of a removal that deleted the record or found
        // it gone (`None`: enough, or not asked).
        let short = move |acked: Acked| match acked {
            Some(Ok(n)) if n < min_replicas => {
                Some(format!("{n} of the {min_replicas} replicas wanted"))
            }
            Some(Err(e)) => Some(format!("WAIT failed ({e}): no replica")),
            _ => None,
        };
        // A record found gone may have been deleted by a removal that failed with
        // UNAVAILABLE (or by another remover) and not have reached the replicas yet:
        // the WAIT after this read (Redis counts every write before it) says whether
        // it did, so that a removal sent again can tell.
        let identity = rt
            .pool
            .call_to_end(
                scripts
                    .identify
                    .on(&record)
                    .replicated(scripts::identity_absent),
                move |identity: Identity, acked: Acked| (identity, short(acked)),
                || {},
            )
            .await;
        let token = match self.counted(identity)? {
            (Identity::Absent, None) => return Ok(false),
            (Identity::Absent, Some(short)) => return self.counted(Err(self.unreplicated(short))),
            (Identity::Version(v), _) => return Err(Inner::<E>::version_error(&v)),
            (Identity::Token(token), _) => token,
        };
        let request = scripts
            .remove
            .on(&record)
            .arg(Inner::<E>::channel(&record))
            .arg(token)
            .arg(millis(self.inner.config.lease))
            .arg(scripts.publish)
            .replicated(scripts::removal_gone);
        let removed = rt
            .pool
            .call_to_end(
                request,
                move |removal: Removal, acked: Acked| (removal, short(acked)),
                || {},
            )
            .await;
        match self.counted(removed)? {
            // Like a claim (and unlike a completion, whose effect happened): an operator
            // told the record is gone must be able to rely on it after a failover.
            (Removal::Deleted | Removal::Absent, Some(short)) => {
                self.counted(Err(self.unreplicated(short)))
            }
            (Removal::Deleted | Removal::Absent, None) => Ok(true),
            (Removal::Other | Removal::Running, _) => Ok(false),
            (Removal::Version(v), _) => Err(Inner::<E>::version_error(&v)),
        }
    }

    /// The error of a removal whose deletion fewer replicas than wanted acknowledged.
    fn unreplicated(&self, short: String) -> Error {
        Error::Unavailable(format!(
            "Redis replication: the record is gone from the primary but {short} \
             acknowledged its deletion within {:?}; a failover now could bring the record \
             back: remove it again later",
            self.inner.config.min_replicas_timeout()
        ))
    }

    /// Call in a child process right after `fork()` (the Python binding does, through
    /// `os.register_at_fork`): the calls the parent had in flight at the fork (copied
    /// into the child, where the threads that would answer them are gone) end at once
    /// with [`Error::Unavailable`] instead of waiting until the child first uses the
    /// store (which ends them too). They never lead or run their action in the child;
    /// the parent's claims stay the parent's. Does nothing in the process that made
    /// the store, nor in a child that already used it.
    pub fn after_fork(&self) {
        self.inner.runtime.after_fork();
    }

    /// Checks that Redis answers (a `PING` through the store's workers, within the I/O
    /// timeout): a health check. [`Error::Unavailable`] when it does not.
    pub async fn ping(&self) -> Result<(), Error> {
        let rt = self.inner.runtime.get()?;
        let pong = rt.pool.call::<String>(Request::command("PING")).await;
        self.counted(pong).map(drop)
    }

    /// Looks `key` up, first in this process, then in Redis, and leads, joins or
    /// replays (SPEC §6) — the primitive [`execute`](Self::execute) drives.
    pub async fn begin(
        &self,
        key: &ScopedKey,
        fingerprint: &str,
        options: ExecuteOptions,
    ) -> Result<Begin<Vec<u8>, E, RedisLease<E>, RedisJoin<E>>, Error> {
        let inner = &self.inner;
        let rt = inner.runtime.get()?;
        // Tier 1: the in-process single-flight.
        let local = match rt.local.begin(key, fingerprint, options)? {
            Begin::Lead(lease) => lease,
            Begin::Join(join) => return Ok(Begin::Join(RedisJoin::Local(join))),
            Begin::Replay(r) => return Ok(Begin::Replay(r)),
        };
        // Tier 2: this process's one claim in Redis.
        let record = inner.record_key(key);
        let token = oncely::IdempotencyKey::random().as_str().to_owned();
        let sent = Instant::now();
        let claim = {
            let lease_ms = millis(inner.config.lease);
            let ttl_ms = millis(inner.config.ttl).max(lease_ms.saturating_mul(2));
            let request = inner
                .scripts
                .claim
                .on(&record)
                .arg(fingerprint)
                .arg(&token)
                .arg(lease_ms)
                .arg(ttl_ms)
                .replicated(scripts::claim_led);
            let (undo_scripts, undo_record, undo_token) =
                (inner.scripts.clone(), record.clone(), token.clone());
            let (later_rt, later_scripts, later_record, later_token) = (
                rt.clone(),
                inner.scripts.clone(),
                record.clone(),
                token.clone(),
            );
            let (lost_rt, lost_scripts, lost_record, lost_token) = (
                rt.clone(),
                inner.scripts.clone(),
                record.clone(),
                token.clone(),
            );
            let min_replicas = inner.config.min_replicas;
            let (wait_scripts, wait_record, wait_token) =
                (inner.scripts.clone(), record.clone(), token.clone());
            rt.pool.call_or_undo(
                request,
                // A claim that led but that fewer replicas than wanted acknowledged (a
                // failover now could lose it and let another caller run the action
                // too) is given back before anything ran.
                move |claim: Claim, acked: Acked| match (claim, acked) {
                    (Claim::Lead { .. }, Some(Ok(n))) if n < min_replicas => (
                        Ok(Claim::Unreplicated {
                            acked: n,
                            wanted: min_replicas,
                        }),
                        Some(release(&wait_scripts, &wait_record, &wait_token)),
                    ),
                    (Claim::Lead { .. }, Some(Err(e))) => (
                        Err(Failure::Redis(e)),
                        Some(release(&wait_scripts, &wait_record, &wait_token)),
                    ),
                    (claim, _) => (Ok(claim), None),
                },
                // The caller went away while claiming: release what it won.
                move |claim: &Claim| match claim {
                    Claim::Lead { .. } => Some(release(&undo_scripts, &undo_record, &undo_token)),
                    _ => None,
                },
                // The caller went away after the answer came, before reading it.
                move |claim| {
                    if let Claim::Lead { .. } = claim {
                        release_in_background(&later_rt, &later_scripts, later_record, later_token);
                    }
                },
                // The answer was lost (timed out, connection broken) after Redis may
                // have run the claim: the caller gets UNAVAILABLE and will not use it.
                // The token is this call's own, so releasing it touches nothing else.
                move || release_in_background(&lost_rt, &lost_scripts, lost_record, lost_token),
            )
        }
        .await;
        let claim = self.counted(claim)?;
        bump(&inner.counters.claims);
        match claim {
            // Read after the call's deadline (this process was stopped, or the caller's
            // executor did not poll it): the lease may have lapsed, been taken over and
            // its key completed since, so leading could run the action again after
            // completion. Handled as a lost answer; the token is this claim's own.
            Claim::Lead { .. } if sent.elapsed() > inner.config.io_timeout() => {
                release_in_background(&rt, &inner.scripts, record, token);
                Err(Error::Unavailable(format!(
                    "the claim's answer was read {:?} after it was sent, past the I/O \
                     timeout ({:?}): its lease may have lapsed",
                    sent.elapsed(),
                    inner.config.io_timeout()
                )))
            }
            Claim::Lead { generation } => {
                bump(&inner.counters.leads);
                if generation > 1 {
                    bump(&inner.counters.takeovers);
                }
                let (renewal, lost) =
                    rt.renewer
                        .register(&inner.link, &inner.scripts, record.clone(), token.clone());
                Ok(Begin::Lead(RedisLease {
                    store: self.clone(),
                    rt,
                    local: Some(local),
                    scoped: key.clone(),
                    record,
                    token,
                    generation,
                    renewal,
                    lost,
                }))
            }
            Claim::Replay(value) => {
                bump(&inner.counters.replays);
                settle_local(&rt, local, key, value.clone());
                Ok(Begin::Replay(Ok(value)))
            }
            // Dropping `local` lets local waiters look again: they find the same.
            Claim::NotStored(type_name) => {
                bump(&inner.counters.replays);
                drop(local);
                Err(not_stored(key, type_name))
            }
            // Dropping `local` lets local waiters look again themselves.
            Claim::Unreplicated { acked, wanted } => {
                bump(&inner.counters.claims_unreplicated);
                drop(local);
                Err(Error::Unavailable(format!(
                    "Redis replication: {acked} of the {wanted} replicas wanted acknowledged the \
                     claim within {:?}; it was released and the action has not run",
                    inner.config.min_replicas_timeout()
                )))
            }
            Claim::Mismatch => Err(Error::FingerprintMismatch),
            Claim::Version(v) => Err(Inner::<E>::version_error(&v)),
            Claim::Running { .. } if !options.wait => Err(Error::InProgress {
                retry_after: inner.config.in_progress_retry_after,
            }),
            Claim::Running { left_ms } => {
                bump(&inner.counters.remote_waits);
                // Wrapped now: a join made before fork() may be dropped unpolled in
                // the child, where the in-process lease is the parent's.
                let local = runtime::ThisProcess::new(local);
                Ok(Begin::Join(RedisJoin::Remote(Box::pin(wait_remote(
                    self.clone(),
                    rt,
                    local,
                    key.clone(),
                    record,
                    fingerprint.to_owned(),
                    left_ms,
                )))))
            }
        }
    }

    /// Runs `action` at most once per `key` across every instance sharing this Redis
    /// (see [`oncely::execute`] for the rules). Waits for a running call.
    pub async fn execute<F, Fut>(
        &self,
        key: &ScopedKey,
        fingerprint: &str,
        action: F,
    ) -> Result<Executed<Vec<u8>>, ExecuteError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Vec<u8>, E>>,
    {
        oncely::execute(self, key, fingerprint, ExecuteOptions::default(), action).await
    }

    /// [`execute`](Self::execute) with options (e.g. [`ExecuteOptions::NO_WAIT`]).
    pub async fn execute_with<F, Fut>(
        &self,
        key: &ScopedKey,
        fingerprint: &str,
        options: ExecuteOptions,
        action: F,
    ) -> Result<Executed<Vec<u8>>, ExecuteError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Vec<u8>, E>>,
    {
        oncely::execute(self, key, fingerprint, options, action).await
    }

    /// The blocking variant of [`execute_with`](Self::execute_with), for
    /// thread-per-request code (and bindings' sync entry points): waiting parks this
    /// thread; `action` runs on it.
    pub fn execute_blocking<F>(
        &self,
        key: &ScopedKey,
        fingerprint: &str,
        options: ExecuteOptions,
        action: F,
    ) -> Result<Executed<Vec<u8>>, ExecuteError<E>>
    where
        F: FnOnce() -> Result<Vec<u8>, E>,
    {
        // This thread waits anyway: its calls go out from it (no worker hand-off).
        pool::blocking(|| {
            pollster::block_on(oncely::execute(self, key, fingerprint, options, || {
                std::future::ready(action())
            }))
        })
    }
}

/// The error of a record whose result was not stored (DATA_LOSS): the action
/// completed, and is not run again.
fn not_stored(key: &ScopedKey, type_name: String) -> Error {
    Error::ResultNotStored {
        key: key.to_string(),
        type_name,
    }
}

/// Hands a value found in Redis to this process's waiters, then forgets it locally:
/// Redis is the one place completed results are kept.
fn settle_local<E>(rt: &Runtime<E>, local: Lease<Vec<u8>, E>, key: &ScopedKey, value: Vec<u8>) {
    local.complete_now(value);
    rt.local.remove(key);
}

impl<E: Send + Sync + 'static> DedupStore<Vec<u8>, E> for RedisStore<E> {
    type Lease = RedisLease<E>;
    type Join = RedisJoin<E>;

    fn begin(
        &self,
        key: &ScopedKey,
        fingerprint: &str,
        options: ExecuteOptions,
    ) -> impl Future<Output = Result<Begin<Vec<u8>, E, RedisLease<E>, RedisJoin<E>>, Error>> {
        RedisStore::begin(self, key, fingerprint, options)
    }

    /// The same for every instance on one Redis URL and prefix (they share their
    /// records): an action that calls another instance with its own key would wait for
    /// itself just the same.
    fn identity(&self) -> Option<usize> {
        Some(self.inner.identity)
    }
}

impl<E> fmt::Debug for RedisStore<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.inner.config.prefix)
            .field("lease", &self.inner.config.lease)
            .field("ttl", &self.inner.config.ttl)
            .finish_non_exhaustive()
    }
}
