//! The dedup stores the layer runs on.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use oncely::http::StoredResponse;
#[cfg(feature = "redis")]
use oncely::DedupStore;
use oncely::{Begin, Error, ExecuteOptions, Joined, LeaderLease, MemoryStore, ScopedKey};

/// A boxed `Send` future.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What [`Store::begin`] gives.
pub type StoreBegin<S> = Begin<Vec<u8>, Unstored, <S as Store>::Lease, <S as Store>::Join>;

/// The "error" a leader settles its key with when its response is not stored (SPEC
/// §8): a status that is not stored, with the response read whole, which waiting
/// duplicates get too. (A response that was not read whole releases the key instead,
/// so a waiting duplicate leads.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unstored {
    /// The response the handler gave, as a record.
    pub response: StoredResponse,
}

impl fmt::Display for Unstored {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a {} response, not stored", self.response.status)
    }
}

impl std::error::Error for Unstored {}

/// A dedup store the layer can use: an [`oncely::DedupStore`](oncely::DedupStore) of stored-response
/// records (`Vec<u8>`) whose futures are `Send`, as servers need.
///
/// Implemented for [`MemoryStore<Vec<u8>, Unstored>`](MemoryStore) and, with the
/// `redis` feature, for `oncely_redis::RedisStore<Unstored>`. For another
/// `DedupStore`, implement it by boxing that store's futures, as these do.
///
/// Do not configure the store to cache failures: a response that is not stored must
/// release its key.
pub trait Store: Clone + Send + Sync + 'static {
    /// The store's lease.
    type Lease: LeaderLease<Vec<u8>, Unstored> + Send + 'static;
    /// The store's wait on a running call.
    type Join: Future<Output = Joined<Vec<u8>, Unstored>> + Send + 'static;
    /// [`oncely::DedupStore::begin`].
    fn begin<'a>(
        &'a self,
        key: &'a ScopedKey,
        fingerprint: &'a str,
        options: ExecuteOptions,
    ) -> BoxFuture<'a, Result<StoreBegin<Self>, Error>>;
    /// [`LeaderLease::complete`].
    fn complete(lease: Self::Lease, record: Vec<u8>) -> BoxFuture<'static, Result<(), Error>>;
    /// [`LeaderLease::fail`].
    fn fail(lease: Self::Lease, unstored: Unstored) -> BoxFuture<'static, Arc<Unstored>>;
}

impl Store for MemoryStore<Vec<u8>, Unstored> {
    type Lease = oncely::Lease<Vec<u8>, Unstored>;
    type Join = oncely::Join<Vec<u8>, Unstored>;

    fn begin<'a>(
        &'a self,
        key: &'a ScopedKey,
        fingerprint: &'a str,
        options: ExecuteOptions,
    ) -> BoxFuture<'a, Result<StoreBegin<Self>, Error>> {
        // The memory store answers at once: no boxing needed.
        let begun = MemoryStore::begin(self, key, fingerprint, options);
        Box::pin(std::future::ready(begun))
    }

    fn complete(lease: Self::Lease, record: Vec<u8>) -> BoxFuture<'static, Result<(), Error>> {
        lease.complete_now(record);
        Box::pin(std::future::ready(Ok(())))
    }

    fn fail(lease: Self::Lease, unstored: Unstored) -> BoxFuture<'static, Arc<Unstored>> {
        Box::pin(std::future::ready(lease.fail_now(unstored)))
    }
}

#[cfg(feature = "redis")]
impl Store for oncely_redis::RedisStore<Unstored> {
    type Lease = oncely_redis::RedisLease<Unstored>;
    type Join = oncely_redis::RedisJoin<Unstored>;

    fn begin<'a>(
        &'a self,
        key: &'a ScopedKey,
        fingerprint: &'a str,
        options: ExecuteOptions,
    ) -> BoxFuture<'a, Result<StoreBegin<Self>, Error>> {
        Box::pin(DedupStore::begin(self, key, fingerprint, options))
    }

    fn complete(lease: Self::Lease, record: Vec<u8>) -> BoxFuture<'static, Result<(), Error>> {
        Box::pin(LeaderLease::complete(lease, record))
    }

    fn fail(lease: Self::Lease, unstored: Unstored) -> BoxFuture<'static, Arc<Unstored>> {
        Box::pin(LeaderLease::fail(lease, unstored))
    }
}
