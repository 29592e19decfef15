//! Reading a large record with `get` costs about its size in memory, like a replay: the
//! reply is not written out as text on the way (tens of bytes of text per result byte,
//! seconds and gigabytes for a result near `max_result_bytes`).
//!
//! One test in this binary: its allocator counts every thread's allocations.

mod support;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::executor::block_on;
use oncely::{IdempotencyKey, ScopedKey};
use oncely_redis::{RecordState, RedisStore};
use support::url;

/// The system allocator, keeping the largest single allocation asked for.
struct Largest;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Largest {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Largest = Largest;

#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn get_of_a_large_record_allocates_about_its_size() {
    const SIZE: usize = 8 << 20;
    let store: RedisStore<std::io::Error> = RedisStore::builder(url())
        .prefix("get-large")
        .build()
        .unwrap();
    let key = ScopedKey::new("acme", "Export", &IdempotencyKey::random()).unwrap();
    let value = vec![7u8; SIZE];
    store
        .execute_blocking(&key, "f", Default::default(), || Ok(value.clone()))
        .unwrap();
    let replayed = store
        .execute_blocking(&key, "f", Default::default(), || Ok(Vec::new()))
        .unwrap();
    assert_eq!(replayed.value.len(), SIZE);
    let replay_largest = LARGEST.swap(0, Ordering::SeqCst);

    let record = block_on(store.get(&key)).unwrap().unwrap();
    let get_largest = LARGEST.load(Ordering::SeqCst);
    assert_eq!(record.state, RecordState::Done { value });
    // A replay's reading buffer is about the size of the reply; `get` needs no more.
    assert!(
        get_largest <= 2 * replay_largest.max(SIZE),
        "get's largest allocation {get_largest} bytes, a replay's {replay_largest}, \
         for a result of {SIZE}"
    );
    assert!(block_on(store.remove(&key)).unwrap());
}
