//! The server contract (SPEC §8): the decisions every server adapter shares — which
//! requests are covered, reading the key, the scope, the request fingerprint, which
//! responses are stored and with which headers, the stored-response record and the
//! RFC 9457 problem bodies.
//!
//! The functions take plain types (`&str`, `u16`, `&[u8]`) so that every adapter —
//! tower in Rust, the Python and Node bindings — calls the same code. An adapter's
//! request path is:
//!
//! 1. [`ServerConfig::read_key`] with the method and the `Idempotency-Key` values:
//!    pass through, a [`Problem`] (400), or a key;
//! 2. [`scope`] (tenant + method + route) and [`request_fingerprint`];
//! 3. the dedup store's `execute`, whose action calls the handler and keeps the
//!    response as a [`StoredResponse`] when [`storable_status`] and
//!    [`ServerConfig::body_fits`] say so, with the headers [`ServerConfig::stores_header`]
//!    selects;
//! 4. a replay answers with the record plus [`REPLAYED_HEADER`]` : true`; a store error
//!    answers with [`Problem::from_error`].
//!
//! ```
//! use oncely::http::{self, KeyDecision, ServerConfig, StoredResponse};
//!
//! let config = ServerConfig::new();
//! let KeyDecision::Dedup(key) = config.read_key("POST", &[b"order-0001"]).unwrap() else {
//!     unreachable!()
//! };
//! let scoped = http::scope("acme", "POST", "/orders", &key).unwrap();
//! assert_eq!(scoped.as_str(), "v1:acme:POST%20/orders:order-0001");
//! let fp = http::request_fingerprint("POST", "/orders", Some("application/json"), br#"{"a":1}"#);
//! assert_eq!(fp.len(), 64);
//!
//! assert!(http::storable_status(201) && !http::storable_status(500));
//! let record = StoredResponse {
//!     status: 201,
//!     headers: vec![("content-type".into(), b"application/json".to_vec())],
//!     body: b"{}".to_vec(),
//!     trailers: vec![],
//! };
//! assert_eq!(StoredResponse::decode(&record.encode()).unwrap(), record);
//!
//! // A GET passes through; a POST without a key is refused.
//! assert_eq!(config.read_key("GET", &[]).unwrap(), KeyDecision::PassThrough);
//! assert_eq!(config.read_key("POST", &[]).unwrap_err().status, 400);
//! ```

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

use crate::code::Code;
use crate::error::Error;
use sha2::{Digest, Sha256};

use crate::key::{canonical_json, headers, IdempotencyKey, ScopedKey};

/// The HTTP header carrying the idempotency key (lower-case, as HTTP/2 sends it).
pub const KEY_HEADER: &str = "idempotency-key";
/// The gRPC metadata key carrying the idempotency key.
pub const GRPC_KEY_METADATA: &str = headers::GRPC_IDEMPOTENCY_KEY;
/// The header (gRPC: trailing metadata) marking a replayed response.
///
/// gRPC answers carry it in their trailers, or in their headers when the answer is
/// trailers-only.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";
/// The value of [`REPLAYED_HEADER`].
pub const REPLAYED_VALUE: &str = "true";
/// The content type of the problem bodies (RFC 9457).
pub const PROBLEM_CONTENT_TYPE: &str = "application/problem+json";
/// The methods covered by default: POST and PATCH.
pub const DEFAULT_METHODS: &[&str] = &["POST", "PATCH"];
/// The largest response body stored by default: 1 MiB.
pub const DEFAULT_BODY_CAP: usize = 1 << 20;
/// The largest request body a covered request may have by default (it is read whole to
/// fingerprint it): 1 MiB. Larger ones get [`Problem::request_too_large`].
pub const DEFAULT_REQUEST_CAP: usize = 1 << 20;
/// The response headers stored by default (those that describe the body).
pub const DEFAULT_STORED_HEADERS: &[&str] =
    &["content-type", "content-encoding", "location", "etag"];
/// The tenant used when the adapter is given no tenant function: one tenant for every
/// caller, so two callers that pick the same key share one result. Give a tenant
/// function (the authenticated principal) whenever callers are not one party.
pub const DEFAULT_TENANT: &str = "default";

/// Headers never stored, whatever the configuration: hop-by-hop headers (RFC 9110
/// §7.6.1), the framing the server recomputes, and the replay marker itself.
const NEVER_STORED: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    REPLAYED_HEADER,
];

/// The adapter settings of the contract: covered methods, whether a key is required,
/// whether concurrent duplicates wait, the body and request caps and the stored headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    methods: Vec<String>,
    required: bool,
    wait: bool,
    body_cap: usize,
    request_cap: usize,
    stored_headers: Vec<String>,
    grpc_methods: Option<Vec<String>>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig::new()
    }
}

impl ServerConfig {
    /// The defaults: POST and PATCH covered, key required, wait for a running
    /// duplicate, 1 MiB body and request caps, [`DEFAULT_STORED_HEADERS`].
    pub fn new() -> Self {
        ServerConfig {
            methods: DEFAULT_METHODS.iter().map(|m| (*m).to_owned()).collect(),
            required: true,
            wait: true,
            body_cap: DEFAULT_BODY_CAP,
            request_cap: DEFAULT_REQUEST_CAP,
            stored_headers: DEFAULT_STORED_HEADERS
                .iter()
                .map(|h| (*h).to_owned())
                .collect(),
            grpc_methods: None,
        }
    }

    /// The covered methods, replacing the default. Methods are case-sensitive (RFC 9110
    /// §9.1) and must be HTTP tokens; anything else is INVALID_ARGUMENT.
    pub fn methods<I, S>(mut self, methods: I) -> Result<Self, Error>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        self.methods = checked_list(methods, "methods", is_token, |m| {
            format!("{m:?} is not an HTTP method (a token such as \"POST\")")
        })?;
        Ok(self)
    }

    /// Whether a covered request without a key is refused with 400 (`true`, the
    /// default) or passed through to the handler untouched.
    pub fn required(mut self, required: bool) -> Self {
        self.required = required;
        self
    }

    /// Whether a duplicate that arrives while the first is running waits for it and
    /// replays its response (`true`, the default) or gets 409 + `Retry-After`.
    pub fn wait(mut self, wait: bool) -> Self {
        self.wait = wait;
        self
    }

    /// The largest response body stored, in bytes; larger responses are sent but not
    /// stored, and the key is released.
    pub fn body_cap(mut self, bytes: usize) -> Self {
        self.body_cap = bytes;
        self
    }

    /// The largest request body a covered request may have, in bytes (it is read whole
    /// to fingerprint it); larger ones get [`Problem::request_too_large`] and the
    /// handler does not run.
    pub fn request_cap(mut self, bytes: usize) -> Self {
        self.request_cap = bytes;
        self
    }

    /// The response headers stored with the body, replacing the default list. Names
    /// are case-insensitive. Hop-by-hop headers, `content-length` and the replay marker
    /// are never stored; `set-cookie` only when listed here.
    pub fn stored_headers<I, S>(mut self, names: I) -> Result<Self, Error>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let names = checked_list(names, "stored_headers", is_token, |n| {
            format!("{n:?} is not a header name")
        })?;
        self.stored_headers = names.iter().map(|n| n.to_ascii_lowercase()).collect();
        Ok(self)
    }

    /// The covered gRPC methods, by full name (`/pkg.Service/Method`). By default every
    /// gRPC call is covered when POST is (gRPC calls are POSTs).
    pub fn grpc_methods<I, S>(mut self, methods: I) -> Result<Self, Error>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let methods = checked_list(
            methods,
            "grpc_methods",
            |m| m.starts_with('/') && m.len() >= 2,
            |m| format!("{m:?} is not a full gRPC method name such as \"/pkg.Orders/Create\""),
        )?;
        self.grpc_methods = Some(methods);
        Ok(self)
    }

    /// Whether requests with this method go through the dedup store.
    pub fn covers(&self, method: &str) -> bool {
        self.methods.iter().any(|m| m == method)
    }

    /// Whether the gRPC call `full_method` (`/pkg.Service/Method`) goes through the
    /// dedup store: POST is covered, and the method is listed (when a list is set).
    pub fn covers_grpc(&self, full_method: &str) -> bool {
        self.covers("POST")
            && self
                .grpc_methods
                .as_ref()
                .is_none_or(|list| list.iter().any(|m| m == full_method))
    }

    /// Whether the response header (or, for a trailers-only gRPC answer, the status
    /// metadata) `name` is stored with a gRPC response: the HTTP list plus
    /// `grpc-encoding`, `grpc-status`, `grpc-message` and `grpc-status-details-bin`.
    pub fn stores_grpc_header(&self, name: &str) -> bool {
        GRPC_STORED_HEADERS
            .iter()
            .any(|n| n.eq_ignore_ascii_case(name))
            || self.stores_header(name)
    }

    /// Whether a missing key is refused (see [`ServerConfig::required`]).
    pub fn is_required(&self) -> bool {
        self.required
    }

    /// Whether running duplicates wait (see [`ServerConfig::wait`]).
    pub fn waits(&self) -> bool {
        self.wait
    }

    /// The body cap in bytes.
    pub fn cap(&self) -> usize {
        self.body_cap
    }

    /// Whether a body of `len` bytes may be stored.
    pub fn body_fits(&self, len: usize) -> bool {
        len <= self.body_cap
    }

    /// The request cap in bytes (see [`ServerConfig::request_cap`]).
    pub fn request_limit(&self) -> usize {
        self.request_cap
    }

    /// Whether a request's `Content-Length` value declares a body over the request cap:
    /// the request is then refused ([`ServerConfig::too_large`]) before its body is
    /// read. A value that declares no length ([`declared_length`] is `None`) declares
    /// nothing here: the server's own parser refuses it, or the adapter does. Digits
    /// beyond any length a server could hold are over the cap.
    pub fn declares_too_large(&self, content_length: &[u8]) -> bool {
        declared_length(content_length).is_some_and(|n| n > self.request_cap as u64)
    }

    /// The problem for a request over the request cap (413).
    pub fn too_large(&self) -> Problem {
        Problem::request_too_large(self.request_cap)
    }

    /// Whether the response header `name` (any case) is stored with the body.
    pub fn stores_header(&self, name: &str) -> bool {
        if NEVER_STORED.iter().any(|n| n.eq_ignore_ascii_case(name)) {
            return false;
        }
        self.stored_headers
            .iter()
            .any(|n| n.eq_ignore_ascii_case(name))
    }

    /// Whether the response header `name` (any case) goes with a response that is not
    /// stored to the duplicates that waited for it (they get that one answer, e.g. a
    /// 503 with its `Retry-After`): every header but the never-stored ones, and
    /// `set-cookie` only when [`stores_header`](Self::stores_header) lists it.
    pub fn shares_header(&self, name: &str) -> bool {
        if name.eq_ignore_ascii_case("set-cookie") {
            return self.stores_header(name);
        }
        !NEVER_STORED.iter().any(|n| n.eq_ignore_ascii_case(name))
    }

    /// Decides what to do with a request: pass it through, refuse it (the [`Problem`]
    /// to send), or dedup it by the key.
    ///
    /// `key_values` are the values of the `Idempotency-Key` header (gRPC:
    /// `x-idempotency-key`) in the request; none when it has no such header. Not
    /// covered → pass through. Covered: no value (or an empty one) → 400 when
    /// required, else pass through; more than one value, or one that is not a valid
    /// key (SPEC §5) → 400.
    pub fn read_key(&self, method: &str, key_values: &[&[u8]]) -> Result<KeyDecision, Problem> {
        self.read(self.covers(method), key_values, Protocol::Http)
    }

    /// [`read_key`](Self::read_key) for the gRPC call `full_method`, covered by
    /// [`covers_grpc`](Self::covers_grpc), with the `x-idempotency-key` values. The
    /// problems' [`Problem::grpc_metadata`] is the gRPC answer.
    pub fn read_grpc_key(
        &self,
        full_method: &str,
        key_values: &[&[u8]],
    ) -> Result<KeyDecision, Problem> {
        self.read(self.covers_grpc(full_method), key_values, Protocol::Grpc)
    }

    fn read(
        &self,
        covered: bool,
        key_values: &[&[u8]],
        protocol: Protocol,
    ) -> Result<KeyDecision, Problem> {
        if !covered {
            return Ok(KeyDecision::PassThrough);
        }
        let value = match key_values {
            [] => b"".as_slice(),
            [one] => one,
            _ => {
                return Err(Problem::from_error(&Error::invalid(
                    "idempotency_key",
                    format!("sent more than once; send one {}", protocol.key_name()),
                )))
            }
        };
        if value.is_empty() {
            return if self.required {
                Err(Problem::from_error_in(&Error::MissingKey, protocol))
            } else {
                Ok(KeyDecision::PassThrough)
            };
        }
        let text = std::str::from_utf8(value).map_err(|_| {
            Problem::from_error(&Error::invalid(
                "idempotency_key",
                "is not ASCII; use only A-Z, a-z, 0-9, '-' and '_'",
            ))
        })?;
        IdempotencyKey::parse(text)
            .map(KeyDecision::Dedup)
            .map_err(|e| Problem::from_error(&e))
    }
}

/// The gRPC response metadata stored besides the HTTP list.
const GRPC_STORED_HEADERS: &[&str] = &[
    "content-type",
    "grpc-encoding",
    "grpc-status",
    "grpc-message",
    "grpc-status-details-bin",
];

/// `items` as owned strings; the first one `valid` refuses is INVALID_ARGUMENT on
/// `field`, with the reason `reason` gives for it.
fn checked_list<I, S>(
    items: I,
    field: &'static str,
    valid: fn(&str) -> bool,
    reason: fn(&str) -> String,
) -> Result<Vec<String>, Error>
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    items
        .into_iter()
        .map(|item| {
            let item = item.as_ref();
            if valid(item) {
                Ok(item.to_owned())
            } else {
                Err(Error::invalid(field, reason(item)))
            }
        })
        .collect()
}

/// An RFC 9110 token (method, header name): one or more `tchar`s.
fn is_token(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(is_tchar)
}

/// RFC 9110 `tchar`: the characters of a token (method, header name).
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// What [`ServerConfig::read_key`] decided for a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyDecision {
    /// Not covered (or no key and none required): call the handler untouched.
    PassThrough,
    /// Dedup the request by this key.
    Dedup(IdempotencyKey),
}

/// The scoped key of a request: `tenant`, and as the method part the HTTP method and
/// the route template (`"POST /orders/{id}"`) where the framework knows it, else the
/// path. gRPC adapters pass `"POST"` and the full method name (`/pkg.Service/Method`).
pub fn scope(
    tenant: &str,
    method: &str,
    route: &str,
    key: &IdempotencyKey,
) -> Result<ScopedKey, Error> {
    let mut part = String::with_capacity(method.len() + 1 + route.len());
    part.push_str(method);
    part.push(' ');
    part.push_str(route);
    ScopedKey::new(tenant, &part, key)
}

/// Whether `content_type` is JSON: `application/json` or any `+json` type, parameters
/// and case ignored.
pub fn is_json(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    match essence.split_once('/') {
        Some((top, sub)) => {
            !top.is_empty() && (essence == "application/json" || sub.ends_with("+json"))
        }
        None => false,
    }
}

/// The fingerprint of a request (SPEC §8): SHA-256, lower-case hex, of
///
/// `"oncely-http-v1" ‖ u64be(len(method)) ‖ method ‖ u64be(len(target)) ‖ target ‖
/// kind ‖ u64be(len(body')) ‖ body'`
///
/// where `target` is the path with its query as sent, and `body'` is the canonical JSON
/// (RFC 8785) of the body with `kind = b'j'` when `content_type` is JSON ([`is_json`])
/// and the body parses as JSON, else the raw body with `kind = b'b'`. So the same JSON
/// data with other key order or whitespace gives the same fingerprint.
pub fn request_fingerprint(
    method: &str,
    target: &str,
    content_type: Option<&str>,
    body: &[u8],
) -> String {
    let canonical = content_type.filter(|ct| is_json(ct)).and_then(|_| {
        if crate::canonical::is_canonical(body) {
            // Already in its canonical form: hashed as it is.
            return Some(Cow::Borrowed(body));
        }
        let v = serde_json::from_slice::<serde_json::Value>(body).ok()?;
        canonical_json(&v).ok().map(Cow::Owned)
    });
    let (kind, body) = match &canonical {
        Some(c) => (b'j', c.as_ref()),
        None => (b'b', body),
    };
    let mut h = Sha256::new();
    h.update(b"oncely-http-v1");
    for part in [method.as_bytes(), target.as_bytes()] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    h.update([kind]);
    h.update((body.len() as u64).to_be_bytes());
    h.update(body);
    hex_lower(&h.finalize())
}

fn hex_lower(digest: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(digest.len() * 2);
    for b in digest {
        s.push(HEX[usize::from(b >> 4)] as char);
        s.push(HEX[usize::from(b & 15)] as char);
    }
    s
}

/// The protocol a server speaks, for naming its key in problems.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// HTTP: the key is the `Idempotency-Key` header.
    Http,
    /// gRPC: the key is the `x-idempotency-key` metadata.
    Grpc,
}

impl Protocol {
    /// How a message names the key of this protocol: `"an Idempotency-Key header"` or
    /// `"x-idempotency-key metadata"`.
    pub const fn key_name(self) -> &'static str {
        match self {
            Protocol::Http => "an Idempotency-Key header",
            Protocol::Grpc => "x-idempotency-key metadata",
        }
    }
}

/// Whether `content_type` is gRPC: `application/grpc`, `application/grpc+<codec>` or
/// either with parameters, case ignored.
pub fn is_grpc(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/grpc" || essence.starts_with("application/grpc+")
}

/// Whether a response with this `content_type` is an event stream
/// (`text/event-stream`, parameters and case ignored): such a response is sent as it
/// is produced and never stored, since it may stay open long after its first events.
pub fn is_event_stream(content_type: &str) -> bool {
    content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .eq_ignore_ascii_case("text/event-stream")
}

/// Whether a gRPC answer with this `grpc-status` value is stored, as HTTP stores 2xx
/// and the 4xx that are final: OK, INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS,
/// PERMISSION_DENIED, FAILED_PRECONDITION, OUT_OF_RANGE, UNAUTHENTICATED. Never the
/// codes that say "try again" or a server fault (CANCELLED, UNKNOWN, DEADLINE_EXCEEDED,
/// RESOURCE_EXHAUSTED, ABORTED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE, DATA_LOSS), nor
/// a value that is not a code.
pub fn storable_grpc_status(value: &[u8]) -> bool {
    let code = std::str::from_utf8(value)
        .ok()
        .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|v| v.parse::<i32>().ok())
        .and_then(Code::from_i32);
    matches!(
        code,
        Some(
            Code::Ok
                | Code::InvalidArgument
                | Code::NotFound
                | Code::AlreadyExists
                | Code::PermissionDenied
                | Code::FailedPrecondition
                | Code::OutOfRange
                | Code::Unauthenticated
        )
    )
}

/// Whether a response with this status is stored: 2xx, and 4xx except 408, 409, 425
/// and 429 (those say "try again", so a retry must run again). Never 1xx, 3xx or 5xx.
pub fn storable_status(status: u16) -> bool {
    matches!(status, 200..=299)
        || (matches!(status, 400..=499) && !matches!(status, 408 | 409 | 425 | 429))
}

/// The length a `Content-Length` value declares (RFC 9110 §8.6): decimal digits, with
/// optional whitespace (spaces and tabs) around them; `u64::MAX` for a number past it.
/// `None` for anything else (a sign, a list, another base, an empty value): no length
/// at all, which a server that has not refused the request must not read by.
pub fn declared_length(content_length: &[u8]) -> Option<u64> {
    let ows = |b: &u8| *b == b' ' || *b == b'\t';
    let start = content_length.iter().position(|b| !ows(b))?;
    let end = content_length.iter().rposition(|b| !ows(b))? + 1;
    let digits = &content_length[start..end];
    if !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(
        digits
            .iter()
            .try_fold(0u64, |n, d| {
                n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
            })
            .unwrap_or(u64::MAX),
    )
}

/// Whether a response to `method` with `status` carries content (RFC 9110 §6.4.1): not
/// one to a HEAD request, nor a 1xx, 204 or 304 (HTTP servers send no body with them).
/// The record of such an answer keeps no body, whatever the handler wrote, so that what
/// is stored is what was sent.
pub fn has_content(method: &str, status: u16) -> bool {
    method != "HEAD" && !matches!(status, 100..=199 | 204 | 304)
}

/// A stored response: what a replay sends back byte for byte.
///
/// Its record ([`StoredResponse::encode`]) is the value kept in the dedup store, so a
/// server in any language can replay a response stored by another:
///
/// ```text
/// "OHR1"                                   4 bytes, format tag and version
/// u16be status
/// u32be n, then n × (u32be len, name, u32be len, value)    headers, names lower-case
/// u32be m, then m × (u32be len, name, u32be len, value)    trailers (gRPC), same
/// u32be len, body
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StoredResponse {
    /// The status code.
    pub status: u16,
    /// The stored headers, names lower-case, in the handler's order.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The whole body.
    pub body: Vec<u8>,
    /// The trailers (gRPC's `grpc-status` and friends), names lower-case.
    pub trailers: Vec<(String, Vec<u8>)>,
}

/// The tag and version at the start of every stored-response record.
pub const RECORD_TAG: &[u8; 4] = b"OHR1";

impl StoredResponse {
    /// The record bytes (see the type's doc).
    pub fn encode(&self) -> Vec<u8> {
        let fields: usize = self
            .headers
            .iter()
            .chain(&self.trailers)
            .map(|(n, v)| 8 + n.len() + v.len())
            .sum();
        let mut out = Vec::with_capacity(4 + 2 + 8 + fields + 4 + self.body.len());
        out.extend_from_slice(RECORD_TAG);
        out.extend_from_slice(&self.status.to_be_bytes());
        for list in [&self.headers, &self.trailers] {
            put_len(&mut out, list.len());
            for (name, value) in list {
                put_len(&mut out, name.len());
                out.extend_from_slice(name.as_bytes());
                put_len(&mut out, value.len());
                out.extend_from_slice(value);
            }
        }
        put_len(&mut out, self.body.len());
        out.extend_from_slice(&self.body);
        out
    }

    /// Reads a record made by [`StoredResponse::encode`] (in any language). Anything
    /// else is UNAVAILABLE: the store holds a value this server cannot replay.
    pub fn decode(bytes: &[u8]) -> Result<Self, Error> {
        let bad = |why: &str| {
            Error::Unavailable(format!(
                "the stored response cannot be read ({why}); it was not written by an \
                 oncely server adapter of this record version (OHR1)"
            ))
        };
        let mut r = Reader(bytes);
        if r.take(4) != Some(RECORD_TAG.as_slice()) {
            return Err(bad("unknown record tag"));
        }
        let status = r
            .take(2)
            .map(|b| u16::from_be_bytes([b[0], b[1]]))
            .ok_or_else(|| bad("truncated"))?;
        let mut lists = [Vec::new(), Vec::new()];
        for list in &mut lists {
            let n = r.len().ok_or_else(|| bad("truncated"))?;
            for _ in 0..n {
                let name = r.chunk().ok_or_else(|| bad("truncated"))?;
                let name = std::str::from_utf8(name)
                    .map_err(|_| bad("a header name is not text"))?
                    .to_owned();
                let value = r.chunk().ok_or_else(|| bad("truncated"))?.to_vec();
                list.push((name, value));
            }
        }
        let body = r.chunk().ok_or_else(|| bad("truncated"))?.to_vec();
        if !r.0.is_empty() {
            return Err(bad("trailing bytes"));
        }
        let [headers, trailers] = lists;
        Ok(StoredResponse {
            status,
            headers,
            body,
            trailers,
        })
    }
}

fn put_len(out: &mut Vec<u8>, len: usize) {
    let len = u32::try_from(len).expect("a stored response part over 4 GiB");
    out.extend_from_slice(&len.to_be_bytes());
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
    fn len(&mut self) -> Option<usize> {
        self.take(4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
    }
    fn chunk(&mut self) -> Option<&'a [u8]> {
        let n = self.len()?;
        self.take(n)
    }
}

/// An RFC 9457 problem answer: the status, headers and `application/problem+json`
/// body an adapter sends when oncely refuses a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The HTTP status ([`Error::http_status`]).
    pub status: u16,
    /// The problem type URI, one per kind: `urn:oncely:problem:<slug>`.
    pub type_uri: &'static str,
    /// A short, fixed summary of the kind.
    pub title: &'static str,
    /// What happened and what to do, for a person.
    pub detail: String,
    /// The gRPC code (gRPC adapters answer with it and `detail`).
    pub code: Code,
    /// For in progress (409) and unavailable (503): the `Retry-After` delay.
    pub retry_after: Option<Duration>,
}

impl Problem {
    /// The problem for an oncely error.
    ///
    /// | error | status | type slug |
    /// |---|---|---|
    /// | `MissingKey` | 400 | `missing-key` |
    /// | `InvalidArgument` | 400 | `invalid-key` |
    /// | `FingerprintMismatch` | 422 | `key-reused` |
    /// | `InProgress` | 409 + Retry-After | `in-progress` |
    /// | `LeaseLost` | 409 | `lease-lost` |
    /// | `Capacity` | 503 + Retry-After 1 | `capacity` |
    /// | `Unavailable` | 503 + Retry-After 1 | `unavailable` |
    /// | `LeaderPanicked`, `Reentrant`, `ResultNotStored` | 500 (code INTERNAL) | `internal` |
    pub fn from_error(error: &Error) -> Self {
        Self::from_error_in(error, Protocol::Http)
    }

    /// [`from_error`](Self::from_error) for a server of `protocol`: a missing key's
    /// `detail` names that protocol's key (the `Idempotency-Key` header, or the
    /// `x-idempotency-key` metadata of gRPC).
    ///
    /// ```
    /// use oncely::http::{Problem, Protocol};
    /// let p = Problem::from_error_in(&oncely::Error::MissingKey, Protocol::Grpc);
    /// assert!(p.detail.starts_with("write operations require x-idempotency-key metadata"));
    /// ```
    pub fn from_error_in(error: &Error, protocol: Protocol) -> Self {
        let (slug, title, retry_after): (&'static str, &'static str, Option<Duration>) = match error
        {
            Error::MissingKey => (
                "urn:oncely:problem:missing-key",
                "Idempotency-Key is missing",
                None,
            ),
            Error::InvalidArgument { .. } => (
                "urn:oncely:problem:invalid-key",
                "Idempotency-Key is invalid",
                None,
            ),
            Error::FingerprintMismatch => (
                "urn:oncely:problem:key-reused",
                "Idempotency-Key reused with another request",
                None,
            ),
            Error::InProgress { retry_after } => (
                "urn:oncely:problem:in-progress",
                "A request with this Idempotency-Key is in progress",
                Some(*retry_after),
            ),
            Error::LeaseLost => (
                "urn:oncely:problem:lease-lost",
                "The request's claim on its Idempotency-Key was lost",
                None,
            ),
            Error::Capacity { .. } => (
                "urn:oncely:problem:capacity",
                "The idempotency store is full",
                Some(Duration::from_secs(1)),
            ),
            Error::Unavailable(_) => (
                "urn:oncely:problem:unavailable",
                "The idempotency store is unavailable",
                Some(Duration::from_secs(1)),
            ),
            Error::LeaderPanicked(_) | Error::Reentrant { .. } | Error::ResultNotStored { .. } => (
                "urn:oncely:problem:internal",
                "The request failed inside the server",
                None,
            ),
        };
        let detail = match error {
            Error::MissingKey => format!(
                "write operations require {}: make one key per operation and send it again \
                 on every retry",
                protocol.key_name()
            ),
            other => other.to_string(),
        };
        // The server's own faults answer INTERNAL (gRPC's 500), whatever the error's code
        // (a re-entrant call is FAILED_PRECONDITION to its caller): a final status such as
        // FAILED_PRECONDITION would be stored by an adapter around this one, keeping the
        // fault as the key's answer after the server is fixed.
        let code = match error {
            Error::LeaderPanicked(_) | Error::Reentrant { .. } | Error::ResultNotStored { .. } => {
                Code::Internal
            }
            other => other.code(),
        };
        Problem {
            status: error.http_status(),
            type_uri: slug,
            title,
            detail,
            code,
            retry_after,
        }
    }

    /// A covered request whose body is over the adapter's request cap (413): it cannot be
    /// fingerprinted, so it is refused before the handler runs.
    pub fn request_too_large(cap: usize) -> Self {
        Problem {
            status: 413,
            type_uri: "urn:oncely:problem:request-too-large",
            title: "The request body is too large",
            detail: format!(
                "a request with an Idempotency-Key may have a body of at most {cap} bytes"
            ),
            code: Code::from_http(413),
            retry_after: None,
        }
    }

    /// A covered request whose body could not be read (400); the handler did not run.
    pub fn request_body_unreadable(detail: impl fmt::Display) -> Self {
        Problem {
            status: 400,
            type_uri: "urn:oncely:problem:body-unreadable",
            title: "The request body could not be read",
            detail: format!("the request body could not be read: {detail}"),
            code: Code::InvalidArgument,
            retry_after: None,
        }
    }

    /// The tenant function gave a tenant a key cannot be scoped by (empty, or over
    /// 1024 bytes): 500 `tenant-unusable`, since the tenant comes from the server's own
    /// code (e.g. no authenticated principal where one was expected), not from the
    /// key the client sent. The handler does not run.
    pub fn tenant_unusable(reason: impl fmt::Display) -> Self {
        Problem {
            status: 500,
            type_uri: "urn:oncely:problem:tenant-unusable",
            title: "The server could not tell the request's tenant",
            detail: format!(
                "the tenant function gave a tenant that cannot scope an Idempotency-Key \
                 ({reason}); the key itself was not checked"
            ),
            code: Code::Internal,
            retry_after: None,
        }
    }

    /// The `Retry-After` value in whole seconds (rounded up, at least 1), if any.
    pub fn retry_after_secs(&self) -> Option<u64> {
        self.retry_after.map(|d| {
            let s = d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0));
            s.max(1)
        })
    }

    /// The headers to send: `content-type: application/problem+json`, and
    /// `retry-after` when there is a delay.
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut h = vec![("content-type", PROBLEM_CONTENT_TYPE.to_owned())];
        if let Some(s) = self.retry_after_secs() {
            h.push(("retry-after", s.to_string()));
        }
        h
    }

    /// The gRPC answer (trailers-only metadata): `grpc-status` (the code's number),
    /// `grpc-message` (`detail`, percent-encoded as gRPC requires) and, when there is a
    /// delay, `grpc-retry-pushback-ms`.
    pub fn grpc_metadata(&self) -> Vec<(&'static str, String)> {
        let mut m = vec![
            ("grpc-status", (self.code as u8).to_string()),
            ("grpc-message", grpc_percent_encode(&self.detail)),
        ];
        if let Some(d) = self.retry_after {
            m.push(("grpc-retry-pushback-ms", d.as_millis().to_string()));
        }
        m
    }

    /// The body: canonical JSON of `type`, `title`, `status`, `detail` and `code` (the
    /// gRPC code name).
    pub fn body(&self) -> Vec<u8> {
        let value = serde_json::json!({
            "type": self.type_uri,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            "code": self.code.as_str(),
        });
        canonical_json(&value).expect("a problem is plain JSON")
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.status, self.title, self.detail)
    }
}

/// gRPC's `grpc-message` encoding: bytes outside printable ASCII, and `%`, as `%XX`.
fn grpc_percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for &b in text.as_bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
