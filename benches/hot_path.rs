//! The hot path, piece by piece: rule matching, counter key building, every algorithm on the memory
//! store, one whole in-process decision, and the deny cache when it is full. `cargo bench --bench
//! hot_path`.

use std::{hint::black_box, sync::Arc};

use criterion::{criterion_group, criterion_main, Criterion};
use ratelimitd::{
    algorithm::{Algorithm, Params},
    clock::Clock,
    limiter::{Descriptor, Entry, Limiter, Options, Request},
    rules::{parse_file, RuleSet, Rules},
    store::{
        keys, Batch, Check, CounterStore, Deadline, DenyCache, MemoryStore, Outcome, Role, Store,
    },
};

const RULES: &str = include_str!("../examples/config/edge.yaml");

fn entries(pairs: &[(&str, &str)]) -> Vec<Entry> {
    pairs
        .iter()
        .map(|(k, v)| Entry {
            key: k.to_string(),
            value: v.to_string(),
        })
        .collect()
}

fn rule_set() -> RuleSet {
    RuleSet::build(&[("edge.yaml".into(), parse_file(RULES).unwrap())], false).unwrap()
}

fn matching(c: &mut Criterion) {
    let set = rule_set();
    let domain = &set.domains["edge"];
    let login = entries(&[
        ("remote_address", "203.0.113.7"),
        ("path", "/login"),
        ("method", "POST"),
    ]);
    let internal = entries(&[("remote_address", "10.1.2.3")]);
    let wildcard = entries(&[("api_key", "partner-42")]);
    c.bench_function("match/3 levels", |b| {
        b.iter(|| black_box(domain.find(black_box(&login)).is_some()))
    });
    c.bench_function("match/cidr", |b| {
        b.iter(|| black_box(domain.find(black_box(&internal)).is_some()))
    });
    c.bench_function("match/wildcard", |b| {
        b.iter(|| black_box(domain.find(black_box(&wildcard)).is_some()))
    });
    // A level of 10 000 wildcards, each needing its own literal somewhere in the value, and a 1 KiB
    // value that matches the last of them.
    let mut many = String::from("domain: many\ndescriptors:\n");
    for i in 0..10_000 {
        many.push_str(&format!(
            "  - key: path\n    value: \"*seg{i}/*\"\n    rate_limit: {{unit: minute, requests_per_unit: 10}}\n"
        ));
    }
    let set = RuleSet::build(&[("many.yaml".into(), parse_file(&many).unwrap())], false).unwrap();
    let value = format!("{}seg9999/", "x".repeat(1015));
    let long = entries(&[("path", value.as_str())]);
    c.bench_function("match/1 KiB value, 10 000 wildcards", |b| {
        b.iter(|| black_box(set.domains["many"].find(black_box(&long)).is_some()))
    });
}

fn key_building(c: &mut Criterion) {
    let mut out = String::with_capacity(128);
    let pairs = [
        ("remote_address", "203.0.113.7"),
        ("path", "/login"),
        ("method", "POST"),
    ];
    c.bench_function("key/fixed window, 3 entries", |b| {
        b.iter(|| {
            keys::limit_key(&mut out, "", "edge", pairs, Algorithm::FixedWindow, 60, 0);
            black_box(out.len())
        })
    });
    c.bench_function("key/token bucket, 3 entries", |b| {
        b.iter(|| {
            keys::limit_key(&mut out, "", "edge", pairs, Algorithm::TokenBucket, 60, 0);
            black_box(out.len())
        })
    });
}

fn algorithms(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::SlidingLog,
        Algorithm::TokenBucket,
        Algorithm::Gcra,
    ] {
        let store = MemoryStore::new(1_000_000);
        let mut i = 0u64;
        let now = Clock::System;
        c.bench_function(&format!("memory store/{}", algorithm.name()), |b| {
            b.iter(|| {
                i += 1;
                let batch = Batch {
                    checks: vec![Check {
                        key: format!("edge_user_{}_", i % 10_000),
                        params: Params {
                            algorithm,
                            limit: 100_000,
                            window_ms: 3_600_000,
                            burst: 100_000,
                            count_over_limit: false,
                        },
                        cost: 1,
                        role: Role::Enforce,
                        further_limit: false,
                        per_second: false,
                        reported: false,
                    }],
                    consume_on_deny: false,
                    known_denied: false,
                };
                runtime
                    .block_on(store.apply(
                        &batch,
                        now.now_millis(),
                        Deadline::within(std::time::Duration::from_secs(1)),
                    ))
                    .unwrap()
            })
        });
    }
}

fn end_to_end(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let rules = Rules::default();
    rules.replace(rule_set());
    let limiter = Limiter::new(
        Arc::new(rules),
        Arc::new(Store::Memory(MemoryStore::new(1_000_000))),
        Clock::System,
        Options::default(),
    );
    let mut i = 0u64;
    c.bench_function("limiter/one login request, memory store", |b| {
        b.iter(|| {
            i += 1;
            let request = Request {
                domain: "edge".into(),
                descriptors: vec![Descriptor {
                    entries: entries(&[
                        ("remote_address", &format!("203.0.113.{}", i % 250)),
                        ("path", "/login"),
                        ("method", "POST"),
                    ]),
                    ..Descriptor::default()
                }],
                hits_addend: 0,
            };
            runtime
                .block_on(limiter.should_rate_limit(&request))
                .unwrap()
        })
    });
}

/// The statsd stream's costs: what a call adds (one histogram observation, per method), and one flush
/// of a registry holding 1 000 rules (read the registry, write the lines of what changed), which the
/// flush task pays once per `STATS_FLUSH_INTERVAL`, off the request path.
fn statsd(c: &mut Criterion) {
    use ratelimitd::telemetry::{metrics::RuleCounter, statsd::Statsd, Metrics, StatsdSettings};
    let metrics = Metrics::new();
    let time = metrics.histogram(
        "ratelimit_service_response_time_seconds",
        "Time to answer a unary gRPC call, by method.",
        vec![("grpc_method", "ShouldRateLimit".to_string())],
    );
    c.bench_function("statsd/per call: one response time observed", |b| {
        b.iter(|| time.observe(black_box(std::time::Duration::from_micros(180))))
    });
    let rules: Vec<_> = (0..1000)
        .map(|i| {
            let rule = format!("remote_address.path_/p{i}.method_POST");
            metrics.rule("edge", &rule, Some(&rule))
        })
        .collect();
    let mut statsd = Statsd::new(&StatsdSettings::default(), Arc::new(metrics));
    let first = statsd.due();
    statsd.delivered(first);
    c.bench_function("statsd/one flush of 1000 changed rules", |b| {
        b.iter(|| {
            for rule in &rules {
                rule.add(RuleCounter::TotalHits, 3);
                rule.add(RuleCounter::WithinLimit, 3);
            }
            let due = statsd.due();
            assert_eq!(due.lines.len(), 2000);
            statsd.delivered(due);
        })
    });
}

/// A denial on a new key when the deny cache is full of live ones (an hour-long window's denials: what a
/// caller sending costs above the limit on fresh keys leaves): it is not remembered, and finding that out
/// should not cost a read of the whole shard.
fn deny_cache(c: &mut Criterion) {
    let cache = DenyCache::new(400_000);
    let params = Params {
        algorithm: Algorithm::FixedWindow,
        limit: 10,
        window_ms: 3_600_000,
        burst: 10,
        count_over_limit: false,
    };
    let denied = Outcome {
        allowed: false,
        remaining: 0,
        reset_after: 3_600,
        retry_after: 3_600,
        retry_ms: 3_600_000,
    };
    let now = Clock::System.now_millis();
    for i in 0..400_000 {
        cache.insert(&format!("held_{i}_"), params, 11, denied, now);
    }
    let mut i = 0u64;
    c.bench_function("deny cache/a new denial, cache full of live ones", |b| {
        b.iter(|| {
            i += 1;
            cache.insert(&format!("new_{i}_"), params, 11, denied, now + i / 1_000);
        })
    });
}

criterion_group!(
    benches,
    matching,
    key_building,
    algorithms,
    end_to_end,
    statsd,
    deny_cache
);
criterion_main!(benches);
