//! Matching a request descriptor against a domain's rules tree.
//!
//! One request entry per level. At each level only the nodes written with exactly the entry's key are
//! candidates; among them the node with exactly the entry's value wins, then the CIDR nodes (the longest
//! prefix containing the value, when it is an IP address), then the wildcard nodes in file order (the
//! pattern against the value alone), then the key-only default node. There is no backtracking, and only
//! a match of the full request depth yields a rule.
//!
//! The reference service looks nodes up by the joined string `key_value`, so a request key `api_key`
//! reaches a rule `key: api, value: "*"`, and an entry `a_b=c` the rule `key: a, value: b_c`. Keeping the
//! key and the value apart is the one place ratelimitd matches differently: no caller can pick another
//! key's rules by putting `_` in a key.

use std::net::IpAddr;

use super::model::{Domain, Level, Node};

/// One entry of a request descriptor, as the matcher needs it.
pub trait EntryRef {
    fn key(&self) -> &str;
    fn value(&self) -> &str;
}

impl Domain {
    /// Finds the rule node a descriptor lands on: the node matched by its last entry, if every entry
    /// matched a level.
    pub fn find<'a, E: EntryRef>(&'a self, entries: &[E]) -> Option<&'a Node> {
        let mut level: &Level = &self.root;
        let mut found = None;
        for entry in entries {
            let node = level.find(entry.key(), entry.value())?;
            found = Some(node);
            level = &node.children;
        }
        found
    }
}

impl Level {
    fn find(&self, key: &str, value: &str) -> Option<&Node> {
        let nodes = self.keys.get(key)?;
        if let Some(node) = nodes.values.get(value) {
            return Some(node);
        }
        if !nodes.cidrs.is_empty() {
            if let Ok(addr) = value.trim().parse::<IpAddr>() {
                // Longest prefix first, so the first hit is the most specific network.
                if let Some((_, node)) = nodes.cidrs.iter().find(|(c, _)| c.contains(addr)) {
                    return Some(node);
                }
            }
        }
        if let Some(node) = nodes.wildcard(value) {
            return Some(node);
        }
        nodes.default.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::{model::RuleSet, yaml::parse_file};

    struct E(&'static str, &'static str);
    impl EntryRef for E {
        fn key(&self) -> &str {
            self.0
        }
        fn value(&self) -> &str {
            self.1
        }
    }

    fn rules(text: &str) -> RuleSet {
        RuleSet::build(&[("f".into(), parse_file(text).unwrap())], false).unwrap()
    }

    fn hit(set: &RuleSet, entries: &[E]) -> Option<String> {
        set.domains["d"].find(entries).map(Node::full_key)
    }

    const TREE: &str = r#"
domain: d
descriptors:
  - key: k
    value: exact
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: k
    value: ex*
    rate_limit: {unit: second, requests_per_unit: 2}
  - key: k
    value: "*"
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: k
    rate_limit: {unit: second, requests_per_unit: 4}
  - key: j
    rate_limit: {unit: second, requests_per_unit: 5}
  - key: parent
    value: p
    rate_limit: {unit: minute, requests_per_unit: 6}
    descriptors:
      - key: child
        rate_limit: {unit: minute, requests_per_unit: 7}
  - key: parent
    descriptors:
      - key: child
        value: c
        rate_limit: {unit: minute, requests_per_unit: 8}
  - key: bare
"#;

    #[test]
    fn exact_value_beats_wildcards_which_beat_the_default_in_file_order() {
        let set = rules(TREE);
        assert_eq!(hit(&set, &[E("k", "exact")]).as_deref(), Some("d.k_exact"));
        assert_eq!(hit(&set, &[E("k", "exam")]).as_deref(), Some("d.k_ex*"));
        assert_eq!(hit(&set, &[E("k", "other")]).as_deref(), Some("d.k_*"));
        // `*` alone matches an empty value too, before the default node.
        assert_eq!(hit(&set, &[E("k", "")]).as_deref(), Some("d.k_*"));
        assert_eq!(hit(&set, &[E("j", "anything")]).as_deref(), Some("d.j"));
        assert_eq!(hit(&set, &[E("unknown", "x")]), None);
    }

    #[test]
    fn an_entry_meets_only_the_nodes_of_its_own_key_and_values_match_alone() {
        let set = rules(
            r#"
domain: d
descriptors:
  - key: api
    value: "*"
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: a
    value: b_c
    rate_limit: {unit: second, requests_per_unit: 2}
  - key: k
    value: v
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: x
    value: "cidr:10.0.0.0/8"
    rate_limit: {unit: second, requests_per_unit: 4}
  - key: x_y
    value: "1*"
    rate_limit: {unit: second, requests_per_unit: 5}
"#,
        );
        // The reference joins `key_value` first: `api_key_1` fits the pattern `api_*`, `a_b_c` is the
        // exact `a_b_c`, and the key `k_v` finds `k_v` among the key-only nodes.
        assert_eq!(hit(&set, &[E("api_key", "1")]), None);
        assert_eq!(hit(&set, &[E("a_b", "c")]), None);
        assert_eq!(hit(&set, &[E("k_v", "anything")]), None);
        assert_eq!(hit(&set, &[E("x", "y_10.1.2.3")]), None);
        assert_eq!(hit(&set, &[E("x", "y_1")]), None);
        // The entries the rules were written for still match, `_` in values included.
        assert_eq!(hit(&set, &[E("api", "key_1")]).as_deref(), Some("d.api_*"));
        assert_eq!(hit(&set, &[E("api", "")]).as_deref(), Some("d.api_*"));
        assert_eq!(hit(&set, &[E("a", "b_c")]).as_deref(), Some("d.a_b_c"));
        assert_eq!(hit(&set, &[E("k", "v")]).as_deref(), Some("d.k_v"));
        assert_eq!(
            hit(&set, &[E("x", "10.1.2.3")]).as_deref(),
            Some("d.x_cidr:10.0.0.0/8")
        );
        assert_eq!(hit(&set, &[E("x_y", "12")]).as_deref(), Some("d.x_y_1*"));
    }

    #[test]
    fn composite_keys_stay_duplicates_as_in_the_reference() {
        for text in [
            "domain: d\ndescriptors:\n  - {key: a, value: \"b*\"}\n  - {key: a_b*}\n",
            "domain: d\ndescriptors:\n  - {key: a_b, value: c}\n  - {key: a, value: b_c}\n",
            "domain: d\ndescriptors:\n  - {key: a, value: \"cidr:10.0.0.0/8\"}\n  - {key: a, value: \"cidr:10.0.0.0/8\"}\n",
        ] {
            let err = RuleSet::build(&[("f".into(), parse_file(text).unwrap())], false)
                .unwrap_err()
                .to_string();
            assert!(
                err.starts_with("f: duplicate descriptor composite key 'd.a_"),
                "{text}: {err}"
            );
        }
    }

    #[test]
    fn cidr_values_come_after_exact_values_and_before_wildcards_longest_prefix_first() {
        let set = rules(
            r#"
domain: d
descriptors:
  - key: ip
    value: "*"
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: ip
    value: "cidr:10.0.0.0/8"
    rate_limit: {unit: second, requests_per_unit: 2}
  - key: ip
    value: "cidr:10.1.0.0/16"
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: ip
    value: 10.1.2.3
    rate_limit: {unit: second, requests_per_unit: 4}
  - key: ip
    value: "cidr:2001:db8::/32"
    rate_limit: {unit: second, requests_per_unit: 5}
"#,
        );
        assert_eq!(
            hit(&set, &[E("ip", "10.1.2.3")]).as_deref(),
            Some("d.ip_10.1.2.3")
        );
        assert_eq!(
            hit(&set, &[E("ip", "10.1.9.9")]).as_deref(),
            Some("d.ip_cidr:10.1.0.0/16")
        );
        assert_eq!(
            hit(&set, &[E("ip", "10.9.9.9")]).as_deref(),
            Some("d.ip_cidr:10.0.0.0/8")
        );
        assert_eq!(
            hit(&set, &[E("ip", "2001:db8::1")]).as_deref(),
            Some("d.ip_cidr:2001:db8::/32")
        );
        assert_eq!(
            hit(&set, &[E("ip", "192.168.0.1")]).as_deref(),
            Some("d.ip_*")
        );
        assert_eq!(
            hit(&set, &[E("ip", "not-an-ip")]).as_deref(),
            Some("d.ip_*")
        );
    }

    #[test]
    fn depth_must_match_exactly_without_backtracking() {
        let set = rules(TREE);
        // A shorter request uses the intermediate node's own limit.
        assert_eq!(
            hit(&set, &[E("parent", "p")]).as_deref(),
            Some("d.parent_p")
        );
        assert_eq!(
            hit(&set, &[E("parent", "p"), E("child", "x")]).as_deref(),
            Some("d.parent_p.child")
        );
        // `parent_p` matched at level 1, so a miss at level 2 does not retry the default `parent`.
        assert_eq!(
            hit(&set, &[E("parent", "p"), E("child", "c")]).as_deref(),
            Some("d.parent_p.child")
        );
        assert_eq!(hit(&set, &[E("parent", "p"), E("other", "c")]), None);
        assert_eq!(
            hit(&set, &[E("parent", "q"), E("child", "c")]).as_deref(),
            Some("d.parent.child_c")
        );
        // A longer request than the tree matches nothing.
        assert_eq!(hit(&set, &[E("j", "v"), E("deeper", "x")]), None);
        // An allow-list node matches but carries no limit.
        let set2 = rules(TREE);
        let bare = set2.domains["d"].find(&[E("bare", "x")]).unwrap();
        assert!(bare.limits.is_empty());
    }
}
