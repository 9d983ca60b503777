//! The compiled rules: a tree per domain that a request's descriptor entries walk level by level.
//!
//! Built from validated files by [`RuleSet::build`], which applies the reference service's semantic checks
//! (units, unlimited, replaces, duplicates, share_threshold) with its messages. A `RuleSet` is immutable;
//! a reload builds a new one and swaps it in whole.

use std::{collections::HashMap, sync::Arc};

use super::{
    pattern::{Cidr, Wildcard, CIDR_PREFIX},
    unit::Unit,
    yaml::{DescriptorSpec, DomainFile, RateLimitSpec},
};
use crate::algorithm::{Algorithm, Params};

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
    /// Never limited and never counted.
    pub unlimited: bool,
    /// Name reported in `current_limit.name` and targeted by `replaces`.
    pub name: Option<Arc<str>>,
    /// Names of limits this one drops from the same request.
    pub replaces: Box<[Arc<str>]>,
}

/// A descriptor node of the rules tree.
#[derive(Debug, Clone)]
pub struct Node {
    /// `domain.key_value.key` path of the node, as `/rlconfig` and error messages name it.
    pub full_key: Box<str>,
    /// The limits of the node: its `rate_limit` first, then its `rate_limits`. A node without limits and
    /// without children is an allow-list entry.
    pub limits: Vec<Limit>,
    /// Over-limit answers of this rule are turned into OK (the counting still happens).
    pub shadow_mode: bool,
    /// The rule takes part in the quota-mode overall decision (see the limiter).
    pub quota_mode: bool,
    /// Metric naming flags, kept for the metrics of the rule.
    pub detailed_metric: bool,
    pub value_to_metric: bool,
    /// The node's wildcard shares one counter across all values it matches.
    pub share_threshold: bool,
    /// The request's value at this node's level is sensitive (`hash_value: true`).
    pub hash_value: bool,
    /// For each level from the domain down to this node, whether that level's node says `hash_value`.
    /// Empty when none does.
    pub hashed_levels: Box<[bool]>,
    /// The `(key, value)` of each level from the domain down to this node, as written in the rules.
    pub path: Box<[(Box<str>, Box<str>)]>,
    /// For each level from the domain down to this node, whether that level's node says
    /// `value_to_metric`. Empty when none does.
    pub metric_levels: Box<[bool]>,
    /// Free-form metadata of the rule.
    pub metadata: Option<Arc<serde_json::Map<String, serde_json::Value>>>,
    /// For each level from the domain down to this node, the value counter keys use instead of the
    /// request's: the wildcard pattern of a `share_threshold` node, `None` elsewhere. Empty when no level
    /// shares.
    pub shared_values: Box<[Option<Box<str>>]>,
    /// Nested descriptors.
    pub children: Level,
}

/// The descriptor nodes at one depth under one parent, grouped by their `key`: a request entry only ever
/// meets the nodes written with exactly its key, so no key can reach another key's rules whatever `_`s
/// the two contain.
#[derive(Debug, Clone, Default)]
pub struct Level {
    pub keys: HashMap<Box<str>, KeyNodes>,
}

/// The nodes of one level that share a `key`, by how their value matches the request's value.
#[derive(Debug, Clone, Default)]
pub struct KeyNodes {
    /// Nodes with a plain value, by that value.
    pub values: HashMap<Box<str>, Node>,
    /// `cidr:` nodes, longest prefix first.
    pub cidrs: Vec<(Cidr, Node)>,
    /// Wildcard-valued nodes, in file order; the pattern is matched against the value alone.
    pub wildcards: Vec<(Wildcard, Node)>,
    /// The node written without a value: any value.
    pub default: Option<Node>,
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

    /// Whether a node of this level already has the reference service's composite key (`key_value`, or
    /// `key` without a value). The reference keys a level by that string, so `key: a_b` and
    /// `key: a, value: b` are duplicates there; they stay duplicates here, with its message, although
    /// matching tells them apart. Tries each `_` of the composite as the place key and value meet.
    fn has_composite(&self, composite: &str) -> bool {
        if self
            .keys
            .get(composite)
            .is_some_and(|k| k.default.is_some())
        {
            return true;
        }
        composite
            .char_indices()
            .filter(|&(_, c)| c == '_')
            .any(|(at, _)| {
                let (key, value) = (&composite[..at], &composite[at + 1..]);
                !value.is_empty()
                    && self
                        .keys
                        .get(key)
                        .is_some_and(|k| k.values.contains_key(value) || k.written(value).is_some())
            })
    }
}

impl KeyNodes {
    /// The `cidr:` or wildcard node whose value is written exactly so.
    fn written(&self, value: &str) -> Option<&Node> {
        self.cidrs
            .iter()
            .map(|(_, n)| n)
            .chain(self.wildcards.iter().map(|(_, n)| n))
            .find(|n| n.path.last().is_some_and(|(_, v)| &**v == value))
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
    pub domains: HashMap<String, Domain>,
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
        }
    }
}

impl Node {
    /// The node's first limit (its `rate_limit`), if any.
    pub fn limit(&self) -> Option<&Limit> {
        self.limits.first()
    }
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

impl RuleSet {
    /// Builds the rule set from parsed files, in the order given, counting with fixed windows unless a
    /// rule says otherwise. Errors are prefixed with the file name.
    pub fn build(files: &[(String, DomainFile)], merge_domains: bool) -> Result<RuleSet, String> {
        Self::build_with(files, merge_domains, Algorithm::FixedWindow)
    }

    /// [`RuleSet::build`] with another default algorithm.
    pub fn build_with(
        files: &[(String, DomainFile)],
        merge_domains: bool,
        default_algorithm: Algorithm,
    ) -> Result<RuleSet, String> {
        let mut set = RuleSet::default();
        for (file_name, file) in files {
            set.add_file(file, merge_domains, default_algorithm)
                .map_err(|e| format!("{file_name}: {e}"))?;
        }
        Ok(set)
    }

    fn add_file(
        &mut self,
        file: &DomainFile,
        merge_domains: bool,
        default_algorithm: Algorithm,
    ) -> Result<(), String> {
        if file.domain.is_empty() {
            return Err("config file cannot have empty domain".into());
        }
        if self.domains.contains_key(&file.domain) && !merge_domains {
            return Err(format!("duplicate domain '{}' in config file", file.domain));
        }
        let domain = self.domains.entry(file.domain.clone()).or_default();
        add_level(
            &mut domain.root,
            &file.descriptors,
            &file.domain,
            &Ancestry::default(),
            default_algorithm,
        )
    }

    /// Every rule with a limit, one line each, sorted: what `/rlconfig` shows.
    pub fn describe(&self) -> Vec<String> {
        self.describe_with(&|_, value, _| value.to_owned())
    }

    /// [`RuleSet::describe`], with each written value shown as `show(key, value, hash_value)` says.
    pub fn describe_with(&self, show: &dyn Fn(&str, &str, bool) -> String) -> Vec<String> {
        fn name(domain: &str, node: &Node, show: &dyn Fn(&str, &str, bool) -> String) -> String {
            let mut out = domain.to_owned();
            for (i, (key, value)) in node.path.iter().enumerate() {
                out.push('.');
                out.push_str(key);
                if !value.is_empty() {
                    let hashed = node.hashed_levels.get(i).copied().unwrap_or(false);
                    out.push('_');
                    out.push_str(&show(key, value, hashed));
                }
            }
            out
        }
        fn walk(
            domain: &str,
            level: &Level,
            show: &dyn Fn(&str, &str, bool) -> String,
            out: &mut Vec<String>,
        ) {
            let nodes = level.keys.values().flat_map(|k| {
                k.values
                    .values()
                    .chain(k.wildcards.iter().map(|(_, n)| n))
                    .chain(k.default.iter())
            });
            for node in nodes {
                let full_key = name(domain, node, show);
                for limit in &node.limits {
                    out.push(if limit.unlimited {
                        format!(
                            "{full_key}: unlimited, shadow_mode: {}, quota_mode: {}",
                            node.shadow_mode, node.quota_mode
                        )
                    } else {
                        let mut line = format!(
                            "{full_key}: unit={} requests_per_unit={}, shadow_mode: {}, quota_mode: {}",
                            limit.unit,
                            limit.requests_per_unit,
                            node.shadow_mode,
                            node.quota_mode
                        );
                        if limit.unit_multiplier != 1 {
                            line.push_str(&format!(", unit_multiplier: {}", limit.unit_multiplier));
                        }
                        if limit.algorithm != Algorithm::FixedWindow {
                            line.push_str(&format!(", algorithm: {}", limit.algorithm.name()));
                        }
                        if limit.algorithm.uses_burst() {
                            line.push_str(&format!(", burst: {}", limit.burst));
                        }
                        line
                    });
                }
                walk(domain, &node.children, show, out);
            }
        }
        let mut out = Vec::new();
        for (name, domain) in &self.domains {
            walk(name, &domain.root, show, &mut out);
        }
        out.sort();
        out
    }
}

/// What a node inherits from the levels above it.
#[derive(Default, Clone)]
struct Ancestry {
    shared: Vec<Option<Box<str>>>,
    hashed: Vec<bool>,
    to_metric: Vec<bool>,
    path: Vec<(Box<str>, Box<str>)>,
}

fn add_level(
    level: &mut Level,
    specs: &[DescriptorSpec],
    parent_key: &str,
    ancestry: &Ancestry,
    default_algorithm: Algorithm,
) -> Result<(), String> {
    for spec in specs {
        if spec.key.is_empty() {
            return Err("descriptor has empty key".into());
        }
        let composite = if spec.value.is_empty() {
            spec.key.clone()
        } else {
            format!("{}_{}", spec.key, spec.value)
        };
        let full_key = format!("{parent_key}.{composite}");
        if level.has_composite(&composite) {
            return Err(format!("duplicate descriptor composite key '{full_key}'"));
        }
        let mut limits = Vec::with_capacity(1 + spec.rate_limits.len());
        if let Some(rate_limit) = &spec.rate_limit {
            limits.push(compile_limit(
                rate_limit,
                &full_key,
                "rate_limit",
                default_algorithm,
            )?);
        }
        for (i, rate_limit) in spec.rate_limits.iter().enumerate() {
            let field = format!("rate_limits[{i}]");
            let limit = compile_limit(rate_limit, &full_key, &field, default_algorithm)?;
            if limit.unlimited {
                return Err(format!(
                    "rule '{full_key}': {field}: unlimited belongs in rate_limit, not in rate_limits"
                ));
            }
            limits.push(limit);
        }
        let cidr = spec
            .value
            .strip_prefix(CIDR_PREFIX)
            .map(|net| {
                Cidr::parse(net).map_err(|e| {
                    format!(
                        "rule '{full_key}': value: malformed CIDR '{}': {e}",
                        spec.value
                    )
                })
            })
            .transpose()?;
        let is_wildcard = cidr.is_none() && spec.value.contains('*');
        if spec.share_threshold && !is_wildcard && cidr.is_none() {
            return Err(format!(
                "share_threshold can only be used with wildcard values (containing '*'), but found key '{composite}'"
            ));
        }
        let mut below = ancestry.clone();
        below
            .shared
            .push(spec.share_threshold.then(|| spec.value.as_str().into()));
        below.hashed.push(spec.hash_value);
        below.to_metric.push(spec.value_to_metric);
        below
            .path
            .push((spec.key.as_str().into(), spec.value.as_str().into()));
        let shared_values: Box<[Option<Box<str>>]> = if below.shared.iter().any(Option::is_some) {
            below.shared.clone().into()
        } else {
            Box::new([])
        };
        let hashed_levels: Box<[bool]> = if below.hashed.contains(&true) {
            below.hashed.clone().into()
        } else {
            Box::new([])
        };
        let metric_levels: Box<[bool]> = if below.to_metric.contains(&true) {
            below.to_metric.clone().into()
        } else {
            Box::new([])
        };
        let mut node = Node {
            full_key: full_key.clone().into(),
            limits,
            shadow_mode: spec.shadow_mode,
            quota_mode: spec.quota_mode,
            detailed_metric: spec.detailed_metric,
            value_to_metric: spec.value_to_metric,
            share_threshold: spec.share_threshold,
            hash_value: spec.hash_value,
            hashed_levels,
            metric_levels,
            path: below.path.clone().into(),
            metadata: spec.metadata.clone().map(Arc::new),
            shared_values,
            children: Level::default(),
        };
        add_level(
            &mut node.children,
            &spec.descriptors,
            &full_key,
            &below,
            default_algorithm,
        )?;
        let same_key = level.keys.entry(spec.key.as_str().into()).or_default();
        if let Some(cidr) = cidr {
            let at = same_key
                .cidrs
                .partition_point(|(c, _)| c.prefix() >= cidr.prefix());
            same_key.cidrs.insert(at, (cidr, node));
        } else if is_wildcard {
            same_key.wildcards.push((Wildcard::new(&spec.value), node));
        } else if spec.value.is_empty() {
            same_key.default = Some(node);
        } else {
            same_key.values.insert(spec.value.as_str().into(), node);
        }
    }
    Ok(())
}

fn compile_limit(
    spec: &RateLimitSpec,
    rule: &str,
    field: &str,
    default_algorithm: Algorithm,
) -> Result<Limit, String> {
    let unit = Unit::from_name(&spec.unit);
    let algorithm = if spec.algorithm.is_empty() {
        default_algorithm
    } else {
        Algorithm::from_name(&spec.algorithm).ok_or_else(|| {
            format!(
                "rule '{rule}': {field}.algorithm: unknown algorithm '{}'; use one of {}",
                spec.algorithm,
                Algorithm::NAMES.join(", ")
            )
        })?
    };
    if spec.burst.is_some() && !algorithm.uses_burst() {
        return Err(format!(
            "rule '{rule}': {field}.burst: burst means nothing for {}; it sets the capacity of token_bucket and gcra",
            algorithm.name()
        ));
    }
    let unit_multiplier = match spec.unit_multiplier {
        None => 1,
        Some(m) => u32::try_from(m).ok().filter(|m| *m >= 1).ok_or_else(|| {
            format!("rule '{rule}': {field}.unit_multiplier: must be a whole number of at least 1, not {m}")
        })?,
    };
    if algorithm == Algorithm::SlidingLog && spec.requests_per_unit > SLIDING_LOG_MAX_LIMIT {
        return Err(format!(
            "rule '{rule}': {field}.requests_per_unit: a sliding_log keeps one entry per counted request; use at most {SLIDING_LOG_MAX_LIMIT}, or sliding_window"
        ));
    }
    if spec.unlimited {
        if unit.is_some() {
            return Err("should not specify rate limit unit when unlimited".into());
        }
    } else if unit.is_none() {
        return Err(format!("invalid rate limit unit '{}'", spec.unit));
    }
    if let (Some(unit), false) = (unit, spec.unlimited) {
        check_window(rule, field, unit, unit_multiplier, algorithm, spec)?;
    }
    let name = (!spec.name.is_empty()).then(|| Arc::<str>::from(spec.name.as_str()));
    let mut replaces = Vec::with_capacity(spec.replaces.len());
    for r in &spec.replaces {
        if r.is_empty() {
            return Err("should not have an empty replaces entry".into());
        }
        if name.as_deref() == Some(r.as_str()) {
            return Err("replaces should not contain name of same descriptor".into());
        }
        replaces.push(Arc::<str>::from(r.as_str()));
    }
    Ok(Limit {
        requests_per_unit: spec.requests_per_unit,
        unit: unit.unwrap_or(Unit::Second),
        unit_multiplier,
        algorithm,
        burst: spec.burst.unwrap_or(u64::from(spec.requests_per_unit)),
        unlimited: spec.unlimited,
        name,
        replaces: replaces.into(),
    })
}

/// Refuses a limit whose window, or whose time to refill a full burst, is longer than [`MAX_WINDOW_SECS`].
fn check_window(
    rule: &str,
    field: &str,
    unit: Unit,
    unit_multiplier: u32,
    algorithm: Algorithm,
    spec: &RateLimitSpec,
) -> Result<(), String> {
    let window_secs = u128::from(unit.seconds()) * u128::from(unit_multiplier);
    if window_secs > u128::from(MAX_WINDOW_SECS) {
        return Err(format!(
            "rule '{rule}': {field}.unit_multiplier: a window of {unit_multiplier} x {unit} ({window_secs} seconds) is longer than the longest a limit may have, 10 years ({MAX_WINDOW_SECS} seconds)"
        ));
    }
    if algorithm.uses_burst() {
        let burst = u128::from(
            spec.burst
                .unwrap_or_else(|| u64::from(spec.requests_per_unit)),
        );
        // A bucket refills `requests_per_unit` per window (one per window when that is 0, as the
        // algorithms count it for expiry).
        let per_window = u128::from(spec.requests_per_unit.max(1));
        if window_secs * burst > u128::from(MAX_WINDOW_SECS) * per_window {
            return Err(format!(
                "rule '{rule}': {field}.burst: refilling a burst of {burst} at {per_window} per {window_secs} seconds takes longer than the longest a limit may take to reset, 10 years ({MAX_WINDOW_SECS} seconds); lower burst or the window, or raise requests_per_unit"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::yaml::parse_file;

    fn build(files: &[(&str, &str)], merge: bool) -> Result<RuleSet, String> {
        let parsed = files
            .iter()
            .map(|(name, text)| Ok((name.to_string(), parse_file(text)?)))
            .collect::<Result<Vec<_>, String>>()
            .map_err(|e| format!("{}: {e}", files[0].0))?;
        RuleSet::build(&parsed, merge)
    }

    fn build_err(text: &str) -> String {
        build(&[("config.f.yaml", text)], false).unwrap_err()
    }

    #[test]
    fn every_semantic_error_uses_the_reference_message() {
        let cases = [
            ("descriptors: []\n", "config.f.yaml: config file cannot have empty domain"),
            ("", "config.f.yaml: config file cannot have empty domain"),
            ("domain: d\ndescriptors:\n  - value: v\n", "config.f.yaml: descriptor has empty key"),
            (
                "domain: d\ndescriptors:\n  - key: a\n    value: b\n  - key: a\n    value: b\n",
                "config.f.yaml: duplicate descriptor composite key 'd.a_b'",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a_b\n  - key: a\n    value: b\n",
                "config.f.yaml: duplicate descriptor composite key 'd.a_b'",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    descriptors:\n      - key: s\n      - key: s\n",
                "config.f.yaml: duplicate descriptor composite key 'd.a.s'",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n",
                "config.f.yaml: invalid rate limit unit 'fortnight'",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {requests_per_unit: 1}\n",
                "config.f.yaml: invalid rate limit unit ''",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, unlimited: true}\n",
                "config.f.yaml: should not specify rate limit unit when unlimited",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, replaces: [{name: ''}]}\n",
                "config.f.yaml: should not have an empty replaces entry",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, name: x, replaces: [{name: x}]}\n",
                "config.f.yaml: replaces should not contain name of same descriptor",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    value: b\n    share_threshold: true\n",
                "config.f.yaml: share_threshold can only be used with wildcard values (containing '*'), but found key 'a_b'",
            ),
        ];
        for (text, want) in cases {
            assert_eq!(build_err(text), want, "{text}");
        }
    }

    #[test]
    fn extension_errors_name_the_file_the_rule_and_the_field() {
        let cases = [
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, algorithm: leaky}\n",
                "config.f.yaml: rule 'd.a': rate_limit.algorithm: unknown algorithm 'leaky'; use one of fixed_window, sliding_window, sliding_log, token_bucket, gcra",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, burst: 5}\n",
                "config.f.yaml: rule 'd.a': rate_limit.burst: burst means nothing for fixed_window; it sets the capacity of token_bucket and gcra",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    value: b\n    rate_limits:\n      - {unit: second, requests_per_unit: 1}\n      - {unit: day, requests_per_unit: 9, unit_multiplier: 0}\n",
                "config.f.yaml: rule 'd.a_b': rate_limits[1].unit_multiplier: must be a whole number of at least 1, not 0",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: hour, requests_per_unit: 100001, algorithm: sliding_log}\n",
                "config.f.yaml: rule 'd.a': rate_limit.requests_per_unit: a sliding_log keeps one entry per counted request; use at most 100000, or sliding_window",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limits: [{unlimited: true}]\n",
                "config.f.yaml: rule 'd.a': rate_limits[0]: unlimited belongs in rate_limit, not in rate_limits",
            ),
        ];
        for (text, want) in cases {
            assert_eq!(build_err(text), want, "{text}");
        }
        let err = build_err(
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: hour, burst: -1}\n",
        );
        assert!(err.contains("burst"), "{err}");
    }

    #[test]
    fn windows_and_refill_times_are_bounded_at_ten_years() {
        let limit = |body: &str| {
            format!("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {{{body}}}\n")
        };
        for ok in [
            "unit: year, unit_multiplier: 10, requests_per_unit: 1",
            "unit: day, unit_multiplier: 3650, requests_per_unit: 1, algorithm: sliding_window",
            "unit: second, unit_multiplier: 315360000, requests_per_unit: 1, algorithm: gcra",
            "unit: second, requests_per_unit: 10, algorithm: token_bucket, burst: 3153600000",
            "unit_multiplier: 4294967295, unlimited: true",
        ] {
            let text = limit(ok);
            assert!(build(&[("f", &text)], false).is_ok(), "{ok}");
        }
        let cases = [
            (
                "unit: year, unit_multiplier: 11, requests_per_unit: 1",
                "f: rule 'd.a': rate_limit.unit_multiplier: a window of 11 x YEAR (346896000 seconds) is longer than the longest a limit may have, 10 years (315360000 seconds)",
            ),
            (
                "unit: year, unit_multiplier: 4294967295, requests_per_unit: 1, algorithm: sliding_log",
                "f: rule 'd.a': rate_limit.unit_multiplier: a window of 4294967295 x YEAR (135446088615120000 seconds) is longer than the longest a limit may have, 10 years (315360000 seconds)",
            ),
            (
                "unit: second, unit_multiplier: 315360001, requests_per_unit: 1",
                "f: rule 'd.a': rate_limit.unit_multiplier: a window of 315360001 x SECOND (315360001 seconds) is longer than the longest a limit may have, 10 years (315360000 seconds)",
            ),
            (
                "unit: year, requests_per_unit: 1, algorithm: gcra, burst: 4294967295",
                "f: rule 'd.a': rate_limit.burst: refilling a burst of 4294967295 at 1 per 31536000 seconds takes longer than the longest a limit may take to reset, 10 years (315360000 seconds); lower burst or the window, or raise requests_per_unit",
            ),
            (
                "unit: day, requests_per_unit: 0, algorithm: token_bucket, burst: 3651",
                "f: rule 'd.a': rate_limit.burst: refilling a burst of 3651 at 1 per 86400 seconds takes longer than the longest a limit may take to reset, 10 years (315360000 seconds); lower burst or the window, or raise requests_per_unit",
            ),
        ];
        for (body, want) in cases {
            assert_eq!(
                build(&[("f", &limit(body))], false).unwrap_err(),
                want,
                "{body}"
            );
        }
    }

    #[test]
    fn extensions_compile_into_limits() {
        let set = build(
            &[(
                "f",
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 10, algorithm: token_bucket, burst: 20}\n    rate_limits:\n      - {unit: minute, requests_per_unit: 100, unit_multiplier: 5, algorithm: sliding_window}\n",
            )],
            false,
        )
        .unwrap();
        let limits = &set.domains["d"].root.node("a", "").unwrap().limits;
        assert_eq!(limits.len(), 2);
        assert_eq!(
            limits[0].params(),
            Params {
                algorithm: Algorithm::TokenBucket,
                limit: 10,
                window_ms: 1000,
                burst: 20
            }
        );
        assert_eq!(limits[1].window_secs(), 300);
        assert_eq!(limits[1].burst, 100, "burst defaults to the limit");
        let gcra = RuleSet::build_with(
            &[("f".into(), parse_file("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n").unwrap())],
            false,
            Algorithm::Gcra,
        )
        .unwrap();
        assert_eq!(
            gcra.domains["d"].root.node("a", "").unwrap().limits[0].algorithm,
            Algorithm::Gcra,
            "the default algorithm applies"
        );
    }

    #[test]
    fn duplicate_domains_are_refused_unless_merging() {
        let a = ("config.a.yaml", "domain: d\ndescriptors:\n  - key: a\n");
        let b = ("config.b.yaml", "domain: d\ndescriptors:\n  - key: b\n");
        assert_eq!(
            build(&[a, b], false).unwrap_err(),
            "config.b.yaml: duplicate domain 'd' in config file"
        );
        let merged = build(&[a, b], true).unwrap();
        let root = &merged.domains["d"].root;
        assert!(root.node("a", "").is_some() && root.node("b", "").is_some());
        let b_again = ("config.c.yaml", "domain: d\ndescriptors:\n  - key: a\n");
        assert_eq!(
            build(&[a, b_again], true).unwrap_err(),
            "config.c.yaml: duplicate descriptor composite key 'd.a'"
        );
    }

    #[test]
    fn all_units_and_special_limits_compile() {
        let set = build(
            &[(
                "f",
                "domain: d\ndescriptors:\n  - {key: s, rate_limit: {unit: second, requests_per_unit: 1}}\n  - {key: w, rate_limit: {unit: WEEK, requests_per_unit: 1}}\n  - {key: m, rate_limit: {unit: month, requests_per_unit: 1}}\n  - {key: y, rate_limit: {unit: year, requests_per_unit: 1}}\n  - {key: u, rate_limit: {unlimited: true}}\n  - {key: z, rate_limit: {unit: hour, requests_per_unit: 0}}\n",
            )],
            false,
        )
        .unwrap();
        let root = &set.domains["d"].root;
        let unit = |k: &str| root.node(k, "").unwrap().limit().unwrap().unit.seconds();
        assert_eq!(unit("s"), 1);
        assert_eq!(unit("w"), 604_800);
        assert_eq!(unit("m"), 2_592_000);
        assert_eq!(unit("y"), 31_536_000);
        assert!(root.node("u", "").unwrap().limit().unwrap().unlimited);
        assert_eq!(
            root.node("z", "")
                .unwrap()
                .limit()
                .unwrap()
                .requests_per_unit,
            0
        );
    }

    #[test]
    fn rlconfig_lists_every_limited_rule() {
        let set = build(
            &[(
                "f",
                "domain: d\ndescriptors:\n  - key: a\n    value: b\n    rate_limit: {unit: minute, requests_per_unit: 5}\n    descriptors:\n      - key: c\n        shadow_mode: true\n        rate_limit: {unit: hour, requests_per_unit: 7}\n  - key: free\n",
            )],
            false,
        )
        .unwrap();
        assert_eq!(
            set.describe(),
            vec![
                "d.a_b.c: unit=HOUR requests_per_unit=7, shadow_mode: true, quota_mode: false",
                "d.a_b: unit=MINUTE requests_per_unit=5, shadow_mode: false, quota_mode: false",
            ]
        );
    }
}
