//! The connection settings every thread shares ([`Link`]) and one lazily (re)opened
//! connection ([`Conn`]) that runs a call by its deadline.

use std::time::{Duration, Instant};

use oncely::Error;

use crate::request::Failure;
use crate::topology::{is_not_primary, Con, Topology};

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
pub(crate) fn left(deadline: Instant, io_timeout: Duration) -> Option<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero() && *d >= io_timeout / 10)
}

/// One lazily (re)opened connection. Any I/O error drops it; the next use reconnects.
pub(crate) struct Conn {
    pub(crate) link: Link,
    pub(crate) con: Option<Con>,
    /// The last [`run`](Self::run) sent again after an I/O error.
    pub(crate) resent: bool,
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
    /// retried once on a fresh connection. So is any connection whose read or write a
    /// signal interrupted (EINTR: a socket with a timeout is never restarted, and a
    /// child process exiting sends SIGCHLD): nothing is wrong with Redis. The command may still have been executed
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
                if (reused || crate::topology::interrupted(&e))
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

    pub(crate) fn run_once<T>(
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
