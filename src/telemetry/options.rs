//! Telemetry's options: logging, traces, the statsd stream, and the bounds on what requests can make metrics hold. Part of
//! the process settings (`settings` assembles them from the settings file and the environment); defaults
//! here are the service's.

use std::{collections::BTreeMap, time::Duration};

use serde::{Deserialize, Serialize};

/// Logging. Env `LOG_LEVEL` (default warn, as the reference), `LOG_FORMAT` (`text` or `json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogSettings {
    /// `trace`, `debug`, `info`, `warn` or `error` (any case); default `warn`.
    pub level: LogLevel,
    /// `text` (default) or `json`.
    pub format: LogFormat,
}

impl Default for LogSettings {
    fn default() -> Self {
        Self {
            level: LogLevel::Warn,
            format: LogFormat::Text,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
}

impl LogLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Trace => "trace",
            Self::Debug => "debug",
            Self::Info => "info",
            Self::Warn => "warn",
            Self::Error => "error",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// OpenTelemetry traces.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TracingSettings {
    /// Env `TRACING_ENABLED` (default false): export spans over OTLP/gRPC.
    pub enabled: bool,
    /// Env `TRACING_SERVICE_NAME` (default `RateLimit`, as the reference): the `service.name` resource.
    pub service_name: String,
    /// Env `TRACING_SAMPLING_RATE` (default 1): share of traces started here that are kept; traces
    /// started by the caller follow the caller's sampling decision.
    pub sampling_rate: f64,
    /// Collector endpoint; unset: the standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` /
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` variables, else `http://localhost:4317`. An `https://` endpoint is
    /// reached over TLS, trusting the system's CA certificates.
    pub endpoint: Option<String>,
    /// Env `TRACING_SERVICE_NAMESPACE`: the `service.namespace` resource; unset: none.
    pub service_namespace: Option<String>,
    /// Env `TRACING_SERVICE_INSTANCE_ID`: the `service.instance.id` resource; unset: a random id drawn at
    /// start, as the reference draws one, so that replicas' spans can be told apart.
    pub service_instance_id: Option<String>,
}

impl TracingSettings {
    /// The collector the exporter sends to, resolved as it resolves it: [`Self::endpoint`], else
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_ENDPOINT`, `http://localhost:4317`;
    /// `var` reads an environment variable.
    pub fn resolved_endpoint(&self, var: impl Fn(&str) -> Option<String>) -> String {
        self.endpoint
            .clone()
            .or_else(|| var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
            .or_else(|| var("OTEL_EXPORTER_OTLP_ENDPOINT"))
            .unwrap_or_else(|| "http://localhost:4317".into())
    }
}

impl Default for TracingSettings {
    fn default() -> Self {
        Self {
            enabled: false,
            service_name: "RateLimit".into(),
            sampling_rate: 1.0,
            endpoint: None,
            service_namespace: None,
            service_instance_id: None,
        }
    }
}

/// Bounds on the metric series that request values can create.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsSettings {
    /// Most `rule` label values one rule takes from request values (`detailed_metric`,
    /// `value_to_metric`; default 1 000); further values are counted together under
    /// `<rule> (other values)`, so callers cannot grow `/metrics` without bound.
    pub max_values_per_rule: usize,
}

impl Default for MetricsSettings {
    fn default() -> Self {
        Self {
            max_values_per_rule: 1000,
        }
    }
}

/// The `/debug/top` sketch of the most denied descriptors.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TopOffendersSettings {
    /// Descriptors tracked (default 100): memory is fixed by this, whatever the traffic.
    pub capacity: usize,
    /// The list covers the last one to two of these (default `60s`).
    #[serde(with = "crate::duration")]
    pub interval: Duration,
}

impl Default for TopOffendersSettings {
    fn default() -> Self {
        Self {
            capacity: 100,
            interval: Duration::from_secs(60),
        }
    }
}

/// The statsd (or DogStatsD) stream, beside Prometheus: the reference's stat names, counted in memory and
/// sent every `flush_interval` by a task of its own, so that no request ever waits for it or fails
/// because of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StatsdSettings {
    /// Env `USE_STATSD`; default false (see the README: the reference defaults to true, sending to
    /// `localhost:8125` whether or not anything listens there).
    pub enabled: bool,
    /// Env `STATSD_HOST`; default `localhost`.
    pub host: String,
    /// Env `STATSD_PORT`; default 8125.
    pub port: u16,
    /// `tcp` or `udp`. Env `STATSD_PROTOCOL` (lyft/gostats' variable); default `tcp` for statsd, as the
    /// reference sends, and `udp` for DogStatsD, which the Datadog agent listens on.
    pub protocol: Option<StatsdProtocol>,
    /// DogStatsD lines: tags as `|#k:v` rather than in the name. Env `USE_DOG_STATSD` (which also turns
    /// the stream on); default false.
    pub dogstatsd: bool,
    /// Tags added to every stat. Env `EXTRA_TAGS` (`k:v,k2:v2`).
    pub extra_tags: BTreeMap<String, String>,
    /// How often counts are sent. Env `STATS_FLUSH_INTERVAL`; default `10s`.
    #[serde(with = "crate::duration")]
    pub flush_interval: Duration,
}

impl Default for StatsdSettings {
    fn default() -> Self {
        Self {
            enabled: false,
            host: "localhost".into(),
            port: 8125,
            protocol: None,
            dogstatsd: false,
            extra_tags: BTreeMap::new(),
            flush_interval: Duration::from_secs(10),
        }
    }
}

impl StatsdSettings {
    /// The protocol in use: the configured one, else `udp` for DogStatsD and `tcp` for statsd.
    pub fn protocol(&self) -> StatsdProtocol {
        self.protocol.unwrap_or(if self.dogstatsd {
            StatsdProtocol::Udp
        } else {
            StatsdProtocol::Tcp
        })
    }
}

/// How stats travel to the statsd server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StatsdProtocol {
    Tcp,
    Udp,
}
