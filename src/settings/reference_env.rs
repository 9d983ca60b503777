//! The environment variables of the reference service (envoyproxy/ratelimit), with their exact names and
//! meanings, so that an existing Deployment can switch image. They win over every other source.
//!
//! One row per variable: its name, how its raw value is read, and what it sets. Values are read as the
//! reference (Go) reads them: booleans as `strconv.ParseBool`, durations as `time.ParseDuration`. A value
//! that does not parse is an error naming the variable and the value.

use std::{
    collections::{BTreeMap, HashMap},
    path::PathBuf,
    str::FromStr,
    time::Duration,
};

use serde::de::{value::StrDeserializer, DeserializeOwned};

use super::{Settings, SettingsError, LOCAL_CACHE_ENTRY_BYTES};
use crate::{
    limiter::ResponseHeaders,
    store::redis::{RedisSettings, Secret},
    telemetry::LogLevel,
};

/// Sets the value of one variable on `T`; an error is the reason, which the caller completes with the
/// variable's name and value.
type Setter<T> = fn(&mut T, &str) -> Result<(), String>;

/// How a variable's raw value is read.
#[derive(Debug, Clone, Copy)]
enum Read {
    /// Trimmed; unset when empty (most variables).
    Trim,
    /// Trimmed; empty is a value (a folder name that may be empty).
    TrimKeepEmpty,
    /// As written, spaces and all; empty is a value (a key prefix).
    Exact,
    /// As written, spaces and all; unset when empty (passwords).
    ExactNonEmpty,
}

/// One variable and what its value sets.
struct Variable<T: 'static> {
    name: &'static str,
    read: Read,
    set: Setter<T>,
}

/// A row of [`REFERENCE`].
enum Row {
    /// A variable of its own.
    One(Variable<Settings>),
    /// The main Redis client's variables: `REDIS_` and each name of [`REDIS_CLIENT`].
    MainRedis,
    /// `REDIS_PERSECOND`: with `true`, a second Redis for limits whose unit is SECOND, configured by
    /// `REDIS_PERSECOND_` and each name of [`REDIS_CLIENT`]; with `false`, none.
    PerSecondRedis,
}

/// `variable!(NAME, read, |target, value| assignment)`: a [`Variable`] whose assignment may use `?` on
/// the parsers below.
macro_rules! variable {
    ($name:literal, $read:ident, |$s:ident, $v:ident| $set:expr) => {
        Variable {
            name: $name,
            read: Read::$read,
            set: |$s, $v| {
                $set;
                Ok(())
            },
        }
    };
}

/// `row!(NAME, read, |settings, value| assignment)`: a [`Row::One`].
macro_rules! row {
    ($($variable:tt)*) => {
        Row::One(variable!($($variable)*))
    };
}

/// Every reference variable, applied in this order (the first bad value is the one reported).
#[rustfmt::skip]
const REFERENCE: &[Row] = &[
    row!("HOST", Trim, |s, v| s.http.host = v.to_owned()),
    row!("PORT", Trim, |s, v| s.http.port = number(v)?),
    row!("GRPC_HOST", Trim, |s, v| s.grpc.host = v.to_owned()),
    row!("GRPC_PORT", Trim, |s, v| if let Some(port) = port(s, "GRPC_PORT", v)? { s.grpc.port = port }),
    row!("GRPC_UDS", Trim, |_s, v| unix_socket(v)?),
    // No debug listener: a Deployment that sets its port is told where its pages are.
    row!("DEBUG_PORT", Trim, |s, v| if let Some(port) = port(s, "DEBUG_PORT", v)? {
        s.warnings.push(format!(
            "DEBUG_PORT={port} is not served: ratelimitd has no debug listener; /rlconfig and /metrics are on the HTTP port (PORT)"
        ))
    }),
    row!("LOG_LEVEL", Trim, |s, v| s.log.level = log_level(v)?),
    // The reference writes JSON for `json` and text for anything else.
    row!("LOG_FORMAT", Trim, |s, v| s.log.format = match choice(v) {
        Ok(format) => format,
        Err(_) => {
            s.warnings.push(format!("LOG_FORMAT={v} is not json: logs are text, as the reference writes them"));
            crate::telemetry::LogFormat::Text
        }
    }),
    row!("RUNTIME_ROOT", Trim, |s, v| s.rules.runtime_root = Some(PathBuf::from(v))),
    row!("RUNTIME_SUBDIRECTORY", TrimKeepEmpty, |s, v| s.rules.runtime_subdirectory = v.to_owned()),
    row!("RUNTIME_APPDIRECTORY", Trim, |s, v| s.rules.runtime_appdirectory = v.to_owned()),
    row!("RUNTIME_WATCH_ROOT", Trim, |s, v| s.rules.runtime_watch_root = boolean(v)?),
    row!("RUNTIME_IGNOREDOTFILES", Trim, |s, v| s.rules.ignore_dotfiles = boolean(v)?),
    row!("MERGE_DOMAIN_CONFIG", Trim, |s, v| s.rules.merge_domains = boolean(v)?),
    row!("BACKEND_TYPE", Trim, |s, v| s.backend = Some(choice(v)?)),
    Row::MainRedis,
    // Set nothing: connections are checked and retried as `redis.*` says. The values must still read.
    row!("REDIS_HEALTH_CHECK_ACTIVE_CONNECTION", Trim, |_s, v| boolean(v)?),
    row!("REDIS_STARTUP_INITIAL_INTERVAL", Trim, |_s, v| duration(v)?),
    row!("REDIS_STARTUP_MAX_INTERVAL", Trim, |_s, v| duration(v)?),
    row!("REDIS_STARTUP_MAX_ELAPSED_TIME", Trim, |_s, v| duration(v)?),
    row!("REDIS_TLS_CACERT", Trim, |s, v| s.redis.tls_ca_cert = Some(PathBuf::from(v))),
    row!("REDIS_TLS_CLIENT_CERT", Trim, |s, v| s.redis.tls_client_cert = Some(PathBuf::from(v))),
    row!("REDIS_TLS_CLIENT_KEY", Trim, |s, v| s.redis.tls_client_key = Some(PathBuf::from(v))),
    row!("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", Trim,
        |s, v| s.redis.tls_skip_hostname_verification = boolean(v)?),
    row!("GRPC_SERVER_USE_TLS", Trim, |s, v| s.grpc_tls.enabled = boolean(v)?),
    row!("GRPC_SERVER_TLS_CERT", Trim, |s, v| s.grpc_tls.cert = PathBuf::from(v)),
    row!("GRPC_SERVER_TLS_KEY", Trim, |s, v| s.grpc_tls.key = PathBuf::from(v)),
    row!("GRPC_CLIENT_TLS_CACERT", Trim, |s, v| s.grpc_tls.client_ca = Some(PathBuf::from(v))),
    row!("GRPC_CLIENT_TLS_SAN", Trim, |s, v| s.grpc_tls.client_san = Some(v.to_owned())),
    row!("GRPC_MAX_CONNECTION_AGE", Trim, |s, v| s.grpc.max_connection_age = duration(v)?),
    row!("GRPC_MAX_CONNECTION_AGE_GRACE", Trim,
        |s, v| s.grpc.max_connection_age_grace = duration(v)?),
    Row::PerSecondRedis,
    row!("CACHE_KEY_PREFIX", Exact, |s, v| s.cache_key_prefix = v.to_owned()),
    row!("EXPIRATION_JITTER_MAX_SECONDS", Trim, |s, v| s.expiration_jitter_max_seconds = number(v)?),
    row!("SHADOW_MODE", Trim, |s, v| s.shadow_mode = boolean(v)?),
    row!("QUOTA_MODE", Trim, |s, v| s.quota_mode = boolean(v)?),
    row!("RESPONSE_DYNAMIC_METADATA", Trim, |s, v| if boolean(v)? {
        s.warnings.push(
            "RESPONSE_DYNAMIC_METADATA=true is not supported: responses carry no dynamic_metadata".into(),
        );
    }),
    // The reference counts every descriptor of a denied request unless told to stop.
    row!("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", Trim, |s, v| s.consume_on_deny = Some(!boolean(v)?)),
    row!("LIMIT_RESPONSE_HEADERS_ENABLED", Trim, |s, v| s.response_headers = if boolean(v)? {
        ResponseHeaders::Envoy
    } else {
        ResponseHeaders::Off
    }),
    row!("LIMIT_LIMIT_HEADER", Trim, |s, v| s.header_names.limit = v.to_owned()),
    row!("LIMIT_REMAINING_HEADER", Trim, |s, v| s.header_names.remaining = v.to_owned()),
    row!("LIMIT_RESET_HEADER", Trim, |s, v| s.header_names.reset = v.to_owned()),
    row!("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED", Trim,
        |s, v| s.healthy_with_at_least_one_config_loaded = boolean(v)?),
    // A size in bytes; the deny cache counts entries.
    row!("LOCAL_CACHE_SIZE_IN_BYTES", Trim,
        |s, v| s.local_cache_max_entries = number::<usize>(v)? / LOCAL_CACHE_ENTRY_BYTES),
    row!("TRACING_ENABLED", Trim, |s, v| s.tracing.enabled = boolean(v)?),
    row!("TRACING_SERVICE_NAME", Trim, |s, v| s.tracing.service_name = v.to_owned()),
    row!("TRACING_SAMPLING_RATE", Trim, |s, v| s.tracing.sampling_rate = number(v)?),
    row!("TRACING_SERVICE_NAMESPACE", Trim, |s, v| s.tracing.service_namespace = Some(v.to_owned())),
    row!("TRACING_SERVICE_INSTANCE_ID", Trim, |s, v| s.tracing.service_instance_id = Some(v.to_owned())),
    // Sets nothing: with traces on, only the one protocol ratelimitd speaks is accepted.
    row!("TRACING_EXPORTER_PROTOCOL", Trim, |s, v| otlp_protocol(v, s.tracing.enabled)?),
    row!("USE_PROMETHEUS", Trim, |s, v| s.prometheus.enabled = boolean(v)?),
    row!("PROMETHEUS_ADDR", Trim, |s, v| s.prometheus.addr = v.to_owned()),
    row!("PROMETHEUS_PATH", Trim, |s, v| s.prometheus.path = v.to_owned()),
    // Sets nothing: ratelimitd's histograms are in seconds, under names of its own.
    row!("PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS", Trim, |_s, v| boolean(v)?),
    row!("NEAR_LIMIT_RATIO", Trim, |s, v| s.near_limit_ratio = number(v)?),
    row!("CONFIG_TYPE", Trim, |s, v| s.rules.config_type = choice(v)?),
    row!("FORCE_START_WITHOUT_INITIAL_CONFIG", Trim,
        |s, v| s.xds.force_start_without_initial_config = boolean(v)?),
    row!("CONFIG_GRPC_XDS_SERVER_URL", Trim, |s, v| s.xds.server_url = v.to_owned()),
    row!("CONFIG_GRPC_XDS_NODE_ID", Trim, |s, v| s.xds.node_id = v.to_owned()),
    row!("CONFIG_GRPC_XDS_NODE_METADATA", Trim, |s, v| s.xds.node_metadata = pairs(v, '=')?),
    row!("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS", Trim,
        |s, v| s.xds.additional_headers =
            pairs(v, ':')?.into_iter().map(|(k, v)| (k, Secret(v))).collect()),
    // Sets nothing: reconnects wait as XDS_CLIENT_BACKOFF_* says. The value must still be a duration.
    row!("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL", Trim, |_s, v| duration(v)?),
    row!("CONFIG_GRPC_XDS_SERVER_USE_TLS", Trim, |s, v| s.xds.tls = boolean(v)?),
    row!("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", Trim, |s, v| s.xds.client_cert = Some(PathBuf::from(v))),
    row!("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", Trim, |s, v| s.xds.client_key = Some(PathBuf::from(v))),
    row!("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", Trim, |s, v| s.xds.server_ca = Some(PathBuf::from(v))),
    row!("CONFIG_GRPC_XDS_SERVER_TLS_SAN", Trim, |s, v| s.xds.server_san = Some(v.to_owned())),
    row!("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", Trim, |s, v| s.xds.backoff.initial = duration(v)?),
    row!("XDS_CLIENT_BACKOFF_MAX_INTERVAL", Trim, |s, v| s.xds.backoff.max = duration(v)?),
    row!("XDS_CLIENT_BACKOFF_RANDOM_FACTOR", Trim, |s, v| s.xds.backoff.random_factor = number(v)?),
    row!("XDS_CLIENT_BACKOFF_JITTER", Trim, |s, v| s.xds.backoff.jitter = boolean(v)?),
    row!("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", Trim, |s, v| s.xds.max_message_bytes = number(v)?),
    row!("USE_STATSD", Trim, |s, v| s.statsd.enabled = boolean(v)?),
    row!("STATSD_HOST", Trim, |s, v| s.statsd.host = v.to_owned()),
    row!("STATSD_PORT", Trim, |s, v| if let Some(port) = port(s, "STATSD_PORT", v)? { s.statsd.port = port }),
    // lyft/gostats' own variable, which the reference's statsd sink reads.
    row!("STATSD_PROTOCOL", Trim, |s, v| s.statsd.protocol = Some(choice(v)?)),
    // DogStatsD is a way of writing the statsd stream: asking for it turns the stream on.
    row!("USE_DOG_STATSD", Trim, |s, v| if boolean(v)? {
        s.statsd.enabled = true;
        s.statsd.dogstatsd = true;
    }),
    row!("USE_DOG_STATSD_MOGRIFIERS", Trim, |s, v| s.warnings.push(format!(
        "USE_DOG_STATSD_MOGRIFIERS={v:?} is not supported: DogStatsD stats keep the reference's plain names, with EXTRA_TAGS as tags"
    ))),
    row!("EXTRA_TAGS", Trim, |s, v| s.statsd.extra_tags = pairs(v, ':')?),
    row!("STATS_FLUSH_INTERVAL", Trim, |s, v| s.statsd.flush_interval = duration(v)?),
    // After USE_STATSD and USE_DOG_STATSD: it wins over both.
    row!("DISABLE_STATS", Trim, |s, v| if boolean(v)? {
        s.statsd.enabled = false;
    }),
];

/// The variables of one Redis client, each named after a prefix: `REDIS_` for the main client,
/// `REDIS_PERSECOND_` for the per-second one.
#[rustfmt::skip]
const REDIS_CLIENT: &[Variable<RedisSettings>] = &[
    variable!("URL", Trim, |r, v| r.url = v.to_owned()),
    variable!("TYPE", Trim, |r, v| r.topology = choice(v)?),
    variable!("SOCKET_TYPE", Trim, |r, v| r.socket_type = Some(choice(v)?)),
    variable!("AUTH", ExactNonEmpty, |r, v| r.auth = Secret(v.to_owned())),
    variable!("SENTINEL_AUTH", ExactNonEmpty, |r, v| r.sentinel_auth = Secret(v.to_owned())),
    variable!("TLS", Trim, |r, v| r.tls = boolean(v)?),
    variable!("POOL_SIZE", Trim, |r, v| r.pool_size = number(v)?),
    variable!("TIMEOUT", Trim, |r, v| r.timeout = duration(v)?),
    // Set nothing: requests share script calls as `redis.*` says. The values must still read.
    variable!("PIPELINE_WINDOW", Trim, |_r, v| duration(v)?),
    variable!("PIPELINE_LIMIT", Trim, |_r, v| number::<u64>(v)?),
    variable!("CLUSTER_PIPELINE_PARALLELISM", Trim, |_r, v| number::<u64>(v)?),
    variable!("POOL_ON_EMPTY_BEHAVIOR", Trim, |_r, v| wait_only(v)?),
];

/// Applies the reference variables set in `env` to `settings`.
pub(super) fn apply(
    settings: &mut Settings,
    env: &HashMap<String, String>,
) -> Result<(), SettingsError> {
    for row in REFERENCE {
        match row {
            Row::One(variable) => variable.apply(settings, "", env)?,
            Row::MainRedis => apply_redis_client(&mut settings.redis, "REDIS_", env)?,
            Row::PerSecondRedis => apply_per_second_redis(settings, env)?,
        }
    }
    if let Some(warning) = http_traces(settings, env) {
        settings.warnings.push(warning);
    }
    Ok(())
}

/// Traces turned on the reference's way, likely meant for OTLP/HTTP, which ratelimitd does not speak:
/// no `TRACING_EXPORTER_PROTOCOL` (the reference's default is `http`) and an endpoint not on a
/// collector's gRPC port (4317), or an OpenTelemetry protocol variable saying `http/...`. Said once, at
/// start: such an endpoint never answers ratelimitd's gRPC.
fn http_traces(settings: &Settings, env: &HashMap<String, String>) -> Option<String> {
    let var = |name| read(env, name, Read::Trim);
    if var("TRACING_ENABLED").is_none()
        || !settings.tracing.enabled
        || var("TRACING_EXPORTER_PROTOCOL").is_some()
    {
        return None;
    }
    let endpoint = settings
        .tracing
        .resolved_endpoint(|name| read(env, name, Read::Trim).map(str::to_owned));
    let protocol =
        var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL").or_else(|| var("OTEL_EXPORTER_OTLP_PROTOCOL"));
    let http = match protocol {
        Some(protocol) => protocol.starts_with("http"),
        None => !endpoint.trim_end_matches('/').ends_with(":4317"),
    };
    http.then(|| format!(
        "traces go to {endpoint} over OTLP/gRPC, the only protocol ratelimitd exports with, where the reference would speak OTLP/HTTP ({}): point the endpoint at the collector's gRPC port (4317), and set TRACING_EXPORTER_PROTOCOL=grpc",
        protocol.map_or_else(|| "TRACING_EXPORTER_PROTOCOL is not set".to_owned(), |p| format!("the OpenTelemetry protocol is {p}"))
    ))
}

impl<T> Variable<T> {
    /// Sets what the variable `prefix` + `name` says, if `env` holds it.
    fn apply(
        &self,
        target: &mut T,
        prefix: &str,
        env: &HashMap<String, String>,
    ) -> Result<(), SettingsError> {
        let name = format!("{prefix}{}", self.name);
        match read(env, &name, self.read) {
            Some(value) => (self.set)(target, value)
                .map_err(|reason| SettingsError::invalid(&name, value, reason)),
            None => Ok(()),
        }
    }
}

fn read<'a>(env: &'a HashMap<String, String>, name: &str, how: Read) -> Option<&'a str> {
    let raw = env.get(name)?.as_str();
    match how {
        Read::Trim => Some(raw.trim()).filter(|v| !v.is_empty()),
        Read::TrimKeepEmpty => Some(raw.trim()),
        Read::Exact => Some(raw),
        Read::ExactNonEmpty => Some(raw).filter(|v| !v.is_empty()),
    }
}

fn apply_redis_client(
    redis: &mut RedisSettings,
    prefix: &str,
    env: &HashMap<String, String>,
) -> Result<(), SettingsError> {
    REDIS_CLIENT
        .iter()
        .try_for_each(|variable| variable.apply(redis, prefix, env))
}

fn apply_per_second_redis(
    settings: &mut Settings,
    env: &HashMap<String, String>,
) -> Result<(), SettingsError> {
    const NAME: &str = "REDIS_PERSECOND";
    let Some(value) = read(env, NAME, Read::Trim) else {
        return Ok(());
    };
    if !boolean(value).map_err(|reason| SettingsError::invalid(NAME, value, reason))? {
        settings.redis_per_second = None;
        return Ok(());
    }
    let main = &settings.redis;
    let per_second = settings
        .redis_per_second
        .get_or_insert_with(|| RedisSettings {
            // TLS files are shared with the main Redis, as in the reference.
            tls_ca_cert: main.tls_ca_cert.clone(),
            tls_client_cert: main.tls_client_cert.clone(),
            tls_client_key: main.tls_client_key.clone(),
            tls_skip_hostname_verification: main.tls_skip_hostname_verification,
            ..RedisSettings::default()
        });
    apply_redis_client(per_second, "REDIS_PERSECOND_", env)
}

/// A port; `None` for the address Kubernetes gives every pod of a namespace for each Service in it
/// (`<SERVICE>_PORT=tcp://10.0.0.7:8125`, with service links on, the default): a Service named `statsd`
/// or `grpc` beside ratelimitd is no reason to stop its start. Ignored, with a warning.
fn port(s: &mut Settings, name: &str, value: &str) -> Result<Option<u16>, String> {
    if ["tcp://", "udp://", "sctp://"]
        .iter()
        .any(|scheme| value.starts_with(scheme))
    {
        s.warnings.push(format!(
            "{name}={value} is ignored: it is the address Kubernetes gives every pod for a Service named {}, not a port (set enableServiceLinks: false on the pod to leave it out)",
            name.trim_end_matches("_PORT").to_lowercase()
        ));
        return Ok(None);
    }
    number(value).map(Some)
}

fn number<T: FromStr>(value: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    value.parse().map_err(|e: T::Err| e.to_string())
}

/// Booleans as Go's `strconv.ParseBool` reads them, which is what the reference accepts.
fn boolean(value: &str) -> Result<bool, String> {
    match value {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(false),
        _ => Err("expected true or false".into()),
    }
}

/// One of the values of `T` in any case, spelled as serde spells its variants (lower case), so that
/// the accepted values are the settings file's; a wrong one lists them.
fn choice<T: DeserializeOwned>(value: &str) -> Result<T, String> {
    let lower = value.to_ascii_lowercase();
    T::deserialize(StrDeserializer::<ChoiceError>::new(&lower)).map_err(|e| e.0)
}

/// Why [`choice`] refused a value: the variants it expected, when that is what went wrong.
#[derive(Debug)]
struct ChoiceError(String);

impl std::fmt::Display for ChoiceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ChoiceError {}

impl serde::de::Error for ChoiceError {
    fn custom<M: std::fmt::Display>(msg: M) -> Self {
        Self(msg.to_string())
    }

    fn unknown_variant(_: &str, expected: &'static [&'static str]) -> Self {
        Self(match expected {
            [] => "expected nothing".into(),
            [only] => format!("expected {only}"),
            [first @ .., last] => format!("expected {} or {last}", first.join(", ")),
        })
    }
}

/// A log level as the reference (logrus) names them, in any case: `warning` is `warn`, and `fatal` and
/// `panic`, which ratelimitd never logs at, are `error`.
fn log_level(value: &str) -> Result<LogLevel, String> {
    let lower = value.to_ascii_lowercase();
    let level = match lower.as_str() {
        "warning" => "warn",
        "fatal" | "panic" => "error",
        other => other,
    };
    choice(level).map_err(|_| "expected one of trace, debug, info, warn, error".into())
}

/// A duration as Go's `time.ParseDuration` reads it (`300ms`, `1.5h`, `2h45m`, `0`), which is what the
/// reference accepts; also the forms of the settings file (`250ms`, `1m 30s`).
fn duration(value: &str) -> Result<Duration, String> {
    go_duration(value)
        .or_else(|| humantime::parse_duration(value).ok())
        .ok_or_else(|| "expected a duration such as 500ms, 10s, 1.5h or 2h45m".to_owned())
        .and_then(crate::duration::at_most_longest)
}

/// Go's duration syntax: a sequence of decimal numbers, each with a unit (`ns`, `us`, `µs`, `ms`, `s`,
/// `m`, `h`); or `0`. Negative durations mean nothing here and are refused.
fn go_duration(text: &str) -> Option<Duration> {
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

/// A map as the reference reads one: `k<sep>v` pairs separated by commas (`k1:v1,k2:v2`; node metadata
/// uses `=`). Spaces around items are ignored; an item without the separator or without a key is an
/// error, not silently dropped.
fn pairs(value: &str, separator: char) -> Result<BTreeMap<String, String>, String> {
    value
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| match item.split_once(separator) {
            Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.trim().to_owned())),
            _ => Err(format!(
                "expected key{separator}value pairs separated by commas, found {item:?}"
            )),
        })
        .collect()
}

/// `TRACING_EXPORTER_PROTOCOL`: the reference also speaks OTLP/HTTP (its default); ratelimitd does not,
/// which matters only when traces are on.
fn otlp_protocol(value: &str, tracing: bool) -> Result<(), String> {
    match value.to_ascii_lowercase().as_str() {
        "grpc" => Ok(()),
        "http" if !tracing => Ok(()),
        "http" => Err(
            "ratelimitd exports traces over OTLP/gRPC only; set grpc (port 4317 of the collector)"
                .into(),
        ),
        _ => Err("expected grpc or http".into()),
    }
}

/// `GRPC_UDS`: the reference can serve gRPC on a unix socket instead of its port; ratelimitd cannot, and
/// serving on the port instead would leave Envoys pointed at the socket without an answer.
fn unix_socket(_path: &str) -> Result<(), String> {
    Err("ratelimitd serves gRPC on GRPC_HOST:GRPC_PORT only, not on a unix socket; unset GRPC_UDS and point Envoy at the port".into())
}

/// `REDIS_POOL_ON_EMPTY_BEHAVIOR`: the reference takes only `WAIT` (and refuses to start otherwise).
fn wait_only(value: &str) -> Result<(), String> {
    if value.eq_ignore_ascii_case("wait") {
        Ok(())
    } else {
        Err("expected WAIT, the only behaviour the reference takes".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{settings::BackendKind, store::redis::RedisTopology, telemetry::LogFormat};

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
            assert_eq!(duration(text).unwrap(), want, "{text}");
        }
        for bad in ["", "10", "-1s", "1x", "h", "1.2.3s", ".s"] {
            assert!(duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn choices_accept_any_case_and_list_the_values_when_wrong() {
        assert_eq!(choice::<LogFormat>("JSON"), Ok(LogFormat::Json));
        assert_eq!(choice::<BackendKind>("Noop"), Ok(BackendKind::Noop));
        assert_eq!(
            choice::<RedisTopology>("SENTINEL"),
            Ok(RedisTopology::Sentinel)
        );
        for (error, want) in [
            (
                choice::<LogFormat>("xml").unwrap_err(),
                "expected text or json",
            ),
            (
                choice::<BackendKind>("memcache").unwrap_err(),
                "expected memory, redis or noop",
            ),
            (
                choice::<crate::limiter::OnBackendError>("retry").unwrap_err(),
                "expected error, allow, deny or local",
            ),
            (
                choice::<RedisTopology>("ring").unwrap_err(),
                "expected single, sentinel or cluster",
            ),
            (
                choice::<crate::store::redis::SocketType>("udp").unwrap_err(),
                "expected tcp or unix",
            ),
        ] {
            assert_eq!(error, want);
        }
        assert_eq!(log_level("Warning"), Ok(LogLevel::Warn));
        assert_eq!(log_level("FATAL"), Ok(LogLevel::Error));
        assert_eq!(
            log_level("loud").unwrap_err(),
            "expected one of trace, debug, info, warn, error"
        );
    }

    #[test]
    fn every_variable_is_named_once() {
        let mut names: Vec<String> = REFERENCE
            .iter()
            .flat_map(|row| match row {
                Row::One(variable) => vec![variable.name.to_owned()],
                Row::MainRedis => REDIS_CLIENT
                    .iter()
                    .map(|v| format!("REDIS_{}", v.name))
                    .collect(),
                Row::PerSecondRedis => std::iter::once("REDIS_PERSECOND".to_owned())
                    .chain(
                        REDIS_CLIENT
                            .iter()
                            .map(|v| format!("REDIS_PERSECOND_{}", v.name)),
                    )
                    .collect(),
            })
            .collect();
        let count = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), count, "a variable has two rows");
    }
}
