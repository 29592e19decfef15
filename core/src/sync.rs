//! The locks and atomics of the dedup store: std's, or shuttle's for the model test.

#[cfg(feature = "shuttle")]
pub(crate) use shuttle::sync::{
    atomic::{AtomicBool, Ordering},
    Mutex, MutexGuard,
};
#[cfg(not(feature = "shuttle"))]
pub(crate) use std::sync::{
    atomic::{AtomicBool, Ordering},
    Mutex, MutexGuard,
};
