//! The conformance suite and cluster-specific tests on a real Redis Cluster (3 masters,
//! 3 replicas), started by `scripts/with-redis-cluster`, which sets
//! `ONCELY_REDIS_CLUSTER_URLS`. `scripts/test-redis` runs them with
//! `--include-ignored`; run that way without the variable, they fail and say so.
//!
//! The tests that move slots or kill nodes are in `redis_cluster_faults.rs` (another
//! test binary, so they never run beside these).

#[macro_use]
mod conformance;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use conformance::{key, with_timeout, Boom, Harness, Lease};
use futures::executor::block_on;
use oncely::{Error, ExecuteError};
use oncely_redis::RedisStore;

/// The throwaway cluster's node URLs, masters first.
fn urls() -> Vec<String> {
    match std::env::var("ONCELY_REDIS_CLUSTER_URLS") {
        Ok(u) if !u.is_empty() => u.split_whitespace().map(str::to_owned).collect(),
        _ => panic!(
            "ONCELY_REDIS_CLUSTER_URLS is not set: this test needs a Redis Cluster. Run \
             scripts/test-redis, which starts a throwaway one on 127.0.0.1 with \
             scripts/with-redis-cluster."
        ),
    }
}

const LEASE: Duration = Duration::from_millis(300);

fn fresh_prefix() -> String {
    format!("t{}", oncely::IdempotencyKey::random().as_str())
}

/// A store on the cluster, given one master as the URL and the other two as seeds.
fn build(prefix: &str, ttl: Duration) -> RedisStore<Boom> {
    let urls = urls();
    RedisStore::builder(urls[0].clone())
        .seeds(urls[1..3].to_vec())
        .cluster(true)
        .prefix(prefix)
        .lease(LEASE)
        .ttl(ttl)
        .build()
        .unwrap()
}

struct Cluster;

impl Harness for Cluster {
    type Store = RedisStore<Boom>;
    const LEASES: bool = true;
    fn lease(&self) -> Duration {
        LEASE
    }
    fn store(&self, ttl: Duration) -> Self::Store {
        build(&fresh_prefix(), ttl)
    }
    fn peer(&self, store: &Self::Store) -> Self::Store {
        build(store.prefix(), store.ttl())
    }
    fn crash(&self, lease: Lease<Self>) {
        lease.stop_renewing();
        std::mem::forget(lease);
    }
    fn pause(&self, lease: &Lease<Self>) {
        lease.stop_renewing();
    }
}

fn node(url: &str) -> redis::Connection {
    redis::Client::open(url).unwrap().get_connection().unwrap()
}

/// The master (its URL) that serves the slot of `record_key`.
fn master_of(record_key: &str) -> String {
    let mut c = node(&urls()[0]);
    let slot: u16 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(record_key)
        .query(&mut c)
        .unwrap();
    let slots: Vec<redis::Value> = redis::cmd("CLUSTER").arg("SLOTS").query(&mut c).unwrap();
    for range in slots {
        let redis::Value::Array(items) = range else {
            continue;
        };
        let start: u16 = redis::from_redis_value_ref(&items[0]).unwrap();
        let end: u16 = redis::from_redis_value_ref(&items[1]).unwrap();
        if (start..=end).contains(&slot) {
            let (host, port): (String, u16) = match &items[2] {
                redis::Value::Array(m) => (
                    redis::from_redis_value_ref(&m[0]).unwrap(),
                    redis::from_redis_value_ref(&m[1]).unwrap(),
                ),
                v => panic!("{v:?}"),
            };
            return format!("redis://{host}:{port}");
        }
    }
    panic!("slot {slot} is not served")
}

/// Named `on_cluster::…`, so the single-node run of scripts/test-redis can skip them.
mod on_cluster {
    use super::*;

    mod suite {
        use super::*;
        conformance_tests!(common: Cluster, #[ignore = "needs a Redis Cluster: run scripts/test-redis"]);
        conformance_tests!(leases: Cluster, #[ignore = "needs a Redis Cluster: run scripts/test-redis"]);
    }

    /// A fleet on the cluster: 4 instances × 6 threads call every one of 60 keys, whose
    /// records spread over all three masters: every action runs exactly once and every
    /// caller gets the leader's value.
    #[test]
    #[ignore = "needs a Redis Cluster: run scripts/test-redis"]
    fn fleet_on_every_master_runs_each_key_once() {
        with_timeout(Duration::from_secs(60), || {
            let prefix = fresh_prefix();
            let instances: Vec<_> = (0..4)
                .map(|_| build(&prefix, Duration::from_secs(60)))
                .collect();
            let keys: Vec<_> = (0..60).map(|_| key()).collect();
            let masters: std::collections::HashSet<String> = keys
                .iter()
                .map(|k| master_of(&instances[0].record_key(k)))
                .collect();
            assert_eq!(masters.len(), 3, "the keys should reach every master");
            let runs: Arc<Vec<AtomicUsize>> =
                Arc::new((0..60).map(|_| AtomicUsize::new(0)).collect());
            let barrier = Arc::new(Barrier::new(24));
            let hs: Vec<_> = (0..24)
                .map(|t| {
                    let s = instances[t % 4].clone();
                    let (keys, runs, barrier) = (keys.clone(), runs.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        barrier.wait();
                        let mut got = Vec::new();
                        for j in 0..keys.len() {
                            let i = (j * 7 + t * 13) % keys.len();
                            let r = block_on(s.execute(&keys[i], "f", || async {
                                runs[i].fetch_add(1, Ordering::SeqCst);
                                std::thread::sleep(Duration::from_millis(2));
                                Ok(format!("{i}:{t}").into_bytes())
                            }));
                            got.push((i, r.unwrap().value));
                        }
                        got
                    })
                })
                .collect();
            let mut value: Vec<Option<Vec<u8>>> = vec![None; 60];
            for h in hs {
                for (i, v) in h.join().unwrap() {
                    match &value[i] {
                        None => value[i] = Some(v),
                        Some(first) => {
                            assert_eq!(first, &v, "key {i}: callers got different values")
                        }
                    }
                }
            }
            for (i, r) in runs.iter().enumerate() {
                assert_eq!(r.load(Ordering::SeqCst), 1, "key {i} ran more than once");
            }
        });
    }

    /// A waiter on another instance is woken by the completion's notification, wherever
    /// the key's slot lives: it gets the value long before its poll interval would let it
    /// look again.
    #[test]
    #[ignore = "needs a Redis Cluster: run scripts/test-redis"]
    fn remote_waiter_woken_on_every_master() {
        with_timeout(Duration::from_secs(60), || {
            let prefix = fresh_prefix();
            let urls = urls();
            let slow_poll = |p: &str| {
                RedisStore::<Boom>::builder(urls[0].clone())
                    .seeds(urls[1..3].to_vec())
                    .cluster(true)
                    .prefix(p)
                    .lease(Duration::from_secs(30))
                    // A waiter that is not woken looks again only after 20 s.
                    .poll_interval(Duration::from_secs(20), Duration::from_secs(20))
                    .build()
                    .unwrap()
            };
            let (a, b) = (slow_poll(&prefix), slow_poll(&prefix));
            let mut masters = std::collections::HashSet::new();
            while masters.len() < 3 {
                let k = key();
                if !masters.insert(master_of(&a.record_key(&k))) {
                    continue;
                }
                let lead = block_on(a.begin(&k, "f", Default::default())).unwrap();
                let oncely::Begin::Lead(lease) = lead else {
                    panic!("expected to lead")
                };
                let (b2, k2) = (b.clone(), k.clone());
                let waiter = std::thread::spawn(move || {
                    block_on(b2.execute(&k2, "f", || async { Ok(b"not me".to_vec()) }))
                });
                std::thread::sleep(Duration::from_millis(200));
                block_on(oncely::LeaderLease::complete(lease, b"v".to_vec())).unwrap();
                let started = std::time::Instant::now();
                let got = waiter.join().unwrap().unwrap();
                assert_eq!(got.value, b"v");
                assert!(
                    started.elapsed() < Duration::from_secs(10),
                    "the waiter was not woken (it polled)"
                );
            }
        });
    }

    /// Auth in cluster mode: a user made on every node (ACLs are per node) reaches the
    /// cluster through any seed; a wrong password is UNAVAILABLE and runs nothing.
    #[test]
    #[ignore = "needs a Redis Cluster: run scripts/test-redis"]
    fn acl_user_on_every_node() {
        with_timeout(Duration::from_secs(60), || {
            let user = format!("u{}", &fresh_prefix()[..12]);
            for u in urls() {
                let _: () = redis::cmd("ACL")
                    .arg("SETUSER")
                    .arg(&user)
                    .arg("on")
                    .arg(">s3cret")
                    .arg("~*")
                    .arg("&*")
                    .arg("+@all")
                    .query(&mut node(&u))
                    .unwrap();
            }
            let with_password = |pw: &str| -> Vec<String> {
                urls()[..3]
                    .iter()
                    .map(|u| u.replacen("redis://", &format!("redis://{user}:{pw}@"), 1))
                    .collect()
            };
            let store = |urls: Vec<String>| {
                RedisStore::<Boom>::builder(urls[0].clone())
                    .seeds(urls[1..].to_vec())
                    .cluster(true)
                    .prefix(fresh_prefix())
                    .lease(Duration::from_secs(3))
                    .build()
                    .unwrap()
            };
            let good = store(with_password("s3cret"));
            let k = key();
            let done = block_on(good.execute(&k, "f", || async { Ok(b"ok".to_vec()) })).unwrap();
            assert_eq!(done.value, b"ok");
            let ran = AtomicUsize::new(0);
            let bad = store(with_password("wrong"));
            let r = block_on(bad.execute(&key(), "f", || async {
                ran.fetch_add(1, Ordering::SeqCst);
                Ok(b"no".to_vec())
            }));
            assert!(
                matches!(r, Err(ExecuteError::Store(Error::Unavailable(_)))),
                "{r:?}"
            );
            assert_eq!(ran.load(Ordering::SeqCst), 0);
            for u in urls() {
                let _: () = redis::cmd("ACL")
                    .arg("DELUSER")
                    .arg(&user)
                    .query(&mut node(&u))
                    .unwrap();
            }
        });
    }

    /// `min_replicas(1)` on a cluster whose masters each have a replica: claims and
    /// completions are acknowledged, nothing is counted as unreplicated; `min_replicas(2)`
    /// cannot be met: the claim is released and the caller gets UNAVAILABLE without the
    /// action running, and the key is free for the next caller.
    #[test]
    #[ignore = "needs a Redis Cluster: run scripts/test-redis"]
    fn min_replicas_waits_for_replicas() {
        with_timeout(Duration::from_secs(60), || {
            let urls = urls();
            let prefix = fresh_prefix();
            // A WAIT window of seconds, not milliseconds: a replica of a cluster just
            // started may still be catching up, and the machine may be busy.
            let store = |n: usize| {
                RedisStore::<Boom>::builder(urls[0].clone())
                    .seeds(urls[1..3].to_vec())
                    .cluster(true)
                    .prefix(&prefix)
                    .lease(Duration::from_secs(9))
                    .io_timeout(Duration::from_secs(3))
                    .min_replicas(n)
                    .min_replicas_timeout(Duration::from_secs(2))
                    .build()
                    .unwrap()
            };
            let one = store(1);
            for _ in 0..10 {
                let r = block_on(one.execute(&key(), "f", || async { Ok(b"v".to_vec()) }));
                assert_eq!(r.unwrap().value, b"v");
            }
            assert_eq!(one.counters().completions_unreplicated, 0);
            assert_eq!(one.counters().claims_unreplicated, 0);
            // A removal the replica acknowledged.
            let gone = key();
            block_on(one.execute(&gone, "f", || async { Ok(b"v".to_vec()) })).unwrap();
            assert!(block_on(one.remove(&gone)).unwrap());
            assert_eq!(one.counters().unavailable, 0);

            let two = store(2);
            let k = key();
            let ran = AtomicUsize::new(0);
            let r = block_on(two.execute(&k, "f", || async {
                ran.fetch_add(1, Ordering::SeqCst);
                Ok(b"v".to_vec())
            }));
            match r {
                Err(ExecuteError::Store(Error::Unavailable(m))) => {
                    assert!(m.contains("replicas"), "{m}")
                }
                r => panic!("{r:?}"),
            }
            assert_eq!(ran.load(Ordering::SeqCst), 0);
            assert_eq!(two.counters().claims_unreplicated, 1);
            // Released: the next caller leads at once (no lease to wait out).
            let r = block_on(one.execute(&k, "f", || async { Ok(b"w".to_vec()) }));
            assert_eq!(r.unwrap().value, b"w");
            // A removal that cannot be acknowledged by 2: deleted on the master, and
            // UNAVAILABLE (a failover could bring it back).
            match block_on(two.remove(&k)) {
                Err(Error::Unavailable(m)) => assert!(m.contains("replicas"), "{m}"),
                r => panic!("{r:?}"),
            }
            assert!(block_on(one.get(&k)).unwrap().is_none());
            // Sent again, it finds no record: still UNAVAILABLE for 2 replicas, while
            // the one replica there is has the deletion (false: nothing to remove).
            match block_on(two.remove(&k)) {
                Err(Error::Unavailable(m)) => assert!(m.contains("replicas"), "{m}"),
                r => panic!("{r:?}"),
            }
            assert!(!block_on(one.remove(&k)).unwrap());
            assert_eq!(one.counters().unavailable, 0);
        });
    }
}
