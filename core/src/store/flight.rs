//! One running execution that waiters can wait on: a result slot and an event.
//!
//! Waiting costs no thread and no polling: a waiter registers an `event-listener`
//! listener, re-checks the slot, and sleeps until the leader settles the flight.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use event_listener::{Event, EventListener, Listener};

use super::Joined;
use crate::sync::{AtomicBool, Mutex, Ordering};

pub(crate) struct Flight<V, E> {
    settled: AtomicBool,
    result: Mutex<Option<Joined<V, E>>>,
    event: Event,
}

impl<V: Clone, E> Flight<V, E> {
    pub(crate) fn new() -> Self {
        Flight {
            settled: AtomicBool::new(false),
            result: Mutex::new(None),
            event: Event::new(),
        }
    }

    /// Publishes the outcome and wakes every waiter. Only the first settle counts.
    pub(crate) fn settle(&self, outcome: Joined<V, E>) {
        {
            let mut slot = self.result.lock().unwrap_or_else(|e| e.into_inner());
            if slot.is_some() {
                return;
            }
            *slot = Some(outcome);
        }
        self.settled.store(true, Ordering::Release);
        self.event.notify(usize::MAX);
    }

    fn peek(&self) -> Option<Joined<V, E>> {
        if !self.settled.load(Ordering::Acquire) {
            return None;
        }
        self.result
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
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
    listener: Option<EventListener>,
}

impl<V: Clone, E> Join<V, E> {
    pub(crate) fn new(flight: Arc<Flight<V, E>>) -> Self {
        Join {
            flight,
            listener: None,
        }
    }

    /// The outcome, if the leader has settled.
    pub fn try_get(&self) -> Option<Joined<V, E>> {
        self.flight.peek()
    }

    /// Blocks this thread until the leader settles (for thread-per-request callers).
    pub fn wait(mut self) -> Joined<V, E> {
        loop {
            if let Some(out) = self.flight.peek() {
                return out;
            }
            match self.listener.take() {
                None => self.listener = Some(self.flight.event.listen()),
                Some(l) => l.wait(),
            }
        }
    }
}

impl<V: Clone, E> Future for Join<V, E> {
    type Output = Joined<V, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            if let Some(out) = self.flight.peek() {
                self.listener = None;
                return Poll::Ready(out);
            }
            match self.listener.as_mut() {
                // Register, then check again: a settle between the first check and
                // the registration is not missed.
                None => {
                    let l = self.flight.event.listen();
                    self.listener = Some(l);
                }
                Some(l) => match Pin::new(l).poll(cx) {
                    Poll::Ready(()) => self.listener = None,
                    Poll::Pending => return Poll::Pending,
                },
            }
        }
    }
}

impl<V, E> fmt::Debug for Join<V, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Join")
            .field("settled", &self.flight.settled.load(Ordering::Relaxed))
            .finish()
    }
}
