//! The in-process dedup store.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::flight::{Flight, Join};
use super::keymap::KeyMap;
use super::{
    check_fingerprint, panic_message, Begin, DedupStore, ExecuteError, ExecuteOptions, Executed,
    Joined, LeaderLease, Source, DEFAULT_IN_PROGRESS_RETRY_AFTER, DEFAULT_MAX_ENTRIES, DEFAULT_TTL,
};
use crate::clock::{coarse_clock, Clock, SharedClock};
use crate::error::Error;
use crate::key::ScopedKey;
use crate::naming::Naming;
use crate::sync::{Mutex, MutexGuard};

/// What [`MemoryStore::begin`] gives.
pub type MemoryBegin<V, E> = Begin<V, E, Lease<V, E>, Join<V, E>>;

/// Expired or stale entries removed per call, at most (amortized cleanup).
const SWEEP_PER_CALL: usize = 4;
/// Stale expiry-queue items tolerated beyond twice the entries before a compaction.
const QUEUE_SLACK: usize = 64;

/// The in-process dedup store: runs an action once per scoped key within the TTL and
/// gives every caller its result (SPEC §6).
///
/// `V` is the stored result (cloned for each caller; use an `Arc` for large values),
/// `E` the action's error (shared as `Arc<E>` with waiters). Clones share one store.
///
/// ```
/// use oncely::{IdempotencyKey, MemoryStore, ScopedKey, Source};
///
/// let store: MemoryStore<u64, std::io::Error> = MemoryStore::new();
/// let key = ScopedKey::new("acme", "CreateOrder", &IdempotencyKey::random()).unwrap();
/// let fp = oncely::fingerprint(&serde_json::json!({"sku": "A1"})).unwrap();
///
/// futures::executor::block_on(async {
///     let first = store.execute(&key, &fp, || async { Ok(42) }).await.unwrap();
///     assert_eq!((first.value, first.source), (42, Source::Led));
///     // A retry with the same key does not run the action again.
///     let again = store.execute(&key, &fp, || async { Ok(7) }).await.unwrap();
///     assert_eq!((again.value, again.source), (42, Source::Replayed));
/// });
/// assert_eq!(store.counters().leads, 1);
/// ```
pub struct MemoryStore<V, E> {
    shared: Arc<Shared<V, E>>,
}

impl<V, E> Clone for MemoryStore<V, E> {
    fn clone(&self) -> Self {
        MemoryStore {
            shared: self.shared.clone(),
        }
    }
}

type CacheFailure<E> = Arc<dyn Fn(&E) -> bool + Send + Sync>;

struct Shared<V, E> {
    table: Mutex<Table<V, E>>,
    clock: SharedClock,
    ttl: Duration,
    max_entries: Option<usize>,
    in_progress_retry_after: Duration,
    cache_failure: Option<CacheFailure<E>>,
    counters: AtomicCounters,
}

struct Table<V, E> {
    map: KeyMap<Slot<V, E>>,
    /// Completed entries in completion order, which is expiry order (one TTL per
    /// store). Items whose `seq` no longer matches the map are stale and skipped.
    order: VecDeque<Queued>,
    next_seq: u64,
}

/// Removes every running entry from `t` (completed ones stay): one item per entry, its
/// flight if anyone joined it. For a copy of the store left by `fork()`.
fn take_running<V, E>(t: &mut Table<V, E>) -> Vec<Option<Arc<Flight<V, E>>>> {
    let mut flights = Vec::new();
    t.map.retain(|slot| match slot {
        Slot::Running { flight, .. } => {
            flights.push(flight.clone());
            false
        }
        Slot::Done { .. } => true,
    });
    flights
}

/// A completed entry's place in the expiry queue. Its expiry is kept here too, so
/// checking the front costs no hash lookup.
struct Queued {
    expires_at: u64,
    seq: u64,
    key: Arc<str>,
}

enum Slot<V, E> {
    Running {
        fingerprint: Fingerprint,
        token: u64,
        /// Made by the first joiner: a lead nobody joins allocates none.
        flight: Option<Arc<Flight<V, E>>>,
    },
    Done {
        fingerprint: Fingerprint,
        outcome: Result<V, Arc<E>>,
        expires_at: u64,
        seq: u64,
    },
}

/// A fingerprint, stored as 32 bytes when it is oncely's own (64 lower-case hex
/// digits) and as text otherwise.
#[derive(Clone)]
enum Fingerprint {
    Sha256([u8; 32]),
    Text(Box<str>),
}

impl Fingerprint {
    fn new(s: &str) -> Self {
        match decode_hex32(s) {
            Some(b) => Fingerprint::Sha256(b),
            None => Fingerprint::Text(s.into()),
        }
    }
    fn matches(&self, s: &str) -> bool {
        match self {
            // Encode the stored digest (a table load per byte) and compare the 64
            // bytes at once, instead of decoding and checking `s` digit by digit.
            Fingerprint::Sha256(b) => {
                let mut hex = [0u8; 64];
                for (pair, byte) in hex.chunks_exact_mut(2).zip(b) {
                    pair.copy_from_slice(&HEX_PAIRS[usize::from(*byte)]);
                }
                s.as_bytes() == hex
            }
            Fingerprint::Text(t) => &**t == s,
        }
    }
}

/// The two lower-case hex digits of each byte value.
static HEX_PAIRS: [[u8; 2]; 256] = {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut t = [[0u8; 2]; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = [DIGITS[i >> 4], DIGITS[i & 15]];
        i += 1;
    }
    t
};

/// The value of each lower-case hex digit; 0xFF for every other byte.
static HEX_VALUES: [u8; 256] = {
    let mut t = [0xFFu8; 256];
    let mut i = 0;
    while i < 10 {
        t[b'0' as usize + i] = i as u8;
        i += 1;
    }
    let mut i = 0;
    while i < 6 {
        t[b'a' as usize + i] = 10 + i as u8;
        i += 1;
    }
    t
};

/// Decodes 64 lower-case hex digits, without a branch per digit.
fn decode_hex32(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    let mut bad = 0u8;
    for (o, pair) in out.iter_mut().zip(s.as_bytes().chunks_exact(2)) {
        let (hi, lo) = (
            HEX_VALUES[usize::from(pair[0])],
            HEX_VALUES[usize::from(pair[1])],
        );
        bad |= hi | lo;
        *o = (hi << 4) | (lo & 15);
    }
    (bad < 16).then_some(out)
}

/// Counts of what a store has done since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Calls that ran the action.
    pub leads: u64,
    /// Calls that waited for a running call and shared its result.
    pub joins: u64,
    /// Calls answered from a completed entry.
    pub replays: u64,
    /// Calls refused because the fingerprint differed.
    pub conflicts: u64,
    /// Completed entries removed because their TTL passed.
    pub expirations: u64,
    /// Completed entries removed early to stay within `max_entries`.
    pub evictions: u64,
}

#[derive(Default)]
struct AtomicCounters {
    leads: AtomicU64,
    joins: AtomicU64,
    replays: AtomicU64,
    conflicts: AtomicU64,
    expirations: AtomicU64,
    evictions: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Builds a [`MemoryStore`]; see [`MemoryStore::builder`].
pub struct MemoryStoreBuilder<V, E> {
    value: std::marker::PhantomData<fn() -> V>,
    clock: Option<SharedClock>,
    ttl: Duration,
    max_entries: Option<usize>,
    in_progress_retry_after: Duration,
    cache_failure: Option<CacheFailure<E>>,
    naming: Naming,
}

impl<V, E> MemoryStoreBuilder<V, E> {
    /// How long a completed result is kept (default 24 h; must exceed the longest
    /// retry window of the clients).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }
    /// Bounds the number of entries (default [`DEFAULT_MAX_ENTRIES`]); past it the
    /// oldest completed entries are evicted (counted in [`Counters::evictions`]);
    /// running ones never are. When every entry is running, a new key fails with
    /// [`Error::Capacity`].
    ///
    /// An evicted result is no longer replayed: a retry that arrives after its
    /// eviction runs the action again. Size the bound to hold every result for the
    /// TTL: peak completions per second × TTL in seconds.
    pub fn max_entries(mut self, n: usize) -> Self {
        self.max_entries = Some(n);
        self
    }
    /// No bound on the number of entries: memory grows with the keys completed
    /// within one TTL. For a store that holds only running entries (whose number is
    /// bounded by the callers), or when the keys come from trusted callers only.
    pub fn unbounded(mut self) -> Self {
        self.max_entries = None;
        self
    }
    /// The retry-after hint given to no-wait callers that find a call in progress
    /// (default 1 s).
    pub fn in_progress_retry_after(mut self, d: Duration) -> Self {
        self.in_progress_retry_after = d;
        self
    }
    /// Reads time from `clock` (tests use [`ManualClock`](crate::ManualClock)).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }
    /// Caches failures for which `permanent` returns true, like successes (opt-in;
    /// clear such an entry with [`MemoryStore::remove`]). Other failures are never
    /// cached.
    pub fn cache_failures_when(
        mut self,
        permanent: impl Fn(&E) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.cache_failure = Some(Arc::new(permanent));
        self
    }
    /// Caches failures whose code is not retryable even for a safe call
    /// (e.g. `INVALID_ARGUMENT`, `NOT_FOUND`).
    pub fn cache_permanent_failures(self) -> Self
    where
        E: crate::Classify,
    {
        self.cache_failures_when(|e: &E| {
            !crate::classify(e.code(), crate::CallFacts::SAFE).retryable
        })
    }

    /// Names the settings and durations in [`build`](Self::build)'s errors as the
    /// caller does (a binding's option names and unit); default [`Naming::RUST`].
    pub fn naming(mut self, naming: Naming) -> Self {
        self.naming = naming;
        self
    }

    /// Makes the store; rejects a zero TTL and `max_entries` of 0.
    pub fn build(self) -> Result<MemoryStore<V, E>, Error> {
        let n = &self.naming;
        if self.ttl.is_zero() {
            return Err(Error::invalid(
                n.field("ttl"),
                format!(
                    "must be greater than {}, e.g. {} (a day), got {}",
                    n.duration(Duration::ZERO),
                    n.value(DEFAULT_TTL),
                    n.value(self.ttl)
                ),
            ));
        }
        if self.max_entries == Some(0) {
            return Err(Error::invalid(
                n.field("max_entries"),
                format!("must be at least 1, e.g. {DEFAULT_MAX_ENTRIES}, got 0"),
            ));
        }
        Ok(MemoryStore {
            shared: Arc::new(Shared {
                table: Mutex::new(Table {
                    map: KeyMap::new(),
                    order: VecDeque::new(),
                    next_seq: 0,
                }),
                clock: self.clock.unwrap_or_else(coarse_clock),
                ttl: self.ttl,
                max_entries: self.max_entries,
                in_progress_retry_after: self.in_progress_retry_after,
                cache_failure: self.cache_failure,
                counters: AtomicCounters::default(),
            }),
        })
    }
}

impl<V, E> MemoryStore<V, E> {
    /// A store with the defaults: TTL 24 h, at most [`DEFAULT_MAX_ENTRIES`] entries,
    /// system clock, failures not cached.
    pub fn new() -> Self {
        Self::builder()
            .build()
            .expect("the default configuration is valid")
    }

    /// A builder for TTL, `max_entries`, clock and failure caching.
    pub fn builder() -> MemoryStoreBuilder<V, E> {
        MemoryStoreBuilder {
            value: std::marker::PhantomData,
            clock: None,
            ttl: DEFAULT_TTL,
            max_entries: Some(DEFAULT_MAX_ENTRIES),
            in_progress_retry_after: DEFAULT_IN_PROGRESS_RETRY_AFTER,
            cache_failure: None,
            naming: Naming::RUST,
        }
    }

    /// The counters so far.
    pub fn counters(&self) -> Counters {
        let c = &self.shared.counters;
        Counters {
            leads: c.leads.load(Ordering::Relaxed),
            joins: c.joins.load(Ordering::Relaxed),
            replays: c.replays.load(Ordering::Relaxed),
            conflicts: c.conflicts.load(Ordering::Relaxed),
            expirations: c.expirations.load(Ordering::Relaxed),
            evictions: c.evictions.load(Ordering::Relaxed),
        }
    }

    /// Entries held now (running and completed; expired ones not yet swept included).
    pub fn len(&self) -> usize {
        self.shared.lock().map.len()
    }

    /// True when the store holds no entry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bound on the entries (`None` when built [`unbounded`](MemoryStoreBuilder::unbounded)).
    pub fn max_entries(&self) -> Option<usize> {
        self.shared.max_entries
    }

    /// The TTL of completed entries.
    pub fn ttl(&self) -> Duration {
        self.shared.ttl
    }

    /// The address of the state that clones share (see [`DedupStore::identity`]).
    fn shared_addr(&self) -> usize {
        Arc::as_ptr(&self.shared) as *const () as usize
    }

    /// Removes a completed entry (e.g. a cached permanent failure) so the next call
    /// runs again. Running entries are left alone. Returns whether one was removed.
    pub fn remove(&self, key: &ScopedKey) -> bool {
        let mut t = self.shared.lock();
        if let Some(Slot::Done { .. }) = t.map.get(key.as_str()) {
            t.map.remove(key.as_str());
            true
        } else {
            false
        }
    }
}

impl<V: Clone, E> MemoryStore<V, E> {
    /// Forgets every running entry, for a child process made by `fork()`: the threads
    /// that ran those actions stayed in the parent, so nothing here would ever settle
    /// them and every caller of their keys would wait for ever. Their waiters (if any)
    /// are told the leader went away, and the next caller of such a key leads in this
    /// process. Completed entries are kept, so nothing that ran is run again here.
    /// Returns how many running entries were forgotten.
    ///
    /// Call it only in the child, right after the fork (the Python binding does, through
    /// `os.register_at_fork`); called in a process whose actions are running, it would
    /// let their keys run twice.
    pub fn forget_running(&self) -> usize {
        let flights = take_running(&mut self.shared.lock());
        let forgotten = flights.len();
        for f in flights.into_iter().flatten() {
            f.settle(Joined::Abandoned);
        }
        forgotten
    }

    /// Ends every running entry's wait with `error` ([`Joined::Error`]) and forgets the
    /// entry, for the copy of a store that a child made by `fork()` will not use again:
    /// unlike [`forget_running`](Self::forget_running), the waiters do not lead in its
    /// place (their leader may still be running in the parent). Returns how many running
    /// entries were failed.
    ///
    /// It never waits for a lock: in the child, a lock that another thread of the
    /// parent held at the fork never comes free. When the store's table is locked it
    /// does nothing and returns `None`; a wait whose own lock is held is left as it is.
    pub fn fail_running(&self, error: &Error) -> Option<usize> {
        let flights = match self.shared.table.try_lock() {
            Ok(mut t) => take_running(&mut t),
            // Consistent when poisoned: see `Shared::lock`.
            Err(std::sync::TryLockError::Poisoned(p)) => take_running(&mut p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        let failed = flights.len();
        for f in flights.into_iter().flatten() {
            f.try_settle(Joined::Error(error.clone()));
        }
        Some(failed)
    }
}

impl<V, E> Default for MemoryStore<V, E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<V, E> Shared<V, E> {
    fn lock(&self) -> MutexGuard<'_, Table<V, E>> {
        // User code (V::clone) may panic under the lock, but never between two
        // writes of one transition, so the table is consistent even when poisoned.
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn now_nanos(&self) -> u64 {
        u64::try_from(self.clock.now().as_nanos()).unwrap_or(u64::MAX)
    }
    fn expiry(&self, now: u64) -> u64 {
        now.saturating_add(u64::try_from(self.ttl.as_nanos()).unwrap_or(u64::MAX))
    }
}

impl<V, E> Table<V, E> {
    /// Removes up to a few expired entries from the front of the queue.
    fn sweep(&mut self, now: u64, counters: &AtomicCounters) {
        for _ in 0..SWEEP_PER_CALL {
            match self.order.front() {
                Some(q) if q.expires_at <= now => {}
                _ => return,
            }
            let Some(q) = self.order.pop_front() else {
                return;
            };
            if self.is_current(&q) {
                self.map.remove(&q.key);
                bump(&counters.expirations);
            }
        }
    }

    /// Whether a queue item still stands for its map entry (not removed or replaced).
    fn is_current(&self, q: &Queued) -> bool {
        matches!(self.map.get(&q.key), Some(Slot::Done { seq, .. }) if *seq == q.seq)
    }

    fn enqueue(&mut self, key: Arc<str>, seq: u64, expires_at: u64) {
        self.order.push_back(Queued {
            expires_at,
            seq,
            key,
        });
        self.compact();
    }

    /// Drops the queue's stale items (entries removed early or replaced) once they
    /// outnumber the entries, so the queue stays bounded by the live entries however
    /// many are removed before their TTL. Each item is dropped once and the items kept
    /// are fewer than those dropped, so this costs O(1) per completion, amortized.
    fn compact(&mut self) {
        if self.order.len() <= 2 * self.map.len() + QUEUE_SLACK {
            return;
        }
        let map = &self.map;
        self.order
            .retain(|q| matches!(map.get(&q.key), Some(Slot::Done { seq, .. }) if *seq == q.seq));
        let keep = 2 * self.order.len() + QUEUE_SLACK;
        if self.order.capacity() > 2 * keep {
            self.order.shrink_to(keep);
        }
    }

    /// Evicts the oldest completed entry; false if every entry is running.
    fn evict_oldest(&mut self, counters: &AtomicCounters) -> bool {
        while let Some(q) = self.order.pop_front() {
            if self.is_current(&q) {
                self.map.remove(&q.key);
                bump(&counters.evictions);
                return true;
            }
        }
        false
    }
}

impl<V: Clone, E> MemoryStore<V, E> {
    /// Looks `key` up and leads, joins or replays, by SPEC §6 — the primitive that
    /// [`execute`](Self::execute) and the Python and Node bindings drive.
    ///
    /// - a completed, unexpired entry with this fingerprint → [`Begin::Replay`];
    /// - a running entry with this fingerprint → [`Begin::Join`] (or
    ///   [`Error::InProgress`] when `options.wait` is false);
    /// - a different fingerprint → [`Error::FingerprintMismatch`];
    /// - otherwise → [`Begin::Lead`]: run the action, then settle the [`Lease`].
    pub fn begin(
        &self,
        key: &ScopedKey,
        fingerprint: &str,
        options: ExecuteOptions,
    ) -> Result<MemoryBegin<V, E>, Error> {
        check_fingerprint(fingerprint)?;
        let sh = &*self.shared;
        let now = sh.now_nanos();
        let mut t = sh.lock();
        t.sweep(now, &sh.counters);
        let h = t.map.hash(key.as_str());
        match t.map.get_mut_h(h, key.as_str()) {
            Some(Slot::Done {
                fingerprint: fp,
                outcome,
                expires_at,
                ..
            }) if *expires_at > now => {
                if !fp.matches(fingerprint) {
                    bump(&sh.counters.conflicts);
                    return Err(Error::FingerprintMismatch);
                }
                bump(&sh.counters.replays);
                return Ok(Begin::Replay(outcome.clone()));
            }
            Some(Slot::Done { .. }) => {
                t.map.remove_h(h, key.as_str());
                bump(&sh.counters.expirations);
            }
            Some(Slot::Running {
                fingerprint: fp,
                flight,
                ..
            }) => {
                if !fp.matches(fingerprint) {
                    bump(&sh.counters.conflicts);
                    return Err(Error::FingerprintMismatch);
                }
                if !options.wait {
                    return Err(Error::InProgress {
                        retry_after: sh.in_progress_retry_after,
                    });
                }
                bump(&sh.counters.joins);
                let flight = flight.get_or_insert_with(|| Arc::new(Flight::new()));
                return Ok(Begin::Join(Join::new(flight.clone())));
            }
            None => {}
        }
        if let Some(max) = sh.max_entries {
            while t.map.len() >= max {
                if !t.evict_oldest(&sh.counters) {
                    return Err(Error::Capacity { max_entries: max });
                }
            }
        }
        let token = t.next_seq;
        t.next_seq += 1;
        let key: Arc<str> = Arc::from(key.as_str());
        t.map.insert_new_h(
            h,
            key.clone(),
            Slot::Running {
                fingerprint: Fingerprint::new(fingerprint),
                token,
                flight: None,
            },
        );
        bump(&sh.counters.leads);
        Ok(Begin::Lead(Lease {
            store: self.shared.clone(),
            key,
            hash: h,
            token,
            settled: false,
        }))
    }

    /// Runs `action` at most once per `key` within the TTL and gives every caller
    /// its result (see [`execute`](crate::execute) for the rules). Waits for a
    /// running call with the same key.
    pub async fn execute<F, Fut>(
        &self,
        key: &ScopedKey,
        fingerprint: &str,
        action: F,
    ) -> Result<Executed<V>, ExecuteError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<V, E>>,
    {
        super::execute(self, key, fingerprint, ExecuteOptions::default(), action).await
    }

    /// [`execute`](Self::execute) with options (e.g. [`ExecuteOptions::NO_WAIT`]).
    pub async fn execute_with<F, Fut>(
        &self,
        key: &ScopedKey,
        fingerprint: &str,
        options: ExecuteOptions,
        action: F,
    ) -> Result<Executed<V>, ExecuteError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<V, E>>,
    {
        super::execute(self, key, fingerprint, options, action).await
    }

    /// The blocking variant of [`execute_with`](Self::execute_with), for
    /// thread-per-request code: waiting blocks this thread. An action that calls
    /// back into this store with its own key gets [`Error::Reentrant`].
    pub fn execute_blocking<F>(
        &self,
        key: &ScopedKey,
        fingerprint: &str,
        options: ExecuteOptions,
        action: F,
    ) -> Result<Executed<V>, ExecuteError<E>>
    where
        F: FnOnce() -> Result<V, E>,
    {
        let identity = self.shared_addr();
        if super::reentry::is_leading(identity, key.as_str()) {
            return Err(ExecuteError::Store(Error::Reentrant {
                key: key.as_str().to_owned(),
            }));
        }
        let mut action = Some(action);
        loop {
            let lease = match self.begin(key, fingerprint, options) {
                Err(e) => return Err(ExecuteError::Store(e)),
                Ok(Begin::Replay(Ok(value))) => {
                    return Ok(Executed {
                        value,
                        source: Source::Replayed,
                    })
                }
                Ok(Begin::Replay(Err(e))) => return Err(ExecuteError::Action(e)),
                Ok(Begin::Join(join)) => match join.wait() {
                    Joined::Value(value) => {
                        return Ok(Executed {
                            value,
                            source: Source::Joined,
                        })
                    }
                    Joined::Failed(e) => return Err(ExecuteError::Action(e)),
                    Joined::Panicked(m) => {
                        return Err(ExecuteError::Store(Error::LeaderPanicked(m.to_string())))
                    }
                    Joined::Abandoned => continue,
                    Joined::Error(e) => return Err(ExecuteError::Store(e)),
                },
                Ok(Begin::Lead(lease)) => lease,
            };
            let Some(action) = action.take() else {
                unreachable!("a caller leads at most once")
            };
            let outcome = {
                let _leading = super::reentry::Frame::enter(identity, key.as_str());
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(action))
            };
            return match outcome {
                Ok(Ok(value)) => {
                    lease.complete_now(value.clone());
                    Ok(Executed {
                        value,
                        source: Source::Led,
                    })
                }
                Ok(Err(e)) => Err(ExecuteError::Action(lease.fail_now(e))),
                Err(payload) => {
                    lease.panicked_now(&panic_message(&*payload));
                    std::panic::resume_unwind(payload)
                }
            };
        }
    }
}

impl<V: Clone, E> DedupStore<V, E> for MemoryStore<V, E> {
    type Lease = Lease<V, E>;
    type Join = Join<V, E>;

    fn begin(
        &self,
        key: &ScopedKey,
        fingerprint: &str,
        options: ExecuteOptions,
    ) -> impl Future<Output = Result<Begin<V, E, Lease<V, E>, Join<V, E>>, Error>> {
        std::future::ready(MemoryStore::begin(self, key, fingerprint, options))
    }

    fn identity(&self) -> Option<usize> {
        Some(self.shared_addr())
    }
}

/// The leader's claim on a key in a [`MemoryStore`]. Settle it with
/// [`complete_now`](Lease::complete_now) or [`fail_now`](Lease::fail_now); dropping it
/// unsettled (a cancelled leader) removes the entry and lets one waiter take over.
pub struct Lease<V: Clone, E> {
    store: Arc<Shared<V, E>>,
    key: Arc<str>,
    hash: u64,
    token: u64,
    settled: bool,
}

impl<V: Clone, E> Lease<V, E> {
    /// Stores `value` until the TTL and wakes the waiters with it.
    pub fn complete_now(mut self, value: V) {
        // User code (`V::clone`, the clock) runs before the lease counts as settled:
        // if it panics, dropping the lease on unwind removes the entry and wakes the
        // waiters.
        let flight = self.finish(Some(Ok(value.clone())));
        self.settled = true;
        if let Some(flight) = flight {
            flight.settle(Joined::Value(value));
        }
    }

    /// Removes the entry (or caches the failure when the store is configured to and
    /// `error` is permanent), then wakes the waiters with the error. Returns the error
    /// shared with the waiters.
    pub fn fail_now(mut self, error: E) -> Arc<E> {
        let error = Arc::new(error);
        // As in `complete_now`: a panicking predicate or clock leaves the lease
        // unsettled, so dropping it on unwind removes the entry and wakes the waiters.
        let cache = self
            .store
            .cache_failure
            .as_ref()
            .is_some_and(|permanent| permanent(&error));
        // Removed before the waiters wake: one that retries at once does not see it.
        let flight = self.finish(cache.then(|| Err(error.clone())));
        self.settled = true;
        if let Some(flight) = flight {
            flight.settle(Joined::Failed(error.clone()));
        }
        error
    }

    /// Replaces this lease's running entry with a completed one holding `outcome`
    /// until the TTL, or removes it (`None`). An entry that is no longer this lease's
    /// is left alone. Gives back the flight the joiners wait on, if any joined, to be
    /// settled once the table is unlocked.
    fn finish(&self, outcome: Option<Result<V, Arc<E>>>) -> Option<Arc<Flight<V, E>>> {
        let sh = &*self.store;
        // The clock is read only when storing: releasing (also on unwind) must not
        // call it.
        let outcome = outcome.map(|o| (o, sh.expiry(sh.now_nanos())));
        let mut t = sh.lock();
        let seq = t.next_seq;
        let slot = t.map.get_mut_h(self.hash, &self.key)?;
        let (fingerprint, flight) = match slot {
            Slot::Running {
                token,
                fingerprint,
                flight,
            } if *token == self.token => (fingerprint.clone(), flight.take()),
            _ => return None,
        };
        match outcome {
            None => {
                t.map.remove_h(self.hash, &self.key);
            }
            Some((outcome, expires_at)) => {
                *slot = Slot::Done {
                    fingerprint,
                    outcome,
                    expires_at,
                    seq,
                };
                t.next_seq += 1;
                t.enqueue(self.key.clone(), seq, expires_at);
            }
        }
        flight
    }

    /// The action panicked (or raised in a host language without an error value):
    /// removes the entry and wakes the waiters with `message`.
    pub fn panicked_now(mut self, message: &str) {
        self.settled = true;
        self.release(Joined::Panicked(Arc::from(message)));
    }

    fn release(&self, outcome: Joined<V, E>) {
        if let Some(flight) = self.finish(None) {
            flight.settle(outcome);
        }
    }

    /// The scoped key this lease is for.
    pub fn key(&self) -> &str {
        &self.key
    }
}

impl<V: Clone, E> Drop for Lease<V, E> {
    fn drop(&mut self) {
        if !self.settled {
            let outcome = if std::thread::panicking() {
                Joined::Panicked(Arc::from("the leader panicked"))
            } else {
                Joined::Abandoned
            };
            self.release(outcome);
        }
    }
}

impl<V: Clone, E> LeaderLease<V, E> for Lease<V, E> {
    fn complete(self, value: V) -> impl Future<Output = Result<(), Error>> {
        self.complete_now(value);
        std::future::ready(Ok(()))
    }
    fn fail(self, error: E) -> impl Future<Output = Arc<E>> {
        std::future::ready(self.fail_now(error))
    }
    fn panicked(self, message: &str) {
        self.panicked_now(message)
    }
}

impl<V, E> fmt::Debug for MemoryStore<V, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("ttl", &self.shared.ttl)
            .field("max_entries", &self.shared.max_entries)
            .finish_non_exhaustive()
    }
}

impl<V: Clone, E> fmt::Debug for Lease<V, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease").field("key", &self.key).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::IdempotencyKey;

    fn key(n: usize) -> ScopedKey {
        let k = IdempotencyKey::parse(&format!("key-{n:06}")).unwrap();
        ScopedKey::new("t", "m", &k).unwrap()
    }

    fn lead(store: &MemoryStore<u64, ()>, key: &ScopedKey) -> Lease<u64, ()> {
        match store.begin(key, "fp", ExecuteOptions::default()).unwrap() {
            Begin::Lead(lease) => lease,
            other => panic!("expected a lead, got {other:?}"),
        }
    }

    fn queue_len(store: &MemoryStore<u64, ()>) -> usize {
        store.shared.lock().order.len()
    }

    #[test]
    fn the_expiry_queue_is_bounded_by_the_live_entries() {
        let store: MemoryStore<u64, ()> = MemoryStore::new();
        // Entries that stay, then many completed and removed at once.
        for n in 0..100 {
            lead(&store, &key(n)).complete_now(1);
        }
        let one = key(1_000);
        let mut peak = 0;
        for _ in 0..100_000 {
            lead(&store, &one).complete_now(2);
            assert!(store.remove(&one));
            peak = peak.max(queue_len(&store));
        }
        assert_eq!(store.len(), 100);
        assert!(peak <= 2 * 101 + QUEUE_SLACK, "queue peaked at {peak}");
        // Removing the lasting entries too leaves a queue bounded by the slack.
        for n in 0..100 {
            assert!(store.remove(&key(n)));
        }
        for _ in 0..1_000 {
            lead(&store, &one).complete_now(2);
            assert!(store.remove(&one));
        }
        assert!(queue_len(&store) <= 2 + QUEUE_SLACK);
        assert!(store.shared.lock().order.capacity() <= 8 * (2 + QUEUE_SLACK));
    }

    #[test]
    fn compaction_keeps_expiry_and_eviction_order() {
        let clock = crate::ManualClock::new();
        let store: MemoryStore<u64, ()> = MemoryStore::builder()
            .clock(clock.clone())
            .ttl(Duration::from_secs(10))
            .max_entries(50)
            .build()
            .unwrap();
        // Interleave lasting entries with many removed ones, so compactions run
        // between them.
        for n in 0..40 {
            lead(&store, &key(n)).complete_now(n as u64);
            clock.advance(Duration::from_millis(10));
            for _ in 0..100 {
                lead(&store, &key(999)).complete_now(0);
                store.remove(&key(999));
            }
        }
        assert_eq!(store.len(), 40);
        // Twenty more: the ten oldest are evicted first.
        for n in 40..60 {
            lead(&store, &key(n)).complete_now(n as u64);
        }
        assert_eq!(store.counters().evictions, 10);
        assert_eq!(store.len(), 50);
        for n in 10..60 {
            let replay = store.begin(&key(n), "fp", ExecuteOptions::default());
            assert!(matches!(replay, Ok(Begin::Replay(Ok(v))) if v == n as u64));
        }
        // The survivors expire in completion order.
        // Now 400 ms; keys 10..=29 (completed at 10 ms × n) expire at 10.295 s.
        clock.advance(Duration::from_millis(9_895));
        for _ in 0..100 {
            let replay = store.begin(&key(59), "fp", ExecuteOptions::default());
            assert!(matches!(replay, Ok(Begin::Replay(Ok(59)))));
        }
        assert_eq!(store.counters().expirations, 20);
        assert_eq!(store.len(), 30);
    }
}
