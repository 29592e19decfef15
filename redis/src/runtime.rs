//! What one process needs to reach Redis: the worker pool, the lease renewer, the
//! pub/sub listener, a timer thread and the in-process tier.
//!
//! Threads do not survive `fork()`: a child inherits the parent's thread state (pool
//! queue, renewals, subscriptions, flights in progress, locks that a parent thread
//! may have held) but none of the threads that drive it. So a store keeps one
//! [`Runtime`] per process: the first use in a child (a different process id) makes a
//! fresh one, with new threads and new connections, and the parent's is never used
//! or dropped there. Leases and waits made under the parent's runtime stay the
//! parent's: a child neither renews, releases nor completes them.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use oncely::{Error, MemoryStore};

use crate::conn::Link;
use crate::lock;
use crate::notifier::Notifier;
use crate::pool::Pool;
use crate::renewer::Renewer;

/// The threads and the in-process tier of one process.
pub(crate) struct Runtime<E> {
    /// The process that made it; anywhere else it is a copy left by `fork()`.
    pid: u32,
    pub(crate) pool: Pool,
    pub(crate) renewer: Arc<Renewer>,
    pub(crate) notifier: Arc<Notifier>,
    pub(crate) timers: Arc<Timers>,
    pub(crate) local: MemoryStore<Vec<u8>, E>,
}

impl<E> Runtime<E> {
    pub(crate) fn new(
        link: &Link,
        workers: usize,
        lease: Duration,
        prefix: &str,
        in_progress_retry_after: Duration,
    ) -> Result<Self, Error> {
        // Unbounded: the tier holds this process's running claims only (completed
        // results live in Redis), and a bound there would refuse callers.
        let local = MemoryStore::builder()
            .unbounded()
            .in_progress_retry_after(in_progress_retry_after)
            .build()?;
        Ok(Runtime {
            pid: std::process::id(),
            pool: Pool::new(link, workers),
            renewer: Renewer::new(lease),
            notifier: Notifier::new(format!(
                "{{{prefix}}}:wake:{}",
                oncely::IdempotencyKey::random().as_str()
            )),
            timers: Timers::new(),
            local,
        })
    }

    /// True in the process that made this runtime (false in a child after `fork()`).
    pub(crate) fn is_current(&self) -> bool {
        self.pid == std::process::id()
    }
}

impl<E> Drop for Runtime<E> {
    fn drop(&mut self) {
        self.renewer.shutdown();
        self.notifier.shutdown();
        self.timers.shutdown();
    }
}

/// The runtime of the current process, made again on first use after `fork()`.
pub(crate) struct PerProcess<E> {
    current: Mutex<Arc<Runtime<E>>>,
    make: Box<dyn Fn() -> Result<Runtime<E>, Error> + Send + Sync>,
}

impl<E> PerProcess<E> {
    pub(crate) fn new(
        make: impl Fn() -> Result<Runtime<E>, Error> + Send + Sync + 'static,
    ) -> Result<Self, Error> {
        Ok(PerProcess {
            current: Mutex::new(Arc::new(make()?)),
            make: Box::new(make),
        })
    }

    /// This process's runtime.
    pub(crate) fn get(&self) -> Result<Arc<Runtime<E>>, Error> {
        let mut current = lock(&self.current);
        if !current.is_current() {
            let parents = std::mem::replace(&mut *current, Arc::new((self.make)()?));
            // Dropping it would join no thread but could wait on a lock a parent
            // thread held at the fork: it is leaked (one per fork) instead.
            std::mem::forget(parents);
        }
        Ok(current.clone())
    }
}

impl<E> Drop for PerProcess<E> {
    fn drop(&mut self) {
        let current = self.current.get_mut().unwrap_or_else(|e| e.into_inner());
        if !current.is_current() {
            // A child that never used the store: the parent's runtime is leaked too.
            std::mem::forget(current.clone());
        }
    }
}

#[derive(Default)]
struct TimerState {
    due: BinaryHeap<Reverse<(Instant, u64)>>,
    wakers: HashMap<u64, Waker>,
    next_id: u64,
    started: bool,
    shutdown: bool,
}

/// Wakes sleeping waiters at their deadlines on one thread of the runtime (the
/// `futures-timer` thread is process-wide and does not come back after `fork()`).
pub(crate) struct Timers {
    state: Mutex<TimerState>,
    cv: Condvar,
}

impl Timers {
    fn new() -> Arc<Self> {
        Arc::new(Timers {
            state: Mutex::new(TimerState::default()),
            cv: Condvar::new(),
        })
    }

    /// A future that is ready `d` from now.
    pub(crate) fn sleep(self: &Arc<Self>, d: Duration) -> Sleep {
        Sleep {
            timers: self.clone(),
            at: Instant::now() + d,
            id: None,
        }
    }

    fn shutdown(&self) {
        lock(&self.state).shutdown = true;
        self.cv.notify_one();
    }

    fn run(&self) {
        let mut st = lock(&self.state);
        loop {
            if st.shutdown {
                return;
            }
            let now = Instant::now();
            let mut wake = Vec::new();
            while let Some(&Reverse((at, id))) = st.due.peek() {
                if at > now {
                    break;
                }
                st.due.pop();
                // Absent when its sleep was dropped or already saw its deadline.
                wake.extend(st.wakers.remove(&id));
            }
            if !wake.is_empty() {
                drop(st);
                wake.into_iter().for_each(Waker::wake);
                st = lock(&self.state);
                continue;
            }
            st = match st.due.peek() {
                Some(&Reverse((at, _))) => {
                    self.cv
                        .wait_timeout(st, at.saturating_duration_since(now))
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
                None => self.cv.wait(st).unwrap_or_else(|e| e.into_inner()),
            };
        }
    }
}

/// See [`Timers::sleep`].
pub(crate) struct Sleep {
    timers: Arc<Timers>,
    at: Instant,
    id: Option<u64>,
}

impl Future for Sleep {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let me = &mut *self;
        let mut st = lock(&me.timers.state);
        if Instant::now() >= me.at {
            if let Some(id) = me.id.take() {
                st.wakers.remove(&id);
            }
            return Poll::Ready(());
        }
        match me.id {
            Some(id) => {
                st.wakers.insert(id, cx.waker().clone());
            }
            None => {
                let id = st.next_id;
                st.next_id += 1;
                let earliest = st.due.peek().is_none_or(|&Reverse((t, _))| me.at < t);
                st.due.push(Reverse((me.at, id)));
                st.wakers.insert(id, cx.waker().clone());
                me.id = Some(id);
                if !st.started {
                    st.started = true;
                    let timers = me.timers.clone();
                    std::thread::Builder::new()
                        .name("oncely-redis-timer".into())
                        .spawn(move || timers.run())
                        .expect("spawning the oncely-redis timer thread");
                } else if earliest {
                    me.timers.cv.notify_one();
                }
            }
        }
        Poll::Pending
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            lock(&self.timers.state).wakers.remove(&id);
        }
    }
}
