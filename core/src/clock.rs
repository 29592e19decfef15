//! Time, injected: a monotonic [`Clock`], a manual one for tests, and [`Deadline`].

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// A monotonic clock: the time elapsed since an arbitrary, fixed origin.
///
/// Everything in oncely that reads time takes it from a `Clock`, so tests can drive
/// time by hand with [`ManualClock`].
pub trait Clock: Send + Sync + 'static {
    /// The current time since the clock's origin.
    fn now(&self) -> Duration;
}

/// The process's monotonic clock ([`Instant`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

fn origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

impl Clock for SystemClock {
    #[inline]
    fn now(&self) -> Duration {
        origin().elapsed()
    }
}

/// A clock that moves only when told to. Clones share one time.
///
/// ```
/// use std::time::Duration;
/// use oncely::{Clock, ManualClock};
/// let clock = ManualClock::new();
/// clock.advance(Duration::from_millis(1500));
/// assert_eq!(clock.now(), Duration::from_millis(1500));
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    nanos: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock at time zero.
    pub fn new() -> Self {
        Self::default()
    }
    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        let _ = self
            .nanos
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                Some(n.saturating_add(by))
            });
    }
    /// Sets the clock to `to` (it may go backwards; tests of clock skew use that).
    pub fn set(&self, to: Duration) {
        self.nanos.store(
            u64::try_from(to.as_nanos()).unwrap_or(u64::MAX),
            Ordering::SeqCst,
        );
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::SeqCst))
    }
}

/// A shared clock handle, as stored by long-lived objects (stores, budgets).
pub type SharedClock = Arc<dyn Clock>;

pub(crate) fn system_clock() -> SharedClock {
    static SYSTEM: OnceLock<SharedClock> = OnceLock::new();
    SYSTEM.get_or_init(|| Arc::new(SystemClock)).clone()
}

/// The clock of the dedup stores: monotonic, read where the OS offers a cheap coarse
/// reading (Linux `CLOCK_MONOTONIC_COARSE`: about 5 ns instead of about 25 ns, a few
/// ms of resolution, plenty for TTLs of hours); the system clock elsewhere.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CoarseClock;

#[cfg(any(target_os = "linux", target_os = "android"))]
impl Clock for CoarseClock {
    #[inline]
    fn now(&self) -> Duration {
        use rustix::time::{clock_gettime, ClockId};
        let t = clock_gettime(ClockId::MonotonicCoarse);
        Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
    }
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
impl Clock for CoarseClock {
    #[inline]
    fn now(&self) -> Duration {
        SystemClock.now()
    }
}

pub(crate) fn coarse_clock() -> SharedClock {
    static COARSE: OnceLock<SharedClock> = OnceLock::new();
    COARSE.get_or_init(|| Arc::new(CoarseClock)).clone()
}

/// The point in time by which a whole call (all its attempts) must finish.
///
/// A deadline is a time on some [`Clock`]; it does not hold the clock itself, so it is
/// `Copy` and can be compared against any reading of the same clock.
///
/// ```
/// use std::time::Duration;
/// use oncely::{Deadline, ManualClock, Clock};
/// let clock = ManualClock::new();
/// let deadline = Deadline::after(&clock, Duration::from_secs(2));
/// clock.advance(Duration::from_millis(500));
/// assert_eq!(deadline.remaining(&clock), Duration::from_millis(1500));
/// assert!(!deadline.is_expired(&clock));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Deadline {
    at: Duration,
}

impl Deadline {
    /// The deadline at time `at` of a clock.
    pub const fn at(at: Duration) -> Self {
        Deadline { at }
    }
    /// `budget` from now on `clock`.
    pub fn after(clock: &dyn Clock, budget: Duration) -> Self {
        Deadline {
            at: clock.now().saturating_add(budget),
        }
    }
    /// `budget` from now on the system clock.
    pub fn from_now(budget: Duration) -> Self {
        Self::after(&SystemClock, budget)
    }
    /// The clock time of the deadline.
    pub const fn instant(&self) -> Duration {
        self.at
    }
    /// Time left at clock time `now` (zero once passed).
    pub fn remaining_at(&self, now: Duration) -> Duration {
        self.at.saturating_sub(now)
    }
    /// Time left on `clock`.
    pub fn remaining(&self, clock: &dyn Clock) -> Duration {
        self.remaining_at(clock.now())
    }
    /// Whether the deadline has passed on `clock`.
    pub fn is_expired(&self, clock: &dyn Clock) -> bool {
        self.remaining(clock).is_zero()
    }
}

impl fmt::Debug for Deadline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Deadline").field("at", &self.at).finish()
    }
}
