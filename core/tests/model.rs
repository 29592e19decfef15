//! Model test of the dedup state machine with shuttle: the store's locks and atomics
//! are shuttle's (feature `shuttle`), so shuttle explores the interleavings of begin,
//! join, complete, fail and abandon, and fails on any deadlock or lost wake-up.
//!
//! Run: `cargo test -p oncely --features shuttle --test model`.
#![cfg(feature = "shuttle")]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use oncely::{Begin, ExecuteError, ExecuteOptions, IdempotencyKey, MemoryStore, ScopedKey, Source};
use shuttle::future::{block_on, spawn, yield_now};

const ITERATIONS: usize = 3_000;

fn key() -> ScopedKey {
    ScopedKey::new("t", "m", &IdempotencyKey::parse("key-0001").unwrap()).unwrap()
}

fn check(test: impl Fn() + Send + Sync + 'static) {
    let test = Arc::new(test);
    let t = test.clone();
    shuttle::check_random(move || t(), ITERATIONS);
    shuttle::check_pct(move || test(), ITERATIONS, 3);
}

#[test]
fn concurrent_callers_run_the_action_once_and_share_its_value() {
    check(|| {
        let store: MemoryStore<usize, ()> = MemoryStore::new();
        let runs = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..3)
            .map(|i| {
                let (store, runs) = (store.clone(), runs.clone());
                spawn(async move {
                    store
                        .execute(&key(), "fp", || async move {
                            runs.fetch_add(1, Ordering::SeqCst);
                            yield_now().await;
                            Ok(i)
                        })
                        .await
                        .unwrap()
                })
            })
            .collect();
        let results: Vec<_> = block_on(async {
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.unwrap());
            }
            out
        });
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert!(results.iter().all(|r| r.value == results[0].value));
        assert_eq!(
            results.iter().filter(|r| r.source == Source::Led).count(),
            1
        );
    });
}

#[test]
fn an_abandoned_lead_is_taken_over_and_nobody_hangs() {
    check(|| {
        let store: MemoryStore<usize, ()> = MemoryStore::new();
        let runs = Arc::new(AtomicUsize::new(0));
        // A leader that claims the key and goes away without settling.
        let s = store.clone();
        let quitter = spawn(async move {
            if let Ok(Begin::Lead(lease)) = s.begin(&key(), "fp", ExecuteOptions::default()) {
                yield_now().await;
                drop(lease);
            }
        });
        let tasks: Vec<_> = (0..2)
            .map(|i| {
                let (store, runs) = (store.clone(), runs.clone());
                spawn(async move {
                    store
                        .execute(&key(), "fp", || async move {
                            runs.fetch_add(1, Ordering::SeqCst);
                            yield_now().await;
                            Ok(10 + i)
                        })
                        .await
                        .unwrap()
                })
            })
            .collect();
        let results: Vec<_> = block_on(async {
            quitter.await.unwrap();
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.unwrap());
            }
            out
        });
        // The quitter never completes, so exactly one of the others ran its action.
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert!(results.iter().all(|r| r.value == results[0].value));
    });
}

#[test]
fn a_failure_reaches_waiters_or_they_run_again_never_a_stale_entry() {
    check(|| {
        let store: MemoryStore<usize, &'static str> = MemoryStore::new();
        let runs = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..3)
            .map(|i| {
                let (store, runs) = (store.clone(), runs.clone());
                spawn(async move {
                    store
                        .execute(&key(), "fp", || async move {
                            let n = runs.fetch_add(1, Ordering::SeqCst);
                            yield_now().await;
                            if n == 0 {
                                Err("first run fails")
                            } else {
                                Ok(i)
                            }
                        })
                        .await
                })
            })
            .collect();
        let results: Vec<_> = block_on(async {
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.unwrap());
            }
            out
        });
        let failed = results
            .iter()
            .filter(|r| matches!(r, Err(ExecuteError::Action(_))))
            .count();
        let ok: Vec<_> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
        assert!(failed >= 1, "the first run's caller sees its failure");
        assert_eq!(failed + ok.len(), 3);
        // Successes all share one value, from at most one successful run.
        assert!(ok.iter().all(|r| r.value == ok[0].value));
        assert!(runs.load(Ordering::SeqCst) <= 2);
        assert_eq!(runs.load(Ordering::SeqCst), 1 + usize::from(!ok.is_empty()));
    });
}

#[test]
fn a_completed_entry_is_replayed_with_the_leaders_value() {
    check(|| {
        let store: MemoryStore<usize, ()> = MemoryStore::new();
        let s = store.clone();
        let leader = spawn(async move {
            s.execute(&key(), "fp", || async {
                yield_now().await;
                Ok(1)
            })
            .await
            .unwrap()
        });
        let s = store.clone();
        let late = spawn(async move {
            yield_now().await;
            s.execute(&key(), "fp", || async { Ok(2) }).await.unwrap()
        });
        block_on(async {
            let a = leader.await.unwrap();
            let b = late.await.unwrap();
            assert_eq!(a.value, b.value);
            assert_eq!(a.value, if a.source == Source::Led { 1 } else { 2 });
        });
        assert_eq!(store.counters().leads, 1);
    });
}
