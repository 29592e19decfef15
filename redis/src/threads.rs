//! The store's own threads, which drive the redis crate's blocking client so that the
//! caller needs no async runtime: a small worker pool (results come back through
//! `futures-channel` oneshots), one lease renewer and one pub/sub listener.
//!
//! Every call has a deadline: `io_timeout` after it was made. It bounds the wait for
//! a worker, connecting and the reply alike, so a slow or black-holed Redis answers
//! each caller within about one I/O timeout, whatever its place in the queue. A call
//! whose deadline passed before a worker took it up is never sent.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use event_listener::Event;
use oncely::Error;

use crate::lock;
use crate::scripts::Scripts;
use crate::topology::{is_not_primary, Con, Topology};

/// Redis could not be reached or answered with an error: UNAVAILABLE, fail closed.
pub(crate) fn unavailable(e: &redis::RedisError) -> Error {
    let what = if e.is_timeout() {
        "timed out"
    } else if e.is_connection_refusal() {
        "connection refused"
    } else if e.is_io_error() {
        "connection failed"
    } else {
        "error"
    };
    Error::Unavailable(format!("Redis {what}: {e}"))
}

/// Why a call gave no value.
#[derive(Debug, Clone)]
pub(crate) enum Failure {
    /// Its deadline passed before it could be sent: Redis never saw it.
    NotSent,
    /// Redis could not be reached or answered with an error.
    Redis(redis::RedisError),
    /// Connecting failed: nothing was sent.
    NotConnected(redis::RedisError),
}

impl From<redis::RedisError> for Failure {
    fn from(e: redis::RedisError) -> Self {
        Failure::Redis(e)
    }
}

impl Failure {
    /// Redis may have run the call but its answer was lost (a broken connection, a
    /// timeout): what it did is undone by the caller where it can be.
    pub(crate) fn is_lost_answer(&self) -> bool {
        matches!(self, Failure::Redis(e) if e.is_timeout() || e.is_io_error())
    }

    /// The failure of a call sent again after its reply was lost: whatever became of
    /// the resend (no connection, an error reply such as `LOADING`, no time left), the
    /// first send may have run, so it is a lost answer.
    pub(crate) fn after_resend(self) -> Failure {
        if self.is_lost_answer() {
            return self;
        }
        Failure::Redis(redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            format!("the reply was lost and sending it again failed: {self:?}"),
        )))
    }

    fn into_error(self, io_timeout: Duration) -> Error {
        match self {
            Failure::NotSent => Error::Unavailable(format!(
                "Redis timed out: the call could not start within its I/O timeout \
                 ({io_timeout:?}), taken by the calls ahead of it or by connecting; it \
                 was not sent"
            )),
            Failure::Redis(e) | Failure::NotConnected(e) => unavailable(&e),
        }
    }
}

/// Connection settings shared by every thread.
#[derive(Clone)]
pub(crate) struct Link {
    pub topology: Topology,
    pub connect_timeout: Duration,
    pub io_timeout: Duration,
    /// Replicas that must acknowledge a replicated request (`WAIT`); 0: no WAIT.
    pub min_replicas: usize,
    /// How long `WAIT` waits for them (below the I/O timeout).
    pub min_replicas_timeout: Duration,
}

impl Link {
    /// The deadline of a call made now.
    pub(crate) fn deadline(&self) -> Instant {
        Instant::now() + self.io_timeout
    }

    /// Opens a connection and sends `PING`, on this thread: UNAVAILABLE when Redis
    /// cannot be reached, refuses the credentials or does not answer in time.
    pub(crate) fn check(&self) -> Result<(), Error> {
        let mut conn = Conn::new(self.clone());
        let deadline = self.deadline() + self.connect_timeout;
        conn.run(deadline, |c| c.ping(deadline))
            .map_err(|f| f.into_error(self.io_timeout))
    }
}

/// Time left before `deadline`, if it is enough to start a command: a tenth of the
/// I/O timeout at least. A command sent with less would likely time out after Redis
/// ran it (a claim then blocks its key for a lease); it is better not sent.
fn left(deadline: Instant, io_timeout: Duration) -> Option<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero() && *d >= io_timeout / 10)
}

/// One lazily (re)opened connection. Any I/O error drops it; the next use reconnects.
pub(crate) struct Conn {
    link: Link,
    con: Option<Con>,
    /// The last [`run`](Self::run) sent again after an I/O error.
    resent: bool,
}

impl Conn {
    pub(crate) fn new(link: Link) -> Self {
        Conn {
            link,
            con: None,
            resent: false,
        }
    }

    /// The deadline of a call made now on this connection.
    pub(crate) fn deadline(&self) -> Instant {
        self.link.deadline()
    }

    /// Runs `f` on the connection, opening it first if needed, by `deadline` (the
    /// socket timeouts are set to the time left; nothing is sent once it passed).
    ///
    /// A connection that was opened before and fails with an I/O error (not a timeout)
    /// is likely stale — e.g. the server restarted since its last use — and `f` is
    /// retried once on a fresh connection. The command may still have been executed
    /// (a connection reset after the server ran it looks the same), so every script is
    /// idempotent when resent with the same arguments: each checks the lease token, a
    /// claim that finds its own token leads, completing twice with one token counts as
    /// stored, and renewing or releasing again is harmless.
    pub(crate) fn run<T>(
        &mut self,
        deadline: Instant,
        mut f: impl FnMut(&mut Con) -> redis::RedisResult<T>,
    ) -> Result<T, Failure> {
        let reused = self.con.is_some();
        self.resent = false;
        match self.run_once(deadline, &mut f) {
            Err(Failure::Redis(e))
                if reused
                    && e.is_io_error()
                    && !e.is_timeout()
                    && left(deadline, self.link.io_timeout).is_some() =>
            {
                self.resent = true;
                match self.run_once(deadline, &mut f) {
                    // The first send may have run: a retry that sent nothing leaves it a
                    // lost answer (the caller undoes a claim it may hold), not unsent.
                    Err(Failure::NotSent | Failure::NotConnected(_)) => Err(Failure::Redis(e)),
                    r => r,
                }
            }
            r => r,
        }
    }

    fn run_once<T>(
        &mut self,
        deadline: Instant,
        f: &mut impl FnMut(&mut Con) -> redis::RedisResult<T>,
    ) -> Result<T, Failure> {
        if self.con.is_none() {
            let time = left(deadline, self.link.io_timeout).ok_or(Failure::NotSent)?;
            let con = self
                .link
                .topology
                .connect(self.link.connect_timeout.min(time))
                .map_err(Failure::NotConnected)?;
            self.con = Some(con);
        }
        let Some(con) = self.con.as_mut() else {
            unreachable!("connected above")
        };
        let r = match left(deadline, self.link.io_timeout) {
            None => return Err(Failure::NotSent),
            Some(time) => con.set_timeouts(time).and_then(|()| f(con)),
        };
        if let Err(e) = &r {
            // A node that is no longer the primary: the next connection goes to the
            // current one (a Sentinel is asked again).
            if e.is_io_error() || e.is_timeout() || e.is_unrecoverable_error() || is_not_primary(e)
            {
                self.con = None;
            }
        }
        Ok(r?)
    }
}

/// One command of a pipeline: a plain command, or a script call sent as `EVALSHA`
/// (see [`crate::scripts::Lua::on`]).
#[derive(Clone)]
pub(crate) struct Request {
    cmd: redis::Cmd,
    /// The script's source, for a script call: loaded when Redis answers NOSCRIPT.
    script: Option<&'static str>,
    /// The key a script call is on: on a Cluster the request goes to its slot's
    /// primary (see [`crate::cluster`]).
    key: Option<String>,
    /// A write that must be on [`Link::min_replicas`] replicas when its reply passes
    /// this test: a `WAIT` follows it on the same connection (see [`run_batch`]).
    replicated: Option<fn(&redis::Value) -> bool>,
}

impl Request {
    /// A plain command, e.g. `Request::command("PUBLISH").arg(channel).arg("x")`.
    pub(crate) fn command(name: &str) -> Self {
        Request {
            cmd: redis::cmd(name),
            script: None,
            key: None,
            replicated: None,
        }
    }

    /// A call of the script `code` (an `EVALSHA` of its hash) on `key`.
    pub(crate) fn script(cmd: redis::Cmd, code: &'static str, key: &str) -> Self {
        Request {
            cmd,
            script: Some(code),
            key: Some(key.to_owned()),
            replicated: None,
        }
    }

    /// Marks this write as one that must reach the store's `min_replicas` replicas
    /// when `wrote(reply)` holds (a claim that led, a completion that stored).
    pub(crate) fn replicated(mut self, wrote: fn(&redis::Value) -> bool) -> Self {
        self.replicated = Some(wrote);
        self
    }

    /// The key the request is routed by on a Cluster (none: any node).
    pub(crate) fn key_bytes(&self) -> &[u8] {
        self.key.as_deref().unwrap_or("").as_bytes()
    }

    /// The script's source, for a script call.
    pub(crate) fn script_code(&self) -> Option<&'static str> {
        self.script
    }

    /// Appends the request, encoded, to `bytes`.
    pub(crate) fn write(&self, bytes: &mut Vec<u8>) {
        self.cmd.write_packed_command(bytes);
    }

    /// Appends an argument.
    pub(crate) fn arg(mut self, arg: impl redis::ToRedisArgs) -> Self {
        self.cmd.arg(arg);
        self
    }
}

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

/// What the replicas said of a replicated write (see [`Request::replicated`]): `None`
/// when no `WAIT` was asked for (no `min_replicas`, or the reply wrote nothing), else
/// how many replicas acknowledged it, or why `WAIT` failed.
pub(crate) type Acked = Option<Result<usize, redis::RedisError>>;

/// What is done with a call's outcome, on the worker (it may queue follow-up calls).
type Done = Box<dyn FnOnce(Result<redis::Value, Failure>, Acked, &Queue) + Send>;

/// A call waiting for a worker.
struct Call {
    request: Request,
    deadline: Instant,
    /// True once nobody waits for the answer and the call need not be sent.
    abandoned: Option<Box<dyn Fn() -> bool + Send>>,
    done: Done,
}

#[derive(Default)]
struct QueueState {
    calls: VecDeque<Call>,
    closed: bool,
    /// Workers waiting for a call: a push wakes one only when there is one (a
    /// notification is a syscall, even with nobody waiting).
    idle: usize,
}

/// The calls waiting for a worker, in order of arrival.
pub(crate) struct Queue {
    state: Mutex<QueueState>,
    ready: Condvar,
}

/// The most calls sent as one pipeline.
const MAX_BATCH: usize = 256;

impl Queue {
    fn push(&self, call: Call) -> bool {
        let mut st = lock(&self.state);
        if st.closed {
            return false;
        }
        st.calls.push_back(call);
        let wake = st.idle > 0;
        drop(st);
        if wake {
            self.ready.notify_one();
        }
        true
    }

    /// Every call queued (up to [`MAX_BATCH`]), waiting for one; None once closed and
    /// drained.
    fn take(&self) -> Option<Vec<Call>> {
        let mut st = lock(&self.state);
        loop {
            if !st.calls.is_empty() {
                let n = st.calls.len().min(MAX_BATCH);
                let batch: Vec<Call> = st.calls.drain(..n).collect();
                let more = !st.calls.is_empty() && st.idle > 0;
                drop(st);
                if more {
                    // Another worker takes the rest while this one is busy.
                    self.ready.notify_one();
                }
                return Some(batch);
            }
            if st.closed {
                return None;
            }
            st.idle += 1;
            st = self.ready.wait(st).unwrap_or_else(|e| e.into_inner());
            st.idle -= 1;
        }
    }
}

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
fn run_batch(conn: &mut Conn, queue: &Queue, batch: Vec<Call>) {
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
    let replies = conn.run(deadline, |c| pipeline(c, &requests, deadline));
    match replies {
        Ok(mut replies) => {
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

/// A fixed pool of threads, each with its own connection, taking the calls queued in
/// order of arrival. A free worker takes every call waiting (up to [`MAX_BATCH`]) and
/// sends them as one pipeline, so calls that arrive together share one round trip,
/// and a slow reply holds up only the calls of its batch: the calls queued behind it
/// go to the next free worker. The threads end when the pool is dropped.
///
/// Every call has the same time, and a batch ends by its earliest deadline, so a call
/// waits for a worker at most until its own deadline, and is then failed without
/// being sent.
pub(crate) struct Pool {
    queue: Arc<Queue>,
    io_timeout: Duration,
    /// Connections for callers that may block their thread (see [`blocking`]), at
    /// most one per worker; made on first use.
    direct: Mutex<Vec<Conn>>,
    /// Direct connections not yet made.
    direct_left: std::sync::atomic::AtomicUsize,
    link: Link,
}

thread_local! {
    static MAY_BLOCK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with this thread marked as one that may block on Redis: the calls it makes
/// while no other call is queued go out from this thread on a direct connection,
/// with no hand-off to a worker and back (two thread wake-ups saved per call). For
/// blocking entry points only (`execute_blocking`), never inside an async task.
pub(crate) fn blocking<T>(f: impl FnOnce() -> T) -> T {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            MAY_BLOCK.with(|b| b.set(self.0));
        }
    }
    let _reset = Reset(MAY_BLOCK.with(|b| b.replace(true)));
    f()
}

/// The answer of a call on the pool (UNAVAILABLE when Redis failed). Dropping it
/// before the answer is read hands a value that already arrived to its undo, if any.
pub(crate) struct Reply<T> {
    rx: Option<futures_channel::oneshot::Receiver<Result<T, Failure>>>,
    undo: Option<Box<dyn FnOnce(T) + Send>>,
    io_timeout: Duration,
}

impl<T> Future for Reply<T> {
    type Output = Result<T, Error>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let io_timeout = self.io_timeout;
        let Some(rx) = self.rx.as_mut() else {
            return Poll::Ready(Err(Error::Unavailable(
                "the Redis store was shut down".into(),
            )));
        };
        let out = match Pin::new(rx).poll(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Ok(Ok(v))) => Ok(v),
            Poll::Ready(Ok(Err(f))) => Err(f.into_error(io_timeout)),
            Poll::Ready(Err(_)) => Err(Error::Unavailable(
                "a Redis worker thread stopped before answering".into(),
            )),
        };
        self.rx = None;
        self.undo = None;
        Poll::Ready(out)
    }
}

impl<T> Drop for Reply<T> {
    fn drop(&mut self) {
        if let (Some(mut rx), Some(undo)) = (self.rx.take(), self.undo.take()) {
            // After `close` no send can succeed: a value is either here now, or the
            // worker keeps it and undoes it there.
            rx.close();
            if let Ok(Some(Ok(v))) = rx.try_recv() {
                undo(v);
            }
        }
    }
}

/// A reply parsed into `T` (a reply of an unexpected shape is a Redis error).
fn parse<T: redis::FromRedisValue>(r: Result<redis::Value, Failure>) -> Result<T, Failure> {
    r.and_then(|v| T::from_redis_value(v).map_err(|e| Failure::Redis(e.into())))
}

impl Pool {
    pub(crate) fn new(link: &Link, threads: usize) -> Self {
        let queue = Arc::new(Queue {
            state: Mutex::new(QueueState::default()),
            ready: Condvar::new(),
        });
        for i in 0..threads {
            let queue = queue.clone();
            let mut conn = Conn::new(link.clone());
            std::thread::Builder::new()
                .name(format!("oncely-redis-{i}"))
                .spawn(move || {
                    while let Some(batch) = queue.take() {
                        run_batch(&mut conn, &queue, batch);
                    }
                })
                .expect("spawning an oncely-redis worker thread");
        }
        Pool {
            queue,
            io_timeout: link.io_timeout,
            direct: Mutex::new(Vec::new()),
            direct_left: std::sync::atomic::AtomicUsize::new(threads),
            link: link.clone(),
        }
    }

    fn reply<T>(
        &self,
        sent: bool,
        rx: futures_channel::oneshot::Receiver<Result<T, Failure>>,
        undo: Option<Box<dyn FnOnce(T) + Send>>,
    ) -> Reply<T> {
        Reply {
            rx: sent.then_some(rx),
            undo,
            io_timeout: self.io_timeout,
        }
    }

    /// Sends `request` on a worker; the future resolves with its reply. Redis errors
    /// become UNAVAILABLE. Not sent when the caller went away before a worker took
    /// it up.
    pub(crate) fn call<T: redis::FromRedisValue + Send + 'static>(
        &self,
        request: Request,
    ) -> Reply<T> {
        let (tx, rx) = futures_channel::oneshot::channel();
        let tx = Arc::new(Mutex::new(Some(tx)));
        let gone = tx.clone();
        let sent = self.submit(Call {
            request,
            deadline: Instant::now() + self.io_timeout,
            abandoned: Some(Box::new(move || {
                lock(&gone).as_ref().is_none_or(|tx| tx.is_canceled())
            })),
            done: Box::new(move |r, _, _| {
                if let Some(tx) = lock(&tx).take() {
                    let _ = tx.send(parse::<T>(r));
                }
            }),
        });
        self.reply(sent, rx, None)
    }

    /// Like [`call`](Self::call), but sent even when the caller goes away, and runs
    /// `after` on the worker once the reply came (or the call failed), before
    /// answering (a completion: once queued, it is never overtaken by a release
    /// queued after it).
    ///
    /// `replicas` turns the parsed reply and what the replicas said of it (see
    /// [`Acked`]) into the answer.
    pub(crate) fn call_to_end<R: redis::FromRedisValue, T: Send + 'static>(
        &self,
        request: Request,
        replicas: impl FnOnce(R, Acked) -> T + Send + 'static,
        after: impl FnOnce() + Send + 'static,
    ) -> Reply<T> {
        let (tx, rx) = futures_channel::oneshot::channel();
        let sent = self.submit(Call {
            request,
            deadline: Instant::now() + self.io_timeout,
            abandoned: None,
            done: Box::new(move |r, acked, _| {
                let r = parse::<R>(r).map(|v| replicas(v, acked));
                after();
                let _ = tx.send(r);
            }),
        });
        self.reply(sent, rx, None)
    }

    /// Like [`call`](Self::call), but a value nobody will read is undone: when the
    /// caller stopped waiting (dropped the future) before the answer came, the request
    /// `undo` makes of the value (if any) is queued with the call's own deadline; when
    /// the answer came but was never read, `undo_later` gets it when the future is
    /// dropped. A claim nobody will use is released at once instead of blocking the
    /// key for a lease.
    ///
    /// When the call fails in a way that may come after Redis ran it (its reply timed
    /// out, or the connection broke), `undo_unknown` runs on the worker: a claim whose
    /// answer was lost is released (best effort) rather than left to its lease.
    ///
    /// `replicas` turns the reply and what the replicas said of it (see [`Acked`])
    /// into the answer, and may ask for a request to be queued at once (a claim the
    /// replicas did not acknowledge is released before its caller hears of it).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn call_or_undo<T: redis::FromRedisValue + Send + 'static>(
        &self,
        request: Request,
        replicas: impl FnOnce(T, Acked) -> (Result<T, Failure>, Option<Request>) + Send + 'static,
        undo: impl FnOnce(&T) -> Option<Request> + Send + 'static,
        undo_later: impl FnOnce(T) + Send + 'static,
        undo_unknown: impl FnOnce() + Send + 'static,
    ) -> Reply<T> {
        let (io_timeout, deadline) = (self.io_timeout, Instant::now() + self.io_timeout);
        let (tx, rx) = futures_channel::oneshot::channel();
        let tx = Arc::new(Mutex::new(Some(tx)));
        let gone = tx.clone();
        let sent = self.submit(Call {
            request,
            deadline,
            abandoned: Some(Box::new(move || {
                lock(&gone).as_ref().is_none_or(|tx| tx.is_canceled())
            })),
            done: Box::new(move |r, acked, queue| {
                let r = match parse::<T>(r) {
                    Ok(v) => {
                        let (r, first) = replicas(v, acked);
                        if let Some(request) = first {
                            // Its own deadline: the claim's may be spent by the WAIT,
                            // and a release left unsent would hold the key a lease.
                            queue.push(Call {
                                request,
                                deadline: Instant::now() + io_timeout,
                                abandoned: None,
                                done: Box::new(|_, _, _| {}),
                            });
                        }
                        r
                    }
                    Err(f) => Err(f),
                };
                if r.as_ref().is_err_and(Failure::is_lost_answer) {
                    undo_unknown();
                }
                let Some(tx) = lock(&tx).take() else {
                    return;
                };
                if let Err(Ok(v)) = tx.send(r) {
                    // Within the same deadline, so the calls behind this one keep
                    // theirs; past it the claim lapses with its lease.
                    if let Some(request) = undo(&v) {
                        queue.push(Call {
                            request,
                            deadline,
                            abandoned: None,
                            done: Box::new(|_, _, _| {}),
                        });
                    }
                }
            }),
        });
        self.reply(sent, rx, Some(Box::new(undo_later)))
    }

    /// Sends `request` without waiting for it (a release after a panic or drop, a
    /// wake-up).
    pub(crate) fn spawn(&self, request: Request) {
        self.submit(Call {
            request,
            deadline: Instant::now() + self.io_timeout,
            abandoned: None,
            done: Box::new(|_, _, _| {}),
        });
    }

    /// Queues `call` for the workers, or sends it at once from this thread when the
    /// thread may block (see [`blocking`]), nothing is queued ahead of it (calls keep
    /// their order) and a direct connection is free.
    fn submit(&self, call: Call) -> bool {
        if MAY_BLOCK.with(std::cell::Cell::get) && lock(&self.queue.state).calls.is_empty() {
            let conn = lock(&self.direct).pop().or_else(|| {
                self.direct_left
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                    .ok()
                    .map(|_| Conn::new(self.link.clone()))
            });
            if let Some(mut conn) = conn {
                run_batch(&mut conn, &self.queue, vec![call]);
                lock(&self.direct).push(conn);
                return true;
            }
        }
        self.queue.push(call)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // The workers send what is queued, then end.
        lock(&self.queue.state).closed = true;
        self.queue.ready.notify_all();
    }
}
/// One lease being renewed.
struct Renewal {
    key: String,
    token: String,
    due: Instant,
    lost: Arc<AtomicBool>,
}

#[derive(Default)]
struct RenewState {
    leases: HashMap<u64, Renewal>,
    next_id: u64,
    started: bool,
    shutdown: bool,
    /// When the renewer thread will wake up by itself, if it is asleep.
    sleeping_until: Option<Instant>,
}

/// Renews every running lease every lease/3 on its own thread and connection, and
/// flags the ones that were lost (taken over) so the leader learns of it.
pub(crate) struct Renewer {
    state: Mutex<RenewState>,
    cv: Condvar,
    lease: Duration,
}

impl Renewer {
    pub(crate) fn new(lease: Duration) -> Arc<Self> {
        Arc::new(Renewer {
            state: Mutex::new(RenewState::default()),
            cv: Condvar::new(),
            lease,
        })
    }

    fn period(&self) -> Duration {
        self.lease / 3
    }

    /// Starts renewing `key` under `token`; returns its id and the lost flag.
    pub(crate) fn register(
        self: &Arc<Self>,
        link: &Link,
        scripts: &Arc<Scripts>,
        key: String,
        token: String,
    ) -> (u64, Arc<AtomicBool>) {
        let lost = Arc::new(AtomicBool::new(false));
        let mut st = lock(&self.state);
        let id = st.next_id;
        st.next_id += 1;
        let due = Instant::now() + self.period();
        st.leases.insert(
            id,
            Renewal {
                key,
                token,
                due,
                lost: lost.clone(),
            },
        );
        // The renewer never sleeps longer than a period, so it only needs waking when
        // it sleeps past this lease's first renewal (rarely: saves a context switch
        // per claim).
        let wake = st.sleeping_until.is_some_and(|t| t > due);
        if !st.started {
            st.started = true;
            let me = self.clone();
            let conn = Conn::new(link.clone());
            let scripts = scripts.clone();
            std::thread::Builder::new()
                .name("oncely-redis-renew".into())
                .spawn(move || me.run(conn, scripts))
                .expect("spawning the oncely-redis renewer thread");
        }
        drop(st);
        if wake {
            self.cv.notify_one();
        }
        (id, lost)
    }

    /// Stops renewing lease `id`.
    pub(crate) fn unregister(&self, id: u64) {
        lock(&self.state).leases.remove(&id);
    }

    pub(crate) fn shutdown(&self) {
        lock(&self.state).shutdown = true;
        self.cv.notify_one();
    }

    fn run(&self, mut conn: Conn, scripts: Arc<Scripts>) {
        let lease_ms = u64::try_from(self.lease.as_millis()).unwrap_or(u64::MAX);
        loop {
            let due: Vec<(u64, String, String)> = {
                let mut st = lock(&self.state);
                loop {
                    if st.shutdown {
                        return;
                    }
                    let now = Instant::now();
                    let due: Vec<_> = st
                        .leases
                        .iter()
                        .filter(|(_, r)| r.due <= now)
                        .map(|(id, r)| (*id, r.key.clone(), r.token.clone()))
                        .collect();
                    if !due.is_empty() {
                        break due;
                    }
                    let wait = st
                        .leases
                        .values()
                        .map(|r| r.due.saturating_duration_since(now))
                        .min()
                        .unwrap_or(self.period())
                        .min(self.period());
                    st.sleeping_until = Some(now + wait);
                    st = self
                        .cv
                        .wait_timeout(st, wait)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                    st.sleeping_until = None;
                }
            };
            // One round trip for every due lease: a slow reply delays them all by one
            // I/O timeout at most, never one after the other.
            let deadline = conn.deadline();
            let requests: Vec<Request> = due
                .iter()
                .map(|(_, key, token)| scripts.renew.on(key).arg(token).arg(lease_ms))
                .collect();
            let requests: Vec<&Request> = requests.iter().collect();
            let r = conn.run(deadline, |c| pipeline(c, &requests, deadline));
            let mut st = lock(&self.state);
            // Redis unreachable or failing: keep trying; when it returns in time the
            // lease is kept, otherwise the complete script reports it lost.
            let retry = Instant::now() + (self.period() / 4).max(Duration::from_millis(5));
            let replies: Vec<Option<i64>> = match r {
                Ok(replies) => replies
                    .into_iter()
                    .map(|r| r.ok().and_then(|v| redis::from_redis_value(v).ok()))
                    .collect(),
                Err(_) => vec![None; due.len()],
            };
            for ((id, _, _), renewed) in due.iter().zip(replies) {
                match renewed {
                    Some(1) => {
                        if let Some(l) = st.leases.get_mut(id) {
                            l.due = Instant::now() + self.period();
                        }
                    }
                    Some(_) => {
                        if let Some(l) = st.leases.remove(id) {
                            l.lost.store(true, Ordering::Release);
                        }
                    }
                    None => {
                        if let Some(l) = st.leases.get_mut(id) {
                            l.due = retry;
                        }
                    }
                }
            }
        }
    }
}

#[derive(Default)]
struct NotifyState {
    channels: HashMap<String, (usize, Arc<Event>)>,
    started: bool,
    shutdown: bool,
}

/// Listens on the per-key channels that waiters of this process care about and wakes
/// them when a complete or release script publishes there.
///
/// The blocking pub/sub read cannot be interrupted to send a SUBSCRIBE, so the
/// listener also listens on a private wake channel: a waiter that needs a new
/// subscription publishes there (see [`Subscription::needs_poke`]) and the listener
/// subscribes at once instead of at its next tick.
pub(crate) struct Notifier {
    state: Mutex<NotifyState>,
    /// Signalled on shutdown, to cut a back-off pause short.
    stopped: Condvar,
    wake_channel: String,
}

/// A waiter's interest in one channel; dropping it unsubscribes when it was the last.
pub(crate) struct Subscription {
    notifier: Arc<Notifier>,
    channel: String,
    pub(crate) event: Arc<Event>,
    /// The channel is new to the listener: publish to [`Notifier::wake_channel`] so it
    /// subscribes now.
    pub(crate) needs_poke: bool,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut st = lock(&self.notifier.state);
        if let Some((n, _)) = st.channels.get_mut(&self.channel) {
            *n -= 1;
            if *n == 0 {
                st.channels.remove(&self.channel);
            }
        }
    }
}

/// How long the listener blocks in one read when nobody pokes it (it then checks for
/// shutdown and new subscriptions).
const LISTEN_TICK: Duration = Duration::from_millis(100);
/// The listener's pause after a failed connection or subscription, doubled on each
/// failure in a row up to [`LISTEN_BACKOFF_MAX`] (waiters poll meanwhile).
const LISTEN_BACKOFF_MIN: Duration = Duration::from_millis(100);
/// The longest pause of the listener between attempts.
const LISTEN_BACKOFF_MAX: Duration = Duration::from_secs(5);

impl Notifier {
    pub(crate) fn new(wake_channel: String) -> Arc<Self> {
        Arc::new(Notifier {
            state: Mutex::new(NotifyState::default()),
            stopped: Condvar::new(),
            wake_channel,
        })
    }

    /// The listener's private wake channel.
    pub(crate) fn wake_channel(&self) -> &str {
        &self.wake_channel
    }

    pub(crate) fn subscribe(self: &Arc<Self>, link: &Link, channel: String) -> Subscription {
        let mut st = lock(&self.state);
        let started = st.started;
        let entry = st
            .channels
            .entry(channel.clone())
            .or_insert_with(|| (0, Arc::new(Event::new())));
        entry.0 += 1;
        let needs_poke = entry.0 == 1 && started;
        let event = entry.1.clone();
        if !st.started {
            st.started = true;
            let me = self.clone();
            let link = link.clone();
            std::thread::Builder::new()
                .name("oncely-redis-listen".into())
                .spawn(move || me.run(link))
                .expect("spawning the oncely-redis listener thread");
        }
        Subscription {
            notifier: self.clone(),
            channel,
            event,
            needs_poke,
        }
    }

    pub(crate) fn shutdown(&self) {
        lock(&self.state).shutdown = true;
        self.stopped.notify_all();
    }

    /// Sleeps `pause` (or until shutdown) and doubles it, up to the bound; false once
    /// shut down.
    fn back_off(&self, pause: &mut Duration) -> bool {
        let st = lock(&self.state);
        let (st, _) = self
            .stopped
            .wait_timeout_while(st, *pause, |st| !st.shutdown)
            .unwrap_or_else(|e| e.into_inner());
        *pause = (*pause * 2).min(LISTEN_BACKOFF_MAX);
        !st.shutdown
    }

    fn wake_all(&self) {
        for (_, e) in lock(&self.state).channels.values() {
            e.notify(usize::MAX);
        }
    }

    fn run(&self, link: Link) {
        // Reset only once a session has subscribed to everything wanted: a server
        // that accepts connections but refuses subscriptions (no channel rights in
        // its ACL) must not be hammered with reconnects.
        let mut pause = LISTEN_BACKOFF_MIN;
        loop {
            if lock(&self.state).shutdown {
                return;
            }
            if self.session(&link, &mut pause) == Session::Stop || !self.back_off(&mut pause) {
                return;
            }
        }
    }

    /// One pub/sub connection, until it fails (or shutdown).
    fn session(&self, link: &Link, pause: &mut Duration) -> Session {
        // Waiters fall back to polling while there is no session.
        let Ok(mut con) = link.topology.listen_connection(link.connect_timeout) else {
            return Session::Failed;
        };
        let mut ps = con.as_pubsub();
        if ps.set_read_timeout(Some(LISTEN_TICK)).is_err()
            || ps.subscribe(&self.wake_channel).is_err()
        {
            return Session::Failed;
        }
        // Messages may have been missed while disconnected: let waiters look.
        self.wake_all();
        let mut subscribed: HashSet<String> = HashSet::new();
        loop {
            let (wanted, shutdown) = {
                let st = lock(&self.state);
                (
                    st.channels.keys().cloned().collect::<HashSet<_>>(),
                    st.shutdown,
                )
            };
            if shutdown {
                return Session::Stop;
            }
            let add: Vec<&String> = wanted.difference(&subscribed).collect();
            let remove: Vec<&String> = subscribed.difference(&wanted).collect();
            if (!add.is_empty() && ps.subscribe(&add).is_err())
                || (!remove.is_empty() && ps.unsubscribe(&remove).is_err())
            {
                return Session::Failed;
            }
            if !add.is_empty() {
                // A publish between a waiter's look and this subscription is not
                // seen: let the new waiters look once more.
                let st = lock(&self.state);
                for ch in &add {
                    if let Some((_, e)) = st.channels.get(*ch) {
                        e.notify(usize::MAX);
                    }
                }
            }
            subscribed = wanted;
            *pause = LISTEN_BACKOFF_MIN;
            match ps.get_message() {
                Ok(msg) => {
                    let st = lock(&self.state);
                    if let Some((_, e)) = st.channels.get(msg.get_channel_name()) {
                        e.notify(usize::MAX);
                    }
                }
                Err(e) if e.is_timeout() => {}
                Err(_) => return Session::Failed,
            }
        }
    }
}

/// How a listener session ended.
#[derive(PartialEq, Eq)]
enum Session {
    /// The store is shut down.
    Stop,
    /// The connection or a subscription failed: back off, then reconnect.
    Failed,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scripts::Lua;

    fn url() -> String {
        match std::env::var("ONCELY_REDIS_URL") {
            Ok(u) if !u.is_empty() => u,
            _ => panic!("ONCELY_REDIS_URL is not set: run scripts/test-redis"),
        }
    }

    /// Calls pushed from many threads, while the workers are now busy, now idle, are
    /// all taken, and the follow-up calls the workers push too: a push that wakes no
    /// worker (none waiting) must never leave a call behind. A lost wake-up hangs,
    /// caught by the bounded wait.
    #[test]
    fn every_call_pushed_is_taken_with_workers_busy_or_idle() {
        use std::sync::atomic::AtomicUsize;
        const PRODUCERS: usize = 8;
        const CALLS: usize = 2_000;
        let queue = Arc::new(Queue {
            state: Mutex::new(QueueState::default()),
            ready: Condvar::new(),
        });
        let done = Arc::new(AtomicUsize::new(0));
        let workers: Vec<_> = (0..3)
            .map(|_| {
                let queue = queue.clone();
                std::thread::spawn(move || {
                    while let Some(batch) = queue.take() {
                        for call in batch {
                            (call.done)(Err(Failure::NotSent), None, &queue);
                        }
                    }
                })
            })
            .collect();
        let call = |done: &Arc<AtomicUsize>, follow_up: bool| {
            let done = done.clone();
            Call {
                request: Request::command("PING"),
                deadline: Instant::now(),
                abandoned: None,
                done: Box::new(move |_, _, queue| {
                    if follow_up {
                        // As a claim nobody waits for queues its release.
                        let done = done.clone();
                        assert!(queue.push(Call {
                            request: Request::command("PING"),
                            deadline: Instant::now(),
                            abandoned: None,
                            done: Box::new(move |_, _, _| {
                                done.fetch_add(1, Ordering::SeqCst);
                            }),
                        }));
                    }
                    done.fetch_add(1, Ordering::SeqCst);
                }),
            }
        };
        let producers: Vec<_> = (0..PRODUCERS)
            .map(|p| {
                let (queue, done) = (queue.clone(), done.clone());
                std::thread::spawn(move || {
                    for i in 0..CALLS {
                        assert!(queue.push(call(&done, i % 7 == 0)));
                        // Now and then, time for every worker to go idle.
                        if (i + p) % 97 == 0 {
                            std::thread::sleep(Duration::from_micros(200));
                        }
                    }
                })
            })
            .collect();
        for p in producers {
            p.join().unwrap();
        }
        let expected = PRODUCERS * (CALLS + CALLS.div_ceil(7));
        let limit = Instant::now() + Duration::from_secs(30);
        while done.load(Ordering::SeqCst) < expected {
            assert!(
                Instant::now() < limit,
                "{} of {expected} calls taken after 30 s: a call was left in the queue",
                done.load(Ordering::SeqCst)
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        lock(&queue.state).closed = true;
        queue.ready.notify_all();
        for w in workers {
            w.join().unwrap();
        }
        assert_eq!(done.load(Ordering::SeqCst), expected);
        assert_eq!(lock(&queue.state).idle, 0);
    }

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

    /// A redis-server on a free loopback port, killed on drop.
    struct Server(std::process::Child, u16);

    impl Server {
        fn start(args: &[&str]) -> Server {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            // Its own dir: a replica writes the primary's snapshot there.
            let dir = std::env::temp_dir().join(format!("oncely-threads-test-{port}"));
            std::fs::create_dir_all(&dir).unwrap();
            let child = std::process::Command::new("redis-server")
                .args([
                    "--port",
                    &port.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--dir",
                    dir.to_str().unwrap(),
                ])
                .args(["--appendonly", "no", "--repl-diskless-sync-delay", "0"])
                .args(args)
                .stdout(std::process::Stdio::null())
                .spawn()
                .expect("redis-server (run scripts/test-redis, which installs it)");
            let s = Server(child, port);
            let deadline = Instant::now() + Duration::from_secs(10);
            while s.con().is_err() {
                assert!(Instant::now() < deadline, "redis-server did not start");
                std::thread::sleep(Duration::from_millis(20));
            }
            s
        }
        fn url(&self) -> String {
            format!("redis://127.0.0.1:{}", self.1)
        }
        fn con(&self) -> redis::RedisResult<redis::Connection> {
            redis::Client::open(self.url())?.get_connection()
        }
        fn signal(&self, sig: &str) {
            let ok = std::process::Command::new("kill")
                .args([sig, &self.0.id().to_string()])
                .status()
                .unwrap();
            assert!(ok.success());
        }
    }

    impl Drop for Server {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
            let dir = std::env::temp_dir().join(format!("oncely-threads-test-{}", self.1));
            let _ = std::fs::remove_dir_all(dir);
        }
    }

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
