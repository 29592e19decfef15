//! How the store reaches Redis: one node, a Redis Cluster, or the primary that a set of
//! Sentinels names. [`Topology`] opens connections; [`Con`] is one of them, and every
//! worker job, renewal and WAIT runs on a `Con` whatever the deployment.
//!
//! - `pipeline::pipeline` runs a batch of requests on a `Con`: one round trip on a
//!   node; on a Cluster one pipeline per node, each request routed by its key to its
//!   slot's primary, MOVED / ASK followed (see [`crate::cluster`]).
//! - `WAIT` goes on the connection that ran the writes: [`Con::wait_replicas`] on a
//!   node, [`ClusterCon::wait`] on a Cluster.
//! - [`is_not_primary`] tells a reply from a node that is no longer the primary
//!   (`READONLY`, `MASTERDOWN`): the connection is dropped and the next one is opened
//!   on the current primary (a Sentinel is asked again).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{ConnectionInfo, RedisResult};

use crate::cluster::ClusterCon;

/// Where the store's Redis is and how to open a connection to it.
#[derive(Clone)]
pub(crate) enum Topology {
    /// One Redis node (`redis://` or `rediss://`).
    Single(redis::Client),
    /// A Redis Cluster reached through one or more seed nodes (their settings are
    /// every node's).
    Cluster(NodeClients),
    /// The primary that the Sentinels name for a master, asked again on every new
    /// connection (so a failover is followed).
    Sentinel(Arc<Mutex<SentinelClient>>),
}

/// The seeds of a Cluster with their settings (auth, database, TLS) and the CA to trust.
#[derive(Clone)]
pub(crate) struct NodeClients {
    pub(crate) seeds: Vec<ConnectionInfo>,
    pub(crate) ca: Option<Vec<u8>>,
    /// The longest wait for one node's connection.
    pub(crate) connect_timeout: Duration,
    /// Nodes whose last read timed out, shared by every connection of the store: a
    /// connection opened while a node stalls asks it last too (see
    /// [`crate::cluster`]).
    pub(crate) slow: Arc<Mutex<HashSet<(String, u16)>>>,
}

/// A client for `info`, trusting only the CA certificate(s) in `ca` when given.
pub(crate) fn open_client(info: ConnectionInfo, ca: Option<Vec<u8>>) -> RedisResult<redis::Client> {
    match ca {
        None => redis::Client::open(info),
        Some(pem) => redis::Client::build_with_tls(
            info,
            redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(pem),
            },
        ),
    }
}

impl Topology {
    /// A Cluster on `seeds` (each already parsed, without the `CLIENT SETINFO`
    /// handshake), trusting `ca` for `rediss://`. Nothing is connected yet; a CA that
    /// cannot be read fails here.
    pub(crate) fn cluster(
        seeds: Vec<ConnectionInfo>,
        ca: Option<Vec<u8>>,
        connect_timeout: Duration,
    ) -> RedisResult<Topology> {
        if let Some(seed) = seeds.first() {
            open_client(seed.clone(), ca.clone())?;
        }
        Ok(Topology::Cluster(NodeClients {
            seeds,
            ca,
            connect_timeout,
            slow: Arc::default(),
        }))
    }

    /// A Sentinel-resolved primary: `sentinels` are the Sentinels' addresses, `master`
    /// the name they monitor it under; `node` gives the primary's auth and database.
    pub(crate) fn sentinel(
        sentinels: Vec<ConnectionInfo>,
        master: &str,
        node: &ConnectionInfo,
    ) -> RedisResult<Topology> {
        let info = SentinelNodeConnectionInfo::default()
            .set_redis_connection_info(node.redis_settings().clone());
        let client =
            SentinelClient::build(sentinels, master, Some(info), SentinelServerType::Master)?;
        Ok(Topology::Sentinel(Arc::new(Mutex::new(client))))
    }

    /// A plain client on the node to use now: the node itself, or the primary the
    /// Sentinels name. `None` for a Cluster (its nodes are reached through
    /// [`connect`](Self::connect) or [`NodeClients`]).
    pub(crate) fn node_client(&self) -> RedisResult<Option<redis::Client>> {
        match self {
            Topology::Single(client) => Ok(Some(client.clone())),
            Topology::Cluster(_) => Ok(None),
            Topology::Sentinel(sentinel) => {
                let mut s = sentinel.lock().unwrap_or_else(|e| e.into_inner());
                s.get_client().map(Some)
            }
        }
    }

    /// A plain connection for classic pub/sub: to the node, or to the Sentinels'
    /// primary. (A Cluster's listener subscribes per master, see
    /// `notifier::Notifier::sharded_session`.)
    pub(crate) fn listen_connection(&self, timeout: Duration) -> RedisResult<redis::Connection> {
        match self.node_client()? {
            Some(client) => client.get_connection_with_timeout(timeout),
            None => Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "a Cluster has no one pub/sub connection",
            ))),
        }
    }

    /// Opens a connection, within `timeout` per node reached.
    pub(crate) fn connect(&self, timeout: Duration) -> RedisResult<Con> {
        // A signal to the process (a child exiting: SIGCHLD) interrupts a blocking
        // connect (EINTR) without anything being wrong: connect again, within the time.
        let started = std::time::Instant::now();
        loop {
            match self.connect_once(timeout.saturating_sub(started.elapsed())) {
                Err(e) if interrupted(&e) && started.elapsed() < timeout => continue,
                r => return r,
            }
        }
    }

    fn connect_once(&self, timeout: Duration) -> RedisResult<Con> {
        match self {
            Topology::Cluster(nodes) => Ok(Con::Cluster(Box::new(ClusterCon::connect(
                nodes.clone(),
                nodes.connect_timeout,
                timeout,
            )?))),
            _ => {
                let Some(client) = self.node_client()? else {
                    unreachable!("a node client for one node or a Sentinel")
                };
                Ok(Con::Node(client.get_connection_with_timeout(timeout)?))
            }
        }
    }
}

/// One connection: to a node (one Redis, or the Sentinels' primary), or to a Cluster
/// (one connection per node it reached, opened as needed by the redis crate).
pub(crate) enum Con {
    /// A connection to one node.
    Node(redis::Connection),
    /// A Cluster connection: requests are routed by key, MOVED / ASK followed.
    /// (Boxed: it is several times the size of a node connection.)
    Cluster(Box<ClusterCon>),
}

impl Con {
    /// Sets the read and write timeouts of the socket(s).
    pub(crate) fn set_timeouts(&mut self, d: Duration) -> RedisResult<()> {
        match self {
            Con::Node(c) => {
                c.set_read_timeout(Some(d))?;
                c.set_write_timeout(Some(d))
            }
            Con::Cluster(c) => c.set_timeouts(d),
        }
    }

    /// `PING`, by `deadline` (on a Cluster, on one primary).
    pub(crate) fn ping(&mut self, deadline: std::time::Instant) -> RedisResult<()> {
        match self {
            Con::Node(c) => redis::cmd("PING").query::<String>(c).map(drop),
            Con::Cluster(c) => c.ping(deadline),
        }
    }

    /// `WAIT n timeout` on a node, after this connection's writes: how many replicas
    /// acknowledged them. (On a Cluster, see [`ClusterCon::wait`].)
    pub(crate) fn wait_replicas(&mut self, n: usize, timeout: Duration) -> RedisResult<usize> {
        let ms = u64::try_from(timeout.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        match self {
            Con::Node(c) => redis::cmd("WAIT").arg(n).arg(ms).query(c),
            Con::Cluster(_) => Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "WAIT on a Cluster goes to the node that ran the write",
            ))),
        }
    }
}

/// Whether `e` came from a node that is no longer the primary (demoted by a failover,
/// or cut from its primary): the connection is to be dropped and opened again.
pub(crate) fn is_not_primary(e: &redis::RedisError) -> bool {
    matches!(
        e.code(),
        Some("READONLY") | Some("MASTERDOWN") | Some("LOADING")
    )
}

/// A system call interrupted by a signal (EINTR), as the redis crate reports it.
pub(crate) fn interrupted(e: &redis::RedisError) -> bool {
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .is_some_and(|io| io.kind() == std::io::ErrorKind::Interrupted)
        // The crate may keep the I/O error only as text: EINTR is errno 4 on Linux.
        || e.to_string().contains("(os error 4)")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connect interrupted by a signal is told apart from a failed one (and retried).
    #[test]
    fn an_interrupted_connect_is_recognised() {
        let eintr = redis::RedisError::from(std::io::Error::from_raw_os_error(4));
        assert!(interrupted(&eintr), "{eintr}");
        let refused =
            redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(!interrupted(&refused), "{refused}");
    }
}
