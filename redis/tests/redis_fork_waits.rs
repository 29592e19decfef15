//! Remote waits copied by `fork()` end in the child without taking a lock a parent
//! thread may have held at the fork: a wait the parent had pending (its listener on the
//! parent's event), and a join the parent took from `begin` but had not polled yet (its
//! subscription on the parent's notifier). At the fork, the parent's pub/sub listener
//! thread is inside a notification (holding the notifier's state lock and the event's
//! lock while it calls the waiter's waker, which is made slow to hold that window open
//! for seconds). Before the fix, the child hung on those locks (killed by its alarm).
//!
//! Its own test binary with one test (see `tests/redis_fork.rs`). Gated like
//! `tests/redis.rs`: ignored unless run by scripts/test-redis.

mod support;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use futures::executor::block_on;
use oncely::{Begin, ExecuteOptions, IdempotencyKey, Joined, LeaderLease, ScopedKey};
use oncely_redis::RedisStore;
use support::url;

type Store = RedisStore<std::io::Error>;

static PARENT: AtomicU32 = AtomicU32::new(0);
static ARMED: AtomicBool = AtomicBool::new(false);
static IN_WAKE: AtomicBool = AtomicBool::new(false);

/// In the parent, once armed, the waker stays in `wake` for 3 s (as a waker that waits
/// for a lock of its own would): the notifying thread holds its locks meanwhile.
struct SlowWaker;
impl Wake for SlowWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        if std::process::id() == PARENT.load(Ordering::SeqCst) && ARMED.load(Ordering::SeqCst) {
            IN_WAKE.store(true, Ordering::SeqCst);
            std::thread::sleep(Duration::from_secs(3));
        }
    }
}

fn key() -> ScopedKey {
    ScopedKey::new("acme", "Pay", &IdempotencyKey::random()).unwrap()
}

fn store(prefix: &str, poll: Duration) -> Store {
    RedisStore::builder(url())
        .prefix(prefix)
        .lease(Duration::from_secs(30))
        .poll_interval(poll, poll)
        .build()
        .unwrap()
}

/// Whether `r` is the child's "in flight at fork" answer.
fn forked(r: &str) -> bool {
    r.contains("forked")
}

#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn waits_copied_by_fork_end_in_the_child_without_the_parents_locks() {
    PARENT.store(std::process::id(), Ordering::SeqCst);
    let prefix = format!("fw{}", IdempotencyKey::random().as_str());
    // The waiters poll every 60 s: woken only by messages.
    let s = store(&prefix, Duration::from_secs(60));
    let other = store(&prefix, Duration::from_millis(10));
    let lead = |k: &ScopedKey| match block_on(other.begin(k, "f", ExecuteOptions::default())) {
        Ok(Begin::Lead(l)) => l,
        r => panic!("expected to lead, got {:?}", r.map(|_| "not a lead")),
    };
    // A wait driven until it sleeps on its listener.
    let k = key();
    let lease = lead(&k);
    let channel = format!("{}:done", s.record_key(&k));
    let mut call: Pin<Box<dyn Future<Output = _>>> =
        Box::pin(s.execute(&k, "f", || async { Ok(b"never".to_vec()) }));
    // A join taken, not polled.
    let k2 = key();
    let lease2 = lead(&k2);
    let Ok(Begin::Join(mut join2)) = block_on(s.begin(&k2, "f", ExecuteOptions::default())) else {
        panic!("expected to join")
    };
    let waker = Waker::from(Arc::new(SlowWaker));
    let mut cx = Context::from_waker(&waker);
    let mut admin = redis::Client::open(url())
        .unwrap()
        .get_connection()
        .unwrap();
    let end = Instant::now() + Duration::from_secs(1);
    while Instant::now() < end {
        assert!(call.as_mut().poll(&mut cx).is_pending());
        std::thread::sleep(Duration::from_millis(5));
    }
    let (_, n): (String, i64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(&channel)
        .query(&mut admin)
        .unwrap();
    assert_eq!(n, 1, "the listener subscribed to the channel");
    // A stray message: the listener thread notifies the wait and calls its waker under
    // its locks; the fork comes while it is in there.
    ARMED.store(true, Ordering::SeqCst);
    let _: i64 = redis::cmd("PUBLISH")
        .arg(&channel)
        .arg("stray")
        .query(&mut admin)
        .unwrap();
    let end = Instant::now() + Duration::from_secs(5);
    while !IN_WAKE.load(Ordering::SeqCst) {
        assert!(Instant::now() < end, "the listener never woke the waiter");
        std::thread::sleep(Duration::from_millis(1));
    }
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        unsafe { libc::alarm(10) };
        s.after_fork();
        let mut cx = Context::from_waker(Waker::noop());
        let join = match Pin::new(&mut join2).poll(&mut cx) {
            Poll::Ready(Joined::Error(e)) => forked(&format!("{e:?}")),
            _ => false,
        };
        let wait = match call.as_mut().poll(&mut cx) {
            Poll::Ready(Err(e)) => forked(&format!("{e:?}")),
            _ => false,
        };
        unsafe { libc::_exit(if join && wait { 0 } else { 1 }) }
    }
    let mut status = 0;
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    // The parent's waits go on and get their results.
    ARMED.store(false, Ordering::SeqCst);
    block_on(lease.complete(b"yes".to_vec())).unwrap();
    assert_eq!(block_on(call).unwrap().value, b"yes");
    block_on(lease2.complete(b"two".to_vec())).unwrap();
    match block_on(join2) {
        Joined::Value(v) => assert_eq!(v, b"two"),
        other => panic!("the parent's join: {other:?}"),
    }
    assert!(
        !libc::WIFSIGNALED(status),
        "the child hung on the parent's locks (killed by signal {})",
        libc::WTERMSIG(status)
    );
    assert_eq!(
        libc::WEXITSTATUS(status),
        0,
        "the child's copies did not end as in flight at fork"
    );
}
