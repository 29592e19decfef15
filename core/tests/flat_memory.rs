//! Memory stays flat under churn that leaves nothing alive: results removed right
//! after they are stored, replays of one key, waiters that give up on a long call.
//! Each test measures the process's resident memory (Linux), so they run one at a time.
#![cfg(target_os = "linux")]

use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll, Waker};

use futures::executor::block_on;
use oncely::{Begin, ExecuteOptions, IdempotencyKey, MemoryStore, ScopedKey, Source};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

const ROUNDS: usize = 1_000_000;
/// Growth allowed over a million rounds after warming up: 8 MB, where a leak of one
/// small allocation per round (16–100 bytes) grows by 16–100 MB.
const ALLOWED_GROWTH_KB: u64 = 8 * 1024;

/// Resident memory of this process, in kB.
fn rss_kb() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Runs `round` ROUNDS times after a warm-up; gives the growth in kB.
fn growth_kb(mut round: impl FnMut(usize)) -> u64 {
    for i in 0..ROUNDS / 10 {
        round(i);
    }
    let before = rss_kb();
    for i in 0..ROUNDS {
        round(i);
    }
    rss_kb().saturating_sub(before)
}

fn key(n: usize) -> ScopedKey {
    let k = IdempotencyKey::derive(&format!("order-{n}"), "create").unwrap();
    ScopedKey::new("tenant", "CreateOrder", &k).unwrap()
}

const FP: &str = "fp";

#[test]
fn storing_and_removing_one_key_a_million_times_keeps_memory_flat() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let store: MemoryStore<u64, ()> = MemoryStore::new();
    // Some lasting entries, so the store is not empty.
    for n in 0..1_000 {
        block_on(store.execute(&key(n), FP, || async { Ok(1) })).unwrap();
    }
    let k = key(1_000_000);
    let grew = growth_kb(|i| {
        let r = block_on(store.execute(&k, FP, || async move { Ok(i as u64) })).unwrap();
        assert_eq!(r.source, Source::Led);
        assert!(store.remove(&k));
    });
    eprintln!("store + remove: RSS grew {grew} kB over {ROUNDS} rounds");
    assert!(grew < ALLOWED_GROWTH_KB, "RSS grew {grew} kB");
    assert_eq!(store.len(), 1_000);
}

#[test]
fn a_million_replays_of_one_key_keep_memory_flat() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let store: MemoryStore<u64, ()> = MemoryStore::new();
    let k = key(1);
    block_on(store.execute(&k, FP, || async { Ok(1) })).unwrap();
    let grew = growth_kb(|_| {
        let r = block_on(store.execute(&k, FP, || async { Ok(2) })).unwrap();
        assert_eq!(r.source, Source::Replayed);
    });
    eprintln!("replays: RSS grew {grew} kB over {ROUNDS} rounds");
    assert!(grew < ALLOWED_GROWTH_KB, "RSS grew {grew} kB");
}

#[test]
fn a_million_waiters_giving_up_on_one_long_call_keep_memory_flat() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let store: MemoryStore<u64, ()> = MemoryStore::new();
    let k = key(2);
    let Ok(Begin::Lead(lease)) = store.begin(&k, FP, ExecuteOptions::default()) else {
        panic!("expected to lead")
    };
    let mut cx = Context::from_waker(Waker::noop());
    // One waiter stays to the end.
    let Ok(Begin::Join(mut stays)) = store.begin(&k, FP, ExecuteOptions::default()) else {
        panic!("expected to join")
    };
    assert!(Pin::new(&mut stays).poll(&mut cx).is_pending());
    let grew = growth_kb(|_| {
        let Ok(Begin::Join(mut join)) = store.begin(&k, FP, ExecuteOptions::default()) else {
            panic!("expected to join")
        };
        assert!(Pin::new(&mut join).poll(&mut cx).is_pending());
    });
    eprintln!("cancelled joiners: RSS grew {grew} kB over {ROUNDS} rounds");
    assert!(grew < ALLOWED_GROWTH_KB / 2, "RSS grew {grew} kB");
    lease.complete_now(5);
    assert!(matches!(
        Pin::new(&mut stays).poll(&mut cx),
        Poll::Ready(oncely::Joined::Value(5))
    ));
}
