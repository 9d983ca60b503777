//! Prometheus metrics: counters, gauges and histograms in the text exposition format, with the names
//! operators of the reference service already alert on.
//!
//! Labels are bounded by the rules: a rule label is a rule's path, never a raw request value unless the
//! rule asks for it (`detailed_metric`, `value_to_metric`), and sensitive values arrive here hashed.
//! This module imports nothing of the service: callers pass plain names and numbers.
//!
//! The series every request updates (histograms, per-rule counters, [`StripedCounter`]) are striped:
//! each thread adds to its own stripe, on its own cache lines, and rendering sums the stripes. Threads on
//! different cores then never write one line, which a shared atomic makes them do on every request.

use std::{
    borrow::Cow,
    collections::{BTreeMap, HashMap, HashSet},
    fmt::Write,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
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

/// How many stripes a hot series has. Threads take stripes in turn as they first add to one, so up to
/// this many threads (a runtime's workers, one per core) each write their own.
const STRIPES: usize = 8;

/// One stripe's values, alone on its cache lines (128 bytes: x86 fetches lines in pairs).
#[derive(Debug)]
#[repr(align(128))]
struct Line<const N: usize>([AtomicU64; N]);

/// `N` values kept in [`STRIPES`] stripes.
#[derive(Debug)]
struct Striped<const N: usize>([Line<N>; STRIPES]);

impl<const N: usize> Default for Striped<N> {
    fn default() -> Self {
        Self(std::array::from_fn(|_| {
            Line(std::array::from_fn(|_| AtomicU64::new(0)))
        }))
    }
}

impl<const N: usize> Striped<N> {
    /// The values of the calling thread's stripe.
    fn mine(&self) -> &[AtomicU64; N] {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        thread_local! {
            static STRIPE: usize = NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES;
        }
        &self.0[STRIPE.with(|s| *s)].0
    }

    /// Adds `by` to value `i`, which stops at `u64::MAX` rather than wrap: a caller's `hits_addend`
    /// near 2^64 must not turn a rule's hit counters back (statsd would then report nothing for it).
    fn add(&self, i: usize, by: u64) {
        let value = &self.mine()[i];
        if value
            .fetch_add(by, Ordering::Relaxed)
            .checked_add(by)
            .is_none()
        {
            value.store(u64::MAX, Ordering::Relaxed);
        }
    }

    /// Value `i` summed over the stripes, at most `u64::MAX`.
    fn sum(&self, i: usize) -> u64 {
        self.0.iter().fold(0u64, |sum, line| {
            sum.saturating_add(line.0[i].load(Ordering::Relaxed))
        })
    }
}

/// A counter of the request path, striped (see the module's comment).
#[derive(Debug, Default)]
pub struct StripedCounter(Striped<1>);

impl StripedCounter {
    pub fn add(&self, by: u64) {
        self.0.add(0, by);
    }

    /// The count now.
    pub fn get(&self) -> u64 {
        self.0.sum(0)
    }
}

/// How many values a histogram's stripe has: a count and a sum per bucket, the last bucket past the
/// last bound.
const HISTOGRAM_VALUES: usize = 2 * (LATENCY_BUCKETS.len() + 1);

/// A histogram with fixed buckets, which also keeps the sum of each bucket's observations, so that a
/// statsd timer can be told each bucket's mean. Its count and sum are those of the buckets, so they
/// always agree with them; striped (see the module's comment).
#[derive(Debug)]
pub struct Histogram(Striped<HISTOGRAM_VALUES>);

/// What a [`Histogram`] holds at one moment: per bucket, then past the last bound, how many
/// observations and their sum in nanoseconds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HistogramSnapshot {
    pub buckets: Vec<(u64, u64)>,
}

impl Histogram {
    fn new() -> Self {
        Self(Striped::default())
    }

    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let i = LATENCY_BUCKETS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(LATENCY_BUCKETS.len());
        let mine = self.0.mine();
        mine[2 * i].fetch_add(1, Ordering::Relaxed);
        mine[2 * i + 1].fetch_add(nanos, Ordering::Relaxed);
    }

    /// The counts and sums now. Read while observations go on, a bucket's count and sum may be one
    /// observation apart.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let buckets = (0..=LATENCY_BUCKETS.len())
            .map(|i| (self.0.sum(2 * i), self.0.sum(2 * i + 1)))
            .collect();
        HistogramSnapshot { buckets }
    }
}

/// A value read when metrics are rendered (gauges and counters kept elsewhere).
pub type Reading = Box<dyn Fn() -> Vec<(Labels, f64)> + Send + Sync>;

struct Family {
    help: &'static str,
    kind: &'static str,
    counters: RwLock<BTreeMap<Labels, Arc<AtomicU64>>>,
    striped: RwLock<BTreeMap<Labels, Arc<StripedCounter>>>,
    histograms: RwLock<BTreeMap<Labels, Arc<Histogram>>>,
    readings: Vec<Reading>,
}

/// One of a rule's counters in [`RuleCounters`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleCounter {
    TotalHits,
    WithinLimit,
    NearLimit,
    OverLimit,
    ShadowMode,
    OverLimitWithLocalCache,
    /// Descriptors (not hits) found over the limit: `rate_limit_exceeded_total`.
    Exceeded,
}

/// The reference service's per-rule counters of one `(domain, rule)`, updated without any lookup once
/// held; striped (see the module's comment). Beside them, which are exported at 0 before their first
/// event (see [`RuleCounters::seen`]).
#[derive(Debug, Default)]
pub struct RuleCounters(Striped<7>, AtomicU64);

impl RuleCounters {
    /// The counters every limited rule can move, exported from its first hit on.
    const ANY_RULE: u64 = 1 << RuleCounter::TotalHits as u64
        | 1 << RuleCounter::WithinLimit as u64
        | 1 << RuleCounter::NearLimit as u64
        | 1 << RuleCounter::OverLimit as u64
        | 1 << RuleCounter::Exceeded as u64;

    pub fn add(&self, counter: RuleCounter, by: u64) {
        self.0.add(counter as usize, by);
    }

    /// One counter now.
    pub fn get(&self, counter: RuleCounter) -> u64 {
        self.0.sum(counter as usize)
    }

    /// The rule got a hit: the counters it can move are exported from now on, at 0 until they do (a
    /// series that appeared with a rule's first denial would hide that denial from `rate()`), its
    /// shadow-mode count too when it is a shadow rule. Written once: later calls only read.
    pub fn seen(&self, shadow: bool) {
        let mut shown = Self::ANY_RULE;
        if shadow {
            shown |= 1 << RuleCounter::ShadowMode as u64;
        }
        if self.1.load(Ordering::Relaxed) & shown != shown {
            self.1.fetch_or(shown, Ordering::Relaxed);
        }
    }

    /// Whether a counter is exported: it moved, or the rule's hits make it one to watch.
    fn shown(&self, counter: RuleCounter) -> Option<u64> {
        let value = self.get(counter);
        (value > 0 || self.1.load(Ordering::Relaxed) & (1 << counter as u64) != 0).then_some(value)
    }
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

/// Names and help of the per-rule families, in the order they are rendered.
const RULE_FAMILIES: &[(&str, &str, RuleCounter)] = &[
    (
        "ratelimit_service_rate_limit_total_hits",
        "Hits asked of each rule.",
        RuleCounter::TotalHits,
    ),
    (
        "ratelimit_service_rate_limit_within_limit",
        "Hits within each rule's limit.",
        RuleCounter::WithinLimit,
    ),
    (
        "ratelimit_service_rate_limit_near_limit",
        "Hits within the limit but above near_limit_ratio of it.",
        RuleCounter::NearLimit,
    ),
    (
        "ratelimit_service_rate_limit_over_limit",
        "Hits over each rule's limit.",
        RuleCounter::OverLimit,
    ),
    (
        "ratelimit_service_rate_limit_shadow_mode",
        "Hits over the limit of a shadow-mode rule (answered OK).",
        RuleCounter::ShadowMode,
    ),
    (
        "ratelimit_service_rate_limit_over_limit_with_local_cache",
        "Hits answered over the limit from the local deny cache, without asking the store.",
        RuleCounter::OverLimitWithLocalCache,
    ),
    (
        "rate_limit_exceeded_total",
        "Descriptors found over their rule's limit.",
        RuleCounter::Exceeded,
    ),
];

/// The counters of one domain's rules, by rule label.
type DomainRules = HashMap<Box<str>, RuleSeries>;

/// A rule label's counters, and which rule they belong to, so that a reload that removes the rule
/// removes them too (see [`Metrics::serve_rules`]).
struct RuleSeries {
    counters: Arc<RuleCounters>,
    /// Which counters these are: a label removed and made again gets new ones, under a new id.
    id: u64,
    /// The rule's path as written; `None` for a label no rule owns (`override`, `runtime`).
    written: Option<Box<str>>,
    /// How the label carries request values (`detailed_metric`, `value_to_metric`, hashed or not): the
    /// rule's `Node::label_form` when the label was made; 0 when it carries none.
    form: u64,
}

/// The rules served, as the per-rule metrics know them: by domain, each rule's path as written, and how
/// its labels carry request values (`Node::label_form`: 0 not at all; [`ANY_FORM`] when two rules
/// written alike carry them differently).
pub type ServedRules = HashMap<Box<str>, HashMap<Box<str>, u64>>;

/// See [`ServedRules`].
pub const ANY_FORM: u64 = u64::MAX;

/// The form of two rules written alike (`a` + `b_c`, `a_b` + `c`), either of which may make a label.
pub fn either_form(a: u64, b: u64) -> u64 {
    match (a, b) {
        (0, form) | (form, 0) => form,
        (a, b) if a == b => a,
        _ => ANY_FORM,
    }
}

/// The per-rule counters, and the rules they may be made for.
#[derive(Default)]
struct RuleTable {
    by_domain: HashMap<Box<str>, DomainRules>,
    /// `None` until the first rules are served.
    served: Option<ServedRules>,
}

impl RuleTable {
    /// Whether the rules served have the rule written `written` in `domain` (`None`: a label no rule
    /// owns, always), and, for a label carrying request values in the form `form`, whether that rule
    /// asks for them so.
    fn serves(&self, domain: &str, written: Option<&str>, form: u64) -> bool {
        serves(self.served.as_ref(), domain, written, form)
    }
}

/// [`RuleTable::serves`], of the rules `served` (`None`: none loaded yet, every rule).
fn serves(served: Option<&ServedRules>, domain: &str, written: Option<&str>, form: u64) -> bool {
    let (Some(served), Some(written)) = (served, written) else {
        return true;
    };
    let takes = served.get(domain).and_then(|rules| rules.get(written));
    takes.is_some_and(|&takes| form == 0 || takes == form || takes == ANY_FORM)
}

/// The counters of a rule label a reload removed, kept for statsd to read once more (see
/// [`Metrics::take_retired`]).
struct Retired {
    domain: Box<str>,
    label: Box<str>,
    id: u64,
    counters: Arc<RuleCounters>,
}

/// How many labels made of request values each (domain, rule as written) has, and their bytes.
type ValueLabels = HashMap<(Box<str>, Box<str>), (usize, usize)>;

/// The bytes of request values a rule's labels may hold on average: a rule written `w` allowed `max`
/// such labels takes them while they hold at most `max` times (this + the length of `w`) bytes, so that
/// long values (a caller's kilobyte headers) cannot make every scrape megabytes long.
pub const VALUE_LABEL_BYTES: usize = 128;

/// Every metric of the process.
pub struct Metrics {
    families: RwLock<BTreeMap<&'static str, Family>>,
    /// Per-rule counters by domain, then rule: looked up with borrowed names, nothing built.
    rules: RwLock<RuleTable>,
    /// Labels made of request values, counted per rule (see [`Metrics::rule_within`]).
    value_labels: std::sync::Mutex<ValueLabels>,
    /// Counters of removed labels, while a reader wants them (see [`Metrics::keep_retired`]).
    retired: std::sync::Mutex<Vec<Retired>>,
    keep_retired: std::sync::atomic::AtomicBool,
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
            rules: RwLock::new(RuleTable::default()),
            value_labels: std::sync::Mutex::new(HashMap::new()),
            retired: std::sync::Mutex::new(Vec::new()),
            keep_retired: std::sync::atomic::AtomicBool::new(false),
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
            striped: RwLock::new(BTreeMap::new()),
            histograms: RwLock::new(BTreeMap::new()),
            readings: Vec::new(),
        });
    }

    /// The counters of a rule label made of request values: created on first use while the rule
    /// `written` has fewer than `max` such labels in `domain`, holding [`VALUE_LABEL_BYTES`] on average;
    /// past that, the counters of the one label `<written> (other values)`. Callers choose request
    /// values, so they must not choose how many series there are, nor how long.
    /// `form` is how the label carries them (the rule's `Node::label_form`).
    pub fn rule_within(
        &self,
        domain: &str,
        label: &str,
        written: &str,
        form: u64,
        max: usize,
    ) -> Arc<RuleCounters> {
        self.value_label(domain, label, written, form, max).1
    }

    /// The label [`Metrics::rule_within`] counts a rule label made of request values under: `label`
    /// while it is admitted (its counters then exist), else `<written> (other values)`. Every series
    /// about a rule labels it so, whichever protocol counted it.
    pub fn rule_label_within<'a>(
        &self,
        domain: &str,
        label: &'a str,
        written: &str,
        form: u64,
        max: usize,
    ) -> Cow<'a, str> {
        self.value_label(domain, label, written, form, max).0
    }

    /// The label of request values `label` is counted under, and its counters: those it has, else
    /// made while its rule is served so (see [`Metrics::rule_within`]; counted nowhere otherwise).
    fn value_label<'a>(
        &self,
        domain: &str,
        label: &'a str,
        written: &str,
        form: u64,
        max: usize,
    ) -> (Cow<'a, str>, Arc<RuleCounters>) {
        if let Some(c) = self.existing_rule(domain, label) {
            return (Cow::Borrowed(label), c);
        }
        if !self.serves(domain, written, form) {
            return (Cow::Borrowed(label), Arc::default());
        }
        let admitted = self.admit_label(domain, label, written, max);
        let (admitted, counters) = self.add_admitted(domain, admitted, written, form);
        (admitted, counters.unwrap_or_default())
    }

    /// Makes the label [`Metrics::admit_label`] admitted; when the rules served no longer take it (a
    /// reload came between), gives back the room it took.
    fn add_admitted<'a>(
        &self,
        domain: &str,
        admitted: Cow<'a, str>,
        written: &str,
        form: u64,
    ) -> (Cow<'a, str>, Option<Arc<RuleCounters>>) {
        let counters = self.add_rule(domain, &admitted, Some(written), form);
        // Only a label admitted as itself took room; the one for the rest takes none.
        if let (None, Cow::Borrowed(label)) = (&counters, &admitted) {
            let mut counts = self.value_labels.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((count, bytes)) = counts.get_mut(&(domain.into(), written.into())) {
                *count = count.saturating_sub(1);
                *bytes = bytes.saturating_sub(label.len());
            }
        }
        (admitted, counters)
    }

    fn existing_rule(&self, domain: &str, label: &str) -> Option<Arc<RuleCounters>> {
        self.rules
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .by_domain
            .get(domain)
            .and_then(|rules| rules.get(label))
            .map(|series| series.counters.clone())
    }

    /// Whether the rules served still ask for labels of request values of the rule `written`, in the
    /// form `form`.
    fn serves(&self, domain: &str, written: &str, form: u64) -> bool {
        let rules = self.rules.read().unwrap_or_else(|p| p.into_inner());
        rules.serves(domain, Some(written), form)
    }

    /// A label not seen yet: itself while `written` has fewer than `max` labels and room for its bytes,
    /// else the one for the rest.
    fn admit_label<'a>(
        &self,
        domain: &str,
        label: &'a str,
        written: &str,
        max: usize,
    ) -> Cow<'a, str> {
        let mut counts = self.value_labels.lock().unwrap_or_else(|p| p.into_inner());
        let (count, bytes) = counts
            .entry((domain.into(), written.into()))
            .or_insert((0, 0));
        let room = max.saturating_mul(written.len() + VALUE_LABEL_BYTES);
        if *count < max && *bytes + label.len() <= room {
            *count += 1;
            *bytes += label.len();
            Cow::Borrowed(label)
        } else {
            Cow::Owned(format!("{written} (other values)"))
        }
    }

    /// The counters of the rule label `label`, which takes no request values; created on first use.
    /// `written` is the rule's path as written, `None` for a label no rule owns (`override`,
    /// `runtime`), which no reload removes.
    pub fn rule(&self, domain: &str, label: &str, written: Option<&str>) -> Arc<RuleCounters> {
        match self.existing_rule(domain, label) {
            Some(c) => c,
            None => self.add_rule(domain, label, written, 0).unwrap_or_default(),
        }
    }

    fn add_rule(
        &self,
        domain: &str,
        label: &str,
        written: Option<&str>,
        form: u64,
    ) -> Option<Arc<RuleCounters>> {
        static IDS: AtomicU64 = AtomicU64::new(1);
        let mut rules = self.rules.write().unwrap_or_else(|p| p.into_inner());
        // A request decided on the rules before a reload, recorded after it: counted nowhere.
        if !rules.serves(domain, written, form) {
            return None;
        }
        let counters = rules
            .by_domain
            .entry(domain.into())
            .or_default()
            .entry(label.into())
            .or_insert_with(|| RuleSeries {
                counters: Arc::default(),
                id: IDS.fetch_add(1, Ordering::Relaxed),
                written: written.map(Into::into),
                form,
            })
            .counters
            .clone();
        Some(counters)
    }

    /// The rules served from now on (at every load that changes them): the labels of rules they no
    /// longer have go, with what counted their labels of request values, and so do the labels carrying
    /// request values of a rule that no longer asks for them, or asks for them otherwise (hashed now);
    /// nor are such labels made again, when a request decided on the rules before records after.
    /// Labels no rule owns stay.
    pub fn serve_rules(&self, served: ServedRules) {
        let keep_retired = self.keep_retired.load(Ordering::Relaxed);
        let mut retired = Vec::new();
        // Rules whose labels of request values went: what counted them starts again.
        let mut recounted: HashSet<(Box<str>, Box<str>)> = HashSet::new();
        let mut rules = self.rules.write().unwrap_or_else(|p| p.into_inner());
        let RuleTable {
            by_domain,
            served: now,
        } = &mut *rules;
        let served = now.insert(served);
        for (domain, labels) in by_domain.iter_mut() {
            labels.retain(|label, series| {
                let written = series.written.as_deref();
                let keep = serves(Some(served), domain, written, series.form);
                if !keep && series.form != 0 {
                    if let Some(written) = written {
                        recounted.insert((domain.clone(), written.into()));
                    }
                }
                if !keep && keep_retired {
                    retired.push(Retired {
                        domain: domain.clone(),
                        label: label.clone(),
                        id: series.id,
                        counters: series.counters.clone(),
                    });
                }
                keep
            });
        }
        by_domain.retain(|_, labels| !labels.is_empty());
        // Under the rules' lock, which no holder of this one ever waits for.
        self.value_labels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(domain, written), _| {
                let takes = served.get(domain).and_then(|rules| rules.get(written));
                takes.is_some_and(|&form| form != 0)
                    && !recounted.contains(&(domain.clone(), written.clone()))
            });
        drop(rules);
        if keep_retired {
            self.retired
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend(retired);
        }
    }

    /// Keeps the counters of the labels a reload removes until [`Metrics::take_retired`] takes them:
    /// statsd, which sends what changed since its last flush, owes their last counts.
    pub fn keep_retired(&self) {
        self.keep_retired.store(true, Ordering::Relaxed);
    }

    /// The counters of the labels removed since the last call: each one's domain, label, id (see
    /// [`Metrics::for_each_rule`]) and totals now.
    pub fn take_retired(&self) -> Vec<(Box<str>, Box<str>, u64, RuleTotals)> {
        let retired = std::mem::take(&mut *self.retired.lock().unwrap_or_else(|p| p.into_inner()));
        retired
            .into_iter()
            .map(|r| (r.domain, r.label, r.id, r.counters.totals()))
            .collect()
    }

    /// A counter series to add to without any lookup; it is exported from now on, at 0 until used.
    pub fn counter(
        &self,
        name: &'static str,
        help: &'static str,
        labels: Labels,
    ) -> Arc<AtomicU64> {
        self.series_of(name, help, "counter", |f| &f.counters, labels, Arc::default)
    }

    /// A counter series of the request path (striped, see the module's comment), to add to without any
    /// lookup; it is exported from now on, at 0 until used.
    pub fn striped_counter(
        &self,
        name: &'static str,
        help: &'static str,
        labels: Labels,
    ) -> Arc<StripedCounter> {
        self.series_of(name, help, "counter", |f| &f.striped, labels, Arc::default)
    }

    /// A histogram series to observe without any lookup.
    pub fn histogram(
        &self,
        name: &'static str,
        help: &'static str,
        labels: Labels,
    ) -> Arc<Histogram> {
        let make = || Arc::new(Histogram::new());
        self.series_of(name, help, "histogram", |f| &f.histograms, labels, make)
    }

    /// The series of `labels` in the family `name` (registered as `kind` on first use), in the map of
    /// the family `pick` chooses, made with `make` when new.
    fn series_of<T>(
        &self,
        name: &'static str,
        help: &'static str,
        kind: &'static str,
        pick: impl FnOnce(&Family) -> &RwLock<BTreeMap<Labels, Arc<T>>>,
        labels: Labels,
        make: impl FnOnce() -> Arc<T>,
    ) -> Arc<T> {
        self.family(name, help, kind);
        let families = self.families.read().unwrap_or_else(|p| p.into_inner());
        match families.get(name) {
            Some(family) => series(pick(family), labels, make),
            None => make(),
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
            // Copied out under the lock and sorted after it: a rule's first hit, which takes the lock
            // to add the rule, does not wait for a whole rendering.
            let mut sorted: Vec<(Box<str>, Box<str>, Arc<RuleCounters>)> = self
                .rules
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .by_domain
                .iter()
                .flat_map(|(domain, rules)| {
                    rules.iter().map(move |(rule, series)| {
                        (domain.clone(), rule.clone(), series.counters.clone())
                    })
                })
                .collect();
            sorted.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
            for (name, help, counter) in RULE_FAMILIES {
                let _ = writeln!(out, "# HELP {name} {help}");
                let _ = writeln!(out, "# TYPE {name} counter");
                for (domain, rule, counters) in &sorted {
                    let Some(value) = counters.shown(*counter) else {
                        continue;
                    };
                    let labels = [("domain", domain.to_string()), ("rule", rule.to_string())];
                    let _ = writeln!(out, "{name}{} {value}", render_labels(&labels, None));
                }
            }
        }
        let families = self.families.read().unwrap_or_else(|p| p.into_inner());
        for (name, family) in families.iter() {
            let _ = writeln!(out, "# HELP {name} {}", family.help);
            let _ = writeln!(out, "# TYPE {name} {}", family.kind);
            for (labels, value) in family.counted() {
                let _ = writeln!(out, "{name}{} {value}", render_labels(&labels, None));
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
                let buckets = h.snapshot().buckets;
                let mut cumulative = 0u64;
                for (bound, (n, _)) in LATENCY_BUCKETS.iter().zip(&buckets) {
                    cumulative = cumulative.wrapping_add(*n);
                    let le = bound.to_string();
                    let _ = writeln!(
                        out,
                        "{name}_bucket{} {cumulative}",
                        render_labels(labels, Some(&le))
                    );
                }
                let (count, sum_ns) = buckets.iter().fold((0u64, 0u64), |(n, s), (bn, bs)| {
                    (n.wrapping_add(*bn), s.wrapping_add(*bs))
                });
                let _ = writeln!(
                    out,
                    "{name}_bucket{} {count}",
                    render_labels(labels, Some("+Inf"))
                );
                let sum = sum_ns as f64 / 1e9;
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
            RuleCounter::TotalHits,
            RuleCounter::OverLimit,
            RuleCounter::NearLimit,
            RuleCounter::WithinLimit,
            RuleCounter::ShadowMode,
            RuleCounter::OverLimitWithLocalCache,
        ]
        .map(|c| self.get(c))
    }
}

impl Metrics {
    /// Calls `f` with every rule's counters now: its domain, its rule label, the counters' id (a label
    /// removed by a reload and made again gets new counters, under a new id) and the totals.
    pub fn for_each_rule(&self, mut f: impl FnMut(&str, &str, u64, RuleTotals)) {
        let rules = self.rules.read().unwrap_or_else(|p| p.into_inner());
        for (domain, rules) in rules.by_domain.iter() {
            for (rule, series) in rules {
                f(domain, rule, series.id, series.counters.totals());
            }
        }
    }

    /// The series of the counter family `name` now (counted here or read from elsewhere), by labels.
    pub fn counter_values(&self, name: &str) -> Vec<(Labels, u64)> {
        let families = self.families.read().unwrap_or_else(|p| p.into_inner());
        let Some(family) = families.get(name) else {
            return Vec::new();
        };
        let counted = family.counted();
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

impl Family {
    /// The family's counter series now (plain and striped), in the order of their labels.
    fn counted(&self) -> Vec<(Labels, u64)> {
        let mut counted: Vec<(Labels, u64)> = self
            .counters
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(labels, value)| (labels.clone(), value.load(Ordering::Relaxed)))
            .collect();
        let striped = self.striped.read().unwrap_or_else(|p| p.into_inner());
        if !striped.is_empty() {
            counted.extend(
                striped
                    .iter()
                    .map(|(labels, value)| (labels.clone(), value.get())),
            );
            counted.sort_by(|a, b| a.0.cmp(&b.0));
        }
        counted
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
        m.counter("c_total", "A counter.", labels())
            .fetch_add(2, Ordering::Relaxed);
        m.counter("c_total", "A counter.", labels())
            .fetch_add(3, Ordering::Relaxed);
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

    #[test]
    fn increments_from_many_threads_at_once_sum_exactly() {
        // More threads than stripes, so that some share one.
        const THREADS: u64 = 2 * STRIPES as u64 + 3;
        const EACH: u64 = 5_000;
        let m = Metrics::new();
        let requests = m.striped_counter("r_total", "R.", vec![("result", "ok".to_string())]);
        let h = m.histogram("t_seconds", "T.", vec![]);
        let rule = m.rule("d", "key_value", Some("key_value"));
        std::thread::scope(|scope| {
            for t in 0..THREADS {
                let (requests, h, rule) = (&requests, &h, &rule);
                scope.spawn(move || {
                    for _ in 0..EACH {
                        requests.add(1);
                        rule.add(RuleCounter::TotalHits, 2);
                        rule.add(RuleCounter::WithinLimit, 1);
                        // Half the threads in the first bucket, half past the last bound.
                        h.observe(Duration::from_micros(if t % 2 == 0 {
                            50
                        } else {
                            2_000_000
                        }));
                    }
                });
            }
        });
        let n = THREADS * EACH;
        let text = m.render();
        assert!(
            text.contains(&format!("r_total{{result=\"ok\"}} {n}\n")),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "ratelimit_service_rate_limit_total_hits{{domain=\"d\",rule=\"key_value\"}} {}\n",
                2 * n
            )),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "ratelimit_service_rate_limit_within_limit{{domain=\"d\",rule=\"key_value\"}} {n}\n"
            )),
            "{text}"
        );
        let first = THREADS.div_ceil(2) * EACH;
        assert!(
            text.contains(&format!("t_seconds_bucket{{le=\"0.0001\"}} {first}\n")),
            "{text}"
        );
        assert!(
            text.contains(&format!("t_seconds_bucket{{le=\"1\"}} {first}\n")),
            "{text}"
        );
        assert!(
            text.contains(&format!("t_seconds_bucket{{le=\"+Inf\"}} {n}\n")),
            "{text}"
        );
        assert!(text.contains(&format!("t_seconds_count {n}\n")), "{text}");
        let sum_ns = first * 50_000 + (n - first) * 2_000_000_000;
        assert!(
            text.contains(&format!("t_seconds_sum {}\n", sum_ns as f64 / 1e9)),
            "{text}"
        );
        assert_eq!(m.counter_values("r_total")[0].1, n);
    }

    /// A label of request values admitted just before a reload that changes how its rule labels them
    /// is never made: the room it took in its rule's budget is given back, not lost until a restart.
    #[test]
    fn a_value_label_refused_after_a_reload_gives_its_room_back() {
        let m = Metrics::new();
        let serve = |form: u64| {
            let rules = HashMap::from([("team".into(), form)]);
            m.serve_rules(HashMap::from([("web".into(), rules)]));
        };
        serve(7);
        // Admitted (the budget is one label), then the reload, then the label made under the old form.
        let admitted = m.admit_label("web", "team_a", "team", 1);
        serve(8);
        assert!(m.add_admitted("web", admitted, "team", 7).1.is_none());
        // The next value takes the room.
        m.rule_within("web", "team_b", "team", 8, 1);
        assert!(m.existing_rule("web", "team_b").is_some());
        assert!(m.existing_rule("web", "team (other values)").is_none());
    }
}
