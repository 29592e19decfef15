//! `execute` on Redis (loopback) against the pattern most middlewares use: `SET NX`
//! to claim, `GET` polling to wait, `SET` to store (no lease, no fencing).
//!
//! Run with `scripts/bench-redis` (a throwaway redis-server; extra args go to
//! criterion, e.g. a filter). Needs `ONCELY_REDIS_URL`. After the criterion groups it
//! measures latency percentiles and multi-threaded throughput by hand and prints a
//! table, also written to `target/criterion/oncely-redis-report.md`.
//!
//! Knobs for profiling: `ONCELY_BENCH_PARTS` (see [`part`]), `ONCELY_BENCH_ONLY`
//! (`async`, `blocking` or `naive`: one configuration of the throughput part),
//! `ONCELY_BENCH_WORKERS` (the store's worker threads).

use std::fmt::Write as _;
use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::Criterion;
use futures::executor::block_on;
use oncely::{ExecuteOptions, IdempotencyKey, ScopedKey};
use oncely_redis::RedisStore;

type Store = RedisStore<std::io::Error>;

/// The masters of the Redis Cluster that scripts/with-redis-cluster started, when the
/// bench runs on one (`scripts/bench-redis` runs the throughput part there too).
fn cluster_urls() -> Option<Vec<String>> {
    let urls = std::env::var("ONCELY_REDIS_CLUSTER_URLS").ok()?;
    Some(urls.split_whitespace().take(3).map(str::to_owned).collect())
}

fn url() -> String {
    if let Some(urls) = cluster_urls() {
        return urls[0].clone();
    }
    std::env::var("ONCELY_REDIS_URL").unwrap_or_else(|_| {
        eprintln!("ONCELY_REDIS_URL is not set: run scripts/bench-redis");
        std::process::exit(2)
    })
}

fn prefix() -> String {
    format!("bench{}", IdempotencyKey::random().as_str())
}

fn store(prefix: &str) -> Store {
    match cluster_urls() {
        Some(urls) => RedisStore::builder(urls[0].clone())
            .seeds(urls[1..].to_vec())
            .cluster(true)
            .prefix(prefix)
            .build()
            .unwrap(),
        None => {
            let b = RedisStore::builder(url()).prefix(prefix);
            // ONCELY_BENCH_WORKERS: the store's worker threads (default: the store's).
            match std::env::var("ONCELY_BENCH_WORKERS") {
                Ok(n) => b.workers(n.parse().unwrap()),
                Err(_) => b,
            }
            .build()
            .unwrap()
        }
    }
}

fn key() -> ScopedKey {
    ScopedKey::new("acme", "CreateOrder", &IdempotencyKey::random()).unwrap()
}

const FP: &str = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0";
const RESULT: &[u8] = b"{\"order\":\"order-1\",\"status\":\"created\"}";
const TTL_MS: u64 = 24 * 3600 * 1000;

fn oncely_lead(s: &Store) {
    let k = key();
    black_box(block_on(s.execute(&k, FP, || async { Ok(RESULT.to_vec()) })).unwrap());
}

fn oncely_call(s: &Store, k: &ScopedKey, work: Duration) {
    black_box(
        block_on(s.execute(k, FP, || async move {
            if !work.is_zero() {
                std::thread::sleep(work);
            }
            Ok(RESULT.to_vec())
        }))
        .unwrap(),
    );
}

/// `execute_blocking`: the caller's thread sends its own calls (what a
/// thread-per-request server, or the naive pattern, does).
fn oncely_blocking(s: &Store, k: &ScopedKey) {
    black_box(
        s.execute_blocking(k, FP, ExecuteOptions::default(), || Ok(RESULT.to_vec()))
            .unwrap(),
    );
}

/// The naive pattern: `SET k running NX PX lease`; the winner runs and `SET`s the
/// result; the others `GET` every `poll` until it is not `running`.
fn naive_call(
    c: &mut dyn redis::ConnectionLike,
    k: &str,
    work: Duration,
    poll: Duration,
) -> Vec<u8> {
    let won: Option<String> = redis::cmd("SET")
        .arg(k)
        .arg("running")
        .arg("NX")
        .arg("PX")
        .arg(30_000)
        .query(c)
        .unwrap();
    if won.is_some() {
        if !work.is_zero() {
            std::thread::sleep(work);
        }
        let _: () = redis::cmd("SET")
            .arg(k)
            .arg(RESULT)
            .arg("PX")
            .arg(TTL_MS)
            .query(c)
            .unwrap();
        return RESULT.to_vec();
    }
    loop {
        let v: Option<Vec<u8>> = redis::cmd("GET").arg(k).query(c).unwrap();
        match v {
            Some(v) if v != b"running" => return v,
            _ => std::thread::sleep(poll),
        }
    }
}

/// A connection for the naive peer: to the node, or a Cluster connection (routed by
/// key) when the bench runs on a Cluster.
fn conn() -> Box<dyn redis::ConnectionLike + Send> {
    match cluster_urls() {
        Some(urls) => Box::new(
            redis::cluster::ClusterClient::new(urls)
                .unwrap()
                .get_connection()
                .unwrap(),
        ),
        None => Box::new(
            redis::Client::open(url())
                .unwrap()
                .get_connection()
                .unwrap(),
        ),
    }
}

const CALLERS: usize = 16;
const WORK: Duration = Duration::from_millis(5);
const POLL: Duration = Duration::from_millis(5);

/// One round of `CALLERS` concurrent same-key callers; returns the wall time.
fn coalesce_round(
    stores: &[Store],
    naive: Option<&mut Vec<Box<dyn redis::ConnectionLike + Send>>>,
) -> Duration {
    let barrier = Arc::new(Barrier::new(CALLERS + 1));
    let k = key();
    let t;
    if let Some(conns) = naive {
        let name = format!("naive:{}", k.as_str());
        let taken: Vec<Box<dyn redis::ConnectionLike + Send>> = std::mem::take(conns);
        let hs: Vec<_> = taken
            .into_iter()
            .map(|mut c| {
                let (barrier, name) = (barrier.clone(), name.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    naive_call(&mut *c, &name, WORK, POLL);
                    c
                })
            })
            .collect();
        barrier.wait();
        t = Instant::now();
        for h in hs {
            conns.push(h.join().unwrap());
        }
    } else {
        let hs: Vec<_> = (0..CALLERS)
            .map(|i| {
                let s = stores[i % stores.len()].clone();
                let (barrier, k) = (barrier.clone(), k.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    oncely_call(&s, &k, WORK);
                })
            })
            .collect();
        barrier.wait();
        t = Instant::now();
        for h in hs {
            h.join().unwrap();
        }
    }
    t.elapsed()
}

fn groups(c: &mut Criterion) {
    let p = prefix();
    let s = store(&p);
    let mut raw = conn();

    let mut g = c.benchmark_group("lead");
    g.bench_function("oncely execute (claim + complete)", |b| {
        b.iter(|| oncely_lead(&s))
    });
    g.bench_function("naive SET NX + SET", |b| {
        b.iter(|| {
            naive_call(
                &mut *raw,
                &format!("naive:{}", key().as_str()),
                Duration::ZERO,
                POLL,
            )
        })
    });
    g.finish();

    let k = key();
    oncely_call(&s, &k, Duration::ZERO);
    let naive_k = format!("naive:{}", key().as_str());
    naive_call(&mut *raw, &naive_k, Duration::ZERO, POLL);
    let mut g = c.benchmark_group("replay");
    g.bench_function("oncely execute (claim script)", |b| {
        b.iter(|| oncely_call(&s, &k, Duration::ZERO))
    });
    g.bench_function("naive SET NX + GET", |b| {
        b.iter(|| naive_call(&mut *raw, &naive_k, Duration::ZERO, POLL))
    });
    g.finish();

    let one = vec![s.clone()];
    let fleet: Vec<Store> = (0..CALLERS).map(|_| store(&p)).collect();
    let mut conns: Vec<_> = (0..CALLERS).map(|_| conn()).collect();
    let mut g = c.benchmark_group("coalesce16 (5 ms action)");
    g.sample_size(20);
    g.bench_function("oncely, one instance (in-process tier)", |b| {
        b.iter_custom(|n| (0..n).map(|_| coalesce_round(&one, None)).sum())
    });
    g.bench_function("oncely, 16 instances (pub/sub wake-ups)", |b| {
        b.iter_custom(|n| (0..n).map(|_| coalesce_round(&fleet, None)).sum())
    });
    g.bench_function("naive, GET polling every 5 ms", |b| {
        b.iter_custom(|n| (0..n).map(|_| coalesce_round(&[], Some(&mut conns))).sum())
    });
    g.finish();
}

fn percentiles(mut v: Vec<Duration>) -> [Duration; 4] {
    v.sort();
    let at = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    [at(0.5), at(0.9), at(0.99), *v.last().unwrap()]
}

fn us(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1e6)
}

/// Calls per second of `threads` threads each doing `per` calls of `f`.
fn throughput(threads: usize, per: usize, f: impl Fn(usize) + Send + Sync + 'static) -> f64 {
    let f = Arc::new(f);
    let barrier = Arc::new(Barrier::new(threads + 1));
    let hs: Vec<_> = (0..threads)
        .map(|t| {
            let (f, barrier) = (f.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                for _ in 0..per {
                    f(t);
                }
            })
        })
        .collect();
    barrier.wait();
    let t = Instant::now();
    for h in hs {
        h.join().unwrap();
    }
    (threads * per) as f64 / t.elapsed().as_secs_f64()
}

/// CPU time, in seconds, of this process (all threads) and of redis-server (from
/// `INFO cpu`), and Redis' time inside the commands the clients send (`EVALSHA`,
/// `SET`, `GET` in `INFO commandstats`).
#[derive(Clone, Copy, Default)]
struct Cpu {
    client: f64,
    redis: f64,
    commands: f64,
}

impl Cpu {
    fn now(redis: Option<&mut dyn redis::ConnectionLike>) -> Cpu {
        // SAFETY: getrusage only writes the struct it is given.
        let client = unsafe {
            let mut u: libc::rusage = std::mem::zeroed();
            libc::getrusage(libc::RUSAGE_SELF, &mut u);
            let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
            tv(u.ru_utime) + tv(u.ru_stime)
        };
        let Some(c) = redis else {
            return Cpu {
                client,
                ..Cpu::default()
            };
        };
        let info: String = redis::cmd("INFO")
            .arg("cpu")
            .arg("commandstats")
            .query(c)
            .unwrap();
        let field = |line: &str, f: &str| -> f64 {
            line.split([',', ':'])
                .find_map(|kv| kv.strip_prefix(f))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0.0)
        };
        let mut cpu = Cpu {
            client,
            ..Cpu::default()
        };
        for line in info.lines() {
            if line.starts_with("used_cpu_sys:") || line.starts_with("used_cpu_user:") {
                cpu.redis += line
                    .split_once(':')
                    .and_then(|(_, v)| v.trim().parse::<f64>().ok())
                    .unwrap_or(0.0);
            } else if ["cmdstat_evalsha:", "cmdstat_set:", "cmdstat_get:"]
                .iter()
                .any(|c| line.starts_with(c))
            {
                // Only the commands clients send: a script's own calls are counted
                // under their names too, and within the script's time.
                cpu.commands += field(line, "usec=") / 1e6;
            }
        }
        cpu
    }

    fn since(self, before: Cpu) -> Cpu {
        Cpu {
            client: self.client - before.client,
            redis: self.redis - before.redis,
            commands: self.commands - before.commands,
        }
    }
}

/// Whether the report part `name` runs: `ONCELY_BENCH_PARTS` is a comma list of
/// `latency`, `throughput`, `bursts` (default: all).
fn part(name: &str) -> bool {
    std::env::var("ONCELY_BENCH_PARTS").map_or(true, |v| v.split(',').any(|p| p.trim() == name))
}

/// Latency targets of the report: oncely ≤ 1.5× the naive peer at p50, ≤ 2× at p99.
fn verdict(ratio: f64, target: f64) -> String {
    format!(
        "{ratio:.2}× (≤ {target}×: {})",
        if ratio <= target { "met" } else { "MISSED" }
    )
}

fn report() {
    let p = prefix();
    let s = store(&p);
    let mut raw = conn();
    let mut out = String::new();

    if part("latency") {
        // oncely and the naive peer alternate call by call, so both see the same load.
        const N: usize = 3000;
        let k = key();
        oncely_call(&s, &k, Duration::ZERO);
        let nk = format!("naive:{}", key().as_str());
        naive_call(&mut *raw, &nk, Duration::ZERO, POLL);
        let names = [
            "oncely lead, `execute_blocking`",
            "oncely lead, async `execute` (`block_on`)",
            "naive lead (SET NX + SET)",
            "oncely replay, `execute_blocking`",
            "oncely replay, async `execute` (`block_on`)",
            "naive replay (SET NX + GET)",
        ];
        let mut t: [Vec<Duration>; 6] = Default::default();
        for i in 0..N + 200 {
            for (j, times) in t.iter_mut().enumerate() {
                let (new_key, naive_key) = (key(), format!("naive:{}", key().as_str()));
                let t0 = Instant::now();
                match j {
                    0 => oncely_blocking(&s, &new_key),
                    1 => oncely_call(&s, &new_key, Duration::ZERO),
                    2 => {
                        naive_call(&mut *raw, &naive_key, Duration::ZERO, POLL);
                    }
                    3 => oncely_blocking(&s, &k),
                    4 => oncely_call(&s, &k, Duration::ZERO),
                    _ => {
                        naive_call(&mut *raw, &nk, Duration::ZERO, POLL);
                    }
                }
                if i >= 200 {
                    times.push(t0.elapsed());
                }
            }
        }
        let [bl, al, nl, br, ar, nr] = t.map(percentiles);
        let _ = writeln!(
            out,
            "| one caller, loopback, {N} calls each (interleaved) | p50 | p90 | p99 | max |"
        );
        let _ = writeln!(out, "|---|---|---|---|---|");
        for (name, [a, b, c, d]) in names.iter().zip([bl, al, nl, br, ar, nr]) {
            let _ = writeln!(
                out,
                "| {name} | {} | {} | {} | {} |",
                us(a),
                us(b),
                us(c),
                us(d)
            );
        }
        let r = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
        let _ = writeln!(out);
        let _ = writeln!(out, "| oncely ÷ naive | p50 | p99 |");
        let _ = writeln!(out, "|---|---|---|");
        for (name, o, n) in [
            ("lead, `execute_blocking`", bl, nl),
            ("lead, async `execute`", al, nl),
            ("replay, `execute_blocking`", br, nr),
            ("replay, async `execute`", ar, nr),
        ] {
            let _ = writeln!(
                out,
                "| {name} | {} | {} |",
                verdict(r(o[0], n[0]), 1.5),
                verdict(r(o[2], n[2]), 2.0)
            );
        }
    }

    // (On a Cluster, INFO answers per node: not shown.)
    if (part("latency") || part("throughput")) && cluster_urls().is_none() {
        // Redis' own time per command over the run so far (no network or client side):
        // what a Lua script costs the server against a plain SET or GET.
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut *raw)
            .unwrap();
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "| Redis `INFO commandstats` | calls | µs per call in Redis |"
        );
        let _ = writeln!(out, "|---|---|---|");
        for line in info.lines() {
            let Some((name, rest)) = line
                .strip_prefix("cmdstat_")
                .and_then(|l| l.split_once(':'))
            else {
                continue;
            };
            if !["evalsha", "set", "get"].contains(&name) {
                continue;
            }
            let field = |f: &str| {
                rest.split(',')
                    .find_map(|kv| kv.strip_prefix(f))
                    .unwrap_or("?")
                    .to_owned()
            };
            let _ = writeln!(
                out,
                "| {name} | {} | {} |",
                field("calls="),
                field("usec_per_call=")
            );
        }
    }

    if part("throughput") {
        // 64 threads calling at once, a new key per call; three rounds each,
        // alternating, the median round reported.
        const THREADS: usize = 64;
        const PER: usize = 200;
        let conns: Arc<Vec<std::sync::Mutex<Box<dyn redis::ConnectionLike + Send>>>> = Arc::new(
            (0..THREADS)
                .map(|_| std::sync::Mutex::new(conn()))
                .collect(),
        );
        let (mut ours, mut ours_blocking, mut naive) = (vec![], vec![], vec![]);
        // Per round and configuration: leads/s, then CPU µs per lead of this process,
        // of redis-server, and of Redis inside commands (one Redis only).
        let mut cpu: [Vec<[f64; 4]>; 3] = Default::default();
        let single = cluster_urls().is_none();
        // ONCELY_BENCH_ONLY=async|blocking|naive runs one configuration (to profile it).
        let only = std::env::var("ONCELY_BENCH_ONLY").ok();
        let mut measured = |i: usize, cpu: &mut [Vec<[f64; 4]>; 3], f: &dyn Fn() -> f64| {
            if only
                .as_deref()
                .is_some_and(|o| o != ["async", "blocking", "naive"][i])
            {
                cpu[i].push([0.0; 4]);
                return 0.0;
            }
            let before = Cpu::now(single.then_some(&mut *raw));
            let rate = f();
            let d = Cpu::now(single.then_some(&mut *raw)).since(before);
            let per = |s: f64| s * 1e6 / (THREADS * PER) as f64;
            cpu[i].push([rate, per(d.client), per(d.redis), per(d.commands)]);
            rate
        };
        for _ in 0..3 {
            let ts = s.clone();
            ours.push(measured(0, &mut cpu, &|| {
                let ts = ts.clone();
                throughput(THREADS, PER, move |_| oncely_lead(&ts))
            }));
            let ts = s.clone();
            ours_blocking.push(measured(1, &mut cpu, &|| {
                let ts = ts.clone();
                throughput(THREADS, PER, move |_| oncely_blocking(&ts, &key()))
            }));
            let conns = conns.clone();
            naive.push(measured(2, &mut cpu, &|| {
                let conns = conns.clone();
                throughput(THREADS, PER, move |t| {
                    let mut c = conns[t].lock().unwrap();
                    naive_call(
                        &mut **c,
                        &format!("naive:{}", key().as_str()),
                        Duration::ZERO,
                        POLL,
                    );
                })
            }));
        }
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (ours, ours_blocking, naive) = (median(ours), median(ours_blocking), median(naive));
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "| {THREADS} threads at once, new key each call (median of 3 rounds){} | leads/s |",
            if cluster_urls().is_some() {
                ", Redis Cluster of 3 masters"
            } else {
                ", one Redis"
            }
        );
        let _ = writeln!(out, "|---|---|");
        let _ = writeln!(
            out,
            "| oncely lead, async `execute` (one store, {} workers) | {ours:.0} |",
            oncely_redis::DEFAULT_WORKERS
        );
        let _ = writeln!(
            out,
            "| oncely lead, `execute_blocking` (one store) | {ours_blocking:.0} |"
        );
        let _ = writeln!(
            out,
            "| naive lead (one connection per thread) | {naive:.0} |"
        );
        for (name, x) in [("async", ours), ("blocking", ours_blocking)] {
            let _ = writeln!(
                out,
                "| oncely ({name}) ÷ naive | {:.2}× (≥ 1×: {}) |",
                x / naive,
                if x >= naive { "met" } else { "MISSED" }
            );
        }
        if single {
            // Where the time goes, per lead (the round of median throughput of each):
            // redis-server's CPU (its one thread is the bound when it nears 100 %), the
            // part of it spent inside commands (scripts included), and this process's.
            let _ = writeln!(out);
            let _ = writeln!(
                out,
                "| CPU per lead, 64 threads (median round) | Redis CPU | Redis busy | in commands | client CPU |"
            );
            let _ = writeln!(out, "|---|---|---|---|---|");
            for (name, rounds) in ["oncely async", "oncely blocking", "naive"].iter().zip(cpu) {
                let mut rounds = rounds;
                rounds.sort_by(|a, b| a[0].total_cmp(&b[0]));
                let [rate, client, redis, commands] = rounds[rounds.len() / 2];
                let _ = writeln!(
                    out,
                    "| {name} | {redis:.1} µs | {:.0} % | {commands:.1} µs | {client:.1} µs |",
                    redis * rate / 1e4
                );
            }
        }
    }

    if !part("bursts") {
        finish(out);
        return;
    }
    // Same-key bursts: Redis round trips per burst, counted on the store.
    let one = store(&p);
    let fleet: Vec<Store> = (0..CALLERS).map(|_| store(&p)).collect();
    let runs = 50;
    let wall_one: Duration = (0..runs)
        .map(|_| coalesce_round(std::slice::from_ref(&one), None))
        .sum();
    let wall_fleet: Duration = (0..runs).map(|_| coalesce_round(&fleet, None)).sum();
    let mut conns: Vec<_> = (0..CALLERS).map(|_| conn()).collect();
    let wall_naive: Duration = (0..runs)
        .map(|_| coalesce_round(&[], Some(&mut conns)))
        .sum();
    let claims_one = one.counters().claims as f64 / runs as f64;
    let claims_fleet: u64 = fleet.iter().map(|s| s.counters().claims).sum();
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "| {CALLERS} same-key callers, 5 ms action (mean of {runs} bursts) | wall time | claims per burst |"
    );
    let _ = writeln!(out, "|---|---|---|");
    let _ = writeln!(
        out,
        "| oncely, one instance (in-process tier) | {} | {claims_one:.1} |",
        us(wall_one / runs as u32)
    );
    let _ = writeln!(
        out,
        "| oncely, {CALLERS} instances (pub/sub) | {} | {:.1} |",
        us(wall_fleet / runs as u32),
        claims_fleet as f64 / runs as f64
    );
    let _ = writeln!(
        out,
        "| naive, GET polling every 5 ms | {} | {CALLERS} SET NX + polls |",
        us(wall_naive / runs as u32)
    );

    finish(out);
}

/// Prints the report and writes it to `target/criterion/oncely-redis-report.md`.
fn finish(out: String) {
    println!("\n{out}");
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/criterion");
    let _ = std::fs::create_dir_all(&path);
    let _ = std::fs::write(path.join("oncely-redis-report.md"), out);
}

fn main() {
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    // On a Cluster only the report's throughput runs (see scripts/bench-redis).
    if cluster_urls().is_none() {
        groups(&mut c);
    }
    c.final_summary();
    if std::env::var_os("ONCELY_BENCH_SKIP_REPORT").is_none() {
        report();
    }
}
