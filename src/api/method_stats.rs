//! Counts and times of the unary gRPC calls, by method, as the reference service keeps them
//! (`ratelimit_server.<Method>.total_requests` and `.response_time` in statsd, which its Prometheus
//! mapping turns into `ratelimit_service_total_requests` and `ratelimit_service_response_time_seconds`
//! with a `grpc_method` label). A tower layer in front of the gRPC services: the series are made once,
//! so a call costs a path comparison, a counter increment and a histogram observation (both striped: no
//! cache line shared between cores).
//!
//! A `ShouldRateLimit` call that carries a deadline (`grpc-timeout`, which Envoy always sends) and is not
//! answered within it is counted in `ratelimitd_calls_past_deadline_total`: answered after it, or cut at
//! it before an answer, wherever it was then (waiting for its body, decoding, deciding). Here rather than
//! in the limiter, which sees a call only once it is read: a call that waits for a worker past its
//! deadline is exactly the one an overloaded replica fails to count.

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{ready, Context, Poll},
    time::Duration,
};

use tokio::time::Instant;
use tonic::codegen::http;

use super::{
    conn::SHOULD_RATE_LIMIT,
    grpc::{parse_grpc_timeout, GRPC_TIMEOUT},
};
use crate::telemetry::{
    metrics::{Histogram, StripedCounter},
    Metrics,
};

/// The unary methods served, by HTTP/2 path, with the name their stats carry.
const UNARY: &[(&str, &str)] = &[
    (SHOULD_RATE_LIMIT, "ShouldRateLimit"),
    ("/grpc.health.v1.Health/Check", "Check"),
];

/// The series of one method.
#[derive(Debug)]
struct MethodSeries {
    path: &'static str,
    calls: Arc<StripedCounter>,
    time: Arc<Histogram>,
    /// Calls not answered within their deadline (ShouldRateLimit only).
    late: Option<Arc<StripedCounter>>,
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
                    late: (*method == "ShouldRateLimit").then(|| {
                        metrics.striped_counter(
                            "ratelimitd_calls_past_deadline_total",
                            "Unary gRPC calls with a deadline (grpc-timeout) not answered within it: answered after it, or cut at it before an answer (by the caller's timer or the server's).",
                            labels(),
                        )
                    }),
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
            let method = &self.methods[i];
            method.calls.add(1);
            let timeout = method.late.as_ref().and_then(|_| {
                let header = request.headers().get(&GRPC_TIMEOUT)?;
                parse_grpc_timeout(header.to_str().ok()?)
            });
            Timing {
                methods: self.methods.clone(),
                method: i,
                start: Instant::now(),
                timeout,
            }
        });
        Timed {
            answer: self.inner.call(request),
            timing,
        }
    }
}

/// One call of a method in [`UNARY`], until it is answered.
struct Timing {
    methods: Arc<[MethodSeries]>,
    method: usize,
    start: Instant,
    /// The call's deadline, while it is not answered (ShouldRateLimit only).
    timeout: Option<Duration>,
}

impl Timing {
    fn answered(mut self) {
        let took = self.start.elapsed();
        let method = &self.methods[self.method];
        method.time.observe(took);
        if let Some(late) = &method.late {
            if self.timeout.take().is_some_and(|timeout| took > timeout) {
                late.add(1);
            }
        }
    }
}

impl Drop for Timing {
    /// A call dropped unanswered at its deadline was cut by a timer (the caller's, or tonic's for the
    /// caller's deadline). The caller's timer started before the call arrived, so its cancel comes a
    /// little before the deadline by this clock: within a tenth of it (at least 2 ms) counts. A call
    /// given up earlier was given up for another reason (its own caller went away), not for waiting.
    fn drop(&mut self) {
        if let Some(timeout) = self.timeout {
            let slack = (timeout / 10).max(Duration::from_millis(2));
            if let Some(late) = &self.methods[self.method].late {
                if self.start.elapsed() + slack >= timeout {
                    late.add(1);
                }
            }
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

    /// A call to a service that answers after `takes`, with `grpc-timeout: timeout` when given.
    fn call(path: &str, timeout: Option<&str>, takes: Duration) -> http::Request<()> {
        let mut request = http::Request::builder().uri(path);
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
        let rls = UNARY[0].0;

        // Answered within the deadline, or without one: not counted.
        answer(call(rls, Some("1S"), Duration::ZERO)).await;
        answer(call(rls, None, Duration::from_millis(30))).await;
        assert_eq!(past_deadline(&metrics), 0);
        // Answered after it.
        answer(call(rls, Some("10m"), Duration::from_millis(30))).await;
        assert_eq!(past_deadline(&metrics), 1);
        // A health check answered after its deadline is not a rate limit call.
        answer(call(UNARY[1].0, Some("10m"), Duration::from_millis(30))).await;
        assert_eq!(past_deadline(&metrics), 1);
        // Cut at its deadline, unanswered: counted, also when the cancel comes a little early by the
        // service's clock (the caller's timer started before the call arrived).
        let pending = stats.call(call(rls, Some("20m"), Duration::from_secs(60)));
        tokio::time::sleep(Duration::from_millis(19)).await;
        drop(pending);
        assert_eq!(past_deadline(&metrics), 2);
        // Given up long before its deadline, or without one: not a call answered late.
        drop(stats.call(call(rls, Some("10S"), Duration::from_secs(60))));
        drop(stats.call(call(rls, None, Duration::from_secs(60))));
        assert_eq!(past_deadline(&metrics), 2);
    }
}
