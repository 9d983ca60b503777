//! One Envoy's stream: the buckets it reports, the demand measured between its reports, what it was
//! last sent for each (so that an unchanged assignment goes out identical, and an older one never after a
//! newer), and the queue of actions its response stream sends: the answers to its reports and the shares
//! other streams' reports freed for it, the latest per bucket.
//!
//! A report of a bucket that arrives much sooner than a report period after the bucket's last counted
//! one (a tenth of a period, at most the second a share counts beyond its TTL) is merged into the next:
//! its requests are counted then, with the time since the last counted report, and it is answered at
//! once with the assignment last sent, unchanged. A stream that reports too often thus costs the store
//! nothing more, and an Envoy's subscription (its first report of a bucket) is always counted at once.
//!
//! Locks: a stream's state is locked briefly and never across an await, and never while the quota
//! service's registry of local members is locked.

use std::{
    collections::{HashMap, HashSet},
    sync::{atomic::Ordering, Arc, Mutex},
    time::Duration,
};

use futures_util::StreamExt;
use tokio::{sync::Notify, time::Instant};

use super::{
    lock,
    share::{significant, DemandUpdate},
    stats::{RuleStat, Unanswered},
    strategy, Action, Answer, BucketAction, BucketId, Decided, LocalMember, Quota, Report,
    ReportError, Strategy, Usage,
};
use crate::limiter::{BucketLimits, RequestLimits};

/// Buckets of one report recomputed at once.
const CONCURRENT_BUCKETS: usize = 16;

/// A bucket within a stream: its domain and id.
pub(super) type BucketSlot = (Arc<str>, Arc<BucketId>);

/// One Envoy's stream, as the API layer holds it: reports go in, actions come out.
#[derive(Debug)]
pub struct Stream {
    quota: Arc<Quota>,
    inner: Arc<StreamInner>,
}

/// A stream's state, shared with the recomputations of other streams that push to it.
#[derive(Debug)]
pub(super) struct StreamInner {
    /// `<replica>-<n>`; each bucket's member id adds the bucket's number in the stream.
    id: String,
    state: Mutex<StreamState>,
    /// Woken when actions are pending, a report's last answer came, or the stream ends.
    ready: Notify,
    /// Longest time actions wait for answers still to come (see [`StreamState::awaiting`]).
    hold_for: Duration,
}

#[derive(Debug, Default)]
struct StreamState {
    /// The domain of its first report: Envoy opens one stream per domain, and a stream keeps one.
    domain: Option<Arc<str>>,
    buckets: HashMap<BucketSlot, Tracked>,
    /// Actions not sent yet, the latest per bucket, in the order they were first queued.
    pending: Pending,
    next_bucket: u64,
    /// No more actions: the stream ended.
    closed: bool,
    /// Answers still to come for its reports: one for each report being decided, and one for each
    /// of its buckets that waits for a recomputation. Actions wait for them (see `next_actions`).
    awaiting: usize,
    /// A pending action lowers a grant: the actions go out at once (the share it frees is handed to
    /// others only a hold after it was sent).
    urgent: bool,
}

/// What a stream knows of one of its buckets.
#[derive(Debug)]
struct Tracked {
    /// The member id of this bucket of this stream.
    member: Arc<str>,
    /// When its last report arrived: demand is measured over the time since.
    reported_at: Option<Instant>,
    /// When it was abandoned (its rule went), until it is reported again: Envoy forgets it, and so does
    /// the stream one TTL later if it is not reported again.
    abandoned_at: Option<Instant>,
    /// Its rule and shares, while it has a rule with limits.
    rule: Option<TrackedRule>,
    /// The last strategy sent with a grant, and that grant.
    sent: Option<(Strategy, f64)>,
    /// The blanket rule (ALLOW_ALL, DENY_ALL) last sent while no grant was: with `sent`, what a merged
    /// report is answered with.
    blanket: Option<Strategy>,
    /// Version of the last assignment sent: an older one is never sent after it.
    sent_version: u64,
    /// What the Envoy can have admitted since its last report, by the token buckets it was sent; `None`
    /// while nothing bounds it (no token bucket sent on this stream yet, or ALLOW_ALL).
    admissible: Option<Admissible>,
    /// Its target in the last recomputation that listed it: while the grant sent is well below it, the
    /// bucket waits for a share, and other members' reports list it to be pushed one.
    target: f64,
    /// Requests allowed and denied in reports merged into the next (they came too soon after the last).
    merged: (u64, u64),
    /// Its last assignment, not queued yet, lowers its grant: it goes out without waiting for others.
    lowered: bool,
}

impl Tracked {
    /// A bucket the stream has just met, as the member `member`.
    fn new(member: Arc<str>) -> Self {
        Self {
            member,
            reported_at: None,
            abandoned_at: None,
            rule: None,
            sent: None,
            blanket: None,
            sent_version: 0,
            admissible: None,
            target: 0.0,
            merged: (0, 0),
            lowered: false,
        }
    }
}

/// The token buckets an Envoy enforced since its last report, as a bound on what it can have admitted:
/// each new bucket starts full (`burst`), and refills at most at the highest rate sent, a fill at a time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Admissible {
    /// Tokens per second, the highest of the buckets sent.
    rate: f64,
    /// Tokens of the largest fill sent: a fill arrives whole.
    fill: f64,
    /// Tokens the buckets held when the period started or were sent with: each starts full.
    burst: f64,
}

impl Admissible {
    /// What one strategy lets an Envoy admit beyond its rate, as sent; `None` for ALLOW_ALL.
    fn of(strategy: &Strategy) -> Option<Self> {
        match strategy {
            Strategy::AllowAll => None,
            Strategy::DenyAll => Some(Self::default()),
            Strategy::TokenBucket(b) => Some(Self {
                rate: b.rate(),
                fill: f64::from(b.tokens_per_fill),
                burst: f64::from(b.max_tokens),
            }),
        }
    }

    /// Another strategy sent in the same period: it starts full.
    fn and(self, strategy: &Strategy) -> Option<Self> {
        let other = Self::of(strategy)?;
        Some(Self {
            rate: self.rate.max(other.rate),
            fill: self.fill.max(other.fill),
            burst: self.burst + other.burst,
        })
    }

    /// Most requests the Envoy can have admitted over `elapsed`.
    fn requests(&self, elapsed: Duration) -> u64 {
        let most = self.rate * elapsed.as_secs_f64() + self.fill + self.burst;
        // A float cast saturates; the ceiling keeps an honest Envoy's last token.
        most.ceil() as u64
    }
}

#[derive(Debug)]
struct TrackedRule {
    shares_key: String,
    /// Its rule's series, where the bucket counts as a subscriber.
    stats: Arc<RuleStat>,
}

/// A report's usage of one bucket, with the demand the stream measured.
#[derive(Debug)]
pub(super) struct TrackedUsage {
    pub slot: BucketSlot,
    /// Requests the Envoy reported allowed.
    pub allowed: u64,
    /// The most of them its token buckets let it admit since its last report (`None`: nothing bounds
    /// it but the rule's limits); what the counters are charged is capped by it.
    pub admissible: Option<u64>,
    /// The time the report covers: since the stream's last report of the bucket, or as the Envoy says
    /// in its first (`None` when it covers none).
    pub covers: Option<Duration>,
    pub denied: u64,
    pub demand: DemandUpdate,
}

impl Stream {
    pub(super) fn new(quota: Arc<Quota>, id: String) -> Self {
        Self {
            inner: Arc::new(StreamInner {
                id,
                state: Mutex::new(StreamState::default()),
                ready: Notify::new(),
                hold_for: quota.answers_within(),
            }),
            quota,
        }
    }

    /// Decides every bucket of `report` and queues the answers; buckets past the stream's bounds, or
    /// that cannot be decided, are not answered. A domain longer than a descriptor key may be, or other
    /// than the stream's first report's, is refused: the stream ends.
    pub async fn report(&self, report: Report) -> Result<(), ReportError> {
        let quota = &self.quota;
        quota.stats.reports.fetch_add(1, Ordering::Relaxed);
        let limits = quota.parts.limiter.request_limits().clone();
        let domain = self.domain(report.domain, &limits)?;
        self.evict_idle();
        let (usages, resent) = self.track(&domain, report.usages, &limits);
        let (inner, domain) = (&self.inner, &domain);
        // Its answers go out together: actions wait until it has queued them, or for `hold_for` at
        // most, and not at all when one lowers a grant. Woken by the first answer queued, to start
        // that wait.
        inner.defer();
        if resent {
            inner.ready.notify_one();
        }
        // Each answer is queued as soon as it is decided (a bucket that waits for a recomputation is
        // answered with it): a lowered grant goes out at once, not after the report's last bucket.
        futures_util::stream::iter(usages)
            .for_each_concurrent(CONCURRENT_BUCKETS, |usage| async move {
                let slot = usage.slot.clone();
                if let Decided::Now(answer) = quota.decide(inner, domain, usage).await {
                    inner.queue_answer(slot, answer, quota);
                }
            })
            .await;
        self.inner.undefer(false);
        Ok(())
    }

    /// The stream's domain: set by its first report, the same in every other.
    fn domain(&self, domain: String, limits: &RequestLimits) -> Result<Arc<str>, ReportError> {
        if domain.len() > limits.max_key_bytes {
            return Err(ReportError::DomainTooLong {
                len: domain.len(),
                max: limits.max_key_bytes,
            });
        }
        let mut state = lock(&self.inner.state);
        match &state.domain {
            Some(first) if **first == *domain => Ok(first.clone()),
            Some(first) => Err(ReportError::DomainChanged {
                first: first.to_string(),
                got: domain,
            }),
            None => {
                let domain: Arc<str> = domain.into();
                state.domain = Some(domain.clone());
                Ok(domain)
            }
        }
    }

    /// Forgets the buckets not reported for an assignment's TTL and its margin: Envoy reports every
    /// bucket it has on each period, so it no longer has them (or traffic will create them again). Not
    /// sooner: the store counts a share that long (the Envoy may still enforce it), and a bucket back
    /// before then would be taken for a newcomer beside its own old share.
    fn evict_idle(&self) {
        let idle = self.quota.parts.settings.assignment_ttl + super::TTL_MARGIN;
        let now = Instant::now();
        let evicted: Vec<Tracked> = {
            let mut state = lock(&self.inner.state);
            let gone: Vec<BucketSlot> = state
                .buckets
                .iter()
                .filter(|(_, t)| {
                    t.reported_at
                        .or(t.abandoned_at)
                        .is_some_and(|at| now.saturating_duration_since(at) > idle)
                })
                .map(|(slot, _)| slot.clone())
                .collect();
            gone.iter()
                .filter_map(|slot| state.buckets.remove(slot))
                .collect()
        };
        self.inner.release(evicted, &self.quota);
    }

    /// The buckets of a report this stream takes, with their demand; and whether it queued the last
    /// assignment again for buckets whose report is merged into the next (unless a newer one waits to
    /// be sent). Queued under the lock that read them, so that a newer one (another stream's
    /// recomputation) is queued after it, and replaces or follows it.
    fn track(
        &self,
        domain: &Arc<str>,
        usages: Vec<Usage>,
        limits: &RequestLimits,
    ) -> (Vec<TrackedUsage>, bool) {
        let settings = &self.quota.parts.settings;
        let floor = (settings.report_period / 10).max(Duration::from_millis(1));
        let early = (settings.report_period / 10).min(super::TTL_MARGIN);
        let now = Instant::now();
        let mut state = lock(&self.inner.state);
        let mut seen: HashSet<Arc<BucketId>> = HashSet::new();
        let mut out = Vec::new();
        let mut resent = false;
        for usage in usages {
            if !valid_bucket(&usage.bucket, limits) {
                self.quota.stats.unanswered(Unanswered::InvalidBucket);
                continue;
            }
            let bucket = Arc::new(usage.bucket);
            if !seen.insert(bucket.clone()) {
                continue;
            }
            let mut slot: BucketSlot = (domain.clone(), bucket.clone());
            if let Some((known, _)) = state.buckets.get_key_value(&slot) {
                // The stream's own handles from now on: the lookups of this report's decisions then
                // compare pointers, not the bucket's entries.
                slot = known.clone();
            } else {
                if state.buckets.len() >= settings.max_buckets_per_stream
                    || !self.quota.take_bucket()
                {
                    self.quota.stats.unanswered(Unanswered::TooManyBuckets);
                    continue;
                }
                state.next_bucket += 1;
                let member = format!("{}-{:x}", self.inner.id, state.next_bucket).into();
                state.buckets.insert(slot.clone(), Tracked::new(member));
            }
            let Some(tracked) = state.buckets.get_mut(&slot) else {
                continue;
            };
            if tracked
                .reported_at
                .is_some_and(|at| now.saturating_duration_since(at) < early)
            {
                let (allowed, denied) = tracked.merged;
                tracked.merged = (
                    allowed.saturating_add(usage.allowed),
                    denied.saturating_add(usage.denied),
                );
                let last = tracked.sent.map(|(s, _)| s).or(tracked.blanket);
                if let Some(strategy) = last.filter(|_| !state.pending.has(&slot)) {
                    state.queue(slot, self.quota.assign(strategy));
                    resent = true;
                }
                continue;
            }
            let (allowed, denied) = std::mem::take(&mut tracked.merged);
            let (allowed, denied) = (
                usage.allowed.saturating_add(allowed),
                usage.denied.saturating_add(denied),
            );
            let requests = allowed.saturating_add(denied) as f64;
            let since = tracked
                .reported_at
                .map(|at| now.saturating_duration_since(at));
            let elapsed = match since {
                Some(since) => Some(since),
                None => Some(usage.elapsed).filter(|e| !e.is_zero()),
            };
            tracked.reported_at = Some(now);
            tracked.abandoned_at = None;
            // An assignment that expired at the Envoy left it to its own fallback: unbounded.
            let admissible = match (tracked.admissible, since) {
                (Some(a), Some(since)) if since <= settings.assignment_ttl => {
                    Some(a.requests(since))
                }
                _ => None,
            };
            // From now on, what it holds is what it was last sent (a bucket holds at most its
            // `max_tokens`).
            tracked.admissible = tracked.sent.as_ref().and_then(|(s, _)| Admissible::of(s));
            let demand = match elapsed {
                None => DemandUpdate::Unknown,
                Some(elapsed) => {
                    let secs = elapsed.max(floor).as_secs_f64();
                    DemandUpdate::Rate(demand(requests, secs))
                }
            };
            out.push(TrackedUsage {
                slot,
                allowed,
                admissible,
                covers: elapsed,
                denied,
                demand,
            });
        }
        (out, resent)
    }

    /// A handle on the stream's actions, for the API layer's response stream.
    pub fn actions(&self) -> Actions {
        Actions(self.inner.clone())
    }

    /// Ends the stream: no more actions, and its buckets leave this replica's metrics and pushes. Their
    /// shares stay counted until their assignments expire: the Envoy enforces them until then.
    pub fn end(&self) {
        self.inner.end(&self.quota);
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.inner.end(&self.quota);
        self.quota.open_streams.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The actions of a stream, for the response stream the API layer returns.
#[derive(Debug, Clone)]
pub struct Actions(Arc<StreamInner>);

impl Actions {
    /// The next actions to send; `None` once the stream ended.
    pub async fn next(&self) -> Option<Vec<BucketAction>> {
        self.0.next_actions().await
    }
}

impl StreamState {
    /// Takes the answer to a report of the bucket in `slot` (`None`: not answered, or not yet); true
    /// when an action was queued. A share is not answered when a newer one went out, or waits to, or
    /// while the others still hold it.
    fn settle(&mut self, slot: BucketSlot, answer: Option<Answer>, quota: &Quota) -> bool {
        let action = match answer {
            Some(Answer::Share {
                grant,
                target,
                version,
            }) => self.buckets.get_mut(&slot).and_then(|tracked| {
                // A share older than the one sent says nothing of the bucket now.
                if version > tracked.sent_version {
                    tracked.target = target;
                }
                let action = assignment(tracked, grant, target, version, quota);
                if action.is_none() && grant <= 0.0 && target > 0.0 {
                    quota.stats.unanswered(Unanswered::Waiting);
                }
                action
            }),
            Some(Answer::Action(action)) => Some(action),
            None => None,
        };
        let Some(action) = action else {
            // Not answered (waiting for a share, the store failing): a merged report gets no old
            // blanket rule either.
            if let Some(tracked) = self.buckets.get_mut(&slot) {
                tracked.blanket = None;
            }
            return false;
        };
        if let Some(tracked) = self.buckets.get_mut(&slot) {
            match &action {
                // Envoy forgets an abandoned bucket: its next report of it is a subscription.
                Action::Abandon => {
                    tracked.reported_at = None;
                    tracked.abandoned_at = Some(Instant::now());
                    tracked.merged = (0, 0);
                    tracked.blanket = None;
                }
                Action::Assign { strategy, .. } => {
                    if Admissible::of(strategy).is_none() {
                        tracked.admissible = None;
                    }
                    if tracked.sent.is_none() {
                        tracked.blanket = Some(*strategy);
                    }
                }
            }
        }
        self.queue(slot, action);
        true
    }

    /// Queues `action`, replacing one not sent yet for the same bucket.
    fn queue(&mut self, slot: BucketSlot, action: Action) {
        if self.closed {
            return;
        }
        if let Some(tracked) = self.buckets.get_mut(&slot) {
            self.urgent |= std::mem::take(&mut tracked.lowered);
        }
        self.pending.put(slot, action);
    }
}

/// Actions not sent yet, the latest per bucket, in the order each bucket was first queued. Found by
/// bucket through an index: a report of many buckets looked each up in the list, which made it
/// quadratic (900 buckets in one report took 150 ms of CPU).
#[derive(Debug, Default)]
struct Pending {
    actions: Vec<(BucketSlot, Action)>,
    at: HashMap<BucketSlot, usize>,
}

impl Pending {
    fn has(&self, slot: &BucketSlot) -> bool {
        self.at.contains_key(slot)
    }

    fn put(&mut self, slot: BucketSlot, action: Action) {
        match self.at.get(&slot) {
            Some(&i) => self.actions[i].1 = action,
            None => {
                self.at.insert(slot.clone(), self.actions.len());
                self.actions.push((slot, action));
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.actions.is_empty()
    }

    /// Every pending action, in order; none is pending after.
    fn take(&mut self) -> Vec<(BucketSlot, Action)> {
        self.at.clear();
        std::mem::take(&mut self.actions)
    }
}

impl StreamInner {
    async fn next_actions(&self) -> Option<Vec<BucketAction>> {
        let mut held: Option<Instant> = None;
        loop {
            let notified = self.ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut state = lock(&self.state);
                if !state.pending.is_empty() {
                    // Actions wait for the answers still to come of a report, so that they go out
                    // in one message; not past `hold_for`, and not when one lowers a grant.
                    let now = Instant::now();
                    if state.awaiting == 0
                        || state.urgent
                        || state.closed
                        || held.is_some_and(|until| now >= until)
                    {
                        state.urgent = false;
                        let pending = state.pending.take();
                        return Some(
                            pending
                                .into_iter()
                                .map(|((_, bucket), action)| BucketAction {
                                    bucket: (*bucket).clone(),
                                    action,
                                })
                                .collect(),
                        );
                    }
                    held.get_or_insert(now + self.hold_for);
                } else if state.closed {
                    return None;
                }
            }
            match held {
                Some(until) => {
                    tokio::select! {
                        () = &mut notified => {}
                        () = tokio::time::sleep_until(until) => {}
                    }
                }
                None => notified.await,
            }
        }
    }

    /// Starts counting the bucket's rule: registers it for pushes under its shares key and in its rule's
    /// subscribers (leaving the rule or key it had before). Returns the bucket's member id.
    pub(super) fn track_rule(
        self: &Arc<Self>,
        slot: &BucketSlot,
        limits: &BucketLimits,
        stats: &Arc<RuleStat>,
        quota: &Quota,
    ) -> Arc<str> {
        let (member, previous) = {
            let mut state = lock(&self.state);
            let Some(tracked) = state.buckets.get_mut(slot) else {
                return Arc::from("");
            };
            let unchanged = tracked
                .rule
                .as_ref()
                .is_some_and(|r| r.shares_key == limits.shares_key && Arc::ptr_eq(&r.stats, stats));
            if unchanged {
                return tracked.member.clone();
            }
            stats.subscribe(1, 0.0);
            let previous = tracked.rule.replace(TrackedRule {
                shares_key: limits.shares_key.clone(),
                stats: stats.clone(),
            });
            // What was sent belongs to the rule or key it had before.
            let sent = tracked.sent.take().map_or(0.0, |(_, grant)| grant);
            if let Some(old) = &previous {
                old.stats.subscribe(-1, -sent);
            }
            (tracked.member.clone(), previous)
        };
        if let Some(old) = previous {
            quota.unregister_local(&old.shares_key, &member);
        }
        quota.register_local(
            &limits.shares_key,
            LocalMember {
                member: member.clone(),
                stream: self.clone(),
                slot: slot.clone(),
            },
        );
        member
    }

    /// Whether the bucket waits for a share: the grant it was last sent is well below its last target.
    /// Only such members are listed when another member of the bucket reports.
    pub(super) fn waits(&self, slot: &BucketSlot) -> bool {
        lock(&self.state).buckets.get(slot).is_some_and(|t| {
            let held = t.sent.map_or(0.0, |(_, g)| g);
            t.target > held && significant(held, t.target)
        })
    }

    /// An answer to come: a report being decided, or a bucket's that may wait for a recomputation.
    /// Each is ended by [`Self::undefer`] or [`Self::settle`].
    pub(super) fn defer(&self) {
        lock(&self.state).awaiting += 1;
    }

    /// An answer that was to come and will not (or was queued with `queued`).
    pub(super) fn undefer(&self, queued: bool) {
        let wake = {
            let mut state = lock(&self.state);
            debug_assert!(state.awaiting > 0, "an answer ended that was not to come");
            state.awaiting = state.awaiting.saturating_sub(1);
            queued || (state.awaiting == 0 && !state.pending.is_empty())
        };
        if wake {
            self.ready.notify_one();
        }
    }

    /// Queues the answer to a report of the bucket in `slot` as it is decided, the report still being
    /// decided: the actions are woken to start their wait (or go at once, for a lowered grant).
    fn queue_answer(&self, slot: BucketSlot, answer: Option<Answer>, quota: &Quota) {
        let wake = {
            let mut state = lock(&self.state);
            let first = state.pending.is_empty();
            state.settle(slot, answer, quota) && (first || state.urgent)
        };
        if wake {
            self.ready.notify_one();
        }
    }

    /// Takes the answer to a report of the bucket that waited for a later recomputation.
    pub(super) fn settle(&self, slot: BucketSlot, answer: Option<Answer>, quota: &Quota) {
        let queued = lock(&self.state).settle(slot, answer, quota);
        self.undefer(queued);
    }

    /// Whether the stream is open and its bucket in `slot` still shares under `key`: a report that
    /// waited for a recomputation is answered only then.
    pub(super) fn follows(&self, slot: &BucketSlot, key: &str) -> bool {
        let state = lock(&self.state);
        !state.closed
            && state
                .buckets
                .get(slot)
                .and_then(|t| t.rule.as_ref())
                .is_some_and(|r| r.shares_key == key)
    }

    /// Records the bucket's target from a recomputation that did not change its grant.
    pub(super) fn note_target(&self, slot: &BucketSlot, target: f64) {
        if let Some(tracked) = lock(&self.state).buckets.get_mut(slot) {
            tracked.target = target;
        }
    }

    /// The version of the last assignment sent for the bucket (0 for none).
    pub(super) fn sent_version(&self, slot: &BucketSlot) -> u64 {
        lock(&self.state)
            .buckets
            .get(slot)
            .map_or(0, |t| t.sent_version)
    }

    /// Stops counting the bucket's rule; true when it had one (its rule is gone).
    pub(super) fn forget_rule(&self, slot: &BucketSlot, quota: &Quota) -> bool {
        let (member, rule, grant) = {
            let mut state = lock(&self.state);
            let Some(tracked) = state.buckets.get_mut(slot) else {
                return false;
            };
            let Some(rule) = tracked.rule.take() else {
                return false;
            };
            let grant = tracked.sent.take().map_or(0.0, |(_, g)| g);
            (tracked.member.clone(), rule, grant)
        };
        rule.stats.subscribe(-1, -grant);
        quota.unregister_local(&rule.shares_key, &member);
        true
    }

    /// A grant another stream's recomputation changed: queued unless a newer one went out already.
    pub(super) fn push(
        &self,
        slot: &BucketSlot,
        grant: f64,
        target: f64,
        version: u64,
        quota: &Quota,
    ) {
        let queued = {
            let mut state = lock(&self.state);
            let Some(tracked) = state.buckets.get_mut(slot) else {
                return;
            };
            if version > tracked.sent_version {
                tracked.target = target;
            }
            match assignment(tracked, grant, target, version, quota) {
                Some(action) => {
                    state.queue(slot.clone(), action);
                    true
                }
                None => false,
            }
        };
        if queued {
            self.ready.notify_one();
        }
    }

    fn end(&self, quota: &Quota) {
        let buckets = {
            let mut state = lock(&self.state);
            if state.closed {
                return;
            }
            state.closed = true;
            std::mem::take(&mut state.buckets)
        };
        self.release(buckets.into_values().collect(), quota);
        self.ready.notify_one();
    }

    /// Buckets the stream no longer tracks leave this replica's metrics, pushes and bucket count.
    fn release(&self, buckets: Vec<Tracked>, quota: &Quota) {
        quota.give_back_buckets(buckets.len());
        for tracked in buckets {
            if let Some(rule) = tracked.rule {
                let grant = tracked.sent.map_or(0.0, |(_, g)| g);
                rule.stats.subscribe(-1, -grant);
                quota.unregister_local(&rule.shares_key, &tracked.member);
            }
        }
    }
}

/// The assignment of `grant` for a tracked bucket, recording it as sent: the same strategy again when
/// the grant did not change (Envoy then keeps its bucket's tokens), a new one when it did. `None` when a
/// newer version went out already, or when the grant is zero while the target is not: the share is
/// still held by others, and the Envoy is better off with what it has (an assignment it got on an
/// earlier stream still counts in the store until it expires).
fn assignment(
    tracked: &mut Tracked,
    grant: f64,
    target: f64,
    version: u64,
    quota: &Quota,
) -> Option<Action> {
    if version <= tracked.sent_version {
        return None;
    }
    if grant <= 0.0 && target > 0.0 {
        return None;
    }
    let strategy = match &tracked.sent {
        Some((strategy, sent)) if *sent == grant => *strategy,
        previous => strategy::for_grant(grant, quota.burst, previous.as_ref().map(|(s, _)| s)),
    };
    // A strategy the Envoy does not hold yet starts full; the same one again keeps its tokens. The first
    // token bucket of a stream bounds the Envoy from then on.
    if tracked.sent.as_ref().map(|(s, _)| s) != Some(&strategy) {
        tracked.admissible = match tracked.admissible {
            Some(a) => a.and(&strategy),
            None => Admissible::of(&strategy),
        };
    }
    let before = tracked.sent.map_or(0.0, |(_, g)| g);
    tracked.lowered = grant < before;
    if let Some(rule) = &tracked.rule {
        rule.stats.subscribe(0, grant - before);
    }
    tracked.sent = Some((strategy, grant));
    tracked.sent_version = version;
    Some(quota.assign(strategy))
}

/// The demand a share is sized for: the requests per second reported (allowed and denied), plus a quarter
/// and one request per report, so that an Envoy whose traffic grows a little, or whose requests fall
/// either side of a report, is not denied for it. Bounded, so that no report reaches arithmetic as a
/// number it cannot hold.
fn demand(requests: f64, secs: f64) -> f64 {
    let rate = requests / secs;
    (rate + rate / 4.0 + 1.0 / secs).clamp(0.0, 1e12)
}

/// A bucket id a descriptor could carry: at least one entry, and within `request_limits`.
fn valid_bucket(bucket: &BucketId, limits: &RequestLimits) -> bool {
    !bucket.is_empty()
        && bucket.len() <= limits.max_entries
        && bucket
            .iter()
            .all(|(k, v)| k.len() <= limits.max_key_bytes && v.len() <= limits.max_value_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        clock::Clock,
        limiter::{Limiter, OnBackendError, Options},
        quota::{state::MemoryShares, QuotaParts, Shares},
        rules::Rules,
        store::{memory::MemoryStore, Store},
        telemetry::Metrics,
    };

    fn quota() -> Arc<Quota> {
        let store = Arc::new(Store::Memory(MemoryStore::new(10)));
        let clock = Clock::manual(0);
        let limiter = Limiter::new(
            Arc::new(Rules::default()),
            store.clone(),
            clock.clone(),
            Options::default(),
        );
        Quota::new(QuotaParts {
            limiter: Arc::new(limiter),
            store,
            shares: Shares::Memory(MemoryShares::new(clock.clone(), 10)),
            settings: Default::default(),
            on_backend_error: OnBackendError::Allow,
            store_wait: Duration::from_secs(1),
            clock,
            metrics: Arc::new(Metrics::new()),
        })
    }

    /// A stream tracking one bucket, and that bucket.
    fn stream_with_bucket(quota: &Arc<Quota>) -> (Stream, BucketSlot) {
        let stream = quota.open().unwrap();
        let slot: BucketSlot = (Arc::from("edge"), Arc::new(vec![("k".into(), "v".into())]));
        lock(&stream.inner.state)
            .buckets
            .insert(slot.clone(), Tracked::new(Arc::from("m-1")));
        (stream, slot)
    }

    fn rate(action: &Action) -> f64 {
        match action {
            Action::Assign {
                strategy: Strategy::TokenBucket(bucket),
                ..
            } => bucket.rate(),
            other => panic!("not a token bucket: {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_share_answered_after_a_newer_one_was_pushed_leaves_the_newer() {
        let quota = quota();
        let (stream, slot) = stream_with_bucket(&quota);
        // A report's recomputation gave the bucket version 1 (10 a second); before the report's other
        // buckets were decided, another stream's recomputation pushed version 2 (20 a second).
        stream.inner.push(&slot, 20.0, 20.0, 2, &quota);
        let older = Answer::Share {
            grant: 10.0,
            target: 10.0,
            version: 1,
        };
        assert!(!lock(&stream.inner.state).settle(slot.clone(), Some(older), &quota));
        let actions = stream.actions().next().await.unwrap();
        assert_eq!(actions.len(), 1);
        assert_eq!(rate(&actions[0].action), 20.0);
        assert_eq!(lock(&stream.inner.state).buckets[&slot].target, 20.0);
        // Sent already: an older share queued afterwards does not follow it either.
        let older = Answer::Share {
            grant: 10.0,
            target: 10.0,
            version: 1,
        };
        assert!(!lock(&stream.inner.state).settle(slot.clone(), Some(older), &quota));
        assert!(lock(&stream.inner.state).pending.is_empty());
        // A newer one does.
        let newer = Answer::Share {
            grant: 30.0,
            target: 30.0,
            version: 3,
        };
        assert!(lock(&stream.inner.state).settle(slot, Some(newer), &quota));
        assert_eq!(
            rate(&stream.actions().next().await.unwrap()[0].action),
            30.0
        );
    }
}
