//! 7. 1,000,000 distinct keys: time per new key and heap bytes per entry.

use super::*;

#[derive(Clone, Copy, Debug)]
pub(crate) struct InsertResult {
    pub(crate) ns_per_key: f64,
    pub(crate) bytes_per_entry: f64,
    pub(crate) overhead_per_entry: f64,
}

/// Inserts `keys` into a fresh store twice: once timed (allocator not counting),
/// once counting live heap bytes. Returns time per key and bytes per entry, the
/// overhead being the bytes beyond the key text and the 8-byte value.
pub(crate) fn insert_many<S>(
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

pub(crate) fn bench_insert_many(n: u64) -> Vec<(&'static str, InsertResult)> {
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
