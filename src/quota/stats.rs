//! The quota service's metrics: per domain and rule (Envoys subscribed on this replica, the tokens per
//! second assigned to them, the requests they reported allowed and denied), and the reports and buckets
//! it received, abandoned or left unanswered. Rule labels come from the rules, never from what Envoys
//! send: a bucket without a rule has no series of its own.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
};

use super::lock;
use crate::telemetry::Metrics;

/// Why a bucket got no answer, as `ratelimitd_rlqs_unanswered_total` labels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Unanswered {
    /// No rules loaded yet.
    NoRules,
    /// The store could not count or share (with `on_backend_error: error` or `local`).
    Store,
    /// The bucket already has `rlqs.max_envoys_per_bucket` Envoys.
    BucketFull,
    /// The stream already reports `rlqs.max_buckets_per_stream` buckets, or the replica tracks
    /// `rlqs.max_buckets`.
    TooManyBuckets,
    /// The bucket id is empty or larger than `request_limits` allow for a descriptor.
    InvalidBucket,
    /// Its share is held by the others until they report (or expire): its Envoy keeps what it has.
    Waiting,
}

impl Unanswered {
    pub fn label(self) -> &'static str {
        match self {
            Unanswered::NoRules => "no_rules",
            Unanswered::Store => "store",
            Unanswered::BucketFull => "bucket_full",
            Unanswered::TooManyBuckets => "too_many_buckets",
            Unanswered::InvalidBucket => "invalid_bucket",
            Unanswered::Waiting => "waiting",
        }
    }
}

pub(super) fn labels(domain: &str, rule: &str) -> crate::telemetry::metrics::Labels {
    vec![("domain", domain.to_owned()), ("rule", rule.to_owned())]
}

/// The service's counters, and its per-rule series.
#[derive(Debug)]
pub(super) struct Stats {
    pub reports: Arc<AtomicU64>,
    pub abandoned: Arc<AtomicU64>,
    unanswered: HashMap<Unanswered, Arc<AtomicU64>>,
    pub rules: Arc<RuleStats>,
    metrics: Arc<Metrics>,
}

/// The series of every rule, by domain and rule.
pub(super) type RuleStats = Mutex<HashMap<(String, String), Arc<RuleStat>>>;

/// One rule's series.
#[derive(Debug)]
pub(super) struct RuleStat {
    pub allowed: Arc<AtomicU64>,
    pub denied: Arc<AtomicU64>,
    /// Buckets of this replica's streams under the rule, and the tokens per second sent to them.
    pub live: Mutex<(i64, f64)>,
}

impl RuleStat {
    /// Counts `buckets` more subscribed buckets and `tokens` more tokens per second sent to them.
    pub fn subscribe(&self, buckets: i64, tokens: f64) {
        let mut live = lock(&self.live);
        live.0 += buckets;
        live.1 += tokens;
        if live.0 <= 0 {
            *live = (0, 0.0);
        }
    }
}

impl Stats {
    pub fn new(metrics: &Arc<Metrics>) -> Self {
        let unanswered = [
            Unanswered::NoRules,
            Unanswered::Store,
            Unanswered::BucketFull,
            Unanswered::TooManyBuckets,
            Unanswered::InvalidBucket,
            Unanswered::Waiting,
        ]
        .into_iter()
        .map(|why| {
            let counter = metrics.counter(
                "ratelimitd_rlqs_unanswered_total",
                "Buckets of usage reports left unanswered, by reason (the Envoy applies its own no-assignment or expired-assignment behaviour).",
                vec![("reason", why.label().to_owned())],
            );
            (why, counter)
        })
        .collect();
        Self {
            reports: metrics.counter(
                "ratelimitd_rlqs_reports_total",
                "Usage reports received on rate limit quota streams.",
                Vec::new(),
            ),
            abandoned: metrics.counter(
                "ratelimitd_rlqs_abandoned_total",
                "Buckets Envoys were told to abandon because their rule is gone.",
                Vec::new(),
            ),
            unanswered,
            rules: Arc::default(),
            metrics: metrics.clone(),
        }
    }

    pub fn unanswered(&self, why: Unanswered) {
        if let Some(counter) = self.unanswered.get(&why) {
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The series of a rule (bounded by the rules: a domain and rule exist in them).
    pub fn rule(&self, domain: &str, rule: &str) -> Arc<RuleStat> {
        let key = (domain.to_owned(), rule.to_owned());
        if let Some(stat) = lock(&self.rules).get(&key) {
            return stat.clone();
        }
        let stat = Arc::new(RuleStat {
            allowed: self.metrics.counter(
                "ratelimitd_rlqs_allowed_total",
                "Requests Envoys reported allowed under the rule's buckets (counted on its counters too).",
                labels(domain, rule),
            ),
            denied: self.metrics.counter(
                "ratelimitd_rlqs_denied_total",
                "Requests Envoys reported denied under the rule's buckets.",
                labels(domain, rule),
            ),
            live: Mutex::new((0, 0.0)),
        });
        lock(&self.rules).entry(key).or_insert(stat).clone()
    }
}
