//! The one mapping from the core's [`oncely::Error`] to the Python exception hierarchy
//! of `oncely.errors` (defined in Python, so that `InvalidArgumentError` can also be a
//! `ValueError`).

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyType};

use oncely::Error;

const ERRORS: &str = "oncely.errors";

macro_rules! class {
    ($py:expr, $name:literal) => {{
        static CELL: PyOnceLock<Py<PyType>> = PyOnceLock::new();
        CELL.import($py, ERRORS, $name)
    }};
}

/// Converts a core error into the matching `oncely.errors` exception.
///
/// | core | Python | code |
/// |---|---|---|
/// | `InvalidArgument { field: "idempotency_key" }` | `InvalidKeyError` | INVALID_ARGUMENT |
/// | `InvalidArgument { field }` | `InvalidArgumentError` (a `ValueError`) | INVALID_ARGUMENT |
/// | `MissingKey` | `MissingKeyError` (an `InvalidKeyError`) | INVALID_ARGUMENT |
/// | `FingerprintMismatch` | `FingerprintMismatchError` | FAILED_PRECONDITION |
/// | `InProgress { retry_after }` | `InProgressError` (`.retry_after` in seconds) | ABORTED |
/// | `LeaseLost` | `LeaseLostError` | ABORTED |
/// | `Capacity { max_entries }` | `CapacityError` (`.max_entries`) | RESOURCE_EXHAUSTED |
/// | `Unavailable(_)` | `StoreUnavailableError` | UNAVAILABLE |
/// | `LeaderPanicked(_)` | `LeaderPanickedError` | INTERNAL |
/// | a variant added later | `OncelyError` with the variant's code | its code |
pub fn to_py(py: Python<'_>, err: Error) -> PyErr {
    match build(py, &err) {
        Ok(e) => e,
        Err(e) => e,
    }
}

/// [`to_py`] as the exception object itself (for handing to waiters).
pub fn to_py_value(py: Python<'_>, err: Error) -> Py<PyAny> {
    to_py(py, err).into_value(py).into_any()
}

fn build(py: Python<'_>, err: &Error) -> PyResult<PyErr> {
    let message = err.to_string();
    let kwargs = PyDict::new(py);
    let cls = match err {
        Error::InvalidArgument { field, .. } => {
            kwargs.set_item("field", *field)?;
            if *field == "idempotency_key" {
                class!(py, "InvalidKeyError")?
            } else {
                class!(py, "InvalidArgumentError")?
            }
        }
        Error::MissingKey => {
            kwargs.set_item("field", "idempotency_key")?;
            class!(py, "MissingKeyError")?
        }
        Error::FingerprintMismatch => class!(py, "FingerprintMismatchError")?,
        Error::InProgress { retry_after } => {
            kwargs.set_item("retry_after", retry_after.as_secs_f64())?;
            class!(py, "InProgressError")?
        }
        Error::LeaseLost => class!(py, "LeaseLostError")?,
        Error::Capacity { max_entries } => {
            kwargs.set_item("max_entries", *max_entries)?;
            class!(py, "CapacityError")?
        }
        Error::Unavailable(_) => class!(py, "StoreUnavailableError")?,
        Error::LeaderPanicked(_) => class!(py, "LeaderPanickedError")?,
        Error::Reentrant { key } => {
            kwargs.set_item("key", key)?;
            class!(py, "ReentrantCallError")?
        }
        Error::ResultNotStored { key, type_name } => {
            kwargs.set_item("key", key)?;
            kwargs.set_item("type_name", type_name)?;
            class!(py, "ResultNotStoredError")?
        }
        // `Error` is non-exhaustive: a variant added to the core later still surfaces
        // as an `OncelyError` carrying its code.
        other => {
            kwargs.set_item("code", other.code() as u8)?;
            class!(py, "OncelyError")?
        }
    };
    let exc = cls.call((message,), Some(&kwargs))?;
    exc.setattr("kind", err.kind())?;
    exc.setattr("http_status", err.http_status())?;
    Ok(PyErr::from_value(exc))
}

/// An INVALID_ARGUMENT error naming `field`, raised for bad host input.
pub fn invalid(py: Python<'_>, field: &'static str, reason: impl Into<String>) -> PyErr {
    to_py(
        py,
        Error::InvalidArgument {
            field,
            reason: reason.into(),
        },
    )
}

/// An `ArgumentTypeError` (an `InvalidArgumentError` that is also a `TypeError`)
/// naming the argument, the type it wants and the type it got.
pub fn wrong_type(field: &str, expected: &str, got: &Bound<'_, PyAny>) -> PyErr {
    let py = got.py();
    let name = got
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".to_owned());
    let message = format!("{field} must be {expected}, not {name}");
    let build = || -> PyResult<PyErr> {
        let kwargs = PyDict::new(py);
        kwargs.set_item("field", field)?;
        let exc = class!(py, "ArgumentTypeError")?.call((message.as_str(),), Some(&kwargs))?;
        let sample = Error::InvalidArgument {
            field: "",
            reason: String::new(),
        };
        exc.setattr("kind", sample.kind())?;
        exc.setattr("http_status", sample.http_status())?;
        Ok(PyErr::from_value(exc))
    };
    build().unwrap_or_else(|e| e)
}

/// A `str` argument; anything else is a [`wrong_type`] error naming `field`.
pub fn text(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<String> {
    match obj.cast::<pyo3::types::PyString>() {
        Ok(s) => s.extract::<String>(),
        Err(_) => Err(wrong_type(field, "a str", obj)),
    }
}

/// Maps a core result into a Python one.
pub trait IntoPyResult<T> {
    /// Converts the error with [`to_py`].
    fn py(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for Result<T, Error> {
    fn py(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py(py, e))
    }
}

/// A `bool` argument (absent or `None`: `default`); anything else is a [`wrong_type`]
/// error naming `field`.
pub fn flag(obj: Option<&Bound<'_, PyAny>>, field: &str, default: bool) -> PyResult<bool> {
    match obj {
        None => Ok(default),
        Some(o) => match o.cast::<pyo3::types::PyBool>() {
            Ok(b) => Ok(b.is_true()),
            Err(_) => Err(wrong_type(field, "a bool", o)),
        },
    }
}

/// An argument that must be an instance of the class `T` (absent or `None`: `None`);
/// anything else is a [`wrong_type`] error naming `field`.
pub fn instance<'a, 'py, T: pyo3::PyTypeInfo>(
    obj: Option<&'a Bound<'py, PyAny>>,
    field: &str,
    expected: &str,
) -> PyResult<Option<&'a Bound<'py, T>>> {
    match obj {
        None => Ok(None),
        Some(o) => o
            .cast::<T>()
            .map(Some)
            .map_err(|_| wrong_type(field, expected, o)),
    }
}
