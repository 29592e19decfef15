//! A worker's batch of calls sent on its connection: cut into runs of calls with
//! close deadlines, each run one pipeline, followed by the `WAIT` its replicated
//! writes need.

use std::time::Instant;

use crate::conn::{left, Conn, Link};
use crate::pipeline::pipeline;
use crate::pool::{Call, Queue};
use crate::request::{Failure, Request};
use crate::topology::Con;

/// What the replicas said of a replicated write (see [`Request::replicated`]): `None`
/// when no `WAIT` was asked for (no `min_replicas`, or the reply wrote nothing), else
/// how many replicas acknowledged it, or why `WAIT` failed.
pub(crate) type Acked = Option<Result<usize, redis::RedisError>>;

/// Calls of one batch whose deadlines lie further apart than this part of the I/O
/// timeout go out in separate pipelines (see [`run_batch`]).
const SPREAD: u32 = 8;

/// Sends a batch of calls on `conn` and hands each its outcome.
///
/// Calls whose caller went away are dropped and calls whose deadline passed are
/// failed, both without being sent. A pipeline is bounded by the earliest deadline of
/// its calls, so calls made far apart (one waited long for a worker, the others came
/// just now) are not sent together: the batch is cut, in order, into runs of calls
/// whose deadlines lie within a [`SPREAD`]th of the I/O timeout of the run's first,
/// each run one pipeline (and its `WAIT`) with its own deadline. Otherwise one old call
/// would leave the others a sliver of their time, and with `min_replicas` a `WAIT` of
/// about nothing: all their claims released as unreplicated.
pub(crate) fn run_batch(conn: &mut Conn, queue: &Queue, batch: Vec<Call>) {
    let io_timeout = conn.link.io_timeout;
    let spread = io_timeout / SPREAD;
    let mut runs: Vec<Vec<Call>> = Vec::new();
    for call in batch {
        match runs.last_mut() {
            Some(run)
                if run[0].deadline.max(call.deadline) - run[0].deadline.min(call.deadline)
                    <= spread =>
            {
                run.push(call)
            }
            _ => runs.push(vec![call]),
        }
    }
    for run in runs {
        run_pipeline(conn, queue, run);
    }
}

/// Sends `batch` as one pipeline on `conn`, bounded by its earliest deadline, and
/// hands each call its outcome (see [`run_batch`]).
fn run_pipeline(conn: &mut Conn, queue: &Queue, batch: Vec<Call>) {
    let io_timeout = conn.link.io_timeout;
    let mut calls = Vec::with_capacity(batch.len());
    for call in batch {
        if call.abandoned.as_ref().is_some_and(|gone| gone()) {
            continue;
        }
        if left(call.deadline, io_timeout).is_none() {
            (call.done)(Err(Failure::NotSent), None, queue);
            continue;
        }
        calls.push(call);
    }
    let Some(deadline) = calls.iter().map(|c| c.deadline).min() else {
        return;
    };
    let requests: Vec<&Request> = calls.iter().map(|c| &c.request).collect();
    let replies = if requests.len() == 1 {
        conn.run(deadline, |c| pipeline(c, &requests, deadline))
    } else {
        run_or_resend_each(conn, &requests, deadline)
    };
    match replies {
        Ok(mut replies) => {
            // Redis closed the connection after a protocol error. On a Cluster that is
            // one node's connection, found broken and replaced on its next use: the
            // others stay, and with them the WAITs the writes they ran need.
            if !matches!(conn.con, Some(Con::Cluster(_))) && replies.iter().any(closes_connection) {
                conn.con = None;
            }
            if conn.resent {
                for r in &mut replies {
                    if let Err(f) = r {
                        *f = f.clone().after_resend();
                    }
                }
            }
            let acked = wait_replicas(conn, &requests, &replies, deadline);
            for ((call, reply), acked) in calls.into_iter().zip(replies).zip(acked) {
                (call.done)(reply, acked, queue);
            }
        }
        Err(f) => {
            for call in calls {
                (call.done)(Err(f.clone()), None, queue);
            }
        }
    }
}

/// Sends `requests` as one pipeline; when the connection breaks (not a timeout), sends
/// each again on its own, in order, each on a new connection if the one before broke
/// it.
///
/// A call Redis refuses by dropping the connection (a protocol error, e.g. an argument
/// over `proto-max-bulk-len`) would break a resent pipeline as surely as the first: the
/// calls sent with it would fail twice, as lost answers. Sent one at a time, the others
/// get their replies and only that call fails. [`Conn::run`]'s rule for the resend
/// holds for each: every write is idempotent when sent again, and a call whose resend
/// fails is a lost answer (the first send may have run).
fn run_or_resend_each(
    conn: &mut Conn,
    requests: &[&Request],
    deadline: Instant,
) -> Result<Vec<Result<redis::Value, Failure>>, Failure> {
    conn.resent = false;
    let first = conn.run_once(deadline, &mut |c: &mut Con| pipeline(c, requests, deadline));
    match first {
        Err(Failure::Redis(e))
            if e.is_io_error()
                && !e.is_timeout()
                && left(deadline, conn.link.io_timeout).is_some() =>
        {
            conn.resent = true;
            Ok(requests
                .iter()
                .map(|r| {
                    match conn.run_once(deadline, &mut |c: &mut Con| pipeline(c, &[*r], deadline)) {
                        Ok(mut one) => {
                            let reply = one.pop().unwrap_or_else(|| Err(Failure::Redis(e.clone())));
                            if closes_connection(&reply) {
                                conn.con = None;
                            }
                            reply
                        }
                        Err(Failure::NotSent | Failure::NotConnected(_)) => {
                            Err(Failure::Redis(e.clone()))
                        }
                        Err(f) => Err(f),
                    }
                })
                .collect())
        }
        r => r,
    }
}

/// Whether Redis closes the connection after this reply: a protocol error (e.g. an
/// argument over `proto-max-bulk-len`) is its last.
fn closes_connection(reply: &Result<redis::Value, Failure>) -> bool {
    matches!(reply, Err(Failure::Redis(e)) if e.to_string().contains("Protocol error"))
}

/// The `WAIT`s the replicated writes of a batch need, on the connection that sent them
/// (WAIT counts the replicas that acknowledged this connection's writes): on a node,
/// one WAIT after the whole batch covers every write of it; on a Cluster, one per node
/// that ran writes, on the connection that ran them. Never on a new connection (it
/// would have written nothing, and WAIT would answer at once).
fn wait_replicas(
    conn: &mut Conn,
    requests: &[&Request],
    replies: &[Result<redis::Value, Failure>],
    deadline: Instant,
) -> Vec<Acked> {
    let n = conn.link.min_replicas;
    let mut acked: Vec<Acked> = vec![None; requests.len()];
    if n == 0 {
        return acked;
    }
    let wrote: Vec<usize> = (0..requests.len())
        .filter(|&i| match (&requests[i].replicated, &replies[i]) {
            (Some(wrote), Ok(v)) => wrote(v),
            _ => false,
        })
        .collect();
    if wrote.is_empty() {
        return acked;
    }
    let lost = || {
        redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::NotConnected,
            "the connection that sent the write was lost before WAIT",
        ))
    };
    // WAIT must answer before the batch's deadline: its own timeout leaves a tenth of
    // the I/O timeout for the reply to travel.
    let timeout = |link: &Link| {
        deadline
            .saturating_duration_since(Instant::now())
            .saturating_sub(link.io_timeout / 10)
            .min(link.min_replicas_timeout)
    };
    if let Some(Con::Cluster(c)) = conn.con.as_mut() {
        // On the connection of each node that ran a write: one WAIT per node.
        let ran: Vec<Option<crate::cluster::Ran>> = wrote
            .iter()
            .map(|&i| c.ran.get(i).cloned().flatten())
            .collect();
        let t = timeout(&conn.link);
        let answers = c.wait(&ran, n, t, deadline);
        for (i, r) in wrote.into_iter().zip(answers) {
            acked[i] = Some(r);
        }
        return acked;
    }
    // One WAIT covers the batch on a node.
    let t = timeout(&conn.link);
    let r = if conn.con.is_none() {
        Err(lost())
    } else {
        // run_once, not run: a retry would WAIT on a fresh connection.
        conn.run_once(deadline, &mut |c: &mut Con| c.wait_replicas(n, t))
            .map_err(|f| match f {
                Failure::Redis(e) | Failure::NotConnected(e) => e,
                Failure::NotSent => redis::RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no time left for WAIT",
                )),
            })
    };
    for i in wrote {
        acked[i] = Some(r.clone());
    }
    acked
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Condvar, Mutex};
    use std::time::Duration;

    use super::*;
    use crate::lock;
    use crate::pool::QueueState;
    use crate::testing::{url, Server};
    use crate::topology::Topology;

    /// A batch holding a call that waited long for a worker (little time left) and one
    /// made just now whose reply takes a while: the young call gets its own time, not
    /// the old call's. (Sent as one pipeline, both were bounded by the old call's
    /// deadline, and the young one timed out.)
    #[test]
    #[ignore = "needs a Redis: run scripts/test-redis"]
    fn a_call_made_long_after_another_in_its_batch_keeps_its_own_deadline() {
        let io_timeout = Duration::from_millis(600);
        let link = Link {
            topology: Topology::Single(redis::Client::open(url()).unwrap()),
            connect_timeout: Duration::from_secs(2),
            io_timeout,
            min_replicas: 0,
            min_replicas_timeout: Duration::from_millis(100),
        };
        let mut conn = Conn::new(link);
        let queue = Queue {
            state: Mutex::new(QueueState::default()),
            ready: Condvar::new(),
        };
        // Connected first: the old call's little time goes to Redis, not to connecting.
        let d = Instant::now() + io_timeout;
        conn.run(d, |c| pipeline(c, &[&Request::command("PING")], d))
            .unwrap();
        // Busy for 200 ms inside Redis.
        let slow = Request::command("EVAL")
            .arg(
                "local a = redis.call('TIME') local t0 = a[1] * 1000000 + a[2] \
                 while true do local b = redis.call('TIME') \
                 if b[1] * 1000000 + b[2] - t0 > 200000 then break end end return 1",
            )
            .arg(0);
        type Outcomes = Vec<(&'static str, Result<redis::Value, Failure>)>;
        let got: Arc<Mutex<Outcomes>> = Arc::default();
        let call = |name: &'static str, request: Request, time: Duration| {
            let got = got.clone();
            Call {
                request,
                deadline: Instant::now() + time,
                abandoned: None,
                done: Box::new(move |r, _, _| lock(&got).push((name, r))),
            }
        };
        let batch = vec![
            call(
                "old",
                Request::command("PING"),
                io_timeout / 10 + Duration::from_millis(30),
            ),
            call("young", slow, io_timeout),
        ];
        run_batch(&mut conn, &queue, batch);
        let got = lock(&got);
        assert_eq!(got.len(), 2);
        for (name, r) in got.iter() {
            assert!(r.is_ok(), "the {name} call failed: {r:?}");
        }
    }

    /// A pipeline whose connection breaks after Redis ran it (the replies were never
    /// sent) goes again on a new connection; there its write finds itself done and
    /// writes nothing (as a completion resent does), and the replica never saw the
    /// first send (it is stopped): the `WAIT` after it must not vouch for the write.
    /// (Redis 7 sets a connection's replication offset to the primary's after any
    /// command, so a `WAIT` after the resend counts the first send's writes too; a
    /// `WAIT` alone on a new connection would answer at once with every replica.)
    ///
    /// The break: a reply over the server's output buffer limit closes the connection
    /// before any reply is written; the resend's reply is small.
    #[test]
    #[ignore = "needs redis-server: run scripts/test-redis"]
    fn a_write_resent_on_a_new_connection_is_not_vouched_for_by_its_wait() {
        let primary = Server::start(&[]);
        let replica = Server::start(&["--replicaof", "127.0.0.1", &primary.1.to_string()]);
        let mut admin = primary.con().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let _: () = redis::cmd("SET")
                .arg("sync")
                .arg("1")
                .query(&mut admin)
                .unwrap();
            let n: usize = redis::cmd("WAIT")
                .arg(1)
                .arg(100)
                .query(&mut admin)
                .unwrap();
            if n == 1 {
                break;
            }
            assert!(Instant::now() < deadline, "the replica did not sync");
        }
        let link = Link {
            topology: Topology::Single(redis::Client::open(primary.url()).unwrap()),
            connect_timeout: Duration::from_secs(2),
            io_timeout: Duration::from_secs(2),
            min_replicas: 1,
            min_replicas_timeout: Duration::from_millis(200),
        };
        let mut conn = Conn::new(link);
        let queue = Queue {
            state: Mutex::new(QueueState::default()),
            ready: Condvar::new(),
        };
        // Open: the break below hits a connection used before, which is resent on.
        let d = Instant::now() + Duration::from_secs(2);
        conn.run(d, |c| pipeline(c, &[&Request::command("PING")], d))
            .unwrap();
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("client-output-buffer-limit")
            .arg("normal 4096 4096 0")
            .query(&mut admin)
            .unwrap();
        replica.signal("-STOP");
        // Writes on its first run only, answers 1 both times.
        let write = Request::command("EVAL")
            .arg("redis.call('SET', KEYS[1], '1', 'NX') return 1")
            .arg(1)
            .arg("w")
            .replicated(|v| matches!(v, redis::Value::Int(1)));
        // A reply past the limit on its first run only.
        let big = Request::command("EVAL")
            .arg(
                "if redis.call('SET', KEYS[1], '1', 'NX') then \
                 return string.rep('x', 65536) end return 'small'",
            )
            .arg(1)
            .arg("big");
        type Outcomes = Vec<(Result<redis::Value, Failure>, Acked)>;
        let got: Arc<Mutex<Outcomes>> = Arc::default();
        let call = |request: Request| {
            let got = got.clone();
            Call {
                request,
                deadline: Instant::now() + Duration::from_secs(2),
                abandoned: None,
                done: Box::new(move |r, acked, _| lock(&got).push((r, acked))),
            }
        };
        run_batch(&mut conn, &queue, vec![call(write), call(big)]);
        replica.signal("-CONT");
        let got = lock(&got);
        assert!(
            matches!(&got[1].0, Ok(redis::Value::BulkString(b)) if b == b"small"),
            "the pipeline was not sent again: {:?}",
            got[1].0
        );
        assert!(
            matches!(got[0].0, Ok(redis::Value::Int(1))),
            "the write: {:?}",
            got[0].0
        );
        match &got[0].1 {
            Some(Ok(n)) if *n >= 1 => panic!(
                "WAIT on the new connection vouched for the first send's write ({n} \
                 replica(s)); the replica was stopped before it"
            ),
            Some(_) => {}
            None => panic!("no WAIT for a replicated write"),
        }
    }
    /// A batch holding a call Redis refuses by dropping the connection (an argument over
    /// `proto-max-bulk-len`, on every send): the other calls of the batch get their
    /// replies (the resend goes one call at a time), only that call fails, as a lost
    /// answer. (Resent as one pipeline, it broke again and every call failed.)
    #[test]
    #[ignore = "needs redis-server: run scripts/test-redis"]
    fn a_call_that_breaks_the_connection_takes_its_batch_down_once_at_most() {
        let server = Server::start(&["--proto-max-bulk-len", "1mb"]);
        let link = Link {
            topology: Topology::Single(redis::Client::open(server.url()).unwrap()),
            connect_timeout: Duration::from_secs(2),
            io_timeout: Duration::from_secs(5),
            min_replicas: 0,
            min_replicas_timeout: Duration::from_millis(100),
        };
        // Whether the oversized write fails or its error reply is read depends on
        // timing: a few rounds of each.
        for round in 0..32 {
            let opened_before = round % 2 == 0;
            let mut conn = Conn::new(link.clone());
            let queue = Queue {
                state: Mutex::new(QueueState::default()),
                ready: Condvar::new(),
            };
            if opened_before {
                let d = Instant::now() + Duration::from_secs(5);
                conn.run(d, |c| pipeline(c, &[&Request::command("PING")], d))
                    .unwrap();
            }
            type Outcomes = Vec<(usize, Result<redis::Value, Failure>)>;
            let got: Arc<Mutex<Outcomes>> = Arc::default();
            let call = |i: usize, request: Request| {
                let got = got.clone();
                Call {
                    request,
                    deadline: Instant::now() + Duration::from_secs(5),
                    abandoned: None,
                    done: Box::new(move |r, _, _| lock(&got).push((i, r))),
                }
            };
            let set = |k: &str, v: Vec<u8>| Request::command("SET").arg(k).arg(v);
            let batch = vec![
                call(0, set("a", b"1".to_vec())),
                // Just over: its write is taken whole and its error reply read (the
                // connection closed after it); far over: the write itself fails.
                call(
                    1,
                    set(
                        "big",
                        vec![
                            b'x';
                            if round % 4 < 2 {
                                (1 << 20) + 1
                            } else {
                                2 << 20
                            }
                        ],
                    ),
                ),
                call(2, set("b", b"2".to_vec())),
                call(3, Request::command("GET").arg("a")),
            ];
            run_batch(&mut conn, &queue, batch);
            let mut got = std::mem::take(&mut *lock(&got));
            got.sort_by_key(|(i, _)| *i);
            assert_eq!(got.len(), 4);
            for i in [0, 2] {
                assert!(
                    matches!(&got[i].1, Ok(redis::Value::Okay)),
                    "call {i} (opened before: {opened_before}): {:?}",
                    got[i].1
                );
            }
            assert!(
                matches!(&got[3].1, Ok(redis::Value::BulkString(v)) if v == b"1"),
                "{:?}",
                got[3].1
            );
            match &got[1].1 {
                Err(f) => assert!(f.is_lost_answer(), "{f:?}"),
                Ok(v) => panic!("Redis stored the oversized value: {v:?}"),
            }
        }
    }
}
