//! A rate limit quota bucket seen as a descriptor, so that one rules file serves both protocols and both
//! count on the same counters.
//!
//! A bucket id is a map, whose entries have no order; a descriptor is a list, matched one entry per level
//! of the rules tree. The bucket's entries become the descriptor in the order the tree nests them: at
//! each level, among the entries not used yet, the one whose key the level has rules for (the first in
//! byte order of the keys, when the level has rules for several) is matched as the reference matching
//! does (exact value, `cidr:`, wildcards in file order, the key-only rule), without backtracking; every
//! entry must be used. `{path: /login, method: POST, remote_address: 203.0.113.7}` therefore meets the
//! rule `remote_address` > `path: /login` > `method: POST` and counts on the very counter a
//! `ShouldRateLimit` with the descriptor `[remote_address, path, method]` counts on.

use std::sync::Arc;

use super::{plan, plan::Resolved, record, Descriptor, Entry, Limiter, Request};
use crate::{
    algorithm::Params,
    rules::{Domain, Node},
    store::{keys, Check},
};

/// What a bucket resolves to under the rules being served.
#[derive(Debug, Clone, PartialEq)]
pub enum BucketRule {
    /// No rules have been loaded yet: nothing can be said of any bucket.
    NoRules,
    /// The domain has no rules, no rule matches the bucket, or the rule limits nothing: not limited.
    Unmatched,
    /// The rule is `unlimited`: never limited, never counted.
    Unlimited { rule: Arc<str> },
    /// The rule limits the bucket.
    Limited(BucketLimits),
}

/// The limits a bucket counts against, as a `ShouldRateLimit` of its descriptor would count them.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketLimits {
    /// The rule as the `rule` metric label names it, for both protocols (see `record::rule_label`).
    pub rule: Arc<str>,
    /// How `rule` carries request values: the rule's `Node::label_form` when it does, else 0.
    pub rule_form: u64,
    /// The rule as written: each level's key and value (`""` for a key-only level), by which a rules
    /// reload is seen to keep or drop it (see [`Limiter::has_bucket_rule`]).
    pub rule_path: Arc<[(Box<str>, Box<str>)]>,
    /// Where the bucket's shares live: the descriptor's key with `:rlqs` (see [`keys::bucket_key`]).
    pub shares_key: String,
    /// One check per limit of the rule, on the counter the descriptor counts on, costing nothing; the
    /// caller sets the cost.
    pub checks: Vec<Check>,
    /// The limits' parameters, in the order of `checks`.
    pub params: Vec<Params>,
    /// The rule never denies (`shadow_mode`, or the global `SHADOW_MODE`).
    pub shadow: bool,
}

impl Limiter {
    /// Resolves a bucket of `domain` (its entries in any order) against the current rules.
    pub fn resolve_bucket(&self, domain: &str, bucket: &[(String, String)]) -> BucketRule {
        let Some(rules) = self.rules.snapshot() else {
            return BucketRule::NoRules;
        };
        let Some(domain_rules) = rules.domains.get(domain) else {
            return BucketRule::Unmatched;
        };
        let Some((entries, node)) = descriptor_of(domain_rules, bucket) else {
            return BucketRule::Unmatched;
        };
        let request = Request {
            domain: domain.to_owned(),
            descriptors: vec![Descriptor {
                entries,
                limit: None,
                hits_addend: Some(0),
            }],
            hits_addend: 0,
        };
        let descriptor = &request.descriptors[0];
        // The rule the bucket was matched to is the one it counts on, looked up once. Runtime limits are
        // for `ShouldRateLimit` callers: a quota bucket shares its rule's limits.
        let mut resolved = [plan::of_rule(node)];
        match resolved[0] {
            Resolved::NoLimit => return BucketRule::Unmatched,
            Resolved::Unlimited(_) => {
                return BucketRule::Unlimited {
                    rule: self.bucket_rule_label(domain, descriptor, node).0,
                }
            }
            Resolved::Limited { .. } => {}
        }
        plan::apply_replaces(&mut resolved);
        let batch = plan::batch(&request, &resolved, &self.options);
        if batch.checks.is_empty() {
            return BucketRule::Unmatched;
        }
        let values = plan::key_values(descriptor, Some(node), &self.options);
        let mut shares_key = String::new();
        keys::bucket_key(
            &mut shares_key,
            &self.options.key_prefix,
            domain,
            descriptor
                .entries
                .iter()
                .zip(&values)
                .map(|(e, v)| (e.key.as_str(), v.as_ref())),
        );
        let rule_path = node
            .path()
            .iter()
            .map(|step| (step.key.clone(), step.value.clone()))
            .collect();
        let (rule, rule_form) = self.bucket_rule_label(domain, descriptor, node);
        BucketRule::Limited(BucketLimits {
            rule,
            rule_form,
            rule_path,
            shares_key,
            params: batch.checks.iter().map(|c| c.params).collect(),
            checks: batch.checks,
            shadow: node.flags.shadow_mode || self.options.shadow_mode,
        })
    }

    /// The rule's `rule` label, as `ShouldRateLimit` labels the same descriptor (see
    /// `record::rule_label`): request values only where the rule asks for them, and as many such
    /// labels per rule as `ShouldRateLimit` allows, shared with it; and how it carries them (see
    /// [`BucketLimits::rule_form`]).
    fn bucket_rule_label(
        &self,
        domain: &str,
        descriptor: &Descriptor,
        node: &Node,
    ) -> (Arc<str>, u64) {
        let label = record::rule_label(Some(node), descriptor, &self.options);
        match &label.written {
            Some(written) if label.request_values => {
                let text = self.options.metrics.rule_label_within(
                    domain,
                    &label.text,
                    written,
                    label.form,
                    self.options.metric_values_per_rule,
                );
                (Arc::from(&*text), label.form)
            }
            _ => (Arc::from(&*label.text), 0),
        }
    }

    /// Whether the rules being served still have, in `domain`, a rule with limits written at `path`
    /// (each level's key and value as written, see [`BucketLimits::rule_path`]), whose labels carry
    /// request values in the form `form` when it is not 0 (see [`BucketLimits::rule_form`]); `None`
    /// before any rules are loaded.
    pub fn has_bucket_rule(
        &self,
        domain: &str,
        path: &[(Box<str>, Box<str>)],
        form: u64,
    ) -> Option<bool> {
        let rules = self.rules.snapshot()?;
        let Some(domain) = rules.domains.get(domain) else {
            return Some(false);
        };
        let mut level = &domain.root;
        let mut found = None;
        for (key, value) in path {
            let Some(node) = level.node(key, value) else {
                return Some(false);
            };
            level = &node.children;
            found = Some(node);
        }
        Some(found.is_some_and(|node| {
            !node.limits.is_empty() && (form == 0 || node.label_form() == form)
        }))
    }
}

/// The bucket's entries in the order the domain's rules nest them, and the rule they land on (see the
/// module documentation).
fn descriptor_of<'a>(
    domain: &'a Domain,
    bucket: &[(String, String)],
) -> Option<(Vec<Entry>, &'a Node)> {
    let mut left: Vec<&(String, String)> = bucket.iter().collect();
    left.sort_by(|a, b| a.0.cmp(&b.0));
    let mut entries: Vec<Entry> = Vec::with_capacity(left.len());
    let mut level = &domain.root;
    let mut node = None;
    while !left.is_empty() {
        let at = left
            .iter()
            .position(|(key, _)| level.keys.contains_key(key.as_str()))?;
        let (key, value) = left.remove(at);
        entries.push(Entry {
            key: key.clone(),
            value: value.clone(),
        });
        let found = domain.find(&entries)?;
        level = &found.children;
        node = Some(found);
    }
    node.map(|node| (entries, node))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::{parse_file, RuleSet};

    fn domain(text: &str) -> RuleSet {
        RuleSet::build(&[("f".into(), parse_file(text).unwrap())], false).unwrap()
    }

    fn order(set: &RuleSet, bucket: &[(&str, &str)]) -> Option<(Vec<String>, String)> {
        let bucket: Vec<(String, String)> = bucket
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        descriptor_of(&set.domains["edge"], &bucket).map(|(entries, node)| {
            (
                entries
                    .into_iter()
                    .map(|e| format!("{}={}", e.key, e.value))
                    .collect(),
                node.full_key(),
            )
        })
    }

    const RULES: &str = r#"
domain: edge
descriptors:
  - key: remote_address
    descriptors:
      - key: path
        value: /login
        descriptors:
          - key: method
            value: POST
            rate_limit: {unit: minute, requests_per_unit: 5}
  - key: generic_key
    value: global
    rate_limit: {unit: second, requests_per_unit: 100}
  - key: api_key
    descriptors:
      - key: generic_key
        rate_limit: {unit: second, requests_per_unit: 7}
"#;

    #[test]
    fn a_bucket_meets_its_rule_in_the_order_the_rules_nest_its_keys() {
        let set = domain(RULES);
        let (entries, rule) = order(
            &set,
            &[
                ("method", "POST"),
                ("path", "/login"),
                ("remote_address", "203.0.113.7"),
            ],
        )
        .unwrap();
        assert_eq!(
            entries,
            ["remote_address=203.0.113.7", "path=/login", "method=POST"]
        );
        assert_eq!(rule, "edge.remote_address.path_/login.method_POST");
        let (entries, _) = order(&set, &[("generic_key", "global")]).unwrap();
        assert_eq!(entries, ["generic_key=global"]);
    }

    #[test]
    fn the_first_key_in_byte_order_is_taken_when_a_level_has_rules_for_several() {
        // `api_key` and `generic_key` both have rules at the top: `api_key` comes first, and then
        // `generic_key` is matched under it.
        let set = domain(RULES);
        let (entries, rule) = order(&set, &[("generic_key", "x"), ("api_key", "k")]).unwrap();
        assert_eq!(entries, ["api_key=k", "generic_key=x"]);
        assert_eq!(rule, "edge.api_key.generic_key");
    }

    #[test]
    fn every_entry_must_be_used_and_there_is_no_backtracking() {
        let set = domain(RULES);
        // One entry too many.
        assert_eq!(
            order(&set, &[("generic_key", "global"), ("zone", "eu")]),
            None
        );
        // `path` has a rule only under `remote_address`.
        assert_eq!(order(&set, &[("path", "/login")]), None);
        // Not every value matches.
        assert_eq!(
            order(&set, &[("remote_address", "a"), ("path", "/other")]),
            None
        );
        assert_eq!(order(&set, &[]), None);
    }
}
