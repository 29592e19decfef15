//! Generated bad input for every parser and reader a peer's bytes reach: the
//! `Retry-After` and `grpc-retry-pushback-ms` parsers, idempotency and scoped keys,
//! canonical JSON and fingerprints, [`oncely::extract`] and the server contract's
//! readers ([`oncely::http`]). Each target checks that the code never panics, fails only
//! with the error its docs name, and round-trips where a round trip exists.
//!
//! `cargo test` runs [`QUICK_CASES`] cases per target. The ignored `soak` test runs
//! `ONCELY_PARSER_CASES` (default 1,000,000) per target and prints the counts; run it in
//! release mode: `cargo test --release -p oncely --test parsers_soak -- --include-ignored`
//! (`scripts/soak --parsers`).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use oncely::http::{self, KeyDecision, Problem, ServerConfig, StoredResponse};
use oncely::{
    canonical_json, extract, fingerprint, fingerprint_bytes, parse_pushback_ms, parse_retry_after,
    Code, Error, IdempotencyKey, RawFailure, RawValue, ReasonCodes, ScopedKey, ServerDelay,
    CANONICAL_JSON_MAX_DEPTH,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestRunner};
use serde_json::Value;

/// Cases per target in a plain `cargo test` run.
const QUICK_CASES: u32 = 256;

/// The seed of runs of at most [`QUICK_CASES`] cases (a plain `cargo test`), so the suite
/// draws the same inputs on every machine and run (`PROPTEST_RNG_SEED` picks another);
/// the soak run draws new ones each time.
const QUICK_SEED: u64 = 0x0_5eed_0ce1;

/// Where a run's inputs come from.
fn quick_seed() -> RngSeed {
    match Config::default().rng_seed {
        RngSeed::Random => RngSeed::Fixed(QUICK_SEED),
        chosen => chosen,
    }
}

/// Runs `check` over `cases` inputs from `strategy`, failing with the shrunk input.
fn run<S: Strategy>(
    name: &str,
    cases: u32,
    strategy: S,
    check: impl Fn(S::Value) -> Result<(), TestCaseError>,
) -> u32 {
    let config = Config {
        cases,
        failure_persistence: None,
        // Strategies filter rarely; a soak run must not give up on rejects.
        max_global_rejects: cases.saturating_mul(2).max(1024),
        max_local_rejects: cases.saturating_mul(2).max(65_536),
        // Suite-sized runs are seeded; longer (soak) runs explore.
        rng_seed: if cases <= QUICK_CASES {
            quick_seed()
        } else {
            Config::default().rng_seed
        },
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let started = std::time::Instant::now();
    if let Err(e) = runner.run(&strategy, check) {
        panic!("{name}: {e}");
    }
    println!(
        "{name}: {cases} cases, {:.2} s",
        started.elapsed().as_secs_f64()
    );
    cases
}

/// Every target, each with `cases` cases; returns (target, cases run).
fn all_targets(cases: u32) -> Vec<(&'static str, u32)> {
    vec![
        (
            "parse_retry_after",
            run(
                "parse_retry_after",
                cases,
                retry_after_input(),
                check_retry_after,
            ),
        ),
        (
            "parse_retry_after (HTTP-date round trip)",
            run(
                "http-date round trip",
                cases,
                (0i64..253_402_300_800, wall_clock()),
                check_http_date_round_trip,
            ),
        ),
        (
            "parse_pushback_ms",
            run("parse_pushback_ms", cases, pushback_input(), check_pushback),
        ),
        (
            "IdempotencyKey::parse",
            run("IdempotencyKey::parse", cases, key_input(), check_key),
        ),
        (
            "ScopedKey::new + parse (round trip)",
            run(
                "ScopedKey round trip",
                cases,
                (scope_part(), scope_part(), valid_key()),
                check_scoped_round_trip,
            ),
        ),
        (
            "ScopedKey::parse",
            run("ScopedKey::parse", cases, scoped_text(), check_scoped_parse),
        ),
        (
            "canonical_json / fingerprint",
            run("canonical_json", cases, json_value(), check_canonical),
        ),
        (
            "canonical_json of parsed bytes",
            run("canonical bytes", cases, json_text(), check_canonical_bytes),
        ),
        (
            "extract",
            run(
                "extract",
                cases,
                (raw_failure(), wall_clock()),
                check_extract,
            ),
        ),
        (
            "http::ServerConfig builders + read_key",
            run("read_key", cases, read_key_input(), check_read_key),
        ),
        (
            "http::scope / request_fingerprint / content types",
            run("request", cases, request_input(), check_request),
        ),
        (
            "http::StoredResponse decode",
            run("decode", cases, record_input(), check_decode),
        ),
        (
            "http::Problem",
            run("problem", cases, error_input(), check_problem),
        ),
    ]
}

#[test]
fn generated_bad_input_quick() {
    all_targets(QUICK_CASES);
}

#[test]
#[ignore = "a long run: scripts/soak --parsers (ONCELY_PARSER_CASES, default 1,000,000)"]
fn generated_bad_input_soak() {
    let cases = std::env::var("ONCELY_PARSER_CASES")
        .ok()
        .map(|v| {
            v.trim()
                .parse::<u32>()
                .expect("ONCELY_PARSER_CASES is a count")
        })
        .unwrap_or(1_000_000);
    let started = std::time::Instant::now();
    let counts = all_targets(cases);
    println!("generated bad input: cases per target (no panic, documented errors only)");
    for (target, n) in &counts {
        println!("  {target:<52} {n:>10}");
    }
    println!(
        "  total {} cases in {:.1} s",
        counts.iter().map(|(_, n)| u64::from(*n)).sum::<u64>(),
        started.elapsed().as_secs_f64()
    );
}

// ---- regression cases: inputs the generated runs found ----------------------------

#[test]
fn a_longest_in_progress_delay_rounds_up_without_overflow() {
    let p = Problem::from_error(&Error::InProgress {
        retry_after: Duration::MAX,
    });
    assert_eq!(p.retry_after_secs(), Some(u64::MAX));
    assert_eq!(
        p.headers()[1],
        ("retry-after", u64::MAX.to_string()),
        "the header says the longest wait"
    );
}

#[test]
fn a_negative_zero_pushback_is_a_zero_delay() {
    for zero in ["-0", "-000", " -0 "] {
        assert_eq!(
            parse_pushback_ms(zero),
            Ok(ServerDelay::After(Duration::ZERO)),
            "{zero:?}"
        );
    }
    assert_eq!(parse_pushback_ms("-01"), Ok(ServerDelay::DoNotRetry));
}

#[test]
fn a_two_digit_year_against_the_earliest_clock_does_not_overflow() {
    let earliest = UNIX_EPOCH
        .checked_sub(Duration::from_secs(i64::MAX as u64))
        .unwrap();
    // RFC 850 years are resolved against the clock, here some 292 billion years BC.
    let got = parse_retry_after("Friday, 06-Nov-05 08:49:37 GMT", earliest);
    assert!(
        matches!(
            got,
            Err(Error::InvalidArgument {
                field: "retry_after",
                ..
            })
        ),
        "{got:?}"
    );
}

// ---- inputs -------------------------------------------------------------------------

/// Any wall clock a host can report, from the far past to the far future.
fn wall_clock() -> impl Strategy<Value = SystemTime> {
    let extreme = |forward: bool| {
        let d = Duration::from_secs(i64::MAX as u64 - 1);
        if forward {
            UNIX_EPOCH.checked_add(d).unwrap()
        } else {
            UNIX_EPOCH.checked_sub(d).unwrap()
        }
    };
    prop_oneof![
        Just(extreme(false)),
        Just(extreme(true)),
        (0u64..4_102_444_800).prop_map(|s| UNIX_EPOCH + Duration::from_secs(s)),
        any::<i64>().prop_map(|s| {
            let d = Duration::from_secs(s.unsigned_abs());
            if s >= 0 {
                UNIX_EPOCH.checked_add(d)
            } else {
                UNIX_EPOCH.checked_sub(d)
            }
            .unwrap_or(UNIX_EPOCH)
        }),
        (any::<u64>(), 0u32..1_000_000_000).prop_map(|(s, n)| {
            UNIX_EPOCH
                .checked_sub(Duration::new(s, n))
                .unwrap_or(UNIX_EPOCH)
        }),
    ]
}

/// Text a header value can be: anything, ASCII noise, and near-misses of each form.
fn noise() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "[ -~]{0,40}",
        "[\\x00-\\x7f]{0,40}",
        "[0-9 \\t+-]{0,30}",
    ]
}

fn date_like() -> impl Strategy<Value = String> {
    let wday = proptest::sample::select(vec![
        "Mon",
        "Tue",
        "Wed",
        "Thu",
        "Fri",
        "Sat",
        "Sun",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Xyz",
        "",
    ]);
    let month = prop_oneof![
        Just("Jan"),
        Just("Feb"),
        Just("Nov"),
        Just("Dec"),
        Just("Foo")
    ];
    (
        wday,
        0u32..100,
        month,
        0u32..10_000,
        0u32..100,
        0u32..100,
        0u32..100,
        0u8..4,
    )
        .prop_map(|(w, d, m, y, hh, mm, ss, form)| match form {
            0 => format!("{w}, {d:02} {m} {y:04} {hh:02}:{mm:02}:{ss:02} GMT"),
            1 => format!("{w}, {d:02}-{m}-{:02} {hh:02}:{mm:02}:{ss:02} GMT", y % 100),
            2 => format!("{w} {m} {d:>2} {hh:02}:{mm:02}:{ss:02} {y:04}"),
            _ => format!("{w}, {d} {m} {y} {hh}:{mm}:{ss} GMT"),
        })
}

fn retry_after_input() -> impl Strategy<Value = (String, SystemTime)> {
    let value = prop_oneof![
        noise(),
        date_like(),
        "[0-9]{1,40}",
        "[ \\t]{0,3}[0-9]{1,25}[ \\t]{0,3}",
        any::<u64>().prop_map(|n| n.to_string()),
    ];
    (value, wall_clock())
}

fn pushback_input() -> impl Strategy<Value = String> {
    prop_oneof![
        noise(),
        "[ \\t]{0,2}-?[0-9]{0,30}[ \\t]{0,2}",
        any::<i64>().prop_map(|n| n.to_string()),
        any::<u64>().prop_map(|n| n.to_string()),
        "--?[0-9]{1,5}",
        "\\+[0-9]{1,5}",
    ]
}

fn key_input() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "[A-Za-z0-9_-]{0,80}",
        "[A-Za-z0-9_ .:/%{}é-]{0,70}",
        "[A-Za-z0-9_-]{6,10}",
        "[A-Za-z0-9_-]{62,66}",
    ]
}

fn valid_key() -> impl Strategy<Value = IdempotencyKey> {
    "[A-Za-z0-9_-]{8,64}".prop_map(|s| IdempotencyKey::parse(&s).unwrap())
}

/// A tenant or method that fits (1 to 1024 bytes): any text, including separators,
/// escapes, braces and non-ASCII.
fn short_scope_part() -> impl Strategy<Value = String> {
    prop_oneof![
        "\\PC{1,12}",
        any::<String>().prop_map(|s| if s.is_empty() { "-".to_owned() } else { s }),
        "[:%/{} a-f0-9A-F]{1,12}",
    ]
}

/// A tenant or method, also around the 1024-byte limit.
fn scope_part() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => short_scope_part(),
        1 => (1020usize..1030, any::<char>()).prop_map(|(n, c)| {
            let mut s = "t".repeat(n);
            s.push(c);
            s
        }),
    ]
}

/// Near-misses of the scoped-key encoding: valid keys, edited keys and noise.
fn scoped_text() -> impl Strategy<Value = String> {
    let valid = (short_scope_part(), short_scope_part(), valid_key())
        .prop_map(|(t, m, k)| ScopedKey::new(&t, &m, &k).unwrap().as_str().to_owned())
        .boxed();
    let edited = (valid.clone(), any::<usize>(), "[%:a-fA-F0-9{}é\\x00]{0,3}").prop_map(
        |(s, at, insert)| {
            let mut s = s;
            let mut at = at % (s.len() + 1);
            while !s.is_char_boundary(at) {
                at -= 1;
            }
            s.insert_str(at, &insert);
            s
        },
    );
    prop_oneof![
        valid,
        edited,
        "v1:[a-zA-Z0-9%:._/-]{0,30}",
        "v1:[%0-9A-Fa-f]{0,12}:[%0-9A-Fa-f:]{0,12}:[A-Za-z0-9_-]{0,12}",
        "v1:%[89A-F][0-9A-F]%[89A-F][0-9A-F]:m:key-0001",
        noise(),
    ]
}

fn json_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("JSON has finite numbers only", |f| f.is_finite())
            .prop_map(Value::from),
        prop_oneof![
            Just(0.0f64),
            Just(-0.0),
            Just(f64::MIN_POSITIVE),
            Just(f64::MAX),
            Just(f64::MIN),
            Just(5e-324),
            Just(1e21),
            Just(1e-7),
            Just(9_007_199_254_740_993.0),
        ]
        .prop_map(Value::from),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        json_number(),
        any::<String>().prop_map(Value::String),
        "[\\x00-\\x1f\"\\\\\\u{7f}-\\u{a0}\\u{2028}\\u{2029}\\u{fffd}\\u{10000}-\\u{10ffff}]{0,6}"
            .prop_map(Value::String),
    ];
    leaf.prop_recursive(12, 64, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::vec((any::<String>(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// Bytes a request body can be: JSON (valid, reformatted, truncated) and noise.
fn json_text() -> impl Strategy<Value = Vec<u8>> {
    let valid = json_value()
        .prop_map(|v| serde_json::to_vec_pretty(&v).unwrap())
        .boxed();
    let cut = (valid.clone(), any::<usize>()).prop_map(|(mut b, at)| {
        b.truncate(at % (b.len() + 1));
        b
    });
    prop_oneof![
        valid,
        cut,
        proptest::collection::vec(any::<u8>(), 0..64),
        "[\\[\\]{}:,\"0-9eE.+ -]{0,40}".prop_map(String::into_bytes),
        (1usize..400).prop_map(|n| format!("{}{}", "[".repeat(n), "]".repeat(n)).into_bytes()),
        "-?[0-9]{1,400}(\\.[0-9]{1,40})?([eE][+-]?[0-9]{1,5})?".prop_map(String::into_bytes),
    ]
}

fn raw_value() -> impl Strategy<Value = Option<RawValue>> {
    prop_oneof![
        Just(None),
        any::<i64>().prop_map(|n| Some(RawValue::Int(n))),
        (-20i64..700).prop_map(|n| Some(RawValue::Int(n))),
        noise().prop_map(|s| Some(RawValue::Text(s))),
        "[A-Za-z_0-9 ]{0,20}".prop_map(|s| Some(RawValue::Text(s))),
    ]
}

/// A `google.rpc.Status` carrying a `RetryInfo` with any (even negative) delay, in
/// base64 as sent on the wire.
fn retry_info_b64(seconds: i64, nanos: i32, url_safe: bool) -> String {
    fn varint(mut v: u64, out: &mut Vec<u8>) {
        loop {
            let byte = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                out.push(byte);
                return;
            }
            out.push(byte | 0x80);
        }
    }
    fn field(tag: u64, bytes: &[u8], out: &mut Vec<u8>) {
        varint(tag << 3 | 2, out);
        varint(bytes.len() as u64, out);
        out.extend_from_slice(bytes);
    }
    let mut duration = Vec::new();
    varint(1 << 3, &mut duration);
    varint(seconds as u64, &mut duration);
    varint(2 << 3, &mut duration);
    varint(i64::from(nanos) as u64, &mut duration);
    let mut info = Vec::new();
    field(1, &duration, &mut info);
    let mut any = Vec::new();
    field(1, b"type.googleapis.com/google.rpc.RetryInfo", &mut any);
    field(2, &info, &mut any);
    let mut status = Vec::new();
    varint(1 << 3, &mut status);
    varint(14, &mut status);
    field(3, &any, &mut status);
    let alphabet: &[u8; 64] = if url_safe {
        b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    } else {
        b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    };
    let mut s = String::new();
    for chunk in status.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            s.push(alphabet[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    s
}

fn header() -> impl Strategy<Value = (String, String)> {
    let name = prop_oneof![
        Just("Retry-After".to_owned()),
        Just(" retry-after ".to_owned()),
        Just("grpc-retry-pushback-ms".to_owned()),
        Just("grpc-status-details-bin".to_owned()),
        noise(),
    ];
    let value = prop_oneof![
        noise(),
        date_like(),
        "[A-Za-z0-9+/=_-]{0,120}",
        "-?[0-9]{0,25}",
        (any::<i64>(), any::<i32>(), any::<bool>()).prop_map(|(s, n, u)| retry_info_b64(s, n, u)),
    ];
    (name, value)
}

fn raw_failure() -> impl Strategy<Value = RawFailure> {
    let leaf = (
        raw_value(),
        raw_value(),
        raw_value(),
        proptest::option::of(noise()),
        proptest::collection::vec(noise(), 0..4),
        proptest::collection::vec(header(), 0..5),
        proptest::option::of((any::<u64>(), 0u32..1_000_000_000)),
    )
        .prop_map(
            |(code, status, status_code, errno, type_names, headers, delay)| RawFailure {
                code,
                status,
                status_code,
                errno,
                type_names,
                headers,
                delay: delay.map(|(s, n)| Duration::new(s, n)),
                cause: None,
            },
        );
    // A chain of causes, one longer than extraction reads.
    proptest::collection::vec(leaf, 1..=RawFailure::MAX_CHAIN + 1).prop_map(|levels| {
        levels
            .into_iter()
            .rev()
            .reduce(|cause, mut outer| {
                outer.cause = Some(Box::new(cause));
                outer
            })
            .expect("at least one level")
    })
}

type ReadKeyInput = (
    Vec<String>,
    Option<Vec<String>>,
    Vec<String>,
    bool,
    String,
    Vec<Vec<u8>>,
);

fn read_key_input() -> impl Strategy<Value = ReadKeyInput> {
    let token_ish = || prop_oneof!["[A-Z]{1,8}", "[!#$%&'*+.^_`|~0-9a-z-]{0,8}", noise()];
    let key_bytes = prop_oneof![
        "[A-Za-z0-9_-]{0,70}".prop_map(String::into_bytes),
        proptest::collection::vec(any::<u8>(), 0..70),
        noise().prop_map(String::into_bytes),
    ];
    (
        proptest::collection::vec(token_ish(), 0..4),
        proptest::option::of(proptest::collection::vec(
            prop_oneof!["/[a-z.]{1,8}/[A-Z][a-z]{0,6}", noise()],
            0..3,
        )),
        proptest::collection::vec(token_ish(), 0..4),
        any::<bool>(),
        prop_oneof![
            Just("POST".to_owned()),
            Just("PATCH".to_owned()),
            token_ish()
        ],
        proptest::collection::vec(key_bytes, 0..3),
    )
}

fn request_input() -> impl Strategy<Value = (String, String, String, Option<String>, Vec<u8>)> {
    let content_type = prop_oneof![
        Just("application/json".to_owned()),
        Just("Application/JSON; charset=utf-8".to_owned()),
        Just("application/problem+json".to_owned()),
        Just("application/grpc+proto".to_owned()),
        Just("text/event-stream; x=1".to_owned()),
        "[a-z/+;= ]{0,30}",
        noise(),
    ];
    (
        noise(),
        noise(),
        noise(),
        proptest::option::of(content_type),
        json_text(),
    )
}

type Record = (
    u16,
    Vec<(String, Vec<u8>)>,
    Vec<u8>,
    Vec<(String, Vec<u8>)>,
    Vec<(usize, u8)>,
    usize,
);

fn record_input() -> impl Strategy<Value = Record> {
    let fields = || {
        proptest::collection::vec(
            (noise(), proptest::collection::vec(any::<u8>(), 0..20)),
            0..4,
        )
    };
    (
        any::<u16>(),
        fields(),
        proptest::collection::vec(any::<u8>(), 0..64),
        fields(),
        proptest::collection::vec((any::<usize>(), any::<u8>()), 0..3),
        any::<usize>(),
    )
}

fn error_input() -> impl Strategy<Value = Error> {
    let duration = prop_oneof![
        (any::<u64>(), 0u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n)),
        Just(Duration::MAX),
        (0u64..10_000).prop_map(Duration::from_millis),
    ];
    prop_oneof![
        Just(Error::MissingKey),
        Just(Error::FingerprintMismatch),
        Just(Error::LeaseLost),
        noise().prop_map(|r| Error::InvalidArgument {
            field: "idempotency_key",
            reason: r
        }),
        duration.prop_map(|retry_after| Error::InProgress { retry_after }),
        any::<usize>().prop_map(|max_entries| Error::Capacity { max_entries }),
        noise().prop_map(Error::Unavailable),
        noise().prop_map(Error::LeaderPanicked),
        noise().prop_map(|key| Error::Reentrant { key }),
        (noise(), noise()).prop_map(|(key, type_name)| Error::ResultNotStored { key, type_name }),
    ]
}

// ---- checks -------------------------------------------------------------------------

fn invalid_on(e: &Error, fields: &[&str]) -> bool {
    matches!(e, Error::InvalidArgument { field, .. } if fields.contains(field))
}

fn check_retry_after((value, now): (String, SystemTime)) -> Result<(), TestCaseError> {
    match parse_retry_after(&value, now) {
        Ok(ServerDelay::After(_)) => {
            let v = value.trim();
            if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
                let secs = v.parse::<u64>().unwrap_or(u64::MAX);
                prop_assert_eq!(
                    parse_retry_after(&value, now).unwrap(),
                    ServerDelay::After(Duration::from_secs(secs))
                );
            }
        }
        Ok(ServerDelay::DoNotRetry) => prop_assert!(false, "Retry-After never says do not retry"),
        Err(e) => prop_assert!(invalid_on(&e, &["retry_after"]), "{e:?}"),
    }
    Ok(())
}

fn check_http_date_round_trip((at, now): (i64, SystemTime)) -> Result<(), TestCaseError> {
    let when = UNIX_EPOCH + Duration::from_secs(at as u64);
    let text = httpdate::fmt_http_date(when);
    let got = parse_retry_after(&text, now);
    let expected = match now.duration_since(UNIX_EPOCH) {
        Ok(n) => Duration::from_secs(at as u64).saturating_sub(Duration::from_millis(
            u64::try_from(n.as_millis()).unwrap_or(u64::MAX),
        )),
        // A clock before 1970: the whole distance from it.
        Err(e) => {
            let back = e.duration();
            let ms = u128::from(at as u64) * 1000 + back.as_millis();
            Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX))
        }
    };
    prop_assert_eq!(got, Ok(ServerDelay::After(expected)), "{}", text);
    Ok(())
}

fn check_pushback(value: String) -> Result<(), TestCaseError> {
    match parse_pushback_ms(&value) {
        Ok(d) => {
            let v = value.trim();
            match v.parse::<i128>() {
                Ok(n) if n < 0 => prop_assert_eq!(d, ServerDelay::DoNotRetry),
                Ok(n) => prop_assert_eq!(
                    d,
                    ServerDelay::After(Duration::from_millis(u64::try_from(n).unwrap_or(u64::MAX)))
                ),
                // Integers past i128 saturate or refuse likewise.
                Err(_) => prop_assert!(v
                    .trim_start_matches('-')
                    .bytes()
                    .all(|b| b.is_ascii_digit())),
            }
            prop_assert!(!v.starts_with('+'), "a plus sign is not accepted: {v:?}");
        }
        Err(e) => prop_assert!(invalid_on(&e, &["grpc-retry-pushback-ms"]), "{e:?}"),
    }
    Ok(())
}

fn check_key(s: String) -> Result<(), TestCaseError> {
    let valid = (8..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    match IdempotencyKey::parse(&s) {
        Ok(k) => {
            prop_assert!(valid, "accepted {s:?}");
            prop_assert_eq!(k.as_str(), s.as_str());
            prop_assert_eq!(s.parse::<IdempotencyKey>().unwrap(), k);
        }
        Err(Error::MissingKey) => prop_assert!(s.is_empty()),
        Err(e) => {
            prop_assert!(!valid, "refused {s:?}");
            prop_assert!(invalid_on(&e, &["idempotency_key"]), "{e:?}");
        }
    }
    Ok(())
}

fn check_scoped_round_trip(
    (tenant, method, key): (String, String, IdempotencyKey),
) -> Result<(), TestCaseError> {
    let scoped = match ScopedKey::new(&tenant, &method, &key) {
        Ok(k) => k,
        Err(e) => {
            let long = |p: &str| p.len() > oncely::SCOPE_PART_MAX_LEN;
            prop_assert!(long(&tenant) || long(&method), "{e:?}");
            prop_assert!(invalid_on(&e, &["tenant", "method"]), "{e:?}");
            return Ok(());
        }
    };
    let s = scoped.as_str();
    prop_assert!(
        s.bytes().all(|b| b.is_ascii_graphic()) && !s.contains(['{', '}']),
        "not printable or has braces: {}",
        s
    );
    prop_assert_eq!(ScopedKey::parse(s), Ok(scoped.clone()));
    let via_http = http::scope(&tenant, "POST", &method, &key);
    match via_http {
        Ok(k) => prop_assert_eq!(ScopedKey::parse(k.as_str()), Ok(k.clone())),
        Err(e) => prop_assert!(invalid_on(&e, &["method"]), "{e:?}"),
    }
    Ok(())
}

fn check_scoped_parse(s: String) -> Result<(), TestCaseError> {
    match ScopedKey::parse(&s) {
        Ok(k) => prop_assert_eq!(k.as_str(), s.as_str()),
        Err(e) => prop_assert!(
            invalid_on(&e, &["scoped_key", "idempotency_key", "tenant", "method"])
                || e == Error::MissingKey,
            "{e:?}"
        ),
    }
    Ok(())
}

/// The nesting depth of arrays and objects (a scalar is 0).
fn depth(v: &Value) -> usize {
    match v {
        Value::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
        Value::Object(o) => 1 + o.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

fn check_canonical(v: Value) -> Result<(), TestCaseError> {
    if depth(&v) > CANONICAL_JSON_MAX_DEPTH {
        // Deeper than the common limit (SPEC §6): refused, never a panic or a stack overflow.
        prop_assert!(
            matches!(canonical_json(&v), Err(Error::InvalidArgument { .. })),
            "a value nested deeper than the limit is refused"
        );
        prop_assert!(
            matches!(fingerprint(&v), Err(Error::InvalidArgument { .. })),
            "a fingerprint of a value nested deeper than the limit is refused"
        );
        return Ok(());
    }
    let bytes = canonical_json(&v)?;
    let back: Value = serde_json::from_slice(&bytes)
        .map_err(|e| TestCaseError::fail(format!("canonical JSON does not parse: {e}")))?;
    // Canonical JSON is a fixed point, and the fingerprint is the hash of it.
    prop_assert_eq!(canonical_json(&back)?, bytes.clone());
    prop_assert_eq!(fingerprint(&v)?, fingerprint_bytes(&bytes));
    prop_assert!(
        std::str::from_utf8(&bytes).is_ok(),
        "canonical JSON is UTF-8"
    );
    Ok(())
}

fn check_canonical_bytes(b: Vec<u8>) -> Result<(), TestCaseError> {
    if let Ok(v) = serde_json::from_slice::<Value>(&b) {
        check_canonical(v)?;
    }
    Ok(())
}

fn check_extract((raw, now): (RawFailure, SystemTime)) -> Result<(), TestCaseError> {
    let reasons = ReasonCodes::default();
    let f = extract(&raw, &reasons, now);
    prop_assert_eq!(
        &f,
        &extract(&raw, &reasons, now),
        "extraction is a function"
    );
    let alone = RawFailure {
        cause: None,
        ..raw.clone()
    };
    let own = extract(&alone, &reasons, now);
    if own.code != Code::Unknown {
        // The first level that names a code decides, and a delay it states wins.
        prop_assert_eq!(&f, &own);
        if let Some(d) = raw.delay {
            prop_assert_eq!(f.server_delay, Some(ServerDelay::After(d)));
        }
    }
    Ok(())
}

fn check_retry_info((seconds, nanos, url_safe): (i64, i32, bool)) -> Result<(), TestCaseError> {
    let raw = RawFailure {
        code: Some(RawValue::Int(14)),
        headers: vec![(
            "grpc-status-details-bin".to_owned(),
            retry_info_b64(seconds, nanos, url_safe),
        )],
        ..RawFailure::default()
    };
    let f = extract(&raw, &ReasonCodes::default(), SystemTime::now());
    let expected = (seconds >= 0 && (0..1_000_000_000).contains(&nanos))
        .then(|| ServerDelay::After(Duration::new(seconds as u64, nanos as u32)));
    prop_assert_eq!(f.code, Code::Unavailable);
    prop_assert_eq!(f.server_delay, expected);
    Ok(())
}

#[test]
fn retry_info_round_trips() {
    run(
        "RetryInfo round trip",
        QUICK_CASES * 4,
        (
            prop_oneof![any::<i64>(), 0i64..100_000],
            prop_oneof![any::<i32>(), 0i32..1_000_000_000],
            any::<bool>(),
        ),
        check_retry_info,
    );
}

fn check_read_key(
    (methods, grpc, stored, required, method, values): ReadKeyInput,
) -> Result<(), TestCaseError> {
    let tokens_ok = |list: &[String]| {
        list.iter().all(|m| {
            !m.is_empty()
                && m.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
        })
    };
    let mut config = ServerConfig::new().required(required);
    match ServerConfig::new().methods(&methods) {
        Ok(c) => {
            prop_assert!(tokens_ok(&methods));
            config = c.required(required);
        }
        Err(e) => {
            prop_assert!(!tokens_ok(&methods));
            prop_assert!(invalid_on(&e, &["methods"]), "{e:?}");
        }
    }
    match config.clone().stored_headers(&stored) {
        Ok(c) => {
            prop_assert!(tokens_ok(&stored));
            for name in &stored {
                prop_assert_eq!(
                    c.stores_header(&name.to_ascii_uppercase()),
                    c.stores_header(name)
                );
            }
        }
        Err(e) => prop_assert!(invalid_on(&e, &["stored_headers"]), "{e:?}"),
    }
    if let Some(grpc) = &grpc {
        match config.clone().grpc_methods(grpc) {
            Ok(c) => {
                for m in grpc {
                    prop_assert_eq!(c.covers_grpc(m), c.covers("POST"));
                }
            }
            Err(e) => prop_assert!(invalid_on(&e, &["grpc_methods"]), "{e:?}"),
        }
    }
    let refs: Vec<&[u8]> = values.iter().map(Vec::as_slice).collect();
    for decision in [
        config.read_key(&method, &refs),
        config.read_grpc_key(&method, &refs),
    ] {
        match decision {
            Ok(KeyDecision::Dedup(k)) => {
                prop_assert_eq!(refs.len(), 1);
                prop_assert_eq!(k.as_str().as_bytes(), refs[0]);
            }
            Ok(KeyDecision::PassThrough) => {}
            Err(p) => {
                prop_assert_eq!(p.status, 400);
                prop_assert_eq!(p.code, Code::InvalidArgument);
                check_problem_shape(&p)?;
            }
        }
    }
    Ok(())
}

fn check_request(
    (tenant, method, target, content_type, body): (String, String, String, Option<String>, Vec<u8>),
) -> Result<(), TestCaseError> {
    let key = IdempotencyKey::parse("order-0001").unwrap();
    match http::scope(&tenant, &method, &target, &key) {
        Ok(k) => prop_assert_eq!(ScopedKey::parse(k.as_str()), Ok(k.clone())),
        Err(e) => prop_assert!(invalid_on(&e, &["tenant", "method"]), "{e:?}"),
    }
    let fp = http::request_fingerprint(&method, &target, content_type.as_deref(), &body);
    prop_assert!(fp.len() == 64 && fp.bytes().all(|b| b.is_ascii_hexdigit()));
    if let Some(ct) = content_type.as_deref() {
        let json = http::is_json(ct);
        let _ = (http::is_grpc(ct), http::is_event_stream(ct));
        // The same JSON data, written differently, fingerprints alike (within the depth
        // limit: deeper bodies are fingerprinted as raw bytes).
        if json {
            if let Some(v) = serde_json::from_slice::<Value>(&body)
                .ok()
                .filter(|v| depth(v) <= CANONICAL_JSON_MAX_DEPTH)
            {
                let pretty = serde_json::to_vec_pretty(&v).unwrap();
                prop_assert_eq!(
                    http::request_fingerprint(&method, &target, Some(ct), &pretty),
                    fp.clone()
                );
            }
        }
    }
    let _ = http::storable_grpc_status(&body);
    Ok(())
}

fn check_decode(
    (status, headers, body, trailers, edits, cut): Record,
) -> Result<(), TestCaseError> {
    let record = StoredResponse {
        status,
        headers,
        body,
        trailers,
    };
    let bytes = record.encode();
    prop_assert_eq!(StoredResponse::decode(&bytes), Ok(record));
    let mut bad = bytes.clone();
    for (at, b) in edits {
        let i = at % bad.len();
        bad[i] = b;
    }
    bad.truncate(cut % (bad.len() + 2));
    if let Err(e) = StoredResponse::decode(&bad) {
        prop_assert!(matches!(e, Error::Unavailable(_)), "{e:?}");
    }
    Ok(())
}

fn check_problem_shape(p: &Problem) -> Result<(), TestCaseError> {
    let body: Value = serde_json::from_slice(&p.body())
        .map_err(|e| TestCaseError::fail(format!("problem body is not JSON: {e}")))?;
    prop_assert_eq!(body["status"].as_u64(), Some(u64::from(p.status)));
    for (name, value) in p.headers().into_iter().chain(p.grpc_metadata()) {
        prop_assert!(
            value.bytes().all(|b| (0x20..=0x7e).contains(&b)),
            "{name}: {value:?} is not a valid header value"
        );
    }
    if let Some(s) = p.retry_after_secs() {
        prop_assert!(s >= 1);
    }
    Ok(())
}

fn check_problem(e: Error) -> Result<(), TestCaseError> {
    let p = Problem::from_error(&e);
    prop_assert_eq!(p.status, e.http_status());
    check_problem_shape(&p)?;
    check_problem_shape(&Problem::request_body_unreadable(e.to_string()))?;
    check_problem_shape(&Problem::tenant_unusable(e.to_string()))
}
