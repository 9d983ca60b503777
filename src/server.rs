//! Wiring: builds the parts from settings, serves gRPC and HTTP, and owns the one shutdown path.
//!
//! Shutdown: the `shutdown` token is cancelled (SIGTERM/SIGINT in `main`, the test harness in tests) ->
//! health turns NOT_SERVING -> after `shutdown.drain_delay` the listeners stop accepting -> in-flight
//! calls finish within `shutdown.grace_period` -> background tasks stop -> `run` returns.

use std::{net::SocketAddr, sync::Arc};

use tokio::net::TcpListener;
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use crate::{
    api::{
        conn::{Acceptor, Bounds, ConnectionAge, TrackCallsLayer},
        grpc::RateLimitApi,
        health::Health,
        http, http1,
        tls::ReloadingTls,
    },
    clock::Clock,
    limiter::{self, Limiter},
    proto,
    rules::{self, Rules},
    settings::{BackendKind, OnBackendError, Settings},
    store::{CounterStore, DenyCache, MemoryStore, RedisStore, Store},
    telemetry::{Metrics, TopOffenders},
};

/// Why the server could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen for {what} on {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("{0}")]
    Setup(String),
    #[error("{what} server failed: {reason}")]
    Serve { what: &'static str, reason: String },
}

/// The bound listeners. Binding is separate from serving so that tests can bind port 0 and learn the
/// address first.
#[derive(Debug)]
pub struct Listeners {
    pub grpc: TcpListener,
    pub http: TcpListener,
    /// The separate Prometheus listener, when `USE_PROMETHEUS` asks for one.
    pub prometheus: Option<TcpListener>,
}

impl Listeners {
    /// Binds the addresses of the settings.
    pub async fn bind(settings: &Settings) -> Result<Self, ServerError> {
        let grpc_addr = settings
            .grpc
            .addr("grpc.host")
            .map_err(|e| ServerError::Setup(e.to_string()))?;
        let http_addr = settings
            .http
            .addr("http.host")
            .map_err(|e| ServerError::Setup(e.to_string()))?;
        let bind = |what, addr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| ServerError::Bind { what, addr, source })
        };
        let prometheus = if settings.prometheus.enabled {
            let addr = settings
                .prometheus
                .socket_addr()
                .map_err(|e| ServerError::Setup(e.to_string()))?;
            Some(bind("Prometheus", addr).await?)
        } else {
            None
        };
        Ok(Self {
            grpc: bind("gRPC", grpc_addr).await?,
            http: bind("HTTP", http_addr).await?,
            prometheus,
        })
    }
}

/// Runs the service until `shutdown` is cancelled and the drain is over.
pub async fn run(
    settings: Settings,
    listeners: Listeners,
    shutdown: CancellationToken,
) -> Result<(), ServerError> {
    run_with_clock(settings, listeners, shutdown, Clock::System).await
}

/// [`run`] with an injected clock.
pub async fn run_with_clock(
    settings: Settings,
    listeners: Listeners,
    shutdown: CancellationToken,
    clock: Clock,
) -> Result<(), ServerError> {
    let backend = settings.backend();
    let store = Arc::new(match backend {
        BackendKind::Memory => Store::Memory(MemoryStore::new(settings.memory.max_keys)),
        BackendKind::Redis => Store::Redis(
            RedisStore::connect(
                &settings.redis,
                settings.redis_per_second.as_ref(),
                settings.expiration_jitter_max_seconds,
                settings.overload.deadline,
            )
            .map_err(|e| ServerError::Setup(e.to_string()))?,
        ),
        BackendKind::Noop => {
            tracing::warn!("backend noop: every request is allowed and nothing is counted");
            Store::Noop
        }
    });
    let (reporter, health_service) = tonic_health::server::health_reporter();
    let health = Arc::new(Health::new(
        reporter,
        settings.healthy_with_at_least_one_config_loaded,
        store.is_ready(),
    ));
    health.publish().await;

    let metrics = Arc::new(Metrics::new());
    let deny_cache = (settings.local_cache_max_entries > 0)
        .then(|| Arc::new(DenyCache::new(settings.local_cache_max_entries)));
    let rules = Arc::new(Rules::default());
    let source = settings.rules.source();
    let reload_stats = Arc::new(rules::ReloadStats::default());
    let on_loaded: rules::OnLoaded = {
        let health = health.clone();
        let deny_cache = deny_cache.clone();
        Box::new(move |loaded: &rules::Loaded| {
            // Limits may have changed: remembered denials no longer hold.
            if let Some(cache) = &deny_cache {
                cache.clear();
            }
            let domains = loaded.rules.domains.len();
            let mut names: Vec<&String> = loaded.rules.domains.keys().collect();
            names.sort();
            for domain in names {
                tracing::info!(domain = %domain, "loading domain: {domain}");
            }
            tracing::warn!(
                files = loaded.files.len(),
                domains,
                fingerprint = format!("{:016x}", loaded.fingerprint),
                "rules loaded"
            );
            let health = health.clone();
            tokio::spawn(async move { health.rules_loaded(domains).await });
        })
    };
    // Watching starts before the first load, so that a change made while it reads is loaded too.
    let watch = if settings.rules.watch {
        rules::RulesWatch::start(&source)
    } else {
        None
    };
    rules::reload(&source, &rules, &reload_stats, &on_loaded);
    register_rules_metrics(&metrics, &rules, &reload_stats);

    // `on_backend_error: local` decides from this replica's memory while Redis cannot.
    let fallback = (backend == BackendKind::Redis
        && settings.on_backend_error == OnBackendError::Local)
        .then(|| limiter::Fallback {
            store: Arc::new(Store::Memory(MemoryStore::new(settings.memory.max_keys))),
            replicas: settings.fallback.replicas,
        });
    let limiter = Arc::new(Limiter::new(
        rules.clone(),
        store.clone(),
        clock.clone(),
        limiter::Options {
            key_prefix: settings.cache_key_prefix.clone(),
            shadow_mode: settings.shadow_mode,
            consume_on_deny: settings.consume_on_deny,
            response_headers: settings.response_headers,
            header_names: settings.header_names.clone(),
            request_limits: settings.request_limits.clone(),
            on_backend_error: settings.on_backend_error,
            sensitive: sensitive(&settings),
            near_limit_ratio: settings.near_limit_ratio,
            metrics: metrics.clone(),
            deny_cache: deny_cache.clone(),
            overload: settings.overload.clone(),
            top: Arc::new(TopOffenders::new(
                settings.top_offenders.capacity,
                settings.top_offenders.interval,
            )),
            fallback: fallback.clone(),
            metric_values_per_rule: settings.metrics.max_values_per_rule,
        },
    ));

    register_store_metrics(&metrics, &store);

    let tasks = TaskTracker::new();
    let stop_tasks = CancellationToken::new();
    for store in std::iter::once(store.clone()).chain(fallback.map(|f| f.store)) {
        let (stop, clock) = (stop_tasks.clone(), clock.clone());
        let every = settings.memory.sweep_interval;
        tasks.spawn(async move { store.maintain(&clock, every, stop).await });
    }

    if let Some(watch) = watch {
        tasks.spawn(watch.run(
            rules.clone(),
            reload_stats,
            on_loaded,
            settings.rules.reload_delay,
            stop_tasks.clone(),
        ));
    }
    if !store.is_ready() {
        let (store, health, stop) = (store.clone(), health.clone(), stop_tasks.clone());
        tasks.spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                () = store.until_ready() => health.backend_ready().await,
            }
        });
    }

    let reflection = |builder: tonic_reflection::server::Builder<'static>| {
        builder
            .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection(tonic_reflection::server::Builder::configure())
        .build_v1()
        .map_err(|e| ServerError::Setup(format!("reflection: {e}")))?;
    let reflection_v1alpha = reflection(tonic_reflection::server::Builder::configure())
        .build_v1alpha()
        .map_err(|e| ServerError::Setup(format!("reflection: {e}")))?;

    let stop_accepting = CancellationToken::new();
    let grpc_addr = listeners.grpc.local_addr().ok();
    let http_addr = listeners.http.local_addr().ok();
    let age = ConnectionAge::draw(
        settings.grpc.max_connection_age,
        settings.grpc.max_connection_age_grace,
    );
    tracing::info!(
        close_after = ?age.close_after,
        cut_off_after = ?age.cut_off_after,
        "gRPC connections are closed gracefully at their age and cut after the grace"
    );
    let mut server = tonic::transport::Server::builder()
        .max_concurrent_streams(settings.overload.max_streams_per_connection)
        .http2_keepalive_interval(Some(settings.grpc.keepalive_interval))
        .http2_keepalive_timeout(Some(settings.grpc.keepalive_timeout));
    // Only the age goes to tonic (GOAWAY at the age); the grace is the acceptor's cut-off, because
    // tonic's own grace would replace the GOAWAY with an abrupt close (see `api::conn`).
    if let Some(age) = age.close_after {
        server = server.max_connection_age(age);
    }
    let router = server
        .layer(TrackCallsLayer)
        .layer(tower::util::MapResponseLayer::new(
            crate::api::grpc::refusals_are_invalid_argument,
        ))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(
            RateLimitApi::new(limiter.clone())
                .into_server()
                .max_decoding_message_size(settings.request_limits.max_message_bytes),
        );
    let acceptor =
        Acceptor::new(listeners.grpc, settings.overload.max_connections, "gRPC").bounds(Bounds {
            handshake: Some(settings.grpc.handshake_timeout),
            idle: Some(settings.grpc.idle_timeout),
            stall: None,
            cut_off: age.cut_off_after,
        });
    // Cancelled once the gRPC listening socket is closed: the drain's GOAWAY waits for it, so that
    // clients reconnecting after it are refused at connect rather than reset in the backlog.
    let grpc_closed = CancellationToken::new();
    let grpc = if settings.grpc_tls.enabled {
        let tls = Arc::new(
            ReloadingTls::load(&settings.grpc_tls)
                .map_err(|e| ServerError::Setup(format!("gRPC TLS: {e}")))?,
        );
        let failures = metrics.counter(
            "ratelimitd_tls_handshake_failures_total",
            "gRPC connections refused during the TLS handshake (bad or missing client certificate, timeout).",
            Vec::new(),
        );
        let incoming = tls.incoming(
            acceptor,
            stop_accepting.clone(),
            grpc_closed.clone(),
            failures,
        );
        tokio::spawn(router.serve_with_incoming_shutdown(incoming, grpc_closed.cancelled_owned()))
    } else {
        tokio::spawn(router.serve_with_incoming_shutdown(
            acceptor.plaintext(stop_accepting.clone(), grpc_closed.clone()),
            grpc_closed.cancelled_owned(),
        ))
    };
    // The HTTP listeners have places of their own, so that clients of the side port can never take the
    // file descriptors that gRPC and health checks need.
    let http_acceptor = |listener, what| {
        Acceptor::new(listener, settings.http.max_connections, what).bounds(Bounds {
            stall: Some(settings.http.idle_timeout),
            ..Bounds::default()
        })
    };
    let timeouts = http1::Timeouts {
        header_read: settings.http.header_read_timeout,
        request: settings.http.request_timeout,
    };
    if let Some(listener) = listeners.prometheus {
        tasks.spawn(http1::serve(
            http_acceptor(listener, "Prometheus"),
            http::metrics_router(metrics.clone(), &settings.prometheus.path),
            timeouts,
            stop_accepting.clone(),
        ));
    }
    let mut grpc = grpc;
    let mut http = tokio::spawn(http1::serve(
        http_acceptor(listeners.http, "HTTP"),
        http::router(limiter, health.clone(), metrics.clone()),
        timeouts,
        stop_accepting.clone(),
    ));
    if let (Some(g), Some(h)) = (grpc_addr, http_addr) {
        tracing::warn!("Listening for gRPC on '{g}', HTTP on '{h}'");
    }

    let early = tokio::select! {
        _ = shutdown.cancelled() => None,
        r = &mut grpc => Some(("gRPC", r.map_err(|e| e.to_string()).and_then(|r| r.map_err(|e| e.to_string())))),
        r = &mut http => Some(("HTTP", r.map_err(|e| e.to_string()))),
    };
    health.shutting_down().await;
    if let Some((what, result)) = early {
        stop_accepting.cancel();
        stop_tasks.cancel();
        let reason = result
            .err()
            .unwrap_or_else(|| "stopped unexpectedly".into());
        return Err(ServerError::Serve { what, reason });
    }

    tracing::warn!(
        drain_delay = ?settings.shutdown.drain_delay,
        grace_period = ?settings.shutdown.grace_period,
        "shutting down: health is NOT_SERVING"
    );
    tokio::time::sleep(settings.shutdown.drain_delay).await;
    stop_accepting.cancel();
    let drained = tokio::time::timeout(settings.shutdown.grace_period, async {
        let _ = (&mut grpc).await;
        let _ = (&mut http).await;
    })
    .await;
    if drained.is_err() {
        tracing::warn!("grace period over: closing the remaining connections");
        grpc.abort();
        http.abort();
    }
    stop_tasks.cancel();
    tasks.close();
    tasks.wait().await;
    store.close().await;
    tracing::warn!("shutdown complete");
    Ok(())
}

/// Metrics read at scrape time from the rules and their loads.
fn register_rules_metrics(metrics: &Metrics, rules: &Arc<Rules>, stats: &Arc<rules::ReloadStats>) {
    use std::sync::atomic::Ordering;
    let s = stats.clone();
    metrics.counter_fn(
        "ratelimit_service_config_load_success",
        "Rules loads that succeeded (at start and on every change).",
        Box::new(move || vec![(Vec::new(), s.successes.load(Ordering::Relaxed) as f64)]),
    );
    let s = stats.clone();
    metrics.counter_fn(
        "ratelimit_service_config_load_error",
        "Rules loads refused because a file was invalid (the previous rules kept serving).",
        Box::new(move || vec![(Vec::new(), s.errors.load(Ordering::Relaxed) as f64)]),
    );
    let (s, r) = (stats.clone(), rules.clone());
    metrics.gauge_fn(
        "ratelimitd_rules_info",
        "The rules being served: fingerprint of their files and number of domains; the value is the domain count.",
        Box::new(move || {
            let domains = r.snapshot().map_or(0, |set| set.domains.len());
            let fingerprint = format!("{:016x}", s.fingerprint.load(Ordering::Relaxed));
            vec![(vec![("fingerprint", fingerprint)], domains as f64)]
        }),
    );
}

/// Metrics read at scrape time from the store.
fn register_store_metrics(metrics: &Metrics, store: &Arc<Store>) {
    let s = store.clone();
    metrics.gauge_fn(
        "ratelimitd_backend_up",
        "1 when the counter store is reachable (Redis: at least one connection up).",
        Box::new(move || {
            let up = s.health().up;
            vec![(
                vec![("backend", s.name().to_string())],
                f64::from(u8::from(up)),
            )]
        }),
    );
    let s = store.clone();
    metrics.gauge_fn(
        "ratelimitd_backend_breaker_open",
        "1 while the circuit breaker in front of Redis answers without asking it.",
        Box::new(move || {
            let open = s.health().breaker_open;
            vec![(
                vec![("backend", s.name().to_string())],
                f64::from(u8::from(open)),
            )]
        }),
    );
    let s = store.clone();
    metrics.gauge_fn(
        "ratelimitd_memory_store_counters",
        "Counters held by the memory store.",
        Box::new(move || {
            s.health()
                .counters
                .map(|n| (Vec::new(), n as f64))
                .into_iter()
                .collect()
        }),
    );
}

/// The hasher of sensitive values: HMAC-SHA256 under `hash_secret`, or unkeyed SHA-256 without one. Either
/// depends on the value alone, so every replica and every restart counts a value under the same key.
fn sensitive(settings: &Settings) -> Option<limiter::Sensitive> {
    let secret = Some(settings.hash_secret.0.as_bytes()).filter(|s| !s.is_empty());
    if secret.is_none() && !settings.hashed_keys.is_empty() {
        tracing::warn!(
            hashed_keys = ?settings.hashed_keys,
            "RATELIMITD_HASH_SECRET is not set: sensitive values are hashed with unkeyed SHA-256 (sha256-...), so anyone who can read the counter keys can confirm a guessed value; set RATELIMITD_HASH_SECRET (the same on every replica) to make the hash keyed (HMAC-SHA256)"
        );
    }
    // Built even with no `hashed_keys`: rule nodes marked `hash_value: true` are hashed regardless.
    Some(limiter::Sensitive::new(&settings.hashed_keys, secret))
}
