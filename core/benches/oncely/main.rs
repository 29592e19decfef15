//! oncely side by side with the crates a Rust user would pick instead.
//!
//! Run with `scripts/bench` (or `cargo bench -p oncely --bench oncely`). Every group
//! measures oncely and its peers in the same run; after the criterion groups the
//! bench measures 1,000,000 inserts with a counting allocator and prints one table of
//! absolute numbers, ratios (oncely / peer) and the targets, also written to
//! `target/criterion/oncely-report.md`. `ONCELY_BENCH_TABLE_ONLY=1` reprints the table
//! from the last run without measuring; `ONCELY_BENCH_SKIP_1M=1` skips the 1M inserts.
//!
//! Numbers are criterion medians (per iteration) of each benchmark.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::future::Future;
use std::hint::black_box;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBuilder, Retryable};
use criterion::{criterion_group, Criterion};
use futures::channel::oneshot;
use futures::future::{BoxFuture, FutureExt, Shared};
use oncely::{
    Attempt, CallFacts, Code, Failure, IdempotencyKey, MemoryStore, RetryPolicy, RetryState,
    ScopedKey,
};

mod alloc;
mod backoff;
mod coalesce;
mod fixtures;
mod inserts;
mod profile;
mod report;
mod retry;
mod store;

use alloc::*;
use backoff::*;
use coalesce::*;
use fixtures::*;
use inserts::*;
use profile::*;
use report::*;
use retry::*;
use store::*;

criterion_group!(
    name = benches;
    // Short by default so the whole run stays within a few minutes on 2 shared cores;
    // command-line options (`--measurement-time`, …) still override these.
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2));
    targets = bench_backoff, bench_retry, bench_replay, bench_miss, bench_coalesce
);

const INSERT_FILE: &str = "oncely-insert.json";

fn save_inserts(rows: &[(&'static str, InsertResult)]) {
    let json: serde_json::Map<String, serde_json::Value> = rows
        .iter()
        .map(|(name, r)| {
            (
                name.to_string(),
                serde_json::json!({
                    "ns_per_key": r.ns_per_key,
                    "bytes_per_entry": r.bytes_per_entry,
                    "overhead_per_entry": r.overhead_per_entry,
                }),
            )
        })
        .collect();
    let dir = criterion_dir();
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(
        dir.join(INSERT_FILE),
        serde_json::to_string_pretty(&json).unwrap(),
    );
}

fn load_inserts() -> Option<Vec<(&'static str, InsertResult)>> {
    let text = std::fs::read_to_string(criterion_dir().join(INSERT_FILE)).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let names = ["floor_mutex_map", "oncely", "moka", "moka_ttl"];
    Some(
        names
            .iter()
            .filter_map(|&name| {
                let r = v.get(name)?;
                Some((
                    name,
                    InsertResult {
                        ns_per_key: r["ns_per_key"].as_f64()?,
                        bytes_per_entry: r["bytes_per_entry"].as_f64()?,
                        overhead_per_entry: r["overhead_per_entry"].as_f64()?,
                    },
                ))
            })
            .collect(),
    )
}

fn main() {
    if let Ok(spec) = std::env::var("ONCELY_BENCH_PROFILE") {
        profile(&spec);
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    let flag = |f: &str| args.iter().any(|a| a == f);
    if flag("--list") {
        benches();
        return;
    }
    let test_mode = flag("--test");
    let table_only = std::env::var_os("ONCELY_BENCH_TABLE_ONLY").is_some();
    if !table_only {
        benches();
        Criterion::default().configure_from_args().final_summary();
        if std::env::var_os("ONCELY_BENCH_SKIP_1M").is_none() {
            let n = if test_mode { 10_000 } else { 1_000_000 };
            let rows = bench_insert_many(n);
            if !test_mode {
                save_inserts(&rows);
            }
        }
    }
    if test_mode {
        return;
    }
    let table = report(load_inserts().as_deref());
    println!(
        "\n## oncely vs peers (criterion medians; oncely / peer < 1 means oncely is faster)\n"
    );
    println!("{table}");
    let _ = std::fs::write(criterion_dir().join("oncely-report.md"), table + "\n");
}
