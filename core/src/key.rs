//! Idempotency keys, their scope, request fingerprints and header names (SPEC §5, §6).

use std::fmt;

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::error::Error;
use crate::rand;

/// Header and metadata names of the protocol.
pub mod headers {
    /// gRPC metadata key carrying the idempotency key.
    pub const GRPC_IDEMPOTENCY_KEY: &str = "x-idempotency-key";
    /// HTTP header carrying the idempotency key (IETF draft).
    pub const HTTP_IDEMPOTENCY_KEY: &str = "Idempotency-Key";
    /// HTTP response header marking a replayed response (value `true`).
    pub const HTTP_IDEMPOTENT_REPLAYED: &str = "Idempotent-Replayed";
    /// HTTP header with the delay before a retry.
    pub const HTTP_RETRY_AFTER: &str = "Retry-After";
    /// gRPC trailer with the server's retry pushback, in milliseconds.
    pub const GRPC_RETRY_PUSHBACK_MS: &str = "grpc-retry-pushback-ms";
    /// gRPC metadata counting earlier attempts of this call.
    pub const GRPC_PREVIOUS_RPC_ATTEMPTS: &str = "grpc-previous-rpc-attempts";
}

/// HTTP statuses for the server side of the protocol (IETF idempotency-key draft).
pub mod http_status {
    /// A write arrived without `Idempotency-Key`.
    pub const MISSING_KEY: u16 = 400;
    /// The key was reused with a different request.
    pub const FINGERPRINT_MISMATCH: u16 = 422;
    /// The first request with this key is still running (send `Retry-After`).
    pub const IN_PROGRESS: u16 = 409;
}

/// Shortest accepted key.
pub const KEY_MIN_LEN: usize = 8;
/// Longest accepted key.
pub const KEY_MAX_LEN: usize = 64;
/// Longest accepted tenant or method, in bytes.
pub const SCOPE_PART_MAX_LEN: usize = 1024;

/// A client-made idempotency key: `[A-Za-z0-9_-]{8,64}`.
///
/// ```
/// use oncely::IdempotencyKey;
/// let k = IdempotencyKey::random();
/// assert_eq!(k.as_str().len(), 36); // a UUID v4
/// assert_eq!(IdempotencyKey::parse(k.as_str()).unwrap(), k);
/// // Derived keys are stable across runs and languages.
/// assert_eq!(
///     IdempotencyKey::derive("order-42", "charge").unwrap(),
///     IdempotencyKey::derive("order-42", "charge").unwrap(),
/// );
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// A random UUID v4 (lower-case, hyphenated) from OS randomness.
    pub fn random() -> Self {
        let mut b = [0u8; 16];
        rand::fill(&mut b);
        IdempotencyKey(uuid_string(b, 4))
    }

    /// A stable key for one business intent, the same in every language:
    ///
    /// `SHA-256("oncely-key-v1" ‖ u64be(len(business_id)) ‖ business_id ‖
    /// u64be(len(operation)) ‖ operation)`, its first 16 bytes formatted as a UUID
    /// with version 8 and the RFC 9562 variant. Both parts must be non-empty.
    pub fn derive(business_id: &str, operation: &str) -> Result<Self, Error> {
        if business_id.is_empty() {
            return Err(Error::invalid("business_id", "must not be empty"));
        }
        if operation.is_empty() {
            return Err(Error::invalid("operation", "must not be empty"));
        }
        let mut h = Sha256::new();
        h.update(b"oncely-key-v1");
        for part in [business_id, operation] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part.as_bytes());
        }
        let digest = h.finalize();
        let mut b = [0u8; 16];
        b.copy_from_slice(&digest[..16]);
        Ok(IdempotencyKey(uuid_string(b, 8)))
    }

    /// Accepts `s` if it matches `[A-Za-z0-9_-]{8,64}`; otherwise INVALID_ARGUMENT.
    pub fn parse(s: &str) -> Result<Self, Error> {
        if s.is_empty() {
            return Err(Error::MissingKey);
        }
        if let Some(c) = s
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
        {
            return Err(Error::invalid(
                "idempotency_key",
                format!("{c:?} is not allowed; use only A-Z, a-z, 0-9, '-' and '_'"),
            ));
        }
        if !(KEY_MIN_LEN..=KEY_MAX_LEN).contains(&s.len()) {
            return Err(Error::invalid(
                "idempotency_key",
                format!(
                    "must be {KEY_MIN_LEN} to {KEY_MAX_LEN} characters, got {}",
                    s.len()
                ),
            ));
        }
        Ok(IdempotencyKey(s.to_owned()))
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey({})", self.0)
    }
}

impl std::str::FromStr for IdempotencyKey {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        IdempotencyKey::parse(s)
    }
}

impl AsRef<str> for IdempotencyKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

fn uuid_string(mut b: [u8; 16], version: u8) -> String {
    b[6] = (b[6] & 0x0f) | (version << 4);
    b[8] = (b[8] & 0x3f) | 0x80;
    let mut s = String::with_capacity(36);
    for (i, byte) in b.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            s.push('-');
        }
        s.push(HEX[(byte >> 4) as usize] as char);
        s.push(HEX[(byte & 0x0f) as usize] as char);
    }
    s
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// The key a store deduplicates by: tenant + method + idempotency key.
///
/// Encoding: `v1:` then tenant, method and key, each percent-encoded and joined by `:`.
/// Percent-encoding escapes every byte outside `[A-Za-z0-9._/-]` (so `%`, `:`, braces,
/// spaces, control characters and all non-ASCII bytes of the UTF-8 text) as `%XX`
/// with upper-case hex. It is **injective**: each part's encoding can be decoded back
/// uniquely (`%` never stands for itself), and the separator `:` never appears inside an
/// encoded part, so the three parts are recovered by splitting at the two `:` after
/// the prefix. Two different triples therefore never give the same scoped key. The
/// result is printable ASCII and has no `{`/`}`, so it can sit inside a Redis hash tag.
///
/// ```
/// use oncely::{IdempotencyKey, ScopedKey};
/// let key = IdempotencyKey::parse("order-42-charge").unwrap();
/// let s = ScopedKey::new("acme", "/shop.Orders/Create", &key).unwrap();
/// assert_eq!(s.as_str(), "v1:acme:/shop.Orders/Create:order-42-charge");
/// // "a:b" + "c" and "a" + "b:c" no longer collide:
/// let x = ScopedKey::new("a:b", "c", &key).unwrap();
/// let y = ScopedKey::new("a", "b:c", &key).unwrap();
/// assert_ne!(x, y);
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ScopedKey(String);

impl ScopedKey {
    /// Scopes `key` to a tenant and a method. Tenant and method must be non-empty and
    /// at most 1024 bytes each.
    pub fn new(tenant: &str, method: &str, key: &IdempotencyKey) -> Result<Self, Error> {
        for (field, part) in [("tenant", tenant), ("method", method)] {
            if part.is_empty() {
                return Err(Error::invalid(
                    field,
                    "must not be empty: keys are scoped by tenant and method, never the key alone",
                ));
            }
            if part.len() > SCOPE_PART_MAX_LEN {
                return Err(Error::invalid(
                    field,
                    format!(
                        "must be at most {SCOPE_PART_MAX_LEN} bytes, got {}",
                        part.len()
                    ),
                ));
            }
        }
        let mut s = String::with_capacity(4 + tenant.len() + method.len() + key.0.len());
        s.push_str("v1:");
        percent_encode(tenant, &mut s);
        s.push(':');
        percent_encode(method, &mut s);
        s.push(':');
        s.push_str(&key.0);
        Ok(ScopedKey(s))
    }

    /// Accepts the encoded form made by [`ScopedKey::new`] (e.g. read back from a
    /// header, a log or a shared store) and nothing else: `parse(k.as_str()) == Ok(k)`
    /// for every scoped key `k`, and any other text is INVALID_ARGUMENT.
    ///
    /// ```
    /// use oncely::{IdempotencyKey, ScopedKey};
    /// let k = ScopedKey::new("a:b", "Créer", &IdempotencyKey::parse("key-0001").unwrap()).unwrap();
    /// assert_eq!(ScopedKey::parse(k.as_str()).unwrap(), k);
    /// assert!(ScopedKey::parse("acme:CreateOrder:key-0001").is_err());
    /// ```
    pub fn parse(s: &str) -> Result<Self, Error> {
        let bad = |why: &str| Error::invalid("scoped_key", format!("{s:?} {why}"));
        let rest = s
            .strip_prefix("v1:")
            .ok_or_else(|| bad("is not a scoped key (it must start with \"v1:\")"))?;
        let mut parts = rest.splitn(3, ':');
        let (Some(tenant), Some(method), Some(key)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(bad("must have a tenant, a method and a key"));
        };
        let tenant = percent_decode(tenant).ok_or_else(|| bad("has a badly encoded tenant"))?;
        let method = percent_decode(method).ok_or_else(|| bad("has a badly encoded method"))?;
        let key = IdempotencyKey::parse(key)?;
        let scoped = ScopedKey::new(&tenant, &method, &key)?;
        if scoped.0 != s {
            return Err(bad("is not in canonical form"));
        }
        Ok(scoped)
    }

    /// The encoded scoped key.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ScopedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ScopedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ScopedKey({})", self.0)
    }
}

impl AsRef<str> for ScopedKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

fn percent_encode(part: &str, out: &mut String) {
    for &b in part.as_bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'/' | b'-') {
            out.push(b as char);
        } else {
            out.push('%');
            out.push(HEX_UPPER[(b >> 4) as usize] as char);
            out.push(HEX_UPPER[(b & 0x0f) as usize] as char);
        }
    }
}

const HEX_UPPER: &[u8; 16] = b"0123456789ABCDEF";

fn percent_decode(part: &str) -> Option<String> {
    let b = part.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b.get(i + 1..i + 3)?;
            let hi = (hex[0] as char).to_digit(16)?;
            let lo = (hex[1] as char).to_digit(16)?;
            out.push((hi * 16 + lo) as u8);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// SHA-256 (lower-case hex) of the canonical JSON (RFC 8785) of `value`: object keys
/// sorted, no insignificant whitespace, numbers in their shortest form. The same data
/// gives the same fingerprint in Rust, Python and Node, whatever its key order.
///
/// ```
/// use serde_json::json;
/// let a = oncely::fingerprint(&json!({"sku": "A1", "qty": 2})).unwrap();
/// let b = oncely::fingerprint(&json!({"qty": 2, "sku": "A1"})).unwrap();
/// assert_eq!(a, b);
/// assert_eq!(a.len(), 64);
/// ```
pub fn fingerprint<T: Serialize + ?Sized>(value: &T) -> Result<String, Error> {
    let bytes = canonical_json(value)?;
    Ok(fingerprint_bytes(&bytes))
}

/// The deepest nesting of arrays and objects that [`canonical_json`] and
/// [`fingerprint`] accept (SPEC §6): the same limit in Rust, Python and Node, below the
/// limits of the languages' own JSON parsers.
pub const CANONICAL_JSON_MAX_DEPTH: usize = 100;

/// The canonical JSON (RFC 8785) bytes of `value`.
///
/// Refused with INVALID_ARGUMENT naming `value`: NaN and infinities (JSON has no such
/// numbers) and nesting deeper than [`CANONICAL_JSON_MAX_DEPTH`](crate::CANONICAL_JSON_MAX_DEPTH).
pub fn canonical_json<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, Error> {
    if crate::finite::has_non_finite(value) {
        return Err(Error::invalid(
            "value",
            "holds NaN or an infinite number, which JSON cannot write",
        ));
    }
    let bytes = serde_jcs::to_vec(value).map_err(|e| {
        Error::invalid("value", format!("cannot be written as canonical JSON: {e}"))
    })?;
    check_depth(&bytes)?;
    Ok(bytes)
}

/// Checks the nesting of canonical JSON text: one pass over the bytes, brackets inside
/// strings skipped (the writer's own output, so strings are well-formed).
fn check_depth(json: &[u8]) -> Result<(), Error> {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for &b in json {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > CANONICAL_JSON_MAX_DEPTH {
                    return Err(Error::invalid(
                        "value",
                        format!(
                            "is nested deeper than {CANONICAL_JSON_MAX_DEPTH} levels of arrays and objects"
                        ),
                    ));
                }
            }
            b']' | b'}' => depth -= 1,
            _ => {}
        }
    }
    Ok(())
}

/// SHA-256 (lower-case hex) of raw request bytes, for callers with their own canonical form.
pub fn fingerprint_bytes(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let mut s = String::with_capacity(64);
    for b in digest {
        s.push(HEX[(b >> 4) as usize] as char);
        s.push(HEX[(b & 0x0f) as usize] as char);
    }
    s
}
