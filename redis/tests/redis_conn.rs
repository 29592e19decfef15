//! The store's connections under faults, through a TCP proxy written here (std::net and
//! threads) between the store and Redis: a reply lost after Redis ran the command, a
//! black-holed Redis, added latency, a cancelled claim or completion, and a Redis user
//! without pub/sub rights.
//!
//! Gated like `tests/redis.rs`: the tests that need a Redis are ignored unless run by
//! scripts/test-redis; the black-hole test needs none and always runs.

mod support;
use std::future::Future;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use futures::executor::block_on;
use oncely::{
    Begin, Code, Error, ExecuteError, ExecuteOptions, IdempotencyKey, LeaderLease, ScopedKey,
    Source,
};
use oncely_redis::RedisStore;
use support::url;

#[derive(Debug)]
struct Boom;

fn key() -> ScopedKey {
    ScopedKey::new("acme", "Pay", &IdempotencyKey::random()).unwrap()
}

fn fresh_prefix() -> String {
    format!("c{}", IdempotencyKey::random().as_str())
}

fn raw() -> redis::Connection {
    redis::Client::open(url())
        .unwrap()
        .get_connection()
        .unwrap()
}

/// `host:port` of the test's Redis.
fn redis_addr() -> String {
    let u = url();
    let rest = u.trim_start_matches("redis://");
    let host_port = rest.rsplit('@').next().unwrap_or(rest);
    host_port.split('/').next().unwrap_or(host_port).to_owned()
}

/// Runs `f` on a thread and fails the test if it takes longer than `limit` (a hang).
fn bounded<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => v,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("did not finish within {limit:?}: a hang")
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            panic!("the test failed (see the panic above)")
        }
    }
}

/// Polls `fut` once with a waker that does nothing.
fn poll_once<F: Future + Unpin>(fut: &mut F) -> Poll<F::Output> {
    let mut cx = Context::from_waker(Waker::noop());
    Pin::new(fut).poll(&mut cx)
}

/// What the proxy does with the traffic.
#[derive(Default)]
struct Faults {
    /// The next client chunk containing this is forwarded; Redis' reply to it is not
    /// relayed and the client connection is closed instead.
    drop_reply_to: Option<Vec<u8>>,
    /// Added before relaying each of Redis' replies.
    latency: Duration,
    /// Client writes longer than this many bytes are held this long before they are
    /// forwarded.
    slow_big_writes: Option<(usize, Duration)>,
    /// Connections that send SUBSCRIBE are closed at once (counted in
    /// [`Proxy::refused`]), as by a server or proxy that does not allow pub/sub.
    refuse_subscribe: bool,
    /// This many of the next connections accepted are closed at once.
    close_new: usize,
    /// This many of the next connections accepted answer their first command with
    /// `-LOADING` (as a Redis that restarted and reads its data) and are closed.
    loading_new: usize,
    /// Run when a reply is dropped, before the client's connection is closed (so
    /// before the client can send again): what other clients do in that gap.
    on_lost_reply: Option<Box<dyn FnOnce() + Send>>,
}

/// A TCP proxy in front of the test's Redis (or, with no upstream, a black hole that
/// accepts connections and never answers).
struct Proxy {
    port: u16,
    faults: Arc<Mutex<Faults>>,
    /// Replies dropped so far.
    dropped: Arc<AtomicUsize>,
    /// Connections closed for sending SUBSCRIBE so far.
    refused: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl Proxy {
    fn new(upstream: Option<String>) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let faults = Arc::new(Mutex::new(Faults::default()));
        let dropped = Arc::new(AtomicUsize::new(0));
        let refused = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        {
            let (faults, dropped, refused, stop) = (
                faults.clone(),
                dropped.clone(),
                refused.clone(),
                stop.clone(),
            );
            std::thread::spawn(move || {
                for client in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(client) = client else { continue };
                    {
                        let mut f = faults.lock().unwrap();
                        if f.close_new > 0 {
                            f.close_new -= 1;
                            continue;
                        }
                        if f.loading_new > 0 {
                            f.loading_new -= 1;
                            std::thread::spawn(move || {
                                let mut client = client;
                                let mut buf = [0u8; 4096];
                                if matches!(client.read(&mut buf), Ok(n) if n > 0) {
                                    let _ = client.write_all(
                                        b"-LOADING Redis is loading the dataset in memory\r\n",
                                    );
                                }
                            });
                            continue;
                        }
                    }
                    match &upstream {
                        None => {
                            // Read and never answer, until the client goes.
                            std::thread::spawn(move || {
                                let mut client = client;
                                let mut buf = [0u8; 4096];
                                while matches!(client.read(&mut buf), Ok(n) if n > 0) {}
                            });
                        }
                        Some(addr) => {
                            let Ok(server) = TcpStream::connect(addr) else {
                                continue;
                            };
                            pipe(
                                client,
                                server,
                                faults.clone(),
                                dropped.clone(),
                                refused.clone(),
                            );
                        }
                    }
                }
            });
        }
        Proxy {
            port,
            faults,
            dropped,
            refused,
            stop,
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn pipe(
    client: TcpStream,
    server: TcpStream,
    faults: Arc<Mutex<Faults>>,
    dropped: Arc<AtomicUsize>,
    refused: Arc<AtomicUsize>,
) {
    let drop_next_reply = Arc::new(AtomicBool::new(false));
    {
        let (mut from, mut to) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        let (faults, drop_next_reply) = (faults.clone(), drop_next_reply.clone());
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 1 << 16];
            loop {
                let n = match from.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                let hold = {
                    let mut f = faults.lock().unwrap();
                    if f.refuse_subscribe && buf[..n].windows(9).any(|w| w == b"SUBSCRIBE") {
                        refused.fetch_add(1, Ordering::SeqCst);
                        break;
                    }
                    if let Some(needle) = &f.drop_reply_to {
                        if buf[..n].windows(needle.len()).any(|w| w == &needle[..]) {
                            f.drop_reply_to = None;
                            drop_next_reply.store(true, Ordering::SeqCst);
                        }
                    }
                    f.slow_big_writes
                        .filter(|(over, _)| n > *over)
                        .map(|(_, hold)| hold)
                };
                if let Some(hold) = hold {
                    std::thread::sleep(hold);
                }
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            let _ = to.shutdown(Shutdown::Both);
            let _ = from.shutdown(Shutdown::Both);
        });
    }
    let (mut from, mut to) = (server, client);
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if drop_next_reply.swap(false, Ordering::SeqCst) {
                // Redis ran the command; its reply is lost with the connection.
                dropped.fetch_add(1, Ordering::SeqCst);
                let meanwhile = faults.lock().unwrap().on_lost_reply.take();
                if let Some(meanwhile) = meanwhile {
                    meanwhile();
                }
                break;
            }
            let latency = faults.lock().unwrap().latency;
            if !latency.is_zero() {
                std::thread::sleep(latency);
            }
            if to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Both);
        let _ = from.shutdown(Shutdown::Both);
    });
}

fn lead(
    b: Begin<Vec<u8>, Boom, oncely_redis::RedisLease<Boom>, oncely_redis::RedisJoin<Boom>>,
) -> oncely_redis::RedisLease<Boom> {
    match b {
        Begin::Lead(l) => l,
        other => panic!("expected to lead, got {other:?}"),
    }
}

/// A claim whose reply is lost after Redis ran it is resent on a fresh connection with
/// the same token: the claim finds its own token and leads, instead of waiting for its
/// own lease.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn resent_claim_leads() {
    bounded(Duration::from_secs(60), || {
        let proxy = Proxy::new(Some(redis_addr()));
        let s: RedisStore<Boom> = RedisStore::builder(proxy.url())
            .prefix(fresh_prefix())
            .lease(Duration::from_secs(20))
            .workers(1)
            .build()
            .unwrap();
        // Open the connection (and load the scripts) first: only a reused connection
        // is resent on.
        block_on(s.execute(&key(), "warm", || async { Ok(vec![1]) })).unwrap();
        let k = key();
        proxy.faults.lock().unwrap().drop_reply_to = Some(b"fp-resent-claim".to_vec());
        let t = Instant::now();
        let lease =
            lead(block_on(s.begin(&k, "fp-resent-claim", ExecuteOptions::default())).unwrap());
        assert_eq!(
            proxy.dropped.load(Ordering::SeqCst),
            1,
            "no reply was dropped"
        );
        assert_eq!(lease.generation(), 1);
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "took {:?}",
            t.elapsed()
        );
        let c = s.counters();
        assert_eq!((c.claims, c.leads, c.remote_waits), (2, 2, 0), "{c:?}");
        block_on(lease.complete(b"v".to_vec())).unwrap();
        let mut r = raw();
        let state: String = redis::cmd("HGET")
            .arg(s.record_key(&k))
            .arg("state")
            .query(&mut r)
            .unwrap();
        assert_eq!(state, "done");
    });
}

/// A claim whose reply is lost after Redis ran it, and whose resend cannot even
/// connect (the new connection is closed while it opens: the database is selected on
/// it), is a lost answer, not a call never sent: its own token is released, so the
/// key is not held for a lease by a claim nobody leads.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn lost_claim_whose_resend_cannot_connect_leaves_no_claim() {
    bounded(Duration::from_secs(60), || {
        let proxy = Proxy::new(Some(redis_addr()));
        let lease = Duration::from_secs(20);
        let s: RedisStore<Boom> = RedisStore::builder(format!("{}/1", proxy.url()))
            .prefix(fresh_prefix())
            .lease(lease)
            .workers(1)
            .build()
            .unwrap();
        let peer: RedisStore<Boom> = RedisStore::builder(format!("{}/1", url()))
            .prefix(s.prefix())
            .lease(lease)
            .build()
            .unwrap();
        // Only a reused connection is resent on.
        block_on(s.execute(&key(), "warm", || async { Ok(vec![1]) })).unwrap();
        let k = key();
        {
            let mut f = proxy.faults.lock().unwrap();
            f.drop_reply_to = Some(b"fp-lost-claim".to_vec());
            f.close_new = 1;
        }
        let err = block_on(s.begin(&k, "fp-lost-claim", ExecuteOptions::default())).unwrap_err();
        assert!(matches!(err, Error::Unavailable(_)), "{err:?}");
        assert_eq!(
            proxy.dropped.load(Ordering::SeqCst),
            1,
            "no reply was dropped"
        );
        assert_eq!(proxy.faults.lock().unwrap().close_new, 0, "no resend");
        let t = Instant::now();
        let ran = AtomicUsize::new(0);
        loop {
            let out = block_on(peer.execute_with(
                &k,
                "fp-lost-claim",
                ExecuteOptions { wait: false },
                || async {
                    ran.fetch_add(1, Ordering::SeqCst);
                    Ok(b"peer".to_vec())
                },
            ));
            match out {
                Ok(e) => {
                    assert_eq!((e.source, ran.load(Ordering::SeqCst)), (Source::Led, 1));
                    break;
                }
                Err(ExecuteError::Store(Error::InProgress { .. })) => {
                    assert!(
                        t.elapsed() < lease / 4,
                        "the lost claim still held the key after {:?}",
                        t.elapsed()
                    );
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("{e:?}"),
            }
        }
    });
}

/// A claim whose reply is lost after Redis ran it, and whose resend is refused with
/// an error (`LOADING`: Redis restarted), is a lost answer all the same: its own token
/// is released, so the key is not held for a lease by a claim nobody leads.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn lost_claim_whose_resend_is_refused_leaves_no_claim() {
    bounded(Duration::from_secs(60), || {
        let proxy = Proxy::new(Some(redis_addr()));
        let lease = Duration::from_secs(20);
        let s: RedisStore<Boom> = RedisStore::builder(proxy.url())
            .prefix(fresh_prefix())
            .lease(lease)
            .workers(1)
            .build()
            .unwrap();
        let peer: RedisStore<Boom> = RedisStore::builder(url())
            .prefix(s.prefix())
            .lease(lease)
            .build()
            .unwrap();
        // Only a reused connection is resent on.
        block_on(s.execute(&key(), "warm", || async { Ok(vec![1]) })).unwrap();
        let k = key();
        {
            let mut f = proxy.faults.lock().unwrap();
            f.drop_reply_to = Some(b"fp-lost-claim".to_vec());
            f.loading_new = 1;
        }
        let err = block_on(s.begin(&k, "fp-lost-claim", ExecuteOptions::default())).unwrap_err();
        assert!(matches!(err, Error::Unavailable(_)), "{err:?}");
        assert_eq!(
            proxy.dropped.load(Ordering::SeqCst),
            1,
            "no reply was dropped"
        );
        assert_eq!(proxy.faults.lock().unwrap().loading_new, 0, "no resend");
        let t = Instant::now();
        let ran = AtomicUsize::new(0);
        loop {
            let out = block_on(peer.execute_with(
                &k,
                "fp-lost-claim",
                ExecuteOptions { wait: false },
                || async {
                    ran.fetch_add(1, Ordering::SeqCst);
                    Ok(b"peer".to_vec())
                },
            ));
            match out {
                Ok(e) => {
                    assert_eq!((e.source, ran.load(Ordering::SeqCst)), (Source::Led, 1));
                    break;
                }
                Err(ExecuteError::Store(Error::InProgress { .. })) => {
                    assert!(
                        t.elapsed() < lease / 4,
                        "the lost claim still held the key after {:?}",
                        t.elapsed()
                    );
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("{e:?}"),
            }
        }
    });
}

/// A large completion to a Redis that takes its bytes slowly (a slow link) still ends
/// within about the I/O timeout: the socket's write timeout bounds each write call,
/// not the whole write, and a write that keeps making a little progress must not
/// hold the caller for as long as the bytes take.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn large_write_to_a_slow_link_ends_by_the_io_timeout() {
    bounded(Duration::from_secs(120), || {
        let proxy = Proxy::new(Some(redis_addr()));
        let io_timeout = Duration::from_millis(500);
        let s: RedisStore<Boom> = RedisStore::builder(proxy.url())
            .prefix(fresh_prefix())
            .lease(Duration::from_secs(20))
            .io_timeout(io_timeout)
            .workers(1)
            .build()
            .unwrap();
        let k = key();
        let lease = lead(block_on(s.begin(&k, "f", ExecuteOptions::default())).unwrap());
        // 64 KiB every 100 ms gets through: the 16 MiB result takes many seconds.
        proxy.faults.lock().unwrap().slow_big_writes =
            Some((16 * 1024, Duration::from_millis(100)));
        let t = Instant::now();
        let r = block_on(lease.complete(vec![b'x'; 16 << 20]));
        let took = t.elapsed();
        proxy.faults.lock().unwrap().slow_big_writes = None;
        assert!(r.is_err(), "the completion got through in {took:?}");
        assert!(
            took < io_timeout * 4,
            "the completion failed only after {took:?} (I/O timeout {io_timeout:?})"
        );
    });
}

/// Completions and releases resent after a lost reply are harmless: the completion
/// still counts as stored, and a second release leaves a new leader's record alone.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn resent_complete_and_release_are_idempotent() {
    bounded(Duration::from_secs(60), || {
        let proxy = Proxy::new(Some(redis_addr()));
        let s: RedisStore<Boom> = RedisStore::builder(proxy.url())
            .prefix(fresh_prefix())
            .lease(Duration::from_secs(20))
            .workers(1)
            .build()
            .unwrap();
        block_on(s.execute(&key(), "warm", || async { Ok(vec![1]) })).unwrap();
        let k = key();
        let lease = lead(block_on(s.begin(&k, "f", ExecuteOptions::default())).unwrap());
        proxy.faults.lock().unwrap().drop_reply_to = Some(b"value-resent-complete".to_vec());
        block_on(lease.complete(b"value-resent-complete".to_vec())).unwrap();
        assert_eq!(proxy.dropped.load(Ordering::SeqCst), 1);
        let again = block_on(s.execute(&k, "f", || async { Ok(b"again".to_vec()) })).unwrap();
        assert_eq!(
            (again.value.as_slice(), again.source),
            (&b"value-resent-complete"[..], Source::Replayed)
        );

        let k = key();
        let lease =
            lead(block_on(s.begin(&k, "fp-resent-release", ExecuteOptions::default())).unwrap());
        let rk = s.record_key(&k);
        proxy.faults.lock().unwrap().drop_reply_to = Some(rk.clone().into_bytes());
        let _ = block_on(lease.fail(Boom));
        assert_eq!(proxy.dropped.load(Ordering::SeqCst), 2);
        let exists: i64 = redis::cmd("EXISTS").arg(&rk).query(&mut raw()).unwrap();
        assert_eq!(exists, 0, "the failed leader's record is released");
    });
}

/// A store through the proxy on one connection, opened first (only a reused connection
/// is resent on) and with the removal's scripts loaded (so the reply that is lost is
/// not a NOSCRIPT), with an I/O timeout that leaves room for what happens while a reply
/// is lost.
fn resending_store(proxy: &Proxy, prefix: &str) -> RedisStore<Boom> {
    let s: RedisStore<Boom> = RedisStore::builder(proxy.url())
        .prefix(prefix)
        .lease(Duration::from_secs(20))
        .io_timeout(Duration::from_secs(5))
        .workers(1)
        .build()
        .unwrap();
    let warm = key();
    block_on(s.execute(&warm, "warm", || async { Ok(vec![1]) })).unwrap();
    assert!(block_on(s.remove(&warm)).unwrap());
    s
}

/// A direct store (no proxy) on `prefix`; each is a process of its own (its own
/// in-process tier).
fn direct_store(prefix: &str) -> RedisStore<Boom> {
    RedisStore::builder(url())
        .prefix(prefix)
        .lease(Duration::from_secs(20))
        .build()
        .unwrap()
}

/// A removal whose reply is lost after Redis deleted the record, while another caller
/// claims the key anew and completes it, is resent: the resend leaves the new record
/// alone (its result is replayed, the action does not run again) and answers false.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn resent_remove_leaves_a_record_made_meanwhile() {
    bounded(Duration::from_secs(60), || {
        let proxy = Proxy::new(Some(redis_addr()));
        let p = fresh_prefix();
        let s = resending_store(&proxy, &p);
        let k = key();
        block_on(direct_store(&p).execute(&k, "fp", || async { Ok(b"old".to_vec()) })).unwrap();
        let ran_new = Arc::new(AtomicUsize::new(0));
        {
            let (newcomer, k, ran_new) = (direct_store(&p), k.clone(), ran_new.clone());
            let mut f = proxy.faults.lock().unwrap();
            // Only the deletion carries the record's channel.
            f.drop_reply_to = Some(format!("{}:done", s.record_key(&k)).into_bytes());
            f.on_lost_reply = Some(Box::new(move || {
                let done = block_on(newcomer.execute(&k, "fp", || async {
                    ran_new.fetch_add(1, Ordering::SeqCst);
                    Ok(b"new".to_vec())
                }))
                .unwrap();
                assert_eq!(done.source, Source::Led, "the record was not deleted");
            }));
        }
        let removed = block_on(s.remove(&k)).unwrap();
        assert_eq!(
            proxy.dropped.load(Ordering::SeqCst),
            1,
            "no reply was dropped"
        );
        assert_eq!(ran_new.load(Ordering::SeqCst), 1);
        let ran = AtomicUsize::new(0);
        let again = block_on(direct_store(&p).execute(&k, "fp", || async {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok(b"third".to_vec())
        }))
        .unwrap();
        assert_eq!(
            (
                again.value.as_slice(),
                again.source,
                ran.load(Ordering::SeqCst)
            ),
            (&b"new"[..], Source::Replayed, 0),
            "the resent removal deleted the record made meanwhile"
        );
        assert!(!removed, "the new record was reported removed");
    });
}

/// A removal whose reply is lost after Redis deleted the record is resent, finds the
/// record gone, and answers true: this call deleted it.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn resent_remove_reports_its_deletion() {
    bounded(Duration::from_secs(60), || {
        let proxy = Proxy::new(Some(redis_addr()));
        let p = fresh_prefix();
        let s = resending_store(&proxy, &p);
        let k = key();
        block_on(direct_store(&p).execute(&k, "fp", || async { Ok(b"old".to_vec()) })).unwrap();
        proxy.faults.lock().unwrap().drop_reply_to =
            Some(format!("{}:done", s.record_key(&k)).into_bytes());
        assert!(
            block_on(s.remove(&k)).unwrap(),
            "the deletion was not reported"
        );
        assert_eq!(
            proxy.dropped.load(Ordering::SeqCst),
            1,
            "no reply was dropped"
        );
        let exists: i64 = redis::cmd("EXISTS")
            .arg(s.record_key(&k))
            .query(&mut raw())
            .unwrap();
        assert_eq!(exists, 0);
    });
}

/// A completion whose future is polled once and dropped (the caller cancelled while
/// completing) is never overtaken by a release of the same token: the record ends
/// completed, and no second action runs.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn cancelled_completion_is_not_overtaken_by_release() {
    bounded(Duration::from_secs(60), || {
        // The completion's large write is held up in the proxy: a release sent after it
        // on another connection would reach Redis first.
        let proxy = Proxy::new(Some(redis_addr()));
        let s: RedisStore<Boom> = RedisStore::builder(proxy.url())
            .prefix(fresh_prefix())
            .lease(Duration::from_secs(20))
            .workers(4)
            .build()
            .unwrap();
        let peer: RedisStore<Boom> = RedisStore::builder(url())
            .prefix(s.prefix())
            .lease(Duration::from_secs(20))
            .build()
            .unwrap();
        proxy.faults.lock().unwrap().slow_big_writes =
            Some((16 * 1024, Duration::from_millis(300)));
        for round in 0..3 {
            let k = key();
            let lease = lead(block_on(s.begin(&k, "f", ExecuteOptions::default())).unwrap());
            let value = vec![b'x'; 48 * 1024 + round];
            let mut completing = Box::pin(lease.complete(value.clone()));
            assert!(poll_once(&mut completing).is_pending());
            drop(completing);
            // Let everything sent reach Redis.
            std::thread::sleep(Duration::from_millis(1200));
            let state: Option<String> = redis::cmd("HGET")
                .arg(s.record_key(&k))
                .arg("state")
                .query(&mut raw())
                .unwrap();
            assert_eq!(
                state.as_deref(),
                Some("done"),
                "round {round}: released, not completed"
            );
            let ran = AtomicUsize::new(0);
            let r = block_on(peer.execute(&k, "f", || async {
                ran.fetch_add(1, Ordering::SeqCst);
                Ok(vec![])
            }))
            .unwrap();
            assert_eq!(
                (r.source, ran.load(Ordering::SeqCst)),
                (Source::Replayed, 0)
            );
            assert_eq!(r.value, value);
        }
    });
}

/// A `begin` cancelled at any point leaves no claim behind: another caller leads at
/// once, not after the lease.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn cancelled_begin_leaves_no_claim() {
    bounded(Duration::from_secs(120), || {
        let lease = Duration::from_secs(10);
        let s: RedisStore<Boom> = RedisStore::builder(url())
            .prefix(fresh_prefix())
            .lease(lease)
            .build()
            .unwrap();
        let peer: RedisStore<Boom> = RedisStore::builder(url())
            .prefix(s.prefix())
            .lease(lease)
            .build()
            .unwrap();
        // Where the caller goes away: before the first poll, right after sending the
        // claim, after its answer arrived but before it was read, after it was read.
        for point in 0..4 {
            for _ in 0..3 {
                let k = key();
                let mut begin = Box::pin(s.begin(&k, "f", ExecuteOptions::default()));
                // (On a busy machine the first poll may already find the answer: that
                // round then drops a lease, as at the last point.)
                match point {
                    0 => {}
                    1 => {
                        if let Poll::Ready(b) = poll_once(&mut begin) {
                            drop(lead(b.unwrap()));
                        }
                    }
                    2 => {
                        if let Poll::Ready(b) = poll_once(&mut begin) {
                            drop(lead(b.unwrap()));
                        }
                        std::thread::sleep(Duration::from_millis(300));
                    }
                    _ => {
                        let t = Instant::now();
                        loop {
                            match poll_once(&mut begin) {
                                Poll::Ready(b) => {
                                    drop(lead(b.unwrap()));
                                    break;
                                }
                                Poll::Pending => std::thread::sleep(Duration::from_millis(1)),
                            }
                            assert!(t.elapsed() < Duration::from_secs(5));
                        }
                    }
                }
                drop(begin);
                let t = Instant::now();
                let ran = AtomicUsize::new(0);
                let r = block_on(peer.execute(&k, "f", || async {
                    ran.fetch_add(1, Ordering::SeqCst);
                    Ok(b"peer".to_vec())
                }))
                .unwrap();
                assert_eq!((r.source, ran.load(Ordering::SeqCst)), (Source::Led, 1));
                assert!(
                    t.elapsed() < lease / 4,
                    "cancelled at point {point}: the next caller led only after {:?}",
                    t.elapsed()
                );
                // The same instance leads again too (its local tier is free).
                let again = block_on(s.execute(&k, "f", || async { Ok(b"x".to_vec()) })).unwrap();
                assert_eq!(again.value, b"peer");
            }
        }
    });
}

/// Many threads cancel `begin` at random points on one store while its workers are
/// busy: afterwards every key is free for another instance at once.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn cancelled_begins_under_load_leave_no_claim() {
    bounded(Duration::from_secs(120), || {
        let lease = Duration::from_secs(10);
        let s: RedisStore<Boom> = RedisStore::builder(url())
            .prefix(fresh_prefix())
            .lease(lease)
            .workers(2)
            .build()
            .unwrap();
        let peer: RedisStore<Boom> = RedisStore::builder(url())
            .prefix(s.prefix())
            .lease(lease)
            .build()
            .unwrap();
        let threads = 8;
        let per_thread = 40;
        let keys: Vec<Vec<ScopedKey>> = (0..threads)
            .map(|_| (0..per_thread).map(|_| key()).collect())
            .collect();
        let hs: Vec<_> = keys
            .iter()
            .enumerate()
            .map(|(t, ks)| {
                let (s, ks) = (s.clone(), ks.clone());
                std::thread::spawn(move || {
                    for (i, k) in ks.iter().enumerate() {
                        let mut begin = Box::pin(s.begin(k, "f", ExecuteOptions::default()));
                        // 0 to 3 polls, some with a pause that lets the answer arrive.
                        for p in 0..(t + i) % 4 {
                            if let Poll::Ready(b) = poll_once(&mut begin) {
                                drop(lead(b.unwrap()));
                                break;
                            }
                            if (p + i) % 2 == 0 {
                                std::thread::sleep(Duration::from_millis(2));
                            }
                        }
                        drop(begin);
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        let t = Instant::now();
        for k in keys.iter().flatten() {
            let r = block_on(peer.execute(k, "f", || async { Ok(b"peer".to_vec()) })).unwrap();
            assert_eq!(r.source, Source::Led);
        }
        assert!(
            t.elapsed() < lease / 2,
            "{} keys took {:?}: some waited for an orphaned claim",
            threads * per_thread,
            t.elapsed()
        );
    });
}

/// A black-holed Redis (connections accepted, never answered) with many concurrent
/// callers: each ends with UNAVAILABLE within about one I/O timeout, whatever its place
/// in the queue, and no action runs.
#[test]
fn black_holed_redis_fails_every_caller_within_the_io_timeout() {
    bounded(Duration::from_secs(60), || {
        let proxy = Proxy::new(None);
        let io = Duration::from_millis(300);
        let s: RedisStore<Boom> = RedisStore::builder(proxy.url())
            .io_timeout(io)
            .connect_timeout(io)
            .workers(4)
            .build()
            .unwrap();
        let n = 48;
        let ran = Arc::new(AtomicUsize::new(0));
        let barrier = Arc::new(Barrier::new(n));
        let callers: Vec<_> = (0..n)
            .map(|i| {
                let (s, ran, barrier) = (s.clone(), ran.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    let t = Instant::now();
                    let options = if i % 2 == 0 {
                        ExecuteOptions::default()
                    } else {
                        ExecuteOptions::NO_WAIT
                    };
                    let r = block_on(s.execute_with(&key(), "f", options, || async {
                        ran.fetch_add(1, Ordering::SeqCst);
                        Ok(vec![])
                    }));
                    (t.elapsed(), r)
                })
            })
            .collect();
        let mut slowest = Duration::ZERO;
        let mut not_sent = 0;
        for c in callers {
            let (took, r) = c.join().unwrap();
            match r {
                Err(ExecuteError::Store(e)) => {
                    assert_eq!(e.code(), Code::Unavailable, "{e}");
                    if e.to_string().contains("not sent") {
                        not_sent += 1;
                    }
                }
                other => panic!("expected UNAVAILABLE, got {other:?}"),
            }
            slowest = slowest.max(took);
        }
        eprintln!("{n} callers on 4 workers, I/O timeout {io:?}: slowest {slowest:?}, {not_sent} not sent");
        assert_eq!(
            ran.load(Ordering::SeqCst),
            0,
            "an action ran without a claim"
        );
        assert!(
            slowest < io + Duration::from_millis(500),
            "a caller waited {slowest:?} (I/O timeout {io:?})"
        );
    });
}

/// Many leases renewed through a slow link: renewals go in one round trip, so each
/// lease is renewed in time and no healthy leader is taken over.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn slow_renewals_do_not_delay_each_other() {
    bounded(Duration::from_secs(60), || {
        let proxy = Proxy::new(Some(redis_addr()));
        let lease = Duration::from_millis(900);
        let s: RedisStore<Boom> = RedisStore::builder(proxy.url())
            .prefix(fresh_prefix())
            .lease(lease)
            .io_timeout(Duration::from_millis(300))
            .build()
            .unwrap();
        let peer: RedisStore<Boom> = RedisStore::builder(url())
            .prefix(s.prefix())
            .lease(lease)
            .build()
            .unwrap();
        let n = 40;
        let keys: Vec<_> = (0..n).map(|_| key()).collect();
        let leases: Vec<_> = keys
            .iter()
            .map(|k| lead(block_on(s.begin(k, "f", ExecuteOptions::default())).unwrap()))
            .collect();
        // Each reply now takes 40 ms: renewing 40 leases one after another would take
        // 1.6 s, longer than the lease.
        proxy.faults.lock().unwrap().latency = Duration::from_millis(40);
        std::thread::sleep(lease * 2);
        for (k, l) in keys.iter().zip(&leases) {
            assert!(
                !l.is_lost(),
                "a lease was lost while its leader was healthy"
            );
            match block_on(
                peer.execute_with(k, "f", ExecuteOptions::NO_WAIT, || async {
                    Ok(b"second".to_vec())
                }),
            ) {
                Err(ExecuteError::Store(e)) => assert_eq!(e.code(), Code::Aborted, "{e}"),
                other => panic!("a healthy lease was taken over: {other:?}"),
            }
        }
        proxy.faults.lock().unwrap().latency = Duration::ZERO;
        for l in leases {
            block_on(l.complete(b"first".to_vec())).unwrap();
        }
        assert_eq!(peer.counters().takeovers, 0);
    });
}

/// Sum of the ACL LOG counts of `user`'s denials.
fn acl_denials(user: &str) -> i64 {
    let log: Vec<redis::Value> = redis::cmd("ACL").arg("LOG").query(&mut raw()).unwrap();
    let mut total = 0;
    for entry in log {
        let fields: Vec<(String, redis::Value)> = match entry {
            redis::Value::Array(items) => items
                .chunks(2)
                .filter_map(|kv| {
                    let k: String = redis::from_redis_value_ref(&kv[0]).ok()?;
                    Some((k, kv.get(1)?.clone()))
                })
                .collect(),
            redis::Value::Map(items) => items
                .into_iter()
                .filter_map(|(k, v)| Some((redis::from_redis_value_ref(&k).ok()?, v)))
                .collect(),
            _ => continue,
        };
        let get = |name: &str| {
            fields
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        };
        let who: Option<String> =
            get("username").and_then(|v| redis::from_redis_value_ref(&v).ok());
        if who.as_deref() == Some(user) {
            total += get("count")
                .and_then(|v| redis::from_redis_value_ref::<i64>(&v).ok())
                .unwrap_or(1);
        }
    }
    total
}

/// A Redis user without rights on any channel: completing stores the result and
/// succeeds (the notification is best effort), waiters on another instance get the
/// value by polling, a failure still releases, and the listener backs off instead of
/// reconnecting in a tight loop.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn user_without_channel_rights_completes() {
    bounded(Duration::from_secs(60), || {
        let user = format!("oncely-{}", IdempotencyKey::random().as_str());
        let _: () = redis::cmd("ACL")
            .arg(&[
                "SETUSER",
                user.as_str(),
                "on",
                ">secret",
                "~*",
                "resetchannels",
                "+@all",
            ])
            .query(&mut raw())
            .unwrap();
        let acl_url = format!("redis://{user}:secret@{}", redis_addr());
        let build = |prefix: &str| -> RedisStore<Boom> {
            RedisStore::builder(acl_url.clone())
                .prefix(prefix)
                .lease(Duration::from_secs(5))
                .poll_interval(Duration::from_millis(10), Duration::from_millis(100))
                .build()
                .unwrap()
        };
        let a = build(&fresh_prefix());
        let b = build(a.prefix());
        let k = key();
        let lease = lead(block_on(a.begin(&k, "f", ExecuteOptions::default())).unwrap());
        let waiter = {
            let (b, k) = (b.clone(), k.clone());
            std::thread::spawn(move || {
                block_on(b.execute(&k, "f", || async { Ok(b"no".to_vec()) }))
            })
        };
        // The waiter's listener tries to subscribe meanwhile, and is refused.
        std::thread::sleep(Duration::from_millis(2000));
        block_on(lease.complete(b"yes".to_vec())).expect("a stored result is a completion");
        let r = waiter.join().unwrap().unwrap();
        assert_eq!(
            (r.value.as_slice(), r.source),
            (&b"yes"[..], Source::Joined)
        );
        let attempts = acl_denials(&user);
        eprintln!("subscription attempts refused in about 2 s: {attempts}");
        assert!(attempts >= 1, "the listener never tried to subscribe");
        assert!(
            attempts <= 12,
            "{attempts} refused subscriptions: the listener does not back off"
        );

        let k = key();
        let r = block_on(a.execute(&k, "f", || async { Err::<Vec<u8>, _>(Boom) }));
        assert!(matches!(r, Err(ExecuteError::Action(_))), "{r:?}");
        let r = block_on(b.execute(&k, "f", || async { Ok(b"after".to_vec()) })).unwrap();
        assert_eq!(r.source, Source::Led);
        drop((a, b));
        let _: () = redis::cmd("ACL")
            .arg(&["DELUSER", user.as_str()])
            .query(&mut raw())
            .unwrap();
    });
}

/// A listener whose subscriptions are refused (the connection closed) backs off
/// instead of reconnecting in a tight loop; waiters still get the value by polling.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn refused_subscriptions_back_off() {
    bounded(Duration::from_secs(60), || {
        let proxy = Proxy::new(Some(redis_addr()));
        proxy.faults.lock().unwrap().refuse_subscribe = true;
        let a: RedisStore<Boom> = RedisStore::builder(url())
            .prefix(fresh_prefix())
            .lease(Duration::from_secs(5))
            .build()
            .unwrap();
        let b: RedisStore<Boom> = RedisStore::builder(proxy.url())
            .prefix(a.prefix())
            .lease(Duration::from_secs(5))
            .poll_interval(Duration::from_millis(10), Duration::from_millis(100))
            .build()
            .unwrap();
        let k = key();
        let lease = lead(block_on(a.begin(&k, "f", ExecuteOptions::default())).unwrap());
        let waiter = {
            let (b, k) = (b.clone(), k.clone());
            std::thread::spawn(move || {
                block_on(b.execute(&k, "f", || async { Ok(b"no".to_vec()) }))
            })
        };
        std::thread::sleep(Duration::from_millis(2000));
        let refused = proxy.refused.load(Ordering::SeqCst);
        block_on(lease.complete(b"yes".to_vec())).unwrap();
        let r = waiter.join().unwrap().unwrap();
        assert_eq!(
            (r.value.as_slice(), r.source),
            (&b"yes"[..], Source::Joined)
        );
        eprintln!("listener connections refused in 2 s: {refused}");
        assert!(refused >= 1, "the listener never tried to subscribe");
        assert!(
            refused <= 10,
            "{refused} refused connections in 2 s: no back-off"
        );
    });
}

/// The lease is checked against the I/O timeout when the store is built.
#[test]
fn lease_shorter_than_three_io_timeouts_is_invalid() {
    let e = RedisStore::<Boom>::builder("redis://127.0.0.1:1")
        .lease(Duration::from_secs(2))
        .io_timeout(Duration::from_secs(1))
        .build()
        .unwrap_err();
    match &e {
        Error::InvalidArgument { field, reason } => {
            assert_eq!(*field, "lease");
            assert!(reason.contains("io_timeout"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(e.code(), Code::InvalidArgument);
    RedisStore::<Boom>::builder("redis://127.0.0.1:1")
        .lease(Duration::from_secs(3))
        .io_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    // Unset, the I/O timeout follows a short lease.
    RedisStore::<Boom>::builder("redis://127.0.0.1:1")
        .lease(Duration::from_millis(300))
        .build()
        .unwrap();
}

/// A claim that Redis ran but whose reply came too late (past the I/O timeout) fails
/// with UNAVAILABLE; the claim it left is released at once, so another instance leads
/// without waiting out the lease.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn timed_out_claim_leaves_no_claim() {
    bounded(Duration::from_secs(60), || {
        let proxy = Proxy::new(Some(redis_addr()));
        let lease = Duration::from_secs(20);
        let io_timeout = Duration::from_millis(300);
        let s: RedisStore<Boom> = RedisStore::builder(proxy.url())
            .prefix(fresh_prefix())
            .lease(lease)
            .io_timeout(io_timeout)
            .build()
            .unwrap();
        let peer: RedisStore<Boom> = RedisStore::builder(url())
            .prefix(s.prefix())
            .lease(lease)
            .build()
            .unwrap();
        block_on(s.execute(&key(), "warm", || async { Ok(vec![1]) })).unwrap();
        let k = key();
        proxy.faults.lock().unwrap().latency = io_timeout * 2;
        let err = block_on(s.begin(&k, "f", ExecuteOptions::default())).unwrap_err();
        assert!(matches!(err, Error::Unavailable(_)), "{err:?}");
        proxy.faults.lock().unwrap().latency = Duration::ZERO;
        let mut r = raw();
        let token: Option<String> = redis::cmd("HGET")
            .arg(s.record_key(&k))
            .arg("token")
            .query(&mut r)
            .unwrap();
        let t = Instant::now();
        let ran = AtomicUsize::new(0);
        loop {
            let out =
                block_on(
                    peer.execute_with(&k, "f", ExecuteOptions { wait: false }, || async {
                        ran.fetch_add(1, Ordering::SeqCst);
                        Ok(b"peer".to_vec())
                    }),
                );
            match out {
                Ok(e) => {
                    assert_eq!((e.source, ran.load(Ordering::SeqCst)), (Source::Led, 1));
                    break;
                }
                Err(ExecuteError::Store(Error::InProgress { .. })) => {
                    assert!(
                        t.elapsed() < lease / 4,
                        "the timed-out claim (token {token:?}) still held the key after {:?}",
                        t.elapsed()
                    );
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("{e:?}"),
            }
        }
    });
}

/// `execute_blocking` sends from the caller's own thread on a direct connection: a
/// black-holed Redis still fails each caller within about one I/O timeout, and no
/// action runs without a claim.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn black_holed_redis_fails_blocking_callers_within_the_io_timeout() {
    bounded(Duration::from_secs(60), || {
        let proxy = Proxy::new(None);
        let io = Duration::from_millis(300);
        let s: RedisStore<Boom> = RedisStore::builder(proxy.url())
            .io_timeout(io)
            .connect_timeout(io)
            .workers(2)
            .build()
            .unwrap();
        let n = 12;
        let ran = Arc::new(AtomicUsize::new(0));
        let barrier = Arc::new(Barrier::new(n));
        let callers: Vec<_> = (0..n)
            .map(|_| {
                let (s, ran, barrier) = (s.clone(), ran.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    let t = Instant::now();
                    let r = s.execute_blocking(&key(), "f", ExecuteOptions::default(), || {
                        ran.fetch_add(1, Ordering::SeqCst);
                        Ok(vec![])
                    });
                    (t.elapsed(), r)
                })
            })
            .collect();
        let mut slowest = Duration::ZERO;
        for c in callers {
            let (took, r) = c.join().unwrap();
            match r {
                Err(ExecuteError::Store(e)) => assert_eq!(e.code(), Code::Unavailable, "{e}"),
                other => panic!("expected UNAVAILABLE, got {other:?}"),
            }
            slowest = slowest.max(took);
        }
        assert_eq!(
            ran.load(Ordering::SeqCst),
            0,
            "an action ran without a claim"
        );
        assert!(
            slowest < io + Duration::from_millis(500),
            "a caller waited {slowest:?} (I/O timeout {io:?})"
        );
    });
}
