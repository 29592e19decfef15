//! 6. 10,000 waiters coalescing on one key.

use super::*;

pub(crate) const WAITERS: usize = 10_000;

pub(crate) type Gate = Shared<oneshot::Receiver<()>>;

/// The ready queue of the minimal executor below: indices of woken futures.
#[derive(Default)]
pub(crate) struct ReadyQueue(Mutex<Vec<usize>>);

/// The waker of future `idx`: pushes its index on the ready queue.
pub(crate) struct SlotWaker {
    idx: usize,
    ready: Arc<ReadyQueue>,
}

impl Wake for SlotWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref()
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.ready.0.lock().unwrap().push(self.idx)
    }
}

/// Runs one leader and `WAITERS` joiners of one key to completion on a minimal
/// single-threaded executor, so that the harness costs little per waiter: the futures
/// sit in one vector (no allocation per future), each with its own prebuilt waker.
/// Every caller is polled once, and so registers, before the gate that the leader's
/// action waits on is opened. The first caller (the leader) gets the gate; the others
/// get it only when `all_gated` (the floor, where every future waits on the gate
/// itself). Returns the wall time from making the futures to the last completion.
pub(crate) fn coalesce<F, Fut>(all_gated: bool, call: F) -> Duration
where
    F: Fn(Option<Gate>) -> Fut,
    Fut: Future<Output = u64>,
{
    let n = WAITERS + 1;
    let ready = Arc::new(ReadyQueue::default());
    let wakers: Vec<Waker> = (0..n)
        .map(|idx| {
            Waker::from(Arc::new(SlotWaker {
                idx,
                ready: ready.clone(),
            }))
        })
        .collect();
    let mut queue = Vec::with_capacity(n);
    let (tx, rx) = oneshot::channel::<()>();
    let gate = rx.shared();

    let start = Instant::now();
    let mut futs: Vec<Option<Fut>> = Vec::with_capacity(n);
    futs.push(Some(call(Some(gate.clone()))));
    for _ in 1..n {
        futs.push(Some(call(all_gated.then(|| gate.clone()))));
    }
    drop(gate);
    let (mut sum, mut left) = (0, n);
    let poll = |idx: usize, futs: &mut Vec<Option<Fut>>| -> Option<u64> {
        let slot = &mut futs[idx];
        // SAFETY: `futs` never grows past its capacity, so its elements never move
        // until they are dropped in place (by assigning `None`) or with the vector.
        let fut = unsafe { Pin::new_unchecked(slot.as_mut()?) };
        let v = match fut.poll(&mut Context::from_waker(&wakers[idx])) {
            Poll::Ready(v) => v,
            Poll::Pending => return None,
        };
        *slot = None;
        Some(v)
    };
    for idx in 0..n {
        if let Some(v) = poll(idx, &mut futs) {
            (sum, left) = (sum + v, left - 1);
        }
    }
    tx.send(()).unwrap();
    while left > 0 {
        std::mem::swap(&mut queue, &mut *ready.0.lock().unwrap());
        assert!(
            !queue.is_empty(),
            "a future is pending with nothing to wake it"
        );
        for idx in queue.drain(..) {
            if let Some(v) = poll(idx, &mut futs) {
                (sum, left) = (sum + v, left - 1);
            }
        }
    }
    let elapsed = start.elapsed();
    assert_eq!(sum, n as u64 * 7);
    elapsed
}

pub(crate) async fn open(gate: Option<Gate>) {
    gate.expect("only the leader runs its action")
        .await
        .unwrap();
}

pub(crate) fn coalesce_floor() -> Duration {
    coalesce(true, |gate| async move {
        open(gate).await;
        7
    })
}

pub(crate) fn coalesce_oncely(store: &MemoryStore<u64, Code>, fp: &str) -> Duration {
    let before = store.counters();
    let key = random_key();
    let key = &key;
    let t = coalesce(false, |gate| async move {
        let done = store
            .execute(key, fp, || async move {
                open(gate).await;
                Ok(7)
            })
            .await
            .unwrap();
        done.value
    });
    assert_eq!(store.counters().joins - before.joins, WAITERS as u64);
    t
}

pub(crate) fn coalesce_moka(cache: &moka::future::Cache<String, u64>) -> Duration {
    let key = random_key();
    let key = key.as_str();
    coalesce(false, |gate| async move {
        cache
            .get_with_by_ref(key, async move {
                open(gate).await;
                7
            })
            .await
    })
}

pub(crate) fn coalesce_naive(naive: &NaiveShared) -> Duration {
    let key = random_key();
    let key = key.as_str();
    coalesce(false, |gate| async move {
        naive
            .get_with(key, async move {
                open(gate).await;
                7
            })
            .await
    })
}

pub(crate) fn bench_coalesce(c: &mut Criterion) {
    let fp = request_fingerprint();
    let fp = fp.as_str();
    let store: MemoryStore<u64, Code> = MemoryStore::new();
    let cache: moka::future::Cache<String, u64> = moka::future::Cache::builder().build();
    let naive = NaiveShared::default();
    let mut g = c.benchmark_group("coalesce_10k");
    g.sample_size(10);
    g.bench_function("floor_shared_gate", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| coalesce_floor()).sum())
    });
    g.bench_function("oncely", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| coalesce_oncely(&store, fp)).sum())
    });
    g.bench_function("moka_get_with", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| coalesce_moka(&cache)).sum())
    });
    g.bench_function("naive_shared", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| coalesce_naive(&naive)).sum())
    });
    g.finish();
}
