//! The settings of the rate limit quota service (`rlqs.*` in the settings file, `RATELIMITD_RLQS__*` in
//! the environment). The reference service has no such service, so there are no reference variables.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How the rate limit quota service shares quota among the Envoys, and what it holds for them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RlqsSettings {
    /// Serve `envoy.service.rate_limit_quota.v3.RateLimitQuotaService` on the gRPC port (default true).
    /// It costs nothing until an Envoy opens a stream.
    pub enabled: bool,
    /// How often each Envoy reports its buckets (default `5s`, the period Envoy's filter uses and does not
    /// let one change). An assignment is sized for the time until the Envoy's next report; demand is
    /// measured over at least a tenth of it; a stream that sends nothing for ten of them is closed.
    #[serde(with = "crate::duration")]
    pub report_period: Duration,
    /// Time to live of every assignment, in whole seconds (default `15s`: three report periods). Envoy
    /// reads only the seconds; each report is answered with the assignment again, which extends it. An
    /// Envoy that stops reporting (its stream dropped, the Envoy gone) keeps its share for this long
    /// (and one second), then the others get it.
    #[serde(with = "crate::duration")]
    pub assignment_ttl: Duration,
    /// Most streams open on this replica (default 10 000); more are refused with RESOURCE_EXHAUSTED.
    pub max_streams: usize,
    /// Most buckets one stream may report (default 1 000); the buckets past it are not answered, and
    /// Envoy applies its own `no_assignment_behavior` to them.
    pub max_buckets_per_stream: usize,
    /// Most buckets this replica tracks over all its streams (default 100 000); a stream's new bucket past
    /// it is not answered (as above). Bounds the memory many streams can hold together; a bucket a
    /// stream has not reported for the assignment TTL is forgotten.
    pub max_buckets: usize,
    /// Most Envoys sharing one bucket (default 1 000); an Envoy past it is not answered (as above). The
    /// cost of recomputing a bucket grows with its Envoys.
    pub max_envoys_per_bucket: usize,
    /// Largest usage report accepted, encoded (default 1 MiB); a larger one ends the stream with
    /// RESOURCE_EXHAUSTED.
    pub max_message_bytes: usize,
}

impl Default for RlqsSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            report_period: Duration::from_secs(5),
            assignment_ttl: Duration::from_secs(15),
            max_streams: 10_000,
            max_buckets_per_stream: 1_000,
            max_buckets: 100_000,
            max_envoys_per_bucket: 1_000,
            max_message_bytes: 1 << 20,
        }
    }
}

impl RlqsSettings {
    /// The TTL sent with every assignment, in whole seconds.
    pub fn ttl_secs(&self) -> u64 {
        self.assignment_ttl.as_secs()
    }
}
