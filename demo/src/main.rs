//! The oncely demo: effectively-once against a simulated flaky service, in-process.
//!
//! Many concurrent clients each have ONE business intent ("deduct stock for order N").
//! A simulated service, seeded, randomly
//!
//! - fails before executing (`UNAVAILABLE`),
//! - rejects with `RESOURCE_EXHAUSTED` and a server pushback (`ServerDelay::After`),
//! - executes and then drops the response (outcome unknown: the client sees `UNAVAILABLE`),
//! - or succeeds,
//!
//! and a side-effect ledger counts how often each intent's effect was applied. Three
//! client strategies run against fresh services that inject the very same faults:
//!
//! - **at-most-once**: one attempt, no retry → intents are lost;
//! - **at-least-once**: `oncely::retry` without an idempotency key, so the service
//!   cannot deduplicate → effects are applied twice;
//! - **oncely**: `oncely::retry` with `.safe(true)`, one `IdempotencyKey` per intent
//!   reused by every attempt, and a service that guards the effect with
//!   `MemoryStore::execute` on a `ScopedKey` + `fingerprint` → 0 lost, 0 duplicates.
//!
//! With `--redis URL --processes N`, the oncely column runs as a fleet: the demo
//! spawns N copies of itself (hidden `--worker` mode, talking over stdin/stdout) that
//! guard the effect with one shared `oncely_redis::RedisStore`; each attempt of an
//! intent goes to another process (a random first one, then the next), so retries
//! land on other instances, and the workers report every applied effect to the parent's
//! ledger.
//!
//! Exits 0 only if the oncely column shows 0 lost and 0 duplicates; 1 otherwise;
//! 2 on bad flags.
//!
//! ```text
//! scripts/demo                       # or: cargo run --release -p oncely-demo
//! scripts/demo --clients 1000 --drop-rate 0.3 --seed 7
//! scripts/demo --redis redis://127.0.0.1:6379 --processes 3
//! scripts/demo --help
//! ```

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::hash::{BuildHasher, Hasher};
use std::io::{BufRead, Write as _};
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use oncely::{
    fingerprint, retry, Classify, Code, Failure, IdempotencyKey, MemoryStore, RetryEvent,
    RetryPolicy, ScopedKey, ServerDelay, StopReason,
};
use oncely_redis::RedisStore;

// ---------------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------------

const USAGE: &str = "\
oncely demo: effectively-once against a simulated flaky service

USAGE:
    scripts/demo [FLAGS]
    cargo run --release -p oncely-demo -- [FLAGS]

FLAGS:
    --clients N          concurrent clients, one intent each        [default: 200]
    --fail-rate F        P(service fails before executing)          [default: 0.15]
    --throttle-rate F    P(RESOURCE_EXHAUSTED + 30 ms pushback)      [default: 0.10]
    --drop-rate F        P(executes, then the response is dropped)  [default: 0.15]
    --attempts N         total attempts per intent (retry policy)   [default: 10]
    --seed N             seed the service's faults (and the jitter):
                         a seeded run is reproducible in its counts  [default: random]
    --redis URL          run the oncely column as a fleet of worker processes
                         sharing one Redis (redis://host:port[/db]): the effect is
                         guarded by oncely_redis::RedisStore instead of MemoryStore
    --processes N        with --redis: how many worker processes (copies of this
                         demo) to spawn; each attempt of an intent goes to another
                         process, so retries land on other instances  [default: 1]
    -h, --help           print this help

Rates are probabilities per attempt in [0, 1]; fail + throttle + drop must not
exceed 1 (the rest succeeds). Values may also be given as --flag=value.

EXIT CODE:
    0  the oncely column shows 0 lost intents and 0 duplicate effects (with --redis:
       counted across every worker process)
    1  it does not (e.g. every attempt of some intent failed before executing)
    2  bad flags
";

#[derive(Debug, Clone)]
struct Config {
    clients: u32,
    fail: f64,
    throttle: f64,
    drop: f64,
    attempts: u32,
    seed: Option<u64>,
    pushback: Duration,
    redis: Option<String>,
    processes: u32,
    /// Hidden: this process is worker N of a `--redis` fleet.
    worker: Option<u32>,
    /// Hidden: the Redis key prefix a fleet's workers share.
    prefix: String,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            clients: 200,
            fail: 0.15,
            throttle: 0.10,
            drop: 0.15,
            attempts: 10,
            seed: None,
            pushback: Duration::from_millis(30),
            redis: None,
            processes: 1,
            worker: None,
            prefix: "oncely-demo".into(),
        }
    }
}

enum Cli {
    Run(Config),
    Help,
}

fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Cli, String> {
    let mut cfg = Config::default();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        if arg == "-h" || arg == "--help" {
            return Ok(Cli::Help);
        }
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_owned(), Some(v.to_owned())),
            _ => (arg.clone(), None),
        };
        let known = [
            "--clients",
            "--fail-rate",
            "--throttle-rate",
            "--drop-rate",
            "--attempts",
            "--seed",
            "--redis",
            "--processes",
            "--worker",
            "--prefix",
        ];
        if !known.contains(&flag.as_str()) {
            return Err(format!("unknown argument {arg:?}"));
        }
        let value = match inline {
            Some(v) => v,
            None => args.next().ok_or_else(|| format!("{flag} needs a value"))?,
        };
        match flag.as_str() {
            "--clients" => cfg.clients = parse_int(&flag, &value, 1, 100_000)? as u32,
            "--attempts" => cfg.attempts = parse_int(&flag, &value, 1, 50)? as u32,
            "--seed" => cfg.seed = Some(parse_int(&flag, &value, 0, u64::MAX)?),
            "--fail-rate" => cfg.fail = parse_rate(&flag, &value)?,
            "--throttle-rate" => cfg.throttle = parse_rate(&flag, &value)?,
            "--drop-rate" => cfg.drop = parse_rate(&flag, &value)?,
            "--redis" => {
                if !(value.starts_with("redis://") || value.starts_with("rediss://")) {
                    return Err(format!("--redis: {value:?} is not a redis:// URL"));
                }
                cfg.redis = Some(value);
            }
            "--processes" => cfg.processes = parse_int(&flag, &value, 1, 64)? as u32,
            "--worker" => cfg.worker = Some(parse_int(&flag, &value, 0, 64)? as u32),
            "--prefix" => cfg.prefix = value,
            _ => unreachable!("checked against the known flags"),
        }
    }
    let sum = cfg.fail + cfg.throttle + cfg.drop;
    if sum > 1.0 + 1e-9 {
        return Err(format!(
            "--fail-rate + --throttle-rate + --drop-rate must not exceed 1, got {:.3}",
            sum
        ));
    }
    if cfg.worker.is_some() && cfg.redis.is_none() {
        return Err("--worker needs --redis".into());
    }
    Ok(Cli::Run(cfg))
}

fn parse_int(flag: &str, value: &str, min: u64, max: u64) -> Result<u64, String> {
    match value.trim().parse::<u64>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(format!(
            "{flag}: {value:?} is not a whole number from {min} to {max}"
        )),
    }
}

fn parse_rate(flag: &str, value: &str) -> Result<f64, String> {
    match value.trim().parse::<f64>() {
        Ok(f) if f.is_finite() && (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(format!(
            "{flag}: {value:?} is not a probability (a number from 0 to 1)"
        )),
    }
}

// ---------------------------------------------------------------------------------
// The simulated service
// ---------------------------------------------------------------------------------

const TENANT: &str = "shop";
const METHOD: &str = "/inventory.Stock/Deduct";

/// What the service does with one request; a pure function of (seed, order, attempt),
/// so a seeded run gives the same counts whatever the thread scheduling, and the three
/// strategies face the very same faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    FailBefore,
    Throttle,
    DropResponse,
    None,
}

/// One request on the wire: the intent, the attempt number (sent as
/// `grpc-previous-rpc-attempts` would be) and, for oncely, the idempotency key
/// (`x-idempotency-key`).
struct Request {
    order: u32,
    qty: u32,
    attempt: u32,
    key: Option<IdempotencyKey>,
}

/// The receipt of a stock deduction.
type Receipt = u64;

struct Service {
    cfg: Config,
    seed: u64,
    /// Guards the effect of keyed requests (requests without a key cannot be deduped).
    store: MemoryStore<Receipt, Failure>,
    /// In a `--redis` worker: the shared store that guards the effect instead.
    redis: Option<RedisStore<Failure>>,
    /// In a `--redis` worker: receipts are unique per process (index in the top bits),
    /// and each applied effect is reported to the parent (`E order` on stdout).
    worker: Option<u32>,
    /// How often each intent's effect (the stock deduction) was applied.
    ledger: Vec<AtomicU32>,
    next_receipt: AtomicU64,
    failed_before: AtomicU64,
    throttled: AtomicU64,
    /// In a `--redis` worker: attempts the Redis store refused (e.g. unreachable).
    store_errors: AtomicU64,
    dropped: AtomicU64,
    answered: AtomicU64,
}

impl Service {
    fn new(cfg: &Config, seed: u64) -> Self {
        Service {
            cfg: cfg.clone(),
            seed,
            store: MemoryStore::new(),
            redis: None,
            worker: None,
            ledger: (0..cfg.clients).map(|_| AtomicU32::new(0)).collect(),
            next_receipt: AtomicU64::new(1),
            failed_before: AtomicU64::new(0),
            throttled: AtomicU64::new(0),
            store_errors: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            answered: AtomicU64::new(0),
        }
    }

    fn fault(&self, order: u32, attempt: u32) -> Fault {
        let h = splitmix64(
            splitmix64(self.seed).wrapping_add((u64::from(order) << 32) | u64::from(attempt)),
        );
        let u = (h >> 11) as f64 / (1u64 << 53) as f64; // uniform in [0, 1)
        let c = &self.cfg;
        if u < c.fail {
            Fault::FailBefore
        } else if u < c.fail + c.throttle {
            Fault::Throttle
        } else if u < c.fail + c.throttle + c.drop {
            Fault::DropResponse
        } else {
            Fault::None
        }
    }

    /// The RPC handler: "deduct `qty` of stock for order N".
    async fn deduct_stock(&self, req: Request) -> Result<Receipt, Failure> {
        let fault = self.fault(req.order, req.attempt);
        match fault {
            Fault::FailBefore => {
                bump(&self.failed_before);
                return Err(Failure::new(Code::Unavailable));
            }
            Fault::Throttle => {
                bump(&self.throttled);
                return Err(Failure::new(Code::ResourceExhausted)
                    .with_server_delay(ServerDelay::After(self.cfg.pushback)));
            }
            Fault::DropResponse | Fault::None => {}
        }
        let receipt = match &req.key {
            // No key: the service cannot tell a retry from a new order.
            None => self.apply(req.order).await?,
            // A key: run the effect at most once per (tenant, method, key).
            Some(key) => {
                let scoped = ScopedKey::new(TENANT, METHOD, key).map_err(|e| failure_of(&e))?;
                let fp = fingerprint(&(req.order, req.qty)).map_err(|e| failure_of(&e))?;
                match &self.redis {
                    None => {
                        self.store
                            .execute(&scoped, &fp, || self.apply(req.order))
                            .await
                            .map_err(|e| failure_of(&e))?
                            .value
                    }
                    // The same, shared by every process of the fleet; results are bytes.
                    Some(redis) => {
                        let bytes = redis
                            .execute(&scoped, &fp, || async {
                                Ok(self.apply(req.order).await?.to_be_bytes().to_vec())
                            })
                            .await
                            .map_err(|e| {
                                if let Some(se) = e.store_error() {
                                    // The first one per worker is shown, the rest counted.
                                    if self.store_errors.fetch_add(1, Ordering::Relaxed) == 0 {
                                        eprintln!("demo worker: the Redis store: {se}");
                                    }
                                }
                                failure_of(&e)
                            })?
                            .value;
                        let bytes: [u8; 8] =
                            bytes.try_into().map_err(|_| Failure::new(Code::DataLoss))?;
                        Receipt::from_be_bytes(bytes)
                    }
                }
            }
        };
        if fault == Fault::DropResponse {
            // Executed, but the connection drops before the answer gets out:
            // the client cannot know whether the effect happened.
            bump(&self.dropped);
            return Err(Failure::outcome_unknown());
        }
        bump(&self.answered);
        Ok(receipt)
    }

    /// The side effect itself: takes a moment, then is recorded in the ledger.
    async fn apply(&self, order: u32) -> Result<Receipt, Failure> {
        tokio::time::sleep(Duration::from_millis(1)).await;
        self.ledger[order as usize].fetch_add(1, Ordering::Relaxed);
        let n = self.next_receipt.fetch_add(1, Ordering::Relaxed);
        match self.worker {
            None => Ok(n),
            Some(w) => {
                // Before the answer, so the parent counts it even if the answer is lost.
                send_line(&format!("E {order}"));
                Ok((u64::from(w) << 40) | n)
            }
        }
    }
}

/// Where a client's requests go: the in-process service, or a `--redis` fleet of
/// worker processes.
#[derive(Clone)]
enum Target {
    Local(Arc<Service>),
    Fleet(Arc<Fleet>),
}

impl Target {
    async fn call(&self, req: Request) -> Result<Receipt, Failure> {
        match self {
            Target::Local(service) => service.deduct_stock(req).await,
            Target::Fleet(fleet) => fleet.call(req).await,
        }
    }
}

// ---------------------------------------------------------------------------------
// A --redis fleet: worker processes sharing one Redis
// ---------------------------------------------------------------------------------
//
// Parent -> worker (stdin):  `Q <id> <order> <qty> <attempt> <key>`
// Worker -> parent (stdout): `E <order>` (an effect applied), `R <id> ok <receipt>`,
// `R <id> err <CODE> <pushback ms | - | n>`, and at the end (stdin closed, every
// request answered) `S <failed> <throttled> <dropped> <answered> <claims> <leads>
// <takeovers> <replays> <remote waits> <store errors>`.

fn send_line(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn encode_failure(f: &Failure) -> String {
    let delay = match f.server_delay {
        None => "-".to_owned(),
        Some(ServerDelay::After(d)) => d.as_millis().to_string(),
        Some(ServerDelay::DoNotRetry) => "n".to_owned(),
    };
    format!("{} {delay}", f.code.as_str())
}

fn decode_failure(code: &str, delay: &str) -> Failure {
    let code = code.parse::<Code>().unwrap_or(Code::Unknown);
    let server_delay = match delay {
        "-" => None,
        "n" => Some(ServerDelay::DoNotRetry),
        ms => ms
            .parse::<u64>()
            .ok()
            .map(|ms| ServerDelay::After(Duration::from_millis(ms))),
    };
    Failure { code, server_delay }
}

type Reply = tokio::sync::oneshot::Sender<Result<Receipt, Failure>>;

#[derive(Default)]
struct WorkerStats {
    reported: u32,
    counts: [u64; 10],
}

struct Fleet {
    /// Parent-side: its ledger counts the effects the workers report; its counters
    /// are filled from the workers' final reports.
    service: Arc<Service>,
    seed: u64,
    url: String,
    prefix: String,
    stdins: Vec<Mutex<Option<ChildStdin>>>,
    children: Mutex<Vec<Child>>,
    readers: Mutex<Vec<std::thread::JoinHandle<()>>>,
    pending: Arc<Mutex<HashMap<u64, Reply>>>,
    next_id: AtomicU64,
    stats: Arc<Mutex<WorkerStats>>,
}

impl Fleet {
    fn spawn(cfg: &Config, seed: u64, url: &str) -> Result<Arc<Fleet>, String> {
        let exe =
            std::env::current_exe().map_err(|e| format!("cannot find the demo binary: {e}"))?;
        let prefix = format!("oncely-demo-{}", IdempotencyKey::random().as_str());
        let service = Arc::new(Service::new(cfg, seed));
        let pending: Arc<Mutex<HashMap<u64, Reply>>> = Arc::default();
        let stats: Arc<Mutex<WorkerStats>> = Arc::default();
        let (mut stdins, mut children, mut readers) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..cfg.processes {
            let mut child = Command::new(&exe)
                .arg(format!("--clients={}", cfg.clients))
                .arg(format!("--fail-rate={}", cfg.fail))
                .arg(format!("--throttle-rate={}", cfg.throttle))
                .arg(format!("--drop-rate={}", cfg.drop))
                .arg(format!("--seed={seed}"))
                .arg(format!("--redis={url}"))
                .arg(format!("--prefix={prefix}"))
                .arg(format!("--worker={i}"))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(|e| format!("cannot start worker process {i}: {e}"))?;
            let stdout = child.stdout.take().expect("piped");
            stdins.push(Mutex::new(child.stdin.take()));
            children.push(child);
            let (service, pending, stats) = (service.clone(), pending.clone(), stats.clone());
            readers.push(std::thread::spawn(move || {
                for line in std::io::BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    let f: Vec<&str> = line.split_whitespace().collect();
                    match f.as_slice() {
                        ["E", order] => {
                            if let Some(n) = order
                                .parse::<usize>()
                                .ok()
                                .and_then(|o| service.ledger.get(o))
                            {
                                n.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        ["R", id, rest @ ..] => {
                            let r = match rest {
                                ["ok", receipt] => receipt
                                    .parse::<Receipt>()
                                    .map_err(|_| Failure::new(Code::Internal)),
                                ["err", code, delay] => Err(decode_failure(code, delay)),
                                _ => Err(Failure::new(Code::Internal)),
                            };
                            let tx = id
                                .parse::<u64>()
                                .ok()
                                .and_then(|id| pending.lock().unwrap().remove(&id));
                            if let Some(tx) = tx {
                                let _ = tx.send(r);
                            }
                        }
                        ["S", nums @ ..] if nums.len() == 10 => {
                            let mut st = stats.lock().unwrap();
                            st.reported += 1;
                            for (total, n) in st.counts.iter_mut().zip(nums) {
                                *total += n.parse::<u64>().unwrap_or(0);
                            }
                        }
                        _ => eprintln!("demo: worker {i}: unexpected line {line:?}"),
                    }
                }
            }));
        }
        Ok(Arc::new(Fleet {
            service,
            seed,
            url: url.to_owned(),
            prefix,
            stdins,
            children: Mutex::new(children),
            readers: Mutex::new(readers),
            pending,
            next_id: AtomicU64::new(1),
            stats,
        }))
    }

    /// Sends the request to a worker: a random one for the first attempt of an
    /// intent, then the next one for each retry, so a retry always lands on another
    /// process (with 2 or more).
    async fn call(&self, req: Request) -> Result<Receipt, Failure> {
        let n = self.stdins.len() as u64;
        let first = splitmix64(self.seed ^ splitmix64(u64::from(req.order) | (1 << 40))) % n;
        let proc = ((first + u64::from(req.attempt)) % n) as usize;
        let Some(key) = &req.key else {
            return Err(Failure::new(Code::InvalidArgument));
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.pending.lock().unwrap().insert(id, tx);
        let line = format!(
            "Q {id} {} {} {} {}",
            req.order,
            req.qty,
            req.attempt,
            key.as_str()
        );
        let sent = match self.stdins[proc].lock().unwrap().as_mut() {
            Some(stdin) => writeln!(stdin, "{line}")
                .and_then(|()| stdin.flush())
                .is_ok(),
            None => false,
        };
        if !sent {
            self.pending.lock().unwrap().remove(&id);
            return Err(Failure::new(Code::Unavailable));
        }
        match tokio::time::timeout(Duration::from_secs(30), rx).await {
            Ok(Ok(r)) => r,
            _ => {
                self.pending.lock().unwrap().remove(&id);
                Err(Failure::new(Code::DeadlineExceeded))
            }
        }
    }

    /// Closes the workers' stdin, waits for them, and fills the parent-side service's
    /// counters from their reports. Returns the Redis counters as a table cell.
    fn finish(&self) -> Result<String, String> {
        for stdin in &self.stdins {
            stdin.lock().unwrap().take();
        }
        let mut failed = Vec::new();
        for (i, child) in self.children.lock().unwrap().iter_mut().enumerate() {
            match child.wait() {
                Ok(status) if status.success() => {}
                Ok(status) => failed.push(format!("worker {i} exited with {status}")),
                Err(e) => failed.push(format!("worker {i}: {e}")),
            }
        }
        for reader in self.readers.lock().unwrap().drain(..) {
            let _ = reader.join();
        }
        let st = self.stats.lock().unwrap();
        if st.reported as usize != self.stdins.len() {
            failed.push(format!(
                "{} of {} workers sent their final report",
                st.reported,
                self.stdins.len()
            ));
        }
        if !failed.is_empty() {
            return Err(failed.join("; "));
        }
        let c = st.counts;
        let svc = &self.service;
        for (atomic, n) in [
            &svc.failed_before,
            &svc.throttled,
            &svc.dropped,
            &svc.answered,
        ]
        .into_iter()
        .zip(c)
        {
            atomic.store(n, Ordering::Relaxed);
        }
        svc.store_errors.store(c[9], Ordering::Relaxed);
        // claims, leads, takeovers, replays, remote waits
        Ok(format!("{}/{}/{}/{}/{}", c[4], c[5], c[6], c[7], c[8]))
    }
}

/// A `--worker` process: serves requests from stdin until it closes, with the effect
/// guarded by the shared Redis store.
fn run_worker(cfg: &Config, index: u32) -> ExitCode {
    let (Some(url), Some(seed)) = (cfg.redis.as_deref(), cfg.seed) else {
        eprintln!("demo worker: --worker needs --redis and --seed");
        return ExitCode::from(2);
    };
    let store = match RedisStore::<Failure>::builder(url)
        .prefix(cfg.prefix.as_str())
        .lease(Duration::from_secs(5))
        .ttl(Duration::from_secs(600))
        .build()
    {
        Ok(s) => s,
        Err(e) => {
            eprintln!("demo worker {index}: cannot use Redis at {url}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut service = Service::new(cfg, seed);
    service.redis = Some(store);
    service.worker = Some(index);
    let service = Arc::new(service);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("demo worker {index}: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut tasks = tokio::task::JoinSet::new();
        while let Some(line) = rx.recv().await {
            let f: Vec<&str> = line.split_whitespace().collect();
            let ["Q", id, order, qty, attempt, key] = f.as_slice() else {
                eprintln!("demo worker {index}: bad request {line:?}");
                continue;
            };
            let (Ok(order), Ok(qty), Ok(attempt), Ok(key)) = (
                order.parse::<u32>(),
                qty.parse::<u32>(),
                attempt.parse::<u32>(),
                key.parse::<IdempotencyKey>(),
            ) else {
                eprintln!("demo worker {index}: bad request {line:?}");
                continue;
            };
            let id = (*id).to_owned();
            let service = service.clone();
            tasks.spawn(async move {
                let req = Request {
                    order,
                    qty,
                    attempt,
                    key: Some(key),
                };
                match service.deduct_stock(req).await {
                    Ok(receipt) => send_line(&format!("R {id} ok {receipt}")),
                    Err(f) => send_line(&format!("R {id} err {}", encode_failure(&f))),
                }
            });
        }
        while tasks.join_next().await.is_some() {}
    });
    let c = service
        .redis
        .as_ref()
        .map(|r| r.counters())
        .unwrap_or_default();
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    send_line(&format!(
        "S {} {} {} {} {} {} {} {} {} {}",
        load(&service.failed_before),
        load(&service.throttled),
        load(&service.dropped),
        load(&service.answered),
        c.claims,
        c.leads,
        c.takeovers,
        c.replays,
        c.remote_waits,
        load(&service.store_errors)
    ));
    ExitCode::SUCCESS
}

fn failure_of(e: &impl Classify) -> Failure {
    Failure {
        code: e.code(),
        server_delay: e.server_delay(),
    }
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

// ---------------------------------------------------------------------------------
// The clients
// ---------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Strategy {
    AtMostOnce,
    AtLeastOnce,
    Oncely,
}

/// What one client saw.
struct Outcome {
    attempts: u32,
    /// `None` if the client got its receipt.
    stopped: Option<StopReason>,
}

/// The delays the retry loops waited before retries, as seen by `on_retry`.
#[derive(Default)]
struct DelayLog {
    backoff: Vec<Duration>,
    pushback: Vec<Duration>,
}

impl DelayLog {
    fn record(&mut self, event: &RetryEvent<'_, Failure>) {
        if event.error.server_delay.is_some() {
            self.pushback.push(event.delay);
        } else {
            self.backoff.push(event.delay);
        }
    }
}

async fn client(
    target: Target,
    strategy: Strategy,
    order: u32,
    policy: RetryPolicy,
    delays: Arc<Mutex<DelayLog>>,
) -> Outcome {
    // The key is made ONCE per intent, before the first attempt, and every retry
    // reuses it: a new key would be a new operation.
    let key = (strategy == Strategy::Oncely).then(IdempotencyKey::random);
    let policy = match strategy {
        Strategy::AtMostOnce => policy.with_max_attempts(1), // no retry
        Strategy::AtLeastOnce | Strategy::Oncely => policy,
    };
    let mut attempts = 0;
    let result = retry(|attempt| {
        attempts = attempt.number;
        let request = Request {
            order,
            qty: 1,
            attempt: attempt.number,
            key: key.clone(),
        };
        let target = target.clone();
        async move { target.call(request).await }
    })
    .policy(policy)
    // oncely: the call carries an idempotency key, so resending after UNAVAILABLE
    // (outcome unknown) is safe. at-least-once claims the same WITHOUT a key: that
    // claim is exactly the bug this column shows.
    .safe(true)
    .on_retry(move |event: &RetryEvent<'_, Failure>| {
        delays.lock().unwrap().record(event);
    })
    .await;
    Outcome {
        attempts,
        stopped: result.err().map(|e| e.reason),
    }
}

// ---------------------------------------------------------------------------------
// One run per strategy
// ---------------------------------------------------------------------------------

struct Report {
    outcomes: Vec<Outcome>,
    delays: DelayLog,
    service: Arc<Service>,
    elapsed: Duration,
    /// With --redis, the oncely column's Redis counters
    /// (claims/leads/takeovers/replays/remote waits), summed over the workers.
    redis_counts: Option<String>,
}

impl Report {
    fn attempts(&self) -> u64 {
        self.outcomes.iter().map(|o| u64::from(o.attempts)).sum()
    }
    fn succeeded(&self) -> usize {
        self.outcomes.iter().filter(|o| o.stopped.is_none()).count()
    }
    fn stopped(&self, reason: StopReason) -> usize {
        self.outcomes
            .iter()
            .filter(|o| o.stopped == Some(reason))
            .count()
    }
    fn applied_once(&self) -> usize {
        self.ledger().filter(|&n| n == 1).count()
    }
    fn lost(&self) -> usize {
        self.ledger().filter(|&n| n == 0).count()
    }
    fn duplicates(&self) -> u64 {
        self.ledger().map(|n| u64::from(n.saturating_sub(1))).sum()
    }
    fn ledger(&self) -> impl Iterator<Item = u32> + '_ {
        self.service
            .ledger
            .iter()
            .map(|n| n.load(Ordering::Relaxed))
    }
}

/// The SPEC defaults (20 ms base, x2, ±20 % jitter) with more attempts and a lower
/// cap, so a demo with a high fault rate still finishes in a second or two.
fn retry_policy(cfg: &Config) -> RetryPolicy {
    RetryPolicy::new()
        .with_max_attempts(cfg.attempts)
        .with_max_delay(Duration::from_millis(250))
}

async fn run(cfg: &Config, seed: u64, strategy: Strategy, fleet: Option<Arc<Fleet>>) -> Report {
    let (service, target) = match fleet {
        Some(fleet) => (fleet.service.clone(), Target::Fleet(fleet)),
        None => {
            let service = Arc::new(Service::new(cfg, seed));
            (service.clone(), Target::Local(service))
        }
    };
    let delays = Arc::new(Mutex::new(DelayLog::default()));
    let base = retry_policy(cfg);
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for order in 0..cfg.clients {
        // Seeded run: seeded jitter, different per client (one seed for all clients
        // would make them retry in lockstep, which jitter exists to prevent).
        let policy = match cfg.seed {
            Some(s) => base.with_seed(splitmix64(s ^ splitmix64(u64::from(order)))),
            None => base,
        };
        tasks.spawn(client(
            target.clone(),
            strategy,
            order,
            policy,
            delays.clone(),
        ));
    }
    let mut outcomes = Vec::with_capacity(cfg.clients as usize);
    while let Some(joined) = tasks.join_next().await {
        outcomes.push(joined.expect("a client task panicked"));
    }
    let elapsed = started.elapsed();
    let delays = std::mem::take(&mut *delays.lock().unwrap());
    Report {
        outcomes,
        delays,
        service,
        elapsed,
        redis_counts: None,
    }
}

// ---------------------------------------------------------------------------------
// Output
// ---------------------------------------------------------------------------------

fn row(out: &mut String, label: &str, cells: [String; 3]) {
    let _ = writeln!(
        out,
        "  {label:<42}{:>14}{:>17}{:>17}",
        cells[0], cells[1], cells[2]
    );
}

fn each(reports: &[Report; 3], f: impl Fn(&Report) -> String) -> [String; 3] {
    [f(&reports[0]), f(&reports[1]), f(&reports[2])]
}

fn ms(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1e3;
    if ms >= 10.0 {
        format!("{ms:.0} ms")
    } else {
        format!("{ms:.1} ms")
    }
}

/// Nearest-rank percentile of a sorted slice.
fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn delay_stat(delays: &[Duration], p: Option<f64>) -> String {
    if delays.is_empty() {
        return "-".into();
    }
    let mut sorted = delays.to_vec();
    sorted.sort();
    match p {
        Some(p) => ms(percentile(&sorted, p)),
        None => sorted.len().to_string(),
    }
}

fn print_report(cfg: &Config, seed: u64, r: &[Report; 3], total: Duration) {
    let pct = |f: f64| format!("{:.0}%", f * 100.0);
    let ok_rate = (1.0 - cfg.fail - cfg.throttle - cfg.drop).max(0.0);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "oncely demo: {} concurrent clients, each with ONE intent (\"deduct stock for order N\")",
        cfg.clients
    );
    let _ = writeln!(
        out,
        "service per attempt: fail before executing {}, throttle {} (pushback {}), \
         execute then drop the response {}, ok {}",
        pct(cfg.fail),
        pct(cfg.throttle),
        ms(cfg.pushback),
        pct(cfg.drop),
        pct(ok_rate)
    );
    let p = retry_policy(cfg);
    let _ = writeln!(
        out,
        "retry policy: up to {} attempts, backoff {} x{} capped at {}, jitter ±{:.0}%",
        p.max_attempts(),
        ms(p.base_delay()),
        p.multiplier(),
        ms(p.max_delay()),
        p.jitter() * 100.0
    );
    if let Some(url) = &cfg.redis {
        let _ = writeln!(
            out,
            "oncely column: {} worker process(es) sharing the Redis store at {url}; each \
             attempt of an intent goes to another process; effects counted across all",
            cfg.processes
        );
    }
    let _ = writeln!(
        out,
        "seed {seed}{}",
        if cfg.seed.is_some() {
            " (counts are reproducible)"
        } else {
            " (random; pass --seed to reproduce the counts)"
        }
    );
    let _ = writeln!(out);
    row(
        &mut out,
        "",
        [
            "at-most-once".into(),
            "at-least-once".into(),
            "oncely".into(),
        ],
    );
    row(
        &mut out,
        "",
        [
            "no retry".into(),
            "retry, no key".into(),
            "retry+key+dedup".into(),
        ],
    );
    let _ = writeln!(out, "clients");
    row(
        &mut out,
        "attempts sent",
        each(r, |x| x.attempts().to_string()),
    );
    row(
        &mut out,
        "retries",
        each(r, |x| (x.attempts() - x.outcomes.len() as u64).to_string()),
    );
    row(
        &mut out,
        "got a receipt",
        each(r, |x| x.succeeded().to_string()),
    );
    row(
        &mut out,
        "gave up",
        each(r, |x| (x.outcomes.len() - x.succeeded()).to_string()),
    );
    for reason in [
        StopReason::AttemptsExhausted,
        StopReason::NotRetryable,
        StopReason::Deadline,
        StopReason::Budget,
        StopReason::ServerSaidNo,
    ] {
        if r.iter().any(|x| x.stopped(reason) > 0) {
            row(
                &mut out,
                &format!("  stop reason: {reason}"),
                each(r, |x| x.stopped(reason).to_string()),
            );
        }
    }
    let _ = writeln!(out, "service");
    let svc = |f: fn(&Service) -> &AtomicU64| {
        move |x: &Report| f(&x.service).load(Ordering::Relaxed).to_string()
    };
    row(
        &mut out,
        "failed before executing (UNAVAILABLE)",
        each(r, svc(|s| &s.failed_before)),
    );
    row(
        &mut out,
        "throttled (RESOURCE_EXHAUSTED + pushback)",
        each(r, svc(|s| &s.throttled)),
    );
    row(
        &mut out,
        "executed, response dropped (UNAVAILABLE)",
        each(r, svc(|s| &s.dropped)),
    );
    row(
        &mut out,
        "executed, answered",
        each(r, svc(|s| &s.answered)),
    );
    row(
        &mut out,
        "dedup store: led / replayed / joined",
        each(r, |x| {
            if let Some(rc) = &x.redis_counts {
                // leads / replays / remote waits, over every worker process
                let n: Vec<&str> = rc.split('/').collect();
                return format!("{}/{}/{}", n[1], n[3], n[4]);
            }
            let c = x.service.store.counters();
            if c.leads + c.replays + c.joins == 0 {
                "-".into()
            } else {
                format!("{}/{}/{}", c.leads, c.replays, c.joins)
            }
        }),
    );
    if let Some(rc) = &r[2].redis_counts {
        row(
            &mut out,
            "redis: claims/leads/takeovers/replays/waits",
            ["-".into(), "-".into(), rc.clone()],
        );
    }
    let _ = writeln!(out, "effects (side-effect ledger, one intent per client)");
    row(
        &mut out,
        "intents applied exactly once",
        each(r, |x| x.applied_once().to_string()),
    );
    row(
        &mut out,
        "LOST (never applied)",
        each(r, |x| x.lost().to_string()),
    );
    row(
        &mut out,
        "DUPLICATES (extra applications)",
        each(r, |x| x.duplicates().to_string()),
    );
    let _ = writeln!(out, "delays before retries (on_retry hook)");
    row(
        &mut out,
        "backoff: count",
        each(r, |x| delay_stat(&x.delays.backoff, None)),
    );
    for (name, p) in [
        ("min", 0.0),
        ("median", 50.0),
        ("p90", 90.0),
        ("max", 100.0),
    ] {
        row(
            &mut out,
            &format!("  {name}"),
            each(r, |x| delay_stat(&x.delays.backoff, Some(p))),
        );
    }
    row(
        &mut out,
        &format!("server pushback ({} each): count", ms(cfg.pushback)),
        each(r, |x| delay_stat(&x.delays.pushback, None)),
    );
    row(&mut out, "wall time", each(r, |x| ms(x.elapsed)));
    let _ = writeln!(out);
    let _ = writeln!(out, "total run time {}", ms(total));
    print!("{out}");
}

// ---------------------------------------------------------------------------------

fn main() -> ExitCode {
    let cfg = match parse_args(std::env::args().skip(1)) {
        Ok(Cli::Run(cfg)) => cfg,
        Ok(Cli::Help) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(msg) => {
            eprintln!("demo: error: {msg}");
            eprintln!("run with --help for the flags");
            return ExitCode::from(2);
        }
    };
    if let Some(index) = cfg.worker {
        return run_worker(&cfg, index);
    }
    let seed = cfg.seed.unwrap_or_else(|| {
        // A fresh random seed from std (no extra dependency), printed so the run can
        // be reproduced with --seed.
        let mut h = RandomState::new().build_hasher();
        h.write_u64(0x6f6e_6365_6c79);
        h.finish()
    });
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_time()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("demo: error: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let started = Instant::now();
    let fleet = match &cfg.redis {
        None => None,
        Some(url) => match Fleet::spawn(&cfg, seed, url) {
            Ok(f) => Some(f),
            Err(e) => {
                eprintln!("demo: error: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    let mut reports = runtime.block_on(async {
        [
            run(&cfg, seed, Strategy::AtMostOnce, None).await,
            run(&cfg, seed, Strategy::AtLeastOnce, None).await,
            run(&cfg, seed, Strategy::Oncely, fleet.clone()).await,
        ]
    });
    if let Some(fleet) = &fleet {
        match fleet.finish() {
            Ok(counts) => reports[2].redis_counts = Some(counts),
            Err(e) => {
                eprintln!(
                    "demo: error: the worker processes (Redis {} prefix {}): {e}",
                    fleet.url, fleet.prefix
                );
                return ExitCode::FAILURE;
            }
        }
    }
    let total = started.elapsed();
    print_report(&cfg, seed, &reports, total);

    let [most, least, once] = &reports;
    let (lost, dups) = (once.lost(), once.duplicates());
    if lost == 0 && dups == 0 {
        println!(
            "PASS: oncely applied all {} intents exactly once (0 lost, 0 duplicates); \
             at-most-once lost {}, at-least-once applied {} duplicates",
            cfg.clients,
            most.lost(),
            least.duplicates()
        );
        ExitCode::SUCCESS
    } else {
        let mut msg =
            format!("FAIL: the oncely column shows {lost} lost intent(s) and {dups} duplicate(s)");
        let store_errors = once.service.store_errors.load(Ordering::Relaxed);
        if store_errors > 0 {
            let _ = write!(
                msg,
                "; the Redis store refused {store_errors} attempt(s) (see the workers' \
                 messages above: is Redis up at {}?)",
                cfg.redis.as_deref().unwrap_or("?")
            );
        } else if dups == 0 && once.stopped(StopReason::AttemptsExhausted) > 0 {
            msg.push_str(
                ": every attempt of those intents failed before executing; a key makes \
                 retries safe, it cannot make them succeed (raise --attempts or lower \
                 --fail-rate/--throttle-rate)",
            );
        }
        println!("{msg}");
        ExitCode::FAILURE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn flags_parse_and_bad_flags_are_errors() {
        let Ok(Cli::Run(c)) = parse_args(args("--clients 5 --fail-rate=0.5 --seed 9")) else {
            panic!("should parse")
        };
        assert_eq!((c.clients, c.fail, c.seed), (5, 0.5, Some(9)));
        assert!(matches!(parse_args(args("--help")), Ok(Cli::Help)));
        let Ok(Cli::Run(c)) = parse_args(args("--redis redis://127.0.0.1:1 --processes 3")) else {
            panic!("should parse")
        };
        assert_eq!(
            (c.redis.as_deref(), c.processes),
            (Some("redis://127.0.0.1:1"), 3)
        );
        for bad in [
            "--clients",
            "--clients 0",
            "--clients x",
            "--fail-rate 1.5",
            "--fail-rate NaN",
            "--drop-rate -0.1",
            "--fail-rate 0.6 --drop-rate 0.6",
            "--seed -1",
            "--processes 0",
            "--redis http://127.0.0.1:1",
            "--worker 1",
            "--bogus 1",
            "stray",
        ] {
            assert!(parse_args(args(bad)).is_err(), "{bad} should be rejected");
        }
    }
}
