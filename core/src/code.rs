//! gRPC status codes, the HTTP status table and domain reason codes.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use crate::error::Error;

/// The 17 gRPC status codes, with their canonical numbers.
///
/// ```
/// use oncely::Code;
/// assert_eq!(Code::Unavailable as i32, 14);
/// assert_eq!("UNAVAILABLE".parse::<Code>().unwrap(), Code::Unavailable);
/// assert_eq!(Code::from_http(503), Code::Unavailable);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Code {
    /// Not an error.
    Ok = 0,
    /// The operation was cancelled, typically by the caller.
    Cancelled = 1,
    /// Unknown error.
    Unknown = 2,
    /// The client specified an invalid argument.
    InvalidArgument = 3,
    /// The deadline expired before the operation could complete.
    DeadlineExceeded = 4,
    /// Some requested entity was not found.
    NotFound = 5,
    /// The entity that a client attempted to create already exists.
    AlreadyExists = 6,
    /// The caller does not have permission.
    PermissionDenied = 7,
    /// Some resource has been exhausted (quota, rate limit).
    ResourceExhausted = 8,
    /// The system is not in a state required for the operation.
    FailedPrecondition = 9,
    /// The operation was aborted, typically by a concurrency conflict.
    Aborted = 10,
    /// The operation was attempted past the valid range.
    OutOfRange = 11,
    /// The operation is not implemented or supported.
    Unimplemented = 12,
    /// An internal invariant was broken.
    Internal = 13,
    /// The service is currently unavailable; usually transient.
    Unavailable = 14,
    /// Unrecoverable data loss or corruption.
    DataLoss = 15,
    /// The request does not have valid authentication credentials.
    Unauthenticated = 16,
}

impl Code {
    /// All codes, in numeric order.
    pub const ALL: [Code; 17] = [
        Code::Ok,
        Code::Cancelled,
        Code::Unknown,
        Code::InvalidArgument,
        Code::DeadlineExceeded,
        Code::NotFound,
        Code::AlreadyExists,
        Code::PermissionDenied,
        Code::ResourceExhausted,
        Code::FailedPrecondition,
        Code::Aborted,
        Code::OutOfRange,
        Code::Unimplemented,
        Code::Internal,
        Code::Unavailable,
        Code::DataLoss,
        Code::Unauthenticated,
    ];

    /// The canonical upper-case name, e.g. `"RESOURCE_EXHAUSTED"`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Code::Ok => "OK",
            Code::Cancelled => "CANCELLED",
            Code::Unknown => "UNKNOWN",
            Code::InvalidArgument => "INVALID_ARGUMENT",
            Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
            Code::NotFound => "NOT_FOUND",
            Code::AlreadyExists => "ALREADY_EXISTS",
            Code::PermissionDenied => "PERMISSION_DENIED",
            Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
            Code::FailedPrecondition => "FAILED_PRECONDITION",
            Code::Aborted => "ABORTED",
            Code::OutOfRange => "OUT_OF_RANGE",
            Code::Unimplemented => "UNIMPLEMENTED",
            Code::Internal => "INTERNAL",
            Code::Unavailable => "UNAVAILABLE",
            Code::DataLoss => "DATA_LOSS",
            Code::Unauthenticated => "UNAUTHENTICATED",
        }
    }

    /// The code with this number, or `None` outside `0..=16`.
    pub const fn from_i32(n: i32) -> Option<Code> {
        if n < 0 || n > 16 {
            None
        } else {
            Some(Code::ALL[n as usize])
        }
    }

    /// Maps an HTTP status to a code by this table (the mapping used by Google APIs
    /// and grpc-gateway, with fallbacks by class):
    ///
    /// | HTTP | code |
    /// |---|---|
    /// | 1xx, 3xx, anything outside 100..=599 | `UNKNOWN` |
    /// | 2xx | `OK` |
    /// | 400 | `INVALID_ARGUMENT` |
    /// | 401 | `UNAUTHENTICATED` |
    /// | 403 | `PERMISSION_DENIED` |
    /// | 404 | `NOT_FOUND` |
    /// | 408 | `DEADLINE_EXCEEDED` |
    /// | 409 | `ABORTED` |
    /// | 412 | `FAILED_PRECONDITION` |
    /// | 429 | `RESOURCE_EXHAUSTED` |
    /// | 499 | `CANCELLED` |
    /// | other 4xx | `FAILED_PRECONDITION` |
    /// | 500 | `INTERNAL` |
    /// | 501 | `UNIMPLEMENTED` |
    /// | 502, 503 | `UNAVAILABLE` |
    /// | 504 | `DEADLINE_EXCEEDED` |
    /// | other 5xx | `INTERNAL` |
    pub const fn from_http(status: u16) -> Code {
        match status {
            400 => Code::InvalidArgument,
            401 => Code::Unauthenticated,
            403 => Code::PermissionDenied,
            404 => Code::NotFound,
            408 => Code::DeadlineExceeded,
            409 => Code::Aborted,
            412 => Code::FailedPrecondition,
            429 => Code::ResourceExhausted,
            499 => Code::Cancelled,
            500 => Code::Internal,
            501 => Code::Unimplemented,
            502 | 503 => Code::Unavailable,
            504 => Code::DeadlineExceeded,
            _ => match status / 100 {
                2 => Code::Ok,
                4 => Code::FailedPrecondition,
                5 => Code::Internal,
                _ => Code::Unknown,
            },
        }
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Code {
    type Err = Error;

    /// Parses a canonical name (`"UNAVAILABLE"`, case-insensitive) or a number (`"14"`).
    fn from_str(s: &str) -> Result<Self, Error> {
        let t = s.trim();
        if let Ok(n) = t.parse::<i32>() {
            return Code::from_i32(n)
                .ok_or_else(|| Error::invalid("code", format!("{n} is not a gRPC code (0..=16)")));
        }
        Code::ALL
            .into_iter()
            .find(|c| c.as_str().eq_ignore_ascii_case(t))
            .ok_or_else(|| {
                Error::invalid(
                    "code",
                    format!("{s:?} is not a gRPC code name such as \"UNAVAILABLE\""),
                )
            })
    }
}

impl TryFrom<i32> for Code {
    type Error = Error;
    fn try_from(n: i32) -> Result<Self, Error> {
        Code::from_i32(n)
            .ok_or_else(|| Error::invalid("code", format!("{n} is not a gRPC code (0..=16)")))
    }
}

/// Domain reason codes (`"RATE_LIMITED"`, `"STOCK_CONFLICT"`, …) and the gRPC code each
/// one means. Starts with the built-in ones; callers add their own.
///
/// ```
/// use oncely::{Code, ReasonCodes};
/// let mut reasons = ReasonCodes::default();
/// reasons.register("PAYMENT_PENDING", Code::Unavailable).unwrap();
/// assert_eq!(reasons.resolve("RATE_LIMITED"), Some(Code::ResourceExhausted));
/// assert_eq!(reasons.resolve("PAYMENT_PENDING"), Some(Code::Unavailable));
/// assert_eq!(reasons.resolve("NO_SUCH_REASON"), None);
/// ```
#[derive(Debug, Clone)]
pub struct ReasonCodes {
    map: HashMap<String, Code>,
}

impl ReasonCodes {
    /// The built-in reasons: `UPSTREAM_UNAVAILABLE` → `UNAVAILABLE`,
    /// `RATE_LIMITED` → `RESOURCE_EXHAUSTED`, `STOCK_CONFLICT` → `ABORTED`.
    pub const BUILTIN: [(&'static str, Code); 3] = [
        ("UPSTREAM_UNAVAILABLE", Code::Unavailable),
        ("RATE_LIMITED", Code::ResourceExhausted),
        ("STOCK_CONFLICT", Code::Aborted),
    ];

    /// Adds a reason. Names are `[A-Z0-9_]{1,64}` starting with a letter; a built-in
    /// reason cannot be redefined to another code.
    pub fn register(&mut self, reason: &str, code: Code) -> Result<(), Error> {
        let valid = !reason.is_empty()
            && reason.len() <= 64
            && reason.as_bytes()[0].is_ascii_uppercase()
            && reason
                .bytes()
                .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
        if !valid {
            return Err(Error::invalid(
                "reason",
                format!("{reason:?} must match [A-Z][A-Z0-9_]{{0,63}}"),
            ));
        }
        if let Some((_, builtin)) = Self::BUILTIN.iter().find(|(name, _)| *name == reason) {
            if *builtin != code {
                return Err(Error::invalid(
                    "reason",
                    format!("{reason} is built in and means {builtin}"),
                ));
            }
        }
        self.map.insert(reason.to_owned(), code);
        Ok(())
    }

    /// The code a reason means, or `None` for an unknown reason.
    pub fn resolve(&self, reason: &str) -> Option<Code> {
        self.map.get(reason).copied()
    }
}

impl Default for ReasonCodes {
    fn default() -> Self {
        ReasonCodes {
            map: Self::BUILTIN
                .iter()
                .map(|(name, code)| ((*name).to_owned(), *code))
                .collect(),
        }
    }
}
