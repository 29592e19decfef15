//! What the Redis-backed test binaries share: where their Redis (or Redis Cluster) is.
// Each test binary uses a part of it.
#![allow(dead_code)]

use std::time::{Duration, Instant};

/// The throwaway Redis that scripts/test-redis starts (`ONCELY_REDIS_URL`). Only that
/// script sets it; no test touches any other address.
pub fn url() -> String {
    match std::env::var("ONCELY_REDIS_URL") {
        Ok(u) if !u.is_empty() => u,
        _ => panic!(
            "ONCELY_REDIS_URL is not set: this test needs a Redis. Run scripts/test-redis, \
             which starts a throwaway redis-server on 127.0.0.1 and sets it."
        ),
    }
}

/// The throwaway Redis Cluster's node URLs, masters first (scripts/with-redis-cluster).
pub fn urls() -> Vec<String> {
    match std::env::var("ONCELY_REDIS_CLUSTER_URLS") {
        Ok(u) if !u.is_empty() => u.split_whitespace().map(str::to_owned).collect(),
        _ => panic!(
            "ONCELY_REDIS_CLUSTER_URLS is not set: this test needs a Redis Cluster. Run \
             scripts/test-redis, which starts a throwaway one with scripts/with-redis-cluster."
        ),
    }
}

/// The cluster nodes' dirs, `DIR/PORT/` (redis.conf, redis.pid), for fault injection.
pub fn cluster_dir() -> String {
    std::env::var("ONCELY_REDIS_CLUSTER_DIR").expect("ONCELY_REDIS_CLUSTER_DIR is not set")
}

/// The port of a `redis://host:port` URL.
pub fn port_of(url: &str) -> u16 {
    url.rsplit(':').next().unwrap().parse().unwrap()
}

/// A connection to the cluster node on `port` (127.0.0.1).
pub fn node(port: u16) -> redis::RedisResult<redis::Connection> {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))?
        .get_connection_with_timeout(Duration::from_millis(500))
}

/// One line of `CLUSTER NODES`.
#[derive(Debug, Clone)]
pub struct NodeInfo {
    pub id: String,
    pub port: u16,
    pub master: bool,
    pub failed: bool,
    pub slots: Vec<(u16, u16)>,
}

/// The cluster as a live node sees it.
pub fn nodes() -> Vec<NodeInfo> {
    let text: String = urls()
        .iter()
        .find_map(|u| {
            let mut c = node(port_of(u)).ok()?;
            redis::cmd("CLUSTER").arg("NODES").query(&mut c).ok()
        })
        .expect("no live node");
    text.lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let port = f[1].split('@').next().unwrap().rsplit(':').next().unwrap();
            NodeInfo {
                id: f[0].to_owned(),
                port: port.parse().unwrap(),
                master: f[2].contains("master"),
                failed: f[2].contains("fail"),
                slots: f[8..]
                    .iter()
                    .filter(|s| !s.starts_with('['))
                    .map(|s| match s.split_once('-') {
                        Some((a, b)) => (a.parse().unwrap(), b.parse().unwrap()),
                        None => (s.parse().unwrap(), s.parse().unwrap()),
                    })
                    .collect(),
            }
        })
        .collect()
}

/// The slot of `record_key`.
pub fn slot_of(record_key: &str) -> u16 {
    // Any live node (one may have been killed).
    urls()
        .iter()
        .find_map(|u| {
            let mut c = node(port_of(u)).ok()?;
            redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(record_key)
                .query(&mut c)
                .ok()
        })
        .expect("no live node")
}

/// The live master serving `slot`.
pub fn owner(slot: u16) -> NodeInfo {
    nodes()
        .into_iter()
        .find(|n| n.master && !n.failed && n.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot)))
        .unwrap_or_else(|| panic!("slot {slot} is not served"))
}

/// The slot map as the node on `port` sees it: (first slot, last slot, master's port),
/// sorted; `None` when it does not answer.
fn slot_map(port: u16) -> Option<Vec<(i64, i64, i64)>> {
    let mut c = node(port).ok()?;
    let redis::Value::Array(ranges) = redis::cmd("CLUSTER").arg("SLOTS").query(&mut c).ok()? else {
        return None;
    };
    let mut map: Vec<(i64, i64, i64)> = ranges
        .iter()
        .filter_map(|r| {
            let redis::Value::Array(r) = r else {
                return None;
            };
            let redis::Value::Array(master) = r.get(2)? else {
                return None;
            };
            let int = |v: &redis::Value| match v {
                redis::Value::Int(i) => Some(*i),
                _ => None,
            };
            Some((int(r.first()?)?, int(r.get(1)?)?, int(master.get(1)?)?))
        })
        .collect();
    map.sort_unstable();
    Some(map)
}

/// Waits until every slot is served by a live master and every node agrees: each
/// answering node says `cluster_state:ok` and sees the same slot map (a master just
/// started again after a failover says ok at once, from its own stale view, until
/// it learns it was demoted: a client that read the map there would write to it).
pub fn wait_cluster_ok(what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ok = urls().iter().all(|u| match node(port_of(u)) {
            // A killed node does not answer: it has no say.
            Err(_) => true,
            Ok(mut c) => redis::cmd("CLUSTER")
                .arg("INFO")
                .query::<String>(&mut c)
                .is_ok_and(|i| i.contains("cluster_state:ok")),
        });
        let maps: Vec<_> = urls().iter().filter_map(|u| slot_map(port_of(u))).collect();
        if ok && maps.windows(2).all(|w| w[0] == w[1]) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the cluster did not recover after {what}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
