//! The rate limit quota service (RLQS): Envoys report how many requests each bucket allowed and denied,
//! and are assigned a quota per bucket that they enforce themselves, with no call on the request path.
//! One rule's limit is shared by every Envoy reporting a bucket of it, fairly by their recent demand, and
//! counted on the same counters `ShouldRateLimit` counts on.
//!
//! For each bucket of a report:
//! 1. the bucket is resolved as a descriptor against the rules (`limiter::bucket`): not limited (ALLOW_ALL),
//!    unlimited (ALLOW_ALL), a rule gone since the last report (abandon), or the rule's limits;
//! 2. the requests the Envoy allowed are added to the rule's counters, as admitted hits (what
//!    `ShouldRateLimit` callers of the same descriptor then see), and the counters say what is left;
//! 3. the bucket is recomputed in the store ([`share`], atomically: `share.lua` on Redis): the **pool**,
//!    the tokens per second its Envoys may share (the rule's rate `limit / window`, less the rate at which
//!    `ShouldRateLimit` callers spend a fixed window), and the members' grants, the reporting Envoy and
//!    every other Envoy this replica streams to for the bucket listed, so that a share freed by one is
//!    pushed to another at once; at most once per tenth of a report period on this replica ([`gather`]):
//!    the reports that come sooner wait for the next recomputation and are listed in it together;
//! 4. each listed Envoy whose assignment changed, and the reporter always, is sent its grant as a token
//!    bucket ([`strategy`]) with the TTL, on its stream.
//!
//! Every stream, bucket and member is bounded by [`RlqsSettings`]; a stream's work is its own task, and
//! all end when the server drains. A recomputation that reports wait for is a task of its own too, which
//! ends within a tenth of a report period and one store call; what it answers a stream that ended is
//! dropped, and such a stream's reports are not listed in it.
//!
//! # Layout
//! - `share`: the arithmetic of one bucket (pool, targets, grants), pure; `share.lua` mirrors it.
//! - `gather`: when a bucket is recomputed on this replica, and which reports wait for it.
//! - `state`: where the buckets live, in this process or in Redis.
//! - `strategy`: a grant as the token bucket Envoy enforces.
//! - `stream`: one Envoy's stream: its buckets, their demand, what was sent, the queue of actions.
//! - `stats`: the metrics by domain and rule, and why buckets went unanswered.
//! - `options`: the `rlqs.*` settings.

mod gather;
mod options;
pub mod share;
pub mod state;
mod stats;
pub mod strategy;
mod stream;

pub use options::RlqsSettings;
pub use state::Shares;
pub use strategy::{Strategy, TokenBucket};
pub use stream::{Actions, Stream};

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use self::{
    gather::{Gathers, Turn},
    share::{Call, DemandUpdate, Given, LimitUse, Listed, Listing, WindowUse},
    stats::{rule_series, Stats, Unanswered},
    stream::{BucketSlot, StreamInner, TrackedUsage},
};
use crate::{
    algorithm::Algorithm,
    clock::Clock,
    limiter::{BucketLimits, BucketRule, Limiter, OnBackendError},
    store::{Batch, CounterStore, Deadline, Outcome, Role, Store, StoreError},
    telemetry::Metrics,
};

/// A bucket's identity: its entries sorted by key (the order of a bucket id's map carries no meaning).
pub type BucketId = Vec<(String, String)>;

/// One bucket of a usage report.
#[derive(Debug, Clone, PartialEq)]
pub struct Usage {
    pub bucket: BucketId,
    /// The time the usage covers, as the Envoy says (whole seconds; zero in the report that creates the
    /// bucket).
    pub elapsed: Duration,
    pub allowed: u64,
    pub denied: u64,
}

/// One usage report of a stream.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Report {
    pub domain: String,
    pub usages: Vec<Usage>,
}

/// What an Envoy is told about one bucket.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Enforce `strategy` for `ttl_secs` seconds (unless told otherwise before).
    Assign { strategy: Strategy, ttl_secs: u64 },
    /// Forget the bucket: its rule is gone.
    Abandon,
}

/// One bucket's action, as a response carries it.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketAction {
    pub bucket: BucketId,
    pub action: Action,
}

/// Why a stream could not be opened.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum QuotaError {
    #[error("too many rate limit quota streams: {max} open (rlqs.max_streams)")]
    TooManyStreams { max: usize },
}

/// Why a usage report ends its stream.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ReportError {
    #[error("usage report domain of {len} bytes: at most {max} (request_limits.max_key_bytes)")]
    DomainTooLong { len: usize, max: usize },
    #[error("usage report for domain {got:?} on a stream of domain {first:?}: open one stream per domain")]
    DomainChanged { first: String, got: String },
}

/// A share counts for its TTL and this much more: Envoy starts the TTL when the assignment arrives.
const TTL_MARGIN: Duration = Duration::from_secs(1);

/// How long a share that comes down still counts at its old size before others may take what it gave
/// back: time for the lower assignment to reach its Envoy, which may enforce the old one until then.
/// Half a report period, at most a second: what it frees still goes out at the next reports.
fn hold(report_period: Duration) -> Duration {
    (report_period / 2).min(Duration::from_secs(1))
}

/// What the quota service needs from the rest of the server.
#[derive(Debug)]
pub struct QuotaParts {
    pub limiter: Arc<Limiter>,
    /// The counters, shared with `ShouldRateLimit`.
    pub store: Arc<Store>,
    pub shares: Shares,
    pub settings: RlqsSettings,
    pub on_backend_error: OnBackendError,
    /// Longest wait for the store.
    pub store_wait: Duration,
    pub clock: Clock,
    pub metrics: Arc<Metrics>,
}

/// The rate limit quota service of this replica.
#[derive(Debug)]
pub struct Quota {
    parts: QuotaParts,
    /// Random per process: member ids of different replicas never meet.
    replica: String,
    next_stream: AtomicU64,
    open_streams: AtomicUsize,
    /// Buckets tracked over all streams, bounded by `rlqs.max_buckets`.
    tracked_buckets: AtomicUsize,
    /// The streams of this replica by the buckets they report: whom a recomputation can push to.
    local: Mutex<HashMap<String, Vec<LocalMember>>>,
    /// Reports that wait for their bucket's next recomputation here: one per tenth of a report period.
    gathers: Gathers<Reporter>,
    /// Seconds of its grant a token bucket holds: a tenth of the report period, from 100 ms (so that
    /// requests that arrive unevenly are not denied for it) to a second.
    burst: f64,
    stats: Stats,
}

/// What a bucket of a report is answered.
#[derive(Debug)]
pub(super) enum Decided {
    /// Now: the answer to queue (`None`: not answered).
    Now(Option<Answer>),
    /// When its bucket's next recomputation here settles it on the stream.
    Later,
}

/// The answer to a bucket's report.
#[derive(Debug)]
pub(super) enum Answer {
    /// An action to send as it is.
    Action(Action),
    /// A share of the bucket: made an assignment on the stream when it is queued, under the stream's
    /// lock, so that a newer share another recomputation pushed meanwhile is never replaced by it.
    Share {
        grant: f64,
        target: f64,
        version: u64,
    },
}

/// A report of a bucket, counted and waiting for the bucket's recomputation.
#[derive(Debug)]
struct Reporter {
    listed: Listed,
    stream: Arc<StreamInner>,
    slot: BucketSlot,
    /// The rule's limits, as its report left their counters.
    uses: Vec<LimitUse>,
}

/// The limits as a recomputation of several reports sees them: the last report's, each fixed window as
/// the report that saw it latest left it, with the hits every report added to that window.
fn merged_uses(reports: &[&[LimitUse]]) -> Vec<LimitUse> {
    let Some(last) = reports.last() else {
        return Vec::new();
    };
    let mut uses = last.to_vec();
    for (k, limit) in uses.iter_mut().enumerate() {
        let Some(mut latest) = limit.window else {
            continue;
        };
        // The same limit in the other reports (a reload may have changed the rule in between).
        let (rate, window_ms) = (limit.rate, latest.window_ms);
        let windows: Vec<WindowUse> = reports
            .iter()
            .filter_map(|r| r.get(k))
            .filter(|u| u.rate == rate)
            .filter_map(|u| u.window)
            .filter(|w| w.window_ms == window_ms)
            .collect();
        for w in &windows {
            if (w.start_ms, w.elapsed_ms) > (latest.start_ms, latest.elapsed_ms) {
                latest = *w;
            }
        }
        let mut merged = WindowUse {
            added: 0.0,
            ..latest
        };
        for w in windows.iter().filter(|w| w.start_ms == latest.start_ms) {
            merged.added += w.added;
            merged.used = merged.used.max(w.used);
        }
        limit.window = Some(merged);
    }
    uses
}

/// A bucket member this replica streams to.
#[derive(Debug, Clone)]
struct LocalMember {
    member: Arc<str>,
    stream: Arc<StreamInner>,
    slot: BucketSlot,
}

impl Quota {
    pub fn new(parts: QuotaParts) -> Arc<Self> {
        let stats = Stats::new(&parts.metrics);
        let quota = Arc::new(Self {
            replica: format!("{:08x}", rand::random::<u32>()),
            next_stream: AtomicU64::new(1),
            open_streams: AtomicUsize::new(0),
            tracked_buckets: AtomicUsize::new(0),
            local: Mutex::new(HashMap::new()),
            gathers: Gathers::new(
                (parts.settings.report_period / 10).max(Duration::from_millis(1)),
            ),
            burst: (parts.settings.report_period.as_secs_f64() / 10.0).clamp(0.1, 1.0),
            stats,
            parts,
        });
        quota.register_metrics();
        quota
    }

    /// The settings it runs with.
    pub fn settings(&self) -> &RlqsSettings {
        &self.parts.settings
    }

    /// Opens a stream for one Envoy; refused past `rlqs.max_streams`.
    pub fn open(self: &Arc<Self>) -> Result<Stream, QuotaError> {
        let max = self.parts.settings.max_streams;
        let before = self.open_streams.fetch_add(1, Ordering::AcqRel);
        if before >= max {
            self.open_streams.fetch_sub(1, Ordering::AcqRel);
            return Err(QuotaError::TooManyStreams { max });
        }
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        Ok(Stream::new(
            self.clone(),
            format!("{}-{id:x}", self.replica),
        ))
    }

    /// Housekeeping until `stop`, every report period: forgets buckets whose members have all expired
    /// (memory store), and the series of rules the rules no longer have.
    pub async fn maintain(&self, stop: tokio_util::sync::CancellationToken) {
        let every = self
            .parts
            .settings
            .report_period
            .max(Duration::from_millis(100));
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                () = tokio::time::sleep(every) => {
                    self.parts.shares.sweep();
                    self.gathers.sweep();
                    self.prune_rules();
                }
            }
        }
    }

    /// Longest a report's answers wait for one another before they go out: its buckets' next
    /// recomputations here and their store calls.
    fn answers_within(&self) -> Duration {
        self.gathers.every().saturating_add(self.parts.store_wait)
    }

    /// Takes one of the replica's `rlqs.max_buckets` for a stream's new bucket; false when none is left.
    fn take_bucket(&self) -> bool {
        let max = self.parts.settings.max_buckets;
        let before = self.tracked_buckets.fetch_add(1, Ordering::AcqRel);
        if before >= max {
            self.tracked_buckets.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        true
    }

    fn give_back_buckets(&self, n: usize) {
        self.tracked_buckets.fetch_sub(n, Ordering::AcqRel);
    }

    fn register_local(&self, key: &str, member: LocalMember) {
        let mut local = lock(&self.local);
        let members = local.entry(key.to_owned()).or_default();
        if !members
            .iter()
            .any(|m| m.member == member.member && Arc::ptr_eq(&m.stream, &member.stream))
        {
            members.push(member);
        }
    }

    fn unregister_local(&self, key: &str, member: &str) {
        let mut local = lock(&self.local);
        if let Some(members) = local.get_mut(key) {
            members.retain(|m| &*m.member != member);
            if members.is_empty() {
                local.remove(key);
            }
        }
    }

    /// The members of `key` this replica streams to that wait for a share, but for those in `except`
    /// (sorted): a recomputation can give them one (the others are recomputed at their own reports).
    fn locals(&self, key: &str, except: &[&str]) -> Vec<LocalMember> {
        let members: Vec<LocalMember> = lock(&self.local)
            .get(key)
            .map(|members| {
                members
                    .iter()
                    .filter(|m| except.binary_search(&&*m.member).is_err())
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        // Streams are locked one at a time, never under the registry's lock.
        members
            .into_iter()
            .filter(|m| m.stream.waits(&m.slot))
            .collect()
    }

    fn register_metrics(self: &Arc<Self>) {
        let metrics = &self.parts.metrics;
        let open = Arc::downgrade(self);
        metrics.gauge_fn(
            "ratelimitd_rlqs_streams",
            "Rate limit quota streams open on this replica (one per Envoy and domain).",
            Box::new(move || {
                let n = open
                    .upgrade()
                    .map_or(0, |q| q.open_streams.load(Ordering::Relaxed));
                vec![(Vec::new(), n as f64)]
            }),
        );
        let rules = &self.stats.rules;
        metrics.gauge_fn(
            "ratelimitd_rlqs_subscribers",
            "Envoys this replica streams to that report a bucket of the rule: subscribed, holding a share of it or waiting for one.",
            rule_series(rules, |s| lock(&s.live).0 as f64),
        );
        metrics.gauge_fn(
            "ratelimitd_rlqs_assigned_tokens_per_second",
            "Tokens per second assigned to the Envoys this replica streams to, by rule (sum over replicas: the fleet's).",
            rule_series(rules, |s| lock(&s.live).1.max(0.0)),
        );
        metrics.counter_fn(
            "ratelimitd_rlqs_allowed_total",
            "Requests Envoys reported allowed under the rule's buckets (charged to its counters too, up to what the assignments sent let an Envoy admit).",
            rule_series(rules, |s| s.allowed.load(Ordering::Relaxed) as f64),
        );
        metrics.counter_fn(
            "ratelimitd_rlqs_denied_total",
            "Requests Envoys reported denied under the rule's buckets.",
            rule_series(rules, |s| s.denied.load(Ordering::Relaxed) as f64),
        );
    }

    /// Drops the series of rules a rules reload removed.
    fn prune_rules(&self) {
        let limiter = &self.parts.limiter;
        self.stats.prune(|domain, path, form| {
            limiter.has_bucket_rule(domain, path, form).unwrap_or(true)
        });
    }

    /// Decides one bucket of a report.
    async fn decide(
        self: &Arc<Self>,
        stream: &Arc<StreamInner>,
        domain: &Arc<str>,
        usage: TrackedUsage,
    ) -> Decided {
        let rule = self.parts.limiter.resolve_bucket(domain, &usage.slot.1);
        let limits = match rule {
            BucketRule::NoRules => {
                self.stats.unanswered(Unanswered::NoRules);
                return Decided::Now(None);
            }
            BucketRule::Unmatched => {
                return Decided::Now(Some(Answer::Action(
                    if stream.forget_rule(&usage.slot, self) {
                        self.stats.abandoned.fetch_add(1, Ordering::Relaxed);
                        Action::Abandon
                    } else {
                        self.allow_all()
                    },
                )));
            }
            BucketRule::Unlimited { .. } => {
                stream.forget_rule(&usage.slot, self);
                return Decided::Now(Some(Answer::Action(self.allow_all())));
            }
            BucketRule::Limited(limits) => limits,
        };
        let rule_stats = self
            .stats
            .rule(domain, &limits.rule, &limits.rule_path, limits.rule_form);
        add_saturating(&rule_stats.allowed, usage.allowed);
        add_saturating(&rule_stats.denied, usage.denied);
        // A report is charged no more than the Envoy can have admitted: a buggy or hostile stream must
        // not spend the counters of `ShouldRateLimit` callers (or other Envoys) for them.
        let allowed = usage
            .admissible
            .map_or(usage.allowed, |most| usage.allowed.min(most));

        // One deadline for the report's counters and shares: a bucket is answered within it, or not.
        let deadline = Deadline::within(self.parts.store_wait);
        let (outcomes, clocks) = match self.charge(&limits, allowed, usage.covers, deadline).await {
            Ok(charged) => charged,
            Err(err) => {
                tracing::debug!(error = %err, "rate limit quota usage not counted");
                return Decided::Now(self.store_failed().map(Answer::Action));
            }
        };
        if limits.shadow {
            stream.forget_rule(&usage.slot, self);
            return Decided::Now(Some(Answer::Action(self.allow_all())));
        }
        let uses = limit_uses(
            &limits,
            &outcomes,
            &clocks,
            allowed,
            usage.covers,
            self.parts.settings.report_period,
        );
        let member = stream.track_rule(&usage.slot, &limits, &rule_stats, self);
        let reporter = Reporter {
            listed: Listed {
                id: member.to_string(),
                demand: usage.demand,
                listing: Listing::Reported,
                sent_version: 0,
            },
            stream: stream.clone(),
            slot: usage.slot,
            uses,
        };
        // Counted before it can be taken: the recomputation that takes it may settle it at once.
        stream.defer();
        match self.gathers.enter(&limits.shares_key, reporter) {
            Turn::Now(reporter) => {
                stream.undefer(false);
                let mut actions = self
                    .recompute(&limits.shares_key, vec![reporter], deadline)
                    .await;
                Decided::Now(actions.pop().flatten())
            }
            Turn::Queued => Decided::Later,
            Turn::First { at } => {
                let (quota, key) = (self.clone(), limits.shares_key.clone());
                tokio::spawn(async move {
                    tokio::time::sleep_until(at).await;
                    let reporters = quota.gathers.take(&key);
                    let streams: Vec<_> = reporters
                        .iter()
                        .map(|r| (r.stream.clone(), r.slot.clone()))
                        .collect();
                    let deadline = Deadline::within(quota.parts.store_wait);
                    let actions = quota.recompute(&key, reporters, deadline).await;
                    for ((stream, slot), action) in streams.into_iter().zip(actions) {
                        stream.settle(slot, action, &quota);
                    }
                });
                Decided::Later
            }
        }
    }

    /// Recomputes the bucket under `key` for the reports of `reporters` (of its members on this
    /// replica), listing too the other members here that wait for a share, and pushes them what they
    /// are given; the reporters' answers, in order.
    async fn recompute(
        &self,
        key: &str,
        mut reporters: Vec<Reporter>,
        deadline: Deadline,
    ) -> Vec<Option<Answer>> {
        // A member that reported twice while waiting is listed with its later report; one whose stream
        // ended, or whose bucket now shares under another rule, is not listed (its hits still count).
        let mut answered = vec![true; reporters.len()];
        let mut later = std::collections::HashSet::new();
        for (r, answered) in reporters.iter().zip(answered.iter_mut()).rev() {
            *answered = later.insert(r.listed.id.as_str()) && r.stream.follows(&r.slot, key);
        }
        drop(later);
        let uses = merged_uses(&reporters.iter().map(|r| &r.uses[..]).collect::<Vec<_>>());
        for r in &mut reporters {
            r.listed.sent_version = r.stream.sent_version(&r.slot);
        }
        let mut listed: Vec<Listed> = reporters
            .iter()
            .zip(&answered)
            .filter(|(_, answered)| **answered)
            .map(|(r, _)| r.listed.clone())
            .collect();
        let mut reported: Vec<&str> = listed.iter().map(|l| l.id.as_str()).collect();
        reported.sort_unstable();
        let locals = self.locals(key, &reported);
        listed.extend(locals.iter().map(|m| Listed {
            id: m.member.to_string(),
            demand: DemandUpdate::Keep,
            listing: Listing::Pushed,
            sent_version: m.stream.sent_version(&m.slot),
        }));
        let listed_reporters = listed.len() - locals.len();
        let call = Call {
            limits: uses,
            counts_for_ms: duration_ms(
                self.parts
                    .settings
                    .assignment_ttl
                    .saturating_add(TTL_MARGIN),
            ),
            hold_ms: duration_ms(hold(self.parts.settings.report_period)),
            max_members: self.parts.settings.max_envoys_per_bucket,
            members: listed,
        };
        let reply = match self.parts.shares.share_by(key, &call, Some(deadline)).await {
            Ok(reply) => reply,
            Err(err) => {
                tracing::debug!(error = %err, "rate limit quota shares not recomputed");
                return reporters
                    .iter()
                    .zip(&answered)
                    .map(|(r, answered)| {
                        if !answered {
                            return None;
                        }
                        // A bucket that never got a share is a subscriber only once the store
                        // gives it one.
                        if r.listed.sent_version == 0 {
                            r.stream.forget_rule(&r.slot, self);
                        }
                        self.store_failed().map(Answer::Action)
                    })
                    .collect();
            }
        };
        for (given, local) in reply.given[listed_reporters..].iter().zip(&locals) {
            match *given {
                Given::Share {
                    changed: true,
                    grant,
                    target,
                    version,
                } => local.stream.push(&local.slot, grant, target, version, self),
                Given::Share { target, .. } => local.stream.note_target(&local.slot, target),
                Given::Full | Given::Gone => {}
            }
        }
        let mut given = reply.given[..listed_reporters].iter();
        reporters
            .iter()
            .zip(&answered)
            .map(|(r, answered)| {
                if !answered {
                    return None;
                }
                match *given.next()? {
                    Given::Share {
                        grant,
                        target,
                        version,
                        ..
                    } => Some(Answer::Share {
                        grant,
                        target,
                        version,
                    }),
                    Given::Full => {
                        // Not a member of the bucket: neither a subscriber nor pushed to.
                        r.stream.forget_rule(&r.slot, self);
                        self.stats.unanswered(Unanswered::BucketFull);
                        None
                    }
                    Given::Gone => None,
                }
            })
            .collect()
    }

    /// Adds `allowed` admitted hits to every counter of the rule, as `ShouldRateLimit` would have for
    /// requests it allowed (see [`charged`]), and reads what is left; with, for each counter, the time
    /// it was read at on the store's clock (the Redis server's: fixed windows start and run on it, so
    /// that replicas with skewed clocks see the same window).
    async fn charge(
        &self,
        limits: &BucketLimits,
        allowed: u64,
        covers: Option<Duration>,
        deadline: Deadline,
    ) -> Result<(Vec<Outcome>, Vec<u64>), StoreError> {
        let batch = Batch {
            checks: limits
                .checks
                .iter()
                .map(|c| {
                    let mut check = c.clone();
                    check.cost = charged(allowed, &check.params, covers);
                    check.role = Role::Enforce;
                    check.reported = true;
                    // Only a fixed window counts hits past what is left of its own accord; the
                    // others take a report as usage counted after the fact (a bucket goes into
                    // bounded debt), so that what the Envoys admitted always reaches the counter.
                    if check.params.algorithm != Algorithm::FixedWindow {
                        check.params.count_over_limit = true;
                    }
                    check
                })
                .collect(),
            // The requests were admitted already: they count whatever the counters say.
            consume_on_deny: true,
            known_denied: false,
        };
        let now = self.parts.clock.now_millis();
        let store = &self.parts.store;
        let applied = store.apply(&batch, now, deadline).await?;
        // After the call: the store has just measured its clock against `now`.
        let clocks = batch
            .checks
            .iter()
            .map(|c| store.clock_ms(now, c.per_second))
            .collect();
        Ok((applied.outcomes, clocks))
    }

    /// The answer while the store cannot count or share, by `on_backend_error`.
    fn store_failed(&self) -> Option<Action> {
        match self.parts.on_backend_error {
            OnBackendError::Allow => Some(self.allow_all()),
            OnBackendError::Deny => Some(self.assign(Strategy::DenyAll)),
            OnBackendError::Error | OnBackendError::Local => {
                self.stats.unanswered(Unanswered::Store);
                None
            }
        }
    }

    fn allow_all(&self) -> Action {
        self.assign(Strategy::AllowAll)
    }

    fn assign(&self, strategy: Strategy) -> Action {
        Action::Assign {
            strategy,
            ttl_secs: self.parts.settings.ttl_secs(),
        }
    }
}

/// The rule's limits as a share call takes them: each one's rate, `limit / window`, and for a fixed
/// window what its counter holds after this report added `added`, and how long the window has run at
/// `now_ms` (one time per check, on the clock its counter counts by). The pool follows from them (see
/// [`share::pool`]).
pub fn limit_uses(
    limits: &BucketLimits,
    outcomes: &[Outcome],
    now_ms: &[u64],
    added: u64,
    covers: Option<Duration>,
    report_period: Duration,
) -> Vec<LimitUse> {
    limits
        .checks
        .iter()
        .zip(&limits.params)
        .zip(outcomes)
        .zip(now_ms)
        .map(|(((check, params), outcome), &now_ms)| {
            let window_ms = params.window_ms.max(1);
            let rate = params.limit as f64 * 1000.0 / window_ms as f64;
            let window = (params.algorithm == Algorithm::FixedWindow)
                .then(|| check.window_start_secs(now_ms))
                .flatten()
                .map(|start| {
                    let start_ms = start.saturating_mul(1000);
                    WindowUse {
                        start_ms,
                        used: params.limit.saturating_sub(outcome.remaining) as f64,
                        added: charged(added, params, covers) as f64,
                        window_ms,
                        elapsed_ms: now_ms.saturating_sub(start_ms),
                        floor_ms: duration_ms(report_period).min(window_ms).max(1),
                    }
                });
            LimitUse { rate, window }
        })
        .collect()
}

/// What a report of `allowed` requests over `covers` charges one limit: for a fixed window shorter
/// than the time the report covers, only the part that falls in the current window (the requests
/// spread evenly over the report), so that a 5 s report does not fill a per-second window and deny its
/// `ShouldRateLimit` callers for the rest of it; and never more than the limit's capacity.
fn charged(allowed: u64, params: &crate::algorithm::Params, covers: Option<Duration>) -> u64 {
    let mut cost = allowed;
    if params.algorithm == Algorithm::FixedWindow {
        let window = u128::from(params.window_ms.max(1));
        let covered = covers.map_or(0, |c| c.as_millis());
        if covered > window {
            // Rounded up: an honest Envoy's last request still counts.
            let part = (u128::from(allowed) * window).div_ceil(covered);
            cost = u64::try_from(part).unwrap_or(u64::MAX);
        }
    }
    cost.min(capacity(params))
}

/// The most hits one report charges a limit: its capacity (the limit, or a token bucket's burst). A
/// charge of more would deny `ShouldRateLimit` callers for nothing the Envoys can have admitted.
fn capacity(params: &crate::algorithm::Params) -> u64 {
    params.limit.max(params.burst)
}

/// Adds to a counter that stops at its largest value rather than wrap (a counter that went backwards
/// would read as a reset).
fn add_saturating(counter: &AtomicU64, n: u64) {
    let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        Some(v.saturating_add(n))
    });
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Locks `mutex`, whose data stays consistent even if a holder panicked (every critical section of the
/// quota service leaves it whole).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixed(rate: f64, start_ms: u64, elapsed_ms: u64, used: f64, added: f64) -> LimitUse {
        LimitUse {
            rate,
            window: Some(WindowUse {
                start_ms,
                used,
                added,
                window_ms: 1000,
                elapsed_ms,
                floor_ms: 200,
            }),
        }
    }

    #[test]
    fn reports_sharing_a_recomputation_add_their_hits_to_the_window_seen_latest() {
        let slow = [
            fixed(100.0, 1000, 900, 80.0, 10.0),
            LimitUse {
                rate: 5.0,
                window: None,
            },
        ];
        let a = [
            fixed(100.0, 2000, 100, 30.0, 20.0),
            LimitUse {
                rate: 5.0,
                window: None,
            },
        ];
        let b = [
            fixed(100.0, 2000, 300, 60.0, 15.0),
            LimitUse {
                rate: 5.0,
                window: None,
            },
        ];
        // The report of the earlier window came last: the later window is still the one counted.
        let merged = merged_uses(&[&a, &b, &slow]);
        let w = merged[0].window.unwrap();
        assert_eq!(
            (w.start_ms, w.elapsed_ms, w.used, w.added),
            (2000, 300, 60.0, 35.0)
        );
        assert_eq!(
            merged[1],
            LimitUse {
                rate: 5.0,
                window: None
            }
        );
        // One report alone is taken as it is.
        assert_eq!(merged_uses(&[&a]), a.to_vec());
        // A limit that changed in between (another rate) is not mixed in.
        let reloaded = [
            fixed(50.0, 2000, 200, 10.0, 10.0),
            LimitUse {
                rate: 5.0,
                window: None,
            },
        ];
        let w = merged_uses(&[&a, &reloaded])[0].window.unwrap();
        assert_eq!((w.used, w.added), (10.0, 10.0));
        assert!(merged_uses(&[]).is_empty());
    }
}
