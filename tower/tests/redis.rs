//! The layer over one shared Redis: two server instances, each with its own
//! `RedisStore`, run a keyed request's handler once between them.
#![cfg(feature = "redis")]

mod common;

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::extract::State;
use bytes::Bytes;
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

/// A body sent in three slow chunks (over a 10-byte cap: sent, not stored).
async fn slow_body(State(calls): State<Calls>) -> axum::response::Response {
    calls.fetch_add(1, Ordering::SeqCst);
    let stream = futures::stream::unfold(0, |i| async move {
        if i == 3 {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(700)).await;
        Some((
            Ok::<_, Infallible>(Bytes::from_static(b"chunk-of-body\n")),
            i + 1,
        ))
    });
    axum::response::Response::builder()
        .status(201)
        .body(axum::body::Body::from_stream(stream))
        .unwrap()
}

/// With a 600 ms lease, a handler that runs 2 s and a body that streams 2 s on one
/// instance keep their key (the lease is renewed while they run and while the body is
/// held by the server): a duplicate on the other instance waits, and never runs the
/// handler alongside.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a Redis: run scripts/test-redis"]
async fn the_lease_is_renewed_while_a_slow_handler_and_a_slow_body_run() {
    let prefix = format!("tower-test-{}", oncely::IdempotencyKey::random());
    let store = || {
        let url = std::env::var("ONCELY_REDIS_URL").expect("ONCELY_REDIS_URL");
        RedisStore::<Unstored>::builder(url)
            .prefix(&prefix)
            .lease(Duration::from_millis(600))
            .io_timeout(Duration::from_millis(200))
            .build()
            .unwrap()
    };
    let calls = Calls::default();
    let app = |store| {
        axum::Router::new()
            .route("/orders", axum::routing::post(common::handler))
            .route("/slow-body", axum::routing::post(slow_body))
            .route_layer(IdempotencyLayer::new(store).body_cap(10))
            .with_state(calls.clone())
    };
    let (a, b) = (
        common::serve(app(store())).await,
        common::serve(app(store())).await,
    );
    let client = common::client();

    // A slow handler.
    let key = ("idempotency-key", "order-slow-1");
    let slow = ("x-respond", r#"{"delay_ms":2000}"#);
    let first = {
        let client = client.clone();
        tokio::spawn(async move { send(&client, a, "POST", "/orders", &[key, slow], b"x").await })
    };
    while calls.load(Ordering::SeqCst) < 1 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let second = send(&client, b, "POST", "/orders", &[key], b"x").await;
    let first = first.await.unwrap();
    assert_eq!(
        (first.status, first.replayed(), &first.body[..]),
        (201, false, &br#"{"call":1}"#[..])
    );
    assert_eq!(
        (second.status, second.replayed(), &second.body[..]),
        (201, true, &br#"{"call":1}"#[..])
    );
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the key was taken over mid-handler"
    );

    // A slow body over the cap: held until sent, then the duplicate leads.
    let key = ("idempotency-key", "order-slow-2");
    let first = {
        let client = client.clone();
        tokio::spawn(async move { send(&client, a, "POST", "/slow-body", &[key], b"x").await })
    };
    while calls.load(Ordering::SeqCst) < 2 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let second = {
        let client = client.clone();
        tokio::spawn(async move { send(&client, b, "POST", "/slow-body", &[key], b"x").await })
    };
    tokio::time::sleep(Duration::from_millis(1800)).await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "the key was taken over mid-body"
    );
    let first = first.await.unwrap();
    assert_eq!((first.status, first.body.len()), (201, 42));
    let second = second.await.unwrap();
    assert_eq!(
        (second.status, second.replayed(), second.body.len()),
        (201, false, 42)
    );
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

#[derive(Default)]
struct Running {
    calls: std::sync::atomic::AtomicU64,
    now: std::sync::atomic::AtomicU64,
    max: std::sync::atomic::AtomicU64,
}

/// Counts how many handlers run at once (across both instances).
async fn counted(State(state): State<std::sync::Arc<Running>>) -> axum::response::Response {
    let n = state.calls.fetch_add(1, Ordering::SeqCst) + 1;
    let now = state.now.fetch_add(1, Ordering::SeqCst) + 1;
    state.max.fetch_max(now, Ordering::SeqCst);
    struct Done<'a>(&'a std::sync::atomic::AtomicU64);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
    let _done = Done(&state.now);
    tokio::time::sleep(Duration::from_millis(40)).await;
    axum::response::Response::builder()
        .status(201)
        .body(axum::body::Body::from(format!("{{\"call\":{n}}}")))
        .unwrap()
}

/// 150 same-key requests spread over two instances, most of whose clients give up at
/// random moments: the handler never runs on both at once, and every request that
/// waits gets the one stored answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a Redis: run scripts/test-redis"]
async fn cancelled_leaders_on_two_instances_hand_over_one_at_a_time() {
    let prefix = format!("tower-test-{}", oncely::IdempotencyKey::random());
    let state = std::sync::Arc::new(Running::default());
    let app = || {
        axum::Router::new()
            .route("/orders", axum::routing::post(counted))
            .route_layer(IdempotencyLayer::new(redis_store(&prefix)))
            .with_state(state.clone())
    };
    let (a, b) = (common::serve(app()).await, common::serve(app()).await);
    let client = common::client();
    // A first leader whose client gives up mid-handler: the key must be handed over.
    let first = {
        let client = client.clone();
        tokio::spawn(async move {
            send(
                &client,
                a,
                "POST",
                "/orders",
                &[("idempotency-key", "order-storm")],
                b"x",
            )
            .await
        })
    };
    while state.calls.load(Ordering::SeqCst) < 1 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    first.abort();
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut tasks = Vec::new();
    for i in 0..150u64 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let give_up = (i % 3 != 0).then_some(Duration::from_millis(seed % 150));
        let addr = if seed % 2 == 0 { a } else { b };
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(seed % 400)).await;
            let req = send(
                &client,
                addr,
                "POST",
                "/orders",
                &[("idempotency-key", "order-storm")],
                b"x",
            );
            match give_up {
                Some(d) => tokio::time::timeout(d, req).await.ok(),
                None => Some(req.await),
            }
        }));
    }
    let mut bodies = Vec::new();
    for t in tasks {
        if let Some(x) = t.await.unwrap() {
            assert_eq!(x.status, 201, "{:?}", x.body);
            bodies.push(x.body);
        }
    }
    assert!(bodies.len() >= 50);
    assert!(
        bodies.iter().all(|x| *x == bodies[0]),
        "one answer for the key"
    );
    assert_eq!(
        state.max.load(Ordering::SeqCst),
        1,
        "two handlers ran at once"
    );
}
