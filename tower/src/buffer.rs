//! Request bodies read whole, so that [`RetryLayer`](crate::RetryLayer) can send them
//! again for clients whose body type is not `Clone` (tonic's).

use std::fmt;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use tower_layer::Layer;
use tower_service::Service;

use crate::store::BoxFuture;

/// A boxed error, as tower and tonic use.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Reads each request body whole into a `Full<Bytes>` before the service it wraps sees
/// it, so that a [`RetryLayer`](crate::RetryLayer) below can send it again. Put it above
/// the `RetryLayer` when the caller's body type is not `Clone`, e.g. in a tonic client:
/// `tonic::client::Grpc::with_origin(ServiceBuilder::new().layer(BufferBodyLayer)
/// .layer(RetryLayer::new()).service(http2_client), origin)`.
///
/// Request trailers are not kept (unary gRPC calls send none). Errors (the body's or
/// the service's) are [`BoxError`]s.
#[derive(Debug, Clone, Copy, Default)]
pub struct BufferBodyLayer;

impl<S> Layer<S> for BufferBodyLayer {
    type Service = BufferBody<S>;
    fn layer(&self, inner: S) -> BufferBody<S> {
        BufferBody { inner }
    }
}

/// The service [`BufferBodyLayer`] makes.
#[derive(Clone)]
pub struct BufferBody<S> {
    inner: S,
}

impl<S> fmt::Debug for BufferBody<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufferBody").finish_non_exhaustive()
    }
}

impl<S, B, RB> Service<Request<B>> for BufferBody<S>
where
    S: Service<Request<Full<Bytes>>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    type Response = Response<RB>;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Response<RB>, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The ready service serves this call; a fresh clone waits for the next one.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let bytes = body.collect().await.map_err(Into::into)?.to_bytes();
            inner
                .call(Request::from_parts(parts, Full::new(bytes)))
                .await
                .map_err(Into::into)
        })
    }
}
