//! `envoy.service.ratelimit.v3.RateLimitService` over tonic, and the wire <-> domain conversions.

use std::sync::Arc;

use tonic::{codegen::http, Request, Response, Status};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::{
    conn::{HELD_FULL, MESSAGE_TIMEOUT, SHOULD_RATE_LIMIT},
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
/// says, and counted as the requests the handler refuses are; the other services (health, reflection,
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
    /// request the handler never saw is recorded in the limiter's metrics, as an invalid request or a
    /// shed one ([`Refusal`]).
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
        if let (Some(refused), Some(limiter)) = (refused, this.counted.take()) {
            match refused {
                Refusal::Unread => limiter.record_unreadable(),
                Refusal::Shed => limiter.record_shed(),
            }
        }
        std::task::Poll::Ready(Ok(answer))
    }
}

/// tonic refuses a request it cannot read before any handler sees it: over
/// `request_limits.max_message_bytes` with OUT_OF_RANGE, malformed protobuf with INTERNAL. Callers get
/// INVALID_ARGUMENT instead, naming the setting or what could not be decoded, like every other refusal of
/// a request; nothing on the server is at fault. Returns the answer and, for a request the handler
/// never saw, why: those two, compression it does not take (UNIMPLEMENTED) and a request that did not
/// arrive within `grpc.message_timeout` (DEADLINE_EXCEEDED, [`MESSAGE_TIMEOUT`]) could not be read; one
/// refused by `grpc.max_held_bytes` (RESOURCE_EXHAUSTED, [`HELD_FULL`]) was shed.
pub fn refusals_are_invalid_argument(
    mut response: http::Response<tonic::body::Body>,
) -> (http::Response<tonic::body::Body>, Option<Refusal>) {
    let headers = response.headers_mut();
    // The handler answers INVALID_ARGUMENT, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED or UNAVAILABLE, never
    // the others, and with messages of its own.
    let status = headers.get(&GRPC_STATUS).and_then(|v| v.to_str().ok());
    let decoding = match status {
        Some("11" | "13") => true,
        Some("12") => return (response, Some(Refusal::Unread)),
        Some("4" | "8") => false,
        _ => return (response, None),
    };
    let message = headers
        .get(&GRPC_MESSAGE)
        .map(|v| percent_encoding::percent_decode(v.as_bytes()).decode_utf8_lossy())
        .unwrap_or_default();
    if !decoding {
        let refusal = if message.starts_with(MESSAGE_TIMEOUT) {
            Some(Refusal::Unread)
        } else if message.starts_with(HELD_FULL) {
            Some(Refusal::Shed)
        } else {
            None
        };
        return (response, refusal);
    }
    let text = if let Some((_, sizes)) = message.split_once("message length too large: ") {
        format!("request too large: {sizes} (request_limits.max_message_bytes)")
    } else if let Some(reason) = message.strip_prefix("failed to decode Protobuf message: ") {
        format!("malformed RateLimitRequest: {reason}")
    } else {
        return (response, Some(Refusal::Unread));
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
    (response, Some(Refusal::Unread))
}

/// Why a request was refused before the handler saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// It could not be read: an invalid request.
    Unread,
    /// The replica held all it takes of requests still arriving: shed, as an overloaded one.
    Shed,
}

#[cfg(test)]
mod tests {
    use super::{parse_grpc_timeout, refusals_are_invalid_argument, Refusal};
    use std::time::Duration;
    use tonic::codegen::http;

    /// A trailers-only answer with this status and message.
    fn status_only(code: &str, message: &str) -> http::Response<tonic::body::Body> {
        http::Response::builder()
            .header("grpc-status", code)
            .header("grpc-message", message)
            .body(tonic::body::Body::empty())
            .unwrap()
    }

    #[test]
    fn refusals_before_the_handler_are_told_from_its_own_answers() {
        for (code, message, want, rewritten) in [
            ("11", "Error, decoded message length too large: found 70000 bytes, the limit is: 65536 bytes", Some(Refusal::Unread), Some("3")),
            ("13", "failed to decode Protobuf message: invalid wire type", Some(Refusal::Unread), Some("3")),
            ("12", "Content is compressed with `gzip` which isn't supported", Some(Refusal::Unread), None),
            ("4", "the request did not arrive in full within grpc.message_timeout (10s)", Some(Refusal::Unread), None),
            ("8", "requests still arriving hold all this replica takes (67108864 bytes, grpc.max_held_bytes): send it again", Some(Refusal::Shed), None),
            // The handler's own.
            ("8", "overloaded: 10000 requests being decided (overload.max_in_flight)", None, None),
            ("4", "no decision within the deadline", None, None),
            ("3", "rate limit domain must not be empty", None, None),
            ("14", "redis unavailable", None, None),
        ] {
            let (answer, refusal) = refusals_are_invalid_argument(status_only(code, message));
            assert_eq!(refusal, want, "{code} {message}");
            let status = answer.headers().get("grpc-status").unwrap().to_str().unwrap();
            assert_eq!(status, rewritten.unwrap_or(code), "{code} {message}");
        }
    }

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
