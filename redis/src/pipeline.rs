//! The send path: a batch of requests written on a connection as one pipeline and
//! their replies read, all by a deadline.

use std::time::{Duration, Instant};

use crate::request::{Failure, Request};
use crate::topology::Con;

/// Runs `requests` on `con` as one pipeline (one write, then the replies in order) and
/// gives one result per request, in order: a reply, or that request's own error.
/// The outer error is the connection's (a timeout or a broken connection: nothing can
/// be said of any request then). The replies are all read by `deadline`.
///
/// A script call that Redis does not know (NOSCRIPT: first use, a restarted or
/// flushed server) is loaded and sent again, with the other unknown ones, in a
/// second pipeline; the other requests keep their first reply.
///
/// This is the only way the store's threads talk to Redis, so a connection of
/// another kind only needs to provide it: on a Cluster, one pipeline per node (see
/// [`crate::cluster::ClusterCon::pipeline`]), each request's own error.
pub(crate) fn pipeline(
    con: &mut Con,
    requests: &[&Request],
    deadline: Instant,
) -> redis::RedisResult<Vec<Result<redis::Value, Failure>>> {
    match con {
        Con::Node(c) => Ok(node_pipeline(c, requests, deadline)?
            .into_iter()
            .map(|r| r.map_err(Failure::Redis))
            .collect()),
        Con::Cluster(c) => Ok(c.pipeline(requests, deadline)),
    }
}

/// [`pipeline`] on one node: one write, then the replies in order.
fn node_pipeline(
    con: &mut redis::Connection,
    requests: &[&Request],
    deadline: Instant,
) -> redis::RedisResult<Vec<redis::RedisResult<redis::Value>>> {
    let mut out = send(con, &[], requests, deadline, true)?;
    let unknown: Vec<usize> = (0..requests.len())
        .filter(|&i| {
            requests[i].script.is_some()
                && matches!(&out[i], Err(e)
                    if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript))
        })
        .collect();
    if !unknown.is_empty() {
        let mut loads: Vec<&str> = unknown.iter().filter_map(|&i| requests[i].script).collect();
        loads.sort_unstable();
        loads.dedup();
        let again: Vec<&Request> = unknown.iter().map(|&i| requests[i]).collect();
        for (i, r) in unknown
            .into_iter()
            .zip(send(con, &loads, &again, deadline, false)?)
        {
            out[i] = r;
        }
    }
    Ok(out)
}

/// How far past its deadline a read of a batch's replies may end (see [`send`]).
const READ_TIMEOUT_SLACK: Duration = Duration::from_millis(1);

/// The largest part of a write given one write timeout (see [`write_by`]).
const WRITE_PART: usize = 64 * 1024;

/// Writes `bytes` on `con` by `deadline`; `timeout_set`: the write timeout already
/// fits `deadline` (set just before).
///
/// A socket's write timeout bounds each write call, not the whole write: a peer that
/// takes a little at a time (a slow link) would let a large write go on far past the
/// deadline. So a large write goes in parts, each given the time left.
pub(crate) fn write_by(
    con: &mut redis::Connection,
    bytes: &[u8],
    deadline: Instant,
    timeout_set: bool,
) -> redis::RedisResult<()> {
    if timeout_set && bytes.len() <= WRITE_PART {
        return con.send_packed_command(bytes);
    }
    for part in bytes.chunks(WRITE_PART) {
        let time = deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| {
                redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut))
            })?;
        con.set_write_timeout(Some(time))?;
        con.send_packed_command(part)?;
    }
    Ok(())
}

/// One write of `SCRIPT LOAD`s for `loads` then `requests`; the replies of `requests`.
/// `timeout_set`: the read timeout already fits `deadline` (set just before).
///
/// Hand-written over `send_packed_command` / `recv_response` rather than the crate's
/// `Pipeline::query`: that one keeps reading after a timed-out reply, each read
/// waiting a whole timeout again, so a black-holed server would hold a batch of n
/// calls n timeouts long. Here the first failed read ends the batch, and every read
/// is bounded by `deadline`.
fn send(
    con: &mut redis::Connection,
    loads: &[&str],
    requests: &[&Request],
    deadline: Instant,
    timeout_set: bool,
) -> redis::RedisResult<Vec<redis::RedisResult<redis::Value>>> {
    // Taken before the write: a write held up (a stalled server, full socket buffers)
    // uses up time the read timeout set before it no longer accounts for.
    let entered = Instant::now();
    let mut bytes = Vec::new();
    for code in loads {
        redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(*code)
            .write_packed_command(&mut bytes);
    }
    for r in requests {
        r.cmd.write_packed_command(&mut bytes);
    }
    write_by(con, &bytes, deadline, timeout_set)?;
    let n = loads.len() + requests.len();
    let mut out = Vec::with_capacity(n);
    // When the read timeout was last set to the time left (the caller just did, if
    // `timeout_set`: at the latest when this function was entered). A read blocks at most that timeout from its own start, so it can
    // end past `deadline` by as much time as went by since: the timeout is set again
    // only once that exceeds `READ_TIMEOUT_SLACK`, not before each reply (most replies
    // of a batch arrive in one read, already buffered: a setsockopt each would cost
    // more than the reads).
    let mut set_at = timeout_set.then_some(entered);
    while out.len() < n {
        let now = Instant::now();
        if set_at.is_none_or(|t| now.duration_since(t) > READ_TIMEOUT_SLACK) {
            let time = deadline
                .checked_duration_since(now)
                .filter(|d| !d.is_zero())
                .ok_or_else(|| {
                    redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut))
                })?;
            con.set_read_timeout(Some(time))?;
            set_at = Some(now);
        }
        match con.recv_response()? {
            redis::Value::Push { .. } => {}
            redis::Value::ServerError(e) => out.push(Err(e.into())),
            v => out.push(Ok(v)),
        }
    }
    Ok(out.split_off(loads.len()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conn::{Conn, Link};
    use crate::scripts::Lua;
    use crate::testing::{url, Server};
    use crate::topology::Topology;

    /// A batch whose write is held up (the server stopped with its socket buffers
    /// full) still ends by its deadline: the read that follows waits for the time left,
    /// not for the whole timeout set before the write. The server runs the request
    /// long after the deadline (a script that spins), so only the deadline ends the
    /// read.
    #[test]
    #[ignore = "needs redis-server: run scripts/test-redis"]
    fn a_write_held_up_does_not_stretch_the_read_past_the_deadline() {
        let server = Server::start(&[]);
        let io_timeout = Duration::from_secs(1);
        let link = Link {
            topology: Topology::Single(redis::Client::open(server.url()).unwrap()),
            connect_timeout: Duration::from_secs(2),
            io_timeout,
            min_replicas: 0,
            min_replicas_timeout: Duration::ZERO,
        };
        let mut conn = Conn::new(link);
        let d = Instant::now() + io_timeout;
        conn.run(d, |c| pipeline(c, &[&Request::command("PING")], d))
            .unwrap();
        // Far larger than the loopback socket buffers: the write blocks while the
        // server is stopped.
        let spin = Request::command("EVAL")
            .arg(
                "local function ms() local t = redis.call('TIME') \
                 return t[1] * 1000 + math.floor(t[2] / 1000) end \
                 local start = ms() while ms() - start < 3000 do end return 1",
            )
            .arg(0)
            .arg(vec![b'x'; 64 << 20]);
        server.signal("-STOP");
        let pid = server.0.id().to_string();
        let resume = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(700));
            let ok = std::process::Command::new("kill")
                .args(["-CONT", &pid])
                .status()
                .unwrap();
            assert!(ok.success());
        });
        let start = Instant::now();
        let deadline = start + io_timeout;
        let r = conn.run(deadline, |c| pipeline(c, &[&spin], deadline));
        let took = start.elapsed();
        resume.join().unwrap();
        assert!(r.is_err(), "the spinning script answered in time: {r:?}");
        assert!(
            took < io_timeout + Duration::from_millis(400),
            "the batch ended {:?} past its deadline",
            took - io_timeout
        );
    }

    /// One pipeline of scripts Redis does not know, plain commands and a failing
    /// command: each request gets its own reply or error, the unknown scripts are
    /// loaded and sent again (once), and nothing else is sent twice.
    #[test]
    #[ignore = "needs a Redis: run scripts/test-redis"]
    fn a_pipeline_answers_each_request_and_resends_only_unknown_scripts() {
        let mut con = redis::Client::open(url())
            .unwrap()
            .get_connection()
            .unwrap();
        let p = oncely::IdempotencyKey::random().as_str().to_owned();
        let (a, b, s) = (format!("{p}:a"), format!("{p}:b"), format!("{p}:s"));
        let _: () = redis::cmd("SET")
            .arg(&s)
            .arg("text")
            .query(&mut con)
            .unwrap();
        // A fresh script text each run, so Redis cannot know it yet.
        let code: &'static str =
            Box::leak(format!("-- {p}\nreturn redis.call('INCR', KEYS[1])").into_boxed_str());
        let incr = Lua::new(code);
        let requests = [
            incr.on(&a),
            Request::command("INCR").arg(&b),
            Request::command("HSET").arg(&s).arg("f").arg("v"),
            incr.on(&a),
            Request::command("PING"),
        ];
        let refs: Vec<&Request> = requests.iter().collect();
        let deadline = Instant::now() + Duration::from_secs(5);
        con.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let out = node_pipeline(&mut con, &refs, deadline).unwrap();
        assert_eq!(out.len(), 5);
        let int = |r: &redis::RedisResult<redis::Value>| match r {
            Ok(v) => redis::from_redis_value_ref::<i64>(v).unwrap(),
            Err(e) => panic!("{e}"),
        };
        // Both script calls ran once each, after the load (1 then 2, in order).
        assert_eq!((int(&out[0]), int(&out[3])), (1, 2));
        assert_eq!(int(&out[1]), 1, "a plain command was sent again");
        match &out[2] {
            Err(e) => assert_eq!(e.code(), Some("WRONGTYPE"), "{e}"),
            Ok(v) => panic!("expected WRONGTYPE, got {v:?}"),
        }
        assert!(matches!(&out[4], Ok(redis::Value::SimpleString(s)) if s == "PONG"));
        let counts: (i64, i64) = redis::pipe()
            .cmd("GET")
            .arg(&a)
            .cmd("GET")
            .arg(&b)
            .query(&mut con)
            .unwrap();
        assert_eq!(counts, (2, 1));
        // Known now: one pipeline, no load.
        let out = node_pipeline(&mut con, &[&requests[0]], deadline).unwrap();
        assert_eq!(int(&out[0]), 3);
    }
}
