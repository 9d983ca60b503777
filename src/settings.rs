//! Process settings: typed, documented field by field, validated once before any port is bound.
//!
//! Sources, in rising precedence:
//! 1. built-in defaults ([`Settings::default`]);
//! 2. an optional settings file (`--config FILE`, YAML or TOML by extension);
//! 3. `RATELIMITD_*` environment variables, `__` separating nested keys
//!    (`RATELIMITD_GRPC__PORT=9000`);
//! 4. the environment variables of the reference service (`GRPC_PORT`, `LOG_LEVEL`, ...), which keep their
//!    exact names and meanings so that an existing Deployment can switch image.
//!
//! Every error names the setting and the bad value; `main` turns it into exit code 64.

use std::{
    collections::HashMap,
    fmt,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    str::FromStr,
    time::Duration,
};

use serde::{Deserialize, Serialize};

use crate::algorithm::Algorithm;

/// A setting that could not be read or does not make sense.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("invalid setting {name}={value:?}: {reason}")]
    Invalid {
        name: String,
        value: String,
        reason: String,
    },
    #[error("settings file {path}: {reason}")]
    File { path: PathBuf, reason: String },
    #[error("invalid settings: {0}")]
    Source(String),
}

impl SettingsError {
    fn invalid(name: &str, value: impl fmt::Display, reason: impl fmt::Display) -> Self {
        Self::Invalid {
            name: name.to_owned(),
            value: value.to_string(),
            reason: reason.to_string(),
        }
    }
}

/// Everything `ratelimitd serve` needs to know, after all sources are merged.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// The gRPC listener (Envoy RLS, health, reflection) and how long its connections live.
    pub grpc: GrpcSettings,
    /// The HTTP listener (`/healthcheck`, `/json`, `/rlconfig`). Env `HOST`, `PORT`; default 0.0.0.0:8080.
    pub http: HttpSettings,
    /// TLS and mTLS on the gRPC listener.
    pub grpc_tls: GrpcTlsSettings,
    /// Bounds that keep an overloaded or attacked replica answering quickly instead of queueing.
    pub overload: OverloadSettings,
    /// Logging. Env `LOG_LEVEL` (default warn, as the reference), `LOG_FORMAT` (`text` or `json`).
    pub log: LogSettings,
    /// Where the rules files are and how they are read.
    pub rules: RulesSettings,
    /// Where counters live: `memory` or `redis`. Env `BACKEND_TYPE`; default `redis` when a Redis URL is
    /// set, else `memory`.
    pub backend: Option<BackendKind>,
    /// The embedded memory store.
    pub memory: MemorySettings,
    /// The Redis store.
    pub redis: RedisSettings,
    /// A second Redis for limits whose unit is SECOND, as the reference's `REDIS_PERSECOND=true` with the
    /// `REDIS_PERSECOND_*` variables configures it; unset, every limit counts in `redis`.
    pub redis_per_second: Option<RedisSettings>,
    /// What to answer when the backend cannot decide. Env `RATELIMITD_ON_BACKEND_ERROR`; default `error`.
    pub on_backend_error: OnBackendError,
    /// How `on_backend_error: local` shares a limit among the replicas while Redis cannot decide.
    pub fallback: FallbackSettings,
    /// Prepended to every counter key, so that several services can share one Redis. Env `CACHE_KEY_PREFIX`.
    pub cache_key_prefix: String,
    /// Counters created in Redis live for their window plus a random 0..N seconds, spreading expiries.
    /// Env `EXPIRATION_JITTER_MAX_SECONDS`; default 300.
    pub expiration_jitter_max_seconds: u64,
    /// Bounds on what one request may carry; larger requests are refused with INVALID_ARGUMENT.
    pub request_limits: RequestLimits,
    /// Answer OK to every request while still counting and reporting per-descriptor statuses.
    /// Env `SHADOW_MODE`; default false.
    pub shadow_mode: bool,
    /// Count every descriptor of a denied request, as the reference service does by default.
    /// Default false: a denied request consumes nothing. Env `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT=false`
    /// sets this to true.
    pub consume_on_deny: bool,
    /// Fraction of a limit above which hits count as "near limit" in metrics. Env `NEAR_LIMIT_RATIO`; default 0.8.
    pub near_limit_ratio: f64,
    /// Rate limit headers added to responses (`off`, `envoy` or `ietf`). Env
    /// `LIMIT_RESPONSE_HEADERS_ENABLED=true` selects `envoy`.
    pub response_headers: ResponseHeaders,
    /// Header names of the `envoy` header mode. Env `LIMIT_LIMIT_HEADER`, `LIMIT_REMAINING_HEADER`,
    /// `LIMIT_RESET_HEADER`.
    pub header_names: HeaderNames,
    /// Health reports NOT_SERVING until rules with at least one domain are loaded.
    /// Env `HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED`; default false.
    pub healthy_with_at_least_one_config_loaded: bool,
    /// Shutdown behaviour on SIGTERM/SIGINT.
    pub shutdown: ShutdownSettings,
    /// Entry keys whose values are sensitive and are hashed before they reach a counter key or
    /// `/rlconfig` (case-insensitive). Env `RATELIMITD_HASHED_KEYS` (comma-separated); default
    /// `api_key`, `authorization`, `x-api-key`.
    pub hashed_keys: Vec<String>,
    /// Most denials the local deny cache remembers (default 0: off). Env `LOCAL_CACHE_SIZE_IN_BYTES` sets it
    /// to that many bytes' worth, counting 256 bytes an entry.
    pub local_cache_max_entries: usize,
    /// The `/debug/top` sketch of the most denied descriptors.
    pub top_offenders: TopOffendersSettings,
    /// Bounds on the metrics that requests shape.
    pub metrics: MetricsSettings,
    /// OpenTelemetry traces.
    pub tracing: TracingSettings,
    /// A separate Prometheus listener, as the reference service has (`/metrics` on the HTTP port is
    /// always there).
    pub prometheus: PrometheusSettings,
    /// Secret of the HMAC-SHA256 that hashes sensitive values. Env `RATELIMITD_HASH_SECRET`; set it to the
    /// same value on every replica. Unset: values are hashed with unkeyed SHA-256 (still never stored raw,
    /// the same on every replica and restart, but a guessed value can be confirmed from the keys).
    pub hash_secret: Secret,
    /// What loading noticed but did not stop for (unknown `RATELIMITD_*` variables), for the caller to log
    /// once logging has started. Not a setting.
    #[serde(skip)]
    pub warnings: Vec<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            grpc: GrpcSettings::default(),
            http: HttpSettings::default(),
            log: LogSettings::default(),
            rules: RulesSettings::default(),
            backend: None,
            memory: MemorySettings::default(),
            redis: RedisSettings::default(),
            redis_per_second: None,
            on_backend_error: OnBackendError::Error,
            fallback: FallbackSettings::default(),
            cache_key_prefix: String::new(),
            expiration_jitter_max_seconds: 300,
            grpc_tls: GrpcTlsSettings::default(),
            overload: OverloadSettings::default(),
            request_limits: RequestLimits::default(),
            shadow_mode: false,
            consume_on_deny: false,
            near_limit_ratio: 0.8,
            response_headers: ResponseHeaders::Off,
            header_names: HeaderNames::default(),
            healthy_with_at_least_one_config_loaded: false,
            shutdown: ShutdownSettings::default(),
            local_cache_max_entries: 0,
            top_offenders: TopOffendersSettings::default(),
            metrics: MetricsSettings::default(),
            tracing: TracingSettings::default(),
            prometheus: PrometheusSettings::default(),
            hashed_keys: vec!["api_key".into(), "authorization".into(), "x-api-key".into()],
            hash_secret: Secret::default(),
            warnings: Vec::new(),
        }
    }
}

/// The HTTP listener, and the bounds that keep slow or idle clients from holding its connections (and
/// the file descriptors that gRPC and health checks need). The separate Prometheus listener, when
/// enabled, has the same bounds, with places of its own.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpSettings {
    /// IP address to bind, e.g. `0.0.0.0` or `127.0.0.1`. Env `HOST`; default `0.0.0.0`.
    pub host: String,
    /// TCP port; 0 picks a free one. Env `PORT`; default 8080.
    pub port: u16,
    /// Open HTTP connections at most (default 256, well below the usual 1 024 file descriptors); beyond
    /// it new connections wait in the kernel's backlog until one closes.
    pub max_connections: usize,
    /// The longest a client may take to send a request's headers (default `10s`), counted from the
    /// moment the connection waits for them: from the accept, and after each answer on a keep-alive
    /// connection, so it is also how long an idle keep-alive connection stays open. Then the connection
    /// is closed.
    #[serde(with = "humantime_serde_compat")]
    pub header_read_timeout: Duration,
    /// The longest one request may take from its headers to its answer, reading its body included
    /// (default `10s`); then it is answered 408 and the connection closed.
    #[serde(with = "humantime_serde_compat")]
    pub request_timeout: Duration,
    /// A connection that moves no byte either way for this long is closed (default `30s`): a stalled
    /// upload, or a client that stops reading its answer.
    #[serde(with = "humantime_serde_compat")]
    pub idle_timeout: Duration,
}

impl Default for HttpSettings {
    fn default() -> Self {
        Self {
            host: "0.0.0.0".into(),
            port: 8080,
            max_connections: 256,
            header_read_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
        }
    }
}

impl HttpSettings {
    /// The socket address to bind.
    pub fn addr(&self, name: &str) -> Result<SocketAddr, SettingsError> {
        socket_addr(&self.host, self.port, name)
    }
}

fn socket_addr(host: &str, port: u16, name: &str) -> Result<SocketAddr, SettingsError> {
    let ip: IpAddr = host
        .parse()
        .map_err(|_| SettingsError::invalid(name, host, "not an IP address"))?;
    Ok(SocketAddr::new(ip, port))
}

/// The gRPC listener, and when its connections are recycled so that new replicas get their share of
/// long-lived clients such as Envoy.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpcSettings {
    /// IP address to bind. Env `GRPC_HOST`; default `0.0.0.0`.
    pub host: String,
    /// TCP port; 0 picks a free one. Env `GRPC_PORT`; default 8081.
    pub port: u16,
    /// A connection this old is closed gracefully: HTTP/2 GOAWAY, so the client opens a new connection
    /// (possibly to another replica) for its next calls while the calls in flight finish. Varied by up to
    /// ±10 %, drawn once when the process starts (tonic takes one age for all connections): replicas
    /// spread their recycling, while connections one replica accepted together are recycled together.
    /// `0s`: never. Env `GRPC_MAX_CONNECTION_AGE`; default `24h`, as the reference.
    #[serde(with = "humantime_serde_compat")]
    pub max_connection_age: Duration,
    /// How long calls still in flight on a connection past its age may run; then the connection is
    /// closed whatever runs on it. `0s`: no bound. Env `GRPC_MAX_CONNECTION_AGE_GRACE`; default `1h`.
    #[serde(with = "humantime_serde_compat")]
    pub max_connection_age_grace: Duration,
    /// A new connection must finish its TLS handshake (with TLS) and send the HTTP/2 client preface
    /// within this long of its accept, or it is dropped (default `10s`): connections that say nothing
    /// cannot keep `overload.max_connections` full.
    #[serde(with = "humantime_serde_compat")]
    pub handshake_timeout: Duration,
    /// A connection on which no call has been in flight for this long is closed (default `5m`; grpc-go's
    /// MaxConnectionIdle). Clients such as Envoy reconnect by themselves on their next call. The close
    /// carries no GOAWAY: a call sent at the very moment of the close fails as on any lost connection.
    #[serde(with = "humantime_serde_compat")]
    pub idle_timeout: Duration,
    /// After this long without a frame from the client, the server sends an HTTP/2 PING (default `1m`)...
    #[serde(with = "humantime_serde_compat")]
    pub keepalive_interval: Duration,
    /// ...and closes the connection when the PING is not answered within this long (default `20s`): a
    /// peer that vanished (host gone, network cut) frees its connection.
    #[serde(with = "humantime_serde_compat")]
    pub keepalive_timeout: Duration,
}

impl Default for GrpcSettings {
    fn default() -> Self {
        Self {
            host: "0.0.0.0".into(),
            port: 8081,
            max_connection_age: Duration::from_secs(24 * 3600),
            max_connection_age_grace: Duration::from_secs(3600),
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
            keepalive_interval: Duration::from_secs(60),
            keepalive_timeout: Duration::from_secs(20),
        }
    }
}

impl GrpcSettings {
    /// The socket address to bind.
    pub fn addr(&self, name: &str) -> Result<SocketAddr, SettingsError> {
        socket_addr(&self.host, self.port, name)
    }
}

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

impl FromStr for LogLevel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "trace" => Ok(Self::Trace),
            "debug" => Ok(Self::Debug),
            "info" => Ok(Self::Info),
            "warn" | "warning" => Ok(Self::Warn),
            "error" | "fatal" | "panic" => Ok(Self::Error),
            _ => Err("expected one of trace, debug, info, warn, error".into()),
        }
    }
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

impl FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            _ => Err("expected text or json".into()),
        }
    }
}

/// Default of `rules.max_yaml_nodes`: room for rules files of some 90 000 descriptors with a limit each.
pub const DEFAULT_MAX_YAML_NODES: usize = 1_000_000;

/// Where the rules live. With `path` set, every file under it is a rules file. Otherwise, when
/// `runtime_root` is set, the reference layout applies (see [`RulesSettings::source`]); with neither,
/// rules come from `./config` when that folder exists.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RulesSettings {
    /// A folder of rules files, read recursively.
    pub path: Option<PathBuf>,
    /// Env `RUNTIME_ROOT`: root of the reference layout.
    pub runtime_root: Option<PathBuf>,
    /// Env `RUNTIME_SUBDIRECTORY`: folder under the root.
    pub runtime_subdirectory: String,
    /// Env `RUNTIME_APPDIRECTORY` (default `config`): folder holding the rules files.
    pub runtime_appdirectory: String,
    /// Env `RUNTIME_WATCH_ROOT` (default true): read `root/subdirectory` and keep the files whose dotted
    /// path starts with `appdirectory.`; false reads `root/subdirectory/appdirectory` directly
    /// (the layout of a Kubernetes ConfigMap mount).
    pub runtime_watch_root: bool,
    /// Env `RUNTIME_IGNOREDOTFILES` (default false): skip files and folders whose name starts with a dot.
    pub ignore_dotfiles: bool,
    /// Env `MERGE_DOMAIN_CONFIG` (default false): files naming the same domain are merged instead of
    /// rejected.
    pub merge_domains: bool,
    /// The algorithm of limits that do not name one (default `fixed_window`, the reference's).
    pub default_algorithm: Algorithm,
    /// Reload the rules when files under the rules folder change (default true).
    pub watch: bool,
    /// Quiet time after the last change before reloading (default `250ms`): changes come in bursts.
    #[serde(with = "humantime_serde_compat")]
    pub reload_delay: Duration,
    /// Most YAML nodes (maps, lists and scalars, aliases expanded) one rules file may hold (default
    /// 1 000 000, some 90 000 descriptors with a limit each); a larger file is refused, naming this setting.
    pub max_yaml_nodes: usize,
}

impl Default for RulesSettings {
    fn default() -> Self {
        Self {
            path: None,
            runtime_root: None,
            runtime_subdirectory: String::new(),
            runtime_appdirectory: "config".into(),
            runtime_watch_root: true,
            ignore_dotfiles: false,
            merge_domains: false,
            default_algorithm: Algorithm::FixedWindow,
            watch: true,
            reload_delay: Duration::from_millis(250),
            max_yaml_nodes: DEFAULT_MAX_YAML_NODES,
        }
    }
}

/// How the rules directory is walked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RulesSource {
    /// The folder walked recursively.
    pub root: PathBuf,
    /// With the reference `RUNTIME_WATCH_ROOT=true` layout: only files whose dotted relative path starts
    /// with this prefix (e.g. `config.`) are rules, and they are named by that dotted path.
    pub key_prefix: Option<String>,
    /// Skip names starting with a dot.
    pub ignore_dotfiles: bool,
    /// Merge files of the same domain.
    pub merge_domains: bool,
    /// The algorithm of limits that do not name one.
    pub default_algorithm: Algorithm,
    /// The path a deployment swaps whole to publish new rules (`RUNTIME_ROOT`, often a symlink), when it
    /// differs from `root`; its parent folder is watched too.
    pub swap_point: Option<PathBuf>,
    /// Most YAML nodes one file may hold (`rules.max_yaml_nodes`).
    pub max_yaml_nodes: usize,
}

impl RulesSettings {
    /// Resolves the settings into the folder to read.
    pub fn source(&self) -> RulesSource {
        let swap_point = match (&self.path, &self.runtime_root) {
            (None, Some(runtime_root)) => Some(runtime_root.clone()),
            _ => None,
        };
        let (root, key_prefix) = match (&self.path, &self.runtime_root) {
            (Some(path), _) => (path.clone(), None),
            (None, Some(runtime_root)) => {
                let base = join_nonempty(runtime_root, &self.runtime_subdirectory);
                if self.runtime_watch_root {
                    (base, Some(format!("{}.", self.runtime_appdirectory)))
                } else {
                    (join_nonempty(&base, &self.runtime_appdirectory), None)
                }
            }
            (None, None) => (PathBuf::from("config"), None),
        };
        RulesSource {
            root,
            key_prefix,
            ignore_dotfiles: self.ignore_dotfiles,
            merge_domains: self.merge_domains,
            default_algorithm: self.default_algorithm,
            swap_point,
            max_yaml_nodes: self.max_yaml_nodes,
        }
    }
}

fn join_nonempty(base: &Path, part: &str) -> PathBuf {
    if part.is_empty() {
        base.to_path_buf()
    } else {
        base.join(part)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// Counters in this process's memory: exact for one replica, lost on restart.
    Memory,
    /// Counters in Redis, shared by every replica.
    Redis,
    /// No counters: every request is allowed without any work. The floor benchmarks measure against.
    Noop,
}

impl FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "memory" => Ok(Self::Memory),
            "redis" => Ok(Self::Redis),
            "noop" => Ok(Self::Noop),
            _ => Err("expected memory, redis or noop".into()),
        }
    }
}

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

impl FromStr for OnBackendError {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "error" => Ok(Self::Error),
            "allow" => Ok(Self::Allow),
            "deny" => Ok(Self::Deny),
            "local" => Ok(Self::Local),
            _ => Err("expected error, allow, deny or local".into()),
        }
    }
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

/// How ratelimitd reaches Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RedisTopology {
    /// One server (`host:port`, a `redis://` URL, or a unix socket path).
    Single,
    /// A master found through Sentinel (`mastername,host:port,host:port...`).
    Sentinel,
    /// Redis Cluster (`host:port,host:port...` seed nodes).
    Cluster,
}

impl FromStr for RedisTopology {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "single" => Ok(Self::Single),
            "sentinel" => Ok(Self::Sentinel),
            "cluster" => Ok(Self::Cluster),
            _ => Err("expected single, sentinel or cluster".into()),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SocketType {
    Tcp,
    Unix,
}

impl FromStr for SocketType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "tcp" => Ok(Self::Tcp),
            "unix" => Ok(Self::Unix),
            _ => Err("expected tcp or unix".into()),
        }
    }
}

/// Bytes one local deny cache entry is counted for when sizing it from `LOCAL_CACHE_SIZE_IN_BYTES`.
pub const LOCAL_CACHE_ENTRY_BYTES: usize = 256;

/// A secret setting: kept out of `Debug` output, logs and error messages.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_empty() {
            "\"\""
        } else {
            "\"<redacted>\""
        })
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
    #[serde(with = "humantime_serde_compat")]
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

/// TLS on the gRPC listener. The files are read at start (an unreadable one stops the start) and again
/// whenever they change, without a restart.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpcTlsSettings {
    /// Env `GRPC_SERVER_USE_TLS` (default false).
    pub enabled: bool,
    /// Env `GRPC_SERVER_TLS_CERT`: the server's PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// Env `GRPC_SERVER_TLS_KEY`: its PEM private key.
    pub key: PathBuf,
    /// Env `GRPC_CLIENT_TLS_CACERT`: when set, clients must present a certificate signed by these PEM CAs
    /// (mTLS).
    pub client_ca: Option<PathBuf>,
    /// Env `GRPC_CLIENT_TLS_SAN`: when set, the client certificate must also name this DNS SAN.
    pub client_san: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisSettings {
    /// Env `REDIS_URL`: `host:port`, `redis://` or `rediss://` URL, a unix socket path,
    /// `mastername,host:port,...` for Sentinel, or comma-separated seed nodes for Cluster. Setting it makes
    /// `redis` the default backend.
    pub url: String,
    /// Env `REDIS_TYPE` (`single`, `sentinel`, `cluster`); default `single`.
    pub topology: RedisTopology,
    /// Env `REDIS_SOCKET_TYPE` (`tcp` or `unix`). Unset: `unix` when the URL is a path, else `tcp`.
    pub socket_type: Option<SocketType>,
    /// Env `REDIS_AUTH`: `password` or `user:password` (Redis ACL user).
    pub auth: Secret,
    /// Env `REDIS_SENTINEL_AUTH`: the Sentinels' own `password` or `user:password`, for Sentinels with
    /// `requirepass` (`auth` is the master's and is not sent to them). Unset: the Sentinels are asked
    /// without authentication, as the reference does.
    pub sentinel_auth: Secret,
    /// Env `REDIS_TLS`: connect with TLS (also implied by a `rediss://` URL). The server certificate is
    /// checked against `tls_ca_cert`, or the system's roots when unset.
    pub tls: bool,
    /// Env `REDIS_TLS_CACERT`: PEM CA certificates that sign the Redis server certificates.
    pub tls_ca_cert: Option<PathBuf>,
    /// Env `REDIS_TLS_CLIENT_CERT`, `REDIS_TLS_CLIENT_KEY`: a PEM client certificate and key, for a Redis
    /// that requires them (`tls-auth-clients yes`).
    pub tls_client_cert: Option<PathBuf>,
    pub tls_client_key: Option<PathBuf>,
    /// Env `REDIS_TLS_SKIP_HOSTNAME_VERIFICATION`: accept a server certificate that does not name the
    /// host connected to (it must still be signed by a trusted CA). Default false.
    pub tls_skip_hostname_verification: bool,
    /// Env `REDIS_POOL_SIZE` (default 10): connections per Redis node; commands are pipelined on each.
    pub pool_size: usize,
    /// Env `REDIS_TIMEOUT` (default `1s`): the longest a request that carries no deadline of its own
    /// waits for Redis before the `on_backend_error` policy answers (never past `overload.deadline`). A
    /// gRPC call with a deadline (Envoy sends its filter timeout as `grpc-timeout`) waits until shortly
    /// before that deadline instead. A dead or hung Redis is not waited for: see `unresponsive_after`.
    #[serde(with = "humantime_serde_compat")]
    pub timeout: Duration,
    /// A Redis server that answers nothing at all for this long while commands wait for it is
    /// unresponsive (hung, paused, stopped, or its connection lost): its circuit breaker opens
    /// (default `300ms`). Answers that merely queue behind a burst never count: they keep arriving.
    #[serde(with = "humantime_serde_compat")]
    pub unresponsive_after: Duration,
    /// Longest wait for a connection to be set up (default `2s`).
    #[serde(with = "humantime_serde_compat")]
    pub connect_timeout: Duration,
    /// Consecutive connection failures (refused, lost, TLS, cluster routing) that open the circuit breaker
    /// of a Redis server (default 5). While open, requests are answered at once by the `on_backend_error`
    /// policy, without waiting for Redis. Error replies (a script refusing a request) are answers, never
    /// failures.
    pub breaker_failures: u32,
    /// How long the breaker stays open before one request probes Redis again (default `500ms`).
    #[serde(with = "humantime_serde_compat")]
    pub breaker_open_for: Duration,
}

impl RedisSettings {
    /// Applies the reference's variables of one Redis client: `REDIS_*` for the main one,
    /// `REDIS_PERSECOND_*` for the per-second one.
    fn apply_reference_env(
        &mut self,
        prefix: &str,
        env: &HashMap<String, String>,
    ) -> Result<(), SettingsError> {
        let name = |suffix: &str| format!("{prefix}{suffix}");
        let get = |suffix: &str| {
            env.get(&name(suffix))
                .map(|v| v.trim())
                .filter(|v| !v.is_empty())
        };
        if let Some(v) = get("URL") {
            self.url = v.to_owned();
        }
        if let Some(v) = get("TYPE") {
            self.topology = parse(v, &name("TYPE"))?;
        }
        if let Some(v) = get("SOCKET_TYPE") {
            self.socket_type = Some(parse(v, &name("SOCKET_TYPE"))?);
        }
        if let Some(v) = env.get(&name("AUTH")).filter(|v| !v.is_empty()) {
            self.auth = Secret(v.clone());
        }
        if let Some(v) = env.get(&name("SENTINEL_AUTH")).filter(|v| !v.is_empty()) {
            self.sentinel_auth = Secret(v.clone());
        }
        if let Some(v) = get("TLS") {
            self.tls = parse_bool(v, &name("TLS"))?;
        }
        if let Some(v) = get("POOL_SIZE") {
            self.pool_size = parse(v, &name("POOL_SIZE"))?;
        }
        if let Some(v) = get("TIMEOUT") {
            self.timeout = parse_duration(v, &name("TIMEOUT"))?;
        }
        Ok(())
    }
}

impl Default for RedisSettings {
    fn default() -> Self {
        Self {
            url: String::new(),
            topology: RedisTopology::Single,
            socket_type: None,
            auth: Secret::default(),
            sentinel_auth: Secret::default(),
            tls: false,
            tls_ca_cert: None,
            tls_client_cert: None,
            tls_client_key: None,
            tls_skip_hostname_verification: false,
            pool_size: 10,
            timeout: Duration::from_secs(1),
            unresponsive_after: Duration::from_millis(300),
            connect_timeout: Duration::from_secs(2),
            breaker_failures: 5,
            breaker_open_for: Duration::from_millis(500),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemorySettings {
    /// Most counters held at once (default 1 000 000, about 100 bytes each). When the bound is reached and
    /// no expired counter can be reclaimed, requests needing a new counter fail with UNAVAILABLE
    /// ("memory store full") rather than evicting live counters, so no count is ever lost silently.
    pub max_keys: usize,
    /// How often expired windows are reclaimed (default `5s`).
    #[serde(with = "humantime_serde_compat")]
    pub sweep_interval: Duration,
}

impl Default for MemorySettings {
    fn default() -> Self {
        Self {
            max_keys: 1_000_000,
            sweep_interval: Duration::from_secs(5),
        }
    }
}

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

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HeaderNames {
    pub limit: String,
    pub remaining: String,
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
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` variables, else `http://localhost:4317`.
    pub endpoint: Option<String>,
}

impl Default for TracingSettings {
    fn default() -> Self {
        Self {
            enabled: false,
            service_name: "RateLimit".into(),
            sampling_rate: 1.0,
            endpoint: None,
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

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TopOffendersSettings {
    /// Descriptors tracked (default 100): memory is fixed by this, whatever the traffic.
    pub capacity: usize,
    /// The list covers the last one to two of these (default `60s`).
    #[serde(with = "humantime_serde_compat")]
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

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrometheusSettings {
    /// Env `USE_PROMETHEUS` (default false): also serve metrics on `addr`.
    pub enabled: bool,
    /// Env `PROMETHEUS_ADDR` (default `:9090`): `host:port`, or `:port` for every address.
    pub addr: String,
    /// Env `PROMETHEUS_PATH` (default `/metrics`).
    pub path: String,
}

impl Default for PrometheusSettings {
    fn default() -> Self {
        Self {
            enabled: false,
            addr: ":9090".into(),
            path: "/metrics".into(),
        }
    }
}

impl PrometheusSettings {
    /// The socket address to bind.
    pub fn socket_addr(&self) -> Result<SocketAddr, SettingsError> {
        let text = if self.addr.starts_with(':') {
            format!("0.0.0.0{}", self.addr)
        } else {
            self.addr.clone()
        };
        text.parse().map_err(|_| {
            SettingsError::invalid("PROMETHEUS_ADDR", &self.addr, "expected host:port or :port")
        })
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShutdownSettings {
    /// After SIGTERM, keep answering (with health NOT_SERVING) this long before closing the listeners, so
    /// that load balancers stop sending traffic first (default `0s`).
    #[serde(with = "humantime_serde_compat")]
    pub drain_delay: Duration,
    /// Longest wait for in-flight calls once the listeners are closed (default `20s`).
    #[serde(with = "humantime_serde_compat")]
    pub grace_period: Duration,
}

impl Default for ShutdownSettings {
    fn default() -> Self {
        Self {
            drain_delay: Duration::ZERO,
            grace_period: Duration::from_secs(20),
        }
    }
}

/// Durations written as `250ms`, `10s`, `1m` in files and env variables.
mod humantime_serde_compat {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        humantime::parse_duration(&text).map_err(|e| {
            serde::de::Error::custom(format!(
                "invalid duration {text:?} ({e}); write e.g. 250ms, 10s, 1m"
            ))
        })
    }
}

impl Settings {
    /// Loads settings from the optional file and the given environment (normally `std::env::vars()`).
    pub fn load(
        file: Option<&Path>,
        env: &HashMap<String, String>,
    ) -> Result<Settings, SettingsError> {
        let defaults = config::Config::try_from(&Settings::default())
            .map_err(|e| SettingsError::Source(e.to_string()))?;
        let mut builder = config::Config::builder().add_source(defaults);
        if let Some(path) = file {
            let format = match path.extension().and_then(|e| e.to_str()) {
                Some("yaml" | "yml") => config::FileFormat::Yaml,
                Some("toml") => config::FileFormat::Toml,
                _ => {
                    return Err(SettingsError::File {
                        path: path.to_owned(),
                        reason: "unknown format: name it *.yaml, *.yml or *.toml".into(),
                    })
                }
            };
            let text = std::fs::read_to_string(path).map_err(|e| SettingsError::File {
                path: path.to_owned(),
                reason: e.to_string(),
            })?;
            builder = builder.add_source(config::File::from_str(&text, format));
        }
        let (prefixed, unknown) = prefixed_env(env)?;
        builder = builder.add_source(
            config::Environment::with_prefix("RATELIMITD")
                .prefix_separator("_")
                .separator("__")
                .try_parsing(true)
                .list_separator(",")
                .with_list_parse_key("hashed_keys")
                .source(Some(prefixed)),
        );
        let merged = builder.build().map_err(|e| from_config_error(file, e))?;
        let mut settings: Settings = merged
            .try_deserialize()
            .map_err(|e| from_config_error(file, e))?;
        settings.apply_reference_env(env)?;
        settings.validate()?;
        if !unknown.is_empty() {
            // Names only: a mistyped variable may well hold a secret.
            settings.warnings.push(format!(
                "ignoring environment variables that name no ratelimitd setting: {} (Kubernetes sets RATELIMITD_* service links in every pod of a namespace with a Service named ratelimitd)",
                unknown.join(", ")
            ));
        }
        Ok(settings)
    }

    /// Applies the environment variables of the reference service, which win over everything else.
    fn apply_reference_env(&mut self, env: &HashMap<String, String>) -> Result<(), SettingsError> {
        let get = |name: &str| env.get(name).map(|v| v.trim()).filter(|v| !v.is_empty());
        if let Some(v) = get("HOST") {
            self.http.host = v.to_owned();
        }
        if let Some(v) = get("PORT") {
            self.http.port = parse(v, "PORT")?;
        }
        if let Some(v) = get("GRPC_HOST") {
            self.grpc.host = v.to_owned();
        }
        if let Some(v) = get("GRPC_PORT") {
            self.grpc.port = parse(v, "GRPC_PORT")?;
        }
        if let Some(v) = get("LOG_LEVEL") {
            self.log.level = parse(v, "LOG_LEVEL")?;
        }
        if let Some(v) = get("LOG_FORMAT") {
            self.log.format = parse(v, "LOG_FORMAT")?;
        }
        if let Some(v) = get("RUNTIME_ROOT") {
            self.rules.runtime_root = Some(PathBuf::from(v));
        }
        if let Some(v) = env.get("RUNTIME_SUBDIRECTORY") {
            self.rules.runtime_subdirectory = v.trim().to_owned();
        }
        if let Some(v) = get("RUNTIME_APPDIRECTORY") {
            self.rules.runtime_appdirectory = v.to_owned();
        }
        if let Some(v) = get("RUNTIME_WATCH_ROOT") {
            self.rules.runtime_watch_root = parse_bool(v, "RUNTIME_WATCH_ROOT")?;
        }
        if let Some(v) = get("RUNTIME_IGNOREDOTFILES") {
            self.rules.ignore_dotfiles = parse_bool(v, "RUNTIME_IGNOREDOTFILES")?;
        }
        if let Some(v) = get("MERGE_DOMAIN_CONFIG") {
            self.rules.merge_domains = parse_bool(v, "MERGE_DOMAIN_CONFIG")?;
        }
        if let Some(v) = get("BACKEND_TYPE") {
            self.backend = Some(parse(v, "BACKEND_TYPE")?);
        }
        self.redis.apply_reference_env("REDIS_", env)?;
        if let Some(v) = get("REDIS_TLS_CACERT") {
            self.redis.tls_ca_cert = Some(PathBuf::from(v));
        }
        if let Some(v) = get("REDIS_TLS_CLIENT_CERT") {
            self.redis.tls_client_cert = Some(PathBuf::from(v));
        }
        if let Some(v) = get("REDIS_TLS_CLIENT_KEY") {
            self.redis.tls_client_key = Some(PathBuf::from(v));
        }
        if let Some(v) = get("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION") {
            self.redis.tls_skip_hostname_verification =
                parse_bool(v, "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION")?;
        }
        if let Some(v) = get("GRPC_SERVER_USE_TLS") {
            self.grpc_tls.enabled = parse_bool(v, "GRPC_SERVER_USE_TLS")?;
        }
        if let Some(v) = get("GRPC_SERVER_TLS_CERT") {
            self.grpc_tls.cert = PathBuf::from(v);
        }
        if let Some(v) = get("GRPC_SERVER_TLS_KEY") {
            self.grpc_tls.key = PathBuf::from(v);
        }
        if let Some(v) = get("GRPC_CLIENT_TLS_CACERT") {
            self.grpc_tls.client_ca = Some(PathBuf::from(v));
        }
        if let Some(v) = get("GRPC_CLIENT_TLS_SAN") {
            self.grpc_tls.client_san = Some(v.to_owned());
        }
        if let Some(v) = get("GRPC_MAX_CONNECTION_AGE") {
            self.grpc.max_connection_age = parse_duration(v, "GRPC_MAX_CONNECTION_AGE")?;
        }
        if let Some(v) = get("GRPC_MAX_CONNECTION_AGE_GRACE") {
            self.grpc.max_connection_age_grace =
                parse_duration(v, "GRPC_MAX_CONNECTION_AGE_GRACE")?;
        }
        if let Some(v) = get("REDIS_PERSECOND") {
            if parse_bool(v, "REDIS_PERSECOND")? {
                let per_second = self.redis_per_second.get_or_insert_with(|| RedisSettings {
                    // TLS files are shared with the main Redis, as in the reference.
                    tls_ca_cert: self.redis.tls_ca_cert.clone(),
                    tls_client_cert: self.redis.tls_client_cert.clone(),
                    tls_client_key: self.redis.tls_client_key.clone(),
                    tls_skip_hostname_verification: self.redis.tls_skip_hostname_verification,
                    ..RedisSettings::default()
                });
                per_second.apply_reference_env("REDIS_PERSECOND_", env)?;
            } else {
                self.redis_per_second = None;
            }
        }
        if let Some(v) = env.get("CACHE_KEY_PREFIX") {
            self.cache_key_prefix = v.clone();
        }
        if let Some(v) = get("EXPIRATION_JITTER_MAX_SECONDS") {
            self.expiration_jitter_max_seconds = parse(v, "EXPIRATION_JITTER_MAX_SECONDS")?;
        }
        if let Some(v) = get("SHADOW_MODE") {
            self.shadow_mode = parse_bool(v, "SHADOW_MODE")?;
        }
        if let Some(v) = get("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT") {
            self.consume_on_deny = !parse_bool(v, "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT")?;
        }
        if let Some(v) = get("LIMIT_RESPONSE_HEADERS_ENABLED") {
            self.response_headers = if parse_bool(v, "LIMIT_RESPONSE_HEADERS_ENABLED")? {
                ResponseHeaders::Envoy
            } else {
                ResponseHeaders::Off
            };
        }
        if let Some(v) = get("LIMIT_LIMIT_HEADER") {
            self.header_names.limit = v.to_owned();
        }
        if let Some(v) = get("LIMIT_REMAINING_HEADER") {
            self.header_names.remaining = v.to_owned();
        }
        if let Some(v) = get("LIMIT_RESET_HEADER") {
            self.header_names.reset = v.to_owned();
        }
        if let Some(v) = get("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED") {
            self.healthy_with_at_least_one_config_loaded =
                parse_bool(v, "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED")?;
        }
        if let Some(v) = get("LOCAL_CACHE_SIZE_IN_BYTES") {
            let bytes: usize = parse(v, "LOCAL_CACHE_SIZE_IN_BYTES")?;
            self.local_cache_max_entries = bytes / LOCAL_CACHE_ENTRY_BYTES;
        }
        if let Some(v) = get("TRACING_ENABLED") {
            self.tracing.enabled = parse_bool(v, "TRACING_ENABLED")?;
        }
        if let Some(v) = get("TRACING_SERVICE_NAME") {
            self.tracing.service_name = v.to_owned();
        }
        if let Some(v) = get("TRACING_SAMPLING_RATE") {
            self.tracing.sampling_rate = parse(v, "TRACING_SAMPLING_RATE")?;
        }
        if let Some(v) = get("TRACING_EXPORTER_PROTOCOL") {
            if !v.eq_ignore_ascii_case("grpc") {
                return Err(SettingsError::invalid(
                    "TRACING_EXPORTER_PROTOCOL",
                    v,
                    "ratelimitd exports traces over OTLP/gRPC only; set grpc (port 4317 of the collector)",
                ));
            }
        }
        if let Some(v) = get("USE_PROMETHEUS") {
            self.prometheus.enabled = parse_bool(v, "USE_PROMETHEUS")?;
        }
        if let Some(v) = get("PROMETHEUS_ADDR") {
            self.prometheus.addr = v.to_owned();
        }
        if let Some(v) = get("PROMETHEUS_PATH") {
            self.prometheus.path = v.to_owned();
        }
        if let Some(v) = get("NEAR_LIMIT_RATIO") {
            self.near_limit_ratio = parse(v, "NEAR_LIMIT_RATIO")?;
        }
        Ok(())
    }

    /// The backend in use: the configured one, else `redis` when a Redis URL is set, else `memory`.
    pub fn backend(&self) -> BackendKind {
        self.backend.unwrap_or(if self.redis.url.is_empty() {
            BackendKind::Memory
        } else {
            BackendKind::Redis
        })
    }

    /// Checks what types alone cannot.
    fn validate(&self) -> Result<(), SettingsError> {
        if self.backend() == BackendKind::Redis {
            if self.redis.url.trim().is_empty() {
                return Err(SettingsError::invalid(
                    "REDIS_URL",
                    "",
                    "the redis backend needs a Redis address",
                ));
            }
            if let Some(per_second) = &self.redis_per_second {
                if per_second.url.trim().is_empty() {
                    return Err(SettingsError::invalid(
                        "REDIS_PERSECOND_URL",
                        "",
                        "REDIS_PERSECOND=true needs the per-second Redis address",
                    ));
                }
                if per_second.pool_size == 0 || per_second.timeout.is_zero() {
                    return Err(SettingsError::invalid(
                        "REDIS_PERSECOND_POOL_SIZE",
                        per_second.pool_size,
                        "the per-second pool size and timeout must be above zero",
                    ));
                }
            }
            if self.redis.pool_size == 0 {
                return Err(SettingsError::invalid(
                    "REDIS_POOL_SIZE",
                    0,
                    "must be at least 1",
                ));
            }
            if self.redis.timeout.is_zero() {
                return Err(SettingsError::invalid(
                    "REDIS_TIMEOUT",
                    "0s",
                    "must be longer than zero",
                ));
            }
            if self.redis.unresponsive_after.is_zero() {
                return Err(SettingsError::invalid(
                    "redis.unresponsive_after",
                    "0s",
                    "must be longer than zero",
                ));
            }
            if self.redis.breaker_failures == 0 {
                return Err(SettingsError::invalid(
                    "redis.breaker_failures",
                    0,
                    "must be at least 1",
                ));
            }
        }
        if self.fallback.replicas == 0 {
            return Err(SettingsError::invalid(
                "fallback.replicas",
                0,
                "must be at least 1",
            ));
        }
        self.grpc.addr("grpc.host")?;
        self.http.addr("http.host")?;
        let tls = &self.grpc_tls;
        if tls.enabled {
            for (name, path) in [
                ("GRPC_SERVER_TLS_CERT", &tls.cert),
                ("GRPC_SERVER_TLS_KEY", &tls.key),
            ] {
                if path.as_os_str().is_empty() {
                    return Err(SettingsError::invalid(
                        name,
                        "",
                        "GRPC_SERVER_USE_TLS=true needs a certificate and its key",
                    ));
                }
            }
        } else if let Some(ca) = &tls.client_ca {
            return Err(SettingsError::invalid(
                "GRPC_CLIENT_TLS_CACERT",
                ca.display(),
                "client certificates need GRPC_SERVER_USE_TLS=true",
            ));
        }
        if let (Some(san), None) = (&tls.client_san, &tls.client_ca) {
            return Err(SettingsError::invalid(
                "GRPC_CLIENT_TLS_SAN",
                san,
                "a required client SAN needs GRPC_CLIENT_TLS_CACERT (client certificates)",
            ));
        }
        if self.redis.tls_client_cert.is_some() != self.redis.tls_client_key.is_some() {
            return Err(SettingsError::invalid(
                "REDIS_TLS_CLIENT_CERT",
                self.redis
                    .tls_client_cert
                    .as_ref()
                    .map_or_else(String::new, |p| p.display().to_string()),
                "REDIS_TLS_CLIENT_CERT and REDIS_TLS_CLIENT_KEY go together",
            ));
        }
        if self.prometheus.enabled {
            self.prometheus.socket_addr()?;
            if !self.prometheus.path.starts_with('/') {
                return Err(SettingsError::invalid(
                    "PROMETHEUS_PATH",
                    &self.prometheus.path,
                    "must start with /",
                ));
            }
        }
        if !(self.near_limit_ratio > 0.0 && self.near_limit_ratio <= 1.0) {
            return Err(SettingsError::invalid(
                "near_limit_ratio",
                self.near_limit_ratio,
                "must be greater than 0 and at most 1",
            ));
        }
        if !(0.0..=1.0).contains(&self.tracing.sampling_rate) {
            return Err(SettingsError::invalid(
                "TRACING_SAMPLING_RATE",
                self.tracing.sampling_rate,
                "must be between 0 and 1",
            ));
        }
        if self.memory.max_keys == 0 {
            return Err(SettingsError::invalid(
                "memory.max_keys",
                0,
                "must be at least 1",
            ));
        }
        if self.memory.sweep_interval.is_zero() {
            return Err(SettingsError::invalid(
                "memory.sweep_interval",
                "0s",
                "must be longer than zero",
            ));
        }
        let limits = &self.request_limits;
        for (name, value) in [
            ("request_limits.max_descriptors", limits.max_descriptors),
            ("request_limits.max_entries", limits.max_entries),
            ("request_limits.max_key_bytes", limits.max_key_bytes),
            ("request_limits.max_value_bytes", limits.max_value_bytes),
            ("request_limits.max_message_bytes", limits.max_message_bytes),
            ("overload.max_connections", self.overload.max_connections),
            (
                "overload.max_streams_per_connection",
                self.overload.max_streams_per_connection as usize,
            ),
            ("overload.max_in_flight", self.overload.max_in_flight),
            ("rules.max_yaml_nodes", self.rules.max_yaml_nodes),
        ] {
            if value == 0 {
                return Err(SettingsError::invalid(name, value, "must be at least 1"));
            }
        }
        if self.http.max_connections == 0 {
            return Err(SettingsError::invalid(
                "http.max_connections",
                0,
                "must be at least 1",
            ));
        }
        for (name, value) in [
            ("overload.deadline", self.overload.deadline),
            ("grpc.handshake_timeout", self.grpc.handshake_timeout),
            ("grpc.idle_timeout", self.grpc.idle_timeout),
            ("grpc.keepalive_interval", self.grpc.keepalive_interval),
            ("grpc.keepalive_timeout", self.grpc.keepalive_timeout),
            ("http.header_read_timeout", self.http.header_read_timeout),
            ("http.request_timeout", self.http.request_timeout),
            ("http.idle_timeout", self.http.idle_timeout),
        ] {
            if value.is_zero() {
                return Err(SettingsError::invalid(
                    name,
                    "0s",
                    "must be longer than zero",
                ));
            }
        }
        for (name, value) in [
            ("header_names.limit", &self.header_names.limit),
            ("header_names.remaining", &self.header_names.remaining),
            ("header_names.reset", &self.header_names.reset),
        ] {
            let valid = !value.is_empty()
                && value
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
            if !valid {
                return Err(SettingsError::invalid(
                    name,
                    value,
                    "not a valid HTTP header name",
                ));
            }
        }
        Ok(())
    }
}

/// The `RATELIMITD_*` variables that name a setting, to be read, and the names of those that do not, to
/// be ignored with a warning. Unknown ones must not stop the service: Kubernetes injects service links
/// such as `RATELIMITD_PORT=tcp://10.0.0.1:8081` into every pod when a Service is named `ratelimitd`.
/// (Unknown keys in a settings file stay errors: that file is ratelimitd's own.)
fn prefixed_env(
    env: &HashMap<String, String>,
) -> Result<(config::Map<String, String>, Vec<String>), SettingsError> {
    let known = setting_keys()?;
    let mut prefixed = config::Map::new();
    let mut unknown = Vec::new();
    for (name, value) in env {
        let Some(rest) = name.strip_prefix("RATELIMITD_") else {
            continue;
        };
        // The key the config crate makes of the name: lower case, `__` between nested keys.
        if known.contains(&rest.to_lowercase().replace("__", ".")) {
            prefixed.insert(name.clone(), value.clone());
        } else {
            unknown.push(name.clone());
        }
    }
    unknown.sort();
    Ok((prefixed, unknown))
}

/// Every settings key, sections and their fields alike (`grpc`, `grpc.port`, ...), as the defaults
/// serialize them (a field that is unset by default serializes as null, so it is listed too).
fn setting_keys() -> Result<std::collections::HashSet<String>, SettingsError> {
    fn walk(prefix: &str, value: &serde_json::Value, keys: &mut std::collections::HashSet<String>) {
        if let serde_json::Value::Object(fields) = value {
            for (name, value) in fields {
                let key = if prefix.is_empty() {
                    name.clone()
                } else {
                    format!("{prefix}.{name}")
                };
                walk(&key, value, keys);
                keys.insert(key);
            }
        }
    }
    // Optional sections are unset by default: fill them in so that their fields are listed too.
    let defaults = Settings {
        redis_per_second: Some(RedisSettings::default()),
        ..Settings::default()
    };
    let defaults =
        serde_json::to_value(defaults).map_err(|e| SettingsError::Source(e.to_string()))?;
    let mut keys = std::collections::HashSet::new();
    walk("", &defaults, &mut keys);
    Ok(keys)
}

fn parse<T: FromStr>(value: &str, name: &str) -> Result<T, SettingsError>
where
    T::Err: fmt::Display,
{
    value
        .parse()
        .map_err(|e| SettingsError::invalid(name, value, e))
}

/// A duration in a reference variable, as Go's `time.ParseDuration` reads it (`300ms`, `1.5h`, `2h45m`,
/// `0`), which is what the reference accepts; also the forms of the settings file (`250ms`, `1m 30s`).
fn parse_duration(value: &str, name: &str) -> Result<Duration, SettingsError> {
    parse_go_duration(value)
        .or_else(|| humantime::parse_duration(value).ok())
        .ok_or_else(|| {
            SettingsError::invalid(
                name,
                value,
                "expected a duration such as 500ms, 10s, 1.5h or 2h45m",
            )
        })
}

/// Go's duration syntax: a sequence of decimal numbers, each with a unit (`ns`, `us`, `µs`, `ms`, `s`,
/// `m`, `h`); or `0`. Negative durations mean nothing here and are refused.
fn parse_go_duration(text: &str) -> Option<Duration> {
    if text == "0" {
        return Some(Duration::ZERO);
    }
    let mut rest = text.strip_prefix('+').unwrap_or(text);
    if rest.is_empty() {
        return None;
    }
    let mut total = 0f64;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, after) = rest.split_at(number_len);
        if number.is_empty() || number == "." {
            return None;
        }
        let unit_len = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        let nanos_per_unit = match unit {
            "ns" => 1.0,
            "us" | "µs" | "μs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            _ => return None,
        };
        total += number.parse::<f64>().ok()? * nanos_per_unit;
        rest = after;
    }
    (total.is_finite() && total < u64::MAX as f64).then(|| Duration::from_nanos(total as u64))
}

/// Booleans as Go's `strconv.ParseBool` reads them, which is what the reference accepts.
fn parse_bool(value: &str, name: &str) -> Result<bool, SettingsError> {
    match value {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(false),
        _ => Err(SettingsError::invalid(
            name,
            value,
            "expected true or false",
        )),
    }
}

fn from_config_error(file: Option<&Path>, e: config::ConfigError) -> SettingsError {
    match file {
        Some(path) => SettingsError::File {
            path: path.to_owned(),
            reason: e.to_string(),
        },
        None => SettingsError::Source(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn defaults_serve_on_the_reference_ports_with_memory_and_local_rules() {
        let s = Settings::load(None, &env(&[])).unwrap();
        assert_eq!(s.grpc.addr("grpc").unwrap().to_string(), "0.0.0.0:8081");
        assert_eq!(s.http.addr("http").unwrap().to_string(), "0.0.0.0:8080");
        assert_eq!(s.backend(), BackendKind::Memory);
        assert_eq!(s.log.level, LogLevel::Warn);
        assert_eq!(s.rules.source().root, PathBuf::from("config"));
        assert!(!s.consume_on_deny);
    }

    #[test]
    fn precedence_is_defaults_then_file_then_prefixed_env_then_reference_env() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("s.yaml");
        std::fs::write(
            &file,
            "grpc:\n  port: 7000\nhttp:\n  port: 7001\nlog:\n  level: info\n",
        )
        .unwrap();
        let s = Settings::load(Some(&file), &env(&[])).unwrap();
        assert_eq!(
            (s.grpc.port, s.http.port, s.log.level),
            (7000, 7001, LogLevel::Info)
        );

        let s = Settings::load(
            Some(&file),
            &env(&[
                ("RATELIMITD_GRPC__PORT", "7100"),
                ("RATELIMITD_HTTP__PORT", "7101"),
            ]),
        )
        .unwrap();
        assert_eq!((s.grpc.port, s.http.port), (7100, 7101));

        let s = Settings::load(
            Some(&file),
            &env(&[("RATELIMITD_GRPC__PORT", "7100"), ("GRPC_PORT", "7200")]),
        )
        .unwrap();
        assert_eq!(s.grpc.port, 7200);
    }

    #[test]
    fn toml_files_are_read_too() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("s.toml");
        std::fs::write(&file, "shadow_mode = true\n[memory]\nmax_keys = 10\n").unwrap();
        let s = Settings::load(
            Some(&file),
            &env(&[("RATELIMITD_RULES__DEFAULT_ALGORITHM", "gcra")]),
        )
        .unwrap();
        assert!(s.shadow_mode);
        assert_eq!(s.memory.max_keys, 10);
        assert_eq!(s.rules.default_algorithm, Algorithm::Gcra);
        let err = Settings::load(
            None,
            &env(&[("RATELIMITD_RULES__DEFAULT_ALGORITHM", "leaky")]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("leaky") && err.contains("sliding_window"),
            "{err}"
        );
    }

    #[test]
    fn reference_env_vars_keep_their_meaning() {
        let s = Settings::load(
            None,
            &env(&[
                ("HOST", "127.0.0.1"),
                ("PORT", "9080"),
                ("LOG_LEVEL", "DEBUG"),
                ("LOG_FORMAT", "json"),
                ("SHADOW_MODE", "true"),
                ("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", "false"),
                ("LIMIT_RESPONSE_HEADERS_ENABLED", "true"),
                ("LIMIT_REMAINING_HEADER", "X-Left"),
                ("MERGE_DOMAIN_CONFIG", "1"),
                ("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED", "T"),
                ("NEAR_LIMIT_RATIO", "0.5"),
                ("BACKEND_TYPE", "memory"),
                ("REDIS_URL", "redis:6379"),
            ]),
        )
        .unwrap();
        assert_eq!(s.http.addr("http").unwrap().to_string(), "127.0.0.1:9080");
        assert_eq!(s.log.level, LogLevel::Debug);
        assert_eq!(s.log.format, LogFormat::Json);
        assert!(s.shadow_mode);
        assert!(s.consume_on_deny);
        assert_eq!(s.response_headers, ResponseHeaders::Envoy);
        assert_eq!(s.header_names.remaining, "X-Left");
        assert!(s.rules.merge_domains);
        assert!(s.healthy_with_at_least_one_config_loaded);
        assert_eq!(s.near_limit_ratio, 0.5);
        assert_eq!(
            s.backend(),
            BackendKind::Memory,
            "BACKEND_TYPE wins over REDIS_URL"
        );
    }

    #[test]
    fn redis_settings_from_the_reference_variables() {
        let s = Settings::load(
            None,
            &env(&[
                ("REDIS_URL", "mymaster,10.0.0.1:26379,10.0.0.2:26379"),
                ("REDIS_TYPE", "SENTINEL"),
                ("REDIS_AUTH", "app:s3cret"),
                ("REDIS_SENTINEL_AUTH", "sentinel-pw"),
                ("REDIS_POOL_SIZE", "4"),
                ("REDIS_TIMEOUT", "25ms"),
                ("CACHE_KEY_PREFIX", "svc:"),
                ("EXPIRATION_JITTER_MAX_SECONDS", "0"),
                ("RATELIMITD_ON_BACKEND_ERROR", "allow"),
                ("RATELIMITD_HASH_SECRET", "hmac-secret-value"),
            ]),
        )
        .unwrap();
        assert_eq!(s.backend(), BackendKind::Redis, "a Redis URL selects redis");
        assert_eq!(s.redis.topology, RedisTopology::Sentinel);
        assert_eq!(s.redis.auth.0, "app:s3cret");
        assert_eq!(s.redis.sentinel_auth.0, "sentinel-pw");
        assert_eq!(
            (s.redis.pool_size, s.redis.timeout),
            (4, Duration::from_millis(25))
        );
        assert_eq!(s.cache_key_prefix, "svc:");
        assert_eq!(s.expiration_jitter_max_seconds, 0);
        assert_eq!(s.on_backend_error, OnBackendError::Allow);
        let shown = format!("{s:?}");
        assert!(
            !shown.contains("s3cret") && !shown.contains("sentinel-pw"),
            "the passwords never show: {shown}"
        );

        // The reference's variables alone are enough: without a secret, values are hashed unkeyed.
        let s = Settings::load(None, &env(&[("REDIS_URL", "h:1")])).unwrap();
        assert_eq!(
            (s.backend(), s.hash_secret.0.as_str(), s.hashed_keys.len()),
            (BackendKind::Redis, "", 3)
        );
        let s = Settings::load(
            None,
            &env(&[
                ("REDIS_URL", "h:1"),
                ("RATELIMITD_HASHED_KEYS", "token,session"),
                ("RATELIMITD_HASH_SECRET", "k"),
            ]),
        )
        .unwrap();
        assert_eq!(s.hashed_keys, vec!["token", "session"]);
        let err = Settings::load(None, &env(&[("BACKEND_TYPE", "redis")])).unwrap_err();
        assert!(err.to_string().contains("REDIS_URL"), "{err}");
        let err = Settings::load(None, &env(&[("REDIS_URL", "h:1"), ("REDIS_TYPE", "ring")]))
            .unwrap_err();
        assert!(
            err.to_string().contains("REDIS_TYPE") && err.to_string().contains("ring"),
            "{err}"
        );
    }

    #[test]
    fn connection_age_from_the_reference_variables_and_the_settings_file() {
        let s = Settings::load(None, &env(&[])).unwrap();
        assert_eq!(
            (s.grpc.max_connection_age, s.grpc.max_connection_age_grace),
            (Duration::from_secs(24 * 3600), Duration::from_secs(3600)),
            "the reference's defaults"
        );
        let s = Settings::load(
            None,
            &env(&[
                ("GRPC_MAX_CONNECTION_AGE", "1h30m"),
                ("GRPC_MAX_CONNECTION_AGE_GRACE", "0"),
            ]),
        )
        .unwrap();
        assert_eq!(
            (s.grpc.max_connection_age, s.grpc.max_connection_age_grace),
            (Duration::from_secs(5400), Duration::ZERO)
        );
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("s.yaml");
        std::fs::write(
            &file,
            "grpc:\n  port: 7000\n  max_connection_age: 10m\n  max_connection_age_grace: 30s\n",
        )
        .unwrap();
        let s = Settings::load(Some(&file), &env(&[])).unwrap();
        assert_eq!(s.grpc.port, 7000);
        assert_eq!(
            (s.grpc.max_connection_age, s.grpc.max_connection_age_grace),
            (Duration::from_secs(600), Duration::from_secs(30))
        );
        let err = Settings::load(None, &env(&[("GRPC_MAX_CONNECTION_AGE", "a day")]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("GRPC_MAX_CONNECTION_AGE") && err.contains("a day"),
            "{err}"
        );
    }

    #[test]
    fn listener_bounds_have_defaults_are_set_by_name_and_refuse_zero() {
        let s = Settings::load(None, &env(&[])).unwrap();
        assert_eq!(
            (
                s.grpc.handshake_timeout,
                s.grpc.idle_timeout,
                s.grpc.keepalive_interval,
                s.grpc.keepalive_timeout
            ),
            (
                Duration::from_secs(10),
                Duration::from_secs(300),
                Duration::from_secs(60),
                Duration::from_secs(20)
            )
        );
        assert_eq!(
            (
                s.http.max_connections,
                s.http.header_read_timeout,
                s.http.request_timeout,
                s.http.idle_timeout
            ),
            (
                256,
                Duration::from_secs(10),
                Duration::from_secs(10),
                Duration::from_secs(30)
            )
        );
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("s.yaml");
        std::fs::write(
            &file,
            "http:\n  max_connections: 64\n  header_read_timeout: 2s\ngrpc:\n  idle_timeout: 1m\n",
        )
        .unwrap();
        let s = Settings::load(
            Some(&file),
            &env(&[
                ("PORT", "9000"),
                ("RATELIMITD_GRPC__HANDSHAKE_TIMEOUT", "3s"),
            ]),
        )
        .unwrap();
        assert_eq!(
            (
                s.http.port,
                s.http.max_connections,
                s.http.header_read_timeout
            ),
            (9000, 64, Duration::from_secs(2))
        );
        assert_eq!(s.http.host, "0.0.0.0", "unnamed fields keep their default");
        assert_eq!(
            (s.grpc.idle_timeout, s.grpc.handshake_timeout),
            (Duration::from_secs(60), Duration::from_secs(3))
        );
        for (variable, name, zero) in [
            (
                "RATELIMITD_HTTP__MAX_CONNECTIONS",
                "http.max_connections",
                "0",
            ),
            (
                "RATELIMITD_HTTP__HEADER_READ_TIMEOUT",
                "http.header_read_timeout",
                "0s",
            ),
            (
                "RATELIMITD_HTTP__REQUEST_TIMEOUT",
                "http.request_timeout",
                "0s",
            ),
            ("RATELIMITD_HTTP__IDLE_TIMEOUT", "http.idle_timeout", "0s"),
            (
                "RATELIMITD_GRPC__HANDSHAKE_TIMEOUT",
                "grpc.handshake_timeout",
                "0s",
            ),
            ("RATELIMITD_GRPC__IDLE_TIMEOUT", "grpc.idle_timeout", "0s"),
            (
                "RATELIMITD_GRPC__KEEPALIVE_INTERVAL",
                "grpc.keepalive_interval",
                "0s",
            ),
            (
                "RATELIMITD_GRPC__KEEPALIVE_TIMEOUT",
                "grpc.keepalive_timeout",
                "0s",
            ),
        ] {
            let err = Settings::load(None, &env(&[(variable, zero)]))
                .unwrap_err()
                .to_string();
            assert!(err.contains(name), "{variable}: {err}");
        }
    }

    #[test]
    fn a_per_second_redis_from_the_reference_variables_or_our_own() {
        let s = Settings::load(
            None,
            &env(&[
                ("REDIS_URL", "main:6379"),
                ("REDIS_TLS_CACERT", "/etc/ca.pem"),
                ("REDIS_PERSECOND", "true"),
                ("REDIS_PERSECOND_URL", "fast:6379"),
                ("REDIS_PERSECOND_TYPE", "cluster"),
                ("REDIS_PERSECOND_POOL_SIZE", "3"),
                ("REDIS_PERSECOND_AUTH", "u:p"),
                ("REDIS_PERSECOND_TIMEOUT", "50ms"),
            ]),
        )
        .unwrap();
        let per_second = s.redis_per_second.as_ref().expect("configured");
        assert_eq!(
            (
                per_second.url.as_str(),
                per_second.topology,
                per_second.pool_size,
                per_second.auth.0.as_str(),
                per_second.timeout,
            ),
            (
                "fast:6379",
                RedisTopology::Cluster,
                3,
                "u:p",
                Duration::from_millis(50)
            )
        );
        assert_eq!(
            per_second.tls_ca_cert.as_deref(),
            Some(Path::new("/etc/ca.pem")),
            "TLS files are shared"
        );
        assert_eq!(s.redis.url, "main:6379");
        assert!(Settings::load(
            None,
            &env(&[("REDIS_URL", "m:1"), ("REDIS_PERSECOND", "true")])
        )
        .unwrap_err()
        .to_string()
        .contains("REDIS_PERSECOND_URL"));
        let s = Settings::load(
            None,
            &env(&[
                ("REDIS_URL", "m:1"),
                ("RATELIMITD_REDIS_PER_SECOND__URL", "fast:1"),
            ]),
        )
        .unwrap();
        assert_eq!(s.redis_per_second.map(|r| r.url).as_deref(), Some("fast:1"));
        assert!(s.warnings.is_empty(), "{:?}", s.warnings);
    }

    #[test]
    fn the_local_fallback_and_the_waits_for_redis() {
        let s = Settings::load(None, &env(&[("REDIS_URL", "m:1")])).unwrap();
        assert_eq!(
            (
                s.redis.timeout,
                s.redis.unresponsive_after,
                s.on_backend_error
            ),
            (
                Duration::from_secs(1),
                Duration::from_millis(300),
                OnBackendError::Error
            )
        );
        let s = Settings::load(
            None,
            &env(&[
                ("REDIS_URL", "m:1"),
                ("RATELIMITD_ON_BACKEND_ERROR", "local"),
                ("RATELIMITD_FALLBACK__REPLICAS", "3"),
                ("RATELIMITD_REDIS__UNRESPONSIVE_AFTER", "150ms"),
            ]),
        )
        .unwrap();
        assert_eq!(
            (
                s.on_backend_error,
                s.fallback.replicas,
                s.redis.unresponsive_after
            ),
            (OnBackendError::Local, 3, Duration::from_millis(150))
        );
        let err = Settings::load(None, &env(&[("RATELIMITD_FALLBACK__REPLICAS", "0")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("fallback.replicas"), "{err}");
    }

    #[test]
    fn runtime_layouts_resolve_like_the_reference() {
        let s = Settings::load(
            None,
            &env(&[
                ("RUNTIME_ROOT", "/srv/data"),
                ("RUNTIME_SUBDIRECTORY", "ratelimit"),
            ]),
        )
        .unwrap();
        let src = s.rules.source();
        assert_eq!(src.root, PathBuf::from("/srv/data/ratelimit"));
        assert_eq!(src.key_prefix.as_deref(), Some("config."));

        let s = Settings::load(
            None,
            &env(&[
                ("RUNTIME_ROOT", "/srv/data"),
                ("RUNTIME_SUBDIRECTORY", "ratelimit"),
                ("RUNTIME_APPDIRECTORY", "rules"),
                ("RUNTIME_WATCH_ROOT", "false"),
                ("RUNTIME_IGNOREDOTFILES", "true"),
            ]),
        )
        .unwrap();
        let src = s.rules.source();
        assert_eq!(src.root, PathBuf::from("/srv/data/ratelimit/rules"));
        assert_eq!(src.key_prefix, None);
        assert!(src.ignore_dotfiles);
    }

    #[test]
    fn a_wrong_setting_names_the_setting_and_the_value() {
        for (name, value) in [
            ("GRPC_PORT", "80800"),
            ("PORT", "http"),
            ("LOG_LEVEL", "loud"),
            ("LOG_FORMAT", "xml"),
            ("SHADOW_MODE", "yes please"),
            ("BACKEND_TYPE", "memcache"),
            ("NEAR_LIMIT_RATIO", "1.5"),
            ("HOST", "my host"),
        ] {
            let err = Settings::load(None, &env(&[(name, value)]))
                .unwrap_err()
                .to_string();
            assert!(err.contains(value), "{name}: {err}");
        }
        let err = Settings::load(None, &env(&[("GRPC_PORT", "80800")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("GRPC_PORT"), "{err}");
        let err = Settings::load(None, &env(&[("RATELIMITD_MEMORY__MAX_KEYS", "lots")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("max_keys") && err.contains("lots"), "{err}");
    }

    #[test]
    fn unknown_prefixed_variables_are_a_warning_and_known_ones_still_apply() {
        let s = Settings::load(
            None,
            &env(&[
                // Kubernetes service links for a Service named ratelimitd.
                ("RATELIMITD_PORT", "tcp://10.0.0.1:8081"),
                ("RATELIMITD_PORT_8081_TCP_ADDR", "10.0.0.1"),
                ("RATELIMITD_SERVICE_HOST", "10.0.0.1"),
                ("RATELIMITD_SERVICE_PORT", "8081"),
                // A typo, whose value may be a secret.
                ("RATELIMITD_HASH_SECRETT", "typed-secret"),
                ("RATELIMITD_GRPC__PROT", "1"),
                ("RATELIMITD_MEMORY__MAX_KEYS", "10"),
                ("RATELIMITD_HASH_SECRET", "s"),
            ]),
        )
        .unwrap();
        assert_eq!((s.memory.max_keys, s.hash_secret.0.as_str()), (10, "s"));
        assert_eq!(s.grpc.port, 8081);
        assert_eq!(s.warnings.len(), 1, "one warning: {:?}", s.warnings);
        let warning = &s.warnings[0];
        assert!(
            warning.contains("RATELIMITD_GRPC__PROT, RATELIMITD_HASH_SECRETT, RATELIMITD_PORT, RATELIMITD_PORT_8081_TCP_ADDR, RATELIMITD_SERVICE_HOST, RATELIMITD_SERVICE_PORT"),
            "{warning}"
        );
        assert!(
            !warning.contains("typed-secret"),
            "values are not shown: {warning}"
        );
        assert!(Settings::load(None, &env(&[])).unwrap().warnings.is_empty());

        // A known setting with a bad value still stops the start, naming it.
        let err = Settings::load(
            None,
            &env(&[
                ("RATELIMITD_PORT", "tcp://10.0.0.1:8081"),
                ("RATELIMITD_MEMORY__MAX_KEYS", "lots"),
            ]),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("max_keys") && err.contains("lots"), "{err}");
    }

    #[test]
    fn reference_durations_read_as_go_reads_them() {
        for (text, want) in [
            ("10s", Duration::from_secs(10)),
            ("300ms", Duration::from_millis(300)),
            ("1.5h", Duration::from_secs(5400)),
            ("2h45m", Duration::from_secs(9900)),
            ("1m30.5s", Duration::from_millis(90_500)),
            ("250us", Duration::from_micros(250)),
            ("0", Duration::ZERO),
            ("1m 30s", Duration::from_secs(90)),
        ] {
            assert_eq!(parse_duration(text, "X").unwrap(), want, "{text}");
        }
        for bad in ["", "10", "-1s", "1x", "h", "1.2.3s", ".s"] {
            let err = parse_duration(bad, "REDIS_TIMEOUT")
                .unwrap_err()
                .to_string();
            assert!(err.contains("REDIS_TIMEOUT"), "{bad}: {err}");
        }
        let s = Settings::load(
            None,
            &env(&[("REDIS_URL", "h:1"), ("REDIS_TIMEOUT", "1.5s")]),
        )
        .unwrap();
        assert_eq!(s.redis.timeout, Duration::from_millis(1500));
    }

    #[test]
    fn a_broken_settings_file_is_reported_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("s.yaml");
        std::fs::write(&file, "grpc:\n  prot: 1\n").unwrap();
        let err = Settings::load(Some(&file), &env(&[]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("s.yaml") && err.contains("prot"), "{err}");
        // Unknown keys in the file stay errors, unlike unknown variables: the file is ratelimitd's own.
        std::fs::write(&file, "port: 8081\n").unwrap();
        let err = Settings::load(Some(&file), &env(&[]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("s.yaml") && err.contains("port"), "{err}");
        let err = Settings::load(Some(&dir.path().join("missing.yaml")), &env(&[]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing.yaml"), "{err}");
    }
}
