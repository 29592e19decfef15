//! The lease renewer: one thread, with its own connection, that renews every running
//! lease of the store and flags the ones that were lost.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::conn::{Conn, Link};
use crate::lock;
use crate::pipeline::pipeline;
use crate::request::Request;
use crate::scripts::Scripts;

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
