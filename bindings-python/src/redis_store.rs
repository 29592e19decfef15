//! The shared dedup store on Redis for Python: `oncely_redis::RedisStore` driven from
//! Python, so the action (a coroutine or a function) runs in the caller's event loop
//! or thread.
//!
//! Every step that talks to Redis (`begin`, including the wait for a leader,
//! `complete`, `fail`) is a [`RedisPending`]: a Rust future that Python either awaits
//! through the same pump as the memory store's joins (`subscribe`: the future is
//! polled without the GIL; its waker only queues an id; the outcome reaches the event
//! loop with `call_soon_threadsafe`) or blocks on with the GIL released (`wait`).
//! Results cross as bytes in the one result encoding of `oncely_redis::codec`
//! (`redis/README.md`, "Result encoding"): `oncely.redis_store` picks the kind of
//! record (JSON text, bytes, no value, not storable, the user codec's output) and this
//! module lays it out and reads it back; only JSON text and bytes become Python values
//! here (`json.loads`, or the store's `loads`).
//!
//! A result that could not be stored is still handed to this process's joiners of its
//! leader: the leader parks its value by key (`Parked`) until they have taken it; every
//! later caller reads the "not storable" record and gets `ResultNotStoredError`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyString, PyTuple};

use oncely::{Begin, Error, ExecuteOptions, Joined, LeaderLease, ScopedKey};
use oncely_redis::codec::{self, StoredResult};
use oncely_redis::{RecordState, RedisJoin, RedisStore};

use crate::convert::{int_in, opt_seconds};
use crate::errors::{to_py, to_py_value, IntoPyResult};
use crate::store::{
    bury, executed, lock, scoped_key, traceback_of, Deliver, Held, NativeFuture, Step, Waited,
};

/// A failed Python action, shared with this process's joiners (never stored in Redis).
pub struct RedisFailure {
    exc: Held,
    tb: Held,
}

type Store = RedisStore<RedisFailure>;
type CoreLease = oncely_redis::RedisLease<RedisFailure>;

/// `Executed(decode(data), source)`, or the decoding error as an exception object.
fn decoded(
    py: Python<'_>,
    data: &[u8],
    source: &'static str,
    key: &ScopedKey,
    loads: Option<&Py<PyAny>>,
    joined: Option<&JoinGuard>,
) -> Py<PyAny> {
    match value_of(py, data, Some(key), loads, joined).and_then(|v| executed(py, v, source)) {
        Ok(v) => v,
        Err(e) => e.into_value(py).into_any(),
    }
}

/// The Python value of a stored result. `joined`: this caller joined a leader of this
/// process, whose value is parked if it could not be stored.
fn value_of(
    py: Python<'_>,
    data: &[u8],
    key: Option<&ScopedKey>,
    loads: Option<&Py<PyAny>>,
    joined: Option<&JoinGuard>,
) -> PyResult<Py<PyAny>> {
    static JSON_LOADS: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    Ok(match codec::decode(data).py(py)? {
        StoredResult::Json(text) => JSON_LOADS
            .import(py, "json", "loads")?
            .call1((text,))?
            .unbind(),
        StoredResult::Bytes(b) => PyBytes::new(py, b).into_any().unbind(),
        StoredResult::NoValue => py.None(),
        r @ StoredResult::NotStorable { type_name } => match joined.and_then(|g| g.value(py)) {
            Some(v) => v,
            None => {
                let e = match key {
                    Some(key) => r.not_stored(key).expect("not storable"),
                    None => Error::ResultNotStored {
                        key: String::new(),
                        type_name: type_name.to_owned(),
                    },
                };
                return Err(to_py(py, e));
            }
        },
        StoredResult::UserBytes(b) => user_loads(py, key, loads, PyBytes::new(py, b).into_any())?,
        StoredResult::UserText(t) => user_loads(py, key, loads, PyString::new(py, t).into_any())?,
    })
}

/// Reads a user codec's record with the store's `loads`. Without one, or when it
/// raises, the call fails (UNAVAILABLE, with `loads`'s exception as the cause): the
/// record stays, and the action is not run again.
fn user_loads(
    py: Python<'_>,
    key: Option<&ScopedKey>,
    loads: Option<&Py<PyAny>>,
    body: Bound<'_, PyAny>,
) -> PyResult<Py<PyAny>> {
    let key = key.map_or_else(|| "this record".to_owned(), |k| k.to_string());
    let Some(loads) = loads else {
        return Err(to_py(
            py,
            Error::Unavailable(format!(
                "the stored result of {key} was written by a user codec (dumps=); give this \
                 store the matching loads= to read it"
            )),
        ));
    };
    loads.call1(py, (body,)).map_err(|cause| {
        let e = to_py(
            py,
            Error::Unavailable(format!(
                "loads= could not decode the stored result of {key} ({cause}); the action is \
                 not run again"
            )),
        );
        e.set_cause(py, Some(cause));
        e
    })
}

/// The record bytes for `kind` (`"json"`, `"bytes"`, `"no_value"`, `"not_storable"`,
/// `"user_bytes"`, `"user_text"`) and its payload (text, bytes, a type name, or None).
#[pyfunction]
#[pyo3(signature = (kind, payload=None))]
pub fn _encode_record<'py>(
    py: Python<'py>,
    kind: &str,
    payload: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let text = || -> PyResult<String> {
        payload
            .ok_or_else(|| pyo3::exceptions::PyTypeError::new_err(format!("{kind} needs a str")))?
            .extract::<String>()
    };
    let bytes = || -> PyResult<&[u8]> {
        let b = payload
            .and_then(|p| p.cast::<PyBytes>().ok())
            .ok_or_else(|| pyo3::exceptions::PyTypeError::new_err(format!("{kind} needs bytes")))?;
        Ok(b.as_bytes())
    };
    let record = match kind {
        "json" => StoredResult::Json(&text()?).encode(),
        "bytes" => StoredResult::Bytes(bytes()?).encode(),
        "no_value" => StoredResult::NoValue.encode(),
        "not_storable" => StoredResult::NotStorable {
            type_name: &text()?,
        }
        .encode(),
        "user_bytes" => StoredResult::UserBytes(bytes()?).encode(),
        "user_text" => StoredResult::UserText(&text()?).encode(),
        other => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "unknown record kind {other:?}"
            )))
        }
    };
    Ok(PyBytes::new(py, &record))
}

/// Reads record bytes back: the value (JSON parsed, bytes as `bytes`, no value as
/// None, a user codec's record through `loads`); a "not storable" record raises
/// `ResultNotStoredError` naming `key`; an unreadable one `StoreUnavailableError`.
#[pyfunction]
#[pyo3(signature = (data, loads=None, key=None))]
pub fn _decode_record(
    py: Python<'_>,
    data: &[u8],
    loads: Option<Py<PyAny>>,
    key: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    let key = key.map(scoped_key).transpose()?;
    value_of(
        py,
        data,
        key.as_ref().map(|k| &k.inner),
        loads.as_ref(),
        None,
    )
}

/// The values of this process's leaders whose results could not be stored, by scoped
/// key, kept while the leader completes and until its local joiners have taken them.
#[derive(Default)]
struct Slot {
    joiners: usize,
    leader: bool,
    value: Option<Held>,
}

type Parked = Arc<Mutex<HashMap<String, Slot>>>;

/// A caller joined to a leader of this process, counted in its key's slot.
struct JoinGuard {
    parked: Parked,
    key: String,
}

impl JoinGuard {
    fn new(parked: &Parked, key: &ScopedKey) -> Self {
        let key = key.as_str().to_owned();
        lock(parked).entry(key.clone()).or_default().joiners += 1;
        JoinGuard {
            parked: parked.clone(),
            key,
        }
    }
    fn value(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        let parked = lock(&self.parked);
        let held = parked.get(&self.key)?.value.as_ref()?;
        Some(held.bind(py).unbind())
    }
}

impl Drop for JoinGuard {
    fn drop(&mut self) {
        let mut parked = lock(&self.parked);
        if let Some(slot) = parked.get_mut(&self.key) {
            slot.joiners -= 1;
            if slot.joiners == 0 && !slot.leader {
                parked.remove(&self.key);
            }
        }
    }
}

/// A leader's parked value, from before its completion is sent until it is done
/// (or dropped); then it stays only while joiners are counted.
struct LeaderPark {
    parked: Parked,
    key: String,
}

impl LeaderPark {
    fn new(parked: &Parked, key: &str, value: Held) -> Self {
        let mut map = lock(parked);
        let slot = map.entry(key.to_owned()).or_default();
        slot.leader = true;
        slot.value = Some(value);
        LeaderPark {
            parked: parked.clone(),
            key: key.to_owned(),
        }
    }
}

impl Drop for LeaderPark {
    fn drop(&mut self) {
        let mut parked = lock(&self.parked);
        if let Some(slot) = parked.get_mut(&self.key) {
            slot.leader = false;
            if slot.joiners == 0 {
                parked.remove(&self.key);
            }
        }
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
    dumps: Option<Py<PyAny>>,
    loads: Option<Arc<Py<PyAny>>>,
    parked: Parked,
}

#[pymethods]
impl PyRedisStore {
    #[new]
    #[pyo3(
        signature = (url, lease=None, ttl=None, *, prefix=None, connect_timeout=None, io_timeout=None, workers=None, in_progress_retry_after=None, dumps=None, loads=None, cluster=None, sentinel=None, min_replicas=None, min_replicas_timeout=None, connect=None, max_result_bytes=None),
        text_signature = "(url, lease=None, ttl=None, *, prefix=None, connect_timeout=None, io_timeout=None, workers=None, in_progress_retry_after=None, dumps=None, loads=None, cluster=False, sentinel=None, min_replicas=None, min_replicas_timeout=None, connect=False, max_result_bytes=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        url: &Bound<'_, PyAny>,
        lease: Option<&Bound<'_, PyAny>>,
        ttl: Option<&Bound<'_, PyAny>>,
        prefix: Option<&Bound<'_, PyAny>>,
        connect_timeout: Option<&Bound<'_, PyAny>>,
        io_timeout: Option<&Bound<'_, PyAny>>,
        workers: Option<&Bound<'_, PyAny>>,
        in_progress_retry_after: Option<&Bound<'_, PyAny>>,
        dumps: Option<Bound<'_, PyAny>>,
        loads: Option<Bound<'_, PyAny>>,
        cluster: Option<&Bound<'_, PyAny>>,
        sentinel: Option<&Bound<'_, PyAny>>,
        min_replicas: Option<&Bound<'_, PyAny>>,
        min_replicas_timeout: Option<&Bound<'_, PyAny>>,
        connect: Option<&Bound<'_, PyAny>>,
        max_result_bytes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let callable = |field: &'static str, f: Option<Bound<'_, PyAny>>| -> PyResult<_> {
            match f.filter(|f| !f.is_none()) {
                Some(f) if f.is_callable() => Ok(Some(f.unbind())),
                Some(f) => Err(crate::errors::wrong_type(field, "a callable", &f)),
                None => Ok(None),
            }
        };
        let dumps = callable("dumps", dumps)?;
        let loads = callable("loads", loads)?;
        if dumps.is_some() != loads.is_some() {
            return Err(crate::errors::invalid(
                py,
                if dumps.is_some() { "loads" } else { "dumps" },
                "dumps and loads go together: give both or neither",
            ));
        }
        // One URL, or several (a Cluster's seeds, or Sentinels): the first is the URL.
        let urls: Vec<String> = match url.extract::<String>() {
            Ok(u) => vec![u],
            Err(_) => match url.extract::<Vec<String>>() {
                Ok(us) if !us.is_empty() => us,
                _ => {
                    return Err(crate::errors::wrong_type(
                        "url",
                        "a str or a non-empty list of str",
                        url,
                    ))
                }
            },
        };
        let mut b = Store::builder(urls[0].clone())
            .seeds(urls[1..].to_vec())
            .naming(oncely::Naming::SECONDS)
            .cluster(crate::errors::flag(cluster, "cluster", false)?);
        if let Some(master) = sentinel.filter(|s| !s.is_none()) {
            b = b.sentinel(crate::errors::text(master, "sentinel")?);
        }
        if let Some(n) = min_replicas.filter(|n| !n.is_none()) {
            b = b.min_replicas(int_in(py, "min_replicas", n, 0, 1024)? as usize);
        }
        if let Some(d) = opt_seconds(py, "min_replicas_timeout", min_replicas_timeout)? {
            b = b.min_replicas_timeout(d);
        }
        if let Some(d) = opt_seconds(py, "lease", lease)? {
            b = b.lease(d);
        }
        if let Some(d) = opt_seconds(py, "ttl", ttl)? {
            b = b.ttl(d);
        }
        if let Some(p) = prefix.filter(|p| !p.is_none()) {
            b = b.prefix(crate::errors::text(p, "prefix")?);
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
        if let Some(n) = max_result_bytes.filter(|n| !n.is_none()) {
            let most = oncely_redis::MAX_RESULT_BYTES_LIMIT as i128;
            b = b.max_result_bytes(int_in(py, "max_result_bytes", n, 1, most)? as usize);
        }
        let b = b.connect_now(crate::errors::flag(connect, "connect", false)?);
        // Connecting (connect=True) waits up to the connect and I/O timeouts.
        let built = py.detach(move || b.build());
        Ok(PyRedisStore {
            inner: built.py(py)?,
            dumps,
            loads: loads.map(Arc::new),
            parked: Parked::default(),
        })
    }

    /// Looks the key up (in this process, then in Redis) and waits for a running call
    /// if there is one: a pending whose outcome is an `Executed` (replayed or joined,
    /// decoded), a `RedisLease` (run the action, then settle it), None (the leader
    /// went away: begin again), a `(exception, traceback)` tuple (a leader in this
    /// process failed) or an exception object (store error).
    #[pyo3(
        signature = (scoped, fingerprint, wait=None),
        text_signature = "($self, scoped, fingerprint, wait=True)"
    )]
    fn begin(
        &self,
        scoped: &Bound<'_, PyAny>,
        fingerprint: &Bound<'_, PyAny>,
        wait: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<RedisPending> {
        let wait = crate::errors::flag(wait, "wait", true)?;
        let key = scoped_key(scoped)?.inner.clone();
        let fingerprint = crate::errors::text(fingerprint, "fingerprint")?;
        let options = if wait {
            ExecuteOptions::default()
        } else {
            ExecuteOptions::NO_WAIT
        };
        let store = self.inner.clone();
        let (loads, parked) = (self.loads.clone(), self.parked.clone());
        let future = async move {
            let deliver: Deliver = match store.begin(&key, &fingerprint, options).await {
                Err(e) => error_value(e),
                Ok(Begin::Replay(Ok(data))) => {
                    Box::new(move |py| decoded(py, &data, "replayed", &key, loads.as_deref(), None))
                }
                Ok(Begin::Replay(Err(f))) => Box::new(move |py| failure_tuple(py, &f)),
                Ok(Begin::Lead(lease)) => Box::new(move |py| {
                    match Py::new(
                        py,
                        RedisLease {
                            inner: Mutex::new(Some(lease)),
                            parked,
                            key: key.as_str().to_owned(),
                        },
                    ) {
                        Ok(l) => l.into_any(),
                        Err(e) => e.into_value(py).into_any(),
                    }
                }),
                Ok(Begin::Join(join)) => {
                    let local =
                        matches!(join, RedisJoin::Local(_)).then(|| JoinGuard::new(&parked, &key));
                    match join.await {
                        Joined::Value(data) => Box::new(move |py| {
                            decoded(py, &data, "joined", &key, loads.as_deref(), local.as_ref())
                        }),
                        Joined::Failed(f) => Box::new(move |py| failure_tuple(py, &f)),
                        Joined::Panicked(m) => error_value(Error::LeaderPanicked(m.to_string())),
                        Joined::Abandoned => Box::new(|py| py.None()),
                        Joined::Error(e) => error_value(e),
                    }
                }
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

    /// The user codec's encoder (`dumps=`), or None for the built-in JSON / bytes one.
    #[getter]
    fn dumps(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.dumps.as_ref().map(|f| f.clone_ref(py))
    }

    /// The user codec's decoder (`loads=`), or None.
    #[getter]
    fn loads(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.loads.as_ref().map(|f| f.clone_ref(py))
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

    /// In a child after `fork()`: ends the calls the parent had in flight (called by the
    /// package's `os.register_at_fork` hook; see `RedisStore::after_fork`).
    fn _after_fork(&self) {
        self.inner.after_fork();
    }

    /// The largest result stored, in bytes (its encoded form); a larger one is
    /// recorded as not storable.
    #[getter]
    fn max_result_bytes(&self) -> usize {
        self.inner.max_result_bytes()
    }

    /// The Redis key holding `scoped`'s record: `{<prefix>:<scoped key>}`.
    fn record_key(&self, scoped: &Bound<'_, PyAny>) -> PyResult<String> {
        Ok(self.inner.record_key(&scoped_key(scoped)?.inner))
    }

    /// What this store instance has done: claims, leads, takeovers, replays,
    /// remote_waits, leases_lost, abandoned, claims_unreplicated,
    /// completions_unreplicated, unavailable.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.inner.counters();
        let d = PyDict::new(py);
        d.set_item("claims", c.claims)?;
        d.set_item("leads", c.leads)?;
        d.set_item("takeovers", c.takeovers)?;
        d.set_item("replays", c.replays)?;
        d.set_item("remote_waits", c.remote_waits)?;
        d.set_item("leases_lost", c.leases_lost)?;
        d.set_item("abandoned", c.abandoned)?;
        d.set_item("claims_unreplicated", c.claims_unreplicated)?;
        d.set_item("completions_unreplicated", c.completions_unreplicated)?;
        d.set_item("unavailable", c.unavailable)?;
        Ok(d)
    }

    /// Reads `scoped`'s record: the pending's outcome is None (no record), a tuple
    /// `(state, fingerprint, generation, lease_left_seconds, data)` (`state` is
    /// "running" or "done"; `data` the result record's bytes when done, else None) or
    /// an exception object (store error).
    #[pyo3(name = "_get")]
    fn get(&self, scoped: &Bound<'_, PyAny>) -> PyResult<RedisPending> {
        let key = scoped_key(scoped)?.inner.clone();
        let store = self.inner.clone();
        let future = async move {
            let deliver: Deliver = match store.get(&key).await {
                Err(e) => error_value(e),
                Ok(None) => Box::new(|py| py.None()),
                Ok(Some(r)) => Box::new(move |py| {
                    let (state, left) = match &r.state {
                        RecordState::Running { lease_left } => {
                            ("running", lease_left.as_secs_f64())
                        }
                        RecordState::Done { .. } | RecordState::NotStored { .. } => ("done", 0.0),
                    };
                    let data = r.state.into_codec_result();
                    let data = data.map(|d| PyBytes::new(py, &d).into_any().unbind());
                    match (state, r.fingerprint, r.generation, left, data).into_pyobject(py) {
                        Ok(t) => t.into_any().unbind(),
                        Err(e) => e.into_value(py).into_any(),
                    }
                }),
            };
            deliver
        };
        Ok(RedisPending::new(Box::pin(future)))
    }

    /// Deletes `scoped`'s record (not a running one whose lease is live): the
    /// pending's outcome is True (deleted), False (none, or running) or an exception
    /// object (store error).
    #[pyo3(name = "_remove")]
    fn remove(&self, scoped: &Bound<'_, PyAny>) -> PyResult<RedisPending> {
        let key = scoped_key(scoped)?.inner.clone();
        let store = self.inner.clone();
        let future = async move {
            let deliver: Deliver = match store.remove(&key).await {
                Err(e) => error_value(e),
                Ok(removed) => Box::new(move |py| {
                    pyo3::types::PyBool::new(py, removed)
                        .to_owned()
                        .into_any()
                        .unbind()
                }),
            };
            deliver
        };
        Ok(RedisPending::new(Box::pin(future)))
    }

    /// Sends `PING`: the pending's outcome is None, or an exception object
    /// (`StoreUnavailableError`).
    #[pyo3(name = "_ping")]
    fn ping(&self) -> RedisPending {
        let store = self.inner.clone();
        let future = async move {
            let deliver: Deliver = match store.ping().await {
                Err(e) => error_value(e),
                Ok(()) => Box::new(|py| py.None()),
            };
            deliver
        };
        RedisPending::new(Box::pin(future))
    }
}

/// A step of the Redis store in flight: await it with `subscribe` (asyncio) or block
/// on it with `wait` (GIL released). Dropping it cancels the step.
#[pyclass(frozen, module = "oncely")]
pub struct RedisPending {
    step: Step,
}

impl RedisPending {
    fn new(future: NativeFuture) -> Self {
        RedisPending {
            step: Step::new(Waited::Native(future)),
        }
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
        self.step.subscribe(py, r#loop, fut)
    }

    /// Stops waiting (the caller was cancelled): the step is dropped.
    fn cancel(&self, py: Python<'_>) {
        self.step.cancel(py)
    }

    /// Blocks this thread, with the GIL released, until the step is done.
    fn wait(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.step.wait(py)
    }
}

/// The leader's claim on a key, in Redis and in this process: renewed until settled
/// with `complete` or `fail`; `abandon` (or garbage collection) releases it so that a
/// waiter takes over.
#[pyclass(frozen, module = "oncely")]
pub struct RedisLease {
    inner: Mutex<Option<CoreLease>>,
    parked: Parked,
    key: String,
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
    /// Stores `data` (the result record) in Redis; the pending's outcome is the
    /// leader's `Executed` of `value`, or the store error (e.g. `LeaseLostError`). For a
    /// "not storable" record, this process's joiners get `value` itself.
    fn complete(&self, data: Vec<u8>, value: Bound<'_, PyAny>) -> PyResult<RedisPending> {
        let lease = self.take()?;
        let parked = matches!(codec::decode(&data), Ok(StoredResult::NotStorable { .. }))
            .then(|| LeaderPark::new(&self.parked, &self.key, Held::new(value.clone().unbind())));
        let value = Held::new(value.unbind());
        let future = async move {
            let stored = lease.complete(data).await;
            drop(parked);
            let deliver: Deliver = match stored {
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
