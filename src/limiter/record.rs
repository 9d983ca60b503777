//! Recording decisions: the per-request counters, the reference service's per-rule counters (in hits),
//! and the most denied descriptors behind `/debug/top`.
//!
//! Offender names are built in one buffer per thread, reused from request to request.

use std::{
    borrow::Cow,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use super::{
    plan, status::Verdict, Code, Descriptor, LimitError, Limiter, OnBackendError, Options, Request,
    Response,
};
use crate::{
    rules::{written_key, Node},
    store::{Role, StoreError},
    telemetry::{
        metrics::{HeldCounters, Histogram, RuleCounter, RuleCounters, StripedCounter},
        Metrics,
    },
};

thread_local! {
    /// Where offender names are built, so that naming one allocates nothing once the buffer has grown.
    static SCRATCH: std::cell::Cell<String> = const { std::cell::Cell::new(String::new()) };
}

/// The metric series every request updates, held so that recording them looks nothing up.
#[derive(Debug)]
pub(super) struct Series {
    /// Whose counters the rules hold ([`HeldCounters`]): this limiter's, under its way of naming rules.
    owner: u64,
    check_duration: Arc<Histogram>,
    requests_ok: Arc<StripedCounter>,
    requests_over_limit: Arc<StripedCounter>,
    requests_error: Arc<StripedCounter>,
    /// `ratelimitd_request_errors_total`, by kind, in the order of [`ERROR_KINDS`].
    errors: [Arc<AtomicU64>; ERROR_KINDS.len()],
    /// `ratelimitd_backend_failures_total` under the answer `on_backend_error` gives.
    backend_failures: Arc<AtomicU64>,
    domain_not_found: Arc<AtomicU64>,
    global_shadow_mode: Arc<AtomicU64>,
    /// When the next failure of the store may be logged, and how many came since the last line.
    failures_log_at_ms: AtomicU64,
    failures_unlogged: AtomicU64,
}

/// The kinds of `ratelimitd_request_errors_total`.
const ERROR_KINDS: [&str; 5] = [
    "invalid_request",
    "no_rules",
    "backend",
    "overloaded",
    "deadline",
];

/// A failure of the store is logged at most this often; the line says how many came since the last one.
const FAILURES_LOG_EVERY_MS: u64 = 10_000;

/// Milliseconds on a monotonic clock, from the first call.
fn since_start_ms() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let start = START.get_or_init(std::time::Instant::now);
    u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX)
}

impl Series {
    /// Every series is exported from here on, at 0 until its first event: a series that appeared
    /// with its first event would hide that event from `rate()` and `increase()` (an outage shorter
    /// than a scrape interval would not show at all).
    pub(super) fn new(metrics: &Metrics, on_backend_error: OnBackendError) -> Self {
        let requests = |result: &str| {
            metrics.striped_counter(
                "ratelimitd_requests_total",
                "ShouldRateLimit requests, by answer.",
                vec![("result", result.to_string())],
            )
        };
        Self {
            owner: HeldCounters::new_owner(),
            check_duration: metrics.histogram(
                "rate_limit_check_duration_seconds",
                "Time to decide one ShouldRateLimit request.",
                Vec::new(),
            ),
            requests_ok: requests("ok"),
            requests_over_limit: requests("over_limit"),
            requests_error: requests("error"),
            errors: ERROR_KINDS.map(|kind| {
                metrics.counter(
                    "ratelimitd_request_errors_total",
                    "Requests answered with an error, by kind.",
                    vec![("kind", kind.to_string())],
                )
            }),
            backend_failures: metrics.counter(
                "ratelimitd_backend_failures_total",
                "Requests the counter store could not decide, by the on_backend_error answer they got.",
                vec![("answer", failure_answer(on_backend_error).to_string())],
            ),
            // No domain label: request domains are not bounded by the rules.
            domain_not_found: metrics.counter(
                "ratelimit_service_rate_limit_domain_not_found",
                "Descriptors asked of a domain no rules file declares.",
                Vec::new(),
            ),
            global_shadow_mode: metrics.counter(
                "ratelimit_service_global_shadow_mode",
                "Requests answered OK only because of global shadow mode.",
                Vec::new(),
            ),
            failures_log_at_ms: AtomicU64::new(0),
            failures_unlogged: AtomicU64::new(0),
        }
    }
}

impl Limiter {
    /// Records one answered (or refused) request and how long it took.
    pub(super) fn record_answer(&self, result: &Result<Response, LimitError>, took: Duration) {
        self.series.check_duration.observe(took);
        let requests = match result {
            Ok(r) if r.overall_code == Code::Ok => &self.series.requests_ok,
            Ok(_) => &self.series.requests_over_limit,
            Err(err) => {
                let kind = match err {
                    LimitError::NoRules => "no_rules",
                    LimitError::Store(_) => "backend",
                    LimitError::Overloaded { .. } => "overloaded",
                    LimitError::Deadline(_) => "deadline",
                    _ => "invalid_request",
                };
                self.count_error(kind);
                &self.series.requests_error
            }
        };
        requests.add(1);
    }

    /// Records a request refused before it could be read as one (a `/json` body that is no request, or
    /// past `request_limits`): an invalid request, answered with an error, as one refused after it was
    /// read is.
    pub fn record_unreadable(&self) {
        self.record_refused("invalid_request");
    }

    /// Records a request refused before it was read because the replica holds all it takes of requests
    /// still arriving (`grpc.max_held_bytes`): an error of kind `overloaded`, as other shed requests.
    pub fn record_shed(&self) {
        self.record_refused("overloaded");
    }

    /// Not timed: nothing was decided, and the time such a request took is its sender's (a body that
    /// never came in full waits `grpc.message_timeout`), which the time to decide must not carry.
    fn record_refused(&self, kind: &str) {
        self.count_error(kind);
        self.series.requests_error.add(1);
    }

    /// Records a request the store could not decide, whatever `on_backend_error` answers: counted by
    /// that answer, and logged as a warning at most once every ten seconds, so that a Redis refusing
    /// every call (out of memory, a user without EVALSHA) shows in the log and the metrics even when the
    /// policy answers OK.
    pub(super) fn record_backend_failure(&self, err: &StoreError) {
        // The fallback's own decisions are `ratelimitd_fallback_decisions_total`.
        self.series.backend_failures.fetch_add(1, Ordering::Relaxed);
        let answer = failure_answer(self.options.on_backend_error);
        let series = &self.series;
        series.failures_unlogged.fetch_add(1, Ordering::Relaxed);
        // Monotonic: a wall clock stepped back would silence the line until it caught up.
        let now = since_start_ms();
        let due = series.failures_log_at_ms.load(Ordering::Relaxed);
        let mine = now >= due
            && series
                .failures_log_at_ms
                .compare_exchange(
                    due,
                    now + FAILURES_LOG_EVERY_MS,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok();
        if mine {
            let requests = series.failures_unlogged.swap(0, Ordering::Relaxed);
            tracing::warn!(
                answer,
                requests,
                "the counter store could not decide: {err} ({requests} requests since the last such line, answered by on_backend_error: {answer})"
            );
        }
    }

    fn count_error(&self, kind: &str) {
        if let Some(at) = ERROR_KINDS.iter().position(|k| *k == kind) {
            self.series.errors[at].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Records the descriptors of a request for a domain no rules file declares: the reference counts
    /// each descriptor it looks up there.
    pub(super) fn record_unknown_domain(&self, descriptors: usize) {
        self.series
            .domain_not_found
            .fetch_add(descriptors as u64, Ordering::Relaxed);
    }

    /// Records a decided request: its denied descriptors in `/debug/top`, each limited descriptor in its
    /// rule's counters, and the answer global shadow mode turned OK.
    pub(super) fn record_decision(
        &self,
        request: &Request,
        verdicts: &[Verdict<'_>],
        denied: bool,
    ) {
        let consumed = !denied || self.options.consume_on_deny;
        for verdict in verdicts {
            let descriptor = &request.descriptors[verdict.index];
            // A quota descriptor over its limit in a request that passed was not denied.
            if denied && !verdict.outcome.allowed && verdict.role != Role::Shadow {
                self.record_offender(&request.domain, descriptor, verdict.node);
            }
            let held = verdict
                .node
                .and_then(|node| node.counters.get(self.series.owner));
            let found;
            let counters = match held {
                Some(counters) => counters,
                None => {
                    found = self.rule_counters(&request.domain, descriptor, verdict);
                    &*found
                }
            };
            // Counted as the store decides them: what its limit could never allow counts as that bound,
            // so that no caller's `hits_addend` takes a counter to its end (where it would stay).
            let hits = plan::hits(request, descriptor).min(verdict.most_hits);
            // A limit counting over its limit counts its hits in a denied request too.
            self.record_rule(counters, verdict, hits, consumed || verdict.counts_over);
        }
        if denied && self.options.shadow_mode {
            self.series
                .global_shadow_mode
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The counters of a descriptor's `rule` label, from the metrics. A label that is the rule's own (no
    /// request values in it) is the same for every request the rule matches: the rule holds its
    /// counters from then on.
    fn rule_counters(
        &self,
        domain: &str,
        descriptor: &Descriptor,
        verdict: &Verdict<'_>,
    ) -> Arc<RuleCounters> {
        let node = verdict.node;
        let rule = if verdict.runtime {
            RuleLabel::unowned("runtime")
        } else {
            rule_label(node, descriptor, &self.options)
        };
        let metrics = &self.options.metrics;
        match &rule.written {
            // Request values in the label: at most so many series per rule, then one for the rest.
            Some(written) if rule.request_values => metrics.rule_within(
                domain,
                &rule.text,
                written,
                rule.form,
                self.options.metric_values_per_rule,
            ),
            written => {
                let counters = metrics.rule(domain, &rule.text, written.as_deref());
                if let Some(node) = node.filter(|_| rule.same_for_every_request) {
                    node.counters.hold(self.series.owner, counters.clone());
                }
                counters
            }
        }
    }

    /// Counts a denied descriptor in `/debug/top`, named by the domain, then its `key=value` entries,
    /// sensitive values hashed.
    fn record_offender(&self, domain: &str, descriptor: &Descriptor, node: Option<&Node>) {
        let path = node.map(Node::path).unwrap_or_default();
        let mut name = SCRATCH.take();
        name.clear();
        name.push_str(domain);
        for (i, e) in descriptor.entries.iter().enumerate() {
            let value = self
                .options
                .show(&e.key, &e.value, plan::hashed_at(&path, i));
            name.push(' ');
            push_word(&mut name, &e.key);
            name.push('=');
            push_word(&mut name, &value);
        }
        self.options.top.denied(&name);
        SCRATCH.set(name);
    }

    /// The reference service's per-rule counters for one descriptor costing `hits`.
    fn record_rule(
        &self,
        counters: &RuleCounters,
        verdict: &Verdict<'_>,
        hits: u64,
        consumed: bool,
    ) {
        let add = |c: RuleCounter, n: u64| counters.add(c, n);
        counters.seen(verdict.role == Role::Shadow);
        let outcome = &verdict.outcome;
        add(RuleCounter::TotalHits, hits);
        if !outcome.allowed {
            add(RuleCounter::OverLimit, hits);
            add(RuleCounter::Exceeded, 1);
            if verdict.role == Role::Shadow {
                add(RuleCounter::ShadowMode, hits);
            }
            if verdict.from_cache {
                add(RuleCounter::OverLimitWithLocalCache, hits);
            }
        } else if consumed {
            add(RuleCounter::WithinLimit, hits);
            let limit = verdict.limit;
            let after = limit.saturating_sub(outcome.remaining);
            let before = after.saturating_sub(hits);
            let threshold = (limit as f64 * self.options.near_limit_ratio).floor() as u64;
            if after > threshold {
                add(
                    RuleCounter::NearLimit,
                    if before >= threshold {
                        hits
                    } else {
                        after - threshold
                    },
                );
            }
        }
    }
}

/// Writes a key or value of a `/debug/top` name as it is, or quoted with escapes where it could be read
/// as more than one word of the name (a space, `=`, a quote, a backslash, a control character, nothing).
fn push_word(name: &mut String, word: &str) {
    if !word.is_empty() && !word.contains([' ', '=', '"', '\\']) && !word.contains(char::is_control)
    {
        name.push_str(word);
    } else {
        use std::fmt::Write;
        let _ = write!(name, "{word:?}");
    }
}

/// The `rule` metric label of a descriptor.
pub(super) struct RuleLabel {
    pub text: Cow<'static, str>,
    /// The rule's path as written, under which the labels carrying request values are bounded, and
    /// whose removal by a reload removes the label's series; `None` for a label no rule owns.
    pub written: Option<String>,
    /// The label carries request values.
    pub request_values: bool,
    /// How: its rule's `Node::label_form` when it carries them, else 0.
    pub form: u64,
    /// The label is the same for every request its rule matches: it takes no request values, not even
    /// where a request's empty value leaves them out this time.
    pub same_for_every_request: bool,
}

impl RuleLabel {
    /// A label no rule owns: `override`, `runtime`.
    fn unowned(text: &'static str) -> Self {
        Self {
            text: Cow::Borrowed(text),
            written: None,
            request_values: false,
            form: 0,
            same_for_every_request: true,
        }
    }
}

/// The `rule` metric label of a descriptor: its rule's path (`key_value.key`...), with request values only
/// where the rule asks for them (`detailed_metric` on the matched rule, `value_to_metric` on a level
/// matched by its key or a wildcard), sensitive values hashed. Every override is labelled `override`: its
/// entry keys are the caller's to choose, so they never become label values. The rate limit quota
/// service labels its buckets' rules with it too, so that both protocols' series of a rule join.
pub(super) fn rule_label(
    node: Option<&Node>,
    descriptor: &Descriptor,
    options: &Options,
) -> RuleLabel {
    let Some(node) = node else {
        return RuleLabel::unowned("override");
    };
    let path = node.path();
    // Most rules: the path as written.
    let takes_request_values = node.labels_request_values();
    let written_sensitive = path
        .iter()
        .any(|step| options.hides_written(&step.key, &step.value, step.flags.hash_value));
    let written = written_key(&path);
    if !takes_request_values && !written_sensitive {
        return RuleLabel {
            text: Cow::Owned(written.clone()),
            written: Some(written),
            request_values: false,
            form: 0,
            same_for_every_request: true,
        };
    }
    let mut from_any_request_value = false;
    let mut parts = Vec::with_capacity(path.len());
    for (i, step) in path.iter().enumerate() {
        let (key, value) = (&*step.key, &*step.value);
        let hashed = step.flags.hash_value;
        let request_value = descriptor.entries.get(i).map_or("", |e| e.value.as_str());
        let shared = step.flags.share_threshold;
        let to_metric = step.flags.value_to_metric;
        let from_request = !shared
            && !request_value.is_empty()
            && (node.flags.detailed_metric
                || (to_metric && (value.is_empty() || value.contains('*'))));
        from_any_request_value |= from_request;
        parts.push(if from_request {
            format!("{key}_{}", options.show(key, request_value, hashed))
        } else if value.is_empty() {
            key.to_string()
        } else if shared {
            format!("{key}_{value}")
        } else {
            format!("{key}_{}", options.show_written(key, value, hashed))
        });
    }
    RuleLabel {
        text: parts.join(".").into(),
        written: Some(written),
        request_values: from_any_request_value,
        form: if from_any_request_value {
            node.label_form()
        } else {
            0
        },
        same_for_every_request: !takes_request_values,
    }
}

/// The `answer` label of a request the store could not decide: `local` reaches the count only without a
/// fallback to decide (or with it failing too), and the caller then gets the error.
fn failure_answer(on_backend_error: OnBackendError) -> &'static str {
    match on_backend_error {
        OnBackendError::Error | OnBackendError::Local => "error",
        OnBackendError::Allow => "allow",
        OnBackendError::Deny => "deny",
    }
}
