//! The store's settings: [`RedisStoreBuilder`], its defaults, and the checks and URL
//! parsing that turn them into a [`RedisStore`].

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use oncely::Error;

use crate::conn::Link;
use crate::runtime::{PerProcess, Runtime};
use crate::scripts::Scripts;
use crate::topology::{self, Topology};
use crate::{AtomicCounters, Inner, RedisStore};

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
/// Default largest result stored (64 MiB): an eighth of the largest bulk string Redis
/// accepts by default (`proto-max-bulk-len`, 512 MiB), so the tag byte, a server that
/// lowered that limit by a few steps, and the time a write of it takes within one I/O
/// timeout all fit; a result this large costs every replay as much again.
pub const DEFAULT_MAX_RESULT_BYTES: usize = 64 << 20;
/// The largest [`RedisStoreBuilder::max_result_bytes`] accepted: Redis' default
/// `proto-max-bulk-len` (512 MiB).
pub const MAX_RESULT_BYTES_LIMIT: usize = 512 << 20;

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
pub(crate) struct Config {
    url: String,
    pub(crate) prefix: String,
    pub(crate) lease: Duration,
    pub(crate) ttl: Duration,
    connect_timeout: Duration,
    /// `None`: [`DEFAULT_IO_TIMEOUT`], or a third of a shorter lease.
    io_timeout: Option<Duration>,
    workers: usize,
    pub(crate) poll_min: Duration,
    pub(crate) poll_max: Duration,
    pub(crate) in_progress_retry_after: Duration,
    tls_ca_file: Option<PathBuf>,
    naming: oncely::Naming,
    /// More seed nodes of a Cluster, or more Sentinels (`url` is the first).
    seeds: Vec<String>,
    cluster: bool,
    /// The master name the Sentinels at `url` and `seeds` monitor.
    sentinel_master: Option<String>,
    /// Replicas that must acknowledge a claim and a completion (`WAIT`), and how long
    /// to wait for them.
    pub(crate) min_replicas: usize,
    /// `None`: half the I/O timeout.
    min_replicas_timeout: Option<Duration>,
    connect_now: bool,
    /// Results larger than this are recorded as not storable instead.
    pub(crate) max_result_bytes: usize,
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
            .field("max_result_bytes", &self.max_result_bytes)
            .finish_non_exhaustive()
    }
}

impl Config {
    pub(crate) fn io_timeout(&self) -> Duration {
        self.io_timeout
            .unwrap_or_else(|| DEFAULT_IO_TIMEOUT.min(self.lease / 3))
    }
    pub(crate) fn min_replicas_timeout(&self) -> Duration {
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
    /// (the action ran), counted in
    /// [`RedisCounters::completions_unreplicated`](crate::RedisCounters::completions_unreplicated)
    /// and logged (`log` crate, warn). A [`remove`](crate::RedisStore::remove) that
    /// deleted a record is followed by `WAIT` too, and fails UNAVAILABLE when fewer
    /// acknowledged the deletion (a failover could bring the record back). The timeout is
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

    /// The largest result stored, in bytes (default [`DEFAULT_MAX_RESULT_BYTES`],
    /// 64 MiB; at most [`MAX_RESULT_BYTES_LIMIT`]). Redis refuses a bulk string over its
    /// `proto-max-bulk-len` (512 MiB by default) and drops the connection, so a larger
    /// completion is never sent: the action has run, so the record says its result was
    /// not stored (see the README's record layout, `nostore`) and it is not run again;
    /// its caller and the callers of its process that waited for it get the value,
    /// every later caller [`Error::ResultNotStored`] (DATA_LOSS, Rust callers of raw
    /// bytes included), and [`RedisStore::get`] shows [`RecordState::NotStored`](crate::RecordState::NotStored). Keep
    /// it at or below the server's `proto-max-bulk-len`.
    pub fn max_result_bytes(mut self, n: usize) -> Self {
        self.config.max_result_bytes = n;
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
        if !(1..=MAX_RESULT_BYTES_LIMIT).contains(&config.max_result_bytes) {
            return Err(Error::InvalidArgument {
                field: n.field("max_result_bytes"),
                reason: format!(
                    "must be between 1 and {MAX_RESULT_BYTES_LIMIT} (Redis' default \
                     proto-max-bulk-len), e.g. {DEFAULT_MAX_RESULT_BYTES}, got {}",
                    config.max_result_bytes
                ),
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
                scripts: Arc::new(Scripts::new(config.cluster)),
                link,
                counters: AtomicCounters::default(),
                config,
            }),
        })
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
                max_result_bytes: DEFAULT_MAX_RESULT_BYTES,
            },
        }
    }
}
