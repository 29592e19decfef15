//! A caller's wait on a running call ([`RedisJoin`]): on a leader in this process, or
//! on one on another instance, woken by pub/sub with polling as the fallback.

use std::fmt;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use oncely::{Join, Joined, Lease, ScopedKey};

use crate::request::Request;
use crate::runtime::{Runtime, ThisProcess};
use crate::scripts::Peek;
use crate::{settle_local, Inner, RedisStore};

/// Waits for a leader on another instance: woken by its pub/sub notification, or by
/// polling under backoff (doubling from `poll_min` up to `poll_max`) as the fallback.
pub(crate) async fn wait_remote<E: Send + Sync + 'static>(
    store: RedisStore<E>,
    rt: Arc<Runtime<E>>,
    local: ThisProcess<Lease<Vec<u8>, E>>,
    key: ScopedKey,
    record: String,
    fingerprint: String,
    mut left_ms: u64,
) -> Joined<Vec<u8>, E> {
    let inner = &store.inner;
    // In a child after fork(), a copy of this wait must not touch the parent's locks
    // (a parent thread may have held one at the fork) when it is polled, ends or is
    // dropped: the in-process lease (wrapped by the caller, as the wait may be dropped
    // unpolled), the notifier, the subscription and its listener are the parent's.
    if !rt.is_current() {
        return Joined::Error(crate::runtime::in_flight_at_fork());
    }
    let mut sub = ThisProcess::new(
        rt.notifier
            .subscribe(&inner.link, Inner::<E>::channel(&record)),
    );
    let mut listener = ThisProcess::new(sub.first.take().expect("a new subscription listens"));
    if sub.needs_poke {
        let wake = rt.notifier.wake_channel().to_owned();
        rt.pool
            .spawn(Request::command("PUBLISH").arg(wake).arg("subscribe"));
    }
    let mut delay = inner.config.poll_min;
    loop {
        let wait = delay.min(Duration::from_millis(left_ms.saturating_add(1)));
        let mut timer = rt.timers.sleep(wait);
        poll_fn(|cx: &mut Context<'_>| {
            // In a child the listener is not polled (that locks the parent's event);
            // the wait ends below.
            if !rt.is_current()
                || Pin::new(&mut *listener).poll(cx).is_ready()
                || Pin::new(&mut timer).poll(cx).is_ready()
            {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
        delay = (delay * 2).min(inner.config.poll_max);
        if !rt.is_current() {
            // A wait the parent had in flight at fork(): its leader is the parent's, and
            // a caller here must not lead in its place.
            return Joined::Error(crate::runtime::in_flight_at_fork());
        }
        // Listen again before looking: a notification that comes while the look is
        // on its way (the completion, just after the record was read as running)
        // must wake the next wait, not be lost until the next poll.
        listener = ThisProcess::new(sub.event.listen());
        let peek = rt
            .pool
            .call::<Peek>(inner.scripts.peek.on(&record).arg(&fingerprint))
            .await;
        match peek {
            Ok(Peek::Done(value)) => {
                settle_local(&rt, local.into_inner(), &key, value.clone());
                return Joined::Value(value);
            }
            Ok(Peek::NotStored(type_name)) => {
                drop(local);
                return Joined::Error(crate::not_stored(&key, type_name));
            }
            Ok(Peek::Running { left_ms: l }) => left_ms = l,
            // Gone (released after a failure, expired lease) or unreadable: look
            // again with a claim, which takes over or reports the error. Dropping
            // `local` lets this process's waiters do the same.
            Ok(Peek::Gone) | Err(_) => return Joined::Abandoned,
        }
    }
}

/// A wait on a running call: on a leader in this process, or on one elsewhere.
pub enum RedisJoin<E> {
    /// The leader is in this process (tier 1).
    Local(Join<Vec<u8>, E>),
    /// The leader is another instance; this process's other callers wait on us.
    Remote(Pin<Box<dyn Future<Output = Joined<Vec<u8>, E>> + Send>>),
}

impl<E> Future for RedisJoin<E> {
    type Output = Joined<Vec<u8>, E>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            RedisJoin::Local(j) => Pin::new(j).poll(cx),
            RedisJoin::Remote(f) => f.as_mut().poll(cx),
        }
    }
}

impl<E> fmt::Debug for RedisJoin<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RedisJoin::Local(_) => "RedisJoin::Local",
            RedisJoin::Remote(_) => "RedisJoin::Remote",
        })
    }
}
