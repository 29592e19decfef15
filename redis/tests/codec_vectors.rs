//! The shared result-codec vectors (`tests/vectors/result_codec.json`, described in
//! `tests/vectors/README.md`) against `oncely_redis::codec`. The Python and Node suites
//! read the same file.

use std::path::PathBuf;

use oncely::Error;
use oncely_redis::codec::{decode, StoredResult};
use serde_json::Value;

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn expected(case: &Value) -> StoredResult<'_> {
    let text = |f: &str| case[f].as_str().expect("text field");
    match case["kind"].as_str().expect("kind") {
        "json" => StoredResult::Json(text("text")),
        "no_value" => StoredResult::NoValue,
        "not_storable" => StoredResult::NotStorable {
            type_name: text("type_name"),
        },
        "user_text" => StoredResult::UserText(text("text")),
        other => panic!("not a borrowed kind: {other}"),
    }
}

#[test]
fn result_codec_vectors() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/vectors/result_codec.json");
    let cases: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert!(cases.len() >= 20);
    let mut failures = Vec::new();
    for case in &cases {
        let comment = case["comment"].as_str().unwrap_or("");
        let record = unhex(case["record_hex"].as_str().unwrap());
        let got = decode(&record);
        if case.get("error").is_some() {
            if !matches!(got, Err(Error::Unavailable(_))) {
                failures.push(format!("{comment}: expected UNAVAILABLE, got {got:?}"));
            }
            continue;
        }
        let bytes;
        let want = match case["kind"].as_str().unwrap() {
            "bytes" => {
                bytes = unhex(case["hex"].as_str().unwrap());
                StoredResult::Bytes(&bytes)
            }
            "user_bytes" => {
                bytes = unhex(case["hex"].as_str().unwrap());
                StoredResult::UserBytes(&bytes)
            }
            _ => expected(case),
        };
        match got {
            Ok(r) if r == want => {}
            other => failures.push(format!("{comment}: decoded {other:?}, expected {want:?}")),
        }
        if want.encode() != record {
            failures.push(format!("{comment}: encode gives {:?}", want.encode()));
        }
        if let StoredResult::Json(text) = want {
            let parsed: Value = serde_json::from_str(text).unwrap();
            if parsed != case["value"] {
                failures.push(format!("{comment}: the JSON text does not hold the value"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
