//! Deciding a request: descriptors -> matched rules -> one batch of checks -> the store -> statuses,
//! overall code and headers.
//!
//! The request and response types here are the domain's own; the API layer converts the wire types at
//! the edge. Shadow mode, quota mode, unlimited rules, `replaces` and request overrides are applied here,
//! with the reference service's semantics.

mod backend;
mod headers;
mod sensitive;
mod types;

use backend::Backend;
pub use backend::Fallback;
pub use sensitive::Sensitive;
pub use types::{
    Code, CurrentLimit, Descriptor, DescriptorStatus, Entry, LimitError, LimitOverride, Request,
    Response,
};

use std::{
    borrow::Cow,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use smallvec::{smallvec, SmallVec};

use crate::{
    algorithm::{Algorithm, Params},
    clock::Clock,
    rules::{Node, PathStep, Rules, Unit},
    settings::{HeaderNames, OnBackendError, OverloadSettings, RequestLimits, ResponseHeaders},
    store::{
        deny_cache::DenyCached, keys, Batch, Check, Deadline, DenyCache, Outcome, Role, Store,
        StoreError,
    },
    telemetry::{
        metrics::{Histogram, RuleCounters},
        Metrics, TopOffenders,
    },
};

/// Everything that shapes decisions besides rules and counters.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Prepended to every counter key (`CACHE_KEY_PREFIX`).
    pub key_prefix: String,
    /// Global shadow mode: the overall code is always OK.
    pub shadow_mode: bool,
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

thread_local! {
    static SCRATCH: std::cell::Cell<String> = const { std::cell::Cell::new(String::new()) };
}

/// Per-request bookkeeping, on the stack for requests of up to eight descriptors.
type Small<T> = SmallVec<[T; 8]>;

/// Decides requests against the current rules and a store.
#[derive(Debug)]
pub struct Limiter {
    rules: Arc<Rules>,
    /// The store, with the deny cache in front when it is on.
    store: DenyCached<Backend>,
    clock: Clock,
    options: Options,
    series: Series,
    /// One permit per request being decided.
    in_flight: tokio::sync::Semaphore,
}

/// The metric series every request updates, held so that recording them looks nothing up.
#[derive(Debug)]
struct Series {
    check_duration: Arc<Histogram>,
    requests_ok: Arc<AtomicU64>,
    requests_over_limit: Arc<AtomicU64>,
    requests_error: Arc<AtomicU64>,
}

impl Series {
    fn new(metrics: &Metrics) -> Self {
        let requests = |result: &str| {
            metrics.counter(
                "ratelimitd_requests_total",
                "ShouldRateLimit requests, by answer.",
                vec![("result", result.to_string())],
            )
        };
        Self {
            check_duration: metrics.histogram(
                "rate_limit_check_duration_seconds",
                "Time to decide one ShouldRateLimit request.",
                Vec::new(),
            ),
            requests_ok: requests("ok"),
            requests_over_limit: requests("over_limit"),
            requests_error: requests("error"),
        }
    }
}

/// One limit a descriptor is checked against.
struct Applicable {
    limit: CurrentLimit,
    params: Params,
    /// Position of the limit in its rule (0 for `rate_limit` and for overrides).
    index: usize,
}

/// What a descriptor resolved to before counting.
enum Resolved<'a> {
    NoLimit,
    /// An unlimited rule: never counted, but its `replaces` still apply.
    Unlimited(&'a Node),
    Limited {
        limits: SmallVec<[Applicable; 2]>,
        /// The rule, when the limits came from one (not from a request override).
        node: Option<&'a Node>,
        role: Role,
    },
}

impl Limiter {
    pub fn new(rules: Arc<Rules>, store: Arc<Store>, clock: Clock, options: Options) -> Self {
        let series = Series::new(&options.metrics);
        let backend = Backend::new(
            store,
            options.on_backend_error,
            options.fallback.clone(),
            &options.metrics,
        );
        let store = DenyCached::new(backend, options.deny_cache.clone());
        let in_flight = tokio::sync::Semaphore::new(
            options
                .overload
                .max_in_flight
                .clamp(1, tokio::sync::Semaphore::MAX_PERMITS),
        );
        Self {
            rules,
            store,
            clock,
            options,
            series,
            in_flight,
        }
    }

    /// The loaded rules, one line each, sensitive values hashed: what `/rlconfig` shows.
    pub fn describe_rules(&self) -> Vec<String> {
        let Some(rules) = self.rules.snapshot() else {
            return Vec::new();
        };
        rules
            .describe_with(&|key, value, hashed| self.options.show(key, value, hashed).into_owned())
    }

    /// Decides one request that carries no deadline of its own, and records it in the metrics.
    pub async fn should_rate_limit(&self, request: &Request) -> Result<Response, LimitError> {
        self.should_rate_limit_by(request, None).await
    }

    /// Decides one request whose answer is due at `due` (the caller's deadline, when it sent one), and
    /// records it in the metrics. The store is waited for until shortly before the answer is due; then
    /// the `on_backend_error` policy answers.
    pub async fn should_rate_limit_by(
        &self,
        request: &Request,
        due: Option<tokio::time::Instant>,
    ) -> Result<Response, LimitError> {
        let started = std::time::Instant::now();
        let result = match self.in_flight.try_acquire() {
            // Past the bound, answering at once beats queueing: the caller's own deadline would pass
            // anyway, and the queue would only grow.
            Err(_) => Err(LimitError::Overloaded {
                max: self.options.overload.max_in_flight,
            }),
            Ok(_permit) => {
                let limit = self.options.overload.deadline;
                let now = tokio::time::Instant::now();
                let answer_by = due.map_or(now + limit, |due| due.min(now + limit));
                let left = answer_by.saturating_duration_since(now);
                let store_deadline = Deadline {
                    at: answer_by - answer_margin(left),
                    from_caller: due.is_some(),
                };
                tokio::time::timeout(limit, self.decide(request, store_deadline))
                    .await
                    .unwrap_or(Err(LimitError::Deadline(limit)))
            }
        };
        self.series.check_duration.observe(started.elapsed());
        let requests = match &result {
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
                self.options.metrics.count(
                    "ratelimitd_request_errors_total",
                    "Requests answered with an error, by kind.",
                    vec![("kind", kind.to_string())],
                    1,
                );
                &self.series.requests_error
            }
        };
        requests.fetch_add(1, Ordering::Relaxed);
        result
    }

    async fn decide(&self, request: &Request, deadline: Deadline) -> Result<Response, LimitError> {
        self.validate(request)?;
        let rules = self.rules.snapshot().ok_or(LimitError::NoRules)?;
        let domain = rules.domains.get(&request.domain);
        if domain.is_none() {
            // No domain label: request domains are not bounded by the rules.
            self.options.metrics.count(
                "ratelimit_service_rate_limit_domain_not_found",
                "Requests for a domain no rules file declares.",
                Vec::new(),
                1,
            );
        }

        let mut resolved: Small<Resolved<'_>> = Small::new();
        for (index, descriptor) in request.descriptors.iter().enumerate() {
            let Some(domain) = domain else {
                resolved.push(Resolved::NoLimit);
                continue;
            };
            if let Some(over) = &descriptor.limit {
                let unit = over.unit.ok_or(LimitError::UnknownOverrideUnit { index })?;
                let limit = u64::from(over.requests_per_unit);
                resolved.push(Resolved::Limited {
                    limits: smallvec![Applicable {
                        limit: CurrentLimit {
                            requests_per_unit: over.requests_per_unit,
                            unit,
                            name: None,
                        },
                        params: Params {
                            algorithm: Algorithm::FixedWindow,
                            limit,
                            window_ms: unit.seconds() * 1000,
                            burst: limit,
                        },
                        index: 0,
                    }],
                    node: None,
                    role: Role::Enforce,
                });
                continue;
            }
            let node = domain.find(&descriptor.entries);
            resolved.push(match node {
                None => Resolved::NoLimit,
                Some(node) if node.limits.is_empty() => Resolved::NoLimit,
                Some(node) if node.limits[0].unlimited => Resolved::Unlimited(node),
                Some(node) => Resolved::Limited {
                    limits: node
                        .limits
                        .iter()
                        .enumerate()
                        .map(|(index, limit)| Applicable {
                            limit: CurrentLimit {
                                requests_per_unit: limit.requests_per_unit,
                                unit: limit.unit,
                                name: limit.name.clone(),
                            },
                            params: limit.params(),
                            index,
                        })
                        .collect(),
                    node: Some(node),
                    role: if node.flags.shadow_mode {
                        Role::Shadow
                    } else if node.flags.quota_mode {
                        Role::Quota
                    } else {
                        Role::Enforce
                    },
                },
            });
        }
        apply_replaces(&mut resolved);

        let mut batch = Batch {
            checks: Vec::with_capacity(resolved.len()),
            consume_on_deny: self.options.consume_on_deny,
            known_denied: false,
        };
        for (descriptor, r) in request.descriptors.iter().zip(&resolved) {
            if let Resolved::Limited { limits, node, role } = r {
                let path = node.map_or(&[][..], |n| &n.path[..]);
                let shared = |i: usize| path.get(i).and_then(PathStep::shared_value);
                // Values as they go into counter keys: shared patterns, or hashes of sensitive values.
                let values: Small<std::borrow::Cow<'_, str>> = descriptor
                    .entries
                    .iter()
                    .enumerate()
                    .map(|(i, e)| match shared(i) {
                        Some(pattern) => pattern.into(),
                        None => self.options.show(&e.key, &e.value, hashed_at(path, i)),
                    })
                    .collect();
                let cost = descriptor
                    .hits_addend
                    .unwrap_or(u64::from(request.hits_addend.max(1)));
                let key_len = self.options.key_prefix.len()
                    + request.domain.len()
                    + descriptor
                        .entries
                        .iter()
                        .map(|e| e.key.len())
                        .sum::<usize>()
                    + values.iter().map(|v| v.len()).sum::<usize>()
                    + 2 * descriptor.entries.len()
                    + 48;
                for applicable in limits {
                    let mut key = String::with_capacity(key_len);
                    keys::limit_key(
                        &mut key,
                        &self.options.key_prefix,
                        &request.domain,
                        descriptor
                            .entries
                            .iter()
                            .zip(&values)
                            .map(|(e, v)| (e.key.as_str(), v.as_ref())),
                        applicable.params.algorithm,
                        applicable.params.window_ms / 1000,
                        applicable.index,
                    );
                    batch.checks.push(Check {
                        key,
                        params: applicable.params,
                        cost,
                        role: *role,
                        per_second: applicable.limit.unit == Unit::Second,
                    });
                }
            }
        }

        let now_ms = self.clock.now_millis();
        // Checks the local deny cache answered: the request is then denied for sure.
        let mut from_cache: Small<bool> = smallvec![false; batch.checks.len()];
        let applied = if batch.checks.is_empty() {
            None
        } else {
            match self
                .store
                .apply_marking(&batch, now_ms, deadline, &mut from_cache)
                .await
            {
                Ok(applied) => Some(applied),
                Err(err) => return self.backend_failed(err, resolved, &batch),
            }
        };
        // Descriptors answered (at least partly) from the local cache, for their metrics.
        let mut cached_descriptors: Small<bool> = smallvec![false; request.descriptors.len()];
        {
            let mut check = 0;
            for (d, r) in resolved.iter().enumerate() {
                if let Resolved::Limited { limits, .. } = r {
                    for _ in limits {
                        if from_cache.get(check).copied().unwrap_or(false) {
                            cached_descriptors[d] = true;
                        }
                        check += 1;
                    }
                }
            }
        }

        let mut outcomes = applied.iter().flat_map(|a| a.outcomes.iter());
        let roles: Small<Option<Role>> = resolved
            .iter()
            .map(|r| match r {
                Resolved::Limited { role, .. } => Some(*role),
                _ => None,
            })
            .collect();
        // The `hash_value` levels of each descriptor's rule, for naming offenders.
        let hashed_by_index: Small<&[PathStep]> = resolved
            .iter()
            .map(|r| match r {
                Resolved::Limited { node: Some(n), .. } => &n.path[..],
                _ => &[][..],
            })
            .collect();
        // Window length of each limited status's limit, in order, for the IETF policy header.
        let mut windows: Small<u64> = Small::new();
        // (descriptor index, rule label, role, chosen limit, outcome) for the per-rule metrics.
        let mut stats: Small<(usize, RuleLabel<'_>, Role, u64, Outcome)> = Small::new();
        let statuses: Vec<DescriptorStatus> = resolved
            .into_iter()
            .enumerate()
            .map(|(index, r)| match r {
                Resolved::NoLimit => DescriptorStatus::no_limit(),
                Resolved::Unlimited(_) => DescriptorStatus::unlimited(),
                Resolved::Limited { limits, role, node } => {
                    // The descriptor's status is its limit closest to denying: a denying one (the
                    // longest wait first), else the one with the least quota left.
                    let mut chosen: Option<(CurrentLimit, Outcome)> = None;
                    let mut chosen_window = 0;
                    for applicable in limits {
                        let Some(outcome) = outcomes.next().copied() else {
                            break;
                        };
                        let window = applicable.params.window_ms / 1000;
                        let closer = chosen.as_ref().is_none_or(|(_, best)| {
                            match (outcome.allowed, best.allowed) {
                                (false, true) => true,
                                (false, false) => outcome.retry_after > best.retry_after,
                                (true, true) => outcome.remaining < best.remaining,
                                (true, false) => false,
                            }
                        });
                        if closer {
                            chosen = Some((applicable.limit, outcome));
                            chosen_window = window;
                        }
                    }
                    windows.push(chosen_window);
                    match chosen {
                        None => DescriptorStatus::no_limit(),
                        Some((limit, outcome)) => {
                            let label = rule_label(
                                node,
                                &request.domain,
                                &request.descriptors[index],
                                &self.options,
                            );
                            stats.push((
                                index,
                                label,
                                role,
                                u64::from(limit.requests_per_unit),
                                outcome,
                            ));
                            let over = !outcome.allowed && role != Role::Shadow;
                            DescriptorStatus {
                                code: if over { Code::OverLimit } else { Code::Ok },
                                current_limit: Some(limit),
                                limit_remaining: u32::try_from(outcome.remaining)
                                    .unwrap_or(u32::MAX),
                                duration_until_reset: Some(outcome.reset_after),
                                retry_after: (!outcome.allowed).then_some(outcome.retry_after),
                            }
                        }
                    }
                }
            })
            .collect();

        let denied = applied.as_ref().is_some_and(|a| a.denied);
        let consumed = !denied || self.options.consume_on_deny;
        for (index, rule, role, limit, outcome) in stats {
            let descriptor = &request.descriptors[index];
            let hits = descriptor
                .hits_addend
                .unwrap_or(u64::from(request.hits_addend.max(1)));
            if !outcome.allowed && role != Role::Shadow {
                let mut name = SCRATCH.take();
                self.offender_name(
                    &mut name,
                    &request.domain,
                    descriptor,
                    index,
                    &hashed_by_index,
                );
                self.options.top.denied(&name);
                SCRATCH.set(name);
            }
            let counters = match rule.request_values_of {
                // Request values in the label: at most so many series per rule, then one for the rest.
                Some(written) => self.options.metrics.rule_within(
                    &request.domain,
                    &rule.text,
                    written,
                    self.options.metric_values_per_rule,
                ),
                None => self.options.metrics.rule(&request.domain, &rule.text),
            };
            self.record_rule(
                &counters,
                role,
                limit,
                hits,
                &outcome,
                consumed,
                cached_descriptors[index],
            );
        }
        let overall_code = if denied && !self.options.shadow_mode {
            Code::OverLimit
        } else {
            Code::Ok
        };
        if denied && self.options.shadow_mode {
            self.options.metrics.count(
                "ratelimit_service_global_shadow_mode",
                "Requests answered OK only because of global shadow mode.",
                Vec::new(),
                1,
            );
        }
        let response_headers = headers::build(
            self.options.response_headers,
            &self.options.header_names,
            &statuses,
            &roles,
            &windows,
            overall_code,
        );
        Ok(Response {
            overall_code,
            statuses,
            response_headers,
        })
    }

    /// The answer when the store cannot decide, by the `on_backend_error` policy: the error itself, every
    /// limited descriptor allowed (reported without a limit, since nothing was counted), or every
    /// enforced descriptor denied.
    fn backend_failed(
        &self,
        err: StoreError,
        resolved: Small<Resolved<'_>>,
        batch: &Batch,
    ) -> Result<Response, LimitError> {
        tracing::debug!(error = %err, policy = ?self.options.on_backend_error, "backend failed");
        let deny = match self.options.on_backend_error {
            // `local` without a fallback store (a store that is itself local) answers like `error`.
            OnBackendError::Error | OnBackendError::Local => return Err(LimitError::Store(err)),
            OnBackendError::Allow => false,
            OnBackendError::Deny => true,
        };
        let statuses: Vec<DescriptorStatus> = resolved
            .into_iter()
            .map(|r| match r {
                Resolved::NoLimit => DescriptorStatus::no_limit(),
                Resolved::Unlimited(_) => DescriptorStatus::unlimited(),
                Resolved::Limited {
                    mut limits, role, ..
                } if deny && role != Role::Shadow => DescriptorStatus {
                    code: Code::OverLimit,
                    current_limit: Some(limits.swap_remove(0).limit),
                    limit_remaining: 0,
                    duration_until_reset: None,
                    retry_after: None,
                },
                Resolved::Limited { .. } => DescriptorStatus::no_limit(),
            })
            .collect();
        let denied = deny && batch.is_denied(|_| false);
        Ok(Response {
            overall_code: if denied && !self.options.shadow_mode {
                Code::OverLimit
            } else {
                Code::Ok
            },
            statuses,
            response_headers: Vec::new(),
        })
    }

    /// How a denied descriptor is named in `/debug/top`: the domain, then `key=value` entries, sensitive
    /// values hashed.
    fn offender_name(
        &self,
        out: &mut String,
        domain: &str,
        descriptor: &Descriptor,
        index: usize,
        hashed_by_index: &[&[PathStep]],
    ) {
        let path = hashed_by_index.get(index).copied().unwrap_or_default();
        out.clear();
        out.push_str(domain);
        for (i, e) in descriptor.entries.iter().enumerate() {
            let value = self.options.show(&e.key, &e.value, hashed_at(path, i));
            out.push(' ');
            out.push_str(&e.key);
            out.push('=');
            out.push_str(&value);
        }
    }

    /// The bounds on a request's size.
    pub fn request_limits(&self) -> &RequestLimits {
        &self.options.request_limits
    }

    /// The sketch behind `/debug/top`.
    pub fn top_offenders(&self) -> &TopOffenders {
        &self.options.top
    }

    /// The reference service's per-rule counters for one descriptor (hits, not requests).
    #[allow(clippy::too_many_arguments)]
    fn record_rule(
        &self,
        counters: &RuleCounters,
        role: Role,
        limit: u64,
        hits: u64,
        outcome: &Outcome,
        consumed: bool,
        from_cache: bool,
    ) {
        let add = |c: &std::sync::atomic::AtomicU64, n: u64| {
            c.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        };
        add(&counters.total_hits, hits);
        if !outcome.allowed {
            add(&counters.over_limit, hits);
            add(&counters.exceeded, 1);
            if role == Role::Shadow {
                add(&counters.shadow_mode, hits);
            }
            if from_cache {
                add(&counters.over_limit_with_local_cache, hits);
            }
        } else if consumed {
            add(&counters.within_limit, hits);
            let after = limit.saturating_sub(outcome.remaining);
            let before = after.saturating_sub(hits);
            let threshold = (limit as f64 * self.options.near_limit_ratio).floor() as u64;
            if after > threshold {
                add(
                    &counters.near_limit,
                    if before >= threshold {
                        hits
                    } else {
                        after - threshold
                    },
                );
            }
        }
    }

    fn validate(&self, request: &Request) -> Result<(), LimitError> {
        if request.domain.is_empty() {
            return Err(LimitError::EmptyDomain);
        }
        if request.descriptors.is_empty() {
            return Err(LimitError::NoDescriptors);
        }
        let limits = &self.options.request_limits;
        // The message is built only for a request that breaks a limit.
        let check =
            |actual: usize, max: usize, setting: &'static str, what: &dyn Fn() -> String| {
                if actual > max {
                    Err(LimitError::TooLarge {
                        what: what(),
                        actual,
                        max,
                        setting,
                    })
                } else {
                    Ok(())
                }
            };
        check(
            request.descriptors.len(),
            limits.max_descriptors,
            "request_limits.max_descriptors",
            &|| "the number of descriptors".into(),
        )?;
        for (i, d) in request.descriptors.iter().enumerate() {
            if d.limit.is_some() && !limits.allow_overrides {
                return Err(LimitError::OverrideRefused { index: i });
            }
            check(
                d.entries.len(),
                limits.max_entries,
                "request_limits.max_entries",
                &|| format!("the number of entries of descriptor {i}"),
            )?;
            for (j, e) in d.entries.iter().enumerate() {
                check(
                    e.key.len(),
                    limits.max_key_bytes,
                    "request_limits.max_key_bytes",
                    &|| format!("the key length of descriptor {i} entry {j}"),
                )?;
                check(
                    e.value.len(),
                    limits.max_value_bytes,
                    "request_limits.max_value_bytes",
                    &|| format!("the value length of descriptor {i} entry {j}"),
                )?;
            }
        }
        Ok(())
    }
}

/// The `rule` metric label of a descriptor.
struct RuleLabel<'a> {
    text: std::borrow::Cow<'a, str>,
    /// When the label carries request values: the rule's path as written, under which the number of
    /// such labels is bounded.
    request_values_of: Option<&'a str>,
}

impl<'a> From<&'a str> for RuleLabel<'a> {
    fn from(text: &'a str) -> Self {
        Self {
            text: text.into(),
            request_values_of: None,
        }
    }
}

/// The `rule` metric label of a descriptor: its rule's path (`key_value.key`...), with request values only
/// where the rule asks for them (`detailed_metric` on the matched rule, `value_to_metric` on a level
/// matched by its key or a wildcard), sensitive values hashed. Every override is labelled `override`: its
/// entry keys are the caller's to choose, so they never become label values.
fn rule_label<'a>(
    node: Option<&'a Node>,
    domain: &str,
    descriptor: &Descriptor,
    options: &Options,
) -> RuleLabel<'a> {
    let Some(node) = node else {
        return "override".into();
    };
    let written = node
        .full_key
        .strip_prefix(domain)
        .and_then(|p| p.strip_prefix('.'))
        .unwrap_or(&node.full_key);
    // Most rules: the path as written, borrowed from the rule without building anything.
    {
        let written_sensitive = node.path.iter().any(|step| {
            !step.value.is_empty() && options.is_sensitive(&step.key, step.flags.hash_value)
        });
        let any_to_metric = node.path.iter().any(|step| step.flags.value_to_metric);
        if !node.flags.detailed_metric && !any_to_metric && !written_sensitive {
            return written.into();
        }
    }
    let mut from_any_request_value = false;
    let mut parts = Vec::with_capacity(node.path.len());
    for (i, step) in node.path.iter().enumerate() {
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
            format!("{key}_{}", options.show(key, value, hashed))
        });
    }
    RuleLabel {
        text: parts.join(".").into(),
        request_values_of: from_any_request_value.then_some(written),
    }
}

/// Whether the rule says `hash_value` at level `i` of its path (no path: a request override).
fn hashed_at(path: &[PathStep], i: usize) -> bool {
    path.get(i).is_some_and(|step| step.flags.hash_value)
}

/// Drops every matched limit whose name another matched limit of the same request replaces
/// (unlimited limits replace too). Overrides have no name and are never replaced.
fn apply_replaces(resolved: &mut [Resolved<'_>]) {
    let replaced: Vec<Arc<str>> = resolved
        .iter()
        .filter_map(|r| match r {
            Resolved::Unlimited(node)
            | Resolved::Limited {
                node: Some(node), ..
            } => Some(node),
            _ => None,
        })
        .flat_map(|node| node.limits.iter())
        .flat_map(|limit| limit.replaces.iter().cloned())
        .collect();
    if replaced.is_empty() {
        return;
    }
    for r in resolved.iter_mut() {
        if let Resolved::Limited { limits, .. } = r {
            limits.retain(|a| a.limit.name.as_ref().is_none_or(|n| !replaced.contains(n)));
            if limits.is_empty() {
                *r = Resolved::NoLimit;
            }
        }
    }
}

#[cfg(test)]
mod tests;
