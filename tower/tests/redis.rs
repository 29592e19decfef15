//! The layer over one shared Redis: two server instances, each with its own
//! `RedisStore`, run a keyed request's handler once between them.
#![cfg(feature = "redis")]

mod common;

use std::sync::atomic::Ordering;

use common::{send, Calls};
use oncely_redis::RedisStore;
use oncely_tower::{IdempotencyLayer, Unstored};

fn redis_store(prefix: &str) -> RedisStore<Unstored> {
    let url = std::env::var("ONCELY_REDIS_URL").expect("ONCELY_REDIS_URL (run scripts/test-redis)");
    RedisStore::builder(url).prefix(prefix).build().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a Redis: run scripts/test-redis"]
async fn two_instances_over_one_redis_run_the_handler_once() {
    let prefix = format!("tower-test-{}", oncely::IdempotencyKey::random());
    let calls = Calls::default();
    let a = common::serve(common::app(
        IdempotencyLayer::new(redis_store(&prefix)),
        calls.clone(),
    ))
    .await;
    let b = common::serve(common::app(
        IdempotencyLayer::new(redis_store(&prefix)),
        calls.clone(),
    ))
    .await;
    let client = common::client();
    let headers = [
        ("idempotency-key", "order-fleet-1"),
        ("content-type", "application/json"),
        ("x-respond", r#"{"delay_ms":300}"#),
    ];
    let tasks: Vec<_> = (0..40)
        .map(|i| {
            let client = client.clone();
            let addr = if i % 2 == 0 { a } else { b };
            tokio::spawn(async move {
                send(
                    &client,
                    addr,
                    "POST",
                    "/orders",
                    &headers,
                    br#"{"sku":"A1"}"#,
                )
                .await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "one effect across both instances"
    );
    for x in &answers {
        assert_eq!((x.status, &x.body[..]), (201, &br#"{"call":1}"#[..]));
    }
    assert_eq!(answers.iter().filter(|x| !x.replayed()).count(), 1);
    // A later retry on either instance is a replay of the stored response.
    for addr in [a, b] {
        let x = send(
            &client,
            addr,
            "POST",
            "/orders",
            &headers,
            br#"{"sku":"A1"}"#,
        )
        .await;
        assert_eq!(
            (x.status, x.replayed(), &x.body[..]),
            (201, true, &br#"{"call":1}"#[..])
        );
        assert_eq!(x.header("etag"), Some("\"call-1\""));
    }
    // Another body with the key: 422 on either instance.
    let x = send(&client, b, "POST", "/orders", &headers, br#"{"sku":"B2"}"#).await;
    assert_eq!(x.status, 422);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Redis: run scripts/test-redis"]
async fn a_5xx_on_one_instance_is_not_stored_for_the_other() {
    let prefix = format!("tower-test-{}", oncely::IdempotencyKey::random());
    let calls = Calls::default();
    let a = common::serve(common::app(
        IdempotencyLayer::new(redis_store(&prefix)),
        calls.clone(),
    ))
    .await;
    let b = common::serve(common::app(
        IdempotencyLayer::new(redis_store(&prefix)),
        calls.clone(),
    ))
    .await;
    let client = common::client();
    let key = ("idempotency-key", "order-fleet-2");
    let x = send(
        &client,
        a,
        "POST",
        "/orders",
        &[key, ("x-respond", r#"{"status":503}"#)],
        b"x",
    )
    .await;
    assert_eq!(x.status, 503);
    let y = send(&client, b, "POST", "/orders", &[key], b"x").await;
    assert_eq!(
        (y.status, y.replayed(), &y.body[..]),
        (201, false, &br#"{"call":2}"#[..])
    );
    let z = send(&client, a, "POST", "/orders", &[key], b"x").await;
    assert_eq!(
        (z.status, z.replayed(), &z.body[..]),
        (201, true, &br#"{"call":2}"#[..])
    );
}
