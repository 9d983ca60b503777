//! Usage reported after the response (`count_over_limit`), as an AI gateway on Envoy sends it: a check
//! before each request (`hits_addend` 0) and a report of the tokens the response used after it (the
//! same descriptors with `hits_addend` set to the count). A report that takes the budget past its limit
//! is answered OVER_LIMIT (Envoy ignores the answer to a late report) and counted, so the next checks
//! are OVER_LIMIT until time pays the excess back: the end of the window, or the bucket's refill.
//!
//! On the memory store under a manual clock the times are exact; on Redis they run on the real clock.
//! `tests/semantics.rs` runs every algorithm's budget on memory, Redis and Cluster, and
//! `tests/store_scenarios.rs` compares the stores on random traces with budgets.

mod common;

use std::time::{Duration, Instant};

use common::{ask, descriptor, redis::RedisProcess, request_costing, with_hits, TestServer};
use ratelimitd::{
    clock::Clock,
    proto::{
        rate_limit_response::Code, HeaderValue, RateLimitRequest, RateLimitResponse,
        RateLimitServiceClient,
    },
    settings::{RedisTopology, ResponseHeaders, Settings},
};
use tonic::transport::Channel;

const RULES: &str = r#"
domain: ai
descriptors:
  - key: tenant
    value: per_minute
    rate_limit: {unit: minute, requests_per_unit: 10000, count_over_limit: true, name: tokens}
  - key: tenant
    value: bucket
    rate_limit:
      {unit: second, unit_multiplier: 10, requests_per_unit: 10000, algorithm: token_bucket, count_over_limit: true, name: tokens}
  - key: tenant
    value: plain
    rate_limit: {unit: minute, requests_per_unit: 10000, name: tokens}
"#;

/// The check Envoy sends before a request: counts nothing.
fn check(tenant: &str) -> RateLimitRequest {
    request_costing(
        "ai",
        vec![with_hits(descriptor(&[("tenant", tenant)]), 0)],
        0,
    )
}

/// The report Envoy sends when the response is done (`apply_on_stream_done`), with the tokens it used.
fn report(tenant: &str, tokens: u32) -> RateLimitRequest {
    request_costing("ai", vec![descriptor(&[("tenant", tenant)])], tokens)
}

fn code(r: &RateLimitResponse) -> Code {
    Code::try_from(r.overall_code).unwrap()
}

fn retry_after(r: &RateLimitResponse) -> Option<&str> {
    r.response_headers_to_add
        .iter()
        .find(|h: &&HeaderValue| h.key == "Retry-After")
        .map(|h| h.value.as_str())
}

/// Three reports of 3 000 fit a budget of 10 000; the fourth is answered over, and counted: the check
/// after it is OVER_LIMIT. Returns that check's answer. `refilled` is how much a bucket may have
/// refilled meanwhile (0 under a manual clock).
async fn spend(
    client: &mut RateLimitServiceClient<Channel>,
    tenant: &str,
    refilled: u32,
) -> RateLimitResponse {
    assert_eq!(code(&ask(client, check(tenant)).await), Code::Ok);
    for left in [7000, 4000, 1000] {
        let r = ask(client, report(tenant, 3000)).await;
        assert_eq!(code(&r), Code::Ok);
        let remaining = r.statuses[0].limit_remaining;
        assert!(
            (left..=left + refilled).contains(&remaining),
            "{remaining} left"
        );
    }
    let fourth = ask(client, report(tenant, 3000)).await;
    assert_eq!(code(&fourth), Code::OverLimit, "12 000 of 10 000");
    let after = ask(client, check(tenant)).await;
    assert_eq!(
        code(&after),
        Code::OverLimit,
        "the fourth report was counted"
    );
    after
}

fn headers_on(s: &mut Settings) {
    s.response_headers = ResponseHeaders::Envoy;
}

#[tokio::test]
async fn a_budget_runs_out_and_stays_out_until_the_window_ends() {
    // 2 222 s after the epoch: 58 s left in the minute.
    let server = TestServer::start(&[("ai.yaml", RULES)], headers_on).await;
    let mut client = server.client().await;
    let over = spend(&mut client, "per_minute", 0).await;
    assert_eq!(retry_after(&over), Some("58"));
    server.clock.advance_millis(57_999);
    assert_eq!(
        code(&ask(&mut client, check("per_minute")).await),
        Code::OverLimit
    );
    server.clock.advance_millis(1);
    assert_eq!(code(&ask(&mut client, check("per_minute")).await), Code::Ok);

    // Without count_over_limit the fourth report is refused and not counted: the budget never runs out.
    for _ in 0..3 {
        ask(&mut client, report("plain", 3000)).await;
    }
    assert_eq!(
        code(&ask(&mut client, report("plain", 3000)).await),
        Code::OverLimit
    );
    assert_eq!(code(&ask(&mut client, check("plain")).await), Code::Ok);
    server.stop().await;
}

#[tokio::test]
async fn a_token_bucket_in_debt_is_repaid_at_its_refill_rate() {
    let server = TestServer::start(&[("ai.yaml", RULES)], headers_on).await;
    let mut client = server.client().await;
    // 2 000 tokens of debt at 10 000 per 10 s: 2 s.
    let over = spend(&mut client, "bucket", 0).await;
    assert_eq!(retry_after(&over), Some("2"));
    server.clock.advance_millis(1_999);
    assert_eq!(
        code(&ask(&mut client, check("bucket")).await),
        Code::OverLimit
    );
    server.clock.advance_millis(1);
    assert_eq!(code(&ask(&mut client, check("bucket")).await), Code::Ok);
    // From an empty bucket, a second refills 1 000 tokens.
    server.clock.advance_millis(1_000);
    let r = ask(&mut client, report("bucket", 1000)).await;
    assert_eq!((code(&r), r.statuses[0].limit_remaining), (Code::Ok, 0));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_the_debt_is_repaid_by_the_real_clock() {
    let redis = RedisProcess::start(&[]);
    let server = TestServer::start_with_clock(&[("ai.yaml", RULES)], Clock::System, |s| {
        headers_on(s);
        s.redis.url = redis.addr();
        s.redis.topology = RedisTopology::Single;
    })
    .await;
    server.wait_serving(Duration::from_secs(20)).await;
    let mut client = server.client().await;
    let over = spend(&mut client, "bucket", 500).await;
    let counted = Instant::now();
    assert!(matches!(retry_after(&over), Some("1" | "2")), "{over:?}");
    // Free again once about 2 s have refilled 2 000 tokens (less what refilled during the reports).
    let free = common::wait_for("the debt repaid", Duration::from_secs(10), async || {
        let r = ask(&mut client, check("bucket")).await;
        (code(&r) == Code::Ok).then(Instant::now)
    })
    .await;
    // `spend` saw at most 500 tokens refill during the reports, so the debt is at least 1 500 tokens
    // (1.5 s) at the fourth; the check after it, on a busy machine, may take a little of that.
    let waited = free - counted;
    assert!(
        waited >= Duration::from_millis(1_200),
        "free after {waited:?}"
    );
    server.stop().await;
}

/// A report on a budget counted over its limit is counted also when another descriptor denies its
/// request, and the rule's metrics say so: its hits are within the limit and consumed, not only in the
/// total (dashboards of within_limit missed every such report).
#[tokio::test]
async fn a_budgets_hits_in_a_denied_request_show_as_consumed_in_its_metrics() {
    let server = TestServer::start(&[("ai.yaml", RULES)], |_| {}).await;
    let mut client = server.client().await;
    ask(&mut client, report("plain", 10_000)).await;
    let both = request_costing(
        "ai",
        vec![
            descriptor(&[("tenant", "plain")]),
            descriptor(&[("tenant", "per_minute")]),
        ],
        40,
    );
    let denied = ask(&mut client, both).await;
    assert_eq!(code(&denied), Code::OverLimit);
    assert_eq!(denied.statuses[1].limit_remaining, 10_000 - 40, "counted");
    let series = |name: &str| format!("{name}{{domain=\"ai\",rule=\"tenant_per_minute\"}}");
    for name in [
        "ratelimit_service_rate_limit_total_hits",
        "ratelimit_service_rate_limit_within_limit",
    ] {
        assert_eq!(server.metric(&series(name)).await, Some(40.0), "{name}");
    }
    server.stop().await;
}
