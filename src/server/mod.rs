//! Wiring: builds the parts from settings, serves gRPC and HTTP, and owns the one shutdown path.
//!
//! - `build` makes the parts: the store, the limiter (deny cache, fallback, hasher), the rate limit
//!   quota service, the rules and their watcher or xDS client, the metrics read at scrape time.
//! - `serve` runs the listeners and drains them.
//! - [`run_with_clock`] is the sequence: build, start the background work, serve, shut down.
//!
//! Every task the server starts is one of its `Tasks`, and `run` returns only once all have ended.
//!
//! Shutdown: the `shutdown` token is cancelled (SIGTERM/SIGINT in `main`, the test harness in tests) ->
//! health turns NOT_SERVING -> after `shutdown.drain_delay` the listeners stop accepting -> in-flight
//! calls finish within `shutdown.grace_period` -> background tasks stop (the statsd stream flushes a
//! last time) -> the store closes -> `run` returns.

mod build;
mod serve;

use std::{future::Future, net::SocketAddr, sync::Arc};

use tokio::{net::TcpListener, task::JoinHandle};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tonic_health::server::HealthReporter;

use self::serve::{Services, Serving};
use crate::{
    api::health::Health,
    clock::Clock,
    rules::Rules,
    settings::{ConfigType, Settings},
    store::{CounterStore, Store},
    telemetry::{statsd::Statsd, Metrics},
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
    /// The operators' API listener, when `admin.enabled`.
    pub admin: Option<TcpListener>,
}

impl Listeners {
    /// Binds the addresses of the settings.
    pub async fn bind(settings: &Settings) -> Result<Self, ServerError> {
        let grpc_addr = settings
            .grpc
            .addr("grpc.host (GRPC_HOST)")
            .map_err(|e| ServerError::Setup(e.to_string()))?;
        let http_addr = settings
            .http
            .addr("http.host (HOST)")
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
        let admin = if settings.admin.enabled {
            let addr = settings
                .admin_addr()
                .map_err(|e| ServerError::Setup(e.to_string()))?;
            Some(bind("the operators' API", addr).await?)
        } else {
            None
        };
        Ok(Self {
            grpc: bind("gRPC", grpc_addr).await?,
            http: bind("HTTP", http_addr).await?,
            prometheus,
            admin,
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
    let tasks = Tasks::default();
    let metrics = Arc::new(Metrics::new());

    let store = build::store(&settings)?;
    let reporter = HealthReporter::new();
    let from_control_plane = settings.rules.config_type == ConfigType::GrpcXdsSotw;
    let health = Arc::new(Health::new(
        reporter.clone(),
        settings.healthy_with_at_least_one_config_loaded,
        store.is_ready(),
        from_control_plane && !settings.xds.force_start_without_initial_config,
    ));
    health.publish().await;
    let rules = Arc::new(Rules::default());
    let deciding = build::limiter(&settings, &rules, &store, &clock, &metrics);
    build::load_rules(
        &settings,
        &deciding.limiter,
        &rules,
        &health,
        deciding.deny_cache.clone(),
        &metrics,
        &tasks,
    );
    let quota = build::quota(&settings, &deciding.limiter, &store, &clock, &metrics);
    if let Some(quota) = &quota {
        let (quota, stop) = (quota.clone(), tasks.stopping());
        tasks.spawn(async move { quota.maintain(stop).await });
    }
    build::register_store_metrics(&metrics, &store);
    start_store_tasks(
        &settings,
        &deciding.stores,
        &deciding.limiter,
        &health,
        &clock,
        &tasks,
    );
    start_runtime_limits(&settings, &deciding.limiter, &store, &tasks);
    if settings.statsd.enabled {
        let statsd = Statsd::new(&settings.statsd, metrics.clone());
        tasks.spawn(statsd.run(tasks.stopping()));
    }

    let services = Services {
        limiter: deciding.limiter,
        quota,
        health: health.clone(),
        reporter,
        metrics,
    };
    let serving = Serving::start(&settings, listeners, services, &tasks);
    let failure = match serving {
        Ok(mut serving) => {
            let failure = serving.until(&shutdown).await;
            health.shutting_down().await;
            drain(&settings, serving, failure.is_some()).await;
            failure
        }
        Err(err) => Some(err),
    };
    tasks.stop().await;
    store.close().await;
    match failure {
        Some(err) => Err(err),
        None => {
            tracing::warn!("shutdown complete");
            Ok(())
        }
    }
}

/// The background work of the stores (the configured one first): their maintenance, and waiting for the
/// configured one to be ready, which `health` then reports.
/// Starts each store's upkeep, and, for a store that is not ready yet (Redis connecting), waits for it
/// and reads the runtime limits once before health says SERVING: a new replica never answers without
/// the limits operators set (a tenant banned, or raised) while the fleet applies them.
fn start_store_tasks(
    settings: &Settings,
    stores: &[Arc<Store>],
    limiter: &Arc<crate::limiter::Limiter>,
    health: &Arc<Health>,
    clock: &Clock,
    tasks: &Tasks,
) {
    for store in stores {
        let (store, clock, stop) = (store.clone(), clock.clone(), tasks.stopping());
        let every = settings.memory.sweep_interval;
        tasks.spawn(async move { store.maintain(&clock, every, stop).await });
    }
    if let Some(store) = stores.first().filter(|s| !s.is_ready()) {
        let (store, health, stop) = (store.clone(), health.clone(), tasks.stopping());
        let limiter = limiter.clone();
        tasks.spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                () = store.until_ready() => {
                    // A store that cannot give them (an ACL user without `+hgetall`, say) does not
                    // keep the replica out of service: the refresh keeps trying, and says so.
                    if let Err(err) = limiter.refresh_runtime_limits().await {
                        tracing::warn!("serving before the runtime limits could be read: {err}");
                    }
                    health.backend_ready().await;
                }
            }
        });
    }
}

/// Reads the runtime limits operators set every `runtime_limits.refresh_interval`, on every replica
/// (whether or not it serves the operators' API), once the store can answer. While it cannot, the limits
/// read last stay in force; the trouble is logged once, and its end too.
fn start_runtime_limits(
    settings: &Settings,
    limiter: &Arc<crate::limiter::Limiter>,
    store: &Arc<Store>,
    tasks: &Tasks,
) {
    let (limiter, store, stop) = (limiter.clone(), store.clone(), tasks.stopping());
    let every = settings.runtime_limits.refresh_interval;
    tasks.spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tick.tick() => {}
            }
            if !store.is_ready() {
                continue;
            }
            match limiter.refresh_runtime_limits().await {
                Ok(_) if failing => {
                    tracing::warn!("runtime limits read from the store again");
                    failing = false;
                }
                Ok(_) => {}
                Err(err) if !failing => {
                    tracing::warn!(
                        "cannot read the runtime limits, the last ones read stay in force: {err}"
                    );
                    failing = true;
                }
                Err(_) => {}
            }
        }
    });
}

/// Ends serving once health is NOT_SERVING: after `shutdown.drain_delay`, the listeners stop accepting
/// and the calls in flight get `shutdown.grace_period`; after a listener failed, everything closes at once.
async fn drain(settings: &Settings, serving: Serving, failed: bool) {
    if failed {
        serving.abort();
        return;
    }
    tracing::warn!(
        drain_delay = ?settings.shutdown.drain_delay,
        grace_period = ?settings.shutdown.grace_period,
        "shutting down: health is NOT_SERVING"
    );
    tokio::time::sleep(settings.shutdown.drain_delay).await;
    serving.drain(settings.shutdown.grace_period).await;
}

/// Every task the server starts, and the token that tells the background ones to stop.
#[derive(Debug, Clone, Default)]
struct Tasks {
    tracker: TaskTracker,
    stop: CancellationToken,
}

impl Tasks {
    /// Runs `task` as one of the server's tasks.
    fn spawn<F>(&self, task: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tracker.spawn(task)
    }

    /// Cancelled when the background tasks are to stop.
    fn stopping(&self) -> CancellationToken {
        self.stop.clone()
    }

    /// Tells the background tasks to stop and waits until every task has ended.
    async fn stop(&self) {
        self.stop.cancel();
        self.tracker.close();
        self.tracker.wait().await;
    }
}
