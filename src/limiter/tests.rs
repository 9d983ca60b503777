//! Decision semantics on the memory store with a manual clock.

use super::*;
use crate::{
    rules::{parse_file, RuleSet, Unit},
    store::MemoryStore,
};

const RULES: &str = r#"
domain: d
descriptors:
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 3, name: k_limit}
  - key: small
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: quota_a
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: quota_b
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: quota_hour
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: free
    rate_limit: {unlimited: true}
  - key: banned
    rate_limit: {unit: minute, requests_per_unit: 0, name: banned_limit}
  - key: vip
    rate_limit:
      unit: minute
      requests_per_unit: 2
      replaces: [{name: banned_limit}]
  - key: files
    value: "files/*"
    share_threshold: true
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: allowed
  - key: multi
    rate_limit: {unit: second, requests_per_unit: 2, name: per_second}
    rate_limits:
      - {unit: day, requests_per_unit: 3, name: per_day}
  - key: five_min
    rate_limit: {unit: minute, requests_per_unit: 2, unit_multiplier: 5}
  - key: bucket
    rate_limit: {unit: minute, requests_per_unit: 60, algorithm: token_bucket, burst: 2}
  - key: closed_bucket
    rate_limit: {unit: minute, requests_per_unit: 0, algorithm: token_bucket, burst: 5}
  - key: closed_gcra
    rate_limit: {unit: minute, requests_per_unit: 0, algorithm: gcra, burst: 5}
  - key: net
    value: "cidr:10.0.0.0/8"
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: net
    value: "cidr:192.168.0.0/16"
    share_threshold: true
    rate_limit: {unit: minute, requests_per_unit: 1}
"#;

fn limiter_with(options: Options, clock: Clock) -> Limiter {
    let rules = Rules::default();
    rules.replace(RuleSet::build(&[("f".into(), parse_file(RULES).unwrap())], false).unwrap());
    Limiter::new(
        Arc::new(rules),
        Arc::new(Store::Memory(MemoryStore::new(1000))),
        clock,
        options,
    )
}

fn limiter() -> Limiter {
    // 2222 s: 58 s before the end of a minute window, as in the reference's header test.
    limiter_with(Options::default(), Clock::manual(2_222_000))
}

fn desc(entries: &[(&str, &str)]) -> Descriptor {
    Descriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect(),
        ..Descriptor::default()
    }
}

fn req(descriptors: Vec<Descriptor>) -> Request {
    Request {
        domain: "d".into(),
        descriptors,
        hits_addend: 0,
    }
}

async fn ask(l: &Limiter, r: &Request) -> Response {
    l.should_rate_limit(r).await.unwrap()
}

#[tokio::test]
async fn counts_up_to_the_limit_then_denies_with_status_details() {
    let l = limiter();
    let r = req(vec![desc(&[("k", "v")])]);
    for left in [2, 1, 0] {
        let resp = ask(&l, &r).await;
        assert_eq!(resp.overall_code, Code::Ok);
        assert_eq!(
            resp.statuses[0],
            DescriptorStatus {
                code: Code::Ok,
                current_limit: Some(CurrentLimit {
                    requests_per_unit: 3,
                    unit: Unit::Minute,
                    name: Some("k_limit".into())
                }),
                limit_remaining: left,
                duration_until_reset: Some(58),
                retry_after: None,
            }
        );
    }
    let resp = ask(&l, &r).await;
    assert_eq!(resp.overall_code, Code::OverLimit);
    assert_eq!(resp.statuses[0].code, Code::OverLimit);
    assert_eq!(resp.statuses[0].limit_remaining, 0);
}

/// `requests_per_unit: 0` blocks everything whatever the burst, on both bucket algorithms alike (a token
/// bucket admitted its burst once, then nothing, where GCRA admitted nothing).
#[tokio::test]
async fn a_limit_of_zero_blocks_everything_whatever_the_burst() {
    let l = limiter();
    for key in ["closed_bucket", "closed_gcra"] {
        let resp = ask(&l, &req(vec![desc(&[(key, "v")])])).await;
        assert_eq!(resp.overall_code, Code::OverLimit, "{key}");
        assert_eq!(resp.statuses[0].limit_remaining, 0, "{key}");
    }
}

#[tokio::test]
async fn a_new_window_starts_a_new_count() {
    let clock = Clock::manual(2_222_000);
    let l = limiter_with(Options::default(), clock.clone());
    let r = req(vec![desc(&[("small", "")])]);
    assert_eq!(ask(&l, &r).await.overall_code, Code::Ok);
    assert_eq!(ask(&l, &r).await.overall_code, Code::OverLimit);
    clock.advance_millis(58_000);
    let resp = ask(&l, &r).await;
    assert_eq!(resp.overall_code, Code::Ok);
    assert_eq!(resp.statuses[0].duration_until_reset, Some(60));
}

#[tokio::test]
async fn hits_addend_per_request_and_per_descriptor() {
    let l = limiter();
    let mut r = req(vec![desc(&[("k", "a")])]);
    r.hits_addend = 2;
    assert_eq!(ask(&l, &r).await.statuses[0].limit_remaining, 1);
    // Per-descriptor 0 checks without counting and beats the request-level addend.
    r.descriptors[0].hits_addend = Some(0);
    assert_eq!(ask(&l, &r).await.statuses[0].limit_remaining, 1);
    r.descriptors[0].hits_addend = Some(2);
    assert_eq!(ask(&l, &r).await.overall_code, Code::OverLimit);
    // Request-level 0 means 1.
    r.hits_addend = 0;
    r.descriptors[0].hits_addend = None;
    assert_eq!(ask(&l, &r).await.statuses[0].limit_remaining, 0);
}

#[tokio::test]
async fn a_denied_request_consumes_none_of_its_descriptors() {
    let l = limiter();
    let both = req(vec![desc(&[("k", "x")]), desc(&[("small", "")])]);
    assert_eq!(ask(&l, &both).await.overall_code, Code::Ok);
    let denied = ask(&l, &both).await;
    assert_eq!(denied.overall_code, Code::OverLimit);
    assert_eq!(denied.statuses[0].code, Code::Ok);
    assert_eq!(denied.statuses[0].limit_remaining, 2);
    // `k` still has 2 left: the denied request did not take one.
    let k = ask(&l, &req(vec![desc(&[("k", "x")])])).await;
    assert_eq!(k.statuses[0].limit_remaining, 1);
}

#[tokio::test]
async fn consume_on_deny_counts_every_descriptor() {
    let options = Options {
        consume_on_deny: true,
        ..Options::default()
    };
    let l = limiter_with(options, Clock::manual(2_222_000));
    let both = req(vec![desc(&[("k", "x")]), desc(&[("small", "")])]);
    ask(&l, &both).await;
    let denied = ask(&l, &both).await;
    assert_eq!(denied.overall_code, Code::OverLimit);
    assert_eq!(denied.statuses[0].limit_remaining, 1);
}

#[tokio::test]
async fn shadow_rules_report_ok_and_global_shadow_only_changes_the_overall_code() {
    let l = limiter();
    let r = req(vec![desc(&[("shadow", "")])]);
    ask(&l, &r).await;
    let resp = ask(&l, &r).await;
    assert_eq!(resp.overall_code, Code::Ok);
    assert_eq!(resp.statuses[0].code, Code::Ok);
    assert_eq!(resp.statuses[0].limit_remaining, 0);

    let options = Options {
        shadow_mode: true,
        ..Options::default()
    };
    let l = limiter_with(options, Clock::manual(2_222_000));
    let r = req(vec![desc(&[("small", "")])]);
    ask(&l, &r).await;
    let resp = ask(&l, &r).await;
    assert_eq!(resp.overall_code, Code::Ok);
    assert_eq!(resp.statuses[0].code, Code::OverLimit);
}

#[tokio::test]
async fn quota_rules_deny_only_when_all_of_them_are_over() {
    let l = limiter();
    let r = req(vec![desc(&[("quota_a", "")]), desc(&[("quota_b", "")])]);
    assert_eq!(ask(&l, &r).await.overall_code, Code::Ok);
    // quota_a is over, quota_b is not: still OK, and the status still says OVER_LIMIT.
    let resp = ask(&l, &r).await;
    assert_eq!(resp.overall_code, Code::Ok);
    assert_eq!(resp.statuses[0].code, Code::OverLimit);
    assert_eq!(ask(&l, &r).await.overall_code, Code::OverLimit);
}

#[tokio::test]
async fn global_quota_mode_denies_only_when_every_limited_descriptor_is_over() {
    let options = Options {
        quota_mode: true,
        ..Options::default()
    };
    let l = limiter_with(options, Clock::manual(2_222_000));
    let both = req(vec![desc(&[("small", "")]), desc(&[("k", "")])]);
    assert_eq!(ask(&l, &both).await.overall_code, Code::Ok);
    // small is over, k is not: OK, with small's status OVER_LIMIT.
    let resp = ask(&l, &both).await;
    assert_eq!(resp.overall_code, Code::Ok);
    assert_eq!(resp.statuses[0].code, Code::OverLimit);
    assert_eq!(ask(&l, &both).await.overall_code, Code::Ok);
    // k's 3 are spent too.
    assert_eq!(ask(&l, &both).await.overall_code, Code::OverLimit);
    // A descriptor that matches no limit, or a shadow rule, passes as quota: nothing denies the request.
    for passing in [("nothing", "here"), ("allowed", "x"), ("shadow", "")] {
        let r = req(vec![desc(&[("small", "")]), desc(&[passing])]);
        let resp = ask(&l, &r).await;
        assert_eq!(resp.overall_code, Code::Ok, "{passing:?}");
        assert_eq!(resp.statuses[0].code, Code::OverLimit, "{passing:?}");
    }
    // An unlimited one counts for neither.
    let r = req(vec![desc(&[("small", "")]), desc(&[("free", "")])]);
    assert_eq!(ask(&l, &r).await.overall_code, Code::OverLimit);
    // Without it, small alone denies as before.
    let l = limiter();
    let r = req(vec![desc(&[("small", "")]), desc(&[("nothing", "here")])]);
    assert_eq!(ask(&l, &r).await.overall_code, Code::Ok);
    assert_eq!(ask(&l, &r).await.overall_code, Code::OverLimit);
}

#[tokio::test]
async fn unlimited_replaces_allow_list_and_unknown_domain() {
    let l = limiter();
    let resp = ask(
        &l,
        &req(vec![desc(&[("free", "")]), desc(&[("allowed", "x")])]),
    )
    .await;
    assert_eq!(resp.statuses[0], DescriptorStatus::unlimited());
    assert_eq!(resp.statuses[0].limit_remaining, 4_294_967_295);
    assert_eq!(resp.statuses[1], DescriptorStatus::no_limit());

    assert_eq!(
        ask(&l, &req(vec![desc(&[("banned", "")])]))
            .await
            .overall_code,
        Code::OverLimit
    );
    let both = req(vec![desc(&[("banned", "")]), desc(&[("vip", "")])]);
    let resp = ask(&l, &both).await;
    assert_eq!(resp.overall_code, Code::Ok);
    assert_eq!(resp.statuses[0], DescriptorStatus::no_limit());
    assert_eq!(resp.statuses[1].limit_remaining, 1);

    let mut other = req(vec![desc(&[("k", "v")])]);
    other.domain = "nobody".into();
    other.descriptors[0].limit = Some(LimitOverride {
        requests_per_unit: 1,
        unit: None,
    });
    // Unknown domain: OK without a limit, even with an override.
    assert_eq!(
        ask(&l, &other).await.statuses[0],
        DescriptorStatus::no_limit()
    );
}

#[tokio::test]
async fn overrides_replace_the_rules_for_known_domains() {
    let l = limiter();
    let mut r = req(vec![desc(&[("anything", "x"), ("deep", "y")])]);
    r.descriptors[0].limit = Some(LimitOverride {
        requests_per_unit: 1,
        unit: Some(Unit::Hour),
    });
    let resp = ask(&l, &r).await;
    assert_eq!(
        resp.statuses[0].current_limit,
        Some(CurrentLimit {
            requests_per_unit: 1,
            unit: Unit::Hour,
            name: None
        })
    );
    assert_eq!(ask(&l, &r).await.overall_code, Code::OverLimit);

    r.descriptors[0].limit = Some(LimitOverride {
        requests_per_unit: 1,
        unit: None,
    });
    let err = l.should_rate_limit(&r).await.unwrap_err();
    assert!(err.is_invalid_request());
    assert!(err.to_string().contains("UNKNOWN"), "{err}");
}

#[tokio::test]
async fn share_threshold_values_share_one_counter() {
    let l = limiter();
    assert_eq!(
        ask(&l, &req(vec![desc(&[("files", "files/a")])]))
            .await
            .overall_code,
        Code::Ok
    );
    assert_eq!(
        ask(&l, &req(vec![desc(&[("files", "files/b")])]))
            .await
            .overall_code,
        Code::Ok
    );
    assert_eq!(
        ask(&l, &req(vec![desc(&[("files", "files/c")])]))
            .await
            .overall_code,
        Code::OverLimit
    );
}

#[tokio::test]
async fn headers_describe_the_descriptor_closest_to_its_limit() {
    let options = Options {
        response_headers: ResponseHeaders::Envoy,
        ..Options::default()
    };
    let l = limiter_with(options, Clock::manual(2_222_000));
    let r = req(vec![desc(&[("k", "h")]), desc(&[("quota_b", "")])]);
    let resp = ask(&l, &r).await;
    let want = |l: &str, r: &str, s: &str| {
        vec![
            ("RateLimit-Limit".to_string(), l.to_string()),
            ("RateLimit-Remaining".to_string(), r.to_string()),
            ("RateLimit-Reset".to_string(), s.to_string()),
        ]
    };
    // k has 2 left, quota_b 1: the first with the smallest remaining wins.
    assert_eq!(resp.response_headers, want("2", "1", "58"));

    let over = req(vec![desc(&[("small", "")])]);
    ask(&l, &over).await;
    let resp = ask(&l, &over).await;
    let mut expected = want("1", "0", "58");
    expected.push(("Retry-After".into(), "58".into()));
    assert_eq!(resp.response_headers, expected);

    // No limited descriptor, no headers.
    let resp = ask(&l, &req(vec![desc(&[("allowed", "")])])).await;
    assert!(resp.response_headers.is_empty());
}

#[tokio::test]
async fn malformed_requests_are_refused_with_what_to_fix() {
    let l = limiter();
    let empty_domain = Request {
        domain: String::new(),
        descriptors: vec![desc(&[("k", "v")])],
        hits_addend: 0,
    };
    let err = l.should_rate_limit(&empty_domain).await.unwrap_err();
    assert_eq!(err.to_string(), "rate limit domain must not be empty");
    let err = l.should_rate_limit(&req(vec![])).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "rate limit descriptor list must not be empty"
    );

    let many = req((0..65).map(|_| desc(&[("k", "v")])).collect());
    let err = l.should_rate_limit(&many).await.unwrap_err();
    assert!(
        err.to_string().contains("request_limits.max_descriptors"),
        "{err}"
    );
    let wide = req(vec![desc(&[("k", "v"); 17])]);
    let err = l.should_rate_limit(&wide).await.unwrap_err();
    assert!(
        err.to_string().contains("request_limits.max_entries"),
        "{err}"
    );
    let long_value = "v".repeat(1025);
    let err = l
        .should_rate_limit(&req(vec![desc(&[("k", &long_value)])]))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("request_limits.max_value_bytes"),
        "{err}"
    );
    assert!(err.is_invalid_request());
}

#[tokio::test]
async fn no_rules_loaded_is_unavailable_not_invalid() {
    let l = Limiter::new(
        Arc::new(Rules::default()),
        Arc::new(Store::Memory(MemoryStore::new(10))),
        Clock::manual(0),
        Options::default(),
    );
    let err = l
        .should_rate_limit(&req(vec![desc(&[("k", "v")])]))
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), "no rate limit configuration loaded");
    assert!(!err.is_invalid_request());
}

#[tokio::test]
async fn several_limits_on_one_rule_report_the_closest_and_consume_none_when_denied() {
    let clock = Clock::manual(2_222_000);
    let l = limiter_with(Options::default(), clock.clone());
    let r = req(vec![desc(&[("multi", "x")])]);
    let name = |resp: &Response| {
        resp.statuses[0]
            .current_limit
            .as_ref()
            .and_then(|l| l.name.as_deref().map(str::to_owned))
    };
    let first = ask(&l, &r).await;
    assert_eq!(
        (name(&first).as_deref(), first.statuses[0].limit_remaining),
        (Some("per_second"), 1)
    );
    ask(&l, &r).await;
    let denied = ask(&l, &r).await;
    assert_eq!(denied.overall_code, Code::OverLimit);
    assert_eq!(name(&denied).as_deref(), Some("per_second"));
    assert_eq!(denied.statuses[0].retry_after, Some(1));

    clock.advance_millis(1_000);
    // The denied request took nothing from the daily limit: 1 of 3 left after this one.
    let next = ask(&l, &r).await;
    assert_eq!(next.overall_code, Code::Ok);
    assert_eq!(
        (name(&next).as_deref(), next.statuses[0].limit_remaining),
        (Some("per_day"), 0)
    );
    clock.advance_millis(1_000);
    let day_over = ask(&l, &r).await;
    assert_eq!(day_over.overall_code, Code::OverLimit);
    assert_eq!(name(&day_over).as_deref(), Some("per_day"));
    assert_eq!(
        day_over.statuses[0].duration_until_reset,
        Some(86_400 - 2_224)
    );
}

#[tokio::test]
async fn unit_multiplier_widens_the_window() {
    let l = limiter();
    let resp = ask(&l, &req(vec![desc(&[("five_min", "")])])).await;
    // 2222 s is 122 s into its 300 s window.
    assert_eq!(resp.statuses[0].duration_until_reset, Some(178));
    assert_eq!(
        resp.statuses[0].current_limit.as_ref().unwrap().unit,
        Unit::Minute
    );
}

#[tokio::test]
async fn a_token_bucket_answers_with_the_wait_for_its_next_token() {
    let options = Options {
        response_headers: ResponseHeaders::Envoy,
        ..Options::default()
    };
    let clock = Clock::manual(2_222_000);
    let l = limiter_with(options, clock.clone());
    let r = req(vec![desc(&[("bucket", "k")])]);
    assert_eq!(ask(&l, &r).await.overall_code, Code::Ok);
    assert_eq!(ask(&l, &r).await.overall_code, Code::Ok);
    let denied = ask(&l, &r).await;
    assert_eq!(denied.overall_code, Code::OverLimit);
    assert_eq!(
        denied.response_headers.last(),
        Some(&("Retry-After".to_string(), "1".to_string()))
    );
    clock.advance_millis(1_000);
    assert_eq!(
        ask(&l, &r).await.overall_code,
        Code::Ok,
        "one token a second"
    );
}

#[tokio::test]
async fn ietf_headers_list_the_policies_and_describe_the_closest() {
    let options = Options {
        response_headers: ResponseHeaders::Ietf,
        ..Options::default()
    };
    let l = limiter_with(options, Clock::manual(2_222_000));
    let r = req(vec![
        desc(&[("k", "i")]),
        desc(&[("quota_b", "")]),
        desc(&[("five_min", "")]),
    ]);
    let resp = ask(&l, &r).await;
    assert_eq!(
        resp.response_headers,
        vec![
            (
                "RateLimit-Policy".to_string(),
                r#""k_limit";q=3;w=60, "d1";q=2;w=60, "d2";q=2;w=300"#.to_string()
            ),
            ("RateLimit".to_string(), r#""d1";r=1;t=58"#.to_string()),
        ]
    );
    ask(&l, &r).await;
    let denied = ask(&l, &r).await;
    assert_eq!(denied.overall_code, Code::OverLimit);
    assert_eq!(denied.response_headers[1].1, r#""d2";r=0;t=178"#);
    assert_eq!(
        denied.response_headers[2],
        ("Retry-After".to_string(), "178".to_string())
    );
}

/// Retry-After is when the same request could pass: every enforced descriptor over its limit must free,
/// but of quota descriptors that all denied it, one freeing is enough; a quota descriptor over its limit
/// beside an enforced one that denies does not lengthen the wait.
#[tokio::test]
async fn retry_after_waits_for_every_enforced_limit_and_the_first_quota_to_free() {
    let options = Options {
        response_headers: ResponseHeaders::Envoy,
        ..Options::default()
    };
    // 37 min 2 s into an hour: a minute frees in 58 s, the hour in 1 378 s.
    let l = limiter_with(options, Clock::manual(2_222_000));
    let retry_after = |resp: &Response| {
        resp.response_headers
            .iter()
            .find(|(name, _)| name == "Retry-After")
            .map(|(_, value)| value.clone())
    };
    let quotas = req(vec![desc(&[("quota_a", "")]), desc(&[("quota_hour", "")])]);
    assert_eq!(ask(&l, &quotas).await.overall_code, Code::Ok);
    let denied = ask(&l, &quotas).await;
    assert_eq!(denied.overall_code, Code::OverLimit);
    assert_eq!(
        retry_after(&denied).as_deref(),
        Some("58"),
        "the minute frees first"
    );

    // An enforced limit of a minute denies; the hour's quota descriptor is over too, but another quota
    // descriptor is within: the quota does not deny.
    let mixed = req(vec![
        desc(&[("small", "")]),
        desc(&[("quota_hour", "")]),
        desc(&[("quota_b", "")]),
    ]);
    let first = ask(&l, &mixed).await;
    assert_eq!(first.overall_code, Code::Ok, "{first:?}");
    let denied = ask(&l, &mixed).await;
    assert_eq!(denied.overall_code, Code::OverLimit);
    assert_eq!(retry_after(&denied).as_deref(), Some("58"));

    // Both deny: the minute's limit frees in 58 s, the hour's quota descriptor (the only one) later.
    let both = req(vec![desc(&[("small", "")]), desc(&[("quota_hour", "")])]);
    let denied = ask(&l, &both).await;
    assert_eq!(denied.overall_code, Code::OverLimit);
    assert_eq!(retry_after(&denied).as_deref(), Some("1378"));
}

/// A descriptor with several limits lists each in the policy, and `RateLimit` names the one its status
/// reports, whichever it is.
#[tokio::test]
async fn ietf_headers_list_every_limit_of_a_descriptor() {
    let options = Options {
        response_headers: ResponseHeaders::Ietf,
        ..Options::default()
    };
    let clock = Clock::manual(2_222_000);
    let l = limiter_with(options, clock.clone());
    let r = req(vec![desc(&[("multi", "x")]), desc(&[("k", "j")])]);
    let header = |resp: &Response, name: &str| {
        resp.response_headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    let first = ask(&l, &r).await;
    assert_eq!(
        header(&first, "RateLimit-Policy"),
        r#""per_second";q=2;w=1, "per_day";q=3;w=86400, "k_limit";q=3;w=60"#
    );
    assert_eq!(header(&first, "RateLimit"), r#""per_second";r=1;t=1"#);
    ask(&l, &r).await;
    // A second on: a new second's quota, one hit of the day's left.
    clock.advance_millis(1_000);
    let later = ask(&l, &r).await;
    assert_eq!(
        header(&later, "RateLimit"),
        format!("\"per_day\";r=0;t={}", 86_400 - 2_223)
    );
}

#[tokio::test]
async fn cidr_rules_count_per_address_or_per_network_when_shared() {
    let l = limiter();
    let code = |resp: Response| resp.overall_code;
    let net = |ip: &'static str| req(vec![desc(&[("net", ip)])]);
    assert_eq!(code(ask(&l, &net("10.0.0.1")).await), Code::Ok);
    assert_eq!(
        code(ask(&l, &net("10.0.0.2")).await),
        Code::Ok,
        "its own counter"
    );
    assert_eq!(code(ask(&l, &net("10.0.0.1")).await), Code::OverLimit);
    assert_eq!(code(ask(&l, &net("192.168.1.1")).await), Code::Ok);
    assert_eq!(
        code(ask(&l, &net("192.168.2.2")).await),
        Code::OverLimit,
        "the network shares one"
    );
    let outside = ask(&l, &net("172.16.0.1")).await;
    assert_eq!(outside.statuses[0].current_limit, None);
}

#[test]
fn the_store_waits_until_shortly_before_the_answer_is_due() {
    use std::time::Duration;
    let waits = |left_ms: u64| {
        let left = Duration::from_millis(left_ms);
        left - super::answer_margin(left)
    };
    // Envoy's default 20 ms: half of it for Redis, half for the trip back and a late timer.
    assert_eq!(waits(20), Duration::from_millis(10));
    assert_eq!(waits(50), Duration::from_millis(35));
    assert_eq!(waits(200), Duration::from_millis(170));
    assert_eq!(waits(1_000), Duration::from_millis(900));
    assert_eq!(waits(5_000), Duration::from_millis(4_900));
    assert_eq!(waits(2), Duration::from_millis(1));
    assert_eq!(waits(0), Duration::ZERO);
}

fn target(entries: &[(&str, &str)]) -> Target {
    Target {
        domain: "d".into(),
        entries: desc(entries).entries,
    }
}

fn per_minute(requests_per_unit: u32) -> runtime::LimitSpec {
    runtime::LimitSpec {
        requests_per_unit,
        unit: "minute".into(),
        unit_multiplier: None,
        algorithm: None,
        burst: None,
        count_over_limit: false,
        name: Some("runtime".into()),
    }
}

fn overridden(entries: &[(&str, &str)], requests_per_unit: u32) -> Descriptor {
    Descriptor {
        limit: Some(LimitOverride {
            requests_per_unit,
            unit: Some(Unit::Minute),
        }),
        ..desc(entries)
    }
}

#[tokio::test]
async fn a_runtime_limit_wins_over_the_override_which_wins_over_the_rules() {
    let l = limiter();
    l.set_runtime_limit(&target(&[("k", "tenant")]), per_minute(10), None, "test")
        .await
        .unwrap();
    // The runtime limit, whatever the request's override says.
    for d in [desc(&[("k", "tenant")]), overridden(&[("k", "tenant")], 5)] {
        let status = &ask(&l, &req(vec![d])).await.statuses[0];
        let limit = status.current_limit.as_ref().unwrap();
        assert_eq!(
            (limit.requests_per_unit, limit.name.as_deref()),
            (10, Some("runtime"))
        );
    }
    // Another value: the override, else the rules.
    let status = &ask(&l, &req(vec![overridden(&[("k", "other")], 5)]))
        .await
        .statuses[0];
    assert_eq!(status.current_limit.as_ref().unwrap().requests_per_unit, 5);
    let status = &ask(&l, &req(vec![desc(&[("k", "third")])])).await.statuses[0];
    assert_eq!(status.current_limit.as_ref().unwrap().requests_per_unit, 3);
    // Deleted: the override, then the rules again, on the counter the runtime limit counted in.
    let id = l.runtime_limit_id(&target(&[("k", "tenant")])).unwrap();
    assert!(l.delete_runtime_limit(&id).await.unwrap().is_some());
    let status = &ask(&l, &req(vec![overridden(&[("k", "tenant")], 5)]))
        .await
        .statuses[0];
    assert_eq!((status.limit_remaining, status.code), (2, Code::Ok));
    let status = &ask(&l, &req(vec![desc(&[("k", "tenant")])])).await.statuses[0];
    assert_eq!(status.code, Code::OverLimit, "4 counted of 3");
    assert!(matches!(
        l.delete_runtime_limit(&id).await,
        Err(OperatorError::NotFound(_))
    ));
}

#[tokio::test]
async fn a_runtime_limit_ends_at_its_expiry_and_is_then_purged() {
    let l = limiter();
    let now = l.clock.now_millis();
    let banned = target(&[("banned", "x")]);
    l.set_runtime_limit(
        &banned,
        per_minute(100),
        Some(runtime::Expiry::At(Some(now + 10_000))),
        "test",
    )
    .await
    .unwrap();
    let r = req(vec![desc(&[("banned", "x")])]);
    assert_eq!(ask(&l, &r).await.overall_code, Code::Ok, "unblocked");
    l.clock.advance_millis(9_999);
    assert_eq!(ask(&l, &r).await.overall_code, Code::Ok);
    l.clock.advance_millis(1);
    assert_eq!(ask(&l, &r).await.overall_code, Code::OverLimit, "expired");
    assert!(l.runtime_limits().await.unwrap().is_empty());
    assert!(matches!(
        l.set_runtime_limit(
            &banned,
            per_minute(1),
            Some(runtime::Expiry::At(Some(now))),
            "test"
        )
        .await,
        Err(OperatorError::Invalid(_))
    ));
}

#[tokio::test]
async fn runtime_limits_keep_sensitive_values_hashed_and_refuse_what_they_cannot_hash() {
    let options = Options {
        sensitive: Some(Sensitive::new(&["k".to_owned()], Some(b"secret"))),
        ..Options::default()
    };
    let l = limiter_with(options, Clock::manual(2_222_000));
    let set = l
        .set_runtime_limit(&target(&[("k", "raw-key")]), per_minute(7), None, "test")
        .await
        .unwrap();
    assert!(set.descriptor[0].1.starts_with("hmac-"), "{set:?}");
    assert!(!serde_json::to_string(&set).unwrap().contains("raw-key"));
    let status = &ask(&l, &req(vec![desc(&[("k", "raw-key")])]))
        .await
        .statuses[0];
    assert_eq!(status.current_limit.as_ref().unwrap().requests_per_unit, 7);
    // Inspecting shows the hash, never the raw value, and what the counter holds.
    let seen = l.inspect(&target(&[("k", "raw-key")])).await.unwrap();
    assert_eq!(seen.descriptor, set.descriptor);
    let applied: Vec<(bool, f64)> = seen
        .limits
        .iter()
        .map(|i| (i.applies, i.usage.used))
        .collect();
    assert_eq!(applied, [(true, 1.0), (false, 1.0)], "one counter, shared");
    // A domain without rules, a malformed limit, and too many limits are refused.
    let elsewhere = Target {
        domain: "none".into(),
        entries: target(&[("k", "v")]).entries,
    };
    assert!(matches!(
        l.set_runtime_limit(&elsewhere, per_minute(1), None, "t")
            .await,
        Err(OperatorError::UnknownDomain(_))
    ));
    let mut fortnight = per_minute(1);
    fortnight.unit = "fortnight".into();
    let err = l
        .set_runtime_limit(&target(&[("k", "v")]), fortnight, None, "t")
        .await
        .unwrap_err();
    assert!(err.to_string().contains("fortnight"), "{err}");
}

#[tokio::test]
async fn a_reset_clears_every_counter_of_the_descriptor() {
    let l = limiter();
    let r = req(vec![desc(&[("multi", "m")])]);
    ask(&l, &r).await;
    ask(&l, &r).await;
    assert_eq!(ask(&l, &r).await.overall_code, Code::OverLimit);
    let reset = l.reset(&target(&[("multi", "m")])).await.unwrap();
    assert_eq!((reset.limits, reset.counters), (2, 2));
    let seen = l.inspect(&target(&[("multi", "m")])).await.unwrap();
    assert!(seen.limits.iter().all(|i| i.usage.used == 0.0));
    assert_eq!(ask(&l, &r).await.overall_code, Code::Ok);
}

#[tokio::test]
async fn rule_counters_held_by_the_rules_count_for_each_limiter_and_survive_a_reload() {
    let rules = Arc::new(Rules::default());
    let build = || RuleSet::build(&[("f".into(), parse_file(RULES).unwrap())], false).unwrap();
    rules.replace(build());
    let limiter_counting_in = |metrics: &Arc<Metrics>| {
        Limiter::new(
            rules.clone(),
            Arc::new(Store::Memory(MemoryStore::new(1000))),
            Clock::manual(2_222_000),
            Options {
                metrics: metrics.clone(),
                ..Options::default()
            },
        )
    };
    let (first, second) = (Arc::new(Metrics::new()), Arc::new(Metrics::new()));
    let (a, b) = (limiter_counting_in(&first), limiter_counting_in(&second));
    let r = req(vec![desc(&[("k", "v")])]);
    let hits = |metrics: &Metrics| {
        let line = "ratelimit_service_rate_limit_total_hits{domain=\"d\",rule=\"k\"} ";
        metrics
            .render()
            .lines()
            .find_map(|l| l.strip_prefix(line).map(str::to_owned))
    };
    ask(&a, &r).await;
    ask(&a, &r).await;
    ask(&b, &r).await;
    assert_eq!(hits(&first).as_deref(), Some("2"));
    assert_eq!(hits(&second).as_deref(), Some("1"), "each limiter its own");
    // A reload builds new rules, which hold nothing yet: the same series goes on counting.
    rules.replace(build());
    ask(&a, &r).await;
    assert_eq!(hits(&first).as_deref(), Some("3"));
}

#[tokio::test]
async fn expired_runtime_limits_leave_room_and_records_are_bounded_and_resolved() {
    let mut options = Options::default();
    options.runtime_limits.max_limits = 2;
    let l = limiter_with(options, Clock::manual(2_222_000));
    let soon = Some(runtime::Expiry::In(std::time::Duration::from_secs(1)));
    for tenant in ["a", "b"] {
        l.set_runtime_limit(&target(&[("k", tenant)]), per_minute(10), soon, "test")
            .await
            .unwrap();
    }
    assert!(matches!(
        l.set_runtime_limit(&target(&[("k", "c")]), per_minute(10), None, "test")
            .await,
        Err(OperatorError::TooMany { max: 2 })
    ));
    // Both expired: room for two again, though their records are purged only after the set.
    l.clock.advance_millis(1_000);
    for tenant in ["c", "d"] {
        l.set_runtime_limit(&target(&[("k", tenant)]), per_minute(10), None, "test")
            .await
            .unwrap();
    }
    // Stored with the algorithm this replica resolved, so replicas with another default agree.
    let listed = l.runtime_limits().await.unwrap();
    assert_eq!(listed.len(), 2);
    assert!(listed
        .iter()
        .all(|r| r.limit.algorithm == Some(crate::algorithm::Algorithm::FixedWindow)));
    // A name is answered in every status: bounded.
    let mut named = per_minute(10);
    named.name = Some("n".repeat(257));
    let refused = l
        .set_runtime_limit(&target(&[("k", "c")]), named, None, "test")
        .await;
    assert!(
        matches!(&refused, Err(OperatorError::Invalid(m)) if m.contains("256 bytes")),
        "{refused:?}"
    );
}

#[tokio::test]
async fn a_record_that_no_longer_reads_is_deleted_by_its_id() {
    let l = limiter();
    l.shared
        .put_record(
            &l.record_keys(),
            "0123456789abcdef",
            "not a runtime limit",
            1,
            0,
        )
        .await
        .unwrap();
    l.refresh_runtime_limits().await.unwrap();
    assert!(l.runtime_limits().await.unwrap().is_empty(), "left out");
    assert!(matches!(
        l.delete_runtime_limit("0123456789abcdef").await,
        Ok(None)
    ));
    assert!(matches!(
        l.delete_runtime_limit("0123456789abcdef").await,
        Err(OperatorError::NotFound(_))
    ));
}
