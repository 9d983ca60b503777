//! Where counters live. Every store implements [`CounterStore`]: one call decides a whole request
//! atomically, so that a denied request can leave every counter untouched. The same interface carries
//! the store's lifecycle (readiness, health for the metrics, housekeeping, closing), so that the server
//! never needs to know which store it runs.
//!
//! `operator` adds what the operators' API asks of a store, off the request path: reading and clearing
//! counters, and keeping the runtime limits every replica applies.

mod breaker;
pub mod deny_cache;
pub mod keys;
pub mod memory;
pub mod operator;
pub mod redis;
mod sharded;

use std::{future::Future, sync::Arc, time::Duration};

use tokio_util::sync::CancellationToken;

use crate::{
    algorithm::{fixed_window, Algorithm, Decision, Params},
    clock::Clock,
};

pub use deny_cache::DenyCache;
pub use memory::MemoryStore;
pub use redis::RedisStore;

/// How a check's verdict weighs in the request's decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Over the limit denies the request.
    Enforce,
    /// Counted and reported, but never denies (`shadow_mode` rules).
    Shadow,
    /// Denies only when every quota check of the request is over (`quota_mode` rules).
    Quota,
}

/// One counter to check (and consume) for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// The counter key (see [`keys`]); for fixed windows without the window start, which the store
    /// appends.
    pub key: String,
    /// The limit and how it counts.
    pub params: Params,
    /// Hits this request adds; 0 only checks.
    pub cost: u64,
    pub role: Role,
    /// A further limit of the descriptor of the check before it (a rule's `rate_limits`): a quota
    /// descriptor is over when any of its limits is, and counts once among the request's quota
    /// descriptors.
    pub further_limit: bool,
    /// The limit's unit is SECOND: with a per-second Redis (`REDIS_PERSECOND`), counted there.
    pub per_second: bool,
    /// Hits reported after they were admitted (a rate limit quota report), not a request asking: the
    /// store counts them itself, and they never make a counter hot nor are answered from a quota lease
    /// (whose view of what is left would be this replica's, not the store's).
    pub reported: bool,
}

impl Check {
    /// A fixed-window check (the reference service's counting).
    pub fn fixed_window(key: String, limit: u64, window_secs: u64, cost: u64, role: Role) -> Self {
        Self {
            key,
            params: Params {
                algorithm: Algorithm::FixedWindow,
                limit,
                window_ms: window_secs * 1000,
                burst: limit,
                count_over_limit: false,
            },
            cost,
            role,
            further_limit: false,
            per_second: window_secs == 1,
            reported: false,
        }
    }

    /// The cost as the store decides it: bounded by what the limit could ever allow (see
    /// [`Params::bounded_cost`]), so that no caller-chosen number reaches arithmetic or storage.
    pub fn bounded_cost(&self) -> u64 {
        self.params.bounded_cost(self.cost)
    }

    /// For fixed windows, the start (seconds since the epoch) of the window containing `now_ms`: the
    /// suffix of its key in the reference layout.
    pub fn window_start_secs(&self, now_ms: u64) -> Option<u64> {
        (self.params.algorithm == Algorithm::FixedWindow).then(|| {
            let window_secs = (self.params.window_ms / 1000).max(1);
            fixed_window::window_start(now_ms / 1000, window_secs)
        })
    }

    /// The key the state lives under at `now_ms`: fixed windows append the window start in seconds
    /// (the reference layout); the other algorithms keep one key.
    pub fn storage_key(&self, now_ms: u64) -> String {
        match self.window_start_secs(now_ms) {
            Some(start) => keys::with_window(&self.key, start),
            None => self.key.clone(),
        }
    }

    /// Writes [`Self::storage_key`] at the end of `out`.
    pub fn push_storage_key(&self, now_ms: u64, out: &mut bytes::BytesMut) {
        match self.window_start_secs(now_ms) {
            Some(start) => keys::push_with_window(out, &self.key, start),
            None => out.extend_from_slice(self.key.as_bytes()),
        }
    }
}

/// Every check of one request.
#[derive(Debug, Clone, Default)]
pub struct Batch {
    pub checks: Vec<Check>,
    /// Consume every counter even when the request is denied (the reference service's behaviour).
    pub consume_on_deny: bool,
    /// A check outside this batch already denies the request (the local deny cache answered it): decide
    /// these checks as the request would, consuming only what a denied request consumes.
    pub known_denied: bool,
}

impl Batch {
    /// Whether a request with these per-check verdicts is denied: an enforced check is over, or the
    /// request has quota descriptors and all of them are over (a descriptor is over when any of its
    /// limits is). decide.lua decides the same way.
    pub fn is_denied(&self, allowed: impl Fn(usize) -> bool) -> bool {
        if self.known_denied {
            return true;
        }
        let (mut quota, mut quota_over, mut this_over) = (0, 0, false);
        for (i, check) in self.checks.iter().enumerate() {
            match check.role {
                Role::Enforce if !allowed(i) => return true,
                Role::Quota => {
                    if !check.further_limit || quota == 0 {
                        quota += 1;
                        this_over = false;
                    }
                    if !allowed(i) && !this_over {
                        this_over = true;
                        quota_over += 1;
                    }
                }
                _ => {}
            }
        }
        quota > 0 && quota_over == quota
    }
}

/// The result of one check.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Outcome {
    /// This counter alone allows the request's cost.
    pub allowed: bool,
    /// Hits left after this request (0 when over).
    pub remaining: u64,
    /// Seconds until the counter is fully reset (rounded up).
    pub reset_after: u64,
    /// When not allowed: seconds before the same cost would be (rounded up); 0 when allowed.
    pub retry_after: u64,
    /// The same wait in milliseconds.
    pub retry_ms: u64,
}

impl From<Decision> for Outcome {
    fn from(d: Decision) -> Self {
        Self {
            allowed: d.allowed,
            remaining: d.remaining,
            reset_after: d.reset_ms.div_ceil(1000),
            retry_after: d.retry_ms.div_ceil(1000),
            retry_ms: d.retry_ms,
        }
    }
}

/// The result of a batch, one outcome per check in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// The request as a whole is denied (see [`Batch::is_denied`]).
    pub denied: bool,
    pub outcomes: Vec<Outcome>,
}

/// How long a store may wait for its backend: the answer to the caller is due.
#[derive(Debug, Clone, Copy)]
pub struct Deadline {
    /// Give up waiting at this moment (the limiter keeps a margin after it to send the answer).
    pub at: tokio::time::Instant,
    /// Whether `at` comes from the caller's own deadline (gRPC `grpc-timeout`). Without one, a store
    /// applies its own bound too (`REDIS_TIMEOUT`).
    pub from_caller: bool,
}

impl Deadline {
    /// No caller deadline: only the service's own bound, `within` from now.
    pub fn within(within: Duration) -> Self {
        Self {
            at: tokio::time::Instant::now() + within,
            from_caller: false,
        }
    }
}

/// Why a store could not decide.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error(
        "memory store full: memory.max_keys ({max_keys}) reached, a counter counting once per started KiB of its key"
    )]
    Full { max_keys: usize },
    #[error("{0}")]
    Backend(String),
    #[error("redis did not answer before the answer was due ({0:?} waited)")]
    Deadline(Duration),
    #[error("redis did not answer within {0:?} (REDIS_TIMEOUT)")]
    Timeout(Duration),
    #[error("redis unresponsive: no answer at all for {0:?} while commands waited (redis.unresponsive_after)")]
    Unresponsive(Duration),
    #[error("redis unavailable: circuit breaker open ({0})")]
    CircuitOpen(&'static str),
    #[error("invalid redis settings: {0}")]
    Config(String),
    /// A Cluster call carrying several slots was refused because one of them moved; nothing was
    /// written. The Redis store sends the request again one slot per call, so this does not reach a
    /// caller.
    #[error("redis cluster: a slot of the call moved before it was decided")]
    SlotsMoved,
}

/// What the metrics show of a store's backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreHealth {
    /// The backend is reachable (Redis: every configured Redis has a connection up).
    pub up: bool,
    /// A circuit breaker answers without asking the backend.
    pub breaker_open: bool,
    /// Counters held in this process, for a store that keeps them here.
    pub counters: Option<usize>,
    /// Quota leases on hot counters, for a store that takes them (Redis).
    pub leases: Option<redis::LeaseStats>,
}

impl Default for StoreHealth {
    /// A store inside this process: always reachable, no breaker, no counters to report.
    fn default() -> Self {
        Self {
            up: true,
            breaker_open: false,
            counters: None,
            leases: None,
        }
    }
}

/// A place that keeps counters and decides batches atomically, with the lifecycle of its backend. The
/// defaults describe a store inside this process: ready at once, always reachable, nothing to maintain or
/// close. A store that wraps another forwards all of them.
pub trait CounterStore: Send + Sync {
    /// Checks every counter of the batch at `now_millis`; consumes them all when the request is allowed
    /// (or when `consume_on_deny`), none otherwise. A remote store stops waiting at `deadline`.
    fn apply(
        &self,
        batch: &Batch,
        now_millis: u64,
        deadline: Deadline,
    ) -> impl Future<Output = Result<Applied, StoreError>> + Send;

    /// Whether the store has been able to decide since start (Redis: connected, scripts loaded).
    fn is_ready(&self) -> bool {
        true
    }

    /// Resolves once the store can decide, trying again (and logging why) until then. Dropping it stops
    /// the trying.
    fn until_ready(&self) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// The backend's state, read at scrape time.
    fn health(&self) -> StoreHealth {
        StoreHealth::default()
    }

    /// Housekeeping every `every` until `stop`; returns at once for a store that needs none.
    fn maintain(
        &self,
        _clock: &Clock,
        _every: Duration,
        _stop: CancellationToken,
    ) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// Closes the backend's connections once nothing decides any more, waiting briefly for commands
    /// still in flight.
    fn close(&self) -> impl Future<Output = ()> + Send {
        async {}
    }
}

/// The configured store.
#[derive(Debug)]
pub enum Store {
    Memory(MemoryStore),
    Redis(Arc<RedisStore>),
    /// Allows everything and counts nothing (benchmark floor).
    Noop,
}

impl Store {
    /// The backend's name in metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Store::Memory(_) => "memory",
            Store::Redis(_) => "redis",
            Store::Noop => "noop",
        }
    }
}

impl Store {
    /// The time on the clock the store counts a check by, at local time `local_ms`: the Redis server's
    /// (as this replica last measured it, see [`RedisStore::clock_ms`]), this process's otherwise.
    /// Fixed windows start and run on it.
    pub fn clock_ms(&self, local_ms: u64, per_second: bool) -> u64 {
        match self {
            Store::Redis(store) => store.clock_ms(local_ms, per_second),
            Store::Memory(_) | Store::Noop => local_ms,
        }
    }
}

/// Every call goes to the configured store; the noop store keeps the in-process defaults.
impl CounterStore for Store {
    async fn apply(
        &self,
        batch: &Batch,
        now_millis: u64,
        deadline: Deadline,
    ) -> Result<Applied, StoreError> {
        match self {
            Store::Memory(store) => store.apply(batch, now_millis, deadline).await,
            // Boxed: a Redis call's state is large, and every future that awaits this one would
            // carry its size (and copy it as it moves) on the memory store too.
            Store::Redis(store) => Box::pin(store.apply(batch, now_millis, deadline)).await,
            Store::Noop => Ok(Applied {
                denied: false,
                outcomes: batch
                    .checks
                    .iter()
                    .map(|c| Outcome {
                        allowed: true,
                        remaining: c.params.limit,
                        reset_after: 0,
                        retry_after: 0,
                        retry_ms: 0,
                    })
                    .collect(),
            }),
        }
    }

    fn is_ready(&self) -> bool {
        match self {
            Store::Memory(store) => store.is_ready(),
            Store::Redis(store) => store.is_ready(),
            Store::Noop => true,
        }
    }

    async fn until_ready(&self) {
        match self {
            Store::Memory(store) => store.until_ready().await,
            Store::Redis(store) => store.until_ready().await,
            Store::Noop => {}
        }
    }

    fn health(&self) -> StoreHealth {
        match self {
            Store::Memory(store) => store.health(),
            Store::Redis(store) => store.health(),
            Store::Noop => StoreHealth::default(),
        }
    }

    async fn maintain(&self, clock: &Clock, every: Duration, stop: CancellationToken) {
        match self {
            Store::Memory(store) => store.maintain(clock, every, stop).await,
            Store::Redis(store) => store.maintain(clock, every, stop).await,
            Store::Noop => {}
        }
    }

    async fn close(&self) {
        match self {
            Store::Memory(store) => store.close().await,
            Store::Redis(store) => store.close().await,
            Store::Noop => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_written_one_after_another_are_the_storage_keys() {
        let fixed = Check::fixed_window("d_user_a_".into(), 5, 60, 1, Role::Enforce);
        let mut bucket = Check::fixed_window("d_user_b".into(), 5, 60, 1, Role::Enforce);
        bucket.params.algorithm = Algorithm::TokenBucket;
        let now_ms = 1_796_234_461_500;
        let mut buffer = bytes::BytesMut::new();
        for check in [&fixed, &bucket, &fixed] {
            check.push_storage_key(now_ms, &mut buffer);
            let key = buffer.split();
            assert_eq!(&key[..], check.storage_key(now_ms).as_bytes());
        }
        assert_eq!(fixed.storage_key(now_ms), "d_user_a_1796234460");
    }

    #[tokio::test(start_paused = true)]
    async fn maintenance_reclaims_expired_counters_in_the_background() {
        let store = Arc::new(Store::Memory(MemoryStore::new(100)));
        let clock = Clock::manual(10_000);
        let batch = Batch {
            checks: (0..10)
                .map(|i| Check::fixed_window(format!("k{i}_"), 5, 1, 1, Role::Enforce))
                .collect(),
            consume_on_deny: false,
            known_denied: false,
        };
        store
            .apply(
                &batch,
                clock.now_millis(),
                Deadline::within(Duration::from_secs(1)),
            )
            .await
            .unwrap();
        let Store::Memory(memory) = &*store else {
            unreachable!()
        };
        assert_eq!(memory.len(), 10);

        let stop = CancellationToken::new();
        let task = tokio::spawn({
            let (store, clock, stop) = (store.clone(), clock.clone(), stop.clone());
            async move { store.maintain(&clock, Duration::from_secs(5), stop).await }
        });
        tokio::time::sleep(Duration::from_secs(6)).await;
        assert_eq!(memory.len(), 10, "still inside their window");
        clock.advance_millis(1_000);
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(memory.is_empty(), "swept once the window ended");
        stop.cancel();
        task.await.unwrap();
    }
}
