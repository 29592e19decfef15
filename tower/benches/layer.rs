//! The layer's overhead against the bare service, in one run: a replay (the stored
//! response answered without the handler) and a first call (handler run, response
//! stored), both on a `MemoryStore`, each request with a small JSON body.
//!
//! `cargo bench -p oncely-tower --bench layer`. Numbers are per request; the overhead
//! is the layered time minus the bare time.

use std::convert::Infallible;
use std::hint::black_box;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion};
use futures::executor::block_on;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use oncely::MemoryStore;
use oncely_tower::{Body, IdempotencyLayer, Unstored};
use tower::{service_fn, Layer, Service};

type In = Body<Full<Bytes>>;

async fn handler(req: Request<In>) -> Result<Response<Full<Bytes>>, Infallible> {
    // Reads the request body, as a handler that parses it would.
    let Ok(body) = req.into_body().collect().await;
    black_box(body);
    let mut resp = Response::new(Full::new(Bytes::from_static(
        br#"{"id":1,"status":"created"}"#,
    )));
    *resp.status_mut() = http::StatusCode::CREATED;
    resp.headers_mut().insert(
        "content-type",
        http::HeaderValue::from_static("application/json"),
    );
    Ok(resp)
}

fn request<B>(key: &str, body: B) -> Request<B> {
    Request::post("/orders")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(body)
        .unwrap()
}

const BODY: &[u8] = br#"{"sku":"A1","qty":2}"#;

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("tower-layer");
    let mut bare = service_fn(handler);
    group.bench_function("bare service", |b| {
        b.iter(|| {
            let req = request(
                "order-0001",
                Body::wrap(Full::new(Bytes::from_static(BODY))),
            );
            let resp = block_on(bare.call(req)).unwrap();
            black_box(block_on(resp.into_body().collect()).unwrap());
        })
    });

    let store: MemoryStore<Vec<u8>, Unstored> = MemoryStore::new();
    let mut layered = IdempotencyLayer::new(store).layer(service_fn(handler));
    let warm = request("order-0001", Full::new(Bytes::from_static(BODY)));
    block_on(layered.call(warm)).unwrap();
    group.bench_function("layer, replay", |b| {
        b.iter(|| {
            let req = request("order-0001", Full::new(Bytes::from_static(BODY)));
            let resp = block_on(layered.call(req)).unwrap();
            assert_eq!(resp.status(), 201);
            black_box(block_on(resp.into_body().collect()).unwrap());
        })
    });

    let store: MemoryStore<Vec<u8>, Unstored> =
        MemoryStore::builder().max_entries(100_000).build().unwrap();
    let mut layered = IdempotencyLayer::new(store).layer(service_fn(handler));
    let mut n = 0u64;
    group.bench_function("layer, first call", |b| {
        b.iter(|| {
            n += 1;
            let key = format!("order-{n:016}");
            let req = request(&key, Full::new(Bytes::from_static(BODY)));
            let resp = block_on(layered.call(req)).unwrap();
            black_box(block_on(resp.into_body().collect()).unwrap());
        })
    });
    group.bench_function("oncely::http::request_fingerprint alone", |b| {
        b.iter(|| {
            black_box(oncely::http::request_fingerprint(
                "POST",
                "/orders",
                Some("application/json"),
                black_box(BODY),
            ))
        })
    });
    let record = oncely::http::StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), b"application/json".to_vec())],
        body: br#"{"id":1,"status":"created"}"#.to_vec(),
        trailers: vec![],
    }
    .encode();
    group.bench_function("StoredResponse::decode alone", |b| {
        b.iter(|| black_box(oncely::http::StoredResponse::decode(black_box(&record)).unwrap()))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
