//! The dedup store (SPEC §6): run an action once per scoped key and give every caller
//! its result.
//!
//! The rules live in one place, [`execute`], written against the small [`DedupStore`]
//! trait (begin → lead / join / replay; complete / fail; drop = abandon). The
//! in-process [`MemoryStore`] implements it; a shared backend implements the same
//! trait and inherits the same rules.

mod flight;
mod keymap;
mod memory;
mod reentry;

use std::any::Any;
use std::fmt;
use std::future::{poll_fn, Future};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

pub use flight::Join;
pub use memory::{Counters, Lease, MemoryBegin, MemoryStore, MemoryStoreBuilder};

use crate::error::Error;
use crate::key::ScopedKey;

/// How a caller got its result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// This caller ran the action.
    Led,
    /// This caller waited for a concurrent call with the same key and shares its result.
    Joined,
    /// The result was stored by an earlier call and is replayed.
    Replayed,
}

/// A successful `execute`: the value and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Executed<V> {
    /// The action's result (the leader's, for joiners and replays).
    pub value: V,
    /// Whether this caller ran the action, joined a running one or got a replay.
    pub source: Source,
}

impl<V> Executed<V> {
    /// True when this caller did not run the action itself (joined or replayed): an
    /// HTTP server answers with `Idempotent-Replayed: true`.
    pub fn is_replay(&self) -> bool {
        self.source != Source::Led
    }
}

/// Why `execute` did not give a value.
#[derive(Debug)]
pub enum ExecuteError<E> {
    /// oncely refused or could not run the action: fingerprint mismatch, in progress
    /// (no-wait), capacity, store unavailable, the leader panicked, bad input.
    Store(Error),
    /// The action failed; the leader and every waiter get this same error.
    Action(Arc<E>),
}

impl<E> ExecuteError<E> {
    /// The oncely error, if this is one.
    pub fn store_error(&self) -> Option<&Error> {
        match self {
            ExecuteError::Store(e) => Some(e),
            ExecuteError::Action(_) => None,
        }
    }
    /// The action's error, if this is one.
    pub fn action_error(&self) -> Option<&Arc<E>> {
        match self {
            ExecuteError::Action(e) => Some(e),
            ExecuteError::Store(_) => None,
        }
    }
}

impl<E: fmt::Display> fmt::Display for ExecuteError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExecuteError::Store(e) => e.fmt(f),
            ExecuteError::Action(e) => e.fmt(f),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for ExecuteError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ExecuteError::Store(e) => Some(e),
            ExecuteError::Action(e) => Some(&**e),
        }
    }
}

impl<E: crate::Classify> crate::Classify for ExecuteError<E> {
    fn code(&self) -> crate::Code {
        match self {
            ExecuteError::Store(e) => e.code(),
            ExecuteError::Action(e) => e.code(),
        }
    }
    fn server_delay(&self) -> Option<crate::ServerDelay> {
        match self {
            ExecuteError::Store(e) => crate::Classify::server_delay(e),
            ExecuteError::Action(e) => e.server_delay(),
        }
    }
}

/// Per-call options of `execute`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExecuteOptions {
    /// Wait for a running call with the same key (default). When `false`, such a
    /// call fails at once with [`Error::InProgress`] (ABORTED + retry-after).
    pub wait: bool,
}

impl Default for ExecuteOptions {
    fn default() -> Self {
        ExecuteOptions { wait: true }
    }
}

impl ExecuteOptions {
    /// Do not wait for a running call: fail with ABORTED + retry-after instead.
    pub const NO_WAIT: ExecuteOptions = ExecuteOptions { wait: false };
}

/// What [`DedupStore::begin`] found for a key.
pub enum Begin<V, E, L, J> {
    /// No live entry: this caller leads and must run the action, then settle the lease.
    Lead(L),
    /// A call with the same key and fingerprint is running: wait on this.
    Join(J),
    /// A completed entry: its stored outcome (a failure only if failure caching is on).
    Replay(Result<V, Arc<E>>),
}

impl<V, E, L, J> fmt::Debug for Begin<V, E, L, J> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Begin::Lead(_) => "Begin::Lead",
            Begin::Join(_) => "Begin::Join",
            Begin::Replay(_) => "Begin::Replay",
        })
    }
}

/// How a wait on a running call ended.
#[derive(Debug)]
pub enum Joined<V, E> {
    /// The leader succeeded.
    Value(V),
    /// The leader's action failed with this error.
    Failed(Arc<E>),
    /// The leader's action panicked (or raised in a host language) without an error
    /// value; the message says what happened.
    Panicked(Arc<str>),
    /// The leader went away (cancelled, dropped) before finishing: call `begin` again;
    /// one of the waiters leads.
    Abandoned,
    /// The wait ended with this store error, without a result: the caller gets it and
    /// does not run its action. E.g. a wait a process had in flight when it forked: in
    /// the child, its leader and the threads that would answer it are the parent's.
    Error(Error),
}

impl<V: Clone, E> Clone for Joined<V, E> {
    fn clone(&self) -> Self {
        match self {
            Joined::Value(v) => Joined::Value(v.clone()),
            Joined::Failed(e) => Joined::Failed(e.clone()),
            Joined::Panicked(m) => Joined::Panicked(m.clone()),
            Joined::Abandoned => Joined::Abandoned,
            Joined::Error(e) => Joined::Error(e.clone()),
        }
    }
}

/// The leader's claim on a key. Dropping it unsettled abandons the claim: the entry
/// is removed and one waiter takes over.
pub trait LeaderLease<V, E> {
    /// Stores the value (until the TTL) and wakes the waiters with it.
    fn complete(self, value: V) -> impl Future<Output = Result<(), Error>>;
    /// Removes the entry (or caches the failure, if configured) and wakes the waiters
    /// with the error; gives back the shared error for the leader.
    fn fail(self, error: E) -> impl Future<Output = Arc<E>>;
    /// The action panicked: removes the entry and wakes the waiters with `message`.
    fn panicked(self, message: &str);
}

/// A backend of the dedup store: the primitives [`execute`] is written against.
pub trait DedupStore<V, E> {
    /// The leader's claim.
    type Lease: LeaderLease<V, E>;
    /// The wait on a running call.
    type Join: Future<Output = Joined<V, E>>;
    /// Looks the key up and leads, joins or replays (SPEC §6 rules 1–4).
    fn begin(
        &self,
        key: &ScopedKey,
        fingerprint: &str,
        options: ExecuteOptions,
    ) -> impl Future<Output = Result<Begin<V, E, Self::Lease, Self::Join>, Error>>;

    /// Identifies the state this store shares with its clones: the same value for
    /// every clone of one store (and for every instance that shares that state, e.g.
    /// one kept in a server), different values for stores that do not share it (e.g.
    /// the address of the shared state). With it, [`execute`] fails at once,
    /// with [`Error::Reentrant`], a call made by an action with the key that action
    /// is leading on the same store, which would otherwise wait for itself forever.
    /// `None` (the default) turns that check off.
    fn identity(&self) -> Option<usize> {
        None
    }
}

/// Runs `action` at most once per scoped key on any [`DedupStore`], by SPEC §6.
///
/// Every caller passes its own `action`; it runs only if this caller leads (first, or
/// taking over from a leader that went away). A panicking action wakes the waiters
/// with [`Error::LeaderPanicked`] and then resumes the panic in the leader.
///
/// An action that calls `execute` on the same store with the key it is leading would
/// wait for itself: that inner call fails at once with [`Error::Reentrant`] when it is
/// made (first polled) while the action is being run or polled on this thread,
/// directly or through futures the action polls itself (`join!`, `select!`,
/// `block_on`, a local executor it runs). A call moved to another task or thread that
/// the action then waits for is not detected. Needs [`DedupStore::identity`].
pub async fn execute<S, V, E, F, Fut>(
    store: &S,
    key: &ScopedKey,
    fingerprint: &str,
    options: ExecuteOptions,
    action: F,
) -> Result<Executed<V>, ExecuteError<E>>
where
    S: DedupStore<V, E>,
    V: Clone,
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<V, E>>,
{
    let identity = store.identity();
    if let Some(id) = identity {
        if reentry::is_leading(id, key.as_str()) {
            return Err(ExecuteError::Store(Error::Reentrant {
                key: key.as_str().to_owned(),
            }));
        }
    }
    let mut action = Some(action);
    loop {
        let lease = match store.begin(key, fingerprint, options).await {
            Err(e) => return Err(ExecuteError::Store(e)),
            Ok(Begin::Replay(Ok(value))) => {
                return Ok(Executed {
                    value,
                    source: Source::Replayed,
                })
            }
            Ok(Begin::Replay(Err(e))) => return Err(ExecuteError::Action(e)),
            Ok(Begin::Join(join)) => match join.await {
                Joined::Value(value) => {
                    return Ok(Executed {
                        value,
                        source: Source::Joined,
                    })
                }
                Joined::Failed(e) => return Err(ExecuteError::Action(e)),
                Joined::Panicked(m) => {
                    return Err(ExecuteError::Store(Error::LeaderPanicked(m.to_string())))
                }
                Joined::Abandoned => continue,
                Joined::Error(e) => return Err(ExecuteError::Store(e)),
            },
            Ok(Begin::Lead(lease)) => lease,
        };
        // A caller leads at most once: after leading it returns.
        let Some(action) = action.take() else {
            unreachable!("a caller leads at most once")
        };
        let leading = || identity.map(|id| reentry::Frame::enter(id, key.as_str()));
        let fut = {
            let _leading = leading();
            catch_unwind(AssertUnwindSafe(action))
        };
        let outcome = match fut {
            Err(payload) => Err(payload),
            Ok(fut) => {
                let mut fut = pin!(fut);
                poll_fn(|cx| {
                    let _leading = leading();
                    match catch_unwind(AssertUnwindSafe(|| fut.as_mut().poll(cx))) {
                        Ok(Poll::Pending) => Poll::Pending,
                        Ok(Poll::Ready(r)) => Poll::Ready(Ok(r)),
                        Err(payload) => Poll::Ready(Err(payload)),
                    }
                })
                .await
            }
        };
        return match outcome {
            Ok(Ok(value)) => {
                lease
                    .complete(value.clone())
                    .await
                    .map_err(ExecuteError::Store)?;
                Ok(Executed {
                    value,
                    source: Source::Led,
                })
            }
            Ok(Err(e)) => Err(ExecuteError::Action(lease.fail(e).await)),
            Err(payload) => {
                lease.panicked(&panic_message(&*payload));
                resume_unwind(payload)
            }
        };
    }
}

/// The text of a panic payload.
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic payload".to_owned()
    }
}

/// Checks a caller-given fingerprint: non-empty, at most 1024 bytes.
pub(crate) fn check_fingerprint(fingerprint: &str) -> Result<(), Error> {
    if fingerprint.is_empty() {
        return Err(Error::invalid("fingerprint", "must not be empty"));
    }
    if fingerprint.len() > 1024 {
        return Err(Error::invalid(
            "fingerprint",
            format!("must be at most 1024 bytes, got {}", fingerprint.len()),
        ));
    }
    Ok(())
}

/// Default time a completed result is kept: 24 h.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);
/// Default bound on a [`MemoryStore`]'s entries: 1,000,000 (each costs its key and
/// value and about 200 bytes more). Past it the oldest completed entries are evicted;
/// running ones never are. A server sets
/// [`max_entries`](MemoryStoreBuilder::max_entries) to its peak completions per
/// second × the TTL in seconds, within its memory.
pub const DEFAULT_MAX_ENTRIES: usize = 1_000_000;
/// Default retry-after hint given to a no-wait caller that finds a call in progress.
pub const DEFAULT_IN_PROGRESS_RETRY_AFTER: Duration = Duration::from_secs(1);
