//! The per-rule stats, most of what a flush reads (six counters a rule, every rule of every domain): each
//! rule's statsd names are made once, when the rule is first seen, and kept beside what the server was
//! sent, so that a flush costs the rules a lookup and six reads each, and a line only for what changed.
//!
//! A reload that removes a rule removes its counters from the metrics; the counts they had taken since
//! the last delivered flush are still owed, and are sent with the next flush (see
//! [`Metrics::take_retired`]). A rule written back gets new counters, counted from 0.

use std::collections::HashMap;

use super::{lines::sanitize, Format};
use crate::telemetry::metrics::{Metrics, RuleCounters, RuleTotals};

/// One rule's stats.
struct RuleStat {
    /// `ratelimit.service.rate_limit.<domain>.<rule>.<counter>`, sanitized, in the order of
    /// [`RuleCounters::REFERENCE`].
    names: [String; 6],
    /// The id of the counters `sent` and `read` are of; `None` while the rule has none.
    counters: Option<u64>,
    /// What the server has been sent of those counters.
    sent: RuleTotals,
    /// What the last flush read of them, sent once that flush is delivered.
    read: RuleTotals,
    /// Counts of counters a reload removed, not yet delivered.
    owed: RuleTotals,
}

/// Every rule's stats, by domain and rule label.
#[derive(Default)]
pub struct RuleStats {
    rules: HashMap<Box<str>, HashMap<Box<str>, RuleStat>>,
}

impl RuleStats {
    /// Reads every rule's counters and adds to `out` the lines of what changed since the last delivered
    /// flush, the last counts of removed counters included.
    pub fn lines(&mut self, metrics: &Metrics, format: &Format, out: &mut Vec<String>) {
        for (domain, rule, id, totals) in metrics.take_retired() {
            let stat = self.stat(&domain, &rule);
            let base = if stat.counters == Some(id) {
                stat.counters = None;
                std::mem::take(&mut stat.sent)
            } else {
                RuleTotals::default()
            };
            stat.read = RuleTotals::default();
            for ((owed, now), sent) in stat.owed.iter_mut().zip(totals).zip(base) {
                *owed = owed.saturating_add(now.saturating_sub(sent));
            }
        }
        metrics.for_each_rule(|domain, rule, id, totals| {
            let stat = self.stat(domain, rule);
            if stat.counters != Some(id) {
                stat.counters = Some(id);
                stat.sent = RuleTotals::default();
            }
            stat.read = totals;
        });
        for stat in self.rules.values().flat_map(HashMap::values) {
            let changes = stat.read.iter().zip(stat.sent).zip(stat.owed);
            for (name, ((now, sent), owed)) in stat.names.iter().zip(changes) {
                let delta = now.saturating_sub(sent).saturating_add(owed);
                if delta > 0 {
                    let mut line = String::with_capacity(name.len() + 16);
                    format.line(&mut line, name, &delta.to_string(), "c", None);
                    out.push(line);
                }
            }
        }
    }

    /// What the last flush read has been delivered; the stats of rules without counters go.
    pub fn delivered(&mut self) {
        for rules in self.rules.values_mut() {
            for stat in rules.values_mut() {
                stat.sent = stat.read;
                stat.owed = RuleTotals::default();
            }
            rules.retain(|_, stat| stat.counters.is_some());
        }
        self.rules.retain(|_, rules| !rules.is_empty());
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
            counters: None,
            sent: RuleTotals::default(),
            read: RuleTotals::default(),
            owed: RuleTotals::default(),
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
