//! The Rust worker of the chaos soak (`scripts/soak`, driven by `tests/soak/soak.py`).
//!
//! `oncely-soak-worker NAME REDIS_URL PREFIX LEASE_MS LEDGER_PATH`
//!
//! With `ONCELY_SOAK_CLUSTER=1`, REDIS_URL is a Redis Cluster's node URLs
//! (space-separated); `ONCELY_SOAK_MIN_REPLICAS` sets the store's `min_replicas`.
//!
//! Reads jobs as JSON lines on stdin and runs each on a thread of its own through one
//! shared `RedisStore`, wrapped in `retry` as a client would; writes one JSON line per
//! job on stdout. Every execution of an action appends a `start` and an `end` line to
//! the ledger file (O_APPEND, one `write` per line, so a SIGKILL loses at most the
//! line being written). The protocol is the one of `tests/soak/worker.py`.
//! At the end of stdin it waits for its jobs and writes its counters.

use std::fs::{File, OpenOptions};
use std::future::IntoFuture;
use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::future::{select, Either};
use oncely::{retry, Classify, Code, ExecuteError, RetryPolicy, ScopedKey, Source};
use oncely_redis::codec::{self, StoredResult};
use oncely_redis::RedisStore;
use serde_json::{json, Value};

/// The action's own failures, as the soak's actions raise them.
#[derive(Debug)]
enum Fail {
    Retryable,
    Permanent,
}

impl Classify for Fail {
    fn code(&self) -> Code {
        match self {
            Fail::Retryable => Code::Unavailable,
            Fail::Permanent => Code::InvalidArgument,
        }
    }
}

/// Why one attempt failed.
#[derive(Debug)]
enum CallError {
    Execute(ExecuteError<Fail>),
    DeadlineExceeded,
}

impl Classify for CallError {
    fn code(&self) -> Code {
        match self {
            CallError::Execute(e) => e.code(),
            CallError::DeadlineExceeded => Code::DeadlineExceeded,
        }
    }
    fn server_delay(&self) -> Option<oncely::ServerDelay> {
        match self {
            CallError::Execute(e) => e.server_delay(),
            CallError::DeadlineExceeded => None,
        }
    }
}

struct Worker {
    name: String,
    store: RedisStore<Fail>,
    out: Mutex<std::io::Stdout>,
    ledger: Mutex<File>,
    execs: AtomicU64,
    calls: [AtomicU64; 3],
}

fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(0.0)
}

impl Worker {
    fn emit(&self, v: &Value) {
        let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(out, "{v}");
        let _ = out.flush();
    }

    fn ledger(&self, v: &Value) {
        let line = format!("{v}\n");
        let mut f = self.ledger.lock().unwrap_or_else(|e| e.into_inner());
        let _ = f.write_all(line.as_bytes());
    }
}

/// Writes the ledger's `end` line when the execution is dropped (cancelled) before it
/// said how it ended.
struct ExecGuard<'a> {
    worker: &'a Worker,
    key: String,
    exec: String,
    status: &'static str,
}

impl Drop for ExecGuard<'_> {
    fn drop(&mut self) {
        self.worker.ledger(&json!({
            "ev": "end", "k": self.key, "x": self.exec, "st": self.status, "t": now_ms(),
        }));
    }
}

/// A small deterministic generator per execution (whether a flaky action fails).
fn coin(seed: &str) -> f64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in seed.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    (h >> 11) as f64 / (1u64 << 53) as f64
}

async fn action(w: &Worker, job: &Value) -> Result<Vec<u8>, Fail> {
    let key = job["key"].as_str().unwrap_or_default().to_owned();
    let exec = format!("{}-{}", w.name, w.execs.fetch_add(1, Ordering::Relaxed));
    w.ledger(&json!({"ev": "start", "k": key, "w": w.name, "x": exec, "t": now_ms()}));
    let mut guard = ExecGuard {
        worker: w,
        key: key.clone(),
        exec: exec.clone(),
        status: "cancel",
    };
    let dur = job["dur_ms"].as_u64().unwrap_or(0);
    if dur > 0 {
        futures_timer::Delay::new(Duration::from_millis(dur)).await;
    }
    let kind = job["kind"].as_str().unwrap_or("ok");
    let out = match kind {
        "perm" => Err(Fail::Permanent),
        "flaky" if coin(&exec) < job["pfail"].as_f64().unwrap_or(0.5) => Err(Fail::Retryable),
        "none" => Ok(StoredResult::NoValue.encode()),
        "big" => {
            let size = job["size"].as_u64().unwrap_or(1 << 20) as usize;
            let mut v = format!("{exec}|").into_bytes();
            v.resize(size.max(v.len()), b'z');
            Ok(StoredResult::Bytes(&v).encode())
        }
        _ => Ok(StoredResult::Json(&json!({"k": key, "x": exec}).to_string()).encode()),
    };
    guard.status = if out.is_ok() { "ok" } else { "fail" };
    out
}

/// The value as the driver compares it across languages: `none`, `x:<exec>` or
/// `big:<exec>:<length>`.
fn summary(bytes: &[u8]) -> String {
    fn text(s: &[u8]) -> String {
        let s = String::from_utf8_lossy(s);
        let exec = s.split('|').next().unwrap_or_default();
        format!("big:{exec}:{}", s.len())
    }
    match codec::decode(bytes) {
        Ok(StoredResult::NoValue) => "none".into(),
        Ok(StoredResult::Bytes(b)) => text(b),
        Ok(StoredResult::Json(j)) => match serde_json::from_str::<Value>(j) {
            Ok(Value::Object(o)) => {
                format!("x:{}", o.get("x").and_then(Value::as_str).unwrap_or("?"))
            }
            Ok(Value::String(s)) => text(s.as_bytes()),
            Ok(Value::Null) => "none".into(),
            other => format!("unexpected:{other:?}"),
        },
        other => format!("unexpected:{other:?}"),
    }
}

fn run_job(w: Arc<Worker>, job: Value) {
    let id = job["id"].clone();
    let key = job["key"].as_str().unwrap_or_default().to_owned();
    let scoped = match ScopedKey::parse(&format!("v1:soak:Soak:{key}")) {
        Ok(s) => s,
        Err(e) => {
            w.emit(&json!({"id": id, "w": w.name, "ok": false, "code": "INTERNAL", "err": e.to_string()}));
            return;
        }
    };
    let fp = oncely::fingerprint(&job["payload"]).unwrap_or_default();
    let deadline = Duration::from_millis(job["deadline_ms"].as_u64().unwrap_or(20_000));
    let policy = RetryPolicy::new()
        .with_max_attempts(1000)
        .with_base_delay(Duration::from_millis(50))
        .with_max_delay(Duration::from_millis(1000));
    let call = retry(|attempt| {
        let (w, scoped, fp, job) = (&w, &scoped, &fp, &job);
        // The time left is this attempt's timeout, as a client forwards it: a waiter
        // stops at the caller's deadline (a leader's action is dropped with it and its
        // claim released).
        let left = attempt.remaining.unwrap_or(Duration::from_secs(60));
        async move {
            let exec = w.store.execute(scoped, fp, || action(w, job));
            match select(Box::pin(exec), futures_timer::Delay::new(left)).await {
                Either::Left((r, _)) => r.map_err(CallError::Execute),
                Either::Right(((), _)) => Err(CallError::DeadlineExceeded),
            }
        }
    })
    .policy(policy)
    .safe(true)
    .timeout(deadline);
    let cancel = job["cancel_ms"].as_u64();
    let outcome = futures::executor::block_on(async {
        match cancel {
            None => Some(call.await),
            Some(ms) => {
                let timer = futures_timer::Delay::new(Duration::from_millis(ms));
                match select(Box::pin(call.into_future()), timer).await {
                    Either::Left((r, _)) => Some(r),
                    Either::Right(((), _)) => None,
                }
            }
        }
    });
    let reply = match outcome {
        None => json!({"id": id, "w": w.name, "cancelled": true}),
        Some(Ok(done)) => {
            let (i, src) = match done.source {
                Source::Led => (0, "led"),
                Source::Joined => (1, "joined"),
                Source::Replayed => (2, "replayed"),
            };
            w.calls[i].fetch_add(1, Ordering::Relaxed);
            json!({"id": id, "w": w.name, "ok": true, "v": summary(&done.value), "src": src})
        }
        Some(Err(e)) => {
            let err = &e.error;
            json!({"id": id, "w": w.name, "ok": false, "code": err.code().as_str(),
                   "err": format!("{err:?}"), "att": e.attempts})
        }
    };
    w.emit(&reply);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 6 {
        eprintln!("usage: oncely-soak-worker NAME REDIS_URL PREFIX LEASE_MS LEDGER_PATH");
        std::process::exit(2);
    }
    let lease = Duration::from_millis(args[4].parse().expect("LEASE_MS"));
    // ONCELY_SOAK_CLUSTER=1: REDIS_URL is a Redis Cluster's node URLs, space-separated.
    let cluster = std::env::var("ONCELY_SOAK_CLUSTER").is_ok_and(|v| v == "1");
    let min_replicas = std::env::var("ONCELY_SOAK_MIN_REPLICAS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut urls = args[2].split_whitespace().map(str::to_owned);
    let first = if cluster {
        urls.next().expect("REDIS_URL")
    } else {
        args[2].clone()
    };
    let store = RedisStore::builder(first)
        .cluster(cluster)
        .seeds(if cluster { urls.collect() } else { Vec::new() })
        .min_replicas(min_replicas)
        .prefix(args[3].clone())
        .lease(lease)
        .build()
        .expect("RedisStore");
    let ledger = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&args[5])
        .expect("ledger");
    let w = Arc::new(Worker {
        name: args[1].clone(),
        store,
        out: Mutex::new(std::io::stdout()),
        ledger: Mutex::new(ledger),
        execs: AtomicU64::new(0),
        calls: Default::default(),
    });
    w.emit(&json!({"ready": w.name}));
    let mut jobs = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        if line.trim().is_empty() {
            continue;
        }
        let Ok(job) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        let w = w.clone();
        jobs.push(std::thread::spawn(move || run_job(w, job)));
        jobs.retain(|j| !j.is_finished());
    }
    for j in jobs {
        let _ = j.join();
    }
    let c = w.store.counters();
    w.emit(&json!({
        "end": w.name,
        "counters": {"claims": c.claims, "leads": c.leads, "takeovers": c.takeovers,
                     "replays": c.replays, "remote_waits": c.remote_waits,
                     "leases_lost": c.leases_lost, "abandoned": c.abandoned,
                     "completions_unreplicated": c.completions_unreplicated},
        "calls": {"led": w.calls[0].load(Ordering::Relaxed),
                  "joined": w.calls[1].load(Ordering::Relaxed),
                  "replayed": w.calls[2].load(Ordering::Relaxed)},
    }));
}
