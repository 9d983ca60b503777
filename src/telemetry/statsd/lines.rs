//! What a flush says: the reference service's stat names read from the metrics registry (but the
//! per-rule ones, which `rule_stats` keeps), and the statsd (or DogStatsD) lines of what changed since
//! the last flush that was delivered.
//!
//! Nothing here is counted twice: the request path counts once, for Prometheus, and a flush reads
//! those counters. Counters go out as deltas (`name:N|c`). Timers go out from the latency histogram:
//! per bucket, the mean of the calls that fell in it, with a sample rate saying how many they were
//! (`name:0.212|ms|@0.25` is four calls of 0.212 ms on average), so that a flush is a bounded number of
//! lines whatever the traffic.

use std::collections::{BTreeMap, HashMap};

use crate::telemetry::metrics::{HistogramSnapshot, Labels, Metrics};

/// One stat's value at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stat {
    /// A counter's total so far.
    Counter(u64),
    /// A timer's histogram: per bucket, the number of calls and their sum in nanoseconds.
    Timer(HistogramSnapshot),
}

/// Every stat now, by its statsd name (tags not yet added).
pub type Stats = BTreeMap<String, Stat>;

/// The statsd name of a Prometheus series, from its labels; `None` for a series the reference has no
/// name for.
type NameOf = fn(&Labels) -> Option<String>;

/// Counters kept under Prometheus names and sent under the reference's statsd names, which some of them
/// share.
const COUNTERS: &[(&str, NameOf)] = &[
    ("ratelimit_service_config_load_success", |_| {
        Some("ratelimit.service.config_load_success".into())
    }),
    ("ratelimit_service_config_load_error", |_| {
        Some("ratelimit.service.config_load_error".into())
    }),
    ("ratelimit_service_global_shadow_mode", |_| {
        Some("ratelimit.service.global_shadow_mode".into())
    }),
    // Without the domain: request domains are the caller's to choose, so they never become names.
    ("ratelimit_service_rate_limit_domain_not_found", |_| {
        Some("ratelimit.service.rate_limit.domain_not_found".into())
    }),
    // The store's failures are `redis_error` whatever `on_backend_error` answered them with (the
    // reference always answers an error): a request answered with the error is counted by
    // `ratelimitd_backend_failures_total` too, and so only there.
    ("ratelimitd_request_errors_total", |labels| {
        (label(labels, "kind")? != "backend")
            .then(|| "ratelimit.service.call.should_rate_limit.service_error".into())
    }),
    ("ratelimitd_backend_failures_total", |_| {
        Some("ratelimit.service.call.should_rate_limit.redis_error".into())
    }),
    ("ratelimitd_fallback_decisions_total", |_| {
        Some("ratelimit.service.call.should_rate_limit.redis_error".into())
    }),
    ("ratelimit_service_total_requests", |labels| {
        Some(format!(
            "ratelimit_server.{}.total_requests",
            label(labels, "grpc_method")?
        ))
    }),
];

/// Histograms sent as the reference's timers, in milliseconds.
const TIMERS: &[(&str, NameOf)] = &[("ratelimit_service_response_time_seconds", |labels| {
    Some(format!(
        "ratelimit_server.{}.response_time",
        label(labels, "grpc_method")?
    ))
})];

fn label<'a>(labels: &'a Labels, name: &str) -> Option<&'a str> {
    labels
        .iter()
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.as_str())
}

/// Every stat of the registry that the reference names, now, but the per-rule ones (see `rule_stats`).
pub fn read(metrics: &Metrics) -> Stats {
    let mut stats = Stats::new();
    for (family, name_of) in COUNTERS {
        for (labels, value) in metrics.counter_values(family) {
            if let Some(name) = name_of(&labels) {
                add_counter(&mut stats, sanitize(&name), value);
            }
        }
    }
    for (family, name_of) in TIMERS {
        for (labels, snapshot) in metrics.histogram_values(family) {
            if let Some(name) = name_of(&labels) {
                stats.insert(sanitize(&name), Stat::Timer(snapshot));
            }
        }
    }
    stats
}

/// Adds to a counter: several series may share one statsd name (every kind of service error).
fn add_counter(stats: &mut Stats, name: String, value: u64) {
    let entry = stats.entry(name).or_insert(Stat::Counter(0));
    if let Stat::Counter(total) = entry {
        *total = total.saturating_add(value);
    }
}

/// How lines are written.
#[derive(Debug, Clone, Default)]
pub struct Format {
    /// DogStatsD: tags as `|#k:v,...`; otherwise in the name, as lyft/gostats writes them (`.__k=v`).
    pub dogstatsd: bool,
    /// Tags on every line (`EXTRA_TAGS`), sorted by key.
    pub tags: Vec<(String, String)>,
}

impl Format {
    pub fn new(dogstatsd: bool, tags: &BTreeMap<String, String>) -> Self {
        Self {
            dogstatsd,
            tags: tags
                .iter()
                .map(|(k, v)| (sanitize_tag(k), sanitize_tag(v)))
                .collect(),
        }
    }

    pub(super) fn line(
        &self,
        out: &mut String,
        name: &str,
        value: &str,
        kind: &str,
        rate: Option<&str>,
    ) {
        out.push_str(name);
        if !self.dogstatsd {
            for (k, v) in &self.tags {
                out.push_str(".__");
                out.push_str(k);
                out.push('=');
                out.push_str(v);
            }
        }
        out.push(':');
        out.push_str(value);
        out.push('|');
        out.push_str(kind);
        if let Some(rate) = rate {
            out.push_str("|@");
            out.push_str(rate);
        }
        if self.dogstatsd && !self.tags.is_empty() {
            out.push_str("|#");
            for (i, (k, v)) in self.tags.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(k);
                out.push(':');
                out.push_str(v);
            }
        }
        out.push('\n');
    }

    /// The lines of what changed from `sent` to `now`; stats that did not change send nothing.
    pub fn lines(&self, now: &Stats, sent: &HashMap<String, Stat>) -> Vec<String> {
        let mut lines = Vec::new();
        for (name, stat) in now {
            let before = sent.get(name);
            match stat {
                Stat::Counter(total) => {
                    let previous = match before {
                        Some(Stat::Counter(n)) => *n,
                        _ => 0,
                    };
                    let delta = total.saturating_sub(previous);
                    if delta > 0 {
                        let mut line = String::new();
                        self.line(&mut line, name, &delta.to_string(), "c", None);
                        lines.push(line);
                    }
                }
                Stat::Timer(snapshot) => {
                    let previous = match before {
                        Some(Stat::Timer(s)) => s.buckets.as_slice(),
                        _ => &[],
                    };
                    for (i, (count, sum)) in snapshot.buckets.iter().enumerate() {
                        let (was, was_sum) = previous.get(i).copied().unwrap_or_default();
                        let calls = count.saturating_sub(was);
                        if calls == 0 {
                            continue;
                        }
                        let mean_ms = sum.saturating_sub(was_sum) as f64 / calls as f64 / 1e6;
                        let rate = (calls > 1).then(|| sample_rate(calls));
                        let mut line = String::new();
                        self.line(
                            &mut line,
                            name,
                            &format!("{mean_ms:.3}"),
                            "ms",
                            rate.as_deref(),
                        );
                        lines.push(line);
                    }
                }
            }
        }
        lines
    }
}

/// The sample rate that makes one line stand for `calls` of them: 1/calls, rounded down, so that a
/// server computing `int(1 / rate)` (statsd_exporter) gets `calls` back, not one less.
fn sample_rate(calls: u64) -> String {
    let scaled = (1e12 / calls as f64).floor() / 1e12;
    let text = format!("{scaled:.12}");
    text.trim_end_matches('0').to_owned()
}

/// A stat name as the reference sanitizes it (`:` and `|` become `_`, and so do the dots of an IPv4
/// address, which would otherwise split it into levels), and without whitespace or control characters,
/// which would break the line.
pub fn sanitize(name: &str) -> String {
    let mut out: Vec<u8> = name
        .bytes()
        .map(|b| match b {
            b':' | b'|' => b'_',
            b if b.is_ascii_whitespace() || b.is_ascii_control() => b'_',
            b => b,
        })
        .collect();
    let mut at = 0;
    while at < out.len() {
        match ipv4_at(&out, at) {
            Some(end) => {
                for b in &mut out[at..end] {
                    if *b == b'.' {
                        *b = b'_';
                    }
                }
                at = end;
            }
            None => at += 1,
        }
    }
    // Only ASCII bytes were replaced, by ASCII: still UTF-8.
    String::from_utf8(out).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

/// The end of an IPv4-looking `d.d.d.d` (1 to 3 digits each) starting at `at`, as the reference's
/// `([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})` finds it.
fn ipv4_at(text: &[u8], at: usize) -> Option<usize> {
    let mut pos = at;
    for group in 0..4 {
        let digits = text[pos..]
            .iter()
            .take(3)
            .take_while(|b| b.is_ascii_digit())
            .count();
        if digits == 0 {
            return None;
        }
        pos += digits;
        if group < 3 {
            if text.get(pos) != Some(&b'.') {
                return None;
            }
            pos += 1;
        }
    }
    Some(pos)
}

/// A tag key or value without the characters that separate tags and values in either format.
fn sanitize_tag(text: &str) -> String {
    text.chars()
        .map(|c| match c {
            ':' | '|' | ',' | '#' | '=' | '.' => '_',
            c if c.is_whitespace() || c.is_control() => '_',
            c => c,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_sanitized_as_the_reference_does() {
        for (raw, want) in [
            (
                "ratelimit.service.rate_limit.edge.remote_address_127.0.0.1.total_hits",
                "ratelimit.service.rate_limit.edge.remote_address_127_0_0_1.total_hits",
            ),
            (
                "a.ip_cidr:10.0.0.0/8.total_hits",
                "a.ip_cidr_10_0_0_0/8.total_hits",
            ),
            ("a.k_1234.5.6.7.x", "a.k_1234_5_6_7.x"),
            ("a.k_1.2.3.x", "a.k_1.2.3.x"),
            (
                "a.k_v|x.user (other values)\n.over_limit",
                "a.k_v_x.user_(other_values)_.over_limit",
            ),
        ] {
            assert_eq!(sanitize(raw), want, "{raw}");
        }
    }

    #[test]
    fn counters_send_what_changed_with_tags_in_either_format() {
        let mut now = Stats::new();
        now.insert("a.total_hits".into(), Stat::Counter(5));
        now.insert("a.over_limit".into(), Stat::Counter(2));
        let sent: HashMap<String, Stat> = [
            ("a.total_hits".to_string(), Stat::Counter(3)),
            ("a.over_limit".to_string(), Stat::Counter(2)),
        ]
        .into();
        let tags: BTreeMap<String, String> = [
            ("env".to_string(), "prod".to_string()),
            ("app".to_string(), "edge:1".to_string()),
        ]
        .into();
        assert_eq!(
            Format::new(false, &BTreeMap::new()).lines(&now, &sent),
            ["a.total_hits:2|c\n"]
        );
        assert_eq!(
            Format::new(false, &tags).lines(&now, &sent),
            ["a.total_hits.__app=edge_1.__env=prod:2|c\n"]
        );
        assert_eq!(
            Format::new(true, &tags).lines(&now, &sent),
            ["a.total_hits:2|c|#app:edge_1,env:prod\n"]
        );
        assert_eq!(
            Format::new(true, &tags).lines(&now, &HashMap::new()).len(),
            2
        );
    }

    #[test]
    fn timers_send_each_bucket_mean_with_its_sample_rate() {
        let ms = 1_000_000;
        let now: Stats = [(
            "t".to_string(),
            Stat::Timer(HistogramSnapshot {
                buckets: vec![(1, 0), (5, 5 * ms / 10), (7, 7 * 3 * ms)],
            }),
        )]
        .into();
        let sent: HashMap<String, Stat> = [(
            "t".to_string(),
            Stat::Timer(HistogramSnapshot {
                buckets: vec![(1, 0), (1, ms / 10), (0, 0)],
            }),
        )]
        .into();
        assert_eq!(
            Format::default().lines(&now, &sent),
            ["t:0.100|ms|@0.25\n", "t:3.000|ms|@0.142857142857\n"]
        );
        for calls in [2, 3, 7, 49, 1000, 999_999] {
            let rate: f64 = sample_rate(calls).parse().unwrap();
            assert_eq!((1.0 / rate) as u64, calls, "{calls}");
        }
    }
}
