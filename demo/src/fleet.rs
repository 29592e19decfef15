//! A --redis fleet: worker processes sharing one Redis.
//!
//! Parent -> worker (stdin):  `Q <id> <order> <qty> <attempt> <key>`
//! Worker -> parent (stdout): `E <order>` (an effect applied), `R <id> ok <receipt>`,
//! `R <id> err <CODE> <pushback ms | - | n>`, and at the end (stdin closed, every
//! request answered) `S <failed> <throttled> <dropped> <answered> <claims> <leads>
//! <takeovers> <replays> <remote waits> <store errors>`.

use super::*;

pub(crate) fn send_line(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

pub(crate) fn encode_failure(f: &Failure) -> String {
    let delay = match f.server_delay {
        None => "-".to_owned(),
        Some(ServerDelay::After(d)) => d.as_millis().to_string(),
        Some(ServerDelay::DoNotRetry) => "n".to_owned(),
    };
    format!("{} {delay}", f.code.as_str())
}

pub(crate) fn decode_failure(code: &str, delay: &str) -> Failure {
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

pub(crate) type Reply = tokio::sync::oneshot::Sender<Result<Receipt, Failure>>;

#[derive(Default)]
pub(crate) struct WorkerStats {
    pub(crate) reported: u32,
    pub(crate) counts: [u64; 10],
}

pub(crate) struct Fleet {
    /// Parent-side: its ledger counts the effects the workers report; its counters
    /// are filled from the workers' final reports.
    pub(crate) service: Arc<Service>,
    pub(crate) seed: u64,
    pub(crate) url: String,
    pub(crate) prefix: String,
    pub(crate) stdins: Vec<Mutex<Option<ChildStdin>>>,
    pub(crate) children: Mutex<Vec<Child>>,
    pub(crate) readers: Mutex<Vec<std::thread::JoinHandle<()>>>,
    pub(crate) pending: Arc<Mutex<HashMap<u64, Reply>>>,
    pub(crate) next_id: AtomicU64,
    pub(crate) stats: Arc<Mutex<WorkerStats>>,
}

impl Fleet {
    pub(crate) fn spawn(cfg: &Config, seed: u64, url: &str) -> Result<Arc<Fleet>, String> {
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
    pub(crate) async fn call(&self, req: Request) -> Result<Receipt, Failure> {
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
    pub(crate) fn finish(&self) -> Result<String, String> {
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
pub(crate) fn run_worker(cfg: &Config, index: u32) -> ExitCode {
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

pub(crate) fn failure_of(e: &impl Classify) -> Failure {
    Failure {
        code: e.code(),
        server_delay: e.server_delay(),
    }
}

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

pub(crate) fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
