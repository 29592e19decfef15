//! The retry loops (SPEC §4): stop reasons, hooks, cancellation, budget, deadline.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Wake, Waker};
use std::time::{Duration, Instant};

use futures::executor::block_on;
use oncely::{
    retry, retry_blocking, Attempt, Clock, Code, Deadline, Failure, ManualClock, RetryBudget,
    RetryPolicy, Rule, ServerDelay, StopReason,
};

fn instant_policy(attempts: u32) -> RetryPolicy {
    RetryPolicy::new()
        .with_max_attempts(attempts)
        .with_base_delay(Duration::ZERO)
        .with_seed(1)
}

/// A sleeper that advances a manual clock instead of waiting, and records the delays.
fn manual_sleeper(
    clock: ManualClock,
    slept: Arc<Mutex<Vec<Duration>>>,
) -> impl Fn(Duration) -> std::future::Ready<()> {
    move |d| {
        clock.advance(d);
        slept.lock().unwrap().push(d);
        std::future::ready(())
    }
}

#[test]
fn succeeds_after_transient_failures_and_tells_the_action_its_attempt() {
    let seen = Mutex::new(Vec::new());
    let out = block_on(async {
        retry(|a: Attempt| {
            seen.lock().unwrap().push(a.number);
            async move {
                if a.number < 3 {
                    Err(Code::Unavailable)
                } else {
                    Ok(a.previous_attempts())
                }
            }
        })
        .policy(instant_policy(3))
        .safe(true)
        .await
    });
    assert_eq!(out.unwrap(), 2);
    assert_eq!(*seen.lock().unwrap(), vec![1, 2, 3]);
}

#[test]
fn stops_not_retryable_at_once_with_the_last_error() {
    let calls = AtomicU32::new(0);
    let err = block_on(async {
        retry(|_| {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Err::<(), _>(Code::InvalidArgument) }
        })
        .policy(instant_policy(5))
        .safe(true)
        .await
    })
    .unwrap_err();
    assert_eq!(
        (err.error, err.attempts, err.reason),
        (Code::InvalidArgument, 1, StopReason::NotRetryable)
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[test]
fn unavailable_is_not_retried_when_the_call_is_not_safe() {
    let err = block_on(async {
        retry(|_| async { Err::<(), _>(Code::Unavailable) })
            .policy(instant_policy(5))
            .await
    })
    .unwrap_err();
    assert_eq!((err.attempts, err.reason), (1, StopReason::NotRetryable));
}

#[test]
fn aborted_is_retried_only_when_the_call_rereads() {
    let run = |rereads| {
        block_on(async {
            retry(|_| async { Err::<(), _>(Code::Aborted) })
                .policy(instant_policy(3))
                .safe(true)
                .rereads(rereads)
                .await
        })
        .unwrap_err()
    };
    assert_eq!(run(false).attempts, 1);
    assert_eq!(run(true).attempts, 3);
    assert_eq!(run(true).reason, StopReason::AttemptsExhausted);
}

#[test]
fn stops_when_attempts_are_exhausted() {
    let err = block_on(async {
        retry(|_| async { Err::<(), _>(Code::Unavailable) })
            .policy(instant_policy(4))
            .safe(true)
            .await
    })
    .unwrap_err();
    assert_eq!(
        (err.attempts, err.reason),
        (4, StopReason::AttemptsExhausted)
    );
    assert!(err.to_string().contains("attempts_exhausted"), "{err}");
}

#[test]
fn obeys_a_server_that_says_do_not_retry() {
    let err = block_on(async {
        retry(|_| async {
            Err::<(), _>(
                Failure::new(Code::ResourceExhausted).with_server_delay(ServerDelay::DoNotRetry),
            )
        })
        .policy(instant_policy(5))
        .await
    })
    .unwrap_err();
    assert_eq!((err.attempts, err.reason), (1, StopReason::ServerSaidNo));
}

#[test]
fn waits_the_server_delay_instead_of_backoff_and_reports_it() {
    let clock = ManualClock::new();
    let slept = Arc::new(Mutex::new(Vec::new()));
    let events = Mutex::new(Vec::new());
    let out = block_on(async {
        retry(|a: Attempt| async move {
            if a.number == 1 {
                Err(Failure::new(Code::ResourceExhausted)
                    .with_server_delay(ServerDelay::After(Duration::from_millis(300))))
            } else {
                Ok(())
            }
        })
        .policy(RetryPolicy::new().with_seed(3))
        .sleeper(manual_sleeper(clock.clone(), slept.clone()))
        .on_retry(|e: &oncely::RetryEvent<'_, Failure>| {
            events
                .lock()
                .unwrap()
                .push((e.attempt, e.delay, e.rule, e.from_server))
        })
        .await
    });
    assert!(out.is_ok());
    assert_eq!(*slept.lock().unwrap(), vec![Duration::from_millis(300)]);
    assert_eq!(
        *events.lock().unwrap(),
        vec![(1, Duration::from_millis(300), Rule::RateLimited, true)]
    );
}

#[test]
fn on_retry_sees_each_retry_with_the_seeded_backoff() {
    let clock = ManualClock::new();
    let slept = Arc::new(Mutex::new(Vec::new()));
    let policy = RetryPolicy::new().with_max_attempts(4).with_seed(99);
    let events = Mutex::new(Vec::new());
    let err = block_on(async {
        retry(|_| async { Err::<(), _>(Code::Unavailable) })
            .policy(policy)
            .safe(true)
            .sleeper(manual_sleeper(clock.clone(), slept.clone()))
            .on_retry(|e: &oncely::RetryEvent<'_, Code>| {
                events.lock().unwrap().push((e.attempt, e.delay, *e.error))
            })
            .await
    })
    .unwrap_err();
    assert_eq!(err.attempts, 4);
    let expected: Vec<Duration> = policy.backoff().collect();
    assert_eq!(*slept.lock().unwrap(), expected);
    let ev = events.lock().unwrap();
    assert_eq!(ev.len(), 3);
    for (i, (attempt, delay, code)) in ev.iter().enumerate() {
        assert_eq!(*attempt, i as u32 + 1);
        assert_eq!(*delay, expected[i]);
        assert_eq!(*code, Code::Unavailable);
    }
}

#[test]
fn never_sleeps_into_an_attempt_that_cannot_finish() {
    let clock = ManualClock::new();
    let slept = Arc::new(Mutex::new(Vec::new()));
    let remaining = Mutex::new(Vec::new());
    // 20 ms then 40 ms delays (no jitter); each attempt takes 30 ms; deadline 150 ms.
    // 30 + 20 + 30 = 80 ms used; the next retry needs 40 + 50 (min_attempt) > 70 left.
    let err = block_on(async {
        let c = clock.clone();
        retry(|a: Attempt| {
            remaining.lock().unwrap().push(a.remaining);
            c.advance(Duration::from_millis(30));
            async { Err::<(), _>(Code::Unavailable) }
        })
        .policy(RetryPolicy::new().with_max_attempts(10).with_jitter(0.0))
        .safe(true)
        .clock(clock.clone())
        .timeout(Duration::from_millis(150))
        .sleeper(manual_sleeper(clock.clone(), slept.clone()))
        .await
    })
    .unwrap_err();
    assert_eq!((err.attempts, err.reason), (2, StopReason::Deadline));
    assert_eq!(*slept.lock().unwrap(), vec![Duration::from_millis(20)]);
    assert_eq!(
        *remaining.lock().unwrap(),
        vec![
            Some(Duration::from_millis(150)),
            Some(Duration::from_millis(100))
        ]
    );
}

#[test]
fn a_server_delay_longer_than_the_deadline_ends_at_once() {
    let clock = ManualClock::new();
    let err = block_on(async {
        retry(|_| async {
            Err::<(), _>(
                Failure::new(Code::ResourceExhausted)
                    .with_server_delay(ServerDelay::After(Duration::from_secs(5))),
            )
        })
        .clock(clock.clone())
        .deadline(Deadline::after(&clock, Duration::from_secs(2)))
        .await
    })
    .unwrap_err();
    assert_eq!((err.attempts, err.reason), (1, StopReason::Deadline));
}

#[test]
fn an_exhausted_budget_fails_a_retryable_error_at_once() {
    let clock = ManualClock::new();
    let budget = RetryBudget::new(0.0, Duration::from_secs(10), 0)
        .unwrap()
        .with_clock(clock.clone());
    let err = block_on(async {
        retry(|_| async { Err::<(), _>(Code::Unavailable) })
            .policy(instant_policy(3))
            .safe(true)
            .budget(&budget)
            .await
    })
    .unwrap_err();
    assert_eq!((err.attempts, err.reason), (1, StopReason::Budget));
    assert_eq!(budget.snapshot().requests, 1);
}

#[test]
fn a_shared_budget_caps_retries_across_calls() {
    let clock = ManualClock::new();
    // 10 % of requests, no floor.
    let budget = RetryBudget::new(0.1, Duration::from_secs(10), 0)
        .unwrap()
        .with_clock(clock.clone());
    let mut retries = 0;
    for _ in 0..100 {
        let err = block_on(async {
            retry(|_| async { Err::<(), _>(Code::Unavailable) })
                .policy(instant_policy(3))
                .safe(true)
                .budget(&budget)
                .await
        })
        .unwrap_err();
        retries += err.attempts - 1;
    }
    // 100 requests allow 10 retries in all, not 200.
    assert_eq!(retries, 10);
    // After the window has passed, the budget recovers.
    clock.advance(Duration::from_secs(11));
    let snap = budget.snapshot();
    assert_eq!((snap.requests, snap.retries), (0, 0));
}

#[test]
fn the_budget_floor_lets_a_quiet_client_retry() {
    let clock = ManualClock::new();
    let budget = RetryBudget::new(0.1, Duration::from_secs(10), 1)
        .unwrap()
        .with_clock(clock.clone());
    budget.record_request();
    // Floor: 1 per second × 10 s = 10 retries even with one request.
    let granted = (0..20).filter(|_| budget.try_withdraw()).count();
    assert_eq!(granted, 10);
}

#[test]
fn budget_settings_are_validated() {
    for (ratio, window, field) in [
        (f64::NAN, Duration::from_secs(1), "ratio"),
        (-0.1, Duration::from_secs(1), "ratio"),
        (f64::INFINITY, Duration::from_secs(1), "ratio"),
        (0.1, Duration::ZERO, "window"),
    ] {
        let e = RetryBudget::new(ratio, window, 0).unwrap_err();
        assert!(
            matches!(e, oncely::Error::InvalidArgument { field: f, .. } if f == field),
            "{e}"
        );
    }
}

struct CountingClock(AtomicUsize);
impl Clock for CountingClock {
    fn now(&self) -> Duration {
        self.0.fetch_add(1, Ordering::SeqCst);
        Duration::ZERO
    }
}

#[test]
fn the_first_attempt_reads_no_clock_without_a_deadline() {
    let clock = Arc::new(CountingClock(AtomicUsize::new(0)));
    struct Shared(Arc<CountingClock>);
    impl Clock for Shared {
        fn now(&self) -> Duration {
            self.0.now()
        }
    }
    let out = block_on(async {
        retry(|_| async { Ok::<_, Code>(1) })
            .clock(Shared(clock.clone()))
            .await
    });
    assert_eq!(out.unwrap(), 1);
    assert_eq!(clock.0.load(Ordering::SeqCst), 0);
}

struct Noop;
impl Wake for Noop {
    fn wake(self: Arc<Self>) {}
}

#[test]
fn dropping_the_future_during_a_sleep_stops_the_loop() {
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let mut fut = Box::pin(
        retry(move |_| {
            c.fetch_add(1, Ordering::SeqCst);
            async { Err::<(), _>(Code::Unavailable) }
        })
        .policy(
            RetryPolicy::new()
                .with_base_delay(Duration::from_millis(50))
                .with_jitter(0.0),
        )
        .safe(true)
        .into_future(),
    );
    let waker = Waker::from(Arc::new(Noop));
    let mut cx = Context::from_waker(&waker);
    assert!(fut.as_mut().poll(&mut cx).is_pending()); // now sleeping 50 ms
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    drop(fut);
    std::thread::sleep(Duration::from_millis(80));
    assert_eq!(calls.load(Ordering::SeqCst), 1, "no attempt after the drop");
}

#[test]
fn really_sleeps_with_futures_timer() {
    let start = Instant::now();
    let err = block_on(async {
        retry(|_| async { Err::<(), _>(Code::Unavailable) })
            .policy(
                RetryPolicy::new()
                    .with_base_delay(Duration::from_millis(10))
                    .with_jitter(0.0),
            )
            .safe(true)
            .await
    })
    .unwrap_err();
    assert_eq!(err.attempts, 3);
    // 10 + 20 ms of delays at least (an upper bound would be a timing assertion).
    assert!(start.elapsed() >= Duration::from_millis(30));
}

#[test]
fn the_blocking_loop_follows_the_same_rules() {
    let calls = AtomicU32::new(0);
    let out = retry_blocking(|a: Attempt| {
        calls.fetch_add(1, Ordering::SeqCst);
        if a.number < 2 {
            Err(std::io::Error::from(std::io::ErrorKind::ConnectionReset))
        } else {
            Ok("done")
        }
    })
    .policy(instant_policy(3))
    .safe(true)
    .call();
    assert_eq!(out.unwrap(), "done");
    let err = retry_blocking(|_| Err::<(), _>(std::io::Error::from(std::io::ErrorKind::TimedOut)))
        .policy(instant_policy(2))
        .safe(true)
        .call()
        .unwrap_err();
    assert_eq!(
        (err.attempts, err.reason),
        (2, StopReason::AttemptsExhausted)
    );
    assert_eq!(err.into_inner().kind(), std::io::ErrorKind::TimedOut);
}

#[test]
#[should_panic(expected = "invalid max_attempts")]
fn an_invalid_policy_is_refused_loudly() {
    let _ = retry_blocking(|_| Ok::<_, Code>(()))
        .policy(RetryPolicy::new().with_max_attempts(0))
        .call();
}

#[test]
fn runs_on_tokio_and_smol_timers() {
    let sleeps = AtomicU32::new(0);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let out = rt.block_on(async {
        retry(|a: Attempt| async move {
            if a.number < 3 {
                Err(Code::Unavailable)
            } else {
                Ok(a.number)
            }
        })
        .safe(true)
        .sleeper(|d| {
            sleeps.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(d)
        })
        .await
    });
    assert_eq!(out.unwrap(), 3);
    assert_eq!(sleeps.load(Ordering::SeqCst), 2);
    let out = smol::block_on(async {
        retry(|a: Attempt| async move {
            if a.number < 2 {
                Err(Code::Unavailable)
            } else {
                Ok(a.number)
            }
        })
        .safe(true)
        .sleeper(|d| async move {
            smol::Timer::after(d).await;
        })
        .await
    });
    assert_eq!(out.unwrap(), 2);
}

/// Helper so `IntoFuture` can be polled by hand.
trait IntoFutureExt: std::future::IntoFuture + Sized {
    fn into_future(self) -> Self::IntoFuture {
        std::future::IntoFuture::into_future(self)
    }
}
impl<T: std::future::IntoFuture> IntoFutureExt for T {}

fn assert_send<T: Send>(_: &T) {}

#[test]
fn the_retry_future_is_send_when_its_parts_are() {
    let fut = retry(|_| async { Ok::<_, Code>(()) }).into_future();
    assert_send(&fut);
    let boxed: Pin<Box<dyn Future<Output = _> + Send>> = Box::pin(fut);
    drop(boxed);
}

#[test]
fn an_in_progress_answer_is_resent_by_a_keyed_call_after_its_delay() {
    let clock = ManualClock::new();
    let slept = Arc::new(Mutex::new(Vec::new()));
    let in_progress = oncely::Error::InProgress {
        retry_after: Duration::from_millis(300),
    };
    let rules = Mutex::new(Vec::new());
    let out = block_on(async {
        retry(|a: Attempt| {
            let e = in_progress.clone();
            async move {
                if a.number < 3 {
                    Err(e)
                } else {
                    Ok(a.number)
                }
            }
        })
        .policy(instant_policy(3))
        .safe(true)
        .clock(clock.clone())
        .sleeper(manual_sleeper(clock.clone(), slept.clone()))
        .on_retry(|e: &oncely::RetryEvent<'_, oncely::Error>| {
            rules.lock().unwrap().push((e.rule, e.from_server))
        })
        .await
    });
    assert_eq!(out.unwrap(), 3);
    assert_eq!(*slept.lock().unwrap(), [Duration::from_millis(300); 2]);
    assert_eq!(
        *rules.lock().unwrap(),
        [(Rule::InProgressKeyed, true), (Rule::InProgressKeyed, true)]
    );
}

#[test]
fn an_in_progress_answer_is_not_resent_by_a_call_that_is_not_safe_and_the_error_says_why() {
    let err = retry_blocking(|_| {
        Err::<(), _>(oncely::Error::InProgress {
            retry_after: Duration::from_millis(300),
        })
    })
    .policy(instant_policy(3))
    .call()
    .unwrap_err();
    assert_eq!(
        (err.attempts, err.reason, err.rule),
        (1, StopReason::NotRetryable, Rule::ConflictNeedsReread)
    );
    let text = err.to_string();
    assert!(
        text.starts_with("gave up after 1 attempt (not_retryable: a conflict (ABORTED)"),
        "{text}"
    );
    assert!(text.contains("(rule conflict_needs_reread)"), "{text}");
}

#[test]
fn every_stop_reason_is_explained() {
    for reason in [
        StopReason::NotRetryable,
        StopReason::AttemptsExhausted,
        StopReason::Deadline,
        StopReason::Budget,
        StopReason::ServerSaidNo,
    ] {
        let why = reason.explain(Some(Rule::Permanent));
        assert!(why.starts_with(&format!("{}: ", reason.as_str())), "{why}");
        assert!(why.len() > reason.as_str().len() + 10, "{why}");
    }
}
