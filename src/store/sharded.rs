//! A map keyed by counter keys, split into shards that each have their own lock, so that requests on
//! different keys seldom wait for one another. The memory store keeps its counters in one, the deny cache
//! its denials.
//!
//! An entry is found by its key and a tag: two entries may share a key under different tags (the memory
//! store keeps a fixed window's counter under the key of the reference layout, which leaves the
//! window's length to the key's Redis suffix, and tags it with that length).
//!
//! Keys are spread by a hasher seeded at random per map, so that nobody can choose keys that all land in
//! one shard or one chain of a shard. A key is hashed once per use ([`Hashed`]): the same hash picks its
//! shard (from its high half) and finds it there (hashbrown's table uses the low bits and the top seven),
//! and each entry keeps its hash so that growing a shard hashes nothing again. A poisoned shard is used
//! as it is: a thread that panicked while holding it left plain values behind, and the map itself stays
//! consistent.

use std::{
    hash::{BuildHasher, RandomState},
    sync::{Mutex, MutexGuard},
};

use hashbrown::{hash_table::Entry, HashTable};
use smallvec::SmallVec;

/// Per-batch bookkeeping, on the stack for batches of up to eight keys.
type Small<T> = SmallVec<[T; 8]>;

/// A key and its tag, with their hash under one map's hasher.
#[derive(Debug, Clone, Copy)]
pub struct Hashed<'k> {
    key: &'k str,
    tag: u64,
    hash: u64,
}

/// One entry: its hash (for growing the table), its key and tag, and its value.
#[derive(Debug)]
struct Slot<V> {
    hash: u64,
    tag: u64,
    key: Box<str>,
    value: V,
}

impl Hashed<'_> {
    /// Whether `slot` holds this key and tag: the full hash first, which tells nearly every other key
    /// apart without reading the slot's key from the heap.
    fn is_in<V>(&self, slot: &Slot<V>) -> bool {
        slot.hash == self.hash && slot.tag == self.tag && *slot.key == *self.key
    }

    /// Whether both are the same key under the same tag.
    fn same(&self, other: &Self) -> bool {
        self.hash == other.hash && self.tag == other.tag && self.key == other.key
    }
}

/// One shard: the part of the map behind one lock.
#[derive(Debug)]
pub struct Shard<V> {
    table: HashTable<Slot<V>>,
}

impl<V> Default for Shard<V> {
    fn default() -> Self {
        Self {
            table: HashTable::new(),
        }
    }
}

impl<V> Shard<V> {
    pub fn len(&self) -> usize {
        self.table.len()
    }

    pub fn get(&self, key: Hashed<'_>) -> Option<&V> {
        self.table
            .find(key.hash, |slot| key.is_in(slot))
            .map(|slot| &slot.value)
    }

    pub fn get_mut(&mut self, key: Hashed<'_>) -> Option<&mut V> {
        self.table
            .find_mut(key.hash, |slot| key.is_in(slot))
            .map(|slot| &mut slot.value)
    }

    /// Stores `value` under `key`, replacing what was there; whether the key is new here.
    pub fn insert(&mut self, key: Hashed<'_>, value: V) -> bool {
        match self
            .table
            .entry(key.hash, |slot| key.is_in(slot), |slot| slot.hash)
        {
            Entry::Occupied(mut held) => {
                held.get_mut().value = value;
                false
            }
            Entry::Vacant(room) => {
                room.insert(Slot {
                    hash: key.hash,
                    tag: key.tag,
                    key: key.key.into(),
                    value,
                });
                true
            }
        }
    }

    pub fn remove(&mut self, key: Hashed<'_>) -> Option<V> {
        self.table
            .find_entry(key.hash, |slot| key.is_in(slot))
            .ok()
            .map(|entry| entry.remove().0.value)
    }

    /// Keeps the entries for which `keep` is true; returns the sum of `weight` over those dropped.
    pub fn retain_weighed(
        &mut self,
        keep: impl Fn(&V) -> bool,
        weight: impl Fn(&V) -> usize,
    ) -> usize {
        let mut dropped = 0;
        self.table.retain(|slot| {
            let kept = keep(&slot.value);
            if !kept {
                dropped += weight(&slot.value);
            }
            kept
        });
        dropped
    }

    pub fn clear(&mut self) {
        self.table.clear();
    }
}

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
                .map(|_| Mutex::new(Shard::default()))
                .collect(),
            hasher: RandomState::new(),
        }
    }

    /// The number of shards.
    pub fn shards(&self) -> usize {
        self.shards.len()
    }

    /// `key` under `tag`, hashed for this map.
    pub fn hash<'k>(&self, key: &'k str, tag: u64) -> Hashed<'k> {
        Hashed {
            key,
            tag,
            hash: self.hasher.hash_one((key, tag)),
        }
    }

    /// The index of the shard `key` lives in: from the hash's high half, which the shard's own table
    /// does not use to place it.
    pub fn shard_of(&self, key: Hashed<'_>) -> usize {
        ((key.hash >> 32) as usize) % self.shards.len()
    }

    /// Locks the shard of this index, waiting for it.
    pub fn lock(&self, index: usize) -> MutexGuard<'_, Shard<V>> {
        self.shards[index]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Locks the shard `key` lives in.
    pub fn lock_of(&self, key: Hashed<'_>) -> MutexGuard<'_, Shard<V>> {
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

    /// Locks the shards of all these keys (each under its tag) at once, each shard once, in ascending
    /// order: two callers locking overlapping shards this way cannot deadlock. Each key is hashed here,
    /// once.
    pub fn lock_keys<'k>(&self, keys: impl Iterator<Item = (&'k str, u64)>) -> Held<'_, 'k, V> {
        let mut hashed: Small<(Hashed<'k>, usize)> = Small::new();
        // The shards to lock, ascending and each once; a request has a handful of keys.
        let mut shards: Small<usize> = Small::new();
        for (key, tag) in keys {
            let key = self.hash(key, tag);
            let shard = self.shard_of(key);
            if let Err(at) = shards.binary_search(&shard) {
                shards.insert(at, shard);
            }
            hashed.push((key, shard));
        }
        Held {
            guards: shards.iter().map(|&i| (i, self.lock(i))).collect(),
            keys: hashed,
        }
    }
}

/// The shards of several keys, locked until this is dropped; keys are named by their position in the
/// order given.
pub struct Held<'a, 'k, V> {
    /// Each shard held, with its index, in ascending order.
    guards: Small<(usize, MutexGuard<'a, Shard<V>>)>,
    /// The keys, hashed, each with the index of its shard.
    keys: Small<(Hashed<'k>, usize)>,
}

impl<'a, V> Held<'a, '_, V> {
    /// The shard of the `key`-th key given (found among a handful held).
    fn shard(&self, key: usize) -> &Shard<V> {
        let shard = self.keys[key].1;
        let at = self.guards.partition_point(|(i, _)| *i < shard);
        &self.guards[at].1
    }

    /// The value of the `key`-th key given.
    pub fn get(&self, key: usize) -> Option<&V> {
        self.shard(key).get(self.keys[key].0)
    }

    /// The value of the `key`-th key given, to change in place.
    pub fn get_mut(&mut self, key: usize) -> Option<&mut V> {
        let (hashed, shard) = self.keys[key];
        let at = self.guards.partition_point(|(i, _)| *i < shard);
        self.guards[at].1.get_mut(hashed)
    }

    /// Whether the `a`-th and `b`-th keys given are the same key under the same tag (their hashes tell
    /// most apart).
    pub fn same_key(&self, a: usize, b: usize) -> bool {
        self.keys[a].0.same(&self.keys[b].0)
    }

    /// Stores `value` under the `key`-th key given, replacing what was there; whether the key is new.
    pub fn insert(&mut self, key: usize, value: V) -> bool {
        let (hashed, shard) = self.keys[key];
        let at = self.guards.partition_point(|(i, _)| *i < shard);
        self.guards[at].1.insert(hashed, value)
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
            let hashed = map.hash(&key, 0);
            map.lock_of(hashed).insert(hashed, i);
        }
        for i in 0..100 {
            let key = format!("k{i}");
            let hashed = map.hash(&key, 0);
            assert_eq!(map.lock_of(hashed).get(hashed), Some(&i));
            let held = map.lock_keys([(key.as_str(), 0)].into_iter());
            assert_eq!(held.get(0), Some(&i), "the same shard through lock_keys");
        }
        assert_eq!(map.each().map(|s| s.len()).sum::<usize>(), 100);
        assert!(map.each().filter(|s| s.len() > 0).count() > 1, "spread");
    }

    #[test]
    fn entries_are_replaced_removed_and_kept_across_growth() {
        let map: Sharded<u32> = Sharded::new(1);
        let keys: Vec<String> = (0..1000).map(|i| format!("key {i}")).collect();
        let mut held = map.lock_keys(keys.iter().map(|k| (k.as_str(), 0)).take(8));
        held.insert(3, 1);
        held.insert(3, 2);
        assert_eq!((held.get(3), held.get(4)), (Some(&2), None));
        drop(held);
        let mut shard = map.lock(0);
        for (i, key) in keys.iter().enumerate() {
            shard.insert(map.hash(key, 0), i as u32);
        }
        assert_eq!(shard.len(), 1000);
        assert!(keys
            .iter()
            .enumerate()
            .all(|(i, k)| shard.get(map.hash(k, 0)) == Some(&(i as u32))));
        assert_eq!(shard.remove(map.hash(&keys[7], 0)), Some(7));
        assert_eq!(shard.remove(map.hash(&keys[7], 0)), None);
        // The odd ones go (one of them removed above), their values summed.
        let dropped = shard.retain_weighed(|v| v % 2 == 0, |v| *v as usize);
        assert_eq!(dropped, (1..1000).step_by(2).sum::<usize>() - 7);
        assert_eq!(shard.len(), 500);
        assert_eq!(shard.get(map.hash(&keys[10], 0)), Some(&10));
    }

    #[test]
    fn one_key_under_two_tags_is_two_entries() {
        let map: Sharded<u32> = Sharded::new(4);
        let mut held = map.lock_keys([("k", 60_000), ("k", 1_000), ("k", 60_000)].into_iter());
        assert!(!held.same_key(0, 1) && held.same_key(0, 2));
        assert!(held.insert(0, 1) && held.insert(1, 2));
        assert!(!held.insert(2, 3), "the first entry again");
        assert_eq!((held.get(0), held.get(1)), (Some(&3), Some(&2)));
        drop(held);
        let minute = map.hash("k", 60_000);
        assert_eq!(map.lock_of(minute).remove(minute), Some(3));
        let second = map.hash("k", 1_000);
        assert_eq!(map.lock_of(second).get(second), Some(&2), "kept");
    }
}
