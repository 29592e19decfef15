//! Which failures may be retried (SPEC §3), and the delays servers ask for.

use std::fmt;
use std::time::{Duration, SystemTime};

use crate::code::Code;
use crate::error::Error;

/// Facts about a call that decide whether resending it is safe.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallFacts {
    /// The operation is idempotent or carries an idempotency key, so resending it
    /// cannot apply the effect twice.
    pub safe: bool,
    /// Each attempt re-reads state (a version) before writing, so a conflict
    /// (`ABORTED`) can be retried.
    pub rereads: bool,
    /// The caller declares `INTERNAL`/`UNKNOWN` transient for this call (opt-in;
    /// only honoured together with `safe`).
    pub transient_internal: bool,
}

impl CallFacts {
    /// Facts for a call that is safe to resend (idempotent or keyed).
    pub const SAFE: CallFacts = CallFacts {
        safe: true,
        rereads: false,
        transient_internal: false,
    };
}

/// Why a code is or is not retryable: the row of the SPEC §3 table that applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Rule {
    /// `UNAVAILABLE` on a safe call: transient, retry.
    TransientSafe,
    /// `UNAVAILABLE`/`DEADLINE_EXCEEDED` on a call that is not safe: the first attempt
    /// may have been applied, resending could apply it twice.
    UnsafeToResend,
    /// `RESOURCE_EXHAUSTED`: rejected before executing; retry after the server's delay.
    RateLimited,
    /// `DEADLINE_EXCEEDED` of one attempt on a safe call: retry if the overall budget allows.
    AttemptTimedOut,
    /// `ABORTED` on a call that re-reads before writing: retry with fresh state.
    ConflictRereads,
    /// `ABORTED` on a call that would resend the same write unchanged.
    ConflictNeedsReread,
    /// `ABORTED` with a server delay (409 + `Retry-After`: the key's first call is still
    /// in progress) on a safe call: resending under the same key replays its result
    /// once it is done, so retry after the delay.
    InProgressKeyed,
    /// `INTERNAL`/`UNKNOWN` that the caller declared transient on a safe call.
    DeclaredTransient,
    /// `INTERNAL`/`UNKNOWN`: a server bug; retrying gives the same answer.
    ServerError,
    /// The request itself is wrong or not allowed; the result would be the same.
    Permanent,
    /// `DATA_LOSS`: retrying may widen the damage.
    DataLoss,
    /// `OK` is not a failure.
    NotAnError,
}

impl Rule {
    /// A stable snake_case name, used in the shared test vectors and by the bindings.
    pub const fn as_str(self) -> &'static str {
        match self {
            Rule::TransientSafe => "transient_safe",
            Rule::UnsafeToResend => "unsafe_to_resend",
            Rule::RateLimited => "rate_limited",
            Rule::AttemptTimedOut => "attempt_timed_out",
            Rule::ConflictRereads => "conflict_rereads",
            Rule::ConflictNeedsReread => "conflict_needs_reread",
            Rule::InProgressKeyed => "in_progress_keyed",
            Rule::DeclaredTransient => "declared_transient",
            Rule::ServerError => "server_error",
            Rule::Permanent => "permanent",
            Rule::DataLoss => "data_loss",
            Rule::NotAnError => "not_an_error",
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The answer of [`classify`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Classification {
    /// Whether the failure may be retried (subject to attempts, deadline and budget).
    pub retryable: bool,
    /// The rule that decided it.
    pub rule: Rule,
}

/// Decides whether a failure with `code` may be retried, per SPEC §3.
///
/// ```
/// use oncely::{classify, CallFacts, Code};
/// assert!(classify(Code::Unavailable, CallFacts::SAFE).retryable);
/// assert!(!classify(Code::Unavailable, CallFacts::default()).retryable);
/// assert!(!classify(Code::InvalidArgument, CallFacts::SAFE).retryable);
/// ```
pub const fn classify(code: Code, facts: CallFacts) -> Classification {
    let (retryable, rule) = match code {
        Code::Unavailable if facts.safe => (true, Rule::TransientSafe),
        Code::Unavailable => (false, Rule::UnsafeToResend),
        Code::ResourceExhausted => (true, Rule::RateLimited),
        Code::DeadlineExceeded if facts.safe => (true, Rule::AttemptTimedOut),
        Code::DeadlineExceeded => (false, Rule::UnsafeToResend),
        Code::Aborted if facts.rereads => (true, Rule::ConflictRereads),
        Code::Aborted => (false, Rule::ConflictNeedsReread),
        Code::Internal | Code::Unknown if facts.transient_internal && facts.safe => {
            (true, Rule::DeclaredTransient)
        }
        Code::Internal | Code::Unknown => (false, Rule::ServerError),
        Code::DataLoss => (false, Rule::DataLoss),
        Code::Ok => (false, Rule::NotAnError),
        Code::InvalidArgument
        | Code::NotFound
        | Code::PermissionDenied
        | Code::Unauthenticated
        | Code::FailedPrecondition
        | Code::Unimplemented
        | Code::AlreadyExists
        | Code::OutOfRange
        | Code::Cancelled => (false, Rule::Permanent),
    };
    Classification { retryable, rule }
}

/// Decides whether `failure` may be retried, per SPEC §3: [`classify`] of its code,
/// except that `ABORTED` with a server delay (an "in progress" answer: 409 +
/// `Retry-After`, or oncely's own [`Error::InProgress`]) may always be resent by a
/// safe (keyed) call, under [`Rule::InProgressKeyed`].
///
/// ```
/// use std::time::Duration;
/// use oncely::{classify_failure, CallFacts, Code, Failure, Rule, ServerDelay};
/// let in_progress = Failure::new(Code::Aborted)
///     .with_server_delay(ServerDelay::After(Duration::from_secs(1)));
/// let c = classify_failure(in_progress, CallFacts::SAFE);
/// assert!(c.retryable);
/// assert_eq!(c.rule, Rule::InProgressKeyed);
/// // Without a key (not safe), or without the delay, a conflict is not resent unchanged.
/// assert!(!classify_failure(in_progress, CallFacts::default()).retryable);
/// assert!(!classify_failure(Failure::new(Code::Aborted), CallFacts::SAFE).retryable);
/// ```
pub const fn classify_failure(failure: Failure, facts: CallFacts) -> Classification {
    let c = classify(failure.code, facts);
    match (failure.code, failure.server_delay) {
        (Code::Aborted, Some(ServerDelay::After(_))) if facts.safe && !c.retryable => {
            Classification {
                retryable: true,
                rule: Rule::InProgressKeyed,
            }
        }
        _ => c,
    }
}

impl Rule {
    /// Why this rule allows or refuses a retry, in one sentence (the bindings put it
    /// in the note of the error they give back).
    ///
    /// ```
    /// assert!(oncely::Rule::ConflictNeedsReread.explain().contains("re-read"));
    /// ```
    pub const fn explain(self) -> &'static str {
        match self {
            Rule::TransientSafe => "a transient failure of a call that is safe to resend",
            Rule::UnsafeToResend => {
                "the first attempt may have been applied and the call is not safe to resend \
                 (declare it safe when it is idempotent or carries an idempotency key)"
            }
            Rule::RateLimited => "rejected before executing (rate limited)",
            Rule::AttemptTimedOut => "one attempt timed out on a call that is safe to resend",
            Rule::ConflictRereads => "a conflict on a call that re-reads state before writing",
            Rule::ConflictNeedsReread => {
                "a conflict (ABORTED) is not resent unchanged: declare that each attempt \
                 re-reads state before writing (rereads); an in-progress answer (ABORTED \
                 or 409 with a server delay) is resent by a safe (keyed) call"
            }
            Rule::InProgressKeyed => {
                "the key's first call is still in progress; resending under the same key \
                 replays its result"
            }
            Rule::DeclaredTransient => "INTERNAL/UNKNOWN declared transient on a safe call",
            Rule::ServerError => {
                "INTERNAL/UNKNOWN is a server error that a retry repeats (a safe call may declare \
                 them transient)"
            }
            Rule::Permanent => {
                "the request itself is wrong or not allowed; a retry gets the same answer"
            }
            Rule::DataLoss => "DATA_LOSS: retrying may widen the damage",
            Rule::NotAnError => "OK is not a failure",
        }
    }
}

/// A delay the server asked for, overriding the computed backoff.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerDelay {
    /// Wait this long before the next attempt.
    After(Duration),
    /// The server said not to retry at all (e.g. a negative `grpc-retry-pushback-ms`).
    DoNotRetry,
}

/// Parses an HTTP `Retry-After` value: delta-seconds (`"120"`) or an HTTP-date
/// (`"Wed, 21 Oct 2015 07:28:00 GMT"`, also the obsolete RFC 850 and asctime forms).
/// A date in the past gives a zero delay. `now` is the wall clock to measure a date
/// against. Only spaces and horizontal tabs around the value are ignored (RFC 9110's
/// OWS); delta-seconds too large for a `u64` saturate.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use oncely::{parse_retry_after, ServerDelay};
/// assert_eq!(parse_retry_after("3", SystemTime::now()).unwrap(), ServerDelay::After(Duration::from_secs(3)));
/// assert!(parse_retry_after("soon", SystemTime::now()).is_err());
/// ```
pub fn parse_retry_after(value: &str, now: SystemTime) -> Result<ServerDelay, Error> {
    let v = trim_ows(value);
    if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
        // Delta-seconds; absurdly long values saturate instead of failing.
        let secs = v.parse::<u64>().unwrap_or(u64::MAX);
        return Ok(ServerDelay::After(Duration::from_secs(secs)));
    }
    let now_ms: i128 = match now.duration_since(std::time::UNIX_EPOCH) {
        Ok(d) => d.as_millis() as i128,
        Err(e) => -(e.duration().as_millis() as i128),
    };
    let now_secs = i64::try_from(now_ms.div_euclid(1000)).unwrap_or(i64::MAX);
    let at = crate::http_date::parse(v, now_secs).ok_or_else(|| {
        Error::invalid(
            "retry_after",
            format!("{value:?} is neither delta-seconds nor an HTTP-date"),
        )
    })?;
    let ms = (i128::from(at) * 1000 - now_ms).max(0);
    Ok(ServerDelay::After(Duration::from_millis(
        u64::try_from(ms).unwrap_or(u64::MAX),
    )))
}

/// Parses gRPC's `grpc-retry-pushback-ms` trailer: a non-negative integer is the delay
/// in milliseconds (`-0` is 0; values too large for a `u64` saturate); a negative one
/// means do not retry. Anything else is an error, which the retry loop and
/// [`extract`](crate::extract) read as "do not retry" (gRFC A6). Spaces and tabs around
/// the value are ignored.
///
/// ```
/// use std::time::Duration;
/// use oncely::{parse_pushback_ms, ServerDelay};
/// assert_eq!(parse_pushback_ms("250").unwrap(), ServerDelay::After(Duration::from_millis(250)));
/// assert_eq!(parse_pushback_ms("-1").unwrap(), ServerDelay::DoNotRetry);
/// ```
pub fn parse_pushback_ms(value: &str) -> Result<ServerDelay, Error> {
    let v = trim_ows(value);
    let digits = v.strip_prefix('-').unwrap_or(v);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(Error::invalid(
            "grpc-retry-pushback-ms",
            format!("{value:?} is not an integer number of milliseconds"),
        ));
    }
    // Negative is below zero: "-0" is the integer 0.
    if v.starts_with('-') && digits.bytes().any(|b| b != b'0') {
        return Ok(ServerDelay::DoNotRetry);
    }
    let ms = digits.parse::<u64>().unwrap_or(u64::MAX);
    Ok(ServerDelay::After(Duration::from_millis(ms)))
}

/// Strips RFC 9110's optional whitespace (spaces and horizontal tabs) at both ends; other
/// whitespace (a line break, a non-breaking space) makes the value malformed.
fn trim_ows(value: &str) -> &str {
    value.trim_matches([' ', '\t'])
}

/// A failure reduced to what the retry decision needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failure {
    /// The gRPC code of the failure.
    pub code: Code,
    /// A delay the server asked for, if any.
    pub server_delay: Option<ServerDelay>,
}

impl Failure {
    /// A failure with `code` and no server delay.
    pub const fn new(code: Code) -> Self {
        Failure {
            code,
            server_delay: None,
        }
    }

    /// The connection dropped after the request was sent: the outcome is unknown.
    /// It is `UNAVAILABLE` and may be retried only by a safe (keyed) call.
    pub const fn outcome_unknown() -> Self {
        Failure::new(Code::Unavailable)
    }

    /// The failure an error that implements [`Classify`] stands for.
    pub fn of<E: Classify + ?Sized>(error: &E) -> Self {
        Failure {
            code: error.code(),
            server_delay: error.server_delay(),
        }
    }

    /// Adds the delay the server asked for.
    pub const fn with_server_delay(mut self, delay: ServerDelay) -> Self {
        self.server_delay = Some(delay);
        self
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code.as_str())?;
        match self.server_delay {
            Some(ServerDelay::After(d)) => write!(f, " (server asked to wait {d:?})"),
            Some(ServerDelay::DoNotRetry) => f.write_str(" (server asked not to retry)"),
            None => Ok(()),
        }
    }
}

impl std::error::Error for Failure {}

impl From<Code> for Failure {
    fn from(code: Code) -> Self {
        Failure::new(code)
    }
}

/// Errors that the retry loop can classify: they say which code they mean and
/// whether the server asked for a delay.
///
/// ```
/// use oncely::{Classify, Code};
/// #[derive(Debug)]
/// struct HttpError { status: u16 }
/// impl Classify for HttpError {
///     fn code(&self) -> Code { Code::from_http(self.status) }
/// }
/// assert_eq!(HttpError { status: 429 }.code(), Code::ResourceExhausted);
/// ```
pub trait Classify {
    /// The gRPC code this error means.
    fn code(&self) -> Code;
    /// A delay the server asked for (Retry-After, pushback, RetryInfo), if any.
    fn server_delay(&self) -> Option<ServerDelay> {
        None
    }
}

impl Classify for Code {
    fn code(&self) -> Code {
        *self
    }
}

impl Classify for Failure {
    fn code(&self) -> Code {
        self.code
    }
    fn server_delay(&self) -> Option<ServerDelay> {
        self.server_delay
    }
}

impl Classify for Error {
    fn code(&self) -> Code {
        Error::code(self)
    }
    fn server_delay(&self) -> Option<ServerDelay> {
        self.retry_after().map(ServerDelay::After)
    }
}

impl<T: Classify + ?Sized> Classify for std::sync::Arc<T> {
    fn code(&self) -> Code {
        (**self).code()
    }
    fn server_delay(&self) -> Option<ServerDelay> {
        (**self).server_delay()
    }
}
