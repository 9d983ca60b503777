//! The local deny cache: a denied check is answered here, without asking the store, until the moment
//! its algorithm guarantees it is still denied.
//!
//! After a store answers "denied" with a wait `w` (the algorithm's `retry`), the same check with at least
//! the same cost cannot be allowed before `sent + w`, where `sent` is when the request was sent: time only
//! moves the state towards allowing at the rate the algorithm says, and other replicas can only add hits.
//! So the cache never changes a decision. It is keyed by the counter key *and* the limit's parameters (a
//! request override with another limit misses), holds at most `max_entries`, and is cleared when the rules
//! change. Under an attack on one key, the store stops seeing that key at all until its wait is over.
//!
//! The key is the counter key without the window start fixed windows add in the store: a fixed-window
//! denial waits for the end of its window, so an entry never outlives the window it was denied in.

use super::{sharded::Sharded, Outcome};
use crate::algorithm::Params;

const SHARDS: usize = 16;

#[derive(Debug, Clone)]
struct Entry {
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
    per_shard: usize,
}

impl DenyCache {
    pub fn new(max_entries: usize) -> Self {
        Self {
            entries: Sharded::new(SHARDS),
            per_shard: max_entries.div_ceil(SHARDS).max(1),
        }
    }

    /// The remembered denial of this check, if it still holds at `now_ms`.
    pub fn lookup(&self, key: &str, params: &Params, cost: u64, now_ms: u64) -> Option<Outcome> {
        let mut shard = self.entries.lock_key(key);
        let entry = shard.get(key)?;
        if now_ms >= entry.until_ms {
            shard.remove(key);
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
        if outcome.allowed || outcome.retry_ms == 0 {
            return;
        }
        let entry = Entry {
            params,
            cost,
            until_ms: sent_ms + outcome.retry_ms,
            outcome,
            since_ms: sent_ms,
        };
        let mut shard = self.entries.lock_key(key);
        if shard.len() >= self.per_shard && !shard.contains_key(key) {
            shard.retain(|_, e| e.until_ms > sent_ms);
            if shard.len() >= self.per_shard {
                // Full of live denials: this one is simply asked of the store again next time.
                return;
            }
        }
        shard.insert(key.into(), entry);
    }

    /// Forgets everything (the rules changed).
    pub fn clear(&self) {
        for mut shard in self.entries.each() {
            shard.clear();
        }
    }

    pub fn len(&self) -> usize {
        self.entries.each().map(|shard| shard.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Algorithm;

    fn params(limit: u64) -> Params {
        Params {
            algorithm: Algorithm::TokenBucket,
            limit,
            window_ms: 1000,
            burst: limit,
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
    fn stays_within_its_bound() {
        let cache = DenyCache::new(32);
        for i in 0..1000 {
            cache.insert(&format!("k{i}"), params(5), 1, denied(60_000), 0);
        }
        assert!(cache.len() <= 32, "{}", cache.len());
    }
}
