//! ratelimitd: an Envoy-compatible rate limit decision service.
#![forbid(unsafe_code)]

pub mod algorithm;
pub mod clock;
pub mod proto;
pub mod rules;
pub mod settings;
pub mod store;
