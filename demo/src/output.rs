//! Output.

use super::*;

pub(crate) fn row(out: &mut String, label: &str, cells: [String; 3]) {
    let _ = writeln!(
        out,
        "  {label:<42}{:>14}{:>17}{:>17}",
        cells[0], cells[1], cells[2]
    );
}

pub(crate) fn each(reports: &[Report; 3], f: impl Fn(&Report) -> String) -> [String; 3] {
    [f(&reports[0]), f(&reports[1]), f(&reports[2])]
}

pub(crate) fn ms(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1e3;
    if ms >= 10.0 {
        format!("{ms:.0} ms")
    } else {
        format!("{ms:.1} ms")
    }
}

/// Nearest-rank percentile of a sorted slice.
pub(crate) fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

pub(crate) fn delay_stat(delays: &[Duration], p: Option<f64>) -> String {
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

pub(crate) fn print_report(cfg: &Config, seed: u64, r: &[Report; 3], total: Duration) {
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
