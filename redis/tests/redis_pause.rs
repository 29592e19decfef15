//! Redis stops answering for a while (`CLIENT PAUSE`): callers get UNAVAILABLE without
//! running their action, the store works again afterwards, and a leader keeps its
//! lease across a pause shorter than the lease.
//!
//! Its own test binary, so the pause cannot slow down the other Redis tests (cargo
//! runs test binaries one after another). Gated like `tests/redis.rs`: ignored unless
//! run by scripts/test-redis.

mod support;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::executor::block_on;
use oncely::{Begin, Code, ExecuteError, ExecuteOptions, IdempotencyKey, LeaderLease, ScopedKey};
use oncely_redis::RedisStore;
use support::url;

fn key() -> ScopedKey {
    ScopedKey::new("acme", "Pay", &IdempotencyKey::random()).unwrap()
}

fn pause(ms: u64) {
    let mut c = redis::Client::open(url())
        .unwrap()
        .get_connection()
        .unwrap();
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(ms)
        .arg("ALL")
        .query(&mut c)
        .unwrap();
}

/// The scenarios run one after another: two pauses at once would overlap.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn redis_paused() {
    paused_redis_is_unavailable_then_recovers();
    leader_keeps_lease_across_short_pause();
}

fn paused_redis_is_unavailable_then_recovers() {
    let prefix = format!("p{}", IdempotencyKey::random().as_str());
    let s: RedisStore<std::io::Error> = RedisStore::builder(url())
        .prefix(&prefix)
        .io_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    // Connections are open before the pause, as in a running service.
    let warm = block_on(s.execute(&key(), "f", || async { Ok(vec![1]) })).unwrap();
    assert_eq!(warm.value, vec![1]);

    let ran = AtomicUsize::new(0);
    let k = key();
    pause(1500);
    let t = Instant::now();
    let r = block_on(
        s.execute_with(&k, "f", ExecuteOptions::default(), || async {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok(vec![2])
        }),
    );
    match r {
        Err(ExecuteError::Store(e)) => {
            assert_eq!(e.code(), Code::Unavailable, "{e}");
            assert!(e.to_string().contains("timed out"), "{e}");
        }
        other => panic!("expected UNAVAILABLE during the pause, got {other:?}"),
    }
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(
        ran.load(Ordering::SeqCst),
        0,
        "the action ran without a claim"
    );

    std::thread::sleep(Duration::from_millis(1700));
    let again = block_on(s.execute(&k, "f", || async {
        ran.fetch_add(1, Ordering::SeqCst);
        Ok(vec![3])
    }))
    .unwrap();
    assert_eq!(again.value, vec![3]);
    assert_eq!(ran.load(Ordering::SeqCst), 1);
}

fn leader_keeps_lease_across_short_pause() {
    let prefix = format!("p{}", IdempotencyKey::random().as_str());
    let build = || -> RedisStore<std::io::Error> {
        RedisStore::builder(url())
            .prefix(&prefix)
            .lease(Duration::from_millis(900))
            .io_timeout(Duration::from_millis(200))
            .build()
            .unwrap()
    };
    let (a, b) = (build(), build());
    let k = key();
    let lease = match block_on(a.begin(&k, "f", ExecuteOptions::default())).unwrap() {
        Begin::Lead(l) => l,
        other => panic!("{other:?}"),
    };
    pause(400);
    std::thread::sleep(Duration::from_millis(1200));
    // Renewal failed during the pause, resumed after it: still ours.
    assert!(!lease.is_lost());
    match block_on(b.execute_with(&k, "f", ExecuteOptions::NO_WAIT, || async { Ok(vec![9]) })) {
        Err(ExecuteError::Store(e)) => assert_eq!(e.code(), Code::Aborted, "{e}"),
        other => panic!("expected the key still in progress, got {other:?}"),
    }
    block_on(lease.complete(vec![7])).unwrap();
    let r = block_on(b.execute(&k, "f", || async { Ok(vec![9]) })).unwrap();
    assert_eq!(r.value, vec![7]);
}
