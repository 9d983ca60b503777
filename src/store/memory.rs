//! The embedded store: counters in a sharded map inside this process.
//!
//! A batch locks the shards its keys live in, in ascending shard order (so concurrent batches cannot
//! deadlock), decides every check, and consumes only when the request is allowed: atomic per request.
//! Checks of limits that count over their limit are counted whatever the request's decision.
//! Counters carry their expiry (end of window); [`MemoryStore::sweep`] reclaims expired ones, so memory
//! follows the live keys, not the keys ever seen. The number of counters is bounded by `max_keys`, a
//! counter whose key is longer than [`KEY_BYTES`] counting once per started [`KEY_BYTES`] of it (a
//! request may carry keys of up to 32 KiB, so a bound in counters alone would be one of 32 GB): when
//! full, expired counters are reclaimed first, and if none can be, the batch fails with
//! [`StoreError::Full`] without touching anything. A full store looks for expired counters at most
//! every [`ROOM_SWEEP_EVERY_MS`]: a sweep reads every counter, and a store kept full of live ones
//! (callers creating counters faster than they expire) would otherwise read them all for each new one.

use std::{
    sync::atomic::{AtomicU64, AtomicUsize, Ordering},
    time::Duration,
};

use smallvec::SmallVec;
use tokio_util::sync::CancellationToken;

use super::{
    operator::LocalRecords,
    sharded::{Held, Shard, Sharded},
    Applied, Batch, Check, CounterStore, Deadline, Outcome, StoreError, StoreHealth,
};
use crate::{
    algorithm::{self, Decision, Next, State},
    clock::Clock,
};

/// Per-batch bookkeeping, on the stack for requests of up to eight checks.
type Small<T> = SmallVec<[T; 8]>;

const SHARDS: usize = 64;

/// Least time between two sweeps a full store makes to find room, in milliseconds.
pub const ROOM_SWEEP_EVERY_MS: u64 = 100;

/// Key bytes a counter counts for once against `max_keys`.
pub const KEY_BYTES: usize = 1024;

/// Most a request's time may lag the latest time a request was decided at and still be taken as that
/// time (see [`MemoryStore::steady_ms`]); a clock further behind has stepped back.
pub const MOST_LAG_MS: u64 = 1_000;

/// The tag a check's counter is kept under beside its key: its window's length. A fixed window's key
/// is the reference layout's without the window start Redis appends, so limits of one key with
/// different windows (a request's override of a rule's unit has the key of the rule's first limit)
/// would otherwise share one counter, each taking it to its own window and forgetting the other's
/// hits. The other algorithms have their window in the key already. (On Redis the window start tells
/// them apart, but for windows that start together, a minute's and an hour's at the top of an hour,
/// which then share a key as they do in the reference service.)
fn window_of(check: &Check) -> u64 {
    check.params.window_ms
}

/// How many times a counter of this key counts against `max_keys`.
fn weight(key: &str) -> usize {
    key.len().div_ceil(KEY_BYTES).max(1)
}

#[derive(Debug, Clone)]
struct Entry {
    state: State,
    /// Milliseconds since the epoch after which the state means nothing and may be dropped.
    expires_at_ms: u64,
    /// How many times it counts against `max_keys` ([`weight`] of its key).
    weight: u32,
}

/// Counters in memory. Exact for one replica; replicas do not share it.
#[derive(Debug)]
pub struct MemoryStore {
    counters: Sharded<Entry>,
    max_keys: usize,
    len: AtomicUsize,
    /// The counters' weights summed: what `max_keys` bounds.
    weight: AtomicUsize,
    /// When a full store last swept for room (`u64::MAX`: never).
    room_swept_ms: AtomicU64,
    /// The latest time a request was decided at.
    latest_ms: AtomicU64,
    /// The runtime limits set by operators, kept here like the counters (see `store::operator`).
    pub(super) records: LocalRecords,
}

impl MemoryStore {
    pub fn new(max_keys: usize) -> Self {
        Self {
            counters: Sharded::new(SHARDS),
            max_keys,
            len: AtomicUsize::new(0),
            weight: AtomicUsize::new(0),
            room_swept_ms: AtomicU64::new(u64::MAX),
            latest_ms: AtomicU64::new(0),
            records: LocalRecords::default(),
        }
    }

    /// The live state of a check's counter, read without changing it (for the operators' API).
    pub fn state_of(&self, check: &Check, now_ms: u64) -> Option<State> {
        let key = self.counters.hash(&check.key, window_of(check));
        live_state(self.counters.lock_of(key).get(key), now_ms).cloned()
    }

    /// Forgets a check's counter (an operator's reset); whether there was one still live at `now_ms`.
    pub fn forget(&self, check: &Check, now_ms: u64) -> bool {
        let key = self.counters.hash(&check.key, window_of(check));
        let removed = self.counters.lock_of(key).remove(key);
        if let Some(entry) = &removed {
            self.len.fetch_sub(1, Ordering::Relaxed);
            self.weight
                .fetch_sub(entry.weight as usize, Ordering::Relaxed);
        }
        removed.is_some_and(|e| e.expires_at_ms > now_ms)
    }

    /// Number of counters held, expired or not.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every counter whose state has expired; returns how many. A request that read the clock
    /// before the sweep and reaches its counter after it is decided at the sweep's time (see
    /// [`MemoryStore::steady_ms`]): it finds the counter gone only in a window where it would have
    /// expired. A clock more than [`MOST_LAG_MS`] behind the latest time has stepped back: the
    /// store's time goes on from it.
    pub fn sweep(&self, now_ms: u64) -> usize {
        let latest = self.latest_ms.fetch_max(now_ms, Ordering::Relaxed);
        if latest > now_ms.saturating_add(MOST_LAG_MS) {
            let _ = self.latest_ms.compare_exchange(
                latest,
                now_ms,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
        let now_ms = self.steady_ms(now_ms);
        self.counters
            .each()
            .map(|mut shard| self.purge(&mut shard, now_ms))
            .sum()
    }

    fn purge(&self, shard: &mut Shard<Entry>, now_ms: u64) -> usize {
        let before = shard.len();
        let weight = shard.retain_weighed(|e| e.expires_at_ms > now_ms, |e| e.weight as usize);
        let removed = before - shard.len();
        self.len.fetch_sub(removed, Ordering::Relaxed);
        self.weight.fetch_sub(weight, Ordering::Relaxed);
        removed
    }

    /// Reserves room for `new_keys` counters weighing `new_weight`, reclaiming expired ones if needed.
    fn reserve(
        &self,
        (new_keys, new_weight): (usize, usize),
        held: &mut Held<'_, '_, Entry>,
        now_ms: u64,
    ) -> Result<(), StoreError> {
        if new_keys == 0 {
            return Ok(());
        }
        for attempt in 0..2 {
            let before = self.weight.fetch_add(new_weight, Ordering::Relaxed);
            if before + new_weight <= self.max_keys {
                self.len.fetch_add(new_keys, Ordering::Relaxed);
                return Ok(());
            }
            self.weight.fetch_sub(new_weight, Ordering::Relaxed);
            if attempt == 0 {
                if !self.room_sweep_due(now_ms) {
                    break;
                }
                for shard in held.shards_mut() {
                    self.purge(shard, now_ms);
                }
                // Other shards too, without waiting for them: blocking here could deadlock with a batch
                // that holds them and waits for ours.
                for i in 0..self.counters.shards() {
                    if !held.holds(i) {
                        if let Some(mut shard) = self.counters.try_lock(i) {
                            self.purge(&mut shard, now_ms);
                        }
                    }
                }
            }
        }
        Err(StoreError::Full {
            max_keys: self.max_keys,
        })
    }

    /// Whether a full store may sweep for room at `now_ms`: once per [`ROOM_SWEEP_EVERY_MS`], by
    /// whichever request asks first (the others meanwhile are refused at once), and again at once
    /// after the clock steps back.
    fn room_sweep_due(&self, now_ms: u64) -> bool {
        let last = self.room_swept_ms.load(Ordering::Relaxed);
        let due = now_ms < last || now_ms - last >= ROOM_SWEEP_EVERY_MS;
        due && self
            .room_swept_ms
            .compare_exchange(last, now_ms, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }

    /// The time a request whose counters are locked is decided at: its own, read before it waited for
    /// them, or the latest time a request was decided at when that is later. Two requests of one
    /// counter are decided in the order they take its lock, and a request that read the clock first
    /// but took the lock second (its thread paused in between) would otherwise take a fixed window's
    /// counter back to the window before, forgetting the hits of the new one, or write a sliding log's
    /// entries out of order. A request more than [`MOST_LAG_MS`] behind is taken at its own time (the
    /// clock may have stepped back), and the latest time stays: only a sweep, which reads the clock
    /// afresh, takes a step back for the store (see [`MemoryStore::sweep`]).
    fn steady_ms(&self, now_ms: u64) -> u64 {
        // Read first, written only when later: most requests of a busy store find a later time
        // there, and leave its cache line shared. Read with the counters locked, it holds at
        // least the time of whichever request held them before.
        let mut latest = self.latest_ms.load(Ordering::Relaxed);
        if now_ms > latest {
            latest = self.latest_ms.fetch_max(now_ms, Ordering::Relaxed);
        }
        if latest > now_ms && latest - now_ms <= MOST_LAG_MS {
            latest
        } else {
            now_ms
        }
    }

    fn apply_now(&self, batch: &Batch, now_ms: u64) -> Result<Applied, StoreError> {
        let checks = &batch.checks;
        // One entry per counter key and window: a fixed-window state carries its window start, and a
        // state from an earlier window has expired. Each key is hashed once, here.
        let mut held = self
            .counters
            .lock_keys(checks.iter().map(|c| (c.key.as_str(), window_of(c))));
        // Read with the counters locked: a request that locks one of them after this one reads it later.
        let now_ms = self.steady_ms(now_ms);
        let mut decided = decide_in_order(checks, &held, now_ms, |_| true);
        let denied = batch.is_denied(|i| decided[i].decision.allowed);
        let consume = !denied || batch.consume_on_deny;
        if consume && decided.iter().any(|d| d.next.is_some()) {
            self.write(checks, &mut decided, &mut held, now_ms)?;
        } else if !consume
            && checks
                .iter()
                .any(|c| c.params.count_over_limit && c.cost > 0)
        {
            // Counted all the same: each decided again on the state as stored (and as its earlier such
            // checks leave it), as decide.lua does.
            let mut counted = decide_in_order(checks, &held, now_ms, |c| c.params.count_over_limit);
            self.write(checks, &mut counted, &mut held, now_ms)?;
        }
        let outcomes = checks
            .iter()
            .zip(&decided)
            .enumerate()
            .map(|(i, (check, decided))| {
                if consume || !decided.decision.allowed || check.params.count_over_limit {
                    Outcome::from(decided.decision)
                } else {
                    // Allowed but not consumed: report the quota as it stands (nothing was written).
                    let stored = live_state(held.get(i), now_ms);
                    let (as_is, _) = algorithm::decide(&check.params, stored, now_ms, 0);
                    Outcome {
                        allowed: true,
                        ..Outcome::from(as_is)
                    }
                }
            })
            .collect();
        Ok(Applied { denied, outcomes })
    }

    /// Stores the new state of every check that has one, once room is reserved for the keys not stored
    /// yet; fails without writing anything when there is none.
    fn write(
        &self,
        checks: &[Check],
        decided: &mut [Decided],
        held: &mut Held<'_, '_, Entry>,
        now_ms: u64,
    ) -> Result<(), StoreError> {
        // A key heavier than the whole bound weighs the bound: it can be stored in an empty store.
        let weight = |key: &str| weight(key).min(self.max_keys);
        let new = decided
            .iter()
            .zip(checks)
            .filter(|(d, _)| d.new_key)
            .fold((0, 0), |(n, w), (_, c)| (n + 1, w + weight(&c.key)));
        self.reserve(new, held, now_ms)?;
        let (mut added, mut added_weight) = (0, 0);
        for (i, check) in checks.iter().enumerate() {
            let Some(next) = decided[i].next.take() else {
                continue;
            };
            let p = &check.params;
            // A sliding log still in use changes in place; any other state is stored whole.
            if let Next::Log(record) = next {
                if let Some(entry) = held.get_mut(i).filter(|e| e.expires_at_ms > now_ms) {
                    if let State::SlidingLog(log) = &mut entry.state {
                        log.record(p, record, now_ms);
                        entry.expires_at_ms = algorithm::expires_at_ms(p, &entry.state, now_ms);
                        continue;
                    }
                }
            }
            let state = next.apply(p, None, now_ms);
            let weight = weight(&check.key);
            let entry = Entry {
                expires_at_ms: algorithm::expires_at_ms(p, &state, now_ms),
                state,
                weight: u32::try_from(weight).unwrap_or(u32::MAX),
            };
            if held.insert(i, entry) {
                added += 1;
                added_weight += weight;
            }
        }
        // Making room may have reclaimed an expired counter of this very batch, which was then stored
        // anew: counted here, so that the count stays the number of counters held.
        if added > new.0 {
            self.len.fetch_add(added - new.0, Ordering::Relaxed);
            self.weight
                .fetch_add(added_weight.saturating_sub(new.1), Ordering::Relaxed);
        }
        Ok(())
    }
}

/// One check decided, before anything is written.
struct Decided {
    decision: Decision,
    /// What the check changes when the request consumes; none when it changes nothing, or when a later
    /// check of the same key in the request takes its change in.
    next: Option<Next>,
    /// The check stores a key that is not stored yet: it writes the key first in the batch (no earlier
    /// check of the key changed it) and no entry is there, expired or not (an expired one is
    /// overwritten in place). Only such keys need room.
    new_key: bool,
}

impl Decided {
    /// A check left as it is.
    fn unchanged() -> Self {
        Self {
            decision: Decision {
                allowed: true,
                remaining: 0,
                reset_ms: 0,
                retry_ms: 0,
            },
            next: None,
            new_key: false,
        }
    }
}

/// Decides every check in order, or only those `deciding` picks (the others change nothing); a key
/// checked twice sees the state the earlier check left.
fn decide_in_order(
    checks: &[Check],
    held: &Held<'_, '_, Entry>,
    now_ms: u64,
    deciding: impl Fn(&Check) -> bool,
) -> Small<Decided> {
    let mut decided: Small<Decided> = Small::new();
    for (i, check) in checks.iter().enumerate() {
        if !deciding(check) {
            decided.push(Decided::unchanged());
            continue;
        }
        let earlier = (0..i)
            .rev()
            .find(|&j| decided[j].next.is_some() && held.same_key(i, j));
        let stored = held.get(i);
        let (decision, next) = algorithm::decide_after(
            &check.params,
            live_state(stored, now_ms),
            earlier.and_then(|j| decided[j].next.as_ref()),
            now_ms,
            check.bounded_cost(),
        );
        // This check's change includes the earlier one's, and is stored instead.
        if let (Some(j), Some(_)) = (earlier, &next) {
            decided[j].next = None;
        }
        decided.push(Decided {
            decision,
            new_key: earlier.is_none() && stored.is_none() && next.is_some(),
            next,
        });
    }
    decided
}

/// The state in a stored entry, unless it has expired.
fn live_state(stored: Option<&Entry>, now_ms: u64) -> Option<&State> {
    stored
        .filter(|e| e.expires_at_ms > now_ms)
        .map(|e| &e.state)
}

impl CounterStore for MemoryStore {
    /// Decided at once under the shard locks: nothing to wait for, so the deadline does not apply.
    async fn apply(
        &self,
        batch: &Batch,
        now_millis: u64,
        _deadline: Deadline,
    ) -> Result<Applied, StoreError> {
        self.apply_now(batch, now_millis)
    }

    fn health(&self) -> StoreHealth {
        StoreHealth {
            counters: Some(self.len()),
            ..StoreHealth::default()
        }
    }

    /// Reclaims expired counters every `every`, so that memory follows the keys in use.
    async fn maintain(&self, clock: &Clock, every: Duration, stop: CancellationToken) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tick.tick() => {
                    let removed = self.sweep(clock.now_millis());
                    if removed > 0 {
                        tracing::debug!(removed, remaining = self.len(), "expired counters reclaimed");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{algorithm::Algorithm, store::Role};

    fn check(key: &str, limit: u64, window: u64, cost: u64, role: Role) -> Check {
        Check::fixed_window(key.into(), limit, window, cost, role)
    }

    fn run(store: &MemoryStore, batch: &Batch, now_secs: u64) -> Applied {
        store.apply_now(batch, now_secs * 1000).unwrap()
    }

    /// A request of one hit on `key`, limited to 5 per window of `window_secs`.
    fn one(key: &str, window_secs: u64) -> Batch {
        Batch {
            checks: vec![check(key, 5, window_secs, 1, Role::Enforce)],
            consume_on_deny: false,
            known_denied: false,
        }
    }

    /// A request that read the clock before another but locks their counter after it (its thread
    /// paused in between) is decided at the other's time: it neither takes a fixed window back to the
    /// window before, forgetting the new window's hits, nor writes a sliding log out of order.
    #[test]
    fn a_request_that_lags_another_is_decided_at_the_others_time() {
        let store = MemoryStore::new(100);
        let limited = |key: &str, limit, algorithm| {
            let mut check = check(key, limit, 1, 1, Role::Enforce);
            check.params.algorithm = algorithm;
            Batch {
                checks: vec![check],
                consume_on_deny: false,
                known_denied: false,
            }
        };
        let fixed = limited("fixed_", 1, Algorithm::FixedWindow);
        assert!(
            !store.apply_now(&fixed, 2_001).unwrap().denied,
            "the new window's hit"
        );
        // Read at 1 999, in the window before, but decided after the request above.
        let lagging = store.apply_now(&fixed, 1_999).unwrap();
        assert!(lagging.denied, "decided at 2 001: {lagging:?}");
        let next = store.apply_now(&fixed, 2_002).unwrap();
        assert!(next.denied, "the new window's hit was kept: {next:?}");

        let log = limited("log_", 3, Algorithm::SlidingLog);
        for read_at in [10_005, 10_000, 10_010] {
            assert!(!store.apply_now(&log, read_at).unwrap().denied);
        }
        let mut two = log.clone();
        two.checks[0].cost = 2;
        let denied = store.apply_now(&two, 11_003).unwrap();
        assert!(denied.denied);
        assert_eq!(
            denied.outcomes[0].retry_ms, 2,
            "two hits leave at 11 005, the lagging one among them"
        );
    }

    /// A request that read the clock before a sweep dropped its counter, expired by the sweep's time,
    /// is decided at that time: in the next window, counted there.
    #[test]
    fn a_request_that_lags_a_sweep_is_counted_in_the_window_after_it() {
        let store = MemoryStore::new(100);
        let once = Batch {
            checks: vec![check("swept_", 1, 1, 1, Role::Enforce)],
            consume_on_deny: false,
            known_denied: false,
        };
        assert!(!store.apply_now(&once, 1_999).unwrap().denied);
        assert_eq!(store.sweep(2_000), 1);
        // Read at 1 998, before the sweep: the window of 1 000 is full, but its counter is gone.
        assert!(
            !store.apply_now(&once, 1_998).unwrap().denied,
            "in the window of 2 000"
        );
        let next = store.apply_now(&once, 2_001).unwrap();
        assert!(next.denied, "that window's one hit was counted: {next:?}");
    }

    /// A clock that steps back further than a request can lag is taken as it is, and once a sweep
    /// has seen it, time goes on from there; one request that lags by more than that does not take
    /// the store's time back.
    #[test]
    fn after_the_clock_steps_back_requests_are_decided_at_its_time() {
        let store = MemoryStore::new(100);
        let (fixed, other) = (one("stepped_", 1), one("other_", 1));
        for _ in 0..5 {
            store.apply_now(&fixed, 20_000).unwrap();
            store.apply_now(&other, 20_000).unwrap();
        }
        assert!(store.apply_now(&fixed, 20_100).unwrap().denied);
        assert!(
            !store.apply_now(&fixed, 5_000).unwrap().denied,
            "the window of 5 000, not of 20 000"
        );
        // Not a step back for the store: a request read just before 20 000 and decided after the
        // others is still decided at 20 100, in the full window.
        assert!(store.apply_now(&other, 19_999).unwrap().denied);
        store.sweep(5_000);
        for _ in 0..4 {
            store.apply_now(&fixed, 5_000).unwrap();
        }
        // 500 ms behind the stepped-back clock, in the window before it: decided at 5 000.
        assert!(store.apply_now(&fixed, 4_500).unwrap().denied);
    }

    #[test]
    fn a_denied_request_consumes_nothing_by_default() {
        let store = MemoryStore::new(100);
        let batch = Batch {
            checks: vec![
                check("a_", 10, 60, 1, Role::Enforce),
                check("b_", 2, 60, 1, Role::Enforce),
            ],
            consume_on_deny: false,
            known_denied: false,
        };
        for _ in 0..2 {
            assert!(!run(&store, &batch, 1000).denied);
        }
        let third = run(&store, &batch, 1000);
        assert!(third.denied);
        // `a` was not consumed by the denied request: 10 - 2 hits left.
        assert_eq!(
            third.outcomes[0],
            Outcome {
                allowed: true,
                remaining: 8,
                reset_after: 20,
                retry_after: 0,
                retry_ms: 0
            }
        );
        assert_eq!(third.outcomes[1].remaining, 0);
        let only_a = Batch {
            checks: vec![check("a_", 10, 60, 1, Role::Enforce)],
            consume_on_deny: false,
            known_denied: false,
        };
        assert_eq!(run(&store, &only_a, 1000).outcomes[0].remaining, 7);
    }

    #[test]
    fn consume_on_deny_counts_every_descriptor_like_the_reference() {
        let store = MemoryStore::new(100);
        let batch = Batch {
            checks: vec![
                check("a_", 10, 60, 1, Role::Enforce),
                check("b_", 1, 60, 1, Role::Enforce),
            ],
            consume_on_deny: true,
            known_denied: false,
        };
        assert!(!run(&store, &batch, 1000).denied);
        let second = run(&store, &batch, 1000);
        assert!(second.denied);
        assert_eq!(second.outcomes[0].remaining, 8);
        assert_eq!(run(&store, &batch, 1000).outcomes[0].remaining, 7);
    }

    #[test]
    fn windows_reset_at_the_epoch_aligned_boundary() {
        let store = MemoryStore::new(100);
        let batch = Batch {
            checks: vec![check("a_", 1, 60, 1, Role::Enforce)],
            consume_on_deny: false,
            known_denied: false,
        };
        assert!(!run(&store, &batch, 1259).denied);
        assert!(run(&store, &batch, 1259).denied);
        assert!(!run(&store, &batch, 1260).denied);
    }

    #[test]
    fn shadow_checks_never_deny_and_quota_checks_deny_only_together() {
        let store = MemoryStore::new(100);
        let shadow = Batch {
            checks: vec![check("s_", 0, 60, 1, Role::Shadow)],
            consume_on_deny: false,
            known_denied: false,
        };
        let applied = run(&store, &shadow, 0);
        assert!(!applied.denied && !applied.outcomes[0].allowed);

        let quota = Batch {
            checks: vec![
                check("q1_", 0, 60, 1, Role::Quota),
                check("q2_", 5, 60, 1, Role::Quota),
            ],
            consume_on_deny: false,
            known_denied: false,
        };
        assert!(!run(&store, &quota, 0).denied);
        let all_over = Batch {
            checks: vec![
                check("q1_", 0, 60, 1, Role::Quota),
                check("q3_", 0, 60, 1, Role::Quota),
            ],
            consume_on_deny: false,
            known_denied: false,
        };
        assert!(run(&store, &all_over, 0).denied);
    }

    #[test]
    fn the_same_key_twice_in_one_request_counts_twice() {
        let store = MemoryStore::new(100);
        let batch = Batch {
            checks: vec![
                check("a_", 1, 60, 1, Role::Enforce),
                check("a_", 1, 60, 1, Role::Enforce),
            ],
            consume_on_deny: true,
            known_denied: false,
        };
        let applied = run(&store, &batch, 0);
        assert!(applied.outcomes[0].allowed && !applied.outcomes[1].allowed);
    }

    #[test]
    fn zero_cost_checks_without_creating_counters() {
        let store = MemoryStore::new(100);
        let batch = Batch {
            checks: vec![check("a_", 3, 60, 0, Role::Enforce)],
            consume_on_deny: false,
            known_denied: false,
        };
        assert_eq!(run(&store, &batch, 0).outcomes[0].remaining, 3);
        assert!(store.is_empty());
    }

    #[test]
    fn the_key_bound_reclaims_expired_counters_then_refuses_new_ones() {
        let store = MemoryStore::new(2);
        let one = |k: &str| one(k, 1);
        run(&store, &one("a_"), 10);
        run(&store, &one("b_"), 10);
        let err = store.apply_now(&one("c_"), 10_000).unwrap_err();
        assert!(err.to_string().contains("memory.max_keys"), "{err}");
        // Existing counters keep working while full.
        assert!(!run(&store, &one("a_"), 10).denied);
        // Once their windows end, their room is reused without waiting for a sweep.
        assert!(!run(&store, &one("c_"), 11).denied);
        assert_eq!(store.len(), 1);
        assert_eq!(store.sweep(12_000), 1);
        assert!(store.is_empty());
    }

    /// A request's override of a rule's unit has the key of the rule's first limit (Redis tells them
    /// apart by the window start it appends, but for windows that start together): each keeps its own
    /// counter, and neither resets the other.
    #[test]
    fn limits_of_one_key_in_two_windows_count_apart() {
        let store = MemoryStore::new(100);
        let per_minute = one("k_", 60);
        let per_second = one("k_", 1);
        for _ in 0..5 {
            assert!(!run(&store, &per_minute, 100).denied);
        }
        assert!(
            run(&store, &per_minute, 100).denied,
            "the sixth in a minute"
        );
        assert!(!run(&store, &per_second, 100).denied, "its own count");
        assert!(
            run(&store, &per_minute, 101).denied,
            "still the minute's sixth: the other window did not start it anew"
        );
        assert_eq!(store.len(), 2);
    }

    #[test]
    fn a_long_key_counts_once_per_kib_against_the_bound() {
        let store = MemoryStore::new(4);
        let long = format!("{}_", "k".repeat(2 * KEY_BYTES + 1));
        run(&store, &one(&long, 1), 10);
        run(&store, &one("a_", 60), 10);
        assert_eq!(store.len(), 2);
        let err = store.apply_now(&one("b_", 60), 10).unwrap_err();
        assert!(err.to_string().contains("memory.max_keys"), "{err}");
        // The long key's window ends: its three places are free again.
        assert_eq!(store.sweep(11_000), 1);
        for k in ["b_", "c_", "d_"] {
            assert!(store.apply_now(&one(k, 60), 11_000).is_ok(), "{k}");
        }
        assert!(store.apply_now(&one("e_", 60), 11_000).is_err());
        assert!(store.forget(&one("a_", 60).checks[0], 11_000));
        assert!(
            !store.forget(&one("b_", 1).checks[0], 11_000),
            "another window's"
        );
        run(&store, &one("f_", 1), 12);
        assert!(
            !store.forget(&one("f_", 1).checks[0], 13_000),
            "ended: nothing to clear"
        );
        assert!(store.apply_now(&one("e_", 60), 11_000).is_ok());
    }

    #[test]
    fn a_full_store_looks_for_room_at_most_every_tenth_of_a_second() {
        let store = MemoryStore::new(2);
        // `a_` ends at 11 s, `b_` lives on.
        store.apply_now(&one("a_", 1), 10_000).unwrap();
        store.apply_now(&one("b_", 60), 10_000).unwrap();
        // Full of live counters: the sweep finds nothing.
        assert!(store.apply_now(&one("c_", 60), 10_950).is_err());
        // `a_` has ended, but the store swept 60 ms ago: refused without reading every counter.
        assert!(store.apply_now(&one("c_", 60), 11_010).is_err());
        assert_eq!(store.len(), 2);
        // A tenth of a second on, it sweeps again and finds `a_`'s room.
        assert!(!store.apply_now(&one("c_", 60), 11_050).unwrap().denied);
        assert_eq!(store.len(), 2);
    }

    #[test]
    fn a_counter_reclaimed_to_make_room_and_stored_again_is_counted() {
        let store = MemoryStore::new(2);
        let one = |k: &str| check(k, 5, 1, 1, Role::Enforce);
        let batch = |checks: Vec<Check>| Batch {
            checks,
            consume_on_deny: false,
            known_denied: false,
        };
        run(&store, &batch(vec![one("a_"), one("b_")]), 10);
        // Both expired; the store is full, so making room for `c_` reclaims them, `a_` included,
        // which this request then stores again.
        run(&store, &batch(vec![one("a_"), one("c_")]), 11);
        assert_eq!(store.len(), 2, "a_ and c_ are held");
        assert_eq!(store.sweep(12_000), 2);
        assert!(store.is_empty());
    }

    #[test]
    fn sweeping_keeps_memory_flat_under_key_churn() {
        let store = MemoryStore::new(1_000_000);
        for second in 0..50u64 {
            for k in 0..200 {
                let batch = Batch {
                    checks: vec![check(
                        &format!("churn{second}_{k}_"),
                        5,
                        1,
                        1,
                        Role::Enforce,
                    )],
                    consume_on_deny: false,
                    known_denied: false,
                };
                run(&store, &batch, second);
            }
            store.sweep(second * 1000);
            assert!(
                store.len() <= 200,
                "second {second}: {} counters",
                store.len()
            );
        }
    }
}
