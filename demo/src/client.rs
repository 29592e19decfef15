//! The clients.

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Strategy {
    AtMostOnce,
    AtLeastOnce,
    Oncely,
}

/// What one client saw.
pub(crate) struct Outcome {
    pub(crate) attempts: u32,
    /// `None` if the client got its receipt.
    pub(crate) stopped: Option<StopReason>,
}

/// The delays the retry loops waited before retries, as seen by `on_retry`.
#[derive(Default)]
pub(crate) struct DelayLog {
    pub(crate) backoff: Vec<Duration>,
    pub(crate) pushback: Vec<Duration>,
}

impl DelayLog {
    pub(crate) fn record(&mut self, event: &RetryEvent<'_, Failure>) {
        if event.error.server_delay.is_some() {
            self.pushback.push(event.delay);
        } else {
            self.backoff.push(event.delay);
        }
    }
}

pub(crate) async fn client(
    target: Target,
    strategy: Strategy,
    order: u32,
    policy: RetryPolicy,
    delays: Arc<Mutex<DelayLog>>,
) -> Outcome {
    // The key is made ONCE per intent, before the first attempt, and every retry
    // reuses it: a new key would be a new operation.
    let key = (strategy == Strategy::Oncely).then(IdempotencyKey::random);
    let policy = match strategy {
        Strategy::AtMostOnce => policy.with_max_attempts(1), // no retry
        Strategy::AtLeastOnce | Strategy::Oncely => policy,
    };
    let mut attempts = 0;
    let result = retry(|attempt| {
        attempts = attempt.number;
        let request = Request {
            order,
            qty: 1,
            attempt: attempt.number,
            key: key.clone(),
        };
        let target = target.clone();
        async move { target.call(request).await }
    })
    .policy(policy)
    // oncely: the call carries an idempotency key, so resending after UNAVAILABLE
    // (outcome unknown) is safe. at-least-once claims the same WITHOUT a key: that
    // claim is exactly the bug this column shows.
    .safe(true)
    .on_retry(move |event: &RetryEvent<'_, Failure>| {
        delays.lock().unwrap().record(event);
    })
    .await;
    Outcome {
        attempts,
        stopped: result.err().map(|e| e.reason),
    }
}
