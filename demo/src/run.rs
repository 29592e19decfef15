//! One run per strategy.

use super::*;

pub(crate) struct Report {
    pub(crate) outcomes: Vec<Outcome>,
    pub(crate) delays: DelayLog,
    pub(crate) service: Arc<Service>,
    pub(crate) elapsed: Duration,
    /// With --redis, the oncely column's Redis counters
    /// (claims/leads/takeovers/replays/remote waits), summed over the workers.
    pub(crate) redis_counts: Option<String>,
}

impl Report {
    pub(crate) fn attempts(&self) -> u64 {
        self.outcomes.iter().map(|o| u64::from(o.attempts)).sum()
    }
    pub(crate) fn succeeded(&self) -> usize {
        self.outcomes.iter().filter(|o| o.stopped.is_none()).count()
    }
    pub(crate) fn stopped(&self, reason: StopReason) -> usize {
        self.outcomes
            .iter()
            .filter(|o| o.stopped == Some(reason))
            .count()
    }
    pub(crate) fn applied_once(&self) -> usize {
        self.ledger().filter(|&n| n == 1).count()
    }
    pub(crate) fn lost(&self) -> usize {
        self.ledger().filter(|&n| n == 0).count()
    }
    pub(crate) fn duplicates(&self) -> u64 {
        self.ledger().map(|n| u64::from(n.saturating_sub(1))).sum()
    }
    pub(crate) fn ledger(&self) -> impl Iterator<Item = u32> + '_ {
        self.service
            .ledger
            .iter()
            .map(|n| n.load(Ordering::Relaxed))
    }
}

/// The SPEC defaults (20 ms base, x2, ±20 % jitter) with more attempts and a lower
/// cap, so a demo with a high fault rate still finishes in a second or two.
pub(crate) fn retry_policy(cfg: &Config) -> RetryPolicy {
    RetryPolicy::new()
        .with_max_attempts(cfg.attempts)
        .with_max_delay(Duration::from_millis(250))
}

pub(crate) async fn run(
    cfg: &Config,
    seed: u64,
    strategy: Strategy,
    fleet: Option<Arc<Fleet>>,
) -> Report {
    let (service, target) = match fleet {
        Some(fleet) => (fleet.service.clone(), Target::Fleet(fleet)),
        None => {
            let service = Arc::new(Service::new(cfg, seed));
            (service.clone(), Target::Local(service))
        }
    };
    let delays = Arc::new(Mutex::new(DelayLog::default()));
    let base = retry_policy(cfg);
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for order in 0..cfg.clients {
        // Seeded run: seeded jitter, different per client (one seed for all clients
        // would make them retry in lockstep, which jitter exists to prevent).
        let policy = match cfg.seed {
            Some(s) => base.with_seed(splitmix64(s ^ splitmix64(u64::from(order)))),
            None => base,
        };
        tasks.spawn(client(
            target.clone(),
            strategy,
            order,
            policy,
            delays.clone(),
        ));
    }
    let mut outcomes = Vec::with_capacity(cfg.clients as usize);
    while let Some(joined) = tasks.join_next().await {
        outcomes.push(joined.expect("a client task panicked"));
    }
    let elapsed = started.elapsed();
    let delays = std::mem::take(&mut *delays.lock().unwrap());
    Report {
        outcomes,
        delays,
        service,
        elapsed,
        redis_counts: None,
    }
}
