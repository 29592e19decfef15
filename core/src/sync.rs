//! The locks, atomics and thread-locals of the dedup store: std's, or shuttle's for the
//! model test.

#[cfg(feature = "shuttle")]
pub(crate) use shuttle::sync::{Mutex, MutexGuard};
#[cfg(feature = "shuttle")]
pub(crate) use shuttle::thread_local;
#[cfg(not(feature = "shuttle"))]
pub(crate) use std::sync::{Mutex, MutexGuard};
#[cfg(not(feature = "shuttle"))]
pub(crate) use std::thread_local;
