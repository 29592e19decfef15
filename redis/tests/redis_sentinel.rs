//! The store on a Sentinel-managed primary (a primary, a replica, 3 Sentinels) started
//! by `scripts/with-redis-sentinel`, which sets `ONCELY_REDIS_SENTINEL_URL` and the
//! others. `scripts/test-redis` runs it with `--include-ignored`; run that way without
//! the variables, it fails and says so.

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::executor::block_on;
use oncely::{Error, ExecuteError, IdempotencyKey, ScopedKey, Source};
use oncely_redis::RedisStore;

#[derive(Debug)]
struct Boom;

fn env(name: &str) -> String {
    match std::env::var(name) {
        Ok(v) if !v.is_empty() => v,
        _ => panic!(
            "{name} is not set: this test needs Redis Sentinels. Run scripts/test-redis, \
             which starts throwaway ones with scripts/with-redis-sentinel."
        ),
    }
}

fn port_of(url: &str) -> u16 {
    url.rsplit(':').next().unwrap().parse().unwrap()
}

fn key() -> ScopedKey {
    ScopedKey::new("acme", "CreateOrder", &IdempotencyKey::random()).unwrap()
}

/// The two ways to name the Sentinels: a `redis+sentinel://` URL, or their addresses
/// and the master name on the builder.
fn stores(prefix: &str) -> (RedisStore<Boom>, RedisStore<Boom>) {
    let tune = |b: oncely_redis::RedisStoreBuilder<Boom>| {
        b.prefix(prefix)
            .lease(Duration::from_millis(900))
            .io_timeout(Duration::from_millis(300))
            .min_replicas(1)
            .min_replicas_timeout(Duration::from_millis(100))
            .build()
            .unwrap()
    };
    let url = env("ONCELY_REDIS_SENTINEL_URL");
    let hosts: Vec<String> = url["redis+sentinel://".len()..]
        .split('/')
        .next()
        .unwrap()
        .split(',')
        .map(|h| format!("redis://{h}"))
        .collect();
    (
        tune(RedisStore::builder(url)),
        tune(
            RedisStore::builder(hosts[0].clone())
                .seeds(hosts[1..].to_vec())
                .sentinel("oncely"),
        ),
    )
}

fn role(port: u16) -> Option<String> {
    let mut c = redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .ok()?
        .get_connection_with_timeout(Duration::from_millis(300))
        .ok()?;
    let r: Vec<redis::Value> = redis::cmd("ROLE").query(&mut c).ok()?;
    redis::from_redis_value_ref(&r[0]).ok()
}

/// Completed results survive the primary's death: the Sentinels promote the replica,
/// both stores follow it on their own, every result is replayed (no action runs
/// again), callers during the failover get UNAVAILABLE without their action running,
/// and once the old primary is back (as a replica) new keys lead with `min_replicas(1)`;
/// after a graceful failover (the old primary stays up as a replica and answers
/// READONLY) both stores move to the new primary.
#[test]
#[ignore = "needs Redis Sentinels: run scripts/test-redis"]
fn on_sentinel_store_follows_a_failover_and_replays_results() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let prefix = format!("s{}", &IdempotencyKey::random().as_str()[..10]);
        let (a, b) = stores(&prefix);
        let keys: Vec<ScopedKey> = (0..30).map(|_| key()).collect();
        for (i, k) in keys.iter().enumerate() {
            let s = if i % 2 == 0 { &a } else { &b };
            let done = block_on(s.execute(k, "f", || async { Ok(format!("{i}").into_bytes()) }));
            assert_eq!(done.unwrap().source, Source::Led);
        }
        assert_eq!(a.counters().completions_unreplicated, 0);
        assert_eq!(b.counters().completions_unreplicated, 0);

        let url = env("ONCELY_REDIS_SENTINEL_URL");
        let primary = env("ONCELY_REDIS_SENTINEL_PRIMARY");
        let replica = env("ONCELY_REDIS_SENTINEL_REPLICA");
        let dir = env("ONCELY_REDIS_SENTINEL_DIR");
        let port = port_of(&primary);
        let pid = std::fs::read_to_string(format!("{dir}/{port}/redis.pid")).unwrap();
        assert!(Command::new("kill")
            .args(["-9", pid.trim()])
            .status()
            .unwrap()
            .success());

        // Until the replica is promoted, callers get UNAVAILABLE and run nothing.
        let ran = AtomicUsize::new(0);
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut unavailable = 0;
        loop {
            let k = keys[unavailable % keys.len()].clone();
            let r = block_on(a.execute(&k, "f", || async {
                ran.fetch_add(1, Ordering::SeqCst);
                Ok(b"again".to_vec())
            }));
            match r {
                Ok(done) => {
                    assert_eq!(done.source, Source::Replayed);
                    break;
                }
                Err(ExecuteError::Store(Error::Unavailable(_))) => unavailable += 1,
                Err(e) => panic!("{e:?}"),
            }
            assert!(
                Instant::now() < deadline,
                "the store did not follow the failover"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(role(port_of(&replica)).as_deref(), Some("master"));
        println!("sentinel failover: {unavailable} calls were UNAVAILABLE meanwhile");

        // Every completed result is replayed, through either store.
        for (i, k) in keys.iter().enumerate() {
            for s in [&a, &b] {
                let done = loop {
                    match block_on(s.execute(k, "f", || async {
                        ran.fetch_add(1, Ordering::SeqCst);
                        Ok(b"again".to_vec())
                    })) {
                        Ok(done) => break done,
                        // The other store may still hold a connection to the dead node.
                        Err(ExecuteError::Store(Error::Unavailable(_)))
                            if Instant::now() < deadline =>
                        {
                            std::thread::sleep(Duration::from_millis(50))
                        }
                        Err(e) => panic!("{e:?}"),
                    }
                };
                assert_eq!(done.value, format!("{i}").into_bytes());
                assert_eq!(done.source, Source::Replayed);
            }
        }
        assert_eq!(ran.load(Ordering::SeqCst), 0, "an action ran again");

        // The old primary comes back; the Sentinels make it a replica of the new one,
        // and new keys lead again with one replica acknowledging.
        let conf = format!("{dir}/{port}/redis.conf");
        assert!(Command::new("redis-server")
            .args([conf.as_str(), "--daemonize", "yes"])
            .status()
            .unwrap()
            .success());
        let k = key();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match block_on(b.execute(&k, "f", || async { Ok(b"new".to_vec()) })) {
                Ok(done) => {
                    assert_eq!(done.value, b"new");
                    break;
                }
                Err(ExecuteError::Store(Error::Unavailable(_))) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100))
                }
                Err(e) => panic!("{e:?}"),
            }
        }
        assert_eq!(role(port).as_deref(), Some("slave"));

        // A graceful failover (SENTINEL FAILOVER): the primary the stores are connected
        // to stays up as a replica and answers writes with READONLY. Each connection
        // that gets it is dropped and the next one goes to the new primary.
        let primary_now = port_of(&replica);
        let sentinel = url["redis+sentinel://".len()..]
            .split(',')
            .next()
            .unwrap()
            .to_owned();
        let mut s = redis::Client::open(format!("redis://{sentinel}"))
            .unwrap()
            .get_connection()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let r: redis::RedisResult<String> = redis::cmd("SENTINEL")
                .arg("FAILOVER")
                .arg("oncely")
                .query(&mut s);
            if r.is_ok() {
                break;
            }
            // The previous failover may still be settling (INPROG, NOGOODSLAVE).
            assert!(
                Instant::now() < deadline,
                "SENTINEL FAILOVER refused: {r:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        while role(primary_now).as_deref() != Some("slave") {
            assert!(
                Instant::now() < deadline,
                "the graceful failover did not happen"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut readonly = 0;
        for s in [&a, &b] {
            let k = key();
            loop {
                match block_on(s.execute(&k, "f", || async { Ok(b"after".to_vec()) })) {
                    Ok(done) => {
                        assert_eq!(done.value, b"after");
                        break;
                    }
                    Err(ExecuteError::Store(Error::Unavailable(_)))
                        if Instant::now() < deadline =>
                    {
                        readonly += 1;
                        std::thread::sleep(Duration::from_millis(50))
                    }
                    Err(e) => panic!("{e:?}"),
                }
            }
        }
        println!("graceful failover: {readonly} calls were UNAVAILABLE meanwhile");
        let _ = tx.send(());
    });
    match rx.recv_timeout(Duration::from_secs(90)) {
        Ok(()) => {}
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            panic!("the scenario failed (see above)")
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("the scenario hung"),
    }
}

/// The settings of a Sentinel deployment are checked when the store is built.
#[test]
fn sentinel_settings_are_checked() {
    let invalid = |b: oncely_redis::RedisStoreBuilder<Boom>| match b.build() {
        Err(Error::InvalidArgument { field, .. }) => field,
        r => panic!("{r:?}"),
    };
    assert_eq!(
        invalid(RedisStore::builder("redis+sentinel://127.0.0.1:1")),
        "url"
    );
    assert_eq!(
        invalid(RedisStore::builder("redis+sentinel:///oncely")),
        "url"
    );
    assert_eq!(
        invalid(RedisStore::builder("redis+sentinel://127.0.0.1:1/m").cluster(true)),
        "cluster"
    );
    assert_eq!(
        invalid(RedisStore::builder("redis://127.0.0.1:1").seeds(["redis://127.0.0.1:2"])),
        "seeds"
    );
    assert_eq!(
        invalid(
            RedisStore::builder("redis://127.0.0.1:1")
                .min_replicas(1)
                .min_replicas_timeout(Duration::from_secs(2))
                .io_timeout(Duration::from_secs(1))
        ),
        "min_replicas"
    );
    RedisStore::<Boom>::builder("redis+sentinel://u:p@127.0.0.1:1,127.0.0.1:2/m/3")
        .build()
        .unwrap();
}
