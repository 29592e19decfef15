//! How the store reaches Redis: one node, a Redis Cluster, or the primary that a set of
//! Sentinels names. [`Topology`] opens connections; [`Con`] is one of them, and every
//! worker job, renewal and WAIT runs on a `Con` whatever the deployment.
//!
//! - A command or a script runs through [`redis::ConnectionLike`] (`Con` implements
//!   it): on a Cluster the redis crate routes it by its key to the slot's primary and
//!   follows MOVED / ASK (resharding, failover).
//! - `threads::pipeline` runs a batch of requests on a `Con`: one round trip on a
//!   node; one by one on a Cluster (each routed by its key).
//! - [`Con::wait_replicas`] sends `WAIT` to the primary that holds a key (on a Cluster
//!   `WAIT` without routing would go to every primary).
//! - [`is_not_primary`] tells a reply from a node that is no longer the primary
//!   (`READONLY`, `MASTERDOWN`): the connection is dropped and the next one is opened
//!   on the current primary (a Sentinel is asked again).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::cluster::{ClusterClient, ClusterConnection};
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{ConnectionInfo, ConnectionLike, RedisResult, Value};

/// Where the store's Redis is and how to open a connection to it.
#[derive(Clone)]
pub(crate) enum Topology {
    /// One Redis node (`redis://` or `rediss://`).
    Single(redis::Client),
    /// A Redis Cluster reached through one or more seed nodes.
    Cluster {
        client: ClusterClient,
        /// The seeds' settings, for the pub/sub connection.
        nodes: NodeClients,
    },
    /// The primary that the Sentinels name for a master, asked again on every new
    /// connection (so a failover is followed).
    Sentinel(Arc<Mutex<SentinelClient>>),
}

/// The seeds of a Cluster with their settings (auth, database, TLS) and the CA to trust.
#[derive(Clone)]
pub(crate) struct NodeClients {
    pub(crate) seeds: Vec<ConnectionInfo>,
    pub(crate) ca: Option<Vec<u8>>,
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
    /// A Cluster client on `seeds` (each already parsed, without the `CLIENT SETINFO`
    /// handshake), trusting `ca` for `rediss://`.
    pub(crate) fn cluster(
        seeds: Vec<ConnectionInfo>,
        ca: Option<Vec<u8>>,
        connect_timeout: Duration,
    ) -> RedisResult<Topology> {
        let mut builder = ClusterClient::builder(seeds.clone())
            .connection_timeout(connect_timeout)
            // A call's deadline is the store's I/O timeout: the crate's own retries
            // (MOVED, ASK, a node that went away) happen within it, not after it.
            .retries(3)
            .min_retry_wait(10)
            .max_retry_wait(200);
        if let Some(pem) = &ca {
            builder = builder.certs(redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(pem.clone()),
            });
        }
        Ok(Topology::Cluster {
            client: builder.build()?,
            nodes: NodeClients { seeds, ca },
        })
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
            Topology::Cluster { .. } => Ok(None),
            Topology::Sentinel(sentinel) => {
                let mut s = sentinel.lock().unwrap_or_else(|e| e.into_inner());
                s.get_client().map(Some)
            }
        }
    }

    /// A plain connection for pub/sub: to the node, to the Sentinels' primary, or to
    /// the first seed of a Cluster that answers (a Cluster forwards every `PUBLISH` to
    /// all its nodes, so one node hears the notifications of every slot).
    pub(crate) fn listen_connection(&self, timeout: Duration) -> RedisResult<redis::Connection> {
        match self {
            Topology::Cluster { nodes, .. } => {
                let mut last = None;
                for seed in &nodes.seeds {
                    match open_client(seed.clone(), nodes.ca.clone())
                        .and_then(|c| c.get_connection_with_timeout(timeout))
                    {
                        Ok(con) => return Ok(con),
                        Err(e) => last = Some(e),
                    }
                }
                Err(last.unwrap_or_else(|| {
                    redis::RedisError::from((redis::ErrorKind::InvalidClientConfig, "no seed"))
                }))
            }
            _ => {
                let Some(client) = self.node_client()? else {
                    unreachable!("a node client for one node or a Sentinel")
                };
                client.get_connection_with_timeout(timeout)
            }
        }
    }

    /// Opens a connection, within `timeout` per node reached.
    pub(crate) fn connect(&self, timeout: Duration) -> RedisResult<Con> {
        match self {
            Topology::Cluster { client, .. } => {
                Ok(Con::Cluster(Box::new(client.get_connection()?)))
            }
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
    /// A Cluster connection: commands are routed by key, MOVED / ASK followed.
    /// (Boxed: it is several times the size of a node connection.)
    Cluster(Box<ClusterConnection>),
}

impl Con {
    /// Sets the read and write timeouts of the socket(s).
    pub(crate) fn set_timeouts(&mut self, d: Duration) -> RedisResult<()> {
        match self {
            Con::Node(c) => {
                c.set_read_timeout(Some(d))?;
                c.set_write_timeout(Some(d))
            }
            Con::Cluster(c) => {
                c.set_read_timeout(Some(d))?;
                c.set_write_timeout(Some(d))
            }
        }
    }

    /// `WAIT n timeout` on the primary that holds `key`, after this connection's
    /// writes there: how many replicas acknowledged them.
    pub(crate) fn wait_replicas(
        &mut self,
        key: &str,
        n: usize,
        timeout: Duration,
    ) -> RedisResult<usize> {
        let ms = u64::try_from(timeout.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let mut wait = redis::cmd("WAIT");
        wait.arg(n).arg(ms);
        match self {
            Con::Node(c) => wait.query(c),
            Con::Cluster(c) => {
                use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
                let route = Route::with_key(key, SlotAddr::Master);
                let v = c.route_command(
                    &wait,
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route)),
                )?;
                Ok(redis::from_redis_value(v)?)
            }
        }
    }
}

impl ConnectionLike for Con {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<Value> {
        match self {
            Con::Node(c) => c.req_packed_command(cmd),
            Con::Cluster(c) => c.req_packed_command(cmd),
        }
    }
    fn req_packed_commands(
        &mut self,
        cmd: &[u8],
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        match self {
            Con::Node(c) => c.req_packed_commands(cmd, offset, count),
            Con::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }
    fn req_command(&mut self, cmd: &redis::Cmd) -> RedisResult<Value> {
        match self {
            Con::Node(c) => c.req_command(cmd),
            Con::Cluster(c) => c.req_command(cmd),
        }
    }
    fn get_db(&self) -> i64 {
        match self {
            Con::Node(c) => c.get_db(),
            Con::Cluster(c) => c.get_db(),
        }
    }
    fn supports_pipelining(&self) -> bool {
        match self {
            Con::Node(c) => c.supports_pipelining(),
            Con::Cluster(c) => c.supports_pipelining(),
        }
    }
    fn check_connection(&mut self) -> bool {
        match self {
            Con::Node(c) => c.check_connection(),
            Con::Cluster(c) => c.check_connection(),
        }
    }
    fn is_open(&self) -> bool {
        match self {
            Con::Node(c) => c.is_open(),
            Con::Cluster(c) => c.is_open(),
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
