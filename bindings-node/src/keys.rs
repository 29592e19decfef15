//! Idempotency keys, scoped keys, fingerprints and the protocol's constants (SPEC §5, §6).

use napi::bindgen_prelude::*;
use napi_derive::napi;

use oncely::{headers, http_status, IdempotencyKey};

use crate::convert::{self, SHORT_STRING_MAX};
use crate::errors::OrThrow;

/// A random idempotency key (UUID v4 from OS randomness): make one per business
/// intent, before the first attempt, and reuse it for every retry.
#[napi]
pub fn new_key() -> String {
    IdempotencyKey::random().as_str().to_owned()
}

/// A stable key for one business intent, the same in Rust, Python and Node.
#[napi(ts_args_type = "businessId: string, operation: string")]
pub fn derive_key(env: &Env, business_id: Unknown<'_>, operation: Unknown<'_>) -> Result<String> {
    let raw = env.raw();
    // Long ids are fine (they are hashed); only non-strings are rejected here.
    let b = convert::string(raw, business_id.raw(), "businessId", usize::MAX)?;
    let o = convert::string(raw, operation.raw(), "operation", usize::MAX)?;
    Ok(IdempotencyKey::derive(&b, &o)
        .or_throw(raw)?
        .as_str()
        .to_owned())
}

/// Returns `key` if it is a valid idempotency key (`[A-Za-z0-9_-]{8,64}`); otherwise
/// throws INVALID_ARGUMENT (`kind` `'missing_key'` for the empty string).
#[napi(ts_args_type = "key: string")]
pub fn validate_key(env: &Env, key: Unknown<'_>) -> Result<String> {
    let raw = env.raw();
    let k = convert::string(raw, key.raw(), "idempotencyKey", SHORT_STRING_MAX)?;
    IdempotencyKey::parse(&k).or_throw(raw)?;
    Ok(k)
}

/// The key a store deduplicates by: tenant + method + idempotency key, encoded
/// injectively (`v1:` + percent-encoded parts, see the core's `ScopedKey`).
#[napi(ts_args_type = "tenant: string, method: string, key: string")]
pub fn scope(
    env: &Env,
    tenant: Unknown<'_>,
    method: Unknown<'_>,
    key: Unknown<'_>,
) -> Result<String> {
    let raw = env.raw();
    let key = convert::with_str(
        raw,
        key.raw(),
        "idempotencyKey",
        SHORT_STRING_MAX,
        IdempotencyKey::parse,
    )?
    .or_throw(raw)?;
    let scoped = convert::with_str(raw, tenant.raw(), "tenant", SHORT_STRING_MAX, |t| {
        convert::with_str(raw, method.raw(), "method", SHORT_STRING_MAX, |m| {
            oncely::ScopedKey::new(t, m, &key)
        })
    })??
    .or_throw(raw)?;
    Ok(scoped.as_str().to_owned())
}

/// Canonical JSON (RFC 8785) of a JSON text. Internal: `canonicalJson(value)` and
/// `fingerprint(value)` serialize with `JSON.stringify` first.
#[napi]
pub fn canonical_json_text(env: &Env, json: String) -> Result<String> {
    let raw = env.raw();
    let value = parse(raw, &json)?;
    let bytes = oncely::canonical_json(&value).or_throw(raw)?;
    Ok(String::from_utf8(bytes).unwrap_or_default())
}

/// SHA-256 (hex) of the canonical JSON of a JSON text. Internal, see above.
#[napi]
pub fn fingerprint_text(env: &Env, json: String) -> Result<String> {
    let raw = env.raw();
    let value = parse(raw, &json)?;
    oncely::fingerprint(&value).or_throw(raw)
}

/// SHA-256 (hex) of raw bytes (a string is taken as its UTF-8 bytes), for callers
/// with their own canonical form.
#[napi(ts_args_type = "data: Uint8Array | string")]
pub fn fingerprint_bytes(env: &Env, data: Unknown<'_>) -> Result<String> {
    let raw = env.raw();
    let v = data.raw();
    if convert::type_of(raw, v) == napi::sys::ValueType::napi_string {
        let s = convert::string(raw, v, "data", usize::MAX)?;
        return Ok(oncely::fingerprint_bytes(s.as_bytes()));
    }
    let mut is_typed = false;
    // SAFETY: `v` is a live value of the current call.
    unsafe { napi::sys::napi_is_typedarray(raw, v, &mut is_typed) };
    if !is_typed {
        return Err(crate::errors::type_error(
            raw,
            "data",
            &format!(
                "data must be a Uint8Array or a string, got {}",
                convert::type_name(raw, v)
            ),
        ));
    }
    let mut kind = 0;
    let mut len = 0usize;
    let mut ptr = std::ptr::null_mut();
    let mut ab = std::ptr::null_mut();
    let mut offset = 0usize;
    // SAFETY: `v` is a typed array; the data pointer stays valid during this call.
    unsafe {
        napi::sys::napi_get_typedarray_info(
            raw,
            v,
            &mut kind,
            &mut len,
            &mut ptr,
            &mut ab,
            &mut offset,
        )
    };
    if kind != napi::sys::TypedarrayType::uint8_array {
        return Err(crate::errors::type_error(
            raw,
            "data",
            "data must be a Uint8Array (or a Buffer) or a string",
        ));
    }
    let bytes: &[u8] = if len == 0 || ptr.is_null() {
        &[]
    } else {
        // SAFETY: a Uint8Array of `len` bytes at `ptr`, alive for this call.
        unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) }
    };
    Ok(oncely::fingerprint_bytes(bytes))
}

fn parse(env: napi::sys::napi_env, json: &str) -> Result<serde_json::Value> {
    serde_json::from_str(json).map_err(|e| {
        crate::errors::range_error(env, "value", &format!("cannot be read as JSON: {e}"))
    })
}

/// Header and metadata names of the protocol.
#[napi(object, object_from_js = false)]
pub struct ProtocolHeaders {
    /// HTTP header carrying the idempotency key: `Idempotency-Key`.
    pub idempotency_key: &'static str,
    /// gRPC metadata key carrying the idempotency key: `x-idempotency-key`.
    pub grpc_idempotency_key: &'static str,
    /// HTTP response header marking a replay (value `true`): `Idempotent-Replayed`.
    pub idempotent_replayed: &'static str,
    /// HTTP header with the delay before a retry: `Retry-After`.
    pub retry_after: &'static str,
    /// gRPC trailer with the server's pushback in ms: `grpc-retry-pushback-ms`.
    pub grpc_retry_pushback_ms: &'static str,
    /// gRPC metadata counting earlier attempts: `grpc-previous-rpc-attempts`.
    pub grpc_previous_rpc_attempts: &'static str,
}

/// HTTP statuses of the server side of the protocol.
#[napi(object)]
pub struct ProtocolHttpStatus {
    /// A write without `Idempotency-Key`: 400.
    pub missing_key: u16,
    /// The key was reused with a different request: 422.
    pub fingerprint_mismatch: u16,
    /// The first request with this key is still running: 409 (with `Retry-After`).
    pub in_progress: u16,
}

/// The protocol's header names. Internal: exported as `headers`.
#[napi]
pub fn protocol_headers() -> ProtocolHeaders {
    ProtocolHeaders {
        idempotency_key: headers::HTTP_IDEMPOTENCY_KEY,
        grpc_idempotency_key: headers::GRPC_IDEMPOTENCY_KEY,
        idempotent_replayed: headers::HTTP_IDEMPOTENT_REPLAYED,
        retry_after: headers::HTTP_RETRY_AFTER,
        grpc_retry_pushback_ms: headers::GRPC_RETRY_PUSHBACK_MS,
        grpc_previous_rpc_attempts: headers::GRPC_PREVIOUS_RPC_ATTEMPTS,
    }
}

/// The protocol's HTTP statuses. Internal: exported as `httpStatus`.
#[napi]
pub fn protocol_http_status() -> ProtocolHttpStatus {
    ProtocolHttpStatus {
        missing_key: http_status::MISSING_KEY,
        fingerprint_mismatch: http_status::FINGERPRINT_MISMATCH,
        in_progress: http_status::IN_PROGRESS,
    }
}
