//! The client side: retries that reuse one idempotency key (SPEC §4 over tower).

use std::fmt;
use std::future::{poll_fn, Future};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use http::header::CONTENT_TYPE;
use http::request::Parts;
use http::{HeaderValue, Method, Request, Response};
use oncely::http::{is_grpc, ServerConfig, GRPC_KEY_METADATA, KEY_HEADER};
use oncely::{
    parse_pushback_ms, parse_retry_after, CallFacts, Clock, Code, Deadline, Decision, Error,
    Failure, IdempotencyKey, RetryBudget, RetryPolicy, RetryState, Sleeper, SystemClock,
    TimerSleeper,
};
use tower_layer::Layer;
use tower_service::Service;

use crate::store::BoxFuture;

/// Retries a client's HTTP or gRPC calls by SPEC §4 (classification, attempts,
/// deadline, budget, the server's `Retry-After` / `grpc-retry-pushback-ms`), with one
/// idempotency key per logical call: a covered request (POST, PATCH; gRPC calls)
/// without an `Idempotency-Key` (`x-idempotency-key`) gets a random one, and every
/// attempt sends the same key, so a server behind
/// [`IdempotencyLayer`](crate::IdempotencyLayer) applies it once.
///
/// A call is safe to resend when it carries a key or its method is idempotent (GET,
/// HEAD, OPTIONS, TRACE, PUT, DELETE). A failed answer is classified by its status
/// (`Code::from_http`) or, for gRPC, by a `grpc-status` in its headers; an error of the
/// wrapped service (connection lost) is an unknown outcome (UNAVAILABLE), retried only
/// when safe. A keyed call answered "in progress" (409 + `Retry-After`, or ABORTED +
/// `grpc-retry-pushback-ms`, from a server behind `IdempotencyLayer::wait(false)`) is
/// retried after that delay: an earlier attempt whose answer was lost still runs. When
/// the loop stops, the last answer (or error, as
/// [`RetryError::Service`]) is given back unchanged. With a [`timeout`](Self::timeout),
/// an attempt still running at the deadline is dropped and the call ends with
/// [`RetryError::DeadlineExceeded`].
///
/// The request body is sent again on every attempt, so it must be `Clone` (e.g.
/// `http_body_util::Full<Bytes>`); for other bodies (tonic's), put
/// [`BufferBodyLayer`](crate::BufferBodyLayer) above this layer. Sleeps use `futures-timer`: no runtime needed.
#[derive(Clone)]
pub struct RetryLayer {
    config: Arc<RetryConfig>,
}

#[derive(Clone)]
struct RetryConfig {
    policy: RetryPolicy,
    timeout: Option<Duration>,
    budget: Option<RetryBudget>,
    rereads: bool,
    transient_internal: bool,
    contract: ServerConfig,
}

impl fmt::Debug for RetryLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryLayer")
            .field("policy", &self.config.policy)
            .field("timeout", &self.config.timeout)
            .finish_non_exhaustive()
    }
}

impl Default for RetryLayer {
    fn default() -> Self {
        RetryLayer::new()
    }
}

impl RetryLayer {
    /// The default policy (3 attempts, 20 ms × 2, 1 s cap, ±20 % jitter), no deadline,
    /// no budget; keys added to POST, PATCH and gRPC calls.
    pub fn new() -> Self {
        RetryLayer {
            config: Arc::new(RetryConfig {
                policy: RetryPolicy::new(),
                timeout: None,
                budget: None,
                rereads: false,
                transient_internal: false,
                contract: ServerConfig::new(),
            }),
        }
    }

    fn with(mut self, f: impl FnOnce(&mut RetryConfig)) -> Self {
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// The backoff policy; INVALID_ARGUMENT (naming the field) if it is invalid.
    pub fn policy(self, policy: RetryPolicy) -> Result<Self, Error> {
        policy.validate()?;
        Ok(self.with(|c| c.policy = policy))
    }

    /// Bounds each logical call, its attempts, retries and sleeps included: an attempt
    /// still running at the deadline is dropped ([`RetryError::DeadlineExceeded`]). A
    /// gRPC attempt tells the server the time left in `grpc-timeout` (unless the caller
    /// set a shorter one).
    pub fn timeout(self, timeout: Duration) -> Self {
        self.with(|c| c.timeout = Some(timeout))
    }

    /// Draws retries from a budget shared by the calls that use it.
    pub fn budget(self, budget: RetryBudget) -> Self {
        self.with(|c| c.budget = Some(budget))
    }

    /// The calls re-read state before writing, so a conflict (ABORTED, 409) may be
    /// retried.
    pub fn rereads(self, rereads: bool) -> Self {
        self.with(|c| c.rereads = rereads)
    }

    /// Treat INTERNAL/UNKNOWN (500) as transient for safe calls (opt-in).
    pub fn transient_internal(self, transient: bool) -> Self {
        self.with(|c| c.transient_internal = transient)
    }

    /// The HTTP methods that get a key when they have none (default POST, PATCH).
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods: Vec<Method> = methods.into_iter().collect();
        self.with(|c| {
            c.contract = c
                .contract
                .clone()
                .methods(methods.iter().map(Method::as_str))
                .expect("an http::Method is a valid token");
        })
    }
}

impl<Svc> Layer<Svc> for RetryLayer {
    type Service = Retrying<Svc>;
    fn layer(&self, inner: Svc) -> Retrying<Svc> {
        Retrying {
            inner,
            config: self.config.clone(),
        }
    }
}

/// The service [`RetryLayer`] makes.
#[derive(Clone)]
pub struct Retrying<Svc> {
    inner: Svc,
    config: Arc<RetryConfig>,
}

impl<Svc> fmt::Debug for Retrying<Svc> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Retrying").finish_non_exhaustive()
    }
}

impl<Svc, B, RB> Service<Request<B>> for Retrying<Svc>
where
    Svc: Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    Svc::Future: Send,
    Svc::Error: Send,
    B: Clone + Send + 'static,
    RB: Send + 'static,
{
    type Response = Response<RB>;
    type Error = RetryError<Svc::Error>;
    type Future = BoxFuture<'static, Result<Response<RB>, RetryError<Svc::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(RetryError::Service)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(run(self.config.clone(), inner, req))
    }
}

async fn run<Svc, B, RB>(
    config: Arc<RetryConfig>,
    mut inner: Svc,
    req: Request<B>,
) -> Result<Response<RB>, RetryError<Svc::Error>>
where
    Svc: Service<Request<B>, Response = Response<RB>>,
    B: Clone,
{
    let (mut parts, body) = req.into_parts();
    let grpc = parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(is_grpc);
    let key_header = if grpc { GRPC_KEY_METADATA } else { KEY_HEADER };
    let covered = if grpc {
        config.contract.covers_grpc(parts.uri.path())
    } else {
        config.contract.covers(parts.method.as_str())
    };
    if covered && !parts.headers.contains_key(key_header) {
        let key = IdempotencyKey::random();
        let value = HeaderValue::from_str(key.as_str()).expect("a key is a header value");
        parts.headers.insert(key_header, value);
    }
    let idempotent_method = !grpc
        && matches!(
            parts.method,
            Method::GET
                | Method::HEAD
                | Method::OPTIONS
                | Method::TRACE
                | Method::PUT
                | Method::DELETE
        );
    let keyed = parts.headers.contains_key(key_header);
    let facts = CallFacts {
        safe: keyed || idempotent_method,
        rereads: config.rereads,
        transient_internal: config.transient_internal,
    };
    let mut state = RetryState::new(config.policy).with_facts(facts);
    let deadline = config.timeout.map(|t| Deadline::after(&SystemClock, t));
    if let Some(d) = deadline {
        state = state.with_deadline(d);
    }
    if let Some(b) = &config.budget {
        state = state.with_budget(b.clone());
    }
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let mut request = rebuild(&parts, body.clone());
        if let (true, Some(d)) = (grpc, deadline) {
            forward_grpc_timeout(request.headers_mut(), d.remaining(&SystemClock));
        }
        let attempt = async {
            poll_fn(|cx| inner.poll_ready(cx)).await?;
            inner.call(request).await
        };
        let outcome = match deadline {
            None => attempt.await,
            Some(d) => match within(d.remaining(&SystemClock), attempt).await {
                Some(outcome) => outcome,
                None => return Err(RetryError::DeadlineExceeded { attempts }),
            },
        };
        let failure = match &outcome {
            Ok(resp) => match failure_of(resp, grpc) {
                None => return outcome.map_err(RetryError::Service),
                Some(f) => f,
            },
            // The request may have been applied: only a safe call is sent again.
            Err(_) => Failure::outcome_unknown(),
        };
        match state.on_failure(failure, SystemClock.now()) {
            Decision::Stop(_) => return outcome.map_err(RetryError::Service),
            Decision::Retry { delay, .. } => {
                drop(outcome);
                if !delay.is_zero() {
                    TimerSleeper.sleep(delay).await;
                }
            }
        }
    }
}

/// Tells the gRPC server the time left (`grpc-timeout`, in whole milliseconds rounded
/// up), unless the caller set a shorter one.
fn forward_grpc_timeout(headers: &mut http::HeaderMap, left: Duration) {
    const NAME: &str = "grpc-timeout";
    let ms = left.as_nanos().div_ceil(1_000_000).min(99_999_999) as u64;
    let theirs = headers
        .get(NAME)
        .and_then(|v| v.to_str().ok())
        .and_then(parse_grpc_timeout);
    if theirs.is_some_and(|t| t <= Duration::from_millis(ms)) {
        return;
    }
    let v = format!("{ms}m");
    headers.insert(NAME, HeaderValue::from_str(&v).expect("digits and a unit"));
}

/// A `grpc-timeout` value: up to 8 digits and a unit (H, M, S, m, u, n).
fn parse_grpc_timeout(v: &str) -> Option<Duration> {
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// `fut`'s output, or `None` when `limit` passes first (`fut` is then dropped).
async fn within<F: Future>(limit: Duration, fut: F) -> Option<F::Output> {
    let mut fut = std::pin::pin!(fut);
    let mut timer = std::pin::pin!(TimerSleeper.sleep(limit.max(Duration::from_nanos(1))));
    poll_fn(|cx| {
        if let Poll::Ready(v) = fut.as_mut().poll(cx) {
            return Poll::Ready(Some(v));
        }
        timer.as_mut().poll(cx).map(|()| None)
    })
    .await
}

/// The error of a call through [`RetryLayer`].
#[derive(Debug)]
#[non_exhaustive]
pub enum RetryError<E> {
    /// The wrapped service's error of the last attempt.
    Service(E),
    /// The call's deadline ([`RetryLayer::timeout`]) passed while an attempt was
    /// running; that attempt was dropped. Whether it was applied is unknown: retry the
    /// call with the same idempotency key to find out.
    DeadlineExceeded {
        /// The attempts made, the dropped one included.
        attempts: u32,
    },
}

impl<E> RetryError<E> {
    /// The wrapped service's error, if that is what this is.
    pub fn into_service(self) -> Option<E> {
        match self {
            RetryError::Service(e) => Some(e),
            RetryError::DeadlineExceeded { .. } => None,
        }
    }

    /// The gRPC code of the error: DEADLINE_EXCEEDED for the deadline, else
    /// UNAVAILABLE (an error of the wrapped service is an unknown outcome).
    pub fn code(&self) -> Code {
        match self {
            RetryError::Service(_) => Code::Unavailable,
            RetryError::DeadlineExceeded { .. } => Code::DeadlineExceeded,
        }
    }
}

impl<E: fmt::Display> fmt::Display for RetryError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RetryError::Service(e) => e.fmt(f),
            RetryError::DeadlineExceeded { attempts } => write!(
                f,
                "the call's deadline passed during attempt {attempts}; its outcome is unknown"
            ),
        }
    }
}

// For every displayable E, so that a `BoxError` service's RetryError (tower stacks,
// tonic clients) is an error too; the service's error is in the message.
impl<E: fmt::Debug + fmt::Display> std::error::Error for RetryError<E> {}

fn rebuild<B>(parts: &Parts, body: B) -> Request<B> {
    let mut req = Request::new(body);
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = parts.uri.clone();
    *req.version_mut() = parts.version;
    *req.headers_mut() = parts.headers.clone();
    *req.extensions_mut() = parts.extensions.clone();
    req
}

/// The failure an answer stands for, or `None` for a success.
fn failure_of<RB>(resp: &Response<RB>, grpc: bool) -> Option<Failure> {
    let header = |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok());
    let (code, delay) = if grpc && resp.status().is_success() {
        // Trailers-only answers carry the status in the headers; a status in the
        // trailers is the caller's to read.
        let code = header("grpc-status")?
            .trim()
            .parse::<i32>()
            .ok()
            .and_then(Code::from_i32)
            .unwrap_or(Code::Unknown);
        (
            code,
            header("grpc-retry-pushback-ms").and_then(|v| parse_pushback_ms(v).ok()),
        )
    } else {
        let status = resp.status().as_u16();
        if status < 400 {
            return None;
        }
        let delay =
            header("retry-after").and_then(|v| parse_retry_after(v, SystemTime::now()).ok());
        (Code::from_http(status), delay)
    };
    if code == Code::Ok {
        return None;
    }
    // A keyed call's "in progress" (409 + Retry-After; ABORTED + pushback) is resent
    // after the delay by the core's rule (SPEC §3, `in_progress_keyed`).
    let mut failure = Failure::new(code);
    failure.server_delay = delay;
    Some(failure)
}
