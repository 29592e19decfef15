//! Wake-ups by sharded pub/sub on a real Redis Cluster (`scripts/with-redis-cluster`,
//! which sets `ONCELY_REDIS_CLUSTER_URLS` and `ONCELY_REDIS_CLUSTER_DIR`): a waiter on
//! another instance subscribes with `SSUBSCRIBE` on the master that owns its key's
//! slot only, a completion's message reaches that shard only, and wake-ups go on
//! across a slot migration and a failover; a dropped store's listener ends; one
//! master refusing a call leaves the other masters' writes their `WAIT`s. One test runs
//! the scenarios in turn, as the later ones change the cluster.

mod support;
use std::process::Command;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use futures::executor::block_on;
use oncely::{Begin, Error, ExecuteError, IdempotencyKey, LeaderLease, ScopedKey};
use oncely_redis::RedisStore;
use support::{cluster_dir, node, nodes, owner, port_of, slot_of, urls, wait_cluster_ok};

#[derive(Debug)]
struct Boom;

/// Far longer than any wait below: a waiter that got its value was woken by a message.
const SLOW_POLL: Duration = Duration::from_secs(60);
/// The bound on a wake-up (or a subscription): beyond it the test calls it a hang.
const BOUND: Duration = Duration::from_secs(15);

type Waiter = JoinHandle<Result<Vec<u8>, ExecuteError<Boom>>>;

fn key() -> ScopedKey {
    ScopedKey::new("acme", "CreateOrder", &IdempotencyKey::random()).unwrap()
}

fn prefix() -> String {
    format!("s{}", &IdempotencyKey::random().as_str()[..10])
}

/// A store on the cluster (every node a seed: any may be down), polling every `poll`.
fn store(url: &str, prefix: &str, poll: Duration, min_replicas: usize) -> RedisStore<Boom> {
    let urls = urls();
    let seeds: Vec<String> = urls[1..]
        .iter()
        .map(|u| u.replacen("redis://", url, 1))
        .collect();
    let mut b = RedisStore::builder(urls[0].replacen("redis://", url, 1))
        .seeds(seeds)
        .cluster(true)
        .prefix(prefix)
        .lease(Duration::from_secs(30))
        .poll_interval(poll, poll);
    if min_replicas > 0 {
        b = b.min_replicas(min_replicas);
    }
    b.build().unwrap()
}

/// The notification channel of `record_key` (see the crate's README).
fn channel(record_key: &str) -> String {
    format!("{record_key}:done")
}

/// `PUBSUB SHARDNUMSUB channel` on each live master: (port, subscribers).
fn shard_subscribers(channel: &str) -> Vec<(u16, i64)> {
    nodes()
        .into_iter()
        .filter(|n| n.master && !n.failed)
        .filter_map(|n| {
            let mut c = node(n.port).ok()?;
            let (_, count): (String, i64) = redis::cmd("PUBSUB")
                .arg("SHARDNUMSUB")
                .arg(channel)
                .query(&mut c)
                .ok()?;
            Some((n.port, count))
        })
        .collect()
}

/// Waits until the channel has one shard subscriber, on the master serving its slot,
/// and none anywhere else.
fn wait_subscribed_on_owner(channel: &str) -> u16 {
    let deadline = Instant::now() + BOUND;
    loop {
        let owner = owner(slot_of(channel)).port;
        let subs = shard_subscribers(channel);
        if subs.iter().all(|&(p, n)| n == i64::from(p == owner)) && subs.len() == 3 {
            return owner;
        }
        assert!(
            Instant::now() < deadline,
            "no single subscription on the owner {owner} of {channel}: {subs:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `a` leads `k`; a caller on `b` waits for it (in a thread).
fn lead_and_wait(
    a: &RedisStore<Boom>,
    b: &RedisStore<Boom>,
    k: &ScopedKey,
) -> (oncely_redis::RedisLease<Boom>, Waiter) {
    let Begin::Lead(lease) = block_on(a.begin(k, "f", Default::default())).unwrap() else {
        panic!("expected to lead")
    };
    let (b, k) = (b.clone(), k.clone());
    let waiter = std::thread::spawn(move || {
        // While a master fails over, a look at the record may get UNAVAILABLE: the
        // caller asks again, and waits again on the leader.
        let mut tries = 0;
        loop {
            match block_on(b.execute(&k, "f", || async { Ok(b"not me".to_vec()) })) {
                Err(ExecuteError::Store(Error::Unavailable(_))) if tries < 200 => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(50));
                }
                r => return r.map(|d| d.value),
            }
        }
    });
    (lease, waiter)
}

/// Completes `lease` with `v` and checks that the waiter gets it within [`BOUND`]
/// (it would otherwise look again only after [`SLOW_POLL`]).
fn complete_and_wake(lease: oncely_redis::RedisLease<Boom>, waiter: Waiter, v: &[u8]) {
    block_on(LeaderLease::complete(lease, v.to_vec())).unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || tx.send(waiter.join().unwrap()));
    let got = rx
        .recv_timeout(BOUND)
        .expect("the waiter was not woken by the completion")
        .unwrap();
    assert_eq!(got, v);
}

/// Classic subscribers (`SUBSCRIBE`) on every master: the completion's message must
/// reach none of them (a `PUBLISH` reaches every node of a cluster).
struct Classic(Vec<redis::Connection>);

impl Classic {
    fn on_every_master(channel: &str) -> Self {
        let cons = nodes()
            .into_iter()
            .filter(|n| n.master && !n.failed)
            .map(|n| {
                let mut c = node(n.port).unwrap();
                let mut ps = c.as_pubsub();
                ps.subscribe(channel).unwrap();
                // Dropping it would unsubscribe.
                std::mem::forget(ps);
                c
            })
            .collect();
        Classic(cons)
    }

    fn heard(&mut self) -> usize {
        self.0
            .iter_mut()
            .filter_map(|c| {
                let mut ps = c.as_pubsub();
                ps.set_read_timeout(Some(Duration::from_millis(300)))
                    .unwrap();
                let heard = ps.get_message().is_ok();
                std::mem::forget(ps);
                heard.then_some(())
            })
            .count()
    }
}

/// A waiter on another instance subscribes on the key's shard only and is woken by
/// the shard message; the message reaches no classic subscriber on any master.
fn woken_by_the_key_shard_only() {
    let p = prefix();
    let (a, b) = (
        store("redis://", &p, SLOW_POLL, 0),
        store("redis://", &p, SLOW_POLL, 0),
    );
    let mut masters = std::collections::HashSet::new();
    while masters.len() < 3 {
        let k = key();
        let ch = channel(&b.record_key(&k));
        if !masters.insert(owner(slot_of(&ch)).port) {
            continue;
        }
        let mut classic = Classic::on_every_master(&ch);
        let (lease, waiter) = lead_and_wait(&a, &b, &k);
        wait_subscribed_on_owner(&ch);
        complete_and_wake(lease, waiter, b"v");
        assert_eq!(
            classic.heard(),
            0,
            "a classic subscriber heard the completion of {ch}"
        );
    }
}

/// The listener threads of this process (named `oncely-redis-listen`, cut to 15
/// bytes by the kernel).
fn listener_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim_end() == "oncely-redis-li")
        .count()
}

/// A store dropped while waits on every master are pending (subscribed, the listener
/// reading its shards), the waits dropped with it: its listener thread ends and its
/// subscriber connections close, within the bound.
fn a_dropped_store_leaves_no_listener_or_subscriber() {
    use std::future::Future;
    use std::pin::Pin;
    use std::task::Context;
    // The stores of the scenarios before are dropped: their listeners end too.
    let end = Instant::now() + BOUND;
    while listener_threads() > 0 {
        assert!(
            Instant::now() < end,
            "the listeners of dropped stores are still running"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let before = 0;
    let p = prefix();
    let (a, b) = (
        store("redis://", &p, SLOW_POLL, 0),
        store("redis://", &p, SLOW_POLL, 0),
    );
    type Wait<'a> = Pin<Box<dyn Future<Output = Result<Vec<u8>, String>> + 'a>>;
    let noop = futures::task::noop_waker();
    let mut masters = std::collections::HashSet::new();
    let (mut leases, mut waits, mut channels) = (Vec::new(), Vec::new(), Vec::new());
    while masters.len() < 3 {
        let k = key();
        let ch = channel(&b.record_key(&k));
        if !masters.insert(owner(slot_of(&ch)).port) {
            continue;
        }
        let Begin::Lead(lease) = block_on(a.begin(&k, "f", Default::default())).unwrap() else {
            panic!("expected to lead")
        };
        let b = &b;
        let mut wait: Wait<'_> = Box::pin(async move {
            b.execute(&k, "f", || async { Ok(b"not me".to_vec()) })
                .await
                .map(|d| d.value)
                .map_err(|e| format!("{e:?}"))
        });
        let end = Instant::now() + BOUND;
        while shard_subscribers(&ch).iter().all(|(_, n)| *n == 0) {
            assert!(
                wait.as_mut()
                    .poll(&mut Context::from_waker(&noop))
                    .is_pending(),
                "the wait ended"
            );
            assert!(Instant::now() < end, "{ch} was never subscribed");
            std::thread::sleep(Duration::from_millis(10));
        }
        leases.push(lease);
        waits.push(wait);
        channels.push(ch);
    }
    assert!(listener_threads() > before);
    drop(waits);
    drop(b);
    let end = Instant::now() + BOUND;
    loop {
        let subscribed: Vec<(String, Vec<(u16, i64)>)> = channels
            .iter()
            .map(|ch| (ch.clone(), shard_subscribers(ch)))
            .filter(|(_, on)| on.iter().any(|(_, n)| *n > 0))
            .collect();
        let threads = listener_threads();
        if subscribed.is_empty() && threads <= before {
            break;
        }
        assert!(
            Instant::now() < end,
            "after the store was dropped: {threads} listener threads (before: {before}), \
             still subscribed: {subscribed:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    for lease in leases {
        block_on(lease.complete(b"v".to_vec())).unwrap();
    }
}

/// With `min_replicas(1)`, a batch of one worker holds a completion that one master
/// refuses by closing the connection (over its `proto-max-bulk-len`, with the store's
/// `max_result_bytes` above it) and claims on another master: the claims' `WAIT`s still
/// go to their master, whose replica acknowledges them, and they lead. (The whole
/// cluster connection was dropped before the `WAIT`s: every claim of the batch was
/// released as unreplicated, UNAVAILABLE.)
fn a_call_refused_by_one_master_leaves_the_waits_on_the_others() {
    let p = prefix();
    let urls = urls();
    let s: RedisStore<Boom> = RedisStore::builder(urls[0].clone())
        .seeds(urls[1..].to_vec())
        .cluster(true)
        .prefix(&p)
        .lease(Duration::from_secs(30))
        .io_timeout(Duration::from_secs(5))
        .min_replicas(1)
        .min_replicas_timeout(Duration::from_secs(2))
        .max_result_bytes(4 << 20)
        .workers(1)
        .build()
        .unwrap();
    let master = |k: &ScopedKey| owner(slot_of(&s.record_key(k))).port;
    let masters: Vec<u16> = {
        let mut m: Vec<u16> = nodes()
            .into_iter()
            .filter(|n| n.master && !n.failed)
            .map(|n| n.port)
            .collect();
        m.sort();
        m
    };
    let (paused, refusing, claimed) = (masters[0], masters[1], masters[2]);
    let key_on = |port: u16| loop {
        let k = key();
        if master(&k) == port {
            return k;
        }
    };
    // Every replica has caught up (a cluster just started, or failed over, may not).
    for port in &masters {
        let end = Instant::now() + BOUND;
        let mut c = node(*port).unwrap();
        loop {
            let n: usize = redis::cmd("WAIT").arg(1).arg(200).query(&mut c).unwrap();
            if n >= 1 {
                break;
            }
            assert!(
                Instant::now() < end,
                "the replica of {port} does not acknowledge"
            );
        }
    }
    let big = key_on(refusing);
    let Begin::Lead(lease) = block_on(s.begin(&big, "f", Default::default())).unwrap() else {
        panic!("expected to lead")
    };
    let set_limit = |v: &str| {
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("proto-max-bulk-len")
            .arg(v)
            .query(&mut node(refusing).unwrap())
            .unwrap();
    };
    set_limit("1mb");
    // The worker is held by a claim on the paused master while the others queue.
    let () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(1000)
        .arg("WRITE")
        .query(&mut node(paused).unwrap())
        .unwrap();
    let first = {
        let (s, k) = (s.clone(), key_on(paused));
        std::thread::spawn(move || {
            block_on(s.execute(&k, "f", || async { Ok(b"first".to_vec()) })).map(|d| d.value)
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    let complete = std::thread::spawn(move || block_on(lease.complete(vec![b'x'; (1 << 20) + 1])));
    let claims: Vec<_> = (0..4)
        .map(|i| {
            let (s, k) = (s.clone(), key_on(claimed));
            std::thread::spawn(move || {
                block_on(s.execute(&k, "f", || async move { Ok(format!("c{i}").into_bytes()) }))
                    .map(|d| d.value)
            })
        })
        .collect();
    let first = first.join().unwrap();
    let complete = complete.join().unwrap();
    let claims: Vec<_> = claims.into_iter().map(|c| c.join().unwrap()).collect();
    set_limit("512mb");
    assert_eq!(first.unwrap(), b"first");
    assert!(
        complete.is_err(),
        "Redis took a value over its proto-max-bulk-len"
    );
    for (i, c) in claims.into_iter().enumerate() {
        match c {
            Ok(v) => assert_eq!(v, format!("c{i}").into_bytes()),
            Err(e) => panic!("claim {i} on master {claimed}: {e:?}"),
        }
    }
    assert_eq!(s.counters().claims_unreplicated, 0);
}

/// Moves the slot of a key a waiter waits on to another master (SETSLOT IMPORTING /
/// MIGRATING, MIGRATE, SETSLOT NODE): the listener subscribes on the new owner and
/// the waiter is woken by the completion.
fn woken_after_its_slot_migrated() {
    let p = prefix();
    let (a, b) = (
        store("redis://", &p, SLOW_POLL, 0),
        store("redis://", &p, SLOW_POLL, 0),
    );
    let k = key();
    let record = b.record_key(&k);
    let ch = channel(&record);
    let slot = slot_of(&record);
    let (lease, waiter) = lead_and_wait(&a, &b, &k);
    let from_port = wait_subscribed_on_owner(&ch);
    let masters: Vec<_> = nodes()
        .into_iter()
        .filter(|n| n.master && !n.failed)
        .collect();
    let from = masters.iter().find(|n| n.port == from_port).unwrap();
    let to = masters.iter().find(|n| n.port != from_port).unwrap();
    let (mut src, mut dst) = (node(from.port).unwrap(), node(to.port).unwrap());
    let setslot = |c: &mut redis::Connection, how: &str, id: &str| {
        let () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg(how)
            .arg(id)
            .query(c)
            .unwrap();
    };
    setslot(&mut dst, "IMPORTING", &from.id);
    setslot(&mut src, "MIGRATING", &to.id);
    let keys: Vec<String> = redis::cmd("CLUSTER")
        .arg("GETKEYSINSLOT")
        .arg(slot)
        .arg(1000)
        .query(&mut src)
        .unwrap();
    assert!(keys.contains(&record), "{record} is not in slot {slot}");
    let () = redis::cmd("MIGRATE")
        .arg("127.0.0.1")
        .arg(to.port)
        .arg("")
        .arg(0)
        .arg(5000)
        .arg("KEYS")
        .arg(&keys)
        .query(&mut src)
        .unwrap();
    setslot(&mut dst, "NODE", &to.id);
    setslot(&mut src, "NODE", &to.id);
    for m in &masters {
        if m.port != from.port && m.port != to.port {
            setslot(&mut node(m.port).unwrap(), "NODE", &to.id);
        }
    }
    wait_cluster_ok("the slot migration");
    assert_eq!(wait_subscribed_on_owner(&ch), to.port);
    complete_and_wake(lease, waiter, b"moved");
}

/// Kills (SIGKILL) the master serving a key a waiter waits on; its replica is
/// promoted: the listener subscribes there and the waiter is woken by the completion
/// (the claim was acknowledged by the replica: `min_replicas(1)`). The killed node is
/// started again (it rejoins as a replica).
fn woken_after_its_master_failed_over() {
    let p = prefix();
    let a = store("redis://", &p, SLOW_POLL, 1);
    let b = store("redis://", &p, SLOW_POLL, 0);
    let k = key();
    let record = b.record_key(&k);
    let ch = channel(&record);
    let (lease, waiter) = lead_and_wait(&a, &b, &k);
    let victim = wait_subscribed_on_owner(&ch);
    let dir = cluster_dir();
    let pid = std::fs::read_to_string(format!("{dir}/{victim}/redis.pid")).unwrap();
    let killed = Command::new("kill")
        .args(["-9", pid.trim()])
        .status()
        .unwrap();
    assert!(killed.success());
    let slot = slot_of(&record);
    let deadline = Instant::now() + Duration::from_secs(30);
    while owner_port(slot).is_none_or(|p| p == victim) {
        assert!(Instant::now() < deadline, "no replica took over");
        std::thread::sleep(Duration::from_millis(50));
    }
    wait_cluster_ok("the failover");
    let new_owner = wait_subscribed_on_owner(&ch);
    assert_ne!(new_owner, victim);
    complete_and_wake(lease, waiter, b"failed over");
    let conf = format!("{dir}/{victim}/redis.conf");
    let started = Command::new("redis-server")
        .args([conf.as_str(), "--daemonize", "yes"])
        .status()
        .unwrap();
    assert!(started.success());
    let deadline = Instant::now() + Duration::from_secs(30);
    while !node(victim).is_ok_and(|mut c| redis::cmd("PING").query::<String>(&mut c).is_ok()) {
        assert!(
            Instant::now() < deadline,
            "the old master did not start again"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    wait_cluster_ok("restarting the old master");
}

/// The live master serving `slot`, if any (none while a failover is under way).
fn owner_port(slot: u16) -> Option<u16> {
    nodes()
        .into_iter()
        .find(|n| n.master && !n.failed && n.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot)))
        .map(|n| n.port)
}

/// Many waiters on keys over every master, half of them dropped mid-wait (their
/// channels unsubscribed when they were the last), then a new waiter per key (the
/// channel subscribed again): every waiter still waiting is woken by the completion.
fn waiters_come_and_go() {
    const KEYS: usize = 24;
    let p = prefix();
    let a = store("redis://", &p, SLOW_POLL, 0);
    let others = [
        store("redis://", &p, SLOW_POLL, 0),
        store("redis://", &p, SLOW_POLL, 0),
    ];
    let keys: Vec<ScopedKey> = (0..KEYS).map(|_| key()).collect();
    let masters: std::collections::HashSet<u16> = keys
        .iter()
        .map(|k| owner(slot_of(&a.record_key(k))).port)
        .collect();
    assert_eq!(masters.len(), 3, "the keys should reach every master");
    let leases: Vec<_> = keys
        .iter()
        .map(
            |k| match block_on(a.begin(k, "f", Default::default())).unwrap() {
                Begin::Lead(lease) => lease,
                _ => panic!("expected to lead"),
            },
        )
        .collect();
    let wait = |k: &ScopedKey, b: &RedisStore<Boom>| {
        let (b, k) = (b.clone(), k.clone());
        let (cancel, cancelled) = futures::channel::oneshot::channel::<()>();
        let h = std::thread::spawn(move || {
            let call = Box::pin(b.execute(&k, "f", || async { Ok(b"not me".to_vec()) }));
            match block_on(futures::future::select(call, cancelled)) {
                futures::future::Either::Left((r, _)) => Some(r.map(|d| d.value)),
                futures::future::Either::Right(_) => None,
            }
        });
        (cancel, h)
    };
    let mut kept = Vec::new();
    let mut dropped = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        for w in 0..3 {
            let waiter = wait(k, &others[(i + w) % 2]);
            // Every key loses a waiter; a third of them lose all of theirs.
            if w == 0 || i % 3 == 0 {
                dropped.push(waiter);
            } else {
                kept.push((i, waiter));
            }
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    for (cancel, h) in dropped {
        cancel.send(()).unwrap();
        assert!(
            h.join().unwrap().is_none(),
            "a dropped waiter got an answer"
        );
    }
    for (i, k) in keys.iter().enumerate().filter(|(i, _)| i % 3 == 0) {
        kept.push((i, wait(k, &others[i % 2])));
    }
    std::thread::sleep(Duration::from_millis(300));
    for (i, lease) in leases.into_iter().enumerate() {
        block_on(LeaderLease::complete(lease, format!("v{i}").into_bytes())).unwrap();
    }
    let (tx, rx) = mpsc::channel();
    let n = kept.len();
    // A dropped sender cancels too: they are kept until the end.
    let mut senders = Vec::new();
    for (i, (cancel, h)) in kept {
        senders.push(cancel);
        let tx = tx.clone();
        std::thread::spawn(move || tx.send((i, h.join().unwrap())));
    }
    for _ in 0..n {
        let (i, got) = rx
            .recv_timeout(BOUND)
            .expect("a waiter was not woken by the completion");
        let got = got.expect("a kept waiter was cancelled").unwrap();
        assert_eq!(got, format!("v{i}").into_bytes());
    }
}

/// A user without rights on any channel (`resetchannels`): `SSUBSCRIBE` is refused
/// and the scripts' `SPUBLISH` fails (best effort); waiters poll and finish.
fn refused_subscriptions_fall_back_to_polling() {
    let user = format!("u{}", &IdempotencyKey::random().as_str()[..10]);
    for u in urls() {
        let () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg(&user)
            .arg(&["on", ">s3cret", "~*", "resetchannels", "+@all"][..])
            .query(&mut node(port_of(&u)).unwrap())
            .unwrap();
    }
    let auth = format!("redis://{user}:s3cret@");
    let p = prefix();
    let poll = Duration::from_millis(100);
    let (a, b) = (store(&auth, &p, poll, 0), store(&auth, &p, poll, 0));
    for round in 0..3 {
        let k = key();
        let ch = channel(&b.record_key(&k));
        let (lease, waiter) = lead_and_wait(&a, &b, &k);
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            shard_subscribers(&ch).iter().all(|&(_, n)| n == 0),
            "{ch} subscribed without channel rights"
        );
        complete_and_wake(lease, waiter, format!("polled {round}").as_bytes());
    }
    for u in urls() {
        let () = redis::cmd("ACL")
            .arg("DELUSER")
            .arg(&user)
            .query(&mut node(port_of(&u)).unwrap())
            .unwrap();
    }
}

#[test]
#[ignore = "needs a Redis Cluster: run scripts/test-redis"]
fn on_cluster_wake_ups_by_sharded_pub_sub() {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        // The binaries before share this cluster: one may have just failed a master
        // over and started it again.
        wait_cluster_ok("the tests before");
        woken_by_the_key_shard_only();
        a_dropped_store_leaves_no_listener_or_subscriber();
        a_call_refused_by_one_master_leaves_the_waits_on_the_others();
        waiters_come_and_go();
        refused_subscriptions_fall_back_to_polling();
        woken_after_its_slot_migrated();
        woken_after_its_master_failed_over();
        tx.send(()).unwrap();
    });
    match rx.recv_timeout(Duration::from_secs(180)) {
        Ok(()) => {}
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("a scenario failed (see above)"),
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("the scenarios hung"),
    }
}
