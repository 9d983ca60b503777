//! Runtime limits: limits that operators set for one descriptor through the operators' API ("give this
//! tenant ten times the limit until Friday"), without a rules file or a restart.
//!
//! They live in the store as records (see `store::operator`), so that every replica applies the same
//! ones and they outlive restarts (on Redis); each replica holds the set it read last, refreshed every
//! `runtime_limits.refresh_interval`, and looks requests up in it.
//!
//! Precedence: a descriptor whose domain, keys and values are exactly those of a runtime limit is counted
//! against that limit alone, in place of its request's own override (`limit`) and of the limits of the
//! rule it matches; a request override in turn wins over the rules. A runtime limit is always enforced (a
//! rule's `shadow_mode` or `quota_mode` does not apply to it; `SHADOW_MODE` still does), and counts in
//! the counter a rule of its algorithm and window would use for the same values (so raising a limit
//! keeps the count so far). It applies until its expiry by this replica's clock, and only in a domain
//! that has rules.
//!
//! Values of the keys in `hashed_keys` are hashed before a runtime limit is kept, shown or logged, as
//! for counter keys: an operator gives the raw value, the store only ever sees its hash. Looking a
//! request up hashes its sensitive values only when a runtime limit of the same keys exists.

use std::{
    borrow::Cow,
    collections::HashMap,
    hash::{BuildHasher, Hasher},
    sync::Arc,
};

use arc_swap::ArcSwapOption;
use hashbrown::HashTable;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use smallvec::SmallVec;

use super::Entry;
use crate::{
    algorithm::Algorithm,
    rules::{compile_runtime_limit, Limit, RateLimitSpec, RuleError, MAX_WINDOW_SECS},
};

/// The furthest ahead a runtime limit's expiry may be: 10 years as `expires_in` counts them (`10y`, years
/// of 365.25 days), a little more than the longest window a rule may have (ten years of 365 days). It
/// keeps every expiry a time that can be added to, compared and written as RFC 3339.
pub const MAX_EXPIRY_MS: u64 = MAX_WINDOW_SECS * 1000 + 10 * 21_600_000;

/// The longest name a runtime limit may carry (answered in `current_limit.name`): every replica holds
/// every record, and reads them all again after each change.
pub const MAX_NAME_BYTES: usize = 256;

/// When a runtime limit being set ends, as the operator wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expiry {
    /// This long after it is set (`expires_in`).
    In(std::time::Duration),
    /// At this time, ms since the epoch (`expires_at`); `None`: a time past what a `u64` holds.
    At(Option<u64>),
}

/// A runtime limit as it is kept in the store (as JSON), listed and logged. Values are as shown: those
/// of sensitive keys hashed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeLimit {
    /// Derived from the domain and the descriptor: setting the same descriptor again replaces it.
    pub id: String,
    pub domain: String,
    /// The descriptor's entries, in order: (key, value).
    pub descriptor: Vec<(String, String)>,
    pub limit: LimitSpec,
    /// When it stops applying, ms since the epoch; `None`: until deleted.
    pub expires_at_ms: Option<u64>,
    /// When it was set, ms since the epoch.
    pub set_at_ms: u64,
    /// Who set it, as the operator said.
    pub set_by: String,
}

/// A limit as an operator writes it: the fields of a rules file's `rate_limit`, validated the same way.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitSpec {
    pub requests_per_unit: u32,
    pub unit: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unit_multiplier: Option<u32>,
    /// `None`: `rules.default_algorithm`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<Algorithm>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub count_over_limit: bool,
    /// Reported in `current_limit.name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl LimitSpec {
    /// The limit it writes, as the rules would compile it; `what` names it in errors.
    pub fn compile(&self, what: &str, default_algorithm: Algorithm) -> Result<Limit, RuleError> {
        let spec = RateLimitSpec {
            unit: self.unit.clone(),
            requests_per_unit: self.requests_per_unit,
            name: self.name.clone().unwrap_or_default(),
            algorithm: self
                .algorithm
                .map(|a| a.name().to_owned())
                .unwrap_or_default(),
            burst: self.burst.map(u64::from),
            unit_multiplier: self.unit_multiplier.map(i64::from),
            count_over_limit: self.count_over_limit,
            ..RateLimitSpec::default()
        };
        compile_runtime_limit(&spec, what, default_algorithm)
    }
}

/// The id of the runtime limit of a domain and a descriptor (values as shown): the first 64 bits of
/// SHA-256 over both, length-prefixed so that no two descriptors share one.
pub fn id_of(domain: &str, descriptor: &[(String, String)]) -> String {
    let mut hash = Sha256::new();
    for part in std::iter::once(domain).chain(descriptor.iter().flat_map(|(k, v)| [&**k, &**v])) {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part.as_bytes());
    }
    hash.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A runtime limit ready to apply.
#[derive(Debug)]
pub struct Applied {
    pub record: RuntimeLimit,
    pub limit: Limit,
    /// Whether the warning that the rules now hash a value it keeps raw was logged (once per record).
    pub warned_unhashed: std::sync::atomic::AtomicBool,
}

impl Applied {
    fn live(&self, now_ms: u64) -> bool {
        self.record.expires_at_ms.is_none_or(|at| now_ms < at)
    }
}

/// One runtime limit of a shape: the hash of its values, its values, the limit.
type ByValues = (u64, Box<[Box<str>]>, Arc<Applied>);

/// The runtime limits of one domain whose descriptors have the same keys in the same order, by their
/// values.
#[derive(Debug)]
struct Shape {
    keys: Box<[String]>,
    by_values: HashTable<ByValues>,
}

/// The runtime limits of one domain.
#[derive(Debug, Default)]
pub struct DomainLimits {
    /// Few: one per descriptor shape operators set limits on.
    shapes: Vec<Shape>,
    hasher: foldhash::fast::RandomState,
}

impl DomainLimits {
    /// The hash of a descriptor's values, each length-prefixed (so that no two lists share one by
    /// construction).
    fn hash<'v>(&self, values: impl Iterator<Item = &'v str>) -> u64 {
        let mut hasher = self.hasher.build_hasher();
        for value in values {
            hasher.write_usize(value.len());
            hasher.write(value.as_bytes());
        }
        hasher.finish()
    }

    /// The live runtime limit of exactly these entries, whose values `show` turns into what the limit
    /// keeps (sensitive values hashed); `show` runs only when a runtime limit of the same keys exists.
    /// Nothing is allocated for descriptors of up to four entries.
    pub fn find<'e>(
        &self,
        entries: &'e [Entry],
        now_ms: u64,
        show: impl Fn(&str, &'e str) -> Cow<'e, str>,
    ) -> Option<&Applied> {
        let shape = self.shapes.iter().find(|s| {
            s.keys
                .iter()
                .map(String::as_str)
                .eq(entries.iter().map(|e| e.key.as_str()))
        })?;
        let shown: SmallVec<[Cow<'e, str>; 4]> =
            entries.iter().map(|e| show(&e.key, &e.value)).collect();
        let hash = self.hash(shown.iter().map(|v| v.as_ref()));
        let (_, _, found) = shape.by_values.find(hash, |(_, values, _)| {
            values
                .iter()
                .map(|v| &**v)
                .eq(shown.iter().map(|v| v.as_ref()))
        })?;
        found.live(now_ms).then_some(&**found)
    }

    fn insert(&mut self, applied: Arc<Applied>) {
        let record = &applied.record;
        let keys: Box<[String]> = record.descriptor.iter().map(|(k, _)| k.clone()).collect();
        let values: Box<[Box<str>]> = record
            .descriptor
            .iter()
            .map(|(_, v)| v.as_str().into())
            .collect();
        let hash = self.hash(values.iter().map(|v| &**v));
        let at = match self.shapes.iter().position(|s| s.keys == keys) {
            Some(at) => at,
            None => {
                self.shapes.push(Shape {
                    keys,
                    by_values: HashTable::new(),
                });
                self.shapes.len() - 1
            }
        };
        let same = |(_, held, _): &ByValues| *held == values;
        match self.shapes[at]
            .by_values
            .entry(hash, same, |(hash, _, _)| *hash)
        {
            hashbrown::hash_table::Entry::Occupied(mut held) => held.get_mut().2 = applied.clone(),
            hashbrown::hash_table::Entry::Vacant(room) => {
                room.insert((hash, values.clone(), applied.clone()));
            }
        }
    }
}

/// Every runtime limit this replica knows, as last read from the store.
#[derive(Debug, Default)]
pub struct Table {
    domains: HashMap<String, DomainLimits>,
    /// By id.
    all: Vec<Arc<Applied>>,
    /// The store's generation they were read at.
    pub generation: u64,
}

impl Table {
    /// Builds the table from the store's records, leaving out (and returning the ids and reasons of)
    /// those that no longer read or compile.
    pub fn build(
        generation: u64,
        records: &[(String, String)],
        default_algorithm: Algorithm,
    ) -> (Self, Vec<(String, String)>) {
        let mut table = Table {
            generation,
            ..Table::default()
        };
        let mut refused = Vec::new();
        for (id, text) in records {
            let applied = serde_json::from_str::<RuntimeLimit>(text)
                .map_err(|e| e.to_string())
                .and_then(|record| {
                    let limit = record
                        .limit
                        .compile(&format!("runtime limit {}", record.id), default_algorithm)
                        .map_err(|e| e.to_string())?;
                    Ok(Applied {
                        record,
                        limit,
                        warned_unhashed: Default::default(),
                    })
                });
            match applied {
                Ok(applied) if applied.record.id == *id => table.insert(Arc::new(applied)),
                Ok(_) => refused.push((id.clone(), "its id does not match its field".into())),
                Err(reason) => refused.push((id.clone(), reason)),
            }
        }
        (table, refused)
    }

    fn insert(&mut self, applied: Arc<Applied>) {
        self.domains
            .entry(applied.record.domain.clone())
            .or_default()
            .insert(applied.clone());
        self.all.push(applied);
    }

    /// The runtime limits of a domain, if it has any.
    pub fn domain(&self, domain: &str) -> Option<&DomainLimits> {
        self.domains.get(domain)
    }

    /// Every runtime limit, live or expired, by id.
    pub fn all(&self) -> &[Arc<Applied>] {
        &self.all
    }

    pub fn get(&self, id: &str) -> Option<&Arc<Applied>> {
        self.all.iter().find(|a| a.record.id == id)
    }
}

/// The table requests are looked up in: empty (and free to look at) until an operator sets a limit.
#[derive(Debug, Default)]
pub struct RuntimeLimits {
    current: ArcSwapOption<Table>,
    /// Held while the table is read again, so that an older read never replaces a newer one.
    pub(super) refreshing: tokio::sync::Mutex<()>,
}

impl RuntimeLimits {
    /// The current table, when it holds any limit.
    pub fn current(&self) -> Option<Arc<Table>> {
        self.current.load_full()
    }

    /// The current table for a moment (a request's decision): no reference count is touched.
    pub fn load(&self) -> arc_swap::Guard<Option<Arc<Table>>> {
        self.current.load()
    }

    /// The generation of the current table (0 before any was read).
    pub fn generation(&self) -> Option<u64> {
        self.current.load().as_ref().map(|t| t.generation)
    }

    pub fn replace(&self, table: Table) {
        self.current.store(Some(Arc::new(table)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(domain: &str, descriptor: &[(&str, &str)], rpu: u32, expires: Option<u64>) -> String {
        let descriptor: Vec<(String, String)> = descriptor
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        serde_json::to_string(&RuntimeLimit {
            id: id_of(domain, &descriptor),
            domain: domain.into(),
            descriptor,
            limit: LimitSpec {
                requests_per_unit: rpu,
                unit: "minute".into(),
                unit_multiplier: None,
                algorithm: None,
                burst: None,
                count_over_limit: false,
                name: None,
            },
            expires_at_ms: expires,
            set_at_ms: 0,
            set_by: "test".into(),
        })
        .unwrap()
    }

    fn entries(pairs: &[(&str, &str)]) -> Vec<Entry> {
        pairs
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect()
    }

    #[test]
    fn a_descriptor_finds_the_live_limit_of_exactly_its_entries() {
        let records: Vec<(String, String)> = [
            record("d", &[("tenant", "a")], 10, None),
            record("d", &[("tenant", "b")], 20, Some(5_000)),
            record("d", &[("tenant", "a"), ("model", "m")], 30, None),
        ]
        .into_iter()
        .map(|text| {
            let r: RuntimeLimit = serde_json::from_str(&text).unwrap();
            (r.id, text)
        })
        .collect();
        let (table, refused) = Table::build(7, &records, Algorithm::FixedWindow);
        assert!(refused.is_empty());
        let d = table.domain("d").unwrap();
        let find = |pairs: &[(&str, &str)], now| {
            d.find(&entries(pairs), now, |_, v| v.into())
                .map(|a| a.limit.requests_per_unit)
        };
        assert_eq!(find(&[("tenant", "a")], 0), Some(10));
        assert_eq!(find(&[("tenant", "a"), ("model", "m")], 0), Some(30));
        assert_eq!(find(&[("tenant", "c")], 0), None);
        assert_eq!(
            find(&[("model", "m"), ("tenant", "a")], 0),
            None,
            "order matters"
        );
        assert_eq!(find(&[("tenant", "b")], 4_999), Some(20));
        assert_eq!(find(&[("tenant", "b")], 5_000), None, "expired");
        assert!(table.domain("other").is_none());
    }

    #[test]
    fn records_that_no_longer_read_are_left_out_and_named() {
        let good = record("d", &[("k", "v")], 1, None);
        let records = vec![
            ("x".into(), "not json".into()),
            ("wrong".into(), good.clone()),
            ("bad".into(), good.replace("\"minute\"", "\"fortnight\"")),
        ];
        let (table, refused) = Table::build(1, &records, Algorithm::FixedWindow);
        assert!(table.all().is_empty());
        let ids: Vec<&str> = refused.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, ["x", "wrong", "bad"]);
        assert!(refused[2].1.contains("fortnight"), "{}", refused[2].1);
    }

    #[test]
    fn ids_tell_descriptors_apart() {
        let d = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert_ne!(
            id_of("d", &d(&[("a", "bc")])),
            id_of("d", &d(&[("ab", "c")]))
        );
        assert_ne!(
            id_of("da", &d(&[("b", "c")])),
            id_of("d", &d(&[("ab", "c")]))
        );
        assert_eq!(id_of("d", &d(&[("a", "b")])).len(), 16);
    }
}
