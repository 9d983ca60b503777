//! The limiter's options: what a request may carry, how much work is taken on at once, which headers
//! answer, and what to answer when the store cannot decide. Part of the process settings (`settings`
//! assembles them from the settings file and the environment); defaults here are the service's.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What to answer when the backend cannot decide (Redis down, slow, or refusing).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnBackendError {
    /// gRPC UNAVAILABLE with the cause; Envoy's `failure_mode_deny` decides.
    #[default]
    Error,
    /// Answer OK (fail open).
    Allow,
    /// Answer OVER_LIMIT for every limited descriptor (fail closed).
    Deny,
    /// Decide from this replica's memory, each limit divided by `fallback.replicas`, until Redis answers
    /// again.
    Local,
}

/// The local fallback of `on_backend_error: local`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FallbackSettings {
    /// Replicas sharing the limits (default 1): while Redis cannot decide, each replica admits
    /// ⌈limit / replicas⌉ per window from its own memory, so the fleet stays near the limit without
    /// failing open or locking everyone out. Set it to the Deployment's replica count.
    pub replicas: u32,
}

impl Default for FallbackSettings {
    fn default() -> Self {
        Self { replicas: 1 }
    }
}

/// Bounds on the work a replica takes on at once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OverloadSettings {
    /// Open gRPC connections at most (default 10 000); beyond it new connections wait in the kernel's
    /// backlog until one closes.
    pub max_connections: usize,
    /// Concurrent requests (HTTP/2 streams) on one gRPC connection (default 1 024).
    pub max_streams_per_connection: u32,
    /// Requests being decided at once, gRPC and `/json` together (default 10 000); more are answered
    /// RESOURCE_EXHAUSTED at once instead of queueing.
    pub max_in_flight: usize,
    /// The longest one request may take to be decided (default `1s`): then DEADLINE_EXCEEDED. A caller's
    /// own shorter gRPC deadline is honoured too.
    #[serde(with = "crate::duration")]
    pub deadline: Duration,
}

impl Default for OverloadSettings {
    fn default() -> Self {
        Self {
            max_connections: 10_000,
            max_streams_per_connection: 1024,
            max_in_flight: 10_000,
            deadline: Duration::from_secs(1),
        }
    }
}

/// Bounds on what one request may carry; larger requests are refused with INVALID_ARGUMENT.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RequestLimits {
    /// Most descriptors in one request (default 64).
    pub max_descriptors: usize,
    /// Most entries in one descriptor (default 16).
    pub max_entries: usize,
    /// Longest entry key, in bytes (default 1024).
    pub max_key_bytes: usize,
    /// Longest entry value, in bytes (default 1024).
    pub max_value_bytes: usize,
    /// Largest encoded gRPC request, in bytes (default 65 536); the `/json` body may be four times that.
    pub max_message_bytes: usize,
    /// Honour a descriptor's `limit` override (default true, as the reference service does). False refuses
    /// a request carrying one with INVALID_ARGUMENT: for callers that reach ratelimitd directly rather
    /// than through Envoy, who must not choose their own limit.
    pub allow_overrides: bool,
}

impl Default for RequestLimits {
    fn default() -> Self {
        Self {
            max_descriptors: 64,
            max_entries: 16,
            max_key_bytes: 1024,
            max_value_bytes: 1024,
            max_message_bytes: 64 * 1024,
            allow_overrides: true,
        }
    }
}

impl RequestLimits {
    /// What one descriptor may carry, which a rule must fit to ever match.
    pub fn entry_bounds(&self) -> crate::rules::EntryBounds {
        crate::rules::EntryBounds {
            max_entries: self.max_entries,
            max_key_bytes: self.max_key_bytes,
            max_value_bytes: self.max_value_bytes,
        }
    }
}

/// Rate limit headers added to responses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResponseHeaders {
    /// No headers.
    #[default]
    Off,
    /// The reference's three headers (limit, remaining, reset) of the descriptor closest to its limit,
    /// plus `Retry-After` on OVER_LIMIT.
    Envoy,
    /// `RateLimit-Policy` and `RateLimit` of the IETF httpapi ratelimit-headers draft, plus
    /// `Retry-After` on OVER_LIMIT.
    Ietf,
}

/// Header names of the `envoy` header mode.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HeaderNames {
    /// The limit of the descriptor described (default `RateLimit-Limit`).
    pub limit: String,
    /// What is left of it in the current window (default `RateLimit-Remaining`).
    pub remaining: String,
    /// Seconds until the window resets (default `RateLimit-Reset`).
    pub reset: String,
}

impl Default for HeaderNames {
    fn default() -> Self {
        Self {
            limit: "RateLimit-Limit".into(),
            remaining: "RateLimit-Remaining".into(),
            reset: "RateLimit-Reset".into(),
        }
    }
}

/// The runtime limits operators set through the operators' API (see `limiter::runtime`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RuntimeLimitsSettings {
    /// How often each replica reads the store for the runtime limits set or deleted anywhere (default
    /// `500ms`): a change applies on every replica within this long plus a store round trip. Between
    /// changes a read is one small command.
    #[serde(with = "crate::duration")]
    pub refresh_interval: Duration,
    /// Most runtime limits at once (default 10 000); setting one more is refused.
    pub max_limits: usize,
}

impl Default for RuntimeLimitsSettings {
    fn default() -> Self {
        Self {
            refresh_interval: Duration::from_millis(500),
            max_limits: 10_000,
        }
    }
}
