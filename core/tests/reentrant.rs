//! An action that calls `execute` with the key it is leading fails that inner call at
//! once (FAILED_PRECONDITION) instead of waiting for itself; calls that are not nested
//! in the leader's action are never taken for re-entrant ones.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::task::Poll;
use std::time::Duration;

use futures::executor::{block_on, LocalPool};
use futures::task::LocalSpawnExt;
use oncely::{
    Code, Error, ExecuteError, ExecuteOptions, IdempotencyKey, MemoryStore, ScopedKey, Source,
};

type Store = MemoryStore<String, String>;

fn key(n: usize) -> ScopedKey {
    let k = IdempotencyKey::derive(&format!("order-{n}"), "create").unwrap();
    ScopedKey::new("tenant", "CreateOrder", &k).unwrap()
}

const FP: &str = "fp";

/// Runs `f` on its own thread and fails the test if it has not finished within 20 s
/// (a re-entrant call that is not detected waits forever).
fn within<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(20))
        .expect("the call hung (or panicked) instead of failing at once")
}

/// What an inner call gave, as text: "reentrant <key>", "led <v>", "joined <v>", ...
fn describe(r: Result<oncely::Executed<String>, ExecuteError<String>>) -> String {
    match r {
        Ok(e) => format!("{:?} {}", e.source, e.value),
        Err(ExecuteError::Store(Error::Reentrant { key })) => format!("reentrant {key}"),
        Err(e) => format!("error {e}"),
    }
}

/// Polls `fut` to completion on this thread, parking between polls: a nested
/// executor, as a blocking wrapper inside an action would be.
fn park_on<F: std::future::Future>(fut: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    loop {
        if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}

/// Gives other futures a turn: returns Pending once, waking itself.
async fn yield_now() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    })
    .await
}

#[test]
fn awaiting_execute_with_the_own_key_fails_at_once() {
    let inner = within(|| {
        let store = Store::new();
        let k = key(1);
        let outer = block_on(store.execute(&k, FP, || async {
            yield_now().await;
            Ok(describe(
                store.execute(&k, FP, || async { Ok("inner".into()) }).await,
            ))
        }))
        .unwrap();
        assert_eq!(outer.source, Source::Led);
        // The leader finished normally and its result is stored.
        let again = block_on(store.execute(&k, FP, || async { Ok("x".into()) })).unwrap();
        assert_eq!(again.source, Source::Replayed);
        assert_eq!(store.counters().leads, 1);
        outer.value
    });
    assert_eq!(inner, format!("reentrant {}", key(1).as_str()));
}

#[test]
fn the_error_is_failed_precondition_and_names_the_key() {
    let store = Store::new();
    let k = key(2);
    let err = within(move || {
        block_on(store.execute(&k, FP, || async {
            match store.execute(&k, FP, || async { Ok(String::new()) }).await {
                Err(ExecuteError::Store(e)) => Err(format!("{}|{e}", e.code().as_str())),
                other => Ok(format!("{other:?}")),
            }
        }))
        .unwrap_err()
    });
    let msg = err.action_error().unwrap();
    assert!(msg.starts_with(Code::FailedPrecondition.as_str()), "{msg}");
    assert!(msg.contains(key(2).as_str()), "{msg}");
}

#[test]
fn a_clone_of_the_store_no_wait_and_a_nested_join_are_detected_too() {
    let got = within(|| {
        let store = Store::new();
        let clone = store.clone();
        let k = key(3);
        block_on(store.execute(&k, FP, || async {
            let (a, b) = futures::join!(
                async {
                    yield_now().await;
                    describe(clone.execute(&k, FP, || async { Ok("a".into()) }).await)
                },
                clone.execute_with(&k, FP, ExecuteOptions::NO_WAIT, || async { Ok("b".into()) }),
            );
            Ok(format!("{a}; {}", describe(b)))
        }))
        .unwrap()
        .value
    });
    let r = format!("reentrant {}", key(3).as_str());
    assert_eq!(got, format!("{r}; {r}"));
}

#[test]
fn an_inner_call_driven_by_a_nested_executor_is_detected() {
    let got = within(|| {
        let store = Store::new();
        let k = key(4);
        block_on(store.execute(&k, FP, || async {
            // A blocking wrapper inside the action…
            let a = describe(park_on(store.execute(&k, FP, || async { Ok("a".into()) })));
            // …a task spawned on a local executor that the action runs…
            let ex = smol::LocalExecutor::new();
            let (s, k2) = (store.clone(), k.clone());
            let task = ex.spawn(async move {
                yield_now().await;
                describe(s.execute(&k2, FP, || async { Ok("b".into()) }).await)
            });
            let b = ex.run(task).await;
            // …and one pushed into a set of futures that the action polls.
            let mut set = futures::stream::FuturesUnordered::new();
            set.push(store.execute(&k, FP, || async { Ok("c".into()) }));
            let c = describe(futures::StreamExt::next(&mut set).await.unwrap());
            Ok(format!("{a}; {b}; {c}"))
        }))
        .unwrap()
        .value
    });
    let r = format!("reentrant {}", key(4).as_str());
    assert_eq!(got, format!("{r}; {r}; {r}"));
}

#[test]
fn a_call_made_while_the_action_is_being_created_is_detected() {
    let got = within(|| {
        let store = Store::new();
        let k = key(5);
        block_on(store.execute(&k, FP, || {
            let inner = describe(park_on(store.execute(&k, FP, || async { Ok("a".into()) })));
            async move { Ok(inner) }
        }))
        .unwrap()
        .value
    });
    assert_eq!(got, format!("reentrant {}", key(5).as_str()));
}

#[test]
fn blocking_execute_inside_its_own_action_fails_at_once() {
    let got = within(|| {
        let store = Store::new();
        let k = key(6);
        store
            .execute_blocking(&k, FP, ExecuteOptions::default(), || {
                Ok(describe(store.execute_blocking(
                    &k,
                    FP,
                    ExecuteOptions::default(),
                    || Ok("inner".into()),
                )))
            })
            .unwrap()
            .value
    });
    assert_eq!(got, format!("reentrant {}", key(6).as_str()));
    // The async inner call in a blocking action, and the other way round.
    let got = within(|| {
        let store = Store::new();
        let k = key(7);
        let a = store
            .execute_blocking(&k, FP, ExecuteOptions::default(), || {
                Ok(describe(block_on(
                    store.execute(&k, FP, || async { Ok("inner".into()) }),
                )))
            })
            .unwrap()
            .value;
        let k = key(8);
        let b = block_on(store.execute(&k, FP, || async {
            Ok(describe(store.execute_blocking(
                &k,
                FP,
                ExecuteOptions::default(),
                || Ok("inner".into()),
            )))
        }))
        .unwrap()
        .value;
        format!("{a}; {b}")
    });
    assert_eq!(
        got,
        format!(
            "reentrant {}; reentrant {}",
            key(7).as_str(),
            key(8).as_str()
        )
    );
}

#[test]
fn a_cycle_through_another_key_is_detected_and_unwinds_cleanly() {
    let got = within(|| {
        let store = Store::new();
        let (k1, k2) = (key(10), key(11));
        let outer = block_on(store.execute(&k1, FP, || async {
            let via_k2 = store
                .execute(&k2, FP, || async {
                    yield_now().await;
                    Ok(describe(
                        store.execute(&k1, FP, || async { Ok("x".into()) }).await,
                    ))
                })
                .await;
            // Back in k1's action, after k2's action returned: still detected.
            let direct = describe(store.execute(&k1, FP, || async { Ok("y".into()) }).await);
            Ok(format!("{}; {direct}", describe(via_k2)))
        }))
        .unwrap();
        // Outside every action, the same thread gets plain replays.
        let r1 = block_on(store.execute(&k1, FP, || async { Ok("z".into()) })).unwrap();
        let r2 = block_on(store.execute(&k2, FP, || async { Ok("z".into()) })).unwrap();
        assert_eq!((r1.source, r2.source), (Source::Replayed, Source::Replayed));
        outer.value
    });
    let r = format!("reentrant {}", key(10).as_str());
    assert_eq!(got, format!("Led {r}; {r}"));
}

#[test]
fn other_keys_and_other_stores_inside_an_action_are_not_reentrant() {
    let got = within(|| {
        let store = Store::new();
        let other = Store::new();
        let k = key(20);
        block_on(store.execute(&k, FP, || async {
            let a = describe(
                store
                    .execute(&key(21), FP, || async { Ok("a".into()) })
                    .await,
            );
            let b = describe(other.execute(&k, FP, || async { Ok("b".into()) }).await);
            let c = describe(other.execute_blocking(
                &key(22),
                FP,
                ExecuteOptions::default(),
                || Ok("c".into()),
            ));
            Ok(format!("{a}; {b}; {c}"))
        }))
        .unwrap()
        .value
    });
    assert_eq!(got, "Led a; Led b; Led c");
}

#[test]
fn other_tasks_on_the_same_thread_join_the_leader() {
    let store = Store::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let results = within({
        let (store, runs) = (store.clone(), runs.clone());
        move || {
            let mut pool = LocalPool::new();
            let handles: Vec<_> = (0..50)
                .map(|i| {
                    let (store, runs) = (store.clone(), runs.clone());
                    pool.spawner()
                        .spawn_local_with_handle(async move {
                            let r = store
                                .execute(&key(30), FP, || async move {
                                    runs.fetch_add(1, Ordering::SeqCst);
                                    for _ in 0..10 {
                                        yield_now().await;
                                    }
                                    Ok(format!("from {i}"))
                                })
                                .await;
                            describe(r)
                        })
                        .unwrap()
                })
                .collect();
            pool.run_until(futures::future::join_all(handles))
        }
    });
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(results.iter().filter(|r| r.starts_with("Led")).count(), 1);
    assert_eq!(
        results.iter().filter(|r| r.starts_with("Joined")).count(),
        49
    );
}

#[test]
fn a_panicking_action_leaves_no_marker_behind() {
    let store = Store::new();
    let k = key(40);
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        block_on(store.execute(&k, FP, || async {
            panic!("boom");
        }))
    }));
    assert!(caught.is_err());
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        store.execute_blocking(&k, FP, ExecuteOptions::default(), || panic!("boom"))
    }));
    assert!(caught.is_err());
    let r = block_on(store.execute(&k, FP, || async { Ok("ok".into()) })).unwrap();
    assert_eq!(r.source, Source::Led);
}

#[test]
fn many_threads_nesting_other_keys_never_see_a_false_reentry() {
    let store = Store::new();
    let handles: Vec<_> = (0..8)
        .map(|t| {
            let store = store.clone();
            std::thread::spawn(move || {
                let mut pool = LocalPool::new();
                let tasks: Vec<_> = (0..200)
                    .map(|i| {
                        let store = store.clone();
                        // Each key is led by one of 8 threads and joined by the others;
                        // its action nests a call on a second key.
                        let n = i % 50;
                        pool.spawner()
                            .spawn_local_with_handle(async move {
                                let r = store
                                    .execute(&key(100 + n), FP, || async {
                                        yield_now().await;
                                        let inner = store
                                            .execute(&key(1_000 + n), FP, || async {
                                                yield_now().await;
                                                Ok(format!("inner {t}"))
                                            })
                                            .await;
                                        match inner {
                                            Ok(_) => Ok(format!("outer {t}")),
                                            Err(e) => Err(e.to_string()),
                                        }
                                    })
                                    .await;
                                r.map(drop).map_err(|e| e.to_string())
                            })
                            .unwrap()
                    })
                    .collect();
                pool.run_until(futures::future::join_all(tasks))
            })
        })
        .collect();
    for h in handles {
        for r in h.join().unwrap() {
            r.unwrap();
        }
    }
    assert_eq!(store.counters().leads, 100);
}

#[test]
fn a_leader_cancelled_at_any_await_leaves_no_marker_behind() {
    let store = Store::new();
    let k = key(50);
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    for polls in 0..6 {
        let mut leader = Box::pin(store.execute(&k, FP, || async {
            yield_now().await;
            let inner = describe(store.execute(&k, FP, || async { Ok("x".into()) }).await);
            assert!(inner.starts_with("reentrant"), "{inner}");
            for _ in 0..3 {
                yield_now().await;
            }
            Ok(inner)
        }));
        for _ in 0..polls {
            if leader.as_mut().poll(&mut cx).is_ready() {
                break;
            }
        }
        // Cancelled (or finished) here: the same thread is no longer inside the action.
        drop(leader);
        let r = block_on(store.execute(&k, FP, || async { Ok("after".into()) })).unwrap();
        if polls < 5 {
            assert_eq!((r.source, r.value.as_str()), (Source::Led, "after"));
            assert!(store.remove(&k));
        } else {
            assert_eq!(r.source, Source::Replayed);
        }
    }
}

#[test]
fn tasks_moving_between_threads_with_cancellations_never_hang_or_misfire() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_time()
        .build()
        .unwrap();
    let store = Store::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let outcome = within({
        let (store, runs) = (store.clone(), runs.clone());
        move || {
            rt.block_on(async {
                let tasks: Vec<_> = (0..400)
                    .map(|i| {
                        let (store, runs) = (store.clone(), runs.clone());
                        tokio::spawn(async move {
                            let k = key(200 + i % 40);
                            let call = store.execute(&k, FP, || async {
                                runs.fetch_add(1, Ordering::SeqCst);
                                tokio::task::yield_now().await;
                                let own = store.execute(&k, FP, || async { Ok("x".into()) }).await;
                                assert!(describe(own).starts_with("reentrant"));
                                let other = store
                                    .execute(&key(5_000 + i), FP, || async {
                                        tokio::task::yield_now().await;
                                        Ok("other".into())
                                    })
                                    .await;
                                assert_eq!(describe(other), "Led other");
                                tokio::task::yield_now().await;
                                Ok(format!("{i}"))
                            });
                            // Every seventh caller gives up early.
                            if i % 7 == 0 {
                                tokio::time::timeout(Duration::from_micros(50), call)
                                    .await
                                    .map(|r| r.map(|e| e.source))
                                    .ok()
                            } else {
                                Some(call.await.map(|e| e.source))
                            }
                        })
                    })
                    .collect();
                let mut done = 0;
                for t in tasks {
                    if let Some(r) = t.await.unwrap() {
                        r.map_err(|e| e.to_string()).unwrap();
                        done += 1;
                    }
                }
                done
            })
        }
    });
    assert!(outcome >= 400 - 400 / 7 - 1);
    // Each key ran at least once, and more only where a leader was cancelled.
    assert!(runs.load(Ordering::SeqCst) >= 40);
    for n in 0..40 {
        let r = block_on(store.execute(&key(200 + n), FP, || async { Ok("late".into()) })).unwrap();
        assert_eq!(r.source, Source::Replayed);
    }
}
