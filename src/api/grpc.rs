//! `envoy.service.ratelimit.v3.RateLimitService` over tonic, and the wire <-> domain conversions.

use std::sync::Arc;

use tonic::{codegen::http, Request, Response, Status};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::{
    conn::{MESSAGE_TIMEOUT, SHOULD_RATE_LIMIT},
    to_status,
};
use crate::{
    limiter::{self, Code, Limiter},
    proto::{
        self, rate_limit_response as wire,
        rate_limit_service_server::{RateLimitService, RateLimitServiceServer},
        RateLimitRequest, RateLimitResponse,
    },
    rules::Unit,
};

/// The gRPC rate limit service.
#[derive(Debug, Clone)]
pub struct RateLimitApi {
    limiter: Arc<Limiter>,
}

impl RateLimitApi {
    pub fn new(limiter: Arc<Limiter>) -> Self {
        Self { limiter }
    }

    pub fn into_server(self) -> RateLimitServiceServer<Self> {
        RateLimitServiceServer::new(self)
    }
}

/// The header Envoy sends its filter timeout in, as the call's deadline.
pub(crate) const GRPC_TIMEOUT: http::HeaderName = http::HeaderName::from_static("grpc-timeout");
/// The status and message of an answer that is a status alone (trailers-only).
const GRPC_STATUS: http::HeaderName = http::HeaderName::from_static("grpc-status");
const GRPC_MESSAGE: http::HeaderName = http::HeaderName::from_static("grpc-message");

#[tonic::async_trait]
impl RateLimitService for RateLimitApi {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let (metadata, _, request) = request.into_parts();
        // Envoy sends its filter timeout as the call's deadline: the answer is due before it.
        let timeout = metadata
            .as_ref()
            .get(&GRPC_TIMEOUT)
            .and_then(|v| v.to_str().ok())
            .and_then(parse_grpc_timeout);
        let request = from_wire(request);
        let span = tracing::info_span!(
            "ShouldRateLimit",
            otel.kind = "server",
            domain = %request.domain,
            descriptors = request.descriptors.len(),
            decision = tracing::field::Empty,
        );
        // The caller's trace context (Envoy, or a service's own tracer), W3C else B3, for a span that is
        // recorded. With traces off the span is not, and the propagator (behind a lock every core takes)
        // is not asked.
        if !span.is_disabled() {
            let parent = opentelemetry::global::get_text_map_propagator(|p| {
                p.extract(&MetadataExtractor(&metadata))
            });
            let _ = span.set_parent(parent);
        }
        let decided = self
            .limiter
            .should_rate_limit_by(&request, timeout)
            .instrument(span.clone())
            .await;
        let _in_span = span.enter();
        match decided {
            Ok(response) => {
                let decision = match response.overall_code {
                    Code::Ok => "OK",
                    Code::OverLimit => "OVER_LIMIT",
                };
                span.record("decision", decision);
                Ok(Response::new(to_wire(response)))
            }
            Err(err) => {
                span.record("decision", "error");
                tracing::debug!(domain = %request.domain, error = %err, "request not decided");
                Err(to_status(&err))
            }
        }
    }
}

/// The `grpc-timeout` header: at most eight digits and a unit (`H`, `M`, `S`, `m`, `u`, `n`).
pub(crate) fn parse_grpc_timeout(text: &str) -> Option<std::time::Duration> {
    use std::time::Duration;
    let (&unit, digits) = text.as_bytes().split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n = digits
        .iter()
        .fold(0u64, |n, &d| n * 10 + u64::from(d - b'0'));
    Some(match unit {
        b'H' => Duration::from_secs(n * 3600),
        b'M' => Duration::from_secs(n * 60),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

/// Reads trace context headers from gRPC metadata.
struct MetadataExtractor<'a>(&'a tonic::metadata::MetadataMap);

impl opentelemetry::propagation::Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// Converts a wire request into the limiter's request.
pub fn from_wire(request: RateLimitRequest) -> limiter::Request {
    limiter::Request {
        domain: request.domain,
        hits_addend: request.hits_addend,
        descriptors: request
            .descriptors
            .into_iter()
            .map(|d| limiter::Descriptor {
                entries: d
                    .entries
                    .into_iter()
                    .map(|e| limiter::Entry {
                        key: e.key,
                        value: e.value,
                    })
                    .collect(),
                limit: d.limit.map(|l| limiter::LimitOverride {
                    requests_per_unit: l.requests_per_unit,
                    unit: Unit::from_wire(l.unit),
                }),
                hits_addend: d.hits_addend,
            })
            .collect(),
    }
}

fn code_to_wire(code: Code) -> i32 {
    match code {
        Code::Ok => wire::Code::Ok as i32,
        Code::OverLimit => wire::Code::OverLimit as i32,
    }
}

/// Converts the limiter's response into the wire response.
pub fn to_wire(response: limiter::Response) -> RateLimitResponse {
    RateLimitResponse {
        overall_code: code_to_wire(response.overall_code),
        statuses: response
            .statuses
            .into_iter()
            .map(|s| wire::DescriptorStatus {
                code: code_to_wire(s.code),
                current_limit: s.current_limit.map(|l| wire::RateLimit {
                    requests_per_unit: l.requests_per_unit,
                    unit: l.unit.to_wire(),
                    name: l.name.map(|n| n.to_string()).unwrap_or_default(),
                }),
                limit_remaining: s.limit_remaining,
                duration_until_reset: s.duration_until_reset.map(|secs| prost_types::Duration {
                    seconds: i64::try_from(secs).unwrap_or(i64::MAX),
                    nanos: 0,
                }),
                quota: None,
            })
            .collect(),
        response_headers_to_add: response
            .response_headers
            .into_iter()
            .map(|(key, value)| proto::HeaderValue {
                key,
                value,
                raw_value: Vec::new(),
            })
            .collect(),
        ..RateLimitResponse::default()
    }
}

/// The rate limit service with tonic's refusals of its requests answered as [`refusals_are_invalid_argument`]
/// says, and counted as the requests the handler finds invalid are; the other services (health, reflection,
/// RLQS) keep tonic's answers, which name no setting of ours.
#[derive(Debug, Clone)]
pub struct RefusalsAsInvalidArgument<S> {
    inner: S,
    limiter: Arc<Limiter>,
}

impl<S> RefusalsAsInvalidArgument<S> {
    pub fn new(inner: S, limiter: Arc<Limiter>) -> Self {
        Self { inner, limiter }
    }
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for RefusalsAsInvalidArgument<S> {
    const NAME: &'static str = S::NAME;
}

type Answer = http::Response<tonic::body::Body>;

impl<S, B> tower::Service<http::Request<B>> for RefusalsAsInvalidArgument<S>
where
    S: tower::Service<http::Request<B>, Response = Answer>,
{
    type Response = Answer;
    type Error = S::Error;
    type Future = Refused<S::Future>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        // Another path under this service is an unknown method: tonic's UNIMPLEMENTED, no request of ours.
        let counted = (request.uri().path() == SHOULD_RATE_LIMIT).then(|| self.limiter.clone());
        Refused {
            answer: self.inner.call(request),
            counted,
        }
    }
}

pin_project_lite::pin_project! {
    /// A call's answer, rewritten by [`refusals_are_invalid_argument`]; a refusal of a ShouldRateLimit
    /// request the handler never saw is recorded in the limiter's metrics as an invalid request.
    pub struct Refused<F> {
        #[pin]
        answer: F,
        counted: Option<Arc<Limiter>>,
    }
}

impl<F, E> std::future::Future for Refused<F>
where
    F: std::future::Future<Output = Result<Answer, E>>,
{
    type Output = F::Output;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let this = self.project();
        let answer = std::task::ready!(this.answer.poll(cx))?;
        let (answer, refused) = refusals_are_invalid_argument(answer);
        if refused {
            if let Some(limiter) = this.counted.take() {
                limiter.record_unreadable(std::time::Duration::ZERO);
            }
        }
        std::task::Poll::Ready(Ok(answer))
    }
}

/// tonic refuses a request it cannot read before any handler sees it: over
/// `request_limits.max_message_bytes` with OUT_OF_RANGE, malformed protobuf with INTERNAL. Callers get
/// INVALID_ARGUMENT instead, naming the setting or what could not be decoded, like every other refusal of
/// a request; nothing on the server is at fault. Returns the answer and whether it is a refusal of a
/// request the handler never saw: those two, compression it does not take (UNIMPLEMENTED), and a request
/// that did not arrive within `grpc.message_timeout` (DEADLINE_EXCEEDED, [`MESSAGE_TIMEOUT`]).
pub fn refusals_are_invalid_argument(
    mut response: http::Response<tonic::body::Body>,
) -> (http::Response<tonic::body::Body>, bool) {
    let headers = response.headers_mut();
    // The handler answers INVALID_ARGUMENT, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED or UNAVAILABLE, never
    // these.
    let status = headers.get(&GRPC_STATUS).and_then(|v| v.to_str().ok());
    let refused_early = match status {
        Some("11" | "13") => true,
        Some("12") => return (response, true),
        Some("4") => false,
        _ => return (response, false),
    };
    let message = headers
        .get(&GRPC_MESSAGE)
        .map(|v| percent_encoding::percent_decode(v.as_bytes()).decode_utf8_lossy())
        .unwrap_or_default();
    if !refused_early {
        let late = message.starts_with(MESSAGE_TIMEOUT);
        return (response, late);
    }
    let text = if let Some((_, sizes)) = message.split_once("message length too large: ") {
        format!("request too large: {sizes} (request_limits.max_message_bytes)")
    } else if let Some(reason) = message.strip_prefix("failed to decode Protobuf message: ") {
        format!("malformed RateLimitRequest: {reason}")
    } else {
        return (response, true);
    };
    // Header values are visible ASCII; anything else (from a quoted field) is replaced.
    let text: String = text
        .chars()
        .map(|c| {
            if (' '..='~').contains(&c) && c != '%' {
                c
            } else {
                '?'
            }
        })
        .collect();
    if let Ok(value) = http::HeaderValue::from_str(&text) {
        headers.insert(GRPC_STATUS, http::HeaderValue::from_static("3"));
        headers.insert(GRPC_MESSAGE, value);
    }
    (response, true)
}

#[cfg(test)]
mod tests {
    use super::parse_grpc_timeout;
    use std::time::Duration;

    #[test]
    fn grpc_timeouts_in_every_unit_and_nothing_else() {
        assert_eq!(parse_grpc_timeout("20m"), Some(Duration::from_millis(20)));
        assert_eq!(parse_grpc_timeout("1S"), Some(Duration::from_secs(1)));
        assert_eq!(parse_grpc_timeout("2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(
            parse_grpc_timeout("99999999u"),
            Some(Duration::from_micros(99_999_999))
        );
        assert_eq!(parse_grpc_timeout("5n"), Some(Duration::from_nanos(5)));
        for bad in ["", "m", "123456789m", "20", "20x", "-1m", "2 m", "é"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad:?}");
        }
    }
}
