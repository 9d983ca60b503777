//! The local deny cache: a denied check is answered here, without asking the store, until the moment
//! its algorithm guarantees it is still denied.
//!
//! After a store answers "denied" with a wait `w` (the algorithm's `retry`), the same check with at least
//! the same cost cannot be allowed before `sent + w`, where `sent` is when the request was sent: time only
//! moves the state towards allowing at the rate the algorithm says, and other replicas can only add hits.
//! So the cache never changes a decision. It is keyed by the counter key *and* the limit's parameters (a
//! request override with another limit misses), holds at most `max_entries`, and is cleared when the rules
//! change. Under an attack on one key, the store stops seeing that key at all until its wait is over.
//! Checks of limits that count over their limit are never answered or remembered here: each of their
//! hits must reach the store to be counted.
//!
//! The key is the counter key without the window start fixed windows add in the store: a fixed-window
//! denial waits for the end of its window, so an entry never outlives the window it was denied in.
//!
//! [`DenyCached`] puts the cache in front of a store: it is itself a [`CounterStore`], answers the checks
//! it remembers and asks the store about the rest.

use std::{
    future::Future,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Arc,
    },
};

use smallvec::{smallvec, SmallVec};

use super::{
    sharded::Sharded, Applied, Batch, Check, CounterStore, Deadline, Outcome, Role, Store,
    StoreError,
};
use crate::algorithm::Params;

/// Per-batch bookkeeping, on the stack for requests of up to eight checks.
type Small<T> = SmallVec<[T; 8]>;

const SHARDS: usize = 16;

/// A full shard is swept for expired denials at most this often: a sweep reads the whole shard, and a
/// cache kept full of live denials (costs above the limit on fresh keys) would otherwise be read whole for
/// every new denial. Until the next sweep, new denials are asked of the store again, as when nothing
/// expired.
pub const SWEEP_EVERY_MS: u64 = 100;

/// Bytes of key an entry holds for each place it takes in the cache: an entry is sized at 256 bytes
/// (`LOCAL_CACHE_SIZE_IN_BYTES` / 256 entries), of which its key takes up to this many; a longer key (a
/// request may ask for keys of up to 32 KiB) takes one more place per started this many bytes.
const KEY_BYTES_PER_PLACE: usize = 128;

/// How many places a denial of this key takes.
fn places(key: &str) -> usize {
    key.len().div_ceil(KEY_BYTES_PER_PLACE).max(1)
}

#[derive(Debug, Clone)]
struct Entry {
    /// The places it takes ([`places`] of its key).
    places: u32,
    params: Params,
    cost: u64,
    /// Denied until this time (ms since the epoch, local clock).
    until_ms: u64,
    /// The store's answer, reset time measured from `since_ms`.
    outcome: Outcome,
    since_ms: u64,
}

/// Denials remembered locally.
#[derive(Debug)]
pub struct DenyCache {
    entries: Sharded<Entry>,
    /// Places in each shard: entries of keys up to [`KEY_BYTES_PER_PLACE`] bytes take one each.
    per_shard: usize,
    /// Places taken in each shard. Read and written under the shard's lock.
    taken: [AtomicUsize; SHARDS],
    /// When each shard was last swept for room (ms; `u64::MAX`: never). Read and written under the
    /// shard's lock.
    swept_ms: [AtomicU64; SHARDS],
    /// Counts the clears: a denial the store decided before one is not remembered after it.
    clears: AtomicU64,
}

impl DenyCache {
    pub fn new(max_entries: usize) -> Self {
        Self {
            entries: Sharded::new(SHARDS),
            per_shard: max_entries.div_ceil(SHARDS).max(1),
            taken: std::array::from_fn(|_| AtomicUsize::new(0)),
            swept_ms: std::array::from_fn(|_| AtomicU64::new(u64::MAX)),
            clears: AtomicU64::new(0),
        }
    }

    /// What [`DenyCache::remember`] is given: read before the store is asked.
    pub fn clears(&self) -> u64 {
        self.clears.load(Ordering::SeqCst)
    }

    /// The remembered denial of this check, if it still holds at `now_ms`.
    pub fn lookup(&self, key: &str, params: &Params, cost: u64, now_ms: u64) -> Option<Outcome> {
        // Kept by window too, as the memory store keeps its counters: a request's override of a rule's
        // unit has the key of the rule's first limit, and its denial is another one.
        let key = self.entries.hash(key, params.window_ms);
        let index = self.entries.shard_of(key);
        let mut shard = self.entries.lock(index);
        let entry = shard.get(key)?;
        // Past its end, or before its start: the clock stepped back, and only the store can say what
        // the denial is worth now.
        if now_ms >= entry.until_ms || now_ms < entry.since_ms {
            if let Some(gone) = shard.remove(key) {
                self.taken[index].fetch_sub(gone.places as usize, Ordering::Relaxed);
            }
            return None;
        }
        if entry.params != *params || cost < entry.cost {
            return None;
        }
        let elapsed_s = (now_ms - entry.since_ms) / 1000;
        Some(Outcome {
            allowed: false,
            remaining: 0,
            reset_after: entry.outcome.reset_after.saturating_sub(elapsed_s).max(1),
            retry_after: (entry.until_ms - now_ms).div_ceil(1000),
            retry_ms: entry.until_ms - now_ms,
        })
    }

    /// Remembers a denial answered by the store for a request sent at `sent_ms`.
    pub fn insert(&self, key: &str, params: Params, cost: u64, outcome: Outcome, sent_ms: u64) {
        self.remember(self.clears(), key, params, cost, outcome, sent_ms);
    }

    /// [`DenyCache::insert`], unless the cache was cleared since [`DenyCache::clears`] read `seen`: an
    /// operator's reset (or new rules) came while the store was deciding, and the denial may no
    /// longer hold.
    pub fn remember(
        &self,
        seen: u64,
        key: &str,
        params: Params,
        cost: u64,
        outcome: Outcome,
        sent_ms: u64,
    ) {
        if outcome.allowed || outcome.retry_ms == 0 {
            return;
        }
        let places = places(key);
        if places > self.per_shard {
            return;
        }
        let entry = Entry {
            places: places as u32,
            params,
            cost,
            until_ms: sent_ms.saturating_add(outcome.retry_ms),
            outcome,
            since_ms: sent_ms,
        };
        let key = self.entries.hash(key, params.window_ms);
        let index = self.entries.shard_of(key);
        let mut shard = self.entries.lock(index);
        // Read with the shard locked: a clear counts itself before it clears the shards, so it
        // either clears this entry after it is written or is seen here.
        if self.clears() != seen {
            return;
        }
        let taken = &self.taken[index];
        let fits = |taken: &AtomicUsize| taken.load(Ordering::Relaxed) + places <= self.per_shard;
        if !fits(taken) && shard.get(key).is_none() {
            // Full: room is made from expired denials, once per SWEEP_EVERY_MS (and at once after the
            // clock stepped back); otherwise this one is simply asked of the store again next time.
            let swept = &self.swept_ms[index];
            let last = swept.load(Ordering::Relaxed);
            if last <= sent_ms && sent_ms - last < SWEEP_EVERY_MS {
                return;
            }
            swept.store(sent_ms, Ordering::Relaxed);
            let freed = shard.retain_weighed(|e| e.until_ms > sent_ms, |e| e.places as usize);
            taken.fetch_sub(freed, Ordering::Relaxed);
            if !fits(taken) {
                return;
            }
        }
        // A key already there is replaced in place: its places stay taken.
        if shard.insert(key, entry) {
            taken.fetch_add(places, Ordering::Relaxed);
        }
    }

    /// Forgets everything (the rules changed, an operator reset a counter), and what the store is
    /// deciding meanwhile.
    pub fn clear(&self) {
        self.clears.fetch_add(1, Ordering::SeqCst);
        for (mut shard, taken) in self.entries.each().zip(&self.taken) {
            shard.clear();
            taken.store(0, Ordering::Relaxed);
        }
    }

    pub fn len(&self) -> usize {
        self.entries.each().map(|shard| shard.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A store whose denials the deny cache may remember. Unless an answer says otherwise, a store's denials
/// hold for every replica's traffic. A denial this replica decided alone (the local fallback of
/// `on_backend_error: local`, while the shared store cannot decide) says otherwise: the shared counters
/// may well allow the next request.
pub trait CacheableStore: CounterStore {
    /// [`CounterStore::apply`], and whether the answer's denials may be remembered.
    fn apply_cacheable(
        &self,
        batch: &Batch,
        now_millis: u64,
        deadline: Deadline,
    ) -> impl Future<Output = Result<(Applied, bool), StoreError>> + Send {
        async move { Ok((self.apply(batch, now_millis, deadline).await?, true)) }
    }
}

impl CacheableStore for Store {}

/// A store with the deny cache in front of it (or none, when the cache is off): enforced checks with a
/// remembered denial are answered here, the others by the store, whose enforced denials are remembered.
#[derive(Debug)]
pub struct DenyCached<S> {
    store: S,
    cache: Option<Arc<DenyCache>>,
}

impl<S: CacheableStore> DenyCached<S> {
    pub fn new(store: S, cache: Option<Arc<DenyCache>>) -> Self {
        Self { store, cache }
    }

    /// [`CounterStore::apply`], marking in `from_cache` (one flag per check) the checks the cache
    /// answered.
    pub async fn apply_marking(
        &self,
        batch: &Batch,
        now_millis: u64,
        deadline: Deadline,
        from_cache: &mut [bool],
    ) -> Result<Applied, StoreError> {
        // A request that checks one counter twice is left to the store: its later checks are decided with
        // the earlier ones' hits added, which neither the cache nor the stored counter alone can tell.
        let Some(cache) = self.cache.as_deref().filter(|_| !counts_a_key_twice(batch)) else {
            return self.store.apply(batch, now_millis, deadline).await;
        };
        let cached: Small<Option<Outcome>> = batch
            .checks
            .iter()
            .map(|c| {
                remembered(c)
                    .then(|| cache.lookup(&c.key, &c.params, c.cost, now_millis))
                    .flatten()
            })
            .collect();
        if cached.iter().all(Option::is_none) {
            return self
                .apply_remembering(cache, batch, now_millis, deadline)
                .await;
        }
        for (marked, outcome) in from_cache.iter_mut().zip(&cached) {
            *marked = outcome.is_some();
        }
        self.apply_denied(batch, &cached, now_millis, deadline)
            .await
    }

    /// The store's answer, its enforced denials remembered when they hold for every replica.
    async fn apply_remembering(
        &self,
        cache: &DenyCache,
        batch: &Batch,
        now_millis: u64,
        deadline: Deadline,
    ) -> Result<Applied, StoreError> {
        let seen = cache.clears();
        let (applied, cacheable) = self
            .store
            .apply_cacheable(batch, now_millis, deadline)
            .await?;
        if cacheable {
            for (c, outcome) in batch.checks.iter().zip(&applied.outcomes) {
                if remembered(c) && !outcome.allowed {
                    cache.remember(seen, &c.key, c.params, c.cost, *outcome, now_millis);
                }
            }
        }
        Ok(applied)
    }

    /// The answer to a request the cache denies: the cached outcomes, and the store's for the other
    /// checks. The store decides those as part of a denied request (their own verdicts for their
    /// statuses, consuming only what a denied request consumes), so the answer and the counters are what
    /// they would be without the cache.
    async fn apply_denied(
        &self,
        batch: &Batch,
        cached: &[Option<Outcome>],
        now_millis: u64,
        deadline: Deadline,
    ) -> Result<Applied, StoreError> {
        let rest: Small<usize> = (0..batch.checks.len())
            .filter(|&i| cached[i].is_none())
            .collect();
        let mut outcomes: Vec<Outcome> = cached.iter().map(|o| o.unwrap_or_default()).collect();
        if !rest.is_empty() {
            let others = Batch {
                checks: rest.iter().map(|&i| batch.checks[i].clone()).collect(),
                consume_on_deny: batch.consume_on_deny,
                known_denied: true,
            };
            let decided = self.store.apply(&others, now_millis, deadline).await?;
            for (&i, outcome) in rest.iter().zip(decided.outcomes) {
                outcomes[i] = outcome;
            }
        }
        Ok(Applied {
            denied: true,
            outcomes,
        })
    }
}

impl<S: CacheableStore> CounterStore for DenyCached<S> {
    async fn apply(
        &self,
        batch: &Batch,
        now_millis: u64,
        deadline: Deadline,
    ) -> Result<Applied, StoreError> {
        let mut from_cache: Small<bool> = smallvec![false; batch.checks.len()];
        self.apply_marking(batch, now_millis, deadline, &mut from_cache)
            .await
    }
}

/// Whether the cache answers (and remembers the denials of) a check: an enforced one, unless it counts
/// over its limit, whose every hit must reach the store to be counted.
fn remembered(check: &Check) -> bool {
    check.role == Role::Enforce && !check.params.count_over_limit
}

/// Whether two checks of the batch count the same key.
fn counts_a_key_twice(batch: &Batch) -> bool {
    let checks = &batch.checks;
    checks
        .iter()
        .enumerate()
        .any(|(i, c)| checks[..i].iter().any(|earlier| earlier.key == c.key))
}

#[cfg(test)]
mod tests {
    use std::{
        sync::atomic::{AtomicUsize, Ordering},
        time::Duration,
    };

    use super::*;
    use crate::{
        algorithm::Algorithm,
        store::{Check, MemoryStore},
    };

    fn params(limit: u64) -> Params {
        Params {
            algorithm: Algorithm::TokenBucket,
            limit,
            window_ms: 1000,
            burst: limit,
            count_over_limit: false,
        }
    }

    fn denied(retry_ms: u64) -> Outcome {
        Outcome {
            allowed: false,
            remaining: 0,
            reset_after: 2,
            retry_after: retry_ms.div_ceil(1000),
            retry_ms,
        }
    }

    #[test]
    fn holds_a_denial_exactly_until_its_wait_is_over() {
        let cache = DenyCache::new(100);
        cache.insert("k", params(5), 1, denied(250), 10_000);
        assert!(cache.lookup("k", &params(5), 1, 10_249).is_some());
        assert_eq!(
            cache.lookup("k", &params(5), 1, 10_100).unwrap().retry_ms,
            150
        );
        assert!(
            cache.lookup("k", &params(5), 1, 10_250).is_none(),
            "over at the exact wait"
        );
        assert!(cache.is_empty());
    }

    #[test]
    fn a_clock_stepped_back_before_a_denial_leaves_it_to_the_store() {
        let cache = DenyCache::new(100);
        cache.insert("k", params(5), 1, denied(2_000), 10_000);
        assert!(cache.lookup("k", &params(5), 1, 9_000).is_none());
        assert!(
            cache.is_empty(),
            "forgotten, not kept for the 3 s it now seems to have left"
        );
    }

    #[test]
    fn misses_for_another_limit_a_smaller_cost_or_after_clear() {
        let cache = DenyCache::new(100);
        cache.insert("k", params(5), 2, denied(1000), 0);
        assert!(
            cache.lookup("k", &params(50), 2, 1).is_none(),
            "an override raised the limit"
        );
        assert!(
            cache.lookup("k", &params(5), 1, 1).is_none(),
            "a smaller cost might fit"
        );
        assert!(cache.lookup("k", &params(5), 3, 1).is_some());
        cache.clear();
        assert!(cache.lookup("k", &params(5), 2, 1).is_none());
    }

    #[test]
    fn denials_of_one_key_in_two_windows_are_both_kept() {
        let cache = DenyCache::new(100);
        let hourly = Params {
            window_ms: 3_600_000,
            ..params(5)
        };
        cache.insert("k", params(5), 1, denied(1000), 0);
        cache.insert("k", hourly, 1, denied(60_000), 0);
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.lookup("k", &params(5), 1, 1).unwrap().retry_ms, 999);
        assert_eq!(cache.lookup("k", &hourly, 1, 1).unwrap().retry_ms, 59_999);
    }

    /// A memory store that counts the batches it is asked, and says whether its denials may be remembered;
    /// it clears `clears` while it decides (an operator's reset seen by this replica meanwhile).
    struct Counted {
        store: MemoryStore,
        asked: AtomicUsize,
        cacheable: bool,
        clears: Option<Arc<DenyCache>>,
    }

    impl CounterStore for Counted {
        async fn apply(
            &self,
            batch: &Batch,
            now: u64,
            deadline: Deadline,
        ) -> Result<Applied, StoreError> {
            self.asked.fetch_add(1, Ordering::Relaxed);
            let applied = self.store.apply(batch, now, deadline).await;
            if let Some(cache) = &self.clears {
                cache.clear();
            }
            applied
        }
    }

    impl CacheableStore for Counted {
        async fn apply_cacheable(
            &self,
            batch: &Batch,
            now: u64,
            deadline: Deadline,
        ) -> Result<(Applied, bool), StoreError> {
            Ok((self.apply(batch, now, deadline).await?, self.cacheable))
        }
    }

    fn cached(cacheable: bool) -> DenyCached<Counted> {
        let store = Counted {
            store: MemoryStore::new(100),
            asked: AtomicUsize::new(0),
            cacheable,
            clears: None,
        };
        DenyCached::new(store, Some(Arc::new(DenyCache::new(100))))
    }

    /// A denial the store decided while the cache was cleared (an operator reset the counter) is not
    /// remembered: the next request goes to the store, which may allow it.
    #[tokio::test]
    async fn a_denial_decided_while_the_cache_is_cleared_is_not_remembered() {
        let cache = Arc::new(DenyCache::new(100));
        let store = Counted {
            store: MemoryStore::new(100),
            asked: AtomicUsize::new(0),
            cacheable: true,
            clears: Some(cache.clone()),
        };
        let cached = DenyCached::new(store, Some(cache.clone()));
        let one = [Check::fixed_window("one_".into(), 1, 60, 1, Role::Enforce)];
        decide(&cached, &one, 60_000).await;
        assert_eq!(decide(&cached, &one, 60_001).await, (true, vec![false]));
        assert!(cache.is_empty(), "the denial came back after the clear");
        assert_eq!(decide(&cached, &one, 60_002).await, (true, vec![false]));
        assert_eq!(cached.store.asked.load(Ordering::Relaxed), 3);
    }

    /// Asks `cached` to decide `checks` at `now_ms`: whether the request was denied, and which checks the
    /// cache answered.
    async fn decide(
        cached: &DenyCached<Counted>,
        checks: &[Check],
        now_ms: u64,
    ) -> (bool, Vec<bool>) {
        let batch = Batch {
            checks: checks.to_vec(),
            consume_on_deny: false,
            known_denied: false,
        };
        let mut from_cache = vec![false; checks.len()];
        let applied = cached
            .apply_marking(
                &batch,
                now_ms,
                Deadline::within(Duration::from_secs(1)),
                &mut from_cache,
            )
            .await
            .unwrap();
        (applied.denied, from_cache)
    }

    #[tokio::test]
    async fn a_remembered_denial_is_answered_without_asking_the_store() {
        let cached = cached(true);
        let one = [Check::fixed_window("one_".into(), 1, 60, 1, Role::Enforce)];
        assert_eq!(decide(&cached, &one, 60_000).await, (false, vec![false]));
        assert_eq!(decide(&cached, &one, 60_001).await, (true, vec![false]));
        assert_eq!(decide(&cached, &one, 60_002).await, (true, vec![true]));
        assert_eq!(cached.store.asked.load(Ordering::Relaxed), 2);
        // With another check beside it, the other is still decided by the store, as part of a denied
        // request: it consumes nothing.
        let two = [
            one[0].clone(),
            Check::fixed_window("two_".into(), 1, 60, 1, Role::Enforce),
        ];
        assert_eq!(
            decide(&cached, &two, 60_003).await,
            (true, vec![true, false])
        );
        assert_eq!(cached.store.asked.load(Ordering::Relaxed), 3);
        assert_eq!(
            decide(&cached, &two[1..], 60_004).await,
            (false, vec![false])
        );
        // A new window: the denial is over.
        assert_eq!(decide(&cached, &one, 120_000).await, (false, vec![false]));
    }

    #[tokio::test]
    async fn denials_a_store_says_are_its_own_are_not_remembered() {
        let cached = cached(false);
        let one = [Check::fixed_window("one_".into(), 1, 60, 1, Role::Enforce)];
        decide(&cached, &one, 60_000).await;
        for now_ms in 60_001..60_004 {
            assert_eq!(decide(&cached, &one, now_ms).await, (true, vec![false]));
        }
        assert_eq!(cached.store.asked.load(Ordering::Relaxed), 4);
    }

    #[tokio::test]
    async fn a_check_that_counts_over_its_limit_always_reaches_the_store() {
        let cached = cached(true);
        let mut budget = Check::fixed_window("budget_".into(), 1, 60, 1, Role::Enforce);
        budget.params.count_over_limit = true;
        let one = [budget];
        assert_eq!(decide(&cached, &one, 60_000).await, (false, vec![false]));
        for now_ms in 60_001..60_004 {
            assert_eq!(decide(&cached, &one, now_ms).await, (true, vec![false]));
        }
        assert_eq!(cached.store.asked.load(Ordering::Relaxed), 4);
        assert!(
            cached.cache.as_ref().unwrap().is_empty(),
            "nothing remembered"
        );
    }

    #[test]
    fn stays_within_its_bound() {
        let cache = DenyCache::new(32);
        for i in 0..1000 {
            cache.insert(&format!("k{i}"), params(5), 1, denied(60_000), 0);
        }
        assert!(cache.len() <= 32, "{}", cache.len());
    }

    #[test]
    fn long_keys_take_a_place_per_128_bytes_so_the_bound_holds_in_bytes() {
        // 4 places a shard: a 300-byte key takes 3, so one such denial a shard at most.
        let cache = DenyCache::new(4 * SHARDS);
        let key = |i: usize| format!("{i:05}{}", "k".repeat(295));
        for i in 0..1000 {
            cache.insert(&key(i), params(5), 1, denied(60_000), 0);
        }
        assert!(cache.len() <= SHARDS, "{}", cache.len());
        assert!(cache.len() > SHARDS / 2, "{}", cache.len());
        // A key longer than a whole shard's places is never remembered, and takes nothing.
        let huge = "h".repeat(4 * KEY_BYTES_PER_PLACE + 1);
        cache.insert(&huge, params(5), 1, denied(60_000), 0);
        assert!(cache.lookup(&huge, &params(5), 1, 10).is_none());
        // Once they expire, short keys fill the places again, four a shard.
        let short = DenyCache::new(4 * SHARDS);
        for i in 0..1000 {
            short.insert(&format!("k{i}"), params(5), 1, denied(60_000), 0);
        }
        assert_eq!(short.len(), 4 * SHARDS);
        for i in 0..1000 {
            cache.insert(&format!("k{i}"), params(5), 1, denied(60_000), 70_000);
        }
        assert_eq!(
            cache.len(),
            4 * SHARDS,
            "the long keys' places were given back"
        );

        // A denial found expired by a lookup gives its place back too.
        let one = DenyCache::new(SHARDS);
        let mut keys = (0..).map(|i| format!("a{i}"));
        let mut first = Vec::new();
        while one.len() < SHARDS {
            let key = keys.next().unwrap();
            one.insert(&key, params(5), 1, denied(50), 0);
            first.push(key);
        }
        for key in &first {
            assert!(one.lookup(key, &params(5), 1, 100).is_none());
        }
        assert!(one.is_empty());
        for key in keys.take(1000) {
            one.insert(&key, params(5), 1, denied(60_000), 100);
        }
        assert_eq!(one.len(), SHARDS);
    }

    #[test]
    fn a_full_cache_is_swept_for_room_at_most_every_100_ms() {
        // One entry per shard: every shard full after one denial that lasts 50 ms.
        let cache = DenyCache::new(SHARDS);
        let mut keys = (0..).map(|i| format!("k{i}"));
        while cache.len() < SHARDS {
            let key = keys.next().unwrap();
            cache.insert(&key, params(5), 1, denied(50), 1_000);
        }
        // Every new denial now sweeps its shard once: nothing has expired, nothing is remembered.
        let newcomers: Vec<String> = keys.take(400).collect();
        for key in &newcomers {
            cache.insert(key, params(5), 1, denied(60_000), 1_000);
        }
        assert_eq!(cache.len(), SHARDS);
        // The old denials expire at 1 050; until 1 100 no shard is swept again, so none makes room.
        for key in &newcomers {
            cache.insert(key, params(5), 1, denied(60_000), 1_060);
            assert!(cache.lookup(key, &params(5), 1, 1_060).is_none());
        }
        assert_eq!(cache.len(), SHARDS);
        // From 1 100 on, a full shard is swept and the expired denial gives its place.
        for key in &newcomers {
            cache.insert(key, params(5), 1, denied(60_000), 1_100);
        }
        assert_eq!(cache.len(), SHARDS);
        let remembered = newcomers
            .iter()
            .filter(|k| cache.lookup(k, &params(5), 1, 1_100).is_some())
            .count();
        assert_eq!(remembered, SHARDS, "one newcomer per shard");
    }
}
