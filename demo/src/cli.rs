//! Command line.

use super::*;

pub(crate) const USAGE: &str = "\
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
pub(crate) struct Config {
    pub(crate) clients: u32,
    pub(crate) fail: f64,
    pub(crate) throttle: f64,
    pub(crate) drop: f64,
    pub(crate) attempts: u32,
    pub(crate) seed: Option<u64>,
    pub(crate) pushback: Duration,
    pub(crate) redis: Option<String>,
    pub(crate) processes: u32,
    /// Hidden: this process is worker N of a `--redis` fleet.
    pub(crate) worker: Option<u32>,
    /// Hidden: the Redis key prefix a fleet's workers share.
    pub(crate) prefix: String,
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

pub(crate) enum Cli {
    Run(Config),
    Help,
}

pub(crate) fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Cli, String> {
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

pub(crate) fn parse_int(flag: &str, value: &str, min: u64, max: u64) -> Result<u64, String> {
    match value.trim().parse::<u64>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(format!(
            "{flag}: {value:?} is not a whole number from {min} to {max}"
        )),
    }
}

pub(crate) fn parse_rate(flag: &str, value: &str) -> Result<f64, String> {
    match value.trim().parse::<f64>() {
        Ok(f) if f.is_finite() && (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(format!(
            "{flag}: {value:?} is not a probability (a number from 0 to 1)"
        )),
    }
}
