//! `execute` on Redis (loopback) against the pattern most middlewares use: `SET NX`
//! to claim, `GET` polling to wait, `SET` to store (no lease, no fencing).
//!
//! Run with `scripts/bench-redis` (a throwaway redis-server; extra args go to
//! criterion, e.g. a filter). Needs `ONCELY_REDIS_URL`. After the criterion groups it
//! measures latency percentiles and multi-threaded throughput by hand and prints a
//! table, also written to `target/criterion/oncely-redis-report.md`.

use std::fmt::Write as _;
use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::Criterion;
use futures::executor::block_on;
use oncely::{IdempotencyKey, ScopedKey};
use oncely_redis::RedisStore;

type Store = RedisStore<std::io::Error>;

fn url() -> String {
    std::env::var("ONCELY_REDIS_URL").unwrap_or_else(|_| {
        eprintln!("ONCELY_REDIS_URL is not set: run scripts/bench-redis");
        std::process::exit(2)
    })
}

fn prefix() -> String {
    format!("bench{}", IdempotencyKey::random().as_str())
}

fn store(prefix: &str) -> Store {
    RedisStore::builder(url()).prefix(prefix).build().unwrap()
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

/// The naive pattern: `SET k running NX PX lease`; the winner runs and `SET`s the
/// result; the others `GET` every `poll` until it is not `running`.
fn naive_call(c: &mut redis::Connection, k: &str, work: Duration, poll: Duration) -> Vec<u8> {
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

fn conn() -> redis::Connection {
    redis::Client::open(url())
        .unwrap()
        .get_connection()
        .unwrap()
}

const CALLERS: usize = 16;
const WORK: Duration = Duration::from_millis(5);
const POLL: Duration = Duration::from_millis(5);

/// One round of `CALLERS` concurrent same-key callers; returns the wall time.
fn coalesce_round(stores: &[Store], naive: Option<&mut Vec<redis::Connection>>) -> Duration {
    let barrier = Arc::new(Barrier::new(CALLERS + 1));
    let k = key();
    let t;
    if let Some(conns) = naive {
        let name = format!("naive:{}", k.as_str());
        let taken: Vec<redis::Connection> = std::mem::take(conns);
        let hs: Vec<_> = taken
            .into_iter()
            .map(|mut c| {
                let (barrier, name) = (barrier.clone(), name.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    naive_call(&mut c, &name, WORK, POLL);
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
                &mut raw,
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
    naive_call(&mut raw, &naive_k, Duration::ZERO, POLL);
    let mut g = c.benchmark_group("replay");
    g.bench_function("oncely execute (claim script)", |b| {
        b.iter(|| oncely_call(&s, &k, Duration::ZERO))
    });
    g.bench_function("naive SET NX + GET", |b| {
        b.iter(|| naive_call(&mut raw, &naive_k, Duration::ZERO, POLL))
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

fn report() {
    const N: usize = 2000;
    let p = prefix();
    let s = store(&p);
    let mut raw = conn();
    let mut rows: Vec<(String, [Duration; 4])> = Vec::new();
    let mut time = |name: &str, f: &mut dyn FnMut()| {
        for _ in 0..100 {
            f();
        }
        let v = (0..N)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed()
            })
            .collect();
        rows.push((name.to_owned(), percentiles(v)));
    };
    time("oncely lead (claim + complete)", &mut || oncely_lead(&s));
    time("naive lead (SET NX + SET)", &mut || {
        naive_call(
            &mut raw,
            &format!("naive:{}", key().as_str()),
            Duration::ZERO,
            POLL,
        );
    });
    let k = key();
    oncely_call(&s, &k, Duration::ZERO);
    time("oncely replay (claim script)", &mut || {
        oncely_call(&s, &k, Duration::ZERO)
    });
    let nk = format!("naive:{}", key().as_str());
    naive_call(&mut raw, &nk, Duration::ZERO, POLL);
    time("naive replay (SET NX + GET)", &mut || {
        naive_call(&mut raw, &nk, Duration::ZERO, POLL);
    });

    let mut out = String::new();
    let _ = writeln!(out, "| single caller, loopback | p50 | p90 | p99 | max |");
    let _ = writeln!(out, "|---|---|---|---|---|");
    for (name, [a, b, c, d]) in &rows {
        let _ = writeln!(
            out,
            "| {name} | {} | {} | {} | {} |",
            us(*a),
            us(*b),
            us(*c),
            us(*d)
        );
    }

    let threads = 8;
    let per = 500;
    let ts = s.clone();
    let lead_tp = throughput(threads, per, move |_| oncely_lead(&ts));
    let url = url();
    let naive_tp = {
        let conns: Vec<_> = (0..threads)
            .map(|_| {
                std::sync::Mutex::new(
                    redis::Client::open(url.as_str())
                        .unwrap()
                        .get_connection()
                        .unwrap(),
                )
            })
            .collect();
        let conns = Arc::new(conns);
        throughput(threads, per, move |t| {
            let mut c = conns[t].lock().unwrap();
            naive_call(
                &mut c,
                &format!("naive:{}", key().as_str()),
                Duration::ZERO,
                POLL,
            );
        })
    };
    let _ = writeln!(out);
    let _ = writeln!(out, "| {threads} threads, new key each call | calls/s |");
    let _ = writeln!(out, "|---|---|");
    let _ = writeln!(out, "| oncely lead (one store, 4 workers) | {lead_tp:.0} |");
    let _ = writeln!(
        out,
        "| naive lead (one connection per thread) | {naive_tp:.0} |"
    );

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
    groups(&mut c);
    c.final_summary();
    if std::env::var_os("ONCELY_BENCH_SKIP_REPORT").is_none() {
        report();
    }
}
