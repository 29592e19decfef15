//! The client-side RetryLayer against a real server behind the IdempotencyLayer.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use oncely::{MemoryStore, RetryPolicy};
use oncely_tower::{IdempotencyLayer, RetryError, RetryLayer, Unstored};
use tower::{service_fn, BoxError, Service, ServiceBuilder, ServiceExt};

type Req = http::Request<Full<Bytes>>;

fn post_orders(addr: SocketAddr) -> Req {
    http::Request::post(format!("http://{addr}/orders"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(br#"{"sku":"A1"}"#)))
        .unwrap()
}

fn policy() -> RetryPolicy {
    RetryPolicy::new()
        .with_max_attempts(4)
        .with_base_delay(Duration::from_millis(5))
}

/// The response of the first attempt is lost after the server ran the handler (the
/// client sees a broken connection); the retry sends the same key and gets the stored
/// response replayed: one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_response_is_retried_with_the_same_key_and_applied_once() {
    let (addr, calls) = common::start(IdempotencyLayer::new(
        MemoryStore::<Vec<u8>, Unstored>::new(),
    ))
    .await;
    let client = common::client();
    let attempts = Arc::new(AtomicU64::new(0));
    let keys = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (a, k) = (attempts.clone(), keys.clone());
    let lossy = service_fn(move |req: Req| {
        let (client, a, k) = (client.clone(), a.clone(), k.clone());
        async move {
            k.lock()
                .unwrap()
                .push(req.headers()["idempotency-key"].clone());
            let resp = client.request(req).await?;
            if a.fetch_add(1, Ordering::SeqCst) == 0 {
                drop(resp);
                return Err::<_, BoxError>("connection reset after the request was sent".into());
            }
            Ok(resp)
        }
    });
    let mut svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(policy()).unwrap())
        .service(lossy);
    let resp = svc
        .ready()
        .await
        .unwrap()
        .call(post_orders(addr))
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    assert_eq!(resp.headers()["idempotent-replayed"], "true");
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], br#"{"call":1}"#);
    assert_eq!(attempts.load(Ordering::SeqCst), 2);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "one effect");
    let keys = keys.lock().unwrap();
    assert_eq!(keys.len(), 2);
    assert_eq!(keys[0], keys[1], "every attempt sends the same key");
}

async fn flaky(State(calls): State<Arc<AtomicU64>>) -> Response {
    match calls.fetch_add(1, Ordering::SeqCst) {
        0 => (
            http::StatusCode::SERVICE_UNAVAILABLE,
            [("retry-after", "0")],
            "busy",
        )
            .into_response(),
        _ => (http::StatusCode::CREATED, "done").into_response(),
    }
}

async fn invalid(State(calls): State<Arc<AtomicU64>>) -> Response {
    calls.fetch_add(1, Ordering::SeqCst);
    (http::StatusCode::UNPROCESSABLE_ENTITY, "no").into_response()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_is_retried_and_a_422_is_not() {
    let calls = Arc::new(AtomicU64::new(0));
    let app = Router::new()
        .route("/orders", post(flaky))
        .route("/invalid", post(invalid))
        .with_state(calls.clone());
    let addr = common::serve(app).await;
    let mut svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(policy()).unwrap())
        .service(common::client());
    let resp = svc
        .ready()
        .await
        .unwrap()
        .call(post_orders(addr))
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    let req = http::Request::post(format!("http://{addr}/invalid"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = svc.ready().await.unwrap().call(req).await.unwrap();
    assert_eq!(resp.status(), 422);
    assert_eq!(calls.load(Ordering::SeqCst), 3, "a 422 is final");
}

/// Without a key a POST is not safe to resend: a lost answer is not retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unkeyed_post_is_not_resent_after_a_lost_answer() {
    let attempts = Arc::new(AtomicU64::new(0));
    let a = attempts.clone();
    let lossy = service_fn(move |_req: Req| {
        a.fetch_add(1, Ordering::SeqCst);
        async { Err::<http::Response<Full<Bytes>>, BoxError>("connection reset".into()) }
    });
    let mut svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .methods([http::Method::PATCH])
                .policy(policy())
                .unwrap(),
        )
        .service(lossy);
    let req = http::Request::post("http://127.0.0.1:9/orders")
        .body(Full::new(Bytes::new()))
        .unwrap();
    assert!(svc.ready().await.unwrap().call(req).await.is_err());
    assert_eq!(attempts.load(Ordering::SeqCst), 1);
}

/// A TCP proxy in front of `server`: on its first connection it relays the request,
/// waits for the first bytes of the answer (the handler has run) and closes the
/// connection without relaying them; later connections are relayed both ways.
async fn dropping_proxy(server: SocketAddr) -> (SocketAddr, Arc<AtomicU64>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let dropped = Arc::new(AtomicU64::new(0));
    let seen = dropped.clone();
    tokio::spawn(async move {
        let mut n = 0u64;
        loop {
            let (mut client, _) = listener.accept().await.unwrap();
            n += 1;
            let first = n == 1;
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut upstream = tokio::net::TcpStream::connect(server).await.unwrap();
                if !first {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                    return;
                }
                let (mut up_read, mut up_write) = upstream.into_split();
                let (mut c_read, _c_write) = client.into_split();
                let relay = tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    loop {
                        match c_read.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(k) => {
                                if up_write.write_all(&buf[..k]).await.is_err() {
                                    break;
                                }
                            }
                        }
                    }
                });
                let mut buf = [0u8; 1];
                let got = up_read.read(&mut buf).await.unwrap();
                assert!(got > 0, "the server answered");
                seen.fetch_add(1, Ordering::SeqCst);
                // Both halves dropped: the client's connection closes unanswered.
                relay.abort();
            });
        }
    });
    (addr, dropped)
}

/// A real connection closed by the network after the server ran the handler (its
/// answer never reaches the client): the RetryLayer sends the request again with the
/// key it added, on a new connection, and the server replays the stored answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_dropped_after_the_handler_ran_is_retried_to_one_effect() {
    let (server, calls) = common::start(IdempotencyLayer::new(
        MemoryStore::<Vec<u8>, Unstored>::new(),
    ))
    .await;
    let (proxy, dropped) = dropping_proxy(server).await;
    let mut svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(policy()).unwrap())
        .service(common::client());
    let call = async {
        svc.ready()
            .await
            .unwrap()
            .call(post_orders(proxy))
            .await
            .expect("the retry got an answer")
    };
    let resp = tokio::time::timeout(Duration::from_secs(20), call)
        .await
        .expect("no answer within 20 s: a hang");
    assert_eq!(
        dropped.load(Ordering::SeqCst),
        1,
        "the first answer was dropped"
    );
    assert_eq!(resp.status(), 201);
    assert_eq!(resp.headers()["idempotent-replayed"], "true");
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], br#"{"call":1}"#);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "one effect");
}

/// The deadline bounds a running attempt too: a server that does not answer does not
/// hold the call past its timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_ends_an_attempt_that_does_not_answer() {
    let (addr, calls) = common::start(IdempotencyLayer::new(
        MemoryStore::<Vec<u8>, Unstored>::new(),
    ))
    .await;
    let mut svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(policy())
                .unwrap()
                .timeout(Duration::from_millis(300)),
        )
        .service(common::client());
    let mut req = post_orders(addr);
    req.headers_mut()
        .insert("x-respond", r#"{"delay_ms":60000}"#.parse().unwrap());
    let call = async { svc.ready().await.unwrap().call(req).await };
    let outcome = tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .expect("the call outlived its deadline: a hang");
    match outcome {
        Err(e @ RetryError::DeadlineExceeded { attempts: 1 }) => {
            assert_eq!(e.code(), oncely::Code::DeadlineExceeded);
        }
        other => panic!("want DeadlineExceeded after one attempt, got {other:?}"),
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// With a server that does not make duplicates wait: the first attempt's answer is
/// lost while its handler still runs, so the retry (same key) is answered 409 in
/// progress + Retry-After; the layer waits that long and sends the key again, and
/// gets the first attempt's answer replayed: one effect, no 409 to the caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_progress_answer_to_a_keyed_retry_is_waited_out() {
    let (addr, calls) =
        common::start(IdempotencyLayer::new(MemoryStore::<Vec<u8>, Unstored>::new()).wait(false))
            .await;
    let client = common::client();
    let attempts = Arc::new(AtomicU64::new(0));
    let a = attempts.clone();
    let lossy = service_fn(move |req: Req| {
        let (client, a) = (client.clone(), a.clone());
        async move {
            if a.fetch_add(1, Ordering::SeqCst) == 0 {
                // The request reaches the server, whose handler runs on; its answer is
                // lost to this caller.
                let mut req = req;
                req.headers_mut()
                    .insert("x-respond", r#"{"delay_ms":500}"#.parse().unwrap());
                let background = client.request(req);
                tokio::spawn(background);
                tokio::time::sleep(Duration::from_millis(100)).await;
                return Err::<http::Response<hyper::body::Incoming>, BoxError>(
                    "connection reset after the request was sent".into(),
                );
            }
            Ok(client.request(req).await?)
        }
    });
    let mut svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(policy()).unwrap())
        .service(lossy);
    let call = async { svc.ready().await.unwrap().call(post_orders(addr)).await };
    let resp = tokio::time::timeout(Duration::from_secs(20), call)
        .await
        .expect("no answer within 20 s: a hang")
        .unwrap();
    assert_eq!(resp.status(), 201, "the caller got the in-progress answer");
    assert_eq!(resp.headers()["idempotent-replayed"], "true");
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], br#"{"call":1}"#);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "one effect");
    assert_eq!(attempts.load(Ordering::SeqCst), 3);
}

/// A gRPC call with a deadline tells the server the time left (`grpc-timeout`) on
/// every attempt; a shorter one set by the caller is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_call_forwards_the_time_left_as_grpc_timeout() {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let s = seen.clone();
    let server = service_fn(move |req: Req| {
        let s = s.clone();
        async move {
            let mut s = s.lock().unwrap();
            s.push(req.headers().get("grpc-timeout").cloned());
            // UNAVAILABLE (trailers-only) twice, then OK.
            let status = if s.len() < 3 { "14" } else { "0" };
            let resp = http::Response::builder()
                .header("content-type", "application/grpc")
                .header("grpc-status", status)
                .body(Full::new(Bytes::new()))
                .unwrap();
            Ok::<_, BoxError>(resp)
        }
    });
    let mut svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(policy())
                .unwrap()
                .timeout(Duration::from_secs(5)),
        )
        .service(server);
    let grpc_call = |timeout: Option<&str>| {
        let mut req = http::Request::post("http://localhost/pkg.Orders/Create")
            .header("content-type", "application/grpc");
        if let Some(t) = timeout {
            req = req.header("grpc-timeout", t);
        }
        req.body(Full::new(Bytes::new())).unwrap()
    };
    let resp = svc
        .ready()
        .await
        .unwrap()
        .call(grpc_call(None))
        .await
        .unwrap();
    assert_eq!(resp.headers()["grpc-status"], "0");
    {
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 3);
        for v in seen.iter() {
            let v = v.as_ref().expect("grpc-timeout sent").to_str().unwrap();
            let ms: u64 = v
                .strip_suffix('m')
                .expect("in milliseconds")
                .parse()
                .unwrap();
            assert!((1..=5000).contains(&ms), "{v}");
        }
    }
    seen.lock().unwrap().clear();
    svc.ready()
        .await
        .unwrap()
        .call(grpc_call(Some("100m")))
        .await
        .unwrap();
    let seen = seen.lock().unwrap();
    assert!(seen.iter().all(|v| v.as_ref().unwrap() == "100m"));
}

/// One key per logical call: its retries send it again, the next call gets another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_logical_call_has_its_own_key() {
    let keys = Arc::new(std::sync::Mutex::new(Vec::new()));
    let k = keys.clone();
    let server = service_fn(move |req: Req| {
        let k = k.clone();
        async move {
            let mut k = k.lock().unwrap();
            k.push(req.headers()["idempotency-key"].clone());
            // Every call's first attempt gets 503.
            let status = if k.len() % 2 == 1 { 503 } else { 201 };
            Ok::<_, BoxError>(
                http::Response::builder()
                    .status(status)
                    .body(Full::new(Bytes::new()))
                    .unwrap(),
            )
        }
    });
    let mut svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(policy()).unwrap())
        .service(server);
    for _ in 0..3 {
        let req = http::Request::post("http://localhost/orders")
            .body(Full::new(Bytes::from_static(b"x")))
            .unwrap();
        let resp = svc.ready().await.unwrap().call(req).await.unwrap();
        assert_eq!(resp.status(), 201);
    }
    let keys = keys.lock().unwrap();
    assert_eq!(keys.len(), 6);
    for call in 0..3 {
        assert_eq!(
            keys[2 * call],
            keys[2 * call + 1],
            "a retry sends its call's key"
        );
    }
    assert!(keys[0] != keys[2] && keys[2] != keys[4] && keys[0] != keys[4]);
}
