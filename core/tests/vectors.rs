//! Runs the shared cross-language test vectors (`tests/vectors/*.json`, described in
//! `tests/vectors/README.md`) through the public API of oncely.
//!
//! The expected values are computed independently of this crate by
//! `tests/vectors/generate.py` (from SPEC.md and the documented formulas); the Python
//! and Node suites read the same files. Each test reads one file, checks every case and
//! reports all the cases that disagree, each with its comment, at the end.

use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use oncely::{
    canonical_json, classify, classify_failure, duration_from_millis_f64, extract, fingerprint,
    fingerprint_bytes, parse_pushback_ms, parse_retry_after, CallFacts, Code, Error, Failure,
    IdempotencyKey, ManualClock, RawFailure, RawValue, ReasonCodes, RetryBudget, RetryPolicy,
    ScopedKey, Scripted, ServerDelay, Simulation, Timeline,
};
use serde_json::{json, Value};

// ----------------------------------------------------------------------------------------
// Loading and reporting
// ----------------------------------------------------------------------------------------

fn vectors_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/vectors")
}

/// Reads `tests/vectors/<name>`: a JSON array of case objects.
fn load(name: &str) -> Vec<Value> {
    let path = vectors_dir().join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let value: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{} is not valid JSON: {e}", path.display()));
    match value {
        Value::Array(cases) => {
            assert!(!cases.is_empty(), "{name} has no cases");
            for (i, case) in cases.iter().enumerate() {
                assert!(
                    case.is_object(),
                    "{name} case #{i} is not an object: {case}"
                );
            }
            cases
        }
        other => panic!("{name} must hold a JSON array of cases, not {other}"),
    }
}

/// Collects the disagreements of one file and fails once, listing them all.
struct Report {
    file: &'static str,
    cases: usize,
    checks: usize,
    skipped: usize,
    failures: Vec<String>,
}

impl Report {
    fn new(file: &'static str, cases: usize) -> Self {
        Report {
            file,
            cases,
            checks: 0,
            skipped: 0,
            failures: Vec::new(),
        }
    }

    /// Records a failure unless `got == want`.
    fn check(&mut self, i: usize, case: &Value, what: &str, got: &Value, want: &Value) {
        self.checks += 1;
        if got != want {
            self.fail(i, case, &format!("{what}: got {got}, want {want}"));
        }
    }

    /// Counts a case that Rust cannot express (a lone surrogate: a Rust `str` is always
    /// UTF-8); the Python and Node suites run it.
    fn skip(&mut self) {
        self.checks += 1;
        self.skipped += 1;
    }

    fn fail(&mut self, i: usize, case: &Value, message: &str) {
        let comment = case
            .get("comment")
            .and_then(Value::as_str)
            .unwrap_or("(no comment)");
        let mut shown = case.to_string();
        if shown.chars().count() > 400 {
            shown = shown.chars().take(400).collect::<String>() + " …";
        }
        self.failures.push(format!(
            "case #{i} \"{comment}\"\n    {message}\n    case: {shown}"
        ));
    }

    fn finish(self) {
        assert!(
            self.skipped < self.cases,
            "{}: every case was skipped",
            self.file
        );
        assert!(
            self.checks >= self.cases,
            "{}: some cases were not checked",
            self.file
        );
        if !self.failures.is_empty() {
            let mut msg = format!(
                "{} of {} cases in tests/vectors/{} disagree with the code \
                 (the vectors follow SPEC.md; a failure here is a bug in the code or in the \
                 vector — see the case comment):\n",
                self.failures.len(),
                self.cases,
                self.file
            );
            for f in &self.failures {
                let _ = writeln!(msg, "  {f}");
            }
            panic!("{msg}");
        }
    }
}

// ----------------------------------------------------------------------------------------
// Field access (a malformed vector panics with the field's name)
// ----------------------------------------------------------------------------------------

fn field<'a>(v: &'a Value, key: &str) -> &'a Value {
    v.get(key)
        .unwrap_or_else(|| panic!("vector field {key:?} missing in {v}"))
}

fn str_of<'a>(v: &'a Value, key: &str) -> &'a str {
    field(v, key)
        .as_str()
        .unwrap_or_else(|| panic!("vector field {key:?} must be a string in {v}"))
}

/// A string field, given as text (`key`) or as UTF-16 code units (`key_utf16`); `None`
/// when the code units hold a lone surrogate, which a Rust `String` cannot.
fn text_of(v: &Value, key: &str) -> Option<String> {
    if let Some(s) = v.get(key) {
        return Some(s.as_str().expect("a string field").to_owned());
    }
    let units: Vec<u16> = field(v, &format!("{key}_utf16"))
        .as_array()
        .expect("code units are an array")
        .iter()
        .map(|u| u16::try_from(u.as_u64().expect("a code unit")).expect("a u16"))
        .collect();
    String::from_utf16(&units).ok()
}

fn u64_of(v: &Value, key: &str) -> u64 {
    field(v, key)
        .as_u64()
        .unwrap_or_else(|| panic!("vector field {key:?} must be a non-negative integer in {v}"))
}

fn u32_of(v: &Value, key: &str) -> u32 {
    u32::try_from(u64_of(v, key)).unwrap_or_else(|_| panic!("{key:?} exceeds u32 in {v}"))
}

fn f64_of(v: &Value, key: &str) -> f64 {
    field(v, key)
        .as_f64()
        .unwrap_or_else(|| panic!("vector field {key:?} must be a number in {v}"))
}

fn bool_of(v: &Value, key: &str) -> bool {
    field(v, key)
        .as_bool()
        .unwrap_or_else(|| panic!("vector field {key:?} must be a boolean in {v}"))
}

/// The JSON form of an error in the vectors: `{"kind": ..., "field": ...}`.
fn error_json(e: &Error) -> Value {
    match e {
        Error::InvalidArgument { field, .. } => {
            json!({"kind": "invalid_argument", "field": field})
        }
        Error::MissingKey => json!({"kind": "missing_key"}),
        other => json!({"kind": format!("unexpected: {other:?}")}),
    }
}

/// A duration as whole milliseconds, or a marker that makes the comparison fail.
fn ms_json(d: Duration) -> Value {
    if d.subsec_nanos() % 1_000_000 == 0 {
        json!(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    } else {
        json!(format!("{d:?} is not a whole number of milliseconds"))
    }
}

/// A delay field in milliseconds: a non-negative integer becomes a Duration directly;
/// anything else goes through the bindings' converter, whose error names `name`.
fn millis_field(p: &Value, key: &str, name: &'static str) -> Result<Duration, Error> {
    let v = field(p, key);
    match v.as_u64() {
        Some(ms) => Ok(Duration::from_millis(ms)),
        None => duration_from_millis_f64(
            name,
            v.as_f64()
                .unwrap_or_else(|| panic!("{key:?} must be a number in {p}")),
        ),
    }
}

/// Builds and validates the policy of a vector.
fn policy_of(p: &Value) -> Result<RetryPolicy, Error> {
    let mut policy = RetryPolicy::new()
        .with_max_attempts(u32_of(p, "max_attempts"))
        .with_base_delay(millis_field(p, "base_delay_ms", "base_delay")?)
        .with_max_delay(millis_field(p, "max_delay_ms", "max_delay")?)
        .with_multiplier(f64_of(p, "multiplier"))
        .with_jitter(f64_of(p, "jitter"));
    match field(p, "seed") {
        Value::Null => {}
        s => {
            policy = policy.with_seed(
                s.as_u64()
                    .unwrap_or_else(|| panic!("seed must be null or an integer in {p}")),
            )
        }
    }
    if p.get("min_attempt_ms").is_some() {
        policy = policy.with_min_attempt(millis_field(p, "min_attempt_ms", "min_attempt")?);
    }
    policy.validate()?;
    Ok(policy)
}

fn code_of(name: &str) -> Code {
    let code = Code::from_str(name).unwrap_or_else(|e| panic!("bad code {name:?}: {e}"));
    assert_eq!(
        code.as_str(),
        name,
        "code names in the vectors are canonical"
    );
    code
}

// ----------------------------------------------------------------------------------------
// 1. backoff.json
// ----------------------------------------------------------------------------------------

#[test]
fn backoff() {
    let cases = load("backoff.json");
    let mut r = Report::new("backoff.json", cases.len());
    for (i, case) in cases.iter().enumerate() {
        let p = field(case, "policy");
        let policy = policy_of(p);
        if let Some(want) = case.get("error") {
            let got = match &policy {
                Ok(_) => json!("the policy was accepted"),
                Err(e) => error_json(e),
            };
            r.check(i, case, "validation error", &got, want);
            continue;
        }
        let policy = match policy {
            Ok(p) => p,
            Err(e) => {
                r.fail(i, case, &format!("valid policy rejected: {e}"));
                continue;
            }
        };
        let seed = policy.seed();
        if seed.is_none() {
            assert_eq!(f64_of(p, "jitter"), 0.0, "unseeded vectors have no jitter");
        }
        let delays = field(case, "delays")
            .as_array()
            .expect("delays is an array");
        assert!(!delays.is_empty(), "case #{i} has no delays");
        for d in delays {
            let n = u32_of(d, "failed_attempt");
            let want = json!(u64_of(d, "delay_ms"));
            if let Some(seed) = seed {
                let got = ms_json(policy.delay_with_seed(n, seed));
                r.check(
                    i,
                    case,
                    &format!("delay_with_seed({n}, {seed})"),
                    &got,
                    &want,
                );
            }
            // Seeded or without jitter, delay_after is deterministic too.
            let got = ms_json(policy.delay_after(n));
            r.check(i, case, &format!("delay_after({n})"), &got, &want);
        }
        if let Some(want) = case.get("sequence_ms") {
            let got: Vec<Value> = policy.backoff().map(ms_json).collect();
            r.check(i, case, "backoff() sequence", &Value::Array(got), want);
            let len = policy.backoff().len();
            r.check(
                i,
                case,
                "backoff().len()",
                &json!(len),
                &json!(policy.max_attempts().saturating_sub(1)),
            );
        }
    }
    r.finish();
}

// ----------------------------------------------------------------------------------------
// 2. classification.json
// ----------------------------------------------------------------------------------------

#[test]
fn classification() {
    let cases = load("classification.json");
    let mut r = Report::new("classification.json", cases.len());
    let mut seen = BTreeSet::new();
    for (i, case) in cases.iter().enumerate() {
        let code = code_of(str_of(case, "code"));
        let facts = CallFacts {
            safe: bool_of(case, "safe"),
            rereads: bool_of(case, "rereads"),
            transient_internal: bool_of(case, "transient_internal"),
        };
        let c = match case.get("server_delay") {
            // Rows with a server delay go through classify_failure.
            Some(sd) => classify_failure(failure_of(code, sd), facts),
            None => {
                seen.insert((code, facts.safe, facts.rereads, facts.transient_internal));
                let c = classify(code, facts);
                let same = classify_failure(Failure::new(code), facts);
                r.check(
                    i,
                    case,
                    "classify_failure without a delay",
                    &json!(same.rule.as_str()),
                    &json!(c.rule.as_str()),
                );
                c
            }
        };
        let got = json!({"retryable": c.retryable, "rule": c.rule.as_str()});
        let want = json!({"retryable": field(case, "retryable"), "rule": field(case, "rule")});
        r.check(i, case, "classify", &got, &want);
        // The Display form is the stable name too.
        r.check(
            i,
            case,
            "rule Display",
            &json!(c.rule.to_string()),
            field(case, "rule"),
        );
    }
    // Every code under every combination of facts.
    assert_eq!(
        seen.len(),
        Code::ALL.len() * 8,
        "classification.json is incomplete"
    );
    r.finish();
}

// ----------------------------------------------------------------------------------------
// 3. http.json
// ----------------------------------------------------------------------------------------

#[test]
fn http() {
    let cases = load("http.json");
    let mut r = Report::new("http.json", cases.len());
    for (i, case) in cases.iter().enumerate() {
        let status = u16::try_from(u64_of(case, "status")).expect("status fits u16");
        let got = json!(Code::from_http(status).as_str());
        r.check(
            i,
            case,
            &format!("from_http({status})"),
            &got,
            field(case, "code"),
        );
    }
    r.finish();
}

// ----------------------------------------------------------------------------------------
// 4. retry_after.json
// ----------------------------------------------------------------------------------------

fn server_delay_json(parsed: Result<ServerDelay, Error>) -> Value {
    match parsed {
        Ok(ServerDelay::After(d)) => json!({"delay_ms": ms_json(d)}),
        Ok(ServerDelay::DoNotRetry) => json!({"do_not_retry": true}),
        Err(e) => json!({"error": error_json(&e)}),
    }
}

/// The expected outcome: exactly one of `delay_ms`, `do_not_retry`, `error`.
fn expected_outcome(case: &Value) -> Value {
    let mut want = serde_json::Map::new();
    for key in ["delay_ms", "do_not_retry", "error"] {
        if let Some(v) = case.get(key) {
            want.insert(key.to_owned(), v.clone());
        }
    }
    assert_eq!(want.len(), 1, "exactly one expected outcome in {case}");
    Value::Object(want)
}

#[test]
fn retry_after() {
    let cases = load("retry_after.json");
    let mut r = Report::new("retry_after.json", cases.len());
    for (i, case) in cases.iter().enumerate() {
        let value = str_of(case, "value");
        let got = match str_of(case, "header") {
            "Retry-After" => {
                let now: SystemTime = UNIX_EPOCH + Duration::from_secs(u64_of(case, "now"));
                server_delay_json(parse_retry_after(value, now))
            }
            "grpc-retry-pushback-ms" => server_delay_json(parse_pushback_ms(value)),
            other => panic!("unknown header {other:?}"),
        };
        if let Some(least) = case.get("delay_ms_at_least") {
            // A saturated delay: longer than any deadline, not a whole number to compare.
            let least = least.as_u64().expect("delay_ms_at_least is an integer");
            let ok = got
                .get("delay_ms")
                .and_then(Value::as_u64)
                .is_some_and(|ms| ms >= least);
            r.check(i, case, "saturated delay", &json!(ok), &json!(true));
            continue;
        }
        r.check(i, case, "parsed", &got, &expected_outcome(case));
    }
    r.finish();
}

// ----------------------------------------------------------------------------------------
// 5. keys.json
// ----------------------------------------------------------------------------------------

#[test]
fn keys() {
    let cases = load("keys.json");
    let mut r = Report::new("keys.json", cases.len());
    let mut scoped_seen: HashMap<String, (String, String, String)> = HashMap::new();
    let mut derived_seen: HashMap<String, (String, String)> = HashMap::new();
    for (i, case) in cases.iter().enumerate() {
        match str_of(case, "op") {
            "parse" => {
                let Some(key) = text_of(case, "key") else {
                    r.skip();
                    continue;
                };
                let key = key.as_str();
                let got = match IdempotencyKey::parse(key) {
                    Ok(k) if k.as_str() == key => json!({"valid": true}),
                    Ok(k) => json!({"valid": format!("changed to {:?}", k.as_str())}),
                    Err(e) => json!({"error": error_json(&e)}),
                };
                let want = match case.get("valid") {
                    Some(v) => json!({ "valid": v }),
                    None => json!({"error": field(case, "error")}),
                };
                r.check(i, case, "IdempotencyKey::parse", &got, &want);
            }
            "derive" => {
                let (Some(b), Some(o)) = (text_of(case, "business_id"), text_of(case, "operation"))
                else {
                    r.skip();
                    continue;
                };
                let (b, o) = (b.as_str(), o.as_str());
                let got = match IdempotencyKey::derive(b, o) {
                    Ok(k) => {
                        // A derived key is itself a valid key (a UUID, version 8).
                        let reparsed = IdempotencyKey::parse(k.as_str()).map(|_| ());
                        r.check(
                            i,
                            case,
                            "derived key parses",
                            &json!(reparsed.is_ok()),
                            &json!(true),
                        );
                        if let Some(prev) = derived_seen.insert(k.to_string(), (b.into(), o.into()))
                        {
                            if prev != (b.to_owned(), o.to_owned()) {
                                r.fail(i, case, &format!("same derived key as {prev:?}"));
                            }
                        }
                        json!({"key": k.as_str()})
                    }
                    Err(e) => json!({"error": error_json(&e)}),
                };
                let want = match case.get("key") {
                    Some(k) => json!({ "key": k }),
                    None => json!({"error": field(case, "error")}),
                };
                r.check(i, case, "IdempotencyKey::derive", &got, &want);
            }
            "scope" => {
                let (Some(t), Some(m), Some(k)) = (
                    text_of(case, "tenant"),
                    text_of(case, "method"),
                    text_of(case, "key"),
                ) else {
                    r.skip();
                    continue;
                };
                let (t, m, k) = (t.as_str(), m.as_str(), k.as_str());
                let got = match IdempotencyKey::parse(k).and_then(|key| ScopedKey::new(t, m, &key))
                {
                    Ok(s) => {
                        // Only Rust has ScopedKey::parse: it gives the same key back.
                        let reparsed = ScopedKey::parse(s.as_str()).map(|p| p == s);
                        r.check(
                            i,
                            case,
                            "ScopedKey::parse(scoped) round trip",
                            &json!(reparsed.ok()),
                            &json!(Some(true)),
                        );
                        let triple = (t.to_owned(), m.to_owned(), k.to_owned());
                        if let Some(prev) = scoped_seen.insert(s.to_string(), triple.clone()) {
                            if prev != triple {
                                r.fail(
                                    i,
                                    case,
                                    &format!("not injective: same scoped key as {prev:?}"),
                                );
                            }
                        }
                        json!({"scoped": s.as_str()})
                    }
                    Err(e) => json!({"error": error_json(&e)}),
                };
                let want = match case.get("scoped") {
                    Some(s) => json!({ "scoped": s }),
                    None => json!({"error": field(case, "error")}),
                };
                r.check(i, case, "ScopedKey::new", &got, &want);
            }
            "parse_scoped" => {
                let text = str_of(case, "scoped");
                let got = match ScopedKey::parse(text) {
                    Ok(k) if k.as_str() == text => json!({"valid": true}),
                    Ok(k) => json!({"valid": format!("changed to {:?}", k.as_str())}),
                    Err(e) => json!({"error": error_json(&e)}),
                };
                let want = match case.get("valid") {
                    Some(v) => json!({ "valid": v }),
                    None => json!({"error": field(case, "error")}),
                };
                r.check(i, case, "ScopedKey::parse", &got, &want);
            }
            other => panic!("unknown op {other:?} in keys.json"),
        }
    }
    r.finish();
}

// ----------------------------------------------------------------------------------------
// 6. fingerprints.json
// ----------------------------------------------------------------------------------------

#[test]
fn fingerprints() {
    let cases = load("fingerprints.json");
    let mut r = Report::new("fingerprints.json", cases.len());
    for (i, case) in cases.iter().enumerate() {
        let value = match fingerprint_input(case) {
            Input::Value(v) => v,
            Input::Refused(got) => {
                r.check(i, case, "refused", &got, field(case, "error"));
                continue;
            }
            Input::Skip => {
                r.skip();
                continue;
            }
        };
        let value = &value;
        if let Some(want) = case.get("error") {
            let got = match canonical_json(value) {
                Ok(_) => json!("accepted"),
                Err(e) => error_json(&e),
            };
            r.check(i, case, "canonical_json refused", &got, want);
            let got = fingerprint(value).map_or_else(|e| error_json(&e), |_| json!("accepted"));
            r.check(i, case, "fingerprint refused", &got, want);
            continue;
        }
        let canonical = field(case, "canonical");
        let sha = field(case, "sha256");
        let got = match canonical_json(value) {
            Ok(bytes) => match String::from_utf8(bytes) {
                Ok(s) => json!(s),
                Err(e) => json!(format!("not UTF-8: {e}")),
            },
            Err(e) => json!(format!("error: {e}")),
        };
        r.check(i, case, "canonical_json", &got, canonical);
        let got = match fingerprint(value) {
            Ok(s) => json!(s),
            Err(e) => json!(format!("error: {e}")),
        };
        r.check(i, case, "fingerprint", &got, sha);
        let bytes = canonical
            .as_str()
            .expect("canonical is a string")
            .as_bytes();
        r.check(
            i,
            case,
            "fingerprint_bytes(canonical)",
            &json!(fingerprint_bytes(bytes)),
            sha,
        );
    }
    r.finish();
}

enum Input {
    Value(Value),
    /// The input cannot be built: the error that refused it, as in the vectors.
    Refused(Value),
    /// Rust cannot express it (a lone surrogate).
    Skip,
}

/// The value of a fingerprints.json case: `value`, or `value_json` read by serde_json
/// (the Rust parser: its refusal is the refusal), `value_special` (a NaN or infinite
/// float), `value_utf16` or `nested`.
fn fingerprint_input(case: &Value) -> Input {
    if let Some(v) = case.get("value") {
        return Input::Value(v.clone());
    }
    if let Some(text) = case.get("value_json") {
        return match serde_json::from_str(text.as_str().expect("value_json is text")) {
            Ok(v) => Input::Value(v),
            Err(_) => Input::Refused(json!({"kind": "invalid_argument", "field": "value"})),
        };
    }
    if let Some(sp) = case.get("value_special") {
        let x = match str_of(sp, "float") {
            "NaN" => f64::NAN,
            "Infinity" => f64::INFINITY,
            "-Infinity" => f64::NEG_INFINITY,
            other => panic!("unknown float {other:?}"),
        };
        // serde_json's Value cannot hold these: serialize the float itself.
        let got = match str_of(sp, "in") {
            "top" => canonical_json(&x),
            "array" => canonical_json(&[x]),
            "object" => canonical_json(&HashMap::from([("x", x)])),
            other => panic!("unknown place {other:?}"),
        };
        return Input::Refused(got.map_or_else(|e| error_json(&e), |_| json!("accepted")));
    }
    if let Some(u) = case.get("value_utf16") {
        let Some(s) = text_of(u, "string") else {
            return Input::Skip;
        };
        return Input::Value(match str_of(u, "in") {
            "top" => json!(s),
            "key" => json!({ s: 0 }),
            other => panic!("unknown place {other:?}"),
        });
    }
    let n = field(case, "nested");
    let mut v = match str_of(n, "kind") {
        "array" => json!([]),
        _ => json!({}),
    };
    for _ in 1..u64_of(n, "depth") {
        v = match str_of(n, "kind") {
            "array" => json!([v]),
            _ => json!({ "a": v }),
        };
    }
    Input::Value(v)
}

// ----------------------------------------------------------------------------------------
// 7. retry_decisions.json
// ----------------------------------------------------------------------------------------

fn scripted_of(step: &Value) -> Scripted {
    let takes = Duration::from_millis(u64_of(step, "takes_ms"));
    let outcome = str_of(step, "outcome");
    if outcome == "ok" {
        assert!(
            field(step, "server_delay").is_null(),
            "a success has no server delay"
        );
        return Scripted::ok().taking(takes);
    }
    let failure = failure_of(code_of(outcome), field(step, "server_delay"));
    Scripted::fail(failure).taking(takes)
}

/// A failure with `code` and the vectors' `server_delay` (null, "do_not_retry" or
/// `{"after_ms": n}`).
fn failure_of(code: Code, server_delay: &Value) -> Failure {
    let failure = Failure::new(code);
    match server_delay {
        Value::Null => failure,
        Value::String(s) if s == "do_not_retry" => {
            failure.with_server_delay(ServerDelay::DoNotRetry)
        }
        d => failure.with_server_delay(ServerDelay::After(Duration::from_millis(u64_of(
            d, "after_ms",
        )))),
    }
}

fn timeline_json(t: &Timeline) -> Value {
    json!({
        "attempts": t.attempts(),
        "delays_ms": t.delays().into_iter().map(ms_json).collect::<Vec<_>>(),
        "result": match t.result {
            Ok(()) => "ok",
            Err(reason) => reason.as_str(),
        },
        "elapsed_ms": ms_json(t.elapsed),
    })
}

#[test]
fn retry_decisions() {
    let cases = load("retry_decisions.json");
    let mut r = Report::new("retry_decisions.json", cases.len());
    for (i, case) in cases.iter().enumerate() {
        let policy = policy_of(field(case, "policy"))
            .unwrap_or_else(|e| panic!("case #{i}: invalid policy in the vector: {e}"));
        let facts = CallFacts {
            safe: bool_of(case, "safe"),
            rereads: bool_of(case, "rereads"),
            transient_internal: bool_of(case, "transient_internal"),
        };
        let mut sim = Simulation::new(policy).facts(facts);
        match field(case, "deadline_ms") {
            Value::Null => {}
            _ => sim = sim.deadline(Duration::from_millis(u64_of(case, "deadline_ms"))),
        }
        let script: Vec<Scripted> = field(case, "script")
            .as_array()
            .expect("script is an array")
            .iter()
            .map(scripted_of)
            .collect();
        assert!(!script.is_empty(), "case #{i} has an empty script");
        let t = sim.run(&script);
        r.check(
            i,
            case,
            "timeline",
            &timeline_json(&t),
            field(case, "expect"),
        );
        // Attempts are numbered 1, 2, … in order.
        let numbers: Vec<u32> = t.steps.iter().map(|s| s.attempt).collect();
        let want: Vec<u32> = (1..=t.attempts()).collect();
        r.check(i, case, "attempt numbers", &json!(numbers), &json!(want));
    }
    r.finish();
}

// ----------------------------------------------------------------------------------------
// budget.json
// ----------------------------------------------------------------------------------------

#[test]
fn budget() {
    let cases = load("budget.json");
    let mut r = Report::new("budget.json", cases.len());
    for (i, case) in cases.iter().enumerate() {
        let b = field(case, "budget");
        let window = Duration::from_millis(u64_of(b, "window_ms"));
        let made = RetryBudget::new(f64_of(b, "ratio"), window, u32_of(b, "min_per_sec"));
        if let Some(want) = case.get("error") {
            let got = made.map_or_else(|e| error_json(&e), |_| json!("accepted"));
            r.check(i, case, "RetryBudget::new refused", &got, want);
            continue;
        }
        let clock = ManualClock::new();
        let budget = made.expect("a valid budget").with_clock(clock.clone());
        for step in field(case, "steps").as_array().expect("steps") {
            clock.set(Duration::from_millis(u64_of(step, "at_ms")));
            if let Some(n) = step.get("requests") {
                for _ in 0..n.as_u64().unwrap() {
                    budget.record_request();
                }
                // Places the requests in the window now (see tests/vectors/README.md).
                budget.snapshot();
            } else if let Some(n) = step.get("withdraw") {
                let results: Vec<bool> = (0..n.as_u64().unwrap())
                    .map(|_| budget.try_withdraw())
                    .collect();
                let granted = results.iter().take_while(|g| **g).count();
                let in_order = results[granted..].iter().all(|g| !g);
                r.check(
                    i,
                    case,
                    "withdrawals",
                    &json!([granted, in_order]),
                    &json!([field(step, "granted"), true]),
                );
            } else {
                let s = budget.snapshot();
                let got =
                    json!({"requests": s.requests, "retries": s.retries, "allowed": s.allowed});
                r.check(
                    i,
                    case,
                    &format!("snapshot at {}", field(step, "at_ms")),
                    &got,
                    field(step, "snapshot"),
                );
            }
        }
    }
    r.finish();
}

// ----------------------------------------------------------------------------------------
// extraction.json
// ----------------------------------------------------------------------------------------

fn raw_value(v: Option<&Value>) -> Option<RawValue> {
    match v? {
        Value::String(s) => Some(RawValue::Text(s.clone())),
        Value::Number(n) => {
            Some(RawValue::Int(n.as_i64().unwrap_or_else(|| {
                panic!("vector number {n} must be an integer")
            })))
        }
        Value::Null => None,
        other => panic!("vector code/status must be a string or a number, not {other}"),
    }
}

fn pairs(v: Option<&Value>) -> Vec<(String, String)> {
    v.and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| {
                    (
                        k.clone(),
                        v.as_str().expect("header values are strings").to_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// What a binding reads off the foreign error a vector shape describes.
fn raw_of(shape: &Value) -> RawFailure {
    let response = shape.get("response");
    let of = |key: &str| shape.get(key).or_else(|| response.and_then(|r| r.get(key)));
    let mut headers = pairs(shape.get("headers"));
    headers.extend(pairs(response.and_then(|r| r.get("headers"))));
    headers.extend(pairs(shape.get("metadata")));
    RawFailure {
        code: raw_value(shape.get("code")),
        status: raw_value(of("status")),
        status_code: raw_value(of("status_code")),
        type_names: shape
            .get("names")
            .and_then(Value::as_array)
            .map(|a| a.iter().map(|n| n.as_str().unwrap().to_owned()).collect())
            .unwrap_or_default(),
        headers,
        cause: shape.get("cause").map(|c| Box::new(raw_of(c))),
        ..RawFailure::default()
    }
}

#[test]
fn extraction() {
    let cases = load("extraction.json");
    let mut report = Report::new("extraction.json", cases.len());
    for (i, case) in cases.iter().enumerate() {
        let mut reasons = ReasonCodes::default();
        if let Some(extra) = case.get("reasons").and_then(Value::as_object) {
            for (name, code) in extra {
                reasons
                    .register(name, code_of(code.as_str().unwrap()))
                    .unwrap();
            }
        }
        let f = extract(&raw_of(field(case, "error")), &reasons, SystemTime::now());
        report.check(
            i,
            case,
            "code",
            &json!(f.code.as_str()),
            field(case, "code"),
        );
        let c = classify(f.code, CallFacts::SAFE);
        report.check(
            i,
            case,
            "retryable",
            &json!(c.retryable),
            field(case, "retryable"),
        );
        report.check(
            i,
            case,
            "rule",
            &json!(c.rule.as_str()),
            field(case, "rule"),
        );
        let (delay, dnr) = match f.server_delay {
            Some(ServerDelay::After(d)) => (ms_json(d), false),
            Some(ServerDelay::DoNotRetry) => (Value::Null, true),
            None => (Value::Null, false),
        };
        report.check(i, case, "delay_ms", &delay, field(case, "delay_ms"));
        report.check(
            i,
            case,
            "do_not_retry",
            &json!(dnr),
            field(case, "do_not_retry"),
        );
    }
    report.finish();
}

// ----------------------------------------------------------------------------------------
// http_server.json — the server contract (SPEC §8); the `sequence` cases run in the
// server adapters' suites (oncely-tower's tests), against a real server.
// ----------------------------------------------------------------------------------------

fn strings_of(v: &Value) -> Option<Vec<String>> {
    v.as_array().map(|a| {
        a.iter()
            .map(|s| s.as_str().expect("a string").to_owned())
            .collect()
    })
}

fn hex_decode(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn hex_encode(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

fn pairs_of(v: &Value) -> Vec<(String, Vec<u8>)> {
    v.as_array()
        .expect("an array of [name, value]")
        .iter()
        .map(|p| {
            (
                p[0].as_str().expect("name").to_owned(),
                p[1].as_str().expect("value").as_bytes().to_vec(),
            )
        })
        .collect()
}

fn error_of(e: &Value) -> Error {
    match str_of(e, "kind") {
        "missing_key" => Error::MissingKey,
        "invalid_argument" => Error::InvalidArgument {
            field: "idempotency_key",
            reason: "bad".into(),
        },
        "fingerprint_mismatch" => Error::FingerprintMismatch,
        "in_progress" => Error::InProgress {
            retry_after: Duration::from_millis(u64_of(e, "retry_after_ms")),
        },
        "lease_lost" => Error::LeaseLost,
        "capacity" => Error::Capacity { max_entries: 10 },
        "unavailable" => Error::Unavailable("down".into()),
        "leader_panicked" => Error::LeaderPanicked("boom".into()),
        "reentrant" => Error::Reentrant { key: "k".into() },
        "result_not_stored" => Error::ResultNotStored {
            key: "k".into(),
            type_name: "T".into(),
        },
        other => panic!("unknown error kind {other:?}"),
    }
}

#[test]
fn http_server() {
    use oncely::http::{self, KeyDecision, ServerConfig, StoredResponse};
    let cases = load("http_server.json");
    let mut r = Report::new("http_server.json", cases.len());
    for (i, case) in cases.iter().enumerate() {
        match str_of(case, "op") {
            "covers" => {
                let mut config = ServerConfig::new();
                if let Some(m) = strings_of(field(case, "methods")) {
                    config = config.methods(m).unwrap();
                }
                let got = config.covers(str_of(case, "method"));
                r.check(i, case, "covered", &json!(got), field(case, "covered"));
            }
            "read_key" => {
                let config = ServerConfig::new().required(bool_of(case, "required"));
                let values = strings_of(field(case, "values")).unwrap();
                let values: Vec<&[u8]> = values.iter().map(|v| v.as_bytes()).collect();
                let got = match config.read_key(str_of(case, "method"), &values) {
                    Ok(KeyDecision::PassThrough) => json!({"pass_through": true}),
                    Ok(KeyDecision::Dedup(k)) => json!({"dedup": k.as_str()}),
                    Err(p) => json!({"problem": {"status": p.status, "type": p.type_uri,
                                                 "code": p.code.as_str()}}),
                };
                r.check(i, case, "decision", &got, field(case, "expect"));
            }
            "scope" => {
                let key = IdempotencyKey::parse(str_of(case, "key")).unwrap();
                let got = http::scope(
                    str_of(case, "tenant"),
                    str_of(case, "method"),
                    str_of(case, "route"),
                    &key,
                )
                .unwrap();
                r.check(
                    i,
                    case,
                    "scoped",
                    &json!(got.as_str()),
                    field(case, "scoped"),
                );
            }
            "fingerprint" => {
                let body = match case.get("body_hex") {
                    Some(h) => hex_decode(h.as_str().unwrap()),
                    None => str_of(case, "body").as_bytes().to_vec(),
                };
                let got = http::request_fingerprint(
                    str_of(case, "method"),
                    str_of(case, "target"),
                    field(case, "content_type").as_str(),
                    &body,
                );
                r.check(
                    i,
                    case,
                    "fingerprint",
                    &json!(got),
                    field(case, "fingerprint"),
                );
            }
            "status" => {
                let got = http::storable_status(u64_of(case, "status") as u16);
                r.check(i, case, "storable", &json!(got), field(case, "storable"));
            }
            "content" => {
                let got = http::has_content(str_of(case, "method"), u64_of(case, "status") as u16);
                r.check(
                    i,
                    case,
                    "has_content",
                    &json!(got),
                    field(case, "has_content"),
                );
            }
            "declared_length" => {
                let config = ServerConfig::new().request_cap(u64_of(case, "request_cap") as usize);
                let got = config.declares_too_large(str_of(case, "value").as_bytes());
                r.check(i, case, "too_large", &json!(got), field(case, "too_large"));
                let length = match http::declared_length(str_of(case, "value").as_bytes()) {
                    None => "none".to_owned(),
                    Some(u64::MAX) => "max".to_owned(),
                    Some(n) => n.to_string(),
                };
                r.check(i, case, "length", &json!(length), field(case, "length"));
            }
            "header" => {
                let mut config = ServerConfig::new();
                if let Some(h) = strings_of(field(case, "stored_headers")) {
                    config = config.stored_headers(h).unwrap();
                }
                let got = config.stores_header(str_of(case, "name"));
                r.check(i, case, "stored", &json!(got), field(case, "stored"));
                let got = config.shares_header(str_of(case, "name"));
                r.check(i, case, "shared", &json!(got), field(case, "shared"));
            }
            "record" => {
                let resp = field(case, "response");
                let record = StoredResponse {
                    status: u64_of(resp, "status") as u16,
                    headers: pairs_of(field(resp, "headers")),
                    body: hex_decode(str_of(resp, "body_hex")),
                    trailers: pairs_of(field(resp, "trailers")),
                };
                let encoded = record.encode();
                r.check(
                    i,
                    case,
                    "encoded",
                    &json!(hex_encode(&encoded)),
                    field(case, "hex"),
                );
                let decoded = StoredResponse::decode(&hex_decode(str_of(case, "hex")));
                r.check(
                    i,
                    case,
                    "decoded",
                    &json!(decoded.as_ref().ok() == Some(&record)),
                    &json!(true),
                );
            }
            "record_decode" => {
                let got = StoredResponse::decode(&hex_decode(str_of(case, "hex")))
                    .map(|_| "decoded".to_owned())
                    .unwrap_or_else(|e| e.code().as_str().to_owned());
                r.check(i, case, "error", &json!(got), field(case, "error"));
            }
            "problem" => {
                let error = error_of(field(case, "error"));
                let p = http::Problem::from_error(&error);
                r.check(
                    i,
                    case,
                    "http_status",
                    &json!(error.http_status()),
                    field(case, "status"),
                );
                r.check(i, case, "status", &json!(p.status), field(case, "status"));
                r.check(i, case, "type", &json!(p.type_uri), field(case, "type"));
                r.check(
                    i,
                    case,
                    "code",
                    &json!(p.code.as_str()),
                    field(case, "code"),
                );
                let headers: serde_json::Map<String, Value> = p
                    .headers()
                    .into_iter()
                    .map(|(n, v)| (n.to_owned(), json!(v)))
                    .collect();
                r.check(
                    i,
                    case,
                    "headers",
                    &Value::Object(headers),
                    field(case, "headers"),
                );
                let body: Value = serde_json::from_slice(&p.body()).unwrap();
                let want = json!({"type": p.type_uri, "title": p.title, "status": p.status,
                                  "detail": p.detail, "code": p.code.as_str()});
                r.check(i, case, "body", &body, &want);
                r.check(i, case, "type in body", &body["type"], field(case, "type"));
            }
            "covers_grpc" => {
                let mut config = ServerConfig::new();
                if let Some(m) = strings_of(field(case, "methods")) {
                    config = config.methods(m).unwrap();
                }
                if let Some(m) = strings_of(field(case, "grpc_methods")) {
                    config = config.grpc_methods(m).unwrap();
                }
                let got = config.covers_grpc(str_of(case, "full_method"));
                r.check(i, case, "covered", &json!(got), field(case, "covered"));
            }
            "grpc_status" => {
                let got = http::storable_grpc_status(str_of(case, "value").as_bytes());
                r.check(i, case, "storable", &json!(got), field(case, "storable"));
            }
            "grpc_problem" => {
                let p = http::Problem::from_error(&error_of(field(case, "error")));
                let m = p.grpc_metadata();
                let get = |name: &str| {
                    m.iter()
                        .find(|(n, _)| *n == name)
                        .map_or(Value::Null, |(_, v)| json!(v))
                };
                r.check(
                    i,
                    case,
                    "grpc-status",
                    &get("grpc-status"),
                    field(case, "grpc_status"),
                );
                r.check(
                    i,
                    case,
                    "grpc-retry-pushback-ms",
                    &get("grpc-retry-pushback-ms"),
                    field(case, "grpc_retry_pushback_ms"),
                );
            }
            "is_grpc" => {
                let got = http::is_grpc(str_of(case, "content_type"));
                r.check(i, case, "grpc", &json!(got), field(case, "grpc"));
            }
            "is_event_stream" => {
                let got = http::is_event_stream(str_of(case, "content_type"));
                r.check(
                    i,
                    case,
                    "event_stream",
                    &json!(got),
                    field(case, "event_stream"),
                );
            }
            // Run against a real server by the adapters' suites.
            "sequence" => r.checks += 1,
            other => r.fail(i, case, &format!("unknown op {other:?}")),
        }
    }
    r.finish();
}
