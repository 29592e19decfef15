//! The dedup store: the core's `MemoryStore` holding JavaScript values.
//!
//! The JavaScript `IdempotencyStore.execute` drives the core's primitives: `begin` →
//! replay (the stored value, by its index), lead (a `NativeLease` the caller settles with
//! `complete`/`fail`/`abandon`) or join (a Promise). Every rule — fingerprints, TTL,
//! single flight, takeover, eviction, counters — is the core's.
//!
//! **Values.** Results stay JavaScript values, each in one element of the array the
//! store shares with its JavaScript side (`slot[1..]`), the core holding the index
//! (`Stored`, shared by `Rc`): every waiter and every replay gets the very same object
//! (`===`); a replay hands JavaScript the index. The element is cleared and reused when
//! the core drops its last copy (entry expired, evicted, removed). Errors are kept by one
//! napi reference each (`Held`).
//!
//! **Waiting.** The joiners of one flight share one Promise (a napi deferred): its core
//! `Join` is polled with a waker that queues the group's id; the queue is drained on the
//! JS thread, which settles the deferreds. The leader's `complete`/`fail`/`abandon` drain it
//! right away (the core wakes the waiters synchronously inside those calls); a wake
//! from anywhere else (a lease dropped by the garbage collector: a takeover) schedules
//! a drain through a threadsafe function, which is unref'd so it never keeps the
//! process alive. No runtime, no polling, no thread.

use crate::hub::{self, Drain, Hub};
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::future::Future;
use std::hash::{BuildHasherDefault, Hasher};
use std::pin::Pin;
use std::ptr;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use napi::bindgen_prelude::*;
use napi::sys;
use napi_derive::napi;

use oncely::{Begin, Code, ExecuteOptions, Join, Joined, Lease, MemoryStore};

use crate::convert::{self, Options, SHORT_STRING_MAX};
use crate::errors::{self, core_error, Ctor, OrThrow, Prop};
use crate::policy::{instance, ms, ManualClock};

/// A JavaScript value kept alive by a napi reference, deleted on drop.
///
/// Created, read and dropped on the JS thread of `env` only: the store and everything
/// holding a `Held` live behind `Rc`s owned by native objects of that thread.
pub(crate) struct Held {
    env: sys::napi_env,
    raw: sys::napi_ref,
    /// Primitives cannot be referenced (Node-API < 10): they sit in a one-element array.
    boxed: bool,
}

impl Held {
    pub(crate) fn new(env: sys::napi_env, value: sys::napi_value) -> Result<Held> {
        let direct = matches!(
            convert::type_of(env, value),
            sys::ValueType::napi_object | sys::ValueType::napi_function
        );
        // SAFETY: `value` is a live value of the current call on the JS thread.
        unsafe {
            let target = if direct {
                value
            } else {
                let mut arr = ptr::null_mut();
                sys::napi_create_array_with_length(env, 1, &mut arr);
                sys::napi_set_element(env, arr, 0, value);
                arr
            };
            let mut raw = ptr::null_mut();
            if sys::napi_create_reference(env, target, 1, &mut raw) != sys::Status::napi_ok {
                return Err(Error::new(
                    Status::GenericFailure,
                    "oncely: could not keep a reference to the value",
                ));
            }
            Ok(Held {
                env,
                raw,
                boxed: !direct,
            })
        }
    }

    pub(crate) fn value(&self, env: sys::napi_env) -> sys::napi_value {
        // SAFETY: `self.raw` is a live strong reference of `env` (same thread).
        unsafe {
            let mut v = ptr::null_mut();
            sys::napi_get_reference_value(env, self.raw, &mut v);
            if self.boxed {
                let mut inner = ptr::null_mut();
                sys::napi_get_element(env, v, 0, &mut inner);
                inner
            } else {
                v
            }
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        // SAFETY: dropped on the JS thread of `env` (see the type's doc).
        unsafe { sys::napi_delete_reference(self.env, self.raw) };
    }
}

/// The JavaScript array the store shares with its JavaScript side: `[0]` is where a
/// leader's lease is handed over, `[1..]` hold the stored results (one element each,
/// instead of a napi reference each: less memory, and a replay reads it in JavaScript).
struct Table {
    env: sys::napi_env,
    array: Held,
    /// Elements free for reuse.
    free: RefCell<Vec<u32>>,
    /// Elements used so far (free or not), the lease's included.
    len: Cell<u32>,
    /// The store is gone (or the environment is going away): nothing is cleared.
    closed: Cell<bool>,
}

impl Table {
    /// Puts `value` in a free element.
    fn put(self: &Rc<Self>, env: sys::napi_env, value: sys::napi_value) -> Result<Stored> {
        let idx = match self.free.borrow_mut().pop() {
            Some(i) => i,
            None => {
                let i = self.len.get();
                if i == u32::MAX {
                    return Err(Error::new(
                        Status::GenericFailure,
                        "oncely: too many stored values",
                    ));
                }
                self.len.set(i + 1);
                i
            }
        };
        // SAFETY: on the JS thread; `array` is an array held by this table.
        unsafe { sys::napi_set_element(env, self.array.value(env), idx, value) };
        Ok(Stored {
            idx,
            table: self.clone(),
        })
    }

    fn get(&self, env: sys::napi_env, idx: u32) -> sys::napi_value {
        let mut v = ptr::null_mut();
        // SAFETY: on the JS thread; `array` is an array held by this table.
        unsafe { sys::napi_get_element(env, self.array.value(env), idx, &mut v) };
        v
    }
}

/// A stored result: its element in the `Table`, cleared and freed when the core drops
/// its last copy (entry expired, evicted, removed; waiters settled).
pub(crate) struct Stored {
    idx: u32,
    table: Rc<Table>,
}

impl Drop for Stored {
    fn drop(&mut self) {
        let t = &*self.table;
        if t.closed.get() {
            return;
        }
        // SAFETY: dropped on the JS thread of `env` (everything holding a `Stored` lives
        // behind the store's `Rc`s, owned by native objects of that thread).
        unsafe {
            let mut undefined = ptr::null_mut();
            sys::napi_get_undefined(t.env, &mut undefined);
            sys::napi_set_element(t.env, t.array.value(t.env), self.idx, undefined);
        }
        t.free.borrow_mut().push(self.idx);
    }
}

/// The stored result.
type Value = Rc<Stored>;

/// A leader's error: the JavaScript value, and the code extracted from it (used only
/// to decide whether a permanent failure is cached, when that is enabled).
pub(crate) struct Failed {
    held: Held,
    code: Code,
}

impl oncely::Classify for Failed {
    fn code(&self) -> Code {
        self.code
    }
}

type Store = MemoryStore<Value, Failed>;

/// The one Promise of a flight, shared by all its waiters (same-thread joiners of one
/// running call): one core `Join`, one deferred, one wake-up for all of them.
struct Group {
    join: Join<Value, Failed>,
    deferred: sys::napi_deferred,
    /// The Promise, handed to every later joiner of the same flight.
    promise: Held,
    waker: Waker,
    /// The scoped key, to forget the group in `by_key` once settled.
    key: Box<str>,
    /// Callers waiting on this Promise.
    waiters: u32,
}

#[derive(Default)]
struct Waiters {
    slots: Vec<Option<Group>>,
    free: Vec<u32>,
    /// The unsettled group of each key with joiners. A key has at most one running
    /// entry, so a group whose flight is unsettled is the one a new `Join` of that key
    /// waits on (checked with `try_get` before sharing).
    by_key: HashMap<Box<str>, u32>,
    /// Callers waiting, over all groups.
    pending: u32,
}

/// Hashes the addresses in `Inner::leases` (a multiply-shift: addresses are not chosen
/// by callers, and SipHash cost more than the rest of the set operation).
#[derive(Default)]
struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = (n as u64)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(32);
    }
}

struct Inner {
    store: Store,
    waiters: RefCell<Waiters>,
    hub: Arc<Hub>,
    /// What a joiner's Promise resolves to when its leader went away: call `begin` again.
    abandoned: Held,
    /// What `begin` returns when the caller leads; the lease is then in `slot[0]`.
    lead: Held,
    /// `slot`: the lease's element and the stored results.
    table: Rc<Table>,
    /// The leases of this store alive now (their addresses): a lease handle from JavaScript
    /// is used only if it is one of these.
    leases: RefCell<HashSet<usize, BuildHasherDefault<AddrHasher>>>,
    /// The leases of the leads begun with `beginHeldFunction`'s function and not yet
    /// settled, innermost last: a server adapter's handler that answers within its call
    /// settles its lease before that call returns (nested leads settle theirs first), so
    /// it needs no External, no finalizer and no slot. One that goes on asynchronously
    /// takes its lease out as an External (`releaseHeld`).
    held: RefCell<Vec<Lease<Value, Failed>>>,
    /// The scoped key parsed last: retries and replays repeat a key, and parsing (the
    /// core's canonical-form check) costs more than comparing the text.
    last_key: RefCell<Option<oncely::ScopedKey>>,
    /// The fingerprint text of the last `begin`.
    last_fp: RefCell<Option<String>>,
}

impl Inner {
    /// Makes `s` the parsed key in `last_key` (parsing it unless it is the same text as
    /// the last call's, or as the key `http.request` made last).
    fn parse_key(&self, s: &str) -> std::result::Result<(), oncely::Error> {
        let mut last = self.last_key.borrow_mut();
        if last.as_ref().is_none_or(|k| k.as_str() != s) {
            *last = Some(match take_scoped(s) {
                Some(k) => k,
                None => oncely::ScopedKey::parse(s)?,
            });
        }
        Ok(())
    }

    /// Runs `settle` (a lease transition, which wakes waiters synchronously), then
    /// settles the woken waiters' Promises.
    fn settling(&self, env: sys::napi_env, settle: impl FnOnce()) {
        self.hub.queueing(settle);
        self.drain(env);
    }

    fn drain(&self, env: sys::napi_env) {
        loop {
            let ids = self.hub.take();
            if ids.is_empty() {
                return;
            }
            for id in ids {
                let done = {
                    let mut ws = self.waiters.borrow_mut();
                    let Some(Some(g)) = ws.slots.get_mut(id as usize) else {
                        continue;
                    };
                    let mut cx = Context::from_waker(&g.waker);
                    match Pin::new(&mut g.join).poll(&mut cx) {
                        Poll::Pending => None,
                        Poll::Ready(out) => {
                            let g = ws.slots[id as usize].take();
                            ws.free.push(id);
                            g.map(|g| {
                                ws.pending -= g.waiters;
                                if ws.by_key.get(&g.key) == Some(&id) {
                                    ws.by_key.remove(&g.key);
                                }
                                (g.deferred, out)
                            })
                        }
                    }
                };
                if let Some((deferred, out)) = done {
                    self.settle(env, deferred, out);
                }
            }
        }
    }

    fn settle(&self, env: sys::napi_env, deferred: sys::napi_deferred, out: Joined<Value, Failed>) {
        // SAFETY: `deferred` is unsettled and belongs to `env`; on the JS thread.
        unsafe {
            match out {
                Joined::Value(v) => {
                    sys::napi_resolve_deferred(env, deferred, self.table.get(env, v.idx));
                }
                Joined::Failed(e) => {
                    sys::napi_reject_deferred(env, deferred, e.held.value(env));
                }
                Joined::Panicked(message) => {
                    let err = errors::make_error(
                        env,
                        Ctor::Error,
                        Code::Internal.as_str(),
                        &oncely::Error::LeaderPanicked(message.to_string()).to_string(),
                        &[Prop::Str(c"kind", "leader_panicked")],
                    );
                    sys::napi_reject_deferred(env, deferred, err);
                }
                Joined::Abandoned => {
                    sys::napi_resolve_deferred(env, deferred, self.abandoned.value(env));
                }
                Joined::Error(e) => {
                    let err = crate::redis_store::thrown(env, &e);
                    sys::napi_reject_deferred(env, deferred, err);
                }
            }
        }
    }

    /// A Promise for the outcome of `join` (a joiner of `key`): the Promise of the
    /// flight's group when this thread already waits on that flight.
    fn wait(
        &self,
        env: sys::napi_env,
        key: &str,
        mut join: Join<Value, Failed>,
    ) -> Result<sys::napi_value> {
        let mut ws = self.waiters.borrow_mut();
        if let Some(&id) = ws.by_key.get(key) {
            if let Some(Some(g)) = ws.slots.get_mut(id as usize) {
                // Unsettled: the key's running entry is still this flight, the one
                // `join` waits on too.
                if g.join.try_get().is_none() {
                    g.waiters += 1;
                    let promise = g.promise.value(env);
                    ws.pending += 1;
                    return Ok(promise);
                }
            }
        }
        let mut deferred = ptr::null_mut();
        let mut promise = ptr::null_mut();
        // SAFETY: on the JS thread of `env`.
        if unsafe { sys::napi_create_promise(env, &mut deferred, &mut promise) }
            != sys::Status::napi_ok
        {
            return Err(Error::new(
                Status::GenericFailure,
                "oncely: napi_create_promise failed",
            ));
        }
        let id = match ws.free.pop() {
            Some(id) => id,
            None => {
                ws.slots.push(None);
                (ws.slots.len() - 1) as u32
            }
        };
        let waker = self.hub.waker(id);
        let mut cx = Context::from_waker(&waker);
        match Pin::new(&mut join).poll(&mut cx) {
            Poll::Ready(out) => {
                ws.free.push(id);
                drop(ws);
                self.settle(env, deferred, out);
            }
            Poll::Pending => {
                let held = Held::new(env, promise)?;
                ws.slots[id as usize] = Some(Group {
                    join,
                    deferred,
                    promise: held,
                    waker,
                    key: key.into(),
                    waiters: 1,
                });
                ws.by_key.insert(key.into(), id);
                ws.pending += 1;
            }
        }
        Ok(promise)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.table.closed.set(true);
        self.hub.release();
    }
}

impl Drain for Inner {
    fn drain(&self, env: sys::napi_env) {
        Inner::drain(self, env);
    }
}

/// Counts of what a store has done since it was made.
#[napi(object)]
pub struct StoreCounters {
    /// Calls that ran the action.
    pub leads: f64,
    /// Calls that waited for a running call and shared its result.
    pub joins: f64,
    /// Calls answered from a completed entry.
    pub replays: f64,
    /// Calls refused because the fingerprint differed.
    pub conflicts: f64,
    /// Completed entries removed because their TTL passed.
    pub expirations: f64,
    /// Completed entries removed early to stay within `maxEntries`.
    pub evictions: f64,
}

/// The core's in-process dedup store holding JavaScript values. Internal: used through
/// `IdempotencyStore`.
#[napi]
pub struct NativeStore {
    inner: Rc<Inner>,
}

#[napi]
impl NativeStore {
    /// `options` as `IdempotencyStore`'s; `abandoned` is the value a joiner's Promise
    /// resolves to when its leader went away; `lead` is what `begin` returns to a leader,
    /// whose lease it puts in `slot[0]`.
    #[napi(
        constructor,
        ts_args_type = "options: unknown, abandoned: object, lead: object, slot: unknown[]"
    )]
    pub fn new(
        env: &Env,
        options: Unknown<'_>,
        abandoned: Unknown<'_>,
        lead: Unknown<'_>,
        slot: Unknown<'_>,
    ) -> Result<Self> {
        let raw = env.raw();
        let o = Options::new(
            raw,
            options.raw(),
            "IdempotencyStore",
            &[
                "ttlMs",
                "maxEntries",
                "inProgressRetryAfterMs",
                "cachePermanentFailures",
                "_clock",
            ],
        )?;
        let mut b = Store::builder().naming(crate::errors::NAMING);
        if let Some(ttl) = o.millis(c"ttlMs", "ttl")? {
            b = b.ttl(ttl);
        }
        if let Some(n) = o.integer(c"maxEntries", 0.0, 9_007_199_254_740_991.0)? {
            b = b.max_entries(n as usize);
        }
        if let Some(d) = o.millis(c"inProgressRetryAfterMs", "in_progress_retry_after")? {
            b = b.in_progress_retry_after(d);
        }
        if o.boolean(c"cachePermanentFailures")?.unwrap_or(false) {
            b = b.cache_permanent_failures();
        }
        if let Some(v) = o.get(c"_clock")? {
            let clock = instance::<ManualClock>(env, v, "_clock", "ManualClock")?;
            b = b.clock(clock.inner.clone());
        }
        let store = b.build().or_throw(raw)?;
        let abandoned = Held::new(raw, abandoned.raw())?;
        let lead = Held::new(raw, lead.raw())?;
        let table = Rc::new(Table {
            env: raw,
            array: Held::new(raw, slot.raw())?,
            free: RefCell::new(Vec::new()),
            len: Cell::new(1),
            closed: Cell::new(false),
        });
        let hub = Hub::new();
        let inner = Rc::new(Inner {
            store,
            waiters: RefCell::new(Waiters::default()),
            hub: hub.clone(),
            abandoned,
            lead,
            table,
            leases: RefCell::new(HashSet::default()),
            held: RefCell::new(Vec::new()),
            last_key: RefCell::new(None),
            last_fp: RefCell::new(None),
        });
        hub::attach(raw, "oncely.IdempotencyStore", Rc::downgrade(&inner), &hub)?;
        Ok(NativeStore { inner })
    }

    /// Looks `key` up (SPEC §6 rules 1–4; `undefined` for the key or the fingerprint: the
    /// same text as the last call's): returns the index in `slot` of the stored value (a
    /// replay), the `lead` sentinel (this caller leads: its lease is in `slot[0]`) or a
    /// Promise (a call is running: it resolves to the value, rejects with the leader's
    /// error, or resolves to the `abandoned` sentinel; one Promise per flight, shared by
    /// its joiners). Throws a cached failure as is, and oncely's errors.
    #[napi(
        ts_args_type = "key: string | undefined, fingerprint: string | undefined, wait: boolean",
        ts_return_type = "unknown"
    )]
    pub fn begin<'env>(
        &self,
        env: &'env Env,
        key: Unknown<'_>,
        fingerprint: Unknown<'_>,
        wait: bool,
    ) -> Result<Unknown<'env>> {
        let raw = env.raw();
        let v = self
            .inner
            .begin(raw, key.raw(), fingerprint.raw(), wait, true, false)?;
        // SAFETY: a live value of this call.
        Ok(unsafe { Unknown::from_raw_unchecked(raw, v) })
    }

    /// `begin` as a plain function bound to this store: `(wait, key?, fingerprint?)`.
    #[napi(ts_return_type = "(wait: boolean, key?: string, fingerprint?: string) => unknown")]
    pub fn begin_function<'env>(&self, env: &'env Env) -> Result<Unknown<'env>> {
        self.bound_begin(env, begin_fn)
    }

    /// `beginFunction`'s function for a lead settled within the call that began it:
    /// `(wait, key, fingerprint, running)`, `running` the number of held leases whose
    /// calls are still running (any more held are given up first). A lead's lease is kept
    /// in the store, innermost last, instead of handed out in `slot[0]`; it is then
    /// settled with `completeHeld`/`failHeld`, taken out with `releaseHeld` or given up
    /// with `abandonHeld`, each naming its depth (`running + 1` at its begin).
    #[napi(
        ts_return_type = "(wait: boolean, key: string | undefined, fingerprint: string | undefined, running: number) => unknown"
    )]
    pub fn begin_held_function<'env>(&self, env: &'env Env) -> Result<Unknown<'env>> {
        self.bound_begin(env, begin_held_fn)
    }

    /// Completes the innermost held lease (`depth`: the number of held leases, it
    /// included, as the caller counts them).
    #[napi(ts_args_type = "depth: number, value: unknown")]
    pub fn complete_held(&self, env: &Env, depth: u32, value: Unknown<'_>) -> Result<()> {
        let raw = env.raw();
        let lease = self.inner.take_held(raw, depth)?;
        self.inner.complete_lease(raw, lease, value.raw())
    }

    /// Fails the innermost held lease (see `completeHeld` and `fail`).
    #[napi(ts_args_type = "depth: number, error: unknown, code: number")]
    pub fn fail_held(&self, env: &Env, depth: u32, error: Unknown<'_>, code: u32) -> Result<()> {
        let raw = env.raw();
        let lease = self.inner.take_held(raw, depth)?;
        self.inner.fail_lease(raw, lease, error.raw(), code)
    }

    /// Takes the innermost held lease out as a lease handle (an External, settled with
    /// `complete`/`fail`): its action goes on asynchronously.
    #[napi(ts_args_type = "depth: number", ts_return_type = "unknown")]
    pub fn release_held<'env>(&self, env: &'env Env, depth: u32) -> Result<Unknown<'env>> {
        let raw = env.raw();
        let lease = self.inner.take_held(raw, depth)?;
        let handle = self.inner.external(raw, lease)?;
        // SAFETY: a live value of this call.
        Ok(unsafe { Unknown::from_raw_unchecked(raw, handle) })
    }

    /// Gives up the innermost held lease without a result: the entry is removed and one
    /// waiter takes over (the caller failed before it could settle it).
    #[napi(ts_args_type = "depth: number")]
    pub fn abandon_held(&self, env: &Env, depth: u32) -> Result<()> {
        let raw = env.raw();
        let lease = self.inner.take_held(raw, depth)?;
        self.inner.settling(raw, move || drop(lease));
        Ok(())
    }

    fn bound_begin<'env>(
        &self,
        env: &'env Env,
        call: unsafe extern "C" fn(sys::napi_env, sys::napi_callback_info) -> sys::napi_value,
    ) -> Result<Unknown<'env>> {
        let raw = env.raw();
        let data = Box::into_raw(Box::new(self.inner.clone()));
        let mut f = ptr::null_mut();
        // SAFETY: on the JS thread; `data` is freed by the function's finalizer (or here
        // when the function could not be made).
        unsafe {
            if sys::napi_create_function(raw, c"begin".as_ptr(), 5, Some(call), data.cast(), &mut f)
                != sys::Status::napi_ok
                || sys::napi_add_finalizer(
                    raw,
                    f,
                    data.cast(),
                    Some(finalize_begin_fn),
                    ptr::null_mut(),
                    ptr::null_mut(),
                ) != sys::Status::napi_ok
            {
                drop(Box::from_raw(data));
                return Err(Error::new(
                    Status::GenericFailure,
                    "oncely: could not make the begin function",
                ));
            }
            Ok(Unknown::from_raw_unchecked(raw, f))
        }
    }

    /// Stores `value` until the TTL and gives it to every waiter.
    #[napi(ts_args_type = "lease: unknown, value: unknown")]
    pub fn complete(&self, env: &Env, lease: Unknown<'_>, value: Unknown<'_>) -> Result<()> {
        let raw = env.raw();
        let lease = self.inner.take_lease(raw, lease.raw())?;
        self.inner.complete_lease(raw, lease, value.raw())
    }

    /// Gives `error` to every waiter and removes the entry (or caches it, when the store
    /// caches permanent failures and `code` is one).
    #[napi(ts_args_type = "lease: unknown, error: unknown, code: number")]
    pub fn fail(&self, env: &Env, lease: Unknown<'_>, error: Unknown<'_>, code: u32) -> Result<()> {
        let raw = env.raw();
        let lease = self.inner.take_lease(raw, lease.raw())?;
        self.inner.fail_lease(raw, lease, error.raw(), code)
    }

    /// Gives up the claim without a result (a lead no one will use): the entry is removed
    /// and one waiter takes over. A settled lease is left alone.
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
    pub fn counters(&self) -> StoreCounters {
        let c = self.inner.store.counters();
        StoreCounters {
            leads: c.leads as f64,
            joins: c.joins as f64,
            replays: c.replays as f64,
            conflicts: c.conflicts as f64,
            expirations: c.expirations as f64,
            evictions: c.evictions as f64,
        }
    }

    /// Entries held now (running and completed).
    #[napi(getter)]
    pub fn size(&self) -> u32 {
        u32::try_from(self.inner.store.len()).unwrap_or(u32::MAX)
    }

    /// Waiters whose Promise is not settled yet.
    #[napi(getter)]
    pub fn pending_waiters(&self) -> u32 {
        self.inner.waiters.borrow().pending
    }

    /// The TTL of completed entries, ms.
    #[napi(getter)]
    pub fn ttl_ms(&self) -> f64 {
        ms(self.inner.store.ttl())
    }

    /// Removes a completed entry so the next call runs again; running ones are left
    /// alone. Returns whether one was removed.
    #[napi(ts_args_type = "key: string")]
    pub fn remove(&self, env: &Env, key: Unknown<'_>) -> Result<bool> {
        let raw = env.raw();
        let key = convert::with_str(
            raw,
            key.raw(),
            "scoped",
            SHORT_STRING_MAX,
            oncely::ScopedKey::parse,
        )?
        .or_throw(raw)?;
        Ok(self.inner.store.remove(&key))
    }
}

/// The error of a call made by the action that holds its key (`kind: 'reentrant'`, with
/// `key`): the core's `Error::Reentrant`, for both stores.
#[napi(ts_args_type = "key: string", ts_return_type = "Error")]
pub fn reentrant_error(env: &Env, key: String) -> Unknown<'_> {
    let raw = env.raw();
    let e = crate::redis_store::thrown(raw, &oncely::Error::Reentrant { key });
    // SAFETY: a live value of this call.
    unsafe { Unknown::from_raw_unchecked(raw, e) }
}

thread_local! {
    /// The scoped key `http.request` made last on this thread: a server adapter passes
    /// its text to `begin` next, which then takes it instead of parsing the text again.
    static LAST_SCOPED: RefCell<Option<oncely::ScopedKey>> = const { RefCell::new(None) };
}

/// Remembers `key`, made by `http.request`, for the `begin` that follows (see `LAST_SCOPED`).
pub(crate) fn remember_scoped(key: oncely::ScopedKey) {
    LAST_SCOPED.with(|k| *k.borrow_mut() = Some(key));
}

/// The remembered scoped key when its text is `text` (taken: a key is begun once).
fn take_scoped(text: &str) -> Option<oncely::ScopedKey> {
    LAST_SCOPED.with(|k| {
        let mut k = k.borrow_mut();
        if k.as_ref().is_some_and(|key| key.as_str() == text) {
            k.take()
        } else {
            None
        }
    })
}

impl Inner {
    /// `NativeStore.begin`; `given`: whether `key` and `fingerprint` were passed (when
    /// not, they are the last call's); `hold`: a lead's lease is kept in `held` instead of
    /// handed out.
    fn begin(
        self: &Rc<Self>,
        raw: sys::napi_env,
        key: sys::napi_value,
        fingerprint: sys::napi_value,
        wait: bool,
        given: bool,
        hold: bool,
    ) -> Result<sys::napi_value> {
        // `undefined`: the same text as the last call's (the JavaScript side remembers
        // it), which spares converting the strings again.
        let same_key = self.last_key.borrow().is_some()
            && (!given || convert::type_of(raw, key) == sys::ValueType::napi_undefined);
        if !same_key {
            convert::with_str(raw, key, "scoped", SHORT_STRING_MAX, |s| self.parse_key(s))?
                .or_throw(raw)?;
        }
        let same_fp = self.last_fp.borrow().is_some()
            && (!given || convert::type_of(raw, fingerprint) == sys::ValueType::napi_undefined);
        if !same_fp {
            convert::with_str(raw, fingerprint, "fingerprint", SHORT_STRING_MAX, |fp| {
                let mut last = self.last_fp.borrow_mut();
                let last = last.get_or_insert_with(String::new);
                last.clear();
                last.push_str(fp);
            })?;
        }
        let begun = {
            let last = self.last_key.borrow();
            let fp = self.last_fp.borrow();
            let (Some(key), Some(fp)) = (last.as_ref(), fp.as_deref()) else {
                return Err(Error::new(Status::GenericFailure, "oncely: no parsed key"));
            };
            self.store.begin(key, fp, ExecuteOptions { wait })
        };
        let v = match begun {
            Err(e) => return Err(core_error(raw, &e)),
            Ok(Begin::Replay(Ok(v))) => {
                // The element's index: the JavaScript side reads `slot[index]`.
                let mut n = ptr::null_mut();
                // SAFETY: on the JS thread.
                unsafe { sys::napi_create_uint32(raw, v.idx, &mut n) };
                n
            }
            Ok(Begin::Replay(Err(e))) => {
                // SAFETY: on the JS thread; throws the leader's own error value.
                unsafe { sys::napi_throw(raw, e.held.value(raw)) };
                return Err(Error::new(Status::PendingException, "cached failure"));
            }
            Ok(Begin::Lead(lease)) if hold => {
                self.held.borrow_mut().push(lease);
                self.lead.value(raw)
            }
            Ok(Begin::Lead(lease)) => self.hand_out(raw, lease)?,
            Ok(Begin::Join(join)) => {
                let last = self.last_key.borrow();
                let key = last.as_ref().map_or("", |k| k.as_str());
                self.wait(raw, key, join)?
            }
        };
        Ok(v)
    }
}

/// `begin` as a plain function bound to one store (`NativeStore.beginFunction`):
/// `(wait, key?, fingerprint?)`, a missing or `undefined` key or fingerprint meaning the
/// last call's. Spares the class-method machinery (unwrapping `this`) on every call.
unsafe extern "C" fn begin_fn(
    env: sys::napi_env,
    info: sys::napi_callback_info,
) -> sys::napi_value {
    // SAFETY: a callback of a function made by `begin_function`.
    unsafe { begin_call(env, info, false) }
}

/// `begin_fn` whose lead's lease is kept in the store's `held` leases
/// (`NativeStore.beginHeldFunction`): `(wait, key, fingerprint, running)`.
unsafe extern "C" fn begin_held_fn(
    env: sys::napi_env,
    info: sys::napi_callback_info,
) -> sys::napi_value {
    // SAFETY: a callback of a function made by `begin_held_function`.
    unsafe { begin_call(env, info, true) }
}

/// The call of a bound begin function; `hold`: `begin_held_fn`'s.
///
/// # Safety
/// A callback of a function made by `bound_begin`, whose data is a boxed `Rc<Inner>`
/// freed only by the function's finalizer.
unsafe fn begin_call(
    env: sys::napi_env,
    info: sys::napi_callback_info,
    hold: bool,
) -> sys::napi_value {
    let mut argc = 4usize;
    let mut argv = [ptr::null_mut(); 4];
    let mut data = ptr::null_mut();
    // SAFETY: see the function's contract; missing arguments read as `undefined`.
    let result = unsafe {
        sys::napi_get_cb_info(
            env,
            info,
            &mut argc,
            argv.as_mut_ptr(),
            ptr::null_mut(),
            &mut data,
        );
        let inner = &*(data as *const Rc<Inner>);
        let mut wait = true;
        sys::napi_get_value_bool(env, argv[0], &mut wait);
        if hold {
            // The held leases whose calls are still running (the caller's count); any
            // more are left over from a call that ended without settling its lease. No
            // count (not a number): nothing is given up.
            let mut running = 0u32;
            if sys::napi_get_value_uint32(env, argv[3], &mut running) == sys::Status::napi_ok {
                inner.give_up_held_above(env, running as usize);
            }
        }
        inner.begin(env, argv[1], argv[2], wait, hold || argc > 1, hold)
    };
    crate::errors::value_or_throw(env, result)
}

unsafe extern "C" fn finalize_begin_fn(_env: sys::napi_env, data: *mut c_void, _hint: *mut c_void) {
    // SAFETY: the `Rc<Inner>` boxed by `begin_function`; finalized once.
    drop(unsafe { Box::from_raw(data as *mut Rc<Inner>) });
}

/// A leader's lease, handed to JavaScript as an External. Freed by the External's
/// finalizer: a lease collected unsettled is dropped, which abandons it (one waiter
/// takes over).
struct LeaseCell {
    lease: Option<Lease<Value, Failed>>,
    inner: Rc<Inner>,
}

unsafe extern "C" fn finalize_lease(_env: sys::napi_env, data: *mut c_void, _hint: *mut c_void) {
    // SAFETY: `data` is the `LeaseCell` boxed by `hand_out`; its External is gone.
    let cell = unsafe { Box::from_raw(data as *mut LeaseCell) };
    cell.inner.leases.borrow_mut().remove(&(data as usize));
    // Dropping an unsettled lease wakes the waiters; not inside a native call, so the
    // wake schedules a drain through the threadsafe function.
    drop(cell);
}

impl Inner {
    /// Wraps `lease` in an External, puts it in `slot[0]` and gives back `lead`.
    fn hand_out(
        self: &Rc<Self>,
        env: sys::napi_env,
        lease: Lease<Value, Failed>,
    ) -> Result<sys::napi_value> {
        let ext = self.external(env, lease)?;
        // SAFETY: `slot` is an array held by this store.
        unsafe { sys::napi_set_element(env, self.table.array.value(env), 0, ext) };
        Ok(self.lead.value(env))
    }

    /// `lease` as a lease handle: an External whose finalizer abandons a lease collected
    /// unsettled.
    fn external(
        self: &Rc<Self>,
        env: sys::napi_env,
        lease: Lease<Value, Failed>,
    ) -> Result<sys::napi_value> {
        let cell = Box::into_raw(Box::new(LeaseCell {
            lease: Some(lease),
            inner: self.clone(),
        }));
        let mut ext = ptr::null_mut();
        // SAFETY: on the JS thread; Node owns `cell` from here on and frees it through
        // `finalize_lease`.
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
            return Err(Error::new(
                Status::GenericFailure,
                "oncely: napi_create_external failed",
            ));
        }
        self.leases.borrow_mut().insert(cell as usize);
        Ok(ext)
    }

    /// The lease behind a handle from JavaScript, if it is a live lease of this store.
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
        // SAFETY: a live `LeaseCell` of this store (freed only by its External's finalizer,
        // which cannot run while JavaScript still passes the External); used on the JS
        // thread only and not reentered.
        Ok(unsafe { &mut *(data as *mut LeaseCell) })
    }

    /// Stores `value` as the outcome of `lease` until the TTL and gives it to every waiter.
    fn complete_lease(
        &self,
        env: sys::napi_env,
        lease: Lease<Value, Failed>,
        value: sys::napi_value,
    ) -> Result<()> {
        let stored = Rc::new(self.table.put(env, value)?);
        self.settling(env, move || lease.complete_now(stored));
        Ok(())
    }

    /// Gives `error` to every waiter of `lease` and removes its entry (or caches it, when
    /// the store caches permanent failures and `code` is one).
    fn fail_lease(
        &self,
        env: sys::napi_env,
        lease: Lease<Value, Failed>,
        error: sys::napi_value,
        code: u32,
    ) -> Result<()> {
        let code = i32::try_from(code)
            .ok()
            .and_then(Code::from_i32)
            .unwrap_or(Code::Unknown);
        let held = Held::new(env, error)?;
        self.settling(env, move || {
            lease.fail_now(Failed { held, code });
        });
        Ok(())
    }

    /// The held lease at `depth` (1: the outermost), the innermost once the leases above
    /// it are given up: those were begun inside its action, which has returned, so their
    /// calls ended without settling them (a stack overflow in their last steps). Throws
    /// when there is no lease at `depth` (it was given up already): nothing is settled
    /// for another lead.
    fn take_held(&self, env: sys::napi_env, depth: u32) -> Result<Lease<Value, Failed>> {
        let depth = depth as usize;
        self.give_up_held_above(env, depth);
        let lease = {
            let mut held = self.held.borrow_mut();
            if held.len() == depth && depth > 0 {
                held.pop()
            } else {
                None
            }
        };
        lease.ok_or_else(|| {
            errors::throw(
                env,
                Ctor::Error,
                Code::Internal.as_str(),
                "oncely: this held lease was given up already",
                &[Prop::Str(c"kind", "lease_settled")],
            )
        })
    }

    /// Gives up the held leases above the first `depth` (their keys are released, one
    /// waiter of each takes over).
    fn give_up_held_above(&self, env: sys::napi_env, depth: usize) {
        if self.held.borrow().len() <= depth {
            return;
        }
        let stale: Vec<_> = self.held.borrow_mut().drain(depth..).collect();
        self.settling(env, move || drop(stale));
    }

    fn take_lease(
        &self,
        env: sys::napi_env,
        handle: sys::napi_value,
    ) -> Result<Lease<Value, Failed>> {
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
