//! The server contract (SPEC §8, the core's `oncely::http`) for the Node adapters
//! (`oncely/express`, `oncely/fastify`): thin conversions only, every decision is the
//! core's.

use std::time::Duration;

use napi::bindgen_prelude::*;
use napi_derive::napi;

use oncely::http::{self as contract, KeyDecision, Problem, ServerConfig, StoredResponse};
use oncely::{Error as CoreError, IdempotencyKey};

use crate::errors::{core_error, OrThrow};

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
    pub body_cap: Option<u32>,
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
                c = c.body_cap(b as usize);
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

/// Whether a response with this status is stored (2xx, 4xx but 408/409/425/429).
#[napi]
pub fn http_storable_status(status: u32) -> bool {
    u16::try_from(status).is_ok_and(contract::storable_status)
}

/// Whether a gRPC answer with this `grpc-status` value is stored.
#[napi]
pub fn http_storable_grpc_status(value: String) -> bool {
    contract::storable_grpc_status(value.as_bytes())
}

/// Whether a content type is JSON (`application/json` or `+json`).
#[napi]
pub fn http_is_json(content_type: String) -> bool {
    contract::is_json(&content_type)
}

/// Whether a content type is an event stream (`text/event-stream`): such a response
/// is sent as it is produced, keeps the key until it ends and is not stored.
#[napi]
pub fn http_is_event_stream(content_type: String) -> bool {
    contract::is_event_stream(&content_type)
}

/// Whether a content type is gRPC.
#[napi]
pub fn http_is_grpc(content_type: String) -> bool {
    contract::is_grpc(&content_type)
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
#[napi]
pub fn http_problem(env: Env, error: HttpProblemSource) -> Result<HttpProblem> {
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
            let cap = msg
                .parse::<usize>()
                .unwrap_or(contract::DEFAULT_REQUEST_CAP);
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
