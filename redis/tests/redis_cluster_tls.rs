//! A Redis Cluster over TLS only (`tls-cluster yes`: the cluster bus too), its
//! certificates signed by a throwaway CA: with `tls_ca_file` the store reaches every
//! master through `rediss://` seeds; without it, calls are UNAVAILABLE and no action
//! runs.
//!
//! Makes the CA and a certificate for 127.0.0.1 with the `openssl` command line (for
//! server and client use: the nodes present it to each other on the bus), starts its
//! OWN 3 masters (TLS ports only, 127.0.0.1, temp dir, no persistence), killed on drop,
//! and joins them with `redis-cli --tls --cluster create`. Gated like
//! `tests/redis_tls.rs`: ignored unless run by scripts/test-redis (which installs
//! `redis-server` and `openssl`).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::executor::block_on;
use oncely::{Error, ExecuteError, IdempotencyKey, ScopedKey, Source};
use oncely_redis::RedisStore;

fn run(dir: &Path, program: &str, args: &[&str]) -> std::process::Output {
    let out = Command::new(program)
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run `{program}` ({e}): run scripts/test-redis"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `ca.crt`, and `node.crt` / `node.key` for IP 127.0.0.1 (server and client auth).
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
    ]);
    ca.extend(["-addext", "basicConstraints=critical,CA:TRUE"]);
    ca.extend(["-addext", "keyUsage=critical,keyCertSign,cRLSign"]);
    run(dir, "openssl", &ca);
    let mut csr = vec!["req", "-new", "-nodes", "-sha256"];
    csr.extend(ec);
    csr.extend([
        "-keyout",
        "node.key",
        "-out",
        "node.csr",
        "-subj",
        "/CN=127.0.0.1",
    ]);
    run(dir, "openssl", &csr);
    std::fs::write(
        dir.join("node.ext"),
        "basicConstraints=critical,CA:FALSE\n\
         keyUsage=critical,digitalSignature\n\
         extendedKeyUsage=serverAuth,clientAuth\n\
         subjectAltName=IP:127.0.0.1\n",
    )
    .unwrap();
    run(
        dir,
        "openssl",
        &[
            "x509",
            "-req",
            "-in",
            "node.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-sha256",
            "-extfile",
            "node.ext",
            "-out",
            "node.crt",
        ],
    );
}

/// Three TLS-only cluster nodes; killed (and their dir removed) on drop.
struct TlsCluster {
    dir: PathBuf,
    ports: Vec<u16>,
    children: Vec<Child>,
}

impl Drop for TlsCluster {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A free port whose cluster bus port (+10000) is free too.
fn free_port(taken: &[u16]) -> u16 {
    loop {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let p = l.local_addr().unwrap().port();
        if p == 6379 || p > 55535 || taken.contains(&p) {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", p + 10000)).is_ok() {
            return p;
        }
    }
}

fn cli(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["--tls", "--cacert", "ca.crt"])
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .expect("run redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl TlsCluster {
    fn start() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "oncely-redis-tls-cluster-{}-{}",
            std::process::id(),
            IdempotencyKey::random().as_str()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = TlsCluster {
            dir,
            ports: Vec::new(),
            children: Vec::new(),
        };
        make_certs(&c.dir);
        for _ in 0..3 {
            let p = free_port(&c.ports);
            c.ports.push(p);
            let node = c.dir.join(p.to_string());
            std::fs::create_dir_all(&node).unwrap();
            let child = Command::new("redis-server")
                .args(["--bind", "127.0.0.1", "--port", "0", "--tls-port"])
                .arg(p.to_string())
                // The bus port explicitly: the default (port + 10000) counts from the
                // plain port, which is 0 here.
                .arg("--cluster-port")
                .arg((p + 10000).to_string())
                .args(["--tls-cluster", "yes", "--cluster-enabled", "yes"])
                .args(["--cluster-node-timeout", "1000", "--cluster-config-file"])
                .arg(node.join("nodes.conf"))
                // Absolute: `--dir` changes the directory before they are read.
                .arg("--tls-cert-file")
                .arg(c.dir.join("node.crt"))
                .arg("--tls-key-file")
                .arg(c.dir.join("node.key"))
                .arg("--tls-ca-cert-file")
                .arg(c.dir.join("ca.crt"))
                .args(["--tls-auth-clients", "no"])
                .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
                .arg("--logfile")
                .arg(node.join("redis.log"))
                .arg("--dir")
                .arg(&node)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start redis-server (scripts/test-redis installs it)");
            c.children.push(child);
        }
        for p in c.ports.clone() {
            let t = Instant::now();
            while !cli(&c.dir, &["-p", &p.to_string(), "ping"]).contains("PONG") {
                assert!(
                    t.elapsed() < Duration::from_secs(10),
                    "TLS node {p} did not start"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let nodes: Vec<String> = c.ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let mut args = vec!["--cluster", "create"];
        args.extend(nodes.iter().map(String::as_str));
        args.extend(["--cluster-replicas", "0", "--cluster-yes"]);
        // `--cluster create` waits for the nodes to meet: bounded by `timeout`.
        let mut create = vec!["20", "redis-cli", "--tls", "--cacert", "ca.crt"];
        create.extend(args);
        run(&c.dir, "timeout", &create);
        let t = Instant::now();
        while !c.ports.iter().all(|p| {
            cli(&c.dir, &["-p", &p.to_string(), "cluster", "info"]).contains("cluster_state:ok")
        }) {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "the TLS cluster did not form"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        c
    }

    fn seeds(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("rediss://127.0.0.1:{p}"))
            .collect()
    }
}

fn key() -> ScopedKey {
    ScopedKey::new("acme", "CreateOrder", &IdempotencyKey::random()).unwrap()
}

#[derive(Debug)]
struct Boom;

#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn tls_cluster_with_its_ca_runs_once_and_without_is_unavailable() {
    let cluster = TlsCluster::start();
    let seeds = cluster.seeds();
    let store = |ca: bool| {
        let mut b = RedisStore::<Boom>::builder(seeds[0].clone())
            .seeds(seeds[1..].to_vec())
            .cluster(true)
            .prefix("tls")
            .lease(Duration::from_secs(3));
        if ca {
            b = b.tls_ca_file(cluster.dir.join("ca.crt"));
        }
        b.build().unwrap()
    };
    let trusted = store(true);
    let runs = AtomicUsize::new(0);
    // Enough keys to reach every master.
    let keys: Vec<ScopedKey> = (0..12).map(|_| key()).collect();
    for k in &keys {
        for expected in [Source::Led, Source::Replayed] {
            let done = block_on(trusted.execute(k, "f", || async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok(b"v".to_vec())
            }))
            .unwrap();
            assert_eq!((done.value.as_slice(), done.source), (&b"v"[..], expected));
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), keys.len());

    let untrusted = store(false);
    let r = block_on(untrusted.execute(&key(), "f", || async {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok(b"no".to_vec())
    }));
    assert!(
        matches!(r, Err(ExecuteError::Store(Error::Unavailable(_)))),
        "{r:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), keys.len());
}
