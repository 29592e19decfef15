//! The body type the layer gives to the service it wraps and to its callers.

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http::HeaderMap;
use http_body::{Frame, SizeHint};

pin_project_lite::pin_project! {
    /// A request or response body through [`IdempotencyLayer`](crate::IdempotencyLayer):
    /// either bytes the layer read whole (a covered request, a stored or replayed
    /// response, a problem) or the original body, after any frames the layer already
    /// read from it.
    ///
    /// Its data is [`Bytes`]; its error is the wrapped body's.
    pub struct Body<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project_lite::pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Full {
            data: Option<Bytes>,
            trailers: Option<HeaderMap>,
        },
        Wrapped {
            #[pin]
            body: B,
        },
        Resumed {
            // Frames already read from `rest` (up to the cap), given out first.
            prefix: VecDeque<Frame<Bytes>>,
            // An error `rest` gave while the layer read the prefix.
            error: Option<ErrorSlot>,
            rest: Pin<Box<B>>,
            // Keeps the key claimed until this body ends or is dropped.
            guard: Option<Guard>,
        },
    }
}

/// The boxed error of the wrapped body, kept to hand out after the prefix.
pub(crate) type ErrorSlot = Box<dyn std::any::Any + Send>;
/// Something held until the body ends (a store lease).
pub(crate) type Guard = Box<dyn Send>;

impl<B> Body<B> {
    /// A body of these bytes and no trailers.
    pub fn full(data: impl Into<Bytes>) -> Self {
        Self::full_with_trailers(data.into(), None)
    }

    /// An empty body.
    pub fn empty() -> Self {
        Self::full_with_trailers(Bytes::new(), None)
    }

    pub(crate) fn full_with_trailers(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        Body {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
                trailers,
            },
        }
    }

    /// The original body, unread.
    pub fn wrap(body: B) -> Self {
        Body {
            kind: Kind::Wrapped { body },
        }
    }

    /// The frames read so far, then (an error the body gave, then) the rest of `body`;
    /// `guard` is dropped when the body ends or is dropped.
    pub(crate) fn resume(
        prefix: VecDeque<Frame<Bytes>>,
        error: Option<ErrorSlot>,
        body: Pin<Box<B>>,
        guard: Option<Guard>,
    ) -> Self {
        Body {
            kind: Kind::Resumed {
                prefix,
                error,
                rest: body,
                guard,
            },
        }
    }
}

impl<B> Default for Body<B> {
    fn default() -> Self {
        Body::empty()
    }
}

impl<B> fmt::Debug for Body<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Full { data, .. } => f
                .debug_struct("Body::Full")
                .field("len", &data.as_ref().map_or(0, Bytes::len))
                .finish(),
            Kind::Wrapped { .. } => f.debug_struct("Body::Wrapped").finish_non_exhaustive(),
            Kind::Resumed { prefix, .. } => f
                .debug_struct("Body::Resumed")
                .field("read_frames", &prefix.len())
                .finish_non_exhaustive(),
        }
    }
}

impl<B> http_body::Body for Body<B>
where
    B: http_body::Body,
    B::Error: Send + 'static,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            KindProj::Full { data, trailers } => {
                if let Some(d) = data.take() {
                    return Poll::Ready(Some(Ok(Frame::data(d))));
                }
                Poll::Ready(trailers.take().map(|t| Ok(Frame::trailers(t))))
            }
            KindProj::Wrapped { body } => body
                .poll_frame(cx)
                .map(|f| f.map(|f| f.map(|f| f.map_data(|mut d| d.copy_to_bytes(d.remaining()))))),
            KindProj::Resumed {
                prefix,
                error,
                rest,
                guard,
            } => {
                if let Some(frame) = prefix.pop_front() {
                    return Poll::Ready(Some(Ok(frame)));
                }
                if let Some(e) = error.take() {
                    guard.take();
                    let e = *e
                        .downcast::<B::Error>()
                        .unwrap_or_else(|_| unreachable!("the slot holds the body's error"));
                    return Poll::Ready(Some(Err(e)));
                }
                let polled = rest.as_mut().poll_frame(cx);
                match polled {
                    Poll::Pending => Poll::Pending,
                    Poll::Ready(None) => {
                        guard.take();
                        Poll::Ready(None)
                    }
                    Poll::Ready(Some(Err(e))) => {
                        guard.take();
                        Poll::Ready(Some(Err(e)))
                    }
                    Poll::Ready(Some(Ok(frame))) => Poll::Ready(Some(Ok(
                        frame.map_data(|mut d| d.copy_to_bytes(d.remaining()))
                    ))),
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { data, trailers } => data.is_none() && trailers.is_none(),
            Kind::Wrapped { body } => body.is_end_stream(),
            Kind::Resumed {
                prefix,
                error,
                rest,
                ..
            } => prefix.is_empty() && error.is_none() && rest.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Wrapped { body } => body.size_hint(),
            Kind::Resumed { prefix, rest, .. } => {
                let read: u64 = prefix
                    .iter()
                    .filter_map(|f| f.data_ref().map(|d| d.len() as u64))
                    .sum();
                let hint = rest.size_hint();
                let mut out = SizeHint::new();
                out.set_lower(hint.lower() + read);
                if let Some(upper) = hint.upper() {
                    out.set_upper(upper + read);
                }
                out
            }
        }
    }
}
