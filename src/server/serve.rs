//! Running the listeners: gRPC (the rate limit service, the rate limit quota service, health and
//! reflection, plaintext or TLS), HTTP,
//! and the separate Prometheus port; and draining them at shutdown.
//!
//! Every listener runs as a task of the server's `Tasks`; all stop accepting on one token, so that
//! the drain is one step for all of them.

use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic_health::{
    pb::health_server::HealthServer,
    server::{HealthReporter, HealthService},
};

use super::{Listeners, ServerError, Tasks};
use crate::{
    api::{
        admin,
        conn::{
            Acceptor, Bounds, ConnectionAge, EndAtDrainLayer, HeldBytes, TrackCallsLayer,
            WholeMessagesLayer, QUOTA_STREAM, SHOULD_RATE_LIMIT,
        },
        grpc::{RateLimitApi, RefusalsAsInvalidArgument},
        health::Health,
        http, http1,
        method_stats::MethodStatsLayer,
        rlqs::RateLimitQuotaApi,
        tls::ReloadingTls,
    },
    limiter::Limiter,
    proto,
    quota::Quota,
    settings::Settings,
    telemetry::Metrics,
};

/// What the listeners serve.
pub(super) struct Services {
    pub limiter: Arc<Limiter>,
    /// The rate limit quota service, unless `rlqs.enabled` is off.
    pub quota: Option<Arc<Quota>>,
    pub health: Arc<Health>,
    /// The reporter `health` publishes to, served as the gRPC health service.
    pub reporter: HealthReporter,
    pub metrics: Arc<Metrics>,
}

/// The running listeners.
pub(super) struct Serving {
    grpc: JoinHandle<Result<(), String>>,
    http: JoinHandle<()>,
    /// Cancelled to stop accepting: every listener closes and drains its connections.
    stop_accepting: CancellationToken,
}

impl Serving {
    /// Starts serving on every listener.
    pub fn start(
        settings: &Settings,
        listeners: Listeners,
        services: Services,
        tasks: &Tasks,
    ) -> Result<Self, ServerError> {
        // What can fail is done before any listener serves: a replica must not serve gRPC without the
        // operators' API it was asked for, and then never stop.
        let admin = match listeners.admin {
            Some(listener) => Some((listener, AdminSecrets::load(settings)?)),
            None => None,
        };
        let stop_accepting = CancellationToken::new();
        let grpc_addr = listeners.grpc.local_addr().ok();
        let http_addr = listeners.http.local_addr().ok();
        let grpc = serve_grpc(
            settings,
            listeners.grpc,
            &services,
            stop_accepting.clone(),
            tasks,
        )?;
        // The HTTP listeners have places of their own, so that clients of the side port can never take
        // the file descriptors that gRPC and health checks need.
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
                http::metrics_router(services.metrics.clone(), &settings.prometheus.path),
                timeouts,
                stop_accepting.clone(),
            ));
        }
        if let Some((listener, secrets)) = admin {
            serve_admin(
                settings,
                listener,
                secrets,
                &services,
                timeouts,
                &stop_accepting,
                tasks,
            );
        }
        let http = tasks.spawn(http1::serve(
            http_acceptor(listeners.http, "HTTP"),
            http::router(services.limiter, services.health, services.metrics),
            timeouts,
            stop_accepting.clone(),
        ));
        if let (Some(g), Some(h)) = (grpc_addr, http_addr) {
            tracing::warn!("Listening for gRPC on '{g}', HTTP on '{h}'");
        }
        Ok(Self {
            grpc,
            http,
            stop_accepting,
        })
    }

    /// Serves until `shutdown` is cancelled (`None`), or until a listener stops on its own: the error.
    pub async fn until(&mut self, shutdown: &CancellationToken) -> Option<ServerError> {
        let (what, result) = tokio::select! {
            _ = shutdown.cancelled() => return None,
            r = &mut self.grpc => ("gRPC", r.map_err(|e| e.to_string()).and_then(|r| r)),
            r = &mut self.http => ("HTTP", r.map_err(|e| e.to_string())),
        };
        let reason = result
            .err()
            .unwrap_or_else(|| "stopped unexpectedly".into());
        Some(ServerError::Serve { what, reason })
    }

    /// Stops accepting, lets the calls in flight finish within `grace`, then closes what remains.
    pub async fn drain(mut self, grace: std::time::Duration) {
        self.stop_accepting.cancel();
        let drained = tokio::time::timeout(grace, async {
            let _ = (&mut self.grpc).await;
            let _ = (&mut self.http).await;
        })
        .await;
        if drained.is_err() {
            tracing::warn!("grace period over: closing the remaining connections");
            self.grpc.abort();
            self.http.abort();
        }
    }

    /// Stops accepting and closes every connection at once (a listener failed).
    pub fn abort(self) {
        self.stop_accepting.cancel();
        self.grpc.abort();
        self.http.abort();
    }
}

/// The operators' API's token, and its TLS when set, as the settings name them.
struct AdminSecrets {
    token: admin::Token,
    tls: Option<Arc<ReloadingTls>>,
}

impl AdminSecrets {
    fn load(settings: &Settings) -> Result<Self, ServerError> {
        let admin = &settings.admin;
        let token =
            admin::Token::from_settings(admin).map_err(|e| ServerError::Setup(e.to_string()))?;
        let tls = if admin.tls.enabled {
            let tls = ReloadingTls::load_files(admin.tls.files())
                .map_err(|e| ServerError::Setup(format!("admin TLS: {e}")))?;
            Some(Arc::new(tls))
        } else {
            None
        };
        Ok(Self { token, tls })
    }
}

/// Serves the operators' API on its own listener until `stop_accepting`.
fn serve_admin(
    settings: &Settings,
    listener: tokio::net::TcpListener,
    AdminSecrets { token, tls }: AdminSecrets,
    services: &Services,
    timeouts: http1::Timeouts,
    stop_accepting: &CancellationToken,
    tasks: &Tasks,
) {
    let admin = &settings.admin;
    let state = admin::AdminState {
        limiter: services.limiter.clone(),
        token: Arc::new(token),
        refused: services.metrics.counter(
            "ratelimitd_admin_refused_total",
            "Operators' API calls refused for a missing or wrong bearer token.",
            Vec::new(),
        ),
    };
    let addr = listener.local_addr().ok();
    let acceptor = Acceptor::new(listener, admin.max_connections, "admin").bounds(Bounds {
        handshake: Some(settings.grpc.handshake_timeout),
        stall: Some(settings.http.idle_timeout),
        ..Bounds::default()
    });
    let secure = tls.is_some();
    tasks.spawn(admin::serve(
        acceptor,
        tls,
        admin::router(state, admin.max_body_bytes),
        timeouts,
        stop_accepting.clone(),
    ));
    if let Some(addr) = addr {
        let scheme = if secure { "https" } else { "http" };
        tracing::warn!("Operators' API listening on '{addr}' ({scheme})");
        if !secure && !addr.ip().is_loopback() {
            tracing::warn!("the operators' API listens beyond this host without TLS: its bearer token crosses the network in the clear; set admin.tls");
        }
    }
}

/// The largest request message of health checks and reflection: a service's name, a file's or a
/// symbol's (tonic's default would take 4 MiB).
const SMALL_MESSAGE_BYTES: usize = 16 * 1024;

/// The largest request message of the decisions and of the quota streams (the other services take
/// [`SMALL_MESSAGE_BYTES`]).
fn largest_messages(settings: &Settings, services: &Services) -> Arc<[(&'static str, usize)]> {
    let quota = services
        .quota
        .as_ref()
        .map_or(0, |quota| quota.settings().max_message_bytes);
    Arc::new([
        (SHOULD_RATE_LIMIT, settings.request_limits.max_message_bytes),
        (QUOTA_STREAM, quota),
    ])
}

/// The reflection services' builder: the rate limit API and the health service.
fn reflection_builder() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
}

/// Serves the gRPC services on `listener` until `stop_accepting`, then drains them; the task ends with
/// the server's error, if any.
fn serve_grpc(
    settings: &Settings,
    listener: tokio::net::TcpListener,
    services: &Services,
    stop_accepting: CancellationToken,
    tasks: &Tasks,
) -> Result<JoinHandle<Result<(), String>>, ServerError> {
    let reflection_v1 = reflection_builder()
        .build_v1()
        .map_err(|e| ServerError::Setup(format!("reflection: {e}")))?;
    let reflection_v1alpha = reflection_builder()
        .build_v1alpha()
        .map_err(|e| ServerError::Setup(format!("reflection: {e}")))?;

    let age = ConnectionAge::draw(
        settings.grpc.max_connection_age,
        settings.grpc.max_connection_age_grace,
    );
    let router = grpc_server(settings, &age)
        .layer(TrackCallsLayer)
        .layer(EndAtDrainLayer {
            draining: stop_accepting.clone(),
        })
        .layer(MethodStatsLayer::new(&services.metrics))
        .layer(WholeMessagesLayer {
            timeout: settings.grpc.message_timeout,
            held: Arc::new(HeldBytes::new(settings.grpc.max_held_bytes)),
            largest: largest_messages(settings, services),
            largest_otherwise: SMALL_MESSAGE_BYTES,
        })
        .add_service(
            HealthServer::new(HealthService::from_health_reporter(
                services.reporter.clone(),
            ))
            .max_decoding_message_size(SMALL_MESSAGE_BYTES),
        )
        .add_service(reflection_v1.max_decoding_message_size(SMALL_MESSAGE_BYTES))
        .add_service(reflection_v1alpha.max_decoding_message_size(SMALL_MESSAGE_BYTES))
        .add_service(RefusalsAsInvalidArgument::new(
            RateLimitApi::new(services.limiter.clone())
                .into_server()
                .max_decoding_message_size(settings.request_limits.max_message_bytes),
            services.limiter.clone(),
        ))
        // Its streams end when the drain begins, so that Envoys move to another replica at once.
        .add_optional_service(services.quota.clone().map(|quota| {
            RateLimitQuotaApi::new(quota, tasks.tracker.clone(), stop_accepting.clone())
                .into_server()
        }));
    let acceptor =
        Acceptor::new(listener, settings.overload.max_connections, "gRPC").bounds(Bounds {
            handshake: Some(settings.grpc.handshake_timeout),
            idle: Some(settings.grpc.idle_timeout),
            stall: None,
            cut_off: age.cut_off_after,
        });
    // Cancelled once the gRPC listening socket is closed: the drain's GOAWAY waits for it, so that
    // clients reconnecting after it are refused at connect rather than reset in the backlog.
    let grpc_closed = CancellationToken::new();
    let served = |result: Result<(), tonic::transport::Error>| result.map_err(|e| e.to_string());
    if settings.grpc_tls.enabled {
        let tls = Arc::new(
            ReloadingTls::load(&settings.grpc_tls)
                .map_err(|e| ServerError::Setup(format!("gRPC TLS: {e}")))?,
        );
        let failures = services.metrics.counter(
            "ratelimitd_tls_handshake_failures_total",
            "gRPC connections refused during the TLS handshake (bad or missing client certificate, timeout).",
            Vec::new(),
        );
        let incoming = tls.incoming(acceptor, stop_accepting, grpc_closed.clone(), failures);
        let serve = router.serve_with_incoming_shutdown(incoming, grpc_closed.cancelled_owned());
        Ok(tasks.spawn(async move { served(serve.await) }))
    } else {
        let incoming = acceptor.plaintext(stop_accepting, grpc_closed.clone());
        let serve = router.serve_with_incoming_shutdown(incoming, grpc_closed.cancelled_owned());
        Ok(tasks.spawn(async move { served(serve.await) }))
    }
}

/// The HTTP/2 settings of the gRPC server, and the connection age it closes connections at.
fn grpc_server(settings: &Settings, age: &ConnectionAge) -> tonic::transport::Server {
    tracing::info!(
        close_after = ?age.close_after,
        cut_off_after = ?age.cut_off_after,
        "gRPC connections are closed gracefully at their age and cut after the grace"
    );
    let server = tonic::transport::Server::builder()
        .max_concurrent_streams(settings.overload.max_streams_per_connection)
        .http2_keepalive_interval(Some(settings.grpc.keepalive_interval))
        .http2_keepalive_timeout(Some(settings.grpc.keepalive_timeout));
    // Only the age goes to tonic (GOAWAY at the age); the grace is the acceptor's cut-off, because
    // tonic's own grace would replace the GOAWAY with an abrupt close (see `api::conn`).
    match age.close_after {
        Some(age) => server.max_connection_age(age),
        None => server,
    }
}
