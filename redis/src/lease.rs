//! The leader's handle on its claim ([`RedisLease`]): renewed while the action runs,
//! then completed, failed or released.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use oncely::{Error, LeaderLease, Lease, ScopedKey};

use crate::batch::Acked;
use crate::codec::StoredResult;
use crate::runtime::Runtime;
use crate::scripts;
use crate::{
    bump, millis, release, release_in_background, settle_local, Completed, Inner, RedisStore,
};

/// The leader's claim on a key in Redis (and in this process). It is renewed every
/// lease/3 until settled. Dropping it unsettled releases the claim (when the token is
/// still ours) so a waiter takes over at once.
///
/// It belongs to the process that claimed it. A copy in a child made by `fork()` is
/// neither renewed nor released there, and completing it fails with
/// [`Error::LeaseLost`] without writing anything: the claim stays the parent's.
pub struct RedisLease<E: Send + Sync + 'static> {
    pub(crate) store: RedisStore<E>,
    pub(crate) rt: Arc<Runtime<E>>,
    pub(crate) local: Option<Lease<Vec<u8>, E>>,
    pub(crate) scoped: ScopedKey,
    pub(crate) record: String,
    pub(crate) token: String,
    pub(crate) generation: u64,
    pub(crate) renewal: u64,
    pub(crate) lost: Arc<AtomicBool>,
}

impl<E: Send + Sync + 'static> RedisLease<E> {
    /// The lease token (fencing token) written in the record.
    pub fn token(&self) -> &str {
        &self.token
    }
    /// The record's generation: 1 for the first claim, +1 for each takeover.
    pub fn generation(&self) -> u64 {
        self.generation
    }
    /// The Redis key of the record.
    pub fn record_key(&self) -> &str {
        &self.record
    }
    /// True once renewal found the lease taken over; completing will then fail with
    /// [`Error::LeaseLost`].
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }
    /// Stops renewing this lease without releasing it, as a paused or crashed process
    /// would (fault injection for tests: after the lease, another instance takes over).
    pub fn stop_renewing(&self) {
        if self.rt.is_current() {
            self.rt.renewer.unregister(self.renewal);
        }
    }

    /// Deletes the record if it is still ours, without waiting.
    fn release_in_background(&self) {
        release_in_background(
            &self.rt,
            &self.store.inner.scripts,
            self.record.clone(),
            self.token.clone(),
        );
    }

    /// Sends the completion at once (before the returned future is first polled), so
    /// that dropping the future cannot make a release overtake it: the future only
    /// waits for the answer. The lease is renewed until the completion has run.
    fn complete_sent(mut self, value: Vec<u8>) -> impl Future<Output = Result<(), Error>> {
        let inner = self.store.inner.clone();
        let rt = self.rt.clone();
        // Taken, so that dropping `self` below releases nothing.
        let local = self.local.take();
        // A result Redis would refuse (a bulk string over its `proto-max-bulk-len` drops
        // the connection, with every call of its batch) is never sent: the action ran,
        // so the record says its result was not stored (`nostore`), and it is not run
        // again. `result` gets the codec's not-storable record, for instances that read
        // no `nostore`.
        let max = inner.config.max_result_bytes;
        let too_large = (value.len() > max).then(|| {
            log::warn!(
                "oncely-redis: the result of {} ({} bytes) is over max_result_bytes ({max}); \
                 it is recorded as not stored",
                self.scoped.as_str(),
                value.len()
            );
            let type_name = format!(
                "result of {} bytes, over the store's max_result_bytes of {max}",
                value.len()
            );
            let record = StoredResult::NotStorable {
                type_name: &type_name,
            }
            .encode();
            (record, type_name)
        });
        // A copy left by fork() sends nothing: the claim stays the parent's.
        let stored = rt.is_current().then(|| {
            let mut request = inner
                .scripts
                .complete
                .on(&self.record)
                .arg(&self.token)
                .arg(too_large.as_ref().map_or(&value[..], |(record, _)| record))
                .arg(millis(inner.config.ttl))
                .arg(Inner::<E>::channel(&self.record))
                .arg(inner.scripts.publish);
            if let Some((_, type_name)) = &too_large {
                request = request.arg(type_name);
            }
            let request = request.replicated(scripts::completion_stored);
            let (renewer, renewal) = (rt.renewer.clone(), self.renewal);
            let min_replicas = inner.config.min_replicas;
            rt.pool.call_to_end(
                request,
                // The effect happened: a WAIT that fails or falls short is reported,
                // the result is still the caller's.
                move |stored: i64, acked: Acked| match (Completed::from(stored), acked) {
                    (Completed::Stored, Some(Ok(n))) if n < min_replicas => {
                        Completed::Unreplicated(format!(
                            "{n} of {min_replicas} replicas acknowledged it"
                        ))
                    }
                    (Completed::Stored, Some(Err(e))) => {
                        Completed::Unreplicated(format!("WAIT failed: {e}"))
                    }
                    (done, _) => done,
                },
                move || renewer.unregister(renewal),
            )
        });
        let scoped = self.scoped.clone();
        let renewal = self.renewal;
        drop(self);
        async move {
            let Some(stored) = stored else {
                // The in-process lease is the parent's (its waiters here were ended by
                // `after_fork`): dropping it would take a lock a parent thread may
                // have held at the fork.
                std::mem::forget(local);
                return Err(Error::LeaseLost);
            };
            let stored = stored.await;
            rt.renewer.unregister(renewal);
            match stored {
                Ok(done @ (Completed::Stored | Completed::Unreplicated(_))) => {
                    if let Completed::Unreplicated(why) = done {
                        bump(&inner.counters.completions_unreplicated);
                        log::warn!(
                            "oncely-redis: the result of {} was stored on the primary but not \
                             on enough replicas ({why}); a failover now could lose it",
                            scoped.as_str()
                        );
                    }
                    if let Some(local) = local {
                        settle_local(&rt, local, &scoped, value);
                    }
                    Ok(())
                }
                // Taken over: the new leader's record is left alone; local waiters look
                // again (and join the new leader).
                Ok(Completed::Lost) => {
                    bump(&inner.counters.leases_lost);
                    Err(Error::LeaseLost)
                }
                Err(Error::Unavailable(m)) => {
                    bump(&inner.counters.unavailable);
                    Err(Error::Unavailable(format!(
                        "{m}; the result was not stored (the claim lapses with its lease)"
                    )))
                }
                Err(e) => Err(e),
            }
        }
    }

    async fn fail_async(mut self, error: E) -> Arc<E> {
        if !self.rt.is_current() {
            // The parent's: see `complete_sent`.
            std::mem::forget(self.local.take());
            return Arc::new(error);
        }
        let inner = self.store.inner.clone();
        let rt = self.rt.clone();
        rt.renewer.unregister(self.renewal);
        // Released in Redis before the local waiters are woken.
        let released = rt
            .pool
            .call::<i64>(release(&inner.scripts, &self.record, &self.token))
            .await;
        let _ = released; // unreachable Redis: the claim lapses with its lease
        match self.local.take() {
            Some(local) => local.fail_now(error),
            None => Arc::new(error),
        }
    }
}

impl<E: Send + Sync + 'static> Drop for RedisLease<E> {
    fn drop(&mut self) {
        if let Some(local) = self.local.take() {
            if !self.rt.is_current() {
                // The parent's: see `complete_sent`.
                std::mem::forget(local);
                return;
            }
            // Unsettled: abandoned (cancelled) or panicked.
            bump(&self.store.inner.counters.abandoned);
            self.stop_renewing();
            self.release_in_background();
            drop(local);
        }
    }
}

impl<E: Send + Sync + 'static> LeaderLease<Vec<u8>, E> for RedisLease<E> {
    fn complete(self, value: Vec<u8>) -> impl Future<Output = Result<(), Error>> {
        self.complete_sent(value)
    }
    fn fail(self, error: E) -> impl Future<Output = Arc<E>> {
        self.fail_async(error)
    }
    fn panicked(mut self, message: &str) {
        self.stop_renewing();
        self.release_in_background();
        if let Some(local) = self.local.take() {
            if self.rt.is_current() {
                local.panicked_now(message);
            } else {
                // The parent's: see `complete_sent`.
                std::mem::forget(local);
            }
        }
    }
}

impl<E: Send + Sync + 'static> fmt::Debug for RedisLease<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLease")
            .field("record", &self.record)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use futures::executor::block_on;
    use std::future::Future;

    use futures::future::{join_all, FutureExt};
    use oncely::{IdempotencyKey, ScopedKey, Source};

    use crate::codec::{decode, StoredResult};
    use crate::testing::Server;
    use crate::{RecordState, RedisStore};

    /// Concurrent completions on a Redis that refuses bulk strings over 1 MiB, one of
    /// them 2 MiB: the others are stored and replayed; the large one is not sent and
    /// its record says its result was not stored: its leader gets its value, a later
    /// caller on another instance `ResultNotStored` naming the key and the size (never
    /// bytes that were not the result), `get` reports it; no action runs twice. (Sent,
    /// it broke the connection and its leader got UNAVAILABLE, and the key ran again on
    /// the next call.)
    #[test]
    #[ignore = "needs redis-server: run scripts/test-redis"]
    fn a_result_over_max_result_bytes_is_recorded_as_not_storable() {
        let server = Server::start(&["--proto-max-bulk-len", "1mb"]);
        let build = || -> RedisStore<std::io::Error> {
            RedisStore::builder(server.url())
                .workers(1)
                .lease(Duration::from_secs(6))
                .max_result_bytes(1 << 20)
                .build()
                .unwrap()
        };
        let (s, other) = (build(), build());
        const N: usize = 24;
        const BIG: usize = 7;
        let keys: Vec<ScopedKey> = (0..N)
            .map(|_| ScopedKey::new("acme", "Export", &IdempotencyKey::random()).unwrap())
            .collect();
        let value = |i: usize| -> Vec<u8> {
            if i == BIG {
                vec![b'x'; 2 << 20]
            } else {
                format!("v{i}").into_bytes()
            }
        };
        let runs: Vec<AtomicUsize> = (0..N).map(|_| AtomicUsize::new(0)).collect();
        let started = AtomicUsize::new(0);
        let (open, gate) = futures::channel::oneshot::channel::<()>();
        let gate = gate.shared();
        let mut admin = server.con().unwrap();
        let mut open = Some(open);
        let all = join_all((0..N).map(|i| {
            let (s, keys, runs, started, gate) = (&s, &keys, &runs, &started, gate.clone());
            async move {
                s.execute(&keys[i], "f", || async move {
                    runs[i].fetch_add(1, Ordering::SeqCst);
                    started.fetch_add(1, Ordering::SeqCst);
                    let _ = gate.await;
                    Ok(value(i))
                })
                .await
            }
        }));
        // Every action holds at the gate; then writes are paused so that the completions
        // queue up behind the first and go out together.
        let mut all = Box::pin(all);
        let results = block_on(futures::future::poll_fn(|cx| {
            if let std::task::Poll::Ready(r) = all.as_mut().poll(cx) {
                return std::task::Poll::Ready(r);
            }
            if started.load(Ordering::SeqCst) == N {
                if let Some(open) = open.take() {
                    let _: () = redis::cmd("CLIENT")
                        .arg("PAUSE")
                        .arg(300)
                        .arg("WRITE")
                        .query(&mut admin)
                        .unwrap();
                    let _ = open.send(());
                }
            } else {
                cx.waker().wake_by_ref();
            }
            std::task::Poll::Pending
        }));
        for (i, r) in results.into_iter().enumerate() {
            match r {
                Ok(done) => {
                    assert_eq!(done.source, Source::Led, "key {i}");
                    assert!(done.value == value(i), "key {i}: another value");
                }
                Err(e) => panic!("key {i}: {e:?}"),
            }
        }
        for i in 0..N {
            let again = block_on(other.execute(&keys[i], "f", || async {
                Ok::<_, std::io::Error>(b"again".to_vec())
            }));
            if i == BIG {
                assert_not_stored(again, &keys[i]);
                let record = block_on(other.get(&keys[i])).unwrap().unwrap();
                match record.state {
                    RecordState::NotStored { type_name } => assert_size(&type_name),
                    r => panic!("the large result's record: {r:?}"),
                }
            } else {
                let again = again.unwrap();
                assert_eq!(again.source, Source::Replayed, "key {i}");
                assert_eq!(again.value, value(i), "key {i}");
                let record = block_on(other.get(&keys[i])).unwrap().unwrap();
                assert_eq!(record.state, RecordState::Done { value: value(i) });
            }
            assert_eq!(runs[i].load(Ordering::SeqCst), 1, "key {i} ran again");
        }
    }

    fn assert_size(type_name: &str) {
        assert!(
            type_name.contains("2097152 bytes") && type_name.contains("1048576"),
            "{type_name}"
        );
    }

    /// The call ended with `ResultNotStored` for `key`, naming the size over the cap.
    fn assert_not_stored(
        r: Result<oncely::Executed<Vec<u8>>, oncely::ExecuteError<std::io::Error>>,
        key: &ScopedKey,
    ) {
        match r {
            Err(oncely::ExecuteError::Store(oncely::Error::ResultNotStored {
                key: k,
                type_name,
            })) => {
                assert_eq!(k, key.to_string());
                assert_size(&type_name);
            }
            Ok(done) => panic!(
                "{key}: {:?} {} bytes, not ResultNotStored",
                done.source,
                done.value.len()
            ),
            Err(e) => panic!("{key}: {e:?}"),
        }
    }

    /// Callers on another instance waiting for a leader whose result is over
    /// max_result_bytes (woken by its completion, or arriving after it) get
    /// `ResultNotStored` naming the key; the action ran once; the leader gets its value.
    /// The record left for readers that know no `nostore` is the codec's not-storable
    /// record.
    #[test]
    #[ignore = "needs redis-server: run scripts/test-redis"]
    fn waiters_on_another_instance_get_result_not_stored_for_a_result_over_max_result_bytes() {
        let server = Server::start(&["--proto-max-bulk-len", "1mb"]);
        let build = || -> RedisStore<std::io::Error> {
            RedisStore::builder(server.url())
                .workers(2)
                .lease(Duration::from_secs(6))
                .max_result_bytes(1 << 20)
                .build()
                .unwrap()
        };
        let (leader, waiting) = (build(), build());
        let key = ScopedKey::new("acme", "Export", &IdempotencyKey::random()).unwrap();
        let runs = AtomicUsize::new(0);
        let (open, gate) = std::sync::mpsc::channel::<()>();
        const WAITERS: usize = 8;
        std::thread::scope(|scope| {
            let (leader, key, runs) = (&leader, &key, &runs);
            let led = scope.spawn(move || {
                leader.execute_blocking(key, "f", Default::default(), || {
                    runs.fetch_add(1, Ordering::SeqCst);
                    gate.recv().unwrap();
                    Ok(vec![b'y'; 2 << 20])
                })
            });
            while runs.load(Ordering::SeqCst) == 0 {
                std::thread::yield_now();
            }
            let waiters: Vec<_> = (0..WAITERS)
                .map(|_| {
                    let waiting = &waiting;
                    scope.spawn(move || {
                        waiting.execute_blocking(key, "f", Default::default(), || {
                            runs.fetch_add(1, Ordering::SeqCst);
                            Ok(b"again".to_vec())
                        })
                    })
                })
                .collect();
            // Bounded: a hang shows as a failure, not a stuck run.
            let until = std::time::Instant::now() + Duration::from_secs(20);
            while waiting.counters().remote_waits == 0 {
                assert!(std::time::Instant::now() < until, "no waiter waits");
                std::thread::sleep(Duration::from_millis(2));
            }
            open.send(()).unwrap();
            let done = led.join().unwrap().unwrap();
            assert_eq!(done.source, Source::Led);
            assert_eq!(done.value.len(), 2 << 20);
            for w in waiters {
                assert_not_stored(w.join().unwrap(), key);
            }
        });
        assert_eq!(runs.load(Ordering::SeqCst), 1, "the action ran again");
        let mut c = server.con().unwrap();
        let result: Vec<u8> = redis::cmd("HGET")
            .arg(leader.record_key(&key))
            .arg("result")
            .query(&mut c)
            .unwrap();
        match decode(&result).unwrap() {
            StoredResult::NotStorable { type_name } => assert_size(type_name),
            r => panic!("{r:?}"),
        }
    }

    #[test]
    fn max_result_bytes_is_checked() {
        for bad in [0, crate::MAX_RESULT_BYTES_LIMIT + 1] {
            let e = RedisStore::<std::io::Error>::builder("redis://127.0.0.1:1")
                .max_result_bytes(bad)
                .build()
                .unwrap_err();
            match e {
                oncely::Error::InvalidArgument { field, reason } => {
                    assert_eq!(field, "max_result_bytes");
                    assert!(reason.contains(&format!("got {bad}")), "{reason}");
                }
                e => panic!("{e:?}"),
            }
        }
        let s = RedisStore::<std::io::Error>::builder("redis://127.0.0.1:1")
            .max_result_bytes(crate::MAX_RESULT_BYTES_LIMIT)
            .build()
            .unwrap();
        assert_eq!(s.max_result_bytes(), crate::MAX_RESULT_BYTES_LIMIT);
        let s = RedisStore::<std::io::Error>::new("redis://127.0.0.1:1").unwrap();
        assert_eq!(s.max_result_bytes(), crate::DEFAULT_MAX_RESULT_BYTES);
    }
}
