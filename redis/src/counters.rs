//! What one store instance has done: [`RedisCounters`], counted as it goes.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counts of what one [`RedisStore`](crate::RedisStore) instance has done since it was
/// made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RedisCounters {
    /// Claim scripts run (one per key per process at a time, thanks to the in-process
    /// tier).
    pub claims: u64,
    /// Claims that made this instance the leader (takeovers included).
    pub leads: u64,
    /// Leads that took over an expired lease (generation > 1).
    pub takeovers: u64,
    /// Claims answered with a stored result.
    pub replays: u64,
    /// Claims that found a leader on another instance and waited for it.
    pub remote_waits: u64,
    /// Leaders that found their lease taken over when completing.
    pub leases_lost: u64,
    /// Leads given up without an outcome: the lease was dropped unsettled (its caller
    /// went away, before its action started or while it ran) and released for a waiter
    /// to take over. `leads - abandoned` is how many leads surely ran their action.
    pub abandoned: u64,
    /// Claims released and answered UNAVAILABLE because fewer replicas than
    /// [`min_replicas`](crate::RedisStoreBuilder::min_replicas) acknowledged them.
    pub claims_unreplicated: u64,
    /// Completions stored on the primary that fewer replicas than
    /// [`min_replicas`](crate::RedisStoreBuilder::min_replicas) acknowledged in time (the
    /// action ran; a failover now could lose the result).
    pub completions_unreplicated: u64,
    /// Calls of this store that failed with
    /// [`Error::Unavailable`](oncely::Error::Unavailable) (Redis unreachable, slow or
    /// failing: claims, completions, [`get`](crate::RedisStore::get),
    /// [`remove`](crate::RedisStore::remove), [`ping`](crate::RedisStore::ping)).
    pub unavailable: u64,
}

#[derive(Default)]
pub(crate) struct AtomicCounters {
    pub(crate) claims: AtomicU64,
    pub(crate) leads: AtomicU64,
    pub(crate) takeovers: AtomicU64,
    pub(crate) replays: AtomicU64,
    pub(crate) remote_waits: AtomicU64,
    pub(crate) leases_lost: AtomicU64,
    pub(crate) abandoned: AtomicU64,
    pub(crate) claims_unreplicated: AtomicU64,
    pub(crate) completions_unreplicated: AtomicU64,
    pub(crate) unavailable: AtomicU64,
}

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}
