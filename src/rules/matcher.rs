//! Matching a request descriptor against a domain's rules tree.
//!
//! One request entry per level; at each level the exact `key_value` node wins, then the wildcard nodes in
//! file order, then the key-only default node. There is no backtracking, and only a match of the full
//! request depth yields a rule.

use super::model::{Domain, Level, Node};

/// A value pattern with `*` standing for any run of characters (possibly empty), matched against a
/// request's composite `key_value` string.
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

    /// The composite `key_value` pattern as written.
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
    /// matched a level. `scratch` is reused between calls to build composite keys without allocating.
    pub fn find<'a, E: EntryRef>(
        &'a self,
        entries: &[E],
        scratch: &mut String,
    ) -> Option<&'a Node> {
        let mut level: &Level = &self.root;
        let mut found = None;
        for entry in entries {
            let node = level.find(entry.key(), entry.value(), scratch)?;
            found = Some(node);
            level = &node.children;
        }
        found
    }
}

impl Level {
    fn find<'a>(&'a self, key: &str, value: &str, scratch: &mut String) -> Option<&'a Node> {
        scratch.clear();
        scratch.push_str(key);
        scratch.push('_');
        scratch.push_str(value);
        if let Some(node) = self.exact.get(scratch.as_str()) {
            return Some(node);
        }
        if let Some((_, node)) = self.wildcards.iter().find(|(w, _)| w.matches(scratch)) {
            return Some(node);
        }
        self.exact.get(key)
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
            .find(entries, &mut String::new())
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
        let bare = set2.domains["d"]
            .find(&[E("bare", "x")], &mut String::new())
            .unwrap();
        assert!(bare.limits.is_empty());
    }
}
