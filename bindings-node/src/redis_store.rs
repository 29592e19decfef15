//! The Redis dedup store: `oncely_redis::RedisStore` driven from the Node event loop.
//!
//! The JavaScript `RedisStore.execute` (index.js) calls `begin` → a Promise of
//! `[kind, payload]`: `0` replayed (the stored bytes), `1` joined (the bytes), `2` lead
//! (a lease handle), `3` abandoned (begin again). The leader settles its lease with
//! `complete` (the result record; a Promise), `fail` (its error; a Promise) or `abandon`.
//!
//! **Results** are records of the one result encoding, `oncely_redis::codec`
//! (redis/README.md, "Result encoding"): index.js picks the kind (`encodeRecord`) and
//! this module lays it out; a stored record comes back to index.js as `[tag, payload]`
//! (`T_*`: JSON text, a Buffer, no value, the leader's own value, a user codec's bytes or
//! text), which it turns into a value. A result that could not be stored is still
//! handed to this process's joiners of its leader: the leader parks its value by record
//! key until they have taken it; later callers get `result_not_stored`.
//!
//! **Waiting.** The store's futures (claims, waits, completions) are polled on the JS
//! thread only. Their wakers — called from the store's own threads — queue the task's
//! id and schedule a drain through a threadsafe function, which polls the woken tasks
//! and settles their deferreds. The threadsafe function is ref'd only while tasks are
//! pending, so a wait keeps the process alive and an idle store does not. No runtime, no
//! thread of ours, the event loop never blocks.
//!
//! **Errors.** A leader's error never leaves the process (not stored in Redis): it is
//! kept by a napi reference under an id (`JsFailure` carries the id), and the waiters of
//! this process are rejected with that very value. When the core drops its last copy,
//! the id is queued and the reference deleted on the JS thread.

use crate::hub::{self, Drain, Hub};
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::future::Future;
use std::pin::Pin;
use std::ptr;
use std::rc::{Rc, Weak};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use napi::bindgen_prelude::*;
use napi::sys;
use napi_derive::napi;

use oncely::{Begin, Code, ExecuteOptions, Joined, LeaderLease};
use oncely_redis::codec::{self, StoredResult};
use oncely_redis::{RedisJoin, RedisLease};

use crate::convert::{self, Options, SHORT_STRING_MAX};
use crate::errors::{self, core_error, Ctor, OrThrow, Prop};
use crate::policy::ms;
use crate::store::Held;

/// A leader's error as the Redis store holds it: the id of its napi reference. Dropped
/// (from any thread) when the core no longer needs it: the id is queued for deletion.
pub(crate) struct JsFailure {
    id: u32,
    dead: Arc<Mutex<Vec<u32>>>,
}

impl Drop for JsFailure {
    fn drop(&mut self) {
        lock(&self.dead).push(self.id);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

type Store = oncely_redis::RedisStore<JsFailure>;
type Lease = RedisLease<JsFailure>;

/// `[tag, payload]` tags of a stored result handed to index.js.
const T_JSON: u32 = 0;
const T_BYTES: u32 = 1;
const T_NO_VALUE: u32 = 2;
const T_VALUE: u32 = 3;
const T_USER_BYTES: u32 = 4;
const T_USER_TEXT: u32 = 5;

/// The values of this process's leaders whose results could not be stored, by record
/// key: kept while the leader completes and until its local joiners have taken them.
#[derive(Default)]
struct Slot {
    joiners: usize,
    leader: bool,
    value: Option<Held>,
}

type Parked = Rc<RefCell<HashMap<String, Slot>>>;

/// A caller joined to a leader of this process, counted in its key's slot.
struct JoinGuard {
    parked: Parked,
    key: String,
}

impl JoinGuard {
    fn new(parked: &Parked, key: String) -> Self {
        parked.borrow_mut().entry(key.clone()).or_default().joiners += 1;
        JoinGuard {
            parked: parked.clone(),
            key,
        }
    }
    fn value(&self, env: sys::napi_env) -> Option<sys::napi_value> {
        let parked = self.parked.borrow();
        Some(parked.get(&self.key)?.value.as_ref()?.value(env))
    }
}

impl Drop for JoinGuard {
    fn drop(&mut self) {
        let removed = {
            let mut parked = self.parked.borrow_mut();
            match parked.get_mut(&self.key) {
                Some(slot) => {
                    slot.joiners -= 1;
                    if slot.joiners == 0 && !slot.leader {
                        parked.remove(&self.key)
                    } else {
                        None
                    }
                }
                None => None,
            }
        };
        drop(removed);
    }
}

/// A leader's parked value, from before its completion is sent until it is done (or
/// dropped); then it stays only while joiners are counted.
struct LeaderPark {
    parked: Parked,
    key: String,
}

impl LeaderPark {
    fn new(parked: &Parked, key: String, value: Held) -> Self {
        let old = {
            let mut map = parked.borrow_mut();
            let slot = map.entry(key.clone()).or_default();
            slot.leader = true;
            slot.value.replace(value)
        };
        drop(old);
        LeaderPark {
            parked: parked.clone(),
            key,
        }
    }
}

impl Drop for LeaderPark {
    fn drop(&mut self) {
        let removed = {
            let mut parked = self.parked.borrow_mut();
            match parked.get_mut(&self.key) {
                Some(slot) => {
                    slot.leader = false;
                    if slot.joiners == 0 {
                        parked.remove(&self.key)
                    } else {
                        None
                    }
                }
                None => None,
            }
        };
        drop(removed);
    }
}

/// What a task ends with.
enum Out {
    /// A stored record: kind 0 (replayed) or 1 (joined); `joined` when the leader is in
    /// this process.
    Value {
        data: Vec<u8>,
        kind: u32,
        key: oncely::ScopedKey,
        joined: Option<JoinGuard>,
    },
    Lead(Lease),
    Abandoned,
    Failed(Arc<JsFailure>),
    Panicked(String),
    Error(oncely::Error),
    Done,
    /// `get`: a record, or none.
    Record(Option<oncely_redis::RedisRecord>),
    /// `remove`: whether a record was deleted.
    Bool(bool),
}

type Task = Pin<Box<dyn Future<Output = Out>>>;

struct Pending {
    fut: Task,
    deferred: sys::napi_deferred,
}

struct Inner {
    store: Store,
    hub: Arc<Hub>,
    tasks: RefCell<HashMap<u32, Pending>>,
    next_task: Cell<u32>,
    /// The threadsafe function is ref'd (tasks are pending).
    reffed: Cell<bool>,
    errors: RefCell<HashMap<u32, Held>>,
    next_error: Cell<u32>,
    dead: Arc<Mutex<Vec<u32>>>,
    /// The live lease cells of this store (addresses).
    leases: RefCell<HashSet<usize>>,
    /// Values of leaders of this process that could not be stored.
    parked: Parked,
    /// This store (lease cells hold it).
    me: Weak<Inner>,
}

impl Inner {
    /// Runs `f` (which may wake tasks), then polls the woken tasks.
    fn settling<R>(&self, env: sys::napi_env, f: impl FnOnce() -> R) -> R {
        let (r, was) = self.hub.queueing(f);
        if !was {
            self.drain(env);
        }
        r
    }

    fn drain(&self, env: sys::napi_env) {
        loop {
            let dead = std::mem::take(&mut *lock(&self.dead));
            if !dead.is_empty() {
                let mut errs = self.errors.borrow_mut();
                for id in dead {
                    errs.remove(&id);
                }
            }
            let ids = self.hub.take();
            if ids.is_empty() {
                break;
            }
            for id in ids {
                self.poll_task(env, id);
            }
        }
        self.update_ref(env);
    }

    fn update_ref(&self, env: sys::napi_env) {
        let want = !self.tasks.borrow().is_empty();
        if want == self.reffed.get() {
            return;
        }
        let tsfn = self.hub.tsfn();
        if tsfn.is_null() {
            return;
        }
        // SAFETY: on the JS thread; the threadsafe function is alive.
        unsafe {
            if want {
                sys::napi_ref_threadsafe_function(env, tsfn);
            } else {
                sys::napi_unref_threadsafe_function(env, tsfn);
            }
        }
        self.reffed.set(want);
    }

    fn poll_task(&self, env: sys::napi_env, id: u32) {
        let Some(mut task) = self.tasks.borrow_mut().remove(&id) else {
            return; // settled or cancelled already
        };
        let waker = self.hub.waker(id);
        let mut cx = Context::from_waker(&waker);
        let (polled, _) = self.hub.queueing(|| task.fut.as_mut().poll(&mut cx));
        match polled {
            Poll::Pending => {
                self.tasks.borrow_mut().insert(id, task);
            }
            Poll::Ready(out) => self.settle(env, task.deferred, out),
        }
    }

    /// A new task: its Promise and id. Polled once at once.
    fn spawn(&self, env: sys::napi_env, fut: Task) -> Result<(sys::napi_value, u32)> {
        let mut deferred = ptr::null_mut();
        let mut promise = ptr::null_mut();
        // SAFETY: on the JS thread.
        if unsafe { sys::napi_create_promise(env, &mut deferred, &mut promise) }
            != sys::Status::napi_ok
        {
            return Err(Error::new(
                Status::GenericFailure,
                "oncely: napi_create_promise failed",
            ));
        }
        let id = self.next_task.get();
        self.next_task.set(id.wrapping_add(1));
        self.tasks
            .borrow_mut()
            .insert(id, Pending { fut, deferred });
        self.settling(env, || self.poll_task(env, id));
        self.update_ref(env);
        Ok((promise, id))
    }

    fn settle(&self, env: sys::napi_env, deferred: sys::napi_deferred, out: Out) {
        // SAFETY: `deferred` is unsettled and belongs to `env`; on the JS thread.
        unsafe {
            let (ok, v) = match out {
                Out::Value {
                    data,
                    kind,
                    key,
                    joined,
                } => match codec::decode(&data) {
                    Err(e) => (false, thrown(env, &e)),
                    Ok(r) => {
                        let tagged = |tag, payload| (true, triple(env, kind, tag, payload));
                        match r {
                            StoredResult::Json(text) => tagged(T_JSON, string(env, text)),
                            StoredResult::Bytes(b) => tagged(T_BYTES, buffer(env, b)),
                            StoredResult::NoValue => tagged(T_NO_VALUE, ptr::null_mut()),
                            StoredResult::NotStorable { .. } => {
                                match joined.as_ref().and_then(|g| g.value(env)) {
                                    Some(v) => tagged(T_VALUE, v),
                                    None => (
                                        false,
                                        thrown(env, &r.not_stored(&key).expect("not storable")),
                                    ),
                                }
                            }
                            StoredResult::UserBytes(b) => tagged(T_USER_BYTES, buffer(env, b)),
                            StoredResult::UserText(t) => tagged(T_USER_TEXT, string(env, t)),
                        }
                    }
                },
                Out::Lead(lease) => match self.hand_out(env, lease) {
                    Some(ext) => (true, pair(env, 2, ext)),
                    None => (
                        false,
                        errors::make_error(
                            env,
                            Ctor::Error,
                            Code::Internal.as_str(),
                            "oncely: napi_create_external failed",
                            &[Prop::Str(c"kind", "other")],
                        ),
                    ),
                },
                Out::Abandoned => (true, pair(env, 3, ptr::null_mut())),
                Out::Failed(e) => {
                    let held = self.errors.borrow().get(&e.id).map(|h| h.value(env));
                    let v = held.unwrap_or_else(|| {
                        errors::make_error(
                            env,
                            Ctor::Error,
                            Code::Unknown.as_str(),
                            "the leader's call failed",
                            &[Prop::Str(c"kind", "other")],
                        )
                    });
                    (false, v)
                }
                Out::Panicked(message) => (
                    false,
                    errors::make_error(
                        env,
                        Ctor::Error,
                        Code::Internal.as_str(),
                        &oncely::Error::LeaderPanicked(message).to_string(),
                        &[Prop::Str(c"kind", "leader_panicked")],
                    ),
                ),
                Out::Error(e) => (false, thrown(env, &e)),
                Out::Done => {
                    let mut u = ptr::null_mut();
                    sys::napi_get_undefined(env, &mut u);
                    (true, u)
                }
                Out::Bool(b) => {
                    let mut v = ptr::null_mut();
                    sys::napi_get_boolean(env, b, &mut v);
                    (true, v)
                }
                Out::Record(None) => {
                    let mut v = ptr::null_mut();
                    sys::napi_get_null(env, &mut v);
                    (true, v)
                }
                Out::Record(Some(r)) => {
                    // [state, fingerprint, generation, leaseLeftMs, data?]
                    let (state, left) = match &r.state {
                        oncely_redis::RecordState::Running { lease_left } => {
                            ("running", lease_left.as_secs_f64() * 1000.0)
                        }
                        oncely_redis::RecordState::Done { .. }
                        | oncely_redis::RecordState::NotStored { .. } => ("done", 0.0),
                    };
                    let data = r.state.into_codec_result();
                    let mut arr = ptr::null_mut();
                    sys::napi_create_array_with_length(env, 5, &mut arr);
                    sys::napi_set_element(env, arr, 0, string(env, state));
                    sys::napi_set_element(env, arr, 1, string(env, &r.fingerprint));
                    let (mut generation, mut ms) = (ptr::null_mut(), ptr::null_mut());
                    sys::napi_create_double(env, r.generation as f64, &mut generation);
                    sys::napi_set_element(env, arr, 2, generation);
                    sys::napi_create_double(env, left, &mut ms);
                    sys::napi_set_element(env, arr, 3, ms);
                    if let Some(d) = data {
                        sys::napi_set_element(env, arr, 4, buffer(env, &d));
                    }
                    (true, arr)
                }
            };
            if ok {
                sys::napi_resolve_deferred(env, deferred, v);
            } else {
                sys::napi_reject_deferred(env, deferred, v);
            }
        }
    }

    /// Wraps `lease` in an External (freed by its finalizer: an unsettled lease collected
    /// is dropped, which releases the claim).
    fn hand_out(&self, env: sys::napi_env, lease: Lease) -> Option<sys::napi_value> {
        let cell = Box::into_raw(Box::new(LeaseCell {
            lease: Some(lease),
            inner: self.me.clone(),
        }));
        let mut ext = ptr::null_mut();
        // SAFETY: on the JS thread; Node owns `cell` from here on.
        let status = unsafe {
            sys::napi_create_external(
                env,
                cell.cast(),
                Some(finalize_lease),
                ptr::null_mut(),
                &mut ext,
            )
        };
        if status != sys::Status::napi_ok {
            // SAFETY: not handed to Node.
            drop(unsafe { Box::from_raw(cell) });
            return None;
        }
        self.leases.borrow_mut().insert(cell as usize);
        Some(ext)
    }

    #[allow(clippy::mut_from_ref)]
    fn lease_cell(&self, env: sys::napi_env, handle: sys::napi_value) -> Result<&mut LeaseCell> {
        let mut data = ptr::null_mut();
        // SAFETY: any value may be asked; non-externals give an error status.
        let status = unsafe { sys::napi_get_value_external(env, handle, &mut data) };
        if status != sys::Status::napi_ok || !self.leases.borrow().contains(&(data as usize)) {
            return Err(errors::type_error(
                env,
                "lease",
                "lease must be a lease handed out by this store",
            ));
        }
        // SAFETY: a live `LeaseCell` of this store, used on the JS thread only.
        Ok(unsafe { &mut *(data as *mut LeaseCell) })
    }

    fn take_lease(&self, env: sys::napi_env, handle: sys::napi_value) -> Result<Lease> {
        self.lease_cell(env, handle)?.lease.take().ok_or_else(|| {
            errors::throw(
                env,
                Ctor::Error,
                Code::FailedPrecondition.as_str(),
                "this lease is already settled",
                &[Prop::Str(c"kind", "lease_settled")],
            )
        })
    }
}

/// The JavaScript error of `e`, as a value (thrown, then caught).
pub(crate) fn thrown(env: sys::napi_env, e: &oncely::Error) -> sys::napi_value {
    let _ = core_error(env, e);
    let mut v = ptr::null_mut();
    // SAFETY: on the JS thread; `core_error` left the error pending.
    unsafe { sys::napi_get_and_clear_last_exception(env, &mut v) };
    v
}

/// `[kind, payload]` (`payload` omitted when null).
fn pair(env: sys::napi_env, kind: u32, payload: sys::napi_value) -> sys::napi_value {
    // SAFETY: on the JS thread.
    unsafe {
        let mut arr = ptr::null_mut();
        sys::napi_create_array_with_length(env, 2, &mut arr);
        let mut k = ptr::null_mut();
        sys::napi_create_uint32(env, kind, &mut k);
        sys::napi_set_element(env, arr, 0, k);
        if !payload.is_null() {
            sys::napi_set_element(env, arr, 1, payload);
        }
        arr
    }
}

/// `[kind, tag, payload]` (`payload` omitted when null).
fn triple(env: sys::napi_env, kind: u32, tag: u32, payload: sys::napi_value) -> sys::napi_value {
    // SAFETY: on the JS thread.
    unsafe {
        let arr = pair(env, kind, ptr::null_mut());
        let mut t = ptr::null_mut();
        sys::napi_create_uint32(env, tag, &mut t);
        sys::napi_set_element(env, arr, 1, t);
        if !payload.is_null() {
            sys::napi_set_element(env, arr, 2, payload);
        }
        arr
    }
}

fn string(env: sys::napi_env, text: &str) -> sys::napi_value {
    let mut v = ptr::null_mut();
    // SAFETY: on the JS thread; `text` is valid UTF-8 for its length.
    unsafe { sys::napi_create_string_utf8(env, text.as_ptr().cast(), text.len() as isize, &mut v) };
    v
}

fn buffer(env: sys::napi_env, bytes: &[u8]) -> sys::napi_value {
    let mut v = ptr::null_mut();
    let mut data = ptr::null_mut();
    // SAFETY: on the JS thread; `bytes` is valid for its length.
    unsafe {
        sys::napi_create_buffer_copy(env, bytes.len(), bytes.as_ptr().cast(), &mut data, &mut v)
    };
    v
}

struct LeaseCell {
    lease: Option<Lease>,
    inner: Weak<Inner>,
}

unsafe extern "C" fn finalize_lease(env: sys::napi_env, data: *mut c_void, _hint: *mut c_void) {
    // SAFETY: the `LeaseCell` boxed by `hand_out`; its External is gone.
    let mut cell = unsafe { Box::from_raw(data as *mut LeaseCell) };
    let lease = cell.lease.take();
    if let Some(inner) = cell.inner.upgrade() {
        inner.leases.borrow_mut().remove(&(data as usize));
        // An unsettled lease: dropping it releases the claim and wakes the waiters.
        inner.settling(env, move || drop(lease));
    } else {
        drop(lease);
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.hub.release();
    }
}

impl Drain for Inner {
    fn drain(&self, env: sys::napi_env) {
        self.settling(env, || ());
    }
}

/// Counts of what one Redis store instance has done since it was made.
#[napi(object)]
pub struct RedisStoreCounters {
    /// Claim scripts run (one per key per process at a time).
    pub claims: f64,
    /// Claims that made this instance the leader (takeovers included).
    pub leads: f64,
    /// Leads that took over an expired lease.
    pub takeovers: f64,
    /// Claims answered with a stored result.
    pub replays: f64,
    /// Claims that found a leader on another instance and waited for it.
    pub remote_waits: f64,
    /// Leaders that found their lease taken over when completing.
    pub leases_lost: f64,
    /// Leads given up without an outcome (the lease was abandoned or collected unsettled,
    /// before its action started or while it ran) and released for a waiter.
    pub abandoned: f64,
    /// Claims released (UNAVAILABLE) because fewer replicas than `minReplicas`
    /// acknowledged them.
    pub claims_unreplicated: f64,
    /// Completions stored on the primary that fewer replicas than `minReplicas`
    /// acknowledged in time (the action ran).
    pub completions_unreplicated: f64,
    /// Calls that failed with UNAVAILABLE (claims, completions, get, remove, ping).
    pub unavailable: f64,
}

/// The shared dedup store on Redis (oncely-redis). Internal: used through `RedisStore`.
#[napi]
pub struct NativeRedisStore {
    inner: Rc<Inner>,
}

/// A scoped key argument (a string from `scope()`), or the field-naming error thrown.
fn scoped_arg(env: &Env, key: &Unknown<'_>) -> Result<oncely::ScopedKey> {
    let raw = env.raw();
    convert::with_str(
        raw,
        key.raw(),
        "scoped",
        SHORT_STRING_MAX,
        oncely::ScopedKey::parse,
    )?
    .or_throw(raw)
}

impl NativeRedisStore {
    /// Runs `fut` on the store's tasks and hands JavaScript its Promise.
    fn promise<'env>(&self, env: &'env Env, fut: Task) -> Result<Unknown<'env>> {
        let raw = env.raw();
        let (promise, _) = self.inner.spawn(raw, fut)?;
        // SAFETY: a value of `raw`, on the JS thread.
        Ok(unsafe { Unknown::from_raw_unchecked(raw, promise) })
    }
}

#[napi]
impl NativeRedisStore {
    /// `options`: `{ url | urls, cluster, sentinel, minReplicas, minReplicasTimeoutMs,
    /// prefix, leaseMs, ttlMs, connectTimeoutMs, ioTimeoutMs, workers,
    /// inProgressRetryAfterMs, maxResultBytes }`.
    #[napi(constructor, ts_args_type = "options: unknown")]
    pub fn new(env: &Env, options: Unknown<'_>) -> Result<Self> {
        let raw = env.raw();
        if convert::is_nullish(raw, options.raw()) {
            return Err(errors::type_error(
                raw,
                "options",
                "RedisStore options must be an object with a url",
            ));
        }
        let o = Options::new(
            raw,
            options.raw(),
            "RedisStore",
            &[
                "url",
                "urls",
                "cluster",
                "sentinel",
                "minReplicas",
                "minReplicasTimeoutMs",
                "prefix",
                "leaseMs",
                "ttlMs",
                "connectTimeoutMs",
                "ioTimeoutMs",
                "workers",
                "inProgressRetryAfterMs",
                "maxResultBytes",
                "connect",
                // The user codec: used by index.js.
                "encode",
                "decode",
            ],
        )?;
        // One URL, or several (`urls`: a Cluster's seeds, or Sentinels).
        let urls = match (o.get(c"url")?, o.get(c"urls")?) {
            (Some(v), None) => vec![convert::string(raw, v, "url", 4096)?],
            (None, Some(v)) => convert::string_array(raw, v, "urls", 4096)?,
            (Some(_), Some(_)) => {
                return Err(errors::type_error(
                    raw,
                    "urls",
                    "give url or urls, not both",
                ))
            }
            (None, None) => {
                return Err(errors::type_error(
                    raw,
                    "url",
                    "url must be a string (redis://host:port/db), got undefined",
                ))
            }
        };
        let mut b = Store::builder(urls[0].clone())
            .seeds(urls[1..].to_vec())
            .naming(errors::NAMING);
        if let Some(on) = o.boolean(c"cluster")? {
            b = b.cluster(on);
        }
        if let Some(v) = o.get(c"sentinel")? {
            b = b.sentinel(convert::string(raw, v, "sentinel", SHORT_STRING_MAX)?);
        }
        if let Some(n) = o.integer(c"minReplicas", 0.0, 1024.0)? {
            b = b.min_replicas(n as usize);
        }
        if let Some(d) = o.millis(c"minReplicasTimeoutMs", "min_replicas_timeout")? {
            b = b.min_replicas_timeout(d);
        }
        if let Some(v) = o.get(c"prefix")? {
            b = b.prefix(convert::string(raw, v, "prefix", SHORT_STRING_MAX)?);
        }
        if let Some(d) = o.millis(c"leaseMs", "lease")? {
            b = b.lease(d);
        }
        if let Some(d) = o.millis(c"ttlMs", "ttl")? {
            b = b.ttl(d);
        }
        if let Some(d) = o.millis(c"connectTimeoutMs", "connect_timeout")? {
            b = b.connect_timeout(d);
        }
        if let Some(d) = o.millis(c"ioTimeoutMs", "io_timeout")? {
            b = b.io_timeout(d);
        }
        if let Some(n) = o.integer(c"workers", 1.0, 1024.0)? {
            b = b.workers(n as usize);
        }
        if let Some(d) = o.millis(c"inProgressRetryAfterMs", "in_progress_retry_after")? {
            b = b.in_progress_retry_after(d);
        }
        if let Some(n) = o.integer(
            c"maxResultBytes",
            1.0,
            oncely_redis::MAX_RESULT_BYTES_LIMIT as f64,
        )? {
            b = b.max_result_bytes(n as usize);
        }
        if let Some(yes) = o.boolean(c"connect")? {
            b = b.connect_now(yes);
        }
        let store = b.build().or_throw(raw)?;
        let hub = Hub::new();
        let inner = Rc::new_cyclic(|me| Inner {
            store,
            hub: hub.clone(),
            tasks: RefCell::new(HashMap::new()),
            next_task: Cell::new(0),
            reffed: Cell::new(false),
            errors: RefCell::new(HashMap::new()),
            next_error: Cell::new(0),
            dead: Arc::new(Mutex::new(Vec::new())),
            leases: RefCell::new(HashSet::new()),
            parked: Parked::default(),
            me: me.clone(),
        });
        hub::attach(raw, "oncely.RedisStore", Rc::downgrade(&inner), &hub)?;
        Ok(NativeRedisStore { inner })
    }

    /// Claims `key` (or joins, or replays): `[promise, id]`, the Promise resolving to
    /// `[0, bytes]` (replayed), `[1, bytes]` (joined), `[2, lease]` (this caller leads) or
    /// `[3]` (the leader went away: begin again); rejecting with oncely's errors or the
    /// error of a leader of this process. `id` is for `cancel`.
    #[napi(
        ts_args_type = "key: string, fingerprint: string, wait: boolean",
        ts_return_type = "[Promise<[number, unknown?]>, number]"
    )]
    pub fn begin<'env>(
        &self,
        env: &'env Env,
        key: Unknown<'_>,
        fingerprint: Unknown<'_>,
        wait: bool,
    ) -> Result<Unknown<'env>> {
        let raw = env.raw();
        let key = convert::with_str(
            raw,
            key.raw(),
            "scoped",
            SHORT_STRING_MAX,
            oncely::ScopedKey::parse,
        )?
        .or_throw(raw)?;
        let fp = convert::string(raw, fingerprint.raw(), "fingerprint", SHORT_STRING_MAX)?;
        let store = self.inner.store.clone();
        let parked = self.inner.parked.clone();
        let fut: Task = Box::pin(async move {
            match store.begin(&key, &fp, ExecuteOptions { wait }).await {
                Err(e) => Out::Error(e),
                Ok(Begin::Replay(Ok(data))) => Out::Value {
                    data,
                    kind: 0,
                    key,
                    joined: None,
                },
                Ok(Begin::Replay(Err(e))) => Out::Failed(e),
                Ok(Begin::Lead(lease)) => Out::Lead(lease),
                Ok(Begin::Join(join)) => {
                    let joined = matches!(join, RedisJoin::Local(_))
                        .then(|| JoinGuard::new(&parked, store.record_key(&key)));
                    match join.await {
                        Joined::Value(data) => Out::Value {
                            data,
                            kind: 1,
                            key,
                            joined,
                        },
                        Joined::Failed(e) => Out::Failed(e),
                        Joined::Panicked(m) => Out::Panicked(m.to_string()),
                        Joined::Abandoned => Out::Abandoned,
                        Joined::Error(e) => Out::Error(e),
                    }
                }
            }
        });
        let (promise, id) = self.inner.spawn(raw, fut)?;
        // SAFETY: on the JS thread: `[promise, id]`.
        unsafe {
            let mut arr = ptr::null_mut();
            sys::napi_create_array_with_length(raw, 2, &mut arr);
            sys::napi_set_element(raw, arr, 0, promise);
            let mut n = ptr::null_mut();
            sys::napi_create_uint32(raw, id, &mut n);
            sys::napi_set_element(raw, arr, 1, n);
            Ok(Unknown::from_raw_unchecked(raw, arr))
        }
    }

    /// Stops task `id` (a caller that stopped waiting): a claim it won (its answer in
    /// or still on its way) is released. Its Promise resolves to `[3]`, which the caller
    /// no longer reads. A task already settled is not found: a lease it handed out is
    /// given back with `abandon`.
    #[napi]
    pub fn cancel(&self, env: &Env, id: u32) {
        let raw = env.raw();
        let task = self.inner.tasks.borrow_mut().remove(&id);
        if let Some(mut task) = task {
            let deferred = task.deferred;
            let waker = self.inner.hub.waker(id);
            self.inner.settling(raw, move || {
                // An answer that arrived but was not polled yet is taken now: a claim it
                // won is dropped here, which releases it, instead of expiring a lease later.
                let mut cx = Context::from_waker(&waker);
                drop(task.fut.as_mut().poll(&mut cx));
                drop(task.fut);
            });
            self.inner.settle(raw, deferred, Out::Abandoned);
            self.inner.update_ref(raw);
        }
    }

    /// Reads `key`'s record: a Promise of `[state, fingerprint, generation, leaseLeftMs,
    /// data?]` (`data` the result record when done) or null.
    #[napi(
        ts_args_type = "key: string",
        ts_return_type = "Promise<[string, string, number, number, Buffer?] | null>"
    )]
    pub fn get<'env>(&self, env: &'env Env, key: Unknown<'_>) -> Result<Unknown<'env>> {
        let key = scoped_arg(env, &key)?;
        let store = self.inner.store.clone();
        let fut: Task = Box::pin(async move {
            match store.get(&key).await {
                Ok(r) => Out::Record(r),
                Err(e) => Out::Error(e),
            }
        });
        self.promise(env, fut)
    }

    /// Deletes `key`'s record unless it is running under a live lease: a Promise of
    /// whether one was deleted.
    #[napi(ts_args_type = "key: string", ts_return_type = "Promise<boolean>")]
    pub fn remove<'env>(&self, env: &'env Env, key: Unknown<'_>) -> Result<Unknown<'env>> {
        let key = scoped_arg(env, &key)?;
        let store = self.inner.store.clone();
        let fut: Task = Box::pin(async move {
            match store.remove(&key).await {
                Ok(b) => Out::Bool(b),
                Err(e) => Out::Error(e),
            }
        });
        self.promise(env, fut)
    }

    /// Sends PING: a Promise that resolves, or rejects with UNAVAILABLE.
    #[napi(ts_return_type = "Promise<void>")]
    pub fn ping<'env>(&self, env: &'env Env) -> Result<Unknown<'env>> {
        let store = self.inner.store.clone();
        let fut: Task = Box::pin(async move {
            match store.ping().await {
                Ok(()) => Out::Done,
                Err(e) => Out::Error(e),
            }
        });
        self.promise(env, fut)
    }

    /// Stores `data` (the result record) for every instance and gives it to this
    /// process's waiters (for a "not storable" record, `value` itself). Rejects with
    /// ABORTED (`lease_lost`) when the lease was taken over, UNAVAILABLE when Redis
    /// could not be reached (nothing is stored then).
    #[napi(
        ts_args_type = "lease: unknown, data: Buffer, value: unknown",
        ts_return_type = "Promise<void>"
    )]
    pub fn complete<'env>(
        &self,
        env: &'env Env,
        lease: Unknown<'_>,
        data: Unknown<'_>,
        value: Unknown<'_>,
    ) -> Result<Unknown<'env>> {
        let raw = env.raw();
        let bytes = buffer_bytes(raw, data.raw(), "data")?;
        let lease = self.inner.take_lease(raw, lease.raw())?;
        let park = match codec::decode(&bytes) {
            Ok(StoredResult::NotStorable { .. }) => Some(LeaderPark::new(
                &self.inner.parked,
                lease.record_key().to_owned(),
                Held::new(raw, value.raw())?,
            )),
            _ => None,
        };
        let fut: Task = Box::pin(async move {
            let stored = LeaderLease::complete(lease, bytes).await;
            drop(park);
            match stored {
                Ok(()) => Out::Done,
                Err(e) => Out::Error(e),
            }
        });
        let (promise, _) = self.inner.spawn(raw, fut)?;
        // SAFETY: a live value of this call.
        Ok(unsafe { Unknown::from_raw_unchecked(raw, promise) })
    }

    /// Releases the claim and gives `error` to this process's waiters (never stored).
    #[napi(
        ts_args_type = "lease: unknown, error: unknown",
        ts_return_type = "Promise<void>"
    )]
    pub fn fail<'env>(
        &self,
        env: &'env Env,
        lease: Unknown<'_>,
        error: Unknown<'_>,
    ) -> Result<Unknown<'env>> {
        let raw = env.raw();
        let lease = self.inner.take_lease(raw, lease.raw())?;
        let id = self.inner.next_error.get();
        self.inner.next_error.set(id.wrapping_add(1));
        self.inner
            .errors
            .borrow_mut()
            .insert(id, Held::new(raw, error.raw())?);
        let failure = JsFailure {
            id,
            dead: self.inner.dead.clone(),
        };
        let fut: Task = Box::pin(async move {
            drop(LeaderLease::fail(lease, failure).await);
            Out::Done
        });
        let (promise, _) = self.inner.spawn(raw, fut)?;
        // SAFETY: a live value of this call.
        Ok(unsafe { Unknown::from_raw_unchecked(raw, promise) })
    }

    /// Gives up the claim without a result (a lead no one will use): released at once,
    /// a waiter takes over. A settled lease is left alone.
    #[napi(ts_args_type = "lease: unknown")]
    pub fn abandon(&self, env: &Env, lease: Unknown<'_>) -> Result<()> {
        let raw = env.raw();
        let cell = self.inner.lease_cell(raw, lease.raw())?;
        if let Some(lease) = cell.lease.take() {
            self.inner.settling(raw, move || drop(lease));
        }
        Ok(())
    }

    /// The counters so far.
    #[napi]
    pub fn counters(&self) -> RedisStoreCounters {
        let c = self.inner.store.counters();
        RedisStoreCounters {
            claims: c.claims as f64,
            leads: c.leads as f64,
            takeovers: c.takeovers as f64,
            replays: c.replays as f64,
            remote_waits: c.remote_waits as f64,
            leases_lost: c.leases_lost as f64,
            abandoned: c.abandoned as f64,
            claims_unreplicated: c.claims_unreplicated as f64,
            completions_unreplicated: c.completions_unreplicated as f64,
            unavailable: c.unavailable as f64,
        }
    }

    /// The lease of this store's claims, ms.
    #[napi(getter)]
    pub fn lease_ms(&self) -> f64 {
        ms(self.inner.store.lease())
    }

    /// How long completed results are kept, ms.
    #[napi(getter)]
    pub fn ttl_ms(&self) -> f64 {
        ms(self.inner.store.ttl())
    }

    /// The key prefix.
    #[napi(getter)]
    pub fn prefix(&self) -> String {
        self.inner.store.prefix().to_owned()
    }

    /// The largest result stored, in bytes (encoded); a larger one is recorded as not
    /// storable.
    #[napi(getter)]
    pub fn max_result_bytes(&self) -> f64 {
        self.inner.store.max_result_bytes() as f64
    }

    /// The Redis key holding `key`'s record: `{<prefix>:<scoped key>}`.
    #[napi(ts_args_type = "key: string")]
    pub fn record_key(&self, env: &Env, key: Unknown<'_>) -> Result<String> {
        let raw = env.raw();
        let key = convert::with_str(
            raw,
            key.raw(),
            "scoped",
            SHORT_STRING_MAX,
            oncely::ScopedKey::parse,
        )?
        .or_throw(raw)?;
        Ok(self.inner.store.record_key(&key))
    }

    /// Tasks not yet settled (claims, waits, completions in flight).
    #[napi(getter)]
    pub fn pending(&self) -> u32 {
        u32::try_from(self.inner.tasks.borrow().len()).unwrap_or(u32::MAX)
    }
}

fn buffer_bytes(env: sys::napi_env, v: sys::napi_value, field: &str) -> Result<Vec<u8>> {
    let mut is_buffer = false;
    // SAFETY: on the JS thread.
    unsafe { sys::napi_is_buffer(env, v, &mut is_buffer) };
    if !is_buffer {
        return Err(errors::type_error(
            env,
            field,
            &format!("{field} must be a Buffer"),
        ));
    }
    let mut p = ptr::null_mut();
    let mut len = 0usize;
    // SAFETY: `v` is a Buffer of this call; copied before returning.
    unsafe {
        sys::napi_get_buffer_info(env, v, &mut p, &mut len);
        Ok(if len == 0 {
            Vec::new()
        } else {
            std::slice::from_raw_parts(p as *const u8, len).to_vec()
        })
    }
}

/// The record bytes of a result (redis/README.md, "Result encoding"): `kind` is
/// `'json'` (payload: the JSON text), `'bytes'` (a Buffer), `'no_value'`,
/// `'not_storable'` (the type name), `'user_bytes'` (a Buffer) or `'user_text'`.
#[napi(
    ts_args_type = "kind: string, payload?: string | Buffer",
    ts_return_type = "Buffer"
)]
pub fn encode_record<'env>(
    env: &'env Env,
    kind: String,
    payload: Option<Unknown<'_>>,
) -> Result<Unknown<'env>> {
    let raw = env.raw();
    let payload = payload.map(|p| p.raw()).unwrap_or(ptr::null_mut());
    let text = || convert::string(raw, payload, "payload", usize::MAX);
    let bytes = || buffer_bytes(raw, payload, "payload");
    let record = match kind.as_str() {
        "json" => StoredResult::Json(&text()?).encode(),
        "bytes" => StoredResult::Bytes(&bytes()?).encode(),
        "no_value" => StoredResult::NoValue.encode(),
        "not_storable" => StoredResult::NotStorable {
            type_name: &text()?,
        }
        .encode(),
        "user_bytes" => StoredResult::UserBytes(&bytes()?).encode(),
        "user_text" => StoredResult::UserText(&text()?).encode(),
        _ => {
            return Err(errors::type_error(
                raw,
                "kind",
                &format!("unknown record kind {kind:?}"),
            ))
        }
    };
    // SAFETY: a live value of this call.
    Ok(unsafe { Unknown::from_raw_unchecked(raw, buffer(raw, &record)) })
}

/// Reads record bytes: `[tag, payload]` with index.js's tags (0 JSON text, 1 Buffer,
/// 2 no value, 4 user bytes, 5 user text). A "not storable" record throws
/// `result_not_stored` (no key), an unreadable one UNAVAILABLE.
#[napi(ts_args_type = "data: Buffer", ts_return_type = "[number, unknown?]")]
pub fn decode_record<'env>(env: &'env Env, data: Unknown<'_>) -> Result<Unknown<'env>> {
    let raw = env.raw();
    let data = buffer_bytes(raw, data.raw(), "data")?;
    let (tag, payload) = match codec::decode(&data).or_throw(raw)? {
        StoredResult::Json(text) => (T_JSON, string(raw, text)),
        StoredResult::Bytes(b) => (T_BYTES, buffer(raw, b)),
        StoredResult::NoValue => (T_NO_VALUE, ptr::null_mut()),
        StoredResult::NotStorable { type_name } => {
            return Err(core_error(
                raw,
                &oncely::Error::ResultNotStored {
                    key: String::new(),
                    type_name: type_name.to_owned(),
                },
            ))
        }
        StoredResult::UserBytes(b) => (T_USER_BYTES, buffer(raw, b)),
        StoredResult::UserText(t) => (T_USER_TEXT, string(raw, t)),
    };
    // SAFETY: a live value of this call.
    Ok(unsafe { Unknown::from_raw_unchecked(raw, pair(raw, tag, payload)) })
}
