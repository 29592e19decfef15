//! The layer on a gRPC (tonic) service served over HTTP/2 on 127.0.0.1, called with a
//! tonic client: the key is the `x-idempotency-key` metadata, refusals are gRPC
//! statuses, and a replay keeps the grpc-status trailers and adds the trailing
//! metadata `idempotent-replayed: true`.

mod common;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use common::Calls;
use http::uri::PathAndQuery;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use oncely::MemoryStore;
use oncely_tower::{IdempotencyLayer, Unstored};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;

#[derive(Clone, PartialEq, prost::Message)]
struct CreateOrder {
    #[prost(string, tag = "1")]
    sku: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Order {
    #[prost(uint64, tag = "1")]
    call: u64,
    #[prost(string, tag = "2")]
    sku: String,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// `/test.Orders/Create`: counts its calls; sku "unavailable" → UNAVAILABLE, "invalid" →
/// INVALID_ARGUMENT, "slow" → answers after 300 ms.
struct Create(Calls);

impl tonic::server::UnaryService<CreateOrder> for Create {
    type Response = Order;
    type Future = BoxFuture<Result<tonic::Response<Order>, Status>>;
    fn call(&mut self, req: tonic::Request<CreateOrder>) -> Self::Future {
        let n = self.0.fetch_add(1, Ordering::SeqCst) + 1;
        let sku = req.into_inner().sku;
        Box::pin(async move {
            match sku.as_str() {
                "unavailable" => Err(Status::unavailable("try later")),
                "invalid" => Err(Status::invalid_argument(format!("bad sku (call {n})"))),
                _ => {
                    if sku == "slow" {
                        tokio::time::sleep(Duration::from_millis(300)).await;
                    }
                    Ok(tonic::Response::new(Order { call: n, sku }))
                }
            }
        })
    }
}

#[derive(Clone)]
struct Orders(Calls);

impl tower::Service<http::Request<axum::body::Body>> for Orders {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }
    fn call(&mut self, req: http::Request<axum::body::Body>) -> Self::Future {
        let calls = self.0.clone();
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Order, CreateOrder>::default());
            Ok(grpc.unary(Create(calls), req).await)
        })
    }
}

type Layer = IdempotencyLayer<MemoryStore<Vec<u8>, Unstored>>;

async fn start(layer: Layer) -> (SocketAddr, Calls) {
    let calls = Calls::default();
    let app = Router::new()
        .route_service("/test.Orders/Create", Orders(calls.clone()))
        .layer(layer);
    (common::serve(app).await, calls)
}

type GrpcClient = tonic::client::Grpc<Client<HttpConnector, tonic::body::Body>>;

fn client(addr: SocketAddr) -> GrpcClient {
    let http = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    tonic::client::Grpc::with_origin(http, format!("http://{addr}").parse().unwrap())
}

/// Calls Create; the answer's message or status, and whether it was replayed.
async fn create(
    client: &GrpcClient,
    key: Option<&str>,
    sku: &str,
) -> (Result<Order, Status>, bool, tonic::metadata::MetadataMap) {
    let mut client = client.clone();
    let mut req = tonic::Request::new(CreateOrder { sku: sku.into() });
    if let Some(k) = key {
        req.metadata_mut()
            .insert("x-idempotency-key", k.parse().unwrap());
    }
    let fut = async {
        client.ready().await.unwrap();
        client
            .unary(
                req,
                PathAndQuery::from_static("/test.Orders/Create"),
                ProstCodec::<CreateOrder, Order>::default(),
            )
            .await
    };
    let answer = tokio::time::timeout(Duration::from_secs(20), fut)
        .await
        .expect("no answer within 20 s: a hang");
    let metadata = match &answer {
        Ok(r) => r.metadata().clone(),
        Err(s) => s.metadata().clone(),
    };
    let replayed = metadata
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    (answer.map(tonic::Response::into_inner), replayed, metadata)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_call_is_replayed_with_its_trailers() {
    let (addr, calls) = start(IdempotencyLayer::new(MemoryStore::new())).await;
    let c = client(addr);
    let (first, replayed, _) = create(&c, Some("order-0001"), "A1").await;
    assert_eq!((first.unwrap().call, replayed), (1, false));
    let (again, replayed, metadata) = create(&c, Some("order-0001"), "A1").await;
    assert_eq!((again.unwrap().call, replayed), (1, true));
    assert!(metadata.get("grpc-status").is_none() || metadata.get("grpc-status").unwrap() == "0");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_grpc_statuses() {
    let (addr, calls) = start(IdempotencyLayer::new(MemoryStore::new())).await;
    let c = client(addr);
    let (missing, _, _) = create(&c, None, "A1").await;
    assert_eq!(missing.unwrap_err().code(), Code::InvalidArgument);
    let (invalid, _, _) = create(&c, Some("bad key!"), "A1").await;
    assert_eq!(invalid.unwrap_err().code(), Code::InvalidArgument);
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    create(&c, Some("order-0002"), "A1").await.0.unwrap();
    let (other, _, _) = create(&c, Some("order-0002"), "B2").await;
    assert_eq!(other.unwrap_err().code(), Code::FailedPrecondition);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_progress_without_waiting_is_aborted_with_pushback() {
    let (addr, calls) = start(IdempotencyLayer::new(MemoryStore::new()).wait(false)).await;
    let c = client(addr);
    let slow = {
        let c = c.clone();
        tokio::spawn(async move { create(&c, Some("order-slow"), "slow").await })
    };
    while calls.load(Ordering::SeqCst) < 1 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (busy, _, metadata) = create(&c, Some("order-slow"), "slow").await;
    assert_eq!(busy.unwrap_err().code(), Code::Aborted);
    assert_eq!(metadata.get("grpc-retry-pushback-ms").unwrap(), "1000");
    assert_eq!(slow.await.unwrap().0.unwrap().call, 1);
    let (later, replayed, _) = create(&c, Some("order-slow"), "slow").await;
    assert_eq!((later.unwrap().call, replayed), (1, true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unavailable_is_not_stored_and_invalid_argument_is() {
    let (addr, calls) = start(IdempotencyLayer::new(MemoryStore::new())).await;
    let c = client(addr);
    for call in 1..=2 {
        let (answer, replayed, _) = create(&c, Some("order-unav"), "unavailable").await;
        assert_eq!(
            (answer.unwrap_err().code(), replayed),
            (Code::Unavailable, false)
        );
        assert_eq!(calls.load(Ordering::SeqCst), call);
    }
    let (first, replayed, _) = create(&c, Some("order-inva"), "invalid").await;
    let first = first.unwrap_err();
    assert_eq!((first.code(), replayed), (Code::InvalidArgument, false));
    let (again, replayed, _) = create(&c, Some("order-inva"), "invalid").await;
    let again = again.unwrap_err();
    assert_eq!(
        (again.code(), again.message(), replayed),
        (Code::InvalidArgument, first.message(), true)
    );
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_concurrent_calls_with_one_key_run_once() {
    let (addr, calls) = start(IdempotencyLayer::new(MemoryStore::new())).await;
    let c = client(addr);
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let c = c.clone();
            tokio::spawn(async move { create(&c, Some("order-many"), "slow").await })
        })
        .collect();
    let mut replays = 0;
    for t in tasks {
        let (answer, replayed, _) = t.await.unwrap();
        assert_eq!(answer.unwrap().call, 1);
        replays += usize::from(replayed);
    }
    assert_eq!(replays, 49);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_not_listed_in_grpc_methods_pass_through() {
    let layer = IdempotencyLayer::new(MemoryStore::new()).grpc_methods(["/test.Orders/Other"]);
    let (addr, calls) = start(layer).await;
    let c = client(addr);
    for call in 1..=2 {
        let (answer, replayed, _) = create(&c, Some("order-pass"), "A1").await;
        assert_eq!((answer.unwrap().call, replayed), (call, false));
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// A tonic client over the RetryLayer (its bodies read whole by BufferBodyLayer): the
/// first attempt reaches the server, whose handler runs, but its answer is lost; the
/// retry sends the same `x-idempotency-key` (added by the layer) and gets the answer
/// replayed with its trailers: one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tonic_client_retrying_a_lost_answer_gets_one_effect() {
    use bytes::Bytes;
    use http_body_util::Full;
    use oncely_tower::{BoxError, BufferBodyLayer, RetryLayer};
    use std::sync::atomic::AtomicU64;
    use std::sync::{Arc, Mutex};
    use tower::{service_fn, ServiceBuilder};

    let (addr, calls) = start(IdempotencyLayer::new(MemoryStore::new())).await;
    let http: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let attempts = Arc::new(AtomicU64::new(0));
    let keys = Arc::new(Mutex::new(Vec::new()));
    let (a, k) = (attempts.clone(), keys.clone());
    let lossy = service_fn(move |req: http::Request<Full<Bytes>>| {
        let (http, a, k) = (http.clone(), a.clone(), k.clone());
        async move {
            k.lock()
                .unwrap()
                .push(req.headers().get("x-idempotency-key").cloned());
            let resp = http.request(req).await?;
            if a.fetch_add(1, Ordering::SeqCst) == 0 {
                drop(resp);
                return Err::<_, BoxError>("the connection was lost".into());
            }
            Ok(resp)
        }
    });
    let stack = ServiceBuilder::new()
        .layer(BufferBodyLayer)
        .layer(
            RetryLayer::new()
                .policy(
                    oncely::RetryPolicy::new()
                        .with_max_attempts(3)
                        .with_base_delay(Duration::from_millis(5)),
                )
                .unwrap(),
        )
        .service(lossy);
    let mut grpc =
        tonic::client::Grpc::with_origin(stack, format!("http://{addr}").parse().unwrap());
    let call = async {
        grpc.ready().await.unwrap();
        grpc.unary(
            tonic::Request::new(CreateOrder { sku: "A1".into() }),
            PathAndQuery::from_static("/test.Orders/Create"),
            ProstCodec::<CreateOrder, Order>::default(),
        )
        .await
    };
    let answer = tokio::time::timeout(Duration::from_secs(20), call)
        .await
        .expect("no answer within 20 s: a hang")
        .expect("the retry got the answer");
    assert_eq!(
        answer
            .metadata()
            .get("idempotent-replayed")
            .map(|v| v.to_str().unwrap()),
        Some("true")
    );
    assert_eq!(answer.into_inner().call, 1);
    assert_eq!(attempts.load(Ordering::SeqCst), 2);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "one effect");
    let keys = keys.lock().unwrap();
    assert!(
        keys[0].is_some() && keys[0] == keys[1],
        "one key for both attempts"
    );
}

/// `/test.Orders/Create` answered with a message but no trailers (no grpc-status): a
/// broken answer whose outcome is unknown.
#[derive(Clone)]
struct NoTrailers(Calls);

impl tower::Service<http::Request<axum::body::Body>> for NoTrailers {
    type Response = http::Response<axum::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }
    fn call(&mut self, _: http::Request<axum::body::Body>) -> Self::Future {
        let n = self.0.fetch_add(1, Ordering::SeqCst) + 1;
        Box::pin(async move {
            let message = prost::Message::encode_to_vec(&Order {
                call: n,
                sku: "A1".into(),
            });
            let mut framed = vec![0u8];
            framed.extend_from_slice(&(message.len() as u32).to_be_bytes());
            framed.extend_from_slice(&message);
            Ok(http::Response::builder()
                .header("content-type", "application/grpc")
                .body(axum::body::Body::from(framed))
                .unwrap())
        })
    }
}

/// An answer whose trailers were never sent has no outcome: it is not stored and never
/// replayed to a later retry, which runs the handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_without_trailers_is_not_stored() {
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(MemoryStore::new());
    let app = Router::new()
        .route_service("/test.Orders/Create", NoTrailers(calls.clone()))
        .layer(layer.clone());
    let c = client(common::serve(app).await);
    for call in 1..=2 {
        let (answer, replayed, _) = create(&c, Some("order-notr"), "A1").await;
        assert!(answer.is_err(), "an answer without grpc-status is an error");
        assert!(!replayed);
        assert_eq!(calls.load(Ordering::SeqCst), call);
    }
    let n = layer.counters();
    assert_eq!((n.stored, n.not_stored, n.replayed), (0, 2, 0));
}
