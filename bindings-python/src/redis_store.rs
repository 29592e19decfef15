//! The shared dedup store on Redis for Python: `oncely_redis::RedisStore` driven from
//! Python, so the action (a coroutine or a function) runs in the caller's event loop
//! or thread.
//!
//! Every step that talks to Redis (`begin`, including the wait for a leader,
//! `complete`, `fail`) is a [`RedisPending`]: a Rust future that Python either awaits
//! through the same pump as the memory store's joins (`subscribe`: the future is
//! polled without the GIL; its waker only queues an id; the outcome reaches the event
//! loop with `call_soon_threadsafe`) or blocks on with the GIL released (`wait`).
//! Results cross as bytes: `oncely.redis_store` encodes and decodes them (the "Result
//! encoding" of `redis/README.md`).

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use oncely::{Begin, Error, ExecuteOptions, Joined, LeaderLease};
use oncely_redis::RedisStore;

use crate::convert::{int_in, opt_seconds};
use crate::errors::{to_py_value, IntoPyResult};
use crate::store::{
    bury, executed, register_native, scoped_key, traceback_of, unregister, Deliver, Held,
    NativeFuture,
};

/// A failed Python action, shared with this process's joiners (never stored in Redis).
pub struct RedisFailure {
    exc: Held,
    tb: Held,
}

type Store = RedisStore<RedisFailure>;
type CoreLease = oncely_redis::RedisLease<RedisFailure>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `Executed(decode(data), source)`, or the decoding error as an exception object.
fn decoded(py: Python<'_>, data: Vec<u8>, source: &'static str) -> Py<PyAny> {
    static DECODE: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let value = DECODE
        .import(py, "oncely.redis_store", "decode_result")
        .and_then(|decode| decode.call1((PyBytes::new(py, &data),)))
        .and_then(|v| executed(py, v.unbind(), source));
    match value {
        Ok(v) => v,
        Err(e) => e.into_value(py).into_any(),
    }
}

fn failure_tuple(py: Python<'_>, f: &RedisFailure) -> Py<PyAny> {
    match PyTuple::new(py, [f.exc.bind(py), f.tb.bind(py)]) {
        Ok(t) => t.into_any().unbind(),
        Err(e) => e.into_value(py).into_any(),
    }
}

fn error_value(e: Error) -> Deliver {
    Box::new(move |py| to_py_value(py, e))
}

/// The native Redis store; `oncely.RedisStore` adds `execute`/`execute_sync`.
#[pyclass(subclass, frozen, module = "oncely", name = "_RedisStore")]
pub struct PyRedisStore {
    inner: Store,
}

#[pymethods]
impl PyRedisStore {
    #[new]
    #[pyo3(signature = (url, lease=None, ttl=None, *, prefix=None, connect_timeout=None, io_timeout=None, workers=None, in_progress_retry_after=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        url: &str,
        lease: Option<&Bound<'_, PyAny>>,
        ttl: Option<&Bound<'_, PyAny>>,
        prefix: Option<&str>,
        connect_timeout: Option<&Bound<'_, PyAny>>,
        io_timeout: Option<&Bound<'_, PyAny>>,
        workers: Option<&Bound<'_, PyAny>>,
        in_progress_retry_after: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut b = Store::builder(url);
        if let Some(d) = opt_seconds(py, "lease", lease)? {
            b = b.lease(d);
        }
        if let Some(d) = opt_seconds(py, "ttl", ttl)? {
            b = b.ttl(d);
        }
        if let Some(p) = prefix {
            b = b.prefix(p);
        }
        if let Some(d) = opt_seconds(py, "connect_timeout", connect_timeout)? {
            b = b.connect_timeout(d);
        }
        if let Some(d) = opt_seconds(py, "io_timeout", io_timeout)? {
            b = b.io_timeout(d);
        }
        if let Some(n) = workers.filter(|n| !n.is_none()) {
            b = b.workers(int_in(py, "workers", n, 1, 1024)? as usize);
        }
        if let Some(d) = opt_seconds(py, "in_progress_retry_after", in_progress_retry_after)? {
            b = b.in_progress_retry_after(d);
        }
        Ok(PyRedisStore {
            inner: b.build().py(py)?,
        })
    }

    /// Looks the key up (in this process, then in Redis) and waits for a running call
    /// if there is one: a pending whose outcome is an `Executed` (replayed or joined,
    /// decoded), a `RedisLease` (run the action, then settle it), None (the leader
    /// went away: begin again), a `(exception, traceback)` tuple (a leader in this
    /// process failed) or an exception object (store error).
    #[pyo3(signature = (scoped, fingerprint, wait=true))]
    fn begin(
        &self,
        scoped: &Bound<'_, PyAny>,
        fingerprint: &str,
        wait: bool,
    ) -> PyResult<RedisPending> {
        let key = scoped_key(scoped)?.inner.clone();
        let options = if wait {
            ExecuteOptions::default()
        } else {
            ExecuteOptions::NO_WAIT
        };
        let store = self.inner.clone();
        let fingerprint = fingerprint.to_owned();
        let future = async move {
            let deliver: Deliver = match store.begin(&key, &fingerprint, options).await {
                Err(e) => error_value(e),
                Ok(Begin::Replay(Ok(data))) => Box::new(move |py| decoded(py, data, "replayed")),
                Ok(Begin::Replay(Err(f))) => Box::new(move |py| failure_tuple(py, &f)),
                Ok(Begin::Lead(lease)) => Box::new(move |py| {
                    match Py::new(
                        py,
                        RedisLease {
                            inner: Mutex::new(Some(lease)),
                        },
                    ) {
                        Ok(l) => l.into_any(),
                        Err(e) => e.into_value(py).into_any(),
                    }
                }),
                Ok(Begin::Join(join)) => match join.await {
                    Joined::Value(data) => Box::new(move |py| decoded(py, data, "joined")),
                    Joined::Failed(f) => Box::new(move |py| failure_tuple(py, &f)),
                    Joined::Panicked(m) => error_value(Error::LeaderPanicked(m.to_string())),
                    Joined::Abandoned => Box::new(|py| py.None()),
                },
            };
            deliver
        };
        Ok(RedisPending::new(Box::pin(future)))
    }

    /// The lease of this store's claims, in seconds.
    #[getter]
    fn lease(&self) -> f64 {
        self.inner.lease().as_secs_f64()
    }

    /// How long completed results are kept, in seconds.
    #[getter]
    fn ttl(&self) -> f64 {
        self.inner.ttl().as_secs_f64()
    }

    /// The key prefix.
    #[getter]
    fn prefix(&self) -> String {
        self.inner.prefix().to_owned()
    }

    /// The Redis key holding `scoped`'s record: `{<prefix>:<scoped key>}`.
    fn record_key(&self, scoped: &Bound<'_, PyAny>) -> PyResult<String> {
        Ok(self.inner.record_key(&scoped_key(scoped)?.inner))
    }

    /// What this store instance has done: claims, leads, takeovers, replays,
    /// remote_waits, leases_lost.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.inner.counters();
        let d = PyDict::new(py);
        d.set_item("claims", c.claims)?;
        d.set_item("leads", c.leads)?;
        d.set_item("takeovers", c.takeovers)?;
        d.set_item("replays", c.replays)?;
        d.set_item("remote_waits", c.remote_waits)?;
        d.set_item("leases_lost", c.leases_lost)?;
        Ok(d)
    }
}

/// A step of the Redis store in flight: await it with `subscribe` (asyncio) or block
/// on it with `wait` (GIL released). Dropping it cancels the step.
#[pyclass(frozen, module = "oncely")]
pub struct RedisPending {
    future: Mutex<Option<NativeFuture>>,
    registration: Mutex<Option<u64>>,
}

impl RedisPending {
    fn new(future: NativeFuture) -> Self {
        RedisPending {
            future: Mutex::new(Some(future)),
            registration: Mutex::new(None),
        }
    }
    fn take(&self) -> PyResult<NativeFuture> {
        lock(&self.future)
            .take()
            .ok_or_else(|| PyRuntimeError::new_err("this pending step was already awaited"))
    }
}

#[pymethods]
impl RedisPending {
    /// Returns the outcome at once if it is ready; otherwise registers `fut` (a future
    /// of `loop`), which gets the outcome through `loop.call_soon_threadsafe`, and
    /// returns `fut` itself.
    fn subscribe(
        &self,
        py: Python<'_>,
        r#loop: Bound<'_, PyAny>,
        fut: Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let future = self.take()?;
        let keep = fut.clone().unbind();
        match register_native(py, future, r#loop, fut) {
            Ok(id) => {
                *lock(&self.registration) = Some(id);
                Ok(keep)
            }
            Err(out) => Ok(out),
        }
    }

    /// Stops waiting (the caller was cancelled): the step is dropped.
    fn cancel(&self, py: Python<'_>) {
        if let Some(id) = lock(&self.registration).take() {
            unregister(py, id);
        }
        let future = lock(&self.future).take();
        drop(future);
        bury(py);
    }

    /// Blocks this thread, with the GIL released, until the step is done.
    fn wait(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let future = self.take()?;
        let deliver = py.detach(move || block_on(future));
        let out = deliver(py);
        bury(py);
        Ok(out)
    }
}

/// The leader's claim on a key, in Redis and in this process: renewed until settled
/// with `complete` or `fail`; `abandon` (or garbage collection) releases it so that a
/// waiter takes over.
#[pyclass(frozen, module = "oncely")]
pub struct RedisLease {
    inner: Mutex<Option<CoreLease>>,
}

impl RedisLease {
    fn take(&self) -> PyResult<CoreLease> {
        lock(&self.inner)
            .take()
            .ok_or_else(|| PyRuntimeError::new_err("this lease is already settled"))
    }
}

#[pymethods]
impl RedisLease {
    /// Stores `data` (the encoded result) in Redis; the pending's outcome is the
    /// leader's `Executed` of `value`, or the store error (e.g. `LeaseLostError`).
    fn complete(&self, data: Vec<u8>, value: Bound<'_, PyAny>) -> PyResult<RedisPending> {
        let lease = self.take()?;
        let value = Held::new(value.unbind());
        let future = async move {
            let deliver: Deliver = match lease.complete(data).await {
                Ok(()) => Box::new(
                    move |py| match executed(py, value.bind(py).unbind(), "led") {
                        Ok(v) => v,
                        Err(e) => e.into_value(py).into_any(),
                    },
                ),
                Err(e) => error_value(e),
            };
            deliver
        };
        Ok(RedisPending::new(Box::pin(future)))
    }

    /// The action raised `exc`: releases the claim in Redis (nothing is stored), then
    /// wakes this process's waiters with `exc`. The pending's outcome is None.
    fn fail(&self, exc: Bound<'_, PyAny>) -> PyResult<RedisPending> {
        let lease = self.take()?;
        let tb = traceback_of(&exc);
        let failure = RedisFailure {
            exc: Held::new(exc.unbind()),
            tb: Held::new(tb.unbind()),
        };
        let future = async move {
            let shared = lease.fail(failure).await;
            drop(shared);
            let deliver: Deliver = Box::new(|py| py.None());
            deliver
        };
        Ok(RedisPending::new(Box::pin(future)))
    }

    /// Gives the claim up unsettled (the leader was cancelled): it is released in
    /// Redis in the background and a waiter takes over.
    fn abandon(&self, py: Python<'_>) {
        let lease = lock(&self.inner).take();
        drop(lease);
        bury(py);
    }

    /// True once renewal found the lease taken over (completing will fail).
    #[getter]
    fn lost(&self) -> bool {
        lock(&self.inner).as_ref().is_some_and(|l| l.is_lost())
    }

    /// The record's generation: 1 for the first claim, +1 for each takeover.
    #[getter]
    fn generation(&self) -> Option<u64> {
        lock(&self.inner).as_ref().map(|l| l.generation())
    }

    /// The Redis key of the record.
    #[getter]
    fn key(&self) -> Option<String> {
        lock(&self.inner)
            .as_ref()
            .map(|l| l.record_key().to_owned())
    }
}

/// Runs a future to completion on this thread, parking between polls.
fn block_on<F: Future>(fut: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    loop {
        if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}
