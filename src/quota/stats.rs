//! The quota service's metrics: per domain and rule (Envoys subscribed on this replica, the tokens per
//! second assigned to them, the requests they reported allowed and denied), and the reports and buckets
//! it received, abandoned or left unanswered. A rule is labelled as `ShouldRateLimit` labels it, so that
//! both protocols' series of a rule join: its path, with request values only where the rule asks for
//! them and no more such labels than `ShouldRateLimit` allows; a bucket without a rule has no series of
//! its own. A rule's series leave with the rule, at the first housekeeping after a rules reload drops it.

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
}

/// The series of every rule, by domain and rule.
pub(super) type RuleStats = Mutex<HashMap<(String, String), Arc<RuleStat>>>;

/// One rule's series.
#[derive(Debug)]
pub(super) struct RuleStat {
    /// The rule as written (see `BucketLimits::rule_path`): the series go when the rules drop it.
    pub rule_path: Arc<[(Box<str>, Box<str>)]>,
    /// How the label carries request values (see `BucketLimits::rule_form`): the series go too when
    /// the rule now writes them otherwise (`hash_value` turned on).
    pub form: u64,
    pub allowed: AtomicU64,
    pub denied: AtomicU64,
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
        }
    }

    pub fn unanswered(&self, why: Unanswered) {
        if let Some(counter) = self.unanswered.get(&why) {
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The series of a rule (bounded by the rules: a domain and rule exist in them).
    pub fn rule(
        &self,
        domain: &str,
        rule: &str,
        rule_path: &Arc<[(Box<str>, Box<str>)]>,
        form: u64,
    ) -> Arc<RuleStat> {
        let key = (domain.to_owned(), rule.to_owned());
        lock(&self.rules)
            .entry(key)
            .or_insert_with(|| {
                Arc::new(RuleStat {
                    rule_path: rule_path.clone(),
                    form,
                    allowed: AtomicU64::new(0),
                    denied: AtomicU64::new(0),
                    live: Mutex::new((0, 0.0)),
                })
            })
            .clone()
    }

    /// Drops the series of every rule `kept` says the rules no longer have, or no longer label so
    /// (Envoys still reporting one of its buckets are told to abandon it at their next report).
    pub fn prune(&self, kept: impl Fn(&str, &[(Box<str>, Box<str>)], u64) -> bool) {
        lock(&self.rules).retain(|(domain, _), stat| kept(domain, &stat.rule_path, stat.form));
    }
}

/// The per-rule series of one metric, read at scrape time.
pub(super) fn rule_series(
    rules: &Arc<RuleStats>,
    read: impl Fn(&RuleStat) -> f64 + Send + Sync + 'static,
) -> crate::telemetry::metrics::Reading {
    let rules = Arc::downgrade(rules);
    Box::new(move || {
        rules.upgrade().map_or_else(Vec::new, |rules| {
            lock(&rules)
                .iter()
                .map(|((domain, rule), s)| (labels(domain, rule), read(s)))
                .collect()
        })
    })
}
