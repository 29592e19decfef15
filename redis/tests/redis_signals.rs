//! A signal delivered while the store waits for a reply (a child process exiting sends
//! SIGCHLD; Node and Python servers spawn children) interrupts the blocking read with
//! EINTR: a socket with a read timeout is never restarted, whatever the handler's
//! flags. Nothing is wrong with Redis, so the call is sent again on a new connection
//! instead of failing UNAVAILABLE. No Redis needed: a scripted server answers.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use oncely_redis::RedisStore;

extern "C" fn ignore(_: libc::c_int) {}

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
    // A handler without SA_RESTART, as the runtimes that reap children install.
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
    let me = unsafe { libc::pthread_self() };
    let signaller = std::thread::spawn(move || {
        pinged
            .recv_timeout(Duration::from_secs(10))
            .expect("the store sent no PING");
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(unsafe { libc::pthread_kill(me, libc::SIGUSR1) }, 0);
    });
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
