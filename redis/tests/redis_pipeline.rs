//! Calls that arrive together go to Redis as one pipeline: with one worker, 200
//! callers at once take far fewer round trips than calls. Alone in its binary, so
//! that Redis' read counter sees no other test.
//!
//! Needs a Redis and is `#[ignore]`d without one (scripts/test-redis runs it against
//! a throwaway redis-server).

mod support;
use std::time::Duration;

use futures::executor::block_on;
use oncely::{IdempotencyKey, ScopedKey, Source};
use oncely_redis::RedisStore;
use support::url;

#[derive(Debug)]
struct Boom;

/// Redis' count of the reads it made from its clients' sockets (one per batch of
/// commands that arrived together on a connection).
fn reads_processed(con: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO").arg("stats").query(con).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("total_reads_processed:"))
        .expect("INFO stats has total_reads_processed (Redis 6+)")
        .trim()
        .parse()
        .unwrap()
}

#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn calls_that_arrive_together_share_round_trips() {
    let s: RedisStore<Boom> = RedisStore::builder(url())
        .prefix(format!("pipe{}", IdempotencyKey::random().as_str()))
        .workers(1)
        .io_timeout(Duration::from_secs(5))
        .lease(Duration::from_secs(30))
        .build()
        .unwrap();
    // Connected, scripts loaded.
    let warm = ScopedKey::new("acme", "Pay", &IdempotencyKey::random()).unwrap();
    block_on(s.execute(&warm, "fp", || async { Ok(vec![]) })).unwrap();
    let mut con = redis::Client::open(url())
        .unwrap()
        .get_connection()
        .unwrap();
    let n = 200;
    let keys: Vec<ScopedKey> = (0..n)
        .map(|_| ScopedKey::new("acme", "Pay", &IdempotencyKey::random()).unwrap())
        .collect();
    let before = reads_processed(&mut con);
    let calls = keys.iter().enumerate().map(|(i, k)| {
        let s = s.clone();
        async move {
            s.execute(k, "fp", || async move { Ok(i.to_string().into_bytes()) })
                .await
        }
    });
    let done = block_on(futures::future::join_all(calls));
    let reads = reads_processed(&mut con) - before;
    for (i, d) in done.into_iter().enumerate() {
        let d = d.unwrap();
        assert_eq!(
            (d.value, d.source),
            (i.to_string().into_bytes(), Source::Led)
        );
    }
    assert_eq!(s.counters().leads, n as u64 + 1);
    // 2n calls (a claim and a completion each) on one connection: one read per call
    // without pipelining; a few batches with it (+1 for the INFO call).
    eprintln!("{} calls, {reads} reads by Redis", 2 * n);
    assert!(
        reads <= (2 * n as u64) / 4,
        "{reads} reads for {} calls: the calls were not pipelined",
        2 * n
    );
}
