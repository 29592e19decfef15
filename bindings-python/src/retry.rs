//! Backoff, classification, deadlines, the retry budget and the sans-IO retry state
//! that the Python retry loops drive.

use std::time::{Duration, SystemTime};

use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};

use oncely::{CallFacts, Clock, Code, Decision, Failure as CoreFailure, ServerDelay, SystemClock};

use crate::convert::{finite, int_in, opt_seconds, seconds};
use crate::errors::{flag, instance, invalid, text, IntoPyResult};

/// A gRPC code from a Python int (or `Code` member).
pub fn code_of(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Code> {
    let n = int_in(py, "code", obj, 0, 16)?;
    Ok(Code::from_i32(n as i32).expect("range checked"))
}

/// The canonical names of the 17 codes, in numeric order.
#[pyfunction]
pub fn code_names() -> Vec<&'static str> {
    Code::ALL.iter().map(|c| c.as_str()).collect()
}

/// The code an HTTP status maps to (the core's table).
#[pyfunction]
pub fn code_from_http(py: Python<'_>, status: &Bound<'_, PyAny>) -> PyResult<u8> {
    let status = int_in(py, "status", status, 0, 65535)?;
    Ok(Code::from_http(status as u16) as u8)
}

/// The code named by `name` (case-insensitive) or a number as text.
#[pyfunction]
pub fn code_from_name(py: Python<'_>, name: &str) -> PyResult<u8> {
    name.parse::<Code>().map(|c| c as u8).py(py)
}

/// Whether a failure with `code` may be retried, and the rule that decided.
#[pyclass(frozen, module = "oncely", eq)]
#[derive(Clone, PartialEq)]
pub struct Classification {
    /// May be retried (subject to attempts, deadline and budget).
    #[pyo3(get)]
    retryable: bool,
    /// The stable name of the SPEC §3 row that decided.
    #[pyo3(get)]
    rule: &'static str,
}

#[pymethods]
impl Classification {
    fn __repr__(&self) -> String {
        format!(
            "Classification(retryable={}, rule={:?})",
            if self.retryable { "True" } else { "False" },
            self.rule
        )
    }
}

/// SPEC §3: may a failure (a `Failure`, whose server delay counts, or a code) be
/// retried, given the facts of the call?
#[pyfunction]
#[pyo3(
    signature = (code, *, safe=None, rereads=None, transient_internal=None),
    text_signature = "(code, *, safe=False, rereads=False, transient_internal=False)"
)]
pub fn classify(
    py: Python<'_>,
    code: &Bound<'_, PyAny>,
    safe: Option<&Bound<'_, PyAny>>,
    rereads: Option<&Bound<'_, PyAny>>,
    transient_internal: Option<&Bound<'_, PyAny>>,
) -> PyResult<Classification> {
    let c = oncely::classify_failure(
        failure_of(py, code)?,
        facts(safe, rereads, transient_internal)?,
    );
    Ok(Classification {
        retryable: c.retryable,
        rule: c.rule.as_str(),
    })
}

/// The call facts from the keyword arguments `safe`, `rereads`, `transient_internal`.
fn facts(
    safe: Option<&Bound<'_, PyAny>>,
    rereads: Option<&Bound<'_, PyAny>>,
    transient_internal: Option<&Bound<'_, PyAny>>,
) -> PyResult<CallFacts> {
    Ok(CallFacts {
        safe: flag(safe, "safe", false)?,
        rereads: flag(rereads, "rereads", false)?,
        transient_internal: flag(transient_internal, "transient_internal", false)?,
    })
}

/// How often and how patiently to retry (SPEC §2). Durations in seconds.
#[pyclass(frozen, module = "oncely", eq)]
#[derive(Clone, PartialEq)]
pub struct RetryPolicy {
    pub inner: oncely::RetryPolicy,
}

#[pymethods]
impl RetryPolicy {
    #[new]
    #[pyo3(signature = (max_attempts=None, base_delay=None, max_delay=None, multiplier=None, jitter=None, seed=None, min_attempt=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        max_attempts: Option<&Bound<'_, PyAny>>,
        base_delay: Option<&Bound<'_, PyAny>>,
        max_delay: Option<&Bound<'_, PyAny>>,
        multiplier: Option<&Bound<'_, PyAny>>,
        jitter: Option<&Bound<'_, PyAny>>,
        seed: Option<&Bound<'_, PyAny>>,
        min_attempt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut p = oncely::RetryPolicy::new();
        if let Some(n) = max_attempts {
            p = p.with_max_attempts(int_in(py, "max_attempts", n, 0, i128::from(u32::MAX))? as u32);
        }
        if let Some(d) = opt_seconds(py, "base_delay", base_delay)? {
            p = p.with_base_delay(d);
        }
        if let Some(d) = opt_seconds(py, "max_delay", max_delay)? {
            p = p.with_max_delay(d);
        }
        if let Some(m) = multiplier {
            p = p.with_multiplier(nan_ok(py, "multiplier", m)?);
        }
        if let Some(j) = jitter {
            p = p.with_jitter(nan_ok(py, "jitter", j)?);
        }
        if let Some(s) = seed.filter(|s| !s.is_none()) {
            p = p.with_seed(int_in(py, "seed", s, 0, i128::from(u64::MAX))? as u64);
        }
        if let Some(d) = opt_seconds(py, "min_attempt", min_attempt)? {
            p = p.with_min_attempt(d);
        }
        p.validate_named(&oncely::Naming::SECONDS).py(py)?;
        Ok(RetryPolicy { inner: p })
    }

    /// Total attempts, the first included.
    #[getter]
    fn max_attempts(&self) -> u32 {
        self.inner.max_attempts()
    }
    /// Delay after the first failure, before jitter (seconds).
    #[getter]
    fn base_delay(&self) -> f64 {
        self.inner.base_delay().as_secs_f64()
    }
    /// Cap on the delay before jitter (seconds).
    #[getter]
    fn max_delay(&self) -> f64 {
        self.inner.max_delay().as_secs_f64()
    }
    /// Growth factor per attempt.
    #[getter]
    fn multiplier(&self) -> f64 {
        self.inner.multiplier()
    }
    /// Relative jitter in [0, 1).
    #[getter]
    fn jitter(&self) -> f64 {
        self.inner.jitter()
    }
    /// The jitter seed, if deterministic.
    #[getter]
    fn seed(&self) -> Option<u64> {
        self.inner.seed()
    }
    /// Time an attempt needs at least before the deadline (seconds).
    #[getter]
    fn min_attempt(&self) -> f64 {
        self.inner.min_attempt().as_secs_f64()
    }

    /// The delay (seconds) after the `failed_attempt`-th failure (1-based).
    fn delay_after(&self, py: Python<'_>, failed_attempt: &Bound<'_, PyAny>) -> PyResult<f64> {
        let n = int_in(
            py,
            "failed_attempt",
            failed_attempt,
            0,
            i128::from(u32::MAX),
        )? as u32;
        Ok(self.inner.delay_after(n).as_secs_f64())
    }

    /// The delay (seconds) after the `failed_attempt`-th failure with jitter from `seed`.
    fn delay_with_seed(
        &self,
        py: Python<'_>,
        failed_attempt: &Bound<'_, PyAny>,
        seed: &Bound<'_, PyAny>,
    ) -> PyResult<f64> {
        let n = int_in(
            py,
            "failed_attempt",
            failed_attempt,
            0,
            i128::from(u32::MAX),
        )? as u32;
        let seed = int_in(py, "seed", seed, 0, i128::from(u64::MAX))? as u64;
        Ok(self.inner.delay_with_seed(n, seed).as_secs_f64())
    }

    /// The whole delay sequence (seconds), `max_attempts - 1` delays; at most 100,000.
    fn backoff(&self, py: Python<'_>) -> PyResult<Vec<f64>> {
        if self.inner.max_attempts() > 100_001 {
            return Err(invalid(
                py,
                "max_attempts",
                "backoff() lists at most 100,000 delays; use delay_after(n)",
            ));
        }
        Ok(self.inner.backoff().map(|d| d.as_secs_f64()).collect())
    }

    fn __repr__(&self) -> String {
        let p = &self.inner;
        format!(
            "RetryPolicy(max_attempts={}, base_delay={}, max_delay={}, multiplier={}, jitter={}, seed={}, min_attempt={})",
            p.max_attempts(),
            p.base_delay().as_secs_f64(),
            p.max_delay().as_secs_f64(),
            p.multiplier(),
            p.jitter(),
            p.seed().map_or("None".to_owned(), |s| s.to_string()),
            p.min_attempt().as_secs_f64(),
        )
    }
}

/// A number that the core validates itself (NaN is passed on and rejected there with
/// the field's name); only the type is checked here.
fn nan_ok(py: Python<'_>, field: &'static str, obj: &Bound<'_, PyAny>) -> PyResult<f64> {
    match finite(py, field, obj) {
        Ok(v) => Ok(v),
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyTypeError>(py) => Err(e),
        Err(_) => Ok(f64::NAN),
    }
}

/// A clock that moves only when told to (for tests of stores, budgets and loops).
#[pyclass(frozen, module = "oncely")]
#[derive(Clone, Default)]
pub struct ManualClock {
    pub inner: oncely::ManualClock,
}

#[pymethods]
impl ManualClock {
    #[new]
    fn new() -> Self {
        Self::default()
    }
    /// Moves the clock forward by `seconds`.
    fn advance(&self, py: Python<'_>, seconds: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner
            .advance(crate::convert::seconds(py, "seconds", seconds)?);
        Ok(())
    }
    /// Sets the clock to `seconds` since its origin.
    fn set(&self, py: Python<'_>, seconds: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner
            .set(crate::convert::seconds(py, "seconds", seconds)?);
        Ok(())
    }
    /// The current time since the clock's origin, in seconds.
    fn now(&self) -> f64 {
        self.inner.now().as_secs_f64()
    }
    fn __repr__(&self) -> String {
        format!("ManualClock(now={})", self.inner.now().as_secs_f64())
    }
}

/// Which clock a deadline or loop reads: the process's monotonic one or a manual one.
#[derive(Clone)]
pub enum AnyClock {
    System,
    Manual(oncely::ManualClock),
}

impl AnyClock {
    pub fn of(clock: Option<&Bound<'_, ManualClock>>) -> Self {
        match clock {
            Some(c) => AnyClock::Manual(c.get().inner.clone()),
            None => AnyClock::System,
        }
    }
    pub fn now(&self) -> Duration {
        match self {
            AnyClock::System => SystemClock.now(),
            AnyClock::Manual(c) => c.now(),
        }
    }
}

/// The point in time by which a whole call must finish.
#[pyclass(frozen, module = "oncely")]
#[derive(Clone)]
pub struct Deadline {
    pub inner: oncely::Deadline,
    pub clock: AnyClock,
}

#[pymethods]
impl Deadline {
    /// A deadline `seconds` from now (on `_clock` if given, else the monotonic clock).
    #[new]
    #[pyo3(signature = (seconds, *, _clock=None))]
    fn new(
        py: Python<'_>,
        seconds: &Bound<'_, PyAny>,
        _clock: Option<&Bound<'_, ManualClock>>,
    ) -> PyResult<Self> {
        let budget = crate::convert::seconds(py, "deadline", seconds)?;
        let clock = AnyClock::of(_clock);
        Ok(Deadline {
            inner: oncely::Deadline::at(clock.now().saturating_add(budget)),
            clock,
        })
    }
    /// Seconds left (0 once passed).
    fn remaining(&self) -> f64 {
        self.inner.remaining_at(self.clock.now()).as_secs_f64()
    }
    /// Whether the deadline has passed.
    #[getter]
    fn expired(&self) -> bool {
        self.inner.remaining_at(self.clock.now()).is_zero()
    }
    fn __repr__(&self) -> String {
        format!("Deadline(remaining={})", self.remaining())
    }
}

/// What a budget holds in its window.
#[pyclass(frozen, module = "oncely", get_all)]
#[derive(Clone)]
pub struct BudgetSnapshot {
    requests: u64,
    retries: u64,
    allowed: f64,
}

#[pymethods]
impl BudgetSnapshot {
    fn __repr__(&self) -> String {
        format!(
            "BudgetSnapshot(requests={}, retries={}, allowed={})",
            self.requests, self.retries, self.allowed
        )
    }
}

/// Caps retries across calls (SPEC §4): share one between the calls of a client.
#[pyclass(frozen, module = "oncely")]
pub struct RetryBudget {
    pub inner: oncely::RetryBudget,
}

#[pymethods]
impl RetryBudget {
    #[new]
    #[pyo3(signature = (ratio=None, window=None, min_per_sec=None, *, _clock=None))]
    fn new(
        py: Python<'_>,
        ratio: Option<&Bound<'_, PyAny>>,
        window: Option<&Bound<'_, PyAny>>,
        min_per_sec: Option<&Bound<'_, PyAny>>,
        _clock: Option<&Bound<'_, ManualClock>>,
    ) -> PyResult<Self> {
        let ratio = match ratio {
            Some(r) => nan_ok(py, "ratio", r)?,
            None => 0.1,
        };
        let window = opt_seconds(py, "window", window)?.unwrap_or(Duration::from_secs(10));
        let min_per_sec = match min_per_sec {
            Some(m) => int_in(py, "min_per_sec", m, 0, i128::from(u32::MAX))? as u32,
            None => 10,
        };
        let mut b =
            oncely::RetryBudget::new_named(ratio, window, min_per_sec, &oncely::Naming::SECONDS)
                .py(py)?;
        if let Some(c) = _clock {
            b = b.with_clock(c.get().inner.clone());
        }
        Ok(RetryBudget { inner: b })
    }
    #[getter]
    fn ratio(&self) -> f64 {
        self.inner.ratio()
    }
    #[getter]
    fn window(&self) -> f64 {
        self.inner.window().as_secs_f64()
    }
    #[getter]
    fn min_per_sec(&self) -> u32 {
        self.inner.min_per_sec()
    }
    /// Counts one call (not one attempt).
    fn record_request(&self) {
        self.inner.record_request()
    }
    /// Takes one retry if the budget has room.
    fn try_withdraw(&self) -> bool {
        self.inner.try_withdraw()
    }
    /// The window's counts now.
    fn snapshot(&self) -> BudgetSnapshot {
        let s = self.inner.snapshot();
        BudgetSnapshot {
            requests: s.requests,
            retries: s.retries,
            allowed: s.allowed,
        }
    }
    fn __repr__(&self) -> String {
        format!(
            "RetryBudget(ratio={}, window={}, min_per_sec={})",
            self.inner.ratio(),
            self.inner.window().as_secs_f64(),
            self.inner.min_per_sec()
        )
    }
}

/// A failure reduced to what the retry decision needs: a code and the server's delay.
#[pyclass(frozen, module = "oncely")]
#[derive(Clone)]
pub struct Failure {
    pub inner: CoreFailure,
}

#[pymethods]
impl Failure {
    /// `delay`: seconds the server asked to wait; `do_not_retry`: it asked not to retry.
    #[new]
    #[pyo3(signature = (code, *, delay=None, do_not_retry=false))]
    fn new(
        py: Python<'_>,
        code: &Bound<'_, PyAny>,
        delay: Option<&Bound<'_, PyAny>>,
        do_not_retry: bool,
    ) -> PyResult<Self> {
        let mut f = CoreFailure::new(code_of(py, code)?);
        if do_not_retry {
            f = f.with_server_delay(ServerDelay::DoNotRetry);
        } else if let Some(d) = opt_seconds(py, "delay", delay)? {
            f = f.with_server_delay(ServerDelay::After(d));
        }
        Ok(Failure { inner: f })
    }

    /// A failure from the raw `Retry-After` and `grpc-retry-pushback-ms` values
    /// (either may be None). A pushback, when given, decides: a negative or malformed one
    /// means do not retry (gRFC A6). A malformed `Retry-After` is ignored: local backoff
    /// applies.
    #[staticmethod]
    #[pyo3(signature = (code, retry_after=None, pushback_ms=None))]
    fn from_headers(
        py: Python<'_>,
        code: &Bound<'_, PyAny>,
        retry_after: Option<&str>,
        pushback_ms: Option<&str>,
    ) -> PyResult<Self> {
        let mut f = CoreFailure::new(code_of(py, code)?);
        let delay = pushback_ms
            .map(|v| oncely::parse_pushback_ms(v).unwrap_or(ServerDelay::DoNotRetry))
            .or_else(|| {
                retry_after.and_then(|v| oncely::parse_retry_after(v, SystemTime::now()).ok())
            });
        if let Some(d) = delay {
            f = f.with_server_delay(d);
        }
        Ok(Failure { inner: f })
    }

    /// The gRPC code (an int; `oncely.Code` wraps it).
    #[getter]
    fn code(&self) -> u8 {
        self.inner.code as u8
    }
    /// The server's delay in seconds, if any.
    #[getter]
    fn delay(&self) -> Option<f64> {
        match self.inner.server_delay {
            Some(ServerDelay::After(d)) => Some(d.as_secs_f64()),
            _ => None,
        }
    }
    /// The server said not to retry.
    #[getter]
    fn do_not_retry(&self) -> bool {
        self.inner.server_delay == Some(ServerDelay::DoNotRetry)
    }
    fn __repr__(&self) -> String {
        format!("Failure({})", self.inner)
    }
}

/// The sans-IO retry machine of one call, driven by the Python loops: feed it each
/// failure; it answers `(delay, rule, from_server)` to retry or a stop reason (str).
#[pyclass(module = "oncely")]
pub struct RetryState {
    inner: oncely::RetryState,
    clock: AnyClock,
    stopped: Option<oncely::StopReason>,
}

#[pymethods]
impl RetryState {
    #[new]
    #[pyo3(
        signature = (policy=None, *, safe=None, rereads=None, transient_internal=None, deadline=None, budget=None, clock=None),
        text_signature = "(policy=None, *, safe=False, rereads=False, transient_internal=False, deadline=None, budget=None, clock=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        policy: Option<&Bound<'_, PyAny>>,
        safe: Option<&Bound<'_, PyAny>>,
        rereads: Option<&Bound<'_, PyAny>>,
        transient_internal: Option<&Bound<'_, PyAny>>,
        deadline: Option<&Bound<'_, PyAny>>,
        budget: Option<&Bound<'_, PyAny>>,
        clock: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let policy = instance::<RetryPolicy>(policy, "policy", "an oncely.RetryPolicy")?;
        let budget = instance::<RetryBudget>(budget, "budget", "an oncely.RetryBudget")?;
        let clock = instance::<ManualClock>(clock, "clock", "an oncely.ManualClock")?;
        let policy = policy.map_or_else(oncely::RetryPolicy::new, |p| p.get().inner);
        let clock = AnyClock::of(clock);
        let facts = facts(safe, rereads, transient_internal)?;
        let mut state = oncely::RetryState::new(policy).with_facts(facts);
        if let Some(d) = deadline.filter(|d| !d.is_none()) {
            let deadline = if let Ok(d) = d.cast::<Deadline>() {
                d.get().inner
            } else {
                oncely::Deadline::at(clock.now().saturating_add(seconds(py, "deadline", d)?))
            };
            state = state.with_deadline(deadline);
        }
        if let Some(b) = budget {
            state = state.with_budget(b.get().inner.clone());
        }
        Ok(RetryState {
            inner: state,
            clock,
            stopped: None,
        })
    }

    /// The number of the attempt in progress (1 for the first).
    #[getter]
    fn attempt(&self) -> u32 {
        self.inner.attempt()
    }

    /// Seconds left before the deadline (None without one).
    fn remaining(&self) -> Option<f64> {
        self.inner
            .remaining_at(self.clock.now())
            .map(|d| d.as_secs_f64())
    }

    /// Decides what follows a failure: `failure` is a `Failure` or a code (int).
    fn on_failure<'py>(
        &mut self,
        py: Python<'py>,
        failure: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let f = failure_of(py, failure)?;
        let now = self.clock.now();
        Ok(match self.inner.on_failure(f, now) {
            Decision::Retry { delay, rule } => {
                let from_server = matches!(f.server_delay, Some(ServerDelay::After(_)));
                PyTuple::new(
                    py,
                    [
                        delay.as_secs_f64().into_pyobject(py)?.into_any(),
                        PyString::intern(py, rule.as_str()).into_any(),
                        pyo3::types::PyBool::new(py, from_server)
                            .to_owned()
                            .into_any(),
                    ],
                )?
                .into_any()
            }
            Decision::Stop(reason) => {
                self.stopped = Some(reason);
                PyString::intern(py, reason.as_str()).into_any()
            }
        })
    }

    /// Why the loop stopped (the stop reason, then its cause; for `not_retryable` the
    /// rule of the last failure), or None before a stop.
    fn why_stopped(&self) -> Option<String> {
        self.stopped.map(|r| self.inner.explain_stop(r))
    }
}

/// A `Failure` as is, or a code (int) as a failure without a server delay.
fn failure_of(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<CoreFailure> {
    match obj.cast::<Failure>() {
        Ok(f) => Ok(f.get().inner),
        Err(_) => Ok(CoreFailure::new(code_of(py, obj)?)),
    }
}

/// Parses an HTTP `Retry-After` value into seconds (`now`: Unix time in seconds, for
/// HTTP-dates; default the wall clock).
#[pyfunction]
#[pyo3(signature = (value, now=None))]
pub fn parse_retry_after(
    py: Python<'_>,
    value: &Bound<'_, PyAny>,
    now: Option<&Bound<'_, PyAny>>,
) -> PyResult<f64> {
    let value = text(value, "value")?;
    let now = match now {
        None => SystemTime::now(),
        Some(n) => {
            let secs = finite(py, "now", n)?;
            let offset = oncely::duration_from_secs_f64("now", secs.abs()).py(py)?;
            let at = if secs >= 0.0 {
                SystemTime::UNIX_EPOCH.checked_add(offset)
            } else {
                SystemTime::UNIX_EPOCH.checked_sub(offset)
            };
            at.ok_or_else(|| {
                invalid(
                    py,
                    "now",
                    format!("{secs} seconds is beyond the system clock's range"),
                )
            })?
        }
    };
    match oncely::parse_retry_after(&value, now).py(py)? {
        ServerDelay::After(d) => Ok(d.as_secs_f64()),
        ServerDelay::DoNotRetry => Ok(f64::INFINITY),
    }
}

/// Parses `grpc-retry-pushback-ms` into seconds; None means "do not retry".
#[pyfunction]
pub fn parse_pushback_ms(py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<Option<f64>> {
    match oncely::parse_pushback_ms(&text(value, "value")?).py(py)? {
        ServerDelay::After(d) => Ok(Some(d.as_secs_f64())),
        ServerDelay::DoNotRetry => Ok(None),
    }
}

/// Domain reason codes (`"RATE_LIMITED"`, …) and the gRPC code each one means; starts
/// with the built-in ones, callers add their own.
#[pyclass(module = "oncely")]
#[derive(Clone, Default)]
pub struct ReasonCodes {
    inner: oncely::ReasonCodes,
}

#[pymethods]
impl ReasonCodes {
    #[new]
    fn new() -> Self {
        ReasonCodes::default()
    }
    /// Adds a reason (`[A-Z][A-Z0-9_]{0,63}`) meaning `code` (a `Code`, an int or a name).
    fn register(
        &mut self,
        py: Python<'_>,
        reason: &Bound<'_, PyAny>,
        code: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let reason = text(reason, "reason")?;
        let code = match code.extract::<String>() {
            Ok(name) => name.parse::<Code>().py(py)?,
            Err(_) => code_of(py, code)?,
        };
        self.inner.register(&reason, code).py(py)
    }
    /// The code a reason means (an int), or None.
    fn resolve(&self, reason: &Bound<'_, PyAny>) -> PyResult<Option<u8>> {
        Ok(self
            .inner
            .resolve(&text(reason, "reason")?)
            .map(|c| c as u8))
    }
    fn __repr__(&self) -> String {
        "ReasonCodes()".to_owned()
    }
}

/// The header and metadata names the core reads off a failure.
#[pyfunction]
pub fn extract_headers() -> Vec<&'static str> {
    oncely::RawFailure::HEADERS.to_vec()
}

/// A text read off a foreign error; one Rust cannot hold (a lone surrogate) keeps its
/// other characters, so that the rest of the error is still read.
fn lossy(s: &Bound<'_, PyString>) -> String {
    s.to_string_lossy().into_owned()
}

fn raw_value(v: &Bound<'_, PyAny>) -> Option<oncely::RawValue> {
    if v.is_none() || v.is_instance_of::<pyo3::types::PyBool>() {
        return None;
    }
    if let Ok(s) = v.cast::<PyString>() {
        return s.extract::<String>().ok().map(oncely::RawValue::Text);
    }
    v.extract::<i64>().ok().map(oncely::RawValue::Int)
}

/// The failure a foreign error stands for, by the core's rules, from the raw facts the
/// Python layer read off it: `levels` is the error and its causes, each a tuple
/// `(code, status, status_code, errno_name, type_names, headers, delay_seconds)`.
#[pyfunction]
#[pyo3(signature = (levels, reasons=None))]
pub fn extract(
    levels: &Bound<'_, pyo3::types::PyList>,
    reasons: Option<&Bound<'_, ReasonCodes>>,
) -> PyResult<Failure> {
    let mut raw: Option<oncely::RawFailure> = None;
    let items: Vec<_> = levels.iter().collect();
    for level in items.iter().rev() {
        let t = level.cast::<PyTuple>()?;
        let delay = t.get_item(6)?;
        let r = oncely::RawFailure {
            code: raw_value(&t.get_item(0)?),
            status: raw_value(&t.get_item(1)?),
            status_code: raw_value(&t.get_item(2)?),
            errno: t.get_item(3)?.extract::<Option<String>>()?,
            type_names: t
                .get_item(4)?
                .extract::<Vec<Bound<'_, PyString>>>()?
                .iter()
                .map(lossy)
                .collect(),
            headers: t
                .get_item(5)?
                .extract::<Vec<(Bound<'_, PyString>, Bound<'_, PyString>)>>()?
                .iter()
                .map(|(n, v)| (lossy(n), lossy(v)))
                .collect(),
            delay: if delay.is_none() {
                None
            } else {
                Some(
                    oncely::duration_from_secs_f64("retry_after", delay.extract::<f64>()?)
                        .py(levels.py())?,
                )
            },
            cause: raw.take().map(Box::new),
        };
        raw = Some(r);
    }
    let raw = raw.unwrap_or_default();
    let f = match reasons {
        Some(r) => oncely::extract(&raw, &r.borrow().inner, SystemTime::now()),
        None => oncely::extract(&raw, &oncely::ReasonCodes::default(), SystemTime::now()),
    };
    Ok(Failure { inner: f })
}
