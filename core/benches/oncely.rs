//! oncely side by side with the crates a Rust user would pick instead.
//!
//! Run with `scripts/bench` (or `cargo bench -p oncely --bench oncely`). Every group
//! measures oncely and its peers in the same run; after the criterion groups the
//! bench measures 1,000,000 inserts with a counting allocator and prints one table of
//! absolute numbers, ratios (oncely / peer) and the targets, also written to
//! `target/criterion/oncely-report.md`. `ONCELY_BENCH_TABLE_ONLY=1` reprints the table
//! from the last run without measuring; `ONCELY_BENCH_SKIP_1M=1` skips the 1M inserts.
//!
//! Numbers are criterion medians (per iteration) of each benchmark.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::future::Future;
use std::hint::black_box;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBuilder, Retryable};
use criterion::{criterion_group, Criterion};
use futures::channel::oneshot;
use futures::future::{BoxFuture, FutureExt, Shared};
use oncely::{
    Attempt, CallFacts, Code, Failure, IdempotencyKey, MemoryStore, RetryPolicy, RetryState,
    ScopedKey,
};

// ---------------------------------------------------------------------------------
// A counting allocator: live heap bytes (requested sizes), counted only while
// `COUNTING` is on, so the criterion groups pay one relaxed load per allocation.

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() && COUNTING.load(Ordering::Relaxed) {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() && COUNTING.load(Ordering::Relaxed) {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        if COUNTING.load(Ordering::Relaxed) {
            LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() && COUNTING.load(Ordering::Relaxed) {
            LIVE.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

// ---------------------------------------------------------------------------------
// Inputs shared by the groups.

const TENANT: &str = "tenant-1";
const METHOD: &str = "/shop.Orders/Create";

/// A realistic scoped key whose idempotency key is a UUID-shaped string made from
/// `i` (no syscall per key, unlike `IdempotencyKey::random`, so that making a million
/// of them stays cheap).
fn key_n(i: u64) -> ScopedKey {
    let mut z = i.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut word = || {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut x = z;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^ (x >> 31)
    };
    let (a, b) = (word(), word());
    let uuid = format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        (b >> 48) & 0x3fff | 0x8000,
        b & 0xffff_ffff_ffff
    );
    ScopedKey::new(TENANT, METHOD, &IdempotencyKey::parse(&uuid).unwrap()).unwrap()
}

fn random_key() -> ScopedKey {
    ScopedKey::new(TENANT, METHOD, &IdempotencyKey::random()).unwrap()
}

fn request_fingerprint() -> String {
    oncely::fingerprint(&serde_json::json!({"sku": "A1", "qty": 1, "price": "9.99"})).unwrap()
}

fn tokio_rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
}

type SharedU64 = Shared<BoxFuture<'static, u64>>;

/// The single-flight a user might write by hand: a map of shared futures.
#[derive(Default)]
struct NaiveShared {
    map: Mutex<HashMap<String, SharedU64>>,
}

impl NaiveShared {
    async fn get_with<F>(&self, key: &str, init: F) -> u64
    where
        F: Future<Output = u64> + Send + 'static,
    {
        let fut = {
            let mut map = self.map.lock().unwrap();
            match map.get(key) {
                Some(f) => f.clone(),
                None => {
                    let f = init.boxed().shared();
                    map.insert(key.to_owned(), f.clone());
                    f
                }
            }
        };
        fut.await
    }
}

// ---------------------------------------------------------------------------------
// 1. Backoff: one delay, one decision.

fn bench_backoff(c: &mut Criterion) {
    let mut g = c.benchmark_group("backoff");
    let policy = RetryPolicy::new().with_seed(7);
    g.bench_function("oncely_delay_after", |b| {
        b.iter(|| black_box(&policy).delay_after(black_box(2)))
    });
    let proto = RetryState::new(policy).with_facts(CallFacts::SAFE);
    g.bench_function("oncely_on_failure", |b| {
        b.iter(|| {
            let mut s = black_box(&proto).clone();
            s.on_failure(black_box(Failure::new(Code::Unavailable)), Duration::ZERO)
        })
    });
    // backon has no "delay of attempt n": the equivalent is building its seeded
    // exponential iterator and taking one delay.
    let builder = ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(20))
        .with_jitter()
        .with_jitter_seed(7);
    g.bench_function("backon_build_next", |b| {
        b.iter(|| black_box(black_box(builder).build().next()))
    });
    g.finish();
}

// ---------------------------------------------------------------------------------
// 2. Retry success path, and 3. fail-fail-succeed with zero delays.

/// The action of the fail-fail-succeed runs: `UNAVAILABLE` twice, then the value.
fn fail_twice(n: &mut u32) -> impl Future<Output = Result<u32, Code>> {
    *n += 1;
    let k = black_box(*n);
    async move {
        if k < 3 {
            Err(Code::Unavailable)
        } else {
            Ok(k)
        }
    }
}

async fn ok_floor() -> Result<i32, Code> {
    let f = |_: Attempt| async { Ok::<_, Code>(1) };
    f(black_box(Attempt {
        number: 1,
        remaining: None,
    }))
    .await
}

async fn ok_oncely() -> Result<i32, oncely::RetryError<Code>> {
    oncely::retry(|_| async { Ok::<_, Code>(1) }).await
}

async fn ok_backon() -> Result<i32, Code> {
    (|| async { Ok::<_, Code>(1) })
        .retry(ExponentialBuilder::default())
        .await
}

async fn ffs_floor() -> u32 {
    let mut n = 0;
    loop {
        if let Ok(v) = fail_twice(&mut n).await {
            break v;
        }
    }
}

/// Zero delays: base 0 (max_delay stays 1 s, which must be ≥ base).
const ZERO_DELAYS: RetryPolicy = RetryPolicy::new().with_base_delay(Duration::ZERO);

async fn ffs_oncely() -> u32 {
    let mut n = 0;
    let r = oncely::retry(|_| fail_twice(&mut n))
        .policy(black_box(ZERO_DELAYS))
        .safe(true)
        .await;
    r.unwrap()
}

const ZERO_BACKON: ExponentialBuilder = ExponentialBuilder::new().with_min_delay(Duration::ZERO);

async fn ffs_backon_noop() -> u32 {
    let mut n = 0;
    let r = (|| fail_twice(&mut n))
        .retry(black_box(ZERO_BACKON))
        .sleep(|_| std::future::ready(()))
        .await;
    r.unwrap()
}

async fn ffs_backon_tokio() -> u32 {
    let mut n = 0;
    let r = (|| fail_twice(&mut n)).retry(black_box(ZERO_BACKON)).await;
    r.unwrap()
}

fn bench_retry(c: &mut Criterion) {
    let rt = tokio_rt();
    let mut g = c.benchmark_group("retry_ok");
    g.bench_function("floor_direct", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(ok_floor().await) })
    });
    g.bench_function("oncely", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(ok_oncely().await) })
    });
    g.bench_function("backon", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(ok_backon().await) })
    });
    g.finish();

    let mut g = c.benchmark_group("retry_ffs");
    g.bench_function("floor_direct", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(ffs_floor().await) })
    });
    g.bench_function("oncely", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(ffs_oncely().await) })
    });
    g.bench_function("backon_noop_sleep", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(ffs_backon_noop().await) })
    });
    g.bench_function("backon_tokio_sleep", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(ffs_backon_tokio().await) })
    });
    g.finish();
}

// ---------------------------------------------------------------------------------
// 4. Replay of a completed key, and 5. a miss (lead + complete on a fresh key).

/// Other entries in every store of the replay group, so lookups do not run in a
/// one-entry table.
const BACKGROUND_KEYS: u64 = 10_000;

/// One completed key (and `BACKGROUND_KEYS` others) in oncely's store and in each peer.
struct Replay {
    key: ScopedKey,
    fp: String,
    store: MemoryStore<u64, Code>,
    floor: Mutex<HashMap<String, u64>>,
    cache: moka::future::Cache<String, u64>,
    naive: NaiveShared,
}

impl Replay {
    fn new(rt: &tokio::runtime::Runtime) -> Self {
        let r = Replay {
            key: random_key(),
            fp: request_fingerprint(),
            store: MemoryStore::new(),
            floor: Mutex::default(),
            cache: moka::future::Cache::builder().build(),
            naive: NaiveShared::default(),
        };
        let background: Vec<ScopedKey> = (0..BACKGROUND_KEYS).map(key_n).collect();
        rt.block_on(async {
            for (i, k) in background.iter().chain([&r.key]).enumerate() {
                let i = i as u64;
                r.store
                    .execute(k, &r.fp, || async move { Ok::<_, Code>(i) })
                    .await
                    .unwrap();
                r.floor.lock().unwrap().insert(k.as_str().to_owned(), i);
                r.cache.get_with_by_ref(k.as_str(), async move { i }).await;
                r.naive.get_with(k.as_str(), async move { i }).await;
            }
            r.cache.run_pending_tasks().await;
        });
        assert_eq!(r.store.counters().leads, BACKGROUND_KEYS + 1);
        r
    }

    fn floor(&self) -> u64 {
        let map = self.floor.lock().unwrap();
        map.get(black_box(&self.key).as_str()).copied().unwrap()
    }

    async fn oncely(&self) -> u64 {
        let done = self
            .store
            .execute(black_box(&self.key), black_box(&self.fp), || async {
                Ok::<_, Code>(0)
            })
            .await
            .unwrap();
        done.value
    }

    async fn moka_get_with(&self) -> u64 {
        let key = black_box(&self.key).as_str().to_owned();
        self.cache.get_with(key, async { 0 }).await
    }

    async fn moka_get_with_by_ref(&self) -> u64 {
        let key = black_box(&self.key).as_str();
        self.cache.get_with_by_ref(key, async { 0 }).await
    }

    async fn naive(&self) -> u64 {
        let key = black_box(&self.key).as_str();
        self.naive.get_with(key, async { 0 }).await
    }
}

fn bench_replay(c: &mut Criterion) {
    let rt = tokio_rt();
    let r = Replay::new(&rt);
    let r = &r;
    let mut g = c.benchmark_group("replay");
    g.bench_function("floor_mutex_map", |b| b.iter(|| black_box(r.floor())));
    g.bench_function("oncely", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(r.oncely().await) })
    });
    g.bench_function("moka_get_with", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(r.moka_get_with().await) })
    });
    g.bench_function("moka_get_with_by_ref", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(r.moka_get_with_by_ref().await) })
    });
    g.bench_function("naive_shared", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(r.naive().await) })
    });
    g.finish();
}

/// Times `iters` first calls on fresh keys against a fresh store made by `make`; the
/// keys are made and the store dropped outside the timing.
fn time_misses<S>(
    rt: &tokio::runtime::Runtime,
    iters: u64,
    make: impl Fn() -> S,
    run: impl AsyncFn(&S, &[ScopedKey]),
) -> Duration {
    let base = rand_base();
    let keys: Vec<ScopedKey> = (0..iters).map(|i| key_n(base + i)).collect();
    let store = make();
    let start = Instant::now();
    rt.block_on(run(&store, &keys));
    let elapsed = start.elapsed();
    drop(store);
    elapsed
}

fn rand_base() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(Instant::now()) >> 8
}

async fn miss_floor(map: &Mutex<HashMap<String, u64>>, keys: &[ScopedKey]) {
    for (i, k) in keys.iter().enumerate() {
        map.lock().unwrap().insert(k.as_str().to_owned(), i as u64);
    }
}

async fn miss_oncely(store: &MemoryStore<u64, Code>, keys: &[ScopedKey], fp: &str) {
    for (i, k) in keys.iter().enumerate() {
        let i = i as u64;
        let done = store.execute(k, fp, || async move { Ok(i) }).await;
        black_box(done.unwrap());
    }
}

async fn miss_moka(cache: &moka::future::Cache<String, u64>, keys: &[ScopedKey]) {
    for (i, k) in keys.iter().enumerate() {
        let i = i as u64;
        black_box(cache.get_with_by_ref(k.as_str(), async move { i }).await);
    }
}

async fn miss_naive(naive: &NaiveShared, keys: &[ScopedKey]) {
    for (i, k) in keys.iter().enumerate() {
        let i = i as u64;
        black_box(naive.get_with(k.as_str(), async move { i }).await);
    }
}

fn new_moka() -> moka::future::Cache<String, u64> {
    moka::future::Cache::builder().build()
}

fn bench_miss(c: &mut Criterion) {
    let rt = tokio_rt();
    let fp = request_fingerprint();
    let fp = fp.as_str();
    let mut g = c.benchmark_group("miss");
    g.bench_function("floor_mutex_map", |b| {
        b.iter_custom(|iters| time_misses(&rt, iters, Mutex::default, miss_floor))
    });
    g.bench_function("oncely", |b| {
        b.iter_custom(|iters| {
            time_misses(&rt, iters, MemoryStore::new, async |s, k| {
                miss_oncely(s, k, fp).await
            })
        })
    });
    g.bench_function("moka_get_with_by_ref", |b| {
        b.iter_custom(|iters| time_misses(&rt, iters, new_moka, miss_moka))
    });
    g.bench_function("naive_shared", |b| {
        b.iter_custom(|iters| time_misses(&rt, iters, NaiveShared::default, miss_naive))
    });
    g.finish();
}

// ---------------------------------------------------------------------------------
// 6. 10,000 waiters coalescing on one key.

const WAITERS: usize = 10_000;

type Gate = Shared<oneshot::Receiver<()>>;

/// The ready queue of the minimal executor below: indices of woken futures.
#[derive(Default)]
struct ReadyQueue(Mutex<Vec<usize>>);

/// The waker of future `idx`: pushes its index on the ready queue.
struct SlotWaker {
    idx: usize,
    ready: Arc<ReadyQueue>,
}

impl Wake for SlotWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref()
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.ready.0.lock().unwrap().push(self.idx)
    }
}

/// Runs one leader and `WAITERS` joiners of one key to completion on a minimal
/// single-threaded executor, so that the harness costs little per waiter: the futures
/// sit in one vector (no allocation per future), each with its own prebuilt waker.
/// Every caller is polled once, and so registers, before the gate that the leader's
/// action waits on is opened. The first caller (the leader) gets the gate; the others
/// get it only when `all_gated` (the floor, where every future waits on the gate
/// itself). Returns the wall time from making the futures to the last completion.
fn coalesce<F, Fut>(all_gated: bool, call: F) -> Duration
where
    F: Fn(Option<Gate>) -> Fut,
    Fut: Future<Output = u64>,
{
    let n = WAITERS + 1;
    let ready = Arc::new(ReadyQueue::default());
    let wakers: Vec<Waker> = (0..n)
        .map(|idx| {
            Waker::from(Arc::new(SlotWaker {
                idx,
                ready: ready.clone(),
            }))
        })
        .collect();
    let mut queue = Vec::with_capacity(n);
    let (tx, rx) = oneshot::channel::<()>();
    let gate = rx.shared();

    let start = Instant::now();
    let mut futs: Vec<Option<Fut>> = Vec::with_capacity(n);
    futs.push(Some(call(Some(gate.clone()))));
    for _ in 1..n {
        futs.push(Some(call(all_gated.then(|| gate.clone()))));
    }
    drop(gate);
    let (mut sum, mut left) = (0, n);
    let poll = |idx: usize, futs: &mut Vec<Option<Fut>>| -> Option<u64> {
        let slot = &mut futs[idx];
        // SAFETY: `futs` never grows past its capacity, so its elements never move
        // until they are dropped in place (by assigning `None`) or with the vector.
        let fut = unsafe { Pin::new_unchecked(slot.as_mut()?) };
        let v = match fut.poll(&mut Context::from_waker(&wakers[idx])) {
            Poll::Ready(v) => v,
            Poll::Pending => return None,
        };
        *slot = None;
        Some(v)
    };
    for idx in 0..n {
        if let Some(v) = poll(idx, &mut futs) {
            (sum, left) = (sum + v, left - 1);
        }
    }
    tx.send(()).unwrap();
    while left > 0 {
        std::mem::swap(&mut queue, &mut *ready.0.lock().unwrap());
        assert!(
            !queue.is_empty(),
            "a future is pending with nothing to wake it"
        );
        for idx in queue.drain(..) {
            if let Some(v) = poll(idx, &mut futs) {
                (sum, left) = (sum + v, left - 1);
            }
        }
    }
    let elapsed = start.elapsed();
    assert_eq!(sum, n as u64 * 7);
    elapsed
}

async fn open(gate: Option<Gate>) {
    gate.expect("only the leader runs its action")
        .await
        .unwrap();
}

fn coalesce_floor() -> Duration {
    coalesce(true, |gate| async move {
        open(gate).await;
        7
    })
}

fn coalesce_oncely(store: &MemoryStore<u64, Code>, fp: &str) -> Duration {
    let before = store.counters();
    let key = random_key();
    let key = &key;
    let t = coalesce(false, |gate| async move {
        let done = store
            .execute(key, fp, || async move {
                open(gate).await;
                Ok(7)
            })
            .await
            .unwrap();
        done.value
    });
    assert_eq!(store.counters().joins - before.joins, WAITERS as u64);
    t
}

fn coalesce_moka(cache: &moka::future::Cache<String, u64>) -> Duration {
    let key = random_key();
    let key = key.as_str();
    coalesce(false, |gate| async move {
        cache
            .get_with_by_ref(key, async move {
                open(gate).await;
                7
            })
            .await
    })
}

fn coalesce_naive(naive: &NaiveShared) -> Duration {
    let key = random_key();
    let key = key.as_str();
    coalesce(false, |gate| async move {
        naive
            .get_with(key, async move {
                open(gate).await;
                7
            })
            .await
    })
}

fn bench_coalesce(c: &mut Criterion) {
    let fp = request_fingerprint();
    let fp = fp.as_str();
    let store: MemoryStore<u64, Code> = MemoryStore::new();
    let cache: moka::future::Cache<String, u64> = moka::future::Cache::builder().build();
    let naive = NaiveShared::default();
    let mut g = c.benchmark_group("coalesce_10k");
    g.sample_size(10);
    g.bench_function("floor_shared_gate", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| coalesce_floor()).sum())
    });
    g.bench_function("oncely", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| coalesce_oncely(&store, fp)).sum())
    });
    g.bench_function("moka_get_with", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| coalesce_moka(&cache)).sum())
    });
    g.bench_function("naive_shared", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| coalesce_naive(&naive)).sum())
    });
    g.finish();
}

// ---------------------------------------------------------------------------------
// 7. 1,000,000 distinct keys: time per new key and heap bytes per entry.

#[derive(Clone, Copy, Debug)]
struct InsertResult {
    ns_per_key: f64,
    bytes_per_entry: f64,
    overhead_per_entry: f64,
}

/// Inserts `keys` into a fresh store twice: once timed (allocator not counting),
/// once counting live heap bytes. Returns time per key and bytes per entry, the
/// overhead being the bytes beyond the key text and the 8-byte value.
fn insert_many<S>(
    keys: &[ScopedKey],
    make: impl Fn() -> S,
    run: impl AsyncFn(&S, &[ScopedKey]),
) -> InsertResult {
    let n = keys.len() as f64;
    let key_bytes = keys.iter().map(|k| k.as_str().len()).sum::<usize>() as f64 / n;

    let store = make();
    let start = Instant::now();
    futures::executor::block_on(run(&store, keys));
    let elapsed = start.elapsed();
    drop(store);

    COUNTING.store(true, Ordering::SeqCst);
    let before = LIVE.load(Ordering::SeqCst);
    let store = make();
    futures::executor::block_on(run(&store, keys));
    let bytes = (LIVE.load(Ordering::SeqCst) - before) as f64;
    COUNTING.store(false, Ordering::SeqCst);
    drop(store);

    let bytes_per_entry = bytes / n;
    InsertResult {
        ns_per_key: elapsed.as_nanos() as f64 / n,
        bytes_per_entry,
        overhead_per_entry: bytes_per_entry - key_bytes - 8.0,
    }
}

fn bench_insert_many(n: u64) -> Vec<(&'static str, InsertResult)> {
    println!("insert_{n}: making {n} keys");
    let base = rand_base();
    let keys: Vec<ScopedKey> = (0..n).map(|i| key_n(base + i)).collect();
    let fp = request_fingerprint();
    let fp = fp.as_str();
    let mut out = Vec::new();

    let r = insert_many(
        &keys,
        Mutex::<HashMap<String, u64>>::default,
        async |m, keys| {
            for (i, k) in keys.iter().enumerate() {
                m.lock().unwrap().insert(k.as_str().to_owned(), i as u64);
            }
        },
    );
    out.push(("floor_mutex_map", r));

    let r = insert_many(&keys, MemoryStore::<u64, Code>::new, async |store, keys| {
        for (i, k) in keys.iter().enumerate() {
            let i = i as u64;
            let done = store.execute(k, fp, || async move { Ok(i) }).await;
            black_box(done.unwrap());
        }
    });
    out.push(("oncely", r));

    let moka_run = async |cache: &moka::future::Cache<String, u64>, keys: &[ScopedKey]| {
        for (i, k) in keys.iter().enumerate() {
            let i = i as u64;
            black_box(cache.get_with_by_ref(k.as_str(), async move { i }).await);
        }
        cache.run_pending_tasks().await;
    };
    let r = insert_many(
        &keys,
        || moka::future::Cache::<String, u64>::builder().build(),
        moka_run,
    );
    out.push(("moka", r));
    let r = insert_many(
        &keys,
        || {
            moka::future::Cache::<String, u64>::builder()
                .time_to_live(Duration::from_secs(24 * 3600))
                .build()
        },
        moka_run,
    );
    out.push(("moka_ttl", r));

    for (name, r) in &out {
        println!(
            "insert_{n}/{name:<16} {:>8.1} ns/key {:>8.1} B/entry ({:>6.1} B beyond key and value)",
            r.ns_per_key, r.bytes_per_entry, r.overhead_per_entry
        );
    }
    out
}

// ---------------------------------------------------------------------------------
// The report: criterion medians, ratios and targets.

fn criterion_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return PathBuf::from(home);
    }
    if let Some(target) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(target).join("criterion");
    }
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../target/criterion"))
}

/// The median time per iteration, in ns, of `group/id` from the last run.
fn median(id: &str) -> Option<f64> {
    let path = criterion_dir().join(id).join("new/estimates.json");
    let text = std::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v["median"]["point_estimate"].as_f64()
}

fn fmt_ns(v: Option<f64>) -> String {
    match v {
        Some(x) if x >= 1e6 => format!("{:.2} ms", x / 1e6),
        Some(x) if x >= 100.0 => format!("{x:.0} ns"),
        Some(x) => format!("{x:.2} ns"),
        None => "—".into(),
    }
}

fn fmt_ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 && a / b < 0.01 => format!("1/{:.0}", b / a),
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
        _ => "—".into(),
    }
}

fn verdict(value: Option<f64>, target: f64) -> &'static str {
    match value {
        Some(v) if v <= target => "met",
        Some(_) => "MISSED",
        None => "—",
    }
}

struct Report {
    lines: Vec<String>,
}

impl Report {
    fn row(&mut self, cells: &[String]) {
        self.lines.push(format!("| {} |", cells.join(" | ")));
    }
}

fn report(inserts: Option<&[(&'static str, InsertResult)]>) -> String {
    let mut r = Report { lines: Vec::new() };
    let s = |x: &str| x.to_string();
    r.row(&[
        s("benchmark"),
        s("oncely"),
        s("peer"),
        s("peer time"),
        s("oncely / peer"),
        s("target"),
        s("result"),
    ]);
    r.row(&[
        s("---"),
        s("---:"),
        s("---"),
        s("---:"),
        s("---:"),
        s("---"),
        s("---"),
    ]);

    // 1
    let delay = median("backoff/oncely_delay_after");
    let decide = median("backoff/oncely_on_failure");
    let backon_next = median("backoff/backon_build_next");
    r.row(&[
        s("1. `delay_after` (seeded)"),
        fmt_ns(delay),
        s("backon build + next"),
        fmt_ns(backon_next),
        fmt_ratio(delay, backon_next),
        s("—"),
        s("—"),
    ]);
    r.row(&[
        s("1. `RetryState::on_failure`"),
        fmt_ns(decide),
        s("backon build + next"),
        fmt_ns(backon_next),
        fmt_ratio(decide, backon_next),
        s("—"),
        s("—"),
    ]);

    // 2
    let floor = median("retry_ok/floor_direct");
    let ok = median("retry_ok/oncely");
    let backon = median("retry_ok/backon");
    let net = |x: Option<f64>, f: Option<f64>| Some(x? - f?);
    let (ok_net, backon_net) = (net(ok, floor), net(backon, floor));
    r.row(&[
        s("2. retry, success (absolute)"),
        fmt_ns(ok),
        s("backon"),
        fmt_ns(backon),
        fmt_ratio(ok, backon),
        s("—"),
        format!("floor {}", fmt_ns(floor)),
    ]);
    r.row(&[
        s("2. retry, success (net of floor)"),
        fmt_ns(ok_net),
        s("backon"),
        fmt_ns(backon_net),
        fmt_ratio(ok_net, backon_net),
        s("≤ 2 ns net"),
        s(verdict(ok_net, 2.0)),
    ]);

    // 3
    let floor = median("retry_ffs/floor_direct");
    let ffs = median("retry_ffs/oncely");
    for (peer, id) in [
        ("backon, no-op sleeper", "retry_ffs/backon_noop_sleep"),
        ("backon, tokio sleeper", "retry_ffs/backon_tokio_sleep"),
    ] {
        let p = median(id);
        r.row(&[
            s("3. fail, fail, succeed (0 delays)"),
            fmt_ns(ffs),
            s(peer),
            fmt_ns(p),
            fmt_ratio(ffs, p),
            s("≤ 30 ns"),
            format!("{} (floor {})", verdict(ffs, 30.0), fmt_ns(floor)),
        ]);
    }

    // 4
    let replay = median("replay/oncely");
    for (peer, id) in [
        ("moka `get_with` (key cloned)", "replay/moka_get_with"),
        ("moka `get_with_by_ref`", "replay/moka_get_with_by_ref"),
        ("naive Mutex<HashMap<_, Shared>>", "replay/naive_shared"),
        (
            "floor: Mutex<HashMap<String, u64>>",
            "replay/floor_mutex_map",
        ),
    ] {
        let p = median(id);
        r.row(&[
            s("4. `execute`, completed key replayed"),
            fmt_ns(replay),
            s(peer),
            fmt_ns(p),
            fmt_ratio(replay, p),
            s("≤ 60 ns"),
            s(verdict(replay, 60.0)),
        ]);
    }

    // 5
    let miss = median("miss/oncely");
    for (peer, id) in [
        ("moka `get_with_by_ref`", "miss/moka_get_with_by_ref"),
        ("naive Mutex<HashMap<_, Shared>>", "miss/naive_shared"),
        ("floor: Mutex<HashMap<String, u64>>", "miss/floor_mutex_map"),
    ] {
        let p = median(id);
        r.row(&[
            s("5. `execute`, miss (lead + complete)"),
            fmt_ns(miss),
            s(peer),
            fmt_ns(p),
            fmt_ratio(miss, p),
            s("—"),
            s("—"),
        ]);
    }

    // 6
    let per = |id: &str| median(id).map(|x| x / WAITERS as f64);
    let waiter = per("coalesce_10k/oncely");
    for (peer, id) in [
        ("moka `get_with`", "coalesce_10k/moka_get_with"),
        (
            "naive Mutex<HashMap<_, Shared>>",
            "coalesce_10k/naive_shared",
        ),
        (
            "floor: Shared gate, no map",
            "coalesce_10k/floor_shared_gate",
        ),
    ] {
        let p = per(id);
        r.row(&[
            s("6. 10k waiters on one key, per waiter"),
            fmt_ns(waiter),
            s(peer),
            fmt_ns(p),
            fmt_ratio(waiter, p),
            s("≤ 300 ns"),
            s(verdict(waiter, 300.0)),
        ]);
    }

    // 7
    if let Some(ins) = inserts {
        let get = |name: &str| ins.iter().find(|(n, _)| *n == name).map(|(_, r)| *r);
        let o = get("oncely");
        for peer in ["moka", "moka_ttl", "floor_mutex_map"] {
            let p = get(peer);
            let label = match peer {
                "moka" => "moka `get_with_by_ref`",
                "moka_ttl" => "moka, `time_to_live` 24 h",
                _ => "floor: Mutex<HashMap<String, u64>>",
            };
            r.row(&[
                s("7. 1M new keys, time per key"),
                fmt_ns(o.map(|x| x.ns_per_key)),
                s(label),
                fmt_ns(p.map(|x| x.ns_per_key)),
                fmt_ratio(o.map(|x| x.ns_per_key), p.map(|x| x.ns_per_key)),
                s("≤ 900 ns"),
                s(verdict(o.map(|x| x.ns_per_key), 900.0)),
            ]);
            r.row(&[
                s("7. 1M new keys, heap B/entry beyond key + value"),
                o.map_or("—".into(), |x| format!("{:.0} B", x.overhead_per_entry)),
                s(label),
                p.map_or("—".into(), |x| format!("{:.0} B", x.overhead_per_entry)),
                fmt_ratio(
                    o.map(|x| x.overhead_per_entry),
                    p.map(|x| x.overhead_per_entry),
                ),
                s("≤ 200 B"),
                s(verdict(o.map(|x| x.overhead_per_entry), 200.0)),
            ]);
        }
    }
    r.lines.join("\n")
}

// ---------------------------------------------------------------------------------
// Profile mode: `ONCELY_BENCH_PROFILE=scenario:n` runs one scenario n times and exits,
// for instruction counts under callgrind (`scripts/bench --instructions`): the count
// of a run with n = 0 (setup only) is subtracted, so the difference / n is per call.

fn profile(spec: &str) {
    let (name, n) = match spec.split_once(':') {
        Some((name, n)) => (name, n.parse::<u64>().expect("scenario:count")),
        None => (spec, 10_000),
    };
    let rt = tokio_rt();
    let fp = request_fingerprint();
    let fp = fp.as_str();
    let repeat = |f: &mut dyn FnMut()| (0..n).for_each(|_| f());
    macro_rules! run_async {
        ($body:expr) => {
            rt.block_on(async {
                for _ in 0..n {
                    let _ = black_box($body.await);
                }
            })
        };
    }
    match name {
        "delay_after" => {
            let p = RetryPolicy::new().with_seed(7);
            repeat(&mut || {
                black_box(black_box(&p).delay_after(black_box(2)));
            })
        }
        "on_failure" => {
            let proto =
                RetryState::new(RetryPolicy::new().with_seed(7)).with_facts(CallFacts::SAFE);
            repeat(&mut || {
                let mut s = black_box(&proto).clone();
                black_box(s.on_failure(black_box(Failure::new(Code::Unavailable)), Duration::ZERO));
            })
        }
        "backon_next" => {
            let b = ExponentialBuilder::default()
                .with_jitter()
                .with_jitter_seed(7);
            repeat(&mut || {
                black_box(black_box(b).build().next());
            })
        }
        "retry_ok_floor" => run_async!(ok_floor()),
        "retry_ok" => run_async!(ok_oncely()),
        "retry_ok_backon" => run_async!(ok_backon()),
        "retry_ffs_floor" => run_async!(ffs_floor()),
        "retry_ffs" => run_async!(ffs_oncely()),
        "retry_ffs_backon" => run_async!(ffs_backon_noop()),
        "replay" | "replay_moka" | "replay_naive" | "replay_floor" => {
            let r = Replay::new(&rt);
            match name {
                "replay" => run_async!(r.oncely()),
                "replay_moka" => run_async!(r.moka_get_with_by_ref()),
                "replay_naive" => run_async!(r.naive()),
                _ => repeat(&mut || {
                    black_box(r.floor());
                }),
            }
        }
        "miss" => {
            time_misses(&rt, n, MemoryStore::new, async |s, k| {
                miss_oncely(s, k, fp).await
            });
        }
        "miss_moka" => {
            time_misses(&rt, n, new_moka, miss_moka);
        }
        "miss_floor" => {
            time_misses(&rt, n, Mutex::default, miss_floor);
        }
        // n new keys into one store, as the 1M-key measurement does (for perf).
        "insert" => {
            let keys: Vec<ScopedKey> = (0..n).map(key_n).collect();
            let store = MemoryStore::new();
            futures::executor::block_on(miss_oncely(&store, &keys, fp));
        }
        // Making the keys only, to subtract from the miss scenarios.
        "miss_keys" => {
            time_misses(&rt, n, || (), async |_, _| {});
        }
        // n rounds of one leader and WAITERS joiners.
        "coalesce" => {
            let store = MemoryStore::new();
            repeat(&mut || {
                coalesce_oncely(&store, fp);
            })
        }
        "coalesce_moka" => {
            let cache = new_moka();
            repeat(&mut || {
                coalesce_moka(&cache);
            })
        }
        "coalesce_floor" => repeat(&mut || {
            coalesce_floor();
        }),
        _ => panic!("unknown profile scenario {name:?}"),
    }
}

// ---------------------------------------------------------------------------------

criterion_group!(
    name = benches;
    // Short by default so the whole run stays within a few minutes on 2 shared cores;
    // command-line options (`--measurement-time`, …) still override these.
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2));
    targets = bench_backoff, bench_retry, bench_replay, bench_miss, bench_coalesce
);

const INSERT_FILE: &str = "oncely-insert.json";

fn save_inserts(rows: &[(&'static str, InsertResult)]) {
    let json: serde_json::Map<String, serde_json::Value> = rows
        .iter()
        .map(|(name, r)| {
            (
                name.to_string(),
                serde_json::json!({
                    "ns_per_key": r.ns_per_key,
                    "bytes_per_entry": r.bytes_per_entry,
                    "overhead_per_entry": r.overhead_per_entry,
                }),
            )
        })
        .collect();
    let dir = criterion_dir();
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(
        dir.join(INSERT_FILE),
        serde_json::to_string_pretty(&json).unwrap(),
    );
}

fn load_inserts() -> Option<Vec<(&'static str, InsertResult)>> {
    let text = std::fs::read_to_string(criterion_dir().join(INSERT_FILE)).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let names = ["floor_mutex_map", "oncely", "moka", "moka_ttl"];
    Some(
        names
            .iter()
            .filter_map(|&name| {
                let r = v.get(name)?;
                Some((
                    name,
                    InsertResult {
                        ns_per_key: r["ns_per_key"].as_f64()?,
                        bytes_per_entry: r["bytes_per_entry"].as_f64()?,
                        overhead_per_entry: r["overhead_per_entry"].as_f64()?,
                    },
                ))
            })
            .collect(),
    )
}

fn main() {
    if let Ok(spec) = std::env::var("ONCELY_BENCH_PROFILE") {
        profile(&spec);
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    let flag = |f: &str| args.iter().any(|a| a == f);
    if flag("--list") {
        benches();
        return;
    }
    let test_mode = flag("--test");
    let table_only = std::env::var_os("ONCELY_BENCH_TABLE_ONLY").is_some();
    if !table_only {
        benches();
        Criterion::default().configure_from_args().final_summary();
        if std::env::var_os("ONCELY_BENCH_SKIP_1M").is_none() {
            let n = if test_mode { 10_000 } else { 1_000_000 };
            let rows = bench_insert_many(n);
            if !test_mode {
                save_inserts(&rows);
            }
        }
    }
    if test_mode {
        return;
    }
    let table = report(load_inserts().as_deref());
    println!(
        "\n## oncely vs peers (criterion medians; oncely / peer < 1 means oncely is faster)\n"
    );
    println!("{table}");
    let _ = std::fs::write(criterion_dir().join("oncely-report.md"), table + "\n");
}
