//! The pub/sub listener: one thread that wakes this process's waiters when a key they
//! wait on is completed or released. On one node or a Sentinels' primary it uses
//! classic pub/sub (`SUBSCRIBE`, one connection); on a Cluster sharded pub/sub
//! (`SSUBSCRIBE`, one connection per primary that owns a wanted channel's slot, see
//! [`Notifier::sharded_session`]).

use std::collections::{HashMap, HashSet};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use event_listener::{Event, EventListener};
use redis::{PushInfo, PushKind, Value};

use crate::cluster::{Addr, ClusterCon};
use crate::conn::Link;
use crate::lock;
use crate::topology::{NodeClients, Topology};

#[derive(Default)]
struct NotifyState {
    channels: HashMap<String, (usize, Arc<Event>)>,
    started: bool,
    shutdown: bool,
    /// A channel was added since the sharded listener last looked (it waits on
    /// [`Notifier::stopped`] while it has no connection, and is woken for this).
    changed: bool,
}

/// Listens on the per-key channels that waiters of this process care about and wakes
/// them when a complete or release script publishes there.
///
/// The blocking pub/sub read cannot be interrupted to send a SUBSCRIBE, so the
/// listener also listens on a private wake channel: a waiter that needs a new
/// subscription publishes there (see [`Subscription::needs_poke`]) and the listener
/// subscribes at once instead of at its next tick. (On a Cluster there is no wake
/// channel: see [`Notifier::sharded_session`].)
pub(crate) struct Notifier {
    state: Mutex<NotifyState>,
    /// Signalled on shutdown, to cut a back-off pause short, and (sharded) when a
    /// channel is added.
    stopped: Condvar,
    wake_channel: String,
}

/// A waiter's interest in one channel; dropping it unsubscribes when it was the last.
pub(crate) struct Subscription {
    notifier: Arc<Notifier>,
    channel: String,
    pub(crate) event: Arc<Event>,
    /// Listening since the subscription was counted (made under the state lock, as
    /// every notification is sent): the listener's "look again" once it has
    /// subscribed cannot come before it. Taken by the first wait.
    pub(crate) first: Option<EventListener>,
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
        let new = entry.0 == 1;
        // The sharded listener has no wake channel: its reads are short (a tick at
        // most per round) and, while idle, it waits on the condition variable.
        let sharded = matches!(link.topology, Topology::Cluster(_));
        let needs_poke = new && started && !sharded;
        let event = entry.1.clone();
        let first = Some(event.listen());
        if new && sharded {
            st.changed = true;
            self.stopped.notify_all();
        }
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
            first,
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
            let session = match &link.topology {
                Topology::Cluster(nodes) => self.sharded_session(&link, nodes, &mut pause),
                _ => self.session(&link, &mut pause),
            };
            if session == Session::Stop || !self.back_off(&mut pause) {
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

/// A sharded subscriber connection to one primary.
struct Shard {
    con: redis::Connection,
    /// The connection's push messages (`ssubscribe`, `smessage`, `sunsubscribe`), in
    /// the order read.
    pushes: mpsc::Receiver<PushInfo>,
    /// The channels this node confirmed (`ssubscribe`) and has not dropped since.
    channels: HashSet<String>,
}

/// The shortest read on one shard connection in a round (a round reads each shard
/// once, within about [`LISTEN_TICK`] in all).
const SHARD_READ_MIN: Duration = Duration::from_millis(10);

/// Whether an `SSUBSCRIBE` error says to ask again where the slot is (the slot moved
/// or the cluster is reconfiguring), rather than that subscriptions are refused.
fn slot_moved(e: &redis::RedisError) -> bool {
    matches!(
        e.code(),
        Some("MOVED" | "ASK" | "TRYAGAIN" | "CLUSTERDOWN" | "LOADING")
    )
}

/// The channel named by a push message (its first item).
fn push_channel(push: &PushInfo) -> Option<String> {
    match push.data.first() {
        Some(Value::BulkString(b)) => String::from_utf8(b.clone()).ok(),
        Some(Value::SimpleString(s)) => Some(s.clone()),
        _ => None,
    }
}

impl Notifier {
    fn notify(&self, channels: impl IntoIterator<Item = impl AsRef<str>>) {
        let st = lock(&self.state);
        for ch in channels {
            if let Some((_, e)) = st.channels.get(ch.as_ref()) {
                e.notify(usize::MAX);
            }
        }
    }

    /// Handles what `shard` read: a message wakes its channel's waiters; an
    /// `sunsubscribe` for a channel still counted as subscribed comes from the node
    /// (its slot moved away): the slot map is to be read again and the waiters look
    /// once (a message may have been missed). True when the map is stale.
    fn take_pushes(&self, shard: &mut Shard) -> bool {
        let mut stale = false;
        while let Ok(push) = shard.pushes.try_recv() {
            let ch = push_channel(&push);
            match (push.kind, ch) {
                (PushKind::SMessage, Some(ch)) => self.notify([ch]),
                (PushKind::SSubscribe, Some(ch)) => {
                    shard.channels.insert(ch);
                }
                (PushKind::SUnsubscribe, Some(ch)) if shard.channels.remove(&ch) => {
                    stale = true;
                    self.notify([ch]);
                }
                (PushKind::Disconnection, _) => stale = true,
                _ => {}
            }
        }
        stale
    }

    /// Sends `SSUBSCRIBE` for each of `add` (one command each: a command's channels
    /// must share a slot) then `PING`, and reads up to the `PING`'s reply: the errors,
    /// in order (the confirmations are pushes, see [`take_pushes`](Self::take_pushes)).
    fn ssubscribe(
        shard: &mut Shard,
        add: &[&String],
        timeout: Duration,
    ) -> redis::RedisResult<Vec<redis::RedisError>> {
        let mut bytes = Vec::new();
        for ch in add {
            redis::cmd("SSUBSCRIBE")
                .arg(ch.as_str())
                .write_packed_command(&mut bytes);
        }
        redis::cmd("PING").write_packed_command(&mut bytes);
        shard.con.set_write_timeout(Some(timeout))?;
        shard.con.set_read_timeout(Some(timeout))?;
        shard.con.send_packed_command(&bytes)?;
        let mut errors = Vec::new();
        loop {
            match shard.con.recv_response()? {
                Value::Push { .. } => {}
                Value::ServerError(e) => errors.push(e.into()),
                _ => return Ok(errors),
            }
        }
    }

    /// One sharded listener session on a Cluster, until a subscription is refused or
    /// the slot map cannot be read (or shutdown). Each wanted channel is subscribed
    /// with `SSUBSCRIBE` on the primary that owns its slot in the slot map, one
    /// connection per such primary (closed when none of its channels is wanted). A
    /// slot that moved (the node's `sunsubscribe`, a `MOVED` answer, a broken
    /// connection) has the map read again and its channels subscribed where it is
    /// now; their waiters look once. Waiters poll meanwhile, and whenever sharded
    /// pub/sub is refused (Redis < 7, an ACL without rights on the channels).
    fn sharded_session(&self, link: &Link, nodes: &NodeClients, pause: &mut Duration) -> Session {
        let timeout = link.io_timeout.max(link.connect_timeout);
        let Ok(mut map) =
            ClusterCon::connect(nodes.clone(), link.connect_timeout, link.connect_timeout)
        else {
            return Session::Failed;
        };
        // Messages may have been missed while there was no session.
        self.wake_all();
        let mut shards: HashMap<Addr, Shard> = HashMap::new();
        let mut stale = false;
        loop {
            let (wanted, shutdown) = {
                let mut st = lock(&self.state);
                st.changed = false;
                (st.channels.keys().cloned().collect::<Vec<_>>(), st.shutdown)
            };
            if shutdown {
                return Session::Stop;
            }
            if stale {
                if map.reload(Instant::now() + timeout).is_err() {
                    return Session::Failed;
                }
                stale = false;
            }
            let mut by_node: HashMap<Addr, HashSet<String>> = HashMap::new();
            for ch in wanted {
                match map.primary_of(ch.as_bytes()) {
                    Some(addr) => {
                        by_node.entry(addr).or_default().insert(ch);
                    }
                    None => stale = true,
                }
            }
            // Leave the channels no longer wanted here (the node's confirmation is
            // then ignored: they are no longer counted); close the idle connections.
            shards.retain(|addr, shard| {
                let Some(want) = by_node.get(addr) else {
                    return false;
                };
                let gone: Vec<String> = shard.channels.difference(want).cloned().collect();
                for ch in &gone {
                    shard.channels.remove(ch);
                    let sent = redis::cmd("SUNSUBSCRIBE")
                        .arg(ch.as_str())
                        .get_packed_command();
                    if shard.con.send_packed_command(&sent).is_err() {
                        return false;
                    }
                }
                true
            });
            for (addr, want) in &by_node {
                let had: HashSet<String> = shards
                    .get(addr)
                    .map(|s| s.channels.clone())
                    .unwrap_or_default();
                let add: Vec<&String> = want.difference(&had).collect();
                if add.is_empty() {
                    continue;
                }
                if !shards.contains_key(addr) {
                    let (tx, rx) = mpsc::channel();
                    match map.open_subscriber(addr, Instant::now() + link.connect_timeout, tx) {
                        Ok(con) => {
                            shards.insert(
                                addr.clone(),
                                Shard {
                                    con,
                                    pushes: rx,
                                    channels: HashSet::new(),
                                },
                            );
                        }
                        // Not reached (a node down, a failover under way): ask the
                        // map again next round.
                        Err(e) if e.is_io_error() => {
                            stale = true;
                            continue;
                        }
                        // Reached but refused (RESP3 unknown before Redis 6, the
                        // credentials): waiters poll; try again after a pause.
                        Err(_) => return Session::Failed,
                    }
                }
                let Some(shard) = shards.get_mut(addr) else {
                    continue;
                };
                match Self::ssubscribe(shard, &add, timeout) {
                    Ok(errors) => {
                        if errors.iter().any(|e| !slot_moved(e)) {
                            // Refused (no SSUBSCRIBE before Redis 7, no rights on
                            // the channels): waiters poll; try again after a pause.
                            return Session::Failed;
                        }
                        stale |= !errors.is_empty();
                        stale |= self.take_pushes(shard);
                    }
                    Err(_) => {
                        shards.remove(addr);
                        stale = true;
                    }
                }
                // A publish between a waiter's look and this subscription is not
                // seen: let the new waiters look once more.
                self.notify(&add);
            }
            *pause = LISTEN_BACKOFF_MIN;
            if shards.is_empty() {
                let st = lock(&self.state);
                let _ = self
                    .stopped
                    .wait_timeout_while(st, LISTEN_TICK, |st| !st.shutdown && !st.changed)
                    .unwrap_or_else(|e| e.into_inner());
                continue;
            }
            let read = u32::try_from(shards.len())
                .map(|n| LISTEN_TICK / n)
                .unwrap_or(SHARD_READ_MIN)
                .max(SHARD_READ_MIN);
            let mut broken = Vec::new();
            for (addr, shard) in shards.iter_mut() {
                let r = shard.con.set_read_timeout(Some(read)).and_then(|()| {
                    // A pub/sub read: unlike `recv_response`, a read that times out
                    // does not skip the next reply. Every push read goes to
                    // `shard.pushes` as well (the message returned is one of them).
                    let mut ps = shard.con.as_pubsub();
                    let r = ps.get_message().map(drop);
                    // Dropping it would leave pub/sub mode (`UNSUBSCRIBE` +
                    // `PUNSUBSCRIBE`, reading their replies) on this connection that
                    // stays in it; it holds nothing else (no message was queued).
                    std::mem::forget(ps);
                    r
                });
                stale |= self.take_pushes(shard);
                if let Err(e) = r {
                    if !e.is_timeout() {
                        broken.push(addr.clone());
                    }
                }
            }
            for addr in broken {
                if let Some(shard) = shards.remove(&addr) {
                    // Messages may have been missed: their waiters look once.
                    self.notify(&shard.channels);
                }
                stale = true;
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
