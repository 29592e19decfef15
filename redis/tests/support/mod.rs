//! What the Redis-backed test binaries share: where their Redis is.

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
