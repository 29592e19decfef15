//! Running the retry decisions against a script, on a simulated clock, without sleeping.

use std::time::Duration;

use super::state::{Decision, RetryState, StopReason};
use crate::backoff::RetryPolicy;
use crate::budget::RetryBudget;
use crate::classify::{CallFacts, Failure};
use crate::clock::Deadline;

/// One scripted attempt: how it ends and how long it takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scripted {
    /// `Ok(())` for success, or the failure.
    pub outcome: Result<(), Failure>,
    /// Simulated time the attempt takes.
    pub takes: Duration,
}

impl Scripted {
    /// An attempt that succeeds instantly.
    pub const fn ok() -> Self {
        Scripted {
            outcome: Ok(()),
            takes: Duration::ZERO,
        }
    }
    /// An attempt that fails instantly.
    pub const fn fail(failure: Failure) -> Self {
        Scripted {
            outcome: Err(failure),
            takes: Duration::ZERO,
        }
    }
    /// Sets how long the attempt takes.
    pub const fn taking(mut self, d: Duration) -> Self {
        self.takes = d;
        self
    }
}

/// One attempt in a [`Timeline`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// The attempt number (1-based).
    pub attempt: u32,
    /// Simulated time the attempt started, from the start of the call.
    pub started: Duration,
    /// How the attempt ended.
    pub outcome: Result<(), Failure>,
    /// What the loop decided after a failure (`None` after a success).
    pub decision: Option<Decision>,
}

/// The whole history of a simulated call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Timeline {
    /// Every attempt made, in order.
    pub steps: Vec<Step>,
    /// `Ok(())` if an attempt succeeded, else why the loop stopped.
    pub result: Result<(), StopReason>,
    /// Simulated time from the start to the end of the last attempt.
    pub elapsed: Duration,
}

impl Timeline {
    /// Number of attempts made.
    pub fn attempts(&self) -> u32 {
        self.steps.len() as u32
    }
    /// The delays slept between attempts.
    pub fn delays(&self) -> Vec<Duration> {
        self.steps
            .iter()
            .filter_map(|s| match s.decision {
                Some(Decision::Retry { delay, .. }) => Some(delay),
                _ => None,
            })
            .collect()
    }
}

/// A simulated call: policy, call facts, an optional deadline and budget.
///
/// ```
/// use std::time::Duration;
/// use oncely::{Code, Failure, RetryPolicy, Scripted, Simulation, StopReason};
///
/// let timeline = Simulation::new(RetryPolicy::new().with_seed(42).with_max_attempts(5))
///     .safe(true)
///     .deadline(Duration::from_millis(200))
///     .run(&[Scripted::fail(Failure::new(Code::Unavailable)).taking(Duration::from_millis(30))]);
/// assert_eq!(timeline.result, Err(StopReason::Deadline));
/// ```
#[derive(Debug, Clone)]
pub struct Simulation {
    policy: RetryPolicy,
    facts: CallFacts,
    deadline: Option<Duration>,
    budget: Option<RetryBudget>,
}

impl Simulation {
    /// A simulation of `policy` for a call that is not marked safe.
    pub fn new(policy: RetryPolicy) -> Self {
        Simulation {
            policy,
            facts: CallFacts::default(),
            deadline: None,
            budget: None,
        }
    }
    /// Marks the call safe to resend.
    pub fn safe(mut self, safe: bool) -> Self {
        self.facts.safe = safe;
        self
    }
    /// Sets all call facts.
    pub fn facts(mut self, facts: CallFacts) -> Self {
        self.facts = facts;
        self
    }
    /// A deadline this long after the start of the call.
    pub fn deadline(mut self, budget: Duration) -> Self {
        self.deadline = Some(budget);
        self
    }
    /// Draws retries from `budget`.
    pub fn budget(mut self, budget: &RetryBudget) -> Self {
        self.budget = Some(budget.clone());
        self
    }

    /// Runs the script: attempt `i` gets `script[i]`; when the script runs out, its
    /// last entry repeats. An empty script is one successful attempt.
    ///
    /// # Panics
    /// If the policy is invalid (see [`RetryState::new`]).
    pub fn run(&self, script: &[Scripted]) -> Timeline {
        let mut state = RetryState::new(self.policy).with_facts(self.facts);
        if let Some(b) = &self.budget {
            state = state.with_budget(b.clone());
        }
        if let Some(d) = self.deadline {
            state = state.with_deadline(Deadline::at(d));
        }
        let mut now = Duration::ZERO;
        let mut steps = Vec::new();
        loop {
            let i = steps.len().min(script.len().saturating_sub(1));
            let entry = script.get(i).copied().unwrap_or_else(Scripted::ok);
            let started = now;
            now = now.saturating_add(entry.takes);
            let mut step = Step {
                attempt: state.attempt(),
                started,
                outcome: entry.outcome,
                decision: None,
            };
            let failure = match entry.outcome {
                Ok(()) => {
                    steps.push(step);
                    return Timeline {
                        steps,
                        result: Ok(()),
                        elapsed: now,
                    };
                }
                Err(f) => f,
            };
            let decision = state.on_failure(failure, now);
            step.decision = Some(decision);
            steps.push(step);
            match decision {
                Decision::Stop(reason) => {
                    return Timeline {
                        steps,
                        result: Err(reason),
                        elapsed: now,
                    }
                }
                Decision::Retry { delay, .. } => now = now.saturating_add(delay),
            }
        }
    }
}

/// Simulates `policy` on a safe call against `script` (see [`Simulation::run`]).
///
/// ```
/// use oncely::{simulate, Code, Failure, RetryPolicy, Scripted};
/// let t = simulate(&RetryPolicy::new().with_seed(1), &[
///     Scripted::fail(Failure::new(Code::Unavailable)),
///     Scripted::ok(),
/// ]);
/// assert_eq!(t.attempts(), 2);
/// assert!(t.result.is_ok());
/// ```
pub fn simulate(policy: &RetryPolicy, script: &[Scripted]) -> Timeline {
    Simulation::new(*policy).safe(true).run(script)
}
