//! Host input → core types: seconds (float or `datetime.timedelta`), bounded integers
//! and JSON-like values. Bad input is a clear Python exception, never a crash.

use std::time::Duration;

use pyo3::exceptions::PyOverflowError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde_json::{Map, Number, Value};

use crate::errors::{invalid, wrong_type, IntoPyResult};

/// Seconds given as `int`, `float` or `datetime.timedelta`, validated by the core
/// (finite, not negative, not too large).
pub fn seconds(py: Python<'_>, field: &'static str, obj: &Bound<'_, PyAny>) -> PyResult<Duration> {
    let secs = seconds_f64(field, obj)?;
    oncely::duration_from_secs_f64(field, secs).py(py)
}

fn seconds_f64(field: &'static str, obj: &Bound<'_, PyAny>) -> PyResult<f64> {
    if obj.is_instance_of::<PyBool>() {
        return Err(wrong_type(field, "seconds (float or timedelta)", obj));
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Ok(f.value());
    }
    if obj.is_instance_of::<PyInt>() {
        return int_as_f64(obj);
    }
    if let Ok(total) = obj.getattr(pyo3::intern!(obj.py(), "total_seconds")) {
        if obj.getattr("days").is_ok() {
            return total.call0()?.extract::<f64>();
        }
    }
    Err(wrong_type(field, "seconds (float or timedelta)", obj))
}

/// A Python int as a float: one beyond a double's range becomes an infinity of its sign,
/// which the core's checks refuse as too large (Python itself raises `OverflowError`).
fn int_as_f64(obj: &Bound<'_, PyAny>) -> PyResult<f64> {
    match obj.extract::<f64>() {
        Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => {
            let negative = obj.lt(0)?;
            Ok(if negative {
                f64::NEG_INFINITY
            } else {
                f64::INFINITY
            })
        }
        other => other,
    }
}

/// Optional seconds: `None` stays `None`.
pub fn opt_seconds(
    py: Python<'_>,
    field: &'static str,
    obj: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<Duration>> {
    match obj {
        None => Ok(None),
        Some(o) if o.is_none() => Ok(None),
        Some(o) => seconds(py, field, o).map(Some),
    }
}

/// An integer in `min..=max`; anything else names `field`.
pub fn int_in(
    py: Python<'_>,
    field: &'static str,
    obj: &Bound<'_, PyAny>,
    min: i128,
    max: i128,
) -> PyResult<i128> {
    if obj.is_instance_of::<PyBool>() || !obj.is_instance_of::<PyInt>() {
        return Err(wrong_type(field, "an int", obj));
    }
    let n = match obj.extract::<i128>() {
        Ok(n) => n,
        Err(e) if e.is_instance_of::<PyOverflowError>(py) => {
            return Err(invalid(
                py,
                field,
                format!("must be in {min}..={max}, got a larger number"),
            ))
        }
        Err(e) => return Err(e),
    };
    if n < min || n > max {
        return Err(invalid(
            py,
            field,
            format!("must be in {min}..={max}, got {n}"),
        ));
    }
    Ok(n)
}

/// A finite float (ints accepted); NaN and infinities name `field`.
pub fn finite(py: Python<'_>, field: &'static str, obj: &Bound<'_, PyAny>) -> PyResult<f64> {
    if obj.is_instance_of::<PyBool>()
        || !(obj.is_instance_of::<PyFloat>() || obj.is_instance_of::<PyInt>())
    {
        return Err(wrong_type(field, "a number", obj));
    }
    let v = if obj.is_instance_of::<PyInt>() {
        int_as_f64(obj)?
    } else {
        obj.extract()?
    };
    if !v.is_finite() {
        return Err(invalid(
            py,
            field,
            format!("must be a finite number, got {v}"),
        ));
    }
    Ok(v)
}

/// The UTF-8 text of a `str` argument. A `str` holding a lone surrogate (U+D800..U+DFFF
/// alone, which Python allows and UTF-8 cannot hold) is INVALID_ARGUMENT naming `field`,
/// as in Node, rather than a bare `UnicodeEncodeError`.
pub fn text<'a>(
    py: Python<'_>,
    field: &'static str,
    obj: &'a Bound<'_, PyAny>,
) -> PyResult<std::borrow::Cow<'a, str>> {
    let s = obj
        .cast::<PyString>()
        .map_err(|_| wrong_type(field, "a str", obj))?;
    s.to_cow().map_err(|_| {
        invalid(
            py,
            field,
            "must be valid Unicode: it holds a lone surrogate (U+D800..U+DFFF)",
        )
    })
}

/// Deepest nesting accepted by [`to_json`]: deeper input (or a cycle) is refused
/// instead of exhausting the stack.
pub const MAX_DEPTH: usize = 256;

/// A JSON-like Python value (dict with str keys, list, tuple, str, int, float, bool,
/// None) as a `serde_json::Value`, for the core's canonical JSON. Ints beyond 64 bits
/// become the nearest double, as RFC 8785 (and JavaScript) treat every number.
pub fn to_json(py: Python<'_>, obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<Value> {
    if depth > MAX_DEPTH {
        return Err(invalid(
            py,
            "value",
            format!("is nested deeper than {MAX_DEPTH} levels (or contains a cycle)"),
        ));
    }
    if obj.is_none() {
        return Ok(Value::Null);
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if obj.is_instance_of::<PyString>() {
        return Ok(Value::String(text(py, "value", obj)?.into_owned()));
    }
    if obj.is_instance_of::<PyInt>() {
        if let Ok(n) = obj.extract::<i64>() {
            return Ok(Value::Number(n.into()));
        }
        if let Ok(n) = obj.extract::<u64>() {
            return Ok(Value::Number(n.into()));
        }
        let f: f64 = obj.extract().map_err(|_| {
            invalid(
                py,
                "value",
                "an int beyond the range of a double is not a JSON number",
            )
        })?;
        return float_value(py, f);
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return float_value(py, f.value());
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        let mut map = Map::new();
        for (k, v) in d.iter() {
            let key = k.cast::<PyString>().map_err(|_| {
                invalid(
                    py,
                    "value",
                    format!(
                        "object keys must be str, got {}",
                        k.get_type()
                            .name()
                            .map(|n| n.to_string())
                            .unwrap_or_default()
                    ),
                )
            })?;
            map.insert(
                text(py, "value", key.as_any())?.into_owned(),
                to_json(py, &v, depth + 1)?,
            );
        }
        return Ok(Value::Object(map));
    }
    if let Ok(l) = obj.cast::<PyList>() {
        let mut out = Vec::with_capacity(l.len());
        for item in l.iter() {
            out.push(to_json(py, &item, depth + 1)?);
        }
        return Ok(Value::Array(out));
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        let mut out = Vec::with_capacity(t.len());
        for item in t.iter() {
            out.push(to_json(py, &item, depth + 1)?);
        }
        return Ok(Value::Array(out));
    }
    Err(invalid(
        py,
        "value",
        format!(
            "cannot be written as JSON: {} is not one of dict, list, tuple, str, int, float, bool, None",
            obj.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ),
    ))
}

fn float_value(py: Python<'_>, f: f64) -> PyResult<Value> {
    Number::from_f64(f)
        .map(Value::Number)
        .ok_or_else(|| invalid(py, "value", format!("{f} is not a JSON number")))
}

/// A sequence of `str` (list, tuple, ...; a lone `str` or `bytes` is refused: it would
/// be read as its characters); anything else names `field`.
pub fn text_list(
    py: Python<'_>,
    field: &'static str,
    obj: &Bound<'_, PyAny>,
) -> PyResult<Vec<String>> {
    let wrong = || wrong_type(field, "a sequence of str", obj);
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<pyo3::types::PyBytes>() {
        return Err(wrong());
    }
    let seq = obj.cast::<pyo3::types::PySequence>().map_err(|_| wrong())?;
    let mut out = Vec::with_capacity(seq.len().unwrap_or(0));
    for item in seq.try_iter()? {
        let item = item?;
        if !item.is_instance_of::<PyString>() {
            return Err(wrong_type(field, "a sequence of str", &item));
        }
        out.push(text(py, field, &item)?.into_owned());
    }
    Ok(out)
}
