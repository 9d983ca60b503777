//! Deciding a request: descriptors -> matched rules -> one batch of checks -> the store -> statuses,
//! overall code and headers.
//!
//! The request and response types (`types.rs`) are the domain's own; the API layer converts the wire
//! types at the edge. Shadow mode, quota mode, unlimited rules, `replaces` and request overrides are
//! applied here, with the reference service's semantics.
//!
//! # Layout
//! - `plan.rs`: a request validated, its descriptors resolved into limits, the limits into checks.
//! - `backend.rs`: each store call timed and traced, and the local fallback of `on_backend_error:
//!   local`. The deny cache stands in front of it ([`crate::store::deny_cache`]).
//! - `status.rs`: the store's outcomes read into statuses, the overall code and the headers
//!   (`headers.rs`).
//! - `record.rs`: the request and per-rule metrics, and `/debug/top`.
//! - `sensitive.rs`: which values are hashed before anyone sees them.
//! - `runtime.rs`: the runtime limits operators set, and `operator.rs`: what the operators' API asks of
//!   the limiter (inspect, reset, runtime limits), off the request path.
//! - `bucket.rs`: a rate limit quota bucket resolved as a descriptor, to the counters it shares with
//!   `ShouldRateLimit`.

mod backend;
mod bucket;
mod headers;
mod operator;
mod options;
mod plan;
mod record;
pub mod runtime;
mod sensitive;
mod status;
mod types;

pub use backend::Fallback;
pub use bucket::{BucketLimits, BucketRule};
pub use operator::{Inspected, Inspection, OperatorError, Reset, Target};
pub use options::{
    FallbackSettings, HeaderNames, OnBackendError, OverloadSettings, RequestLimits,
    ResponseHeaders, RuntimeLimitsSettings,
};
pub use sensitive::Sensitive;
pub use types::{
    Code, CurrentLimit, Descriptor, DescriptorStatus, Entry, LimitError, LimitOverride, Request,
    Response,
};

use std::{
    borrow::Cow,
    future::{poll_fn, Future},
    pin::{pin, Pin},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    task::Poll,
    time::Duration,
};

use smallvec::{smallvec, SmallVec};

use crate::{
    clock::Clock,
    rules::{RuleSet, Rules},
    store::{deny_cache::DenyCached, Batch, Deadline, DenyCache, Store, StoreError},
    telemetry::{Metrics, TopOffenders},
};
use backend::Backend;
use plan::Resolved;
use record::Series;

/// Everything that shapes decisions besides rules and counters.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Prepended to every counter key (`CACHE_KEY_PREFIX`).
    pub key_prefix: String,
    /// Global shadow mode: the overall code is always OK.
    pub shadow_mode: bool,
    /// Global quota mode (`QUOTA_MODE`): every limited descriptor is a quota descriptor, and one that
    /// matched no limit, or only a shadow rule, passes as one (see [`plan::global_quota_mode`]).
    pub quota_mode: bool,
    pub consume_on_deny: bool,
    pub response_headers: ResponseHeaders,
    pub header_names: HeaderNames,
    pub request_limits: RequestLimits,
    /// What to answer when the store cannot decide.
    pub on_backend_error: OnBackendError,
    /// Which values are hashed before they reach a counter key or `/rlconfig`; `None` hashes nothing.
    pub sensitive: Option<Sensitive>,
    /// Share of a limit above which hits count as near the limit in metrics.
    pub near_limit_ratio: f64,
    /// Where the per-rule and per-request metrics go.
    pub metrics: Arc<Metrics>,
    /// The sketch of the most denied descriptors (`/debug/top`).
    pub top: Arc<TopOffenders>,
    /// The local deny cache, when enabled.
    pub deny_cache: Option<Arc<DenyCache>>,
    /// Requests decided at once, and how long one may take.
    pub overload: OverloadSettings,
    /// Where `on_backend_error: local` decides while the store cannot.
    pub fallback: Option<Fallback>,
    /// Most `rule` label values a rule may take from request values (`detailed_metric`,
    /// `value_to_metric`); further values share one label, `<rule> (other values)`.
    pub metric_values_per_rule: usize,
    /// How many runtime limits operators may set.
    pub runtime_limits: RuntimeLimitsSettings,
    /// The algorithm of runtime limits that name none (`rules.default_algorithm`).
    pub default_algorithm: crate::algorithm::Algorithm,
}

/// A rule's value that matches many (`partner-*`, `cidr:10.0.0.0/8`), not one.
fn is_pattern(value: &str) -> bool {
    value.contains('*') || value.starts_with("cidr:")
}

impl Options {
    /// How a request or rule value appears in counter keys, metric labels, `/debug/top` and `/rlconfig`:
    /// hashed when sensitive, as it is otherwise.
    fn show<'a>(&self, key: &str, value: &'a str, hash_value: bool) -> Cow<'a, str> {
        match &self.sensitive {
            Some(s) => s.show(key, value, hash_value),
            None => value.into(),
        }
    }

    /// How a value written in a rules file appears in metric labels, statsd names and `/rlconfig`: as
    /// [`Self::show`] says, but a wildcard or `cidr:` pattern as written: it is no one's value, and the
    /// same pattern under a key that is not hashed, or one shared by `share_threshold`, shows as written.
    fn show_written<'a>(&self, key: &str, value: &'a str, hash_value: bool) -> Cow<'a, str> {
        if is_pattern(value) {
            return value.into();
        }
        self.show(key, value, hash_value)
    }

    /// Whether [`Self::show_written`] hides this written value.
    fn hides_written(&self, key: &str, value: &str, hash_value: bool) -> bool {
        !value.is_empty() && !is_pattern(value) && self.is_sensitive(key, hash_value)
    }

    /// Whether values of this key are hashed before they are shown.
    fn is_sensitive(&self, key: &str, hash_value: bool) -> bool {
        self.sensitive
            .as_ref()
            .is_some_and(|s| s.is_sensitive(key, hash_value))
    }
}

/// The part of an answer's time reserved for sending it: the store stops waiting this long before the
/// answer is due, 10 ms plus a tenth of the time left for the trip back and a late timer, at most 100 ms
/// and never more than half of the time left (Envoy's default 20 ms: the store waits 10 ms).
fn answer_margin(left: Duration) -> Duration {
    (Duration::from_millis(10) + left / 10)
        .min(Duration::from_millis(100))
        .min(left / 2)
}

/// Per-request bookkeeping, on the stack for requests of up to eight descriptors.
type Small<T> = SmallVec<[T; 8]>;

/// The requests being decided, bounded by `overload.max_in_flight`. Requests past the bound are refused,
/// never queued, so a counter is all it takes: no waiters to wake when one ends.
#[derive(Debug)]
struct InFlight {
    count: AtomicUsize,
    max: usize,
}

impl InFlight {
    fn new(max: usize) -> Self {
        Self {
            count: AtomicUsize::new(0),
            max: max.max(1),
        }
    }

    /// A place among the requests being decided, held until the guard drops; `None` when all are taken.
    fn enter(&self) -> Option<InFlightGuard<'_>> {
        self.count
            .fetch_update(Ordering::Acquire, Ordering::Relaxed, |n| {
                (n < self.max).then_some(n + 1)
            })
            .ok()
            .map(|_| InFlightGuard(self))
    }
}

/// One request being decided.
struct InFlightGuard<'a>(&'a InFlight);

impl Drop for InFlightGuard<'_> {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::Release);
    }
}

/// `future`'s output, unless `deadline` passes first. It is polled once before any timer is armed: a
/// decision the store answers at once (the memory store) never touches the timer wheel.
async fn before<F: Future>(
    deadline: tokio::time::Instant,
    mut future: Pin<&mut F>,
) -> Option<F::Output> {
    if let Poll::Ready(output) = poll_fn(|cx| Poll::Ready(future.as_mut().poll(cx))).await {
        return Some(output);
    }
    tokio::time::timeout_at(deadline, future).await.ok()
}

/// Decides requests against the current rules and a store.
#[derive(Debug)]
pub struct Limiter {
    rules: Arc<Rules>,
    /// The store, with the deny cache in front when it is on.
    store: DenyCached<Backend>,
    clock: Clock,
    options: Options,
    series: Series,
    in_flight: InFlight,
    /// The runtime limits operators set, as this replica last read them.
    runtime: runtime::RuntimeLimits,
    /// The store itself, for the operators' API (requests go through `store`).
    shared: Arc<Store>,
}

impl Limiter {
    pub fn new(rules: Arc<Rules>, store: Arc<Store>, clock: Clock, options: Options) -> Self {
        let series = Series::new(&options.metrics, options.on_backend_error);
        let shared = store.clone();
        let backend = Backend::new(
            store,
            options.on_backend_error,
            options.fallback.clone(),
            &options.metrics,
        );
        let store = DenyCached::new(backend, options.deny_cache.clone());
        let in_flight = InFlight::new(options.overload.max_in_flight);
        Self {
            rules,
            store,
            clock,
            options,
            series,
            in_flight,
            runtime: runtime::RuntimeLimits::default(),
            shared,
        }
    }

    /// The rules loaded now (`None`: none ever were).
    pub fn rules_snapshot(&self) -> Option<Arc<RuleSet>> {
        self.rules.snapshot()
    }

    /// `rules`, one line each, sensitive values hashed: what `/rlconfig` shows.
    pub fn describe_rules(&self, rules: &RuleSet) -> Vec<String> {
        rules.describe_with(&|key, value, hashed| {
            self.options.show_written(key, value, hashed).into_owned()
        })
    }

    /// The warnings of [`RuleSet::unreachable`] for `rules` against this service's request bounds,
    /// rules named as `/rlconfig` names them (sensitive values hashed).
    pub fn unreachable_rules(&self, rules: &RuleSet) -> Vec<String> {
        let bounds = self.options.request_limits.entry_bounds();
        rules.unreachable_with(bounds, &|key, value, hashed| {
            self.options.show_written(key, value, hashed).into_owned()
        })
    }

    /// Decides one request that carries no deadline of its own, and records it in the metrics.
    pub async fn should_rate_limit(&self, request: &Request) -> Result<Response, LimitError> {
        self.should_rate_limit_by(request, None).await
    }

    /// Decides one request whose answer is due within `timeout` from now (the caller's deadline, when it
    /// sent one), and records it in the metrics. The store is waited for until shortly before the answer
    /// is due; then the `on_backend_error` policy answers.
    pub async fn should_rate_limit_by(
        &self,
        request: &Request,
        timeout: Option<Duration>,
    ) -> Result<Response, LimitError> {
        // One reading of the clock for the answer's time and its deadline.
        let started = tokio::time::Instant::now();
        let due = timeout.map(|timeout| started + timeout);
        let result = match self.in_flight.enter() {
            // Past the bound, answering at once beats queueing: the caller's own deadline would pass
            // anyway, and the queue would only grow.
            None => Err(LimitError::Overloaded {
                max: self.options.overload.max_in_flight,
            }),
            Some(_in_flight) => {
                let limit = self.options.overload.deadline;
                let answer_by = due.map_or(started + limit, |due| due.min(started + limit));
                let left = answer_by.saturating_duration_since(started);
                let store_deadline = Deadline {
                    at: answer_by - answer_margin(left),
                    from_caller: due.is_some(),
                };
                let decision = pin!(self.decide(request, store_deadline));
                before(started + limit, decision)
                    .await
                    .unwrap_or(Err(LimitError::Deadline(limit)))
            }
        };
        self.record_answer(&result, started.elapsed());
        result
    }

    /// The limits of the request's descriptors in the current rules and runtime limits. Without runtime
    /// limits in the request's domain, looking for them costs one map lookup in a table, if there is one.
    /// (Not part of `decide`, so that its locals are no part of every request's future.)
    fn resolve<'a>(
        &'a self,
        request: &Request,
        rules: &'a Option<Arc<RuleSet>>,
        runtime: &'a Option<Arc<runtime::Table>>,
    ) -> Result<Small<Resolved<'a>>, LimitError> {
        let rules = rules.as_deref().ok_or(LimitError::NoRules)?;
        let domain = rules.domains.get(&request.domain);
        if domain.is_none() {
            self.record_unknown_domain(request.descriptors.len());
        }
        let lookup = runtime
            .as_deref()
            .and_then(|table| table.domain(&request.domain))
            .map(|limits| plan::RuntimeLookup {
                limits,
                options: &self.options,
                now_ms: self.clock.now_millis(),
            });
        let mut resolved = plan::resolve(domain, request, lookup.as_ref())?;
        if self.options.quota_mode {
            plan::global_quota_mode(&mut resolved);
        }
        Ok(resolved)
    }

    async fn decide(&self, request: &Request, deadline: Deadline) -> Result<Response, LimitError> {
        plan::validate(request, &self.options.request_limits)?;
        // Both held until the answer: the limits resolved borrow from them.
        let rules = self.rules.current();
        let runtime = self.runtime.load();
        let resolved = self.resolve(request, &rules, &runtime)?;
        let batch = plan::recycled_batch(request, &resolved, &self.options);

        // The checks the local deny cache answered, for their metrics.
        let mut from_cache: Small<bool> = smallvec![false; batch.checks.len()];
        let applied = if batch.checks.is_empty() {
            None
        } else {
            let now_ms = self.clock.now_millis();
            let applied = self
                .store
                .apply_marking(&batch, now_ms, deadline, &mut from_cache)
                .await;
            match applied {
                Ok(applied) => Some(applied),
                Err(err) => return self.backend_failed(err, &resolved, &batch),
            }
        };
        let denied = applied.as_ref().is_some_and(|a| a.denied);
        let outcomes = applied.as_ref().map_or(&[][..], |a| &a.outcomes[..]);

        let decided = status::choose(&resolved, outcomes, &from_cache);
        self.record_decision(request, &decided.verdicts, denied);
        Ok(decided.into_response(&resolved, &self.options, denied))
    }

    /// The answer when the store cannot decide, by the `on_backend_error` policy: the error itself, every
    /// limited descriptor allowed (reported without a limit, since nothing was counted), or every
    /// enforced descriptor denied.
    fn backend_failed(
        &self,
        err: StoreError,
        resolved: &[Resolved<'_>],
        batch: &Batch,
    ) -> Result<Response, LimitError> {
        self.record_backend_failure(&err);
        let deny = match self.options.on_backend_error {
            // `local` without a fallback store (a store that is itself local) answers like `error`.
            OnBackendError::Error | OnBackendError::Local => return Err(LimitError::Store(err)),
            OnBackendError::Allow => false,
            OnBackendError::Deny => true,
        };
        let denied = deny && batch.is_denied(|_| false);
        Ok(Response {
            overall_code: status::overall(denied, self.options.shadow_mode),
            statuses: status::undecided(resolved, deny),
            response_headers: Vec::new(),
        })
    }

    /// The bounds on a request's size.
    pub fn request_limits(&self) -> &RequestLimits {
        &self.options.request_limits
    }

    /// The sketch behind `/debug/top`.
    pub fn top_offenders(&self) -> &TopOffenders {
        &self.options.top
    }
}

#[cfg(test)]
mod tests;
