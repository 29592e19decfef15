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
//!
//! A future the parent had in flight at the fork (a call waiting for a worker's answer,
//! a sleep, a wait on an in-process leader) is copied into the child too, where the
//! thread that would wake it is gone. So every such future registers its waker in its
//! runtime's [`Waiters`] and checks the process id when polled: in the child it ends
//! with UNAVAILABLE ("in flight at fork"), never leading or running an action there,
//! once the child wakes the parent's waiters — when it makes its own runtime, or
//! earlier through [`PerProcess::after_fork`].

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use oncely::{Error, MemoryStore};

use crate::conn::Link;
use crate::lock;
use crate::notifier::Notifier;
use crate::pool::Pool;
use crate::renewer::Renewer;

/// The error of a future that was in flight when its process forked, in the child.
pub(crate) fn in_flight_at_fork() -> Error {
    Error::Unavailable(
        "this call was in flight when the process forked (its answer would come to the \
         parent's threads): in the child it ends here, without leading or running its \
         action; call again"
            .into(),
    )
}

/// The wakers of the futures waiting on one runtime's threads (worker replies, sleeps),
/// woken all at once in a child after `fork()` (see the module's doc).
pub(crate) struct Waiters {
    /// The process of the runtime.
    pid: u32,
    next: AtomicU64,
    wakers: Mutex<HashMap<u64, Waker>>,
    /// Set in a child once the parent's waiters were woken.
    woken: AtomicBool,
}

/// A future's entry in [`Waiters`]: its id and the waker last registered.
pub(crate) type Registered = Option<(u64, Waker)>;

impl Waiters {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Waiters {
            pid: std::process::id(),
            next: AtomicU64::new(0),
            wakers: Mutex::new(HashMap::new()),
            woken: AtomicBool::new(false),
        })
    }

    /// True in a child of the process that made the runtime.
    pub(crate) fn forked(&self) -> bool {
        self.pid != std::process::id()
    }

    /// Registers `waker` for `entry` (again only when it changed).
    pub(crate) fn register(&self, entry: &mut Registered, waker: &Waker) {
        if let Some((_, w)) = entry {
            if w.will_wake(waker) {
                return;
            }
        }
        let id = match entry {
            Some((id, _)) => *id,
            None => self.next.fetch_add(1, Ordering::Relaxed),
        };
        lock(&self.wakers).insert(id, waker.clone());
        *entry = Some((id, waker.clone()));
    }

    /// Forgets `entry` (the future is done or dropped). In a child, nothing is done:
    /// the lock may have been held by a parent thread at the fork.
    pub(crate) fn unregister(&self, entry: &mut Registered) {
        if let Some((id, _)) = entry.take() {
            if !self.forked() {
                lock(&self.wakers).remove(&id);
            }
        }
    }

    /// In a child: wakes every future registered, once (each then ends with
    /// [`in_flight_at_fork`]). A lock that a parent thread held at the fork can never
    /// be taken here: its futures are then left as they are (they are woken only by a
    /// poll of their own).
    fn wake_all_in_child(&self) {
        if !self.forked() || self.woken.swap(true, Ordering::AcqRel) {
            return;
        }
        let wakers: Vec<Waker> = match self.wakers.try_lock() {
            Ok(mut w) => w.drain().map(|(_, w)| w).collect(),
            Err(std::sync::TryLockError::Poisoned(p)) => {
                p.into_inner().drain().map(|(_, w)| w).collect()
            }
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        wakers.into_iter().for_each(Waker::wake);
    }
}

/// A value a future holds that belongs to the process that made it (an in-process
/// lease, an interest in a pub/sub channel): dropped there as usual, forgotten in a
/// child after `fork()`, where its drop would take locks that a parent thread may have
/// held at the fork (see the module's doc).
pub(crate) struct ThisProcess<T> {
    value: Option<T>,
    pid: u32,
}

impl<T> ThisProcess<T> {
    pub(crate) fn new(value: T) -> Self {
        ThisProcess {
            value: Some(value),
            pid: std::process::id(),
        }
    }

    /// The value, to be used (or dropped) in this process.
    pub(crate) fn into_inner(mut self) -> T {
        self.value.take().expect("taken only here")
    }
}

impl<T> std::ops::Deref for ThisProcess<T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.value.as_ref().expect("taken only by into_inner")
    }
}

impl<T> std::ops::DerefMut for ThisProcess<T> {
    fn deref_mut(&mut self) -> &mut T {
        self.value.as_mut().expect("taken only by into_inner")
    }
}

impl<T> Drop for ThisProcess<T> {
    fn drop(&mut self) {
        if self.pid != std::process::id() {
            std::mem::forget(self.value.take());
        }
    }
}

/// The threads and the in-process tier of one process.
pub(crate) struct Runtime<E> {
    /// The process that made it; anywhere else it is a copy left by `fork()`.
    pid: u32,
    pub(crate) waiters: Arc<Waiters>,
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
        let waiters = Waiters::new();
        Ok(Runtime {
            pid: std::process::id(),
            pool: Pool::new(link, workers, waiters.clone()),
            renewer: Renewer::new(lease),
            notifier: Notifier::new(format!(
                "{{{prefix}}}:wake:{}",
                oncely::IdempotencyKey::random().as_str()
            )),
            timers: Timers::new(waiters.clone()),
            waiters,
            local,
        })
    }

    /// True in the process that made this runtime (false in a child after `fork()`).
    pub(crate) fn is_current(&self) -> bool {
        self.pid == std::process::id()
    }

    /// In a child: ends the waits the parent had in flight at the fork (its threads'
    /// answers and its in-process flights, which never settle here).
    fn end_waits_in_child(&self) {
        if self.is_current() || self.waiters.woken.load(Ordering::Acquire) {
            return;
        }
        // Failed first: a claim woken below drops its in-process lease, which would
        // tell the joiners to lead. (Skipped when a parent thread held the table's lock
        // at the fork: those waits are then left as they are, rather than the child
        // waiting for ever here.)
        let _ = self.local.fail_running(&in_flight_at_fork());
        self.waiters.wake_all_in_child();
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
///
/// Found without taking a lock: a lock that another thread of the parent held at the
/// fork never comes free in the child, where that thread is gone, and the child's
/// `after_fork` and first call would wait for it for ever. Each process's runtime is a
/// [`Level`] below its parent's: the maker reads its own at the root, a child (and its
/// children) walk down to theirs, made on first use (a fork copies the whole chain, so
/// each child fills in its own copy of the slot below its parent's).
pub(crate) struct PerProcess<E> {
    root: Level<E>,
    make: Box<dyn Fn() -> Result<Runtime<E>, Error> + Send + Sync>,
}

/// One process's runtime and the slot of the runtime of a child it forked (see
/// [`PerProcess`]).
struct Level<E> {
    runtime: Arc<Runtime<E>>,
    below: OnceLock<Box<Level<E>>>,
}

impl<E> Level<E> {
    fn new(runtime: Runtime<E>) -> Self {
        Level {
            runtime: Arc::new(runtime),
            below: OnceLock::new(),
        }
    }
}

impl<E> PerProcess<E> {
    pub(crate) fn new(
        make: impl Fn() -> Result<Runtime<E>, Error> + Send + Sync + 'static,
    ) -> Result<Self, Error> {
        Ok(PerProcess {
            root: Level::new(make()?),
            make: Box::new(make),
        })
    }

    /// This process's runtime.
    pub(crate) fn get(&self) -> Result<Arc<Runtime<E>>, Error> {
        let mut level = &self.root;
        while !level.runtime.is_current() {
            // Made by this process's parent (or one before it): its waits end here.
            level.runtime.end_waits_in_child();
            level = match level.below.get() {
                Some(below) => below,
                None => {
                    let made = Box::new(Level::new((self.make)()?));
                    // Another thread of this process may have set it first: `made`
                    // is then dropped (this process's own, never used).
                    let _ = level.below.set(made);
                    level.below.get().expect("set just now")
                }
            };
        }
        Ok(level.runtime.clone())
    }

    /// In a child after `fork()`: ends the waits the parent had in flight (see the
    /// module's doc) without making a runtime yet. Nothing in the parent.
    pub(crate) fn after_fork(&self) {
        let mut level = Some(&self.root);
        while let Some(l) = level.filter(|l| !l.runtime.is_current()) {
            l.runtime.end_waits_in_child();
            level = l.below.get().map(|b| &**b);
        }
    }
}

impl<E> Drop for PerProcess<E> {
    fn drop(&mut self) {
        // Dropping a runtime of another process (copied by fork) would join no thread
        // but could wait on a lock a parent thread held at the fork: it is leaked (one
        // per fork) instead.
        let mut level = Some(&self.root);
        while let Some(l) = level {
            if !l.runtime.is_current() {
                std::mem::forget(l.runtime.clone());
            }
            level = l.below.get().map(|b| &**b);
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
    waiters: Arc<Waiters>,
}

impl Timers {
    fn new(waiters: Arc<Waiters>) -> Arc<Self> {
        Arc::new(Timers {
            state: Mutex::new(TimerState::default()),
            cv: Condvar::new(),
            waiters,
        })
    }

    /// A future that is ready `d` from now (at once in a child after `fork()`, where
    /// the timer thread is gone).
    pub(crate) fn sleep(self: &Arc<Self>, d: Duration) -> Sleep {
        Sleep {
            timers: self.clone(),
            at: Instant::now() + d,
            id: None,
            registered: None,
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
    /// In the runtime's [`Waiters`], while pending.
    registered: Registered,
}

impl Future for Sleep {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let me = &mut *self;
        if me.timers.waiters.forked() {
            // The timer thread stayed in the parent (its lock too, maybe).
            me.id = None;
            me.registered = None;
            return Poll::Ready(());
        }
        me.timers.waiters.register(&mut me.registered, cx.waker());
        let mut st = lock(&me.timers.state);
        if Instant::now() >= me.at {
            if let Some(id) = me.id.take() {
                st.wakers.remove(&id);
            }
            drop(st);
            me.timers.waiters.unregister(&mut me.registered);
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
        if self.timers.waiters.forked() {
            return; // the parent's locks: see Sleep::poll
        }
        if let Some(id) = self.id.take() {
            lock(&self.timers.state).wakers.remove(&id);
        }
        self.timers.waiters.unregister(&mut self.registered);
    }
}
