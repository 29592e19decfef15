//! What the Redis-backed test binaries share: where their Redis (or Redis Cluster) is.
// Each test binary uses a part of it.
#![allow(dead_code)]

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
