//! The dedup store's rules (SPEC §6), its concurrency and its failure handling.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use futures::channel::oneshot;
use futures::executor::block_on;
use futures::future::{join_all, FutureExt};
use oncely::{
    Begin, Code, Error, ExecuteError, ExecuteOptions, IdempotencyKey, Joined, ManualClock,
    MemoryStore, ScopedKey, Source,
};

fn key(n: usize) -> ScopedKey {
    let k = IdempotencyKey::derive(&format!("order-{n}"), "create").unwrap();
    ScopedKey::new("tenant", "CreateOrder", &k).unwrap()
}

const FP: &str = "fp-A";

#[derive(Debug, PartialEq)]
struct Boom(&'static str);

fn store() -> MemoryStore<u64, Boom> {
    MemoryStore::new()
}

#[test]
fn ten_thousand_concurrent_callers_run_the_action_once() {
    let store = store();
    let runs = AtomicUsize::new(0);
    let (tx, rx) = oneshot::channel::<()>();
    let rx = rx.shared();
    let k = key(1);
    let calls = (0..10_000).map(|_| {
        let (store, k, rx, runs) = (&store, &k, rx.clone(), &runs);
        async move {
            store
                .execute(k, FP, || async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    rx.await.unwrap();
                    Ok(7)
                })
                .await
        }
    });
    let all = join_all(calls);
    let release = async {
        // Let every caller register before the leader finishes.
        yield_now().await;
        tx.send(()).unwrap();
    };
    let (results, ()) = block_on(futures::future::join(all, release));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let mut led = 0;
    for r in results {
        let done = r.unwrap();
        assert_eq!(done.value, 7);
        led += usize::from(done.source == Source::Led);
    }
    assert_eq!(led, 1);
    let c = store.counters();
    assert_eq!((c.leads, c.joins), (1, 9_999));
}

#[test]
fn replay_returns_the_stored_result_and_marks_it() {
    let store = store();
    let k = key(2);
    let first = block_on(store.execute(&k, FP, || async { Ok(1) })).unwrap();
    assert!(!first.is_replay());
    let again = block_on(store.execute(&k, FP, || async { Ok(2) })).unwrap();
    assert_eq!((again.value, again.source), (1, Source::Replayed));
    assert!(again.is_replay());
    assert_eq!(store.counters().replays, 1);
}

#[test]
fn a_different_fingerprint_is_refused_for_completed_and_running_entries() {
    let store = store();
    let k = key(3);
    block_on(store.execute(&k, FP, || async { Ok(1) })).unwrap();
    let err = block_on(store.execute(&k, "fp-B", || async { Ok(2) })).unwrap_err();
    let e = err.store_error().unwrap();
    assert_eq!(e, &Error::FingerprintMismatch);
    assert_eq!(e.code(), Code::FailedPrecondition);

    let k2 = key(4);
    let Ok(Begin::Lead(lease)) = store.begin(&k2, FP, ExecuteOptions::default()) else {
        panic!("expected to lead")
    };
    let err = store
        .begin(&k2, "fp-B", ExecuteOptions::default())
        .unwrap_err();
    assert_eq!(err, Error::FingerprintMismatch);
    lease.complete_now(5);
    assert_eq!(store.counters().conflicts, 2);
}

#[test]
fn sha256_fingerprints_are_compared_exactly() {
    let store = store();
    let k = key(5);
    let a = oncely::fingerprint(&serde_json::json!({"a": 1})).unwrap();
    let b = oncely::fingerprint(&serde_json::json!({"a": 2})).unwrap();
    block_on(store.execute(&k, &a, || async { Ok(1) })).unwrap();
    assert!(block_on(store.execute(&k, &a, || async { Ok(2) })).is_ok());
    assert!(block_on(store.execute(&k, &b, || async { Ok(2) })).is_err());
    // Upper-case hex of the same digest is a different text: refused.
    assert!(block_on(store.execute(&k, &a.to_uppercase(), || async { Ok(2) })).is_err());
}

#[test]
fn entries_expire_after_the_ttl_and_run_again() {
    let clock = ManualClock::new();
    let store: MemoryStore<u64, Boom> = MemoryStore::builder()
        .ttl(Duration::from_secs(60))
        .clock(clock.clone())
        .build()
        .unwrap();
    let k = key(6);
    block_on(store.execute(&k, FP, || async { Ok(1) })).unwrap();
    clock.advance(Duration::from_secs(59));
    let r = block_on(store.execute(&k, FP, || async { Ok(2) })).unwrap();
    assert_eq!(r.value, 1);
    clock.advance(Duration::from_secs(1));
    let r = block_on(store.execute(&k, FP, || async { Ok(3) })).unwrap();
    assert_eq!((r.value, r.source), (3, Source::Led));
    assert_eq!(store.counters().expirations, 1);
}

#[test]
fn expired_entries_are_swept_without_a_background_thread() {
    let clock = ManualClock::new();
    let store: MemoryStore<u64, Boom> = MemoryStore::builder()
        .ttl(Duration::from_secs(1))
        .clock(clock.clone())
        .build()
        .unwrap();
    for round in 0..50 {
        for i in 0..100 {
            let k = key(round * 100 + i);
            block_on(store.execute(&k, FP, || async { Ok(1) })).unwrap();
        }
        clock.advance(Duration::from_secs(2));
    }
    // 5,000 keys were seen; at most the last round's and a few stragglers remain.
    assert!(store.len() <= 200, "len = {}", store.len());
    assert!(store.counters().expirations >= 4_800);
}

#[test]
fn a_failure_is_not_cached_and_reaches_every_waiter_as_the_same_error() {
    let store = store();
    let k = key(7);
    let (tx, rx) = oneshot::channel::<()>();
    let leader = store.execute(&k, FP, || async {
        rx.await.unwrap();
        Err(Boom("out of stock"))
    });
    let waiters = join_all((0..3).map(|_| store.execute(&k, FP, || async { Ok(99) })));
    let release = async {
        yield_now().await;
        tx.send(()).unwrap();
    };
    let (l, w, ()) = block_on(futures::future::join3(leader, waiters, release));
    let ExecuteError::Action(le) = l.unwrap_err() else {
        panic!("leader: expected the action's error")
    };
    for r in w {
        let ExecuteError::Action(we) = r.unwrap_err() else {
            panic!("waiter: expected the action's error")
        };
        assert!(Arc::ptr_eq(&le, &we), "waiters share the leader's error");
    }
    assert_eq!(*le, Boom("out of stock"));
    // Not cached: the next call runs again.
    let r = block_on(store.execute(&k, FP, || async { Ok(5) })).unwrap();
    assert_eq!((r.value, r.source), (5, Source::Led));
}

#[test]
fn a_failed_entry_is_removed_before_waiters_wake() {
    let store = store();
    let k = key(8);
    let Ok(Begin::Lead(lease)) = store.begin(&k, FP, ExecuteOptions::default()) else {
        panic!("expected to lead")
    };
    let Ok(Begin::Join(join)) = store.begin(&k, FP, ExecuteOptions::default()) else {
        panic!("expected to join")
    };
    let store2 = store.clone();
    let k2 = k.clone();
    let waiter = std::thread::spawn(move || {
        let out = join.wait();
        assert!(matches!(out, Joined::Failed(_)));
        // Retrying at once must lead, not see the stale failure.
        matches!(
            store2.begin(&k2, FP, ExecuteOptions::default()),
            Ok(Begin::Lead(_))
        )
    });
    std::thread::sleep(Duration::from_millis(10));
    lease.fail_now(Boom("x"));
    assert!(waiter.join().unwrap());
}

#[test]
fn permanent_failures_are_cached_only_when_asked_and_can_be_removed() {
    let store: MemoryStore<u64, Code> = MemoryStore::builder()
        .cache_permanent_failures()
        .build()
        .unwrap();
    let k = key(9);
    let runs = AtomicUsize::new(0);
    let run = |code: Code| {
        block_on(store.execute(&k, FP, || async {
            runs.fetch_add(1, Ordering::SeqCst);
            Err(code)
        }))
    };
    // Transient: not cached.
    run(Code::Unavailable).unwrap_err();
    run(Code::Unavailable).unwrap_err();
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    // Permanent: cached, replayed without running.
    run(Code::InvalidArgument).unwrap_err();
    let replay = run(Code::Unavailable).unwrap_err();
    assert_eq!(**replay.action_error().unwrap(), Code::InvalidArgument);
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    assert!(store.remove(&k));
    assert!(!store.remove(&k));
    block_on(store.execute(&k, FP, || async { Ok(1) })).unwrap();
}

#[test]
fn no_wait_callers_get_aborted_with_a_retry_after() {
    let store: MemoryStore<u64, Boom> = MemoryStore::builder()
        .in_progress_retry_after(Duration::from_millis(250))
        .build()
        .unwrap();
    let k = key(10);
    let Ok(Begin::Lead(lease)) = store.begin(&k, FP, ExecuteOptions::default()) else {
        panic!("expected to lead")
    };
    let err = block_on(store.execute_with(&k, FP, ExecuteOptions::NO_WAIT, || async { Ok(1) }))
        .unwrap_err();
    let e = err.store_error().unwrap();
    assert_eq!(e.code(), Code::Aborted);
    assert_eq!(e.retry_after(), Some(Duration::from_millis(250)));
    drop(lease);
}

/// A leader whose action awaits `steps` times before finishing.
async fn slow_ok(steps: usize, value: u64, runs: &AtomicUsize) -> Result<u64, Boom> {
    runs.fetch_add(1, Ordering::SeqCst);
    for _ in 0..steps {
        yield_now().await;
    }
    Ok(value)
}

#[test]
fn cancelling_the_leader_at_every_await_point_lets_a_waiter_take_over() {
    const STEPS: usize = 5;
    for cancel_after in 0..=STEPS {
        let store = store();
        let k = key(11);
        let runs = AtomicUsize::new(0);
        let waker = Waker::from(Arc::new(Noop));
        let mut cx = Context::from_waker(&waker);

        let mut leader = Box::pin(store.execute(&k, FP, || slow_ok(STEPS, 1, &runs)));
        let mut waiters: Vec<_> = (0..3)
            .map(|i| Box::pin(store.execute(&k, FP, move || async move { Ok(10 + i) })))
            .collect();
        // Poll the leader `cancel_after` times, with the waiters registered.
        assert!(leader.as_mut().poll(&mut cx).is_pending());
        for w in &mut waiters {
            assert!(w.as_mut().poll(&mut cx).is_pending());
        }
        for _ in 1..cancel_after {
            assert!(leader.as_mut().poll(&mut cx).is_pending());
        }
        drop(leader);
        // Exactly one waiter takes over; the others share its result.
        let results = block_on(join_all(waiters));
        let values: Vec<u64> = results.iter().map(|r| r.as_ref().unwrap().value).collect();
        assert!(values.iter().all(|v| *v == values[0]), "{values:?}");
        let led = results
            .iter()
            .filter(|r| r.as_ref().unwrap().source == Source::Led)
            .count();
        assert_eq!(led, 1, "cancel after {cancel_after}");
        assert_eq!(store.counters().leads, 2);
    }
}

#[test]
fn a_waiter_cancelled_leaves_the_others_alone() {
    let store = store();
    let k = key(12);
    let waker = Waker::from(Arc::new(Noop));
    let mut cx = Context::from_waker(&waker);
    let runs = AtomicUsize::new(0);
    let mut leader = Box::pin(store.execute(&k, FP, || slow_ok(1, 3, &runs)));
    assert!(leader.as_mut().poll(&mut cx).is_pending());
    let mut w1 = Box::pin(store.execute(&k, FP, || async { Ok(0) }));
    let mut w2 = Box::pin(store.execute(&k, FP, || async { Ok(0) }));
    assert!(w1.as_mut().poll(&mut cx).is_pending());
    assert!(w2.as_mut().poll(&mut cx).is_pending());
    drop(w1);
    let (l, w) = block_on(futures::future::join(leader, w2));
    assert_eq!(l.unwrap().value, 3);
    assert_eq!(w.unwrap().value, 3);
}

#[test]
fn a_panicking_action_reaches_waiters_and_the_store_stays_usable() {
    let store = store();
    let k = key(13);
    let waker = Waker::from(Arc::new(Noop));
    let mut cx = Context::from_waker(&waker);
    let mut leader = Box::pin(store.execute(&k, FP, || async {
        yield_now().await;
        panic!("kaboom");
    }));
    assert!(leader.as_mut().poll(&mut cx).is_pending());
    let mut waiter = Box::pin(store.execute(&k, FP, || async { Ok(1) }));
    assert!(waiter.as_mut().poll(&mut cx).is_pending());
    let caught = std::panic::catch_unwind(AssertUnwindSafe(|| leader.as_mut().poll(&mut cx)));
    let payload = caught.unwrap_err();
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"kaboom"));
    let err = block_on(waiter).unwrap_err();
    let e = err.store_error().unwrap();
    assert_eq!(e.code(), Code::Internal);
    assert!(e.to_string().contains("kaboom"), "{e}");
    // Usable afterwards, and the key runs again.
    let r = block_on(store.execute(&k, FP, || async { Ok(2) })).unwrap();
    assert_eq!((r.value, r.source), (2, Source::Led));
}

#[test]
fn a_panicking_blocking_action_is_contained() {
    let store = store();
    let k = key(14);
    let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
        store.execute_blocking(&k, FP, ExecuteOptions::default(), || panic!("sync boom"))
    }));
    assert!(r.is_err());
    assert!(store.is_empty());
    let r = store
        .execute_blocking(&k, FP, ExecuteOptions::default(), || Ok(4))
        .unwrap();
    assert_eq!(r.value, 4);
}

#[test]
fn max_entries_evicts_the_oldest_completed_and_never_a_running_one() {
    let store: MemoryStore<u64, Boom> = MemoryStore::builder().max_entries(3).build().unwrap();
    for i in 0..3 {
        block_on(store.execute(&key(100 + i), FP, || async { Ok(i as u64) })).unwrap();
    }
    block_on(store.execute(&key(103), FP, || async { Ok(3) })).unwrap();
    assert_eq!(store.len(), 3);
    assert_eq!(store.counters().evictions, 1);
    // The oldest (100) went first: it runs again.
    let r = block_on(store.execute(&key(100), FP, || async { Ok(50) })).unwrap();
    assert_eq!(r.source, Source::Led);
    // 101 was next-oldest and is gone too; 103 is still there.
    let r = block_on(store.execute(&key(103), FP, || async { Ok(0) })).unwrap();
    assert_eq!(r.source, Source::Replayed);

    // All in flight: RESOURCE_EXHAUSTED.
    let full: MemoryStore<u64, Boom> = MemoryStore::builder().max_entries(2).build().unwrap();
    let _a = full.begin(&key(1), FP, ExecuteOptions::default()).unwrap();
    let _b = full.begin(&key(2), FP, ExecuteOptions::default()).unwrap();
    let err = full
        .begin(&key(3), FP, ExecuteOptions::default())
        .unwrap_err();
    assert_eq!(err, Error::Capacity { max_entries: 2 });
    assert_eq!(err.code(), Code::ResourceExhausted);
}

#[test]
fn the_store_is_bounded_by_default_and_eviction_passes_over_running_entries() {
    let store: MemoryStore<u64, Boom> = MemoryStore::new();
    assert_eq!(store.max_entries(), Some(oncely::DEFAULT_MAX_ENTRIES));
    assert_eq!(oncely::DEFAULT_MAX_ENTRIES, 1_000_000);
    let unbounded = MemoryStore::<u64, Boom>::builder().unbounded().build();
    assert_eq!(unbounded.unwrap().max_entries(), None);

    let store: MemoryStore<u64, Boom> = MemoryStore::builder().max_entries(3).build().unwrap();
    // The oldest entry is running; two completed ones follow.
    let Ok(Begin::Lead(running)) = store.begin(&key(200), FP, ExecuteOptions::default()) else {
        panic!("expected to lead")
    };
    for i in 201..203 {
        block_on(store.execute(&key(i), FP, || async { Ok(1) })).unwrap();
    }
    for i in 203..205 {
        block_on(store.execute(&key(i), FP, || async { Ok(1) })).unwrap();
    }
    assert_eq!(store.counters().evictions, 2);
    assert!(matches!(
        store.begin(&key(200), FP, ExecuteOptions::NO_WAIT),
        Err(Error::InProgress { .. })
    ));
    running.complete_now(7);
    let r = block_on(store.execute(&key(200), FP, || async { Ok(0) })).unwrap();
    assert_eq!((r.value, r.source), (7, Source::Replayed));
}

#[test]
fn bad_configuration_and_fingerprints_are_refused_with_the_field_named() {
    let e = MemoryStore::<u64, Boom>::builder()
        .ttl(Duration::ZERO)
        .build()
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { field: "ttl", .. }));
    let e = MemoryStore::<u64, Boom>::builder()
        .max_entries(0)
        .build()
        .unwrap_err();
    assert!(matches!(
        e,
        Error::InvalidArgument {
            field: "max_entries",
            ..
        }
    ));
    let store = store();
    for fp in [String::new(), "x".repeat(1025)] {
        let e = store
            .begin(&key(1), &fp, ExecuteOptions::default())
            .unwrap_err();
        assert!(matches!(
            e,
            Error::InvalidArgument {
                field: "fingerprint",
                ..
            }
        ));
    }
}

#[test]
fn many_keys_from_many_threads_each_run_once() {
    let store = store();
    let runs: Arc<Vec<AtomicUsize>> = Arc::new((0..500).map(|_| AtomicUsize::new(0)).collect());
    let threads = 8;
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (store, runs, barrier) = (store.clone(), runs.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                for i in 0..500 {
                    let i = (i + t * 37) % 500;
                    let r = store
                        .execute_blocking(&key(i), FP, ExecuteOptions::default(), || {
                            runs[i].fetch_add(1, Ordering::SeqCst);
                            std::thread::yield_now();
                            Ok(i as u64)
                        })
                        .unwrap();
                    assert_eq!(r.value, i as u64);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert!(runs.iter().all(|r| r.load(Ordering::SeqCst) == 1));
    let c = store.counters();
    assert_eq!(c.leads, 500);
    assert_eq!(c.leads + c.joins + c.replays, 500 * threads as u64);
}

/// Gives other futures a turn: returns Pending once, waking itself.
async fn yield_now() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    })
    .await
}

/// A waker that counts its wakes.
struct Counting(AtomicUsize);
impl Wake for Counting {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}
struct Noop;
impl Wake for Noop {
    fn wake(self: Arc<Self>) {}
}

#[test]
fn a_join_is_pending_then_woken_then_ready() {
    let store = store();
    let k = key(15);
    let Ok(Begin::Lead(lease)) = store.begin(&k, FP, ExecuteOptions::default()) else {
        panic!("expected to lead")
    };
    let Ok(Begin::Join(mut join)) = store.begin(&k, FP, ExecuteOptions::default()) else {
        panic!("expected to join")
    };
    let counter = Arc::new(Counting(AtomicUsize::new(0)));
    let waker = Waker::from(counter.clone());
    let mut cx = Context::from_waker(&waker);
    assert!(Pin::new(&mut join).poll(&mut cx).is_pending());
    assert!(join.try_get().is_none());
    assert_eq!(counter.0.load(Ordering::SeqCst), 0);
    lease.complete_now(8);
    assert_eq!(counter.0.load(Ordering::SeqCst), 1);
    assert!(matches!(
        Pin::new(&mut join).poll(&mut cx),
        Poll::Ready(Joined::Value(8))
    ));
}

#[test]
fn dropping_a_lease_wakes_waiters_with_abandoned() {
    let store = store();
    let k = key(16);
    let Ok(Begin::Lead(lease)) = store.begin(&k, FP, ExecuteOptions::default()) else {
        panic!("expected to lead")
    };
    let Ok(Begin::Join(join)) = store.begin(&k, FP, ExecuteOptions::default()) else {
        panic!("expected to join")
    };
    drop(lease);
    assert!(matches!(block_on(join), Joined::Abandoned));
    assert!(store.is_empty());
}

/// The same scenario on three executors: the core needs no particular runtime.
async fn coalesce_on_runtime(sleep: impl Fn(Duration) -> Pin<Box<dyn Future<Output = ()> + Send>>) {
    let store: MemoryStore<u64, Boom> = MemoryStore::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let k = key(17);
    let calls = (0..100).map(|i| {
        let (store, k, runs) = (store.clone(), k.clone(), runs.clone());
        let nap = sleep(Duration::from_millis(20));
        async move {
            store
                .execute(&k, FP, move || async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    nap.await;
                    Ok(i)
                })
                .await
                .unwrap()
                .value
        }
    });
    let values = join_all(calls).await;
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(values.iter().all(|v| *v == values[0]));
}

fn timer(d: Duration) -> Pin<Box<dyn Future<Output = ()> + Send>> {
    Box::pin(futures_timer_sleep(d))
}

async fn futures_timer_sleep(d: Duration) {
    // The retry loop's own sleeper, which needs no runtime.
    use oncely::Sleeper;
    oncely::TimerSleeper.sleep(d).await
}

#[test]
fn runs_on_futures_executor() {
    block_on(coalesce_on_runtime(timer));
}

#[test]
fn runs_on_smol() {
    smol::block_on(coalesce_on_runtime(|d| {
        Box::pin(async move {
            smol::Timer::after(d).await;
        })
    }));
}

#[test]
fn runs_on_tokio() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(coalesce_on_runtime(|d| Box::pin(tokio::time::sleep(d))));
}

#[test]
fn tokio_tasks_on_many_keys_with_cancellation_never_hang() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        let store: MemoryStore<u64, Boom> = MemoryStore::new();
        let runs = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for i in 0..2_000u64 {
            let (store, runs) = (store.clone(), runs.clone());
            let k = key((i % 50) as usize);
            tasks.push(tokio::spawn(async move {
                let call = store.execute(&k, FP, || async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(i % 3)).await;
                    Ok(i % 50)
                });
                // Every third caller gives up quickly: cancellation by drop.
                if i % 3 == 0 {
                    let _ = tokio::time::timeout(Duration::from_micros(200), call).await;
                    None
                } else {
                    Some(call.await.unwrap().value)
                }
            }));
        }
        let all = tokio::time::timeout(Duration::from_secs(30), join_all(tasks))
            .await
            .expect("no caller may hang");
        for (i, r) in all.into_iter().enumerate() {
            if let Some(v) = r.unwrap() {
                assert_eq!(v, (i % 50) as u64);
            }
        }
        // Cancelled leaders let others run again, but never two at once on a key,
        // and every completed key ran exactly once to completion.
        assert!(runs.load(Ordering::SeqCst) >= 50);
        assert_eq!(store.len(), 50);
    });
}

/// A value whose `clone` panics once the clones allowed are used up.
#[derive(Debug)]
struct FragileClone {
    n: u64,
    clones_left: Arc<AtomicUsize>,
}

impl Clone for FragileClone {
    fn clone(&self) -> Self {
        if self
            .clones_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_err()
        {
            panic!("clone refused");
        }
        FragileClone {
            n: self.n,
            clones_left: self.clones_left.clone(),
        }
    }
}

/// Polls `fut` once; a panic is caught and returned as `Err`.
fn poll_catching<F: Future + Unpin>(fut: &mut F) -> Result<Poll<F::Output>, String> {
    let waker = Waker::from(Arc::new(Noop));
    let mut cx = Context::from_waker(&waker);
    std::panic::catch_unwind(AssertUnwindSafe(|| Pin::new(&mut *fut).poll(&mut cx)))
        .map_err(|p| oncely::panic_message(&*p))
}

#[test]
fn a_panicking_clone_of_the_result_while_settling_ends_every_waiter() {
    let store: MemoryStore<FragileClone, Boom> = MemoryStore::new();
    let k = key(40);
    let clones_left = Arc::new(AtomicUsize::new(usize::MAX));
    let value = FragileClone {
        n: 1,
        clones_left: clones_left.clone(),
    };
    let mut leader = Box::pin(store.execute(&k, FP, || async {
        yield_now().await;
        Ok(value)
    }));
    let mut waiter = Box::pin(store.execute(&k, FP, || async { unreachable!() }));
    assert!(poll_catching(&mut leader).unwrap().is_pending());
    assert!(poll_catching(&mut waiter).unwrap().is_pending());
    // The leader's own copy is made; the one the store keeps panics.
    clones_left.store(1, Ordering::SeqCst);
    assert_eq!(poll_catching(&mut leader).unwrap_err(), "clone refused");
    clones_left.store(usize::MAX, Ordering::SeqCst);
    let Ok(Poll::Ready(Err(err))) = poll_catching(&mut waiter) else {
        panic!("the waiter is still waiting")
    };
    assert_eq!(err.store_error().unwrap().code(), Code::Internal);
    assert!(store.is_empty());
    let again = block_on(store.execute(&k, FP, || async {
        Ok(FragileClone {
            n: 2,
            clones_left: clones_left.clone(),
        })
    }))
    .unwrap();
    assert_eq!((again.value.n, again.source), (2, Source::Led));

    // The same through the blocking path.
    let k = key(41);
    let Ok(Begin::Lead(lease)) = store.begin(&k, FP, ExecuteOptions::default()) else {
        panic!("expected to lead")
    };
    let Ok(Begin::Join(mut join)) = store.begin(&k, FP, ExecuteOptions::default()) else {
        panic!("expected to join")
    };
    assert!(poll_catching(&mut join).unwrap().is_pending());
    clones_left.store(0, Ordering::SeqCst);
    let caught = std::panic::catch_unwind(AssertUnwindSafe(|| {
        lease.complete_now(FragileClone {
            n: 3,
            clones_left: clones_left.clone(),
        })
    }));
    assert!(caught.is_err());
    assert!(matches!(
        poll_catching(&mut join),
        Ok(Poll::Ready(Joined::Panicked(_)))
    ));
    assert_eq!(store.len(), 1, "only the first key's entry is left");
}

#[test]
fn a_panicking_cache_predicate_ends_every_waiter() {
    let store: MemoryStore<u64, Boom> = MemoryStore::builder()
        .cache_failures_when(|e: &Boom| e.0 != "predicate bug" || panic!("predicate panicked"))
        .build()
        .unwrap();
    let k = key(42);
    let mut leader = Box::pin(store.execute(&k, FP, || async {
        yield_now().await;
        Err(Boom("predicate bug"))
    }));
    let mut waiters: Vec<_> = (0..3)
        .map(|_| Box::pin(store.execute(&k, FP, || async { Ok(9) })))
        .collect();
    assert!(poll_catching(&mut leader).unwrap().is_pending());
    for w in &mut waiters {
        assert!(poll_catching(w).unwrap().is_pending());
    }
    assert_eq!(
        poll_catching(&mut leader).unwrap_err(),
        "predicate panicked"
    );
    for w in &mut waiters {
        let Ok(Poll::Ready(Err(err))) = poll_catching(w) else {
            panic!("a waiter is still waiting")
        };
        assert_eq!(err.store_error().unwrap().code(), Code::Internal);
    }
    assert!(store.is_empty());
    let r = block_on(store.execute(&k, FP, || async { Ok(5) })).unwrap();
    assert_eq!((r.value, r.source), (5, Source::Led));
}

/// A clock that panics while `broken` is set.
struct BrokenClock {
    broken: Arc<std::sync::atomic::AtomicBool>,
}

impl oncely::Clock for BrokenClock {
    fn now(&self) -> Duration {
        assert!(!self.broken.load(Ordering::SeqCst), "clock broken");
        Duration::from_secs(1)
    }
}

#[test]
fn a_panicking_clock_while_settling_ends_every_waiter() {
    let broken = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let store: MemoryStore<u64, Boom> = MemoryStore::builder()
        .clock(BrokenClock {
            broken: broken.clone(),
        })
        .cache_failures_when(|_| true)
        .build()
        .unwrap();
    for (n, complete) in [(43, true), (44, false)] {
        let k = key(n);
        let Ok(Begin::Lead(lease)) = store.begin(&k, FP, ExecuteOptions::default()) else {
            panic!("expected to lead")
        };
        let Ok(Begin::Join(mut join)) = store.begin(&k, FP, ExecuteOptions::default()) else {
            panic!("expected to join")
        };
        assert!(poll_catching(&mut join).unwrap().is_pending());
        broken.store(true, Ordering::SeqCst);
        let caught = std::panic::catch_unwind(AssertUnwindSafe(|| {
            if complete {
                lease.complete_now(1);
            } else {
                lease.fail_now(Boom("x"));
            }
        }));
        broken.store(false, Ordering::SeqCst);
        assert!(caught.is_err());
        assert!(matches!(
            poll_catching(&mut join),
            Ok(Poll::Ready(Joined::Panicked(_)))
        ));
        assert!(store.is_empty());
    }
}

#[test]
fn forget_running_hands_running_keys_on_and_keeps_completed_ones() {
    let store: MemoryStore<u32, String> = MemoryStore::new();
    let done = ScopedKey::new("t", "m", &oncely::IdempotencyKey::random()).unwrap();
    let running = ScopedKey::new("t", "m", &oncely::IdempotencyKey::random()).unwrap();
    match store.begin(&done, "fp", ExecuteOptions::default()).unwrap() {
        Begin::Lead(lease) => lease.complete_now(1),
        other => panic!("expected a lead, got {other:?}"),
    }
    let Begin::Lead(old) = store
        .begin(&running, "fp", ExecuteOptions::default())
        .unwrap()
    else {
        panic!("expected a lead")
    };
    let Begin::Join(join) = store
        .begin(&running, "fp", ExecuteOptions::default())
        .unwrap()
    else {
        panic!("expected a join")
    };
    assert_eq!(store.forget_running(), 1);
    // The waiter is told the leader went away (it does not hang).
    assert!(matches!(join.wait(), Joined::Abandoned));
    // The next caller leads; the forgotten lease can no longer settle the key.
    let Begin::Lead(new) = store
        .begin(&running, "fp", ExecuteOptions::default())
        .unwrap()
    else {
        panic!("expected a new lead")
    };
    old.complete_now(7);
    new.complete_now(2);
    match store
        .begin(&running, "fp", ExecuteOptions::default())
        .unwrap()
    {
        Begin::Replay(Ok(v)) => assert_eq!(v, 2),
        other => panic!("expected the new leader's replay, got {other:?}"),
    }
    match store.begin(&done, "fp", ExecuteOptions::default()).unwrap() {
        Begin::Replay(Ok(v)) => assert_eq!(v, 1),
        other => panic!("expected a replay, got {other:?}"),
    }
    assert_eq!(store.forget_running(), 0);
}

#[test]
fn fail_running_ends_waits_with_the_error_and_keeps_completed_ones() {
    let store: MemoryStore<u32, String> = MemoryStore::new();
    let done = ScopedKey::new("t", "m", &oncely::IdempotencyKey::random()).unwrap();
    let running = ScopedKey::new("t", "m", &oncely::IdempotencyKey::random()).unwrap();
    match store.begin(&done, "fp", ExecuteOptions::default()).unwrap() {
        Begin::Lead(lease) => lease.complete_now(1),
        other => panic!("expected a lead, got {other:?}"),
    }
    let Begin::Lead(old) = store
        .begin(&running, "fp", ExecuteOptions::default())
        .unwrap()
    else {
        panic!("expected a lead")
    };
    let Begin::Join(join) = store
        .begin(&running, "fp", ExecuteOptions::default())
        .unwrap()
    else {
        panic!("expected a join")
    };
    let error = Error::Unavailable("in flight at fork".into());
    assert_eq!(store.fail_running(&error), Some(1));
    // The waiter gets the error (it neither hangs nor leads), and the lease dropped
    // afterwards does not turn it into "the leader went away".
    drop(old);
    assert!(matches!(join.wait(), Joined::Error(e) if e == error));
    match store.begin(&done, "fp", ExecuteOptions::default()).unwrap() {
        Begin::Replay(Ok(v)) => assert_eq!(v, 1),
        other => panic!("expected a replay, got {other:?}"),
    }
    assert_eq!(store.fail_running(&error), Some(0));
}
