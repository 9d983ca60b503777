//! Prometheus metrics: counters, gauges and histograms in the text exposition format, with the names
//! operators of the reference service already alert on.
//!
//! Labels are bounded by the rules: a rule label is a rule's path, never a raw request value unless the
//! rule asks for it (`detailed_metric`, `value_to_metric`), and sensitive values arrive here hashed.
//! This module imports nothing of the service: callers pass plain names and numbers.

use std::{
    borrow::Cow,
    collections::{BTreeMap, HashMap},
    fmt::Write,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, OnceLock, RwLock,
    },
    time::Duration,
};

/// Buckets of the check and backend latency histograms, in seconds.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// A series' labels, in the order they are rendered.
pub type Labels = Vec<(&'static str, String)>;

/// A histogram with fixed buckets, which also keeps the sum of each bucket's observations, so that a
/// statsd timer can be told each bucket's mean.
#[derive(Debug)]
pub struct Histogram {
    buckets: Vec<AtomicU64>,
    /// Sum of each bucket's observations, in nanoseconds.
    bucket_sums_ns: Vec<AtomicU64>,
    count: AtomicU64,
    /// Sum in nanoseconds.
    sum_ns: AtomicU64,
}

/// What a [`Histogram`] holds at one moment: per bucket, then past the last bound, how many
/// observations and their sum in nanoseconds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HistogramSnapshot {
    pub buckets: Vec<(u64, u64)>,
}

impl Histogram {
    fn new() -> Self {
        let zeros = || LATENCY_BUCKETS.iter().map(|_| AtomicU64::new(0)).collect();
        Self {
            buckets: zeros(),
            bucket_sums_ns: zeros(),
            count: AtomicU64::new(0),
            sum_ns: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        if let Some(i) = LATENCY_BUCKETS.iter().position(|b| secs <= *b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
            self.bucket_sums_ns[i].fetch_add(nanos, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(nanos, Ordering::Relaxed);
    }

    /// The counts and sums now. Read while observations go on, a bucket's count and sum may be one
    /// observation apart.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut buckets: Vec<(u64, u64)> = self
            .buckets
            .iter()
            .zip(&self.bucket_sums_ns)
            .map(|(n, sum)| (n.load(Ordering::Relaxed), sum.load(Ordering::Relaxed)))
            .collect();
        let (within, within_sum) = buckets.iter().fold((0u64, 0u64), |(n, s), (bn, bs)| {
            (n + bn, s.saturating_add(*bs))
        });
        let count = self.count.load(Ordering::Relaxed);
        let sum = self.sum_ns.load(Ordering::Relaxed);
        buckets.push((count.saturating_sub(within), sum.saturating_sub(within_sum)));
        HistogramSnapshot { buckets }
    }
}

/// A value read when metrics are rendered (gauges and counters kept elsewhere).
pub type Reading = Box<dyn Fn() -> Vec<(Labels, f64)> + Send + Sync>;

struct Family {
    help: &'static str,
    kind: &'static str,
    counters: RwLock<BTreeMap<Labels, Arc<AtomicU64>>>,
    histograms: RwLock<BTreeMap<Labels, Arc<Histogram>>>,
    readings: Vec<Reading>,
}

/// The reference service's per-rule counters of one `(domain, rule)`, updated without any lookup once held.
#[derive(Debug, Default)]
pub struct RuleCounters {
    pub total_hits: AtomicU64,
    pub within_limit: AtomicU64,
    pub near_limit: AtomicU64,
    pub over_limit: AtomicU64,
    pub shadow_mode: AtomicU64,
    pub over_limit_with_local_cache: AtomicU64,
    /// Descriptors (not hits) found over the limit: `rate_limit_exceeded_total`.
    pub exceeded: AtomicU64,
}

/// A rule's counters, held beside the rule once found (the rules tree keeps one per rule), so that
/// recording under the rule looks nothing up. Each holds them for one owner only, the limiter that found
/// them (its metrics and its way of naming rules): another owner finds its own.
#[derive(Debug, Default, Clone)]
pub struct HeldCounters(OnceLock<(u64, Arc<RuleCounters>)>);

impl HeldCounters {
    /// A number for an owner of held counters, unique in this process.
    pub fn new_owner() -> u64 {
        static OWNERS: AtomicU64 = AtomicU64::new(1);
        OWNERS.fetch_add(1, Ordering::Relaxed)
    }

    /// The counters held for `owner`, if it has found them.
    pub fn get(&self, owner: u64) -> Option<&RuleCounters> {
        self.0
            .get()
            .filter(|(held_for, _)| *held_for == owner)
            .map(|(_, counters)| &**counters)
    }

    /// Holds `counters` for `owner`, unless some are held already.
    pub fn hold(&self, owner: u64, counters: Arc<RuleCounters>) {
        let _ = self.0.set((owner, counters));
    }
}

/// Reads one counter of a [`RuleCounters`].
type RuleField = fn(&RuleCounters) -> &AtomicU64;

/// Names and help of the per-rule families, in the order they are rendered.
const RULE_FAMILIES: &[(&str, &str, RuleField)] = &[
    (
        "ratelimit_service_rate_limit_total_hits",
        "Hits asked of each rule.",
        |c| &c.total_hits,
    ),
    (
        "ratelimit_service_rate_limit_within_limit",
        "Hits within each rule's limit.",
        |c| &c.within_limit,
    ),
    (
        "ratelimit_service_rate_limit_near_limit",
        "Hits within the limit but above near_limit_ratio of it.",
        |c| &c.near_limit,
    ),
    (
        "ratelimit_service_rate_limit_over_limit",
        "Hits over each rule's limit.",
        |c| &c.over_limit,
    ),
    (
        "ratelimit_service_rate_limit_shadow_mode",
        "Hits over the limit of a shadow-mode rule (answered OK).",
        |c| &c.shadow_mode,
    ),
    (
        "ratelimit_service_rate_limit_over_limit_with_local_cache",
        "Hits answered over the limit from the local deny cache, without asking the store.",
        |c| &c.over_limit_with_local_cache,
    ),
    (
        "rate_limit_exceeded_total",
        "Descriptors found over their rule's limit.",
        |c| &c.exceeded,
    ),
];

/// The counters of one domain's rules, by rule label.
type DomainRules = HashMap<Box<str>, Arc<RuleCounters>>;

/// How many labels made of request values each (domain, rule as written) has.
type ValueLabels = HashMap<(Box<str>, Box<str>), usize>;

/// Every metric of the process.
pub struct Metrics {
    families: RwLock<BTreeMap<&'static str, Family>>,
    /// Per-rule counters by domain, then rule: looked up with borrowed names, nothing built.
    rules: RwLock<HashMap<Box<str>, DomainRules>>,
    /// Labels made of request values, counted per rule (see [`Metrics::rule_within`]).
    value_labels: std::sync::Mutex<ValueLabels>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let m = Self {
            families: RwLock::new(BTreeMap::new()),
            rules: RwLock::new(HashMap::new()),
            value_labels: std::sync::Mutex::new(HashMap::new()),
        };
        m.gauge_fn(
            "ratelimitd_build_info",
            "Build information; the value is always 1.",
            Box::new(|| {
                vec![(
                    vec![("version", env!("CARGO_PKG_VERSION").to_string())],
                    1.0,
                )]
            }),
        );
        m
    }

    /// Creates the family on first use (a read lock only, once it exists).
    fn family(&self, name: &'static str, help: &'static str, kind: &'static str) {
        if self
            .families
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(name)
        {
            return;
        }
        let mut families = self.families.write().unwrap_or_else(|p| p.into_inner());
        families.entry(name).or_insert_with(|| Family {
            help,
            kind,
            counters: RwLock::new(BTreeMap::new()),
            histograms: RwLock::new(BTreeMap::new()),
            readings: Vec::new(),
        });
    }

    /// The counters of a rule label made of request values: created on first use while the rule
    /// `written` has fewer than `max` such labels in `domain`; past that, the counters of the one label
    /// `<written> (other values)`. Callers choose request values, so they must not choose how many
    /// series there are.
    pub fn rule_within(
        &self,
        domain: &str,
        label: &str,
        written: &str,
        max: usize,
    ) -> Arc<RuleCounters> {
        if let Some(c) = self.existing_rule(domain, label) {
            return c;
        }
        self.rule(domain, &self.admit_label(domain, label, written, max))
    }

    /// The label [`Metrics::rule_within`] counts a rule label made of request values under: `label`
    /// while it is admitted (its counters then exist), else `<written> (other values)`. Every series
    /// about a rule labels it so, whichever protocol counted it.
    pub fn rule_label_within<'a>(
        &self,
        domain: &str,
        label: &'a str,
        written: &str,
        max: usize,
    ) -> Cow<'a, str> {
        if self.existing_rule(domain, label).is_some() {
            return Cow::Borrowed(label);
        }
        let admitted = self.admit_label(domain, label, written, max);
        self.rule(domain, &admitted);
        admitted
    }

    fn existing_rule(&self, domain: &str, label: &str) -> Option<Arc<RuleCounters>> {
        self.rules
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(domain)
            .and_then(|rules| rules.get(label))
            .cloned()
    }

    /// A label not seen yet: itself while `written` has fewer than `max` labels, else the one for
    /// the rest.
    fn admit_label<'a>(
        &self,
        domain: &str,
        label: &'a str,
        written: &str,
        max: usize,
    ) -> Cow<'a, str> {
        let mut counts = self.value_labels.lock().unwrap_or_else(|p| p.into_inner());
        let count = counts.entry((domain.into(), written.into())).or_insert(0);
        if *count < max {
            *count += 1;
            Cow::Borrowed(label)
        } else {
            Cow::Owned(format!("{written} (other values)"))
        }
    }

    /// The counters of one rule; created on first use.
    pub fn rule(&self, domain: &str, rule: &str) -> Arc<RuleCounters> {
        if let Some(c) = self
            .rules
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(domain)
            .and_then(|rules| rules.get(rule))
        {
            return c.clone();
        }
        self.rules
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .entry(domain.into())
            .or_default()
            .entry(rule.into())
            .or_default()
            .clone()
    }

    /// A counter series to add to without any lookup; it is exported from now on, at 0 until used.
    pub fn counter(
        &self,
        name: &'static str,
        help: &'static str,
        labels: Labels,
    ) -> Arc<AtomicU64> {
        self.family(name, help, "counter");
        let families = self.families.read().unwrap_or_else(|p| p.into_inner());
        match families.get(name) {
            Some(family) => series(&family.counters, labels, Arc::default),
            None => Arc::default(),
        }
    }

    /// A histogram series to observe without any lookup.
    pub fn histogram(
        &self,
        name: &'static str,
        help: &'static str,
        labels: Labels,
    ) -> Arc<Histogram> {
        self.family(name, help, "histogram");
        let families = self.families.read().unwrap_or_else(|p| p.into_inner());
        match families.get(name) {
            Some(family) => series(&family.histograms, labels, || Arc::new(Histogram::new())),
            None => Arc::new(Histogram::new()),
        }
    }

    /// Adds `by` to a counter, creating its series on first use.
    pub fn count(&self, name: &'static str, help: &'static str, labels: Labels, by: u64) {
        if by > 0 {
            self.counter(name, help, labels)
                .fetch_add(by, Ordering::Relaxed);
        }
    }

    /// A gauge whose values are read at render time.
    pub fn gauge_fn(&self, name: &'static str, help: &'static str, read: Reading) {
        self.reading(name, help, "gauge", read);
    }

    /// A counter kept elsewhere, read at render time.
    pub fn counter_fn(&self, name: &'static str, help: &'static str, read: Reading) {
        self.reading(name, help, "counter", read);
    }

    fn reading(&self, name: &'static str, help: &'static str, kind: &'static str, read: Reading) {
        self.family(name, help, kind);
        let mut families = self.families.write().unwrap_or_else(|p| p.into_inner());
        if let Some(family) = families.get_mut(name) {
            family.readings.push(read);
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        {
            let rules = self.rules.read().unwrap_or_else(|p| p.into_inner());
            let mut sorted: Vec<(&str, &str, &RuleCounters)> = rules
                .iter()
                .flat_map(|(domain, rules)| {
                    rules
                        .iter()
                        .map(move |(rule, c)| (&**domain, &**rule, c.as_ref()))
                })
                .collect();
            sorted.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
            for (name, help, field) in RULE_FAMILIES {
                let _ = writeln!(out, "# HELP {name} {help}");
                let _ = writeln!(out, "# TYPE {name} counter");
                for (domain, rule, counters) in &sorted {
                    let value = field(counters).load(Ordering::Relaxed);
                    if value > 0 {
                        let labels = [("domain", domain.to_string()), ("rule", rule.to_string())];
                        let _ = writeln!(out, "{name}{} {value}", render_labels(&labels, None));
                    }
                }
            }
        }
        let families = self.families.read().unwrap_or_else(|p| p.into_inner());
        for (name, family) in families.iter() {
            let _ = writeln!(out, "# HELP {name} {}", family.help);
            let _ = writeln!(out, "# TYPE {name} {}", family.kind);
            for (labels, value) in family
                .counters
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
            {
                let _ = writeln!(
                    out,
                    "{name}{} {}",
                    render_labels(labels, None),
                    value.load(Ordering::Relaxed)
                );
            }
            for read in &family.readings {
                for (labels, value) in read() {
                    let _ = writeln!(out, "{name}{} {value}", render_labels(&labels, None));
                }
            }
            for (labels, h) in family
                .histograms
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
            {
                let mut cumulative = 0;
                for (bound, bucket) in LATENCY_BUCKETS.iter().zip(&h.buckets) {
                    cumulative += bucket.load(Ordering::Relaxed);
                    let le = bound.to_string();
                    let _ = writeln!(
                        out,
                        "{name}_bucket{} {cumulative}",
                        render_labels(labels, Some(&le))
                    );
                }
                let count = h.count.load(Ordering::Relaxed);
                let _ = writeln!(
                    out,
                    "{name}_bucket{} {count}",
                    render_labels(labels, Some("+Inf"))
                );
                let sum = h.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
                let _ = writeln!(out, "{name}_sum{} {sum}", render_labels(labels, None));
                let _ = writeln!(out, "{name}_count{} {count}", render_labels(labels, None));
            }
        }
        out
    }
}

/// The reference service's per-rule counters of one `(domain, rule)`, read at one moment, in the order
/// of [`RuleCounters::REFERENCE`].
pub type RuleTotals = [u64; 6];

impl RuleCounters {
    /// The reference's names of the per-rule counters, in the order of [`RuleTotals`].
    pub const REFERENCE: [&'static str; 6] = [
        "total_hits",
        "over_limit",
        "near_limit",
        "within_limit",
        "shadow_mode",
        "over_limit_with_local_cache",
    ];

    fn totals(&self) -> RuleTotals {
        [
            &self.total_hits,
            &self.over_limit,
            &self.near_limit,
            &self.within_limit,
            &self.shadow_mode,
            &self.over_limit_with_local_cache,
        ]
        .map(|c| c.load(Ordering::Relaxed))
    }
}

impl Metrics {
    /// Calls `f` with every rule's counters now: its domain, its rule label and the totals.
    pub fn for_each_rule(&self, mut f: impl FnMut(&str, &str, RuleTotals)) {
        let rules = self.rules.read().unwrap_or_else(|p| p.into_inner());
        for (domain, rules) in rules.iter() {
            for (rule, counters) in rules {
                f(domain, rule, counters.totals());
            }
        }
    }

    /// The series of the counter family `name` now (counted here or read from elsewhere), by labels.
    pub fn counter_values(&self, name: &str) -> Vec<(Labels, u64)> {
        let families = self.families.read().unwrap_or_else(|p| p.into_inner());
        let Some(family) = families.get(name) else {
            return Vec::new();
        };
        let counted = family
            .counters
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(labels, value)| (labels.clone(), value.load(Ordering::Relaxed)))
            .collect::<Vec<_>>();
        let read = family
            .readings
            .iter()
            .flat_map(|read| read())
            .map(|(labels, value)| (labels, value as u64));
        counted.into_iter().chain(read).collect()
    }

    /// The series of the histogram family `name` now, by labels.
    pub fn histogram_values(&self, name: &str) -> Vec<(Labels, HistogramSnapshot)> {
        let families = self.families.read().unwrap_or_else(|p| p.into_inner());
        let Some(family) = families.get(name) else {
            return Vec::new();
        };
        let histograms = family.histograms.read().unwrap_or_else(|p| p.into_inner());
        histograms
            .iter()
            .map(|(labels, h)| (labels.clone(), h.snapshot()))
            .collect()
    }
}

/// The series of `labels` in a family's map, created with `make` on first use.
fn series<T>(
    map: &RwLock<BTreeMap<Labels, Arc<T>>>,
    labels: Labels,
    make: impl FnOnce() -> Arc<T>,
) -> Arc<T> {
    if let Some(existing) = map.read().unwrap_or_else(|p| p.into_inner()).get(&labels) {
        return existing.clone();
    }
    map.write()
        .unwrap_or_else(|p| p.into_inner())
        .entry(labels)
        .or_insert_with(make)
        .clone()
}

fn render_labels(labels: &[(&'static str, String)], le: Option<&str>) -> String {
    if labels.is_empty() && le.is_none() {
        return String::new();
    }
    let mut out = String::from("{");
    let mut first = true;
    let all = labels
        .iter()
        .map(|(k, v)| (*k, v.as_str()))
        .chain(le.map(|le| ("le", le)));
    for (k, v) in all {
        if !first {
            out.push(',');
        }
        first = false;
        out.push_str(k);
        out.push_str("=\"");
        for c in v.chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                '"' => out.push_str("\\\""),
                '\n' => out.push_str("\\n"),
                c => out.push(c),
            }
        }
        out.push('"');
    }
    out.push('}');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_gauges_and_histograms_in_text_format() {
        let m = Metrics::new();
        let labels = || vec![("domain", "d".to_string()), ("rule", "a\"b".to_string())];
        m.count("c_total", "A counter.", labels(), 2);
        m.count("c_total", "A counter.", labels(), 3);
        m.histogram("lat_seconds", "Latency.", vec![])
            .observe(Duration::from_micros(300));
        m.gauge_fn("g", "A gauge.", Box::new(|| vec![(vec![], 1.5)]));
        let text = m.render();
        assert!(
            text.contains("# TYPE c_total counter\nc_total{domain=\"d\",rule=\"a\\\"b\"} 5\n"),
            "{text}"
        );
        assert!(
            text.contains("lat_seconds_bucket{le=\"0.00025\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains("lat_seconds_bucket{le=\"0.0005\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "lat_seconds_bucket{le=\"+Inf\"} 1\nlat_seconds_sum 0.0003\nlat_seconds_count 1\n"
            ),
            "{text}"
        );
        assert!(text.contains("# TYPE g gauge\ng 1.5\n"), "{text}");
        assert!(text.contains("ratelimitd_build_info{version="), "{text}");
    }

    #[test]
    fn snapshots_hold_each_bucket_count_and_sum_and_what_passed_the_last_bound() {
        let m = Metrics::new();
        let h = m.histogram("t_seconds", "T.", vec![]);
        for micros in [50, 80, 300, 2_000_000] {
            h.observe(Duration::from_micros(micros));
        }
        let buckets = h.snapshot().buckets;
        assert_eq!(buckets.len(), LATENCY_BUCKETS.len() + 1);
        assert_eq!(buckets[0], (2, 130_000), "0.1 ms: two calls, 130 us");
        assert_eq!(buckets[2], (1, 300_000), "0.5 ms: one call");
        assert_eq!(
            buckets[LATENCY_BUCKETS.len()],
            (1, 2_000_000_000),
            "past 1 s"
        );
        assert_eq!(buckets.iter().map(|b| b.0).sum::<u64>(), 4);
        assert_eq!(m.histogram_values("t_seconds")[0].1.buckets, buckets);
    }
}
