//! A store made before `fork()` works in the child: its threads and connections are
//! made again there, the parent's leases and in-process flights stay the parent's
//! (the child neither renews, releases nor completes them, nor joins them), and the
//! parent's store keeps working.
//!
//! Each child runs under an alarm: a call that hangs kills it, and the parent reports
//! it. Its own test binary with one test, so no other test thread of this process can
//! hold a lock at the fork. Gated like `tests/redis.rs`: ignored unless run by
//! scripts/test-redis.

mod support;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures::executor::block_on;
use oncely::{
    Begin, Error, ExecuteOptions, Executed, IdempotencyKey, LeaderLease, ScopedKey, Source,
};
use oncely_redis::{RedisLease, RedisStore};
use support::url;

type Store = RedisStore<std::io::Error>;

fn key() -> ScopedKey {
    ScopedKey::new("acme", "Pay", &IdempotencyKey::random()).unwrap()
}

const LEASE: Duration = Duration::from_millis(300);
/// How long a child may take before its alarm kills it (a hang).
const CHILD_ALARM_SECS: u32 = 20;

/// A store whose waiters poll Redis only every 60 s: within a child's alarm, a remote
/// waiter is woken by the pub/sub listener or by the lease's own deadline, so a
/// listener or timer thread that did not come back after the fork shows as a hang.
fn store(prefix: &str) -> Store {
    RedisStore::builder(url())
        .prefix(prefix)
        .lease(LEASE)
        .poll_interval(Duration::from_secs(60), Duration::from_secs(60))
        .build()
        .unwrap()
}

fn lead(s: &Store, k: &ScopedKey) -> RedisLease<std::io::Error> {
    match block_on(s.begin(k, "f", ExecuteOptions::default())) {
        Ok(Begin::Lead(l)) => l,
        other => panic!("expected to lead, got {:?}", other.map(|_| "not a lead")),
    }
}

fn run(s: &Store, k: &ScopedKey, value: &[u8]) -> Result<Executed<Vec<u8>>, String> {
    let value = value.to_vec();
    block_on(s.execute(k, "f", || async move { Ok(value) })).map_err(|e| format!("{e:?}"))
}

fn expect(
    what: &str,
    got: Result<Executed<Vec<u8>>, String>,
    value: &[u8],
    source: Source,
) -> Result<(), String> {
    match got {
        Ok(d) if d.value == value && d.source == source => Ok(()),
        other => Err(format!(
            "{what}: expected {value:?} ({source:?}), got {other:?}"
        )),
    }
}

/// Waits (bounded) until `f` holds.
fn until(what: &str, mut f: impl FnMut() -> bool) -> Result<(), String> {
    let end = Instant::now() + Duration::from_secs(10);
    while !f() {
        if Instant::now() > end {
            return Err(format!("timed out waiting until {what}"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// Makes every thread of `s` run before the fork: workers, the renewer (a lead), the
/// pub/sub listener and the timer (a wait on `other`'s lead).
fn warm_up(s: &Store, other: &Store) {
    run(s, &key(), b"warm").unwrap();
    let k = key();
    let l = lead(other, &k);
    let waits = s.counters().remote_waits;
    std::thread::scope(|scope| {
        let waiter = scope.spawn(|| run(s, &k, b"never"));
        until("the waiter waits on Redis", || {
            s.counters().remote_waits > waits
        })
        .unwrap();
        block_on(l.complete(b"w".to_vec())).unwrap();
        expect("warm-up wait", waiter.join().unwrap(), b"w", Source::Joined).unwrap();
    });
}

fn redis_get(k: &str) -> Option<String> {
    let mut c = redis::Client::open(url())
        .unwrap()
        .get_connection()
        .unwrap();
    redis::cmd("GET").arg(k).query(&mut c).unwrap()
}

fn redis_set(k: &str) -> Result<(), String> {
    let mut c = redis::Client::open(url())
        .and_then(|c| c.get_connection())
        .map_err(|e| e.to_string())?;
    redis::cmd("SET")
        .arg(k)
        .arg("1")
        .query::<()>(&mut c)
        .map_err(|e| e.to_string())
}

/// Writes to fd 2 directly: in the child, the test harness's output capture (and its
/// locks) belong to the parent.
fn say(msg: &str) {
    let line = format!("{msg}\n");
    // SAFETY: writes a valid buffer of its length to fd 2.
    unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
}

struct Child(libc::pid_t);

/// Forks; the child runs `f` under an alarm and exits with 0 when it returned Ok.
fn fork(f: impl FnOnce() -> Result<(), String>) -> Child {
    // SAFETY: the child only runs `f` (Rust code that takes no lock a thread of the
    // parent held: this binary's only test thread is the one forking) and `_exit`s.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid > 0 {
        return Child(pid);
    }
    // SAFETY: alarm and _exit are async-signal-safe and take plain integers.
    unsafe { libc::alarm(CHILD_ALARM_SECS) };
    let code = match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => 0,
        Ok(Err(m)) => {
            say(&format!("child: {m}"));
            1
        }
        Err(p) => {
            let m = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            say(&format!("child panicked: {m}"));
            2
        }
    };
    unsafe { libc::_exit(code) }
}

impl Child {
    /// The child's outcome; a child killed by its alarm hung.
    fn wait(self) -> Result<(), String> {
        let mut status = 0;
        // SAFETY: waits for our own child, writing its status into a local.
        let r = unsafe { libc::waitpid(self.0, &mut status, 0) };
        assert_eq!(r, self.0, "waitpid failed");
        if libc::WIFSIGNALED(status) {
            let sig = libc::WTERMSIG(status);
            return Err(if sig == libc::SIGALRM {
                format!("the child hung: killed by its {CHILD_ALARM_SECS} s alarm")
            } else {
                format!("the child was killed by signal {sig}")
            });
        }
        match libc::WEXITSTATUS(status) {
            0 => Ok(()),
            n => Err(format!(
                "the child failed with status {n} (see its message above)"
            )),
        }
    }
}

#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn redis_fork() {
    child_uses_a_store_made_before_fork();
    parents_lease_and_flight_stay_the_parents();
    child_renews_its_leases_not_the_parents();
    calls_in_flight_at_the_fork_end_in_the_child();
    a_fork_while_other_threads_use_the_store_does_not_hang_the_child();
}

/// Other threads of the parent use the store (calls in flight, `after_fork`, which
/// does nothing in the parent) while it forks again and again, a wait on another
/// instance's leader pending in the forking thread: a lock one of them held at a fork
/// never comes free in the child, where that thread is gone. Each child's `after_fork`,
/// the drop of its copy of the pending wait, and its first call must not wait on one (a
/// hang is killed by the child's alarm). In the parent, the wait gets the leader's
/// result.
fn a_fork_while_other_threads_use_the_store_does_not_hang_the_child() {
    use std::task::Context;
    let prefix = format!("f{}", IdempotencyKey::random().as_str());
    let (s, other) = (store(&prefix), store(&prefix));
    warm_up(&s, &other);
    let stop = AtomicBool::new(false);
    let noop = futures::task::noop_waker();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                s.after_fork();
            }
        });
        for _ in 0..2 {
            scope.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    // Errors (a loaded machine's I/O timeouts) do not matter here.
                    let k = key();
                    let _ = run(&s, &k, b"v");
                    let _ = run(&s, &k, b"x");
                }
            });
        }
        let outcome = (0..40).try_for_each(|i| {
            let k = key();
            let l = lead(&other, &k);
            let wait: Call<'_> = Box::pin(async {
                s.execute(&k, "f", || async { Ok(b"never".to_vec()) })
                    .await
                    .map_err(|e| format!("{e:?}"))
            });
            let mut wait = Some(wait);
            let (ka, kb) = (key(), key());
            let mut leases = Some((lead(&s, &ka), lead(&s, &kb)));
            let waits = s.counters().remote_waits;
            until("the call waits on Redis", || {
                let pending = wait.as_mut().is_some_and(|w| {
                    w.as_mut()
                        .poll(&mut Context::from_waker(&noop))
                        .is_pending()
                });
                pending && s.counters().remote_waits > waits
            })?;
            let child = fork(|| {
                s.after_fork();
                drop(wait.take());
                // The parent's leases: completing one fails, dropping the other
                // releases nothing.
                let (la, lb) = leases.take().ok_or("no leases")?;
                match block_on(la.complete(b"copy".to_vec())) {
                    Err(Error::LeaseLost) => {}
                    other => return Err(format!("completing the parent's lease: {other:?}")),
                }
                drop(lb);
                block_on(s.ping()).map_err(|e| format!("ping in the child: {e}"))
            });
            child.wait().map_err(|e| format!("fork {i}: {e}"))?;
            block_on(l.complete(b"led".to_vec())).map_err(|e| format!("complete: {e}"))?;
            let (la, lb) = leases.take().ok_or("the leases were taken in the parent")?;
            for (lease, k) in [(la, &ka), (lb, &kb)] {
                block_on(lease.complete(b"a".to_vec())).map_err(|e| format!("complete: {e}"))?;
                expect("a parent's lease", run(&s, k, b"y"), b"a", Source::Replayed)?;
            }
            let wait = wait.take().ok_or("the wait was taken in the parent")?;
            expect(
                "the wait in the parent",
                block_on(wait),
                b"led",
                Source::Joined,
            )
            .map_err(|e| format!("fork {i}: {e}"))
        });
        stop.store(true, Ordering::Relaxed);
        outcome.unwrap();
    });
    expect("parent lead", run(&s, &key(), b"p"), b"p", Source::Led).unwrap();
}

/// A waker that counts its wakes.
struct Wakes(std::sync::atomic::AtomicUsize);

impl futures::task::ArcWake for Wakes {
    fn wake_by_ref(me: &std::sync::Arc<Self>) {
        me.0.fetch_add(1, Ordering::SeqCst);
    }
}

type Call<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Executed<Vec<u8>>, String>> + 'a>>;

/// Three calls of the parent are pending when it forks: one waits for its claim's
/// answer (Redis holds writes: `CLIENT PAUSE`), one for another instance's leader (in
/// Redis), one for a leader in this process. In the child, `after_fork` wakes each
/// and each ends with UNAVAILABLE, without running its action; in the parent they go
/// on as if nothing happened. (Their answers would come to the parent's threads: in the
/// child they waited for ever.)
fn calls_in_flight_at_the_fork_end_in_the_child() {
    use std::sync::Arc;
    use std::task::{Context, Poll};
    let prefix = format!("f{}", IdempotencyKey::random().as_str());
    // A 1 s I/O timeout: the claim outlasts the pause below.
    let s: Store = RedisStore::builder(url())
        .prefix(&prefix)
        .lease(Duration::from_secs(3))
        .poll_interval(Duration::from_secs(60), Duration::from_secs(60))
        .build()
        .unwrap();
    let other = store(&prefix);
    warm_up(&s, &other);
    let (kc, kr, kl) = (key(), key(), key());
    let remote = lead(&other, &kr);
    let local = lead(&s, &kl);
    let ran = [
        AtomicBool::new(false),
        AtomicBool::new(false),
        AtomicBool::new(false),
    ];
    let call = |i: usize, k: ScopedKey| -> Call<'_> {
        let (s, ran) = (&s, &ran);
        Box::pin(async move {
            s.execute(&k, "f", || async move {
                ran[i].store(true, Ordering::SeqCst);
                Ok(format!("ran-{i}").into_bytes())
            })
            .await
            .map_err(|e| format!("{e:?}"))
        })
    };
    let wakes: Vec<Arc<Wakes>> = (0..3)
        .map(|_| Arc::new(Wakes(std::sync::atomic::AtomicUsize::new(0))))
        .collect();
    let mut calls = [
        call(0, kc.clone()),
        call(1, kr.clone()),
        call(2, kl.clone()),
    ];
    let poll = |c: &mut Call<'_>, w: &Arc<Wakes>| {
        let waker = futures::task::waker(w.clone());
        c.as_mut().poll(&mut Context::from_waker(&waker))
    };
    // The remote and the local waits, until they wait.
    let waits = s.counters().remote_waits;
    until("the call waits on Redis", || {
        assert!(poll(&mut calls[1], &wakes[1]).is_pending());
        s.counters().remote_waits > waits
    })
    .unwrap();
    assert!(poll(&mut calls[2], &wakes[2]).is_pending());
    // The claim, sent while Redis holds writes.
    let mut admin = redis::Client::open(url())
        .unwrap()
        .get_connection()
        .unwrap();
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(500)
        .arg("WRITE")
        .query(&mut admin)
        .unwrap();
    assert!(poll(&mut calls[0], &wakes[0]).is_pending());
    std::thread::sleep(Duration::from_millis(50));
    assert!(poll(&mut calls[0], &wakes[0]).is_pending());
    let before: Vec<usize> = wakes.iter().map(|w| w.0.load(Ordering::SeqCst)).collect();
    let child = fork(|| {
        s.after_fork();
        for (i, w) in wakes.iter().enumerate() {
            if w.0.load(Ordering::SeqCst) == before[i] {
                return Err(format!("call {i} was not woken by after_fork"));
            }
        }
        for (i, c) in calls.iter_mut().enumerate() {
            match poll(c, &wakes[i]) {
                Poll::Ready(Err(e)) if e.contains("Unavailable") && e.contains("forked") => {}
                other => return Err(format!("call {i} in the child: {other:?}")),
            }
            if ran[i].load(Ordering::SeqCst) {
                return Err(format!("call {i}'s action ran in the child"));
            }
        }
        // The store itself works in the child (a read: Redis still holds writes).
        block_on(s.ping()).map_err(|e| format!("ping in the child: {e}"))
    });
    child.wait().unwrap();
    // In the parent the three calls go on: the claim leads once Redis takes writes
    // again, the waits get their leaders' results.
    let _: () = redis::cmd("SET")
        .arg(format!("{{{prefix}}}:resumed"))
        .arg(1)
        .query(&mut admin)
        .unwrap();
    let [c0, c1, c2] = calls;
    block_on(remote.complete(b"remote".to_vec())).unwrap();
    block_on(local.complete(b"local".to_vec())).unwrap();
    expect(
        "the claim in the parent",
        block_on(c0),
        b"ran-0",
        Source::Led,
    )
    .unwrap();
    expect(
        "the remote wait in the parent",
        block_on(c1),
        b"remote",
        Source::Joined,
    )
    .unwrap();
    expect(
        "the local wait in the parent",
        block_on(c2),
        b"local",
        Source::Joined,
    )
    .unwrap();
    assert!(!ran[1].load(Ordering::SeqCst) && !ran[2].load(Ordering::SeqCst));
}

/// Leads, replays and waits in a child (and a grandchild); the parent's store and the
/// child's results are the same afterwards.
fn child_uses_a_store_made_before_fork() {
    let prefix = format!("f{}", IdempotencyKey::random().as_str());
    let (s, other) = (store(&prefix), store(&prefix));
    warm_up(&s, &other);
    let (ka, kb, kg) = (key(), key(), key());
    let child = fork(|| {
        expect("lead in the child", run(&s, &ka, b"a"), b"a", Source::Led)?;
        expect(
            "replay in the child",
            run(&s, &ka, b"x"),
            b"a",
            Source::Replayed,
        )?;
        // A wait on another instance's lead, woken by this process's listener.
        let l = lead(&other, &kb);
        let waits = s.counters().remote_waits;
        std::thread::scope(|scope| {
            let waiter = scope.spawn(|| run(&s, &kb, b"never"));
            until("the child's waiter waits on Redis", || {
                s.counters().remote_waits > waits
            })?;
            block_on(l.complete(b"b".to_vec())).map_err(|e| format!("complete: {e}"))?;
            expect(
                "wait in the child",
                waiter.join().unwrap(),
                b"b",
                Source::Joined,
            )
        })?;
        fork(|| {
            expect(
                "lead in the grandchild",
                run(&s, &kg, b"g"),
                b"g",
                Source::Led,
            )
        })
        .wait()
    });
    child.wait().unwrap();
    // The parent's store still works, and sees what the child stored.
    expect("parent replay", run(&s, &ka, b"y"), b"a", Source::Replayed).unwrap();
    expect("parent replay", run(&s, &kb, b"y"), b"b", Source::Replayed).unwrap();
    expect("parent replay", run(&s, &kg, b"y"), b"g", Source::Replayed).unwrap();
    expect("parent lead", run(&s, &key(), b"p"), b"p", Source::Led).unwrap();
    warm_up(&s, &other);
}

/// The parent leads two keys when it forks. In the child, completing the copy of one
/// lease fails with LEASE_LOST and writes nothing, dropping the copy of the other
/// releases nothing, and a caller on the first key does not join the parent's
/// in-process flight (which never settles in the child): it waits for the parent in
/// Redis and gets the parent's result, without running its action.
fn parents_lease_and_flight_stay_the_parents() {
    let prefix = format!("f{}", IdempotencyKey::random().as_str());
    let (s, other) = (store(&prefix), store(&prefix));
    warm_up(&s, &other);
    let (ka, kb) = (key(), key());
    let (la, lb) = (lead(&s, &ka), lead(&s, &kb));
    let ready = format!("{{{prefix}}}:child-ready");
    let (la_parent, lb_parent) = (&la, &lb);
    let child = fork(|| {
        // SAFETY: the child's own copies of the parent's leases, each read once; the
        // originals are never used or dropped in the child, which `_exit`s.
        let (la, lb) = unsafe { (std::ptr::read(la_parent), std::ptr::read(lb_parent)) };
        let ran = AtomicBool::new(false);
        let waits = s.counters().remote_waits;
        std::thread::scope(|scope| {
            let waiter = scope.spawn(|| {
                block_on(s.execute(&ka, "f", || async {
                    ran.store(true, Ordering::SeqCst);
                    Ok(b"child".to_vec())
                }))
                .map_err(|e| format!("{e:?}"))
            });
            match block_on(la.complete(b"copy".to_vec())) {
                Err(Error::LeaseLost) => {}
                other => return Err(format!("completing the parent's lease: {other:?}")),
            }
            drop(lb);
            until("the child's caller waits on Redis", || {
                s.counters().remote_waits > waits
            })?;
            redis_set(&ready)?;
            expect(
                "the child's caller",
                waiter.join().unwrap(),
                b"parent",
                Source::Joined,
            )
        })?;
        if ran.load(Ordering::SeqCst) {
            return Err("the child's action ran".into());
        }
        Ok(())
    });
    // The parent completes once the child has done its worst and waits for the result.
    let end = Instant::now() + Duration::from_secs(CHILD_ALARM_SECS.into());
    while redis_get(&ready).is_none() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(5));
    }
    block_on(la.complete(b"parent".to_vec())).unwrap();
    child.wait().unwrap();
    // Still the parent's: neither released nor completed by the child.
    assert!(!lb.is_lost());
    block_on(lb.complete(b"parent-b".to_vec())).unwrap();
    expect(
        "parent replay",
        run(&s, &ka, b"y"),
        b"parent",
        Source::Replayed,
    )
    .unwrap();
    expect(
        "parent replay",
        run(&s, &kb, b"y"),
        b"parent-b",
        Source::Replayed,
    )
    .unwrap();
}

/// The parent leads a key and stops renewing it right after the fork. The child's own
/// lead outlives several leases (its renewer renews it), while the parent's lease,
/// which the child must not renew, expires and a caller in the child takes over.
fn child_renews_its_leases_not_the_parents() {
    let prefix = format!("f{}", IdempotencyKey::random().as_str());
    let (s, other) = (store(&prefix), store(&prefix));
    warm_up(&s, &other);
    let (kp, kc) = (key(), key());
    let lp = lead(&s, &kp);
    let child = fork(|| {
        std::thread::scope(|scope| {
            let long = scope.spawn(|| {
                block_on(s.execute(&kc, "f", || async {
                    std::thread::sleep(LEASE * 4);
                    Ok(b"long".to_vec())
                }))
                .map_err(|e| format!("{e:?}"))
            });
            expect(
                "takeover in the child",
                run(&s, &kp, b"taken"),
                b"taken",
                Source::Led,
            )?;
            expect(
                "the child's long lead",
                long.join().unwrap(),
                b"long",
                Source::Led,
            )
        })
    });
    lp.stop_renewing();
    child.wait().unwrap();
    match block_on(lp.complete(b"parent".to_vec())) {
        Err(Error::LeaseLost) => {}
        other => panic!("the parent's lease expired and was taken over, got {other:?}"),
    }
    expect(
        "parent replay",
        run(&s, &kp, b"y"),
        b"taken",
        Source::Replayed,
    )
    .unwrap();
    expect(
        "parent replay",
        run(&s, &kc, b"y"),
        b"long",
        Source::Replayed,
    )
    .unwrap();
}
