//! Counts and times of the unary gRPC calls, by method, as the reference service keeps them
//! (`ratelimit_server.<Method>.total_requests` and `.response_time` in statsd, which its Prometheus
//! mapping turns into `ratelimit_service_total_requests` and `ratelimit_service_response_time_seconds`
//! with a `grpc_method` label). A tower layer in front of the gRPC services: the series are made once,
//! so a call costs a path comparison, a counter increment and a histogram observation (both striped: no
//! cache line shared between cores).

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{ready, Context, Poll},
};

use tokio::time::Instant;
use tonic::codegen::http;

use crate::telemetry::{
    metrics::{Histogram, StripedCounter},
    Metrics,
};

/// The unary methods served, by HTTP/2 path, with the name their stats carry.
const UNARY: &[(&str, &str)] = &[
    (
        "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        "ShouldRateLimit",
    ),
    ("/grpc.health.v1.Health/Check", "Check"),
];

/// The series of one method.
#[derive(Debug)]
struct MethodSeries {
    path: &'static str,
    calls: Arc<StripedCounter>,
    time: Arc<Histogram>,
}

/// Counts and times every unary call.
#[derive(Debug, Clone)]
pub struct MethodStatsLayer {
    methods: Arc<[MethodSeries]>,
}

impl MethodStatsLayer {
    pub fn new(metrics: &Metrics) -> Self {
        let methods = UNARY
            .iter()
            .map(|(path, method)| {
                let labels = || vec![("grpc_method", method.to_string())];
                MethodSeries {
                    path,
                    calls: metrics.striped_counter(
                        "ratelimit_service_total_requests",
                        "Unary gRPC calls, by method.",
                        labels(),
                    ),
                    time: metrics.histogram(
                        "ratelimit_service_response_time_seconds",
                        "Time to answer a unary gRPC call, by method.",
                        labels(),
                    ),
                }
            })
            .collect();
        Self { methods }
    }
}

impl<S> tower::Layer<S> for MethodStatsLayer {
    type Service = MethodStats<S>;

    fn layer(&self, inner: S) -> Self::Service {
        MethodStats {
            inner,
            methods: self.methods.clone(),
        }
    }
}

/// The service of [`MethodStatsLayer`].
#[derive(Debug, Clone)]
pub struct MethodStats<S> {
    inner: S,
    methods: Arc<[MethodSeries]>,
}

impl<S, B> tower::Service<http::Request<B>> for MethodStats<S>
where
    S: tower::Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Timed<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let path = request.uri().path();
        let timing = self.methods.iter().position(|m| m.path == path).map(|i| {
            self.methods[i].calls.add(1);
            (self.methods.clone(), i, Instant::now())
        });
        Timed {
            answer: self.inner.call(request),
            timing,
        }
    }
}

pin_project_lite::pin_project! {
    /// A call's answer, timed when its method is one of [`UNARY`]. In place, not boxed: a box would cost
    /// an allocation and a copy of the answer's future per call.
    pub struct Timed<F> {
        #[pin]
        answer: F,
        timing: Option<(Arc<[MethodSeries]>, usize, Instant)>,
    }
}

impl<F: Future> Future for Timed<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let answer = ready!(this.answer.poll(cx));
        if let Some((methods, i, start)) = this.timing.take() {
            methods[i].time.observe(start.elapsed());
        }
        Poll::Ready(answer)
    }
}
