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

mod listeners;
mod reference_env;
#[cfg(test)]
mod tests;
mod validate;

use std::{
    collections::{HashMap, HashSet},
    fmt,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::{Deserialize, Serialize};

// Each layer owns its options; the process settings gather them, and these re-exports keep one place to
// name them all.
pub use crate::{
    api::{
        admin::{AdminSettings, AdminTlsSettings},
        tls::GrpcTlsSettings,
        xds::{BackoffSettings, XdsSettings},
    },
    limiter::{
        FallbackSettings, HeaderNames, OnBackendError, OverloadSettings, RequestLimits,
        ResponseHeaders, RuntimeLimitsSettings,
    },
    quota::RlqsSettings,
    rules::{ConfigType, RulesSettings, Source as RulesSource, DEFAULT_MAX_YAML_NODES},
    store::redis::{RedisSettings, RedisTopology, Secret, SocketType},
    telemetry::{
        LogFormat, LogLevel, LogSettings, MetricsSettings, StatsdProtocol, StatsdSettings,
        TopOffendersSettings, TracingSettings,
    },
};
pub use listeners::{GrpcSettings, HttpSettings, PrometheusSettings, ShutdownSettings};

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
    /// A file or an address that a setting names cannot be used; the message names the setting.
    #[error("{0}")]
    Unusable(String),
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
    /// Where the rules come from (files or a control plane) and how files are read.
    pub rules: RulesSettings,
    /// The xDS control plane the rules come from with `CONFIG_TYPE=GRPC_XDS_SOTW`.
    pub xds: XdsSettings,
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
    /// Every limited descriptor is a quota descriptor, as a rule's `quota_mode: true` makes its own: a
    /// request is denied only when all of them are over, and not at all when one of its descriptors
    /// matched no limit. Env `QUOTA_MODE`; default false.
    pub quota_mode: bool,
    /// Count every descriptor of a denied request, as the reference service does by default. Unset: a
    /// denied request consumes nothing, but with rules over xDS, which carry no `count_over_limit` (see
    /// [`Settings::consumes_on_deny`]). Env `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT`, inverted.
    pub consume_on_deny: Option<bool>,
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
    /// The statsd (or DogStatsD) stream of the reference's stat names, beside Prometheus.
    pub statsd: StatsdSettings,
    /// The rate limit quota service (RLQS) on the gRPC port: report period, assignment TTL, bounds.
    pub rlqs: RlqsSettings,
    /// Secret of the HMAC-SHA256 that hashes sensitive values. Env `RATELIMITD_HASH_SECRET`; set it to the
    /// same value on every replica. Unset: values are hashed with unkeyed SHA-256 (still never stored raw,
    /// the same on every replica and restart, but a guessed value can be confirmed from the keys).
    pub hash_secret: Secret,
    /// The runtime limits operators set through the operators' API: how often each replica reads them,
    /// and how many there may be.
    pub runtime_limits: RuntimeLimitsSettings,
    /// The operators' API: off unless enabled, on a listener of its own, every call with a bearer token.
    pub admin: AdminSettings,
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
            xds: XdsSettings::default(),
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
            quota_mode: false,
            consume_on_deny: None,
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
            statsd: StatsdSettings::default(),
            rlqs: RlqsSettings::default(),
            hashed_keys: vec!["api_key".into(), "authorization".into(), "x-api-key".into()],
            hash_secret: Secret::default(),
            runtime_limits: RuntimeLimitsSettings::default(),
            admin: AdminSettings::default(),
            warnings: Vec::new(),
        }
    }
}

/// Where counters live.
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

/// The embedded memory store.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemorySettings {
    /// Most counters held at once (default 1 000 000, about 100 bytes each); a counter whose key is longer
    /// than 1 KiB counts once per started KiB of it. When the bound is reached and
    /// no expired counter can be reclaimed, requests needing a new counter fail with UNAVAILABLE
    /// ("memory store full") rather than evicting live counters, so no count is ever lost silently.
    pub max_keys: usize,
    /// How often expired windows are reclaimed (default `5s`).
    #[serde(with = "crate::duration")]
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

/// Bytes one local deny cache entry is counted for when sizing it from `LOCAL_CACHE_SIZE_IN_BYTES`.
pub const LOCAL_CACHE_ENTRY_BYTES: usize = 256;

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
        let (mut prefixed, unknown) = prefixed_env(env)?;
        // Names are matched as the config crate matches them: in any case.
        let hashed_keys = prefixed
            .keys()
            .find(|name| name.eq_ignore_ascii_case(HASHED_KEYS_VAR))
            .cloned()
            .and_then(|name| prefixed.remove(&name));
        // Values stay text: a token, a password or a prefix made of digits is not a number to the
        // settings it goes to (`0001` stays `0001`); numbers and booleans are read from text anyway.
        builder = builder.add_source(
            config::Environment::with_prefix("RATELIMITD")
                .prefix_separator("_")
                .separator("__")
                .source(Some(prefixed)),
        );
        let merged = builder.build().map_err(|e| from_config_error(file, e))?;
        let mut settings: Settings = merged
            .try_deserialize()
            .map_err(|e| from_config_error(file, e))?;
        if let Some(list) = hashed_keys {
            settings.hashed_keys = list_items(&list);
        }
        reference_env::apply(&mut settings, env)?;
        settings.ignore_client_certificates_without_tls(env);
        settings.validate()?;
        settings.check_files_and_addresses()?;
        if !unknown.is_empty() {
            // Names only: a mistyped variable may well hold a secret.
            settings.warnings.push(format!(
                "ignoring environment variables that name no ratelimitd setting: {} (Kubernetes sets RATELIMITD_* service links in every pod of a namespace with a Service named ratelimitd)",
                unknown.join(", ")
            ));
        }
        Ok(settings)
    }

    /// Client certificates are asked for over TLS only: with `GRPC_SERVER_USE_TLS` off, the reference's
    /// `GRPC_CLIENT_TLS_CACERT` and `GRPC_CLIENT_TLS_SAN` are left unread, as the reference leaves them,
    /// and a warning says so. Set otherwise (the settings file), they still stop the start.
    fn ignore_client_certificates_without_tls(&mut self, env: &HashMap<String, String>) {
        let tls = &mut self.grpc_tls;
        let reference = ["GRPC_CLIENT_TLS_CACERT", "GRPC_CLIENT_TLS_SAN"]
            .iter()
            .any(|name| env.contains_key(*name));
        if tls.enabled || !reference {
            return;
        }
        tls.client_ca = None;
        tls.client_san = None;
        self.warnings.push(
            "GRPC_CLIENT_TLS_CACERT and GRPC_CLIENT_TLS_SAN are ignored: client certificates are asked for over TLS only, and GRPC_SERVER_USE_TLS is not true".into(),
        );
    }

    /// Whether a denied request consumes its descriptors' counters: as set, else only when the rules
    /// come over xDS. An Envoy Gateway route that reports a cost after its response (a token count from
    /// dynamic metadata) needs each report counted in full even when it takes the counter past its
    /// limit; a rules file says so with `count_over_limit`, which xDS cannot carry, so such a deployment
    /// counts as the reference does by default, and a budget runs out.
    pub fn consumes_on_deny(&self) -> bool {
        self.consume_on_deny
            .unwrap_or(self.rules.config_type == ConfigType::GrpcXdsSotw)
    }

    /// The backend in use: the configured one, else `redis` when a Redis URL is set, else `memory`.
    pub fn backend(&self) -> BackendKind {
        self.backend.unwrap_or(if self.redis.url.is_empty() {
            BackendKind::Memory
        } else {
            BackendKind::Redis
        })
    }
}

/// The variable of the `hashed_keys` list: its items are separated by commas.
const HASHED_KEYS_VAR: &str = "RATELIMITD_HASHED_KEYS";

/// The items of a comma-separated list, each without the spaces around it; empty ones are no items
/// (`a, b` is `a` and `b`; an empty value is an empty list).
fn list_items(list: &str) -> Vec<String> {
    list.split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(str::to_owned)
        .collect()
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
fn setting_keys() -> Result<HashSet<String>, SettingsError> {
    fn walk(prefix: &str, value: &serde_json::Value, keys: &mut HashSet<String>) {
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
    let mut keys = HashSet::new();
    walk("", &defaults, &mut keys);
    Ok(keys)
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
