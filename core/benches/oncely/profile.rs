//! Profile mode: `ONCELY_BENCH_PROFILE=scenario:n` runs one scenario n times and exits,
//! for instruction counts under callgrind (`scripts/bench --instructions`): the count
//! of a run with n = 0 (setup only) is subtracted, so the difference / n is per call.

use super::*;

pub(crate) fn profile(spec: &str) {
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
