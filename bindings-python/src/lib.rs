//! `oncely._oncely`: the private native module of the Python package `oncely`.
//!
//! Every rule (backoff, classification, budget, keys, fingerprints, dedup state) is the
//! core crate's; this module only converts between Python and the core. The Python
//! package (`bindings-python/python/oncely`) hosts the waiting: its asyncio and sync
//! retry loops drive [`retry::RetryState`], and its store awaits [`store::Join`]s that
//! are woken safely from any thread (see the `store` module).

use pyo3::prelude::*;

mod convert;
mod errors;
mod http;
mod keys;
mod redis_store;
mod retry;
mod store;

#[pymodule]
fn _oncely(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(retry::code_names, m)?)?;
    m.add_function(wrap_pyfunction!(retry::code_from_http, m)?)?;
    m.add_function(wrap_pyfunction!(retry::code_from_name, m)?)?;
    m.add_function(wrap_pyfunction!(retry::classify, m)?)?;
    m.add_function(wrap_pyfunction!(retry::parse_retry_after, m)?)?;
    m.add_function(wrap_pyfunction!(retry::parse_pushback_ms, m)?)?;
    m.add_class::<retry::Classification>()?;
    m.add_class::<retry::RetryPolicy>()?;
    m.add_class::<retry::ManualClock>()?;
    m.add_class::<retry::Deadline>()?;
    m.add_class::<retry::RetryBudget>()?;
    m.add_class::<retry::BudgetSnapshot>()?;
    m.add_class::<retry::Failure>()?;
    m.add_class::<retry::RetryState>()?;
    m.add_class::<retry::ReasonCodes>()?;
    m.add_function(wrap_pyfunction!(retry::extract, m)?)?;
    m.add_function(wrap_pyfunction!(retry::extract_headers, m)?)?;

    m.add_function(wrap_pyfunction!(keys::new_key, m)?)?;
    m.add_function(wrap_pyfunction!(keys::derive_key, m)?)?;
    m.add_function(wrap_pyfunction!(keys::validate_key, m)?)?;
    m.add_function(wrap_pyfunction!(keys::scope, m)?)?;
    m.add_function(wrap_pyfunction!(keys::fingerprint, m)?)?;
    m.add_function(wrap_pyfunction!(keys::canonical_json, m)?)?;
    m.add_function(wrap_pyfunction!(keys::fingerprint_bytes, m)?)?;
    m.add_class::<keys::ScopedKey>()?;
    keys::add_constants(m)?;

    m.add_function(wrap_pyfunction!(store::reentrant_error, m)?)?;
    m.add_class::<store::PyStore>()?;
    m.add_class::<store::Executed>()?;
    m.add_class::<store::Counters>()?;
    m.add_class::<store::Lease>()?;
    m.add_class::<store::Join>()?;

    m.add_class::<redis_store::PyRedisStore>()?;
    m.add_class::<redis_store::RedisPending>()?;
    m.add_class::<redis_store::RedisLease>()?;
    m.add_function(wrap_pyfunction!(redis_store::_encode_record, m)?)?;
    m.add_function(wrap_pyfunction!(redis_store::_decode_record, m)?)?;
    http::add(m)?;
    Ok(())
}
