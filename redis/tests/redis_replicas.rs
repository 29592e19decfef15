//! `min_replicas` on one node without replicas, with calls that go out together in one
//! pipeline: every claim is followed by a WAIT on the connection that sent it, none is
//! acknowledged, so every claim is released and answered UNAVAILABLE before its action
//! runs; the completions of a store without `min_replicas` are untouched.
//!
//! They need a Redis and are `#[ignore]`d without one (scripts/test-redis runs them
//! against a throwaway redis-server).

mod support;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::executor::block_on;
use futures::future::join_all;
use oncely::{Error, ExecuteError, IdempotencyKey, ScopedKey, Source};
use oncely_redis::RedisStore;
use support::url;

#[derive(Debug)]
struct Boom;

fn key() -> ScopedKey {
    ScopedKey::new("acme", "CreateOrder", &IdempotencyKey::random()).unwrap()
}

fn store(prefix: &str, min_replicas: usize) -> RedisStore<Boom> {
    RedisStore::builder(url())
        .prefix(prefix)
        .lease(Duration::from_secs(30))
        .io_timeout(Duration::from_millis(600))
        .min_replicas(min_replicas)
        .min_replicas_timeout(Duration::from_millis(100))
        .workers(1)
        .build()
        .unwrap()
}

#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn claims_batched_together_that_no_replica_acknowledged_are_released_unrun() {
    let prefix = format!("repl{}", IdempotencyKey::random().as_str());
    let wanting = store(&prefix, 1);
    let keys: Vec<ScopedKey> = (0..48).map(|_| key()).collect();
    let ran = AtomicUsize::new(0);
    // One worker: the calls queue up behind each other and go out in batches.
    let outcomes = block_on(join_all(keys.iter().map(|k| {
        wanting.execute(k, "fp", || async {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok(b"v".to_vec())
        })
    })));
    for r in &outcomes {
        match r {
            Err(ExecuteError::Store(Error::Unavailable(m))) => {
                assert!(m.contains("replicas"), "{m}")
            }
            r => panic!("expected UNAVAILABLE (no replica), got {r:?}"),
        }
    }
    assert_eq!(
        ran.load(Ordering::SeqCst),
        0,
        "an action ran without a replicated claim"
    );
    assert_eq!(wanting.counters().claims_unreplicated, keys.len() as u64);
    // The blocking entry point (its calls go out from the caller's thread) too.
    let k = key();
    let r = wanting.execute_blocking(&k, "fp", Default::default(), || {
        ran.fetch_add(1, Ordering::SeqCst);
        Ok(b"v".to_vec())
    });
    assert!(
        matches!(r, Err(ExecuteError::Store(Error::Unavailable(_)))),
        "{r:?}"
    );
    assert_eq!(ran.load(Ordering::SeqCst), 0);

    // Every claim was given back: a store without min_replicas leads each key at once
    // (no lease of 30 s to wait out), and its completions count nothing unreplicated.
    let plain = store(&prefix, 0);
    for k in keys.iter().chain([&k]) {
        let done = block_on(plain.execute_with(
            k,
            "fp",
            oncely::ExecuteOptions::NO_WAIT,
            || async { Ok(b"w".to_vec()) },
        ))
        .unwrap();
        assert_eq!((done.value, done.source), (b"w".to_vec(), Source::Led));
    }
    assert_eq!(plain.counters().completions_unreplicated, 0);
}

/// A removal that no replica acknowledged fails UNAVAILABLE (a failover could bring the
/// record back), after deleting the record on the primary, and so does the same removal
/// sent again (it finds no record, but nothing says the deletion reached a replica);
/// one that leaves a live lease alone waits for no replica.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn a_removal_no_replica_acknowledged_is_unavailable() {
    let prefix = format!("repl{}", IdempotencyKey::random().as_str());
    let (wanting, plain) = (store(&prefix, 1), store(&prefix, 0));
    let k = key();
    block_on(plain.execute(&k, "fp", || async { Ok(b"v".to_vec()) })).unwrap();
    match block_on(wanting.remove(&k)) {
        Err(Error::Unavailable(m)) => assert!(m.contains("replicas"), "{m}"),
        r => panic!("expected UNAVAILABLE (no replica acknowledged), got {r:?}"),
    }
    assert_eq!(wanting.counters().unavailable, 1);
    assert!(block_on(plain.get(&k)).unwrap().is_none());
    // Removed again: nothing left to delete on the primary, but the deletion is still
    // not acknowledged by any replica.
    match block_on(wanting.remove(&k)) {
        Err(Error::Unavailable(m)) => assert!(m.contains("replicas"), "{m}"),
        r => panic!("expected UNAVAILABLE (the deletion is still unreplicated), got {r:?}"),
    }
    assert_eq!(wanting.counters().unavailable, 2);
    // Without min_replicas: there is none.
    assert!(!block_on(plain.remove(&k)).unwrap());
    // A live lease is left alone, without a WAIT.
    let lease = match block_on(plain.begin(&k, "fp", Default::default())).unwrap() {
        oncely::Begin::Lead(lease) => lease,
        _ => panic!("expected to lead"),
    };
    assert!(!block_on(wanting.remove(&k)).unwrap());
    assert_eq!(wanting.counters().unavailable, 2);
    drop(lease);
}
