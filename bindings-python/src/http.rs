//! The server contract (`oncely::http`, SPEC §8) for the Python adapters
//! (`oncely.asgi`, `oncely.wsgi`): covered methods, the key, the scope, the request
//! fingerprint, which responses are stored and with which headers, the stored-response
//! record and the problem bodies. Conversions only: every decision is the core's.

use std::time::Duration;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use oncely::http::{self, KeyDecision};
use oncely::{Error, IdempotencyKey};

use crate::convert::{int_in, text_list};
use crate::errors::{flag, IntoPyResult};
use crate::keys::ScopedKey;

/// An optional argument given and not `None`.
fn present<'a, 'py>(obj: Option<&'a Bound<'py, PyAny>>) -> Option<&'a Bound<'py, PyAny>> {
    obj.filter(|o| !o.is_none())
}

/// The adapter settings of the contract (Rust `oncely::http::ServerConfig`).
#[pyclass(frozen, module = "oncely.http", name = "ServerConfig")]
pub struct PyServerConfig {
    inner: http::ServerConfig,
}

#[pymethods]
impl PyServerConfig {
    #[new]
    #[pyo3(signature = (*, methods=None, required=None, wait=None, body_cap=None, request_cap=None, stored_headers=None, grpc_methods=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        methods: Option<&Bound<'_, PyAny>>,
        required: Option<&Bound<'_, PyAny>>,
        wait: Option<&Bound<'_, PyAny>>,
        body_cap: Option<&Bound<'_, PyAny>>,
        request_cap: Option<&Bound<'_, PyAny>>,
        stored_headers: Option<&Bound<'_, PyAny>>,
        grpc_methods: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut c = http::ServerConfig::new()
            .required(flag(present(required), "required", true)?)
            .wait(flag(present(wait), "wait", true)?);
        if let Some(cap) = present(body_cap) {
            c = c.body_cap(int_in(py, "body_cap", cap, 0, usize::MAX as i128)? as usize);
        }
        if let Some(cap) = present(request_cap) {
            c = c.request_cap(int_in(py, "request_cap", cap, 0, usize::MAX as i128)? as usize);
        }
        if let Some(m) = present(methods) {
            c = c.methods(text_list(py, "methods", m)?).py(py)?;
        }
        if let Some(h) = present(stored_headers) {
            c = c
                .stored_headers(text_list(py, "stored_headers", h)?)
                .py(py)?;
        }
        if let Some(g) = present(grpc_methods) {
            c = c.grpc_methods(text_list(py, "grpc_methods", g)?).py(py)?;
        }
        Ok(PyServerConfig { inner: c })
    }

    /// Whether requests with this method go through the dedup store.
    fn covers(&self, method: &str) -> bool {
        self.inner.covers(method)
    }

    /// Whether the gRPC call `full_method` goes through the dedup store.
    fn covers_grpc(&self, full_method: &str) -> bool {
        self.inner.covers_grpc(full_method)
    }

    /// Whether the response header `name` (any case) is stored with the body.
    fn stores_header(&self, name: &str) -> bool {
        self.inner.stores_header(name)
    }

    /// Whether the response header `name` (any case) is given to the duplicates that
    /// waited for a response that is not stored (every header but the never-stored
    /// ones; `set-cookie` only when stored).
    fn shares_header(&self, name: &str) -> bool {
        self.inner.shares_header(name)
    }

    /// Whether the gRPC response metadata `name` is stored.
    fn stores_grpc_header(&self, name: &str) -> bool {
        self.inner.stores_grpc_header(name)
    }

    /// Whether a body of `length` bytes may be stored.
    fn body_fits(&self, length: usize) -> bool {
        self.inner.body_fits(length)
    }

    /// Whether a covered request without a key is refused.
    #[getter]
    fn required(&self) -> bool {
        self.inner.is_required()
    }

    /// Whether a running duplicate is waited for (else 409).
    #[getter]
    fn wait(&self) -> bool {
        self.inner.waits()
    }

    /// The largest response body stored, in bytes.
    #[getter]
    fn body_cap(&self) -> usize {
        self.inner.cap()
    }

    /// The largest request body of a covered request, in bytes.
    #[getter]
    fn request_cap(&self) -> usize {
        self.inner.request_limit()
    }

    /// Whether a request's `Content-Length` value declares a body over the request cap
    /// (it is refused with `too_large()` before its body is read).
    fn declares_too_large(&self, content_length: &[u8]) -> bool {
        self.inner.declares_too_large(content_length)
    }

    /// The problem for a request over the request cap (413).
    fn too_large(&self) -> PyProblem {
        PyProblem {
            inner: self.inner.too_large(),
        }
    }

    /// What to do with a request: `None` (pass it through), the key (`str`: dedup by
    /// it) or the `Problem` to answer with. `values` are the `Idempotency-Key` header
    /// values of the request.
    fn read_key(&self, py: Python<'_>, method: &str, values: Vec<Vec<u8>>) -> PyResult<Py<PyAny>> {
        let refs: Vec<&[u8]> = values.iter().map(Vec::as_slice).collect();
        decision(py, self.inner.read_key(method, &refs))
    }

    /// `read_key` for the gRPC call `full_method` and its `x-idempotency-key` values.
    fn read_grpc_key(
        &self,
        py: Python<'_>,
        full_method: &str,
        values: Vec<Vec<u8>>,
    ) -> PyResult<Py<PyAny>> {
        let refs: Vec<&[u8]> = values.iter().map(Vec::as_slice).collect();
        decision(py, self.inner.read_grpc_key(full_method, &refs))
    }
}

fn decision(py: Python<'_>, d: Result<KeyDecision, http::Problem>) -> PyResult<Py<PyAny>> {
    Ok(match d {
        Ok(KeyDecision::PassThrough) => py.None(),
        Ok(KeyDecision::Dedup(key)) => key.as_str().into_pyobject(py)?.into_any().unbind(),
        Err(p) => Py::new(py, PyProblem { inner: p })?.into_any(),
    })
}

/// The scoped key of a request: `tenant` and `"<method> <route>"` (Rust `http::scope`).
#[pyfunction]
pub fn http_scope(
    py: Python<'_>,
    tenant: &Bound<'_, PyAny>,
    method: &Bound<'_, PyAny>,
    route: &Bound<'_, PyAny>,
    key: &Bound<'_, PyAny>,
) -> PyResult<ScopedKey> {
    // As `oncely.scope`: the key first, then the tenant (SPEC §5); a str that is not
    // Unicode (a lone surrogate) or another type is the named field's error.
    let key = IdempotencyKey::parse(&crate::convert::text(py, "idempotency_key", key)?).py(py)?;
    let tenant = crate::convert::text(py, "tenant", tenant)?;
    let method = crate::convert::text(py, "method", method)?;
    let route = crate::convert::text(py, "route", route)?;
    http::scope(&tenant, &method, &route, &key)
        .map(|inner| ScopedKey { inner })
        .py(py)
}

/// The request fingerprint of SPEC §8 (method, target, JSON-canonical or raw body).
#[pyfunction]
#[pyo3(signature = (method, target, content_type, body))]
pub fn request_fingerprint(
    py: Python<'_>,
    method: &str,
    target: &str,
    content_type: Option<&str>,
    body: &[u8],
) -> String {
    py.detach(|| http::request_fingerprint(method, target, content_type, body))
}

/// The length a `Content-Length` value declares: decimal digits with optional spaces
/// and tabs around them (`2**64 - 1` for a number past it); `None` for anything else.
#[pyfunction]
pub fn declared_length(content_length: &[u8]) -> Option<u64> {
    http::declared_length(content_length)
}

/// Whether a response to `method` with `status` carries content (RFC 9110 §6.4.1): not
/// one to a HEAD, nor a 1xx, 204 or 304. Its record keeps no body.
#[pyfunction]
pub fn has_content(method: &str, status: u16) -> bool {
    http::has_content(method, status)
}

/// Whether a response with this status is stored.
#[pyfunction]
pub fn storable_status(status: u16) -> bool {
    http::storable_status(status)
}

/// Whether a gRPC answer with this `grpc-status` value is stored.
#[pyfunction]
pub fn storable_grpc_status(value: &[u8]) -> bool {
    http::storable_grpc_status(value)
}

/// Whether the content type is JSON.
#[pyfunction]
pub fn is_json(content_type: &str) -> bool {
    http::is_json(content_type)
}

/// Whether the content type is an event stream (`text/event-stream`): sent as it is
/// produced, never read ahead to the cap.
#[pyfunction]
pub fn is_event_stream(content_type: &str) -> bool {
    http::is_event_stream(content_type)
}

/// Whether the content type is gRPC.
#[pyfunction]
pub fn is_grpc(content_type: &str) -> bool {
    http::is_grpc(content_type)
}

type Pairs = Vec<(String, Vec<u8>)>;

/// The stored-response record (Rust `StoredResponse::encode`) of a response.
#[pyfunction]
#[pyo3(signature = (status, headers, body, trailers=Vec::new()))]
pub fn encode_response<'py>(
    py: Python<'py>,
    status: u16,
    headers: Pairs,
    body: Vec<u8>,
    trailers: Pairs,
) -> Bound<'py, PyBytes> {
    let record = http::StoredResponse {
        status,
        headers,
        body,
        trailers,
    };
    PyBytes::new(py, &record.encode())
}

/// Reads a stored-response record: `(status, headers, body, trailers)`, the header and
/// trailer lists as `(name, value)` pairs of `str` and `bytes`. Anything that is not a
/// record raises `StoreUnavailableError`.
#[pyfunction]
pub fn decode_response<'py>(py: Python<'py>, record: &[u8]) -> PyResult<Bound<'py, PyTuple>> {
    let r = http::StoredResponse::decode(record).py(py)?;
    let pairs = |list: &[(String, Vec<u8>)]| -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for (n, v) in list {
            out.append((n.as_str(), PyBytes::new(py, v)))?;
        }
        Ok(out)
    };
    (
        r.status,
        pairs(&r.headers)?,
        PyBytes::new(py, &r.body),
        pairs(&r.trailers)?,
    )
        .into_pyobject(py)
}

/// An RFC 9457 problem answer (Rust `http::Problem`).
#[pyclass(frozen, module = "oncely.http", name = "Problem")]
pub struct PyProblem {
    inner: http::Problem,
}

#[pymethods]
impl PyProblem {
    /// The problem for an oncely exception (an `OncelyError`, read by its `kind`).
    #[staticmethod]
    fn from_error(error: &Bound<'_, PyAny>) -> PyResult<Self> {
        let err = error_of(error)?;
        let mut p = http::Problem::from_error(&err);
        if !matches!(err, Error::MissingKey) {
            // The exception's message is the core error's text: keep it whole.
            p.detail = error.str()?.to_string();
        }
        Ok(PyProblem { inner: p })
    }

    /// A covered request whose body is over `cap` bytes (413).
    #[staticmethod]
    fn request_too_large(cap: usize) -> Self {
        PyProblem {
            inner: http::Problem::request_too_large(cap),
        }
    }

    /// A covered request whose body could not be read (400).
    #[staticmethod]
    fn request_body_unreadable(detail: &str) -> Self {
        PyProblem {
            inner: http::Problem::request_body_unreadable(detail),
        }
    }

    /// The tenant function gave a tenant no key can be scoped by (500).
    #[staticmethod]
    fn tenant_unusable(reason: &str) -> Self {
        PyProblem {
            inner: http::Problem::tenant_unusable(reason),
        }
    }

    /// The HTTP status.
    #[getter]
    fn status(&self) -> u16 {
        self.inner.status
    }

    /// The problem type URI (`urn:oncely:problem:<slug>`).
    #[getter]
    fn r#type(&self) -> &'static str {
        self.inner.type_uri
    }

    /// The short summary of the kind.
    #[getter]
    fn title(&self) -> &'static str {
        self.inner.title
    }

    /// What happened and what to do.
    #[getter]
    fn detail(&self) -> &str {
        &self.inner.detail
    }

    /// The gRPC code name (e.g. `"INVALID_ARGUMENT"`).
    #[getter]
    fn code(&self) -> &'static str {
        self.inner.code.as_str()
    }

    /// The gRPC code number.
    #[getter]
    fn grpc_code(&self) -> u8 {
        self.inner.code as u8
    }

    /// The `Retry-After` delay in seconds, if any.
    #[getter]
    fn retry_after(&self) -> Option<f64> {
        self.inner.retry_after.map(|d| d.as_secs_f64())
    }

    /// The headers to send, `(name, value)` text pairs.
    fn headers(&self) -> Vec<(&'static str, String)> {
        self.inner.headers()
    }

    /// The gRPC answer's metadata, `(name, value)` text pairs.
    fn grpc_metadata(&self) -> Vec<(&'static str, String)> {
        self.inner.grpc_metadata()
    }

    /// The `application/problem+json` body.
    fn body<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.body())
    }

    fn __repr__(&self) -> String {
        format!("Problem({})", self.inner)
    }
}

/// The core error an `oncely.errors` exception stands for, rebuilt from its `kind` and
/// attributes.
fn error_of(exc: &Bound<'_, PyAny>) -> PyResult<Error> {
    let attr = |name: &str| exc.getattr(name);
    let text = |name: &str| -> PyResult<String> { attr(name)?.extract::<String>() };
    let kind: String = attr("kind").and_then(|k| k.extract()).map_err(|_| {
        PyTypeError::new_err("Problem.from_error needs an oncely error (with .kind)")
    })?;
    Ok(match kind.as_str() {
        "missing_key" => Error::MissingKey,
        "invalid_argument" => Error::InvalidArgument {
            field: "idempotency_key",
            reason: exc.str()?.to_string(),
        },
        "fingerprint_mismatch" => Error::FingerprintMismatch,
        "in_progress" => {
            let secs: f64 = attr("retry_after")?.extract()?;
            Error::InProgress {
                retry_after: Duration::try_from_secs_f64(secs).unwrap_or(Duration::from_secs(1)),
            }
        }
        "lease_lost" => Error::LeaseLost,
        "capacity" => Error::Capacity {
            max_entries: attr("max_entries")?.extract()?,
        },
        "unavailable" => Error::Unavailable(exc.str()?.to_string()),
        "leader_panicked" => Error::LeaderPanicked(exc.str()?.to_string()),
        "reentrant" => Error::Reentrant { key: text("key")? },
        "result_not_stored" => Error::ResultNotStored {
            key: text("key")?,
            type_name: text("type_name")?,
        },
        other => {
            return Err(PyTypeError::new_err(format!(
                "Problem.from_error: unknown oncely error kind {other:?}"
            )))
        }
    })
}

/// Adds the contract's constants to the module (prefixed `HTTP_` where the name is
/// otherwise ambiguous).
pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyServerConfig>()?;
    m.add_class::<PyProblem>()?;
    m.add_function(wrap_pyfunction!(http_scope, m)?)?;
    m.add_function(wrap_pyfunction!(request_fingerprint, m)?)?;
    m.add_function(wrap_pyfunction!(storable_status, m)?)?;
    m.add_function(wrap_pyfunction!(has_content, m)?)?;
    m.add_function(wrap_pyfunction!(declared_length, m)?)?;
    m.add_function(wrap_pyfunction!(storable_grpc_status, m)?)?;
    m.add_function(wrap_pyfunction!(is_json, m)?)?;
    m.add_function(wrap_pyfunction!(is_grpc, m)?)?;
    m.add_function(wrap_pyfunction!(is_event_stream, m)?)?;
    m.add_function(wrap_pyfunction!(encode_response, m)?)?;
    m.add_function(wrap_pyfunction!(decode_response, m)?)?;
    m.add("HTTP_KEY_HEADER", http::KEY_HEADER)?;
    m.add("HTTP_GRPC_KEY_METADATA", http::GRPC_KEY_METADATA)?;
    m.add("HTTP_REPLAYED_HEADER", http::REPLAYED_HEADER)?;
    m.add("HTTP_REPLAYED_VALUE", http::REPLAYED_VALUE)?;
    m.add("HTTP_PROBLEM_CONTENT_TYPE", http::PROBLEM_CONTENT_TYPE)?;
    m.add("HTTP_DEFAULT_METHODS", http::DEFAULT_METHODS.to_vec())?;
    m.add("HTTP_DEFAULT_BODY_CAP", http::DEFAULT_BODY_CAP)?;
    m.add("HTTP_DEFAULT_REQUEST_CAP", http::DEFAULT_REQUEST_CAP)?;
    m.add(
        "HTTP_DEFAULT_STORED_HEADERS",
        http::DEFAULT_STORED_HEADERS.to_vec(),
    )?;
    m.add("HTTP_DEFAULT_TENANT", http::DEFAULT_TENANT)?;
    Ok(())
}
