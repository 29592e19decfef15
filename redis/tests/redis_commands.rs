//! What each transition asks of Redis, counted by Redis itself (`INFO commandstats`,
//! which counts the commands a script runs as well): every `redis.call` inside a script
//! costs Redis about as much as a plain command, so the common paths make only the
//! calls they need. One test in this binary, so no other test's commands are counted
//! (scripts/test-redis runs the test binaries one after another).

mod support;
use std::collections::HashMap;
use std::time::Duration;

use futures::executor::block_on;
use oncely::{IdempotencyKey, ScopedKey, Source};
use oncely_redis::RedisStore;
use support::url;

/// Calls per command since the last `CONFIG RESETSTAT`.
fn calls(c: &mut redis::Connection) -> HashMap<String, u64> {
    let info: String = redis::cmd("INFO").arg("commandstats").query(c).unwrap();
    info.lines()
        .filter_map(|l| l.strip_prefix("cmdstat_")?.split_once(':'))
        .filter_map(|(name, rest)| {
            let n = rest.split(',').find_map(|f| f.strip_prefix("calls="))?;
            Some((name.to_owned(), n.parse().ok()?))
        })
        .collect()
}

fn reset(c: &mut redis::Connection) {
    let _: () = redis::cmd("CONFIG").arg("RESETSTAT").query(c).unwrap();
}

/// The counts of `names` in `got` (0 when Redis saw none).
fn only(got: &HashMap<String, u64>, names: &[&str]) -> Vec<(String, u64)> {
    names
        .iter()
        .map(|n| ((*n).to_owned(), got.get(*n).copied().unwrap_or(0)))
        .collect()
}

const COMMANDS: &[&str] = &[
    "evalsha", "exists", "hmget", "time", "hset", "hdel", "pexpire", "publish",
];

/// A lead on a new key: the claim finds the key absent with `EXISTS` (no fields read)
/// and creates it; the completion checks the token and stores. A replay reads the
/// record once and never asks for the time.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn a_lead_and_a_replay_make_only_the_calls_they_need() {
    let s: RedisStore<std::io::Error> = RedisStore::builder(url())
        .prefix(format!("cost{}", IdempotencyKey::random().as_str()))
        .lease(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut c = redis::Client::open(url())
        .unwrap()
        .get_connection()
        .unwrap();
    let key = || ScopedKey::new("acme", "CreateOrder", &IdempotencyKey::random()).unwrap();
    let run = |k: &ScopedKey| {
        let out = block_on(s.execute(k, "fp", || async { Ok(b"r".to_vec()) })).unwrap();
        assert_eq!(out.value, b"r");
        out.source
    };
    // The scripts loaded, the connections open.
    run(&key());
    const N: u64 = 10;
    let keys: Vec<ScopedKey> = (0..N).map(|_| key()).collect();

    reset(&mut c);
    for k in &keys {
        assert_eq!(run(k), Source::Led);
    }
    let n = N;
    assert_eq!(
        only(&calls(&mut c), COMMANDS),
        only(
            &HashMap::from([
                ("evalsha".into(), 2 * n),
                // The claim: EXISTS, TIME, HSET, PEXPIRE.
                ("exists".into(), n),
                // The completion: HMGET (token check), TIME, HSET, HDEL, PEXPIRE, PUBLISH.
                ("hmget".into(), n),
                ("time".into(), 2 * n),
                ("hset".into(), 2 * n),
                ("hdel".into(), n),
                ("pexpire".into(), 2 * n),
                ("publish".into(), n),
            ]),
            COMMANDS
        ),
        "commands of {N} leads"
    );

    reset(&mut c);
    for k in &keys {
        assert_eq!(run(k), Source::Replayed);
    }
    assert_eq!(
        only(&calls(&mut c), COMMANDS),
        only(
            &HashMap::from([
                ("evalsha".into(), n),
                ("exists".into(), n),
                ("hmget".into(), n),
            ]),
            COMMANDS
        ),
        "commands of {N} replays"
    );
}
