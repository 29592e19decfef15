//! The conformance suite and Redis-specific tests on a real Redis.
//!
//! Tests that need a Redis are `#[ignore]`d with the reason "needs a Redis: run
//! scripts/test-redis", so a plain `cargo test --workspace` lists them as ignored
//! instead of passing them silently. `scripts/test-redis` starts a throwaway
//! redis-server, sets `ONCELY_REDIS_URL` and runs them with `--include-ignored`; run
//! that way without the variable, they fail and say so. The unreachable-Redis tests
//! need no server (they use a closed and a silent port on 127.0.0.1) and always run.

#[macro_use]
mod conformance;
mod support;

use std::io::Read;
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use conformance::{key, with_timeout, Boom, Harness, Lease};
use futures::executor::block_on;
use oncely::{Begin, Code, Error, ExecuteError, ExecuteOptions, LeaderLease, ScopedKey, Source};
use oncely_redis::RedisStore;
use support::url;

const LEASE: Duration = Duration::from_millis(300);

fn fresh_prefix() -> String {
    format!("t{}", oncely::IdempotencyKey::random().as_str())
}

fn build(prefix: &str, ttl: Duration) -> RedisStore<Boom> {
    RedisStore::builder(url())
        .prefix(prefix)
        .lease(LEASE)
        .ttl(ttl)
        .build()
        .unwrap()
}

struct Redis;

impl Harness for Redis {
    type Store = RedisStore<Boom>;
    const LEASES: bool = true;
    fn lease(&self) -> Duration {
        LEASE
    }
    fn store(&self, ttl: Duration) -> Self::Store {
        build(&fresh_prefix(), ttl)
    }
    fn peer(&self, store: &Self::Store) -> Self::Store {
        build(store.prefix(), store.ttl())
    }
    fn crash(&self, lease: Lease<Self>) {
        // No release, no renewal, no local settle: as if the process died.
        lease.stop_renewing();
        std::mem::forget(lease);
    }
    fn pause(&self, lease: &Lease<Self>) {
        lease.stop_renewing();
    }
}

mod conformance_redis {
    use super::*;
    conformance_tests!(common: Redis, #[ignore = "needs a Redis: run scripts/test-redis"]);
    conformance_tests!(leases: Redis, #[ignore = "needs a Redis: run scripts/test-redis"]);
}

fn raw() -> redis::Connection {
    redis::Client::open(url())
        .unwrap()
        .get_connection()
        .unwrap()
}

fn timed(f: impl FnOnce() + Send + 'static) {
    with_timeout(Duration::from_secs(60), f)
}

/// The record in Redis is the documented format, version 1.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn record_format_v1() {
    timed(|| {
        let s = build(&fresh_prefix(), Duration::from_secs(3600));
        let k = key();
        let rk = s.record_key(&k);
        assert_eq!(rk, format!("{{{}:{}}}", s.prefix(), k.as_str()));
        let lease = match block_on(s.begin(&k, "fp-1", ExecuteOptions::default())).unwrap() {
            Begin::Lead(l) => l,
            other => panic!("{other:?}"),
        };
        let mut c = raw();
        let running: std::collections::HashMap<String, Vec<u8>> =
            redis::cmd("HGETALL").arg(&rk).query(&mut c).unwrap();
        let field = |m: &std::collections::HashMap<String, Vec<u8>>, f: &str| {
            String::from_utf8(m.get(f).cloned().unwrap_or_default()).unwrap()
        };
        assert_eq!(field(&running, "v"), "1");
        assert_eq!(field(&running, "state"), "running");
        assert_eq!(field(&running, "fp"), "fp-1");
        assert_eq!(field(&running, "token"), lease.token());
        assert_eq!(field(&running, "gen"), "1");
        assert!(field(&running, "deadline").parse::<u64>().unwrap() > 1_600_000_000_000);
        block_on(lease.complete(vec![0, 159, 255])).unwrap();
        let done: std::collections::HashMap<String, Vec<u8>> =
            redis::cmd("HGETALL").arg(&rk).query(&mut c).unwrap();
        assert_eq!(field(&done, "state"), "done");
        assert_eq!(done["result"], vec![0, 159, 255]);
        assert!(!done.contains_key("deadline"));
        assert!(field(&done, "done_at").parse::<u64>().unwrap() > 1_600_000_000_000);
        let ttl: i64 = redis::cmd("PTTL").arg(&rk).query(&mut c).unwrap();
        assert!(ttl > 3_500_000 && ttl <= 3_600_000, "PTTL {ttl}");
    });
}

/// A record written in another format version is refused (UNAVAILABLE, fail closed).
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn unknown_record_version_refused() {
    timed(|| {
        let s = build(&fresh_prefix(), Duration::from_secs(60));
        let k = key();
        let mut c = raw();
        let _: () = redis::cmd("HSET")
            .arg(s.record_key(&k))
            .arg(&["v", "99", "state", "done", "fp", "f"])
            .query(&mut c)
            .unwrap();
        let ran = AtomicUsize::new(0);
        let r = block_on(s.execute(&k, "f", || async {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok(vec![])
        }));
        match r {
            Err(ExecuteError::Store(e @ Error::Unavailable(_))) => {
                assert!(e.to_string().contains("version"), "{e}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(ran.load(Ordering::SeqCst), 0);
    });
}

/// A hash at the record's key without a `state` (fields a format-1 writer never leaves
/// alone, e.g. written by hand) is claimed as an absent record: the claim leads with
/// generation 1 and writes every field of the format.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn hash_without_state_is_claimed_as_absent() {
    timed(|| {
        let s = build(&fresh_prefix(), Duration::from_secs(60));
        let k = key();
        let rk = s.record_key(&k);
        let mut c = raw();
        let _: () = redis::cmd("HSET")
            .arg(&rk)
            .arg(&["result", "stale"])
            .query(&mut c)
            .unwrap();
        let lease = match block_on(s.begin(&k, "fp-1", ExecuteOptions::default())).unwrap() {
            Begin::Lead(l) => l,
            other => panic!("{other:?}"),
        };
        assert_eq!(lease.generation(), 1);
        let running: std::collections::HashMap<String, String> =
            redis::cmd("HGETALL").arg(&rk).query(&mut c).unwrap();
        assert_eq!(running["v"], "1");
        assert_eq!(running["state"], "running");
        assert_eq!(running["fp"], "fp-1");
        assert_eq!(running["token"], lease.token());
        assert_eq!(running["gen"], "1");
        let now_ms = {
            let (secs, micros): (u64, u64) = redis::cmd("TIME").query(&mut c).unwrap();
            secs * 1000 + micros / 1000
        };
        let deadline: u64 = running["deadline"].parse().unwrap();
        assert!(
            deadline > now_ms && deadline <= now_ms + LEASE.as_millis() as u64,
            "deadline {deadline}, Redis time {now_ms}"
        );
        let ttl: i64 = redis::cmd("PTTL").arg(&rk).query(&mut c).unwrap();
        assert!(ttl > 50_000 && ttl <= 60_000, "PTTL {ttl}");
        block_on(lease.complete(b"fresh".to_vec())).unwrap();
        let (value, source) = {
            let out = block_on(s.execute(&k, "fp-1", || async { Ok(vec![]) })).unwrap();
            (out.value, out.source)
        };
        assert_eq!((&value[..], source), (&b"fresh"[..], Source::Replayed));
    });
}

/// Takeover bumps the generation and gives a new token.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn takeover_bumps_generation() {
    timed(|| {
        let a = build(&fresh_prefix(), Duration::from_secs(60));
        let b = build(a.prefix(), a.ttl());
        let k = key();
        let first = match block_on(a.begin(&k, "f", ExecuteOptions::default())).unwrap() {
            Begin::Lead(l) => l,
            other => panic!("{other:?}"),
        };
        first.stop_renewing();
        std::thread::sleep(LEASE + Duration::from_millis(50));
        let second = match block_on(b.begin(&k, "f", ExecuteOptions::default())).unwrap() {
            Begin::Lead(l) => l,
            other => panic!("{other:?}"),
        };
        assert_eq!((first.generation(), second.generation()), (1, 2));
        assert_ne!(first.token(), second.token());
        assert_eq!(b.counters().takeovers, 1);
        // The record's fields are integer text, as the first claim wrote them.
        let record: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
            .arg(b.record_key(&k))
            .query(&mut raw())
            .unwrap();
        assert_eq!(record["gen"], "2");
        assert_eq!(record["token"], second.token());
        assert!(record["deadline"].parse::<u64>().unwrap() > 1_600_000_000_000);
        block_on(second.complete(b"2".to_vec())).unwrap();
        // The first leader's failure path must not delete the new record either.
        let _ = block_on(first.fail(Boom("late")));
        let r = block_on(b.execute(&k, "f", || async { Ok(b"3".to_vec()) })).unwrap();
        assert_eq!(
            (r.value.as_slice(), r.source),
            (&b"2"[..], Source::Replayed)
        );
    });
}

/// Two tiers: N same-key callers in one process make one claim.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn one_claim_per_process() {
    timed(|| {
        let s = build(&fresh_prefix(), Duration::from_secs(60));
        let k = key();
        let n = 24;
        let barrier = Arc::new(Barrier::new(n));
        let runs = Arc::new(AtomicUsize::new(0));
        let hs: Vec<_> = (0..n)
            .map(|_| {
                let (s, k, barrier, runs) = (s.clone(), k.clone(), barrier.clone(), runs.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    block_on(s.execute(&k, "f", || async {
                        runs.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(100));
                        Ok(b"v".to_vec())
                    }))
                    .unwrap()
                })
            })
            .collect();
        for h in hs {
            assert_eq!(h.join().unwrap().value, b"v");
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(s.counters().claims, 1, "{:?}", s.counters());
    });
}

/// A waiter on another instance is woken by the notification, not by its next poll.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn remote_waiter_woken_by_notification() {
    timed(|| {
        let a = build(&fresh_prefix(), Duration::from_secs(60));
        let b: RedisStore<Boom> = RedisStore::builder(url())
            .prefix(a.prefix())
            .lease(LEASE)
            .poll_interval(Duration::from_secs(5), Duration::from_secs(5))
            .build()
            .unwrap();
        let k = key();
        let lease = match block_on(a.begin(&k, "f", ExecuteOptions::default())).unwrap() {
            Begin::Lead(l) => l,
            other => panic!("{other:?}"),
        };
        let waiter = {
            let (b, k) = (b.clone(), k.clone());
            std::thread::spawn(move || {
                let r = block_on(b.execute(&k, "f", || async { Ok(b"no".to_vec()) })).unwrap();
                (r, Instant::now())
            })
        };
        std::thread::sleep(Duration::from_millis(300));
        let completed = Instant::now();
        block_on(lease.complete(b"yes".to_vec())).unwrap();
        let (r, at) = waiter.join().unwrap();
        assert_eq!(
            (r.value.as_slice(), r.source),
            (&b"yes"[..], Source::Joined)
        );
        // Its next poll is 5 s after its first: any wake well before that came from
        // the notification (a loaded machine can take a few hundred ms to get there).
        let lag = at.duration_since(completed);
        assert!(
            lag < Duration::from_millis(2500),
            "woken after {lag:?}: by polling, not pub/sub"
        );
        assert_eq!(b.counters().remote_waits, 1);
    });
}

/// A leader that panics releases its claim: a waiter elsewhere takes over at once
/// (not after the lease), and the store stays usable.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn panicking_leader_releases() {
    timed(|| {
        let a = RedisStore::<Boom>::builder(url())
            .prefix(fresh_prefix())
            .lease(Duration::from_secs(30))
            .build()
            .unwrap();
        let k = key();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            block_on(a.execute(&k, "f", || async {
                panic!("boom");
                #[allow(unreachable_code)]
                Ok(vec![])
            }))
        }));
        assert!(r.is_err());
        let t = Instant::now();
        let b = build(a.prefix(), a.ttl());
        let r = block_on(b.execute(&k, "f", || async { Ok(b"after".to_vec()) })).unwrap();
        assert_eq!(r.source, Source::Led);
        assert!(t.elapsed() < Duration::from_secs(5));
    });
}

fn assert_unavailable_without_running(url: String, io_timeout: Duration) {
    let s: RedisStore<Boom> = RedisStore::builder(url)
        .connect_timeout(Duration::from_millis(500))
        .io_timeout(io_timeout)
        .build()
        .unwrap();
    let ran = AtomicUsize::new(0);
    let t = Instant::now();
    for options in [ExecuteOptions::default(), ExecuteOptions::NO_WAIT] {
        let r = block_on(s.execute_with(&key(), "f", options, || async {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok(vec![])
        }));
        match r {
            Err(ExecuteError::Store(e)) => {
                assert_eq!(e.code(), Code::Unavailable, "{e}");
                assert!(e.to_string().contains("Redis"), "{e}");
            }
            other => panic!("expected UNAVAILABLE, got {other:?}"),
        }
    }
    assert_eq!(
        ran.load(Ordering::SeqCst),
        0,
        "the action ran without a claim"
    );
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
}

/// Nothing listens: UNAVAILABLE at once, and the action never runs (fail closed).
#[test]
fn unreachable_redis_is_unavailable() {
    timed(|| {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        assert_unavailable_without_running(
            format!("redis://127.0.0.1:{port}"),
            Duration::from_millis(300),
        );
    });
}

/// A server that accepts and never answers: UNAVAILABLE after the timeout, and the
/// action never runs.
#[test]
fn silent_redis_times_out_unavailable() {
    timed(|| {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for mut s in l.incoming().flatten() {
                let mut buf = [0u8; 256];
                let _ = s.set_read_timeout(Some(Duration::from_millis(10)));
                let _ = s.read(&mut buf);
                held.push(s); // never answer
            }
        });
        assert_unavailable_without_running(
            format!("redis://127.0.0.1:{port}"),
            Duration::from_millis(300),
        );
    });
}

/// Settings are checked when the store is built.
#[test]
fn bad_settings_are_invalid_argument() {
    for b in [
        RedisStore::<Boom>::builder("redis://127.0.0.1:1").lease(Duration::from_millis(1)),
        RedisStore::<Boom>::builder("redis://127.0.0.1:1").ttl(Duration::ZERO),
        RedisStore::<Boom>::builder("redis://127.0.0.1:1").workers(0),
        RedisStore::<Boom>::builder("redis://127.0.0.1:1").prefix("a{b}"),
        RedisStore::<Boom>::builder("nope://x"),
    ] {
        let e = b.build().unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    }
}

/// The messages name the setting and its unit as the caller does, with an example, and
/// a URL that does not parse shows the expected form.
#[test]
fn bad_settings_are_named_in_the_callers_terms() {
    fn node(field: &'static str) -> &'static str {
        match field {
            "lease" => "leaseMs",
            "io_timeout" => "ioTimeoutMs",
            other => other,
        }
    }
    let lease = |naming| {
        RedisStore::<Boom>::builder("redis://127.0.0.1:1")
            .lease(Duration::ZERO)
            .naming(naming)
            .build()
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        lease(oncely::Naming::RUST),
        "invalid lease: must be at least 30ms, e.g. 30s, got 0ns"
    );
    assert_eq!(
        lease(oncely::Naming::SECONDS),
        "invalid lease: must be at least 0.03 (seconds), e.g. 30, got 0"
    );
    let node = oncely::Naming::new(node, oncely::DurationUnit::Milliseconds);
    assert_eq!(
        lease(node),
        "invalid leaseMs: must be at least 30 (milliseconds), e.g. 30000, got 0"
    );
    let short = RedisStore::<Boom>::builder("redis://127.0.0.1:1")
        .lease(Duration::from_millis(60))
        .io_timeout(Duration::from_secs(1))
        .naming(node)
        .build()
        .unwrap_err();
    assert!(
        short.to_string().starts_with(
            "invalid leaseMs: must be at least 3 × ioTimeoutMs (1000 (milliseconds)), got 60"
        ),
        "{short}"
    );
    let url = RedisStore::<Boom>::builder("localhost:6379")
        .build()
        .unwrap_err();
    assert!(
        url.to_string().contains("expected redis://host:6379/0"),
        "{url}"
    );
    // The URL may hold a password: a TLS complaint names only its scheme.
    let tls = RedisStore::<Boom>::builder("redis://:secret@127.0.0.1:1")
        .tls_ca_file("/nonexistent/ca.pem")
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        tls.contains("got a redis:// URL") && !tls.contains("secret"),
        "{tls}"
    );
}

/// A fleet in miniature: 4 instances × 6 threads, each thread calling every one of 60
/// keys (in its own order, some with no-wait and retry): every action runs exactly
/// once and every caller gets the leader's value.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn fleet_every_key_runs_once() {
    timed(|| {
        let prefix = fresh_prefix();
        // A lease of 3 s (I/O timeout 1 s): with the suite's 300 ms lease the I/O timeout
        // is 100 ms, which 24 threads on a loaded 2-core machine can overrun; a call
        // then fails UNAVAILABLE, and a leader told so may rightly run again.
        let instances: Vec<RedisStore<Boom>> = (0..4)
            .map(|_| {
                RedisStore::builder(url())
                    .prefix(&prefix)
                    .lease(Duration::from_secs(3))
                    .ttl(Duration::from_secs(60))
                    .build()
                    .unwrap()
            })
            .collect();
        let keys: Vec<_> = (0..60).map(|_| key()).collect();
        let runs: Arc<Vec<AtomicUsize>> = Arc::new((0..60).map(|_| AtomicUsize::new(0)).collect());
        let barrier = Arc::new(Barrier::new(24));
        let hs: Vec<_> = (0..24)
            .map(|t| {
                let s = instances[t % 4].clone();
                let (keys, runs, barrier) = (keys.clone(), runs.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    let mut got = Vec::new();
                    for j in 0..keys.len() {
                        let i = (j * 7 + t * 13) % keys.len();
                        let options = if t % 3 == 0 {
                            ExecuteOptions::NO_WAIT
                        } else {
                            ExecuteOptions::default()
                        };
                        loop {
                            let r = block_on(s.execute_with(&keys[i], "f", options, || async {
                                runs[i].fetch_add(1, Ordering::SeqCst);
                                std::thread::sleep(Duration::from_millis(2));
                                Ok(format!("{i}:{t}").into_bytes())
                            }));
                            match r {
                                Ok(done) => {
                                    got.push((i, done.value));
                                    break;
                                }
                                Err(ExecuteError::Store(Error::InProgress { .. })) => {
                                    std::thread::sleep(Duration::from_millis(5))
                                }
                                Err(e) => panic!("{e:?}"),
                            }
                        }
                    }
                    got
                })
            })
            .collect();
        let mut value: Vec<Option<Vec<u8>>> = vec![None; 60];
        for h in hs {
            for (i, v) in h.join().unwrap() {
                match &value[i] {
                    None => value[i] = Some(v),
                    Some(first) => assert_eq!(first, &v, "key {i}: callers got different values"),
                }
            }
        }
        for (i, r) in runs.iter().enumerate() {
            assert_eq!(
                r.load(Ordering::SeqCst),
                1,
                "key {i} ran {} times",
                r.load(Ordering::SeqCst)
            );
        }
    });
}

/// A running record outlives a retention shorter than the action: its key TTL is kept
/// ahead of the lease, so no second leader can start meanwhile.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn running_record_outlives_short_retention() {
    timed(|| {
        let a = build(&fresh_prefix(), Duration::from_millis(100));
        let b = build(a.prefix(), a.ttl());
        let k = key();
        let lease = match block_on(a.begin(&k, "f", ExecuteOptions::default())).unwrap() {
            Begin::Lead(l) => l,
            other => panic!("{other:?}"),
        };
        std::thread::sleep(Duration::from_millis(900));
        match block_on(b.execute_with(&k, "f", ExecuteOptions::NO_WAIT, || async {
            Ok(b"second".to_vec())
        })) {
            Err(ExecuteError::Store(e)) => assert_eq!(e.code(), Code::Aborted, "{e}"),
            other => panic!("a second leader started: {other:?}"),
        }
        block_on(lease.complete(b"first".to_vec())).unwrap();
    });
}

/// The store, its leases and its futures are `Send` (usable from `tokio::spawn` or any
/// multi-threaded executor); making a future connects nothing.
#[test]
fn futures_are_send() {
    fn send<T: Send>(_: &T) {}
    fn sync<T: Send + Sync>() {}
    sync::<RedisStore<Boom>>();
    sync::<oncely_redis::RedisLease<Boom>>();
    let s: RedisStore<Boom> = RedisStore::builder("redis://127.0.0.1:1").build().unwrap();
    let k = key();
    let exec = s.execute(&k, "f", || async { Ok(vec![]) });
    send(&exec);
    let begin = s.begin(&k, "f", ExecuteOptions::default());
    send(&begin);
}

/// A remote join polled by hand with a counting waker: pending → woken by the
/// notification (polling is set to 5 s, so only pub/sub can wake it in time) → ready
/// with the leader's value.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn remote_join_pending_woken_ready() {
    use std::future::Future;
    use std::sync::atomic::AtomicUsize;
    use std::task::{Context, Poll, Wake, Waker};

    struct Counting(AtomicUsize);
    impl Wake for Counting {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    timed(|| {
        let a = build(&fresh_prefix(), Duration::from_secs(60));
        let b: RedisStore<Boom> = RedisStore::builder(url())
            .prefix(a.prefix())
            .lease(LEASE)
            .poll_interval(Duration::from_secs(5), Duration::from_secs(5))
            .build()
            .unwrap();
        let k = key();
        let lease = match block_on(a.begin(&k, "f", ExecuteOptions::default())).unwrap() {
            Begin::Lead(l) => l,
            other => panic!("{other:?}"),
        };
        let mut join = match block_on(b.begin(&k, "f", ExecuteOptions::default())).unwrap() {
            Begin::Join(j) => j,
            other => panic!("expected to join, got {other:?}"),
        };
        let counter = Arc::new(Counting(AtomicUsize::new(0)));
        let waker = Waker::from(counter.clone());
        let mut cx = Context::from_waker(&waker);
        assert!(std::pin::Pin::new(&mut join).poll(&mut cx).is_pending());
        // Let the listener subscribe (it wakes the waiter once when it has).
        std::thread::sleep(Duration::from_millis(200));
        assert!(
            std::pin::Pin::new(&mut join).poll(&mut cx).is_pending(),
            "ready before the leader completed"
        );
        let before = counter.0.load(Ordering::SeqCst);
        block_on(lease.complete(b"v".to_vec())).unwrap();
        let t = Instant::now();
        let out = loop {
            assert!(
                t.elapsed() < Duration::from_secs(2),
                "never woken by the notification"
            );
            if counter.0.load(Ordering::SeqCst) > before {
                match std::pin::Pin::new(&mut join).poll(&mut cx) {
                    Poll::Ready(out) => break out,
                    Poll::Pending => {}
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        match out {
            oncely::Joined::Value(v) => assert_eq!(v, b"v"),
            other => panic!("{other:?}"),
        }
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "woken after {:?}",
            t.elapsed()
        );
    });
}

/// `execute_blocking` from plain threads on two instances: one run, and a panicking
/// action propagates to its caller while the others take over.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn execute_blocking_from_threads() {
    timed(|| {
        let a = build(&fresh_prefix(), Duration::from_secs(60));
        let b = build(a.prefix(), a.ttl());
        let k = key();
        let runs = Arc::new(AtomicUsize::new(0));
        let barrier = Arc::new(Barrier::new(8));
        let hs: Vec<_> = (0..8)
            .map(|i| {
                let s = if i % 2 == 0 { a.clone() } else { b.clone() };
                let (k, runs, barrier) = (k.clone(), runs.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    s.execute_blocking(&k, "f", ExecuteOptions::default(), || {
                        runs.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(20));
                        Ok(b"once".to_vec())
                    })
                    .unwrap()
                })
            })
            .collect();
        for h in hs {
            assert_eq!(h.join().unwrap().value, b"once");
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);

        let k = key();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            a.execute_blocking(&k, "f", ExecuteOptions::default(), || panic!("boom"))
        }));
        assert!(r.is_err());
        let after = b
            .execute_blocking(&k, "f", ExecuteOptions::default(), || Ok(b"after".to_vec()))
            .unwrap();
        assert_eq!(after.source, Source::Led);
    });
}

/// A claim whose answer is read only after the call's deadline (its process was
/// stopped, or its executor did not poll it) does not lead: by then its lease may have
/// lapsed and been taken over, and the taker's result stored. Leading there would run
/// the action again after completion. The caller gets UNAVAILABLE instead and the
/// stored result stays the one every later caller gets.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn claim_answered_after_its_deadline_does_not_lead() {
    timed(|| {
        let a = build(&fresh_prefix(), Duration::from_secs(60));
        let b = build(a.prefix(), a.ttl());
        let waker = futures::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        // The claim is sent and its answer left unread. A first poll that already has
        // the answer (this thread was paused long enough for a worker to reply within
        // it, on a loaded machine) is not that case: try again with another key.
        let keys: Vec<ScopedKey> = (0..20).map(|_| key()).collect();
        let mut sent = None;
        for k in &keys {
            let mut claim = Box::pin(a.begin(k, "f", ExecuteOptions::default()));
            if std::future::Future::poll(claim.as_mut(), &mut cx).is_pending() {
                sent = Some((k, claim));
                break;
            }
        }
        let (k, claim) = sent.expect("20 claims were all answered within their first poll");
        // The answer arrives and waits unread, past the whole lease.
        std::thread::sleep(LEASE * 2);
        let taker = block_on(b.execute(k, "f", || async { Ok(b"b".to_vec()) })).unwrap();
        assert_eq!(taker.source, Source::Led);
        match block_on(claim) {
            Err(e) => assert_eq!(e.code(), Code::Unavailable, "{e}"),
            Ok(Begin::Lead(l)) => panic!(
                "a claim read after its deadline led (generation {}) after the key completed",
                l.generation()
            ),
            Ok(other) => panic!("{other:?}"),
        }
        let r = block_on(a.execute(k, "f", || async { Ok(b"a".to_vec()) })).unwrap();
        assert_eq!(
            (r.value.as_slice(), r.source),
            (&b"b"[..], Source::Replayed)
        );
    });
}
