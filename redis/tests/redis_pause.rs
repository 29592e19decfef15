//! Redis stops answering for a while (`CLIENT PAUSE`): callers get UNAVAILABLE without
//! running their action, the store works again afterwards, and a leader keeps its
//! lease across a pause shorter than the lease; a pause that holds a waiter's look
//! until the completion is sent behind it does not lose its wake-up.
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
    remote_waiter_woken_by_a_completion_during_its_look();
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

/// A completion whose notification comes while the waiter is looking at the record
/// (woken by another message on its channel, its look read the record as running)
/// still wakes it: it listens again before it looks, not after. Each round wakes the
/// waiter with a stray message on its channel and pauses Redis' writes at once (one
/// pipeline), so that its look waits there; the completion is sent behind it. When the
/// pause ends, the look reads "running" and the completion's message follows its
/// reply. The waiter polls only every 60 s.
fn remote_waiter_woken_by_a_completion_during_its_look() {
    // Calls wait out the pause.
    let io = Duration::from_secs(2);
    let a: RedisStore<std::io::Error> = RedisStore::builder(url())
        .prefix(format!("w{}", IdempotencyKey::random().as_str()))
        .lease(Duration::from_secs(30))
        .io_timeout(io)
        .build()
        .unwrap();
    let b: RedisStore<std::io::Error> = RedisStore::builder(url())
        .prefix(a.prefix())
        .lease(Duration::from_secs(30))
        .io_timeout(io)
        .poll_interval(Duration::from_secs(60), Duration::from_secs(60))
        .build()
        .unwrap();
    let mut con = redis::Client::open(url())
        .unwrap()
        .get_connection()
        .unwrap();
    for round in 0..20 {
        let k = key();
        let channel = format!("{}:done", b.record_key(&k));
        let Begin::Lead(lease) = block_on(a.begin(&k, "f", ExecuteOptions::default())).unwrap()
        else {
            panic!("expected to lead")
        };
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let (b, k) = (b.clone(), k.clone());
            std::thread::spawn(move || {
                let r = block_on(b.execute(&k, "f", || async { Ok(b"no".to_vec()) }));
                let _ = tx.send(r.map(|d| d.value));
            });
        }
        // Subscribed, and past the look its subscription asks for.
        while redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(&channel)
            .query::<(String, i64)>(&mut con)
            .unwrap()
            .1
            == 0
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(20));
        let () = redis::pipe()
            .cmd("PUBLISH")
            .arg(&channel)
            .arg("stray")
            .ignore()
            .cmd("CLIENT")
            .arg("PAUSE")
            .arg(150)
            .arg("WRITE")
            .ignore()
            .query(&mut con)
            .unwrap();
        // The look is queued behind the pause by now; the completion queues after it.
        std::thread::sleep(Duration::from_millis(50));
        block_on(lease.complete(b"yes".to_vec())).unwrap();
        let got = rx
            .recv_timeout(Duration::from_secs(5))
            .unwrap_or_else(|_| panic!("round {round}: the completion did not wake the waiter"));
        assert_eq!(got.unwrap(), b"yes");
    }
}
