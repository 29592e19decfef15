//! The async and blocking retry loops over [`RetryState`].

use std::fmt;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use pin_project_lite::pin_project;

use super::state::{Decision, RetryState, StopReason};
use crate::backoff::RetryPolicy;
use crate::budget::RetryBudget;
use crate::classify::{CallFacts, Classify, Failure, Rule};
use crate::clock::{system_clock, Clock, Deadline, SharedClock};

/// What the action is told about the attempt it is making.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attempt {
    /// 1 for the first attempt, 2 for the first retry, …
    pub number: u32,
    /// Time left before the call's deadline, if it has one (forward it as a
    /// per-attempt timeout).
    pub remaining: Option<Duration>,
}

impl Attempt {
    /// Attempts made before this one (the value of `grpc-previous-rpc-attempts`).
    pub fn previous_attempts(&self) -> u32 {
        self.number - 1
    }
}

/// What an [`OnRetry`] hook sees before each retry.
#[derive(Debug)]
pub struct RetryEvent<'a, E> {
    /// The number of the attempt that failed.
    pub attempt: u32,
    /// The delay before the next attempt.
    pub delay: Duration,
    /// The error of the failed attempt.
    pub error: &'a E,
    /// The classification rule that allowed the retry.
    pub rule: Rule,
    /// Whether `delay` is the server's (Retry-After, pushback) rather than backoff.
    pub from_server: bool,
}

/// A callback that sees each retry, for logging and metrics.
pub trait OnRetry<E> {
    /// Called after a failure that will be retried, before the delay.
    fn on_retry(&mut self, event: &RetryEvent<'_, E>);
}

/// The hook that does nothing (the default).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoHook;

impl<E> OnRetry<E> for NoHook {
    #[inline]
    fn on_retry(&mut self, _: &RetryEvent<'_, E>) {}
}

impl<E, G: FnMut(&RetryEvent<'_, E>)> OnRetry<E> for G {
    fn on_retry(&mut self, event: &RetryEvent<'_, E>) {
        self(event)
    }
}

/// How the async loop waits between attempts. The default is [`TimerSleeper`]
/// (futures-timer, no runtime needed); a runtime's own timer can be plugged in.
pub trait Sleeper {
    /// The future of one sleep.
    type Sleep: Future<Output = ()>;
    /// Sleeps for `delay` (never called with a zero delay).
    fn sleep(&self, delay: Duration) -> Self::Sleep;
}

/// Sleeps with `futures_timer::Delay`, which works on every executor.
#[derive(Debug, Clone, Copy, Default)]
pub struct TimerSleeper;

impl Sleeper for TimerSleeper {
    type Sleep = futures_timer::Delay;
    fn sleep(&self, delay: Duration) -> Self::Sleep {
        futures_timer::Delay::new(delay)
    }
}

impl<Fut: Future<Output = ()>, G: Fn(Duration) -> Fut> Sleeper for G {
    type Sleep = Fut;
    fn sleep(&self, delay: Duration) -> Fut {
        self(delay)
    }
}

/// The error a retry loop gives back: the last error itself, with the number of
/// attempts made and why the loop stopped.
#[derive(Debug)]
pub struct RetryError<E> {
    /// The error of the last attempt, unchanged.
    pub error: E,
    /// How many attempts were made.
    pub attempts: u32,
    /// Why no further attempt was made.
    pub reason: StopReason,
    /// The classification rule of the last error (SPEC §3): for
    /// [`StopReason::NotRetryable`], why it is not retried.
    pub rule: Rule,
}

impl<E> RetryError<E> {
    /// Why no further attempt was made (the field `reason`), under the name the
    /// bindings use: Python `exc.stop_reason`, Node `err.stopReason`.
    pub const fn stop_reason(&self) -> StopReason {
        self.reason
    }

    /// The last error, unchanged.
    pub fn into_inner(self) -> E {
        self.error
    }
}

impl<E: fmt::Display> fmt::Display for RetryError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "gave up after {} attempt{} ({}): {}",
            self.attempts,
            if self.attempts == 1 { "" } else { "s" },
            self.reason.explain(Some(self.rule)),
            self.error
        )
    }
}

impl<E: std::error::Error + 'static> std::error::Error for RetryError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

#[derive(Debug, Clone, Copy)]
enum DeadlineSpec {
    None,
    At(Deadline),
    After(Duration),
}

/// A retry loop being configured; `.await` it (async action) or [`call`](Retry::call)
/// it (blocking action). Made by [`retry`] or [`retry_blocking`].
#[must_use = "a Retry does nothing until it is awaited or called"]
pub struct Retry<F, S = TimerSleeper, H = NoHook> {
    action: F,
    policy: RetryPolicy,
    facts: CallFacts,
    deadline: DeadlineSpec,
    budget: Option<RetryBudget>,
    clock: Option<SharedClock>,
    sleeper: S,
    hook: H,
}

/// Retries an async `action` by `policy` (default: the SPEC defaults).
///
/// The action gets an [`Attempt`] and returns a future of `Result<T, E>` where `E`
/// says its code through [`Classify`]. Dropping the returned future cancels the loop at
/// once, during a sleep too. Works on any executor.
///
/// ```
/// use oncely::{retry, Code, RetryPolicy};
/// use std::sync::atomic::{AtomicU32, Ordering};
///
/// let calls = AtomicU32::new(0);
/// let result = futures::executor::block_on(async {
///     retry(|attempt| {
///         let n = calls.fetch_add(1, Ordering::SeqCst);
///         async move { if n < 2 { Err(Code::Unavailable) } else { Ok(attempt.number) } }
///     })
///     .policy(RetryPolicy::new().with_base_delay(std::time::Duration::ZERO))
///     .safe(true)
///     .await
/// });
/// assert_eq!(result.unwrap(), 3);
/// ```
pub fn retry<F, R>(action: F) -> Retry<F>
where
    F: FnMut(Attempt) -> R,
{
    Retry {
        action,
        policy: RetryPolicy::new(),
        facts: CallFacts::default(),
        deadline: DeadlineSpec::None,
        budget: None,
        clock: None,
        sleeper: TimerSleeper,
        hook: NoHook,
    }
}

/// Retries a blocking `action`, sleeping the thread between attempts; for
/// thread-per-request code only. Finish with [`Retry::call`].
///
/// ```
/// use oncely::{retry_blocking, Code, RetryPolicy, StopReason};
/// let err = retry_blocking(|_| Err::<(), _>(Code::InvalidArgument))
///     .policy(RetryPolicy::new())
///     .call()
///     .unwrap_err();
/// assert_eq!(err.reason, StopReason::NotRetryable);
/// assert_eq!(err.attempts, 1);
/// ```
pub fn retry_blocking<F, R>(action: F) -> Retry<F>
where
    F: FnMut(Attempt) -> R,
{
    retry(action)
}

impl<F, S, H> Retry<F, S, H> {
    /// The backoff policy.
    ///
    /// # Panics
    /// If `policy` does not pass [`RetryPolicy::validate`] (the message names the field).
    #[track_caller]
    pub fn policy(mut self, policy: RetryPolicy) -> Self {
        super::state::assert_valid(&policy);
        self.policy = policy;
        self
    }
    /// Whether resending is safe (idempotent, or carries an idempotency key).
    pub fn safe(mut self, safe: bool) -> Self {
        self.facts.safe = safe;
        self
    }
    /// Whether each attempt re-reads state before writing (makes `ABORTED` retryable).
    pub fn rereads(mut self, rereads: bool) -> Self {
        self.facts.rereads = rereads;
        self
    }
    /// All call facts at once.
    pub fn facts(mut self, facts: CallFacts) -> Self {
        self.facts = facts;
        self
    }
    /// A deadline for the whole call, all attempts and delays included.
    pub fn deadline(mut self, deadline: Deadline) -> Self {
        self.deadline = DeadlineSpec::At(deadline);
        self
    }
    /// A deadline `budget` after the loop starts.
    pub fn timeout(mut self, budget: Duration) -> Self {
        self.deadline = DeadlineSpec::After(budget);
        self
    }
    /// Shares a retry budget with other calls.
    pub fn budget(mut self, budget: &RetryBudget) -> Self {
        self.budget = Some(budget.clone());
        self
    }
    /// The clock deadlines are measured on (default: the system clock).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }
    /// A hook called before each retry.
    pub fn on_retry<H2>(self, hook: H2) -> Retry<F, S, H2> {
        Retry {
            action: self.action,
            policy: self.policy,
            facts: self.facts,
            deadline: self.deadline,
            budget: self.budget,
            clock: self.clock,
            sleeper: self.sleeper,
            hook,
        }
    }
    /// How to sleep between attempts (default: futures-timer).
    pub fn sleeper<S2>(self, sleeper: S2) -> Retry<F, S2, H> {
        Retry {
            action: self.action,
            policy: self.policy,
            facts: self.facts,
            deadline: self.deadline,
            budget: self.budget,
            clock: self.clock,
            sleeper,
            hook: self.hook,
        }
    }

    #[inline]
    fn start(&mut self) -> (RetryState, Option<SharedClock>) {
        // The default policy is valid and `policy()` validated any other.
        let mut state = RetryState::new_valid(self.policy).with_facts(self.facts);
        if let Some(budget) = self.budget.take() {
            state = state.with_budget(budget);
        }
        let clock = match self.deadline {
            DeadlineSpec::None => None,
            DeadlineSpec::At(d) => {
                state = state.with_deadline(d);
                Some(self.clock.take().unwrap_or_else(system_clock))
            }
            DeadlineSpec::After(budget) => {
                let clock = self.clock.take().unwrap_or_else(system_clock);
                state = state.with_deadline(Deadline::after(&*clock, budget));
                Some(clock)
            }
        };
        (state, clock)
    }
}

impl<F, T, E, H> Retry<F, TimerSleeper, H>
where
    F: FnMut(Attempt) -> Result<T, E>,
    E: Classify,
    H: OnRetry<E>,
{
    /// Runs the blocking loop on this thread.
    ///
    /// # Panics
    /// If the policy is invalid (see [`RetryState::new`]).
    pub fn call(mut self) -> Result<T, RetryError<E>> {
        let (mut state, clock) = self.start();
        loop {
            let attempt = Attempt {
                number: state.attempt(),
                remaining: clock.as_ref().and_then(|c| state.remaining_at(c.now())),
            };
            let error = match (self.action)(attempt) {
                Ok(v) => return Ok(v),
                Err(e) => e,
            };
            let failure = Failure::of(&error);
            let now = clock.as_ref().map_or(Duration::ZERO, |c| c.now());
            match state.on_failure(failure, now) {
                Decision::Stop(reason) => {
                    return Err(RetryError {
                        error,
                        attempts: state.attempt(),
                        reason,
                        rule: state.rule().unwrap_or(Rule::NotAnError),
                    })
                }
                Decision::Retry { delay, rule } => {
                    self.hook.on_retry(&RetryEvent {
                        attempt: state.attempt() - 1,
                        delay,
                        error: &error,
                        rule,
                        from_server: failure.server_delay.is_some(),
                    });
                    if !delay.is_zero() {
                        std::thread::sleep(delay);
                    }
                }
            }
        }
    }
}

pin_project! {
    /// The future of an async [`Retry`] loop.
    #[must_use = "futures do nothing unless polled"]
    pub struct RetryFuture<F, Fut, S: Sleeper, H> {
        action: F,
        sleeper: S,
        hook: H,
        machine: RetryState,
        clock: Option<SharedClock>,
        #[pin]
        step: Step<Fut, S::Sleep>,
    }
}

pin_project! {
    #[project = StepProj]
    enum Step<Fut, Sl> {
        Idle,
        Running { #[pin] fut: Fut },
        Sleeping { #[pin] sleep: Sl },
    }
}

impl<F, Fut, T, E, S, H> IntoFuture for Retry<F, S, H>
where
    F: FnMut(Attempt) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: Classify,
    S: Sleeper,
    H: OnRetry<E>,
{
    type Output = Result<T, RetryError<E>>;
    type IntoFuture = RetryFuture<F, Fut, S, H>;

    /// # Panics
    /// If the policy is invalid (see [`RetryState::new`]).
    #[inline]
    fn into_future(mut self) -> Self::IntoFuture {
        let (machine, clock) = self.start();
        RetryFuture {
            action: self.action,
            sleeper: self.sleeper,
            hook: self.hook,
            machine,
            clock,
            step: Step::Idle,
        }
    }
}

impl<F, Fut, T, E, S, H> Future for RetryFuture<F, Fut, S, H>
where
    F: FnMut(Attempt) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: Classify,
    S: Sleeper,
    H: OnRetry<E>,
{
    type Output = Result<T, RetryError<E>>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.step.as_mut().project() {
                StepProj::Idle => {
                    let attempt = Attempt {
                        number: this.machine.attempt(),
                        remaining: this
                            .clock
                            .as_ref()
                            .and_then(|c| this.machine.remaining_at(c.now())),
                    };
                    let fut = (this.action)(attempt);
                    this.step.set(Step::Running { fut });
                }
                StepProj::Running { fut } => {
                    let error = match ready!(fut.poll(cx)) {
                        Ok(v) => return Poll::Ready(Ok(v)),
                        Err(e) => e,
                    };
                    let failure = Failure::of(&error);
                    let now = this.clock.as_ref().map_or(Duration::ZERO, |c| c.now());
                    match this.machine.on_failure(failure, now) {
                        Decision::Stop(reason) => {
                            this.step.set(Step::Idle);
                            return Poll::Ready(Err(RetryError {
                                error,
                                attempts: this.machine.attempt(),
                                reason,
                                rule: this.machine.rule().unwrap_or(Rule::NotAnError),
                            }));
                        }
                        Decision::Retry { delay, rule } => {
                            this.hook.on_retry(&RetryEvent {
                                attempt: this.machine.attempt() - 1,
                                delay,
                                error: &error,
                                rule,
                                from_server: failure.server_delay.is_some(),
                            });
                            if delay.is_zero() {
                                this.step.set(Step::Idle);
                            } else {
                                let sleep = this.sleeper.sleep(delay);
                                this.step.set(Step::Sleeping { sleep });
                            }
                        }
                    }
                }
                StepProj::Sleeping { sleep } => {
                    ready!(sleep.poll(cx));
                    this.step.set(Step::Idle);
                }
            }
        }
    }
}

impl Classify for std::io::Error {
    /// Connection refused/reset/aborted and broken pipes are `UNAVAILABLE` (for a
    /// reset after sending, the outcome is unknown: retried only when safe); timeouts
    /// are `DEADLINE_EXCEEDED`; invalid input, not found and permission errors map to
    /// their codes; everything else is `UNKNOWN`.
    fn code(&self) -> crate::Code {
        use crate::Code;
        use std::io::ErrorKind as K;
        match self.kind() {
            K::ConnectionRefused
            | K::ConnectionReset
            | K::ConnectionAborted
            | K::NotConnected
            | K::BrokenPipe
            | K::UnexpectedEof
            | K::Interrupted
            | K::WouldBlock => Code::Unavailable,
            K::TimedOut => Code::DeadlineExceeded,
            K::InvalidInput | K::InvalidData => Code::InvalidArgument,
            K::NotFound => Code::NotFound,
            K::PermissionDenied => Code::PermissionDenied,
            K::AlreadyExists => Code::AlreadyExists,
            K::Unsupported => Code::Unimplemented,
            K::OutOfMemory => Code::ResourceExhausted,
            _ => Code::Unknown,
        }
    }
}
