//! 1. Backoff: one delay, one decision.

use super::*;

pub(crate) fn bench_backoff(c: &mut Criterion) {
    let mut g = c.benchmark_group("backoff");
    let policy = RetryPolicy::new().with_seed(7);
    g.bench_function("oncely_delay_after", |b| {
        b.iter(|| black_box(&policy).delay_after(black_box(2)))
    });
    let proto = RetryState::new(policy).with_facts(CallFacts::SAFE);
    g.bench_function("oncely_on_failure", |b| {
        b.iter(|| {
            let mut s = black_box(&proto).clone();
            s.on_failure(black_box(Failure::new(Code::Unavailable)), Duration::ZERO)
        })
    });
    // backon has no "delay of attempt n": the equivalent is building its seeded
    // exponential iterator and taking one delay.
    let builder = ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(20))
        .with_jitter()
        .with_jitter_seed(7);
    g.bench_function("backon_build_next", |b| {
        b.iter(|| black_box(black_box(builder).build().next()))
    });
    g.finish();
}
