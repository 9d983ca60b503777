//! Health as callers see it: the gRPC health service (names `""` and `ratelimit`) and `/healthcheck`.
//!
//! Serving means: not shutting down, the backend reached once since start (Redis: connected and scripts
//! loaded), with rules from a control plane a first rule set applied (unless
//! `FORCE_START_WITHOUT_INITIAL_CONFIG`), and, with `healthy_with_at_least_one_config_loaded`, rules with
//! at least one domain loaded.
//! Like the reference service, a backend lost after start does not turn health off: that would take
//! every replica out of its load balancer at once, and `on_backend_error` decides what callers get.

use std::sync::atomic::{AtomicBool, Ordering};

use tonic_health::{server::HealthReporter, ServingStatus};

/// The gRPC health service name of the rate limit service (the reference's).
pub const SERVICE_NAME: &str = "ratelimit";

#[derive(Debug)]
pub struct Health {
    reporter: HealthReporter,
    require_rules: bool,
    rules_loaded: AtomicBool,
    /// True until a first rule set is applied, when health waits for one (rules from a control plane).
    awaiting_rules: AtomicBool,
    backend_ready: AtomicBool,
    shutting_down: AtomicBool,
    /// One publication at a time, each of the status when it got here: two interleaved could write an
    /// older status last (SERVING, decided as the backend connected, after a shutdown's NOT_SERVING).
    /// Holds the status last published: watchers are sent changes only, as the health protocol says
    /// (a reload republished SERVING to every watcher).
    publishing: tokio::sync::Mutex<Option<ServingStatus>>,
}

impl Health {
    /// `backend_ready`: whether the backend needs no waiting (the memory store); `await_rules`: whether
    /// to report NOT_SERVING until a first rule set is applied, even one without domains.
    pub fn new(
        reporter: HealthReporter,
        require_rules: bool,
        backend_ready: bool,
        await_rules: bool,
    ) -> Self {
        Self {
            reporter,
            require_rules,
            rules_loaded: AtomicBool::new(false),
            awaiting_rules: AtomicBool::new(await_rules),
            backend_ready: AtomicBool::new(backend_ready),
            shutting_down: AtomicBool::new(false),
            publishing: tokio::sync::Mutex::new(None),
        }
    }

    pub fn is_serving(&self) -> bool {
        !self.shutting_down.load(Ordering::SeqCst)
            && self.backend_ready.load(Ordering::SeqCst)
            && !self.awaiting_rules.load(Ordering::SeqCst)
            && (!self.require_rules || self.rules_loaded.load(Ordering::SeqCst))
    }

    /// Records that the backend was reached.
    pub async fn backend_ready(&self) {
        self.backend_ready.store(true, Ordering::SeqCst);
        self.publish().await;
    }

    /// Records a successful rules load with this many domains; [`Health::publish`] then says it. Apart,
    /// so that loads are recorded in their order (as they are swapped in) while their publications run
    /// as tasks in any order: each publishes the status at its time, the last one the newest.
    pub fn rules_loaded(&self, domains: usize) {
        self.rules_loaded.store(domains > 0, Ordering::SeqCst);
        self.awaiting_rules.store(false, Ordering::SeqCst);
    }

    /// Turns NOT_SERVING for good.
    pub async fn shutting_down(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        self.publish().await;
    }

    pub async fn publish(&self) {
        let mut published = self.publishing.lock().await;
        let status = if self.is_serving() {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        if published.replace(status) == Some(status) {
            return;
        }
        for name in ["", SERVICE_NAME] {
            self.reporter.set_service_status(name, status).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two rule sets swapped in one after the other (none, then three domains), their publications
    /// run in the other order: health says what the newest set makes it.
    #[tokio::test]
    async fn publications_out_of_order_say_the_newest_rules() {
        let reporter = HealthReporter::new();
        let health = Health::new(reporter, true, true, false);
        health.rules_loaded(0);
        health.rules_loaded(3);
        health.publish().await;
        health.publish().await;
        assert!(health.is_serving());
        health.rules_loaded(0);
        health.publish().await;
        assert!(
            !health.is_serving(),
            "a set without domains, when one is required"
        );
    }

    /// A watcher is sent changes only: a publication of the status it has (a reload, the backend
    /// reached again) sends nothing.
    #[tokio::test]
    async fn watchers_are_sent_changes_only() {
        use tokio_stream::StreamExt;
        use tonic_health::pb::{health_server::Health as _, HealthCheckRequest};
        let reporter = HealthReporter::new();
        let service = tonic_health::server::HealthService::from_health_reporter(reporter.clone());
        let health = Health::new(reporter, false, true, false);
        health.publish().await;
        let request = tonic::Request::new(HealthCheckRequest {
            service: SERVICE_NAME.into(),
        });
        let mut watch = service.watch(request).await.unwrap().into_inner();
        let status = |item: Option<Result<tonic_health::pb::HealthCheckResponse, _>>| {
            item.unwrap().unwrap().status
        };
        assert_eq!(status(watch.next().await), ServingStatus::Serving as i32);
        health.rules_loaded(2);
        health.publish().await;
        health.backend_ready().await;
        let quiet = tokio::time::timeout(std::time::Duration::from_millis(200), watch.next()).await;
        assert!(quiet.is_err(), "an unchanged status was sent: {quiet:?}");
        health.shutting_down().await;
        assert_eq!(
            status(watch.next().await),
            ServingStatus::NotServing as i32,
            "the next message is the change"
        );
    }
}
