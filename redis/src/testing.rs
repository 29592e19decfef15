//! What the unit tests that need Redis share: the Redis of the run and redis-servers
//! of their own.

use std::time::{Duration, Instant};

pub(crate) fn url() -> String {
    match std::env::var("ONCELY_REDIS_URL") {
        Ok(u) if !u.is_empty() => u,
        _ => panic!("ONCELY_REDIS_URL is not set: run scripts/test-redis"),
    }
}

/// A redis-server on a free loopback port, killed on drop.
pub(crate) struct Server(pub(crate) std::process::Child, pub(crate) u16);

impl Server {
    pub(crate) fn start(args: &[&str]) -> Server {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        // Its own dir: a replica writes the primary's snapshot there.
        let dir = std::env::temp_dir().join(format!("oncely-threads-test-{port}"));
        std::fs::create_dir_all(&dir).unwrap();
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--dir",
                dir.to_str().unwrap(),
            ])
            .args(["--appendonly", "no", "--repl-diskless-sync-delay", "0"])
            .args(args)
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server (run scripts/test-redis, which installs it)");
        let s = Server(child, port);
        let deadline = Instant::now() + Duration::from_secs(10);
        while s.con().is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }
    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.1)
    }
    pub(crate) fn con(&self) -> redis::RedisResult<redis::Connection> {
        redis::Client::open(self.url())?.get_connection()
    }
    pub(crate) fn signal(&self, sig: &str) {
        let ok = std::process::Command::new("kill")
            .args([sig, &self.0.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let dir = std::env::temp_dir().join(format!("oncely-threads-test-{}", self.1));
        let _ = std::fs::remove_dir_all(dir);
    }
}
