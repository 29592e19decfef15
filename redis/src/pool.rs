//! The store's worker threads, which drive the redis crate's blocking client so that
//! the caller needs no async runtime: the calls queued in order of arrival, taken up
//! in batches by a small pool of workers (results come back through
//! `futures-channel` oneshots).
//!
//! Every call has a deadline: `io_timeout` after it was made. It bounds the wait for
//! a worker, connecting and the reply alike, so a slow or black-holed Redis answers
//! each caller within about one I/O timeout, whatever its place in the queue. A call
//! whose deadline passed before a worker took it up is never sent.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use oncely::Error;

use crate::batch::{run_batch, Acked};
use crate::conn::{Conn, Link};
use crate::lock;
use crate::request::{Failure, Request};
use crate::runtime::{in_flight_at_fork, Registered, Waiters};

/// What is done with a call's outcome, on the worker (it may queue follow-up calls).
pub(crate) type Done = Box<dyn FnOnce(Result<redis::Value, Failure>, Acked, &Queue) + Send>;

/// A call waiting for a worker.
pub(crate) struct Call {
    pub(crate) request: Request,
    pub(crate) deadline: Instant,
    /// True once nobody waits for the answer and the call need not be sent.
    pub(crate) abandoned: Option<Box<dyn Fn() -> bool + Send>>,
    pub(crate) done: Done,
}

#[derive(Default)]
pub(crate) struct QueueState {
    calls: VecDeque<Call>,
    closed: bool,
    /// Workers waiting for a call: a push wakes one only when there is one (a
    /// notification is a syscall, even with nobody waiting).
    idle: usize,
}

/// The calls waiting for a worker, in order of arrival.
pub(crate) struct Queue {
    pub(crate) state: Mutex<QueueState>,
    pub(crate) ready: Condvar,
}

/// The most calls sent as one pipeline.
const MAX_BATCH: usize = 256;

impl Queue {
    fn push(&self, call: Call) -> bool {
        let mut st = lock(&self.state);
        if st.closed {
            return false;
        }
        st.calls.push_back(call);
        let wake = st.idle > 0;
        drop(st);
        if wake {
            self.ready.notify_one();
        }
        true
    }

    /// Every call queued (up to [`MAX_BATCH`]), waiting for one; None once closed and
    /// drained.
    fn take(&self) -> Option<Vec<Call>> {
        let mut st = lock(&self.state);
        loop {
            if !st.calls.is_empty() {
                let n = st.calls.len().min(MAX_BATCH);
                let batch: Vec<Call> = st.calls.drain(..n).collect();
                let more = !st.calls.is_empty() && st.idle > 0;
                drop(st);
                if more {
                    // Another worker takes the rest while this one is busy.
                    self.ready.notify_one();
                }
                return Some(batch);
            }
            if st.closed {
                return None;
            }
            st.idle += 1;
            st = self.ready.wait(st).unwrap_or_else(|e| e.into_inner());
            st.idle -= 1;
        }
    }
}

/// A fixed pool of threads, each with its own connection, taking the calls queued in
/// order of arrival. A free worker takes every call waiting (up to [`MAX_BATCH`]) and
/// sends them as one pipeline, so calls that arrive together share one round trip,
/// and a slow reply holds up only the calls of its batch: the calls queued behind it
/// go to the next free worker. The threads end when the pool is dropped.
///
/// Every call has the same time, and a batch ends by its earliest deadline, so a call
/// waits for a worker at most until its own deadline, and is then failed without
/// being sent.
pub(crate) struct Pool {
    queue: Arc<Queue>,
    io_timeout: Duration,
    /// Connections for callers that may block their thread (see [`blocking`]), at
    /// most one per worker; made on first use.
    direct: Mutex<Vec<Conn>>,
    /// Direct connections not yet made.
    direct_left: std::sync::atomic::AtomicUsize,
    link: Link,
    waiters: Arc<Waiters>,
}

thread_local! {
    static MAY_BLOCK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with this thread marked as one that may block on Redis: the calls it makes
/// while no other call is queued go out from this thread on a direct connection,
/// with no hand-off to a worker and back (two thread wake-ups saved per call). For
/// blocking entry points only (`execute_blocking`), never inside an async task.
pub(crate) fn blocking<T>(f: impl FnOnce() -> T) -> T {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            MAY_BLOCK.with(|b| b.set(self.0));
        }
    }
    let _reset = Reset(MAY_BLOCK.with(|b| b.replace(true)));
    f()
}

/// The answer of a call on the pool (UNAVAILABLE when Redis failed). Dropping it
/// before the answer is read hands a value that already arrived to its undo, if any.
///
/// In a child after `fork()` it ends with UNAVAILABLE at its next poll, whatever came:
/// the answer goes to the parent's threads, and one that came before the fork (a claim
/// won) is the parent's (see [`crate::runtime`]).
pub(crate) struct Reply<T> {
    rx: Option<futures_channel::oneshot::Receiver<Result<T, Failure>>>,
    undo: Option<Box<dyn FnOnce(T) + Send>>,
    io_timeout: Duration,
    waiters: Arc<Waiters>,
    registered: Registered,
}

impl<T> Future for Reply<T> {
    type Output = Result<T, Error>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let io_timeout = self.io_timeout;
        if self.waiters.forked() {
            // Left as they are: undoing or unregistering would take the parent's locks.
            std::mem::forget(self.rx.take());
            std::mem::forget(self.undo.take());
            self.registered = None;
            return Poll::Ready(Err(in_flight_at_fork()));
        }
        let Some(rx) = self.rx.as_mut() else {
            return Poll::Ready(Err(Error::Unavailable(
                "the Redis store was shut down".into(),
            )));
        };
        let out = match Pin::new(rx).poll(cx) {
            Poll::Pending => {
                let me = &mut *self;
                me.waiters.register(&mut me.registered, cx.waker());
                return Poll::Pending;
            }
            Poll::Ready(Ok(Ok(v))) => Ok(v),
            Poll::Ready(Ok(Err(f))) => Err(f.into_error(io_timeout)),
            Poll::Ready(Err(_)) => Err(Error::Unavailable(
                "a Redis worker thread stopped before answering".into(),
            )),
        };
        self.rx = None;
        self.undo = None;
        let me = &mut *self;
        me.waiters.unregister(&mut me.registered);
        Poll::Ready(out)
    }
}

impl<T> Drop for Reply<T> {
    fn drop(&mut self) {
        if self.waiters.forked() {
            // The parent's: see `poll`.
            std::mem::forget(self.rx.take());
            std::mem::forget(self.undo.take());
            return;
        }
        self.waiters.unregister(&mut self.registered);
        if let (Some(mut rx), Some(undo)) = (self.rx.take(), self.undo.take()) {
            // After `close` no send can succeed: a value is either here now, or the
            // worker keeps it and undoes it there.
            rx.close();
            if let Ok(Some(Ok(v))) = rx.try_recv() {
                undo(v);
            }
        }
    }
}

/// A reply parsed into `T` (a reply of an unexpected shape is a Redis error).
fn parse<T: redis::FromRedisValue>(r: Result<redis::Value, Failure>) -> Result<T, Failure> {
    r.and_then(|v| T::from_redis_value(v).map_err(|e| Failure::Redis(e.into())))
}

impl Pool {
    pub(crate) fn new(link: &Link, threads: usize, waiters: Arc<Waiters>) -> Self {
        let queue = Arc::new(Queue {
            state: Mutex::new(QueueState::default()),
            ready: Condvar::new(),
        });
        for i in 0..threads {
            let queue = queue.clone();
            let mut conn = Conn::new(link.clone());
            std::thread::Builder::new()
                .name(format!("oncely-redis-{i}"))
                .spawn(move || {
                    while let Some(batch) = queue.take() {
                        run_batch(&mut conn, &queue, batch);
                    }
                })
                .expect("spawning an oncely-redis worker thread");
        }
        Pool {
            queue,
            io_timeout: link.io_timeout,
            direct: Mutex::new(Vec::new()),
            direct_left: std::sync::atomic::AtomicUsize::new(threads),
            link: link.clone(),
            waiters,
        }
    }

    fn reply<T>(
        &self,
        sent: bool,
        rx: futures_channel::oneshot::Receiver<Result<T, Failure>>,
        undo: Option<Box<dyn FnOnce(T) + Send>>,
    ) -> Reply<T> {
        Reply {
            rx: sent.then_some(rx),
            undo,
            io_timeout: self.io_timeout,
            waiters: self.waiters.clone(),
            registered: None,
        }
    }

    /// Sends `request` on a worker; the future resolves with its reply. Redis errors
    /// become UNAVAILABLE. Not sent when the caller went away before a worker took
    /// it up.
    pub(crate) fn call<T: redis::FromRedisValue + Send + 'static>(
        &self,
        request: Request,
    ) -> Reply<T> {
        let (tx, rx) = futures_channel::oneshot::channel();
        let tx = Arc::new(Mutex::new(Some(tx)));
        let gone = tx.clone();
        let sent = self.submit(Call {
            request,
            deadline: Instant::now() + self.io_timeout,
            abandoned: Some(Box::new(move || {
                lock(&gone).as_ref().is_none_or(|tx| tx.is_canceled())
            })),
            done: Box::new(move |r, _, _| {
                if let Some(tx) = lock(&tx).take() {
                    let _ = tx.send(parse::<T>(r));
                }
            }),
        });
        self.reply(sent, rx, None)
    }

    /// Like [`call`](Self::call), but sent even when the caller goes away, and runs
    /// `after` on the worker once the reply came (or the call failed), before
    /// answering (a completion: once queued, it is never overtaken by a release
    /// queued after it).
    ///
    /// `replicas` turns the parsed reply and what the replicas said of it (see
    /// [`Acked`]) into the answer.
    pub(crate) fn call_to_end<R: redis::FromRedisValue, T: Send + 'static>(
        &self,
        request: Request,
        replicas: impl FnOnce(R, Acked) -> T + Send + 'static,
        after: impl FnOnce() + Send + 'static,
    ) -> Reply<T> {
        let (tx, rx) = futures_channel::oneshot::channel();
        let sent = self.submit(Call {
            request,
            deadline: Instant::now() + self.io_timeout,
            abandoned: None,
            done: Box::new(move |r, acked, _| {
                let r = parse::<R>(r).map(|v| replicas(v, acked));
                after();
                let _ = tx.send(r);
            }),
        });
        self.reply(sent, rx, None)
    }

    /// Like [`call`](Self::call), but a value nobody will read is undone: when the
    /// caller stopped waiting (dropped the future) before the answer came, the request
    /// `undo` makes of the value (if any) is queued with the call's own deadline; when
    /// the answer came but was never read, `undo_later` gets it when the future is
    /// dropped. A claim nobody will use is released at once instead of blocking the
    /// key for a lease.
    ///
    /// When the call fails in a way that may come after Redis ran it (its reply timed
    /// out, or the connection broke), `undo_unknown` runs on the worker: a claim whose
    /// answer was lost is released (best effort) rather than left to its lease.
    ///
    /// `replicas` turns the reply and what the replicas said of it (see [`Acked`])
    /// into the answer, and may ask for a request to be queued at once (a claim the
    /// replicas did not acknowledge is released before its caller hears of it).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn call_or_undo<T: redis::FromRedisValue + Send + 'static>(
        &self,
        request: Request,
        replicas: impl FnOnce(T, Acked) -> (Result<T, Failure>, Option<Request>) + Send + 'static,
        undo: impl FnOnce(&T) -> Option<Request> + Send + 'static,
        undo_later: impl FnOnce(T) + Send + 'static,
        undo_unknown: impl FnOnce() + Send + 'static,
    ) -> Reply<T> {
        let (io_timeout, deadline) = (self.io_timeout, Instant::now() + self.io_timeout);
        let (tx, rx) = futures_channel::oneshot::channel();
        let tx = Arc::new(Mutex::new(Some(tx)));
        let gone = tx.clone();
        let sent = self.submit(Call {
            request,
            deadline,
            abandoned: Some(Box::new(move || {
                lock(&gone).as_ref().is_none_or(|tx| tx.is_canceled())
            })),
            done: Box::new(move |r, acked, queue| {
                let r = match parse::<T>(r) {
                    Ok(v) => {
                        let (r, first) = replicas(v, acked);
                        if let Some(request) = first {
                            // Its own deadline: the claim's may be spent by the WAIT,
                            // and a release left unsent would hold the key a lease.
                            queue.push(Call {
                                request,
                                deadline: Instant::now() + io_timeout,
                                abandoned: None,
                                done: Box::new(|_, _, _| {}),
                            });
                        }
                        r
                    }
                    Err(f) => Err(f),
                };
                if r.as_ref().is_err_and(Failure::is_lost_answer) {
                    undo_unknown();
                }
                let Some(tx) = lock(&tx).take() else {
                    return;
                };
                if let Err(Ok(v)) = tx.send(r) {
                    // Within the same deadline, so the calls behind this one keep
                    // theirs; past it the claim lapses with its lease.
                    if let Some(request) = undo(&v) {
                        queue.push(Call {
                            request,
                            deadline,
                            abandoned: None,
                            done: Box::new(|_, _, _| {}),
                        });
                    }
                }
            }),
        });
        self.reply(sent, rx, Some(Box::new(undo_later)))
    }

    /// Sends `request` without waiting for it (a release after a panic or drop, a
    /// wake-up).
    pub(crate) fn spawn(&self, request: Request) {
        self.submit(Call {
            request,
            deadline: Instant::now() + self.io_timeout,
            abandoned: None,
            done: Box::new(|_, _, _| {}),
        });
    }

    /// Queues `call` for the workers, or sends it at once from this thread when the
    /// thread may block (see [`blocking`]), nothing is queued ahead of it (calls keep
    /// their order) and a direct connection is free.
    fn submit(&self, call: Call) -> bool {
        if MAY_BLOCK.with(std::cell::Cell::get) && lock(&self.queue.state).calls.is_empty() {
            let conn = lock(&self.direct).pop().or_else(|| {
                self.direct_left
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                    .ok()
                    .map(|_| Conn::new(self.link.clone()))
            });
            if let Some(mut conn) = conn {
                run_batch(&mut conn, &self.queue, vec![call]);
                lock(&self.direct).push(conn);
                return true;
            }
        }
        self.queue.push(call)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // The workers send what is queued, then end.
        lock(&self.queue.state).closed = true;
        self.queue.ready.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Calls pushed from many threads, while the workers are now busy, now idle, are
    /// all taken, and the follow-up calls the workers push too: a push that wakes no
    /// worker (none waiting) must never leave a call behind. A lost wake-up hangs,
    /// caught by the bounded wait.
    #[test]
    fn every_call_pushed_is_taken_with_workers_busy_or_idle() {
        use std::sync::atomic::AtomicUsize;
        const PRODUCERS: usize = 8;
        const CALLS: usize = 2_000;
        let queue = Arc::new(Queue {
            state: Mutex::new(QueueState::default()),
            ready: Condvar::new(),
        });
        let done = Arc::new(AtomicUsize::new(0));
        let workers: Vec<_> = (0..3)
            .map(|_| {
                let queue = queue.clone();
                std::thread::spawn(move || {
                    while let Some(batch) = queue.take() {
                        for call in batch {
                            (call.done)(Err(Failure::NotSent), None, &queue);
                        }
                    }
                })
            })
            .collect();
        let call = |done: &Arc<AtomicUsize>, follow_up: bool| {
            let done = done.clone();
            Call {
                request: Request::command("PING"),
                deadline: Instant::now(),
                abandoned: None,
                done: Box::new(move |_, _, queue| {
                    if follow_up {
                        // As a claim nobody waits for queues its release.
                        let done = done.clone();
                        assert!(queue.push(Call {
                            request: Request::command("PING"),
                            deadline: Instant::now(),
                            abandoned: None,
                            done: Box::new(move |_, _, _| {
                                done.fetch_add(1, Ordering::SeqCst);
                            }),
                        }));
                    }
                    done.fetch_add(1, Ordering::SeqCst);
                }),
            }
        };
        let producers: Vec<_> = (0..PRODUCERS)
            .map(|p| {
                let (queue, done) = (queue.clone(), done.clone());
                std::thread::spawn(move || {
                    for i in 0..CALLS {
                        assert!(queue.push(call(&done, i % 7 == 0)));
                        // Now and then, time for every worker to go idle.
                        if (i + p) % 97 == 0 {
                            std::thread::sleep(Duration::from_micros(200));
                        }
                    }
                })
            })
            .collect();
        for p in producers {
            p.join().unwrap();
        }
        let expected = PRODUCERS * (CALLS + CALLS.div_ceil(7));
        let limit = Instant::now() + Duration::from_secs(30);
        while done.load(Ordering::SeqCst) < expected {
            assert!(
                Instant::now() < limit,
                "{} of {expected} calls taken after 30 s: a call was left in the queue",
                done.load(Ordering::SeqCst)
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        lock(&queue.state).closed = true;
        queue.ready.notify_all();
        for w in workers {
            w.join().unwrap();
        }
        assert_eq!(done.load(Ordering::SeqCst), expected);
        assert_eq!(lock(&queue.state).idle, 0);
    }
}
