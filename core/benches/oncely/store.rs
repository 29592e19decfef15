//! 4. Replay of a completed key, and 5. a miss (lead + complete on a fresh key).

use super::*;

/// Other entries in every store of the replay group, so lookups do not run in a
/// one-entry table.
pub(crate) const BACKGROUND_KEYS: u64 = 10_000;

/// One completed key (and `BACKGROUND_KEYS` others) in oncely's store and in each peer.
pub(crate) struct Replay {
    key: ScopedKey,
    fp: String,
    store: MemoryStore<u64, Code>,
    floor: Mutex<HashMap<String, u64>>,
    cache: moka::future::Cache<String, u64>,
    naive: NaiveShared,
}

impl Replay {
    pub(crate) fn new(rt: &tokio::runtime::Runtime) -> Self {
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

    pub(crate) fn floor(&self) -> u64 {
        let map = self.floor.lock().unwrap();
        map.get(black_box(&self.key).as_str()).copied().unwrap()
    }

    pub(crate) async fn oncely(&self) -> u64 {
        let done = self
            .store
            .execute(black_box(&self.key), black_box(&self.fp), || async {
                Ok::<_, Code>(0)
            })
            .await
            .unwrap();
        done.value
    }

    pub(crate) async fn moka_get_with(&self) -> u64 {
        let key = black_box(&self.key).as_str().to_owned();
        self.cache.get_with(key, async { 0 }).await
    }

    pub(crate) async fn moka_get_with_by_ref(&self) -> u64 {
        let key = black_box(&self.key).as_str();
        self.cache.get_with_by_ref(key, async { 0 }).await
    }

    pub(crate) async fn naive(&self) -> u64 {
        let key = black_box(&self.key).as_str();
        self.naive.get_with(key, async { 0 }).await
    }
}

pub(crate) fn bench_replay(c: &mut Criterion) {
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
pub(crate) fn time_misses<S>(
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

pub(crate) fn rand_base() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(Instant::now()) >> 8
}

pub(crate) async fn miss_floor(map: &Mutex<HashMap<String, u64>>, keys: &[ScopedKey]) {
    for (i, k) in keys.iter().enumerate() {
        map.lock().unwrap().insert(k.as_str().to_owned(), i as u64);
    }
}

pub(crate) async fn miss_oncely(store: &MemoryStore<u64, Code>, keys: &[ScopedKey], fp: &str) {
    for (i, k) in keys.iter().enumerate() {
        let i = i as u64;
        let done = store.execute(k, fp, || async move { Ok(i) }).await;
        black_box(done.unwrap());
    }
}

pub(crate) async fn miss_moka(cache: &moka::future::Cache<String, u64>, keys: &[ScopedKey]) {
    for (i, k) in keys.iter().enumerate() {
        let i = i as u64;
        black_box(cache.get_with_by_ref(k.as_str(), async move { i }).await);
    }
}

pub(crate) async fn miss_naive(naive: &NaiveShared, keys: &[ScopedKey]) {
    for (i, k) in keys.iter().enumerate() {
        let i = i as u64;
        black_box(naive.get_with(k.as_str(), async move { i }).await);
    }
}

pub(crate) fn new_moka() -> moka::future::Cache<String, u64> {
    moka::future::Cache::builder().build()
}

pub(crate) fn bench_miss(c: &mut Criterion) {
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
