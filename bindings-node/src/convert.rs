//! Reading JavaScript arguments and option objects, with errors that name the field:
//! a wrong type is a `TypeError`, a value out of range a `RangeError` (the range itself
//! is the core's: durations go through `duration_from_millis_f64`, policies through
//! `RetryPolicy::validate`).

use std::ffi::CStr;
use std::ptr;
use std::time::Duration;

use napi::sys;

use crate::errors::{js_field, range_error, type_error, OrThrow};

/// Longest string accepted where a short one is expected (keys, tenants, methods,
/// fingerprints, header values), before the core's own, tighter, check. Keeps a
/// mistaken multi-megabyte argument from being copied at all.
pub(crate) const SHORT_STRING_MAX: usize = 64 * 1024;

pub(crate) fn type_of(env: sys::napi_env, v: sys::napi_value) -> sys::napi_valuetype {
    let mut t = 0;
    // SAFETY: `v` is a live value of the current call.
    unsafe { sys::napi_typeof(env, v, &mut t) };
    t
}

pub(crate) fn type_name(env: sys::napi_env, v: sys::napi_value) -> &'static str {
    match type_of(env, v) {
        sys::ValueType::napi_undefined => "undefined",
        sys::ValueType::napi_null => "null",
        sys::ValueType::napi_boolean => "a boolean",
        sys::ValueType::napi_number => "a number",
        sys::ValueType::napi_string => "a string",
        sys::ValueType::napi_symbol => "a symbol",
        sys::ValueType::napi_function => "a function",
        sys::ValueType::napi_bigint => "a bigint",
        _ => "an object",
    }
}

pub(crate) fn is_nullish(env: sys::napi_env, v: sys::napi_value) -> bool {
    v.is_null()
        || matches!(
            type_of(env, v),
            sys::ValueType::napi_undefined | sys::ValueType::napi_null
        )
}

/// A number argument: must be a JavaScript number (NaN and infinities are left to the
/// caller's range check).
pub(crate) fn number(env: sys::napi_env, v: sys::napi_value, field: &str) -> napi::Result<f64> {
    if type_of(env, v) != sys::ValueType::napi_number {
        return Err(type_error(
            env,
            field,
            &format!("{field} must be a number, got {}", type_name(env, v)),
        ));
    }
    let mut n = 0.0;
    // SAFETY: `v` is a number.
    unsafe { sys::napi_get_value_double(env, v, &mut n) };
    Ok(n)
}

/// An integer in `min..=max` given as a number.
pub(crate) fn integer(
    env: sys::napi_env,
    v: sys::napi_value,
    field: &str,
    min: f64,
    max: f64,
) -> napi::Result<f64> {
    let n = number(env, v, field)?;
    if !n.is_finite() || n.fract() != 0.0 {
        return Err(range_error(
            env,
            field,
            &format!("must be an integer, got {}", fmt_num(n)),
        ));
    }
    if n < min || n > max {
        return Err(range_error(
            env,
            field,
            &format!("must be in {min}..={max}, got {}", fmt_num(n)),
        ));
    }
    Ok(n)
}

/// A duration in milliseconds, checked by the core's converter.
pub(crate) fn millis(
    env: sys::napi_env,
    v: sys::napi_value,
    core_field: &'static str,
) -> napi::Result<Duration> {
    let n = number(env, v, js_field(core_field))?;
    oncely::duration_from_millis_f64(core_field, n).or_throw(env)
}

pub(crate) fn boolean(env: sys::napi_env, v: sys::napi_value, field: &str) -> napi::Result<bool> {
    if type_of(env, v) != sys::ValueType::napi_boolean {
        return Err(type_error(
            env,
            field,
            &format!("{field} must be a boolean, got {}", type_name(env, v)),
        ));
    }
    let mut b = false;
    // SAFETY: `v` is a boolean.
    unsafe { sys::napi_get_value_bool(env, v, &mut b) };
    Ok(b)
}

/// A non-empty array of strings (each at most `max` bytes).
pub(crate) fn string_array(
    env: sys::napi_env,
    v: sys::napi_value,
    field: &str,
    max: usize,
) -> napi::Result<Vec<String>> {
    let mut is_array = false;
    // SAFETY: `v` is a live value of the current call.
    unsafe { sys::napi_is_array(env, v, &mut is_array) };
    let mut len = 0u32;
    if is_array {
        // SAFETY: `v` is an array.
        unsafe { sys::napi_get_array_length(env, v, &mut len) };
    }
    if !is_array || len == 0 {
        return Err(type_error(
            env,
            field,
            &format!(
                "{field} must be a non-empty array of strings, got {}",
                if is_array {
                    "an empty array"
                } else {
                    type_name(env, v)
                }
            ),
        ));
    }
    let mut out = Vec::with_capacity(len as usize);
    for i in 0..len {
        let mut item = ptr::null_mut();
        // SAFETY: `i` is in bounds.
        let status = unsafe { sys::napi_get_element(env, v, i, &mut item) };
        if status != sys::Status::napi_ok {
            // A getter threw: its exception is pending and propagates.
            return Err(napi::Error::new(
                napi::Status::PendingException,
                "reading an array failed",
            ));
        }
        out.push(string(env, item, field, max)?);
    }
    Ok(out)
}

/// A string argument of at most `max` UTF-8 bytes (longer ones are rejected before
/// being copied).
pub(crate) fn string(
    env: sys::napi_env,
    v: sys::napi_value,
    field: &str,
    max: usize,
) -> napi::Result<String> {
    if type_of(env, v) != sys::ValueType::napi_string {
        return Err(type_error(
            env,
            field,
            &format!("{field} must be a string, got {}", type_name(env, v)),
        ));
    }
    let mut len = 0usize;
    // SAFETY: `v` is a string; a null buffer asks for its UTF-8 length.
    unsafe { sys::napi_get_value_string_utf8(env, v, ptr::null_mut(), 0, &mut len) };
    if len > max {
        return Err(range_error(
            env,
            field,
            &format!("must be at most {max} bytes, got {len}"),
        ));
    }
    let mut buf = vec![0u8; len + 1];
    let mut written = 0usize;
    // SAFETY: `buf` has room for `len` bytes and the terminating NUL.
    unsafe {
        sys::napi_get_value_string_utf8(env, v, buf.as_mut_ptr().cast(), len + 1, &mut written)
    };
    buf.truncate(written);
    // napi writes valid UTF-8, lone surrogates as U+FFFD: refuse those.
    let s = String::from_utf8(buf)
        .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
    check_well_formed(env, v, field, &s)?;
    Ok(s)
}

/// A string that napi wrote with U+FFFD may have held a lone surrogate (U+D800..U+DFFF
/// alone), which UTF-8 cannot hold: napi would replace it silently, so two different
/// tenants could scope to one key. Such strings are INVALID_ARGUMENT naming `field`, as
/// in Python. Only strings with U+FFFD in them are read again, as UTF-16.
fn check_well_formed(
    env: sys::napi_env,
    v: sys::napi_value,
    field: &str,
    utf8: &str,
) -> napi::Result<()> {
    if !utf8.contains('\u{FFFD}') {
        return Ok(());
    }
    let mut len = 0usize;
    // SAFETY: `v` is a string; a null buffer asks for its UTF-16 length.
    unsafe { sys::napi_get_value_string_utf16(env, v, ptr::null_mut(), 0, &mut len) };
    let mut units = vec![0u16; len + 1];
    let mut written = 0usize;
    // SAFETY: `units` has room for `len` code units and the terminating NUL.
    unsafe { sys::napi_get_value_string_utf16(env, v, units.as_mut_ptr(), len + 1, &mut written) };
    units.truncate(written);
    if char::decode_utf16(units).any(|c| c.is_err()) {
        return Err(range_error(
            env,
            field,
            "must be well-formed Unicode: it holds a lone surrogate (U+D800..U+DFFF)",
        ));
    }
    Ok(())
}

/// Runs `f` on the UTF-8 text of the string `v` (at most `max` bytes). Short strings
/// are read into a stack buffer in one call: no length query, no allocation.
pub(crate) fn with_str<R>(
    env: sys::napi_env,
    v: sys::napi_value,
    field: &str,
    max: usize,
    f: impl FnOnce(&str) -> R,
) -> napi::Result<R> {
    let mut buf = [0u8; 256];
    let mut written = 0usize;
    // SAFETY: `buf` has room for 255 bytes and the NUL.
    let status = unsafe {
        sys::napi_get_value_string_utf8(env, v, buf.as_mut_ptr().cast(), buf.len(), &mut written)
    };
    if status != sys::Status::napi_ok {
        return Err(type_error(
            env,
            field,
            &format!("{field} must be a string, got {}", type_name(env, v)),
        ));
    }
    // napi writes whole characters only: a string that did not fit leaves less room
    // than one character (at most 4 bytes) unused. Less than that written: it all fit.
    if written + 4 < buf.len() {
        if written > max {
            return Err(range_error(
                env,
                field,
                &format!("must be at most {max} bytes, got {written}"),
            ));
        }
        // napi writes whole characters of valid UTF-8.
        let s = std::str::from_utf8(&buf[..written]).unwrap_or_default();
        check_well_formed(env, v, field, s)?;
        return Ok(f(s));
    }
    let s = string(env, v, field, max)?;
    Ok(f(&s))
}

/// A `u64` seed: a non-negative safe integer, or a bigint in `0..2^64`.
pub(crate) fn seed(env: sys::napi_env, v: sys::napi_value, field: &str) -> napi::Result<u64> {
    if type_of(env, v) == sys::ValueType::napi_bigint {
        let mut n = 0u64;
        let mut lossless = false;
        // SAFETY: `v` is a bigint.
        unsafe { sys::napi_get_value_bigint_uint64(env, v, &mut n, &mut lossless) };
        if !lossless {
            return Err(range_error(env, field, "must be a bigint in 0..2^64"));
        }
        return Ok(n);
    }
    Ok(integer(env, v, field, 0.0, 9_007_199_254_740_991.0)? as u64)
}

pub(crate) fn fmt_num(n: f64) -> String {
    if n.is_nan() {
        "NaN".into()
    } else if n.is_infinite() {
        if n > 0.0 { "Infinity" } else { "-Infinity" }.into()
    } else if n != 0.0 && (n.abs() >= 1e21 || n.abs() < 1e-6) {
        // JavaScript's own form for these (`1e+21`, `5e-324`), not ~300 digits.
        let e = format!("{n:e}");
        match e.split_once('e') {
            Some((mantissa, exp)) if !exp.starts_with('-') => format!("{mantissa}e+{exp}"),
            _ => e,
        }
    } else {
        format!("{n}")
    }
}

/// An options object (`undefined`/`null` means all defaults).
pub(crate) struct Options {
    env: sys::napi_env,
    obj: Option<sys::napi_value>,
}

impl Options {
    /// Reads `v` as the options of `what` (e.g. `"RetryPolicy"`); rejects properties
    /// not in `allowed`, so a misspelt option is an error rather than a silent default.
    pub(crate) fn new(
        env: sys::napi_env,
        v: sys::napi_value,
        what: &str,
        allowed: &[&str],
    ) -> napi::Result<Self> {
        if is_nullish(env, v) {
            return Ok(Options { env, obj: None });
        }
        if type_of(env, v) != sys::ValueType::napi_object {
            return Err(type_error(
                env,
                "options",
                &format!(
                    "{what} options must be an object, got {}",
                    type_name(env, v)
                ),
            ));
        }
        let opts = Options { env, obj: Some(v) };
        for name in opts.keys()? {
            if !allowed.contains(&name.as_str()) {
                return Err(type_error(
                    env,
                    &name,
                    &format!(
                        "unknown {what} option {name:?}; expected one of: {}",
                        allowed.join(", ")
                    ),
                ));
            }
        }
        Ok(opts)
    }

    fn keys(&self) -> napi::Result<Vec<String>> {
        let Some(obj) = self.obj else {
            return Ok(Vec::new());
        };
        let env = self.env;
        let mut names = ptr::null_mut();
        // SAFETY: `obj` is an object of the current call.
        let status = unsafe { sys::napi_get_property_names(env, obj, &mut names) };
        if status != sys::Status::napi_ok {
            return Err(napi::Error::new(
                napi::Status::PendingException,
                "reading options failed",
            ));
        }
        let mut len = 0u32;
        // SAFETY: `names` is an array.
        unsafe { sys::napi_get_array_length(env, names, &mut len) };
        let mut out = Vec::with_capacity(len as usize);
        for i in 0..len {
            let mut k = ptr::null_mut();
            // SAFETY: `i` is in bounds.
            unsafe { sys::napi_get_element(env, names, i, &mut k) };
            if type_of(env, k) == sys::ValueType::napi_string {
                out.push(string(env, k, "option name", SHORT_STRING_MAX)?);
            }
        }
        Ok(out)
    }

    /// The value of option `name`, or `None` when absent or `undefined`.
    pub(crate) fn get(&self, name: &CStr) -> napi::Result<Option<sys::napi_value>> {
        let Some(obj) = self.obj else {
            return Ok(None);
        };
        let mut v = ptr::null_mut();
        // SAFETY: `obj` is an object; `name` is NUL-terminated.
        let status = unsafe { sys::napi_get_named_property(self.env, obj, name.as_ptr(), &mut v) };
        if status != sys::Status::napi_ok {
            // A getter threw: its exception is pending and propagates.
            return Err(napi::Error::new(
                napi::Status::PendingException,
                "reading an option failed",
            ));
        }
        if type_of(self.env, v) == sys::ValueType::napi_undefined {
            Ok(None)
        } else {
            Ok(Some(v))
        }
    }

    pub(crate) fn millis(
        &self,
        name: &CStr,
        core_field: &'static str,
    ) -> napi::Result<Option<Duration>> {
        self.get(name)?
            .map(|v| millis(self.env, v, core_field))
            .transpose()
    }

    pub(crate) fn number(&self, name: &CStr) -> napi::Result<Option<f64>> {
        let field = name.to_str().unwrap_or("option");
        self.get(name)?
            .map(|v| number(self.env, v, field))
            .transpose()
    }

    pub(crate) fn integer(&self, name: &CStr, min: f64, max: f64) -> napi::Result<Option<f64>> {
        let field = name.to_str().unwrap_or("option");
        self.get(name)?
            .map(|v| integer(self.env, v, field, min, max))
            .transpose()
    }

    pub(crate) fn boolean(&self, name: &CStr) -> napi::Result<Option<bool>> {
        let field = name.to_str().unwrap_or("option");
        self.get(name)?
            .map(|v| boolean(self.env, v, field))
            .transpose()
    }

    pub(crate) fn seed(&self, name: &CStr) -> napi::Result<Option<u64>> {
        let field = name.to_str().unwrap_or("option");
        match self.get(name)? {
            None => Ok(None),
            Some(v) if type_of(self.env, v) == sys::ValueType::napi_null => Ok(None),
            Some(v) => seed(self.env, v, field).map(Some),
        }
    }
}
