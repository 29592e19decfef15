//! The RedisStore keeps two of the store's promises under load: an action that calls
//! `execute` with its own key fails at once instead of waiting for itself, and a
//! million replays of one key leave the process's memory flat.
//!
//! Both need a Redis and are `#[ignore]`d without one (scripts/test-redis runs them
//! against a throwaway redis-server).

mod support;
use std::sync::mpsc;
use std::time::Duration;

use futures::executor::block_on;
use oncely::{Error, ExecuteError, ExecuteOptions, IdempotencyKey, ScopedKey, Source};
use oncely_redis::RedisStore;
use support::url;

#[derive(Debug)]
struct Boom;

fn store() -> RedisStore<Boom> {
    store_with(&format!("t{}", IdempotencyKey::random().as_str()))
}

fn store_with(prefix: &str) -> RedisStore<Boom> {
    RedisStore::builder(url()).prefix(prefix).build().unwrap()
}

fn key(n: usize) -> ScopedKey {
    let k = IdempotencyKey::derive(&format!("order-{n}"), "create").unwrap();
    ScopedKey::new("tenant", "CreateOrder", &k).unwrap()
}

const FP: &str = "fp";

/// Runs `f` on its own thread; fails the test if it takes more than `secs`.
fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs))
        .expect("hung (or panicked) instead of finishing")
}

fn describe(r: Result<oncely::Executed<Vec<u8>>, ExecuteError<Boom>>) -> String {
    match r {
        Ok(e) => format!("{:?} {}", e.source, String::from_utf8_lossy(&e.value)),
        Err(ExecuteError::Store(Error::Reentrant { key })) => format!("reentrant {key}"),
        Err(e) => format!("error {e:?}"),
    }
}

#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn an_action_calling_execute_with_its_own_key_fails_at_once() {
    let got = within(30, || {
        let store = store();
        let clone = store.clone();
        let (k, other) = (key(1), key(2));
        let outer = block_on(store.execute(&k, FP, || async {
            let same = describe(clone.execute(&k, FP, || async { Ok(b"x".to_vec()) }).await);
            let blocking =
                describe(
                    clone.execute_blocking(&k, FP, ExecuteOptions::default(), || Ok(b"y".to_vec())),
                );
            let different = describe(
                clone
                    .execute(&other, FP, || async { Ok(b"z".to_vec()) })
                    .await,
            );
            Ok(format!("{same}; {blocking}; {different}").into_bytes())
        }))
        .unwrap();
        assert_eq!(outer.source, Source::Led);
        // Stored once; a later call from outside the action replays it.
        let again = block_on(store.execute(&k, FP, || async { Ok(b"w".to_vec()) })).unwrap();
        assert_eq!(
            (again.source, &again.value),
            (Source::Replayed, &outer.value)
        );
        // Another store on the same Redis is another store: not re-entrant, it
        // replays what the first one stored.
        let peer = RedisStore::<Boom>::builder(url())
            .prefix(store.prefix())
            .build()
            .unwrap();
        let k2 = key(3);
        let nested = block_on(store.execute(&k2, FP, || async {
            let r = peer.execute(&k, FP, || async { Ok(b"v".to_vec()) }).await;
            Ok(describe(r).into_bytes())
        }))
        .unwrap();
        assert_eq!(
            String::from_utf8(nested.value).unwrap(),
            format!("Replayed {}", String::from_utf8_lossy(&outer.value))
        );
        String::from_utf8(outer.value).unwrap()
    });
    let r = format!("reentrant {}", key(1).as_str());
    assert_eq!(got, format!("{r}; {r}; Led z"));
}

/// Resident memory of this process, in kB.
fn rss_kb() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
#[cfg(target_os = "linux")]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn a_million_replays_of_one_key_keep_memory_flat() {
    const ROUNDS: usize = 1_000_000;
    // A leak of ~100 bytes per replay grows by ~100 MB; buffers and allocator noise
    // stay far below this.
    const ALLOWED_GROWTH_KB: u64 = 16 * 1024;
    let grew = within(1_800, || {
        let store = store();
        let k = key(10);
        block_on(store.execute(&k, FP, || async { Ok(b"stored".to_vec()) })).unwrap();
        let replay = || {
            let r = store
                .execute_blocking(&k, FP, ExecuteOptions::default(), || Ok(b"again".to_vec()))
                .unwrap();
            assert_eq!(r.source, Source::Replayed);
        };
        for _ in 0..ROUNDS / 10 {
            replay();
        }
        let before = rss_kb();
        for _ in 0..ROUNDS {
            replay();
        }
        let grew = rss_kb().saturating_sub(before);
        assert_eq!(store.counters().leads, 1);
        grew
    });
    eprintln!("RSS grew {grew} kB over {} replays", 1_000_000);
    assert!(grew < ALLOWED_GROWTH_KB, "RSS grew {grew} kB");
}

/// Two instances on one Redis and prefix share their records: an action of one that
/// calls the other with its own key would wait for itself, and fails at once too.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn an_action_calling_another_instance_with_its_own_key_fails_at_once() {
    let got = within(10, || {
        let prefix = format!("flat-{}", IdempotencyKey::random().as_str());
        let (a, b) = (store_with(&prefix), store_with(&prefix));
        let elsewhere = store_with(&format!("{prefix}-other"));
        let k = key(1);
        let outer = block_on(a.execute(&k, FP, || async {
            let same = describe(b.execute(&k, FP, || async { Ok(b"x".to_vec()) }).await);
            let other_prefix = describe(
                elsewhere
                    .execute(&k, FP, || async { Ok(b"y".to_vec()) })
                    .await,
            );
            Ok(format!("{same} | {other_prefix}").into_bytes())
        }));
        describe(outer)
    });
    assert!(got.starts_with("Led reentrant "), "{got}");
    assert!(got.ends_with("| Led y"), "{got}");
}
