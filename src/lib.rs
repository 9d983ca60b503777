//! ratelimitd: an Envoy-compatible rate limit decision service.
//!
//! # Layout
//! Requests flow one way, and no module imports one above it:
//!
//! ```text
//! api (gRPC RLS, HTTP)  ->  limiter (plan + decide)  ->  store (memory)  ->  algorithm (pure math)
//!                               |
//!                               +--> rules (compiled, swapped snapshot)
//! ```
//!
//! - [`proto`] — the wire API (Envoy RLS v3 subset), generated from `proto/`.
//! - [`settings`] — process settings, typed and validated before any port is bound. Each layer defines
//!   its own options (`limiter::OverloadSettings`, `store::redis::RedisSettings`, ...); `settings`
//!   assembles them from the settings file and the environment, and only `main` and `server` use it.
//! - [`rules`] — the reference rules format, validated and compiled into a matcher.
//! - [`limiter`] — decides a request: matching, counting, statuses, headers.
//! - [`store`] — where counters live, behind the [`store::CounterStore`] trait.
//! - [`algorithm`] — rate limit arithmetic, no I/O.
//! - [`api`] — gRPC service, health, reflection and the HTTP side port; the only place that converts
//!   between wire and domain types.
//! - [`telemetry`] — logging.
//! - [`server`] — wiring and the shutdown path.
#![forbid(unsafe_code)]

pub mod algorithm;
pub mod api;
pub mod clock;
mod duration;
pub mod limiter;
pub mod proto;
pub mod rules;
pub mod server;
pub mod settings;
pub mod store;
pub mod telemetry;
pub mod tls;
