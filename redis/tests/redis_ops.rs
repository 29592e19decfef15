//! What an operator uses: reading and removing a record by its scoped key, the health
//! check, connecting at startup, and the per-store counters.
//!
//! They need a Redis and are `#[ignore]`d without one (scripts/test-redis runs them
//! against a throwaway redis-server).

mod support;
use std::net::TcpListener;
use std::time::Duration;

use futures::executor::block_on;
use oncely::{Begin, Code, Error, ExecuteError, ExecuteOptions, IdempotencyKey, LeaderLease};
use oncely::{ScopedKey, Source};
use oncely_redis::{RecordState, RedisCounters, RedisStore};
use support::url;

#[derive(Debug)]
struct Boom;

fn key() -> ScopedKey {
    ScopedKey::new("acme", "CreateOrder", &IdempotencyKey::random()).unwrap()
}

fn store(prefix: &str, lease: Duration) -> RedisStore<Boom> {
    RedisStore::builder(url())
        .prefix(prefix)
        .lease(lease)
        .build()
        .unwrap()
}

fn prefix() -> String {
    format!("ops{}", IdempotencyKey::random().as_str())
}

/// A port on 127.0.0.1 that refuses connections.
fn closed_port_url() -> String {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("redis://127.0.0.1:{port}")
}

fn run(s: &RedisStore<Boom>, k: &ScopedKey, value: &[u8]) -> (Vec<u8>, Source) {
    let v = value.to_vec();
    let done = block_on(s.execute(k, "fp", || async move { Ok(v) })).unwrap();
    (done.value, done.source)
}

#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn a_completed_record_is_read_and_removed_and_the_next_call_runs_again() {
    let s = store(&prefix(), Duration::from_secs(30));
    let k = key();
    assert_eq!(block_on(s.get(&k)).unwrap(), None);
    assert!(!block_on(s.remove(&k)).unwrap(), "nothing to remove");
    run(&s, &k, b"bad");
    let got = block_on(s.get(&k)).unwrap().unwrap();
    assert_eq!(got.fingerprint, "fp");
    assert_eq!(got.generation, 1);
    assert_eq!(
        got.state,
        RecordState::Done {
            value: b"bad".to_vec()
        }
    );
    assert!(block_on(s.remove(&k)).unwrap());
    assert_eq!(block_on(s.get(&k)).unwrap(), None);
    assert_eq!(run(&s, &k, b"good"), (b"good".to_vec(), Source::Led));
    assert_eq!(run(&s, &k, b"other"), (b"good".to_vec(), Source::Replayed));
}

#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn a_running_record_is_removed_only_once_its_lease_ran_out() {
    let p = prefix();
    let lease = Duration::from_millis(300);
    let (a, b) = (store(&p, lease), store(&p, lease));
    let k = key();
    let Begin::Lead(held) = block_on(a.begin(&k, "fp", ExecuteOptions::default())).unwrap() else {
        panic!("expected to lead")
    };
    let Some(got) = block_on(b.get(&k)).unwrap() else {
        panic!("no record")
    };
    match got.state {
        RecordState::Running { lease_left } => {
            assert!(
                lease_left > Duration::ZERO && lease_left <= lease,
                "{lease_left:?}"
            )
        }
        other => panic!("expected running, got {other:?}"),
    }
    // A live lease: its leader may be running the action, so it stays.
    assert!(!block_on(b.remove(&k)).unwrap());
    assert!(block_on(b.get(&k)).unwrap().is_some());
    let r = block_on(b.execute_with(&k, "fp", ExecuteOptions::NO_WAIT, || async {
        Ok(b"second".to_vec())
    }));
    assert!(
        matches!(r, Err(ExecuteError::Store(Error::InProgress { .. }))),
        "a second leader ran while the first held its lease: {r:?}"
    );
    // The leader stops renewing (as a crashed one would): once the lease ran out the
    // record may go.
    held.stop_renewing();
    std::thread::sleep(lease + Duration::from_millis(100));
    match block_on(b.get(&k)).unwrap().map(|r| r.state) {
        Some(RecordState::Running { lease_left }) => assert_eq!(lease_left, Duration::ZERO),
        other => panic!("expected an expired running record, got {other:?}"),
    }
    assert!(block_on(b.remove(&k)).unwrap());
    assert_eq!(run(&b, &k, b"new"), (b"new".to_vec(), Source::Led));
    // The old leader finds its claim gone and stores nothing.
    assert!(matches!(
        block_on(held.complete(b"late".to_vec())),
        Err(Error::LeaseLost)
    ));
    assert_eq!(run(&b, &k, b"x"), (b"new".to_vec(), Source::Replayed));
}

/// A hash at a record's key without a `state` field (foreign or damaged data) is not a
/// record, as the claim sees it: `get` finds none, `remove` deletes it, and the next call
/// runs. A hash whose `v` names another format version, with or without a `state`, is
/// refused by `get`, `remove` and a call alike, and left alone: an instance of another
/// version may be running it.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn a_hash_without_a_state_is_absent_to_get_and_removed() {
    let s = store(&prefix(), Duration::from_secs(30));
    let mut c = redis::Client::open(url())
        .unwrap()
        .get_connection()
        .unwrap();
    let exists = |c: &mut redis::Connection, k: &ScopedKey| -> i64 {
        redis::cmd("EXISTS").arg(s.record_key(k)).query(c).unwrap()
    };
    for fields in [&["v", "1", "token", "t"][..], &["x", "y"]] {
        let k = key();
        let _: () = redis::cmd("HSET")
            .arg(s.record_key(&k))
            .arg(fields)
            .query(&mut c)
            .unwrap();
        assert!(block_on(s.get(&k)).unwrap().is_none(), "{fields:?}");
        assert!(block_on(s.remove(&k)).unwrap(), "{fields:?}");
        assert_eq!(exists(&mut c, &k), 0, "{fields:?}");
        assert!(!block_on(s.remove(&k)).unwrap(), "{fields:?}");
        assert_eq!(run(&s, &k, b"v"), (b"v".to_vec(), Source::Led));
    }
    for (fields, v) in [
        (&["v", "2", "state", "done", "fp", "f"][..], "2"),
        (&["v", "7", "fp", "f"], "7"),
    ] {
        let k = key();
        let _: () = redis::cmd("HSET")
            .arg(s.record_key(&k))
            .arg(fields)
            .query(&mut c)
            .unwrap();
        let call = block_on(s.execute(&k, "f", || async { Ok(b"taken over".to_vec()) }));
        let call = match call {
            Err(ExecuteError::Store(e)) => e,
            other => panic!("{other:?}"),
        };
        for e in [
            block_on(s.get(&k)).map(|_| ()).unwrap_err(),
            block_on(s.remove(&k)).map(|_| ()).unwrap_err(),
            call,
        ] {
            assert_eq!(e.code(), Code::Unavailable, "{e}");
            assert!(e.to_string().contains(&format!("version \"{v}\"")), "{e}");
        }
        assert_eq!(exists(&mut c, &k), 1, "{fields:?}");
    }
}

#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn ping_answers_and_connect_now_fails_a_bad_url_at_build() {
    let s = store(&prefix(), Duration::from_secs(30));
    block_on(s.ping()).unwrap();
    let built = RedisStore::<Boom>::builder(url()).connect_now(true).build();
    assert!(built.is_ok(), "{:?}", built.err());

    let bad = closed_port_url();
    match RedisStore::<Boom>::builder(&bad).connect_now(true).build() {
        Err(e) => assert_eq!(e.code(), Code::Unavailable, "{e}"),
        Ok(_) => panic!("connect_now built a store on a closed port"),
    }
    // A wrong password fails at build too.
    let wrong = url().replacen("redis://", "redis://nobody:wrong@", 1);
    match RedisStore::<Boom>::builder(&wrong)
        .connect_now(true)
        .build()
    {
        Err(e) => assert_eq!(e.code(), Code::Unavailable, "{e}"),
        Ok(_) => panic!("connect_now built a store with a wrong password"),
    }
    // Without it, the store is made and the health check reports the failure.
    let lazy = RedisStore::<Boom>::builder(&bad)
        .io_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let e = block_on(lazy.ping()).unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    assert_eq!(
        block_on(lazy.get(&key())).unwrap_err().code(),
        Code::Unavailable
    );
    let r = block_on(lazy.execute(&key(), "fp", || async { Ok(vec![]) }));
    assert!(
        matches!(r, Err(ExecuteError::Store(Error::Unavailable(_)))),
        "{r:?}"
    );
    assert_eq!(lazy.counters().unavailable, 3);
}

#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn counters_count_claims_replays_takeovers_and_lost_leases() {
    let p = prefix();
    let lease = Duration::from_millis(300);
    let (a, b) = (store(&p, lease), store(&p, lease));
    let k = key();
    run(&a, &k, b"v");
    run(&a, &k, b"v");
    run(&b, &k, b"v");
    let k2 = key();
    let Begin::Lead(held) = block_on(a.begin(&k2, "fp", ExecuteOptions::default())).unwrap() else {
        panic!("expected to lead")
    };
    held.stop_renewing();
    std::thread::sleep(lease + Duration::from_millis(100));
    assert_eq!(run(&b, &k2, b"w"), (b"w".to_vec(), Source::Led));
    assert!(matches!(
        block_on(held.complete(b"late".to_vec())),
        Err(Error::LeaseLost)
    ));
    // A lead dropped unsettled (its caller went away) is counted as abandoned, and its
    // key is free for the next caller.
    let k3 = key();
    let Begin::Lead(dropped) = block_on(a.begin(&k3, "fp", ExecuteOptions::default())).unwrap()
    else {
        panic!("expected to lead")
    };
    drop(dropped);
    // Released in the background: waited for, so that `b` leads without waiting first.
    let released = std::time::Instant::now();
    while block_on(a.get(&k3)).unwrap().is_some() {
        assert!(
            released.elapsed() < Duration::from_secs(5),
            "never released"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(run(&b, &k3, b"x"), (b"x".to_vec(), Source::Led));
    assert_eq!(
        a.counters(),
        RedisCounters {
            claims: 4,
            leads: 3,
            takeovers: 0,
            replays: 1,
            remote_waits: 0,
            leases_lost: 1,
            abandoned: 1,
            unavailable: 0,
            claims_unreplicated: 0,
            completions_unreplicated: 0,
        }
    );
    assert_eq!(
        b.counters(),
        RedisCounters {
            claims: 3,
            leads: 2,
            takeovers: 1,
            replays: 1,
            remote_waits: 0,
            leases_lost: 0,
            abandoned: 0,
            unavailable: 0,
            claims_unreplicated: 0,
            completions_unreplicated: 0,
        }
    );
}

/// A running record without a `deadline`, or with one that is no number, or without a
/// `gen` (foreign or damaged data) is no error: with no lease to judge its leader by, a
/// claim and `remove` give it one lease from now and leave it alone (its leader may be
/// live and renew it), then take it over or delete it once that lease ran out; a waiter
/// whose look finds the deadline gone claims again and waits that lease; `get` reads it.
#[test]
#[ignore = "needs a Redis: run scripts/test-redis"]
fn a_running_record_without_a_deadline_or_a_generation_is_given_a_lease() {
    let lease = Duration::from_millis(400);
    let s = store(&prefix(), lease);
    let mut c = redis::Client::open(url())
        .unwrap()
        .get_connection()
        .unwrap();
    let record = |k: &ScopedKey| s.record_key(k);
    // The record of a leader of generation 3 (or of none), with `deadline` set as given.
    let write = |c: &mut redis::Connection, k: &ScopedKey, gen: bool, deadline: Option<&str>| {
        let mut cmd = redis::cmd("HSET");
        cmd.arg(record(k))
            .arg(&["v", "1", "state", "running", "fp", "fp", "token", "t"]);
        if gen {
            cmd.arg(&["gen", "3"]);
        }
        if let Some(d) = deadline {
            cmd.arg(&["deadline", d]);
        }
        let _: () = cmd.query(c).unwrap();
        let _: () = redis::cmd("PEXPIRE")
            .arg(record(k))
            .arg(60_000)
            .query(c)
            .unwrap();
    };
    let redis_now_ms = |c: &mut redis::Connection| -> u64 {
        let (s, us): (u64, u64) = redis::cmd("TIME").query(c).unwrap();
        s * 1000 + us / 1000
    };
    let exists = |c: &mut redis::Connection, k: &ScopedKey| -> i64 {
        redis::cmd("EXISTS").arg(record(k)).query(c).unwrap()
    };
    let after_the_lease = || std::thread::sleep(lease + Duration::from_millis(150));
    for (gen, deadline) in [(true, None), (true, Some("soon")), (false, None)] {
        let case = format!("gen: {gen}, deadline: {deadline:?}");
        // A claim: in progress, the action not run, until the lease it gave ran out.
        let k = key();
        write(&mut c, &k, gen, deadline);
        let r = block_on(s.execute_with(&k, "fp", ExecuteOptions::NO_WAIT, || async {
            panic!("ran while a leader may be live ({case})")
        }));
        assert!(
            matches!(r, Err(ExecuteError::Store(Error::InProgress { .. }))),
            "{case}: {r:?}"
        );
        after_the_lease();
        assert_eq!(run(&s, &k, b"v"), (b"v".to_vec(), Source::Led), "{case}");
        let got = block_on(s.get(&k)).unwrap().unwrap();
        assert_eq!(got.generation, if gen { 4 } else { 2 }, "{case}");

        // get reads it; remove leaves it alone until the lease it gave ran out.
        let k = key();
        write(&mut c, &k, gen, deadline);
        let got = block_on(s.get(&k)).unwrap().unwrap();
        assert_eq!(got.generation, if gen { 3 } else { 0 }, "{case}");
        assert!(
            matches!(got.state, RecordState::Running { .. }),
            "{case}: {got:?}"
        );
        assert!(!block_on(s.remove(&k)).unwrap(), "{case}");
        assert_eq!(exists(&mut c, &k), 1, "{case}");
        after_the_lease();
        assert!(block_on(s.remove(&k)).unwrap(), "{case}");
        assert_eq!(exists(&mut c, &k), 0, "{case}");

        // A waiter whose look finds the record damaged while it waits.
        let k = key();
        let live = (redis_now_ms(&mut c) + 300).to_string();
        write(&mut c, &k, gen, Some(&live));
        std::thread::scope(|scope| {
            let waiter = scope.spawn(|| run(&s, &k, b"w"));
            std::thread::sleep(Duration::from_millis(100));
            match deadline {
                Some(d) => write(&mut c, &k, gen, Some(d)),
                None => {
                    let _: () = redis::cmd("HDEL")
                        .arg(record(&k))
                        .arg("deadline")
                        .query(&mut c)
                        .unwrap();
                }
            }
            assert_eq!(
                waiter.join().unwrap(),
                (b"w".to_vec(), Source::Led),
                "{case}"
            );
        });
    }
}
