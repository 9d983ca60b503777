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

/// An IPv4 or IPv6 network written `cidr:<address>/<prefix>` as a rule value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    network: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Parses `10.0.0.0/8`, `2001:db8::/32` or a bare address (a /32 or /128).
    pub fn parse(text: &str) -> Result<Self, String> {
        let (addr, prefix) = match text.split_once('/') {
            Some((addr, prefix)) => (addr, Some(prefix)),
            None => (text, None),
        };
        let network: IpAddr = addr
            .trim()
            .parse()
            .map_err(|_| format!("'{addr}' is not an IP address"))?;
        let max = if network.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => p
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("prefix '/{p}' must be 0 to {max}"))?,
        };
        let cidr = Self { network, prefix };
        if cidr.mask(network) != network {
            return Err(format!(
                "host bits are set; the network is {}/{prefix}",
                cidr.mask(network)
            ));
        }
        Ok(cidr)
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    fn mask(&self, addr: IpAddr) -> IpAddr {
        match addr {
            IpAddr::V4(a) => {
                let bits = u32::from(a);
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                IpAddr::V4((bits & mask).into())
            }
            IpAddr::V6(a) => {
                let bits = u128::from(a);
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                IpAddr::V6((bits & mask).into())
            }
        }
    }

    /// Whether the address lies in the network (IPv4-mapped IPv6 addresses count as IPv4).
    pub fn contains(&self, addr: IpAddr) -> bool {
        let addr = addr.to_canonical();
        addr.is_ipv4() == self.network.is_ipv4() && self.mask(addr) == self.network
    }
}

/// A value pattern with `*` standing for any run of characters (possibly empty), matched against a
/// request entry's value.
#[derive(Debug, Clone)]
pub struct Wildcard {
    pattern: Box<str>,
    /// The pattern split on `*`: the first part is a prefix, the last a suffix, the others must appear in
    /// order between them.
    parts: Box<[Box<str>]>,
}

impl Wildcard {
    pub fn new(pattern: &str) -> Self {
        Self {
            pattern: pattern.into(),
            parts: pattern.split('*').map(Into::into).collect(),
        }
    }

    /// The value pattern as written.
    pub fn pattern(&self) -> &str {
        &self.pattern
    }

    pub fn matches(&self, text: &str) -> bool {
        let parts = &self.parts;
        let (first, last) = (&parts[0], &parts[parts.len() - 1]);
        if parts.len() == 1 {
            return text == &**first;
        }
        if text.len() < first.len() + last.len()
            || !text.starts_with(&**first)
            || !text.ends_with(&**last)
        {
            return false;
        }
        let mut middle = &text[first.len()..text.len() - last.len()];
        for part in &parts[1..parts.len() - 1] {
            match middle.find(&**part) {
                Some(at) => middle = &middle[at + part.len()..],
                None => return false,
            }
        }
        true
    }
}

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
        if let Some((_, node)) = nodes.wildcards.iter().find(|(w, _)| w.matches(value)) {
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
        set.domains["d"]
            .find(entries)
            .map(|n| n.full_key.to_string())
    }

    #[test]
    fn wildcard_patterns_follow_the_reference_examples() {
        let cases = [
            ("foo*", "foo1", true),
            ("foo*", "foo", true),
            ("foo*", "fo", false),
            ("bar*b", "barab", true),
            ("bar*b", "bar123b", true),
            ("bar*b", "barb", true),
            ("bar*b", "bara", false),
            ("bar*b", "xbarb", false),
            ("foo*bar*baz", "foobarbaz", true),
            ("foo*bar*baz", "foo1bar2baz", true),
            ("foo*bar*baz", "foo123baz", false),
            ("a*a", "a", false),
            ("*", "", true),
            ("k_*", "k_", true),
        ];
        for (pattern, text, want) in cases {
            assert_eq!(
                Wildcard::new(pattern).matches(text),
                want,
                "{pattern} ~ {text}"
            );
        }
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
                .unwrap_err();
            assert!(
                err.starts_with("f: duplicate descriptor composite key 'd.a_"),
                "{text}: {err}"
            );
        }
    }

    #[test]
    fn cidrs_parse_strictly_and_contain_v4_and_v6() {
        let net = Cidr::parse("10.0.0.0/8").unwrap();
        assert!(net.contains("10.200.1.2".parse().unwrap()));
        assert!(net.contains("::ffff:10.1.2.3".parse().unwrap()));
        assert!(!net.contains("11.0.0.1".parse().unwrap()));
        assert!(!net.contains("::1".parse().unwrap()));
        let v6 = Cidr::parse("2001:db8::/32").unwrap();
        assert!(v6.contains("2001:db8:1::5".parse().unwrap()));
        assert!(Cidr::parse("0.0.0.0/0")
            .unwrap()
            .contains("8.8.8.8".parse().unwrap()));
        assert_eq!(Cidr::parse("192.168.1.7").unwrap().prefix(), 32);
        for bad in ["10.0.0.0/33", "10.0.0/8", "10.1.0.0/8", "fe80::/129", "x/1"] {
            assert!(Cidr::parse(bad).is_err(), "{bad}");
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
