//! The local deny cache never changes a decision: the same random traces of requests, at the same
//! instants, are decided by a limiter with the cache and one without, and every answer's codes must agree,
//! for every algorithm, with requests that mix several descriptors, costs, check-only hits and the same
//! counter twice, whether denied requests consume or not.

use std::sync::Arc;

use proptest::prelude::*;
use ratelimitd::{
    clock::Clock,
    limiter::{Descriptor, Entry, Limiter, Options, Request},
    rules::{parse_file, RuleSet, Rules},
    store::{DenyCache, MemoryStore, Store},
};

const RULES: &str = r#"
domain: c
descriptors:
  - key: fixed
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: sliding
    rate_limit: {unit: second, requests_per_unit: 4, algorithm: sliding_window}
  - key: log
    rate_limit: {unit: second, requests_per_unit: 3, algorithm: sliding_log}
  - key: bucket
    rate_limit: {unit: second, requests_per_unit: 2, burst: 4, algorithm: token_bucket}
  - key: gcra
    rate_limit: {unit: second, requests_per_unit: 2, burst: 3, algorithm: gcra}
  - key: daily
    rate_limit: {unit: minute, requests_per_unit: 5}
    rate_limits:
      - {unit: second, requests_per_unit: 2, algorithm: sliding_log}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 1}
"#;

const KEYS: &[&str] = &[
    "fixed", "sliding", "log", "bucket", "gcra", "daily", "shadow",
];

fn limiter(clock: &Clock, cache: bool, consume_on_deny: bool) -> Limiter {
    let rules = Rules::default();
    rules.replace(RuleSet::build(&[("c.yaml".into(), parse_file(RULES).unwrap())], false).unwrap());
    Limiter::new(
        Arc::new(rules),
        Arc::new(Store::Memory(MemoryStore::new(10_000))),
        clock.clone(),
        Options {
            deny_cache: cache.then(|| Arc::new(DenyCache::new(1_000))),
            consume_on_deny,
            ..Options::default()
        },
    )
}

/// One step: wait, then a request of one to three descriptors (rule, value, cost).
type Step = (u64, Vec<(usize, u8, Option<u64>)>);

fn steps() -> impl Strategy<Value = Vec<Step>> {
    let descriptor = (
        0..KEYS.len(),
        0u8..2,
        prop_oneof![3 => Just(None), 1 => (0u64..3).prop_map(Some)],
    );
    prop::collection::vec((0u64..400, prop::collection::vec(descriptor, 1..4)), 1..150)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, failure_persistence: None, .. ProptestConfig::default() })]

    #[test]
    fn decisions_are_the_same_with_and_without_the_deny_cache(trace in steps(), consume_on_deny in any::<bool>()) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        let clock = Clock::manual(1_800_000_000_000);
        let (plain, cached) = (limiter(&clock, false, consume_on_deny), limiter(&clock, true, consume_on_deny));
        for (i, (wait, descriptors)) in trace.iter().enumerate() {
            clock.advance_millis(*wait);
            let request = Request {
                domain: "c".into(),
                descriptors: descriptors
                    .iter()
                    .map(|&(rule, value, hits)| Descriptor {
                        entries: vec![Entry { key: KEYS[rule].into(), value: format!("v{value}") }],
                        limit: None,
                        hits_addend: hits,
                    })
                    .collect(),
                hits_addend: 0,
            };
            let a = runtime.block_on(plain.should_rate_limit(&request)).unwrap();
            let b = runtime.block_on(cached.should_rate_limit(&request)).unwrap();
            prop_assert_eq!(a.overall_code, b.overall_code, "step {}: {:?}", i, request);
            let codes = |r: &ratelimitd::limiter::Response| r.statuses.iter().map(|s| s.code).collect::<Vec<_>>();
            prop_assert_eq!(codes(&a), codes(&b), "step {}: {:?}", i, request);
            let limits = |r: &ratelimitd::limiter::Response| {
                r.statuses.iter().map(|s| s.current_limit.as_ref().map(|l| l.requests_per_unit)).collect::<Vec<_>>()
            };
            prop_assert_eq!(limits(&a), limits(&b), "step {}", i);
        }
    }
}
