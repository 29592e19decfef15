//! The pub/sub listener: one thread that wakes this process's waiters when a key they
//! wait on is completed or released.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use event_listener::Event;

use crate::conn::Link;
use crate::lock;

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
