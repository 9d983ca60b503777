//! Assembling the settings: the sources and their precedence, the reference variables, validation,
//! and the messages a wrong setting gets.

use super::*;
use crate::algorithm::Algorithm;

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
    assert!(!s.consumes_on_deny());
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

/// A duration too long to add to the clock is refused at the start, named, in every spelling.
#[test]
fn durations_longer_than_a_century_are_refused() {
    for (name, value, named) in [
        ("REDIS_TIMEOUT", "10000000000000000000s", "REDIS_TIMEOUT"),
        ("RATELIMITD_OVERLOAD__DEADLINE", "300000000000y", "deadline"),
        (
            "RATELIMITD_REDIS__BREAKER_OPEN_FOR",
            "101years",
            "breaker_open_for",
        ),
    ] {
        let err = Settings::load(None, &env(&[(name, value)]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("100 years") && err.contains(named),
            "{name}: {err}"
        );
    }
    let s = Settings::load(
        None,
        &env(&[("RATELIMITD_REDIS__BREAKER_OPEN_FOR", "99years")]),
    );
    assert!(s.is_ok(), "{s:?}");
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
            ("QUOTA_MODE", "t"),
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
    assert!(s.quota_mode);
    assert!(s.consumes_on_deny());
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
    let err =
        Settings::load(None, &env(&[("REDIS_URL", "h:1"), ("REDIS_TYPE", "ring")])).unwrap_err();
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
            s.grpc.message_timeout,
            s.grpc.keepalive_interval,
            s.grpc.keepalive_timeout
        ),
        (
            Duration::from_secs(10),
            Duration::from_secs(300),
            Duration::from_secs(10),
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
            "RATELIMITD_GRPC__MESSAGE_TIMEOUT",
            "grpc.message_timeout",
            "0s",
        ),
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
    // The per-second Redis is held to every check of the main one, each named as it is set.
    for (name, value, named) in [
        (
            "REDIS_PERSECOND_POOL_SIZE",
            "0",
            "REDIS_PERSECOND_POOL_SIZE",
        ),
        ("REDIS_PERSECOND_TIMEOUT", "0s", "REDIS_PERSECOND_TIMEOUT"),
        (
            "RATELIMITD_REDIS_PER_SECOND__UNRESPONSIVE_AFTER",
            "0s",
            "redis_per_second.unresponsive_after",
        ),
        (
            "RATELIMITD_REDIS_PER_SECOND__CALLS_IN_FLIGHT",
            "0",
            "redis_per_second.calls_in_flight",
        ),
    ] {
        let err = Settings::load(
            None,
            &env(&[
                ("REDIS_URL", "m:1"),
                ("REDIS_PERSECOND", "true"),
                ("REDIS_PERSECOND_URL", "fast:1"),
                (name, value),
            ]),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains(named), "{name}={value}: {err}");
    }
    // Its address is named as its own.
    let err = Settings::load(
        None,
        &env(&[
            ("REDIS_URL", "m:1"),
            ("REDIS_PERSECOND", "true"),
            ("REDIS_PERSECOND_URL", "fast:bad"),
        ]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("REDIS_PERSECOND_URL: bad port in \"fast:bad\""),
        "{err}"
    );
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

    // RUNTIME_SUBDIRECTORY alone: the reference's default root, swapped as a whole like any.
    let s = Settings::load(None, &env(&[("RUNTIME_SUBDIRECTORY", "ratelimit")])).unwrap();
    let src = s.rules.source();
    assert_eq!(
        src.root,
        PathBuf::from("/srv/runtime_data/current/ratelimit")
    );
    assert_eq!(src.key_prefix.as_deref(), Some("config."));
    assert_eq!(
        src.swap_point,
        Some(PathBuf::from("/srv/runtime_data/current"))
    );
}

#[test]
fn a_wrong_setting_names_the_setting_and_the_value() {
    for (name, value) in [
        ("GRPC_PORT", "80800"),
        ("PORT", "http"),
        ("LOG_LEVEL", "loud"),
        ("SHADOW_MODE", "yes please"),
        ("BACKEND_TYPE", "memcache"),
        ("NEAR_LIMIT_RATIO", "1.5"),
        ("HOST", "my host"),
        ("QUOTA_MODE", "maybe"),
        // Variables that set nothing here still take only what the reference takes.
        ("DEBUG_PORT", "abc"),
        ("REDIS_PIPELINE_WINDOW", "abc"),
        ("REDIS_PIPELINE_LIMIT", "-1"),
        ("REDIS_POOL_ON_EMPTY_BEHAVIOR", "CREATE"),
        ("REDIS_HEALTH_CHECK_ACTIVE_CONNECTION", "sometimes"),
        ("RESPONSE_DYNAMIC_METADATA", "yes"),
        ("TRACING_EXPORTER_PROTOCOL", "carrier-pigeon"),
        // Served elsewhere than the reference would: refused rather than ignored.
        ("GRPC_UDS", "/sockets/ratelimit.sock"),
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
    // Held bytes below the largest message would refuse every such message that arrives in pieces.
    let err = Settings::load(None, &env(&[("RATELIMITD_GRPC__MAX_HELD_BYTES", "100000")]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("grpc.max_held_bytes") && err.contains("rlqs.max_message_bytes"),
        "{err}"
    );
    let err = Settings::load(None, &env(&[("NEAR_LIMIT_RATIO", "2")]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("NEAR_LIMIT_RATIO"), "{err}");
    let err = Settings::load(None, &env(&[("GRPC_UDS", "/s/rl.sock")]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("GRPC_UDS") && err.contains("unix socket"),
        "{err}"
    );
    // The reference's defaults and usual values load, the ones that change nothing here with a warning
    // where a Deployment would miss something.
    let s = Settings::load(
        None,
        &env(&[
            ("NEAR_LIMIT_RATIO", "0"),
            ("TRACING_EXPORTER_PROTOCOL", "http"),
            ("DEBUG_HOST", "0.0.0.0"),
            ("DEBUG_PORT", "6070"),
            ("REDIS_PIPELINE_WINDOW", "150us"),
            ("REDIS_PIPELINE_LIMIT", "8"),
            ("REDIS_POOL_ON_EMPTY_BEHAVIOR", "WAIT"),
            ("RESPONSE_DYNAMIC_METADATA", "true"),
            ("PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS", "false"),
        ]),
    )
    .unwrap();
    assert_eq!(s.near_limit_ratio, 0.0);
    assert_eq!(s.warnings.len(), 2, "{:?}", s.warnings);
    assert!(
        s.warnings[0].contains("DEBUG_PORT=6070"),
        "{:?}",
        s.warnings
    );
    assert!(
        s.warnings[1].contains("RESPONSE_DYNAMIC_METADATA"),
        "{:?}",
        s.warnings
    );
    // With traces on, OTLP/HTTP is refused: ratelimitd would send gRPC to an HTTP collector.
    let err = Settings::load(
        None,
        &env(&[
            ("TRACING_ENABLED", "true"),
            ("TRACING_EXPORTER_PROTOCOL", "http"),
        ]),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("OTLP/gRPC only"), "{err}");
    // Traces on with no protocol, where the reference would speak OTLP/HTTP: said at start.
    let warned = |pairs: &[(&str, &str)]| {
        let s = Settings::load(None, &env(pairs)).unwrap();
        s.warnings.iter().any(|w| w.contains("over OTLP/gRPC"))
    };
    assert!(warned(&[
        ("TRACING_ENABLED", "true"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://otel:4318")
    ]));
    assert!(warned(&[
        ("TRACING_ENABLED", "true"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://otel:4317"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    ]));
    assert!(!warned(&[
        ("TRACING_ENABLED", "true"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://otel:4317")
    ]));
    assert!(!warned(&[
        ("TRACING_ENABLED", "true"),
        ("RATELIMITD_TRACING__ENDPOINT", "http://otel:4317")
    ]));
    assert!(!warned(&[
        ("TRACING_ENABLED", "true"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://otel:14317")
    ]));
    let s = Settings::load(
        None,
        &env(&[
            ("TRACING_ENABLED", "true"),
            ("TRACING_EXPORTER_PROTOCOL", "grpc"),
        ]),
    )
    .unwrap();
    assert!(s.warnings.is_empty(), "{:?}", s.warnings);
    // Header names are checked when headers are sent, and named by their reference variable.
    assert!(Settings::load(None, &env(&[("LIMIT_RESET_HEADER", "Reset Time")])).is_ok());
    let err = Settings::load(
        None,
        &env(&[
            ("LIMIT_RESPONSE_HEADERS_ENABLED", "true"),
            ("LIMIT_RESET_HEADER", "Reset Time"),
        ]),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("LIMIT_RESET_HEADER"), "{err}");
    // Logs are JSON for json and text for anything else, as the reference writes them.
    let s = Settings::load(None, &env(&[("LOG_FORMAT", "console")])).unwrap();
    assert_eq!(s.log.format, crate::telemetry::LogFormat::Text);
    assert!(
        s.warnings[0].contains("LOG_FORMAT=console"),
        "{:?}",
        s.warnings
    );
    // Host names bind where they resolve, as the reference binds them.
    let s = Settings::load(
        None,
        &env(&[
            ("HOST", "localhost"),
            ("GRPC_HOST", "127.0.0.1"),
            ("USE_PROMETHEUS", "true"),
            ("PROMETHEUS_ADDR", "localhost:9091"),
        ]),
    )
    .unwrap();
    assert_eq!(s.http.addr("HOST").unwrap().to_string(), "127.0.0.1:8080");
    assert_eq!(
        s.prometheus.socket_addr().unwrap().to_string(),
        "127.0.0.1:9091"
    );
    let err = Settings::load(
        None,
        &env(&[("USE_PROMETHEUS", "true"), ("PROMETHEUS_ADDR", "localhost")]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("PROMETHEUS_ADDR") && err.contains(":<port>"),
        "{err}"
    );
    // A Service named statsd (or grpc) beside ratelimitd, with Kubernetes' service links: ignored.
    let s = Settings::load(
        None,
        &env(&[
            ("STATSD_PORT", "tcp://10.0.0.7:8125"),
            ("GRPC_PORT", "tcp://10.0.0.8:8081"),
        ]),
    )
    .unwrap();
    assert_eq!((s.statsd.port, s.grpc.port), (8125, 8081));
    assert_eq!(s.warnings.len(), 2, "{:?}", s.warnings);
    assert!(
        s.warnings[0].contains("GRPC_PORT=tcp://10.0.0.8:8081 is ignored")
            && s.warnings[0].contains("Service named grpc"),
        "{:?}",
        s.warnings
    );
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

#[test]
fn files_and_addresses_are_checked_before_any_port_is_bound() {
    let dir = tempfile::tempdir().unwrap();
    let cert = dir.path().join("server.pem");
    let key = dir.path().join("server.key");
    std::fs::write(&cert, "-----BEGIN PRIVATE KEY-----\nk3y-mat3rial\n").unwrap();
    std::fs::write(&key, "whatever").unwrap();
    let err = Settings::load(
        None,
        &env(&[
            ("GRPC_SERVER_USE_TLS", "true"),
            ("GRPC_SERVER_TLS_CERT", cert.to_str().unwrap()),
            ("GRPC_SERVER_TLS_KEY", key.to_str().unwrap()),
        ]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("GRPC_SERVER_TLS_CERT") && !err.contains("k3y-mat3rial"),
        "{err}"
    );
    let err = Settings::load(
        None,
        &env(&[
            ("GRPC_SERVER_USE_TLS", "true"),
            ("GRPC_SERVER_TLS_CERT", "/nonexistent/server.pem"),
            ("GRPC_SERVER_TLS_KEY", key.to_str().unwrap()),
        ]),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("GRPC_SERVER_TLS_CERT"), "{err}");

    for (url, topology) in [
        ("h:port", "single"),
        ("mymaster", "sentinel"),
        (",", "cluster"),
    ] {
        let err = Settings::load(
            None,
            &env(&[
                ("BACKEND_TYPE", "redis"),
                ("REDIS_URL", url),
                ("REDIS_TYPE", topology),
            ]),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("REDIS_URL"), "{url}: {err}");
    }
    let err = Settings::load(
        None,
        &env(&[
            ("REDIS_URL", "main:6379"),
            ("REDIS_PERSECOND", "true"),
            ("REDIS_PERSECOND_URL", "fast:port"),
        ]),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("per-second"), "{err}");
}

#[test]
fn xds_settings_from_the_reference_variables() {
    let s = Settings::load(None, &env(&[])).unwrap();
    assert_eq!(s.rules.config_type, ConfigType::File);
    assert_eq!(s.xds, XdsSettings::default());
    assert_eq!(
        (s.xds.server_url.as_str(), s.xds.node_id.as_str()),
        ("localhost:18000", "default")
    );
    assert_eq!(
        s.xds.backoff,
        BackoffSettings {
            initial: Duration::from_secs(10),
            max: Duration::from_secs(60),
            random_factor: 0.5,
            jitter: true,
        }
    );
    let s = Settings::load(
        None,
        &env(&[
            ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
            ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
            ("CONFIG_GRPC_XDS_SERVER_URL", "envoy-gateway:18001"),
            ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
            ("CONFIG_GRPC_XDS_NODE_METADATA", "zone=a, team=edge"),
            (
                "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
                "authorization:Bearer t0k3n",
            ),
            ("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL", "5s"),
            ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "250ms"),
            ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "2s"),
            ("XDS_CLIENT_BACKOFF_RANDOM_FACTOR", "0.2"),
            ("XDS_CLIENT_BACKOFF_JITTER", "false"),
            ("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", "16777216"),
        ]),
    )
    .unwrap();
    assert_eq!(s.rules.config_type, ConfigType::GrpcXdsSotw);
    let x = &s.xds;
    assert!(x.force_start_without_initial_config);
    assert_eq!(
        (x.server_url.as_str(), x.node_id.as_str()),
        ("envoy-gateway:18001", "envoy-ratelimit")
    );
    assert_eq!(
        x.node_metadata,
        [("team".into(), "edge".into()), ("zone".into(), "a".into())].into()
    );
    assert_eq!(
        x.additional_headers,
        [("authorization".into(), Secret("Bearer t0k3n".into()))].into()
    );
    assert!(!format!("{x:?}").contains("t0k3n"), "{x:?}");
    assert_eq!(
        x.backoff,
        BackoffSettings {
            initial: Duration::from_millis(250),
            max: Duration::from_secs(2),
            random_factor: 0.2,
            jitter: false,
        }
    );
    assert_eq!(x.max_message_bytes(), 16 << 20);
    // Rules over xDS carry no count_over_limit: denied requests count, as the reference counts them,
    // unless told otherwise.
    assert!(s.consumes_on_deny());
    let xds = [
        ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
        ("CONFIG_GRPC_XDS_SERVER_URL", "envoy-gateway:18001"),
    ];
    for (stop, consumes) in [("true", false), ("false", true)] {
        let mut vars = xds.to_vec();
        vars.push(("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", stop));
        let s = Settings::load(None, &env(&vars)).unwrap();
        assert_eq!(s.consumes_on_deny(), consumes, "{stop}");
    }
    let mut vars = xds.to_vec();
    vars.push(("RATELIMITD_CONSUME_ON_DENY", "false"));
    assert!(!Settings::load(None, &env(&vars))
        .unwrap()
        .consumes_on_deny());

    for (name, value, says) in [
        ("CONFIG_TYPE", "CONSUL", "expected file or grpc_xds_sotw"),
        ("CONFIG_GRPC_XDS_SERVER_URL", "http://cp:18000", "host:port"),
        ("CONFIG_GRPC_XDS_NODE_METADATA", "zone:a", "key=value"),
        (
            "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
            "x y:z",
            "metadata name",
        ),
        (
            "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL",
            "3",
            "duration",
        ),
        (
            "XDS_CLIENT_BACKOFF_INITIAL_INTERVAL",
            "0",
            "longer than zero",
        ),
        ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "1s", "at least"),
        ("XDS_CLIENT_BACKOFF_RANDOM_FACTOR", "2", "between 0 and 1"),
        ("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", "-1", "invalid digit"),
        (
            "CONFIG_GRPC_XDS_CLIENT_TLS_CERT",
            "/tls/cert.pem",
            "go together",
        ),
    ] {
        let err = Settings::load(
            None,
            &env(&[("CONFIG_TYPE", "grpc_xds_sotw"), (name, value)]),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains(name) && err.contains(says), "{name}: {err}");
    }
    let err = Settings::load(
        None,
        &env(&[
            ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
            ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
            ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "/nonexistent/ca.pem"),
        ]),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("CONFIG_GRPC_XDS_SERVER_TLS_CACERT"), "{err}");
}

#[test]
fn statsd_settings_from_the_reference_variables() {
    let s = Settings::load(None, &env(&[])).unwrap();
    assert!(!s.statsd.enabled, "off unless asked for: see the README");
    assert_eq!(
        (s.statsd.host.as_str(), s.statsd.port, s.statsd.protocol()),
        ("localhost", 8125, StatsdProtocol::Tcp)
    );
    let s = Settings::load(
        None,
        &env(&[
            ("USE_STATSD", "true"),
            ("STATSD_HOST", "statsd.monitoring"),
            ("STATSD_PORT", "9125"),
            ("EXTRA_TAGS", "env:prod,team:edge"),
            ("STATS_FLUSH_INTERVAL", "1s"),
        ]),
    )
    .unwrap();
    let st = &s.statsd;
    assert!(st.enabled && !st.dogstatsd);
    assert_eq!((st.host.as_str(), st.port), ("statsd.monitoring", 9125));
    assert_eq!(
        st.extra_tags,
        [
            ("env".into(), "prod".into()),
            ("team".into(), "edge".into())
        ]
        .into()
    );
    assert_eq!(st.flush_interval, Duration::from_secs(1));
    let dog = Settings::load(None, &env(&[("USE_DOG_STATSD", "true")])).unwrap();
    assert!(dog.statsd.enabled && dog.statsd.dogstatsd);
    assert_eq!(dog.statsd.protocol(), StatsdProtocol::Udp);
    let tcp = Settings::load(
        None,
        &env(&[("USE_DOG_STATSD", "true"), ("STATSD_PROTOCOL", "TCP")]),
    )
    .unwrap();
    assert_eq!(tcp.statsd.protocol(), StatsdProtocol::Tcp);
    let off = Settings::load(
        None,
        &env(&[("USE_STATSD", "true"), ("DISABLE_STATS", "true")]),
    )
    .unwrap();
    assert!(!off.statsd.enabled);
    let mogrified = Settings::load(
        None,
        &env(&[
            ("USE_DOG_STATSD", "true"),
            ("USE_DOG_STATSD_MOGRIFIERS", "A"),
        ]),
    )
    .unwrap();
    assert!(
        mogrified.warnings[0].contains("USE_DOG_STATSD_MOGRIFIERS"),
        "{:?}",
        mogrified.warnings
    );
    for (name, value) in [
        ("STATSD_PORT", "0"),
        ("STATSD_PORT", "statsd"),
        ("STATSD_PROTOCOL", "quic"),
        ("EXTRA_TAGS", "env"),
        ("STATS_FLUSH_INTERVAL", "0s"),
    ] {
        let err = Settings::load(None, &env(&[("USE_STATSD", "true"), (name, value)]))
            .unwrap_err()
            .to_string();
        assert!(err.contains(name), "{name}={value}: {err}");
    }
}

#[test]
fn envoy_gateways_environment_loads_as_is() {
    let certs = tempfile::tempdir().unwrap();
    let (cert, key, ca) = (
        certs.path().join("tls.crt"),
        certs.path().join("tls.key"),
        certs.path().join("ca.crt"),
    );
    let generated = rcgen::generate_simple_self_signed(vec!["envoy-ratelimit".into()]).unwrap();
    std::fs::write(&cert, generated.cert.pem()).unwrap();
    std::fs::write(&key, generated.key_pair.serialize_pem()).unwrap();
    std::fs::write(&ca, generated.cert.pem()).unwrap();
    let (cert, key, ca) = (
        cert.to_str().unwrap(),
        key.to_str().unwrap(),
        ca.to_str().unwrap(),
    );
    let s = Settings::load(
        None,
        &env(&[
            ("RUNTIME_ROOT", "/data"),
            ("RUNTIME_SUBDIRECTORY", "ratelimit"),
            ("RUNTIME_IGNOREDOTFILES", "true"),
            ("RUNTIME_WATCH_ROOT", "false"),
            ("LOG_LEVEL", "info"),
            ("USE_STATSD", "true"),
            ("STATSD_PORT", "9125"),
            ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
            ("CONFIG_GRPC_XDS_SERVER_URL", "envoy-gateway:18001"),
            ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
            ("GRPC_SERVER_USE_TLS", "true"),
            ("GRPC_SERVER_TLS_CERT", cert),
            ("GRPC_SERVER_TLS_KEY", key),
            ("GRPC_SERVER_TLS_CA_CERT", ca),
            ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", cert),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", key),
            ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", ca),
            ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "redis.redis-system.svc.cluster.local:6379"),
        ]),
    )
    .unwrap();
    assert_eq!(s.rules.config_type, ConfigType::GrpcXdsSotw);
    assert_eq!(s.backend(), BackendKind::Redis);
    assert!(s.statsd.enabled && s.xds.tls && s.grpc_tls.enabled);
    assert_eq!(
        s.grpc_tls.client_ca, None,
        "GRPC_SERVER_TLS_CA_CERT is not the reference's"
    );
    assert!(s.warnings.is_empty(), "{:?}", s.warnings);
}

#[test]
fn ratelimitd_variables_keep_text_as_text_and_read_numbers_from_it() {
    let s = Settings::load(
        None,
        &env(&[
            ("RATELIMITD_ADMIN__ENABLED", "true"),
            ("RATELIMITD_ADMIN__TOKEN", "00000000000000000001"),
            ("RATELIMITD_HASH_SECRET", "0123"),
            ("RATELIMITD_CACHE_KEY_PREFIX", "007"),
            ("RATELIMITD_GRPC__PORT", "9090"),
            ("RATELIMITD_RLQS__ENABLED", "false"),
            ("RATELIMITD_RLQS__REPORT_PERIOD", "2s"),
            ("RATELIMITD_HASHED_KEYS", "api_key, token ,,session"),
        ]),
    )
    .unwrap();
    // Digits are text to a token, a secret and a prefix: a number would have dropped the zeros.
    assert_eq!(s.admin.token.0, "00000000000000000001");
    assert_eq!(s.hash_secret.0, "0123");
    assert_eq!(s.cache_key_prefix, "007");
    assert!(s.admin.enabled);
    assert_eq!(s.grpc.port, 9090);
    assert!(!s.rlqs.enabled);
    assert_eq!(s.rlqs.report_period, Duration::from_secs(2));
    // Spaces around an item are not part of it, and empty items are none: `token` is hashed.
    assert_eq!(s.hashed_keys, vec!["api_key", "token", "session"]);
    let s = Settings::load(None, &env(&[("RATELIMITD_HASHED_KEYS", "")])).unwrap();
    assert!(s.hashed_keys.is_empty(), "{:?}", s.hashed_keys);
    let s = Settings::load(None, &env(&[("RATELIMITD_hashed_keys", "a, b")])).unwrap();
    assert_eq!(s.hashed_keys, vec!["a", "b"]);
    let err = Settings::load(None, &env(&[("RATELIMITD_GRPC__PORT", "ninety")])).unwrap_err();
    assert!(err.to_string().contains("grpc.port"), "{err}");
}

/// Client certificates are asked for over TLS only: without it, GRPC_CLIENT_TLS_CACERT and
/// GRPC_CLIENT_TLS_SAN are left unread with a warning, as the reference leaves them (a Deployment it
/// runs started; this one stopped with exit 64). With TLS, a SAN no certificate could be valid for is
/// refused at start rather than refusing every client.
#[test]
fn client_certificate_settings_apply_over_tls_only() {
    let s = Settings::load(
        None,
        &env(&[
            ("GRPC_CLIENT_TLS_CACERT", "/etc/ca.pem"),
            ("GRPC_CLIENT_TLS_SAN", "envoy.internal"),
        ]),
    )
    .unwrap();
    assert_eq!(
        (
            s.grpc_tls.client_ca.as_deref(),
            s.grpc_tls.client_san.as_deref()
        ),
        (None, None)
    );
    assert!(
        s.warnings
            .iter()
            .any(|w| w.contains("GRPC_CLIENT_TLS_CACERT")),
        "{:?}",
        s.warnings
    );
    let err = Settings::load(
        None,
        &env(&[
            ("GRPC_SERVER_USE_TLS", "true"),
            ("GRPC_SERVER_TLS_CERT", "/etc/tls.crt"),
            ("GRPC_SERVER_TLS_KEY", "/etc/tls.key"),
            ("GRPC_CLIENT_TLS_CACERT", "/etc/ca.pem"),
            ("GRPC_CLIENT_TLS_SAN", "not a name!"),
        ]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("GRPC_CLIENT_TLS_SAN") && err.contains("not a DNS name"),
        "{err}"
    );
    // ratelimitd's own setting still stops the start without TLS.
    let err = Settings::load(
        None,
        &env(&[("RATELIMITD_GRPC_TLS__CLIENT_CA", "/etc/ca.pem")]),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("grpc_tls.client_ca"), "{err}");
}
