//! A signal delivered while the store waits for a reply (a child process exiting sends
//! SIGCHLD; Node and Python servers spawn children) interrupts the blocking read with
//! EINTR: a socket with a read timeout is never restarted, whatever the handler's
//! flags. Nothing is wrong with Redis, so the call is sent again on a new connection
//! instead of failing UNAVAILABLE, on one node as on a Cluster. No Redis needed:
//! scripted servers answer.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use oncely::{ExecuteOptions, IdempotencyKey, ScopedKey, Source};
use oncely_redis::RedisStore;

extern "C" fn ignore(_: libc::c_int) {}

/// Gives SIGUSR1 a handler without SA_RESTART, as the runtimes that reap children
/// install.
fn handle_sigusr1_without_restart() {
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = ignore as *const () as usize;
        action.sa_flags = 0;
        libc::sigemptyset(&mut action.sa_mask);
        assert_eq!(
            libc::sigaction(libc::SIGUSR1, &action, std::ptr::null_mut()),
            0
        );
    }
}

/// Reads one RESP command (an array of bulk strings); None at the end of the stream.
fn command(r: &mut BufReader<std::net::TcpStream>) -> Option<Vec<String>> {
    let mut line = String::new();
    if r.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let n: usize = line.trim_end().strip_prefix('*')?.parse().ok()?;
    let mut parts = Vec::with_capacity(n);
    for _ in 0..n {
        line.clear();
        r.read_line(&mut line).ok()?;
        let len: usize = line.trim_end().strip_prefix('$')?.parse().ok()?;
        let mut buf = vec![0; len + 2];
        r.read_exact(&mut buf).ok()?;
        buf.truncate(len);
        parts.push(String::from_utf8(buf).ok()?);
    }
    Some(parts)
}

#[test]
fn a_reply_wait_interrupted_by_a_signal_is_sent_again() {
    handle_sigusr1_without_restart();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let pings = Arc::new(AtomicUsize::new(0));
    let (first_ping, pinged) = mpsc::channel::<()>();
    {
        let pings = pings.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let (pings, first_ping) = (pings.clone(), first_ping.clone());
                std::thread::spawn(move || {
                    let mut w = stream.try_clone().unwrap();
                    let mut r = BufReader::new(stream);
                    while let Some(cmd) = command(&mut r) {
                        let reply: &[u8] = if cmd[0].eq_ignore_ascii_case("PING") {
                            if pings.fetch_add(1, Ordering::SeqCst) == 0 {
                                // The first PING is answered late: the client is
                                // blocked reading when the signal comes.
                                let _ = first_ping.send(());
                                std::thread::sleep(Duration::from_millis(600));
                            }
                            b"+PONG\r\n"
                        } else {
                            b"+OK\r\n"
                        };
                        if w.write_all(reply).is_err() {
                            return;
                        }
                    }
                });
            }
        });
    }
    let signaller = signal_this_thread_once(pinged, "the store sent no PING");
    let store = RedisStore::<std::io::Error>::builder(format!("redis://127.0.0.1:{port}"))
        .io_timeout(Duration::from_secs(2))
        .connect_now(true)
        .build();
    signaller.join().unwrap();
    assert!(
        store.is_ok(),
        "the store gave up on an interrupted read: {:?}",
        store.err()
    );
    assert_eq!(
        pings.load(Ordering::SeqCst),
        2,
        "sent again once, on a new connection"
    );
}

/// On a Cluster the call goes to its node on a connection opened for it (the seed that
/// gave the slot map is another node), and the signal interrupts the wait for its first
/// reply there: the call is sent again on a new connection too, not only on a
/// connection used before. A blocking caller sends its calls from its own thread, which
/// gets the signal.
#[test]
fn a_reply_wait_interrupted_by_a_signal_on_a_new_cluster_connection_is_sent_again() {
    handle_sigusr1_without_restart();
    // The seed only tells the slot map: every slot on the node.
    let seed = TcpListener::bind("127.0.0.1:0").unwrap();
    let node = TcpListener::bind("127.0.0.1:0").unwrap();
    let seed_port = seed.local_addr().unwrap().port();
    let node_port = node.local_addr().unwrap().port();
    let claims = Arc::new(AtomicUsize::new(0));
    let (first_claim, claimed) = mpsc::channel::<()>();
    for listener in [seed, node] {
        let (claims, first_claim) = (claims.clone(), first_claim.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let (claims, first_claim) = (claims.clone(), first_claim.clone());
                std::thread::spawn(move || {
                    let mut w = stream.try_clone().unwrap();
                    let mut r = BufReader::new(stream);
                    while let Some(cmd) = command(&mut r) {
                        let is = |name: &str| cmd[0].eq_ignore_ascii_case(name);
                        let reply = if is("CLUSTER") {
                            format!(
                                "*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n\
                                 :{node_port}\r\n"
                            )
                        } else if is("EVALSHA") && cmd.iter().any(|a| a == "fp") {
                            // The claim (the only script given the fingerprint).
                            if claims.fetch_add(1, Ordering::SeqCst) == 0 {
                                // The first is answered late: the caller is blocked
                                // reading when the signal comes.
                                let _ = first_claim.send(());
                                std::thread::sleep(Duration::from_millis(600));
                            }
                            "*2\r\n$4\r\nlead\r\n:1\r\n".to_owned()
                        } else if is("EVALSHA") {
                            // The completion: stored.
                            ":1\r\n".to_owned()
                        } else {
                            "+OK\r\n".to_owned()
                        };
                        if w.write_all(reply.as_bytes()).is_err() {
                            return;
                        }
                    }
                });
            }
        });
    }
    let signaller = signal_this_thread_once(claimed, "the store sent no claim");
    let store = RedisStore::<std::io::Error>::builder(format!("redis://127.0.0.1:{seed_port}"))
        .cluster(true)
        .io_timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let key = ScopedKey::new("acme", "CreateOrder", &IdempotencyKey::random()).unwrap();
    let r = store.execute_blocking(&key, "fp", ExecuteOptions::default(), || {
        Ok(b"created".to_vec())
    });
    signaller.join().unwrap();
    let executed = match r {
        Ok(executed) => executed,
        Err(e) => panic!("the store gave up on an interrupted read: {e:?}"),
    };
    assert_eq!(executed.source, Source::Led);
    assert_eq!(executed.value, b"created");
    assert_eq!(
        claims.load(Ordering::SeqCst),
        2,
        "sent again once, on a new connection"
    );
}

/// Sends SIGUSR1 to the calling thread 100 ms after `ready` gets a message (the call
/// is then blocked reading its reply); the thread's handle, to join.
fn signal_this_thread_once(
    ready: mpsc::Receiver<()>,
    missing: &'static str,
) -> std::thread::JoinHandle<()> {
    let me = unsafe { libc::pthread_self() };
    std::thread::spawn(move || {
        ready.recv_timeout(Duration::from_secs(10)).expect(missing);
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(unsafe { libc::pthread_kill(me, libc::SIGUSR1) }, 0);
    })
}
