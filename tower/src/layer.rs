//! The server layer: SPEC §8 in front of any `Service<http::Request<B>>`.

use std::collections::VecDeque;
use std::fmt;
use std::future::poll_fn;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::header::CONTENT_TYPE;
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body::{Body as HttpBody, Frame};
use oncely::http::{
    self as contract, KeyDecision, Problem, ServerConfig, StoredResponse, DEFAULT_TENANT,
    GRPC_KEY_METADATA, KEY_HEADER, REPLAYED_HEADER, REPLAYED_VALUE,
};
use oncely::{panic_message, Begin, Error, ExecuteOptions, Joined, ScopedKey};
use tower_layer::Layer;
use tower_service::Service;

use crate::body::Body;
use crate::store::{BoxFuture, Store, Unstored};

type TenantFn = Arc<dyn Fn(&Parts) -> String + Send + Sync>;
type RouteFn = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;
type FingerprintFn = Arc<dyn Fn(&Parts, &[u8]) -> String + Send + Sync>;
type ReplayFn = Arc<dyn Fn(&Parts, &ScopedKey) + Send + Sync>;

/// Makes a tower service idempotent by the `Idempotency-Key` header (SPEC §8), on any
/// [`Store`]: a retry of a covered request gets the first response replayed instead of
/// running the handler again.
///
/// The defaults: POST and PATCH covered, the key required, one tenant
/// ([`DEFAULT_TENANT`]: give a [`tenant`](Self::tenant) function whenever callers are
/// not one party), the path as the route, duplicates wait for the first, bodies up to
/// 1 MiB stored, the headers `content-type`, `content-encoding`, `location` and `etag`
/// stored.
///
/// The wrapped service gets `http::Request<Body<B>>`; callers get
/// `http::Response<Body<RB>>` ([`Body`]).
pub struct IdempotencyLayer<S> {
    settings: Settings<S>,
}

struct Settings<S> {
    store: S,
    contract: ServerConfig,
    tenant: Option<TenantFn>,
    route: Option<RouteFn>,
    fingerprint: Option<FingerprintFn>,
    on_replay: Option<ReplayFn>,
    counters: Arc<AtomicCounters>,
}

impl<S: Clone> Clone for Settings<S> {
    fn clone(&self) -> Self {
        Settings {
            store: self.store.clone(),
            contract: self.contract.clone(),
            tenant: self.tenant.clone(),
            route: self.route.clone(),
            fingerprint: self.fingerprint.clone(),
            on_replay: self.on_replay.clone(),
            counters: self.counters.clone(),
        }
    }
}

impl<S: Clone> Clone for IdempotencyLayer<S> {
    fn clone(&self) -> Self {
        IdempotencyLayer {
            settings: self.settings.clone(),
        }
    }
}

impl<S> fmt::Debug for IdempotencyLayer<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("contract", &self.settings.contract)
            .finish_non_exhaustive()
    }
}

impl<S: Store> IdempotencyLayer<S> {
    /// A layer on `store` with the defaults.
    pub fn new(store: S) -> Self {
        IdempotencyLayer {
            settings: Settings {
                store,
                contract: ServerConfig::new(),
                tenant: None,
                route: None,
                fingerprint: None,
                on_replay: None,
                counters: Arc::default(),
            },
        }
    }

    /// The tenant of a request (e.g. the authenticated principal), the first part of
    /// its scope: the same key from two tenants names two operations.
    pub fn tenant(mut self, f: impl Fn(&Parts) -> String + Send + Sync + 'static) -> Self {
        self.settings.tenant = Some(Arc::new(f));
        self
    }

    /// The route template of a request (`/orders/{id}`) for its scope, where the
    /// framework knows it; `None` (and the default) use the path. With axum, behind
    /// `Router::route_layer`:
    /// `.route(|p| p.extensions.get::<MatchedPath>().map(|m| m.as_str().to_owned()))`.
    pub fn route(mut self, f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        self.settings.route = Some(Arc::new(f));
        self
    }

    /// The covered methods, replacing POST and PATCH.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods: Vec<Method> = methods.into_iter().collect();
        self.settings.contract = self
            .settings
            .contract
            .methods(methods.iter().map(Method::as_str))
            .expect("an http::Method is a valid token");
        self
    }

    /// The covered gRPC calls, by full method name (`/pkg.Orders/Create`); by default
    /// every gRPC call is covered (gRPC calls are POSTs). Panics on a name that does
    /// not start with `/`.
    pub fn grpc_methods<I>(mut self, methods: I) -> Self
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        self.settings.contract = self
            .settings
            .contract
            .clone()
            .grpc_methods(methods)
            .unwrap_or_else(|e| panic!("{e}"));
        self
    }

    /// Whether a covered request without a key is refused with 400 (`true`, the
    /// default) or passed through.
    pub fn required(mut self, required: bool) -> Self {
        self.settings.contract = self.settings.contract.clone().required(required);
        self
    }

    /// Whether a duplicate that arrives while the first runs waits and replays its
    /// response (`true`, the default) or gets 409 + `Retry-After`.
    pub fn wait(mut self, wait: bool) -> Self {
        self.settings.contract = self.settings.contract.clone().wait(wait);
        self
    }

    /// The largest response body stored (default 1 MiB); larger ones are sent but not
    /// stored, and the key is released once they have been sent.
    pub fn body_cap(mut self, bytes: usize) -> Self {
        self.settings.contract = self.settings.contract.clone().body_cap(bytes);
        self
    }

    /// The largest request body of a covered request (default 1 MiB): it is read whole
    /// to fingerprint it; larger ones get 413.
    pub fn request_cap(mut self, bytes: usize) -> Self {
        self.settings.contract = self.settings.contract.clone().request_cap(bytes);
        self
    }

    /// The response headers stored with the body, replacing the default list
    /// (hop-by-hop headers and `content-length` are never stored).
    pub fn stored_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        let names: Vec<HeaderName> = names.into_iter().collect();
        self.settings.contract = self
            .settings
            .contract
            .clone()
            .stored_headers(names.iter().map(HeaderName::as_str))
            .expect("an http::HeaderName is a valid token");
        self
    }

    /// The request fingerprint, replacing [`oncely::http::request_fingerprint`] of the
    /// method, path and query, and body. A reused key with another fingerprint gets 422.
    pub fn fingerprint(
        mut self,
        f: impl Fn(&Parts, &[u8]) -> String + Send + Sync + 'static,
    ) -> Self {
        self.settings.fingerprint = Some(Arc::new(f));
        self
    }

    /// Called for every replayed answer (a stored response, or a running one joined),
    /// so business metrics are not counted twice.
    pub fn on_replay(mut self, f: impl Fn(&Parts, &ScopedKey) + Send + Sync + 'static) -> Self {
        self.settings.on_replay = Some(Arc::new(f));
        self
    }

    /// What the layer (every service it made) has done so far.
    pub fn counters(&self) -> Counters {
        self.settings.counters.snapshot()
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.settings.store
    }
}

impl<S: Store, Svc> Layer<Svc> for IdempotencyLayer<S> {
    type Service = Idempotency<Svc, S>;
    fn layer(&self, inner: Svc) -> Self::Service {
        Idempotency {
            inner,
            settings: Arc::new(self.settings.clone()),
        }
    }
}

/// The service [`IdempotencyLayer`] makes.
pub struct Idempotency<Svc, S> {
    inner: Svc,
    settings: Arc<Settings<S>>,
}

impl<Svc: Clone, S> Clone for Idempotency<Svc, S> {
    fn clone(&self) -> Self {
        Idempotency {
            inner: self.inner.clone(),
            settings: self.settings.clone(),
        }
    }
}

impl<Svc, S> fmt::Debug for Idempotency<Svc, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency").finish_non_exhaustive()
    }
}

/// Counts of what a layer has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Requests passed to the handler untouched (not covered, or no key and none
    /// required).
    pub passed_through: u64,
    /// Requests refused with a problem before the handler ran (missing or invalid key,
    /// body too large, reused key, in progress, store unavailable).
    pub refused: u64,
    /// Requests whose handler ran under a key.
    pub led: u64,
    /// Responses stored.
    pub stored: u64,
    /// Responses not stored (status, size, a failing handler or body).
    pub not_stored: u64,
    /// Requests answered with another request's response.
    pub replayed: u64,
}

#[derive(Default)]
struct AtomicCounters {
    passed_through: AtomicU64,
    refused: AtomicU64,
    led: AtomicU64,
    stored: AtomicU64,
    not_stored: AtomicU64,
    replayed: AtomicU64,
}

impl AtomicCounters {
    fn snapshot(&self) -> Counters {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Counters {
            passed_through: get(&self.passed_through),
            refused: get(&self.refused),
            led: get(&self.led),
            stored: get(&self.stored),
            not_stored: get(&self.not_stored),
            replayed: get(&self.replayed),
        }
    }
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl<Svc, S, B, RB> Service<Request<B>> for Idempotency<Svc, S>
where
    Svc: Service<Request<Body<B>>, Response = Response<RB>> + Clone + Send + 'static,
    Svc::Future: Send + 'static,
    Svc::Error: Send + 'static,
    S: Store,
    B: HttpBody + Send + 'static,
    B::Data: Send,
    B::Error: fmt::Display + Send + 'static,
    RB: HttpBody + Send + 'static,
    RB::Data: Send,
    RB::Error: Send + 'static,
{
    type Response = Response<Body<RB>>;
    type Error = Svc::Error;
    type Future = BoxFuture<'static, Result<Response<Body<RB>>, Svc::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The ready service serves this call; a fresh clone waits for the next one.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(serve(self.settings.clone(), inner, req))
    }
}

async fn serve<Svc, S, B, RB>(
    s: Arc<Settings<S>>,
    mut inner: Svc,
    req: Request<B>,
) -> Result<Response<Body<RB>>, Svc::Error>
where
    Svc: Service<Request<Body<B>>, Response = Response<RB>>,
    S: Store,
    B: HttpBody,
    B::Error: fmt::Display + Send + 'static,
    RB: HttpBody,
    RB::Error: Send + 'static,
{
    let (parts, body) = req.into_parts();
    // gRPC calls are POSTs: another method with a gRPC content type is plain HTTP (a
    // GET stays passed through).
    let grpc = parts.method == Method::POST
        && parts
            .headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(contract::is_grpc);
    let decision = {
        // The first two values are enough to tell none, one and "more than one".
        let mut all = parts
            .headers
            .get_all(if grpc { GRPC_KEY_METADATA } else { KEY_HEADER })
            .iter()
            .map(HeaderValue::as_bytes);
        let pair = [all.next(), all.next()];
        let n = pair.iter().flatten().count();
        let pair = pair.map(|v| v.unwrap_or_default());
        let values = &pair[..n];
        if grpc {
            s.contract.read_grpc_key(parts.uri.path(), values)
        } else {
            s.contract.read_key(parts.method.as_str(), values)
        }
    };
    let key = match decision {
        Ok(KeyDecision::Dedup(key)) => key,
        Ok(KeyDecision::PassThrough) => {
            bump(&s.counters.passed_through);
            let resp = inner
                .call(Request::from_parts(parts, Body::wrap(body)))
                .await?;
            return Ok(resp.map(Body::wrap));
        }
        Err(problem) => return Ok(refuse(&s, grpc, &problem)),
    };
    let body = match Box::pin(collect(body, s.contract.request_limit())).await {
        Collected::Whole { data, .. } => data,
        Collected::Over { .. } => return Ok(refuse(&s, grpc, &s.contract.too_large())),
        Collected::Failed { error, .. } => {
            return Ok(refuse(&s, grpc, &Problem::request_body_unreadable(error)))
        }
    };
    let tenant = s.tenant.as_ref().map(|f| f(&parts));
    // A gRPC call's route is its full method name, its path.
    let route = s.route.as_ref().filter(|_| !grpc).and_then(|f| f(&parts));
    let scoped = match contract::scope(
        tenant.as_deref().unwrap_or(DEFAULT_TENANT),
        parts.method.as_str(),
        route.as_deref().unwrap_or(parts.uri.path()),
        &key,
    ) {
        Ok(k) => k,
        Err(Error::InvalidArgument {
            field: "tenant",
            reason,
        }) => return Ok(refuse(&s, grpc, &Problem::tenant_unusable(reason))),
        Err(e) => return Ok(refuse(&s, grpc, &Problem::from_error(&e))),
    };
    let fingerprint = match &s.fingerprint {
        Some(f) => f(&parts, &body),
        None => contract::request_fingerprint(
            parts.method.as_str(),
            parts
                .uri
                .path_and_query()
                .map_or(parts.uri.path(), |pq| pq.as_str()),
            parts
                .headers
                .get(CONTENT_TYPE)
                .and_then(|v| v.to_str().ok()),
            &body,
        ),
    };
    let options = if s.contract.waits() {
        ExecuteOptions::default()
    } else {
        ExecuteOptions::NO_WAIT
    };
    // The rules of oncely::execute, driven here because the layer keeps the lease past
    // the handler's return while an unstored body is still being sent.
    let lease = loop {
        match s.store.begin(&scoped, &fingerprint, options).await {
            Err(e) => return Ok(refuse(&s, grpc, &Problem::from_error(&e))),
            Ok(Begin::Lead(lease)) => break lease,
            Ok(Begin::Replay(Ok(record))) => {
                return Ok(replay_bytes(&s, grpc, &parts, &scoped, &record))
            }
            Ok(Begin::Replay(Err(unstored))) => {
                return Ok(replay(&s, grpc, &parts, &scoped, &unstored.response))
            }
            Ok(Begin::Join(join)) => match join.await {
                Joined::Value(record) => {
                    return Ok(replay_bytes(&s, grpc, &parts, &scoped, &record))
                }
                Joined::Failed(unstored) => {
                    return Ok(replay(&s, grpc, &parts, &scoped, &unstored.response))
                }
                Joined::Panicked(message) => {
                    let e = Error::LeaderPanicked(message.to_string());
                    return Ok(refuse(&s, grpc, &Problem::from_error(&e)));
                }
                // The leader went away before answering: begin again (one of us leads).
                Joined::Abandoned => continue,
                Joined::Error(e) => return Ok(refuse(&s, grpc, &Problem::from_error(&e))),
            },
        }
    };
    // The lead path in a box of its own keeps this future small for replays.
    Box::pin(lead(s, grpc, inner, parts, body, lease)).await
}

/// Runs the handler under the lease and stores (or not) its response.
async fn lead<Svc, S, B, RB>(
    s: Arc<Settings<S>>,
    grpc: bool,
    mut inner: Svc,
    parts: Parts,
    body: Bytes,
    lease: S::Lease,
) -> Result<Response<Body<RB>>, Svc::Error>
where
    Svc: Service<Request<Body<B>>, Response = Response<RB>>,
    S: Store,
    RB: HttpBody,
    RB::Error: Send + 'static,
{
    bump(&s.counters.led);
    let cap = s.contract.cap();
    let method = parts.method.clone();
    let request = Request::from_parts(parts, Body::full(body));
    let run = async move {
        let resp = inner.call(request).await?;
        let (head, body) = resp.into_parts();
        let streams = head
            .headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(contract::is_event_stream);
        let collected = if streams {
            // Sent as it comes, like a body over the cap: waiting for its end (or
            // the cap) could keep the client waiting for ever.
            Collected::Over {
                prefix: VecDeque::new(),
                rest: Box::pin(body),
            }
        } else {
            collect(body, cap).await
        };
        Ok::<_, Svc::Error>((head, collected))
    };
    let (head, collected) = match catch_unwind_async(run).await {
        Ok(Ok(done)) => done,
        // The handler failed: nothing to store, the key is released (the lease drops).
        Ok(Err(e)) => {
            bump(&s.counters.not_stored);
            return Err(e);
        }
        Err(payload) => {
            oncely::LeaderLease::panicked(lease, &panic_message(&*payload));
            resume_unwind(payload)
        }
    };
    match collected {
        Collected::Whole { data, trailers } => {
            let storable = if grpc {
                // The outcome is the grpc-status trailer (in the headers when the
                // answer is trailers-only).
                let status = trailers
                    .as_ref()
                    .and_then(|t| t.get("grpc-status"))
                    .or_else(|| head.headers.get("grpc-status"));
                head.status == StatusCode::OK
                    && status.is_some_and(|v| contract::storable_grpc_status(v.as_bytes()))
            } else {
                contract::storable_status(head.status.as_u16())
            };
            let record = StoredResponse {
                status: head.status.as_u16(),
                headers: head
                    .headers
                    .iter()
                    .filter(|(name, _)| {
                        let name = name.as_str();
                        if !storable {
                            // Only for the duplicates waiting now: the whole answer.
                            s.contract.shares_header(name)
                        } else if grpc {
                            s.contract.stores_grpc_header(name)
                        } else {
                            s.contract.stores_header(name)
                        }
                    })
                    .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
                    .collect(),
                // What was sent: no body to a HEAD, nor with a 1xx, 204 or 304.
                body: if contract::has_content(method.as_str(), head.status.as_u16()) {
                    data.to_vec()
                } else {
                    Vec::new()
                },
                trailers: trailers
                    .iter()
                    .flatten()
                    .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
                    .collect(),
            };
            if storable {
                // The handler has run: its response is the answer even when it could
                // not be stored (store unreachable, lease lost). A problem instead
                // would invite a retry, which would run the handler again.
                match S::complete(lease, record.encode()).await {
                    Ok(()) => bump(&s.counters.stored),
                    Err(_) => bump(&s.counters.not_stored),
                }
            } else {
                // Waiting duplicates get this response too; a later retry runs again.
                S::fail(lease, Unstored { response: record }).await;
                bump(&s.counters.not_stored);
            }
            Ok(Response::from_parts(
                head,
                Body::full_with_trailers(data, trailers),
            ))
        }
        Collected::Over { prefix, rest } => {
            // Sent, not stored (over the cap, or an event stream): the key stays
            // claimed until the body has been sent whole (or dropped), then a waiting
            // duplicate leads.
            bump(&s.counters.not_stored);
            Ok(Response::from_parts(
                head,
                Body::resume(prefix, None, rest, Some(Box::new(lease))),
            ))
        }
        Collected::Failed {
            prefix,
            error,
            rest,
        } => {
            // The body broke: the handler's work has stopped; the key is released.
            drop(lease);
            bump(&s.counters.not_stored);
            Ok(Response::from_parts(
                head,
                Body::resume(prefix, Some(Box::new(error)), rest, None),
            ))
        }
    }
}

/// Polls `fut`, catching a panic, as `oncely::execute` does for its action.
async fn catch_unwind_async<F: std::future::Future>(
    fut: F,
) -> Result<F::Output, Box<dyn std::any::Any + Send>> {
    let mut fut = pin!(fut);
    poll_fn(
        |cx| match catch_unwind(AssertUnwindSafe(|| fut.as_mut().poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(v)) => Poll::Ready(Ok(v)),
            Err(payload) => Poll::Ready(Err(payload)),
        },
    )
    .await
}

enum Collected<B: HttpBody> {
    /// The body ended within the cap.
    Whole {
        data: Bytes,
        trailers: Option<HeaderMap>,
    },
    /// The body went over the cap: the frames read so far and the rest.
    Over {
        prefix: VecDeque<Frame<Bytes>>,
        rest: Pin<Box<B>>,
    },
    /// The body gave an error after these frames.
    Failed {
        prefix: VecDeque<Frame<Bytes>>,
        error: B::Error,
        rest: Pin<Box<B>>,
    },
}

/// Reads `body` whole if it has at most `cap` bytes.
async fn collect<B: HttpBody>(body: B, cap: usize) -> Collected<B> {
    use bytes::Buf;
    let mut body = Box::pin(body);
    if body.size_hint().lower() > cap as u64 {
        return Collected::Over {
            prefix: VecDeque::new(),
            rest: body,
        };
    }
    let mut frames: VecDeque<Frame<Bytes>> = VecDeque::new();
    let mut len = 0usize;
    loop {
        match poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
            None => break,
            Some(Err(error)) => {
                return Collected::Failed {
                    prefix: frames,
                    error,
                    rest: body,
                }
            }
            Some(Ok(frame)) => {
                let frame = frame.map_data(|mut d| d.copy_to_bytes(d.remaining()));
                len += frame.data_ref().map_or(0, Bytes::len);
                frames.push_back(frame);
                if len > cap {
                    return Collected::Over {
                        prefix: frames,
                        rest: body,
                    };
                }
            }
        }
    }
    let mut trailers: Option<HeaderMap> = None;
    let data = if frames.len() == 1 && frames[0].is_data() {
        frames
            .pop_front()
            .and_then(|f| f.into_data().ok())
            .unwrap_or_default()
    } else {
        let mut buf = BytesMut::with_capacity(len);
        for frame in frames {
            match frame.into_data() {
                Ok(d) => buf.extend_from_slice(&d),
                Err(frame) => {
                    if let Ok(t) = frame.into_trailers() {
                        trailers.get_or_insert_with(HeaderMap::new).extend(t);
                    }
                }
            }
        }
        buf.freeze()
    };
    Collected::Whole { data, trailers }
}

fn refuse<S, RB>(s: &Settings<S>, grpc: bool, problem: &Problem) -> Response<Body<RB>> {
    bump(&s.counters.refused);
    if grpc {
        // A trailers-only gRPC answer: the status is in the headers.
        let mut resp = Response::new(Body::empty());
        let h = resp.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        for (name, value) in problem.grpc_metadata() {
            if let Ok(v) = HeaderValue::from_str(&value) {
                h.insert(name, v);
            }
        }
        return resp;
    }
    let mut resp = Response::new(Body::full(problem.body()));
    *resp.status_mut() =
        StatusCode::from_u16(problem.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    for (name, value) in problem.headers() {
        if let Ok(v) = HeaderValue::from_str(&value) {
            resp.headers_mut().insert(name, v);
        }
    }
    resp
}

fn replay_bytes<S, RB>(
    s: &Settings<S>,
    grpc: bool,
    parts: &Parts,
    key: &ScopedKey,
    record: &[u8],
) -> Response<Body<RB>> {
    match StoredResponse::decode(record) {
        Ok(r) => replay(s, grpc, parts, key, &r),
        Err(e) => refuse(s, grpc, &Problem::from_error(&e)),
    }
}

fn replay<S, RB>(
    s: &Settings<S>,
    grpc: bool,
    parts: &Parts,
    key: &ScopedKey,
    record: &StoredResponse,
) -> Response<Body<RB>> {
    let Ok(status) = StatusCode::from_u16(record.status) else {
        let e = Error::Unavailable(format!(
            "the stored response has the status {}, which is not an HTTP status",
            record.status
        ));
        return refuse(s, grpc, &Problem::from_error(&e));
    };
    let trailers = (!record.trailers.is_empty()).then(|| {
        let mut t = header_map(&record.trailers);
        // gRPC clients read the marker as trailing metadata.
        t.insert(
            HeaderName::from_static(REPLAYED_HEADER),
            HeaderValue::from_static(REPLAYED_VALUE),
        );
        t
    });
    let mut resp = Response::new(Body::full_with_trailers(
        Bytes::copy_from_slice(&record.body),
        trailers,
    ));
    *resp.status_mut() = status;
    *resp.headers_mut() = header_map(&record.headers);
    resp.headers_mut().insert(
        HeaderName::from_static(REPLAYED_HEADER),
        HeaderValue::from_static(REPLAYED_VALUE),
    );
    bump(&s.counters.replayed);
    if let Some(hook) = &s.on_replay {
        hook(parts, key);
    }
    resp
}

/// The record's headers; a pair that is not a valid header (written by a foreign
/// adapter) is left out.
fn header_map(pairs: &[(String, Vec<u8>)]) -> HeaderMap {
    let mut map = HeaderMap::with_capacity(pairs.len());
    for (name, value) in pairs {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(value),
        ) {
            map.append(n, v);
        }
    }
    map
}
