//! The retry budget against retry storms (SPEC §4).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::clock::{system_clock, SharedClock};
use crate::error::Error;
use crate::naming::Naming;

const SLOTS: usize = 10;
/// Requests are counted with one atomic add; every this-many the count is moved into
/// the time window, so the clock is read once per batch, not once per request.
const FLUSH_EVERY: u64 = 64;

/// Caps retries across calls: a retry is allowed while
/// `retries + 1 ≤ ratio × requests + min_per_sec × window` over a sliding window.
///
/// Share one budget (it is a cheap `Clone`) between all calls of a client. Recording a
/// request is one atomic add; only retries take a lock.
///
/// ```
/// use std::time::Duration;
/// use oncely::{ManualClock, RetryBudget};
/// let clock = ManualClock::new();
/// // 10 % of requests, 10 s window, no floor.
/// let budget = RetryBudget::new(0.1, Duration::from_secs(10), 0).unwrap().with_clock(clock.clone());
/// for _ in 0..20 { budget.record_request(); }
/// assert!(budget.try_withdraw());
/// assert!(budget.try_withdraw());
/// assert!(!budget.try_withdraw()); // 2 retries = 10 % of 20 requests
/// ```
#[derive(Clone)]
pub struct RetryBudget {
    inner: Arc<Inner>,
}

struct Inner {
    ratio: f64,
    window: Duration,
    min_per_sec: u32,
    slot_nanos: u64,
    clock: SharedClock,
    pending: AtomicU64,
    slots: Mutex<[Slot; SLOTS]>,
}

#[derive(Clone, Copy, Default)]
struct Slot {
    tick: u64,
    requests: u64,
    retries: u64,
}

/// What a [`RetryBudget`] holds in its window right now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BudgetSnapshot {
    /// Requests recorded in the window.
    pub requests: u64,
    /// Retries withdrawn in the window.
    pub retries: u64,
    /// Retries the window allows in total (`ratio × requests + floor`).
    pub allowed: f64,
}

impl RetryBudget {
    /// A budget allowing `ratio` retries per request over `window`, plus
    /// `min_per_sec × window` retries regardless (the floor for quiet clients).
    /// Defaults (SPEC §4): `0.1`, 10 s, 10.
    pub fn new(ratio: f64, window: Duration, min_per_sec: u32) -> Result<Self, Error> {
        Self::new_named(ratio, window, min_per_sec, &Naming::RUST)
    }

    /// [`new`](Self::new), an error naming the setting and its durations as the
    /// caller does (a binding's option names and unit).
    pub fn new_named(
        ratio: f64,
        window: Duration,
        min_per_sec: u32,
        naming: &Naming,
    ) -> Result<Self, Error> {
        if !ratio.is_finite() || ratio < 0.0 {
            return Err(Error::invalid(
                naming.field("ratio"),
                format!("must be a finite number ≥ 0, e.g. 0.1, got {ratio}"),
            ));
        }
        let least = Duration::from_millis(SLOTS as u64);
        if window < least {
            return Err(Error::invalid(
                naming.field("window"),
                format!(
                    "must be at least {}, e.g. {}, got {}",
                    naming.duration(least),
                    naming.value(Duration::from_secs(10)),
                    naming.value(window)
                ),
            ));
        }
        let slot_nanos = u64::try_from(window.as_nanos() / SLOTS as u128).unwrap_or(u64::MAX);
        Ok(RetryBudget {
            inner: Arc::new(Inner {
                ratio,
                window,
                min_per_sec,
                slot_nanos,
                clock: system_clock(),
                pending: AtomicU64::new(0),
                slots: Mutex::new([Slot::default(); SLOTS]),
            }),
        })
    }

    /// Reads time from `clock` instead of the system clock (for tests). Call it before
    /// sharing the budget.
    pub fn with_clock(self, clock: impl crate::Clock) -> Self {
        let i = &self.inner;
        RetryBudget {
            inner: Arc::new(Inner {
                ratio: i.ratio,
                window: i.window,
                min_per_sec: i.min_per_sec,
                slot_nanos: i.slot_nanos,
                clock: Arc::new(clock),
                pending: AtomicU64::new(i.pending.load(Ordering::Relaxed)),
                slots: Mutex::new(*lock(&i.slots)),
            }),
        }
    }

    /// The ratio of retries to requests.
    pub fn ratio(&self) -> f64 {
        self.inner.ratio
    }
    /// The sliding window.
    pub fn window(&self) -> Duration {
        self.inner.window
    }
    /// The floor, in retries per second of window.
    pub fn min_per_sec(&self) -> u32 {
        self.inner.min_per_sec
    }

    /// Counts one call (not one attempt). Cheap: an atomic add, and a clock read once
    /// every 64 calls.
    #[inline]
    pub fn record_request(&self) {
        let n = self.inner.pending.fetch_add(1, Ordering::Relaxed) + 1;
        if n >= FLUSH_EVERY {
            let now = self.inner.clock.now();
            self.inner.locked(now, |_| ());
        }
    }

    /// Takes one retry from the budget if it has room; `false` means the retry must not
    /// happen.
    pub fn try_withdraw(&self) -> bool {
        self.try_withdraw_at(self.inner.clock.now())
    }

    /// [`try_withdraw`](Self::try_withdraw) at clock time `now` (for sans-IO callers).
    pub fn try_withdraw_at(&self, now: Duration) -> bool {
        let inner = &self.inner;
        inner.locked(now, |w| {
            let (requests, retries) = w.totals();
            if (retries + 1) as f64 <= inner.allowed(requests) {
                w.current().retries += 1;
                true
            } else {
                false
            }
        })
    }

    /// The window's counts at this moment.
    pub fn snapshot(&self) -> BudgetSnapshot {
        let inner = &self.inner;
        inner.locked(inner.clock.now(), |w| {
            let (requests, retries) = w.totals();
            BudgetSnapshot {
                requests,
                retries,
                allowed: inner.allowed(requests),
            }
        })
    }
}

struct Window<'a> {
    slots: &'a mut [Slot; SLOTS],
    tick: u64,
}

impl Window<'_> {
    fn current(&mut self) -> &mut Slot {
        &mut self.slots[(self.tick % SLOTS as u64) as usize]
    }
    fn totals(&self) -> (u64, u64) {
        let oldest = self.tick.saturating_sub(SLOTS as u64 - 1);
        self.slots
            .iter()
            .filter(|s| s.tick >= oldest && s.tick <= self.tick)
            .fold((0, 0), |(q, r), s| (q + s.requests, r + s.retries))
    }
}

impl Inner {
    fn allowed(&self, requests: u64) -> f64 {
        self.ratio * requests as f64 + f64::from(self.min_per_sec) * self.window.as_secs_f64()
    }

    /// Rotates the window to `now`, moves pending requests into it, then runs `f`.
    fn locked<T>(&self, now: Duration, f: impl FnOnce(&mut Window<'_>) -> T) -> T {
        let mut slots = lock(&self.slots);
        let tick = u64::try_from(now.as_nanos()).unwrap_or(u64::MAX) / self.slot_nanos;
        let mut w = Window {
            slots: &mut slots,
            tick,
        };
        let cur = w.current();
        if cur.tick != tick {
            *cur = Slot {
                tick,
                requests: 0,
                retries: 0,
            };
        }
        cur.requests += self.pending.swap(0, Ordering::Relaxed);
        f(&mut w)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // No user code runs under this lock, so a poisoned lock still holds valid counts.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Default for RetryBudget {
    /// 10 % of requests over 10 s, floor 10 retries per second.
    fn default() -> Self {
        RetryBudget::new(0.1, Duration::from_secs(10), 10).expect("defaults are valid")
    }
}

impl fmt::Debug for RetryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryBudget")
            .field("ratio", &self.inner.ratio)
            .field("window", &self.inner.window)
            .field("min_per_sec", &self.inner.min_per_sec)
            .finish()
    }
}
