//! The conformance suite on the core's in-process `MemoryStore` (no Redis needed).

#[macro_use]
mod conformance;

use std::time::Duration;

use conformance::{Boom, Harness, Lease};
use oncely::MemoryStore;

struct Memory;

impl Harness for Memory {
    type Store = MemoryStore<Vec<u8>, Boom>;
    const LEASES: bool = false;
    fn lease(&self) -> Duration {
        Duration::ZERO
    }
    fn store(&self, ttl: Duration) -> Self::Store {
        MemoryStore::builder().ttl(ttl).build().unwrap()
    }
    fn peer(&self, store: &Self::Store) -> Self::Store {
        store.clone()
    }
    fn crash(&self, lease: Lease<Self>) {
        drop(lease)
    }
    fn pause(&self, _lease: &Lease<Self>) {}
}

conformance_tests!(common: Memory);
