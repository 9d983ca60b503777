//! The limiter's side of a store call: every call timed and traced, and, under `on_backend_error: local`,
//! this replica's own memory deciding while the store cannot.
//!
//! The deny cache stands in front of this (see [`crate::store::deny_cache`]): checks it answers never
//! reach the store, so they are neither timed nor traced, and the fallback's denials are never
//! remembered, since the shared counters may allow where one replica's share does not.

use std::sync::{
    atomic::{AtomicBool, AtomicU64, Ordering},
    Arc,
};

use super::OnBackendError;
use crate::{
    store::{
        deny_cache::CacheableStore, Applied, Batch, CounterStore, Deadline, Store, StoreError,
    },
    telemetry::{metrics::Histogram, Metrics},
};

/// The local fallback of `on_backend_error: local`: this replica's own memory, each limit divided by
/// the number of replicas sharing it.
#[derive(Debug, Clone)]
pub struct Fallback {
    /// A memory store (swept like the main one).
    pub store: Arc<Store>,
    /// Replicas sharing the limits (`fallback.replicas`, at least 1).
    pub replicas: u32,
}

impl Fallback {
    /// The batch as this replica decides it alone: every limit (and burst) divided by the replicas,
    /// rounded up, so that a limit of 1 still admits one request rather than none.
    fn share(&self, batch: &Batch) -> Batch {
        let replicas = u64::from(self.replicas.max(1));
        let mut local = batch.clone();
        for check in &mut local.checks {
            check.params.limit = check.params.limit.div_ceil(replicas);
            check.params.burst = check.params.burst.div_ceil(replicas);
        }
        local
    }
}

/// The store as the limiter calls it.
#[derive(Debug)]
pub(super) struct Backend {
    store: Arc<Store>,
    /// Set only under `on_backend_error: local`.
    fallback: Option<Fallback>,
    /// Time of each store call.
    duration: Arc<Histogram>,
    /// Requests decided by the local fallback.
    fallback_decisions: Arc<AtomicU64>,
    /// When the local fallback decides, for its gauge and its log lines.
    fallback_episode: Arc<FallbackEpisode>,
}

impl Backend {
    pub(super) fn new(
        store: Arc<Store>,
        on_backend_error: OnBackendError,
        fallback: Option<Fallback>,
        metrics: &Metrics,
    ) -> Self {
        let backend = store.name();
        Self {
            fallback: fallback.filter(|_| on_backend_error == OnBackendError::Local),
            duration: metrics.histogram(
                "ratelimitd_backend_call_duration_seconds",
                "Time the counter store took to decide one request (Redis: its script calls; next to nothing when leases or an open breaker answered).",
                vec![("backend", backend.to_string())],
            ),
            fallback_decisions: metrics.counter(
                "ratelimitd_fallback_decisions_total",
                "Requests decided from this replica's memory because the store could not decide (on_backend_error: local).",
                Vec::new(),
            ),
            fallback_episode: FallbackEpisode::register(metrics, store.clone()),
            store,
        }
    }
}

impl CacheableStore for Backend {
    /// One call to the store, timed and traced; when the store cannot decide and the policy is `local`,
    /// the local fallback decides instead, and its answer is not to be remembered.
    async fn apply_cacheable(
        &self,
        batch: &Batch,
        now_millis: u64,
        deadline: Deadline,
    ) -> Result<(Applied, bool), StoreError> {
        let started = std::time::Instant::now();
        let span = tracing::info_span!(
            "backend call",
            otel.kind = "client",
            backend = self.store.name(),
            checks = batch.checks.len(),
        );
        let applied =
            tracing::Instrument::instrument(self.store.apply(batch, now_millis, deadline), span)
                .await;
        self.duration.observe(started.elapsed());
        let episode = &self.fallback_episode;
        match (applied, &self.fallback) {
            (Ok(applied), _) => {
                if episode.store_answered() {
                    tracing::warn!(
                        backend = self.store.name(),
                        "the store decides again: local fallback over"
                    );
                }
                Ok((applied, true))
            }
            (Err(err), Some(fallback)) => {
                if episode.fell_back() {
                    tracing::warn!(
                        backend = self.store.name(),
                        replicas = fallback.replicas,
                        "the store cannot decide ({err}): deciding from this replica's memory, each limit divided by {} (on_backend_error: local)",
                        fallback.replicas
                    );
                }
                // Decided at the time the store gave up, not the time the request came: the wait
                // for it (up to the request's deadline) would put this request behind those the
                // fallback decided meanwhile. (With a manual clock, tests', the wait is real time.)
                let waited = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
                let local = fallback
                    .store
                    .apply(
                        &fallback.share(batch),
                        now_millis.saturating_add(waited),
                        deadline,
                    )
                    .await?;
                // Counted once decided: a memory store full of counters answers an error too.
                self.fallback_decisions.fetch_add(1, Ordering::Relaxed);
                Ok((local, false))
            }
            (Err(err), None) => Err(err),
        }
    }
}

impl CounterStore for Backend {
    async fn apply(
        &self,
        batch: &Batch,
        now_millis: u64,
        deadline: Deadline,
    ) -> Result<Applied, StoreError> {
        let (applied, _) = self.apply_cacheable(batch, now_millis, deadline).await?;
        Ok(applied)
    }
}

/// Whether the local fallback is deciding, told once per episode in the log: an episode starts with the
/// first fallback decision after a quiet second and ends with a store answer a second after the last
/// fallback decision (a store failing for some requests only does not flood the log). The gauge also
/// turns 0 when requests stop coming once the store can be reached again: nothing is decided from
/// memory then, although no store answer has ended the episode yet.
#[derive(Debug)]
struct FallbackEpisode {
    active: AtomicBool,
    /// Milliseconds since `epoch` of the last fallback decision, plus one (0: none yet).
    last_ms: AtomicU64,
    epoch: std::time::Instant,
}

impl FallbackEpisode {
    const QUIET_MS: u64 = 1_000;

    /// A new episode tracker, its state exposed as the `ratelimitd_fallback_active` gauge.
    fn register(metrics: &Metrics, store: Arc<Store>) -> Arc<Self> {
        let episode = Arc::new(Self {
            active: AtomicBool::new(false),
            last_ms: AtomicU64::new(0),
            epoch: std::time::Instant::now(),
        });
        let read = episode.clone();
        metrics.gauge_fn(
            "ratelimitd_fallback_active",
            "1 while the local fallback decides because the store cannot (on_backend_error: local).",
            Box::new(move || {
                let active = read.deciding(|| {
                    let health = store.health();
                    health.up && !health.breaker_open
                });
                vec![(Vec::new(), f64::from(u8::from(active)))]
            }),
        );
        episode
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX) + 1
    }

    /// Whether the fallback decides now: in an episode, with a fallback decision within the last second or
    /// a store that cannot be reached (no connection, or its breaker open).
    fn deciding(&self, reachable: impl FnOnce() -> bool) -> bool {
        let recent = || {
            self.now_ms()
                .saturating_sub(self.last_ms.load(Ordering::Relaxed))
                <= Self::QUIET_MS
        };
        self.active.load(Ordering::Relaxed) && (recent() || !reachable())
    }

    /// Records a fallback decision; true when it starts an episode.
    fn fell_back(&self) -> bool {
        let now = self.now_ms();
        let last = self.last_ms.swap(now, Ordering::Relaxed);
        self.active.store(true, Ordering::Relaxed);
        last == 0 || now.saturating_sub(last) > Self::QUIET_MS
    }

    /// Records a store answer; true when it ends an episode.
    fn store_answered(&self) -> bool {
        self.active.load(Ordering::Relaxed)
            && self
                .now_ms()
                .saturating_sub(self.last_ms.load(Ordering::Relaxed))
                > Self::QUIET_MS
            && self
                .active
                .compare_exchange(true, false, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        algorithm::{Algorithm, Params},
        store::{Check, MemoryStore, Role},
    };

    #[test]
    fn the_local_fallback_shares_each_limit_among_the_replicas_rounding_up() {
        let fallback = Fallback {
            store: Arc::new(Store::Memory(MemoryStore::new(10))),
            replicas: 3,
        };
        let check = |limit, burst| Check {
            key: "k".into(),
            params: Params {
                algorithm: Algorithm::TokenBucket,
                limit,
                window_ms: 1000,
                burst,
                count_over_limit: false,
            },
            cost: 1,
            role: Role::Enforce,
            further_limit: false,
            per_second: false,
            reported: false,
        };
        let batch = Batch {
            checks: vec![check(10, 20), check(1, 1), check(0, 0)],
            ..Default::default()
        };
        let shared: Vec<(u64, u64)> = fallback
            .share(&batch)
            .checks
            .iter()
            .map(|c| (c.params.limit, c.params.burst))
            .collect();
        assert_eq!(shared, vec![(4, 7), (1, 1), (0, 0)]);
    }
}
