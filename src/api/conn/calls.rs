//! Counting the calls in flight on each connection, for the idle bound: the calls go through a tower
//! layer that finds the connection's [`Activity`] in each request's extensions.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Arc,
    },
    task::{ready, Context, Poll},
    time::Duration,
};

use tokio::time::Instant;
use tonic::codegen::http;

use super::ConnectionInfo;

/// What is going on on one connection, shared between the connection and the calls made on it.
#[derive(Debug)]
pub struct Activity {
    /// The connection's accept: `idle_since` counts from it.
    origin: Instant,
    /// Calls begun and not yet answered in full.
    in_flight: AtomicUsize,
    /// Nanoseconds from `origin` to the end of the last call (0: none ended yet).
    idle_since: AtomicU64,
}

impl Activity {
    pub(super) fn new(origin: Instant) -> Self {
        Self {
            origin,
            in_flight: AtomicUsize::new(0),
            idle_since: AtomicU64::new(0),
        }
    }

    /// Counts a call as in flight until the returned guard drops.
    pub fn begin(self: &Arc<Self>) -> CallGuard {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        CallGuard(self.clone())
    }

    /// Since when no call has been in flight; `None` while one is.
    pub(super) fn idle_since(&self) -> Option<Instant> {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return None;
        }
        let nanos = self.idle_since.load(Ordering::Acquire);
        Some(self.origin + Duration::from_nanos(nanos))
    }
}

/// A call in flight on a connection; dropping it ends the call.
#[derive(Debug)]
pub struct CallGuard(Arc<Activity>);

impl Drop for CallGuard {
    fn drop(&mut self) {
        let since = Instant::now().saturating_duration_since(self.0.origin);
        let nanos = u64::try_from(since.as_nanos()).unwrap_or(u64::MAX);
        // The end is stored before the count drops, so whoever sees no call in flight sees it.
        self.0.idle_since.fetch_max(nanos, Ordering::AcqRel);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Counts the calls in flight on each connection, for `grpc.idle_timeout`: a call is in flight from
/// its request until its whole answer (streams included) has been sent.
#[derive(Debug, Clone, Copy, Default)]
pub struct TrackCallsLayer;

impl<S> tower::Layer<S> for TrackCallsLayer {
    type Service = TrackCalls<S>;

    fn layer(&self, inner: S) -> Self::Service {
        TrackCalls { inner }
    }
}

/// The service of [`TrackCallsLayer`].
#[derive(Debug, Clone)]
pub struct TrackCalls<S> {
    inner: S,
}

impl<S, B, ResBody> tower::Service<http::Request<B>> for TrackCalls<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<ResBody>>,
{
    type Response = http::Response<Guarded<ResBody>>;
    type Error = S::Error;
    type Future = TrackedCall<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let guard = request
            .extensions()
            .get::<ConnectionInfo>()
            .and_then(|info| info.activity.as_ref())
            .map(Activity::begin);
        TrackedCall {
            answer: self.inner.call(request),
            guard,
        }
    }
}

pin_project_lite::pin_project! {
    /// A counted call until its answer's head is ready; the call's guard then moves into the answer's
    /// body. Dropped before (the caller went away), it ends the call.
    pub struct TrackedCall<F> {
        #[pin]
        answer: F,
        guard: Option<CallGuard>,
    }
}

impl<F, ResBody, E> Future for TrackedCall<F>
where
    F: Future<Output = Result<http::Response<ResBody>, E>>,
{
    type Output = Result<http::Response<Guarded<ResBody>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let response = ready!(this.answer.poll(cx))?;
        let guard = this.guard.take();
        Poll::Ready(Ok(response.map(|body| Guarded {
            body,
            _guard: guard,
        })))
    }
}

pin_project_lite::pin_project! {
    /// An answer's body that keeps its call in flight until it is sent in full (or dropped); with no
    /// guard (calls not counted), the body as it is. Wrapped in place: tonic boxes the answer's body
    /// once whatever its type, so a box of our own would only add an allocation per call.
    pub struct Guarded<B> {
        #[pin]
        body: B,
        _guard: Option<CallGuard>,
    }
}

impl<B: http_body::Body> http_body::Body for Guarded<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        self.project().body.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
