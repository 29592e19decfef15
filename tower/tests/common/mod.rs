//! The test server (an axum Router behind the layer, on 127.0.0.1) and a hyper client.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{MatchedPath, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use axum::Router;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use oncely_tower::{IdempotencyLayer, Store};
use serde_json::{json, Value};

/// The handler's call counter.
pub type Calls = Arc<AtomicU64>;

/// Answers call n per the request header `x-respond` (JSON: `status`, `bytes`,
/// `delay_ms`, `panic` after the delay): status (default 201), body `{"call":n}` or `bytes` bytes of `x`,
/// headers `etag: "call-n"`, `x-call: n`, `set-cookie: call=n`.
pub async fn handler(State(calls): State<Calls>, req: Request) -> Response {
    let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
    let respond: Value = req
        .headers()
        .get("x-respond")
        .map(|v| serde_json::from_slice(v.as_bytes()).expect("x-respond is JSON"))
        .unwrap_or_else(|| json!({}));
    if let Some(ms) = respond.get("delay_ms").and_then(Value::as_u64) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if respond.get("panic").and_then(Value::as_bool) == Some(true) {
        panic!("the handler panicked (as the test asked)");
    }
    let status = respond.get("status").and_then(Value::as_u64).unwrap_or(201) as u16;
    let (content_type, body) = match respond.get("bytes").and_then(Value::as_u64) {
        Some(len) => ("text/plain", vec![b'x'; len as usize]),
        None => ("application/json", format!("{{\"call\":{n}}}").into_bytes()),
    };
    let mut resp = (StatusCode::from_u16(status).unwrap(), body).into_response();
    let h = resp.headers_mut();
    h.insert("content-type", HeaderValue::from_static(content_type));
    h.insert(
        "etag",
        HeaderValue::from_str(&format!("\"call-{n}\"")).unwrap(),
    );
    h.insert("x-call", HeaderValue::from_str(&n.to_string()).unwrap());
    h.insert(
        "set-cookie",
        HeaderValue::from_str(&format!("call={n}")).unwrap(),
    );
    resp
}

/// The routes of the test server, with the layer on them.
pub fn app<S: Store>(layer: IdempotencyLayer<S>, calls: Calls) -> Router {
    let layer = layer
        .tenant(|p| {
            p.headers
                .get("x-tenant")
                .and_then(|v| v.to_str().ok())
                .unwrap_or(oncely::http::DEFAULT_TENANT)
                .to_owned()
        })
        .route(|p| {
            p.extensions
                .get::<MatchedPath>()
                .map(|m| m.as_str().to_owned())
        });
    Router::new()
        .route("/orders", any(handler))
        .route("/orders/{id}", any(handler))
        .route("/payments", any(handler))
        .route_layer(layer)
        .with_state(calls)
}

/// Serves `app` on 127.0.0.1 (a free port) until the runtime ends.
pub async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// A server with the layer; returns its address and the handler's call counter.
pub async fn start<S: Store>(layer: IdempotencyLayer<S>) -> (SocketAddr, Calls) {
    let calls = Calls::default();
    let addr = serve(app(layer, calls.clone())).await;
    (addr, calls)
}

/// The tests' client type.
pub type TestClient = Client<HttpConnector, Full<Bytes>>;

/// A pooled HTTP/1 client.
pub fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// One answer, read whole.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .map(|v| v.as_bytes())
            == Some(b"true")
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body {:?} is not JSON: {e}", self.body))
    }
}

/// Sends a request; `headers` as (name, value). Fails the test after 20 s (a hang).
pub async fn send(
    client: &TestClient,
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Answer {
    let mut req = http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"));
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    let req = req.body(Full::new(Bytes::copy_from_slice(body))).unwrap();
    let fut = async {
        let resp = client.request(req).await.expect("the request failed");
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.expect("the body failed").to_bytes();
        Answer {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body,
        }
    };
    tokio::time::timeout(Duration::from_secs(20), fut)
        .await
        .expect("no answer within 20 s: a hang")
}
