//! The edge: gRPC (Envoy RLS v3, health, reflection) and the HTTP side port. Wire types are converted
//! to and from the limiter's domain types here and nowhere else.

pub mod conn;
pub mod grpc;
pub mod health;
pub mod http;
mod json;
pub mod tls;

use tonic::{Code as GrpcCode, Status};

use crate::limiter::LimitError;

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
