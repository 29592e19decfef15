//! Backoff, classification, deadlines, budgets, the manual clock and the sans-IO retry
//! machine, as JavaScript classes. Durations are milliseconds as `number`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use napi::bindgen_prelude::*;
use napi::sys;
use napi_derive::napi;

use oncely::{CallFacts, Clock, Code, Decision, Failure, ServerDelay, StopReason};

use crate::convert::{self, Options, SHORT_STRING_MAX};
use crate::errors::{range_error, type_error, OrThrow};

/// Milliseconds of a duration, exact for whole milliseconds.
pub(crate) fn ms(d: Duration) -> f64 {
    d.as_millis() as f64 + f64::from(d.subsec_nanos() % 1_000_000) / 1e6
}

/// The largest delay a server's answer gives JavaScript, in ms: 2⁵³ − 1, the largest
/// integer a Number holds exactly. A server delay that saturated (SPEC §3: longer than
/// any deadline) is handed out as this, so that it reads back as a delay (a `Failure`
/// given to `onFailure` or `classify`) instead of one too large to be a `Duration`.
const MAX_SERVER_DELAY_MS: f64 = 9_007_199_254_740_991.0;

/// A server's delay in ms, for JavaScript (see [`MAX_SERVER_DELAY_MS`]).
pub(crate) fn server_delay_ms(d: Duration) -> f64 {
    ms(d).min(MAX_SERVER_DELAY_MS)
}

/// Unwraps an instance of the native class `T` from `v`, or throws a `TypeError`
/// naming `field`.
pub(crate) fn instance<'a, T: JavaScriptClassExt + 'static>(
    env: &'a Env,
    v: sys::napi_value,
    field: &str,
    class: &str,
) -> Result<ClassInstance<'a, T>> {
    // SAFETY: `v` is a live value of the current call.
    let unknown = unsafe { Unknown::from_raw_unchecked(env.raw(), v) };
    if !T::instance_of(env, &unknown)? {
        return Err(type_error(
            env.raw(),
            field,
            &format!(
                "{field} must be a {class}, got {}",
                convert::type_name(env.raw(), v)
            ),
        ));
    }
    // SAFETY: `v` is an instance of `T` (checked above).
    unsafe { ClassInstance::<T>::from_napi_value(env.raw(), v) }
}

/// Options of `new RetryPolicy(options)`; every field is optional (SPEC §2 defaults).
// Read by hand (`Options`), declared for the generated typings only.
#[allow(dead_code)]
#[napi(object)]
pub struct RetryPolicyOptions {
    /// Total attempts, the first included (integer ≥ 1; default 3).
    pub max_attempts: Option<u32>,
    /// Delay after the first failure, before jitter (default 20).
    pub base_delay_ms: Option<f64>,
    /// Cap on the delay before jitter (default 1000).
    pub max_delay_ms: Option<f64>,
    /// Growth per attempt (≥ 1; default 2).
    pub multiplier: Option<f64>,
    /// Relative jitter in [0, 1) (default 0.2).
    pub jitter: Option<f64>,
    /// Makes the jitter deterministic: the same delays in Rust, Python and Node.
    #[napi(ts_type = "number | bigint | null")]
    pub seed: Option<f64>,
    /// Time an attempt needs at least before the deadline (default 50).
    pub min_attempt_ms: Option<f64>,
}

const POLICY_OPTIONS: &[&str] = &[
    "maxAttempts",
    "baseDelayMs",
    "maxDelayMs",
    "multiplier",
    "jitter",
    "seed",
    "minAttemptMs",
];

/// How often and how patiently to retry: exponential, capped, jittered backoff
/// (SPEC §2). Invalid settings throw a `RangeError`/`TypeError` naming the field.
#[napi]
pub struct RetryPolicy {
    pub(crate) inner: oncely::RetryPolicy,
}

#[napi]
impl RetryPolicy {
    #[napi(constructor, ts_args_type = "options?: RetryPolicyOptions")]
    pub fn new(env: &Env, options: Unknown<'_>) -> Result<Self> {
        let raw = env.raw();
        let o = Options::new(raw, options.raw(), "RetryPolicy", POLICY_OPTIONS)?;
        let mut p = oncely::RetryPolicy::new();
        if let Some(n) = o.integer(c"maxAttempts", 0.0, f64::from(u32::MAX))? {
            p = p.with_max_attempts(n as u32);
        }
        if let Some(d) = o.millis(c"baseDelayMs", "base_delay")? {
            p = p.with_base_delay(d);
        }
        if let Some(d) = o.millis(c"maxDelayMs", "max_delay")? {
            p = p.with_max_delay(d);
        }
        if let Some(m) = o.number(c"multiplier")? {
            p = p.with_multiplier(m);
        }
        if let Some(j) = o.number(c"jitter")? {
            p = p.with_jitter(j);
        }
        if let Some(s) = o.seed(c"seed")? {
            p = p.with_seed(s);
        }
        if let Some(d) = o.millis(c"minAttemptMs", "min_attempt")? {
            p = p.with_min_attempt(d);
        }
        p.validate_named(&crate::errors::NAMING).or_throw(raw)?;
        Ok(RetryPolicy { inner: p })
    }

    /// Total attempts, the first included.
    #[napi(getter)]
    pub fn max_attempts(&self) -> u32 {
        self.inner.max_attempts()
    }
    /// Delay after the first failure, before jitter.
    #[napi(getter)]
    pub fn base_delay_ms(&self) -> f64 {
        ms(self.inner.base_delay())
    }
    /// Cap on the delay before jitter.
    #[napi(getter)]
    pub fn max_delay_ms(&self) -> f64 {
        ms(self.inner.max_delay())
    }
    /// Growth factor per attempt.
    #[napi(getter)]
    pub fn multiplier(&self) -> f64 {
        self.inner.multiplier()
    }
    /// Relative jitter.
    #[napi(getter)]
    pub fn jitter(&self) -> f64 {
        self.inner.jitter()
    }
    /// The jitter seed, or `null` when jitter is drawn from the OS.
    #[napi(getter)]
    pub fn seed(&self) -> Option<BigInt> {
        self.inner.seed().map(BigInt::from)
    }
    /// Time an attempt needs at least before the deadline.
    #[napi(getter)]
    pub fn min_attempt_ms(&self) -> f64 {
        ms(self.inner.min_attempt())
    }

    /// The delay (ms) after the `failedAttempt`-th failure (1-based; 0 is taken as 1, as
    /// in Rust and Python).
    #[napi(ts_args_type = "failedAttempt: number")]
    pub fn delay_after(&self, env: &Env, failed_attempt: Unknown<'_>) -> Result<f64> {
        let n = convert::integer(
            env.raw(),
            failed_attempt.raw(),
            "failedAttempt",
            0.0,
            f64::from(u32::MAX),
        )?;
        Ok(ms(self.inner.delay_after(n as u32)))
    }

    /// The whole delay sequence (`maxAttempts − 1` delays, ms).
    #[napi]
    pub fn delays(&self) -> Vec<f64> {
        self.inner.backoff().map(ms).collect()
    }
}

/// The point in time by which a whole call (all its attempts) must finish, on the
/// process's monotonic clock.
#[napi]
pub struct Deadline {
    pub(crate) inner: oncely::Deadline,
    /// The clock the deadline is measured on (the system clock when `None`).
    pub(crate) clock: Option<oncely::ManualClock>,
}

#[napi]
impl Deadline {
    /// A deadline `ms` milliseconds from now (on `_clock`, a test hook, if given).
    #[napi(constructor, ts_args_type = "ms: number, _clock?: ManualClock")]
    pub fn new(env: &Env, ms: Unknown<'_>, clock: Unknown<'_>) -> Result<Self> {
        let raw = env.raw();
        let budget = convert::millis(raw, ms.raw(), "deadline")?;
        if convert::is_nullish(raw, clock.raw()) {
            return Ok(Deadline {
                inner: oncely::Deadline::from_now(budget),
                clock: None,
            });
        }
        let clock = instance::<ManualClock>(env, clock.raw(), "_clock", "ManualClock")?;
        Ok(Deadline {
            inner: oncely::Deadline::after(&clock.inner, budget),
            clock: Some(clock.inner.clone()),
        })
    }
    /// Milliseconds left (0 once passed).
    #[napi(getter)]
    pub fn remaining_ms(&self) -> f64 {
        ms(self.inner.remaining_at(self.now()))
    }
    /// Whether the deadline has passed.
    #[napi(getter)]
    pub fn expired(&self) -> bool {
        self.inner.remaining_at(self.now()).is_zero()
    }
}

impl Deadline {
    fn now(&self) -> Duration {
        match &self.clock {
            Some(c) => c.now(),
            None => oncely::SystemClock.now(),
        }
    }
}

/// A clock that moves only when told to: the test hook of `IdempotencyStore` and
/// `RetryBudget` (`_clock` option).
#[napi]
pub struct ManualClock {
    pub(crate) inner: oncely::ManualClock,
}

#[napi]
impl ManualClock {
    /// A clock at time zero.
    #[napi(constructor)]
    #[allow(clippy::new_without_default)]
    pub fn new() -> Self {
        ManualClock {
            inner: oncely::ManualClock::new(),
        }
    }
    /// Moves the clock forward by `ms`.
    #[napi(ts_args_type = "ms: number")]
    pub fn advance(&self, env: &Env, ms: Unknown<'_>) -> Result<()> {
        let by = convert::millis(env.raw(), ms.raw(), "ms")?;
        self.inner.advance(by);
        Ok(())
    }
    /// Sets the clock to `ms` (it may go backwards).
    #[napi(ts_args_type = "ms: number")]
    pub fn set(&self, env: &Env, ms: Unknown<'_>) -> Result<()> {
        let to = convert::millis(env.raw(), ms.raw(), "ms")?;
        self.inner.set(to);
        Ok(())
    }
    /// The clock's time in milliseconds.
    #[napi(getter)]
    pub fn now_ms(&self) -> f64 {
        ms(self.inner.now())
    }
}

/// Options of `new RetryBudget(options)`.
// Read by hand (`Options`), declared for the generated typings only.
#[allow(dead_code)]
#[napi(object)]
pub struct RetryBudgetOptions {
    /// Retries allowed per request over the window (default 0.1).
    pub ratio: Option<f64>,
    /// The sliding window (default 10000, at least 10).
    pub window_ms: Option<f64>,
    /// Retries per second of window allowed regardless (default 10).
    pub min_per_sec: Option<u32>,
}

/// What a `RetryBudget` holds in its window right now.
#[napi(object)]
pub struct BudgetSnapshot {
    /// Requests recorded in the window.
    pub requests: f64,
    /// Retries withdrawn in the window.
    pub retries: f64,
    /// Retries the window allows in total.
    pub allowed: f64,
}

/// Caps retries across calls (retry storms, SPEC §4): share one budget between all the
/// calls of a client.
#[napi]
pub struct RetryBudget {
    pub(crate) inner: oncely::RetryBudget,
}

#[napi]
impl RetryBudget {
    #[napi(constructor, ts_args_type = "options?: RetryBudgetOptions")]
    pub fn new(env: &Env, options: Unknown<'_>) -> Result<Self> {
        let raw = env.raw();
        let o = Options::new(
            raw,
            options.raw(),
            "RetryBudget",
            &["ratio", "windowMs", "minPerSec", "_clock"],
        )?;
        let ratio = o.number(c"ratio")?.unwrap_or(0.1);
        let window = o
            .millis(c"windowMs", "window")?
            .unwrap_or(Duration::from_secs(10));
        let min_per_sec = o
            .integer(c"minPerSec", 0.0, f64::from(u32::MAX))?
            .map_or(10, |n| n as u32);
        let mut budget =
            oncely::RetryBudget::new_named(ratio, window, min_per_sec, &crate::errors::NAMING)
                .or_throw(raw)?;
        if let Some(v) = o.get(c"_clock")? {
            let clock = instance::<ManualClock>(env, v, "_clock", "ManualClock")?;
            budget = budget.with_clock(clock.inner.clone());
        }
        Ok(RetryBudget { inner: budget })
    }

    /// Counts one call (not one attempt); the retry loop does this for each call given
    /// the budget.
    #[napi]
    pub fn record_request(&self) {
        self.inner.record_request();
    }

    /// Takes one retry from the budget if it has room; `false` means the retry must not
    /// happen. The retry loop does this before each retry.
    #[napi]
    pub fn try_withdraw(&self) -> bool {
        self.inner.try_withdraw()
    }

    /// The window's counts now.
    #[napi]
    pub fn snapshot(&self) -> BudgetSnapshot {
        let s = self.inner.snapshot();
        BudgetSnapshot {
            requests: s.requests as f64,
            retries: s.retries as f64,
            allowed: s.allowed,
        }
    }
}

/// The sans-IO retry machine of one call (the core's `RetryState`), driven by the
/// JavaScript `retry` loop after a failure. Internal.
#[napi]
pub struct RetryState {
    inner: oncely::RetryState,
    clock: Option<oncely::ManualClock>,
    stop: Option<StopReason>,
    rule: Option<oncely::Rule>,
}

#[napi]
impl RetryState {
    /// `deadline`, `budget` and `clock` may be `undefined`. Counts the call in `budget`.
    /// Time is read from `clock` (a test hook) or the system clock.
    #[napi(constructor)]
    pub fn new(
        policy: &RetryPolicy,
        safe: bool,
        rereads: bool,
        transient_internal: bool,
        deadline: Option<&Deadline>,
        budget: Option<&RetryBudget>,
        clock: Option<&ManualClock>,
    ) -> Self {
        let mut inner = oncely::RetryState::new(policy.inner).with_facts(CallFacts {
            safe,
            rereads,
            transient_internal,
        });
        if let Some(d) = deadline {
            inner = inner.with_deadline(d.inner);
        }
        if let Some(b) = budget {
            inner = inner.with_budget(b.inner.clone());
        }
        RetryState {
            inner,
            clock: clock.map(|c| c.inner.clone()),
            stop: None,
            rule: None,
        }
    }

    /// Decides what follows a failed attempt: the delay in ms before the next one, or
    /// -1 to stop (see `stopReason`). The server's delay, if any, is `delayMs` (already
    /// in ms), `doNotRetry`, a `grpc-retry-pushback-ms` value or a `Retry-After` value,
    /// in that order of precedence; a malformed pushback means do not retry (gRFC A6), a
    /// malformed `Retry-After` is ignored.
    #[napi]
    pub fn on_failure(
        &mut self,
        env: &Env,
        code: u32,
        delay_ms: Option<f64>,
        do_not_retry: Option<bool>,
        pushback: Option<String>,
        retry_after: Option<String>,
    ) -> Result<f64> {
        let raw = env.raw();
        let Some(code) = i32::try_from(code).ok().and_then(Code::from_i32) else {
            return Err(range_error(
                raw,
                "code",
                &format!("{code} is not a gRPC code (0..=16)"),
            ));
        };
        let mut failure = Failure::new(code);
        let server = if do_not_retry == Some(true) {
            Some(ServerDelay::DoNotRetry)
        } else if let Some(d) = delay_ms {
            Some(ServerDelay::After(
                oncely::duration_from_millis_f64("retry_after", d).or_throw(raw)?,
            ))
        } else if let Some(p) = pushback.as_deref() {
            Some(oncely::parse_pushback_ms(p).unwrap_or(ServerDelay::DoNotRetry))
        } else if let Some(r) = retry_after.as_deref() {
            oncely::parse_retry_after(r, SystemTime::now()).ok()
        } else {
            None
        };
        if let Some(s) = server {
            failure = failure.with_server_delay(s);
        }
        match self.inner.on_failure(failure, self.now()) {
            Decision::Retry { delay, rule } => {
                self.rule = Some(rule);
                Ok(ms(delay))
            }
            Decision::Stop(reason) => {
                self.stop = Some(reason);
                Ok(-1.0)
            }
        }
    }

    /// The number of the attempt in progress (1 for the first).
    #[napi(getter)]
    pub fn attempt(&self) -> u32 {
        self.inner.attempt()
    }
    /// Why the loop stopped, after `onFailure` returned -1.
    #[napi(getter)]
    pub fn stop_reason(&self) -> Option<&'static str> {
        self.stop.map(StopReason::as_str)
    }
    /// Why the loop stopped, in words (the stop reason, then its cause; for
    /// `not_retryable` the rule of the last failure), after `onFailure` returned -1.
    #[napi(getter)]
    pub fn why_stopped(&self) -> Option<String> {
        self.stop.map(|r| self.inner.explain_stop(r))
    }
    /// The classification rule that allowed the last retry.
    #[napi(getter)]
    pub fn rule(&self) -> Option<&'static str> {
        self.rule.map(oncely::Rule::as_str)
    }
    /// Milliseconds left before the deadline (`null` without one).
    #[napi(getter)]
    pub fn remaining_ms(&self) -> Option<f64> {
        self.inner.remaining_at(self.now()).map(ms)
    }
}

impl RetryState {
    fn now(&self) -> Duration {
        match &self.clock {
            Some(c) => c.now(),
            None => oncely::SystemClock.now(),
        }
    }
}

/// The gRPC code names, in numeric order (0 = `OK` … 16 = `UNAUTHENTICATED`).
#[napi]
pub fn code_names() -> Vec<&'static str> {
    Code::ALL.iter().map(|c| c.as_str()).collect()
}

/// Reads a code given as its number or its name (`14`, `"UNAVAILABLE"`).
pub(crate) fn code_arg(env: sys::napi_env, v: sys::napi_value, field: &str) -> Result<Code> {
    match convert::type_of(env, v) {
        sys::ValueType::napi_number => {
            let n = convert::integer(env, v, field, 0.0, 16.0)?;
            Ok(Code::ALL[n as usize])
        }
        sys::ValueType::napi_string => {
            let s = convert::string(env, v, field, SHORT_STRING_MAX)?;
            s.parse::<Code>().or_throw(env)
        }
        _ => Err(type_error(
            env,
            field,
            &format!(
                "{field} must be a gRPC code number or name, got {}",
                convert::type_name(env, v)
            ),
        )),
    }
}

/// The gRPC code an HTTP status means (the table of SPEC §3).
#[napi(ts_args_type = "status: number", ts_return_type = "Code")]
pub fn code_from_http(env: &Env, status: Unknown<'_>) -> Result<u32> {
    let s = convert::integer(env.raw(), status.raw(), "status", 0.0, 65535.0)?;
    Ok(Code::from_http(s as u16) as u32)
}

/// The answer of `classify`.
#[napi(object)]
pub struct Classification {
    /// Whether the failure may be retried (subject to attempts, deadline and budget).
    pub retryable: bool,
    /// The rule that decided it (`"transient_safe"`, `"permanent"`, …).
    pub rule: String,
}

/// Facts about a call that decide whether resending it is safe.
// Read by hand (`Options`), declared for the generated typings only.
#[allow(dead_code)]
#[napi(object)]
pub struct CallFactsOptions {
    /// The operation is idempotent or carries an idempotency key.
    pub safe: Option<bool>,
    /// Each attempt re-reads state before writing (conflicts may be retried).
    pub rereads: Option<bool>,
    /// INTERNAL/UNKNOWN are declared transient for this (safe) call.
    pub transient_internal: Option<bool>,
}

/// The delay a server asked for with a failure, for `classify`.
// Read by hand (`Options`), declared for the generated typings only.
#[allow(dead_code)]
#[napi(object)]
pub struct ServerDelayOptions {
    /// Wait this many ms before the next attempt (Retry-After, pushback, RetryInfo,
    /// an in-progress answer's delay).
    pub delay_ms: Option<f64>,
    /// The server said not to retry.
    pub do_not_retry: Option<bool>,
}

/// Whether a failure with `code` may be retried, and by which rule (SPEC §3). With
/// `server`, the delay the server asked for counts: ABORTED with a delay is an
/// in-progress answer, which a safe (keyed) call resends.
#[napi(
    ts_args_type = "code: Code | CodeName, facts?: CallFactsOptions, server?: ServerDelayOptions"
)]
pub fn classify(
    env: &Env,
    code: Unknown<'_>,
    facts: Unknown<'_>,
    server: Unknown<'_>,
) -> Result<Classification> {
    let raw = env.raw();
    let code = code_arg(raw, code.raw(), "code")?;
    let o = Options::new(
        raw,
        facts.raw(),
        "classify",
        &["safe", "rereads", "transientInternal"],
    )?;
    let facts = CallFacts {
        safe: o.boolean(c"safe")?.unwrap_or(false),
        rereads: o.boolean(c"rereads")?.unwrap_or(false),
        transient_internal: o.boolean(c"transientInternal")?.unwrap_or(false),
    };
    let server = Options::new(
        raw,
        server.raw(),
        "server delay",
        &["delayMs", "doNotRetry"],
    )?;
    let mut failure = Failure::new(code);
    if server.boolean(c"doNotRetry")? == Some(true) {
        failure = failure.with_server_delay(ServerDelay::DoNotRetry);
    } else if let Some(d) = server.number(c"delayMs")? {
        failure = failure.with_server_delay(ServerDelay::After(
            oncely::duration_from_millis_f64("delayMs", d).or_throw(raw)?,
        ));
    }
    let c = oncely::classify_failure(failure, facts);
    Ok(Classification {
        retryable: c.retryable,
        rule: c.rule.as_str().to_owned(),
    })
}

/// Parses an HTTP `Retry-After` value (delta-seconds or an HTTP-date) into a delay in
/// ms, measured from `nowMs` (Unix time in ms; default: now). Throws a `RangeError`
/// naming `retryAfter` for anything else.
#[napi(ts_args_type = "value: string, nowMs?: number")]
pub fn parse_retry_after(env: &Env, value: Unknown<'_>, now_ms: Unknown<'_>) -> Result<f64> {
    let raw = env.raw();
    let v = convert::string(raw, value.raw(), "retryAfter", SHORT_STRING_MAX)?;
    let now = if convert::is_nullish(raw, now_ms.raw()) {
        SystemTime::now()
    } else {
        let n = convert::number(raw, now_ms.raw(), "nowMs")?;
        if !n.is_finite() {
            return Err(range_error(raw, "nowMs", "must be finite"));
        }
        let d = Duration::from_secs_f64(n.abs().min(1e15) / 1000.0);
        if n >= 0.0 {
            UNIX_EPOCH + d
        } else {
            UNIX_EPOCH - d
        }
    };
    match oncely::parse_retry_after(&v, now).or_throw(raw)? {
        ServerDelay::After(d) => Ok(server_delay_ms(d)),
        ServerDelay::DoNotRetry => Ok(-1.0),
    }
}

/// A parsed `grpc-retry-pushback-ms`.
#[napi(object)]
pub struct Pushback {
    /// The delay in ms; absent when the server said not to retry.
    pub delay_ms: Option<f64>,
    /// True for a negative pushback: do not retry.
    pub do_not_retry: bool,
}

/// Parses gRPC's `grpc-retry-pushback-ms`: a non-negative integer is the delay, a
/// negative one means do not retry; anything else throws a `RangeError`.
#[napi(ts_args_type = "value: string")]
pub fn parse_pushback_ms(env: &Env, value: Unknown<'_>) -> Result<Pushback> {
    let raw = env.raw();
    let v = convert::string(raw, value.raw(), "grpc-retry-pushback-ms", SHORT_STRING_MAX)?;
    Ok(match oncely::parse_pushback_ms(&v).or_throw(raw)? {
        ServerDelay::After(d) => Pushback {
            delay_ms: Some(server_delay_ms(d)),
            do_not_retry: false,
        },
        ServerDelay::DoNotRetry => Pushback {
            delay_ms: None,
            do_not_retry: true,
        },
    })
}

/// Domain reason codes (`"RATE_LIMITED"`, …) and the gRPC code each one means; starts
/// with the built-in ones, callers add their own.
#[napi]
pub struct ReasonCodes {
    inner: oncely::ReasonCodes,
}

#[napi]
impl ReasonCodes {
    #[napi(constructor)]
    #[allow(clippy::new_without_default)]
    pub fn new() -> Self {
        ReasonCodes {
            inner: oncely::ReasonCodes::default(),
        }
    }
    /// Adds a reason (`[A-Z][A-Z0-9_]{0,63}`) meaning `code`.
    #[napi(ts_args_type = "reason: string, code: Code | CodeName")]
    pub fn register(&mut self, env: &Env, reason: Unknown<'_>, code: Unknown<'_>) -> Result<()> {
        let raw = env.raw();
        let r = convert::string(raw, reason.raw(), "reason", SHORT_STRING_MAX)?;
        let c = code_arg(raw, code.raw(), "code")?;
        self.inner.register(&r, c).or_throw(raw)
    }
    /// The code a reason means, or `null`.
    #[napi(ts_args_type = "reason: string", ts_return_type = "Code | null")]
    pub fn resolve(&self, env: &Env, reason: Unknown<'_>) -> Result<Option<u32>> {
        let r = convert::string(env.raw(), reason.raw(), "reason", SHORT_STRING_MAX)?;
        Ok(self.inner.resolve(&r).map(|c| c as u32))
    }
}

/// What the JavaScript layer read off one error of a chain (the error, then its
/// `cause`s), unjudged; the core's `extract` decides what it means.
#[napi(object)]
pub struct RawLevel {
    /// The error's `code`.
    pub code: Option<Either<String, f64>>,
    /// The error's `status`, or its response's.
    pub status: Option<Either<String, f64>>,
    /// The error's `statusCode`, or its response's.
    pub status_code: Option<Either<String, f64>>,
    /// The error's `name` and its constructors' names, most specific first.
    pub type_names: Option<Vec<String>>,
    /// `[name, value]` pairs of headers and gRPC metadata (binary values in base64).
    pub headers: Option<Vec<Vec<String>>>,
    /// A delay the error states itself (`retryAfterMs`).
    pub delay_ms: Option<f64>,
}

/// The failure `extractFailure` found: a code and the server's delay, if any.
#[napi(object)]
pub struct Extracted {
    /// The gRPC code.
    #[napi(ts_type = "Code")]
    pub code: u32,
    /// The server's delay in ms, if it asked for one.
    pub delay_ms: Option<f64>,
    /// The server said not to retry.
    pub do_not_retry: bool,
}

fn raw_value(v: Option<Either<String, f64>>) -> Option<oncely::RawValue> {
    match v? {
        Either::A(s) => Some(oncely::RawValue::Text(s)),
        Either::B(n) if n.is_finite() && n.fract() == 0.0 && n.abs() < 9.0e15 => {
            Some(oncely::RawValue::Int(n as i64))
        }
        Either::B(_) => None,
    }
}

/// The header and metadata names the core reads off a failure.
#[napi]
pub fn extract_headers() -> Vec<&'static str> {
    oncely::RawFailure::HEADERS.to_vec()
}

/// The failure an error stands for, by the core's rules (SPEC §3, "Extraction"), from
/// the raw facts of the error and its causes.
#[napi]
pub fn extract_failure(levels: Vec<RawLevel>, reasons: Option<&ReasonCodes>) -> Extracted {
    let mut raw: Option<oncely::RawFailure> = None;
    for level in levels.into_iter().rev() {
        raw = Some(oncely::RawFailure {
            code: raw_value(level.code),
            status: raw_value(level.status),
            status_code: raw_value(level.status_code),
            errno: None,
            type_names: level.type_names.unwrap_or_default(),
            headers: level
                .headers
                .unwrap_or_default()
                .into_iter()
                .filter_map(|mut p| {
                    (p.len() == 2).then(|| {
                        let v = p.pop().unwrap_or_default();
                        (p.pop().unwrap_or_default(), v)
                    })
                })
                .collect(),
            delay: level
                .delay_ms
                .filter(|d| d.is_finite() && *d >= 0.0)
                .and_then(|d| oncely::duration_from_millis_f64("retry_after", d).ok()),
            cause: raw.take().map(Box::new),
        });
    }
    let raw = raw.unwrap_or_default();
    let default = oncely::ReasonCodes::default();
    let reasons = reasons.map_or(&default, |r| &r.inner);
    let f = oncely::extract(&raw, reasons, SystemTime::now());
    let (delay_ms, do_not_retry) = match f.server_delay {
        Some(ServerDelay::After(d)) => (Some(server_delay_ms(d)), false),
        Some(ServerDelay::DoNotRetry) => (None, true),
        None => (None, false),
    };
    Extracted {
        code: f.code as u32,
        delay_ms,
        do_not_retry,
    }
}
