//! What types alone cannot check, checked once after the sources are merged and before any port is bound:
//! values that must be above zero, settings that need one another, addresses that must parse, and the
//! files that TLS, Redis and the xDS client will read. Each error names the setting (by the name its user most likely
//! set: the reference variable when there is one, else the settings key).

use std::time::Duration;

use super::{BackendKind, ConfigType, RedisSettings, Settings, SettingsError};
use crate::api::{admin::Token, tls::TlsError, xds::XdsError};

impl Settings {
    /// Checks what types alone cannot, reading nothing.
    pub(super) fn validate(&self) -> Result<(), SettingsError> {
        if self.backend() == BackendKind::Redis {
            self.validate_redis()?;
        }
        at_least_one("fallback.replicas", self.fallback.replicas as usize)?;
        self.grpc.addr("grpc.host (GRPC_HOST)")?;
        self.http.addr("http.host (HOST)")?;
        self.validate_grpc_tls()?;
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
        self.validate_prometheus()?;
        self.validate_admin()?;
        // A message that arrives in pieces is held whole before it is read: a bound below the largest
        // a call may send would refuse every such message, however often it is sent again.
        let (largest, named) = if self.rlqs.enabled
            && self.rlqs.max_message_bytes > self.request_limits.max_message_bytes
        {
            (self.rlqs.max_message_bytes, "rlqs.max_message_bytes")
        } else {
            (
                self.request_limits.max_message_bytes,
                "request_limits.max_message_bytes",
            )
        };
        if self.grpc.max_held_bytes < largest.saturating_add(5) {
            return Err(SettingsError::invalid(
                "grpc.max_held_bytes",
                self.grpc.max_held_bytes,
                format!("must hold the largest message a call may send ({largest} bytes, {named}) and its 5-byte prefix"),
            ));
        }
        // 0 as the reference reads it: every hit is near the limit.
        if !(0.0..=1.0).contains(&self.near_limit_ratio) {
            return Err(SettingsError::invalid(
                "near_limit_ratio (NEAR_LIMIT_RATIO)",
                self.near_limit_ratio,
                "must be between 0 and 1",
            ));
        }
        if !(0.0..=1.0).contains(&self.tracing.sampling_rate) {
            return Err(SettingsError::invalid(
                "TRACING_SAMPLING_RATE",
                self.tracing.sampling_rate,
                "must be between 0 and 1",
            ));
        }
        self.validate_statsd()?;
        at_least_one("memory.max_keys", self.memory.max_keys)?;
        at_least_one("runtime_limits.max_limits", self.runtime_limits.max_limits)?;
        longer_than_zero(
            "runtime_limits.refresh_interval",
            self.runtime_limits.refresh_interval,
        )?;
        longer_than_zero("memory.sweep_interval", self.memory.sweep_interval)?;
        self.validate_bounds()?;
        self.validate_rlqs()?;
        self.validate_header_names()
    }

    /// The rate limit quota service: bounds above zero, and a TTL Envoy can read (whole seconds) that
    /// outlives two report periods, so that an assignment does not lapse between reports.
    fn validate_rlqs(&self) -> Result<(), SettingsError> {
        let rlqs = &self.rlqs;
        for (name, value) in [
            ("rlqs.max_streams", rlqs.max_streams),
            ("rlqs.max_buckets_per_stream", rlqs.max_buckets_per_stream),
            ("rlqs.max_buckets", rlqs.max_buckets),
            ("rlqs.max_envoys_per_bucket", rlqs.max_envoys_per_bucket),
            ("rlqs.max_message_bytes", rlqs.max_message_bytes),
        ] {
            at_least_one(name, value)?;
        }
        longer_than_zero("rlqs.report_period", rlqs.report_period)?;
        at_most("rlqs.report_period", rlqs.report_period, MAX_REPORT_PERIOD)?;
        let ttl = rlqs.assignment_ttl;
        at_most("rlqs.assignment_ttl", ttl, MAX_ASSIGNMENT_TTL)?;
        let shown = humantime::format_duration(ttl);
        if ttl.subsec_nanos() != 0 || ttl.is_zero() {
            return Err(SettingsError::invalid(
                "rlqs.assignment_ttl",
                shown,
                "must be a whole number of seconds, at least 1s (Envoy reads only the seconds)",
            ));
        }
        if ttl < rlqs.report_period.saturating_mul(2) {
            return Err(SettingsError::invalid(
                "rlqs.assignment_ttl",
                shown,
                format!(
                    "must be at least two report periods (rlqs.report_period is {})",
                    humantime::format_duration(rlqs.report_period)
                ),
            ));
        }
        Ok(())
    }

    /// Opens what the settings name, without connecting or binding: the gRPC TLS files must read, parse
    /// and go together, and the Redis addresses (and Redis TLS files) must make a client configuration.
    /// Run after [`Settings::validate`].
    pub(super) fn check_files_and_addresses(&self) -> Result<(), SettingsError> {
        if self.grpc_tls.enabled {
            self.grpc_tls.check().map_err(|e| {
                SettingsError::Unusable(match e {
                    TlsError::File(file) => format!("invalid setting {file}"),
                    TlsError::Config(reason) => {
                        format!("invalid gRPC TLS settings (GRPC_SERVER_USE_TLS): {reason}")
                    }
                })
            })?;
        }
        if self.rules.config_type == ConfigType::GrpcXdsSotw {
            self.xds.check().map_err(|e| match e {
                XdsError::Setting {
                    name,
                    value,
                    reason,
                } => SettingsError::invalid(name, value, reason),
                other => SettingsError::Unusable(other.to_string()),
            })?;
        }
        if self.admin.enabled {
            Token::from_settings(&self.admin)
                .map_err(|e| SettingsError::Unusable(e.to_string()))?;
            if self.admin.tls.enabled {
                self.admin.tls.files().check().map_err(|e| {
                    SettingsError::Unusable(match e {
                        TlsError::File(file) => format!("invalid setting {file}"),
                        TlsError::Config(reason) => {
                            format!("invalid admin TLS settings (admin.tls): {reason}")
                        }
                    })
                })?;
            }
        }
        if self.backend() == BackendKind::Redis {
            self.redis
                .check()
                .map_err(|e| SettingsError::Unusable(e.to_string()))?;
            if let Some(per_second) = &self.redis_per_second {
                // The messages name the main Redis's variables; the per-second one has its own
                // address, kind and socket type (REDIS_PERSECOND_*) and shares the TLS files.
                per_second.check().map_err(|e| {
                    let text =
                        ["URL", "TYPE", "SOCKET_TYPE"]
                            .iter()
                            .fold(e.to_string(), |text, name| {
                                text.replace(
                                    &format!("REDIS_{name}"),
                                    &format!("REDIS_PERSECOND_{name}"),
                                )
                            });
                    SettingsError::Unusable(format!("{text} (the per-second Redis)"))
                })?;
            }
        }
        Ok(())
    }

    fn validate_redis(&self) -> Result<(), SettingsError> {
        if self.redis.url.trim().is_empty() {
            return Err(SettingsError::invalid(
                "REDIS_URL",
                "",
                "the redis backend needs a Redis address",
            ));
        }
        validate_one_redis(&self.redis, "REDIS", "redis")?;
        if let Some(per_second) = &self.redis_per_second {
            if per_second.url.trim().is_empty() {
                return Err(SettingsError::invalid(
                    "REDIS_PERSECOND_URL",
                    "",
                    "REDIS_PERSECOND=true needs the per-second Redis address",
                ));
            }
            validate_one_redis(per_second, "REDIS_PERSECOND", "redis_per_second")?;
        }
        Ok(())
    }

    fn validate_grpc_tls(&self) -> Result<(), SettingsError> {
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
            // Set in the settings file: the reference's variable is left unread (see
            // `Settings::load`).
            return Err(SettingsError::invalid(
                "grpc_tls.client_ca",
                ca.display(),
                "client certificates need TLS (grpc_tls.enabled, GRPC_SERVER_USE_TLS=true)",
            ));
        } else if tls.client_san.is_none() {
            return Ok(());
        }
        if let (Some(san), None) = (&tls.client_san, &tls.client_ca) {
            return Err(SettingsError::invalid(
                "GRPC_CLIENT_TLS_SAN",
                san,
                "a required client SAN needs GRPC_CLIENT_TLS_CACERT (client certificates)",
            ));
        }
        if let Some(san) = &tls.client_san {
            // Checked against each client certificate as a name it is valid for: one that is no DNS
            // name or IP address would refuse every client.
            if rustls::pki_types::ServerName::try_from(san.as_str()).is_err() {
                return Err(SettingsError::invalid(
                    "GRPC_CLIENT_TLS_SAN",
                    san,
                    "not a DNS name or an IP address, which a client certificate could be valid for",
                ));
            }
        }
        Ok(())
    }

    fn validate_statsd(&self) -> Result<(), SettingsError> {
        let statsd = &self.statsd;
        if !statsd.enabled {
            return Ok(());
        }
        if statsd.host.trim().is_empty() {
            return Err(SettingsError::invalid(
                "STATSD_HOST",
                "",
                "USE_STATSD=true needs the statsd server's host",
            ));
        }
        if statsd.port == 0 {
            return Err(SettingsError::invalid(
                "STATSD_PORT",
                0,
                "must be a port number",
            ));
        }
        longer_than_zero("STATS_FLUSH_INTERVAL", statsd.flush_interval)
    }

    fn validate_admin(&self) -> Result<(), SettingsError> {
        let admin = &self.admin;
        if !admin.enabled {
            return Ok(());
        }
        self.admin_addr()?;
        at_least_one("admin.max_connections", admin.max_connections)?;
        at_least_one("admin.max_body_bytes", admin.max_body_bytes)?;
        let tls = &admin.tls;
        if tls.enabled {
            for (name, path) in [("admin.tls.cert", &tls.cert), ("admin.tls.key", &tls.key)] {
                if path.as_os_str().is_empty() {
                    return Err(SettingsError::invalid(
                        name,
                        "",
                        "admin.tls.enabled needs a certificate and its key",
                    ));
                }
            }
        } else if let Some(ca) = &tls.client_ca {
            return Err(SettingsError::invalid(
                "admin.tls.client_ca",
                ca.display(),
                "client certificates need admin.tls.enabled",
            ));
        }
        Ok(())
    }

    /// The operators' API's socket address.
    pub fn admin_addr(&self) -> Result<std::net::SocketAddr, SettingsError> {
        let ip: std::net::IpAddr = self.admin.host.parse().map_err(|_| {
            SettingsError::invalid("admin.host", &self.admin.host, "not an IP address")
        })?;
        Ok(std::net::SocketAddr::new(ip, self.admin.port))
    }

    fn validate_prometheus(&self) -> Result<(), SettingsError> {
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
        Ok(())
    }

    /// The bounds on requests, connections and waits: none may be zero.
    fn validate_bounds(&self) -> Result<(), SettingsError> {
        let limits = &self.request_limits;
        for (name, value) in [
            ("request_limits.max_descriptors", limits.max_descriptors),
            ("request_limits.max_entries", limits.max_entries),
            ("request_limits.max_key_bytes", limits.max_key_bytes),
            ("request_limits.max_value_bytes", limits.max_value_bytes),
            ("request_limits.max_message_bytes", limits.max_message_bytes),
            ("grpc.max_held_bytes", self.grpc.max_held_bytes),
            ("overload.max_connections", self.overload.max_connections),
            (
                "overload.max_streams_per_connection",
                self.overload.max_streams_per_connection as usize,
            ),
            ("overload.max_in_flight", self.overload.max_in_flight),
            ("rules.max_yaml_nodes", self.rules.max_yaml_nodes),
            ("http.max_connections", self.http.max_connections),
        ] {
            at_least_one(name, value)?;
        }
        for (name, value) in [
            ("overload.deadline", self.overload.deadline),
            ("grpc.handshake_timeout", self.grpc.handshake_timeout),
            ("grpc.idle_timeout", self.grpc.idle_timeout),
            ("grpc.message_timeout", self.grpc.message_timeout),
            ("grpc.keepalive_interval", self.grpc.keepalive_interval),
            ("grpc.keepalive_timeout", self.grpc.keepalive_timeout),
            ("http.header_read_timeout", self.http.header_read_timeout),
            ("http.request_timeout", self.http.request_timeout),
            ("http.idle_timeout", self.http.idle_timeout),
        ] {
            longer_than_zero(name, value)?;
        }
        Ok(())
    }

    /// The names of the headers `envoy` mode sends, when it sends them (headers off, the reference
    /// never reads them either).
    fn validate_header_names(&self) -> Result<(), SettingsError> {
        if self.response_headers != super::ResponseHeaders::Envoy {
            return Ok(());
        }
        for (name, value) in [
            (
                "header_names.limit (LIMIT_LIMIT_HEADER)",
                &self.header_names.limit,
            ),
            (
                "header_names.remaining (LIMIT_REMAINING_HEADER)",
                &self.header_names.remaining,
            ),
            (
                "header_names.reset (LIMIT_RESET_HEADER)",
                &self.header_names.reset,
            ),
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

/// The longest `rlqs.report_period`: a stream is closed after ten silent periods, and Envoy's is 5 s.
const MAX_REPORT_PERIOD: Duration = Duration::from_secs(60);

/// The longest `rlqs.assignment_ttl`: a share held by a vanished Envoy comes back only after it.
const MAX_ASSIGNMENT_TTL: Duration = Duration::from_secs(3_600);

fn at_most(name: &str, value: Duration, most: Duration) -> Result<(), SettingsError> {
    if value > most {
        return Err(SettingsError::invalid(
            name,
            humantime::format_duration(value),
            format!("must be at most {}", humantime::format_duration(most)),
        ));
    }
    Ok(())
}

/// The numbers of one Redis deployment (the main one or the per-second one), named by their
/// environment variable (`env`) or settings-file section (`file`).
fn validate_one_redis(redis: &RedisSettings, env: &str, file: &str) -> Result<(), SettingsError> {
    at_least_one(&format!("{env}_POOL_SIZE"), redis.pool_size)?;
    at_least_one(&format!("{file}.calls_in_flight"), redis.calls_in_flight)?;
    at_least_one(
        &format!("{file}.batch_max_requests"),
        redis.batch_max_requests,
    )?;
    at_least_one(&format!("{file}.batch_max_bytes"), redis.batch_max_bytes)?;
    longer_than_zero(&format!("{env}_TIMEOUT"), redis.timeout)?;
    longer_than_zero(
        &format!("{file}.unresponsive_after"),
        redis.unresponsive_after,
    )?;
    if redis.lease_after > 0 {
        longer_than_zero(&format!("{file}.lease_for"), redis.lease_for)?;
    }
    at_least_one(
        &format!("{file}.breaker_failures"),
        redis.breaker_failures as usize,
    )
}

fn at_least_one(name: &str, value: usize) -> Result<(), SettingsError> {
    if value == 0 {
        return Err(SettingsError::invalid(name, 0, "must be at least 1"));
    }
    Ok(())
}

fn longer_than_zero(name: &str, value: Duration) -> Result<(), SettingsError> {
    if value.is_zero() {
        return Err(SettingsError::invalid(
            name,
            "0s",
            "must be longer than zero",
        ));
    }
    Ok(())
}
