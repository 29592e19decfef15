//! The store conformance suite: the same scenarios against every [`DedupStore`]
//! (the core's `MemoryStore` in `tests/memory.rs`, Redis in `tests/redis.rs`).
//!
//! A [`Harness`] makes stores; `conformance_tests!(harness)` expands to one `#[test]`
//! per scenario. Every scenario runs under a hard timeout: hanging means a deadlock.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use futures::executor::block_on;
use oncely::{
    execute, Begin, Code, DedupStore, Error, ExecuteError, ExecuteOptions, IdempotencyKey,
    LeaderLease, ScopedKey, Source,
};

/// The action error used by the scenarios.
#[derive(Debug, PartialEq, Eq)]
pub struct Boom(pub &'static str);

/// Makes the stores a scenario runs on.
pub trait Harness: Sync {
    /// The store under test.
    type Store: DedupStore<Vec<u8>, Boom> + Clone + Send + Sync + 'static;
    /// Whether claims are leases that expire (shared stores) rather than in-process
    /// entries removed when their leader is dropped.
    const LEASES: bool;
    /// The lease of the stores made (how long a crashed leader blocks a key).
    fn lease(&self) -> Duration;
    /// A fresh, empty store whose results are kept for `ttl`.
    fn store(&self, ttl: Duration) -> Self::Store;
    /// Another instance on the same backend (for Redis: its own threads, connections
    /// and in-process tier, as another process would have).
    fn peer(&self, store: &Self::Store) -> Self::Store;
    /// The leader goes away without settling, as a crashed process would.
    fn crash(&self, lease: Lease<Self>);
    /// The leader stops renewing but lives on, as a paused process would.
    fn pause(&self, lease: &Lease<Self>);
}

/// The lease type of a harness's store.
pub type Lease<H> = <<H as Harness>::Store as DedupStore<Vec<u8>, Boom>>::Lease;

const DAY: Duration = Duration::from_secs(24 * 3600);

/// Runs `f` on a thread and fails if it does not finish in time.
pub fn with_timeout(limit: Duration, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(limit) {
        Ok(()) => t.join().unwrap(),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            if let Err(p) = t.join() {
                std::panic::resume_unwind(p)
            }
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("scenario still running after {limit:?}: a deadlock or a lost wake-up")
        }
    }
}

pub fn key() -> ScopedKey {
    ScopedKey::new("acme", "CreateOrder", &IdempotencyKey::random()).unwrap()
}

fn fp(s: &str) -> String {
    oncely::fingerprint(&serde_json::json!({ "req": s })).unwrap()
}

type Outcome = Result<oncely::Executed<Vec<u8>>, ExecuteError<Boom>>;

fn run<S: DedupStore<Vec<u8>, Boom>>(
    store: &S,
    key: &ScopedKey,
    fingerprint: &str,
    options: ExecuteOptions,
    runs: &AtomicUsize,
    value: &[u8],
) -> Outcome {
    block_on(execute(store, key, fingerprint, options, || async {
        runs.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(30));
        Ok(value.to_vec())
    }))
}

fn store_code<T: std::fmt::Debug>(r: Result<T, ExecuteError<Boom>>) -> (Code, Error) {
    match r {
        Err(ExecuteError::Store(e)) => (e.code(), e),
        other => panic!("expected an oncely error, got {other:?}"),
    }
}

fn lead<S: DedupStore<Vec<u8>, Boom>>(store: &S, key: &ScopedKey, f: &str) -> S::Lease {
    match block_on(store.begin(key, f, ExecuteOptions::default())) {
        Ok(Begin::Lead(l)) => l,
        other => panic!(
            "expected to lead, got {:?}",
            other.map(|b| format!("{b:?}"))
        ),
    }
}

/// Many concurrent callers on one key (spread over two instances): one run, one
/// leader, everyone gets its value.
pub fn race_one_run<H: Harness>(h: &H) {
    let a = h.store(DAY);
    let b = h.peer(&a);
    let k = key();
    let f = fp("race");
    let runs = Arc::new(AtomicUsize::new(0));
    let n = 16;
    let barrier = Arc::new(Barrier::new(n));
    let handles: Vec<_> = (0..n)
        .map(|i| {
            let store = if i % 2 == 0 { a.clone() } else { b.clone() };
            let (k, f, runs, barrier) = (k.clone(), f.clone(), runs.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let v = format!("value-{i}");
                run(
                    &store,
                    &k,
                    &f,
                    ExecuteOptions::default(),
                    &runs,
                    v.as_bytes(),
                )
                .unwrap()
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the action ran more than once"
    );
    let led: Vec<_> = results.iter().filter(|r| r.source == Source::Led).collect();
    assert_eq!(led.len(), 1);
    assert!(results.iter().all(|r| r.value == led[0].value));
}

/// A completed key replays its stored value without running the action.
pub fn replay<H: Harness>(h: &H) {
    let s = h.store(DAY);
    let k = key();
    let f = fp("replay");
    let runs = AtomicUsize::new(0);
    let first = run(&s, &k, &f, ExecuteOptions::default(), &runs, b"first").unwrap();
    assert_eq!(
        (first.value.as_slice(), first.source),
        (&b"first"[..], Source::Led)
    );
    let again = run(&s, &k, &f, ExecuteOptions::default(), &runs, b"second").unwrap();
    assert_eq!(
        (again.value.as_slice(), again.source),
        (&b"first"[..], Source::Replayed)
    );
    let peer = h.peer(&s);
    let there = run(&peer, &k, &f, ExecuteOptions::default(), &runs, b"third").unwrap();
    assert_eq!(
        (there.value.as_slice(), there.source),
        (&b"first"[..], Source::Replayed)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// One key with other parameters is FAILED_PRECONDITION, completed or in flight.
pub fn fingerprint_mismatch<H: Harness>(h: &H) {
    let s = h.store(DAY);
    let runs = AtomicUsize::new(0);
    let k = key();
    run(&s, &k, &fp("one"), ExecuteOptions::default(), &runs, b"v").unwrap();
    let (code, e) = store_code(run(
        &s,
        &k,
        &fp("two"),
        ExecuteOptions::default(),
        &runs,
        b"x",
    ));
    assert_eq!(
        (code, e),
        (Code::FailedPrecondition, Error::FingerprintMismatch)
    );
    // In flight, seen from this instance and from another.
    let k2 = key();
    let lease = lead(&s, &k2, &fp("one"));
    for store in [s.clone(), h.peer(&s)] {
        let (code, _) = store_code(run(
            &store,
            &k2,
            &fp("two"),
            ExecuteOptions::default(),
            &runs,
            b"x",
        ));
        assert_eq!(code, Code::FailedPrecondition);
    }
    block_on(lease.complete(b"v".to_vec())).unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// After the TTL the result is gone and the action runs again.
pub fn expiry<H: Harness>(h: &H) {
    let s = h.store(Duration::from_millis(200));
    let k = key();
    let f = fp("expiry");
    let runs = AtomicUsize::new(0);
    run(&s, &k, &f, ExecuteOptions::default(), &runs, b"old").unwrap();
    std::thread::sleep(Duration::from_millis(400));
    let again = run(&s, &k, &f, ExecuteOptions::default(), &runs, b"new").unwrap();
    assert_eq!(
        (again.value.as_slice(), again.source),
        (&b"new"[..], Source::Led)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// A failure is given back and not cached: the next call runs again.
pub fn failure_not_cached<H: Harness>(h: &H) {
    let s = h.store(DAY);
    let k = key();
    let f = fp("fail");
    let r = block_on(execute(&s, &k, &f, ExecuteOptions::default(), || async {
        Err::<Vec<u8>, _>(Boom("down"))
    }));
    match r {
        Err(ExecuteError::Action(e)) => assert_eq!(*e, Boom("down")),
        other => panic!("expected the action's error, got {other:?}"),
    }
    let runs = AtomicUsize::new(0);
    for store in [s.clone(), h.peer(&s)] {
        let k = key();
        let _ = block_on(execute(
            &store,
            &k,
            &f,
            ExecuteOptions::default(),
            || async { Err::<Vec<u8>, _>(Boom("down")) },
        ));
        let ok = run(&store, &k, &f, ExecuteOptions::default(), &runs, b"ok").unwrap();
        assert_eq!(ok.source, Source::Led);
    }
    let ok = run(&s, &k, &f, ExecuteOptions::default(), &runs, b"ok").unwrap();
    assert_eq!(ok.source, Source::Led);
}

/// A leader that goes away (crashed, dropped) without settling: a waiter that was
/// already waiting, and a later caller, get the key; exactly one of them runs.
pub fn takeover_after_crash<H: Harness>(h: &H) {
    let a = h.store(DAY);
    let b = h.peer(&a);
    let k = key();
    let f = fp("takeover");
    let runs = Arc::new(AtomicUsize::new(0));
    let lease = lead(&a, &k, &f);
    let waiter = {
        let (b, k, f, runs) = (b.clone(), k.clone(), f.clone(), runs.clone());
        std::thread::spawn(move || run(&b, &k, &f, ExecuteOptions::default(), &runs, b"waiter"))
    };
    std::thread::sleep(Duration::from_millis(50));
    let crashed = Instant::now();
    h.crash(lease);
    let w = waiter.join().unwrap().unwrap();
    assert_eq!(
        (w.value.as_slice(), w.source),
        (&b"waiter"[..], Source::Led)
    );
    if H::LEASES {
        assert!(
            crashed.elapsed() + Duration::from_millis(60) >= h.lease(),
            "taken over before the crashed leader's lease ran out"
        );
    }
    let later = run(&b, &k, &f, ExecuteOptions::default(), &runs, b"later").unwrap();
    assert_eq!(
        (later.value.as_slice(), later.source),
        (&b"waiter"[..], Source::Replayed)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A leader whose lease lapsed and was taken over cannot complete: LEASE_LOST
/// (ABORTED), and the new leader's result stands.
pub fn lost_lease_fenced<H: Harness>(h: &H) {
    assert!(H::LEASES, "only for stores with leases");
    let a = h.store(DAY);
    let b = h.peer(&a);
    let k = key();
    let f = fp("fenced");
    let runs = AtomicUsize::new(0);
    let old = lead(&a, &k, &f);
    h.pause(&old);
    std::thread::sleep(h.lease() + Duration::from_millis(100));
    let new = run(&b, &k, &f, ExecuteOptions::default(), &runs, b"new").unwrap();
    assert_eq!(new.source, Source::Led);
    let err = block_on(old.complete(b"old".to_vec())).unwrap_err();
    assert_eq!((err.code(), err), (Code::Aborted, Error::LeaseLost));
    let c = h.peer(&a);
    let r = run(&c, &k, &f, ExecuteOptions::default(), &runs, b"third").unwrap();
    assert_eq!(
        (r.value.as_slice(), r.source),
        (&b"new"[..], Source::Replayed)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A running leader renews its lease: an action longer than the lease is not taken
/// over.
pub fn renewal_keeps_lease<H: Harness>(h: &H) {
    let a = h.store(DAY);
    let b = h.peer(&a);
    let k = key();
    let f = fp("renew");
    let runs = AtomicUsize::new(0);
    let lease = lead(&a, &k, &f);
    std::thread::sleep(h.lease() * 2);
    let (code, _) = store_code(run(&b, &k, &f, ExecuteOptions::NO_WAIT, &runs, b"x"));
    assert_eq!(code, Code::Aborted);
    block_on(lease.complete(b"long".to_vec())).unwrap();
    let r = run(&b, &k, &f, ExecuteOptions::default(), &runs, b"x").unwrap();
    assert_eq!(
        (r.value.as_slice(), r.source),
        (&b"long"[..], Source::Replayed)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

/// With no-wait, a running call is ABORTED + retry-after at once, on this instance
/// and on another; the action does not run.
pub fn no_wait_aborted<H: Harness>(h: &H) {
    let a = h.store(DAY);
    let k = key();
    let f = fp("nowait");
    let runs = AtomicUsize::new(0);
    let lease = lead(&a, &k, &f);
    for store in [a.clone(), h.peer(&a)] {
        let t = Instant::now();
        let (code, e) = store_code(run(&store, &k, &f, ExecuteOptions::NO_WAIT, &runs, b"x"));
        assert_eq!(code, Code::Aborted);
        assert!(e.retry_after().is_some(), "{e:?} has no retry-after");
        assert!(t.elapsed() < Duration::from_millis(500), "no-wait waited");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    block_on(lease.complete(b"v".to_vec())).unwrap();
}

/// Waiters get the leader's value when it completes (joined, not re-run).
pub fn waiters_share_value<H: Harness>(h: &H) {
    let a = h.store(DAY);
    let b = h.peer(&a);
    let k = key();
    let f = fp("join");
    let runs = Arc::new(AtomicUsize::new(0));
    let lease = lead(&a, &k, &f);
    let waiters: Vec<_> = [a.clone(), b.clone(), b.clone()]
        .into_iter()
        .map(|s| {
            let (k, f, runs) = (k.clone(), f.clone(), runs.clone());
            std::thread::spawn(move || run(&s, &k, &f, ExecuteOptions::default(), &runs, b"x"))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    block_on(lease.complete(b"shared".to_vec())).unwrap();
    for w in waiters {
        let r = w.join().unwrap().unwrap();
        assert_eq!(r.value, b"shared");
        assert!(r.is_replay());
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

/// Expands to one `#[test]` per scenario for `$harness` (an expression), with extra
/// attributes (e.g. `#[ignore = "…"]`) on each: `common` scenarios hold for every
/// store, `leases` ones only for stores whose claims are expiring leases.
#[macro_export]
macro_rules! conformance_tests {
    (common: $harness:expr $(, #[$attr:meta])*) => {
        $crate::conformance_tests!(@each $harness, [$(#[$attr])*],
            race_one_run, replay, fingerprint_mismatch, expiry, failure_not_cached,
            takeover_after_crash, no_wait_aborted, waiters_share_value);
    };
    (leases: $harness:expr $(, #[$attr:meta])*) => {
        $crate::conformance_tests!(@each $harness, [$(#[$attr])*],
            lost_lease_fenced, renewal_keeps_lease);
    };
    (@each $harness:expr, [$($attr:tt)*], $name:ident $(, $rest:ident)*) => {
        #[test]
        $($attr)*
        fn $name() {
            conformance::with_timeout(std::time::Duration::from_secs(60), || {
                conformance::$name(&$harness)
            });
        }
        $crate::conformance_tests!(@each $harness, [$($attr)*] $(, $rest)*);
    };
    (@each $harness:expr, [$($attr:tt)*]) => {};
}
