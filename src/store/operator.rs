//! What the operators' API asks of a store besides deciding requests: read the state of some counters
//! without consuming anything, clear them, and keep the runtime limits that every replica applies.
//! None of it runs on the request path.
//!
//! Runtime limits are kept as records (an id and a text the limiter writes and reads, see
//! `limiter::runtime`) with a generation that every operator change moves on: a set, a delete, and a
//! reset (whose replicas must forget the denials they remember). Each replica reads the generation every
//! `runtime_limits.refresh_interval` and the records when it moved. On Redis both live under the hash
//! tag `{ratelimitd}` (one Cluster slot), prefixed by `CACHE_KEY_PREFIX`; in memory, in the process.

use std::{
    collections::BTreeMap,
    sync::{Mutex, MutexGuard},
};

use super::{Check, Store, StoreError};
use crate::algorithm::State;

/// The states read for some checks, in order, and the instant they were read at (the store's clock).
#[derive(Debug, Clone, PartialEq)]
pub struct Read {
    pub now_ms: u64,
    /// `None`: nothing stored (or expired).
    pub states: Vec<Option<State>>,
}

/// The runtime limit records and the generation they were read at.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Records {
    pub generation: u64,
    /// (id, record), by id.
    pub records: Vec<(String, String)>,
}

/// Where a store keeps the records: the key names on Redis, built from `CACHE_KEY_PREFIX`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordKeys {
    /// A hash: id -> record.
    pub records: String,
    /// A counter: the generation.
    pub generation: String,
}

impl RecordKeys {
    pub fn new(prefix: &str) -> Self {
        Self {
            records: format!("{prefix}{{ratelimitd}}:runtime_limits"),
            generation: format!("{prefix}{{ratelimitd}}:operator_changes"),
        }
    }
}

/// The records of a store inside this process.
#[derive(Debug, Default)]
pub struct LocalRecords {
    held: Mutex<(u64, BTreeMap<String, String>)>,
}

/// A record's expiry as its text says: `None` for text that is no record (not a JSON object), inside
/// it `None` for a record that does not expire.
fn expiry_of(text: &str) -> Option<Option<u64>> {
    let record = serde_json::from_str::<serde_json::Value>(text).ok()?;
    record.is_object().then(|| {
        record
            .get("expires_at_ms")
            .and_then(serde_json::Value::as_u64)
    })
}

/// Whether a record's text reads as a record not expired by `now_ms` (as records.lua counts them).
fn in_force(text: &str, now_ms: u64) -> bool {
    expiry_of(text).is_some_and(|at| at.is_none_or(|at| at > now_ms))
}

/// Whether a record's text says it expired by `now_ms`.
fn expired(text: &str, now_ms: u64) -> bool {
    expiry_of(text).flatten().is_some_and(|at| at <= now_ms)
}

impl LocalRecords {
    fn lock(&self) -> MutexGuard<'_, (u64, BTreeMap<String, String>)> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn read(&self, known: Option<u64>) -> Option<Records> {
        let held = self.lock();
        (known != Some(held.0)).then(|| Records {
            generation: held.0,
            records: held.1.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        })
    }

    /// Writes a record unless `most` records not expired by `now_ms` are held beside it (a new id);
    /// whether it was written.
    fn put(&self, id: &str, record: &str, most: usize, now_ms: u64) -> bool {
        let mut held = self.lock();
        // Below the bound the count decides, as HLEN does on Redis: a record is read only at it.
        if !held.1.contains_key(id) && held.1.len() >= most {
            let live = held
                .1
                .values()
                .filter(|text| in_force(text, now_ms))
                .count();
            if live >= most {
                return false;
            }
        }
        held.1.insert(id.to_owned(), record.to_owned());
        held.0 += 1;
        true
    }

    fn delete(&self, ids: &[String]) -> usize {
        self.delete_where(ids, |_| true)
    }

    /// Deletes those of `ids` whose record, as held now, expired by `now_ms` (see
    /// [`Store::purge_records`]).
    fn purge(&self, ids: &[String], now_ms: u64) -> usize {
        self.delete_where(ids, |text| expired(text, now_ms))
    }

    /// Deletes those of `ids` held whose record `doomed` picks, under one lock; how many.
    fn delete_where(&self, ids: &[String], doomed: impl Fn(&str) -> bool) -> usize {
        let mut held = self.lock();
        let mut deleted = 0;
        for id in ids {
            if held.1.get(id).is_some_and(|text| doomed(text)) {
                held.1.remove(id);
                deleted += 1;
            }
        }
        // Nothing deleted, nothing changed: the replicas keep what they remember.
        if deleted > 0 {
            held.0 += 1;
        }
        deleted
    }

    fn announce(&self) {
        self.lock().0 += 1;
    }
}

/// The noop store keeps nothing: it cannot hold runtime limits.
fn keeps_nothing() -> StoreError {
    StoreError::Backend("the noop backend keeps no counters and no runtime limits".into())
}

impl Store {
    /// The state of each check's counter now, without changing anything.
    pub async fn read(&self, checks: &[Check], now_ms: u64) -> Result<Read, StoreError> {
        match self {
            Store::Memory(store) => Ok(Read {
                now_ms,
                states: checks.iter().map(|c| store.state_of(c, now_ms)).collect(),
            }),
            Store::Redis(store) => store.read(checks, now_ms).await,
            Store::Noop => Ok(Read {
                now_ms,
                states: vec![None; checks.len()],
            }),
        }
    }

    /// Clears the counters of the checks (every algorithm's state); returns how many held something.
    pub async fn clear(&self, checks: &[Check], now_ms: u64) -> Result<usize, StoreError> {
        match self {
            Store::Memory(store) => Ok(checks.iter().filter(|c| store.forget(c, now_ms)).count()),
            Store::Redis(store) => store.clear(checks, now_ms).await,
            Store::Noop => Ok(0),
        }
    }

    /// The runtime limit records, unless their generation is still `known`.
    pub async fn records(
        &self,
        keys: &RecordKeys,
        known: Option<u64>,
    ) -> Result<Option<Records>, StoreError> {
        match self {
            Store::Memory(store) => Ok(store.records.read(known)),
            Store::Redis(store) => store.records(keys, known).await,
            Store::Noop => Ok((known != Some(0)).then(Records::default)),
        }
    }

    /// Writes (or replaces) one record, and moves the generation on, unless it is a new id and `most`
    /// records not expired by `now_ms` are held already (checked in the same step as the write, so that
    /// replicas setting limits at once never hold more): whether it was written.
    pub async fn put_record(
        &self,
        keys: &RecordKeys,
        id: &str,
        record: &str,
        most: usize,
        now_ms: u64,
    ) -> Result<bool, StoreError> {
        match self {
            Store::Memory(store) => Ok(store.records.put(id, record, most, now_ms)),
            Store::Redis(store) => store.put_record(keys, id, record, most, now_ms).await,
            Store::Noop => Err(keeps_nothing()),
        }
    }

    /// Deletes records, and moves the generation on; returns how many there were.
    pub async fn delete_records(
        &self,
        keys: &RecordKeys,
        ids: &[String],
    ) -> Result<usize, StoreError> {
        match self {
            Store::Memory(store) => Ok(store.records.delete(ids)),
            Store::Redis(store) => store.delete_records(keys, ids).await,
            Store::Noop => Err(keeps_nothing()),
        }
    }

    /// Deletes the records of `ids` that, as stored now, expired by `now_ms`; returns how many. A record
    /// a replica read as expired may have been set again meanwhile under the same id (the id is the
    /// descriptor's): that one stays.
    pub async fn purge_records(
        &self,
        keys: &RecordKeys,
        ids: &[String],
        now_ms: u64,
    ) -> Result<usize, StoreError> {
        match self {
            Store::Memory(store) => Ok(store.records.purge(ids, now_ms)),
            Store::Redis(store) => store.purge_records(keys, ids, now_ms).await,
            Store::Noop => Err(keeps_nothing()),
        }
    }

    /// Moves the generation on without changing a record (after a reset), so that every replica
    /// forgets what it remembers of the counters.
    pub async fn announce(&self, keys: &RecordKeys) -> Result<(), StoreError> {
        match self {
            Store::Memory(store) => {
                store.records.announce();
                Ok(())
            }
            Store::Redis(store) => store.announce(keys).await,
            Store::Noop => Ok(()),
        }
    }

    /// An operator changed something: what this replica holds of the counters ends (Redis: the quota
    /// leases, dropped rather than given back, since the counters they came from may be gone), so that
    /// the next requests see the store as it is.
    pub fn operator_changed(&self) {
        if let Store::Redis(store) = self {
            store.drop_leases();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{MemoryStore, Role};

    #[tokio::test]
    async fn the_memory_store_reads_and_clears_counters_and_keeps_records() {
        let store = Store::Memory(MemoryStore::new(100));
        let check = Check::fixed_window("k_".into(), 5, 60, 2, Role::Enforce);
        let batch = crate::store::Batch {
            checks: vec![check.clone()],
            ..Default::default()
        };
        use crate::store::CounterStore;
        let deadline = crate::store::Deadline::within(std::time::Duration::from_secs(1));
        store.apply(&batch, 60_000, deadline).await.unwrap();
        let read = store
            .read(std::slice::from_ref(&check), 60_001)
            .await
            .unwrap();
        assert_eq!(
            read.states,
            [Some(State::FixedWindow {
                start_ms: 60_000,
                count: 2
            })]
        );
        assert_eq!(
            store
                .clear(std::slice::from_ref(&check), 60_001)
                .await
                .unwrap(),
            1
        );
        assert_eq!(store.read(&[check], 60_001).await.unwrap().states, [None]);

        let keys = RecordKeys::new("");
        let first = store.records(&keys, None).await.unwrap().unwrap();
        assert_eq!(first, Records::default());
        assert!(store.records(&keys, Some(0)).await.unwrap().is_none());
        assert!(store.put_record(&keys, "a", "{}", 10, 0).await.unwrap());
        let next = store.records(&keys, Some(0)).await.unwrap().unwrap();
        assert_eq!((next.generation, next.records.len()), (1, 1));
        assert_eq!(store.delete_records(&keys, &["a".into()]).await.unwrap(), 1);
        // Nothing to delete: the generation stays.
        assert_eq!(store.delete_records(&keys, &["a".into()]).await.unwrap(), 0);
        // A purge deletes only what has expired as held now.
        store
            .put_record(&keys, "old", r#"{"expires_at_ms":100}"#, 10, 0)
            .await
            .unwrap();
        store
            .put_record(&keys, "new", r#"{"expires_at_ms":900}"#, 10, 0)
            .await
            .unwrap();
        // Room for two records in force: "old" has expired by 500, so a third fits; for one, it does not,
        // and a record held already is replaced whatever the count.
        assert!(!store
            .put_record(&keys, "third", "{}", 1, 500)
            .await
            .unwrap());
        assert!(store
            .put_record(&keys, "new", r#"{"expires_at_ms":900}"#, 1, 500)
            .await
            .unwrap());
        assert!(store
            .put_record(&keys, "third", "{}", 2, 500)
            .await
            .unwrap());
        assert_eq!(
            store
                .delete_records(&keys, &["third".into()])
                .await
                .unwrap(),
            1
        );
        let both = ["old".to_string(), "new".to_string()];
        assert_eq!(store.purge_records(&keys, &both, 500).await.unwrap(), 1);
        assert_eq!(store.purge_records(&keys, &both, 500).await.unwrap(), 0);
        let held = store.records(&keys, None).await.unwrap().unwrap();
        assert_eq!((held.generation, held.records.len()), (8, 1));
        store.announce(&keys).await.unwrap();
        assert_eq!(
            store
                .records(&keys, Some(1))
                .await
                .unwrap()
                .unwrap()
                .generation,
            9
        );
    }
}
