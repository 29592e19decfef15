//! JavaScript errors: every error oncely throws is an `Error` (or `TypeError` /
//! `RangeError` for bad input) with a string `code` (the gRPC code name), a `kind` (the
//! variant of the core's error) and, where they apply, `field` and `retryAfterMs`.

use std::ffi::CStr;
use std::ptr;

use napi::{sys, Status};

/// Which JavaScript error constructor to use.
#[derive(Clone, Copy)]
pub(crate) enum Ctor {
    Error,
    Type,
    Range,
}

/// An extra property set on a thrown error.
pub(crate) enum Prop<'a> {
    Str(&'a CStr, &'a str),
    Num(&'a CStr, f64),
}

/// Throws a new error and gives back the `napi::Error` that tells napi-rs an exception
/// is already pending (so it is not replaced).
///
/// If an exception is already pending (a getter of the caller's options object threw,
/// say), that one is kept.
pub(crate) fn throw(
    env: sys::napi_env,
    ctor: Ctor,
    code: &str,
    message: &str,
    props: &[Prop<'_>],
) -> napi::Error {
    // SAFETY: `env` is the environment of the running native call, on its JS thread;
    // every pointer passed below is valid for the duration of the call.
    unsafe {
        let mut pending = false;
        sys::napi_is_exception_pending(env, &mut pending);
        if !pending {
            let err = make_error(env, ctor, code, message, props);
            if !err.is_null() {
                sys::napi_throw(env, err);
            }
        }
    }
    napi::Error::new(Status::PendingException, message.to_owned())
}

/// Creates (without throwing) an error object as [`throw`] would.
pub(crate) fn make_error(
    env: sys::napi_env,
    ctor: Ctor,
    code: &str,
    message: &str,
    props: &[Prop<'_>],
) -> sys::napi_value {
    // SAFETY: as in `throw`.
    unsafe {
        let js_code = js_string(env, code);
        let js_msg = js_string(env, message);
        let mut err = ptr::null_mut();
        let status = match ctor {
            Ctor::Error => sys::napi_create_error(env, js_code, js_msg, &mut err),
            Ctor::Type => sys::napi_create_type_error(env, js_code, js_msg, &mut err),
            Ctor::Range => sys::napi_create_range_error(env, js_code, js_msg, &mut err),
        };
        if status != sys::Status::napi_ok {
            return ptr::null_mut();
        }
        for p in props {
            let (name, value) = match p {
                Prop::Str(name, s) => (name, js_string(env, s)),
                Prop::Num(name, n) => {
                    let mut v = ptr::null_mut();
                    sys::napi_create_double(env, *n, &mut v);
                    (name, v)
                }
            };
            sys::napi_set_named_property(env, err, name.as_ptr(), value);
        }
        err
    }
}

pub(crate) fn js_string(env: sys::napi_env, s: &str) -> sys::napi_value {
    let mut v = ptr::null_mut();
    // SAFETY: `s` is valid UTF-8 of the given length; `env` is the current env.
    unsafe {
        sys::napi_create_string_utf8(env, s.as_ptr().cast(), s.len() as isize, &mut v);
    }
    v
}

/// The JavaScript name of a field the core names: option names in camelCase, durations
/// with their unit (`base_delay` → `baseDelayMs`).
pub(crate) fn js_field(core: &str) -> &str {
    match core {
        "max_attempts" => "maxAttempts",
        "base_delay" => "baseDelayMs",
        "max_delay" => "maxDelayMs",
        "min_attempt" => "minAttemptMs",
        "window" => "windowMs",
        "ttl" => "ttlMs",
        "max_entries" => "maxEntries",
        "min_per_sec" => "minPerSec",
        "in_progress_retry_after" => "inProgressRetryAfterMs",
        "lease" => "leaseMs",
        "connect_timeout" => "connectTimeoutMs",
        "io_timeout" => "ioTimeoutMs",
        "poll_interval" => "pollIntervalMs",
        "min_replicas" => "minReplicas",
        "min_replicas_timeout" => "minReplicasTimeoutMs",
        "max_result_bytes" => "maxResultBytes",
        "idempotency_key" => "idempotencyKey",
        "business_id" => "businessId",
        "retry_after" => "retryAfter",
        "scoped_key" => "scoped",
        other => other,
    }
}

/// A `TypeError` for an argument or option of the wrong type.
/// How Node names the core's settings (camelCase, durations in ms) in the core's messages.
pub(crate) const NAMING: oncely::Naming =
    oncely::Naming::new(js_field, oncely::DurationUnit::Milliseconds);

pub(crate) fn type_error(env: sys::napi_env, field: &str, message: &str) -> napi::Error {
    throw(
        env,
        Ctor::Type,
        "INVALID_ARGUMENT",
        message,
        &[
            Prop::Str(c"kind", "invalid_argument"),
            Prop::Num(c"httpStatus", invalid_argument_status()),
            Prop::Str(c"field", field),
        ],
    )
}

/// A `RangeError` for an argument or option with a value out of range.
pub(crate) fn range_error(env: sys::napi_env, field: &str, reason: &str) -> napi::Error {
    throw(
        env,
        Ctor::Range,
        "INVALID_ARGUMENT",
        &format!("invalid {field}: {reason}"),
        &[
            Prop::Str(c"kind", "invalid_argument"),
            Prop::Num(c"httpStatus", invalid_argument_status()),
            Prop::Str(c"field", field),
        ],
    )
}

/// Throws the JavaScript form of a core error.
pub(crate) fn core_error(env: sys::napi_env, e: &oncely::Error) -> napi::Error {
    let code = e.code().as_str();
    match e {
        oncely::Error::InvalidArgument { field, reason } => {
            range_error(env, js_field(field), reason)
        }
        oncely::Error::MissingKey => throw(
            env,
            Ctor::Range,
            code,
            &e.to_string(),
            &[
                Prop::Str(c"kind", e.kind()),
                Prop::Num(c"httpStatus", f64::from(e.http_status())),
                Prop::Str(c"field", "idempotencyKey"),
            ],
        ),
        oncely::Error::FingerprintMismatch => simple(env, code, e),
        oncely::Error::InProgress { retry_after } => throw(
            env,
            Ctor::Error,
            code,
            &format!(
                "an operation with this idempotency key is in progress; retry after {} ms",
                retry_after.as_millis()
            ),
            &[
                Prop::Str(c"kind", e.kind()),
                Prop::Num(c"httpStatus", f64::from(e.http_status())),
                Prop::Num(c"retryAfterMs", retry_after.as_secs_f64() * 1000.0),
            ],
        ),
        oncely::Error::LeaseLost => simple(env, code, e),
        oncely::Error::Capacity { max_entries } => throw(
            env,
            Ctor::Error,
            code,
            &e.to_string(),
            &[
                Prop::Str(c"kind", e.kind()),
                Prop::Num(c"httpStatus", f64::from(e.http_status())),
                Prop::Num(c"maxEntries", *max_entries as f64),
            ],
        ),
        oncely::Error::Unavailable(_) => simple(env, code, e),
        oncely::Error::LeaderPanicked(_) => simple(env, code, e),
        oncely::Error::Reentrant { key } => throw(
            env,
            Ctor::Error,
            code,
            &e.to_string(),
            &[
                Prop::Str(c"kind", e.kind()),
                Prop::Num(c"httpStatus", f64::from(e.http_status())),
                Prop::Str(c"key", key),
            ],
        ),
        oncely::Error::ResultNotStored { key, type_name } => throw(
            env,
            Ctor::Error,
            code,
            &e.to_string(),
            &[
                Prop::Str(c"kind", e.kind()),
                Prop::Num(c"httpStatus", f64::from(e.http_status())),
                Prop::Str(c"key", key),
                Prop::Str(c"typeName", type_name),
            ],
        ),
        _ => simple(env, code, e),
    }
}

fn simple(env: sys::napi_env, code: &str, e: &oncely::Error) -> napi::Error {
    throw(
        env,
        Ctor::Error,
        code,
        &e.to_string(),
        &[
            Prop::Str(c"kind", e.kind()),
            Prop::Num(c"httpStatus", f64::from(e.http_status())),
        ],
    )
}

/// The HTTP status of an INVALID_ARGUMENT error (the core's `Error::http_status`).
pub(crate) fn invalid_argument_status() -> f64 {
    f64::from(
        oncely::Error::InvalidArgument {
            field: "",
            reason: String::new(),
        }
        .http_status(),
    )
}

/// Maps a core result into a napi result, throwing the JavaScript form of the error.
pub(crate) trait OrThrow<T> {
    fn or_throw(self, env: sys::napi_env) -> napi::Result<T>;
}

impl<T> OrThrow<T> for Result<T, oncely::Error> {
    fn or_throw(self, env: sys::napi_env) -> napi::Result<T> {
        self.map_err(|e| core_error(env, &e))
    }
}

/// The value a raw napi callback returns for `result`: the value, or null with the
/// error thrown (unless one is already pending).
pub(crate) fn value_or_throw(
    env: sys::napi_env,
    result: napi::Result<sys::napi_value>,
) -> sys::napi_value {
    match result {
        Ok(v) => v,
        Err(e) => {
            if e.status != Status::PendingException {
                let msg = std::ffi::CString::new(e.reason.replace('\0', "")).unwrap_or_default();
                // SAFETY: on the JS thread, inside the native call.
                unsafe { sys::napi_throw_error(env, std::ptr::null(), msg.as_ptr()) };
            }
            std::ptr::null_mut()
        }
    }
}

/// The HTTP statuses of the errors the JavaScript layer makes itself (the core's
/// `Error::http_status` of the same kinds).
#[napi_derive::napi(object)]
pub struct JsErrorStatus {
    /// `invalid_argument`.
    pub invalid_argument: f64,
    /// `unavailable`.
    pub unavailable: f64,
}

/// See [`JsErrorStatus`].
#[napi_derive::napi]
pub fn js_error_status() -> JsErrorStatus {
    JsErrorStatus {
        invalid_argument: invalid_argument_status(),
        unavailable: f64::from(oncely::Error::Unavailable(String::new()).http_status()),
    }
}

/// One kind of oncely error: its stable name, gRPC code name and HTTP status.
#[napi_derive::napi(object)]
pub struct ErrorKind {
    /// `invalid_argument`, `missing_key`, …
    pub kind: String,
    /// The gRPC code name (`err.code`).
    pub code: String,
    /// The HTTP status a server answers with it (`err.httpStatus`).
    pub http_status: f64,
}

/// Every kind of error oncely throws, with its code and HTTP status (the core's
/// `Error::kind`, `Error::code`, `Error::http_status`): the error classes of index.js.
#[napi_derive::napi]
pub fn error_kinds() -> Vec<ErrorKind> {
    use oncely::Error;
    use std::time::Duration;
    let samples = [
        Error::InvalidArgument {
            field: "",
            reason: String::new(),
        },
        Error::MissingKey,
        Error::FingerprintMismatch,
        Error::InProgress {
            retry_after: Duration::ZERO,
        },
        Error::LeaseLost,
        Error::Capacity { max_entries: 0 },
        Error::Unavailable(String::new()),
        Error::LeaderPanicked(String::new()),
        Error::Reentrant { key: String::new() },
        Error::ResultNotStored {
            key: String::new(),
            type_name: String::new(),
        },
    ];
    samples
        .iter()
        .map(|e| ErrorKind {
            kind: e.kind().to_owned(),
            code: e.code().as_str().to_owned(),
            http_status: f64::from(e.http_status()),
        })
        .collect()
}
