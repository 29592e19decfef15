//! The dedup store for Python: the core's `MemoryStore` holding Python objects, its
//! lease and join primitives, and the safe waking of asyncio waiters.
//!
//! # Waking asyncio waiters without deadlocks
//!
//! A waiter's `Join` is never handed to Python as a Rust future. `Join.subscribe`
//! polls it once, on the event-loop thread, with a waker that only pushes the
//! registration's id onto a pending list: it needs no GIL and takes no lock that a
//! GIL-holding thread could hold while waiting. The core calls that waker
//! from whichever thread settles the flight; nothing else happens there. The ids are
//! then processed, without the GIL and outside every lock but the registry's, by
//! whichever comes first: the thread that settled the flight, if it is a Python thread
//! (`Lease.complete`/`fail`/`abandon` deliver at once, after the settle, still
//! attached), or one pump thread (started on first use, restarted after `fork`) that
//! attaches to Python only after polling, once per batch. Outcomes reach each event
//! loop with one `call_soon_threadsafe` per loop and batch.
//!
//! Lock order: the registry lock and the store's lock are never held while waiting for
//! the GIL, and no Python code runs under them: a Python object whose last reference
//! a store drops under its lock (expiry, eviction) is moved to a graveyard and released
//! after the lock, when the thread is attached again.

use std::cell::Cell;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, LazyLock, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PyString, PyTuple};

use oncely::{Begin, CallFacts, Code, Error, ExecuteOptions, Joined, MemoryStore};

use crate::convert::{int_in, opt_seconds};
use crate::errors::{to_py_value, IntoPyResult};
use crate::keys::ScopedKey;
use crate::retry::{code_of, ManualClock};

// ---------------------------------------------------------------------------------------
// Python objects held by the core
// ---------------------------------------------------------------------------------------

/// A Python object held inside the core store. Dropping it never runs Python code on
/// the spot: the reference goes to the graveyard and is released by [`bury`].
pub struct Held(Option<Py<PyAny>>);

impl Held {
    pub(crate) fn new(obj: Py<PyAny>) -> Self {
        Held(Some(obj))
    }
    pub(crate) fn bind<'py>(&self, py: Python<'py>) -> Bound<'py, PyAny> {
        self.0
            .as_ref()
            .expect("a held object is only taken by drop")
            .bind(py)
            .clone()
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(obj) = self.0.take() {
            lock(&GRAVEYARD).push(obj);
            GRAVEYARD_FULL.store(true, Ordering::Release);
        }
    }
}

static GRAVEYARD: Mutex<Vec<Py<PyAny>>> = Mutex::new(Vec::new());
static GRAVEYARD_FULL: AtomicBool = AtomicBool::new(false);

/// Releases the references dropped by the store, while attached and holding no lock.
pub(crate) fn bury(_py: Python<'_>) {
    if GRAVEYARD_FULL.swap(false, Ordering::AcqRel) {
        let dead = std::mem::take(&mut *lock(&GRAVEYARD));
        drop(dead);
    }
}

/// Locks a mutex, going on after a panic elsewhere (no critical section leaves its state
/// half-done).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A stored result: the leader's object, shared by reference with every caller.
type Value = Arc<Held>;

/// A failed action: the user's exception (given unchanged to every waiter), its
/// traceback at the leader, and its code if the store caches permanent failures.
pub struct PyFailure {
    exc: Held,
    tb: Held,
    code: Option<Code>,
}

type Store = MemoryStore<Value, PyFailure>;
type CoreJoin = oncely::Join<Value, PyFailure>;
type CoreLease = oncely::Lease<Value, PyFailure>;
type Outcome = Joined<Value, PyFailure>;

// ---------------------------------------------------------------------------------------
// Python-facing types
// ---------------------------------------------------------------------------------------

/// A successful execute: the value and how this caller got it.
#[pyclass(frozen, module = "oncely")]
pub struct Executed {
    value: Py<PyAny>,
    source: &'static str,
}

#[pymethods]
impl Executed {
    /// The action's result (the leader's very object, for joiners and replays).
    #[getter]
    fn value(&self, py: Python<'_>) -> Py<PyAny> {
        self.value.clone_ref(py)
    }
    /// `"led"`, `"joined"` or `"replayed"`.
    #[getter]
    fn source<'py>(&self, py: Python<'py>) -> Bound<'py, PyString> {
        PyString::intern(py, self.source)
    }
    /// True when this caller did not run the action (joined or replayed): an HTTP
    /// server answers with `Idempotent-Replayed: true`.
    #[getter]
    fn replayed(&self) -> bool {
        self.source != "led"
    }
    /// `Executed[T]` at run time (a `types.GenericAlias`), as in the stubs.
    #[classmethod]
    fn __class_getitem__<'py>(
        cls: &Bound<'py, pyo3::types::PyType>,
        item: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = cls.py();
        py.import("types")?
            .getattr("GenericAlias")?
            .call1((cls, item))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "Executed(value={}, source={:?})",
            self.value.bind(py).repr()?,
            self.source
        ))
    }
}

pub(crate) fn executed(
    py: Python<'_>,
    value: Py<PyAny>,
    source: &'static str,
) -> PyResult<Py<PyAny>> {
    Ok(Py::new(py, Executed { value, source })?.into_any())
}

/// What a store has done since it was made.
#[pyclass(frozen, module = "oncely", get_all, eq)]
#[derive(Clone, PartialEq)]
pub struct Counters {
    leads: u64,
    joins: u64,
    replays: u64,
    conflicts: u64,
    expirations: u64,
    evictions: u64,
}

#[pymethods]
impl Counters {
    fn __repr__(&self) -> String {
        format!(
            "Counters(leads={}, joins={}, replays={}, conflicts={}, expirations={}, evictions={})",
            self.leads, self.joins, self.replays, self.conflicts, self.expirations, self.evictions
        )
    }
}

/// The waiter-side view of an outcome: an `Executed` (value), a `(exception,
/// traceback)` tuple (failure), or None (the leader went away: begin again).
fn outcome(py: Python<'_>, out: Outcome, source: &'static str) -> PyResult<Py<PyAny>> {
    match out {
        Joined::Value(v) => executed(py, v.bind(py).unbind(), source),
        Joined::Failed(f) => failure_tuple(py, &f),
        Joined::Panicked(m) => {
            let exc = to_py_value(py, Error::LeaderPanicked(m.to_string()));
            Ok(PyTuple::new(py, [exc, py.None()])?.into_any().unbind())
        }
        Joined::Abandoned => Ok(py.None()),
        Joined::Error(e) => {
            let exc = to_py_value(py, e);
            Ok(PyTuple::new(py, [exc, py.None()])?.into_any().unbind())
        }
    }
}

fn failure_tuple(py: Python<'_>, f: &PyFailure) -> PyResult<Py<PyAny>> {
    Ok(PyTuple::new(py, [f.exc.bind(py), f.tb.bind(py)])?
        .into_any()
        .unbind())
}

/// The native dedup store; `oncely.IdempotencyStore` adds `execute`/`execute_sync`.
#[pyclass(subclass, frozen, module = "oncely", name = "_Store")]
pub struct PyStore {
    inner: Store,
    caches_failures: bool,
}

#[pymethods]
impl PyStore {
    #[new]
    #[pyo3(
        signature = (ttl=None, max_entries=None, *, in_progress_retry_after=None, cache_permanent_failures=None, _clock=None),
        text_signature = "(ttl=None, max_entries=None, *, in_progress_retry_after=None, cache_permanent_failures=False, _clock=None)"
    )]
    fn new(
        py: Python<'_>,
        ttl: Option<&Bound<'_, PyAny>>,
        max_entries: Option<&Bound<'_, PyAny>>,
        in_progress_retry_after: Option<&Bound<'_, PyAny>>,
        cache_permanent_failures: Option<&Bound<'_, PyAny>>,
        _clock: Option<&Bound<'_, ManualClock>>,
    ) -> PyResult<Self> {
        let cache_permanent_failures =
            crate::errors::flag(cache_permanent_failures, "cache_permanent_failures", false)?;
        let mut b = Store::builder().naming(oncely::Naming::SECONDS);
        if let Some(ttl) = opt_seconds(py, "ttl", ttl)? {
            b = b.ttl(ttl);
        }
        if let Some(n) = max_entries.filter(|n| !n.is_none()) {
            b = b.max_entries(int_in(py, "max_entries", n, 0, isize::MAX as i128)? as usize);
        }
        if let Some(d) = opt_seconds(py, "in_progress_retry_after", in_progress_retry_after)? {
            b = b.in_progress_retry_after(d);
        }
        if cache_permanent_failures {
            b = b.cache_failures_when(|f: &PyFailure| {
                f.code
                    .is_some_and(|c| !oncely::classify(c, CallFacts::SAFE).retryable)
            });
        }
        if let Some(c) = _clock {
            b = b.clock(c.get().inner.clone());
        }
        Ok(PyStore {
            inner: b.build().py(py)?,
            caches_failures: cache_permanent_failures,
        })
    }

    /// In a child after `fork()`: forgets the running entries, whose actions stayed
    /// with the parent's threads (see `MemoryStore::forget_running`). Called by the
    /// package's `os.register_at_fork` hook; returns how many were forgotten.
    fn _forget_running(&self) -> usize {
        self.inner.forget_running()
    }

    /// Looks the key up: an `Executed` (replay), a `(exception, traceback)` tuple (a
    /// cached failure), a `Lease` (run the action, then settle it) or a `Join` (wait).
    #[pyo3(
        signature = (scoped, fingerprint, wait=None),
        text_signature = "($self, scoped, fingerprint, wait=True)"
    )]
    fn begin(
        &self,
        py: Python<'_>,
        scoped: &Bound<'_, PyAny>,
        fingerprint: &Bound<'_, PyAny>,
        wait: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let wait = crate::errors::flag(wait, "wait", true)?;
        let key = scoped_key(scoped)?;
        let fingerprint = crate::errors::text(fingerprint, "fingerprint")?;
        let options = if wait {
            ExecuteOptions::default()
        } else {
            ExecuteOptions::NO_WAIT
        };
        let begun = self.inner.begin(&key.inner, &fingerprint, options);
        let out = match begun.py(py)? {
            Begin::Replay(Ok(v)) => executed(py, v.bind(py).unbind(), "replayed"),
            Begin::Replay(Err(f)) => failure_tuple(py, &f),
            Begin::Lead(lease) => Ok(Py::new(
                py,
                Lease {
                    inner: Mutex::new(Some(lease)),
                },
            )?
            .into_any()),
            Begin::Join(join) => Ok(Py::new(
                py,
                Join {
                    step: Step::new(Waited::Memory(join)),
                },
            )?
            .into_any()),
        };
        bury(py);
        out
    }

    /// Whether failures classified permanent are cached (they then need a code).
    #[getter]
    fn caches_failures(&self) -> bool {
        self.caches_failures
    }

    /// The TTL of completed entries, in seconds.
    #[getter]
    fn ttl(&self) -> f64 {
        self.inner.ttl().as_secs_f64()
    }

    /// Counts of leads, joins, replays, conflicts, expirations, evictions.
    fn counters(&self) -> Counters {
        let c = self.inner.counters();
        Counters {
            leads: c.leads,
            joins: c.joins,
            replays: c.replays,
            conflicts: c.conflicts,
            expirations: c.expirations,
            evictions: c.evictions,
        }
    }

    /// Removes a completed entry (e.g. a cached failure) so the next call runs again.
    fn remove(&self, py: Python<'_>, scoped: &Bound<'_, PyAny>) -> PyResult<bool> {
        let key = scoped_key(scoped)?;
        let removed = self.inner.remove(&key.inner);
        bury(py);
        Ok(removed)
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }
}

pub(crate) fn scoped_key<'a, 'py>(obj: &'a Bound<'py, PyAny>) -> PyResult<PyRef<'py, ScopedKey>> {
    obj.extract::<PyRef<'py, ScopedKey>>().map_err(|_| {
        crate::errors::wrong_type(
            "scoped",
            "an oncely.ScopedKey made by oncely.scope(tenant, method, key)",
            obj,
        )
    })
}

/// The leader's claim on a key: settle it with `complete`, `fail` or `panicked`;
/// `abandon` (or garbage collection) lets a waiter take over.
#[pyclass(frozen, module = "oncely")]
pub struct Lease {
    inner: Mutex<Option<CoreLease>>,
}

impl Lease {
    fn take(&self) -> PyResult<CoreLease> {
        lock(&self.inner)
            .take()
            .ok_or_else(|| PyRuntimeError::new_err("this lease is already settled"))
    }
}

#[pymethods]
impl Lease {
    /// Stores `value` and wakes the waiters with it; returns the leader's `Executed`.
    fn complete(&self, py: Python<'_>, value: Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let lease = self.take()?;
        let stored = Arc::new(Held::new(value.clone().unbind()));
        settling(py, || lease.complete_now(stored));
        bury(py);
        executed(py, value.unbind(), "led")
    }

    /// The action raised `exc`: wakes the waiters with it (and removes the entry, or
    /// caches it when the store caches permanent failures and `code` is one).
    #[pyo3(signature = (exc, code=None))]
    fn fail(
        &self,
        py: Python<'_>,
        exc: Bound<'_, PyAny>,
        code: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let lease = self.take()?;
        // The lease is settled whatever the exception holds: an unreadable code is not
        // cached, an unreadable traceback is None.
        let code = code
            .filter(|c| !c.is_none())
            .and_then(|c| code_of(py, c).ok());
        let tb = traceback_of(&exc);
        let failure = PyFailure {
            exc: Held::new(exc.unbind()),
            tb: Held::new(tb.unbind()),
            code,
        };
        settling(py, || drop(lease.fail_now(failure)));
        bury(py);
        Ok(())
    }

    /// The action failed without an error value: waiters get `LeaderPanickedError`.
    fn panicked(&self, py: Python<'_>, message: &str) -> PyResult<()> {
        let lease = self.take()?;
        settling(py, || lease.panicked_now(message));
        bury(py);
        Ok(())
    }

    /// Gives the claim up unsettled (the leader was cancelled): one waiter takes over.
    fn abandon(&self, py: Python<'_>) {
        let lease = lock(&self.inner).take();
        settling(py, || drop(lease));
        bury(py);
    }

    /// The scoped key this lease is for.
    #[getter]
    fn key(&self) -> Option<String> {
        lock(&self.inner).as_ref().map(|l| l.key().to_owned())
    }
}

/// `exc.__traceback__`, or None when reading it fails (a foreign exception type may
/// override it): settling a failed action never depends on it.
pub(crate) fn traceback_of<'py>(exc: &Bound<'py, PyAny>) -> Bound<'py, PyAny> {
    let py = exc.py();
    exc.getattr(pyo3::intern!(py, "__traceback__"))
        .unwrap_or_else(|_| py.None().into_bound(py))
}

/// The error of an action that calls `execute` on the key it is leading, raised by the
/// Python layer before the inner call reaches the store (it would wait for itself).
#[pyfunction]
pub fn reentrant_error(py: Python<'_>, scoped: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
    let key = scoped_key(scoped)?.inner.to_string();
    Ok(to_py_value(py, Error::Reentrant { key }))
}

/// A wait on a running call with the same key.
#[pyclass(frozen, module = "oncely")]
pub struct Join {
    step: Step,
}

#[pymethods]
impl Join {
    /// Waits from asyncio: returns the outcome at once if the leader has settled;
    /// otherwise registers `fut` (a future of `loop`), which gets the outcome through
    /// `loop.call_soon_threadsafe`, and returns `fut` itself.
    fn subscribe(
        &self,
        py: Python<'_>,
        r#loop: Bound<'_, PyAny>,
        fut: Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        self.step.subscribe(py, r#loop, fut)
    }

    /// Stops waiting (the waiter was cancelled); the leader and other waiters go on.
    fn cancel(&self, py: Python<'_>) {
        self.step.cancel(py)
    }

    /// Blocks this thread, with the GIL released, until the leader settles.
    fn wait(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.step.wait(py)
    }
}

/// A wait handed to Python, shared by the memory store's `Join` and the Redis store's
/// `RedisPending`: awaited from asyncio (`subscribe`, `cancel`) or blocked on (`wait`,
/// GIL released). Dropping it drops what it waits for.
pub(crate) struct Step {
    waited: Mutex<Option<Waited>>,
    registration: Mutex<Option<u64>>,
}

impl Step {
    pub(crate) fn new(waited: Waited) -> Self {
        Step {
            waited: Mutex::new(Some(waited)),
            registration: Mutex::new(None),
        }
    }

    fn take(&self) -> PyResult<Waited> {
        lock(&self.waited)
            .take()
            .ok_or_else(|| PyRuntimeError::new_err("this step was already waited on"))
    }

    /// Returns the outcome at once if it is ready; otherwise registers `fut` (a future
    /// of `loop`), which gets the outcome through `loop.call_soon_threadsafe` from the
    /// pump, and returns `fut` itself.
    pub(crate) fn subscribe(
        &self,
        py: Python<'_>,
        event_loop: Bound<'_, PyAny>,
        fut: Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let mut waited = self.take()?;
        if let Waited::Memory(join) = &mut waited {
            if let Some(out) = join.try_get() {
                return outcome(py, out, "joined");
            }
        }
        let id = REGISTRY.next.fetch_add(1, Ordering::Relaxed);
        let waker = Waker::from(Arc::new(IdWaker(id)));
        let ready = {
            let mut map = lock(&REGISTRY.map);
            // Polled under the registry lock: a wake that comes before the entry is
            // in the map waits for the lock in the pump, so it is never lost.
            match waited.poll(&mut Context::from_waker(&waker)) {
                Poll::Ready(out) => Some(out),
                Poll::Pending => {
                    map.insert(
                        id,
                        Entry {
                            waited,
                            waker,
                            event_loop: event_loop.unbind(),
                            fut: fut.clone().unbind(),
                        },
                    );
                    None
                }
            }
        };
        match ready {
            Some(out) => {
                let v = ready_value(py, out);
                bury(py);
                Ok(v)
            }
            None => {
                *lock(&self.registration) = Some(id);
                Ok(fut.unbind())
            }
        }
    }

    /// Stops waiting (the waiter was cancelled): what it waited for is dropped.
    pub(crate) fn cancel(&self, py: Python<'_>) {
        let id = lock(&self.registration).take();
        if let Some(id) = id {
            let entry = lock(&REGISTRY.map).remove(&id);
            drop(entry);
        }
        let waited = lock(&self.waited).take();
        drop(waited);
        bury(py);
    }

    /// Blocks this thread, with the GIL released, until the outcome is ready. A signal
    /// (Ctrl-C: `KeyboardInterrupt`) stops the wait, as a cancellation stops an asyncio
    /// waiter: what it waited for is dropped.
    pub(crate) fn wait(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let waited = self.take()?;
        let ready = wait_interruptibly(py, waited);
        let out = ready.map(|ready| ready_value(py, ready));
        bury(py);
        out
    }
}

/// How often a blocked `wait` lets Python run its signal handlers.
const SIGNAL_CHECK: Duration = Duration::from_millis(50);

/// Wakes a thread parked in [`wait_interruptibly`].
struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Polls `waited` on this thread, parked with the GIL released between polls, and runs
/// Python's signal handlers every [`SIGNAL_CHECK`]. Hand-written rather than
/// `pollster::block_on`, which cannot be woken to look at signals: a waiter blocked on a
/// long-running leader would ignore Ctrl-C until that leader ended.
fn wait_interruptibly(py: Python<'_>, mut waited: Waited) -> PyResult<Ready> {
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    loop {
        let waker = waker.clone();
        let (back, ready) = py.detach(move || {
            let mut cx = Context::from_waker(&waker);
            let until = Instant::now() + SIGNAL_CHECK;
            loop {
                if let Poll::Ready(out) = waited.poll(&mut cx) {
                    return (None, Some(out));
                }
                let now = Instant::now();
                if now >= until {
                    return (Some(waited), None);
                }
                std::thread::park_timeout(until - now);
            }
        });
        if let Some(out) = ready {
            return Ok(out);
        }
        waited = back.expect("a pending wait is handed back");
        // An exception from a signal handler ends the wait; `waited` is dropped here.
        py.check_signals()?;
    }
}

// ---------------------------------------------------------------------------------------
// The pump: wakes of asyncio waiters, forwarded to their event loops
// ---------------------------------------------------------------------------------------

/// What a registration waits for: a memory-store join, or any native future whose
/// output is turned into a Python object once the GIL is held (the Redis store).
pub(crate) enum Waited {
    Memory(CoreJoin),
    Native(NativeFuture),
}

/// A Rust future handed to asyncio through the pump (see [`register_native`]).
pub(crate) type NativeFuture = Pin<Box<dyn Future<Output = Deliver> + Send>>;
/// Turns a native future's output into the Python object its waiter gets.
pub(crate) type Deliver = Box<dyn FnOnce(Python<'_>) -> Py<PyAny> + Send>;

enum Ready {
    Memory(Outcome),
    Native(Deliver),
}

impl Waited {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Ready> {
        match self {
            Waited::Memory(j) => Pin::new(j).poll(cx).map(Ready::Memory),
            Waited::Native(f) => f.as_mut().poll(cx).map(Ready::Native),
        }
    }
}

fn ready_value(py: Python<'_>, ready: Ready) -> Py<PyAny> {
    match ready {
        Ready::Memory(out) => match outcome(py, out, "joined") {
            Ok(v) => v,
            Err(e) => e.into_value(py).into_any(),
        },
        Ready::Native(deliver) => deliver(py),
    }
}

struct Entry {
    waited: Waited,
    waker: Waker,
    event_loop: Py<PyAny>,
    fut: Py<PyAny>,
}

struct Registry {
    map: Mutex<HashMap<u64, Entry>>,
    next: AtomicU64,
}

static REGISTRY: LazyLock<Registry> = LazyLock::new(|| Registry {
    map: Mutex::new(HashMap::new()),
    next: AtomicU64::new(1),
});

/// The waker of one registration: it only sends the id to the pump.
struct IdWaker(u64);

impl Wake for IdWaker {
    fn wake(self: Arc<Self>) {
        send(self.0);
    }
    fn wake_by_ref(self: &Arc<Self>) {
        send(self.0);
    }
}

/// Wake ids not yet processed, and the process that runs the pump thread.
struct Pending {
    ids: Vec<u64>,
    pump_pid: Option<u32>,
}

static PENDING: Mutex<Pending> = Mutex::new(Pending {
    ids: Vec::new(),
    pump_pid: None,
});
static PENDING_CV: Condvar = Condvar::new();

fn send(id: u64) {
    let mut p = lock(&PENDING);
    let pid = std::process::id();
    if p.pump_pid != Some(pid) {
        // First use, or a child after fork (threads do not survive fork).
        let spawned = std::thread::Builder::new()
            .name("oncely-waker".into())
            .spawn(run_pump);
        if spawned.is_ok() {
            p.pump_pid = Some(pid);
        }
    }
    p.ids.push(id);
    // A Python thread that is settling a flight delivers the wakes itself right after
    // (`deliver_now`): the pump thread is woken only for settles from elsewhere.
    if p.ids.len() == 1 && !SETTLING.with(Cell::get) {
        PENDING_CV.notify_one();
    }
}

thread_local! {
    static SETTLING: Cell<bool> = const { Cell::new(false) };
}

/// Runs a settle of a lease on this (attached) thread, then delivers its wakes.
fn settling<R>(py: Python<'_>, f: impl FnOnce() -> R) -> R {
    SETTLING.with(|s| s.set(true));
    let r = f();
    SETTLING.with(|s| s.set(false));
    deliver_now(py);
    r
}

/// Polls the joins of `ids` (holding the registry lock, never the GIL) and returns
/// those that are ready with their outcomes.
fn poll_ready(ids: Vec<u64>) -> Vec<(Entry, Ready)> {
    let mut ready = Vec::new();
    let mut map = lock(&REGISTRY.map);
    for id in ids {
        let Some(entry) = map.get_mut(&id) else {
            continue; // cancelled, or already resolved by an earlier wake
        };
        let waker = entry.waker.clone();
        if let Poll::Ready(out) = entry.waited.poll(&mut Context::from_waker(&waker)) {
            let entry = map.remove(&id).expect("entry present");
            ready.push((entry, out));
        }
    }
    ready
}

fn run_pump() {
    loop {
        let ids = {
            let mut p = lock(&PENDING);
            while p.ids.is_empty() {
                p = PENDING_CV.wait(p).unwrap_or_else(|e| e.into_inner());
            }
            std::mem::take(&mut p.ids)
        };
        let ready = poll_ready(ids);
        if ready.is_empty() {
            continue;
        }
        // Attach only now, holding no lock. During interpreter shutdown there is no
        // loop left to wake: the references are left to PyO3's release pool.
        let _ = Python::try_attach(move |py| deliver(py, ready));
    }
}

/// Delivers the wakes that a settle on this (attached) thread just caused, without
/// waiting for the pump thread: the common case of a leader and its waiters in one
/// process costs no thread hop. Holds no lock while calling Python.
fn deliver_now(py: Python<'_>) {
    let ids = std::mem::take(&mut lock(&PENDING).ids);
    if ids.is_empty() {
        return;
    }
    let ready = poll_ready(ids);
    if !ready.is_empty() {
        deliver(py, ready);
    }
}

fn deliver(py: Python<'_>, batch: Vec<(Entry, Ready)>) {
    static SETTLE: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let Ok(settle) = SETTLE.import(py, "oncely.store", "_settle_batch") else {
        return;
    };
    let mut groups: Vec<(Py<PyAny>, Bound<'_, PyList>)> = Vec::new();
    for (entry, out) in batch {
        let value = ready_value(py, out);
        let Ok(item) = PyTuple::new(py, [entry.fut.clone_ref(py), value]) else {
            continue;
        };
        let group = match groups
            .iter()
            .position(|(l, _)| l.bind(py).is(entry.event_loop.bind(py)))
        {
            Some(i) => &groups[i].1,
            None => {
                groups.push((entry.event_loop.clone_ref(py), PyList::empty(py)));
                &groups[groups.len() - 1].1
            }
        };
        let _ = group.append(item);
    }
    for (event_loop, items) in groups {
        // A closed loop refuses the call; its waiters are gone with it.
        let _ = event_loop.call_method1(py, "call_soon_threadsafe", (settle, items));
    }
    bury(py);
}
