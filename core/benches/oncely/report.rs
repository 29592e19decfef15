//! The report: criterion medians, ratios and targets.

use super::*;

pub(crate) fn criterion_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return PathBuf::from(home);
    }
    if let Some(target) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(target).join("criterion");
    }
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../target/criterion"))
}

/// The median time per iteration, in ns, of `group/id` from the last run.
pub(crate) fn median(id: &str) -> Option<f64> {
    let path = criterion_dir().join(id).join("new/estimates.json");
    let text = std::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v["median"]["point_estimate"].as_f64()
}

pub(crate) fn fmt_ns(v: Option<f64>) -> String {
    match v {
        Some(x) if x >= 1e6 => format!("{:.2} ms", x / 1e6),
        Some(x) if x >= 100.0 => format!("{x:.0} ns"),
        Some(x) => format!("{x:.2} ns"),
        None => "—".into(),
    }
}

pub(crate) fn fmt_ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 && a / b < 0.01 => format!("1/{:.0}", b / a),
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
        _ => "—".into(),
    }
}

pub(crate) fn verdict(value: Option<f64>, target: f64) -> &'static str {
    match value {
        Some(v) if v <= target => "met",
        Some(_) => "MISSED",
        None => "—",
    }
}

pub(crate) struct Report {
    lines: Vec<String>,
}

impl Report {
    fn row(&mut self, cells: &[String]) {
        self.lines.push(format!("| {} |", cells.join(" | ")));
    }
}

pub(crate) fn report(inserts: Option<&[(&'static str, InsertResult)]>) -> String {
    let mut r = Report { lines: Vec::new() };
    let s = |x: &str| x.to_string();
    r.row(&[
        s("benchmark"),
        s("oncely"),
        s("peer"),
        s("peer time"),
        s("oncely / peer"),
        s("target"),
        s("result"),
    ]);
    r.row(&[
        s("---"),
        s("---:"),
        s("---"),
        s("---:"),
        s("---:"),
        s("---"),
        s("---"),
    ]);

    // 1
    let delay = median("backoff/oncely_delay_after");
    let decide = median("backoff/oncely_on_failure");
    let backon_next = median("backoff/backon_build_next");
    r.row(&[
        s("1. `delay_after` (seeded)"),
        fmt_ns(delay),
        s("backon build + next"),
        fmt_ns(backon_next),
        fmt_ratio(delay, backon_next),
        s("—"),
        s("—"),
    ]);
    r.row(&[
        s("1. `RetryState::on_failure`"),
        fmt_ns(decide),
        s("backon build + next"),
        fmt_ns(backon_next),
        fmt_ratio(decide, backon_next),
        s("—"),
        s("—"),
    ]);

    // 2
    let floor = median("retry_ok/floor_direct");
    let ok = median("retry_ok/oncely");
    let backon = median("retry_ok/backon");
    let net = |x: Option<f64>, f: Option<f64>| Some(x? - f?);
    let (ok_net, backon_net) = (net(ok, floor), net(backon, floor));
    r.row(&[
        s("2. retry, success (absolute)"),
        fmt_ns(ok),
        s("backon"),
        fmt_ns(backon),
        fmt_ratio(ok, backon),
        s("—"),
        format!("floor {}", fmt_ns(floor)),
    ]);
    r.row(&[
        s("2. retry, success (net of floor)"),
        fmt_ns(ok_net),
        s("backon"),
        fmt_ns(backon_net),
        fmt_ratio(ok_net, backon_net),
        s("≤ 2 ns net"),
        s(verdict(ok_net, 2.0)),
    ]);

    // 3
    let floor = median("retry_ffs/floor_direct");
    let ffs = median("retry_ffs/oncely");
    for (peer, id) in [
        ("backon, no-op sleeper", "retry_ffs/backon_noop_sleep"),
        ("backon, tokio sleeper", "retry_ffs/backon_tokio_sleep"),
    ] {
        let p = median(id);
        r.row(&[
            s("3. fail, fail, succeed (0 delays)"),
            fmt_ns(ffs),
            s(peer),
            fmt_ns(p),
            fmt_ratio(ffs, p),
            s("≤ 30 ns"),
            format!("{} (floor {})", verdict(ffs, 30.0), fmt_ns(floor)),
        ]);
    }

    // 4
    let replay = median("replay/oncely");
    for (peer, id) in [
        ("moka `get_with` (key cloned)", "replay/moka_get_with"),
        ("moka `get_with_by_ref`", "replay/moka_get_with_by_ref"),
        ("naive Mutex<HashMap<_, Shared>>", "replay/naive_shared"),
        (
            "floor: Mutex<HashMap<String, u64>>",
            "replay/floor_mutex_map",
        ),
    ] {
        let p = median(id);
        r.row(&[
            s("4. `execute`, completed key replayed"),
            fmt_ns(replay),
            s(peer),
            fmt_ns(p),
            fmt_ratio(replay, p),
            s("≤ 60 ns"),
            s(verdict(replay, 60.0)),
        ]);
    }

    // 5
    let miss = median("miss/oncely");
    for (peer, id) in [
        ("moka `get_with_by_ref`", "miss/moka_get_with_by_ref"),
        ("naive Mutex<HashMap<_, Shared>>", "miss/naive_shared"),
        ("floor: Mutex<HashMap<String, u64>>", "miss/floor_mutex_map"),
    ] {
        let p = median(id);
        r.row(&[
            s("5. `execute`, miss (lead + complete)"),
            fmt_ns(miss),
            s(peer),
            fmt_ns(p),
            fmt_ratio(miss, p),
            s("—"),
            s("—"),
        ]);
    }

    // 6
    let per = |id: &str| median(id).map(|x| x / WAITERS as f64);
    let waiter = per("coalesce_10k/oncely");
    for (peer, id) in [
        ("moka `get_with`", "coalesce_10k/moka_get_with"),
        (
            "naive Mutex<HashMap<_, Shared>>",
            "coalesce_10k/naive_shared",
        ),
        (
            "floor: Shared gate, no map",
            "coalesce_10k/floor_shared_gate",
        ),
    ] {
        let p = per(id);
        r.row(&[
            s("6. 10k waiters on one key, per waiter"),
            fmt_ns(waiter),
            s(peer),
            fmt_ns(p),
            fmt_ratio(waiter, p),
            s("≤ 300 ns"),
            s(verdict(waiter, 300.0)),
        ]);
    }

    // 7
    if let Some(ins) = inserts {
        let get = |name: &str| ins.iter().find(|(n, _)| *n == name).map(|(_, r)| *r);
        let o = get("oncely");
        for peer in ["moka", "moka_ttl", "floor_mutex_map"] {
            let p = get(peer);
            let label = match peer {
                "moka" => "moka `get_with_by_ref`",
                "moka_ttl" => "moka, `time_to_live` 24 h",
                _ => "floor: Mutex<HashMap<String, u64>>",
            };
            r.row(&[
                s("7. 1M new keys, time per key"),
                fmt_ns(o.map(|x| x.ns_per_key)),
                s(label),
                fmt_ns(p.map(|x| x.ns_per_key)),
                fmt_ratio(o.map(|x| x.ns_per_key), p.map(|x| x.ns_per_key)),
                s("≤ 900 ns"),
                s(verdict(o.map(|x| x.ns_per_key), 900.0)),
            ]);
            r.row(&[
                s("7. 1M new keys, heap B/entry beyond key + value"),
                o.map_or("—".into(), |x| format!("{:.0} B", x.overhead_per_entry)),
                s(label),
                p.map_or("—".into(), |x| format!("{:.0} B", x.overhead_per_entry)),
                fmt_ratio(
                    o.map(|x| x.overhead_per_entry),
                    p.map(|x| x.overhead_per_entry),
                ),
                s("≤ 200 B"),
                s(verdict(o.map(|x| x.overhead_per_entry), 200.0)),
            ]);
        }
    }
    r.lines.join("\n")
}
