//! A map keyed by counter keys, split into shards that each have their own lock, so that requests on
//! different keys seldom wait for one another. The memory store keeps its counters in one, the deny cache
//! its denials.
//!
//! Keys are spread by a hasher seeded at random per map, so that nobody can choose keys that all land in
//! one shard. A poisoned shard is used as it is: a thread that panicked while holding it left plain values
//! behind, and the map itself stays consistent.

use std::{
    collections::HashMap,
    hash::{BuildHasher, RandomState},
    sync::{Mutex, MutexGuard},
};

use smallvec::SmallVec;

/// Per-batch bookkeeping, on the stack for batches of up to eight keys.
type Small<T> = SmallVec<[T; 8]>;

/// One shard: the part of the map behind one lock.
pub type Shard<V> = HashMap<Box<str>, V>;

/// A map split into a fixed number of locked shards.
#[derive(Debug)]
pub struct Sharded<V> {
    shards: Box<[Mutex<Shard<V>>]>,
    hasher: RandomState,
}

impl<V> Sharded<V> {
    /// An empty map of `shards` shards (at least one).
    pub fn new(shards: usize) -> Self {
        Self {
            shards: (0..shards.max(1))
                .map(|_| Mutex::new(HashMap::new()))
                .collect(),
            hasher: RandomState::new(),
        }
    }

    /// The number of shards.
    pub fn shards(&self) -> usize {
        self.shards.len()
    }

    /// The index of the shard `key` lives in.
    pub fn shard_of(&self, key: &str) -> usize {
        (self.hasher.hash_one(key) as usize) % self.shards.len()
    }

    /// Locks the shard of this index, waiting for it.
    pub fn lock(&self, index: usize) -> MutexGuard<'_, Shard<V>> {
        self.shards[index]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Locks the shard `key` lives in.
    pub fn lock_key(&self, key: &str) -> MutexGuard<'_, Shard<V>> {
        self.lock(self.shard_of(key))
    }

    /// Locks the shard of this index if nobody holds it (a poisoned one is skipped too).
    pub fn try_lock(&self, index: usize) -> Option<MutexGuard<'_, Shard<V>>> {
        self.shards[index].try_lock().ok()
    }

    /// Every shard in turn, each locked only while the caller holds its guard.
    pub fn each(&self) -> impl Iterator<Item = MutexGuard<'_, Shard<V>>> {
        (0..self.shards.len()).map(|i| self.lock(i))
    }

    /// Locks the shards of all these keys at once, each once, in ascending order: two callers locking
    /// overlapping shards this way cannot deadlock.
    pub fn lock_keys<'k>(&self, keys: impl Iterator<Item = &'k str>) -> Held<'_, V> {
        let shards: Small<usize> = keys.map(|key| self.shard_of(key)).collect();
        let mut held: Small<usize> = shards.clone();
        held.sort_unstable();
        held.dedup();
        Held {
            slots: shards
                .iter()
                .map(|shard| held.partition_point(|i| i < shard))
                .collect(),
            guards: held.iter().map(|&i| (i, self.lock(i))).collect(),
        }
    }
}

/// The shards of several keys, locked until this is dropped.
pub struct Held<'a, V> {
    /// Each shard held, with its index, in ascending order.
    guards: Small<(usize, MutexGuard<'a, Shard<V>>)>,
    /// For each key, in the order given, the position in `guards` of its shard.
    slots: Small<usize>,
}

impl<'a, V> Held<'a, V> {
    /// The shard of the `key`-th key given.
    pub fn shard(&self, key: usize) -> &Shard<V> {
        &self.guards[self.slots[key]].1
    }

    pub fn shard_mut(&mut self, key: usize) -> &mut Shard<V> {
        &mut self.guards[self.slots[key]].1
    }

    /// Whether the shard of this index is among those held.
    pub fn holds(&self, index: usize) -> bool {
        self.guards.iter().any(|(held, _)| *held == index)
    }

    /// Every shard held.
    pub fn shards_mut(&mut self) -> impl Iterator<Item = &mut Shard<V>> + use<'_, 'a, V> {
        self.guards.iter_mut().map(|(_, guard)| &mut **guard)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_always_lands_in_the_same_shard() {
        let map: Sharded<u32> = Sharded::new(8);
        for i in 0..100 {
            let key = format!("k{i}");
            map.lock_key(&key).insert(key.as_str().into(), i);
        }
        for i in 0..100 {
            let key = format!("k{i}");
            assert_eq!(map.lock(map.shard_of(&key)).get(key.as_str()), Some(&i));
        }
        assert_eq!(map.each().map(|s| s.len()).sum::<usize>(), 100);
        assert!(map.each().filter(|s| !s.is_empty()).count() > 1, "spread");
    }
}
