//! One node of a Redis Cluster stalls or a slot is half-way to another node, on a
//! real cluster started by `scripts/with-redis-cluster` (which sets
//! `ONCELY_REDIS_CLUSTER_URLS` and `ONCELY_REDIS_CLUSTER_DIR`):
//!
//! - a claim that Redis redirects (ASK, a slot being migrated) is replicated where it
//!   ran: `WAIT` goes to the node that ran it, not to the slot's old owner;
//! - a call to a paused master answers UNAVAILABLE by its deadline, not after retries;
//! - one paused master does not stall the renewals of the leases on the others;
//! - nor does it take the time of a call another master sends back for a second round
//!   (NOSCRIPT) in the same batch.
//!
//! The scenarios run one after another (each changes the cluster for a while); their
//! own test binary, so they never run beside the other cluster tests.

mod support;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::executor::block_on;
use oncely::{Begin, Code, ExecuteError, ExecuteOptions, IdempotencyKey, LeaderLease, ScopedKey};
use oncely_redis::RedisStore;
use support::{cluster_dir, port_of, urls, wait_cluster_ok};

#[derive(Debug)]
struct Boom;

fn node(port: u16) -> redis::Connection {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .unwrap()
        .get_connection_with_timeout(Duration::from_secs(2))
        .unwrap()
}

/// A master, its slots and its replicas' ports, as `CLUSTER NODES` tells.
#[derive(Debug, Clone)]
struct Master {
    id: String,
    port: u16,
    slots: Vec<u16>,
    replicas: Vec<u16>,
}

/// The masters, once each has a live replica (after a failover in another test the
/// old master may still be rejoining as a replica).
fn masters() -> Vec<Master> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ms = masters_now();
        if ms.len() == 3 && ms.iter().all(|m| !m.replicas.is_empty()) {
            return ms;
        }
        assert!(
            Instant::now() < deadline,
            "a master has no live replica: {:?}",
            ms.iter()
                .map(|m| (m.port, m.replicas.clone()))
                .collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn masters_now() -> Vec<Master> {
    let text: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query(&mut node(port_of(&urls()[0])))
        .unwrap();
    let lines: Vec<Vec<&str>> = text
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    let port = |f: &[&str]| -> u16 {
        f[1].split('@')
            .next()
            .unwrap()
            .rsplit(':')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    lines
        .iter()
        .filter(|f| f[2].contains("master") && !f[2].contains("fail") && f.len() > 8)
        .map(|f| Master {
            id: f[0].to_owned(),
            port: port(f),
            slots: f[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .flat_map(|s| match s.split_once('-') {
                    Some((a, b)) => a.parse::<u16>().unwrap()..=b.parse().unwrap(),
                    None => s.parse().unwrap()..=s.parse().unwrap(),
                })
                .collect(),
            replicas: lines
                .iter()
                .filter(|r| r[3] == f[0] && !r[2].contains("fail") && r[7] == "connected")
                .map(|r| port(r))
                .collect(),
        })
        .collect()
}

fn store(prefix: &str, min_replicas: usize) -> RedisStore<Boom> {
    builder(prefix, min_replicas).build().unwrap()
}

fn builder(prefix: &str, min_replicas: usize) -> oncely_redis::RedisStoreBuilder<Boom> {
    let urls = urls();
    let mut b = RedisStore::builder(urls[0].clone())
        .seeds(urls[1..].to_vec())
        .cluster(true)
        .prefix(prefix)
        .lease(Duration::from_millis(900))
        .io_timeout(Duration::from_millis(300));
    if min_replicas > 0 {
        b = b
            .min_replicas(min_replicas)
            .min_replicas_timeout(Duration::from_millis(150));
    }
    b
}

fn key() -> ScopedKey {
    ScopedKey::new("acme", "CreateOrder", &IdempotencyKey::random()).unwrap()
}

/// A key whose record hashes to `slot`... or to any slot of `slots` (the first found).
fn key_in(store: &RedisStore<Boom>, slots: &[u16]) -> (ScopedKey, u16) {
    let mut c = node(port_of(&urls()[0]));
    loop {
        let batch: Vec<ScopedKey> = (0..2000).map(|_| key()).collect();
        let mut p = redis::pipe();
        for k in &batch {
            p.cmd("CLUSTER").arg("KEYSLOT").arg(store.record_key(k));
        }
        let got: Vec<u16> = p.query(&mut c).unwrap();
        if let Some((k, s)) = batch.into_iter().zip(got).find(|(_, s)| slots.contains(s)) {
            return (k, s);
        }
    }
}

fn signal(port: u16, sig: &str) {
    let pid = std::fs::read_to_string(format!("{}/{port}/redis.pid", cluster_dir())).unwrap();
    let ok = Command::new("kill")
        .args([sig, pid.trim()])
        .status()
        .unwrap();
    assert!(ok.success(), "kill {sig} of the node on port {port}");
}

fn pause(port: u16, ms: u64) {
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(ms)
        .arg("ALL")
        .query(&mut node(port))
        .unwrap();
}

/// Waits until `master`'s replicas are all in sync (`WAIT` on the master).
fn wait_synced(master: &Master) {
    let mut c = node(master.port);
    let n = master.replicas.len();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let _: () = redis::cmd("SET")
            .arg(format!("sync{{{}}}", master.slots[0]))
            .arg("x")
            .query(&mut c)
            .unwrap_or(());
        let acked: usize = redis::cmd("WAIT").arg(n).arg(200).query(&mut c).unwrap();
        if acked >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{master:?}: replicas not in sync"
        );
    }
}

#[test]
#[ignore = "needs a Redis Cluster: run scripts/test-redis"]
fn on_cluster_stalled_nodes_and_migrating_slots() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // The binaries before share this cluster: one may have just failed a master
        // over and started it again.
        wait_cluster_ok("the tests before");
        redirected_claim_is_replicated_where_it_ran();
        connection_killed_during_wait_vouches_for_nothing();
        script_unknown_to_the_importing_node_is_loaded_there();
        script_reload_keeps_its_time_beside_a_paused_master();
        paused_master_does_not_stall_renewals_elsewhere();
        call_to_paused_master_ends_by_its_deadline();
        let _ = tx.send(());
    });
    match rx.recv_timeout(Duration::from_secs(120)) {
        Ok(()) => {}
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            panic!("a scenario failed (see above)")
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("the scenarios hung"),
    }
}

/// A slot MIGRATING from master A to master B whose replica is stopped: a claim of a
/// new key there is redirected (ASK) to B, which cannot replicate it; with
/// `min_replicas(1)` the caller must get UNAVAILABLE and the action must not run. (A
/// `WAIT` sent by slot would go to A, whose replica is in sync, and vouch for it.)
fn redirected_claim_is_replicated_where_it_ran() {
    let prefix = format!("m{}", &IdempotencyKey::random().as_str()[..10]);
    let s = store(&prefix, 1);
    let ms = masters();
    let (a, b) = (&ms[0], &ms[1]);
    wait_synced(a);
    wait_synced(b);
    // Warm: the store's connections are open and have written on A, and B knows the
    // scripts.
    // (A replica just synced may still miss one WAIT of 150 ms on a loaded machine.)
    for m in [a, b] {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let (warm, _) = key_in(&s, &m.slots);
            match block_on(s.execute(&warm, "f", || async { Ok(vec![0]) })) {
                Ok(_) => break,
                Err(ExecuteError::Store(oncely::Error::Unavailable(e)))
                    if Instant::now() < until =>
                {
                    eprintln!("warming: {e}");
                }
                Err(e) => panic!("warming: {e:?}"),
            }
        }
    }
    let (k, slot) = key_in(&s, &a.slots);
    let back = migrate(slot, a, b);
    for &r in &b.replicas {
        signal(r, "-STOP");
    }
    let ran = AtomicUsize::new(0);
    let r = block_on(s.execute(&k, "f", || async {
        ran.fetch_add(1, Ordering::SeqCst);
        Ok(vec![1])
    }));
    for &r in &b.replicas {
        signal(r, "-CONT");
    }
    // Back as it was: the slot stays with A (nothing was written on B that A lacks
    // but a released record, deleted).
    back();
    match r {
        Err(ExecuteError::Store(e)) => assert_eq!(e.code(), Code::Unavailable, "{e}"),
        other => panic!(
            "a claim B's replicas never saw was vouched for: expected UNAVAILABLE, got \
             {other:?}"
        ),
    }
    assert_eq!(ran.load(Ordering::SeqCst), 0, "the action ran unreplicated");
    wait_synced(b);
}

/// A claim's `WAIT` is waiting (the master's replica is stopped) when the master
/// kills the store's connections (`CLIENT KILL`): the claim must count as not
/// replicated. (A `WAIT` sent again on a new connection, which wrote nothing, would
/// answer at once with the replicas that acknowledged nothing of it.)
fn connection_killed_during_wait_vouches_for_nothing() {
    let prefix = format!("k{}", &IdempotencyKey::random().as_str()[..10]);
    // One worker, so that the warm-up below opened the connection the claim goes on.
    let s = builder(&prefix, 1).workers(1).build().unwrap();
    let ms = masters();
    let a = &ms[2];
    wait_synced(a);
    let (warm, _) = key_in(&s, &a.slots);
    block_on(s.execute(&warm, "f", || async { Ok(vec![0]) })).unwrap();
    let (k, _) = key_in(&s, &a.slots);
    for &r in &a.replicas {
        signal(r, "-STOP");
    }
    let port = a.port;
    let killer = std::thread::spawn(move || {
        let mut c = node(port);
        // The claim ran; its WAIT waits 150 ms for the stopped replica: kill the
        // connection it waits on.
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            let list: String = redis::cmd("CLIENT").arg("LIST").query(&mut c).unwrap();
            let waiting = list
                .lines()
                .find(|l| l.contains(" cmd=wait"))
                .and_then(|l| {
                    l.split_whitespace()
                        .find_map(|f| f.strip_prefix("id="))
                        .map(str::to_owned)
                });
            if let Some(id) = waiting {
                let _: () = redis::cmd("CLIENT")
                    .arg("KILL")
                    .arg("ID")
                    .arg(id)
                    .query(&mut c)
                    .unwrap();
                return true;
            }
        }
        false
    });
    let ran = AtomicUsize::new(0);
    let r = block_on(s.execute(&k, "f", || async {
        ran.fetch_add(1, Ordering::SeqCst);
        Ok(vec![1])
    }));
    let killed = killer.join().unwrap();
    for &r in &a.replicas {
        signal(r, "-CONT");
    }
    match r {
        Err(ExecuteError::Store(e)) => assert_eq!(e.code(), Code::Unavailable, "{e}"),
        other => panic!(
            "a claim whose WAIT was cut off was vouched for: expected UNAVAILABLE, got \
             {other:?}"
        ),
    }
    assert_eq!(ran.load(Ordering::SeqCst), 0, "the action ran unreplicated");
    assert!(killed, "no connection was seen waiting in WAIT");
    wait_synced(a);
}

/// Starts moving `slot` from `a` to `b` (MIGRATING / IMPORTING); the function
/// returned cancels the move (the slot stays with `a`).
fn migrate(slot: u16, a: &Master, b: &Master) -> impl Fn() {
    let setslot = move |port: u16, how: &str, id: &str| {
        let _: () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg(how)
            .arg(id)
            .query(&mut node(port))
            .unwrap();
    };
    setslot(b.port, "IMPORTING", &a.id);
    setslot(a.port, "MIGRATING", &b.id);
    let (a, b) = (a.clone(), b.clone());
    move || {
        // STABLE: the migration is cancelled whatever keys the slot holds on A.
        for port in [a.port, b.port] {
            let _: () = redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg("STABLE")
                .query(&mut node(port))
                .unwrap();
        }
    }
}

/// A slot MIGRATING to a node that does not know the scripts (flushed): a claim
/// there (ASK) gets NOSCRIPT from that node, so the script is loaded on it, not on
/// the slot's owner, and the call leads.
fn script_unknown_to_the_importing_node_is_loaded_there() {
    let prefix = format!("s{}", &IdempotencyKey::random().as_str()[..10]);
    let s = store(&prefix, 0);
    let ms = masters();
    let (a, b) = (&ms[0], &ms[1]);
    let (warm, _) = key_in(&s, &a.slots);
    block_on(s.execute(&warm, "f", || async { Ok(vec![0]) })).unwrap();
    let (k, slot) = key_in(&s, &a.slots);
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut node(b.port))
        .unwrap();
    let back = migrate(slot, a, b);
    let r = block_on(s.execute(&k, "f", || async { Ok(vec![1]) }));
    // The record was created on B: copied back to A with the slot (B's copy is
    // left in a slot it does not serve).
    let mut src = node(b.port);
    let record = s.record_key(&k);
    let (dump,): (Option<Vec<u8>>,) = redis::pipe()
        .cmd("ASKING")
        .ignore()
        .cmd("DUMP")
        .arg(&record)
        .query(&mut src)
        .unwrap();
    back();
    if let Some(dump) = dump {
        let _: () = redis::cmd("RESTORE")
            .arg(&record)
            .arg(0)
            .arg(dump)
            .arg("REPLACE")
            .query(&mut node(a.port))
            .unwrap();
    }
    let r = r.expect("a claim on an importing node that did not know the script");
    assert_eq!(r.value, vec![1]);
}

/// One batch holds a call on a paused master (A) and one on a master that forgot the
/// scripts (B, `SCRIPT FLUSH`): B's call needs a second round (load the script, send
/// again), which must get its share of the time, not what A's stall left (nothing).
/// Twice: A read first (not yet known as slow), then A read last (known as slow).
/// One worker; a short pause of a third master (C) holds it while the two calls queue
/// up, so they go out together.
fn script_reload_keeps_its_time_beside_a_paused_master() {
    let prefix = format!("r{}", &IdempotencyKey::random().as_str()[..10]);
    let s = builder(&prefix, 0)
        .io_timeout(Duration::from_millis(600))
        .lease(Duration::from_secs(2))
        .workers(1)
        .build()
        .unwrap();
    let ms = masters();
    let (a, b, c) = (&ms[0], &ms[1], &ms[2]);
    for m in [a, b, c] {
        let (warm, _) = key_in(&s, &m.slots);
        block_on(s.execute(&warm, "f", || async { Ok(vec![0]) })).unwrap();
    }
    // Found before the pause (key_in asks a node that may be A).
    let keys: Vec<_> = (0..2)
        .map(|_| {
            (
                key_in(&s, &a.slots).0,
                key_in(&s, &b.slots).0,
                key_in(&s, &c.slots).0,
            )
        })
        .collect();
    pause(a.port, 4000);
    let started = Instant::now();
    for (round, (ka, kb, kc)) in ["A read first", "A read last"].into_iter().zip(keys) {
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query(&mut node(b.port))
            .unwrap();
        pause(c.port, 150);
        std::thread::scope(|scope| {
            let holder = scope.spawn(|| block_on(s.begin(&kc, "f", ExecuteOptions::default())));
            std::thread::sleep(Duration::from_millis(50));
            // Claims only: with one worker, what follows a claim on A (its release)
            // waits for A again.
            let (ra, rb) = block_on(futures::future::join(
                s.begin(&ka, "f", ExecuteOptions::default()),
                s.begin(&kb, "f", ExecuteOptions::default()),
            ));
            match ra {
                Err(e) => assert_eq!(e.code(), Code::Unavailable, "{round}: {e}"),
                Ok(other) => panic!("{round}: a claim on a paused master: {other:?}"),
            }
            match rb {
                Ok(Begin::Lead(lease)) => drop(lease),
                other => panic!(
                    "{round}: a claim on a healthy master that needed its script loaded: \
                     {other:?}"
                ),
            }
            assert!(
                matches!(holder.join().unwrap(), Ok(Begin::Lead(_))),
                "{round}: the claim on C"
            );
        });
        // What the claims left queued (the release of A's claim, sent to A) is done
        // before the next round.
        std::thread::sleep(Duration::from_millis(800));
    }
    assert!(
        started.elapsed() < Duration::from_millis(3900),
        "the scenario outlasted A's pause"
    );
    std::thread::sleep(Duration::from_millis(4100).saturating_sub(started.elapsed()));
}

/// A master paused (`CLIENT PAUSE`): a call on one of its keys answers UNAVAILABLE
/// within its I/O timeout and a small bound, not after the client's own retries.
fn call_to_paused_master_ends_by_its_deadline() {
    let prefix = format!("d{}", &IdempotencyKey::random().as_str()[..10]);
    let s = store(&prefix, 0);
    let ms = masters();
    let p = &ms[2];
    let (warm, _) = key_in(&s, &p.slots);
    block_on(s.execute(&warm, "f", || async { Ok(vec![0]) })).unwrap();
    let (k, _) = key_in(&s, &p.slots);
    pause(p.port, 2500);
    let ran = AtomicUsize::new(0);
    let t = Instant::now();
    let r = block_on(s.execute(&k, "f", || async {
        ran.fetch_add(1, Ordering::SeqCst);
        Ok(vec![1])
    }));
    let took = t.elapsed();
    println!("a call on a paused master answered after {took:?} (I/O timeout 300 ms)");
    match r {
        Err(ExecuteError::Store(e)) => assert_eq!(e.code(), Code::Unavailable, "{e}"),
        other => panic!("expected UNAVAILABLE from a paused master, got {other:?}"),
    }
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    // The I/O timeout is 300 ms: the client's retries took it past 1 s.
    assert!(
        took < Duration::from_millis(800),
        "a call on a paused master took {took:?} (I/O timeout 300 ms)"
    );
    std::thread::sleep(Duration::from_millis(2600).saturating_sub(t.elapsed()));
}

/// Leases on two masters; one master is paused for three leases: the leases on the
/// other must be renewed all along (their records' deadlines, in Redis' own time,
/// never pass: no other store could take them over), and their leaders complete.
/// The paused master is the store's first seed, and the renewer opens its connection
/// during the pause: a connection opened while a node stalls must not wait on it
/// each time (it asks it last once any connection of the store saw it time out).
fn paused_master_does_not_stall_renewals_elsewhere() {
    let prefix = format!("n{}", &IdempotencyKey::random().as_str()[..10]);
    let ms = masters();
    let (healthy, paused) = (&ms[0], &ms[1]);
    let first = format!("redis://127.0.0.1:{}", paused.port);
    let s: RedisStore<Boom> = RedisStore::builder(first.clone())
        .seeds(
            urls()
                .into_iter()
                .filter(|u| *u != first)
                .collect::<Vec<_>>(),
        )
        .cluster(true)
        .prefix(&prefix)
        .lease(Duration::from_millis(900))
        .io_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let mut leases = Vec::new();
    let mut records = Vec::new();
    // Several on each: the renewer sends them together.
    for i in 0..6 {
        let m = if i % 2 == 0 { healthy } else { paused };
        let (k, _) = key_in(&s, &m.slots);
        match block_on(s.begin(&k, "f", ExecuteOptions::default())).unwrap() {
            Begin::Lead(l) => leases.push(l),
            other => panic!("{other:?}"),
        }
        if i % 2 == 0 {
            records.push(s.record_key(&k));
        }
    }
    let mut h = node(healthy.port);
    pause(paused.port, 3000);
    let until = Instant::now() + Duration::from_millis(2900);
    while Instant::now() < until {
        let (secs, micros): (u64, u64) = redis::cmd("TIME").query(&mut h).unwrap();
        let now = secs * 1000 + micros / 1000;
        for r in &records {
            let deadline: u64 = redis::cmd("HGET")
                .arg(r)
                .arg("deadline")
                .query(&mut h)
                .unwrap();
            assert!(
                deadline > now,
                "a lease on a healthy master lapsed ({} ms ago) while another master was \
                 paused",
                now - deadline
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    for (i, l) in leases.into_iter().enumerate() {
        if i % 2 == 0 {
            assert!(!l.is_lost(), "lease {i} on the healthy master was lost");
            block_on(l.complete(vec![1])).unwrap();
        } else {
            drop(l);
        }
    }
}
