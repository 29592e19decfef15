//! `rediss://`: TLS to a redis-server whose certificate is signed by a private CA.
//! Trusting that CA with `tls_ca_file` → the action runs once and is replayed; without
//! it → UNAVAILABLE with a clear message and the action does not run.
//!
//! Makes a throwaway CA and a server certificate for 127.0.0.1 with the `openssl`
//! command line, and starts its OWN redis-server child (TLS only: `--port 0
//! --tls-port <free port>`, 127.0.0.1, a temp dir, no persistence), killed on drop.
//! Gated like `tests/redis.rs`: ignored unless run by scripts/test-redis (which
//! installs `redis-server` and `openssl`).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::executor::block_on;
use oncely::{Code, Error, ExecuteError, IdempotencyKey, ScopedKey, Source};
use oncely_redis::RedisStore;

/// Runs `openssl ARGS` in `dir`; panics with its output when it fails.
fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run `openssl` ({e}): this test needs the openssl binary on PATH; \
                 run scripts/test-redis, which installs it (apt-get install openssl)"
            )
        });
    assert!(
        out.status.success(),
        "openssl {args:?} failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA (`ca.crt`) and a server certificate for IP 127.0.0.1 signed by it
/// (`server.crt`, `server.key`) in `dir`: P-256 keys, valid for a day.
fn make_certs(dir: &Path) {
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];
    let mut ca = vec!["req", "-x509", "-nodes", "-days", "1", "-sha256"];
    ca.extend(ec);
    ca.extend([
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-subj",
        "/CN=oncely test CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    ]);
    openssl(dir, &ca);
    let mut csr = vec!["req", "-new", "-nodes", "-sha256"];
    csr.extend(ec);
    csr.extend([
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    ]);
    openssl(dir, &csr);
    std::fs::write(
        dir.join("server.ext"),
        "basicConstraints=critical,CA:FALSE\n\
         keyUsage=critical,digitalSignature\n\
         extendedKeyUsage=serverAuth\n\
         subjectAltName=IP:127.0.0.1\n",
    )
    .expect("write server.ext");
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-sha256",
            "-extfile",
            "server.ext",
            "-out",
            "server.crt",
        ],
    );
}

/// A TLS-only redis-server child on 127.0.0.1:`port`, with its certificates and data
/// in `dir`; killed (and `dir` removed) on drop.
struct Server {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl Server {
    fn start() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "oncely-redis-tls-{}-{}",
            std::process::id(),
            IdempotencyKey::random().as_str()
        ));
        std::fs::create_dir_all(&dir).expect("create the temp dir");
        // Owns `dir` from here, so a failure below still removes it.
        let mut s = Server {
            port: 0,
            dir,
            child: None,
        };
        make_certs(&s.dir);
        s.port = loop {
            let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
            let p = l.local_addr().unwrap().port();
            if p != 6379 {
                break p;
            }
        };
        let spawned = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", "0", "--tls-port"])
            .arg(s.port.to_string())
            .args([
                "--tls-cert-file",
                "server.crt",
                "--tls-key-file",
                "server.key",
                "--tls-ca-cert-file",
                "ca.crt",
                "--tls-auth-clients",
                "no",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--logfile",
                "redis.log",
                "--dir",
            ])
            .arg(&s.dir)
            .current_dir(&s.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        s.child = Some(match spawned {
            Ok(c) => c,
            Err(e) => panic!(
                "cannot start `redis-server` ({e}): this test needs the redis-server binary \
                 on PATH; run scripts/test-redis, which installs it (apt-get install \
                 redis-server) when it is missing"
            ),
        });
        // Up when a TLS PING (trusting the CA) answers.
        let client = redis::Client::build_with_tls(
            s.url(),
            redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(std::fs::read(s.ca()).unwrap()),
            },
        )
        .unwrap();
        let t = Instant::now();
        loop {
            if let Ok(mut c) = client.get_connection_with_timeout(Duration::from_millis(200)) {
                let _ = c.set_read_timeout(Some(Duration::from_millis(500)));
                if redis::cmd("PING").query::<String>(&mut c).is_ok() {
                    break;
                }
            }
            if let Some(Ok(Some(status))) = s.child.as_mut().map(Child::try_wait) {
                panic!(
                    "redis-server exited at start ({status}) on TLS port {} (is it built \
                     with TLS?):\n{}",
                    s.port,
                    s.log()
                );
            }
            if t.elapsed() > Duration::from_secs(10) {
                panic!(
                    "redis-server did not answer a TLS PING within 10 s on port {}:\n{}",
                    s.port,
                    s.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }

    fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.port)
    }

    fn ca(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn key() -> ScopedKey {
    ScopedKey::new("acme", "Pay", &IdempotencyKey::random()).unwrap()
}

fn builder(url: &str) -> oncely_redis::RedisStoreBuilder<std::io::Error> {
    RedisStore::builder(url)
        .prefix(format!("t{}", IdempotencyKey::random().as_str()))
        .lease(Duration::from_millis(1500))
        .connect_timeout(Duration::from_millis(500))
        .io_timeout(Duration::from_millis(500))
        .poll_interval(Duration::from_millis(5), Duration::from_millis(50))
}

/// Runs `f` on a thread and fails the test if it takes longer than `limit`.
fn bounded<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let h = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => v,
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            // It panicked: report that panic, not a timeout.
            std::panic::resume_unwind(h.join().expect_err("ended without a value"))
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("did not finish within {limit:?}")
        }
    }
}

#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn rediss_with_the_private_ca_runs_once_and_replays_without_it_is_unavailable() {
    bounded(Duration::from_secs(60), tls_scenario);
}

fn tls_scenario() {
    let server = Server::start();
    let ran = Arc::new(AtomicUsize::new(0));
    let run = |v: u8| {
        let ran = ran.clone();
        move || async move {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok(vec![v])
        }
    };

    // Trusting the CA: runs once, then replays.
    let trusted = builder(&server.url())
        .tls_ca_file(server.ca())
        .build()
        .unwrap();
    let k = key();
    let first = block_on(trusted.execute(&k, "f", run(1))).unwrap();
    assert_eq!((first.value, first.source), (vec![1], Source::Led));
    let again = block_on(trusted.execute(&k, "f", run(2))).unwrap();
    assert_eq!(again.value, vec![1]);
    assert!(again.is_replay(), "{again:?}");
    assert_eq!(ran.load(Ordering::SeqCst), 1);

    // Not trusting it (only the built-in public roots): fails closed, fast, clearly.
    let untrusted = builder(&server.url()).build().unwrap();
    for k in [&k, &key()] {
        let t = Instant::now();
        match block_on(untrusted.execute(k, "f", run(3))) {
            Err(ExecuteError::Store(e)) => {
                assert_eq!(e.code(), Code::Unavailable, "{e}");
                let msg = e.to_string();
                assert!(
                    msg.contains("Redis") && msg.contains("certificate"),
                    "the message should say the Redis certificate is not trusted: {msg}"
                );
            }
            other => panic!("expected UNAVAILABLE with an untrusted CA, got {other:?}"),
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "took {:?}",
            t.elapsed()
        );
    }
    assert_eq!(
        ran.load(Ordering::SeqCst),
        1,
        "an action ran over an untrusted connection"
    );

    // The trusted store is unaffected.
    let replay = block_on(trusted.execute(&k, "f", run(4))).unwrap();
    assert_eq!(replay.value, vec![1]);
    assert_eq!(ran.load(Ordering::SeqCst), 1);
}

/// Bad TLS settings are caught by `build`, before any connection (no server needed).
#[test]
fn tls_ca_file_is_checked_by_build() {
    let invalid = |r: Result<RedisStore<std::io::Error>, Error>| match r {
        Err(Error::InvalidArgument { field, reason }) => {
            assert_eq!(field, "tls_ca_file");
            reason
        }
        Err(e) => panic!("expected InvalidArgument(tls_ca_file), got {e}"),
        Ok(_) => panic!("expected InvalidArgument(tls_ca_file), got a store"),
    };
    let dir = std::env::temp_dir().join(format!(
        "oncely-redis-tls-arg-{}-{}",
        std::process::id(),
        IdempotencyKey::random().as_str()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = dir.join("missing.pem");
    let garbage = dir.join("garbage.pem");
    std::fs::write(
        &garbage,
        "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n",
    )
    .unwrap();

    let reason = invalid(
        RedisStore::builder("redis://127.0.0.1:1")
            .tls_ca_file(&garbage)
            .build(),
    );
    assert!(reason.contains("rediss://"), "{reason}");
    let reason = invalid(
        RedisStore::builder("rediss://127.0.0.1:1")
            .tls_ca_file(&missing)
            .build(),
    );
    assert!(reason.contains("missing.pem"), "{reason}");
    let reason = invalid(
        RedisStore::builder("rediss://127.0.0.1:1")
            .tls_ca_file(&garbage)
            .build(),
    );
    assert!(reason.contains("garbage.pem"), "{reason}");
    let _ = std::fs::remove_dir_all(&dir);
    // Without a CA file a rediss:// URL builds (the public roots are trusted).
    assert!(RedisStore::<std::io::Error>::new("rediss://127.0.0.1:1").is_ok());
}
