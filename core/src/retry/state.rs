//! The sans-IO retry decision: one machine that the async loop, the blocking loop,
//! [`simulate`](crate::simulate) and the Python and Node bindings all drive.

use std::fmt;
use std::time::Duration;

use crate::backoff::RetryPolicy;
use crate::budget::RetryBudget;
use crate::classify::{classify_failure, CallFacts, Failure, Rule, ServerDelay};
use crate::clock::Deadline;
use crate::rand;

/// Why the retry loop stopped and gave back the last error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StopReason {
    /// The error may not be retried (SPEC §3).
    NotRetryable,
    /// `max_attempts` attempts were made.
    AttemptsExhausted,
    /// The deadline leaves no room for another attempt after the delay.
    Deadline,
    /// The retry budget is exhausted (retry storm protection).
    Budget,
    /// The server said not to retry (negative pushback).
    ServerSaidNo,
}

impl StopReason {
    /// The stable snake_case name (`"attempts_exhausted"`, …) used by every language.
    pub const fn as_str(self) -> &'static str {
        match self {
            StopReason::NotRetryable => "not_retryable",
            StopReason::AttemptsExhausted => "attempts_exhausted",
            StopReason::Deadline => "deadline",
            StopReason::Budget => "budget",
            StopReason::ServerSaidNo => "server_said_no",
        }
    }
}

impl StopReason {
    /// Why the loop stopped, in words: the stable name, then the cause. For
    /// [`StopReason::NotRetryable`], `rule` (the classification of the last error)
    /// says why that error is not retried.
    ///
    /// ```
    /// use oncely::{Rule, StopReason};
    /// let why = StopReason::NotRetryable.explain(Some(Rule::ConflictNeedsReread));
    /// assert!(why.starts_with("not_retryable: "));
    /// assert!(why.contains("conflict_needs_reread"));
    /// ```
    pub fn explain(self, rule: Option<Rule>) -> String {
        let why = match self {
            StopReason::NotRetryable => {
                return match rule {
                    Some(rule) => format!("not_retryable: {} (rule {rule})", rule.explain()),
                    None => "not_retryable".to_owned(),
                }
            }
            StopReason::AttemptsExhausted => "the policy's maximum number of attempts was made",
            StopReason::Deadline => {
                "the deadline leaves no room for another attempt after the delay"
            }
            StopReason::Budget => "the shared retry budget is exhausted (too many retries)",
            StopReason::ServerSaidNo => "the server asked not to retry",
        };
        format!("{}: {why}", self.as_str())
    }
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Sleep this long, then make the next attempt.
    Retry {
        /// The delay before the next attempt (zero means: at once, no timer).
        delay: Duration,
        /// The classification rule that allowed the retry.
        rule: Rule,
    },
    /// Give up and surface the last error.
    Stop(StopReason),
}

/// The state of one call's retries, without any I/O: feed it failures and the time,
/// it answers [`Decision::Retry`] or [`Decision::Stop`] by SPEC §4's four checks
/// (retryable; attempts left; the deadline leaves `min_attempt` after the delay; the
/// budget has room).
///
/// ```
/// use std::time::Duration;
/// use oncely::{CallFacts, Code, Decision, Failure, RetryPolicy, RetryState, StopReason};
///
/// let policy = RetryPolicy::new().with_seed(1).with_jitter(0.0);
/// let mut state = RetryState::new(policy).with_facts(CallFacts::SAFE);
/// let now = Duration::ZERO;
/// assert!(matches!(state.on_failure(Failure::new(Code::Unavailable), now),
///                  Decision::Retry { delay, .. } if delay == Duration::from_millis(20)));
/// assert_eq!(state.attempt(), 2);
/// assert!(matches!(state.on_failure(Failure::new(Code::Unavailable), now),
///                  Decision::Retry { delay, .. } if delay == Duration::from_millis(40)));
/// assert_eq!(state.on_failure(Failure::new(Code::Unavailable), now),
///            Decision::Stop(StopReason::AttemptsExhausted));
/// ```
#[derive(Debug, Clone)]
pub struct RetryState {
    policy: RetryPolicy,
    facts: CallFacts,
    deadline: Option<Deadline>,
    budget: Option<RetryBudget>,
    attempt: u32,
    seed: Option<u64>,
    rule: Option<Rule>,
}

impl RetryState {
    /// A call about to make its first attempt. Reads neither the clock nor the
    /// random generator.
    ///
    /// # Panics
    /// If `policy` does not pass [`RetryPolicy::validate`] (the message names the field).
    /// Bindings validate host input before they get here.
    pub fn new(policy: RetryPolicy) -> Self {
        assert_valid(&policy);
        Self::new_valid(policy)
    }

    /// [`new`](Self::new) for a policy already validated (the retry loops validate it
    /// once, when it is set, not on every call).
    #[inline]
    pub(crate) fn new_valid(policy: RetryPolicy) -> Self {
        RetryState {
            policy,
            facts: CallFacts::default(),
            deadline: None,
            budget: None,
            attempt: 1,
            seed: policy.seed(),
            rule: None,
        }
    }

    /// Sets whether the call is safe to resend, re-reads, or declares internal errors
    /// transient.
    #[inline]
    pub fn with_facts(mut self, facts: CallFacts) -> Self {
        self.facts = facts;
        self
    }

    /// Bounds the whole call by `deadline` (on the clock whose `now` is passed to
    /// [`on_failure`](Self::on_failure)).
    pub fn with_deadline(mut self, deadline: Deadline) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// Draws retries from `budget`, and counts this call as one request in it.
    pub fn with_budget(mut self, budget: RetryBudget) -> Self {
        budget.record_request();
        self.budget = Some(budget);
        self
    }

    /// The number of the attempt in progress (1 for the first).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The rule that classified the last failure (`None` before the first).
    pub fn rule(&self) -> Option<Rule> {
        self.rule
    }

    /// Why the loop stopped with `reason` after the last failure, in words (see
    /// [`StopReason::explain`]): what the bindings note on the error they give back.
    pub fn explain_stop(&self, reason: StopReason) -> String {
        reason.explain(self.rule)
    }

    /// The policy in force.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// The facts in force.
    pub fn facts(&self) -> CallFacts {
        self.facts
    }

    /// The deadline, if any.
    pub fn deadline(&self) -> Option<Deadline> {
        self.deadline
    }

    /// Time left before the deadline at clock time `now` (`None` without a deadline).
    pub fn remaining_at(&self, now: Duration) -> Option<Duration> {
        self.deadline.map(|d| d.remaining_at(now))
    }

    /// Decides what follows the failure of the current attempt at clock time `now`.
    /// On [`Decision::Retry`] the attempt counter moves on to the next attempt.
    pub fn on_failure(&mut self, failure: Failure, now: Duration) -> Decision {
        let class = classify_failure(failure, self.facts);
        self.rule = Some(class.rule);
        if !class.retryable {
            return Decision::Stop(StopReason::NotRetryable);
        }
        if failure.server_delay == Some(ServerDelay::DoNotRetry) {
            return Decision::Stop(StopReason::ServerSaidNo);
        }
        if self.attempt >= self.policy.max_attempts() {
            return Decision::Stop(StopReason::AttemptsExhausted);
        }
        let delay = match failure.server_delay {
            Some(ServerDelay::After(d)) => d,
            // A zero base gives a zero delay whatever the jitter: skip the draw.
            _ if self.policy.base_delay().is_zero() => Duration::ZERO,
            _ => {
                let seed = *self.seed.get_or_insert_with(rand::next_u64);
                self.policy.delay_with_seed(self.attempt, seed)
            }
        };
        if let Some(deadline) = self.deadline {
            // Compared as instants, not against the time left: that saturates at zero,
            // and would let a zero delay start an attempt after an overrun deadline.
            let next_ends = now
                .saturating_add(delay)
                .saturating_add(self.policy.min_attempt());
            if next_ends > deadline.instant() {
                return Decision::Stop(StopReason::Deadline);
            }
        }
        if let Some(budget) = &self.budget {
            if !budget.try_withdraw() {
                return Decision::Stop(StopReason::Budget);
            }
        }
        self.attempt += 1;
        Decision::Retry {
            delay,
            rule: class.rule,
        }
    }
}

/// Panics with the field's name if `policy` is invalid.
#[track_caller]
pub(crate) fn assert_valid(policy: &RetryPolicy) {
    if let Err(e) = policy.validate() {
        panic!("oncely: invalid RetryPolicy: {e}");
    }
}
