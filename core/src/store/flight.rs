//! One running execution that waiters can wait on: a result slot and the wakers of
//! its waiters, under one lock.
//!
//! Waiting costs no thread and no polling: a waiter leaves its waker in the flight
//! (one slot per waiter, reused when it is polled again, freed for the next waiter
//! when it is dropped) and the leader wakes them all when it settles the flight.
//!
//! Hand-written rather than built on `event-listener` / `async-lock` (the crates one
//! would reach for): with them each waiter cost a heap-allocated listener, an intrusive
//! list insert and remove, and a second lock to read the result (3,180 instructions and
//! 302 ns per waiter among 10,000); keeping the result and the wakers under one lock
//! made it 1,566 instructions and 204 ns (docs/BENCHMARKS.md, "10,000 waiters").

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;

use super::Joined;
use crate::sync::Mutex;

pub(crate) struct Flight<V, E> {
    state: Mutex<State<V, E>>,
}

struct State<V, E> {
    result: Option<Joined<V, E>>,
    /// The waiters' wakers; a waiter keeps the index of its slot.
    wakers: Vec<Option<Waker>>,
    /// Slots of dropped waiters, taken by new ones first: the list is as long as the
    /// most waiters ever present at once, not the number that ever waited.
    free: Vec<usize>,
}

impl<V, E> Flight<V, E> {
    fn lock(&self) -> crate::sync::MutexGuard<'_, State<V, E>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn forget(&self, slot: usize) {
        let mut s = self.lock();
        // After a settle the list is gone (and a new one never forms).
        if s.result.is_some() {
            return;
        }
        if let Some(w) = s.wakers.get_mut(slot) {
            *w = None;
            s.free.push(slot);
        }
    }
}

impl<V: Clone, E> Flight<V, E> {
    pub(crate) fn new() -> Self {
        Flight {
            state: Mutex::new(State {
                result: None,
                wakers: Vec::new(),
                free: Vec::new(),
            }),
        }
    }

    /// Publishes the outcome and wakes every waiter. Only the first settle counts.
    pub(crate) fn settle(&self, outcome: Joined<V, E>) {
        Self::settle_locked(self.lock(), outcome);
    }

    /// [`settle`](Self::settle), unless the flight is locked (then nothing is done): for
    /// a child after `fork()`, where a lock a parent thread held never comes free.
    pub(crate) fn try_settle(&self, outcome: Joined<V, E>) {
        match self.state.try_lock() {
            Ok(s) => Self::settle_locked(s, outcome),
            Err(std::sync::TryLockError::Poisoned(p)) => {
                Self::settle_locked(p.into_inner(), outcome)
            }
            Err(std::sync::TryLockError::WouldBlock) => {}
        }
    }

    fn settle_locked(mut s: crate::sync::MutexGuard<'_, State<V, E>>, outcome: Joined<V, E>) {
        if s.result.is_some() {
            return;
        }
        s.result = Some(outcome);
        s.free = Vec::new();
        let wakers = std::mem::take(&mut s.wakers);
        drop(s);
        for w in wakers.into_iter().flatten() {
            w.wake();
        }
    }

    fn peek(&self) -> Option<Joined<V, E>> {
        self.lock().result.clone()
    }

    /// The outcome if settled; otherwise leaves `waker` in slot `*slot` (taking a
    /// new slot the first time).
    fn poll_with(&self, slot: &mut Option<usize>, waker: &Waker) -> Option<Joined<V, E>> {
        let mut s = self.lock();
        if let Some(out) = &s.result {
            return Some(out.clone());
        }
        match *slot {
            Some(i) => match &mut s.wakers[i] {
                Some(w) if w.will_wake(waker) => {}
                w => *w = Some(waker.clone()),
            },
            None => match s.free.pop() {
                Some(i) => {
                    s.wakers[i] = Some(waker.clone());
                    *slot = Some(i);
                }
                None => {
                    *slot = Some(s.wakers.len());
                    s.wakers.push(Some(waker.clone()));
                }
            },
        }
        None
    }
}

/// A wait on a running call with the same key; resolves to its [`Joined`] outcome.
///
/// Dropping it stops waiting without affecting the leader or other waiters. Besides
/// `.await`, [`Join::wait`] blocks the thread and [`Join::try_get`] polls without
/// waiting.
#[must_use = "a Join does nothing unless awaited"]
pub struct Join<V, E> {
    flight: Arc<Flight<V, E>>,
    slot: Option<usize>,
}

struct Unpark(Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark()
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark()
    }
}

impl<V: Clone, E> Join<V, E> {
    pub(crate) fn new(flight: Arc<Flight<V, E>>) -> Self {
        Join { flight, slot: None }
    }

    /// The outcome, if the leader has settled.
    pub fn try_get(&self) -> Option<Joined<V, E>> {
        self.flight.peek()
    }

    /// Blocks this thread until the leader settles (for thread-per-request callers).
    pub fn wait(mut self) -> Joined<V, E> {
        let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
        loop {
            if let Some(out) = self.flight.poll_with(&mut self.slot, &waker) {
                return out;
            }
            std::thread::park();
        }
    }
}

impl<V: Clone, E> Future for Join<V, E> {
    type Output = Joined<V, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        match this.flight.poll_with(&mut this.slot, cx.waker()) {
            Some(out) => Poll::Ready(out),
            None => Poll::Pending,
        }
    }
}

impl<V, E> Drop for Join<V, E> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot {
            self.flight.forget(slot);
        }
    }
}

impl<V, E> fmt::Debug for Join<V, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Join")
            .field("settled", &self.flight.lock().result.is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::Waker;

    fn poll_once(join: &mut Join<u64, ()>) -> Poll<Joined<u64, ()>> {
        Pin::new(join).poll(&mut Context::from_waker(Waker::noop()))
    }

    #[test]
    fn cancelled_waiters_leave_no_slot_behind() {
        let flight = Arc::new(Flight::<u64, ()>::new());
        let mut kept = Join::new(flight.clone());
        assert!(poll_once(&mut kept).is_pending());
        for _ in 0..1_000_000 {
            let mut cancelled = Join::new(flight.clone());
            assert!(poll_once(&mut cancelled).is_pending());
        }
        // Ten at a time, to check that slots freed together are all reused.
        for _ in 0..1_000 {
            let mut batch: Vec<_> = (0..10).map(|_| Join::new(flight.clone())).collect();
            for j in &mut batch {
                assert!(poll_once(j).is_pending());
            }
        }
        {
            let s = flight.lock();
            assert!(s.wakers.len() <= 11, "{} waker slots", s.wakers.len());
            assert!(s.free.len() <= 10);
        }
        flight.settle(Joined::Value(7));
        assert!(matches!(
            poll_once(&mut kept),
            Poll::Ready(Joined::Value(7))
        ));
        let s = flight.lock();
        assert!(s.wakers.is_empty() && s.free.is_empty());
    }

    #[test]
    fn a_reused_slot_wakes_its_new_waiter() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        struct Count(AtomicUsize);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let flight = Arc::new(Flight::<u64, ()>::new());
        let mut gone = Join::new(flight.clone());
        assert!(poll_once(&mut gone).is_pending());
        drop(gone);
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let mut waiting = Join::new(flight.clone());
        let mut cx = Context::from_waker(&waker);
        assert!(Pin::new(&mut waiting).poll(&mut cx).is_pending());
        assert_eq!(waiting.slot, Some(0));
        flight.settle(Joined::Value(1));
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert!(matches!(
            poll_once(&mut waiting),
            Poll::Ready(Joined::Value(1))
        ));
    }
}
