//! A simulated Envoy with the rate limit quota filter, behaving as Envoy's client does (its
//! `global_client_impl.cc`): one stream per domain, opened by the first request; a bucket's first
//! request is decided by the no-assignment behaviour and reported at once, alone, with zero elapsed time;
//! then every bucket is reported together each period with the time since its last report in whole
//! seconds; an assignment lasts the whole seconds of its TTL and falls back to the no-assignment
//! behaviour after; a token bucket refills continuously at `tokens_per_fill / fill_interval` (whole
//! seconds), starts full, and is kept with its tokens (and its old rate) when `max_tokens`,
//! `tokens_per_fill` and the interval's nanoseconds are unchanged; `abandon_action` forgets the bucket;
//! a broken stream is opened again at the next report, the usage in between lost.
#![allow(dead_code)]

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use ratelimitd::proto::rlqs::{
    rate_limit_quota_response::bucket_action::BucketAction as Action,
    rate_limit_quota_usage_reports::BucketQuotaUsage, rate_limit_strategy::Strategy, BucketId,
    RateLimitQuotaResponse, RateLimitQuotaServiceClient, RateLimitQuotaUsageReports,
    RateLimitStrategy,
};
use tokio::{sync::mpsc, task::JoinHandle, time::Instant};
use tokio_util::sync::CancellationToken;

/// A bucket id as the tests write it.
pub type Bucket = Vec<(String, String)>;

pub fn bucket(entries: &[(&str, &str)]) -> Bucket {
    let mut b: Bucket = entries
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    b.sort();
    b
}

/// What a request gets while a bucket has no assignment (Envoy's `no_assignment_behavior`, also used
/// when an assignment expires, as Envoy does without an `expired_assignment_behavior`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    AllowAll,
    DenyAll,
}

/// An assignment as the simulated Envoy enforces it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Enforced {
    AllowAll,
    DenyAll,
    /// A token bucket: its capacity, its rate (tokens per second), and the tokens in it at `at`.
    Tokens {
        max_tokens: u32,
        tokens_per_fill: u32,
        fill_nanos: i32,
        rate: f64,
        tokens: f64,
        at: Instant,
    },
}

impl Enforced {
    /// Tokens per second admitted, sustained (AllowAll: infinite).
    pub fn rate(&self) -> f64 {
        match self {
            Enforced::AllowAll => f64::INFINITY,
            Enforced::DenyAll => 0.0,
            Enforced::Tokens { rate, .. } => *rate,
        }
    }
}

#[derive(Debug)]
struct SimBucket {
    allowed: u64,
    denied: u64,
    last_report: Instant,
    enforced: Option<(Enforced, Instant)>,
}

/// One assignment received, for the tests' timelines.
#[derive(Debug, Clone)]
pub struct Received {
    pub at: Instant,
    pub bucket: Bucket,
    /// `None` for an abandon action.
    pub enforced: Option<Enforced>,
    pub ttl_secs: i64,
}

#[derive(Debug, Default)]
struct State {
    buckets: BTreeMap<Bucket, SimBucket>,
    /// The stream's sender, while one is open.
    stream: Option<mpsc::UnboundedSender<RateLimitQuotaUsageReports>>,
    received: Vec<Received>,
    /// Admitted requests by bucket, per 10 ms since `epoch`.
    admitted: BTreeMap<Bucket, Vec<u32>>,
    /// Tokens that new token buckets started with: what they could admit beyond their rates.
    fresh_tokens: f64,
    streams_opened: u64,
}

/// A simulated Envoy.
pub struct Envoy {
    pub name: String,
    domain: String,
    period: Duration,
    fallback: Fallback,
    addr: SocketAddr,
    epoch: Instant,
    state: Arc<Mutex<State>>,
    stop: CancellationToken,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

const SLOT: Duration = Duration::from_millis(10);

impl Envoy {
    /// An Envoy reporting to the server at `addr` every `period`; nothing is sent before its first
    /// request. `epoch` is the start of the tests' timeline.
    pub fn new(
        name: &str,
        addr: SocketAddr,
        domain: &str,
        period: Duration,
        fallback: Fallback,
        epoch: Instant,
    ) -> Arc<Self> {
        let envoy = Arc::new(Self {
            name: name.into(),
            domain: domain.into(),
            period,
            fallback,
            addr,
            epoch,
            state: Arc::default(),
            stop: CancellationToken::new(),
            tasks: Mutex::new(Vec::new()),
        });
        let reporter = envoy.clone();
        let task = tokio::spawn(async move { reporter.report_every_period().await });
        lock(&envoy.tasks).push(task);
        envoy
    }

    /// Decides one request of `bucket`, as the filter does.
    pub fn request(&self, bucket: &Bucket) -> bool {
        let now = Instant::now();
        let mut state = lock(&self.state);
        let allowed = match state.buckets.get_mut(bucket) {
            None => {
                let allowed = self.fallback == Fallback::AllowAll;
                state.buckets.insert(
                    bucket.clone(),
                    SimBucket {
                        allowed: 0,
                        denied: 0,
                        last_report: now,
                        enforced: None,
                    },
                );
                // The bucket's first report, alone, at once: its subscription.
                let report = RateLimitQuotaUsageReports {
                    domain: self.domain.clone(),
                    bucket_quota_usages: vec![usage(
                        bucket,
                        0,
                        u64::from(allowed),
                        u64::from(!allowed),
                    )],
                };
                self.send(&mut state, report);
                allowed
            }
            Some(b) => {
                let allowed = match &mut b.enforced {
                    Some((_, expires)) if *expires <= now => {
                        b.enforced = None;
                        self.fallback == Fallback::AllowAll
                    }
                    None => self.fallback == Fallback::AllowAll,
                    Some((Enforced::AllowAll, _)) => true,
                    Some((Enforced::DenyAll, _)) => false,
                    Some((
                        Enforced::Tokens {
                            max_tokens,
                            rate,
                            tokens,
                            at,
                            ..
                        },
                        _,
                    )) => {
                        let refilled = (*tokens
                            + now.saturating_duration_since(*at).as_secs_f64() * *rate)
                            .min(f64::from(*max_tokens));
                        *at = now;
                        if refilled >= 1.0 {
                            *tokens = refilled - 1.0;
                            true
                        } else {
                            *tokens = refilled;
                            false
                        }
                    }
                };
                if allowed {
                    b.allowed += 1;
                } else {
                    b.denied += 1;
                }
                allowed
            }
        };
        if allowed {
            let slot =
                (now.saturating_duration_since(self.epoch).as_nanos() / SLOT.as_nanos()) as usize;
            let counts = state.admitted.entry(bucket.clone()).or_default();
            if counts.len() <= slot {
                counts.resize(slot + 1, 0);
            }
            counts[slot] += 1;
        }
        allowed
    }

    /// Sends `report` on the stream, opening one if none is open.
    fn send(&self, state: &mut State, report: RateLimitQuotaUsageReports) {
        if let Some(tx) = &state.stream {
            if tx.send(report.clone()).is_ok() {
                return;
            }
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let _ = tx.send(report);
        state.stream = Some(tx);
        state.streams_opened += 1;
        let (addr, shared, stop) = (self.addr, self.state.clone(), self.stop.clone());
        let task = tokio::spawn(async move {
            let outbound = futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|m| (m, rx))
            });
            let Ok(mut client) =
                RateLimitQuotaServiceClient::connect(format!("http://{addr}")).await
            else {
                lock(&shared).stream = None;
                return;
            };
            let Ok(response) = client.stream_rate_limit_quotas(outbound).await else {
                lock(&shared).stream = None;
                return;
            };
            let mut inbound = response.into_inner();
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    next = inbound.message() => match next {
                        Ok(Some(response)) => apply(&shared, response),
                        _ => break,
                    },
                }
            }
            lock(&shared).stream = None;
        });
        lock(&self.tasks).push(task);
    }

    async fn report_every_period(self: Arc<Self>) {
        let mut tick = tokio::time::interval_at(Instant::now() + self.period, self.period);
        loop {
            tokio::select! {
                _ = self.stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let now = Instant::now();
            let mut state = lock(&self.state);
            if state.buckets.is_empty() && state.stream.is_none() {
                continue;
            }
            let usages = state
                .buckets
                .iter_mut()
                .map(|(id, b)| {
                    let elapsed = now.saturating_duration_since(b.last_report).as_secs() as i64;
                    b.last_report = now;
                    let (allowed, denied) = (b.allowed, b.denied);
                    (b.allowed, b.denied) = (0, 0);
                    usage(id, elapsed, allowed, denied)
                })
                .collect();
            let report = RateLimitQuotaUsageReports {
                domain: self.domain.clone(),
                bucket_quota_usages: usages,
            };
            self.send(&mut state, report);
        }
    }

    /// Sends `rate` requests per second (read every tick, so it can change) of `bucket`, evenly, until
    /// the Envoy stops.
    pub fn drive(self: &Arc<Self>, bucket: Bucket, rate: Arc<Rate>) {
        let envoy = self.clone();
        let task = tokio::spawn(async move {
            let tick = Duration::from_millis(5);
            let mut due = 0.0;
            let mut last = Instant::now();
            let mut ticks = tokio::time::interval(tick);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tokio::select! {
                    _ = envoy.stop.cancelled() => return,
                    _ = ticks.tick() => {}
                }
                let now = Instant::now();
                due += rate.get() * now.saturating_duration_since(last).as_secs_f64();
                last = now;
                while due >= 1.0 {
                    envoy.request(&bucket);
                    due -= 1.0;
                }
            }
        });
        lock(&self.tasks).push(task);
    }

    /// The Envoy disappears: no more requests, reports or streams.
    pub async fn kill(&self) {
        self.stop.cancel();
        lock(&self.state).stream = None;
        let tasks: Vec<JoinHandle<()>> = std::mem::take(&mut *lock(&self.tasks));
        for task in tasks {
            let _ = task.await;
        }
    }

    /// What the bucket enforces now, if it has an assignment.
    pub fn enforced(&self, bucket: &Bucket) -> Option<Enforced> {
        let now = Instant::now();
        lock(&self.state)
            .buckets
            .get(bucket)
            .and_then(|b| b.enforced)
            .filter(|(_, expires)| *expires > now)
            .map(|(e, _)| e)
    }

    /// Requests of `bucket` admitted in `[from, to)` (10 ms resolution).
    pub fn admitted(&self, bucket: &Bucket, from: Instant, to: Instant) -> u64 {
        let slot = |t: Instant| {
            (t.saturating_duration_since(self.epoch).as_nanos() / SLOT.as_nanos()) as usize
        };
        let state = lock(&self.state);
        let Some(counts) = state.admitted.get(bucket) else {
            return 0;
        };
        let (a, b) = (slot(from), slot(to).min(counts.len()));
        counts
            .get(a..b)
            .map_or(0, |c| c.iter().map(|&n| u64::from(n)).sum())
    }

    /// Every assignment received so far.
    pub fn received(&self) -> Vec<Received> {
        lock(&self.state).received.clone()
    }

    /// Tokens new token buckets started with, so far.
    pub fn fresh_tokens(&self) -> f64 {
        lock(&self.state).fresh_tokens
    }

    /// Tokens the bucket holds now (0 without a token bucket).
    pub fn tokens_held(&self, bucket: &Bucket) -> f64 {
        match self.enforced(bucket) {
            Some(Enforced::Tokens {
                max_tokens,
                rate,
                tokens,
                at,
                ..
            }) => (tokens + Instant::now().saturating_duration_since(at).as_secs_f64() * rate)
                .min(f64::from(max_tokens)),
            _ => 0.0,
        }
    }

    pub fn streams_opened(&self) -> u64 {
        lock(&self.state).streams_opened
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A request rate that a test can change while traffic flows.
#[derive(Debug, Default)]
pub struct Rate(AtomicU64);

impl Rate {
    pub fn new(per_second: f64) -> Arc<Self> {
        Arc::new(Self(AtomicU64::new(per_second.to_bits())))
    }
    pub fn set(&self, per_second: f64) {
        self.0.store(per_second.to_bits(), Ordering::Relaxed);
    }
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

fn usage(bucket: &Bucket, elapsed_secs: i64, allowed: u64, denied: u64) -> BucketQuotaUsage {
    BucketQuotaUsage {
        bucket_id: Some(BucketId {
            bucket: bucket.iter().cloned().collect(),
        }),
        time_elapsed: Some(prost_types::Duration {
            seconds: elapsed_secs,
            nanos: 0,
        }),
        num_requests_allowed: allowed,
        num_requests_denied: denied,
    }
}

/// Applies a response's actions in order, as Envoy does.
fn apply(shared: &Mutex<State>, response: RateLimitQuotaResponse) {
    let now = Instant::now();
    let mut state = lock(shared);
    for action in response.bucket_action {
        let Some(id) = action.bucket_id else { continue };
        let mut bucket: Bucket = id.bucket.into_iter().collect();
        bucket.sort();
        let Some(kind) = action.bucket_action else {
            continue;
        };
        match kind {
            Action::AbandonAction(_) => {
                if state.buckets.remove(&bucket).is_some() {
                    state.received.push(Received {
                        at: now,
                        bucket,
                        enforced: None,
                        ttl_secs: 0,
                    });
                }
            }
            Action::QuotaAssignmentAction(assign) => {
                let ttl = assign.assignment_time_to_live.map_or(0, |d| d.seconds);
                let Some(RateLimitStrategy {
                    strategy: Some(strategy),
                }) = assign.rate_limit_strategy
                else {
                    continue;
                };
                let mut fresh = 0.0;
                let Some(b) = state.buckets.get_mut(&bucket) else {
                    // Envoy ignores an action for a bucket it does not know.
                    continue;
                };
                let enforced = match strategy {
                    Strategy::BlanketRule(0) => Enforced::AllowAll,
                    Strategy::BlanketRule(_) => Enforced::DenyAll,
                    Strategy::RequestsPerTimeUnit(_) => continue,
                    Strategy::TokenBucket(tb) => {
                        let per_fill = tb.tokens_per_fill.unwrap_or(1);
                        let interval = tb.fill_interval.unwrap_or_default();
                        let kept = match b.enforced {
                            Some((
                                e @ Enforced::Tokens {
                                    max_tokens,
                                    tokens_per_fill,
                                    fill_nanos,
                                    ..
                                },
                                _,
                            )) if max_tokens == tb.max_tokens
                                && tokens_per_fill == per_fill
                                && fill_nanos == interval.nanos =>
                            {
                                Some(e)
                            }
                            _ => None,
                        };
                        match kept {
                            Some(e) => e,
                            None => {
                                let secs = interval.seconds.max(0) as f64;
                                let rate = if secs > 0.0 {
                                    f64::from(per_fill) / secs
                                } else {
                                    f64::INFINITY
                                };
                                fresh = f64::from(tb.max_tokens);
                                Enforced::Tokens {
                                    max_tokens: tb.max_tokens,
                                    tokens_per_fill: per_fill,
                                    fill_nanos: interval.nanos,
                                    rate,
                                    tokens: f64::from(tb.max_tokens),
                                    at: now,
                                }
                            }
                        }
                    }
                };
                b.enforced = Some((enforced, now + Duration::from_secs(ttl.max(0) as u64)));
                state.fresh_tokens += fresh;
                state.received.push(Received {
                    at: now,
                    bucket,
                    enforced: Some(enforced),
                    ttl_secs: ttl,
                });
            }
        }
    }
}
