//! # oncely-redis — the shared dedup store for a fleet of instances
//!
//! [`RedisStore`] implements [`oncely::DedupStore`] on Redis (6+ / Valkey), so
//! [`oncely::execute`] runs an action once per scoped key across every instance that
//! shares the Redis, with the same rules as the in-process
//! [`MemoryStore`](oncely::MemoryStore) (SPEC §6, multi-instance part):
//!
//! - one hash-tagged Redis key per scoped operation holding a versioned record
//!   (see the README for the format, which Python and Node read and write too);
//! - claim (with takeover of an expired lease), renew, complete and release are one
//!   Lua script each, checked against the lease token; lease deadlines come from
//!   Redis `TIME`;
//! - the leader's lease is renewed every lease/3 while its action runs; a leader that
//!   lost its lease gets [`Error::LeaseLost`] and writes nothing;
//! - waiters on other instances are woken by pub/sub, with polling under backoff as
//!   the fallback;
//! - Redis unreachable or slow → [`Error::Unavailable`] within about one I/O timeout
//!   (each call's deadline, waiting for a free connection included) and the action does
//!   not run;
//! - two tiers: an in-process single-flight sits in front, so N same-key callers in
//!   one process make one claim.
//!
//! Results are bytes (`Vec<u8>`), so instances in any language can replay them.
//!
//! No async runtime is needed: the redis crate's blocking client runs on the store's
//! own threads and results come back through `futures-channel`, so the futures run on
//! tokio, smol, async-std or `futures::executor` alike.
//!
//! ```no_run
//! use oncely::{IdempotencyKey, ScopedKey};
//! use oncely_redis::RedisStore;
//!
//! let store: RedisStore<std::io::Error> = RedisStore::builder("redis://127.0.0.1:6379")
//!     .prefix("shop")
//!     .build()
//!     .unwrap();
//! let key = ScopedKey::new("acme", "CreateOrder", &IdempotencyKey::random()).unwrap();
//! let fp = oncely::fingerprint(&serde_json::json!({"sku": "A1"})).unwrap();
//! let done = futures::executor::block_on(
//!     store.execute(&key, &fp, || async { Ok(b"order-1".to_vec()) }),
//! )
//! .unwrap();
//! assert_eq!(done.value, b"order-1");
//! ```
#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod cluster;
pub mod codec;
mod runtime;
mod scripts;
mod threads;
mod topology;

/// The README's example, compiled as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

use std::fmt;
use std::future::{poll_fn, Future};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use oncely::{
    Begin, DedupStore, Error, ExecuteError, ExecuteOptions, Executed, Join, Joined, LeaderLease,
    Lease, ScopedKey,
};

use runtime::{PerProcess, Runtime};
pub use scripts::RECORD_VERSION;
use scripts::{Claim, Got, Identity, Peek, Removal, Scripts};
use threads::{Acked, Failure, Link, Request};
use topology::Topology;

/// Locks a mutex, going on after a panic elsewhere: every critical section leaves its
/// state whole, so a poisoned lock holds nothing half-done.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Default lease: how long a claim lives without renewal (30 s).
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// Default key prefix.
pub const DEFAULT_PREFIX: &str = "oncely";
/// Default timeout for opening a connection (1 s).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Default deadline of one Redis call (1 s; a third of the lease when that is shorter).
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(1);
/// Default number of worker threads (each with one connection).
pub const DEFAULT_WORKERS: usize = 4;
/// Default first poll interval of a waiter when no notification comes (10 ms).
pub const DEFAULT_POLL_MIN: Duration = Duration::from_millis(10);
/// Default cap of a waiter's poll interval (500 ms).
pub const DEFAULT_POLL_MAX: Duration = Duration::from_millis(500);

/// Parses the URL into the client's settings. No `CLIENT SETINFO` handshake: opening a
/// connection then takes no extra round trip, so it stays within one timeout (each
/// handshake reply may wait a whole timeout).
fn connection_info(url: &str) -> Result<redis::ConnectionInfo, Error> {
    use redis::IntoConnectionInfo;
    let info = url
        .into_connection_info()
        .map_err(|e| Error::InvalidArgument {
            field: "url",
            reason: format!("{e}; {URL_FORM}"),
        })?;
    let settings = info.redis_settings().clone().set_skip_set_lib_name();
    Ok(info.set_redis_settings(settings))
}

/// Whether `url` asks for TLS (`rediss://`).
fn is_tls_url(url: &str) -> bool {
    url.get(..9)
        .is_some_and(|scheme| scheme.eq_ignore_ascii_case("rediss://"))
}

/// rustls needs a process-wide crypto provider: ring (the one this crate enables) is
/// installed unless the program already installed one.
fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Losing a race to another installer is fine: some provider is installed.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// The URL forms a store accepts, shown when a URL does not parse.
const URL_FORM: &str = "expected redis://host:6379/0 (with a password: \
                        redis://:password@host:6379/0; TLS: rediss://host:6380/0; a socket: \
                        redis+unix:///run/redis.sock)";

/// The scheme of a URL for a message (the rest may hold a password).
fn url_scheme(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, _)) => format!("a {scheme}:// URL"),
        None => "no scheme".to_owned(),
    }
}

/// The scheme of a Sentinel URL.
const SENTINEL_SCHEME: &str = "redis+sentinel://";

/// Splits `redis+sentinel://[user:password@]host:port[,host:port...]/master[/db]` into
/// the Sentinels' URLs, the master name and the primary's settings URL.
fn parse_sentinel_url(url: &str) -> Result<(Vec<String>, String, String), Error> {
    let invalid = |reason: &str| {
        Error::InvalidArgument {
        field: "url",
        reason: format!(
            "{reason}: expected {SENTINEL_SCHEME}[user:password@]host:port[,host:port...]/master[/db]"
        ),
    }
    };
    let rest = &url[SENTINEL_SCHEME.len()..];
    let (authority, path) = rest
        .split_once('/')
        .ok_or_else(|| invalid("no master name"))?;
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    let (master, db) = match path.split_once('/') {
        Some((m, d)) => (m, Some(d)),
        None => (path, None),
    };
    if master.is_empty() {
        return Err(invalid("no master name"));
    }
    let sentinels: Vec<String> = hosts
        .split(',')
        .filter(|h| !h.is_empty())
        .map(|h| format!("redis://{h}"))
        .collect();
    if sentinels.is_empty() {
        return Err(invalid("no Sentinel address"));
    }
    // The primary's user, password and database (its address comes from the Sentinels).
    let node = format!(
        "redis://{}127.0.0.1/{}",
        userinfo.map(|u| format!("{u}@")).unwrap_or_default(),
        db.unwrap_or("0")
    );
    Ok((sentinels, master.to_owned(), node))
}

/// How the configured store reaches Redis (checks the URLs and the CA file).
fn topology_of(config: &Config) -> Result<Topology, Error> {
    let n = &config.naming;
    let url_error = |e: redis::RedisError| Error::InvalidArgument {
        field: n.field("url"),
        reason: format!("{e}; {URL_FORM}"),
    };
    let sentinel_url = config
        .url
        .get(..SENTINEL_SCHEME.len())
        .is_some_and(|s| s.eq_ignore_ascii_case(SENTINEL_SCHEME));
    let sentinel = sentinel_url || config.sentinel_master.is_some();
    if config.cluster && sentinel {
        return Err(Error::InvalidArgument {
            field: n.field("cluster"),
            reason: "a Cluster has no Sentinels: use one or the other".into(),
        });
    }
    if !config.seeds.is_empty() && !config.cluster && config.sentinel_master.is_none() {
        return Err(Error::InvalidArgument {
            field: n.field("seeds"),
            reason: "more addresses are for a Cluster (cluster) or Sentinels (sentinel)".into(),
        });
    }
    let urls: Vec<&str> = std::iter::once(config.url.as_str())
        .chain(config.seeds.iter().map(String::as_str))
        .collect();
    let tls = urls.iter().any(|u| is_tls_url(u));
    let ca = match &config.tls_ca_file {
        None => None,
        Some(path) => {
            let invalid = |reason: String| Error::InvalidArgument {
                field: "tls_ca_file",
                reason,
            };
            if let Some(plain) = urls.iter().find(|u| !is_tls_url(u)) {
                return Err(invalid(format!(
                    "needs a rediss:// URL, e.g. rediss://host:6380/0, got {}",
                    url_scheme(plain)
                )));
            }
            Some(
                std::fs::read(path)
                    .map_err(|e| invalid(format!("cannot read {}: {e}", path.display())))?,
            )
        }
    };
    if tls {
        install_crypto_provider();
    }
    if sentinel {
        if tls {
            return Err(Error::InvalidArgument {
                field: n.field("url"),
                reason: "TLS to Sentinels and their primary is not supported".into(),
            });
        }
        let (sentinels, master, node) = if sentinel_url {
            if config.sentinel_master.is_some() || !config.seeds.is_empty() {
                return Err(Error::InvalidArgument {
                    field: n.field("sentinel"),
                    reason: "a redis+sentinel:// URL already names the Sentinels and the master"
                        .into(),
                });
            }
            parse_sentinel_url(&config.url)?
        } else {
            let master = config.sentinel_master.clone().unwrap_or_default();
            // The URLs' user, password and database are the primary's.
            (
                urls.iter()
                    .map(|u| {
                        let info = connection_info(u)?;
                        Ok(format!("redis://{}", info.addr()))
                    })
                    .collect::<Result<Vec<_>, Error>>()?,
                master,
                config.url.clone(),
            )
        };
        let sentinels = sentinels
            .iter()
            .map(|u| connection_info(u))
            .collect::<Result<Vec<_>, _>>()?;
        return Topology::sentinel(sentinels, &master, &connection_info(&node)?).map_err(url_error);
    }
    if config.cluster {
        let seeds = urls
            .iter()
            .map(|u| connection_info(u))
            .collect::<Result<Vec<_>, _>>()?;
        return Topology::cluster(seeds, ca, config.connect_timeout).map_err(|e| {
            match &config.tls_ca_file {
                Some(path) if ca_error(&e) => Error::InvalidArgument {
                    field: "tls_ca_file",
                    reason: format!("{}: {e}", path.display()),
                },
                _ => url_error(e),
            }
        });
    }
    let info = connection_info(&config.url)?;
    match (&config.tls_ca_file, ca) {
        (Some(path), Some(pem)) => topology::open_client(info, Some(pem))
            .map(Topology::Single)
            .map_err(|e| Error::InvalidArgument {
                field: "tls_ca_file",
                reason: format!("{}: {e}", path.display()),
            }),
        _ => redis::Client::open(info)
            .map(Topology::Single)
            .map_err(url_error),
    }
}

/// Whether building a client failed on its TLS certificates.
fn ca_error(e: &redis::RedisError) -> bool {
    e.kind() == redis::ErrorKind::InvalidClientConfig
}

/// Builds a [`RedisStore`]; see [`RedisStore::builder`].
pub struct RedisStoreBuilder<E> {
    config: Config,
    error: std::marker::PhantomData<fn() -> E>,
}

impl<E> fmt::Debug for RedisStoreBuilder<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.config.fmt(f)
    }
}

impl<E> Clone for RedisStoreBuilder<E> {
    fn clone(&self) -> Self {
        RedisStoreBuilder {
            config: self.config.clone(),
            error: std::marker::PhantomData,
        }
    }
}

#[derive(Clone)]
struct Config {
    url: String,
    prefix: String,
    lease: Duration,
    ttl: Duration,
    connect_timeout: Duration,
    /// `None`: [`DEFAULT_IO_TIMEOUT`], or a third of a shorter lease.
    io_timeout: Option<Duration>,
    workers: usize,
    poll_min: Duration,
    poll_max: Duration,
    in_progress_retry_after: Duration,
    tls_ca_file: Option<PathBuf>,
    naming: oncely::Naming,
    /// More seed nodes of a Cluster, or more Sentinels (`url` is the first).
    seeds: Vec<String>,
    cluster: bool,
    /// The master name the Sentinels at `url` and `seeds` monitor.
    sentinel_master: Option<String>,
    /// Replicas that must acknowledge a claim and a completion (`WAIT`), and how long
    /// to wait for them.
    min_replicas: usize,
    /// `None`: half the I/O timeout.
    min_replicas_timeout: Option<Duration>,
    connect_now: bool,
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The URL may hold a password: not shown.
        f.debug_struct("RedisStoreBuilder")
            .field("prefix", &self.prefix)
            .field("lease", &self.lease)
            .field("ttl", &self.ttl)
            .field("connect_timeout", &self.connect_timeout)
            .field("io_timeout", &self.io_timeout())
            .field("workers", &self.workers)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("cluster", &self.cluster)
            .field("sentinel_master", &self.sentinel_master)
            .field("min_replicas", &self.min_replicas)
            .field("min_replicas_timeout", &self.min_replicas_timeout())
            .finish_non_exhaustive()
    }
}

impl Config {
    fn io_timeout(&self) -> Duration {
        self.io_timeout
            .unwrap_or_else(|| DEFAULT_IO_TIMEOUT.min(self.lease / 3))
    }
    fn min_replicas_timeout(&self) -> Duration {
        self.min_replicas_timeout
            .unwrap_or_else(|| self.io_timeout() / 2)
    }
}

impl<E> RedisStoreBuilder<E> {
    /// The key prefix (default `"oncely"`): records live at `{<prefix>:<scoped key>}`.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.config.prefix = prefix.into();
        self
    }
    /// The lease (default 30 s): a leader that stops renewing (crashed, paused) loses
    /// its claim after this long and one waiter takes over. Renewed every lease/3.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config.lease = lease;
        self
    }
    /// How long a completed result is kept (default 24 h; must exceed the longest
    /// retry window of the clients).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.config.ttl = ttl;
        self
    }
    /// Timeout for opening a connection (default 1 s).
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.config.connect_timeout = d;
        self
    }
    /// The deadline of one call (default 1 s, or a third of the lease when that is
    /// shorter): waiting for a free worker, connecting and the reply together; past it
    /// the call fails with UNAVAILABLE. A call that could not be sent in time (every
    /// worker busy with a slow Redis) is failed without being sent. The lease must be
    /// at least 3 × this, so that a renewal that times out can be retried before the
    /// lease runs out.
    pub fn io_timeout(mut self, d: Duration) -> Self {
        self.config.io_timeout = Some(d);
        self
    }
    /// Worker threads, each with one connection (default 4).
    pub fn workers(mut self, n: usize) -> Self {
        self.config.workers = n;
        self
    }
    /// Poll interval bounds of a waiter on another instance, used when no
    /// notification arrives (defaults 10 ms doubling up to 500 ms).
    pub fn poll_interval(mut self, min: Duration, max: Duration) -> Self {
        self.config.poll_min = min;
        self.config.poll_max = max;
        self
    }
    /// The retry-after hint given to no-wait callers that find a call in progress
    /// (default 1 s).
    pub fn in_progress_retry_after(mut self, d: Duration) -> Self {
        self.config.in_progress_retry_after = d;
        self
    }

    /// Trusts the CA certificate(s) in this PEM file for a `rediss://` URL, for a
    /// private deployment whose server certificate is signed by its own CA.
    ///
    /// The file is read by [`build`](Self::build) (an unreadable or invalid file, or a
    /// URL that is not `rediss://`, is [`Error::InvalidArgument`] with field
    /// `"tls_ca_file"`). It replaces the default roots: with it, only the CA(s) in the
    /// file are trusted; without it, `rediss://` trusts the public web PKI roots
    /// (Mozilla's, built in). The server name in the URL must match the certificate
    /// (a host name or an IP address in its subject alternative names). A server whose
    /// certificate is not trusted makes every call fail with UNAVAILABLE.
    pub fn tls_ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.config.tls_ca_file = Some(path.into());
        self
    }

    /// Names the settings and durations in [`build`](Self::build)'s errors as the
    /// caller does (a binding's option names and unit); default
    /// [`Naming::RUST`](oncely::Naming::RUST).
    pub fn naming(mut self, naming: oncely::Naming) -> Self {
        self.config.naming = naming;
        self
    }

    /// Connects to a Redis Cluster (default: one node). The URL given to
    /// [`RedisStore::builder`] is a seed node, and [`seeds`](Self::seeds) adds more; the
    /// store learns the slots from them and follows them as they move (MOVED / ASK:
    /// resharding, a primary that failed over). A record's key and its notification
    /// channel hash to one slot (the hash tag `{<prefix>:<scoped key>}`), so every
    /// script runs on one node.
    pub fn cluster(mut self, on: bool) -> Self {
        self.config.cluster = on;
        self
    }

    /// More addresses (URLs) besides the first: seed nodes of a Cluster, or Sentinels
    /// (with [`sentinel`](Self::sentinel)). With neither, [`build`](Self::build)
    /// refuses them (field `"seeds"`).
    pub fn seeds<S: Into<String>>(mut self, urls: impl IntoIterator<Item = S>) -> Self {
        self.config.seeds = urls.into_iter().map(Into::into).collect();
        self
    }

    /// Connects to the primary that the Sentinels at the URL (and the
    /// [`seeds`](Self::seeds)) monitor under the name `master`. The URL's user,
    /// password and database are the primary's; the Sentinels are reached without
    /// them. The same as a `redis+sentinel://[user:password@]host:port[,host:port...]/master[/db]`
    /// URL. Every new connection asks the Sentinels again, and a connection whose node
    /// answers as a replica (`READONLY`) is dropped, so the store follows a failover on
    /// its own; during one, calls get UNAVAILABLE and no action runs without a claim.
    pub fn sentinel(mut self, master: impl Into<String>) -> Self {
        self.config.sentinel_master = Some(master.into());
        self
    }

    /// Durability chosen per store: every claim and every completion is followed by
    /// `WAIT n timeout` on the primary that holds the record, so that it is on `n`
    /// replicas before the caller goes on (default 0: no WAIT). A claim that fewer
    /// replicas acknowledged is released and the caller gets UNAVAILABLE (the action
    /// has not run); a completion that fewer acknowledged is still returned as stored
    /// (the action ran), counted in [`RedisCounters::completions_unreplicated`] and
    /// logged (`log` crate, warn). The timeout is
    /// [`min_replicas_timeout`](Self::min_replicas_timeout).
    pub fn min_replicas(mut self, n: usize) -> Self {
        self.config.min_replicas = n;
        self
    }

    /// How long `WAIT` waits for the replicas of [`min_replicas`](Self::min_replicas)
    /// (default half the I/O timeout; it must be below the I/O timeout, as WAIT runs
    /// within the call's deadline).
    pub fn min_replicas_timeout(mut self, d: Duration) -> Self {
        self.config.min_replicas_timeout = Some(d);
        self
    }

    /// Connect when the store is built: [`build`](Self::build) then opens a
    /// connection and sends `PING` (within the connect and I/O timeouts), so a wrong
    /// URL, password or TLS setting, or an unreachable Redis, fails at startup with
    /// [`Error::Unavailable`] instead of at the first request. Off by default.
    pub fn connect_now(mut self, yes: bool) -> Self {
        self.config.connect_now = yes;
        self
    }

    /// Makes the store. Checks the settings and the URL; does not connect unless
    /// [`connect_now`](Self::connect_now) is set (otherwise an unreachable Redis shows
    /// as UNAVAILABLE on use).
    pub fn build(self) -> Result<RedisStore<E>, Error> {
        let config = self.config;
        let n = &config.naming;
        let positive = |field: &'static str, d: Duration, example: Duration| {
            if d.is_zero() {
                Err(Error::InvalidArgument {
                    field: n.field(field),
                    reason: format!(
                        "must be greater than {}, e.g. {}, got {}",
                        n.duration(Duration::ZERO),
                        n.value(example),
                        n.value(d)
                    ),
                })
            } else {
                Ok(())
            }
        };
        positive("ttl", config.ttl, oncely::DEFAULT_TTL)?;
        positive(
            "connect_timeout",
            config.connect_timeout,
            DEFAULT_CONNECT_TIMEOUT,
        )?;
        let least = Duration::from_millis(30);
        if config.lease < least {
            return Err(Error::InvalidArgument {
                field: n.field("lease"),
                reason: format!(
                    "must be at least {}, e.g. {}, got {}",
                    n.duration(least),
                    n.value(DEFAULT_LEASE),
                    n.value(config.lease)
                ),
            });
        }
        let io_timeout = config.io_timeout();
        positive("io_timeout", io_timeout, DEFAULT_IO_TIMEOUT)?;
        positive("poll_interval", config.poll_min, DEFAULT_POLL_MIN)?;
        if config.lease < io_timeout * 3 {
            return Err(Error::InvalidArgument {
                field: n.field("lease"),
                reason: format!(
                    "must be at least 3 × {} ({}), got {}: a renewal that times out must \
                     leave time for another before the lease runs out (raise {} or lower {})",
                    n.field("io_timeout"),
                    n.duration(io_timeout),
                    n.value(config.lease),
                    n.field("lease"),
                    n.field("io_timeout"),
                ),
            });
        }
        if config.poll_max < config.poll_min {
            return Err(Error::InvalidArgument {
                field: n.field("poll_interval"),
                reason: format!(
                    "max must not be below min (min {}, max {})",
                    n.duration(config.poll_min),
                    n.value(config.poll_max)
                ),
            });
        }
        if config.workers == 0 {
            return Err(Error::InvalidArgument {
                field: n.field("workers"),
                reason: format!("must be at least 1, e.g. {DEFAULT_WORKERS}, got 0"),
            });
        }
        if config.prefix.is_empty() || config.prefix.contains(['{', '}']) {
            return Err(Error::InvalidArgument {
                field: n.field("prefix"),
                reason: format!(
                    "must be non-empty and contain no '{{' or '}}', e.g. \"oncely\", got {:?}",
                    config.prefix
                ),
            });
        }
        positive(
            "min_replicas_timeout",
            config.min_replicas_timeout(),
            io_timeout / 2,
        )?;
        if config.min_replicas > 0 && config.min_replicas_timeout() >= io_timeout {
            return Err(Error::InvalidArgument {
                field: n.field("min_replicas"),
                reason: format!(
                    "{} ({}) must be below {} ({}): WAIT runs within the call's deadline",
                    n.field("min_replicas_timeout"),
                    n.duration(config.min_replicas_timeout()),
                    n.field("io_timeout"),
                    n.duration(io_timeout),
                ),
            });
        }
        let topology = topology_of(&config)?;
        let link = Link {
            topology,
            connect_timeout: config.connect_timeout,
            io_timeout,
            min_replicas: config.min_replicas,
            min_replicas_timeout: config.min_replicas_timeout(),
        };
        if config.connect_now {
            link.check()?;
        }
        let runtime = {
            let (link, c) = (link.clone(), config.clone());
            PerProcess::new(move || {
                Runtime::new(
                    &link,
                    c.workers,
                    c.lease,
                    &c.prefix,
                    c.in_progress_retry_after,
                )
            })?
        };
        // The state lives in Redis: every instance on one URL and prefix shares it.
        let identity = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (config.url.as_str(), &config.seeds, config.prefix.as_str()).hash(&mut h);
            h.finish() as usize
        };
        Ok(RedisStore {
            inner: Arc::new(Inner {
                identity,
                runtime,
                scripts: Arc::new(Scripts::new()),
                link,
                counters: AtomicCounters::default(),
                config,
            }),
        })
    }
}

/// The shared dedup store on Redis: [`oncely::DedupStore`] for `Vec<u8>` results.
///
/// `E` is the action's error type; it never leaves the process (errors are not
/// stored in Redis: a failed leader releases its claim and a waiter on another
/// instance then runs its own action). Clones share one store (threads, connections
/// and the in-process tier).
pub struct RedisStore<E> {
    inner: Arc<Inner<E>>,
}

impl<E> Clone for RedisStore<E> {
    fn clone(&self) -> Self {
        RedisStore {
            inner: self.inner.clone(),
        }
    }
}

/// Counts of what one [`RedisStore`] instance has done since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RedisCounters {
    /// Claim scripts run (one per key per process at a time, thanks to the in-process
    /// tier).
    pub claims: u64,
    /// Claims that made this instance the leader (takeovers included).
    pub leads: u64,
    /// Leads that took over an expired lease (generation > 1).
    pub takeovers: u64,
    /// Claims answered with a stored result.
    pub replays: u64,
    /// Claims that found a leader on another instance and waited for it.
    pub remote_waits: u64,
    /// Leaders that found their lease taken over when completing.
    pub leases_lost: u64,
    /// Claims released and answered UNAVAILABLE because fewer replicas than
    /// [`min_replicas`](RedisStoreBuilder::min_replicas) acknowledged them.
    pub claims_unreplicated: u64,
    /// Completions stored on the primary that fewer replicas than
    /// [`min_replicas`](RedisStoreBuilder::min_replicas) acknowledged in time (the
    /// action ran; a failover now could lose the result).
    pub completions_unreplicated: u64,
    /// Calls of this store that failed with [`Error::Unavailable`] (Redis unreachable,
    /// slow or failing: claims, completions, [`get`](RedisStore::get),
    /// [`remove`](RedisStore::remove), [`ping`](RedisStore::ping)).
    pub unavailable: u64,
}

/// A record as stored in Redis, read by [`RedisStore::get`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisRecord {
    /// The request fingerprint the record was claimed with.
    pub fingerprint: String,
    /// 1 for the first claim, +1 for each takeover.
    pub generation: u64,
    /// Running or done.
    pub state: RecordState,
}

/// The state of a [`RedisRecord`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordState {
    /// A leader holds (or held) the claim. `lease_left` is zero when its lease ran
    /// out: the leader is gone and the next claim takes over.
    Running {
        /// Time left on the leader's lease (by Redis' clock).
        lease_left: Duration,
    },
    /// Completed: the stored result, replayed to every later call.
    Done {
        /// The result bytes (see the README's result encoding).
        value: Vec<u8>,
    },
}

#[derive(Default)]
struct AtomicCounters {
    claims: AtomicU64,
    leads: AtomicU64,
    takeovers: AtomicU64,
    replays: AtomicU64,
    remote_waits: AtomicU64,
    leases_lost: AtomicU64,
    claims_unreplicated: AtomicU64,
    completions_unreplicated: AtomicU64,
    unavailable: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

struct Inner<E> {
    /// [`DedupStore::identity`]: the same for every instance on one URL and prefix.
    identity: usize,
    counters: AtomicCounters,
    config: Config,
    link: Link,
    /// Threads and the in-process tier, made again in a child after `fork()`.
    runtime: PerProcess<E>,
    scripts: Arc<Scripts>,
}

/// What a completion did.
enum Completed {
    /// Stored (and acknowledged by the replicas wanted, if any).
    Stored,
    /// Stored on the primary, but fewer replicas than wanted acknowledged it.
    Unreplicated(String),
    /// The lease was taken over: nothing written.
    Lost,
}

impl From<i64> for Completed {
    fn from(script_reply: i64) -> Self {
        if script_reply == 1 {
            Completed::Stored
        } else {
            Completed::Lost
        }
    }
}

/// The release script's call: 1 deleted, 0 not ours (left alone).
fn release(scripts: &Scripts, record: &str, token: &str) -> Request {
    scripts.release.on(record).arg(token).arg(channel(record))
}

/// The notification channel of a record.
fn channel(record_key: &str) -> String {
    format!("{record_key}:done")
}

/// Deletes `record` if `token` still holds it, without waiting, on `rt`'s workers.
fn release_in_background<E>(
    rt: &Runtime<E>,
    scripts: &Arc<Scripts>,
    record: String,
    token: String,
) {
    if !rt.is_current() {
        return; // a copy left by fork(): the claim stays the parent's
    }
    rt.pool.spawn(release(scripts, &record, &token));
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl<E> Inner<E> {
    fn record_key(&self, key: &ScopedKey) -> String {
        format!("{{{}:{}}}", self.config.prefix, key.as_str())
    }
    fn channel(record_key: &str) -> String {
        channel(record_key)
    }
    fn version_error(v: &str) -> Error {
        Error::Unavailable(format!(
            "the Redis record has format version {v:?}; this oncely-redis reads version \
             {RECORD_VERSION} (upgrade every instance to one version)"
        ))
    }
}

impl<E> RedisStore<E> {
    /// A builder for `url` (`redis://[user:password@]host:port/db`, or `rediss://...`
    /// for TLS, see [`RedisStoreBuilder::tls_ca_file`]), with the defaults: prefix
    /// `"oncely"`, lease 30 s, TTL 24 h, 1 s timeouts (the I/O timeout is a third of a
    /// lease shorter than 3 s), 4 workers.
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder<E> {
        RedisStoreBuilder {
            error: std::marker::PhantomData,
            config: Config {
                url: url.into(),
                prefix: DEFAULT_PREFIX.into(),
                lease: DEFAULT_LEASE,
                ttl: oncely::DEFAULT_TTL,
                connect_timeout: DEFAULT_CONNECT_TIMEOUT,
                io_timeout: None,
                workers: DEFAULT_WORKERS,
                poll_min: DEFAULT_POLL_MIN,
                poll_max: DEFAULT_POLL_MAX,
                in_progress_retry_after: oncely::DEFAULT_IN_PROGRESS_RETRY_AFTER,
                tls_ca_file: None,
                naming: oncely::Naming::RUST,
                seeds: Vec::new(),
                cluster: false,
                sentinel_master: None,
                min_replicas: 0,
                min_replicas_timeout: None,
                connect_now: false,
            },
        }
    }
}

impl<E: Send + Sync + 'static> RedisStore<E> {
    /// A store on `url` with the defaults (see [`RedisStore::builder`]).
    pub fn new(url: impl Into<String>) -> Result<Self, Error> {
        RedisStore::builder(url).build()
    }

    /// The Redis key holding `key`'s record: `{<prefix>:<scoped key>}`.
    pub fn record_key(&self, key: &ScopedKey) -> String {
        self.inner.record_key(key)
    }

    /// The lease of this store's claims.
    pub fn lease(&self) -> Duration {
        self.inner.config.lease
    }

    /// How long completed results are kept.
    pub fn ttl(&self) -> Duration {
        self.inner.config.ttl
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.inner.config.prefix
    }

    /// What this store (this process's instance) has done so far.
    pub fn counters(&self) -> RedisCounters {
        let c = &self.inner.counters;
        RedisCounters {
            claims: c.claims.load(Ordering::Relaxed),
            leads: c.leads.load(Ordering::Relaxed),
            takeovers: c.takeovers.load(Ordering::Relaxed),
            replays: c.replays.load(Ordering::Relaxed),
            remote_waits: c.remote_waits.load(Ordering::Relaxed),
            leases_lost: c.leases_lost.load(Ordering::Relaxed),
            claims_unreplicated: c.claims_unreplicated.load(Ordering::Relaxed),
            completions_unreplicated: c.completions_unreplicated.load(Ordering::Relaxed),
            unavailable: c.unavailable.load(Ordering::Relaxed),
        }
    }

    /// Counts an UNAVAILABLE answer in [`RedisCounters::unavailable`].
    fn counted<T>(&self, r: Result<T, Error>) -> Result<T, Error> {
        if let Err(Error::Unavailable(_)) = &r {
            bump(&self.inner.counters.unavailable);
        }
        r
    }

    /// Reads `key`'s record from Redis, for an operator (None when there is none).
    /// Records of another format version are [`Error::Unavailable`], as in a claim. A
    /// hash at the key without a `state` field (foreign or damaged data) is not a
    /// record: None, as a claim sees it (and takes it over).
    pub async fn get(&self, key: &ScopedKey) -> Result<Option<RedisRecord>, Error> {
        let rt = self.inner.runtime.get()?;
        let record = self.inner.record_key(key);
        let got = rt
            .pool
            .call::<Got>(self.inner.scripts.get.on(&record))
            .await;
        Ok(match self.counted(got)? {
            Got::Absent => None,
            Got::Version(v) => return Err(Inner::<E>::version_error(&v)),
            Got::Record {
                done,
                fingerprint,
                generation,
                result,
                left_ms,
            } => Some(RedisRecord {
                fingerprint,
                generation,
                state: if done {
                    RecordState::Done { value: result }
                } else {
                    RecordState::Running {
                        lease_left: Duration::from_millis(left_ms),
                    }
                },
            }),
        })
    }

    /// Deletes `key`'s record, for an operator (a bad stored result, a record in the
    /// way): the next call runs the action again. Returns whether one was deleted.
    ///
    /// A running record whose lease is live is left alone (false): its leader may
    /// still be running the action, and deleting its claim would let a second
    /// leader run it at the same time. Once that lease runs out (the leader is gone)
    /// the record can be removed; a leader that is only slow then finds its claim
    /// gone when completing and stores nothing ([`Error::LeaseLost`]). Waiters on
    /// other instances are woken and claim again. Records of another format version
    /// are [`Error::Unavailable`] and left alone; a hash without a `state` field (not
    /// a record, see [`get`](Self::get)) is deleted.
    ///
    /// It takes two steps: the record's identity (the lease token of the claim that
    /// wrote it) is read, then the record is deleted only if it still has that token.
    /// The deletion may be sent again after a lost reply; the resend finds the record
    /// gone (true: this call deleted it, or another did at the same moment) or a
    /// record a new claim made since, which it leaves alone (false).
    pub async fn remove(&self, key: &ScopedKey) -> Result<bool, Error> {
        let rt = self.inner.runtime.get()?;
        let record = self.inner.record_key(key);
        let scripts = &self.inner.scripts;
        let identity = rt.pool.call::<Identity>(scripts.identify.on(&record)).await;
        let token = match self.counted(identity)? {
            Identity::Absent => return Ok(false),
            Identity::Version(v) => return Err(Inner::<E>::version_error(&v)),
            Identity::Token(token) => token,
        };
        let removed = rt
            .pool
            .call::<Removal>(
                scripts
                    .remove
                    .on(&record)
                    .arg(Inner::<E>::channel(&record))
                    .arg(token),
            )
            .await;
        match self.counted(removed)? {
            Removal::Deleted | Removal::Absent => Ok(true),
            Removal::Other | Removal::Running => Ok(false),
            Removal::Version(v) => Err(Inner::<E>::version_error(&v)),
        }
    }

    /// Checks that Redis answers (a `PING` through the store's workers, within the I/O
    /// timeout): a health check. [`Error::Unavailable`] when it does not.
    pub async fn ping(&self) -> Result<(), Error> {
        let rt = self.inner.runtime.get()?;
        let pong = rt.pool.call::<String>(Request::command("PING")).await;
        self.counted(pong).map(drop)
    }

    /// Looks `key` up, first in this process, then in Redis, and leads, joins or
    /// replays (SPEC §6) — the primitive [`execute`](Self::execute) drives.
    pub async fn begin(
        &self,
        key: &ScopedKey,
        fingerprint: &str,
        options: ExecuteOptions,
    ) -> Result<Begin<Vec<u8>, E, RedisLease<E>, RedisJoin<E>>, Error> {
        let inner = &self.inner;
        let rt = inner.runtime.get()?;
        // Tier 1: the in-process single-flight.
        let local = match rt.local.begin(key, fingerprint, options)? {
            Begin::Lead(lease) => lease,
            Begin::Join(join) => return Ok(Begin::Join(RedisJoin::Local(join))),
            Begin::Replay(r) => return Ok(Begin::Replay(r)),
        };
        // Tier 2: this process's one claim in Redis.
        let record = inner.record_key(key);
        let token = oncely::IdempotencyKey::random().as_str().to_owned();
        let sent = Instant::now();
        let claim = {
            let lease_ms = millis(inner.config.lease);
            let ttl_ms = millis(inner.config.ttl).max(lease_ms.saturating_mul(2));
            let request = inner
                .scripts
                .claim
                .on(&record)
                .arg(fingerprint)
                .arg(&token)
                .arg(lease_ms)
                .arg(ttl_ms)
                .replicated(scripts::claim_led);
            let (undo_scripts, undo_record, undo_token) =
                (inner.scripts.clone(), record.clone(), token.clone());
            let (later_rt, later_scripts, later_record, later_token) = (
                rt.clone(),
                inner.scripts.clone(),
                record.clone(),
                token.clone(),
            );
            let (lost_rt, lost_scripts, lost_record, lost_token) = (
                rt.clone(),
                inner.scripts.clone(),
                record.clone(),
                token.clone(),
            );
            let min_replicas = inner.config.min_replicas;
            let (wait_scripts, wait_record, wait_token) =
                (inner.scripts.clone(), record.clone(), token.clone());
            rt.pool.call_or_undo(
                request,
                // A claim that led but that fewer replicas than wanted acknowledged (a
                // failover now could lose it and let another caller run the action
                // too) is given back before anything ran.
                move |claim: Claim, acked: Acked| match (claim, acked) {
                    (Claim::Lead { .. }, Some(Ok(n))) if n < min_replicas => (
                        Ok(Claim::Unreplicated {
                            acked: n,
                            wanted: min_replicas,
                        }),
                        Some(release(&wait_scripts, &wait_record, &wait_token)),
                    ),
                    (Claim::Lead { .. }, Some(Err(e))) => (
                        Err(Failure::Redis(e)),
                        Some(release(&wait_scripts, &wait_record, &wait_token)),
                    ),
                    (claim, _) => (Ok(claim), None),
                },
                // The caller went away while claiming: release what it won.
                move |claim: &Claim| match claim {
                    Claim::Lead { .. } => Some(release(&undo_scripts, &undo_record, &undo_token)),
                    _ => None,
                },
                // The caller went away after the answer came, before reading it.
                move |claim| {
                    if let Claim::Lead { .. } = claim {
                        release_in_background(&later_rt, &later_scripts, later_record, later_token);
                    }
                },
                // The answer was lost (timed out, connection broken) after Redis may
                // have run the claim: the caller gets UNAVAILABLE and will not use it.
                // The token is this call's own, so releasing it touches nothing else.
                move || release_in_background(&lost_rt, &lost_scripts, lost_record, lost_token),
            )
        }
        .await;
        let claim = self.counted(claim)?;
        bump(&inner.counters.claims);
        match claim {
            // Read after the call's deadline (this process was stopped, or the caller's
            // executor did not poll it): the lease may have lapsed, been taken over and
            // its key completed since, so leading could run the action again after
            // completion. Handled as a lost answer; the token is this claim's own.
            Claim::Lead { .. } if sent.elapsed() > inner.config.io_timeout() => {
                release_in_background(&rt, &inner.scripts, record, token);
                Err(Error::Unavailable(format!(
                    "the claim's answer was read {:?} after it was sent, past the I/O \
                     timeout ({:?}): its lease may have lapsed",
                    sent.elapsed(),
                    inner.config.io_timeout()
                )))
            }
            Claim::Lead { generation } => {
                bump(&inner.counters.leads);
                if generation > 1 {
                    bump(&inner.counters.takeovers);
                }
                let (renewal, lost) =
                    rt.renewer
                        .register(&inner.link, &inner.scripts, record.clone(), token.clone());
                Ok(Begin::Lead(RedisLease {
                    store: self.clone(),
                    rt,
                    local: Some(local),
                    scoped: key.clone(),
                    record,
                    token,
                    generation,
                    renewal,
                    lost,
                }))
            }
            Claim::Replay(value) => {
                bump(&inner.counters.replays);
                settle_local(&rt, local, key, value.clone());
                Ok(Begin::Replay(Ok(value)))
            }
            // Dropping `local` lets local waiters look again themselves.
            Claim::Unreplicated { acked, wanted } => {
                bump(&inner.counters.claims_unreplicated);
                drop(local);
                Err(Error::Unavailable(format!(
                    "Redis replication: {acked} of the {wanted} replicas wanted acknowledged the \
                     claim within {:?}; it was released and the action has not run",
                    inner.config.min_replicas_timeout()
                )))
            }
            Claim::Mismatch => Err(Error::FingerprintMismatch),
            Claim::Version(v) => Err(Inner::<E>::version_error(&v)),
            Claim::Running { .. } if !options.wait => Err(Error::InProgress {
                retry_after: inner.config.in_progress_retry_after,
            }),
            Claim::Running { left_ms } => {
                bump(&inner.counters.remote_waits);
                Ok(Begin::Join(RedisJoin::Remote(Box::pin(wait_remote(
                    self.clone(),
                    rt,
                    local,
                    key.clone(),
                    record,
                    fingerprint.to_owned(),
                    left_ms,
                )))))
            }
        }
    }

    /// Runs `action` at most once per `key` across every instance sharing this Redis
    /// (see [`oncely::execute`] for the rules). Waits for a running call.
    pub async fn execute<F, Fut>(
        &self,
        key: &ScopedKey,
        fingerprint: &str,
        action: F,
    ) -> Result<Executed<Vec<u8>>, ExecuteError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Vec<u8>, E>>,
    {
        oncely::execute(self, key, fingerprint, ExecuteOptions::default(), action).await
    }

    /// [`execute`](Self::execute) with options (e.g. [`ExecuteOptions::NO_WAIT`]).
    pub async fn execute_with<F, Fut>(
        &self,
        key: &ScopedKey,
        fingerprint: &str,
        options: ExecuteOptions,
        action: F,
    ) -> Result<Executed<Vec<u8>>, ExecuteError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Vec<u8>, E>>,
    {
        oncely::execute(self, key, fingerprint, options, action).await
    }

    /// The blocking variant of [`execute_with`](Self::execute_with), for
    /// thread-per-request code (and bindings' sync entry points): waiting parks this
    /// thread; `action` runs on it.
    pub fn execute_blocking<F>(
        &self,
        key: &ScopedKey,
        fingerprint: &str,
        options: ExecuteOptions,
        action: F,
    ) -> Result<Executed<Vec<u8>>, ExecuteError<E>>
    where
        F: FnOnce() -> Result<Vec<u8>, E>,
    {
        // This thread waits anyway: its calls go out from it (no worker hand-off).
        threads::blocking(|| {
            pollster::block_on(oncely::execute(self, key, fingerprint, options, || {
                std::future::ready(action())
            }))
        })
    }
}

/// Hands a value found in Redis to this process's waiters, then forgets it locally:
/// Redis is the one place completed results are kept.
fn settle_local<E>(rt: &Runtime<E>, local: Lease<Vec<u8>, E>, key: &ScopedKey, value: Vec<u8>) {
    local.complete_now(value);
    rt.local.remove(key);
}

/// Waits for a leader on another instance: woken by its pub/sub notification, or by
/// polling under backoff (doubling from `poll_min` up to `poll_max`) as the fallback.
async fn wait_remote<E: Send + Sync + 'static>(
    store: RedisStore<E>,
    rt: Arc<Runtime<E>>,
    local: Lease<Vec<u8>, E>,
    key: ScopedKey,
    record: String,
    fingerprint: String,
    mut left_ms: u64,
) -> Joined<Vec<u8>, E> {
    let inner = &store.inner;
    let sub = rt
        .notifier
        .subscribe(&inner.link, Inner::<E>::channel(&record));
    if sub.needs_poke {
        let wake = rt.notifier.wake_channel().to_owned();
        rt.pool
            .spawn(Request::command("PUBLISH").arg(wake).arg("subscribe"));
    }
    let mut delay = inner.config.poll_min;
    loop {
        let mut listener = sub.event.listen();
        let wait = delay.min(Duration::from_millis(left_ms.saturating_add(1)));
        let mut timer = rt.timers.sleep(wait);
        poll_fn(|cx: &mut Context<'_>| {
            if Pin::new(&mut listener).poll(cx).is_ready()
                || Pin::new(&mut timer).poll(cx).is_ready()
            {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
        delay = (delay * 2).min(inner.config.poll_max);
        if !rt.is_current() {
            // A copy left by fork(): look again with this process's own runtime.
            return Joined::Abandoned;
        }
        let peek = rt
            .pool
            .call::<Peek>(inner.scripts.peek.on(&record).arg(&fingerprint))
            .await;
        match peek {
            Ok(Peek::Done(value)) => {
                settle_local(&rt, local, &key, value.clone());
                return Joined::Value(value);
            }
            Ok(Peek::Running { left_ms: l }) => left_ms = l,
            // Gone (released after a failure, expired lease) or unreadable: look
            // again with a claim, which takes over or reports the error. Dropping
            // `local` lets this process's waiters do the same.
            Ok(Peek::Gone) | Err(_) => return Joined::Abandoned,
        }
    }
}

/// A wait on a running call: on a leader in this process, or on one elsewhere.
pub enum RedisJoin<E> {
    /// The leader is in this process (tier 1).
    Local(Join<Vec<u8>, E>),
    /// The leader is another instance; this process's other callers wait on us.
    Remote(Pin<Box<dyn Future<Output = Joined<Vec<u8>, E>> + Send>>),
}

impl<E> Future for RedisJoin<E> {
    type Output = Joined<Vec<u8>, E>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            RedisJoin::Local(j) => Pin::new(j).poll(cx),
            RedisJoin::Remote(f) => f.as_mut().poll(cx),
        }
    }
}

impl<E> fmt::Debug for RedisJoin<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RedisJoin::Local(_) => "RedisJoin::Local",
            RedisJoin::Remote(_) => "RedisJoin::Remote",
        })
    }
}

/// The leader's claim on a key in Redis (and in this process). It is renewed every
/// lease/3 until settled. Dropping it unsettled releases the claim (when the token is
/// still ours) so a waiter takes over at once.
///
/// It belongs to the process that claimed it. A copy in a child made by `fork()` is
/// neither renewed nor released there, and completing it fails with
/// [`Error::LeaseLost`] without writing anything: the claim stays the parent's.
pub struct RedisLease<E: Send + Sync + 'static> {
    store: RedisStore<E>,
    rt: Arc<Runtime<E>>,
    local: Option<Lease<Vec<u8>, E>>,
    scoped: ScopedKey,
    record: String,
    token: String,
    generation: u64,
    renewal: u64,
    lost: Arc<AtomicBool>,
}

impl<E: Send + Sync + 'static> RedisLease<E> {
    /// The lease token (fencing token) written in the record.
    pub fn token(&self) -> &str {
        &self.token
    }
    /// The record's generation: 1 for the first claim, +1 for each takeover.
    pub fn generation(&self) -> u64 {
        self.generation
    }
    /// The Redis key of the record.
    pub fn record_key(&self) -> &str {
        &self.record
    }
    /// True once renewal found the lease taken over; completing will then fail with
    /// [`Error::LeaseLost`].
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }
    /// Stops renewing this lease without releasing it, as a paused or crashed process
    /// would (fault injection for tests: after the lease, another instance takes over).
    pub fn stop_renewing(&self) {
        if self.rt.is_current() {
            self.rt.renewer.unregister(self.renewal);
        }
    }

    /// Deletes the record if it is still ours, without waiting.
    fn release_in_background(&self) {
        release_in_background(
            &self.rt,
            &self.store.inner.scripts,
            self.record.clone(),
            self.token.clone(),
        );
    }

    /// Sends the completion at once (before the returned future is first polled), so
    /// that dropping the future cannot make a release overtake it: the future only
    /// waits for the answer. The lease is renewed until the completion has run.
    fn complete_sent(mut self, value: Vec<u8>) -> impl Future<Output = Result<(), Error>> {
        let inner = self.store.inner.clone();
        let rt = self.rt.clone();
        // Taken, so that dropping `self` below releases nothing.
        let local = self.local.take();
        // A copy left by fork() sends nothing: the claim stays the parent's.
        let stored = rt.is_current().then(|| {
            let request = inner
                .scripts
                .complete
                .on(&self.record)
                .arg(&self.token)
                .arg(&value)
                .arg(millis(inner.config.ttl))
                .arg(Inner::<E>::channel(&self.record))
                .replicated(scripts::completion_stored);
            let (renewer, renewal) = (rt.renewer.clone(), self.renewal);
            let min_replicas = inner.config.min_replicas;
            rt.pool.call_to_end(
                request,
                // The effect happened: a WAIT that fails or falls short is reported,
                // the result is still the caller's.
                move |stored: i64, acked: Acked| match (Completed::from(stored), acked) {
                    (Completed::Stored, Some(Ok(n))) if n < min_replicas => {
                        Completed::Unreplicated(format!(
                            "{n} of {min_replicas} replicas acknowledged it"
                        ))
                    }
                    (Completed::Stored, Some(Err(e))) => {
                        Completed::Unreplicated(format!("WAIT failed: {e}"))
                    }
                    (done, _) => done,
                },
                move || renewer.unregister(renewal),
            )
        });
        let scoped = self.scoped.clone();
        let renewal = self.renewal;
        drop(self);
        async move {
            let Some(stored) = stored else {
                // Local waiters look again, and wait for the parent in Redis.
                drop(local);
                return Err(Error::LeaseLost);
            };
            let stored = stored.await;
            rt.renewer.unregister(renewal);
            match stored {
                Ok(done @ (Completed::Stored | Completed::Unreplicated(_))) => {
                    if let Completed::Unreplicated(why) = done {
                        bump(&inner.counters.completions_unreplicated);
                        log::warn!(
                            "oncely-redis: the result of {} was stored on the primary but not \
                             on enough replicas ({why}); a failover now could lose it",
                            scoped.as_str()
                        );
                    }
                    if let Some(local) = local {
                        settle_local(&rt, local, &scoped, value);
                    }
                    Ok(())
                }
                // Taken over: the new leader's record is left alone; local waiters look
                // again (and join the new leader).
                Ok(Completed::Lost) => {
                    bump(&inner.counters.leases_lost);
                    Err(Error::LeaseLost)
                }
                Err(Error::Unavailable(m)) => {
                    bump(&inner.counters.unavailable);
                    Err(Error::Unavailable(format!(
                        "{m}; the result was not stored (the claim lapses with its lease)"
                    )))
                }
                Err(e) => Err(e),
            }
        }
    }

    async fn fail_async(mut self, error: E) -> Arc<E> {
        if !self.rt.is_current() {
            return match self.local.take() {
                Some(local) => local.fail_now(error),
                None => Arc::new(error),
            };
        }
        let inner = self.store.inner.clone();
        let rt = self.rt.clone();
        rt.renewer.unregister(self.renewal);
        // Released in Redis before the local waiters are woken.
        let released = rt
            .pool
            .call::<i64>(release(&inner.scripts, &self.record, &self.token))
            .await;
        let _ = released; // unreachable Redis: the claim lapses with its lease
        match self.local.take() {
            Some(local) => local.fail_now(error),
            None => Arc::new(error),
        }
    }
}

impl<E: Send + Sync + 'static> Drop for RedisLease<E> {
    fn drop(&mut self) {
        if let Some(local) = self.local.take() {
            // Unsettled: abandoned (cancelled) or panicked.
            self.stop_renewing();
            self.release_in_background();
            drop(local);
        }
    }
}

impl<E: Send + Sync + 'static> LeaderLease<Vec<u8>, E> for RedisLease<E> {
    fn complete(self, value: Vec<u8>) -> impl Future<Output = Result<(), Error>> {
        self.complete_sent(value)
    }
    fn fail(self, error: E) -> impl Future<Output = Arc<E>> {
        self.fail_async(error)
    }
    fn panicked(mut self, message: &str) {
        self.stop_renewing();
        self.release_in_background();
        if let Some(local) = self.local.take() {
            local.panicked_now(message);
        }
    }
}

impl<E: Send + Sync + 'static> fmt::Debug for RedisLease<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLease")
            .field("record", &self.record)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

impl<E: Send + Sync + 'static> DedupStore<Vec<u8>, E> for RedisStore<E> {
    type Lease = RedisLease<E>;
    type Join = RedisJoin<E>;

    fn begin(
        &self,
        key: &ScopedKey,
        fingerprint: &str,
        options: ExecuteOptions,
    ) -> impl Future<Output = Result<Begin<Vec<u8>, E, RedisLease<E>, RedisJoin<E>>, Error>> {
        RedisStore::begin(self, key, fingerprint, options)
    }

    /// The same for every instance on one Redis URL and prefix (they share their
    /// records): an action that calls another instance with its own key would wait for
    /// itself just the same.
    fn identity(&self) -> Option<usize> {
        Some(self.inner.identity)
    }
}

impl<E> fmt::Debug for RedisStore<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.inner.config.prefix)
            .field("lease", &self.inner.config.lease)
            .field("ttl", &self.inner.config.ttl)
            .finish_non_exhaustive()
    }
}
