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

mod cli;
mod client;
mod fleet;
mod output;
mod run;
mod service;

use cli::*;
use client::*;
use fleet::*;
use output::*;
use run::*;
use service::*;

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
