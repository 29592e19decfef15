//! Runs the request sequences of `tests/vectors/http_server.json` (SPEC §8; the format
//! is in tests/vectors/README.md) against a real axum server on 127.0.0.1 behind the
//! layer, with a fresh memory store per sequence.

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{send, Answer, Calls};
use http::{HeaderName, Method};
use oncely::MemoryStore;
use oncely_tower::{IdempotencyLayer, Unstored};
use serde_json::Value;

fn sequences() -> Vec<Value> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/vectors/http_server.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let cases: Vec<Value> = serde_json::from_str(&text).unwrap();
    let seqs: Vec<Value> = cases
        .into_iter()
        .filter(|c| c["op"] == "sequence")
        .collect();
    assert!(!seqs.is_empty());
    seqs
}

fn layer_of(config: &Value) -> IdempotencyLayer<MemoryStore<Vec<u8>, Unstored>> {
    let mut layer = IdempotencyLayer::new(MemoryStore::new());
    if let Some(m) = config.get("methods").and_then(Value::as_array) {
        layer = layer.methods(
            m.iter()
                .map(|m| Method::from_bytes(m.as_str().unwrap().as_bytes()).unwrap()),
        );
    }
    if let Some(r) = config.get("required").and_then(Value::as_bool) {
        layer = layer.required(r);
    }
    if let Some(w) = config.get("wait").and_then(Value::as_bool) {
        layer = layer.wait(w);
    }
    if let Some(c) = config.get("body_cap").and_then(Value::as_u64) {
        layer = layer.body_cap(c as usize);
    }
    if let Some(h) = config.get("stored_headers").and_then(Value::as_array) {
        layer = layer.stored_headers(
            h.iter()
                .map(|n| HeaderName::from_bytes(n.as_str().unwrap().as_bytes()).unwrap()),
        );
    }
    layer
}

async fn send_vector(client: &common::TestClient, addr: SocketAddr, r: &Value) -> Answer {
    let mut headers: Vec<(String, String)> = r["headers"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.clone(), v.as_str().unwrap().to_owned()))
        .collect();
    if let Some(respond) = r.get("respond") {
        headers.push(("x-respond".into(), respond.to_string()));
    }
    let headers: Vec<(&str, &str)> = headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    send(
        client,
        addr,
        r["method"].as_str().unwrap(),
        r["path"].as_str().unwrap(),
        &headers,
        r["body"].as_str().unwrap().as_bytes(),
    )
    .await
}

/// The disagreements of one answer with an expectation.
fn check(e: &Value, a: &Answer, out: &mut Vec<String>) {
    let status = e["status"].as_u64().unwrap() as u16;
    if a.status != status {
        out.push(format!(
            "status {} (body {:?}), want {status}",
            a.status, a.body
        ));
        return;
    }
    if let Some(replayed) = e.get("replayed").and_then(Value::as_bool) {
        if a.replayed() != replayed {
            out.push(format!("replayed {}, want {replayed}", a.replayed()));
        }
    }
    if let Some(call) = e.get("call").and_then(Value::as_u64) {
        match e.get("body_len").and_then(Value::as_u64) {
            Some(len) => {
                if a.body.len() as u64 != len {
                    out.push(format!("body of {} bytes, want {len}", a.body.len()));
                }
                let etag = format!("\"call-{call}\"");
                if a.header("etag") != Some(etag.as_str()) {
                    out.push(format!("etag {:?}, want {etag}", a.header("etag")));
                }
            }
            None => {
                let want = format!("{{\"call\":{call}}}");
                if a.body != want.as_bytes() {
                    out.push(format!("body {:?}, want {want}", a.body));
                }
            }
        }
    }
    if let Some(ty) = e.get("problem").and_then(Value::as_str) {
        if a.header("content-type") != Some("application/problem+json") {
            out.push(format!("content-type {:?}", a.header("content-type")));
        }
        let body = a.json();
        if body["type"] != ty || body["status"] != status {
            out.push(format!("problem {body}, want type {ty}"));
        }
    }
    if let Some(headers) = e.get("headers").and_then(Value::as_object) {
        for (name, want) in headers {
            let got = a.header(name);
            if got != want.as_str() {
                out.push(format!("header {name}: {got:?}, want {want}"));
            }
        }
    }
}

async fn wait_calls(calls: &Calls, n: u64) {
    for _ in 0..2000 {
        if calls.load(Ordering::SeqCst) >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the handler was not called {n} times within 10 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_server_sequences() {
    let client = common::client();
    let mut failures = Vec::new();
    let seqs = sequences();
    for (i, case) in seqs.iter().enumerate() {
        let comment = case["comment"].as_str().unwrap_or("");
        let (addr, calls) = common::start(layer_of(&case["config"])).await;
        let mut background = None;
        let mut problems = Vec::new();
        for (j, step) in case["steps"].as_array().unwrap().iter().enumerate() {
            let mut out = Vec::new();
            if let Some(r) = step.get("background") {
                let (client, r) = (client.clone(), r.clone());
                background = Some(tokio::spawn(
                    async move { send_vector(&client, addr, &r).await },
                ));
            } else if let Some(n) = step.get("wait_handler_calls").and_then(Value::as_u64) {
                wait_calls(&calls, n).await;
            } else if step.get("await_background").is_some() {
                let a = background
                    .take()
                    .expect("a background request")
                    .await
                    .unwrap();
                check(&step["expect"], &a, &mut out);
            } else if let Some(n) = step.get("concurrent").and_then(Value::as_u64) {
                let tasks: Vec<_> = (0..n)
                    .map(|_| {
                        let (client, r) = (client.clone(), step["request"].clone());
                        tokio::spawn(async move { send_vector(&client, addr, &r).await })
                    })
                    .collect();
                let mut replayed = 0;
                let e = &step["expect"];
                for t in tasks {
                    let a = t.await.unwrap();
                    replayed += u64::from(a.replayed());
                    let mut each = e.clone();
                    each.as_object_mut().unwrap().remove("replayed_count");
                    check(&each, &a, &mut out);
                }
                let want = e["replayed_count"].as_u64().unwrap();
                if replayed != want {
                    out.push(format!("{replayed} replayed, want {want}"));
                }
            } else {
                let a = send_vector(&client, addr, &step["request"]).await;
                check(&step["expect"], &a, &mut out);
            }
            problems.extend(out.into_iter().map(|m| format!("step {j}: {m}")));
        }
        let want_calls = case["handler_calls"].as_u64().unwrap();
        let got_calls = calls.load(Ordering::SeqCst);
        if got_calls != want_calls {
            problems.push(format!(
                "handler called {got_calls} times, want {want_calls}"
            ));
        }
        if !problems.is_empty() {
            failures.push(format!(
                "sequence #{i} \"{comment}\":\n    {}",
                problems.join("\n    ")
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} sequences of tests/vectors/http_server.json disagree:\n  {}",
        failures.len(),
        seqs.len(),
        failures.join("\n  ")
    );
}
