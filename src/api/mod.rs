//! The edge: gRPC (Envoy RLS v3, the rate limit quota service, health, reflection), the HTTP side port,
//! the operators' API (`admin`), and the xDS client that takes the rules from a control plane. Wire types
//! are converted to and from the domain types (the limiter's, the rules') here and nowhere else.

pub mod admin;
pub mod conn;
pub mod grpc;
pub mod health;
pub mod http;
pub mod http1;
pub mod json;
pub mod method_stats;
pub mod rlqs;
pub mod tls;
pub mod xds;

use axum::http::StatusCode;
use tonic::{Code as GrpcCode, Status};

use crate::{limiter::LimitError, store::StoreError};

/// The one mapping from limiter errors to gRPC status codes: a bad request is INVALID_ARGUMENT,
/// anything that keeps the service from deciding is UNAVAILABLE.
pub fn to_status(err: &LimitError) -> Status {
    let code = match err {
        LimitError::Overloaded { .. } => GrpcCode::ResourceExhausted,
        LimitError::Deadline(_) => GrpcCode::DeadlineExceeded,
        err if err.is_invalid_request() => GrpcCode::InvalidArgument,
        _ => GrpcCode::Unavailable,
    };
    Status::new(code, err.to_string())
}

/// The same mapping for `/json`: 400 for a request that cannot be decided as sent, 503 whenever the
/// service cannot decide (backend down or slow, breaker open, no rules loaded, overloaded), so that a
/// caller retries elsewhere or applies its failure mode instead of "fixing" a valid request. The
/// reason is short and ratelimitd's own: a backend's raw error text stays in the log.
pub fn to_http_status(err: &LimitError) -> (StatusCode, String) {
    if err.is_invalid_request() {
        return (StatusCode::BAD_REQUEST, err.to_string());
    }
    let reason = match err {
        LimitError::Store(StoreError::Backend(_)) => "rate limit backend unavailable".to_owned(),
        err => err.to_string(),
    };
    (StatusCode::SERVICE_UNAVAILABLE, reason)
}
