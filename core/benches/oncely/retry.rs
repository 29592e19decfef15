//! 2. Retry success path, and 3. fail-fail-succeed with zero delays.

use super::*;

/// The action of the fail-fail-succeed runs: `UNAVAILABLE` twice, then the value.
pub(crate) fn fail_twice(n: &mut u32) -> impl Future<Output = Result<u32, Code>> {
    *n += 1;
    let k = black_box(*n);
    async move {
        if k < 3 {
            Err(Code::Unavailable)
        } else {
            Ok(k)
        }
    }
}

pub(crate) async fn ok_floor() -> Result<i32, Code> {
    let f = |_: Attempt| async { Ok::<_, Code>(1) };
    f(black_box(Attempt {
        number: 1,
        remaining: None,
    }))
    .await
}

pub(crate) async fn ok_oncely() -> Result<i32, oncely::RetryError<Code>> {
    oncely::retry(|_| async { Ok::<_, Code>(1) }).await
}

pub(crate) async fn ok_backon() -> Result<i32, Code> {
    (|| async { Ok::<_, Code>(1) })
        .retry(ExponentialBuilder::default())
        .await
}

pub(crate) async fn ffs_floor() -> u32 {
    let mut n = 0;
    loop {
        if let Ok(v) = fail_twice(&mut n).await {
            break v;
        }
    }
}

/// Zero delays: base 0 (max_delay stays 1 s, which must be ≥ base).
pub(crate) const ZERO_DELAYS: RetryPolicy = RetryPolicy::new().with_base_delay(Duration::ZERO);

pub(crate) async fn ffs_oncely() -> u32 {
    let mut n = 0;
    let r = oncely::retry(|_| fail_twice(&mut n))
        .policy(black_box(ZERO_DELAYS))
        .safe(true)
        .await;
    r.unwrap()
}

pub(crate) const ZERO_BACKON: ExponentialBuilder =
    ExponentialBuilder::new().with_min_delay(Duration::ZERO);

pub(crate) async fn ffs_backon_noop() -> u32 {
    let mut n = 0;
    let r = (|| fail_twice(&mut n))
        .retry(black_box(ZERO_BACKON))
        .sleep(|_| std::future::ready(()))
        .await;
    r.unwrap()
}

pub(crate) async fn ffs_backon_tokio() -> u32 {
    let mut n = 0;
    let r = (|| fail_twice(&mut n)).retry(black_box(ZERO_BACKON)).await;
    r.unwrap()
}

pub(crate) fn bench_retry(c: &mut Criterion) {
    let rt = tokio_rt();
    let mut g = c.benchmark_group("retry_ok");
    g.bench_function("floor_direct", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(ok_floor().await) })
    });
    g.bench_function("oncely", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(ok_oncely().await) })
    });
    g.bench_function("backon", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(ok_backon().await) })
    });
    g.finish();

    let mut g = c.benchmark_group("retry_ffs");
    g.bench_function("floor_direct", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(ffs_floor().await) })
    });
    g.bench_function("oncely", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(ffs_oncely().await) })
    });
    g.bench_function("backon_noop_sleep", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(ffs_backon_noop().await) })
    });
    g.bench_function("backon_tokio_sleep", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(ffs_backon_tokio().await) })
    });
    g.finish();
}
