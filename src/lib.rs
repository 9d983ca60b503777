//! ratelimitd: an Envoy-compatible rate limit decision service.
#![forbid(unsafe_code)]

pub mod proto;
