//! Property tests: delays stay within their bounds; scoped keys never collide.

use std::collections::HashMap;
use std::time::Duration;

use oncely::{IdempotencyKey, RetryPolicy, ScopedKey};
use proptest::prelude::*;

fn policy() -> impl Strategy<Value = RetryPolicy> {
    (
        1u32..50,
        0u64..5_000,
        0u64..100_000,
        1.0f64..10.0,
        0.0f64..0.999,
        any::<u64>(),
    )
        .prop_map(|(attempts, base, extra, mult, jitter, seed)| {
            RetryPolicy::new()
                .with_max_attempts(attempts)
                .with_base_delay(Duration::from_millis(base))
                .with_max_delay(Duration::from_millis(base + extra))
                .with_multiplier(mult)
                .with_jitter(jitter)
                .with_seed(seed)
        })
}

proptest! {
    #[test]
    fn delays_stay_within_the_jittered_cap(p in policy(), n in 1u32..=u32::MAX, seed in any::<u64>()) {
        prop_assert!(p.validate().is_ok());
        let d = p.delay_with_seed(n, seed).as_secs_f64() * 1000.0;
        let base = p.base_delay().as_secs_f64() * 1000.0;
        let max = p.max_delay().as_secs_f64() * 1000.0;
        let capped = if base == 0.0 { 0.0 } else { (base * p.multiplier().powf(f64::from(n - 1))).min(max) };
        let lo = (capped * (1.0 - p.jitter())).floor();
        let hi = (capped * (1.0 + p.jitter()) + 0.5).floor();
        prop_assert!(d >= lo - 1.0 && d <= hi, "delay {d} not in [{lo}, {hi}] (capped {capped})");
        prop_assert!(d <= max * (1.0 + p.jitter()) + 1.0);
    }

    #[test]
    fn delays_are_deterministic_for_a_seed(p in policy(), n in 1u32..1000) {
        prop_assert_eq!(p.delay_after(n), p.delay_after(n));
        let seq: Vec<_> = p.backoff().collect();
        prop_assert_eq!(seq.len() as u32, p.max_attempts() - 1);
        prop_assert_eq!(seq, p.backoff().collect::<Vec<_>>());
    }

    #[test]
    fn the_capped_delay_never_decreases_without_jitter(p in policy(), n in 1u32..200) {
        let p = p.with_jitter(0.0);
        prop_assert!(p.delay_after(n) <= p.delay_after(n + 1));
    }

    #[test]
    fn scoped_keys_are_injective(
        triples in proptest::collection::vec(
            ("[a:%/{} ]{1,4}", "[b:%/{}é ]{1,4}", "[k0-9_-]{8,9}"), 2..40)
    ) {
        let mut seen: HashMap<String, (String, String, String)> = HashMap::new();
        for (tenant, method, key) in triples {
            let k = IdempotencyKey::parse(&key).unwrap();
            let scoped = ScopedKey::new(&tenant, &method, &k).unwrap();
            let s = scoped.as_str().to_owned();
            prop_assert!(s.bytes().all(|b| b.is_ascii_graphic()), "not printable: {s}");
            prop_assert!(!s.contains(['{', '}']), "braces in {}", s);
            prop_assert_eq!(s.matches(':').count(), 3);
            prop_assert_eq!(ScopedKey::parse(&s).unwrap(), scoped);
            let triple = (tenant, method, key);
            if let Some(prev) = seen.insert(s.clone(), triple.clone()) {
                prop_assert_eq!(prev, triple, "two triples gave {}", s);
            }
        }
    }

    #[test]
    fn fingerprints_ignore_key_order(a in any::<i64>(), b in "\\PC{0,8}", c in any::<bool>()) {
        let x = serde_json::json!({"a": a, "b": b, "c": {"x": c, "y": [a, c]}});
        let y = serde_json::json!({"c": {"y": [a, c], "x": c}, "b": b, "a": a});
        prop_assert_eq!(oncely::fingerprint(&x).unwrap(), oncely::fingerprint(&y).unwrap());
    }

    #[test]
    fn random_keys_are_valid_uuid_v4(_i in 0..50u8) {
        let k = IdempotencyKey::random();
        prop_assert!(IdempotencyKey::parse(k.as_str()).is_ok());
        prop_assert_eq!(&k.as_str()[14..15], "4");
        prop_assert!(matches!(&k.as_str()[19..20], "8" | "9" | "a" | "b"));
    }
}

fn raw_value() -> impl Strategy<Value = Option<oncely::RawValue>> {
    prop_oneof![
        Just(None),
        any::<i64>().prop_map(|n| Some(oncely::RawValue::Int(n))),
        (-20i64..700).prop_map(|n| Some(oncely::RawValue::Int(n))),
        ".{0,80}".prop_map(|s| Some(oncely::RawValue::Text(s))),
        "[A-Za-z_0-9 ]{0,20}".prop_map(|s| Some(oncely::RawValue::Text(s))),
    ]
}

fn raw_failure() -> impl Strategy<Value = oncely::RawFailure> {
    let header = (
        prop_oneof![
            Just("Retry-After".to_owned()),
            Just("grpc-retry-pushback-ms".to_owned()),
            Just("grpc-status-details-bin".to_owned()),
            ".{0,20}",
        ],
        prop_oneof![".{0,40}", "[A-Za-z0-9+/=_-]{0,120}", "-?[0-9]{0,25}"],
    );
    let leaf = (
        raw_value(),
        raw_value(),
        raw_value(),
        proptest::option::of("[A-Z_]{0,16}"),
        proptest::collection::vec(".{0,30}", 0..4),
        proptest::collection::vec(header, 0..5),
    )
        .prop_map(|(code, status, status_code, errno, type_names, headers)| {
            oncely::RawFailure {
                code,
                status,
                status_code,
                errno,
                type_names,
                headers,
                ..oncely::RawFailure::default()
            }
        });
    leaf.prop_recursive(8, 16, 1, |inner| {
        (inner.clone(), inner).prop_map(|(mut outer, cause)| {
            outer.cause = Some(Box::new(cause));
            outer
        })
    })
}

proptest! {
    // Whatever a binding hands over, extraction answers (never panics), and the answer
    // depends only on the first level of the chain that names a code.
    #[test]
    fn extraction_is_total_and_reads_the_first_level_that_names_a_code(raw in raw_failure()) {
        let reasons = oncely::ReasonCodes::default();
        let now = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
        let f = oncely::extract(&raw, &reasons, now);
        let alone = oncely::RawFailure { cause: None, ..raw.clone() };
        let own = oncely::extract(&alone, &reasons, now);
        if own.code != oncely::Code::Unknown || own.server_delay.is_some() {
            // This level named a code (UNKNOWN with a delay also means it did).
            prop_assert_eq!(f, own);
        }
    }
}
