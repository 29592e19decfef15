//! The layer under load and faults, against a real axum server on 127.0.0.1.

mod common;

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body as AxumBody;
use axum::extract::State;
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use common::send;
use oncely::MemoryStore;
use oncely_tower::{BoxFuture, IdempotencyLayer, Store, StoreBegin, Unstored};
use tokio::sync::Semaphore;

fn memory() -> IdempotencyLayer<MemoryStore<Vec<u8>, Unstored>> {
    IdempotencyLayer::new(MemoryStore::new())
}

const JSON: (&str, &str) = ("content-type", "application/json");

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_concurrent_duplicates_run_the_handler_once() {
    let replays = Arc::new(AtomicU64::new(0));
    let counted = replays.clone();
    let layer = memory().on_replay(move |_, _| {
        counted.fetch_add(1, Ordering::SeqCst);
    });
    let (addr, calls) = common::start(layer).await;
    let client = common::client();
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move {
                send(
                    &client,
                    addr,
                    "POST",
                    "/orders",
                    &[
                        ("idempotency-key", "order-0200"),
                        JSON,
                        ("x-respond", r#"{"delay_ms":100}"#),
                    ],
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
        "the handler ran more than once"
    );
    assert!(answers.iter().all(|a| a.status == 201));
    assert!(answers.iter().all(|a| a.body == answers[0].body));
    assert_eq!(&answers[0].body[..], br#"{"call":1}"#);
    let replayed = answers.iter().filter(|a| a.replayed()).count();
    assert_eq!(replayed, 199, "all but the first are replays");
    assert_eq!(
        replays.load(Ordering::SeqCst),
        199,
        "on_replay once per replay"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5xx_is_not_stored_and_the_retry_runs_again() {
    let layer = memory();
    let (addr, calls) = common::start(layer.clone()).await;
    let client = common::client();
    let key = ("idempotency-key", "order-0500");
    let a = send(
        &client,
        addr,
        "POST",
        "/orders",
        &[key, ("x-respond", r#"{"status":500}"#)],
        b"x",
    )
    .await;
    assert_eq!((a.status, a.replayed()), (500, false));
    let b = send(&client, addr, "POST", "/orders", &[key], b"x").await;
    assert_eq!(
        (b.status, b.replayed(), &b.body[..]),
        (201, false, &br#"{"call":2}"#[..])
    );
    let c = send(&client, addr, "POST", "/orders", &[key], b"x").await;
    assert_eq!(
        (c.status, c.replayed(), &c.body[..]),
        (201, true, &br#"{"call":2}"#[..])
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    let n = layer.counters();
    assert_eq!((n.led, n.stored, n.not_stored, n.replayed), (2, 1, 1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_cap_is_sent_whole_and_not_stored() {
    let layer = memory().body_cap(1000);
    let (addr, calls) = common::start(layer.clone()).await;
    let client = common::client();
    let headers = [
        ("idempotency-key", "order-big1"),
        ("x-respond", r#"{"bytes":100000}"#),
    ];
    for call in 1..=2 {
        let a = send(&client, addr, "POST", "/orders", &headers, b"x").await;
        assert_eq!(
            (a.status, a.replayed(), a.body.len()),
            (201, false, 100_000)
        );
        assert!(a.body.iter().all(|b| *b == b'x'));
        assert_eq!(calls.load(Ordering::SeqCst), call);
    }
    assert_eq!(layer.counters().stored, 0);
}

/// A handler whose body is two chunks, the second one sent when the test allows.
async fn streaming(State((calls, gate)): State<(Arc<AtomicU64>, Arc<Semaphore>)>) -> Response {
    calls.fetch_add(1, Ordering::SeqCst);
    let first = Bytes::from(vec![b'a'; 2000]);
    let stream = futures::stream::unfold(0, move |i| {
        let (gate, first) = (gate.clone(), first.clone());
        async move {
            match i {
                0 => Some((Ok::<_, Infallible>(first), 1)),
                1 => {
                    gate.acquire().await.unwrap().forget();
                    Some((Ok(Bytes::from_static(b"end")), 2))
                }
                _ => None,
            }
        }
    });
    Response::builder()
        .status(201)
        .body(AxumBody::from_stream(stream))
        .unwrap()
}

/// An unstored (over-cap) response holds its key until its body has been sent: a
/// duplicate waits meanwhile and leads afterwards; it never runs alongside.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_over_cap_body_holds_the_key_until_it_is_sent() {
    let calls = Arc::new(AtomicU64::new(0));
    let gate = Arc::new(Semaphore::new(0));
    let app = Router::new()
        .route("/stream", post(streaming))
        .route_layer(memory().body_cap(1000))
        .with_state((calls.clone(), gate.clone()));
    let addr = common::serve(app).await;
    let client = common::client();
    let key = [("idempotency-key", "stream-0001")];
    let first = {
        let client = client.clone();
        tokio::spawn(async move { send(&client, addr, "POST", "/stream", &key, b"x").await })
    };
    while calls.load(Ordering::SeqCst) < 1 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let second = {
        let client = client.clone();
        tokio::spawn(async move { send(&client, addr, "POST", "/stream", &key, b"x").await })
    };
    // The first body is half sent: the duplicate must not run the handler.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the key was handed over mid-body"
    );
    assert!(!second.is_finished());
    gate.add_permits(2);
    let a = first.await.unwrap();
    assert_eq!((a.status, a.body.len(), a.replayed()), (201, 2003, false));
    let b = second.await.unwrap();
    assert_eq!((b.status, b.body.len(), b.replayed()), (201, 2003, false));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// A client that goes away while the handler runs drops it: the key is released and
/// the next request with the key runs the handler (nothing was stored).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_client_went_away_is_not_stored() {
    let (addr, calls) = common::start(memory().wait(false)).await;
    let client = common::client();
    let key = ("idempotency-key", "order-gone");
    let slow = {
        let client = client.clone();
        tokio::spawn(async move {
            send(
                &client,
                addr,
                "POST",
                "/orders",
                &[key, ("x-respond", r#"{"delay_ms":5000}"#)],
                b"x",
            )
            .await
        })
    };
    while calls.load(Ordering::SeqCst) < 1 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    slow.abort();
    // Bounded: the server notices the closed connection and drops the handler.
    let mut answer = None;
    for _ in 0..100 {
        let a = send(
            &client,
            addr,
            "POST",
            "/orders",
            &[key, ("x-respond", r#"{"delay_ms":0}"#)],
            b"x",
        )
        .await;
        if a.status != 409 {
            answer = Some(a);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let a = answer.expect("the key was never released");
    assert_eq!(
        (a.status, a.replayed(), &a.body[..]),
        (201, false, &br#"{"call":2}"#[..])
    );
}

/// A handler that panics wakes its waiters with a 500 problem (they do not run it
/// again), and the key is released for a later retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_panicking_handler_answers_its_waiters_with_500_and_releases_the_key() {
    let (addr, calls) = common::start(memory()).await;
    let client = common::client();
    let key = ("idempotency-key", "order-panic");
    let leader = {
        let client = client.clone();
        tokio::spawn(async move {
            let req = http::Request::post(format!("http://{addr}/orders"))
                .header(key.0, key.1)
                .header("x-respond", r#"{"delay_ms":300,"panic":true}"#)
                .body(http_body_util::Full::new(Bytes::from_static(b"x")))
                .unwrap();
            client.request(req).await.map(|r| r.status().as_u16())
        })
    };
    while calls.load(Ordering::SeqCst) < 1 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let waiters: Vec<_> = (0..5)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move { send(&client, addr, "POST", "/orders", &[key], b"x").await })
        })
        .collect();
    for w in waiters {
        let a = w.await.unwrap();
        assert_eq!(a.status, 500);
        assert_eq!(a.json()["type"], "urn:oncely:problem:internal");
    }
    // The leader's connection ends without an answer (its task panicked).
    assert!(leader.await.unwrap().is_err());
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "waiters do not run a panicked handler"
    );
    let a = send(&client, addr, "POST", "/orders", &[key], b"x").await;
    assert_eq!(
        (a.status, a.replayed(), &a.body[..]),
        (201, false, &br#"{"call":2}"#[..])
    );
}

/// Runs the handler for `/orders`, counting how many run at once.
async fn guarded(State(state): State<Arc<Guarded>>) -> Response {
    let n = state.calls.fetch_add(1, Ordering::SeqCst) + 1;
    let now = state.running.fetch_add(1, Ordering::SeqCst) + 1;
    state.max_running.fetch_max(now, Ordering::SeqCst);
    struct Done<'a>(&'a AtomicU64);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
    let _done = Done(&state.running);
    tokio::time::sleep(Duration::from_millis(20)).await;
    Response::builder()
        .status(201)
        .body(AxumBody::from(format!("{{\"call\":{n}}}")))
        .unwrap()
}

#[derive(Default)]
struct Guarded {
    calls: AtomicU64,
    running: AtomicU64,
    max_running: AtomicU64,
}

/// 300 requests with one key whose clients give up at random moments (cancelling
/// leaders and waiters mid-flight): the handler never runs twice at once, every
/// request that is not cancelled gets an answer, and all of them the same one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancelled_leaders_hand_over_one_at_a_time_and_every_waiter_ends() {
    let state = Arc::new(Guarded::default());
    let app = Router::new()
        .route("/orders", post(guarded))
        .route_layer(memory())
        .with_state(state.clone());
    let addr = common::serve(app).await;
    let client = common::client();
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut tasks = Vec::new();
    for i in 0..300u64 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let give_up = (i % 3 != 0).then_some(Duration::from_millis(seed % 60));
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(seed % 40)).await;
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
        if let Some(a) = t.await.unwrap() {
            assert_eq!(a.status, 201, "{:?}", a.body);
            bodies.push(a.body);
        }
    }
    assert!(
        bodies.len() >= 100,
        "every third request waits for its answer"
    );
    assert!(
        bodies.iter().all(|b| *b == bodies[0]),
        "one answer for the key"
    );
    assert_eq!(
        state.max_running.load(Ordering::SeqCst),
        1,
        "two handlers ran at once"
    );
    // Afterwards the key is settled: a retry is a replay of that answer.
    let a = send(
        &client,
        addr,
        "POST",
        "/orders",
        &[("idempotency-key", "order-storm")],
        b"x",
    )
    .await;
    assert_eq!((a.replayed(), &a.body), (true, &bodies[0]));
}

/// A memory store whose `complete` fails as an unreachable store does: the record is
/// not written and the claim is released.
#[derive(Clone, Default)]
struct Unwritable(MemoryStore<Vec<u8>, Unstored>);

impl Store for Unwritable {
    type Lease = oncely::Lease<Vec<u8>, Unstored>;
    type Join = oncely::Join<Vec<u8>, Unstored>;
    fn begin<'a>(
        &'a self,
        key: &'a oncely::ScopedKey,
        fingerprint: &'a str,
        options: oncely::ExecuteOptions,
    ) -> BoxFuture<'a, Result<StoreBegin<Self>, oncely::Error>> {
        Box::pin(std::future::ready(self.0.begin(key, fingerprint, options)))
    }
    fn complete(lease: Self::Lease, _: Vec<u8>) -> BoxFuture<'static, Result<(), oncely::Error>> {
        drop(lease);
        Box::pin(std::future::ready(Err(oncely::Error::Unavailable(
            "the store went away".into(),
        ))))
    }
    fn fail(lease: Self::Lease, unstored: Unstored) -> BoxFuture<'static, Arc<Unstored>> {
        Box::pin(std::future::ready(lease.fail_now(unstored)))
    }
}

/// The handler ran but its response could not be stored: the client still gets that
/// response (not a retryable 503, whose retry would run the handler again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_the_store_cannot_keep_is_still_the_answer() {
    let layer = IdempotencyLayer::new(Unwritable::default());
    let (addr, calls) = common::start(layer.clone()).await;
    let client = common::client();
    let a = send(
        &client,
        addr,
        "POST",
        "/orders",
        &[("idempotency-key", "order-nostore")],
        b"x",
    )
    .await;
    assert_eq!(
        (a.status, a.replayed(), &a.body[..]),
        (201, false, &br#"{"call":1}"#[..])
    );
    assert_eq!(a.header("etag"), Some("\"call-1\""));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let n = layer.counters();
    assert_eq!((n.led, n.stored, n.not_stored, n.refused), (1, 0, 1, 0));
}

/// An event stream: one event at once, then the next when the test allows.
async fn events(State((calls, gate)): State<(Arc<AtomicU64>, Arc<Semaphore>)>) -> Response {
    calls.fetch_add(1, Ordering::SeqCst);
    let stream = futures::stream::unfold(0, move |i| {
        let gate = gate.clone();
        async move {
            match i {
                0 => Some((Ok::<_, Infallible>(Bytes::from_static(b"data: one\n\n")), 1)),
                1 => {
                    gate.acquire().await.unwrap().forget();
                    Some((Ok(Bytes::from_static(b"data: two\n\n")), 2))
                }
                _ => None,
            }
        }
    });
    Response::builder()
        .status(200)
        .header("content-type", "text/event-stream")
        .body(AxumBody::from_stream(stream))
        .unwrap()
}

/// An event stream far under the cap reaches its client as it is produced (it is not
/// held back to be stored), holds its key while it runs and is not stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_stream_is_sent_as_it_comes_and_not_stored() {
    use http_body_util::BodyExt;
    let calls = Arc::new(AtomicU64::new(0));
    let gate = Arc::new(Semaphore::new(0));
    let layer = memory();
    let app = Router::new()
        .route("/events", post(events))
        .route_layer(layer.clone())
        .with_state((calls.clone(), gate.clone()));
    let addr = common::serve(app).await;
    let client = common::client();
    let req = http::Request::post(format!("http://{addr}/events"))
        .header("idempotency-key", "events-0001")
        .body(http_body_util::Full::new(Bytes::from_static(b"x")))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
        .await
        .expect("no response head within 10 s: the stream was held back")
        .unwrap();
    let mut body = resp.into_body();
    let first = tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .expect("no first event within 10 s: the stream was held back")
        .unwrap()
        .unwrap()
        .into_data()
        .unwrap();
    assert_eq!(&first[..], b"data: one\n\n");
    // The stream still runs: a duplicate must not run the handler meanwhile.
    let dup = {
        let client = client.clone();
        tokio::spawn(async move {
            send(
                &client,
                addr,
                "POST",
                "/events",
                &[("idempotency-key", "events-0001")],
                b"x",
            )
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the key was handed over mid-stream"
    );
    gate.add_permits(2);
    let rest = body.collect().await.unwrap().to_bytes();
    assert_eq!(&rest[..], b"data: two\n\n");
    let b = dup.await.unwrap();
    assert_eq!((b.status, b.replayed()), (200, false));
    assert_eq!(&b.body[..], b"data: one\n\ndata: two\n\n");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(layer.counters().stored, 0);
}

/// A GET is passed through untouched whatever its content type: a gRPC content type
/// does not make it a covered gRPC call (gRPC calls are POSTs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_with_a_grpc_content_type_is_passed_through() {
    let layer = memory();
    let (addr, calls) = common::start(layer.clone()).await;
    let client = common::client();
    let grpc = ("content-type", "application/grpc");
    let a = send(&client, addr, "GET", "/orders", &[grpc], b"").await;
    assert_eq!(
        (a.status, a.replayed(), &a.body[..]),
        (201, false, &br#"{"call":1}"#[..])
    );
    let keyed = [grpc, ("x-idempotency-key", "order-get1")];
    for call in 2..=3 {
        let a = send(&client, addr, "GET", "/orders", &keyed, b"").await;
        assert_eq!((a.status, a.replayed()), (201, false));
        assert_eq!(a.json()["call"], call);
    }
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    let n = layer.counters();
    assert_eq!((n.passed_through, n.refused, n.led), (3, 0, 0));
}

/// A body over the cap, sent in 5 chunks 5 ms apart; `running` counts the handlers
/// whose body is not yet finished or dropped.
async fn guarded_stream(State(state): State<Arc<Guarded>>) -> Response {
    state.calls.fetch_add(1, Ordering::SeqCst);
    let now = state.running.fetch_add(1, Ordering::SeqCst) + 1;
    state.max_running.fetch_max(now, Ordering::SeqCst);
    struct Done(Arc<Guarded>);
    impl Drop for Done {
        fn drop(&mut self) {
            self.0.running.fetch_sub(1, Ordering::SeqCst);
        }
    }
    let done = Done(state.clone());
    let stream = futures::stream::unfold((0, done), |(i, done)| async move {
        if i == 5 {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        Some((
            Ok::<_, Infallible>(Bytes::from(vec![b'z'; 400])),
            (i + 1, done),
        ))
    });
    Response::builder()
        .status(201)
        .body(AxumBody::from_stream(stream))
        .unwrap()
}

/// 200 same-key requests for a body over the cap whose clients give up at random
/// moments, many of them mid-body: a body dropped mid-stream releases the key, the
/// next request leads, two bodies never stream at once, and every request that is not
/// cancelled gets the whole body.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bodies_dropped_mid_stream_hand_the_key_over_one_at_a_time() {
    use http_body_util::BodyExt;
    let state = Arc::new(Guarded::default());
    let app = Router::new()
        .route("/stream", post(guarded_stream))
        .route_layer(memory().body_cap(1000))
        .with_state(state.clone());
    let addr = common::serve(app).await;
    let client = common::client();
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let mut tasks = Vec::new();
    for i in 0..200u64 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let give_up = (i % 4 != 0).then_some(Duration::from_millis(seed % 80));
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(seed % 50)).await;
            let req = http::Request::post(format!("http://{addr}/stream"))
                .header("idempotency-key", "stream-storm")
                .body(http_body_util::Full::new(Bytes::from_static(b"x")))
                .unwrap();
            let whole = async {
                let resp = client.request(req).await.expect("the request failed");
                let status = resp.status().as_u16();
                (status, resp.into_body().collect().await.unwrap().to_bytes())
            };
            match give_up {
                Some(d) => tokio::time::timeout(d, whole).await.ok(),
                None => Some(
                    tokio::time::timeout(Duration::from_secs(60), whole)
                        .await
                        .expect("no answer within 60 s: a hang"),
                ),
            }
        }));
    }
    let mut answered = 0;
    for t in tasks {
        if let Some((status, body)) = t.await.unwrap() {
            assert_eq!((status, body.len()), (201, 2000));
            answered += 1;
        }
    }
    assert!(answered >= 50, "every fourth request waits for its answer");
    assert_eq!(
        state.max_running.load(Ordering::SeqCst),
        1,
        "two bodies streamed at once"
    );
    // Every body has ended or been dropped, so the key is free again.
    for _ in 0..100 {
        if state.running.load(Ordering::SeqCst) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(state.running.load(Ordering::SeqCst), 0);
}

/// A slow 503 with `Retry-After`, a custom header and a cookie.
async fn busy(State(calls): State<Arc<AtomicU64>>) -> Response {
    calls.fetch_add(1, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await;
    Response::builder()
        .status(503)
        .header("retry-after", "7")
        .header("x-reason", "maintenance")
        .header("set-cookie", "session=leader")
        .body(AxumBody::from("busy"))
        .unwrap()
}

/// A duplicate that waited for a response that is not stored gets that whole answer
/// (its `Retry-After` too), not only the headers a stored response keeps; cookies stay
/// the first client's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_gets_the_whole_unstored_answer() {
    let calls = Arc::new(AtomicU64::new(0));
    let app = Router::new()
        .route("/busy", post(busy))
        .route_layer(memory())
        .with_state(calls.clone());
    let addr = common::serve(app).await;
    let client = common::client();
    let key = [("idempotency-key", "busy-0001")];
    let first = {
        let client = client.clone();
        tokio::spawn(async move { send(&client, addr, "POST", "/busy", &key, b"x").await })
    };
    while calls.load(Ordering::SeqCst) < 1 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let waiter = send(&client, addr, "POST", "/busy", &key, b"x").await;
    let first = first.await.unwrap();
    assert_eq!((first.status, first.replayed()), (503, false));
    assert_eq!(
        (waiter.status, waiter.replayed(), &waiter.body[..]),
        (503, true, &b"busy"[..])
    );
    assert_eq!(waiter.header("retry-after"), Some("7"));
    assert_eq!(waiter.header("x-reason"), Some("maintenance"));
    assert_eq!(waiter.header("set-cookie"), None);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A handler that writes a body to a HEAD, or with a 204 (a server sends none): the
/// record keeps what was sent, no body, so its replay has none either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_without_content_is_stored_without_its_body() {
    use http_body_util::{BodyExt, Full};
    use tower::{Layer, ServiceExt};
    for (method, status) in [(http::Method::HEAD, 200u16), (http::Method::POST, 204)] {
        let calls = Arc::new(AtomicU64::new(0));
        let counted = calls.clone();
        let handler = tower::service_fn(move |_req: http::Request<_>| {
            counted.fetch_add(1, Ordering::SeqCst);
            async move {
                Ok::<_, Infallible>(
                    http::Response::builder()
                        .status(status)
                        .header("etag", "\"1\"")
                        .body(Full::new(Bytes::from_static(b"hello")))
                        .unwrap(),
                )
            }
        });
        let svc = memory().methods([method.clone()]).layer(handler);
        let mut bodies = Vec::new();
        for _ in 0..2 {
            let req = http::Request::builder()
                .method(method.clone())
                .uri("/orders")
                .header("idempotency-key", "order-head-0001")
                .body(Full::new(Bytes::new()))
                .unwrap();
            let resp = svc.clone().oneshot(req).await.unwrap();
            let replayed = resp.headers().contains_key("idempotent-replayed");
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            bodies.push((replayed, body));
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1, "{method} {status}");
        // The first answer goes out as the handler gave it (the server drops its body).
        assert_eq!(bodies[0], (false, Bytes::from_static(b"hello")));
        assert_eq!(bodies[1], (true, Bytes::new()), "{method} {status}");
    }
}
