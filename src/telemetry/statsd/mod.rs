//! The statsd (or DogStatsD) stream (`USE_STATSD`, `USE_DOG_STATSD`): every `STATS_FLUSH_INTERVAL`, a
//! task of its own reads the metrics registry and sends what changed since the last delivered flush,
//! under the reference service's stat names, so that dashboards built on them (through a
//! statsd_exporter sidecar, as Envoy Gateway deploys one) keep working.
//!
//! - `lines`: the names, the deltas and the line format; `sink`: UDP or TCP, every step bounded.
//!
//! The request path never sees this stream: requests count once, in the registry Prometheus reads, and
//! only this task talks to the network. When the server cannot be reached, nothing is lost while
//! nothing was sent (the counts go out with the next flush that gets through), the failure is logged
//! once, not at every flush, and counted in `ratelimitd_statsd_send_failures_total`; the return is
//! logged too. The last flush happens at shutdown, after the calls in flight have finished.

mod lines;
mod rule_stats;
mod sink;

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
};

use tokio_util::sync::CancellationToken;

pub use self::lines::{read, sanitize, Format, Stat, Stats};
use self::{
    rule_stats::RuleStats,
    sink::{SendError, Sink},
};
use super::{Metrics, StatsdSettings};

/// The flush task's state.
pub struct Statsd {
    settings: StatsdSettings,
    metrics: Arc<Metrics>,
    format: Format,
    sink: Sink,
    /// What the server has been sent, by name: the base of the next deltas (the per-rule stats keep
    /// theirs in `rules`).
    sent: HashMap<String, Stat>,
    rules: RuleStats,
    /// Whether the last flush failed: a failure is logged when it starts, and so is the recovery.
    failing: bool,
    failures: Arc<AtomicU64>,
}

impl Statsd {
    pub fn new(settings: &StatsdSettings, metrics: Arc<Metrics>) -> Self {
        let failures = metrics.counter(
            "ratelimitd_statsd_send_failures_total",
            "Flushes of the statsd stream that could not be sent (the counts are sent with the next one that can).",
            Vec::new(),
        );
        metrics.keep_retired();
        Self {
            format: Format::new(settings.dogstatsd, &settings.extra_tags),
            sink: Sink::new(&settings.host, settings.port, settings.protocol()),
            settings: settings.clone(),
            metrics,
            sent: HashMap::new(),
            rules: RuleStats::default(),
            failing: false,
            failures,
        }
    }

    /// Flushes every `flush_interval` until `stop`, then once more.
    pub async fn run(mut self, stop: CancellationToken) {
        tracing::info!(
            target = %self.sink.target(),
            dogstatsd = self.settings.dogstatsd,
            every = ?self.settings.flush_interval,
            "sending stats to statsd"
        );
        let mut every = tokio::time::interval(self.settings.flush_interval);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        every.tick().await;
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = every.tick() => self.flush().await,
            }
        }
        self.flush().await;
    }

    /// Sends what changed since the last delivered flush.
    pub async fn flush(&mut self) {
        let due = self.due();
        if due.lines.is_empty() {
            return;
        }
        match self.sink.send(&due.lines).await {
            Ok(()) => {
                if self.failing {
                    self.failing = false;
                    tracing::warn!(target = %self.sink.target(), "statsd reachable again: stats are sent");
                }
                self.delivered(due);
            }
            Err(err) => {
                self.failures.fetch_add(1, Ordering::Relaxed);
                if !self.failing {
                    self.failing = true;
                    tracing::warn!(
                        target = %self.sink.target(),
                        "cannot send stats to statsd: {err}; trying again at every flush, quietly until it works"
                    );
                }
                // What was not sent stays owed; what may have been is not sent again.
                if let SendError::Partly(_) = err {
                    self.delivered(due);
                }
            }
        }
    }

    /// What a flush would send now: the lines of what changed since the last delivered flush.
    pub fn due(&mut self) -> Due {
        let read = read(&self.metrics);
        let mut lines = self.format.lines(&read, &self.sent);
        self.rules.lines(&self.metrics, &self.format, &mut lines);
        Due { lines, read }
    }

    /// Records `due` as delivered: the next flush sends what changes from it on.
    pub fn delivered(&mut self, due: Due) {
        self.sent = due.read.into_iter().collect();
        self.rules.delivered();
    }
}

/// The lines a flush sends, and what they were read from.
pub struct Due {
    pub lines: Vec<String>,
    read: Stats,
}
