//! Streams that end when the drain begins: a gRPC health `Watch` or a reflection session stays open for
//! as long as its client likes, and the server's graceful shutdown waits for every call in flight, so a
//! single watcher (a gRPC client with health checking turned on holds one per connection) would make
//! every shutdown last the whole `shutdown.grace_period`. Their answers end with UNAVAILABLE as the
//! listeners stop accepting: the watcher has seen NOT_SERVING since the shutdown began, and retries on
//! another replica. Their requests end once the answer has: a reflection session reads its client's
//! questions until they end, and the connection could not close while it did.
//!
//! The rate limit quota streams end themselves at the same moment ([`RateLimitQuotaApi`]); unary calls
//! are not cut, they finish within the grace period.
//!
//! [`RateLimitQuotaApi`]: crate::api::rlqs::RateLimitQuotaApi

use std::{
    future::Future,
    pin::Pin,
    task::{ready, Context, Poll},
};

use bytes::Bytes;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tonic::{
    body::Body,
    codegen::http::{self, HeaderMap, HeaderValue},
};

/// The streaming calls that end at the drain, by HTTP/2 path.
const ENDED_AT_DRAIN: &[&str] = &[
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
];

/// The status a stream ended at the drain carries.
const SHUTTING_DOWN: &str = "ratelimitd is shutting down: call another replica";

/// Ends the answers of health watches and reflection sessions once `draining` is cancelled.
#[derive(Debug, Clone)]
pub struct EndAtDrainLayer {
    pub draining: CancellationToken,
}

impl<S> tower::Layer<S> for EndAtDrainLayer {
    type Service = EndAtDrain<S>;

    fn layer(&self, inner: S) -> Self::Service {
        EndAtDrain {
            inner,
            draining: self.draining.clone(),
        }
    }
}

/// The service of [`EndAtDrainLayer`].
#[derive(Debug, Clone)]
pub struct EndAtDrain<S> {
    inner: S,
    draining: CancellationToken,
}

impl<S, ResBody> tower::Service<http::Request<Body>> for EndAtDrain<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<ResBody>>,
{
    type Response = http::Response<Ending<ResBody>>;
    type Error = S::Error;
    type Future = EndingCall<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        if !ENDED_AT_DRAIN.contains(&request.uri().path()) {
            return EndingCall {
                answer: self.inner.call(request),
                drain: None,
            };
        }
        let answered = CancellationToken::new();
        let request = request.map(|body| {
            Body::new(EndingRequest {
                body,
                drain: Box::pin(answered.clone().cancelled_owned()),
            })
        });
        EndingCall {
            answer: self.inner.call(request),
            drain: Some(Drain {
                begun: Box::pin(self.draining.clone().cancelled_owned()),
                answered,
            }),
        }
    }
}

pin_project_lite::pin_project! {
    /// A call until its answer's head is ready; the drain's wait then moves into the answer's body.
    pub struct EndingCall<F> {
        #[pin]
        answer: F,
        drain: Option<Drain>,
    }
}

/// The drain as a streaming call's answer waits for it.
struct Drain {
    begun: Pin<Box<WaitForCancellationFutureOwned>>,
    /// Cancelled once the answer has ended at the drain: the request then ends too.
    answered: CancellationToken,
}

impl<F, ResBody, E> Future for EndingCall<F>
where
    F: Future<Output = Result<http::Response<ResBody>, E>>,
{
    type Output = Result<http::Response<Ending<ResBody>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let response = ready!(this.answer.poll(cx))?;
        let drain = this.drain.take();
        Poll::Ready(Ok(response.map(|body| Ending {
            body,
            drain,
            ended: false,
        })))
    }
}

pin_project_lite::pin_project! {
    /// An answer's body that, once the drain begins, ends with UNAVAILABLE trailers at the next
    /// message boundary; with no drain to wait for (every other call), the body as it is.
    pub struct Ending<B> {
        #[pin]
        body: B,
        drain: Option<Drain>,
        ended: bool,
    }
}

impl<B: http_body::Body> http_body::Body for Ending<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        if *this.ended {
            return Poll::Ready(None);
        }
        let Some(drain) = this.drain else {
            return this.body.poll_frame(cx);
        };
        match ready!(until_drained(this.body, &mut drain.begun, cx)) {
            Next::Frame(frame) => Poll::Ready(frame),
            Next::Drained => {
                *this.ended = true;
                drain.answered.cancel();
                Poll::Ready(Some(Ok(http_body::Frame::trailers(shutting_down()))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        if self.drain.is_some() {
            return http_body::SizeHint::default();
        }
        self.body.size_hint()
    }
}

/// What a body gives when polled.
type Polled<B> =
    Option<Result<http_body::Frame<<B as http_body::Body>::Data>, <B as http_body::Body>::Error>>;

/// What a body ended at the drain gives next.
enum Next<F> {
    /// The body's own next frame, or its end.
    Frame(F),
    /// The drain has begun.
    Drained,
}

/// `body`'s frames until the drain begins, then [`Next::Drained`]. The body's own frames come first: a
/// message ready at that moment still goes whole.
fn until_drained<B: http_body::Body>(
    body: Pin<&mut B>,
    drain: &mut Pin<Box<WaitForCancellationFutureOwned>>,
    cx: &mut Context<'_>,
) -> Poll<Next<Polled<B>>> {
    if let Poll::Ready(frame) = body.poll_frame(cx) {
        return Poll::Ready(Next::Frame(frame));
    }
    drain.as_mut().poll(cx).map(|()| Next::Drained)
}

/// A streaming call's request body, which ends once its answer has ended at the drain, so that the
/// service reading it ends too.
struct EndingRequest {
    body: Body,
    drain: Pin<Box<WaitForCancellationFutureOwned>>,
}

impl http_body::Body for EndingRequest {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, tonic::Status>>> {
        let Self { body, drain } = &mut *self;
        match ready!(until_drained(Pin::new(body), drain, cx)) {
            Next::Frame(frame) => Poll::Ready(frame),
            Next::Drained => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }
}

/// The trailers of a stream ended at the drain: UNAVAILABLE (14), which gRPC clients retry elsewhere.
fn shutting_down() -> HeaderMap {
    let mut trailers = HeaderMap::with_capacity(2);
    trailers.insert("grpc-status", HeaderValue::from_static("14"));
    trailers.insert("grpc-message", HeaderValue::from_static(SHUTTING_DOWN));
    trailers
}
