//! Waking the JS thread from any thread, shared by both stores: a waker queues the id of
//! its task in the store's [`Hub`], and one threadsafe-function call (at most one on its
//! way) has the store drain the queue on the JS thread. A native call already on the JS
//! thread drains the queue itself when it returns, so it schedules nothing.

use std::ffi::c_void;
use std::ptr;
use std::rc::Weak;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Wake, Waker};

use napi::{sys, Error, Result, Status};

use crate::errors;

/// The part of a store the wakers reach, from any thread.
pub(crate) struct Hub {
    ready: Mutex<Vec<u32>>,
    /// A drain through the threadsafe function is on its way.
    scheduled: AtomicBool,
    /// A native call on the JS thread drains the queue itself when it returns.
    draining: AtomicBool,
    /// Null once the store released it or Node finalized it.
    tsfn: AtomicPtr<sys::napi_threadsafe_function__>,
}

impl Hub {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Hub {
            ready: Mutex::new(Vec::new()),
            scheduled: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            tsfn: AtomicPtr::new(ptr::null_mut()),
        })
    }

    fn push(&self, id: u32) {
        self.ready
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(id);
        if !self.draining.load(Ordering::Acquire) && !self.scheduled.swap(true, Ordering::AcqRel) {
            let tsfn = self.tsfn.load(Ordering::Acquire);
            if !tsfn.is_null() {
                // SAFETY: the threadsafe function is alive (not yet finalized); calling
                // it is allowed from any thread.
                unsafe {
                    sys::napi_call_threadsafe_function(
                        tsfn,
                        ptr::null_mut(),
                        sys::ThreadsafeFunctionCallMode::nonblocking,
                    )
                };
            }
        }
    }

    /// The ids queued so far.
    pub(crate) fn take(&self) -> Vec<u32> {
        std::mem::take(&mut *self.ready.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// A waker that queues `id`.
    pub(crate) fn waker(self: &Arc<Self>, id: u32) -> Waker {
        Waker::from(Arc::new(WakeId {
            hub: self.clone(),
            id,
        }))
    }

    /// Runs `f` on the JS thread with wake-ups only queued (the caller drains after);
    /// also says whether an outer call was already draining.
    pub(crate) fn queueing<R>(&self, f: impl FnOnce() -> R) -> (R, bool) {
        let was = self.draining.swap(true, Ordering::AcqRel);
        let r = f();
        self.draining.store(was, Ordering::Release);
        (r, was)
    }

    /// The threadsafe function, or null once released or finalized.
    pub(crate) fn tsfn(&self) -> sys::napi_threadsafe_function {
        self.tsfn.load(Ordering::Acquire)
    }

    /// Releases the threadsafe function (the store is going away).
    pub(crate) fn release(&self) {
        let tsfn = self.tsfn.swap(ptr::null_mut(), Ordering::AcqRel);
        if !tsfn.is_null() {
            // SAFETY: not yet finalized (the finalizer nulls the pointer first).
            unsafe {
                sys::napi_release_threadsafe_function(
                    tsfn,
                    sys::ThreadsafeFunctionReleaseMode::release,
                )
            };
        }
    }
}

struct WakeId {
    hub: Arc<Hub>,
    id: u32,
}

impl Wake for WakeId {
    fn wake(self: Arc<Self>) {
        self.hub.push(self.id);
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.hub.push(self.id);
    }
}

/// A store that drains its hub's queue on the JS thread.
pub(crate) trait Drain: 'static {
    /// Handles the queued ids (called on the JS thread).
    fn drain(&self, env: sys::napi_env);
}

struct Context<T> {
    store: Weak<T>,
    hub: Arc<Hub>,
}

/// Creates the threadsafe function through which wakers from other threads reach
/// `store` on the JS thread, unref'd (a pending drain never keeps the process alive on
/// its own), and hands it to `hub`.
pub(crate) fn attach<T: Drain>(
    env: sys::napi_env,
    name: &str,
    store: Weak<T>,
    hub: &Arc<Hub>,
) -> Result<()> {
    let ctx = Box::into_raw(Box::new(Context {
        store,
        hub: hub.clone(),
    }));
    let mut tsfn = ptr::null_mut();
    // SAFETY: on the JS thread; `ctx` stays valid until `finalize` frees it.
    let status = unsafe {
        sys::napi_create_threadsafe_function(
            env,
            ptr::null_mut(),
            ptr::null_mut(),
            errors::js_string(env, name),
            0,
            1,
            ctx.cast(),
            Some(finalize::<T>),
            ctx.cast(),
            Some(call_js::<T>),
            &mut tsfn,
        )
    };
    if status != sys::Status::napi_ok {
        // SAFETY: not handed to Node: free it here.
        drop(unsafe { Box::from_raw(ctx) });
        return Err(Error::new(
            Status::GenericFailure,
            "oncely: napi_create_threadsafe_function failed",
        ));
    }
    // SAFETY: `tsfn` was just created on this thread.
    unsafe { sys::napi_unref_threadsafe_function(env, tsfn) };
    hub.tsfn.store(tsfn, Ordering::Release);
    Ok(())
}

unsafe extern "C" fn call_js<T: Drain>(
    env: sys::napi_env,
    _js_callback: sys::napi_value,
    context: *mut c_void,
    _data: *mut c_void,
) {
    if env.is_null() || context.is_null() {
        return; // the environment is shutting down
    }
    // SAFETY: `context` is the `Context` leaked at creation, freed only by `finalize`,
    // which Node runs after the last call.
    let ctx = unsafe { &*(context as *const Context<T>) };
    ctx.hub.scheduled.store(false, Ordering::Release);
    if let Some(store) = ctx.store.upgrade() {
        store.drain(env);
    }
}

unsafe extern "C" fn finalize<T: Drain>(
    _env: sys::napi_env,
    data: *mut c_void,
    _hint: *mut c_void,
) {
    if data.is_null() {
        return;
    }
    // SAFETY: `data` is the `Context` leaked at creation; finalize runs once.
    let ctx = unsafe { Box::from_raw(data as *mut Context<T>) };
    ctx.hub.tsfn.store(ptr::null_mut(), Ordering::Release);
}
