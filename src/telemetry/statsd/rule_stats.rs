//! The per-rule stats, most of what a flush reads (six counters a rule, every rule of every domain): each
//! rule's statsd names are made once, when the rule is first seen, and kept beside what the server was
//! sent, so that a flush costs the rules a lookup and six reads each, and a line only for what changed.

use std::collections::HashMap;

use super::{lines::sanitize, Format};
use crate::telemetry::metrics::{Metrics, RuleCounters, RuleTotals};

/// One rule's stats.
struct RuleStat {
    /// `ratelimit.service.rate_limit.<domain>.<rule>.<counter>`, sanitized, in the order of
    /// [`RuleCounters::REFERENCE`].
    names: [String; 6],
    /// What the server has been sent.
    sent: RuleTotals,
    /// What the last flush read, sent once that flush is delivered.
    read: RuleTotals,
}

/// Every rule's stats, by domain and rule label.
#[derive(Default)]
pub struct RuleStats {
    rules: HashMap<Box<str>, HashMap<Box<str>, RuleStat>>,
}

impl RuleStats {
    /// Reads every rule's counters and adds to `out` the lines of what changed since the last delivered
    /// flush.
    pub fn lines(&mut self, metrics: &Metrics, format: &Format, out: &mut Vec<String>) {
        metrics.for_each_rule(|domain, rule, totals| {
            let stat = self.stat(domain, rule);
            stat.read = totals;
            for ((name, now), sent) in stat.names.iter().zip(totals).zip(stat.sent) {
                let delta = now.saturating_sub(sent);
                if delta > 0 {
                    let mut line = String::with_capacity(name.len() + 16);
                    format.line(&mut line, name, &delta.to_string(), "c", None);
                    out.push(line);
                }
            }
        });
    }

    /// What the last flush read has been delivered.
    pub fn delivered(&mut self) {
        for stat in self.rules.values_mut().flat_map(HashMap::values_mut) {
            stat.sent = stat.read;
        }
    }

    /// The stats of one rule, named on first sight.
    fn stat(&mut self, domain: &str, rule: &str) -> &mut RuleStat {
        let rules = by_name(&mut self.rules, domain, HashMap::new);
        by_name(rules, rule, || RuleStat {
            names: RuleCounters::REFERENCE.map(|counter| {
                sanitize(&format!(
                    "ratelimit.service.rate_limit.{domain}.{rule}.{counter}"
                ))
            }),
            sent: RuleTotals::default(),
            read: RuleTotals::default(),
        })
    }
}

/// The entry of `name`, made with `make` when missing; a name is copied into the map only then, so a
/// flush over known rules allocates nothing.
fn by_name<'a, V>(
    map: &'a mut HashMap<Box<str>, V>,
    name: &str,
    make: impl FnOnce() -> V,
) -> &'a mut V {
    if !map.contains_key(name) {
        map.insert(name.into(), make());
    }
    map.get_mut(name).expect("inserted just above when missing")
}
