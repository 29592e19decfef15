//! The server contract (SPEC §8, the core's `oncely::http`) for the Node adapters
//! (`oncely/express`, `oncely/fastify`): thin conversions only, every decision is the
//! core's.

use std::ffi::c_void;
use std::ptr;
use std::time::Duration;

use napi::bindgen_prelude::*;
use napi::sys;
use napi_derive::napi;

use oncely::http::{self as contract, KeyDecision, Problem, ServerConfig, StoredResponse};
use oncely::{Error as CoreError, IdempotencyKey};

use crate::convert;
use crate::errors::{core_error, js_field, range_error, type_error, OrThrow};

/// The settings of a server adapter (all optional; the defaults are the core's).
#[napi(object)]
pub struct HttpConfigOptions {
    /// The covered methods (default `['POST', 'PATCH']`), case-sensitive.
    pub methods: Option<Vec<String>>,
    /// Whether a covered request without a key gets 400 (default `true`).
    pub required: Option<bool>,
    /// Whether a duplicate waits for a running first request (default `true`).
    pub wait: Option<bool>,
    /// The largest response body stored, bytes (default 1 MiB).
    pub body_cap: Option<f64>,
    /// The largest request body of a covered request, bytes (default 1 MiB): it is read
    /// whole to fingerprint it; larger ones get 413.
    pub request_cap: Option<f64>,
    /// The response headers stored with the body (default content-type,
    /// content-encoding, location, etag).
    pub stored_headers: Option<Vec<String>>,
    /// The covered gRPC calls by full method name (default: every call).
    pub grpc_methods: Option<Vec<String>>,
}

/// A problem answer (RFC 9457), as the core's `oncely::http::Problem` builds it.
#[napi(object)]
pub struct HttpProblem {
    /// The HTTP status.
    pub status: u32,
    /// The problem type URI (`urn:oncely:problem:<slug>`).
    #[napi(js_name = "type")]
    pub type_uri: String,
    /// A short summary of the kind.
    pub title: String,
    /// What happened and what to do.
    pub detail: String,
    /// The gRPC code name (`'INVALID_ARGUMENT'`).
    pub code: String,
    /// The headers to send, lower-case names: `content-type` and maybe `retry-after`.
    pub headers: Vec<Vec<String>>,
    /// The `application/problem+json` body.
    pub body: Buffer,
    /// The gRPC answer: `grpc-status`, `grpc-message`, maybe `grpc-retry-pushback-ms`.
    pub grpc_metadata: Vec<Vec<String>>,
}

/// What `HttpConfig.readKey` decided: pass the request through, refuse it with
/// `problem`, or dedup it by `key`.
#[napi(object)]
pub struct HttpKeyDecision {
    /// The request goes to the handler untouched.
    pub pass_through: bool,
    /// The validated key, when the request is deduplicated.
    pub key: Option<String>,
    /// The refusal, when the key is missing or invalid.
    pub problem: Option<HttpProblem>,
}

/// A header or trailer of a stored response.
#[napi(object)]
pub struct HttpField {
    /// The name, lower-case.
    pub name: String,
    /// The value bytes.
    pub value: Buffer,
}

/// A stored response: status, stored headers, body and (gRPC) trailers.
#[napi(object)]
pub struct HttpStoredResponse {
    /// The status code.
    pub status: u32,
    /// The stored headers in the handler's order.
    pub headers: Vec<HttpField>,
    /// The whole body.
    pub body: Buffer,
    /// The trailers (gRPC), usually empty.
    pub trailers: Option<Vec<HttpField>>,
}

fn problem_js(p: &Problem) -> HttpProblem {
    let pairs = |v: Vec<(&'static str, String)>| {
        v.into_iter()
            .map(|(n, v)| vec![n.to_owned(), v])
            .collect::<Vec<_>>()
    };
    HttpProblem {
        status: u32::from(p.status),
        type_uri: p.type_uri.to_owned(),
        title: p.title.to_owned(),
        detail: p.detail.clone(),
        code: p.code.as_str().to_owned(),
        headers: pairs(p.headers()),
        body: p.body().into(),
        grpc_metadata: pairs(p.grpc_metadata()),
    }
}

fn decision_js(d: std::result::Result<KeyDecision, Problem>) -> HttpKeyDecision {
    match d {
        Ok(KeyDecision::PassThrough) => HttpKeyDecision {
            pass_through: true,
            key: None,
            problem: None,
        },
        Ok(KeyDecision::Dedup(key)) => HttpKeyDecision {
            pass_through: false,
            key: Some(key.as_str().to_owned()),
            problem: None,
        },
        Err(p) => HttpKeyDecision {
            pass_through: false,
            key: None,
            problem: Some(problem_js(&p)),
        },
    }
}

fn values(v: &[Either<String, Buffer>]) -> Vec<&[u8]> {
    v.iter()
        .map(|x| match x {
            Either::A(s) => s.as_bytes(),
            Either::B(b) => b.as_ref(),
        })
        .collect()
}

/// The adapter settings of the server contract (the core's `ServerConfig`).
#[napi]
pub struct HttpConfig {
    inner: ServerConfig,
}

#[napi]
impl HttpConfig {
    /// The settings; a method or header name that is not an HTTP token throws
    /// INVALID_ARGUMENT.
    #[napi(constructor)]
    pub fn new(env: Env, options: Option<HttpConfigOptions>) -> Result<Self> {
        let raw = env.raw();
        let mut c = ServerConfig::new();
        if let Some(o) = options {
            if let Some(m) = o.methods {
                c = c.methods(m).or_throw(raw)?;
            }
            if let Some(r) = o.required {
                c = c.required(r);
            }
            if let Some(w) = o.wait {
                c = c.wait(w);
            }
            if let Some(b) = o.body_cap {
                c = c.body_cap(byte_count(raw, "bodyCap", b)?);
            }
            if let Some(b) = o.request_cap {
                c = c.request_cap(byte_count(raw, "requestCap", b)?);
            }
            if let Some(h) = o.stored_headers {
                c = c.stored_headers(h).or_throw(raw)?;
            }
            if let Some(g) = o.grpc_methods {
                c = c.grpc_methods(g).or_throw(raw)?;
            }
        }
        Ok(HttpConfig { inner: c })
    }

    /// Whether requests with this method are deduplicated.
    #[napi]
    pub fn covers(&self, method: String) -> bool {
        self.inner.covers(&method)
    }

    /// Whether the gRPC call `fullMethod` (`/pkg.Service/Method`) is deduplicated.
    #[napi]
    pub fn covers_grpc(&self, full_method: String) -> bool {
        self.inner.covers_grpc(&full_method)
    }

    /// Whether the response header `name` (any case) is stored with the body.
    #[napi]
    pub fn stores_header(&self, name: String) -> bool {
        self.inner.stores_header(&name)
    }

    /// Whether the response header `name` (any case) goes, with a response that is
    /// not stored, to the duplicates that waited for it: every header but the
    /// never-stored ones, and `set-cookie` only when `storesHeader` lists it.
    #[napi]
    pub fn shares_header(&self, name: String) -> bool {
        self.inner.shares_header(&name)
    }

    /// Whether the gRPC response metadata `name` is stored.
    #[napi]
    pub fn stores_grpc_header(&self, name: String) -> bool {
        self.inner.stores_grpc_header(&name)
    }

    /// Whether a body of `len` bytes may be stored.
    #[napi]
    pub fn body_fits(&self, len: f64) -> bool {
        len >= 0.0 && len <= self.inner.cap() as f64
    }

    /// Decides a request from its method and the values of its `Idempotency-Key`
    /// header (an empty list: no header).
    #[napi]
    pub fn read_key(
        &self,
        method: String,
        values_: Vec<Either<String, Buffer>>,
    ) -> HttpKeyDecision {
        decision_js(self.inner.read_key(&method, &values(&values_)))
    }

    /// `readKey` for a gRPC call, with its `x-idempotency-key` values.
    #[napi]
    pub fn read_grpc_key(
        &self,
        full_method: String,
        values_: Vec<Either<String, Buffer>>,
    ) -> HttpKeyDecision {
        decision_js(self.inner.read_grpc_key(&full_method, &values(&values_)))
    }

    /// Whether a covered request without a key is refused.
    #[napi(getter)]
    pub fn required(&self) -> bool {
        self.inner.is_required()
    }

    /// Whether duplicates wait for a running first request.
    #[napi(getter)]
    pub fn wait(&self) -> bool {
        self.inner.waits()
    }

    /// The body cap, bytes.
    #[napi(getter)]
    pub fn body_cap(&self) -> f64 {
        self.inner.cap() as f64
    }

    /// The request cap, bytes.
    #[napi(getter)]
    pub fn request_cap(&self) -> f64 {
        self.inner.request_limit() as f64
    }

    /// Whether a request's `Content-Length` value declares a body over the request cap
    /// (it is answered `tooLarge()` before its body is read).
    #[napi(ts_args_type = "contentLength: string")]
    pub fn declares_too_large(&self, env: &Env, content_length: Unknown<'_>) -> Result<bool> {
        lossy_str(env.raw(), content_length.raw(), "contentLength", |v| {
            self.inner.declares_too_large(v.as_bytes())
        })
    }

    /// The problem for a request over the request cap (413).
    #[napi]
    pub fn too_large(&self) -> HttpProblem {
        problem_js(&self.inner.too_large())
    }
}

/// A size in bytes given as a number: a whole number from 0 to 2^53 - 1, else a
/// RangeError naming `field` (napi's own u32 conversion would wrap larger sizes).
fn byte_count(env: sys::napi_env, field: &str, n: f64) -> Result<usize> {
    if !(n.is_finite() && n.fract() == 0.0 && (0.0..=9_007_199_254_740_991.0).contains(&n)) {
        return Err(range_error(
            env,
            field,
            &format!(
                "must be a whole number of bytes (at least 0), e.g. 1048576, got {}",
                convert::fmt_num(n)
            ),
        ));
    }
    Ok(n as usize)
}

/// The scoped key of a request: `tenant`, `method` + `route` (the route template where
/// the framework knows it, else the path) and the key.
#[napi]
pub fn http_scope(
    env: Env,
    tenant: String,
    method: String,
    route: String,
    key: String,
) -> Result<String> {
    let raw = env.raw();
    let key = IdempotencyKey::parse(&key).or_throw(raw)?;
    Ok(contract::scope(&tenant, &method, &route, &key)
        .or_throw(raw)?
        .as_str()
        .to_owned())
}

/// The fingerprint of a request (SPEC §8): method, target (path and query as sent),
/// and the body (canonical JSON when the content type is JSON and it parses).
#[napi]
pub fn http_request_fingerprint(
    method: String,
    target: String,
    content_type: Option<String>,
    body: Either<String, Buffer>,
) -> String {
    let bytes: &[u8] = match &body {
        Either::A(s) => s.as_bytes(),
        Either::B(b) => b.as_ref(),
    };
    contract::request_fingerprint(&method, &target, content_type.as_deref(), bytes)
}

/// The contract's names and defaults, as the core has them (read once by `index.js`).
#[napi(object)]
pub struct HttpConstants {
    /// The request header carrying the key.
    pub key_header: String,
    /// The gRPC metadata carrying the key.
    pub grpc_key_metadata: String,
    /// The header marking a replayed answer.
    pub replayed_header: String,
    /// The tenant when no tenant function is given.
    pub default_tenant: String,
    /// The request cap by default, bytes.
    pub default_request_cap: f64,
}

/// The contract's names and defaults (`http.KEY_HEADER` and the others in `index.js`).
#[napi]
pub fn http_constants() -> HttpConstants {
    HttpConstants {
        key_header: contract::KEY_HEADER.to_owned(),
        grpc_key_metadata: contract::GRPC_KEY_METADATA.to_owned(),
        replayed_header: contract::REPLAYED_HEADER.to_owned(),
        default_tenant: contract::DEFAULT_TENANT.to_owned(),
        default_request_cap: contract::DEFAULT_REQUEST_CAP as f64,
    }
}

/// Whether a response to `method` with `status` carries content: not one to a HEAD,
/// nor a 1xx, 204 or 304. Its record keeps no body.
#[napi(ts_args_type = "method: string, status: number")]
pub fn http_has_content(env: &Env, method: Unknown<'_>, status: Unknown<'_>) -> Result<bool> {
    let status = convert::integer(env.raw(), status.raw(), "status", 0.0, 65_535.0)? as u16;
    lossy_str(env.raw(), method.raw(), "method", |m| {
        contract::has_content(m, status)
    })
}

/// Whether a response with this status is stored (2xx, 4xx but 408/409/425/429).
/// A status that is not an integer in `0..=65535` is refused (a TypeError or RangeError,
/// INVALID_ARGUMENT), as the Python binding's `u16` refuses it.
#[napi(ts_args_type = "status: number")]
pub fn http_storable_status(env: &Env, status: Unknown<'_>) -> Result<bool> {
    let n = convert::integer(env.raw(), status.raw(), "status", 0.0, 65_535.0)?;
    Ok(contract::storable_status(n as u16))
}

/// Whether a gRPC answer with this `grpc-status` value is stored.
#[napi(ts_args_type = "value: string")]
pub fn http_storable_grpc_status(env: &Env, value: Unknown<'_>) -> Result<bool> {
    text_rule(env, value, "value", |v| {
        contract::storable_grpc_status(v.as_bytes())
    })
}

/// Whether a content type is JSON (`application/json` or `+json`).
#[napi(ts_args_type = "contentType: string")]
pub fn http_is_json(env: &Env, content_type: Unknown<'_>) -> Result<bool> {
    text_rule(env, content_type, "contentType", contract::is_json)
}

/// Whether a content type is an event stream (`text/event-stream`): such a response
/// is sent as it is produced, keeps the key until it ends and is not stored.
#[napi(ts_args_type = "contentType: string")]
pub fn http_is_event_stream(env: &Env, content_type: Unknown<'_>) -> Result<bool> {
    text_rule(env, content_type, "contentType", contract::is_event_stream)
}

/// Whether a content type is gRPC.
#[napi(ts_args_type = "contentType: string")]
pub fn http_is_grpc(env: &Env, content_type: Unknown<'_>) -> Result<bool> {
    text_rule(env, content_type, "contentType", contract::is_grpc)
}

/// A rule of the core over one string argument; anything else is a TypeError naming it.
fn text_rule(
    env: &Env,
    v: Unknown<'_>,
    field: &str,
    rule: impl FnOnce(&str) -> bool,
) -> Result<bool> {
    convert::with_str(env.raw(), v.raw(), field, convert::SHORT_STRING_MAX, rule)
}

fn fields(v: Option<Vec<HttpField>>) -> Vec<(String, Vec<u8>)> {
    v.unwrap_or_default()
        .into_iter()
        .map(|f| (f.name.to_ascii_lowercase(), f.value.to_vec()))
        .collect()
}

/// The record bytes of a stored response (the format every adapter shares).
#[napi]
pub fn http_encode_response(env: Env, response: HttpStoredResponse) -> Result<Buffer> {
    let status = u16::try_from(response.status)
        .ok()
        .filter(|s| (100..=999).contains(s))
        .ok_or_else(|| {
            core_error(
                env.raw(),
                &CoreError::InvalidArgument {
                    field: "status",
                    reason: "must be an HTTP status (100..=999)".into(),
                },
            )
        })?;
    let record = StoredResponse {
        status,
        headers: fields(Some(response.headers)),
        body: response.body.to_vec(),
        trailers: fields(response.trailers),
    };
    Ok(record.encode().into())
}

/// Reads record bytes back; anything else throws UNAVAILABLE.
#[napi]
pub fn http_decode_response(env: Env, record: Buffer) -> Result<HttpStoredResponse> {
    let r = StoredResponse::decode(&record).or_throw(env.raw())?;
    let js = |v: Vec<(String, Vec<u8>)>| {
        v.into_iter()
            .map(|(name, value)| HttpField {
                name,
                value: value.into(),
            })
            .collect::<Vec<_>>()
    };
    Ok(HttpStoredResponse {
        status: u32::from(r.status),
        headers: js(r.headers),
        body: r.body.into(),
        trailers: Some(js(r.trailers)),
    })
}

/// What `httpProblem` reads from an error of oncely.
#[napi(object)]
pub struct HttpProblemSource {
    /// The error's `kind` (`'missing_key'`, `'in_progress'`, ...).
    pub kind: String,
    /// Its message (the detail of `unavailable` and `leader_panicked`).
    pub message: Option<String>,
    /// `in_progress`: the delay before a retry, ms.
    pub retry_after_ms: Option<f64>,
    /// `invalid_argument`: the field.
    pub field: Option<String>,
    /// `capacity`: the entry bound.
    pub max_entries: Option<f64>,
    /// `reentrant` / `result_not_stored`: the scoped key.
    pub key: Option<String>,
    /// `result_not_stored`: the type name.
    pub type_name: Option<String>,
}

/// The problem answer for an error of oncely (by its `kind`); also
/// `kind: 'request_too_large'` (the request cap in bytes as `message`) and
/// `kind: 'body_unreadable'` (the reason as `message`) and `kind: 'tenant_unusable'`
/// (why the tenant function's tenant cannot scope a key, as `message`).
#[napi(ts_args_type = "error: HttpProblemSource")]
pub fn http_problem(env: Env, error: Unknown<'_>) -> Result<HttpProblem> {
    let raw = env.raw();
    if convert::type_of(raw, error.raw()) != sys::ValueType::napi_object {
        let got = convert::type_name(raw, error.raw());
        return Err(type_error(
            raw,
            "error",
            &format!("error must be an error of oncely or an object with a `kind`, got {got}"),
        ));
    }
    // SAFETY: a live object of this call.
    let error = unsafe { HttpProblemSource::from_napi_value(raw, error.raw()) }.map_err(|e| {
        type_error(
            raw,
            "error",
            &format!(
                "error must have a string `kind` and fields of their types: {}",
                e.reason
            ),
        )
    })?;
    let msg = error.message.clone().unwrap_or_default();
    let e = match error.kind.as_str() {
        "missing_key" => CoreError::MissingKey,
        "invalid_argument" => CoreError::InvalidArgument {
            field: static_field(error.field.as_deref().unwrap_or("idempotency_key")),
            reason: msg,
        },
        "fingerprint_mismatch" => CoreError::FingerprintMismatch,
        "in_progress" => CoreError::InProgress {
            retry_after: Duration::from_secs_f64(
                error.retry_after_ms.unwrap_or(0.0).max(0.0) / 1000.0,
            ),
        },
        "lease_lost" => CoreError::LeaseLost,
        "capacity" => CoreError::Capacity {
            max_entries: error.max_entries.unwrap_or(0.0) as usize,
        },
        "unavailable" => CoreError::Unavailable(msg),
        "leader_panicked" => CoreError::LeaderPanicked(msg),
        "reentrant" => CoreError::Reentrant {
            key: error.key.unwrap_or_default(),
        },
        "result_not_stored" => CoreError::ResultNotStored {
            key: error.key.unwrap_or_default(),
            type_name: error.type_name.unwrap_or_default(),
        },
        "request_too_large" => {
            let Ok(cap) = msg.parse::<usize>() else {
                return Err(type_error(
                    raw,
                    "error",
                    &format!(
                        "a request_too_large problem takes the request cap in bytes as its message, got {msg:?}"
                    ),
                ));
            };
            return Ok(problem_js(&Problem::request_too_large(cap)));
        }
        "body_unreadable" => return Ok(problem_js(&Problem::request_body_unreadable(msg))),
        "tenant_unusable" => return Ok(problem_js(&Problem::tenant_unusable(msg))),
        other => {
            return Err(core_error(
                env.raw(),
                &CoreError::InvalidArgument {
                    field: "kind",
                    reason: format!("{other:?} is not an error kind of oncely"),
                },
            ))
        }
    };
    Ok(problem_js(&Problem::from_error(&e)))
}

/// `Error::InvalidArgument` takes a `&'static str` field: the fields adapters report
/// are few.
fn static_field(field: &str) -> &'static str {
    match field {
        "idempotency_key" | "idempotencyKey" => "idempotency_key",
        "tenant" => "tenant",
        "method" => "method",
        _ => "argument",
    }
}

// ---------------------------------------------------------------------------------------
// The adapters' hot path: one call per step of a request (its key; its scope and
// fingerprint; its record), arguments read straight from the napi values and results
// given as strings and flat arrays. The object forms above (`readKey`, `scope` +
// `requestFingerprint`, `encodeResponse` / `decodeResponse`) build a JavaScript object
// and a Buffer per field, which cost more than the rest of a replay.
// ---------------------------------------------------------------------------------------

/// Runs `f` on the UTF-8 text of the string `v`, read as napi-rs reads a `String`
/// argument (a lone surrogate becomes U+FFFD, no length limit), in one call when it
/// fits the stack buffer; anything but a string is a TypeError naming `field`.
fn lossy_str<R>(
    env: sys::napi_env,
    v: sys::napi_value,
    field: &str,
    f: impl FnOnce(&str) -> R,
) -> Result<R> {
    let mut buf = [0u8; 256];
    let mut written = 0usize;
    // SAFETY: `buf` has room for 255 bytes and the NUL.
    let status = unsafe {
        sys::napi_get_value_string_utf8(env, v, buf.as_mut_ptr().cast(), buf.len(), &mut written)
    };
    if status != sys::Status::napi_ok {
        return Err(not_a_string(env, v, field));
    }
    // napi writes whole characters only: less than one character (4 bytes) of room
    // left unused means it all fit.
    if written + 4 < buf.len() {
        return Ok(f(std::str::from_utf8(&buf[..written]).unwrap_or_default()));
    }
    let mut len = 0usize;
    // SAFETY: `v` is a string; a null buffer asks for its UTF-8 length.
    unsafe { sys::napi_get_value_string_utf8(env, v, ptr::null_mut(), 0, &mut len) };
    let mut heap = vec![0u8; len + 1];
    // SAFETY: `heap` has room for `len` bytes and the NUL.
    unsafe {
        sys::napi_get_value_string_utf8(env, v, heap.as_mut_ptr().cast(), len + 1, &mut written)
    };
    heap.truncate(written);
    Ok(f(std::str::from_utf8(&heap).unwrap_or_default()))
}

fn not_a_string(env: sys::napi_env, v: sys::napi_value, field: &str) -> Error {
    type_error(
        env,
        field,
        &format!(
            "{field} must be a string, got {}",
            convert::type_name(env, v)
        ),
    )
}

/// The bytes of a Buffer (or any Uint8Array) `v`, borrowed for this call, or `None`
/// when `v` is not one.
fn buffer_bytes<'a>(env: sys::napi_env, v: sys::napi_value) -> Option<&'a [u8]> {
    let mut is_buffer = false;
    // SAFETY: a live value of this call.
    unsafe { sys::napi_is_buffer(env, v, &mut is_buffer) };
    if !is_buffer {
        return None;
    }
    let mut p = ptr::null_mut();
    let mut len = 0usize;
    // SAFETY: `v` is a Buffer; its bytes stay alive and unmoved for this call (no
    // JavaScript runs before the borrow ends).
    unsafe { sys::napi_get_buffer_info(env, v, &mut p, &mut len) };
    Some(if len == 0 {
        &[]
    } else {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(p as *const u8, len) }
    })
}

/// Runs `f` on the bytes of `v`: a Buffer's, or a string's UTF-8.
fn with_bytes<R>(
    env: sys::napi_env,
    v: sys::napi_value,
    field: &str,
    f: impl FnOnce(&[u8]) -> R,
) -> Result<R> {
    if let Some(b) = buffer_bytes(env, v) {
        return Ok(f(b));
    }
    if convert::type_of(env, v) != sys::ValueType::napi_string {
        return Err(type_error(
            env,
            field,
            &format!(
                "{field} must be a string or a Buffer, got {}",
                convert::type_name(env, v)
            ),
        ));
    }
    lossy_str(env, v, field, |s| f(s.as_bytes()))
}

/// The Latin-1 bytes of the string `v` (a header value: one byte per character, as
/// `Buffer.from(value, 'latin1')` gives them), or a Buffer's bytes, appended to `out`.
fn push_latin1(
    env: sys::napi_env,
    v: sys::napi_value,
    field: &str,
    out: &mut Vec<u8>,
) -> Result<()> {
    if let Some(b) = buffer_bytes(env, v) {
        out.extend_from_slice(b);
        return Ok(());
    }
    let mut len = 0usize;
    // SAFETY: a null buffer asks for the length (in Latin-1 bytes: one per character).
    let status = unsafe { sys::napi_get_value_string_latin1(env, v, ptr::null_mut(), 0, &mut len) };
    if status != sys::Status::napi_ok {
        return Err(type_error(
            env,
            field,
            &format!(
                "{field} must be a string or a Buffer, got {}",
                convert::type_name(env, v)
            ),
        ));
    }
    let start = out.len();
    out.resize(start + len + 1, 0);
    let mut written = 0usize;
    // SAFETY: `out` has room for `len` bytes and the NUL from `start`.
    unsafe {
        sys::napi_get_value_string_latin1(
            env,
            v,
            out.as_mut_ptr().add(start).cast(),
            len + 1,
            &mut written,
        )
    };
    out.truncate(start + written);
    Ok(())
}

fn js_str(env: sys::napi_env, s: &str) -> sys::napi_value {
    let mut v = ptr::null_mut();
    // SAFETY: on the JS thread; `s` is valid UTF-8 for its length.
    unsafe { sys::napi_create_string_utf8(env, s.as_ptr().cast(), s.len() as isize, &mut v) };
    v
}

fn js_latin1(env: sys::napi_env, b: &[u8]) -> sys::napi_value {
    let mut v = ptr::null_mut();
    // SAFETY: on the JS thread; one character per byte.
    unsafe { sys::napi_create_string_latin1(env, b.as_ptr().cast(), b.len() as isize, &mut v) };
    v
}

fn js_u32(env: sys::napi_env, n: u32) -> sys::napi_value {
    let mut v = ptr::null_mut();
    // SAFETY: on the JS thread.
    unsafe { sys::napi_create_uint32(env, n, &mut v) };
    v
}

fn js_array(env: sys::napi_env, items: &[sys::napi_value]) -> sys::napi_value {
    let mut a = ptr::null_mut();
    // SAFETY: on the JS thread; every item is a live value of this call.
    unsafe {
        sys::napi_create_array_with_length(env, items.len(), &mut a);
        for (i, v) in items.iter().enumerate() {
            sys::napi_set_element(env, a, i as u32, *v);
        }
    }
    a
}

fn array_len(env: sys::napi_env, v: sys::napi_value, field: &str, what: &str) -> Result<u32> {
    let mut is_array = false;
    // SAFETY: a live value of this call.
    unsafe { sys::napi_is_array(env, v, &mut is_array) };
    if !is_array {
        return Err(type_error(
            env,
            field,
            &format!("{field} must be {what}, got {}", convert::type_name(env, v)),
        ));
    }
    let mut len = 0u32;
    // SAFETY: `v` is an array.
    unsafe { sys::napi_get_array_length(env, v, &mut len) };
    Ok(len)
}

fn element(env: sys::napi_env, v: sys::napi_value, i: u32) -> Result<sys::napi_value> {
    let mut item = ptr::null_mut();
    // SAFETY: `v` is an array of this call.
    if unsafe { sys::napi_get_element(env, v, i, &mut item) } != sys::Status::napi_ok {
        // A getter threw: its exception is pending and propagates.
        return Err(Error::new(Status::PendingException, "a getter threw"));
    }
    Ok(item)
}

fn problem_value(env: sys::napi_env, p: &Problem) -> Result<sys::napi_value> {
    // SAFETY: on the JS thread.
    unsafe { HttpProblem::to_napi_value(env, problem_js(p)) }
}

/// The calls of one request, their arguments read from `argv`; `Ok(value)` is the
/// function's result. Errors carry a pending exception or a message to throw.
fn js_call(
    env: sys::napi_env,
    info: sys::napi_callback_info,
    f: impl FnOnce(&[sys::napi_value], *mut c_void) -> Result<sys::napi_value>,
) -> sys::napi_value {
    let mut argc = 8usize;
    let mut argv = [ptr::null_mut(); 8];
    let mut data = ptr::null_mut();
    // SAFETY: a callback of a function made by `plain_function`; missing arguments are
    // `undefined`.
    unsafe {
        sys::napi_get_cb_info(
            env,
            info,
            &mut argc,
            argv.as_mut_ptr(),
            ptr::null_mut(),
            &mut data,
        )
    };
    crate::errors::value_or_throw(env, f(&argv, data))
}

/// A JavaScript function calling `cb`, with `data` (freed by `finalize`, if given).
fn plain_function<'env>(
    env: &'env Env,
    name: &std::ffi::CStr,
    cb: unsafe extern "C" fn(sys::napi_env, sys::napi_callback_info) -> sys::napi_value,
    data: *mut c_void,
    finalize: Option<unsafe extern "C" fn(sys::napi_env, *mut c_void, *mut c_void)>,
) -> Result<Unknown<'env>> {
    let raw = env.raw();
    let mut f = ptr::null_mut();
    // SAFETY: on the JS thread; `data` lives until `finalize` runs.
    unsafe {
        if sys::napi_create_function(
            raw,
            name.as_ptr(),
            name.count_bytes() as isize,
            Some(cb),
            data,
            &mut f,
        ) != sys::Status::napi_ok
            || (finalize.is_some()
                && sys::napi_add_finalizer(
                    raw,
                    f,
                    data,
                    finalize,
                    ptr::null_mut(),
                    ptr::null_mut(),
                ) != sys::Status::napi_ok)
        {
            if let Some(fin) = finalize {
                fin(raw, data, ptr::null_mut());
            }
            return Err(Error::new(
                Status::GenericFailure,
                "oncely: could not make a function",
            ));
        }
        Ok(Unknown::from_raw_unchecked(raw, f))
    }
}

/// `(method, values)` of `HttpConfig.keyReader()`.
unsafe extern "C" fn key_reader_fn(
    env: sys::napi_env,
    info: sys::napi_callback_info,
) -> sys::napi_value {
    read_key_call(env, info, false)
}

/// `(fullMethod, values)` of `HttpConfig.grpcKeyReader()`.
unsafe extern "C" fn grpc_key_reader_fn(
    env: sys::napi_env,
    info: sys::napi_callback_info,
) -> sys::napi_value {
    read_key_call(env, info, true)
}

/// `ServerConfig::read_key` or `read_grpc_key`.
type ReadKey = fn(&ServerConfig, &str, &[&[u8]]) -> std::result::Result<KeyDecision, Problem>;

/// A key reader's call: `ServerConfig::read_key` (an HTTP method) or, with `grpc`,
/// `read_grpc_key` (a gRPC method's full name).
fn read_key_call(env: sys::napi_env, info: sys::napi_callback_info, grpc: bool) -> sys::napi_value {
    let (what, read): (&str, ReadKey) = if grpc {
        ("fullMethod", ServerConfig::read_grpc_key)
    } else {
        ("method", ServerConfig::read_key)
    };
    js_call(env, info, |argv, data| {
        // SAFETY: the data of a key reader: a boxed `ServerConfig` freed by its finalizer.
        let config = unsafe { &*(data as *const ServerConfig) };
        let values = argv[1];
        let n = array_len(
            env,
            values,
            "values",
            "an array of the Idempotency-Key values",
        )?;
        let decision = lossy_str(env, argv[0], what, |method| -> Result<_> {
            Ok(match n {
                0 => read(config, method, &[]),
                1 => {
                    let v = element(env, values, 0)?;
                    with_bytes(env, v, "values", |b| read(config, method, &[b]))?
                }
                _ => {
                    let mut owned = Vec::with_capacity(n as usize);
                    for i in 0..n {
                        let v = element(env, values, i)?;
                        owned.push(with_bytes(env, v, "values", <[u8]>::to_vec)?);
                    }
                    let refs: Vec<&[u8]> = owned.iter().map(Vec::as_slice).collect();
                    read(config, method, &refs)
                }
            })
        })??;
        match decision {
            Ok(KeyDecision::PassThrough) => {
                let mut null = ptr::null_mut();
                // SAFETY: on the JS thread.
                unsafe { sys::napi_get_null(env, &mut null) };
                Ok(null)
            }
            Ok(KeyDecision::Dedup(key)) => Ok(js_str(env, key.as_str())),
            Err(p) => problem_value(env, &p),
        }
    })
}

unsafe extern "C" fn finalize_config(_env: sys::napi_env, data: *mut c_void, _hint: *mut c_void) {
    // SAFETY: the `ServerConfig` boxed by `key_reader`; finalized once.
    drop(unsafe { Box::from_raw(data as *mut ServerConfig) });
}

#[napi]
impl HttpConfig {
    /// `readKey` as a plain function bound to these settings, for a server's hot path:
    /// `(method, values)` gives `null` (pass the request through), the validated key
    /// (a string), or the problem to answer (an object: `HttpProblem`). `values` is an
    /// array of the `Idempotency-Key` values (strings or Buffers; empty: no header).
    #[napi(
        ts_return_type = "(method: string, values: Array<string | Buffer>) => string | null | HttpProblem"
    )]
    pub fn key_reader<'env>(&self, env: &'env Env) -> Result<Unknown<'env>> {
        let data = Box::into_raw(Box::new(self.inner.clone()));
        plain_function(
            env,
            c"readKey",
            key_reader_fn,
            data.cast(),
            Some(finalize_config),
        )
    }

    /// `readGrpcKey` as a plain function bound to these settings, for a gRPC server's hot
    /// path: `(fullMethod, values)` gives what `keyReader()`'s function gives, `values`
    /// being the `x-idempotency-key` metadata values.
    #[napi(
        ts_return_type = "(fullMethod: string, values: Array<string | Buffer>) => string | null | HttpProblem"
    )]
    pub fn grpc_key_reader<'env>(&self, env: &'env Env) -> Result<Unknown<'env>> {
        let data = Box::into_raw(Box::new(self.inner.clone()));
        plain_function(
            env,
            c"readGrpcKey",
            grpc_key_reader_fn,
            data.cast(),
            Some(finalize_config),
        )
    }
}

/// The scoped key and the fingerprint of a request in one call (SPEC §8): what
/// `scope(tenant, method, route, key)` and `requestFingerprint(method, target,
/// contentType, body)` give, as `[scoped, fingerprint]`; `target` null or undefined
/// skips the fingerprint (`[scoped]`). A tenant, method or key that cannot scope a key
/// gives the problem to answer instead (an object: 500 tenant-unusable for the tenant,
/// else 400): the tenant comes from the server's own function, not from the client.
/// Arguments of the wrong type throw a TypeError (INVALID_ARGUMENT).
#[napi(
    ts_args_type = "tenant: string, method: string, route: string, key: string, target?: string | null, contentType?: string | null, body?: string | Buffer",
    ts_return_type = "[string, string] | [string] | HttpProblem"
)]
// Positional arguments: an options object would cost a property lookup per field.
#[allow(clippy::too_many_arguments)]
pub fn http_request<'env>(
    env: &'env Env,
    tenant: Unknown<'env>,
    method: Unknown<'env>,
    route: Unknown<'env>,
    key: Unknown<'env>,
    target: Option<Unknown<'env>>,
    content_type: Option<Unknown<'env>>,
    body: Option<Unknown<'env>>,
) -> Result<Unknown<'env>> {
    let raw = env.raw();
    let out = match scoped_request(raw, tenant, method, route, key, target, content_type, body)? {
        Err(p) => problem_value(raw, &p)?,
        Ok((scoped, None)) => js_array(raw, &[js_str(raw, &scoped)]),
        Ok((scoped, Some(fp))) => js_array(raw, &[js_str(raw, &scoped), js_str(raw, &fp)]),
    };
    // SAFETY: a live value of this call.
    Ok(unsafe { Unknown::from_raw_unchecked(raw, out) })
}

/// `request` for the server adapters, as one string: the fingerprint's 64 hex digits
/// followed by the scoped key (the scoped key alone without `target`), or the problem.
/// Spares the array and a second string (a server makes one per covered request).
#[napi(
    ts_args_type = "tenant: string, method: string, route: string, key: string, target?: string | null, contentType?: string | null, body?: string | Buffer",
    ts_return_type = "string | HttpProblem"
)]
#[allow(clippy::too_many_arguments)]
pub fn http_request_text<'env>(
    env: &'env Env,
    tenant: Unknown<'env>,
    method: Unknown<'env>,
    route: Unknown<'env>,
    key: Unknown<'env>,
    target: Option<Unknown<'env>>,
    content_type: Option<Unknown<'env>>,
    body: Option<Unknown<'env>>,
) -> Result<Unknown<'env>> {
    let raw = env.raw();
    let out = match scoped_request(raw, tenant, method, route, key, target, content_type, body)? {
        Err(p) => problem_value(raw, &p)?,
        Ok((scoped, None)) => js_str(raw, &scoped),
        Ok((scoped, Some(mut fp))) => {
            debug_assert_eq!(fp.len(), FINGERPRINT_HEX_LEN);
            fp.push_str(&scoped);
            js_str(raw, &fp)
        }
    };
    // SAFETY: a live value of this call.
    Ok(unsafe { Unknown::from_raw_unchecked(raw, out) })
}

/// The length of a request fingerprint (SHA-256 in lower-case hex), where
/// `requestText` puts the scoped key.
pub(crate) const FINGERPRINT_HEX_LEN: usize = 64;

/// What `request` and `requestText` give: the scoped key and, with a `target`, the
/// fingerprint; or the problem to answer.
#[allow(clippy::too_many_arguments)]
fn scoped_request<'env>(
    raw: sys::napi_env,
    tenant: Unknown<'env>,
    method: Unknown<'env>,
    route: Unknown<'env>,
    key: Unknown<'env>,
    target: Option<Unknown<'env>>,
    content_type: Option<Unknown<'env>>,
    body: Option<Unknown<'env>>,
) -> Result<std::result::Result<(String, Option<String>), Problem>> {
    let text = |v: Unknown<'env>, field: &str| lossy_str(raw, v.raw(), field, str::to_owned);
    let method = text(method, "method")?;
    let scoped = scoped_or_problem(
        &text(tenant, "tenant")?,
        &method,
        &text(route, "route")?,
        &text(key, "key")?,
    );
    let scoped = match scoped {
        Ok(s) => s,
        Err(p) => return Ok(Err(p)),
    };
    let present =
        |v: Option<Unknown<'env>>| v.map(|v| v.raw()).filter(|v| !convert::is_nullish(raw, *v));
    let Some(t) = present(target) else {
        return Ok(Ok((scoped, None)));
    };
    let target = lossy_str(raw, t, "target", str::to_owned)?;
    let ct = match present(content_type) {
        None => None,
        Some(c) => Some(lossy_str(raw, c, "contentType", str::to_owned)?),
    };
    let Some(body) = present(body) else {
        return Err(type_error(
            raw,
            "body",
            "body must be a string or a Buffer, got nothing",
        ));
    };
    let fp = with_bytes(raw, body, "body", |b| {
        contract::request_fingerprint(&method, &target, ct.as_deref(), b)
    })?;
    Ok(Ok((scoped, Some(fp))))
}

/// The scoped key, or the problem to answer when the parts cannot make one: what the
/// adapters answered when `scope` threw (a tenant: 500 tenant-unusable; a method or a
/// key: 400 with the error's message).
fn scoped_or_problem(
    tenant: &str,
    method: &str,
    route: &str,
    key: &str,
) -> std::result::Result<String, Problem> {
    let scoped =
        IdempotencyKey::parse(key).and_then(|key| contract::scope(tenant, method, route, &key));
    match scoped {
        Ok(s) => {
            let text = s.as_str().to_owned();
            crate::store::remember_scoped(s);
            Ok(text)
        }
        Err(CoreError::InvalidArgument { field, reason }) => {
            let field = js_field(field);
            let message = format!("invalid {field}: {reason}");
            Err(if field == "tenant" {
                Problem::tenant_unusable(message)
            } else {
                Problem::from_error(&CoreError::InvalidArgument {
                    field: static_field(field),
                    reason: message,
                })
            })
        }
        Err(e) => Err(Problem::from_error(&e)),
    }
}

/// The record bytes (`OHR1`) of an HTTP response in one call: `status`, `fields` the
/// stored headers as one flat array `[name, value, name, value, ...]` (values as
/// Latin-1 strings, one byte per character as Node keeps header values, or Buffers),
/// the body and, optionally, the trailers in the same flat form (a gRPC answer's
/// `grpc-status`): what `encodeResponse` makes of the same response. A status outside
/// 100..=999 or a malformed field list throws INVALID_ARGUMENT.
#[napi(
    ts_args_type = "status: number, fields: Array<string | Buffer>, body: Buffer, trailers?: Array<string | Buffer> | null",
    ts_return_type = "Buffer"
)]
pub fn http_encode_record<'env>(
    env: &'env Env,
    status: Unknown<'env>,
    fields: Unknown<'env>,
    body: Unknown<'env>,
    trailers: Option<Unknown<'env>>,
) -> Result<Unknown<'env>> {
    let raw = env.raw();
    let record = record_of(raw, status, fields, body, trailers)?;
    // SAFETY: a live value of this call.
    Ok(unsafe { Unknown::from_raw_unchecked(raw, buffer_copy(raw, &record)) })
}

/// `encodeRecord` writing into `scratch`, a Buffer the caller reuses: the record's
/// length when it fits (the record is `scratch.subarray(0, length)`, to be copied out
/// before the next call), else a new Buffer holding the record. A server copies a small
/// record out of `scratch` into Node's shared Buffer pool: a Buffer made here has a
/// memory block of its own, which V8 allocates and sweeps one by one.
#[napi(
    ts_args_type = "scratch: Buffer, status: number, fields: Array<string | Buffer>, body: Buffer, trailers?: Array<string | Buffer> | null",
    ts_return_type = "number | Buffer"
)]
pub fn http_encode_record_into<'env>(
    env: &'env Env,
    scratch: Unknown<'env>,
    status: Unknown<'env>,
    fields: Unknown<'env>,
    body: Unknown<'env>,
    trailers: Option<Unknown<'env>>,
) -> Result<Unknown<'env>> {
    let raw = env.raw();
    // Every argument is read (which may run JavaScript: getters, proxies) before the
    // scratch Buffer is written.
    let record = record_of(raw, status, fields, body, trailers)?;
    let mut is_buffer = false;
    // SAFETY: a live value of this call.
    unsafe { sys::napi_is_buffer(raw, scratch.raw(), &mut is_buffer) };
    if !is_buffer {
        return Err(type_error(
            raw,
            "scratch",
            &format!(
                "scratch must be a Buffer, got {}",
                convert::type_name(raw, scratch.raw())
            ),
        ));
    }
    let mut p = ptr::null_mut();
    let mut len = 0usize;
    // SAFETY: `scratch` is a Buffer of this call.
    unsafe { sys::napi_get_buffer_info(raw, scratch.raw(), &mut p, &mut len) };
    let out = if record.len() <= len && !record.is_empty() {
        // SAFETY: `p` holds `len >= record.len()` writable bytes, not aliased by `record`
        // (a Vec of its own); no JavaScript runs during the copy.
        unsafe { ptr::copy_nonoverlapping(record.as_ptr(), p.cast::<u8>(), record.len()) };
        let mut n = ptr::null_mut();
        // SAFETY: on the JS thread.
        unsafe { sys::napi_create_double(raw, record.len() as f64, &mut n) };
        n
    } else {
        buffer_copy(raw, &record)
    };
    // SAFETY: a live value of this call.
    Ok(unsafe { Unknown::from_raw_unchecked(raw, out) })
}

/// The record bytes of `encodeRecord`'s arguments.
fn record_of<'env>(
    raw: sys::napi_env,
    status: Unknown<'env>,
    fields: Unknown<'env>,
    body: Unknown<'env>,
    trailers: Option<Unknown<'env>>,
) -> Result<Vec<u8>> {
    let status = convert::integer(raw, status.raw(), "status", 100.0, 999.0)? as u16;
    let headers = if convert::type_of(raw, fields.raw()) == sys::ValueType::napi_string {
        text_fields(raw, fields.raw(), "fields")?
    } else {
        flat_fields(raw, fields.raw(), "fields")?
    };
    let trailers = match trailers.map(|t| t.raw()) {
        Some(t) if !convert::is_nullish(raw, t) => flat_fields(raw, t, "trailers")?,
        _ => Vec::new(),
    };
    let Some(body) = buffer_bytes(raw, body.raw()) else {
        return Err(type_error(
            raw,
            "body",
            &format!(
                "body must be a Buffer, got {}",
                convert::type_name(raw, body.raw())
            ),
        ));
    };
    Ok(StoredResponse {
        status,
        headers,
        body: body.to_vec(),
        trailers,
    }
    .encode())
}

/// A new Buffer holding a copy of `bytes`.
fn buffer_copy(raw: sys::napi_env, bytes: &[u8]) -> sys::napi_value {
    let mut v = ptr::null_mut();
    let mut data = ptr::null_mut();
    // SAFETY: on the JS thread; `bytes` is valid for its length.
    unsafe {
        sys::napi_create_buffer_copy(raw, bytes.len(), bytes.as_ptr().cast(), &mut data, &mut v)
    };
    v
}

/// Fields given flat, `[name, value, ...]`: names lower-cased, values as Latin-1 strings
/// (one byte per character) or Buffers. Anything else is INVALID_ARGUMENT naming `field`.
fn flat_fields(
    raw: sys::napi_env,
    v: sys::napi_value,
    field: &str,
) -> Result<Vec<(String, Vec<u8>)>> {
    let n = array_len(raw, v, field, "an array of names and values")?;
    if n % 2 != 0 {
        return Err(range_error(
            raw,
            field,
            &format!("must hold a value for every name, got {n} items"),
        ));
    }
    let mut out = Vec::with_capacity(n as usize / 2);
    for i in (0..n).step_by(2) {
        let name = lossy_str(raw, element(raw, v, i)?, field, str::to_ascii_lowercase)?;
        let mut value = Vec::new();
        push_latin1(raw, element(raw, v, i + 1)?, field, &mut value)?;
        out.push((name, value));
    }
    Ok(out)
}

/// Fields given as one string, each name and each value followed by a newline
/// (`name\nvalue\n...`): the form a server adapter passes, one string read instead of an
/// array element per name and value. Split on the newline characters themselves (read
/// as UTF-16: a character above U+00FF whose low byte is a newline's does not split),
/// then each character taken as one byte, as `flat_fields` takes a value. A string that
/// does not split into whole pairs is INVALID_ARGUMENT naming `field`.
fn text_fields(
    raw: sys::napi_env,
    v: sys::napi_value,
    field: &str,
) -> Result<Vec<(String, Vec<u8>)>> {
    let mut len = 0usize;
    // SAFETY: a null buffer asks for the length in UTF-16 units.
    let status = unsafe { sys::napi_get_value_string_utf16(raw, v, ptr::null_mut(), 0, &mut len) };
    if status != sys::Status::napi_ok {
        return Err(not_a_string(raw, v, field));
    }
    let mut units = vec![0u16; len + 1];
    let mut written = 0usize;
    // SAFETY: `units` has room for `len` units and the NUL.
    unsafe { sys::napi_get_value_string_utf16(raw, v, units.as_mut_ptr(), len + 1, &mut written) };
    units.truncate(written);
    let mut parts = units.split(|u| *u == u16::from(b'\n'));
    // The text ends with a newline: the last part is empty.
    let last = parts.next_back();
    // One byte per character, as a header value given as a string in the flat form.
    let bytes = |part: &[u16]| part.iter().map(|u| *u as u8).collect::<Vec<u8>>();
    let mut out = Vec::new();
    while let Some(name) = parts.next() {
        let Some(value) = parts.next() else {
            return Err(range_error(
                raw,
                field,
                "must hold a value for every name, one per line",
            ));
        };
        out.push((
            String::from_utf16_lossy(name).to_ascii_lowercase(),
            bytes(value),
        ));
    }
    if last.is_some_and(|l| !l.is_empty()) {
        return Err(range_error(
            raw,
            field,
            "must end every name and value with a newline",
        ));
    }
    Ok(out)
}

/// Reads record bytes back in one call, flat: `[status, bodyStart, bodyEnd, headerCount,
/// name, value, ...]`, the headers then the trailers as names and Latin-1 string values;
/// the body is `record.subarray(bodyStart, bodyEnd)` (not copied). Anything but a record
/// throws UNAVAILABLE, as `decodeResponse`.
#[napi(
    ts_args_type = "record: Buffer",
    ts_return_type = "Array<number | string>"
)]
pub fn http_decode_record<'env>(env: &'env Env, record: Unknown<'env>) -> Result<Unknown<'env>> {
    let raw = env.raw();
    let Some(bytes) = buffer_bytes(raw, record.raw()) else {
        return Err(type_error(
            raw,
            "record",
            &format!(
                "record must be a Buffer, got {}",
                convert::type_name(raw, record.raw())
            ),
        ));
    };
    let r = StoredResponse::decode(bytes).or_throw(raw)?;
    // The body is the record's last part (`decode` refuses trailing bytes).
    let end = bytes.len();
    let start = end - r.body.len();
    let mut items = Vec::with_capacity(4 + 2 * (r.headers.len() + r.trailers.len()));
    items.push(js_u32(raw, u32::from(r.status)));
    items.push(js_u32(raw, start as u32));
    items.push(js_u32(raw, end as u32));
    items.push(js_u32(raw, r.headers.len() as u32));
    for (name, value) in r.headers.iter().chain(&r.trailers) {
        items.push(js_str(raw, name));
        items.push(js_latin1(raw, value));
    }
    // SAFETY: a live value of this call.
    Ok(unsafe { Unknown::from_raw_unchecked(raw, js_array(raw, &items)) })
}
