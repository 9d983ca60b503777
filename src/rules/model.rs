//! The compiled rules: a tree per domain that a request's descriptor entries walk level by level.
//!
//! Built from validated files by [`RuleSet::build`] (see `compile`). A `RuleSet` is immutable; a reload
//! builds a new one and swaps it in whole.

use std::{collections::HashMap, sync::Arc};

use smallvec::SmallVec;

use super::{
    flags::RuleFlags,
    pattern::{Cidr, Wildcard, WildcardIndex},
    unit::Unit,
};
use crate::{
    algorithm::{Algorithm, Params},
    telemetry::metrics::HeldCounters,
};

/// The maps of the tree, by domain, key and value. Their keys come from the rules files alone (a request
/// only looks up), so no caller can crowd one chain: a fast hash, seeded per map, serves them.
pub type RuleMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// A limit of a rule (`rate_limit`, or an entry of `rate_limits`).
#[derive(Debug, Clone, PartialEq)]
pub struct Limit {
    /// Hits allowed per window; 0 denies every counted hit.
    pub requests_per_unit: u32,
    /// The window's unit; meaningless when `unlimited`.
    pub unit: Unit,
    /// The window is this many units (`unit_multiplier`, default 1).
    pub unit_multiplier: u32,
    /// How hits are counted.
    pub algorithm: Algorithm,
    /// Capacity of token bucket and GCRA limits (`burst`, default `requests_per_unit`).
    pub burst: u64,
    /// Every hit is counted, also one past the limit (`count_over_limit`): for usage reported after the
    /// response, such as an LLM's token count, so that a budget runs out.
    pub count_over_limit: bool,
    /// Never limited and never counted.
    pub unlimited: bool,
    /// Name reported in `current_limit.name` and targeted by `replaces`.
    pub name: Option<Arc<str>>,
    /// Names of limits this one drops from the same request.
    pub replaces: Box<[Arc<str>]>,
}

/// Largest `requests_per_unit` of a sliding log: it keeps one entry per counted request, up to this many.
pub const SLIDING_LOG_MAX_LIMIT: u32 = 100_000;

/// Longest window a limit may have (`unit` x `unit_multiplier`), and longest a token bucket or GCRA may
/// take to refill a full burst: ten years of 365 days, in seconds. Every time the algorithms and the Redis
/// script derive from a limit then stays far inside what they count with: milliseconds in a `u64`,
/// microseconds since the epoch in a Lua double (exact below 2^53, some 285 years), and the TTLs Redis
/// accepts from EXPIRE and PEXPIRE. Without a bound, `unit_multiplier` overflowed the window, and Redis
/// refused an expiry after the script had already counted, leaving a key without a TTL.
pub const MAX_WINDOW_SECS: u64 = 10 * 365 * 86_400;

/// A descriptor node of the rules tree.
#[derive(Debug, Clone)]
pub struct Node {
    /// The limits of the node: its `rate_limit` first, then its `rate_limits`. A node without limits and
    /// without children is an allow-list entry.
    pub limits: Vec<Limit>,
    /// The rule's own yes/no settings (those of its own step).
    pub flags: RuleFlags,
    /// Where the node is written: its own level, and its parent's path, shared (see [`RulePath`]).
    pub at: Arc<RulePath>,
    /// Free-form metadata of the rule.
    pub metadata: Option<Arc<serde_json::Map<String, serde_json::Value>>>,
    /// Nested descriptors.
    pub children: Level,
    /// The rule's counters in the metrics, held here once found, as the reference keeps a rule's stats
    /// with the rule: recording a decision under the rule then looks nothing up.
    pub counters: HeldCounters,
}

/// A node's levels from the domain down, its own last: what matching a request's entries by position
/// reads. Built from the shared links, without allocating for rules up to 8 levels deep.
pub type Path<'a> = SmallVec<[&'a PathStep; 8]>;

/// Where a rule is written: its own level and the path above it. A node's path shares its parent's, so a
/// rule costs its own key and value however deep it is written: copied per node, a path grew with depth
/// times the rules below, and a few hundred kilobytes of rules with a long key near the top took
/// gigabytes.
#[derive(Debug)]
pub struct RulePath {
    pub step: PathStep,
    above: Above,
    /// See [`RulePath::values_as_sent`].
    values_as_sent: bool,
}

/// `key_value.key...` of the levels `steps`, as the reference service names a rule within its domain.
pub fn written_key(steps: &[&PathStep]) -> String {
    let mut out = String::new();
    for (i, step) in steps.iter().enumerate() {
        if i > 0 {
            out.push('.');
        }
        out.push_str(&step.key);
        if !step.value.is_empty() {
            out.push('_');
            out.push_str(&step.value);
        }
    }
    out
}

/// What is above a level: the domain, or the parent rule's path.
#[derive(Debug)]
enum Above {
    Domain(Arc<str>),
    Rule(Arc<RulePath>),
}

impl RulePath {
    /// A top-level rule of `domain`.
    pub fn top(domain: Arc<str>, step: PathStep) -> Arc<RulePath> {
        Arc::new(RulePath {
            values_as_sent: step.value_as_sent(),
            step,
            above: Above::Domain(domain),
        })
    }

    /// A rule nested under `parent`.
    pub fn under(parent: &Arc<RulePath>, step: PathStep) -> Arc<RulePath> {
        Arc::new(RulePath {
            values_as_sent: parent.values_as_sent && step.value_as_sent(),
            step,
            above: Above::Rule(parent.clone()),
        })
    }

    /// Whether no level down to this one shares its value's counter (`share_threshold`) or hashes its
    /// value (`hash_value`): what lets a request's counter keys be built without reading the path.
    pub fn values_as_sent(&self) -> bool {
        self.values_as_sent
    }

    /// Each level from the domain down, this one last.
    pub fn steps(&self) -> Path<'_> {
        let mut steps = Path::new();
        let mut at = self;
        loop {
            steps.push(&at.step);
            match &at.above {
                Above::Domain(_) => break,
                Above::Rule(parent) => at = parent,
            }
        }
        steps.reverse();
        steps
    }

    /// The domain the rule belongs to.
    pub fn domain(&self) -> &str {
        let mut at = self;
        loop {
            match &at.above {
                Above::Domain(domain) => return domain,
                Above::Rule(parent) => at = parent,
            }
        }
    }

    /// `key_value.key...` from the top level down, as the reference service names a rule within its
    /// domain. Built on each call, for messages, operators' tools and metric labels.
    pub fn written_key(&self) -> String {
        written_key(&self.steps())
    }

    /// `domain.key_value.key...`: the rule's full key, as `/rlconfig` and error messages name it.
    pub fn full_key(&self) -> String {
        format!("{}.{}", self.domain(), self.written_key())
    }
}

/// One level of a rule's path: the `key` and `value` written there, and that level's flags, which shape
/// how the request's value at that level is counted (`share_threshold`), shown (`hash_value`) and
/// labelled in metrics (`value_to_metric`).
#[derive(Debug, Clone)]
pub struct PathStep {
    pub key: Box<str>,
    /// `""` for a key-only level.
    pub value: Box<str>,
    pub flags: RuleFlags,
}

impl PathStep {
    /// The value counter keys use at this level instead of the request's: the written pattern, when the
    /// level shares one counter among all values it matches.
    pub fn shared_value(&self) -> Option<&str> {
        self.flags.share_threshold.then_some(&*self.value)
    }

    /// Whether the rule leaves the request's value at this level as it is for counter keys: neither
    /// shared among the values the level matches nor hashed.
    fn value_as_sent(&self) -> bool {
        !self.flags.share_threshold && !self.flags.hash_value
    }
}

/// The descriptor nodes at one depth under one parent, grouped by their `key`: a request entry only ever
/// meets the nodes written with exactly its key, so no key can reach another key's rules whatever `_`s
/// the two contain.
#[derive(Debug, Clone, Default)]
pub struct Level {
    pub keys: RuleMap<Box<str>, KeyNodes>,
}

/// The nodes of one level that share a `key`, by how their value matches the request's value.
#[derive(Debug, Clone, Default)]
pub struct KeyNodes {
    /// Nodes with a plain value, by that value.
    pub values: RuleMap<Box<str>, Node>,
    /// `cidr:` nodes, longest prefix first.
    pub cidrs: Vec<(Cidr, Node)>,
    /// Wildcard-valued nodes, in file order; the pattern is matched against the value alone.
    pub wildcards: Vec<(Wildcard, Node)>,
    /// `wildcards` indexed by the literal part each needs, when there are many of them.
    pub(super) wildcard_index: Option<WildcardIndex>,
    /// The node written without a value: any value.
    pub default: Option<Node>,
    /// The written values of `cidrs` and `wildcards`, so that a rule's duplicate is found without a
    /// scan of its siblings (a scan per sibling made a level of many wildcards quadratic to build).
    pub(super) patterns: RuleMap<Box<str>, ()>,
}

impl Level {
    /// The node written with exactly this `key` and `value` (`""`: the key-only node), however it
    /// matches: what tests and tools look rules up by.
    pub fn node(&self, key: &str, value: &str) -> Option<&Node> {
        let nodes = self.keys.get(key)?;
        if value.is_empty() {
            return nodes.default.as_ref();
        }
        nodes.values.get(value).or_else(|| nodes.written(value))
    }
}

impl KeyNodes {
    /// Every node of the key, however its value matches.
    pub fn nodes(&self) -> impl Iterator<Item = &Node> {
        self.values
            .values()
            .chain(self.cidrs.iter().map(|(_, n)| n))
            .chain(self.wildcards.iter().map(|(_, n)| n))
            .chain(self.default.iter())
    }

    /// The first wildcard node, in file order, whose pattern matches `value`.
    pub(super) fn wildcard(&self, value: &str) -> Option<&Node> {
        let at = match &self.wildcard_index {
            Some(index) => index.first_match(&self.wildcards, value)?,
            None => self.wildcards.iter().position(|(w, _)| w.matches(value))?,
        };
        Some(&self.wildcards[at].1)
    }

    /// The `cidr:` or wildcard node whose value is written exactly so.
    pub(super) fn written(&self, value: &str) -> Option<&Node> {
        if !self.patterns.contains_key(value) {
            return None;
        }
        self.cidrs
            .iter()
            .map(|(_, n)| n)
            .chain(self.wildcards.iter().map(|(_, n)| n))
            .find(|n| &*n.at.step.value == value)
    }
}

/// One domain's rules.
#[derive(Debug, Clone, Default)]
pub struct Domain {
    pub root: Level,
}

/// Every loaded domain: an immutable snapshot.
#[derive(Debug, Clone, Default)]
pub struct RuleSet {
    pub domains: RuleMap<String, Domain>,
}

impl Limit {
    /// Window length in seconds.
    pub fn window_secs(&self) -> u64 {
        self.unit.seconds() * u64::from(self.unit_multiplier)
    }

    /// The parameters the algorithms count with.
    pub fn params(&self) -> Params {
        Params {
            algorithm: self.algorithm,
            limit: u64::from(self.requests_per_unit),
            window_ms: self.window_secs() * 1000,
            burst: self.burst,
            count_over_limit: self.count_over_limit,
        }
    }
}

impl Node {
    /// The node's first limit (its `rate_limit`), if any.
    pub fn limit(&self) -> Option<&Limit> {
        self.limits.first()
    }

    /// Each level from the domain down, the node's own last (see [`RulePath::steps`]).
    pub fn path(&self) -> Path<'_> {
        self.at.steps()
    }

    /// `domain.key_value.key...` (see [`RulePath::full_key`]).
    pub fn full_key(&self) -> String {
        self.at.full_key()
    }

    /// Whether the rule's metric labels may carry request values: `detailed_metric` on the rule, or
    /// `value_to_metric` on a level of its path.
    pub fn labels_request_values(&self) -> bool {
        self.flags.detailed_metric || self.path().iter().any(|s| s.flags.value_to_metric)
    }

    /// How the rule's metric labels carry request values: 0 when they carry none, else a digest of the
    /// flags that shape them (`detailed_metric`, and each level's `value_to_metric`, `hash_value` and
    /// `share_threshold`). A reload that changes it for a kept rule (`hash_value` turned on) makes the
    /// labels the rule took before stale: written otherwise, they would never be made again.
    pub fn label_form(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        if !self.labels_request_values() {
            return 0;
        }
        let mut digest = std::hash::DefaultHasher::new();
        self.flags.detailed_metric.hash(&mut digest);
        for step in self.path() {
            let flags = &step.flags;
            (
                flags.value_to_metric,
                flags.hash_value,
                flags.share_threshold,
            )
                .hash(&mut digest);
        }
        // 0 means no request values, and `u64::MAX` any form (see `telemetry::metrics::ServedRules`).
        digest.finish().clamp(1, u64::MAX - 1)
    }
}

impl RuleSet {
    /// Calls `f` with every node of every domain, nested ones included, each after its parent.
    pub fn for_each_node<'a>(&'a self, mut f: impl FnMut(&'a str, &'a Node)) {
        for (name, domain) in &self.domains {
            each_node(name, &domain.root, &mut f);
        }
    }
}

fn each_node<'a>(domain: &'a str, level: &'a Level, f: &mut impl FnMut(&'a str, &'a Node)) {
    for nodes in level.keys.values() {
        for node in nodes.nodes() {
            f(domain, node);
            each_node(domain, &node.children, f);
        }
    }
}
