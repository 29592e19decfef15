//! Exponential, capped, jittered backoff (SPEC §2).

use std::time::Duration;

use crate::error::Error;
use crate::naming::Naming;
use crate::rand;

/// How often and how patiently to retry.
///
/// Defaults (SPEC §2): 3 attempts in total, 20 ms base delay, ×2 per attempt, 1 s cap,
/// ±20 % jitter, at least 50 ms left for an attempt after a delay.
///
/// ```
/// use std::time::Duration;
/// use oncely::RetryPolicy;
///
/// let policy = RetryPolicy::new().with_max_attempts(5).with_seed(7);
/// policy.validate().unwrap();
/// // Seeded: the same delays in Rust, Python and Node.
/// let delays: Vec<Duration> = policy.backoff().collect();
/// assert_eq!(delays.len(), 4);
/// assert_eq!(delays, policy.backoff().collect::<Vec<_>>());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    max_attempts: u32,
    base_delay: Duration,
    max_delay: Duration,
    multiplier: f64,
    jitter: f64,
    seed: Option<u64>,
    min_attempt: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl RetryPolicy {
    /// The SPEC defaults: 3 attempts, 20 ms, 1 s cap, ×2, jitter 0.2, min_attempt 50 ms.
    pub const fn new() -> Self {
        RetryPolicy {
            max_attempts: 3,
            base_delay: Duration::from_millis(20),
            max_delay: Duration::from_secs(1),
            multiplier: 2.0,
            jitter: 0.2,
            seed: None,
            min_attempt: Duration::from_millis(50),
        }
    }

    /// Total attempts, the first included (≥ 1).
    pub const fn with_max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n;
        self
    }
    /// Delay after the first failure, before jitter.
    pub const fn with_base_delay(mut self, d: Duration) -> Self {
        self.base_delay = d;
        self
    }
    /// Cap on the delay before jitter.
    pub const fn with_max_delay(mut self, d: Duration) -> Self {
        self.max_delay = d;
        self
    }
    /// Growth factor per attempt (≥ 1, finite).
    pub const fn with_multiplier(mut self, m: f64) -> Self {
        self.multiplier = m;
        self
    }
    /// Relative jitter, in `[0, 1)`: a delay is scaled by `1 + u`, `u ∈ [−jitter, +jitter)`.
    pub const fn with_jitter(mut self, j: f64) -> Self {
        self.jitter = j;
        self
    }
    /// Makes the jitter deterministic: the same seed gives the same delays everywhere.
    ///
    /// For tests and reproducible runs. Clients that share one seed retry in lockstep,
    /// which is what jitter exists to prevent: give each client its own seed, or none.
    pub const fn with_seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }
    /// Back to OS-seeded jitter.
    pub const fn without_seed(mut self) -> Self {
        self.seed = None;
        self
    }
    /// Time an attempt needs at least: a retry whose delay would leave less than this
    /// before the deadline is not started.
    pub const fn with_min_attempt(mut self, d: Duration) -> Self {
        self.min_attempt = d;
        self
    }

    /// Total attempts, the first included.
    pub const fn max_attempts(&self) -> u32 {
        self.max_attempts
    }
    /// Delay after the first failure, before jitter.
    pub const fn base_delay(&self) -> Duration {
        self.base_delay
    }
    /// Cap on the delay before jitter.
    pub const fn max_delay(&self) -> Duration {
        self.max_delay
    }
    /// Growth factor per attempt.
    pub const fn multiplier(&self) -> f64 {
        self.multiplier
    }
    /// Relative jitter.
    pub const fn jitter(&self) -> f64 {
        self.jitter
    }
    /// The jitter seed, if the policy is deterministic.
    pub const fn seed(&self) -> Option<u64> {
        self.seed
    }
    /// Time an attempt needs at least before the deadline.
    pub const fn min_attempt(&self) -> Duration {
        self.min_attempt
    }

    /// Checks every field; the error names the first one that is out of range.
    ///
    /// ```
    /// use oncely::RetryPolicy;
    /// let err = RetryPolicy::new().with_jitter(1.5).validate().unwrap_err();
    /// assert!(err.to_string().contains("jitter"));
    /// ```
    pub fn validate(&self) -> Result<(), Error> {
        self.validate_named(&Naming::RUST)
    }

    /// [`validate`](Self::validate), the error naming the field and its durations as
    /// the caller does (a binding's option names and unit).
    ///
    /// ```
    /// use std::time::Duration;
    /// use oncely::{Naming, RetryPolicy};
    /// let p = RetryPolicy::new().with_base_delay(Duration::from_secs(2)).with_max_delay(Duration::from_secs(1));
    /// let err = p.validate_named(&Naming::SECONDS).unwrap_err();
    /// assert_eq!(err.to_string(), "invalid base_delay: must not exceed max_delay (1 (seconds)), got 2");
    /// ```
    pub fn validate_named(&self, naming: &Naming) -> Result<(), Error> {
        if self.max_attempts < 1 {
            return Err(Error::invalid(
                naming.field("max_attempts"),
                format!(
                    "must be at least 1 (it counts the first attempt), e.g. 3, got {}",
                    self.max_attempts
                ),
            ));
        }
        if !(self.jitter.is_finite() && (0.0..1.0).contains(&self.jitter)) {
            return Err(Error::invalid(
                naming.field("jitter"),
                format!("must be in [0, 1), e.g. 0.2, got {}", self.jitter),
            ));
        }
        if !(self.multiplier.is_finite() && self.multiplier >= 1.0) {
            return Err(Error::invalid(
                naming.field("multiplier"),
                format!(
                    "must be finite and at least 1, e.g. 2, got {}",
                    self.multiplier
                ),
            ));
        }
        if self.base_delay > self.max_delay {
            return Err(Error::invalid(
                naming.field("base_delay"),
                format!(
                    "must not exceed {} ({}), got {}",
                    naming.field("max_delay"),
                    naming.duration(self.max_delay),
                    naming.value(self.base_delay)
                ),
            ));
        }
        Ok(())
    }

    /// The delay after the `failed_attempt`-th failure (1-based; 0 is taken as 1).
    ///
    /// Seeded policies give a fixed value for each attempt number; unseeded ones draw
    /// fresh jitter from an OS-seeded generator on each call.
    pub fn delay_after(&self, failed_attempt: u32) -> Duration {
        let seed = match self.seed {
            Some(s) => s,
            None => rand::next_u64(),
        };
        self.delay_with_seed(failed_attempt, seed)
    }

    /// The delay after the `failed_attempt`-th failure with jitter drawn from `seed`.
    ///
    /// The formula (SPEC §2), in milliseconds as `f64`:
    ///
    /// ```text
    /// capped = min(base × multiplier^(n−1), max)        (0 when base is 0)
    /// delay  = max(floor(capped × (1 + u) + 0.5), 0)    u = jitter × (2·unit(seed, n) − 1)
    /// ```
    ///
    /// `unit(seed, n)` is the SplitMix64 finalizer applied to
    /// `seed + n × 0x9E3779B97F4A7C15` (wrapping), its top 53 bits scaled to `[0, 1)`.
    /// An exponent that overflows saturates at `max`; the result is whole milliseconds.
    pub fn delay_with_seed(&self, failed_attempt: u32, seed: u64) -> Duration {
        let n = failed_attempt.max(1);
        let base_ms = millis_f64(self.base_delay);
        let max_ms = millis_f64(self.max_delay);
        let capped = if base_ms == 0.0 {
            0.0
        } else {
            // multiplier^(n−1), exactly as `powf` gives it, without calling it in
            // the common cases: the first retry, and the default multiplier 2.
            let k = n - 1;
            let growth = if k == 0 {
                1.0
            } else if self.multiplier == 2.0 && k < 1023 {
                f64::from_bits((1023 + u64::from(k)) << 52)
            } else {
                self.multiplier.powf(f64::from(k))
            };
            let raw = base_ms * growth;
            if raw.is_nan() {
                max_ms
            } else {
                raw.min(max_ms)
            }
        };
        let u = if self.jitter == 0.0 {
            0.0
        } else {
            self.jitter * (2.0 * rand::unit(seed, n) - 1.0)
        };
        let ms = (capped * (1.0 + u) + 0.5).floor();
        if ms.is_nan() || ms <= 0.0 {
            Duration::ZERO
        } else if ms >= u64::MAX as f64 {
            Duration::from_millis(u64::MAX)
        } else {
            Duration::from_millis(ms as u64)
        }
    }

    /// The delays between attempts, `max_attempts − 1` of them, as an iterator. The
    /// jitter seed is the policy's, or one drawn from the OS for this iterator.
    pub fn backoff(&self) -> Backoff {
        Backoff {
            policy: *self,
            seed: self.seed.unwrap_or_else(rand::next_u64),
            next: 1,
        }
    }
}

/// The delays of one retry sequence; see [`RetryPolicy::backoff`].
#[derive(Debug, Clone)]
pub struct Backoff {
    policy: RetryPolicy,
    seed: u64,
    next: u32,
}

impl Iterator for Backoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        if self.next >= self.policy.max_attempts {
            return None;
        }
        let d = self.policy.delay_with_seed(self.next, self.seed);
        self.next += 1;
        Some(d)
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.policy.max_attempts.saturating_sub(self.next) as usize;
        (left, Some(left))
    }
}

impl ExactSizeIterator for Backoff {}

fn millis_f64(d: Duration) -> f64 {
    d.as_secs() as f64 * 1000.0 + f64::from(d.subsec_nanos()) / 1_000_000.0
}

/// Converts seconds given as `f64` by a host language into a [`Duration`], rejecting
/// NaN, infinities and negative values with an error naming `field`.
///
/// ```
/// use oncely::duration_from_secs_f64;
/// assert_eq!(duration_from_secs_f64("base_delay", 0.02).unwrap().as_millis(), 20);
/// assert!(duration_from_secs_f64("base_delay", f64::NAN).is_err());
/// ```
pub fn duration_from_secs_f64(field: &'static str, secs: f64) -> Result<Duration, Error> {
    if !secs.is_finite() || secs < 0.0 {
        return Err(Error::invalid(
            field,
            format!("must be a finite, non-negative number of seconds, got {secs}"),
        ));
    }
    Duration::try_from_secs_f64(secs)
        .map_err(|_| Error::invalid(field, format!("{secs} seconds is too large")))
}

/// Like [`duration_from_secs_f64`], for milliseconds.
pub fn duration_from_millis_f64(field: &'static str, ms: f64) -> Result<Duration, Error> {
    if !ms.is_finite() || ms < 0.0 {
        return Err(Error::invalid(
            field,
            format!("must be a finite, non-negative number of milliseconds, got {ms}"),
        ));
    }
    Duration::try_from_secs_f64(ms / 1000.0)
        .map_err(|_| Error::invalid(field, format!("{ms} milliseconds is too large")))
}
