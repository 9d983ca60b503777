//! Counts and times of the unary gRPC calls, by method, as the reference service keeps them
//! (`ratelimit_server.<Method>.total_requests` and `.response_time` in statsd, which its Prometheus
//! mapping turns into `ratelimit_service_total_requests` and `ratelimit_service_response_time_seconds`
//! with a `grpc_method` label), and the calls not answered within the deadline their caller set
//! (`ratelimitd_calls_past_deadline_total`). A tower layer in front of the gRPC services: the series are
//! made once, so a call costs a path comparison, a header lookup, a counter increment and a histogram
//! observation (all striped: no cache line shared between cores).

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{ready, Context, Poll},
    time::Duration,
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
    past_deadline: Arc<StripedCounter>,
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
                    past_deadline: metrics.striped_counter(
                        "ratelimitd_calls_past_deadline_total",
                        "Unary gRPC calls with a deadline (grpc-timeout) not answered within it: answered later than it after their arrival, or dropped unanswered at it (cut by the caller).",
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
            let deadline = request
                .headers()
                .get(&super::grpc::GRPC_TIMEOUT)
                .and_then(|v| v.to_str().ok())
                .and_then(super::grpc::parse_grpc_timeout);
            Timing {
                methods: self.methods.clone(),
                i,
                start: Instant::now(),
                deadline,
            }
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
        timing: Option<Timing>,
    }
}

/// When a call of one of [`UNARY`] arrived, and the deadline its caller set.
struct Timing {
    methods: Arc<[MethodSeries]>,
    i: usize,
    start: Instant,
    deadline: Option<Duration>,
}

impl Timing {
    fn answered(mut self) {
        let took = self.start.elapsed();
        let method = &self.methods[self.i];
        method.time.observe(took);
        if self.deadline.take().is_some_and(|deadline| took > deadline) {
            method.past_deadline.add(1);
        }
    }
}

impl Drop for Timing {
    /// A call dropped unanswered at its deadline (its caller's timer cut it) was not answered in time
    /// either. The caller's timer started before the call arrived, so its cancel comes a little before
    /// the deadline by the service's clock: within a tenth of it (at least 2 ms) counts. A call given up
    /// earlier was given up for another reason (its own caller went away), not for waiting.
    fn drop(&mut self) {
        if let Some(deadline) = self.deadline {
            let slack = (deadline / 10).max(Duration::from_millis(2));
            if self.start.elapsed() + slack >= deadline {
                self.methods[self.i].past_deadline.add(1);
            }
        }
    }
}

impl<F: Future> Future for Timed<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let answer = ready!(this.answer.poll(cx));
        if let Some(timing) = this.timing.take() {
            timing.answered();
        }
        Poll::Ready(answer)
    }
}

#[cfg(test)]
mod tests {
    use std::{convert::Infallible, time::Duration};

    use tower::{Layer, Service, ServiceExt};

    use super::*;

    const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

    /// A call to a service that answers after `takes`, with `grpc-timeout: timeout` when given.
    fn call(timeout: Option<&str>, takes: Duration) -> http::Request<()> {
        let mut request = http::Request::builder().uri(PATH);
        if let Some(timeout) = timeout {
            request = request.header("grpc-timeout", timeout);
        }
        let mut request = request.body(()).unwrap();
        request.extensions_mut().insert(takes);
        request
    }

    fn past_deadline(metrics: &Metrics) -> u64 {
        let text = metrics.render();
        text.lines()
            .find_map(|l| {
                l.strip_prefix(
                    "ratelimitd_calls_past_deadline_total{grpc_method=\"ShouldRateLimit\"} ",
                )
            })
            .map_or(0, |n| n.parse().unwrap())
    }

    #[tokio::test]
    async fn calls_not_answered_within_their_deadline_are_counted() {
        let metrics = Metrics::new();
        let answering = tower::service_fn(|request: http::Request<()>| async move {
            let takes = *request.extensions().get::<Duration>().unwrap();
            tokio::time::sleep(takes).await;
            Ok::<_, Infallible>(())
        });
        let mut stats = MethodStatsLayer::new(&metrics).layer(answering);
        let answer = |request| {
            let stats = stats.clone();
            async move { stats.oneshot(request).await.unwrap() }
        };

        // Answered within the deadline, or without one: not counted.
        answer(call(Some("1S"), Duration::ZERO)).await;
        answer(call(None, Duration::from_millis(30))).await;
        assert_eq!(past_deadline(&metrics), 0);
        // Answered after it.
        answer(call(Some("10m"), Duration::from_millis(30))).await;
        assert_eq!(past_deadline(&metrics), 1);
        // Cut by the caller at its deadline, unanswered: counted, also when the cancel comes a little
        // early by the service's clock (the caller's timer started before the call arrived).
        let pending = stats.call(call(Some("20m"), Duration::from_secs(60)));
        tokio::time::sleep(Duration::from_millis(19)).await;
        drop(pending);
        assert_eq!(past_deadline(&metrics), 2);
        // Given up long before its deadline, or without one: not a call answered late.
        drop(stats.call(call(Some("10S"), Duration::from_secs(60))));
        drop(stats.call(call(None, Duration::from_secs(60))));
        assert_eq!(past_deadline(&metrics), 2);
    }
}
