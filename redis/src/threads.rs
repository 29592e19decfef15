//! The store's own threads, which drive the redis crate's blocking client so that the
//! caller needs no async runtime: a small worker pool (results come back through
//! `futures-channel` oneshots), one lease renewer and one pub/sub listener.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use event_listener::Event;
use oncely::Error;

use crate::scripts::Scripts;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

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

/// Connection settings shared by every thread.
#[derive(Clone)]
pub(crate) struct Link {
    pub client: redis::Client,
    pub connect_timeout: Duration,
    pub io_timeout: Duration,
}

/// One lazily (re)opened connection. Any I/O error drops it; the next use reconnects.
pub(crate) struct Conn {
    link: Link,
    con: Option<redis::Connection>,
}

impl Conn {
    pub(crate) fn new(link: Link) -> Self {
        Conn { link, con: None }
    }

    /// Runs `f` on the connection, opening it first if needed. A connection that was
    /// opened before and fails with an I/O error (not a timeout) is stale — e.g. the
    /// server restarted since its last use, so the command never reached a server —
    /// and `f` is retried once on a fresh connection. Every script is safe to resend:
    /// each checks the lease token, and completing twice with one token is a success.
    pub(crate) fn run<T>(
        &mut self,
        mut f: impl FnMut(&mut redis::Connection) -> redis::RedisResult<T>,
    ) -> redis::RedisResult<T> {
        let reused = self.con.is_some();
        match self.run_once(&mut f) {
            Err(e) if reused && e.is_io_error() && !e.is_timeout() => self.run_once(&mut f),
            r => r,
        }
    }

    fn run_once<T>(
        &mut self,
        f: &mut impl FnMut(&mut redis::Connection) -> redis::RedisResult<T>,
    ) -> redis::RedisResult<T> {
        if self.con.is_none() {
            let con = self
                .link
                .client
                .get_connection_with_timeout(self.link.connect_timeout)?;
            con.set_read_timeout(Some(self.link.io_timeout))?;
            con.set_write_timeout(Some(self.link.io_timeout))?;
            self.con = Some(con);
        }
        let Some(con) = self.con.as_mut() else {
            unreachable!("connected above")
        };
        let r = f(con);
        if let Err(e) = &r {
            if e.is_io_error() || e.is_timeout() || e.is_unrecoverable_error() {
                self.con = None;
            }
        }
        r
    }
}

type Job = Box<dyn FnOnce(&mut Conn) + Send>;

/// A fixed pool of threads, each with its own connection, running jobs in order of
/// arrival. The threads end when the pool is dropped.
pub(crate) struct Pool {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
}

impl Pool {
    pub(crate) fn new(link: &Link, threads: usize) -> Self {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads {
            let rx = rx.clone();
            let mut conn = Conn::new(link.clone());
            std::thread::Builder::new()
                .name(format!("oncely-redis-{i}"))
                .spawn(move || loop {
                    let job = lock(&rx).recv();
                    match job {
                        Ok(job) => job(&mut conn),
                        Err(_) => return,
                    }
                })
                .expect("spawning an oncely-redis worker thread");
        }
        Pool {
            tx: Mutex::new(Some(tx)),
        }
    }

    /// Runs `f` on a worker; the future resolves with its result. Redis errors
    /// become UNAVAILABLE.
    pub(crate) fn call<T: Send + 'static>(
        &self,
        f: impl FnMut(&mut redis::Connection) -> redis::RedisResult<T> + Send + 'static,
    ) -> impl Future<Output = Result<T, Error>> {
        let (tx, rx) = futures_channel::oneshot::channel();
        let job: Job = Box::new(move |conn: &mut Conn| {
            let _ = tx.send(conn.run(f));
        });
        let sent = lock(&self.tx).as_ref().is_some_and(|s| s.send(job).is_ok());
        async move {
            if !sent {
                return Err(Error::Unavailable("the Redis store was shut down".into()));
            }
            match rx.await {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(e)) => Err(unavailable(&e)),
                Err(_) => Err(Error::Unavailable(
                    "a Redis worker thread stopped before answering".into(),
                )),
            }
        }
    }

    /// Like [`call`](Self::call), but when the caller stopped waiting (its future was
    /// dropped) before `f` finished, runs `undo` with `f`'s value on the same worker:
    /// a claim nobody will use is released at once instead of blocking the key for a
    /// lease.
    pub(crate) fn call_or_undo<T: Send + 'static>(
        &self,
        f: impl FnMut(&mut redis::Connection) -> redis::RedisResult<T> + Send + 'static,
        undo: impl FnOnce(&mut redis::Connection, T) -> redis::RedisResult<()> + Send + 'static,
    ) -> impl Future<Output = Result<T, Error>> {
        let (tx, rx) = futures_channel::oneshot::channel();
        let job: Job = Box::new(move |conn: &mut Conn| {
            if let Err(Ok(v)) = tx.send(conn.run(f)) {
                let mut undo = Some((undo, v));
                let _ = conn.run(|c| match undo.take() {
                    Some((undo, v)) => undo(c, v),
                    None => Ok(()),
                });
            }
        });
        let sent = lock(&self.tx).as_ref().is_some_and(|s| s.send(job).is_ok());
        async move {
            if !sent {
                return Err(Error::Unavailable("the Redis store was shut down".into()));
            }
            match rx.await {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(e)) => Err(unavailable(&e)),
                Err(_) => Err(Error::Unavailable(
                    "a Redis worker thread stopped before answering".into(),
                )),
            }
        }
    }

    /// Runs `f` on a worker without waiting for it (release after a panic or drop).
    pub(crate) fn spawn(
        &self,
        f: impl FnMut(&mut redis::Connection) -> redis::RedisResult<()> + Send + 'static,
    ) {
        let job: Job = Box::new(move |conn: &mut Conn| {
            let _ = conn.run(f);
        });
        if let Some(s) = lock(&self.tx).as_ref() {
            let _ = s.send(job);
        }
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
            for (id, key, token) in due {
                let r: redis::RedisResult<i64> =
                    conn.run(|c| scripts.renew.key(&key).arg(&token).arg(lease_ms).invoke(c));
                let mut st = lock(&self.state);
                match r {
                    Ok(1) => {
                        if let Some(l) = st.leases.get_mut(&id) {
                            l.due = Instant::now() + self.period();
                        }
                    }
                    Ok(_) => {
                        if let Some(l) = st.leases.remove(&id) {
                            l.lost.store(true, Ordering::Release);
                        }
                    }
                    // Redis unreachable: keep trying; when it returns in time the
                    // lease is kept, otherwise the complete script reports it lost.
                    Err(_) => {
                        if let Some(l) = st.leases.get_mut(&id) {
                            l.due =
                                Instant::now() + (self.period() / 4).max(Duration::from_millis(5));
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

impl Notifier {
    pub(crate) fn new(wake_channel: String) -> Arc<Self> {
        Arc::new(Notifier {
            state: Mutex::new(NotifyState::default()),
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
    }

    fn wake_all(&self) {
        for (_, e) in lock(&self.state).channels.values() {
            e.notify(usize::MAX);
        }
    }

    fn run(&self, link: Link) {
        loop {
            if lock(&self.state).shutdown {
                return;
            }
            let Ok(mut con) = link
                .client
                .get_connection_with_timeout(link.connect_timeout)
            else {
                // Waiters fall back to polling meanwhile.
                std::thread::sleep(Duration::from_millis(100));
                continue;
            };
            let mut ps = con.as_pubsub();
            if ps.set_read_timeout(Some(LISTEN_TICK)).is_err()
                || ps.subscribe(&self.wake_channel).is_err()
            {
                continue;
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
                    return;
                }
                let add: Vec<&String> = wanted.difference(&subscribed).collect();
                let remove: Vec<&String> = subscribed.difference(&wanted).collect();
                if (!add.is_empty() && ps.subscribe(&add).is_err())
                    || (!remove.is_empty() && ps.unsubscribe(&remove).is_err())
                {
                    break;
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
                match ps.get_message() {
                    Ok(msg) => {
                        let st = lock(&self.state);
                        if let Some((_, e)) = st.channels.get(msg.get_channel_name()) {
                            e.notify(usize::MAX);
                        }
                    }
                    Err(e) if e.is_timeout() => {}
                    Err(_) => break,
                }
            }
        }
    }
}
