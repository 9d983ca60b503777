//! ratelimitd: an Envoy-compatible rate limit decision service.
//!
//! # Layout
//! A request flows down through four layers, and no module imports one above it:
//!
//! ```text
//! api (gRPC RLS, /json, health)  ->  limiter  ->  store  ->  algorithm (pure arithmetic)
//!     (gRPC RLQS) -> quota --------^    |     (memory | redis, with the deny cache in front)
//!                                       +-->  rules (compiled tree, swapped whole on reload)
//! ```
//!
//! `telemetry` (metrics, traces, logs, top offenders) sits beside them and imports none of them.
//! `settings` and `server` sit on top: `settings` assembles every layer's own options from the settings
//! file and the environment, `server` builds the parts from them and runs them. Only `main` and
//! `server` import `settings`.
//!
//! - [`proto`] — the wire API (Envoy RLS v3 subset, and the xDS discovery subset with the rule sets it
//!   carries), generated from `proto/`.
//! - [`api`] — gRPC service, health, reflection and the HTTP side port, the listeners' connection bounds,
//!   and the xDS client that streams the rules from a control plane; the only place that converts
//!   between wire and domain types.
//! - [`limiter`] — decides a request as steps: `plan` (descriptors to checks), the store call
//!   (`backend`: timing, traces, the local fallback), `status` (verdicts to statuses and headers),
//!   `record` (metrics and offenders). Its options are in `limiter::options`.
//! - [`quota`] — the rate limit quota service (RLQS): buckets resolved as descriptors by the limiter,
//!   Envoys' reported usage counted on the rules' counters, each bucket's limit shared fairly among the
//!   Envoys reporting it (`share`, mirrored by `share.lua`), the shares kept in the store (`state`).
//! - [`rules`] — the reference rules format: `yaml` reads, `compile` validates and builds the tree of
//!   `model`, `matcher` walks it per request, `rlconfig` prints it; `loader` and `watcher` read the folder.
//! - [`store`] — where counters live, behind [`store::CounterStore`], which also carries a store's
//!   lifecycle (readiness, health, housekeeping, close): the memory store, the Redis store (its calling
//!   contract with `decide.lua` in `store::redis::script`; requests that wait for a busy server share
//!   one call, hot counters are leased), the deny cache as a wrapper store, the counter key schema and
//!   the circuit breaker.
//! - [`algorithm`] — the five algorithms as pure functions, mirrored by the Redis script.
//! - [`telemetry`] — metrics, traces (W3C and B3), logs, the top offenders, and the statsd stream of the
//!   reference's stat names.
//! - [`settings`] — the process settings: file, `RATELIMITD_*` and the reference's variables
//!   (`settings::reference_env` is their table), validated before any port is bound.
//! - [`server`] — `build` makes the store, limiter, rules watcher and metrics from the settings; `serve`
//!   runs the listeners; every task it starts is tracked and drained on shutdown.
#![forbid(unsafe_code)]

pub mod algorithm;
pub mod api;
pub mod clock;
mod duration;
pub mod limiter;
pub mod proto;
pub mod quota;
pub mod rules;
pub mod server;
pub mod settings;
pub mod store;
pub mod telemetry;
pub mod tls;
