//! The text `/rlconfig` shows: every limit of the loaded rules, one line each, in the reference service's
//! format (`<domain>.<key>_<value>...: unit=<UNIT> requests_per_unit=<n>, shadow_mode: <b>, quota_mode:
//! <b>`), followed by ratelimitd's extensions when a limit uses them.

use std::fmt::Write;

use super::model::{Limit, Node, RuleSet};
use crate::algorithm::Algorithm;

/// How a written value is shown: `(key, value, hash_value)` to the text to print.
pub type ShowValue<'a> = &'a dyn Fn(&str, &str, bool) -> String;

impl RuleSet {
    /// Every rule with a limit, one line each, sorted: what `/rlconfig` shows.
    pub fn describe(&self) -> Vec<String> {
        self.describe_with(&|_, value, _| value.to_owned())
    }

    /// [`RuleSet::describe`], with each written value shown as `show(key, value, hash_value)` says.
    pub fn describe_with(&self, show: ShowValue<'_>) -> Vec<String> {
        let mut out = Vec::new();
        self.for_each_node(|domain, node| {
            let name = rule_name(domain, node, show);
            for limit in &node.limits {
                out.push(limit_line(&name, node, limit));
            }
        });
        out.sort();
        out
    }
}

/// `domain.key_value.key...`, each written value shown as `show` says.
pub(super) fn rule_name(domain: &str, node: &Node, show: ShowValue<'_>) -> String {
    let mut out = domain.to_owned();
    for step in node.path() {
        out.push('.');
        out.push_str(&step.key);
        if !step.value.is_empty() {
            out.push('_');
            out.push_str(&show(&step.key, &step.value, step.flags.hash_value));
        }
    }
    out
}

fn limit_line(name: &str, node: &Node, limit: &Limit) -> String {
    let (shadow_mode, quota_mode) = (node.flags.shadow_mode, node.flags.quota_mode);
    if limit.unlimited {
        return format!("{name}: unlimited, shadow_mode: {shadow_mode}, quota_mode: {quota_mode}");
    }
    let mut line = format!(
        "{name}: unit={} requests_per_unit={}, shadow_mode: {shadow_mode}, quota_mode: {quota_mode}",
        limit.unit, limit.requests_per_unit,
    );
    // Writing to a String cannot fail.
    if limit.unit_multiplier != 1 {
        let _ = write!(line, ", unit_multiplier: {}", limit.unit_multiplier);
    }
    if limit.algorithm != Algorithm::FixedWindow {
        let _ = write!(line, ", algorithm: {}", limit.algorithm.name());
    }
    if limit.algorithm.uses_burst() {
        let _ = write!(line, ", burst: {}", limit.burst);
    }
    if limit.count_over_limit {
        line.push_str(", count_over_limit: true");
    }
    line
}

#[cfg(test)]
mod tests {
    use crate::rules::{parse_file, RuleSet};

    fn build(text: &str) -> RuleSet {
        RuleSet::build(&[("f".into(), parse_file(text).unwrap())], false).unwrap()
    }

    #[test]
    fn rlconfig_lists_every_limited_rule() {
        let set = build(
                "domain: d\ndescriptors:\n  - key: a\n    value: b\n    rate_limit: {unit: minute, requests_per_unit: 5}\n    descriptors:\n      - key: c\n        shadow_mode: true\n        rate_limit: {unit: hour, requests_per_unit: 7}\n  - key: free\n",
        );
        assert_eq!(
            set.describe(),
            vec![
                "d.a_b.c: unit=HOUR requests_per_unit=7, shadow_mode: true, quota_mode: false",
                "d.a_b: unit=MINUTE requests_per_unit=5, shadow_mode: false, quota_mode: false",
            ]
        );
    }

    #[test]
    fn rlconfig_lists_cidr_and_wildcard_rules_too() {
        let set = build(
            r#"domain: d
descriptors:
  - key: ip
    value: "cidr:10.0.0.0/8"
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: ip
    value: "192.*"
    rate_limit: {unit: second, requests_per_unit: 4}
  - key: ip
    rate_limit: {unit: second, requests_per_unit: 5}
"#,
        );
        assert_eq!(
            set.describe(),
            vec![
                "d.ip: unit=SECOND requests_per_unit=5, shadow_mode: false, quota_mode: false",
                "d.ip_192.*: unit=SECOND requests_per_unit=4, shadow_mode: false, quota_mode: false",
                "d.ip_cidr:10.0.0.0/8: unit=SECOND requests_per_unit=3, shadow_mode: false, quota_mode: false",
            ]
        );
    }
}
