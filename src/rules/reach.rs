//! Rules that no request can match: a request whose descriptor has more entries, or a longer key or
//! value, than `request_limits` allows is refused before any rule is read, so a rule written deeper
//! than that, or with a longer key or plain value, loads and is listed but never counts a hit. The
//! reference has no such bounds; a rules file or an xDS route written for it can cross ours.

use super::{
    model::{Level, Node, PathStep, RuleSet},
    rlconfig::{rule_name, ShowValue},
};

/// What a request's descriptor may carry (`request_limits`), against which rules are checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryBounds {
    /// `request_limits.max_entries`.
    pub max_entries: usize,
    /// `request_limits.max_key_bytes`.
    pub max_key_bytes: usize,
    /// `request_limits.max_value_bytes`.
    pub max_value_bytes: usize,
}

/// The rules of one kind out of reach: how many, and the first in the order of their written paths
/// (compared level by level: no name is built but the one shown).
#[derive(Debug, Default)]
struct Found<'a> {
    count: usize,
    first: Option<&'a Node>,
}

impl<'a> Found<'a> {
    fn add(&mut self, node: &'a Node) {
        self.count += 1;
        let earlier = self.first.is_none_or(|first| {
            fn written<'s>(step: &&'s PathStep) -> (&'s str, &'s str) {
                (&step.key, &step.value)
            }
            let (path, first) = (node.path(), first.path());
            path.iter().map(written).lt(first.iter().map(written))
        });
        if earlier {
            self.first = Some(node);
        }
    }

    /// `rule 'web.a_b' (and 2 other rules)`, a long name cut in its middle.
    fn rules(&self, show: ShowValue<'_>) -> Option<String> {
        const HEAD: usize = 40;
        const TAIL: usize = 80;
        let first = self.first?;
        let name = rule_name(first.at.domain(), first, show);
        let chars = name.chars().count();
        let name = if chars > HEAD + TAIL + 3 {
            let head: String = name.chars().take(HEAD).collect();
            let tail: String = name.chars().skip(chars - TAIL).collect();
            format!("{head}...{tail}")
        } else {
            name
        };
        Some(match self.count {
            1 => format!("rule '{name}'"),
            2 => format!("rule '{name}' (and 1 other rule)"),
            n => format!("rule '{name}' (and {} other rules)", n - 1),
        })
    }
}

#[derive(Debug, Default)]
struct Unreachable<'a> {
    deep: Found<'a>,
    long_key: Found<'a>,
    long_value: Found<'a>,
}

impl RuleSet {
    /// One warning per way rules are out of reach of every request within `bounds`, naming the first
    /// such rule and how many there are, and the setting that would serve them. Empty when every rule
    /// can match.
    pub fn unreachable(&self, bounds: EntryBounds) -> Vec<String> {
        self.unreachable_with(bounds, &|_, value, _| value.to_owned())
    }

    /// [`RuleSet::unreachable`], each written value in a rule's name shown as `show` says (hashed
    /// where `/rlconfig` hashes it).
    pub fn unreachable_with(&self, bounds: EntryBounds, show: ShowValue<'_>) -> Vec<String> {
        let mut found = Unreachable::default();
        for domain in self.domains.values() {
            found.level(&domain.root, 1, bounds);
        }
        let mut warnings = Vec::new();
        if let Some(rules) = found.deep.rules(show) {
            warnings.push(format!(
                "{rules} is nested deeper than request_limits.max_entries ({}), the most entries a request's descriptor may carry: it can never match; raise request_limits.max_entries to serve it",
                bounds.max_entries
            ));
        }
        if let Some(rules) = found.long_key.rules(show) {
            warnings.push(format!(
                "{rules} has a key longer than request_limits.max_key_bytes ({}), the longest key a request may send: it can never match; raise request_limits.max_key_bytes to serve it",
                bounds.max_key_bytes
            ));
        }
        if let Some(rules) = found.long_value.rules(show) {
            warnings.push(format!(
                "{rules} has a value longer than request_limits.max_value_bytes ({}), the longest value a request may send: it can never match; raise request_limits.max_value_bytes to serve it",
                bounds.max_value_bytes
            ));
        }
        warnings
    }
}

impl<'a> Unreachable<'a> {
    /// Checks the nodes of `level`, written at `depth` (1 for a domain's top level). A node too deep is
    /// counted alone, not with the rules below it, and a node out of reach for its key or value is not
    /// descended into: what is under it is out of reach too, for the same cause.
    fn level(&mut self, level: &'a Level, depth: usize, bounds: EntryBounds) {
        for (key, nodes) in &level.keys {
            if depth > bounds.max_entries {
                nodes.nodes().for_each(|node| self.deep.add(node));
                continue;
            }
            if key.len() > bounds.max_key_bytes {
                nodes.nodes().for_each(|node| self.long_key.add(node));
                continue;
            }
            for (value, node) in &nodes.values {
                if value.len() > bounds.max_value_bytes {
                    self.long_value.add(node);
                } else {
                    self.level(&node.children, depth + 1, bounds);
                }
            }
            for (pattern, node) in &nodes.wildcards {
                // The shortest value a wildcard matches is its pattern without the `*`s.
                let literal = pattern.pattern().bytes().filter(|&b| b != b'*').count();
                if literal > bounds.max_value_bytes {
                    self.long_value.add(node);
                } else {
                    self.level(&node.children, depth + 1, bounds);
                }
            }
            let others = nodes.cidrs.iter().map(|(_, n)| n);
            for node in others.chain(nodes.default.iter()) {
                self.level(&node.children, depth + 1, bounds);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::{parse_file, RuleSet};

    fn rules(text: &str) -> RuleSet {
        RuleSet::build(&[("r.yaml".into(), parse_file(text).unwrap())], false).unwrap()
    }

    const BOUNDS: EntryBounds = EntryBounds {
        max_entries: 2,
        max_key_bytes: 8,
        max_value_bytes: 8,
    };

    #[test]
    fn rules_within_the_request_bounds_are_all_reachable() {
        let set = rules(
            "domain: web\ndescriptors:\n  - key: a\n    value: '12345678'\n    descriptors:\n      - key: '12345678'\n        value: 'x*'\n        rate_limit: {unit: second, requests_per_unit: 1}\n",
        );
        assert_eq!(set.unreachable(BOUNDS), Vec::<String>::new());
    }

    #[test]
    fn a_rule_deeper_than_a_request_may_go_is_named_once_with_the_setting() {
        let set = rules(
            "domain: web\ndescriptors:\n  - key: a\n    descriptors:\n      - key: b\n        descriptors:\n          - key: c\n            rate_limit: {unit: second, requests_per_unit: 1}\n            descriptors:\n              - key: d\n                rate_limit: {unit: second, requests_per_unit: 1}\n          - key: e\n            value: x*\n            rate_limit: {unit: second, requests_per_unit: 1}\n",
        );
        let warnings = set.unreachable(BOUNDS);
        assert_eq!(
            warnings,
            ["rule 'web.a.b.c' (and 1 other rule) is nested deeper than request_limits.max_entries (2), the most entries a request's descriptor may carry: it can never match; raise request_limits.max_entries to serve it"]
        );
    }

    #[test]
    fn a_key_or_a_plain_value_longer_than_a_request_may_send_is_named() {
        let set = rules(
            "domain: web\ndescriptors:\n  - key: a_long_key\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: a\n    value: a_long_value\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: a\n    value: a_long_value_too*\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        );
        let warnings = set.unreachable(BOUNDS);
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(
            warnings[0].starts_with(
                "rule 'web.a_long_key' has a key longer than request_limits.max_key_bytes (8)"
            ),
            "{warnings:?}"
        );
        // The wildcard needs 16 bytes at least; `x*` in the first test needs 1.
        assert!(
            warnings[1].starts_with("rule 'web.a_a_long_value' (and 1 other rule) has a value longer than request_limits.max_value_bytes (8)"),
            "{warnings:?}"
        );
    }

    #[test]
    fn a_rule_is_named_as_rlconfig_shows_it_and_a_long_name_keeps_both_ends() {
        let set = rules(
            "domain: web\ndescriptors:\n  - key: api_key\n    value: sekrit-partner-token\n    hash_value: true\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        );
        let show: ShowValue<'_> = &|_, value, hashed| {
            if hashed {
                "hidden".into()
            } else {
                value.into()
            }
        };
        let warnings = set.unreachable_with(BOUNDS, show);
        assert!(
            warnings[0].starts_with("rule 'web.api_key_hidden' has a value longer"),
            "{warnings:?}"
        );

        let long = format!(
            "domain: web\ndescriptors:\n  - key: a\n    value: {}\n    descriptors:\n      - key: b\n        descriptors:\n          - key: tail\n            rate_limit: {{unit: second, requests_per_unit: 1}}\n",
            "v".repeat(200)
        );
        let warnings = rules(&long).unreachable(EntryBounds {
            max_value_bytes: 1024,
            ..BOUNDS
        });
        let name = warnings[0]
            .strip_prefix("rule '")
            .and_then(|w| w.split_once('\'').map(|(name, _)| name))
            .unwrap();
        assert!(
            name.starts_with("web.a_vvv") && name.ends_with("vvv.b.tail"),
            "{name}"
        );
        assert!(name.contains("..."), "{name}");
        assert_eq!(name.chars().count(), 40 + 3 + 80, "{name}");
    }
}
