//! How a foreign error becomes a [`Failure`] (SPEC §3, "Extraction").
//!
//! The bindings walk their language's objects (attributes, `cause` chains, response
//! objects, gRPC errors) and hand what they read, unjudged, to [`extract`] as
//! [`RawFailure`]s; every rule about what those facts mean lives here, so that one
//! foreign error reads alike in Rust, Python and Node.

use std::time::{Duration, SystemTime};

use crate::classify::{parse_pushback_ms, parse_retry_after, Failure, ServerDelay};
use crate::code::{Code, ReasonCodes};

/// A value read off a foreign error's `code`, `status` or `statusCode`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RawValue {
    /// A string (or an enum member's name).
    Text(String),
    /// An integer.
    Int(i64),
}

/// What a binding can read off one foreign error, without judging it. All fields are
/// optional; [`extract`] decides what they mean.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawFailure {
    /// The error's `code` (a gRPC error's code, an errno-style name, a reason, an HTTP
    /// status, …).
    pub code: Option<RawValue>,
    /// The error's `status`, or that of the response it carries.
    pub status: Option<RawValue>,
    /// The error's `statusCode` / `status_code`, or that of its response.
    pub status_code: Option<RawValue>,
    /// The OS error name of a numeric errno (`"ECONNRESET"`).
    pub errno: Option<String>,
    /// The error's type names, most specific first: a Python exception's classes
    /// along the MRO (`"ConnectionResetError"` for built-ins, `"httpx.TimeoutException"`
    /// — top-level module and class — otherwise), a JavaScript error's `name`.
    pub type_names: Vec<String>,
    /// Header or metadata pairs, in order; names are matched ignoring ASCII case. A
    /// binary (`-bin`) metadata value is given in base64, as on the wire. Only the
    /// names in [`RawFailure::HEADERS`] are read.
    pub headers: Vec<(String, String)>,
    /// A delay the error states itself (oncely's own in-progress error).
    pub delay: Option<Duration>,
    /// The error this one wraps (`cause`, `__cause__`), read when this one names no code.
    pub cause: Option<Box<RawFailure>>,
}

impl RawFailure {
    /// The header and metadata names [`extract`] reads: a binding need only collect these.
    pub const HEADERS: [&'static str; 3] =
        [RETRY_AFTER, GRPC_RETRY_PUSHBACK_MS, GRPC_STATUS_DETAILS_BIN];

    /// How many errors of a `cause` chain [`extract`] reads (the error and four causes).
    pub const MAX_CHAIN: usize = 5;
}

const RETRY_AFTER: &str = "retry-after";
const GRPC_RETRY_PUSHBACK_MS: &str = "grpc-retry-pushback-ms";
const GRPC_STATUS_DETAILS_BIN: &str = "grpc-status-details-bin";
const RETRY_INFO_TYPE: &str = "type.googleapis.com/google.rpc.RetryInfo";

/// OS and socket error names (Node's `err.code`, Python's errno names) and undici's.
/// The request may have been sent (a reset, a broken pipe): the outcome is unknown,
/// which is `UNAVAILABLE`, retried only by a safe (keyed) call. Not sent (refused,
/// unreachable, DNS) is `UNAVAILABLE` too.
const OS_ERRORS: [(&str, Code); 23] = [
    ("ECONNRESET", Code::Unavailable),
    ("EPIPE", Code::Unavailable),
    ("ECONNABORTED", Code::Unavailable),
    ("ECONNREFUSED", Code::Unavailable),
    ("EHOSTUNREACH", Code::Unavailable),
    ("EHOSTDOWN", Code::Unavailable),
    ("ENETUNREACH", Code::Unavailable),
    ("ENETDOWN", Code::Unavailable),
    ("ENETRESET", Code::Unavailable),
    ("EAI_AGAIN", Code::Unavailable),
    ("ENOTFOUND", Code::Unavailable),
    ("ETIMEDOUT", Code::DeadlineExceeded),
    ("ESOCKETTIMEDOUT", Code::DeadlineExceeded),
    ("UND_ERR_CONNECT_TIMEOUT", Code::Unavailable),
    ("UND_ERR_HEADERS_TIMEOUT", Code::DeadlineExceeded),
    ("UND_ERR_BODY_TIMEOUT", Code::DeadlineExceeded),
    ("UND_ERR_ABORTED", Code::Cancelled),
    ("ABORT_ERR", Code::Cancelled),
    ("UND_ERR_INVALID_ARG", Code::InvalidArgument),
    ("UND_ERR_INVALID_RETURN_VALUE", Code::InvalidArgument),
    ("UND_ERR_NOT_SUPPORTED", Code::Unimplemented),
    ("UND_ERR_SOCKET", Code::Unavailable),
    ("UND_ERR_CLOSED", Code::Unavailable),
];

/// Error type names: Python's built-in OS errors and the transport errors of httpx,
/// requests, aiohttp and urllib3; JavaScript's `TimeoutError` and `AbortError`.
const TYPE_NAMES: [(&str, Code); 22] = [
    ("TimeoutError", Code::DeadlineExceeded),
    ("AbortError", Code::Cancelled),
    ("ConnectionResetError", Code::Unavailable),
    ("ConnectionAbortedError", Code::Unavailable),
    ("ConnectionRefusedError", Code::Unavailable),
    ("BrokenPipeError", Code::Unavailable),
    ("ConnectionError", Code::Unavailable),
    ("socket.gaierror", Code::Unavailable),
    ("socket.timeout", Code::DeadlineExceeded),
    ("asyncio.TimeoutError", Code::DeadlineExceeded),
    ("httpx.TimeoutException", Code::DeadlineExceeded),
    ("httpx.TransportError", Code::Unavailable),
    ("requests.Timeout", Code::DeadlineExceeded),
    ("requests.ConnectionError", Code::Unavailable),
    ("aiohttp.ServerTimeoutError", Code::DeadlineExceeded),
    ("aiohttp.ConnectionTimeoutError", Code::DeadlineExceeded),
    ("aiohttp.SocketTimeoutError", Code::DeadlineExceeded),
    ("aiohttp.ClientConnectionError", Code::Unavailable),
    ("urllib3.TimeoutError", Code::DeadlineExceeded),
    ("urllib3.NewConnectionError", Code::Unavailable),
    ("urllib3.ProtocolError", Code::Unavailable),
    ("grpc.FutureTimeoutError", Code::DeadlineExceeded),
];

/// The failure a foreign error stands for: its code and the delay its server asked
/// for. `now` is the wall clock, to measure a `Retry-After` date against. The rules
/// (SPEC §3, "Extraction"):
///
/// 1. The first error of the chain (the error, then its `cause`, … at most
///    [`RawFailure::MAX_CHAIN`]) whose facts name a code decides; its own facts alone
///    give the delay. When none does, the failure is `UNKNOWN`.
/// 2. Within one error, in this order, the first fact that names a code: `code`,
///    `status`, `status_code`, `errno`, then each type name.
/// 3. A number (or a number as text) in `code`, `status` or `status_code`: 0–16 is the
///    gRPC code with that number, 100–599 an HTTP status (mapped by
///    [`Code::from_http`]); any other number names no code.
/// 4. A text in `code` (trimmed, ASCII case ignored): a gRPC code name
///    (`"unavailable"`), a number, a reason code (`reasons`, built-in or registered),
///    an OS/socket error name (`"ECONNRESET"`), any other `UND_ERR_*` (undici) is
///    `UNAVAILABLE`. Anything else names no code.
/// 5. The delay, from the error that named the code: the delay it states itself, else
///    `grpc-retry-pushback-ms` (a non-negative integer is the delay; a negative or
///    unparseable value means do not retry, as gRFC A6 says), else a
///    `google.rpc.RetryInfo` in `grpc-status-details-bin`, else `Retry-After`
///    (delta-seconds or an HTTP-date). An unparseable `Retry-After` or RetryInfo is
///    ignored (local backoff applies). The first pair of a name counts.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use oncely::{extract, Code, RawFailure, RawValue, ReasonCodes, ServerDelay};
/// let raw = RawFailure {
///     code: Some(RawValue::Int(429)),
///     headers: vec![("Retry-After".into(), "2".into())],
///     ..RawFailure::default()
/// };
/// let f = extract(&raw, &ReasonCodes::default(), SystemTime::now());
/// assert_eq!(f.code, Code::ResourceExhausted);
/// assert_eq!(f.server_delay, Some(ServerDelay::After(Duration::from_secs(2))));
/// ```
pub fn extract(raw: &RawFailure, reasons: &ReasonCodes, now: SystemTime) -> Failure {
    let mut level = Some(raw);
    for _ in 0..RawFailure::MAX_CHAIN {
        let Some(r) = level else { break };
        if let Some(code) = code_of(r, reasons) {
            let mut f = Failure::new(code);
            if let Some(d) = server_delay(r, now) {
                f = f.with_server_delay(d);
            }
            return f;
        }
        level = r.cause.as_deref();
    }
    Failure::new(Code::Unknown)
}

/// The code one error's facts name (rule 2), ignoring its cause.
fn code_of(r: &RawFailure, reasons: &ReasonCodes) -> Option<Code> {
    let from_value = |v: &Option<RawValue>, text_rules: bool| match v.as_ref()? {
        RawValue::Int(n) => number(*n),
        RawValue::Text(t) if text_rules => text(t, reasons),
        RawValue::Text(t) => t.trim().parse::<i64>().ok().and_then(number),
    };
    from_value(&r.code, true)
        .or_else(|| from_value(&r.status, false))
        .or_else(|| from_value(&r.status_code, false))
        .or_else(|| r.errno.as_deref().and_then(os_error))
        .or_else(|| r.type_names.iter().find_map(|n| lookup(&TYPE_NAMES, n)))
}

/// Rule 3: 0–16 a gRPC code, 100–599 an HTTP status.
fn number(n: i64) -> Option<Code> {
    match n {
        0..=16 => Code::from_i32(n as i32),
        100..=599 => Some(Code::from_http(n as u16)),
        _ => None,
    }
}

/// Rule 4.
fn text(t: &str, reasons: &ReasonCodes) -> Option<Code> {
    let t = t.trim();
    if t.is_empty() || t.len() > 64 {
        return None;
    }
    if let Ok(n) = t.parse::<i64>() {
        return number(n);
    }
    let upper = t.to_ascii_uppercase();
    Code::ALL
        .into_iter()
        .find(|c| c.as_str() == upper)
        .or_else(|| reasons.resolve(&upper))
        .or_else(|| os_error(&upper))
}

fn os_error(name: &str) -> Option<Code> {
    let upper = name.trim().to_ascii_uppercase();
    lookup(&OS_ERRORS, &upper).or_else(|| upper.starts_with("UND_ERR").then_some(Code::Unavailable))
}

fn lookup(table: &[(&str, Code)], name: &str) -> Option<Code> {
    table.iter().find(|(n, _)| *n == name).map(|(_, c)| *c)
}

fn header<'a>(r: &'a RawFailure, name: &str) -> Option<&'a str> {
    r.headers
        .iter()
        .find(|(n, _)| n.trim().eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// Rule 5.
fn server_delay(r: &RawFailure, now: SystemTime) -> Option<ServerDelay> {
    if let Some(d) = r.delay {
        return Some(ServerDelay::After(d));
    }
    if let Some(p) = header(r, GRPC_RETRY_PUSHBACK_MS) {
        return Some(parse_pushback_ms(p).unwrap_or(ServerDelay::DoNotRetry));
    }
    if let Some(d) = header(r, GRPC_STATUS_DETAILS_BIN).and_then(retry_info) {
        return Some(ServerDelay::After(d));
    }
    header(r, RETRY_AFTER).and_then(|v| parse_retry_after(v, now).ok())
}

/// The `retry_delay` of a `google.rpc.RetryInfo` among the details of the
/// `google.rpc.Status` in `value` (base64, padded or not, standard or URL-safe).
fn retry_info(value: &str) -> Option<Duration> {
    let status = base64(value.trim())?;
    // google.rpc.Status: field 3 (repeated google.protobuf.Any details).
    for (field, detail) in proto_fields(&status)? {
        let Some(Proto::Bytes(any)) = (field == 3).then_some(detail) else {
            continue;
        };
        let mut type_url = None;
        let mut payload = None;
        for (f, v) in proto_fields(any)? {
            match (f, v) {
                (1, Proto::Bytes(b)) => type_url = Some(b),
                (2, Proto::Bytes(b)) => payload = Some(b),
                _ => {}
            }
        }
        if type_url != Some(RETRY_INFO_TYPE.as_bytes()) {
            continue;
        }
        // RetryInfo { Duration retry_delay = 1 }; Duration { int64 seconds = 1; int32 nanos = 2 }.
        let mut seconds: i64 = 0;
        let mut nanos: i64 = 0;
        for (f, v) in proto_fields(payload.unwrap_or(&[]))? {
            if let (1, Proto::Bytes(d)) = (f, v) {
                for (g, w) in proto_fields(d)? {
                    match (g, w) {
                        (1, Proto::Varint(s)) => seconds = s as i64,
                        (2, Proto::Varint(n)) => nanos = i64::from(n as i32),
                        _ => {}
                    }
                }
            }
        }
        if seconds < 0 || !(0..1_000_000_000).contains(&nanos) {
            return None;
        }
        return Some(Duration::new(seconds as u64, nanos as u32));
    }
    None
}

enum Proto<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Other,
}

/// The fields of a protobuf message, or `None` if it is malformed.
fn proto_fields(mut b: &[u8]) -> Option<Vec<(u64, Proto<'_>)>> {
    fn varint(b: &mut &[u8]) -> Option<u64> {
        let mut v: u64 = 0;
        for i in 0..10 {
            let (&byte, rest) = b.split_first()?;
            *b = rest;
            v |= u64::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                return Some(v);
            }
        }
        None
    }
    let mut out = Vec::new();
    while !b.is_empty() {
        let tag = varint(&mut b)?;
        let value = match tag & 7 {
            0 => Proto::Varint(varint(&mut b)?),
            1 => {
                b = b.get(8..)?;
                Proto::Other
            }
            2 => {
                let len = usize::try_from(varint(&mut b)?).ok()?;
                let (data, rest) = (b.get(..len)?, b.get(len..)?);
                b = rest;
                Proto::Bytes(data)
            }
            5 => {
                b = b.get(4..)?;
                Proto::Other
            }
            _ => return None,
        };
        out.push((tag >> 3, value));
    }
    Some(out)
}

fn base64(s: &str) -> Option<Vec<u8>> {
    let s = s.trim_end_matches('=');
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in s.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(code: RawValue) -> RawFailure {
        RawFailure {
            code: Some(code),
            ..RawFailure::default()
        }
    }

    #[test]
    fn a_cause_deeper_than_the_chain_limit_is_not_read() {
        let mut r = raw(RawValue::Text("ECONNRESET".into()));
        for _ in 0..RawFailure::MAX_CHAIN {
            r = RawFailure {
                cause: Some(Box::new(r)),
                ..RawFailure::default()
            };
        }
        let reasons = ReasonCodes::default();
        assert_eq!(extract(&r, &reasons, SystemTime::now()).code, Code::Unknown);
        let inner = *r.cause.unwrap();
        assert_eq!(
            extract(&inner, &reasons, SystemTime::now()).code,
            Code::Unavailable
        );
    }

    #[test]
    fn malformed_status_details_are_ignored() {
        for v in ["", "!!!!", "CgA", "////", "GgM="] {
            assert_eq!(retry_info(v), None, "{v}");
        }
    }
}
