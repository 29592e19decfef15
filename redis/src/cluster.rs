//! A Redis Cluster connection of the store's own: the slot map (`CLUSTER SLOTS`), one
//! plain connection per primary, and a batch of requests sent as one pipeline per
//! node, all nodes written before any is read.
//!
//! Hand-written rather than the redis crate's `ClusterConnection`, which the store
//! needs to do three things it cannot:
//!
//! - `WAIT` on the very connection that ran a write. `WAIT` counts the replicas that
//!   acknowledged *that connection's* writes; the crate reconnects and retries by
//!   itself, and routes `WAIT` by slot, so after a redirect (ASK) or a reconnect its
//!   `WAIT` could vouch for a write the replicas never saw. Here every reply records
//!   the node and the connection (its epoch) that gave it ([`Ran`]), and
//!   [`ClusterCon::wait`] only asks that connection.
//! - Keep a call's deadline: the crate retries timed-out reads and refreshes the slot
//!   map outside of it; here every connect, write and read is bounded by the batch's
//!   deadline, a timed-out node is not retried, and redirects are followed a bounded
//!   number of rounds within the deadline.
//! - One pipeline per node: the crate's sync cluster pipeline fails every command
//!   when one fails (a NOSCRIPT is one), so batches went one request at a time.
//!
//! A node that stalls costs its own requests their deadline, not the others': all
//! nodes are written first, then read, the nodes that timed out last time read last,
//! and while others remain (to read, or to send again) a node's read gets at most half
//! the time left.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use redis::{ConnectionAddr, RedisError, RedisResult, Value};

use crate::pipeline::write_by;
use crate::request::{Failure, Request};
use crate::topology::{open_client, NodeClients};

/// Slots of a Redis Cluster.
const SLOTS: usize = 16384;
/// Rounds of one pipeline: the first send, then redirects (MOVED / ASK), unknown
/// scripts (NOSCRIPT), a reconnect after a stale connection or a slot without a
/// primary for a moment.
const ROUNDS: usize = 5;
/// A read after the deadline passed still takes a reply that is already there (the
/// other nodes' replies, read after a stalled node's timeout) for this long at most.
const GRACE: Duration = Duration::from_millis(1);

/// A node's address.
pub(crate) type Addr = (String, u16);

/// Where a request ran: the node and the connection (see [`ClusterCon::wait`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Ran {
    addr: Addr,
    epoch: u64,
    /// Sent again on a new connection after the first one broke: the first send may
    /// have run it too, and `WAIT` on the new connection says nothing of that one.
    pub(crate) resent: bool,
}

/// Where a request is to be sent.
#[derive(Clone)]
enum To {
    /// The primary of its key's slot in the slot map.
    Slot,
    /// A node named by a `MOVED` redirect.
    Moved(Addr),
    /// A node named by an `ASK` redirect: `ASKING` precedes the request.
    Ask(Addr),
}

/// A request of the pipeline still to be sent.
#[derive(Clone)]
struct Item {
    index: usize,
    to: To,
    /// The script is to be loaded first (the node answered NOSCRIPT).
    load: bool,
    resent: bool,
}

struct Node {
    con: redis::Connection,
    epoch: u64,
}

/// A connection to a Redis Cluster (see the module documentation).
pub(crate) struct ClusterCon {
    nodes: NodeClients,
    connect_timeout: Duration,
    /// The primary of each slot, as an index into `addrs`.
    slots: Vec<Option<u16>>,
    addrs: Vec<Addr>,
    conns: HashMap<Addr, Node>,
    epochs: u64,
    /// The slot map is to be read again before the next send.
    stale: bool,
    /// Where each request of the last [`pipeline`](Self::pipeline) ran.
    pub(crate) ran: Vec<Option<Ran>>,
}

/// The slot of `key` (CRC16 of its hash tag, as Redis computes it).
fn slot(key: &[u8]) -> usize {
    let tagged = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    usize::from(crc16::State::<crc16::XMODEM>::calculate(tagged)) % SLOTS
}

/// Time left before `deadline` for a read: at least [`GRACE`].
fn read_time(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(GRACE)
}

/// Time left before `deadline`, if any.
fn time_left(deadline: Instant) -> Option<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
}

fn timed_out() -> RedisError {
    RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut))
}

/// The node a redirect (`MOVED slot host:port`, `ASK slot host:port`) names.
fn redirect(e: &RedisError) -> Option<Addr> {
    let (node, _) = e.redirect_node()?;
    let (host, port) = node.rsplit_once(':')?;
    Some((host.trim_matches(['[', ']']).to_owned(), port.parse().ok()?))
}

/// A reply from a node that did not run the request and whose slot map is to be read
/// again: it is no longer the primary, or the cluster is reconfiguring.
fn not_run_try_again(e: &RedisError) -> bool {
    matches!(
        e.code(),
        Some("READONLY" | "MASTERDOWN" | "LOADING" | "TRYAGAIN" | "CLUSTERDOWN")
    )
}

/// Whether requests written on a connection that then failed with `e` go again, once,
/// on a new connection (the scripts may be resent, see `conn::Conn::run`): when the
/// connection was open before and broke (not timed out), likely stale (the node
/// restarted); and when a signal interrupted the read or write (EINTR: a socket with a
/// timeout is never restarted, and a child process exiting sends SIGCHLD), on any
/// connection, however new: nothing is wrong with the node.
fn send_again(e: &RedisError, reused: bool) -> bool {
    (reused || crate::topology::interrupted(e)) && e.is_io_error() && !e.is_timeout()
}

impl ClusterCon {
    /// Reads the slot map from the first seed that answers within `timeout`.
    pub(crate) fn connect(
        nodes: NodeClients,
        connect_timeout: Duration,
        timeout: Duration,
    ) -> RedisResult<Self> {
        let mut c = ClusterCon {
            nodes,
            connect_timeout,
            slots: vec![None; SLOTS],
            addrs: Vec::new(),
            conns: HashMap::new(),
            epochs: 0,
            stale: true,
            ran: Vec::new(),
        };
        c.refresh(Instant::now() + timeout)?;
        Ok(c)
    }

    /// A connection to `addr` with the seeds' settings (auth, database, TLS).
    fn open(&self, addr: &Addr, deadline: Instant) -> RedisResult<redis::Connection> {
        let time = time_left(deadline).ok_or_else(timed_out)?;
        open_client(self.node_info(addr)?, self.nodes.ca.clone())?
            .get_connection_with_timeout(self.connect_timeout.min(time))
    }

    /// The settings of a connection to `addr`: the seeds' (auth, database, TLS).
    fn node_info(&self, addr: &Addr) -> RedisResult<redis::ConnectionInfo> {
        let seed =
            self.nodes.seeds.first().ok_or_else(|| {
                RedisError::from((redis::ErrorKind::InvalidClientConfig, "no seed"))
            })?;
        let (host, port) = addr.clone();
        let to = match seed.addr() {
            ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => ConnectionAddr::TcpTls {
                host,
                port,
                insecure: *insecure,
                tls_params: tls_params.clone(),
            },
            _ => ConnectionAddr::Tcp(host, port),
        };
        Ok(seed.clone().set_addr(to))
    }

    /// A RESP3 connection to `addr` for sharded pub/sub (`SSUBSCRIBE`): its push
    /// messages go to `pushes` as they are read.
    pub(crate) fn open_subscriber(
        &self,
        addr: &Addr,
        deadline: Instant,
        pushes: std::sync::mpsc::Sender<redis::PushInfo>,
    ) -> RedisResult<redis::Connection> {
        let time = time_left(deadline).ok_or_else(timed_out)?;
        let info = self.node_info(addr)?;
        let settings = info
            .redis_settings()
            .clone()
            .set_protocol(redis::ProtocolVersion::RESP3);
        let mut con = open_client(info.set_redis_settings(settings), self.nodes.ca.clone())?
            .get_connection_with_timeout(self.connect_timeout.min(time))?;
        con.set_push_sender(pushes);
        Ok(con)
    }

    /// The primary that serves `key`'s slot in the slot map, if one does.
    pub(crate) fn primary_of(&self, key: &[u8]) -> Option<Addr> {
        self.slots[slot(key)].map(|i| self.addrs[usize::from(i)].clone())
    }

    /// Reads the slot map again, by `deadline` (a failure keeps the map it had).
    pub(crate) fn reload(&mut self, deadline: Instant) -> RedisResult<()> {
        self.refresh(deadline)
    }

    /// The connection to `addr`, opened if needed; true when it was open already.
    fn node(&mut self, addr: &Addr, deadline: Instant) -> RedisResult<(&mut Node, bool)> {
        let reused = self.conns.contains_key(addr);
        if !reused {
            let con = self.open(addr, deadline)?;
            self.epochs += 1;
            let epoch = self.epochs;
            self.conns.insert(addr.clone(), Node { con, epoch });
        }
        let Some(node) = self.conns.get_mut(addr) else {
            unreachable!("inserted above")
        };
        Ok((node, reused))
    }

    /// The nodes whose last read timed out (on any connection of the store): asked
    /// and read after the others.
    fn slow(&self) -> HashSet<Addr> {
        self.nodes
            .slow
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn set_slow(&self, addr: &Addr, slow: bool) {
        let mut set = self.nodes.slow.lock().unwrap_or_else(|e| e.into_inner());
        if slow {
            set.insert(addr.clone());
        } else {
            set.remove(addr);
        }
    }

    /// Reads the slot map again: from a node already connected, else from a seed.
    fn refresh(&mut self, deadline: Instant) -> RedisResult<()> {
        let mut candidates: Vec<Addr> = self.conns.keys().cloned().collect();
        candidates.extend(self.seed_addrs());
        let mut seen = HashSet::new();
        candidates.retain(|a| seen.insert(a.clone()));
        // The nodes that timed out last go last (a stalled node asked first would take
        // the time left; in a pipeline a failed refresh keeps the map it had).
        let slow = self.slow();
        candidates.sort_by_key(|a| slow.contains(a));
        let mut last = None;
        let n = candidates.len();
        for (i, addr) in candidates.into_iter().enumerate() {
            let Some(left) = time_left(deadline) else {
                break;
            };
            // Half the time left while others remain: a stalled node not yet known as
            // one (a fresh store, the first seed) leaves the others time to answer. (A
            // fixed share of the time per candidate failed fresh connects under load.)
            let by = if i + 1 < n {
                Instant::now() + left / 2
            } else {
                deadline
            };
            let r = self.node(&addr, by).and_then(|(n, _)| {
                let t = time_left(by).ok_or_else(timed_out)?;
                n.con.set_read_timeout(Some(t))?;
                n.con.set_write_timeout(Some(t))?;
                redis::cmd("CLUSTER")
                    .arg("SLOTS")
                    .query::<Value>(&mut n.con)
            });
            match r.and_then(|v| self.set_slots(v, &addr.0)) {
                Ok(()) => {
                    self.set_slow(&addr, false);
                    self.stale = false;
                    return Ok(());
                }
                Err(e) => {
                    self.conns.remove(&addr);
                    if e.is_timeout() {
                        self.set_slow(&addr, true);
                    }
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(timed_out))
    }

    /// The seeds' addresses.
    fn seed_addrs(&self) -> Vec<Addr> {
        self.nodes
            .seeds
            .iter()
            .filter_map(|seed| match seed.addr() {
                ConnectionAddr::Tcp(h, p)
                | ConnectionAddr::TcpTls {
                    host: h, port: p, ..
                } => Some((h.clone(), *p)),
                _ => None,
            })
            .collect()
    }

    /// Takes a `CLUSTER SLOTS` reply from the node at `host` as the slot map.
    fn set_slots(&mut self, v: Value, host: &str) -> RedisResult<()> {
        let bad = || RedisError::from((redis::ErrorKind::Parse, "unexpected CLUSTER SLOTS reply"));
        let Value::Array(ranges) = v else {
            return Err(bad());
        };
        let mut slots = vec![None; SLOTS];
        let mut addrs: Vec<Addr> = Vec::new();
        for range in ranges {
            let Value::Array(r) = range else {
                return Err(bad());
            };
            let (Some(Value::Int(a)), Some(Value::Int(b)), Some(Value::Array(primary))) =
                (r.first(), r.get(1), r.get(2))
            else {
                return Err(bad());
            };
            let h = match primary.first() {
                Some(Value::BulkString(h)) => String::from_utf8_lossy(h).into_owned(),
                Some(Value::Nil) => String::new(),
                _ => return Err(bad()),
            };
            if h == "?" {
                continue;
            }
            // An empty host: the node that answered.
            let h = if h.is_empty() { host.to_owned() } else { h };
            let Some(Value::Int(p)) = primary.get(1) else {
                return Err(bad());
            };
            let addr = (h, u16::try_from(*p).map_err(|_| bad())?);
            let i = match addrs.iter().position(|x| *x == addr) {
                Some(i) => i,
                None => {
                    addrs.push(addr);
                    addrs.len() - 1
                }
            };
            let i = u16::try_from(i).map_err(|_| bad())?;
            let (a, b) = (
                usize::try_from(*a).map_err(|_| bad())?,
                usize::try_from(*b).map_err(|_| bad())?,
            );
            for s in slots.iter_mut().take((b + 1).min(SLOTS)).skip(a) {
                *s = Some(i);
            }
        }
        // Connections to nodes that are no longer primaries are closed, and such nodes
        // are forgotten as slow (seeds stay known: a refresh asks them again).
        self.conns.retain(|a, _| addrs.contains(a));
        let seeds = self.seed_addrs();
        self.nodes
            .slow
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|a| addrs.contains(a) || seeds.contains(a));
        self.slots = slots;
        self.addrs = addrs;
        Ok(())
    }

    /// Sets the read and write timeouts of every open connection.
    pub(crate) fn set_timeouts(&mut self, d: Duration) -> RedisResult<()> {
        for n in self.conns.values() {
            n.con.set_read_timeout(Some(d))?;
            n.con.set_write_timeout(Some(d))?;
        }
        Ok(())
    }

    /// `PING` on the primary of slot 0's node, or any node reached.
    pub(crate) fn ping(&mut self, deadline: Instant) -> RedisResult<()> {
        let addr = self
            .slots
            .iter()
            .flatten()
            .next()
            .map(|&i| self.addrs[usize::from(i)].clone())
            .ok_or_else(|| RedisError::from((redis::ErrorKind::Client, "no slot is served")))?;
        let (n, _) = self.node(&addr, deadline)?;
        let t = time_left(deadline).ok_or_else(timed_out)?;
        n.con.set_read_timeout(Some(t))?;
        n.con.set_write_timeout(Some(t))?;
        redis::cmd("PING").query::<String>(&mut n.con).map(drop)
    }

    /// Runs `requests`, each on the primary of its key's slot, as one pipeline per
    /// node; every node is written before any is read. One result per request, in
    /// order; [`ran`](Self::ran) tells where each that got a reply ran.
    ///
    /// MOVED and ASK are followed, an unknown script is loaded on the node that does
    /// not know it and sent again, a request on a connection found broken before its
    /// reply (one used before, or any a signal interrupted: see [`send_again`]) is sent
    /// again once on a new one: all within `deadline`, at most [`ROUNDS`] rounds. A node
    /// that times out fails its own requests only, and is not retried. A request sent
    /// again that still fails is a lost answer (see [`Failure::after_resend`]).
    pub(crate) fn pipeline(
        &mut self,
        requests: &[&Request],
        deadline: Instant,
    ) -> Vec<Result<Value, Failure>> {
        let n = requests.len();
        let mut out: Vec<Option<Result<Value, Failure>>> = vec![None; n];
        // Requests sent again after a lost reply: their first send may have run.
        let mut resent = vec![false; n];
        self.ran = vec![None; n];
        let mut todo: Vec<Item> = (0..n)
            .map(|index| Item {
                index,
                to: To::Slot,
                load: false,
                resent: false,
            })
            .collect();
        for round in 0..ROUNDS {
            if todo.is_empty() {
                break;
            }
            if time_left(deadline).is_none() {
                break;
            }
            if self.stale {
                // A failed refresh keeps the map it had: the redirects still lead.
                let _ = self.refresh(deadline);
            }
            let mut groups: Vec<(Addr, Vec<Item>)> = Vec::new();
            let mut retry = Vec::new();
            for item in todo.drain(..) {
                let addr = match &item.to {
                    To::Moved(a) | To::Ask(a) => a.clone(),
                    To::Slot => {
                        let key = requests[item.index].key_bytes();
                        match self.slots[slot(key)] {
                            Some(i) => self.addrs[usize::from(i)].clone(),
                            None => {
                                self.stale = true;
                                out[item.index] =
                                    Some(Err(Failure::NotConnected(RedisError::from((
                                        redis::ErrorKind::Client,
                                        "no primary serves the key's slot",
                                    )))));
                                retry.push(item);
                                continue;
                            }
                        }
                    }
                };
                match groups.iter_mut().find(|(a, _)| *a == addr) {
                    Some((_, g)) => g.push(item),
                    None => groups.push((addr, vec![item])),
                }
            }
            // Write every node first.
            let mut sent: Vec<(Addr, Vec<Item>, u64, bool, usize)> = Vec::new();
            for (addr, items) in groups {
                match self.send(&addr, &items, requests, deadline) {
                    Ok((epoch, reused, loads)) => sent.push((addr, items, epoch, reused, loads)),
                    Err((e, written, reused)) => {
                        self.conns.remove(&addr);
                        self.stale = true;
                        // A connection that was open before and broke (likely stale),
                        // or a write a signal interrupted: see `send_again`.
                        let again = send_again(&e, reused);
                        for item in items {
                            out[item.index] = Some(Err(if written {
                                Failure::Redis(e.clone())
                            } else {
                                Failure::NotConnected(e.clone())
                            }));
                            if !written {
                                // Nothing was sent: it may go where the new map says.
                                retry.push(Item {
                                    to: To::Slot,
                                    ..item
                                });
                            } else if again && !item.resent {
                                resent[item.index] = true;
                                retry.push(Item {
                                    resent: true,
                                    ..item
                                });
                            }
                        }
                    }
                }
            }
            // Then read them, the nodes that were slow last time last. While other nodes
            // remain to be read, or requests wait for another round (a redirect, a
            // script to load), a node gets at most half the time left, as in
            // `refresh`: a node that stalls would otherwise take all of it, and a
            // request another node answered with NOSCRIPT or a redirect would fail
            // unsent, its node healthy.
            let slow = self.slow();
            sent.sort_by_key(|(addr, ..)| slow.contains(addr));
            let nodes = sent.len();
            for (i, (addr, items, epoch, reused, loads)) in sent.into_iter().enumerate() {
                let others = i + 1 < nodes || !retry.is_empty();
                let by = match time_left(deadline) {
                    Some(left) if others && round + 1 < ROUNDS => Instant::now() + left / 2,
                    _ => deadline,
                };
                let r = self.read(&addr, &items, loads, by);
                let (replies, broken) = match r {
                    Ok(replies) => (replies, None),
                    Err((replies, e)) => (replies, Some(e)),
                };
                if broken.is_none() {
                    self.set_slow(&addr, false);
                }
                let got = replies.len();
                for (item, reply) in items.iter().zip(replies) {
                    match reply {
                        Ok(v) => {
                            out[item.index] = Some(Ok(v));
                            self.ran[item.index] = Some(Ran {
                                addr: addr.clone(),
                                epoch,
                                resent: item.resent,
                            });
                        }
                        Err(e) => {
                            let next = if e.kind()
                                == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
                                && !item.load
                            {
                                Some(Item {
                                    load: true,
                                    ..item.clone()
                                })
                            } else if e.kind()
                                == redis::ErrorKind::Server(redis::ServerErrorKind::Moved)
                            {
                                self.stale = true;
                                redirect(&e).map(|a| Item {
                                    to: To::Moved(a),
                                    ..item.clone()
                                })
                            } else if e.kind()
                                == redis::ErrorKind::Server(redis::ServerErrorKind::Ask)
                            {
                                redirect(&e).map(|a| Item {
                                    to: To::Ask(a),
                                    ..item.clone()
                                })
                            } else if not_run_try_again(&e) {
                                self.stale = true;
                                Some(Item {
                                    to: To::Slot,
                                    ..item.clone()
                                })
                            } else {
                                None
                            };
                            out[item.index] = Some(Err(Failure::Redis(e)));
                            retry.extend(next);
                        }
                    }
                }
                if let Some(e) = broken {
                    self.conns.remove(&addr);
                    self.stale = true;
                    if e.is_timeout() {
                        self.set_slow(&addr, true);
                    }
                    // A connection that was open before and broke (likely stale), or
                    // a read a signal interrupted: see `send_again`.
                    let again = send_again(&e, reused);
                    for item in &items[got..] {
                        out[item.index] = Some(Err(Failure::Redis(e.clone())));
                        if again && !item.resent {
                            resent[item.index] = true;
                            retry.push(Item {
                                resent: true,
                                ..item.clone()
                            });
                        }
                    }
                }
            }
            todo = retry;
            if !todo.is_empty()
                && round + 1 < ROUNDS
                && todo.iter().all(|i| matches!(i.to, To::Slot))
            {
                // Only waiting for the cluster (no redirect to follow): a short pause.
                let pause = Duration::from_millis(10 << round);
                if let Some(t) = time_left(deadline) {
                    std::thread::sleep(pause.min(t));
                }
            }
        }
        out.into_iter()
            .zip(resent)
            .map(|(r, resent)| match r.unwrap_or(Err(Failure::NotSent)) {
                // Whatever became of the resend (no connection, a redirect, no time
                // left), the first send may have run: a lost answer, which the caller
                // undoes (a claim it may hold is released), not a call never run.
                Err(f) if resent => Err(f.after_resend()),
                r => r,
            })
            .collect()
    }

    /// Writes `items` to `addr` as one pipeline (the scripts to load first): its
    /// connection's epoch, whether it was open before and how many scripts it loads;
    /// or the error, whether anything may have been written and whether the
    /// connection was open before.
    fn send(
        &mut self,
        addr: &Addr,
        items: &[Item],
        requests: &[&Request],
        deadline: Instant,
    ) -> Result<(u64, bool, usize), (RedisError, bool, bool)> {
        let (node, reused) = self.node(addr, deadline).map_err(|e| (e, false, false))?;
        let mut bytes = Vec::new();
        let mut loads: Vec<&str> = items
            .iter()
            .filter(|i| i.load)
            .filter_map(|i| requests[i.index].script_code())
            .collect();
        loads.sort_unstable();
        loads.dedup();
        let n_loads = loads.len();
        for code in loads {
            redis::cmd("SCRIPT")
                .arg("LOAD")
                .arg(code)
                .write_packed_command(&mut bytes);
        }
        for item in items {
            if matches!(item.to, To::Ask(_)) {
                redis::cmd("ASKING").write_packed_command(&mut bytes);
            }
            requests[item.index].write(&mut bytes);
        }
        let t = time_left(deadline).ok_or_else(|| (timed_out(), false, reused))?;
        node.con
            .set_write_timeout(Some(t))
            .map_err(|e| (e, false, reused))?;
        write_by(&mut node.con, &bytes, deadline, true).map_err(|e| (e, true, reused))?;
        Ok((node.epoch, reused, n_loads))
    }

    /// Reads the replies of what [`send`](Self::send) wrote for `items` (after `loads`
    /// replies of `SCRIPT LOAD`): the replies
    /// in order, and the connection's error if it broke or timed out before the last.
    #[allow(clippy::type_complexity)]
    fn read(
        &mut self,
        addr: &Addr,
        items: &[Item],
        loads: usize,
        deadline: Instant,
    ) -> Result<Vec<RedisResult<Value>>, (Vec<RedisResult<Value>>, RedisError)> {
        let mut out = Vec::with_capacity(items.len());
        let Some(node) = self.conns.get_mut(addr) else {
            return Err((out, timed_out()));
        };
        let recv = |con: &mut redis::Connection| -> RedisResult<RedisResult<Value>> {
            loop {
                con.set_read_timeout(Some(read_time(deadline)))?;
                match con.recv_response()? {
                    Value::Push { .. } => {}
                    Value::ServerError(e) => return Ok(Err(e.into())),
                    v => return Ok(Ok(v)),
                }
            }
        };
        for _ in 0..loads {
            if let Err(e) = recv(&mut node.con) {
                return Err((out, e));
            }
        }
        for item in items {
            if matches!(item.to, To::Ask(_)) {
                match recv(&mut node.con) {
                    Ok(_) => {}
                    Err(e) => return Err((out, e)),
                }
            }
            match recv(&mut node.con) {
                Ok(r) => out.push(r),
                Err(e) => return Err((out, e)),
            }
        }
        Ok(out)
    }

    /// `WAIT n timeout` on each connection that ran one of `ran` (one `WAIT` per
    /// connection covers all its writes), all sent before any is read: per entry, how
    /// many replicas acknowledged its connection's writes. A write whose connection
    /// was closed since (also when a newer connection to its node ran other writes of
    /// the pipeline), or that was resent on a new connection, gets an error: no `WAIT`
    /// can vouch for it any more.
    pub(crate) fn wait(
        &mut self,
        ran: &[Option<Ran>],
        n: usize,
        timeout: Duration,
        deadline: Instant,
    ) -> Vec<RedisResult<usize>> {
        let lost = |why: &'static str| {
            RedisError::from(std::io::Error::new(std::io::ErrorKind::NotConnected, why))
        };
        let ms = u64::try_from(timeout.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        // By connection, not by node: writes of one pipeline may have run on two
        // connections to a node (the first broke, a later round opened another), and a
        // WAIT on the second says nothing of the first's (the node may have restarted).
        let mut answers: HashMap<(Addr, u64), RedisResult<usize>> = HashMap::new();
        let mut asked: Vec<Addr> = Vec::new();
        for r in ran.iter().flatten() {
            let con = (r.addr.clone(), r.epoch);
            if r.resent || answers.contains_key(&con) || asked.contains(&r.addr) {
                continue;
            }
            let same = self.conns.get(&r.addr).is_some_and(|c| c.epoch == r.epoch);
            if !same {
                answers.insert(
                    con,
                    Err(lost(
                        "the connection that sent the write was lost before WAIT",
                    )),
                );
                continue;
            }
            let Some(node) = self.conns.get_mut(&r.addr) else {
                unreachable!("checked above")
            };
            let sent = time_left(deadline)
                .ok_or_else(timed_out)
                .and_then(|t| node.con.set_write_timeout(Some(t)))
                .and_then(|()| {
                    let mut bytes = Vec::new();
                    redis::cmd("WAIT")
                        .arg(n)
                        .arg(ms)
                        .write_packed_command(&mut bytes);
                    node.con.send_packed_command(&bytes)
                });
            match sent {
                Ok(()) => asked.push(r.addr.clone()),
                Err(e) => {
                    self.conns.remove(&r.addr);
                    answers.insert(con, Err(e));
                }
            }
        }
        for addr in asked {
            let Some(node) = self.conns.get_mut(&addr) else {
                continue;
            };
            let epoch = node.epoch;
            let r = node
                .con
                .set_read_timeout(Some(read_time(deadline)))
                .and_then(|()| node.con.recv_response())
                .and_then(|v| match v {
                    Value::ServerError(e) => Err(e.into()),
                    v => Ok(redis::from_redis_value::<usize>(v)?),
                });
            if r.as_ref().is_err_and(|e| e.is_io_error() || e.is_timeout()) {
                self.conns.remove(&addr);
                self.stale = true;
            }
            answers.insert((addr, epoch), r);
        }
        ran.iter()
            .map(|r| match r {
                None => Err(lost("the write got no reply")),
                Some(r) if r.resent => Err(lost(
                    "the write was sent again on a new connection: WAIT there cannot vouch \
                     for the first send",
                )),
                Some(r) => answers
                    .get(&(r.addr.clone(), r.epoch))
                    .cloned()
                    .unwrap_or_else(|| Err(lost("no WAIT"))),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    /// A Cluster connection whose every slot is on the one node at `port` (a scripted
    /// node in these tests), opened as the store opens them: no handshake.
    fn one_node_on(port: u16) -> ClusterCon {
        let seed =
            redis::IntoConnectionInfo::into_connection_info(format!("redis://127.0.0.1:{port}"))
                .unwrap();
        let settings = seed.redis_settings().clone().set_skip_set_lib_name();
        ClusterCon {
            nodes: NodeClients {
                seeds: vec![seed.set_redis_settings(settings)],
                ca: None,
                connect_timeout: Duration::from_secs(1),
                slow: Default::default(),
            },
            connect_timeout: Duration::from_secs(1),
            slots: vec![Some(0); SLOTS],
            addrs: vec![("127.0.0.1".to_owned(), port)],
            conns: HashMap::new(),
            epochs: 0,
            stale: false,
            ran: Vec::new(),
        }
    }

    /// A request whose connection breaks before its reply (Redis may have run it) is
    /// sent again; when the node cannot even be reached for that, the request still
    /// fails as a lost answer (which the caller undoes), not as one never sent. The
    /// "node" is a socket scripted here: it answers one PING, takes the request, stops
    /// listening and closes the connection.
    #[test]
    fn a_resend_that_cannot_connect_leaves_a_lost_answer() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let node = std::thread::spawn(move || {
            let (mut con, _) = listener.accept().unwrap();
            let mut buf = [0u8; 4096];
            let n = con.read(&mut buf).unwrap();
            assert!(buf[..n].windows(4).any(|w| w == b"PING"));
            con.write_all(b"+PONG\r\n").unwrap();
            let n = con.read(&mut buf).unwrap();
            assert!(buf[..n].windows(4).any(|w| w == b"INCR"));
            drop(listener);
            drop(con);
        });
        let mut c = one_node_on(port);
        let deadline = Instant::now() + Duration::from_secs(2);
        let ping = Request::command("PING");
        let r = c.pipeline(&[&ping], deadline);
        assert!(
            matches!(&r[0], Ok(Value::SimpleString(s)) if s == "PONG"),
            "{r:?}"
        );
        let write = Request::command("INCR").arg("k");
        let deadline = Instant::now() + Duration::from_secs(2);
        let r = c.pipeline(&[&write], deadline);
        node.join().unwrap();
        assert!(
            r[0].as_ref().is_err_and(Failure::is_lost_answer),
            "a request whose reply was lost ended as {:?}",
            r[0]
        );
    }

    /// One command of RESP from `r` (an array of bulk strings), as text; None once the
    /// connection is closed.
    fn next_command(r: &mut impl std::io::BufRead) -> Option<Vec<String>> {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return None;
        }
        let n: usize = line.trim_end().trim_start_matches('*').parse().unwrap();
        (0..n)
            .map(|_| {
                line.clear();
                r.read_line(&mut line).unwrap();
                let len: usize = line.trim_end().trim_start_matches('$').parse().unwrap();
                let mut arg = vec![0u8; len + 2];
                r.read_exact(&mut arg).unwrap();
                String::from_utf8_lossy(&arg[..len]).into_owned()
            })
            .collect::<Vec<_>>()
            .into()
    }

    fn read_command(r: &mut impl std::io::BufRead) -> Vec<String> {
        next_command(r).expect("a command")
    }

    /// Two writes of one pipeline ran on one node on two connections: X on the first,
    /// which then broke, Y (sent back with NOSCRIPT on the first) on the second. The
    /// `WAIT` on the second connection must not vouch for X: the node may have lost it
    /// (a restart broke the connection), and only its own connection's `WAIT` counted
    /// it. The "node" is a socket scripted here.
    #[test]
    fn a_wait_on_a_new_connection_does_not_vouch_for_a_write_on_the_old_one() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let node = std::thread::spawn(move || {
            let (first, _) = listener.accept().unwrap();
            let mut r = std::io::BufReader::new(first.try_clone().unwrap());
            let mut w = first;
            assert_eq!(read_command(&mut r), ["PING"]);
            w.write_all(b"+PONG\r\n").unwrap();
            let y = read_command(&mut r);
            assert_eq!(y[0], "EVALSHA");
            assert_eq!(read_command(&mut r), ["INCR", "x"]);
            assert_eq!(read_command(&mut r), ["INCR", "z"]);
            // Y unknown, X ran, then the connection breaks before Z's reply.
            w.write_all(b"-NOSCRIPT No matching script.\r\n:1\r\n")
                .unwrap();
            drop((r, w));
            let (second, _) = listener.accept().unwrap();
            let mut r = std::io::BufReader::new(second.try_clone().unwrap());
            let mut w = second;
            assert_eq!(read_command(&mut r), ["CLUSTER", "SLOTS"]);
            let map = format!("*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:{port}\r\n");
            w.write_all(map.as_bytes()).unwrap();
            assert_eq!(read_command(&mut r)[..2], ["SCRIPT", "LOAD"]);
            assert_eq!(read_command(&mut r), y);
            assert_eq!(read_command(&mut r), ["INCR", "z"]);
            w.write_all(b"$3\r\nsha\r\n:1\r\n:1\r\n").unwrap();
            // Any WAIT here counts one replica.
            while let Some(cmd) = next_command(&mut r) {
                assert_eq!(cmd[0], "WAIT");
                w.write_all(b":1\r\n").unwrap();
            }
        });
        let mut c = one_node_on(port);
        let deadline = Instant::now() + Duration::from_secs(2);
        let ping = Request::command("PING");
        assert!(c.pipeline(&[&ping], deadline)[0].is_ok());
        let mut script = redis::cmd("EVALSHA");
        script.arg("0123").arg(1).arg("y");
        let y = Request::script(script, "return redis.call('INCR', KEYS[1])", "y");
        let (x, z) = (
            Request::command("INCR").arg("x"),
            Request::command("INCR").arg("z"),
        );
        let deadline = Instant::now() + Duration::from_secs(2);
        let replies = c.pipeline(&[&y, &x, &z], deadline);
        assert!(
            replies.iter().all(Result::is_ok),
            "the pipeline: {replies:?}"
        );
        let ran = c.ran.clone();
        let acked = c.wait(&ran, 1, Duration::from_millis(100), deadline);
        drop(c);
        node.join().unwrap();
        assert!(matches!(acked[0], Ok(1)), "Y: {:?}", acked[0]);
        assert!(
            acked[1].is_err(),
            "X, run on the connection that broke, was vouched for by a WAIT on the new \
             one: {:?}",
            acked[1]
        );
        assert!(acked[2].is_err(), "Z, sent again: {:?}", acked[2]);
    }

    /// Nodes once slow that are neither primaries in a new slot map nor seeds are
    /// forgotten: the shared set does not grow with every address a cluster ever had.
    #[test]
    fn a_new_slot_map_forgets_slow_nodes_that_left() {
        let seed =
            redis::IntoConnectionInfo::into_connection_info("redis://10.0.0.1:7000").unwrap();
        let mut c = ClusterCon {
            nodes: NodeClients {
                seeds: vec![seed],
                ca: None,
                connect_timeout: Duration::from_secs(1),
                slow: Default::default(),
            },
            connect_timeout: Duration::from_secs(1),
            slots: vec![None; SLOTS],
            addrs: Vec::new(),
            conns: HashMap::new(),
            epochs: 0,
            stale: false,
            ran: Vec::new(),
        };
        for port in [7000, 7001, 7002] {
            c.set_slow(&("10.0.0.1".to_owned(), port), true);
        }
        let primary = |port: i64| {
            Value::Array(vec![
                Value::BulkString(b"10.0.0.1".to_vec()),
                Value::Int(port),
            ])
        };
        let map = Value::Array(vec![Value::Array(vec![
            Value::Int(0),
            Value::Int(16383),
            primary(7001),
        ])]);
        c.set_slots(map, "10.0.0.1").unwrap();
        let mut slow: Vec<u16> = c.slow().into_iter().map(|(_, p)| p).collect();
        slow.sort_unstable();
        // 7000 a seed, 7001 a primary; 7002 left.
        assert_eq!(slow, [7000, 7001]);
    }
}
