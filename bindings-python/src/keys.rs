//! Idempotency keys, scoped keys, fingerprints and the protocol's header names.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use oncely::{IdempotencyKey, ScopedKey as CoreScopedKey};

use crate::convert::{text, to_json};
use crate::errors::IntoPyResult;

/// The `key` argument as text: a non-`str` is a type error naming the argument `key`;
/// a lone surrogate is an invalid `idempotency_key`, as every other bad key value is.
fn key_text<'a>(py: Python<'_>, key: &'a Bound<'_, PyAny>) -> PyResult<std::borrow::Cow<'a, str>> {
    if !key.is_instance_of::<pyo3::types::PyString>() {
        return Err(crate::errors::wrong_type("key", "a str", key));
    }
    text(py, "idempotency_key", key)
}

/// A random UUID v4 key.
#[pyfunction]
pub fn new_key() -> String {
    IdempotencyKey::random().as_str().to_owned()
}

/// The stable key of one business intent (the same in Rust, Python and Node).
#[pyfunction]
pub fn derive_key(
    py: Python<'_>,
    business_id: &Bound<'_, PyAny>,
    operation: &Bound<'_, PyAny>,
) -> PyResult<String> {
    let business_id = text(py, "business_id", business_id)?;
    let operation = text(py, "operation", operation)?;
    IdempotencyKey::derive(&business_id, &operation)
        .map(|k| k.as_str().to_owned())
        .py(py)
}

/// Returns `key` if it matches `[A-Za-z0-9_-]{8,64}`; raises `InvalidKeyError` (or
/// `MissingKeyError` for the empty string) otherwise.
#[pyfunction]
pub fn validate_key(py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<String> {
    IdempotencyKey::parse(&key_text(py, key)?)
        .map(|k| k.as_str().to_owned())
        .py(py)
}

/// The key a store deduplicates by: tenant + method + idempotency key, encoded
/// injectively. Build it with `oncely.scope(tenant, method, key)`.
#[pyclass(frozen, module = "oncely", eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ScopedKey {
    pub inner: CoreScopedKey,
}

#[pymethods]
impl ScopedKey {
    fn __str__(&self) -> &str {
        self.inner.as_str()
    }
    fn __repr__(&self) -> String {
        format!("ScopedKey({:?})", self.inner.as_str())
    }
    /// The encoded scoped key (`v1:<tenant>:<method>:<key>`).
    #[getter]
    fn value(&self) -> &str {
        self.inner.as_str()
    }
}

/// Scopes an idempotency key to a tenant and a method.
#[pyfunction]
pub fn scope(
    py: Python<'_>,
    tenant: &Bound<'_, PyAny>,
    method: &Bound<'_, PyAny>,
    key: &Bound<'_, PyAny>,
) -> PyResult<ScopedKey> {
    // The key is checked first, then the tenant, then the method (SPEC §5).
    let key = IdempotencyKey::parse(&key_text(py, key)?).py(py)?;
    let tenant = text(py, "tenant", tenant)?;
    let method = text(py, "method", method)?;
    CoreScopedKey::new(&tenant, &method, &key)
        .map(|inner| ScopedKey { inner })
        .py(py)
}

/// SHA-256 (hex) of the canonical JSON (RFC 8785) of a JSON-like value.
#[pyfunction]
pub fn fingerprint(py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<String> {
    let v = to_json(py, value, 0)?;
    oncely::fingerprint(&v).py(py)
}

/// The canonical JSON (RFC 8785) bytes of a JSON-like value.
#[pyfunction]
pub fn canonical_json<'py>(
    py: Python<'py>,
    value: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let v = to_json(py, value, 0)?;
    let bytes = oncely::canonical_json(&v).py(py)?;
    Ok(PyBytes::new(py, &bytes))
}

/// SHA-256 (hex) of raw request bytes.
#[pyfunction]
pub fn fingerprint_bytes(data: &[u8]) -> String {
    oncely::fingerprint_bytes(data)
}

/// Adds the header and status constants to the module.
pub fn add_constants(m: &Bound<'_, PyModule>) -> PyResult<()> {
    use oncely::{headers, http_status};
    m.add("GRPC_IDEMPOTENCY_KEY", headers::GRPC_IDEMPOTENCY_KEY)?;
    m.add("HTTP_IDEMPOTENCY_KEY", headers::HTTP_IDEMPOTENCY_KEY)?;
    m.add(
        "HTTP_IDEMPOTENT_REPLAYED",
        headers::HTTP_IDEMPOTENT_REPLAYED,
    )?;
    m.add("HTTP_RETRY_AFTER", headers::HTTP_RETRY_AFTER)?;
    m.add("GRPC_RETRY_PUSHBACK_MS", headers::GRPC_RETRY_PUSHBACK_MS)?;
    m.add(
        "GRPC_PREVIOUS_RPC_ATTEMPTS",
        headers::GRPC_PREVIOUS_RPC_ATTEMPTS,
    )?;
    m.add("HTTP_STATUS_MISSING_KEY", http_status::MISSING_KEY)?;
    m.add(
        "HTTP_STATUS_FINGERPRINT_MISMATCH",
        http_status::FINGERPRINT_MISMATCH,
    )?;
    m.add("HTTP_STATUS_IN_PROGRESS", http_status::IN_PROGRESS)?;
    m.add("KEY_MIN_LEN", oncely::KEY_MIN_LEN)?;
    m.add("KEY_MAX_LEN", oncely::KEY_MAX_LEN)?;
    m.add("DEFAULT_TTL", oncely::DEFAULT_TTL.as_secs_f64())?;
    Ok(())
}
