//! The Envoy RLS v3 API end to end: a real tonic client over a real socket against the in-process server.

mod common;

use common::{ask, descriptor, request, with_override, TestServer};
use ratelimitd::proto::{
    envoy::r#type::v3::RateLimitUnit,
    rate_limit_response::{rate_limit::Unit, Code, DescriptorStatus, RateLimit},
    HeaderValue, RateLimitRequest,
};
use tonic::Code as Status;

const RULES: &str = r#"
domain: web
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 3, name: per_ip}
  - key: user
    rate_limit: {unit: second, requests_per_unit: 2}
  - key: tight
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: preview
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: internal
    rate_limit: {unlimited: true}
  - key: plan
    value: free
    rate_limit: {unit: minute, requests_per_unit: 0, name: free_plan}
  - key: plan
    value: paid
    rate_limit:
      unit: minute
      requests_per_unit: 2
      replaces: [{name: free_plan}]
  - key: path
    value: /api/*
    rate_limit: {unit: week, requests_per_unit: 100}
"#;

async fn server() -> TestServer {
    TestServer::start(&[("web.yaml", RULES)], |_| {}).await
}

fn status(
    code: Code,
    limit: Option<(u32, Unit, &str)>,
    remaining: u32,
    reset: Option<i64>,
) -> DescriptorStatus {
    DescriptorStatus {
        code: code as i32,
        current_limit: limit.map(|(rpu, unit, name)| RateLimit {
            requests_per_unit: rpu,
            unit: unit as i32,
            name: name.into(),
        }),
        limit_remaining: remaining,
        duration_until_reset: reset.map(|seconds| prost_types::Duration { seconds, nanos: 0 }),
        quota: None,
    }
}

#[tokio::test]
async fn counts_to_the_limit_and_resets_with_the_next_window() {
    let s = server().await;
    let mut c = s.client().await;
    let r = request("web", vec![descriptor(&[("remote_address", "10.0.0.1")])]);
    for left in [2, 1, 0] {
        let resp = ask(&mut c, r.clone()).await;
        assert_eq!(resp.overall_code, Code::Ok as i32);
        assert_eq!(
            resp.statuses,
            vec![status(
                Code::Ok,
                Some((3, Unit::Minute, "per_ip")),
                left,
                Some(58)
            )]
        );
    }
    let resp = ask(&mut c, r.clone()).await;
    assert_eq!(resp.overall_code, Code::OverLimit as i32);
    assert_eq!(
        resp.statuses,
        vec![status(
            Code::OverLimit,
            Some((3, Unit::Minute, "per_ip")),
            0,
            Some(58)
        )]
    );
    // Another address has its own counter.
    let other = request("web", vec![descriptor(&[("remote_address", "10.0.0.2")])]);
    let resp = ask(&mut c, other).await;
    assert_eq!(resp.overall_code, Code::Ok as i32);

    s.clock.advance_millis(58_000);
    let resp = ask(&mut c, r).await;
    assert_eq!(resp.overall_code, Code::Ok as i32);
    assert_eq!(resp.statuses[0].limit_remaining, 2);
    assert_eq!(
        resp.statuses[0]
            .duration_until_reset
            .as_ref()
            .unwrap()
            .seconds,
        60
    );
    s.stop().await;
}

/// Shadow rules, costs, several descriptors and consume_on_deny are rows of the semantics table
/// (semantics.rs), on every store; global shadow mode is decided above the store.
#[tokio::test]
async fn global_shadow_mode_answers_ok_but_reports_the_status() {
    let s = TestServer::start(&[("web.yaml", RULES)], |s| s.shadow_mode = true).await;
    let mut c = s.client().await;
    let r = request("web", vec![descriptor(&[("tight", "t")])]);
    ask(&mut c, r.clone()).await;
    let resp = ask(&mut c, r).await;
    assert_eq!(
        resp.overall_code,
        Code::Ok as i32,
        "global shadow answers OK"
    );
    assert_eq!(
        resp.statuses[0].code,
        Code::OverLimit as i32,
        "but reports the status"
    );
    s.stop().await;
}

#[tokio::test]
async fn unlimited_replaces_and_unmatched_descriptors() {
    let s = server().await;
    let mut c = s.client().await;
    let resp = ask(
        &mut c,
        request(
            "web",
            vec![
                descriptor(&[("internal", "x")]),
                descriptor(&[("nothing", "matches")]),
                descriptor(&[("path", "/api/v1/users")]),
            ],
        ),
    )
    .await;
    assert_eq!(resp.statuses[0], status(Code::Ok, None, u32::MAX, None));
    assert_eq!(resp.statuses[1], status(Code::Ok, None, 0, None));
    assert_eq!(
        resp.statuses[2].current_limit.as_ref().unwrap().unit,
        Unit::Week as i32
    );

    let free = descriptor(&[("plan", "free")]);
    let resp = ask(&mut c, request("web", vec![free.clone()])).await;
    assert_eq!(
        resp.overall_code,
        Code::OverLimit as i32,
        "0 per minute blocks"
    );
    let resp = ask(
        &mut c,
        request("web", vec![free, descriptor(&[("plan", "paid")])]),
    )
    .await;
    assert_eq!(
        resp.overall_code,
        Code::Ok as i32,
        "paid replaces free_plan"
    );
    assert_eq!(resp.statuses[0], status(Code::Ok, None, 0, None));
    assert_eq!(resp.statuses[1].limit_remaining, 1);

    let resp = ask(
        &mut c,
        request("unknown-domain", vec![descriptor(&[("user", "u")])]),
    )
    .await;
    assert_eq!(resp.overall_code, Code::Ok as i32);
    assert_eq!(resp.statuses[0].current_limit, None);
    s.stop().await;
}

#[tokio::test]
async fn request_overrides_apply_to_known_domains_and_reject_unknown_units() {
    let s = server().await;
    let mut c = s.client().await;
    let d = with_override(
        descriptor(&[("anything", "x")]),
        1,
        RateLimitUnit::Day as i32,
    );
    let resp = ask(&mut c, request("web", vec![d.clone()])).await;
    assert_eq!(
        resp.statuses[0].current_limit,
        Some(RateLimit {
            requests_per_unit: 1,
            unit: Unit::Day as i32,
            name: String::new()
        })
    );
    let resp = ask(&mut c, request("web", vec![d.clone()])).await;
    assert_eq!(resp.overall_code, Code::OverLimit as i32);

    // WEEK (7) is accepted in overrides too.
    let week = with_override(descriptor(&[("w", "x")]), 5, 7);
    let resp = ask(&mut c, request("web", vec![week])).await;
    assert_eq!(
        resp.statuses[0].current_limit.as_ref().unwrap().unit,
        Unit::Week as i32
    );

    let unknown = with_override(
        descriptor(&[("anything", "x")]),
        1,
        RateLimitUnit::Unknown as i32,
    );
    let err = c
        .should_rate_limit(request("web", vec![unknown.clone()]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Status::InvalidArgument);
    assert!(err.message().contains("UNKNOWN"), "{}", err.message());
    // Unknown domain: the override is ignored, no error.
    let resp = ask(&mut c, request("elsewhere", vec![unknown])).await;
    assert_eq!(resp.overall_code, Code::Ok as i32);
    s.stop().await;
}

#[tokio::test]
async fn overrides_are_refused_when_request_limits_allow_overrides_is_false() {
    let s = TestServer::start(&[("web.yaml", RULES)], |s| {
        s.request_limits.allow_overrides = false;
    })
    .await;
    let mut c = s.client().await;
    let refused = "descriptor 1: rate limit overrides are refused here (request_limits.allow_overrides is false)";
    let d = with_override(
        descriptor(&[("user", "mallory")]),
        1_000_000,
        RateLimitUnit::Second as i32,
    );
    let err = c
        .should_rate_limit(request("web", vec![descriptor(&[("user", "a")]), d]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Status::InvalidArgument);
    assert_eq!(err.message(), refused);

    let (code, body) = s
        .http(
            "POST",
            "/json",
            r#"{"domain":"web","descriptors":[{"entries":[{"key":"user","value":"a"}]},{"entries":[{"key":"user","value":"mallory"}],"limit":{"requestsPerUnit":1000000,"unit":"SECOND"}}]}"#,
        )
        .await;
    assert_eq!((code, body.trim()), (400, refused));

    // Without an override the same descriptors are decided by the rules.
    let resp = ask(
        &mut c,
        request("web", vec![descriptor(&[("user", "mallory")])]),
    )
    .await;
    assert_eq!(
        resp.statuses[0]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit,
        2
    );
    s.stop().await;
}

#[tokio::test]
async fn response_headers_when_enabled() {
    let s = TestServer::start(&[("web.yaml", RULES)], |s| {
        s.response_headers = ratelimitd::settings::ResponseHeaders::Envoy;
    })
    .await;
    let mut c = s.client().await;
    let r = request("web", vec![descriptor(&[("tight", "h")])]);
    let resp = ask(&mut c, r.clone()).await;
    let header = |k: &str, v: &str| HeaderValue {
        key: k.into(),
        value: v.into(),
        raw_value: vec![],
    };
    // 2222 s is 1378 s before the end of its hour.
    assert_eq!(
        resp.response_headers_to_add,
        vec![
            header("RateLimit-Limit", "1"),
            header("RateLimit-Remaining", "0"),
            header("RateLimit-Reset", "1378"),
        ]
    );
    let resp = ask(&mut c, r).await;
    assert_eq!(
        resp.response_headers_to_add.last(),
        Some(&header("Retry-After", "1378"))
    );
    s.stop().await;

    let s = server().await;
    let mut c = s.client().await;
    let resp = ask(&mut c, request("web", vec![descriptor(&[("tight", "h")])])).await;
    assert!(resp.response_headers_to_add.is_empty(), "off by default");
    s.stop().await;
}

#[tokio::test]
async fn malformed_requests_get_invalid_argument_with_the_reason() {
    let s = server().await;
    let mut c = s.client().await;
    let cases: Vec<(RateLimitRequest, &str)> = vec![
        (
            request("", vec![descriptor(&[("user", "u")])]),
            "rate limit domain must not be empty",
        ),
        (
            request("web", vec![]),
            "rate limit descriptor list must not be empty",
        ),
        (
            request(
                "web",
                (0..65).map(|_| descriptor(&[("user", "u")])).collect(),
            ),
            "request_limits.max_descriptors",
        ),
        (
            request("web", vec![descriptor(&[("user", "u"); 17])]),
            "request_limits.max_entries",
        ),
        (
            request("web", vec![descriptor(&[("k".repeat(1025).as_str(), "u")])]),
            "request_limits.max_key_bytes",
        ),
        (
            request(
                "web",
                vec![descriptor(&[("user", "v".repeat(1025).as_str())])],
            ),
            "request_limits.max_value_bytes",
        ),
    ];
    for (r, want) in cases {
        let err = c.should_rate_limit(r).await.unwrap_err();
        assert_eq!(err.code(), Status::InvalidArgument);
        assert!(err.message().contains(want), "{} !~ {want}", err.message());
    }
    // The service keeps serving after bad requests.
    let ok = ask(&mut c, request("web", vec![descriptor(&[("user", "u")])])).await;
    assert_eq!(ok.overall_code, Code::Ok as i32);
    s.stop().await;
}

#[tokio::test]
async fn broken_rules_at_start_mean_unavailable_not_a_crash() {
    let s = TestServer::start(
        &[
            ("web.yaml", RULES),
            (
                "broken.yaml",
                "domain: x\ndescriptors:\n  - key: a\n    rate_limit: {unit: parsec}\n",
            ),
        ],
        |_| {},
    )
    .await;
    let mut c = s.client().await;
    let err = c
        .should_rate_limit(request("web", vec![descriptor(&[("user", "u")])]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Status::Unavailable);
    assert_eq!(err.message(), "no rate limit configuration loaded");
    s.stop().await;
}

#[tokio::test]
async fn the_memory_key_bound_answers_unavailable_and_keeps_existing_counters() {
    let s = TestServer::start(&[("web.yaml", RULES)], |s| s.memory.max_keys = 2).await;
    let mut c = s.client().await;
    for user in ["a", "b"] {
        ask(&mut c, request("web", vec![descriptor(&[("user", user)])])).await;
    }
    let err = c
        .should_rate_limit(request("web", vec![descriptor(&[("user", "c")])]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Status::Unavailable);
    assert!(
        err.message().contains("memory.max_keys"),
        "{}",
        err.message()
    );
    let resp = ask(&mut c, request("web", vec![descriptor(&[("user", "a")])])).await;
    assert_eq!(
        resp.statuses[0].limit_remaining, 0,
        "user a's counter is intact"
    );
    s.stop().await;
}

#[tokio::test]
async fn the_noop_backend_allows_everything_and_counts_nothing() {
    let s = TestServer::start(&[("web.yaml", RULES)], |s| {
        s.backend = Some(ratelimitd::settings::BackendKind::Noop);
    })
    .await;
    let mut c = s.client().await;
    for _ in 0..5 {
        let resp = ask(&mut c, request("web", vec![descriptor(&[("tight", "t")])])).await;
        assert_eq!(resp.overall_code, Code::Ok as i32);
        assert_eq!(resp.statuses[0].limit_remaining, 1);
    }
    s.stop().await;
}
