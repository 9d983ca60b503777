//! The rate limit quota service on the gRPC port, over real sockets, as an Envoy meets it: what a
//! subscription, a report, a rule without limits, a removed rule, a bound and a shutdown get, in the
//! shapes Envoy's filter reads (explicit `tokens_per_fill`, whole-second intervals and TTLs).

mod common;

use std::{collections::HashMap, path::Path, time::Duration};

use common::{ask, descriptor, request, wait_for, TestServer};
use ratelimitd::{
    clock::Clock,
    proto::rlqs::{
        rate_limit_quota_response::bucket_action::BucketAction as Action,
        rate_limit_quota_usage_reports::BucketQuotaUsage, rate_limit_strategy::Strategy, BucketId,
        RateLimitQuotaResponse, RateLimitQuotaServiceClient, RateLimitQuotaUsageReports,
        TokenBucket,
    },
    settings::Settings,
};
use tokio::sync::mpsc;
use tonic::{Code, Streaming};

const RULES: &str = r#"
domain: edge
descriptors:
  - key: generic_key
    value: shared
    rate_limit: {unit: second, requests_per_unit: 100}
  - key: generic_key
    value: free
    rate_limit: {unlimited: true}
  - key: generic_key
    value: closed
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: remote_address
    descriptors:
      - key: path
        value: /login
        rate_limit: {unit: minute, requests_per_unit: 600}
  - key: tenant
  - key: generic_key
    value: bucketed
    rate_limit: {unit: minute, requests_per_unit: 10, algorithm: token_bucket}
"#;

/// Settings for a fast test: a report every 200 ms, assignments of 1 s.
fn fast(s: &mut Settings) {
    s.rlqs.report_period = Duration::from_millis(200);
    s.rlqs.assignment_ttl = Duration::from_secs(1);
}

/// Longer than a tenth of the report period: a report sooner than that after the last one of its bucket
/// is merged into the next.
const APART: Duration = Duration::from_millis(50);

async fn start(tweak: impl FnOnce(&mut Settings)) -> TestServer {
    TestServer::start_with_clock(&[("edge.yaml", RULES)], Clock::System, |s| {
        fast(s);
        tweak(s);
    })
    .await
}

/// A server whose Envoys report every `period` and get assignments of `ttl`, serving.
async fn serving_with_period(period: Duration, ttl: Duration) -> TestServer {
    let s = start(|s| {
        s.rlqs.report_period = period;
        s.rlqs.assignment_ttl = ttl;
    })
    .await;
    s.wait_serving(Duration::from_secs(5)).await;
    s
}

/// A bucket id as the tests write it.
type Entries<'a> = &'a [(&'a str, &'a str)];

/// One bucket of a report: its id, the seconds elapsed, allowed and denied.
type UsageRow<'a> = (Entries<'a>, i64, u64, u64);

/// What a response says of each bucket: its strategy and TTL, or `None` for an abandon action.
type Actions = HashMap<Vec<(String, String)>, Option<(Strategy, i64)>>;

/// A stream driven by hand.
struct Raw {
    tx: mpsc::UnboundedSender<RateLimitQuotaUsageReports>,
    rx: Streaming<RateLimitQuotaResponse>,
}

impl Raw {
    async fn open(s: &TestServer) -> Result<Self, tonic::Status> {
        let mut client = RateLimitQuotaServiceClient::new(s.channel().await);
        let (tx, rx) = mpsc::unbounded_channel();
        let outbound =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|m| (m, rx)) },
            );
        let rx = client
            .stream_rate_limit_quotas(outbound)
            .await?
            .into_inner();
        Ok(Self { tx, rx })
    }

    fn report(&self, domain: &str, usages: &[UsageRow<'_>]) {
        let report = RateLimitQuotaUsageReports {
            domain: domain.into(),
            bucket_quota_usages: usages
                .iter()
                .map(|(bucket, elapsed, allowed, denied)| BucketQuotaUsage {
                    bucket_id: Some(id(bucket)),
                    time_elapsed: Some(prost_types::Duration {
                        seconds: *elapsed,
                        nanos: 0,
                    }),
                    num_requests_allowed: *allowed,
                    num_requests_denied: *denied,
                })
                .collect(),
        };
        self.tx.send(report).unwrap();
    }

    /// The next response, within 5 s.
    async fn next(&mut self) -> RateLimitQuotaResponse {
        match tokio::time::timeout(Duration::from_secs(5), self.rx.message()).await {
            Ok(Ok(Some(r))) => r,
            other => panic!("no response: {other:?}"),
        }
    }

    /// How the stream ends, within `within`.
    async fn end(&mut self, within: Duration) -> Option<tonic::Status> {
        let ended = tokio::time::timeout(within, async {
            loop {
                match self.rx.message().await {
                    Ok(Some(_)) => continue,
                    Ok(None) => return None,
                    Err(status) => return Some(status),
                }
            }
        });
        ended.await.expect("the stream ends in time")
    }
}

fn id(bucket: &[(&str, &str)]) -> BucketId {
    BucketId {
        bucket: bucket
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}

/// The actions of a response by bucket.
fn actions(r: &RateLimitQuotaResponse) -> Actions {
    r.bucket_action
        .iter()
        .map(|a| {
            let mut bucket: Vec<(String, String)> =
                a.bucket_id.clone().unwrap().bucket.into_iter().collect();
            bucket.sort();
            let what = match a.bucket_action.unwrap() {
                Action::AbandonAction(_) => None,
                Action::QuotaAssignmentAction(q) => {
                    let ttl = q.assignment_time_to_live.unwrap();
                    assert_eq!(ttl.nanos, 0, "whole seconds");
                    Some((
                        q.rate_limit_strategy.unwrap().strategy.unwrap(),
                        ttl.seconds,
                    ))
                }
            };
            (bucket, what)
        })
        .collect()
}

fn key(bucket: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut b: Vec<(String, String)> = bucket
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    b.sort();
    b
}

fn token_bucket(s: &Strategy) -> TokenBucket {
    match s {
        Strategy::TokenBucket(b) => *b,
        other => panic!("not a token bucket: {other:?}"),
    }
}

const SHARED: Entries<'static> = &[("generic_key", "shared")];

#[tokio::test]
async fn a_subscription_is_answered_at_once_with_a_token_bucket_envoy_can_read() {
    let s = start(|_| {}).await;
    s.wait_serving(Duration::from_secs(5)).await;
    let mut stream = Raw::open(&s).await.unwrap();
    // Envoy's first report of a bucket: one request, no time elapsed.
    stream.report("edge", &[(SHARED, 0, 1, 0)]);
    let response = stream.next().await;
    let got = actions(&response);
    let (strategy, ttl) = got[&key(SHARED)].unwrap();
    assert_eq!(ttl, 1, "the configured TTL, in whole seconds");
    let b = token_bucket(&strategy);
    let interval = b.fill_interval.unwrap();
    assert!(interval.seconds >= 1 && interval.nanos == 0, "{b:?}");
    let per_fill = b.tokens_per_fill.expect("tokens_per_fill is always sent");
    // Alone, it gets the whole limit of 100 per second, never more.
    let rate = f64::from(per_fill) / interval.seconds as f64;
    assert!((90.0..=100.0).contains(&rate), "{b:?}");
    assert!(b.max_tokens >= 1 && b.max_tokens <= 100, "{b:?}");

    // Its next report is answered with the same bucket again, which extends it without resetting it.
    stream.report("edge", &[(SHARED, 0, 20, 0)]);
    let again = actions(&stream.next().await);
    assert_eq!(again[&key(SHARED)], Some((strategy, 1)));
    s.stop().await;
}

/// A bucket whose reports pause for longer than its TTL, but not its TTL and the second after it that
/// the store still counts its share (the Envoy may be enforcing it), comes back under its own share: it
/// was forgotten at its TTL and taken for a newcomer beside its own old share (1.5 of 50 per second).
#[tokio::test]
async fn a_bucket_back_within_its_ttls_margin_keeps_its_share() {
    let s = start(|_| {}).await;
    s.wait_serving(Duration::from_secs(5)).await;
    let mut stream = Raw::open(&s).await.unwrap();
    let rate = |response: &RateLimitQuotaResponse| {
        let (strategy, _) = actions(response)[&key(SHARED)].unwrap();
        let b = token_bucket(&strategy);
        f64::from(b.tokens_per_fill.unwrap()) / b.fill_interval.unwrap().seconds as f64
    };
    stream.report("edge", &[(SHARED, 0, 1, 0)]);
    let first = rate(&stream.next().await);
    assert!(first >= 90.0, "alone, nearly the whole limit: {first}");
    // Silent for 1.4 s: past the TTL of 1 s, within its margin.
    tokio::time::sleep(Duration::from_millis(1400)).await;
    stream.report("edge", &[(SHARED, 1, 60, 0)]);
    let back = rate(&stream.next().await);
    assert!(back >= 60.0, "its share again, not a newcomer's: {back}");
    s.stop().await;
}

/// A report that comes much sooner than a report period after the last one of its bucket costs the
/// store nothing: it is answered with the same assignment, and its requests are counted with the next
/// report, which covers the time since the last counted one.
#[tokio::test]
async fn a_report_that_comes_too_soon_is_merged_into_the_next() {
    // Reports merge within a tenth of the report period: 200 ms here, room enough for a busy machine
    // to send the second report in time (20 ms at the other tests' period would not be).
    let s = serving_with_period(Duration::from_secs(2), Duration::from_secs(4)).await;
    let mut stream = Raw::open(&s).await.unwrap();
    let free: Entries<'_> = &[("generic_key", "free")];
    stream.report("edge", &[(SHARED, 0, 1, 0), (free, 0, 1, 0)]);
    let mut first = HashMap::new();
    while first.len() < 2 {
        first.extend(actions(&stream.next().await));
    }
    let allowed = || async {
        let (_, text) = s.http("GET", "/metrics", "").await;
        let want = "ratelimitd_rlqs_allowed_total{domain=\"edge\",rule=\"generic_key_shared\"} ";
        text.lines()
            .find_map(|l| l.strip_prefix(want)?.trim().parse::<f64>().ok())
    };
    // At once after the subscription: the same token bucket again, nothing counted yet; and the same
    // blanket rule for a bucket without limits.
    stream.report("edge", &[(SHARED, 0, 30, 0), (free, 0, 5, 0)]);
    let mut again = HashMap::new();
    while again.len() < 2 {
        again.extend(actions(&stream.next().await));
    }
    assert_eq!(again, first);
    assert_eq!(allowed().await, Some(1.0));
    // A report past the tenth of a period counts both.
    tokio::time::sleep(Duration::from_millis(250)).await;
    stream.report("edge", &[(SHARED, 0, 10, 0)]);
    stream.next().await;
    assert_eq!(allowed().await, Some(41.0));
    s.stop().await;
}

/// Buckets another Envoy's report has just recomputed wait for their next recomputation (a tenth of a
/// report period after it, one for all the reports that waited): a report of them is answered when
/// that comes, every bucket in one response, as a report recomputed at once is.
#[tokio::test]
async fn a_report_that_waits_for_its_buckets_recomputations_is_answered_in_one_response() {
    // Envoy's period: a tenth of it, 500 ms, is room enough for a busy machine to send the second
    // report before the buckets are due again.
    let s = serving_with_period(Duration::from_secs(5), Duration::from_secs(15)).await;
    let addresses: Vec<String> = (0..20).map(|i| format!("198.51.100.{i}")).collect();
    let buckets: Vec<Vec<(&str, &str)>> = addresses
        .iter()
        .map(|a| vec![("remote_address", a.as_str()), ("path", "/login")])
        .collect();
    let rows: Vec<UsageRow<'_>> = buckets.iter().map(|b| (&b[..], 0, 1, 0)).collect();
    let mut first = Raw::open(&s).await.unwrap();
    let mut second = Raw::open(&s).await.unwrap();
    first.report("edge", &rows);
    let answered = actions(&first.next().await);
    assert_eq!(answered.len(), 20, "recomputed at once: one response");
    let sent = std::time::Instant::now();
    second.report("edge", &rows);
    let response = second.next().await;
    let waited = sent.elapsed();
    let got = actions(&response);
    assert_eq!(
        got.len(),
        20,
        "every bucket in one response, after {waited:?}"
    );
    for b in &buckets {
        let (strategy, _) = got[&key(b)].expect("an assignment");
        assert!(token_bucket(&strategy).tokens_per_fill.unwrap() > 0);
    }
    // Each bucket was recomputed less than 500 ms before, so these waited for the next.
    assert!(
        waited >= Duration::from_millis(100),
        "answered after {waited:?}"
    );
    // Nothing was left for another response.
    let more = tokio::time::timeout(Duration::from_millis(500), second.rx.message()).await;
    assert!(more.is_err(), "another response: {more:?}");
    s.stop().await;
}

#[tokio::test]
async fn unlimited_unmatched_and_zero_limits_get_blanket_rules() {
    let s = start(|_| {}).await;
    s.wait_serving(Duration::from_secs(5)).await;
    let mut stream = Raw::open(&s).await.unwrap();
    let free: Entries<'_> = &[("generic_key", "free")];
    let closed: Entries<'_> = &[("generic_key", "closed")];
    let unknown: Entries<'_> = &[("nothing", "here")];
    let allow_list: Entries<'_> = &[("tenant", "acme")];
    stream.report(
        "edge",
        &[
            (free, 0, 1, 0),
            (closed, 0, 1, 0),
            (unknown, 0, 1, 0),
            (allow_list, 0, 1, 0),
        ],
    );
    let mut got = HashMap::new();
    while got.len() < 4 {
        got.extend(actions(&stream.next().await));
    }
    let allow = Some((Strategy::BlanketRule(0), 1));
    assert_eq!(got[&key(free)], allow, "unlimited");
    assert_eq!(
        got[&key(unknown)],
        allow,
        "no rule: not limited, as ShouldRateLimit answers"
    );
    assert_eq!(got[&key(allow_list)], allow, "a rule without a limit");
    assert_eq!(
        got[&key(closed)],
        Some((Strategy::BlanketRule(1), 1)),
        "a limit of 0"
    );

    // A domain without rules is not limited either.
    let mut other = Raw::open(&s).await.unwrap();
    other.report("unknown-domain", &[(SHARED, 0, 1, 0)]);
    assert_eq!(actions(&other.next().await)[&key(SHARED)], allow);
    s.stop().await;
}

#[tokio::test]
async fn bucket_entries_are_matched_in_the_order_the_rules_nest_them() {
    let s = start(|_| {}).await;
    s.wait_serving(Duration::from_secs(5)).await;
    let mut stream = Raw::open(&s).await.unwrap();
    let login: Entries<'_> = &[("path", "/login"), ("remote_address", "203.0.113.7")];
    stream.report("edge", &[(login, 0, 1, 0)]);
    let (strategy, _) = actions(&stream.next().await)[&key(login)].unwrap();
    // 600 a minute: 10 per second.
    let b = token_bucket(&strategy);
    let rate = f64::from(b.tokens_per_fill.unwrap()) / b.fill_interval.unwrap().seconds as f64;
    assert!((9.0..=10.0).contains(&rate), "{b:?}");
    s.stop().await;
}

/// The buckets deploy/envoy/rlqs.yaml builds (`path=/search`, `api_key=<header>`, `generic_key=global`)
/// meet the rules of examples/config/edge.yaml and are assigned their limits, shared by one Envoy alone.
#[tokio::test]
async fn the_buckets_of_the_envoy_example_meet_the_example_rules() {
    let edge = include_str!("../examples/config/edge.yaml");
    let s = TestServer::start_with_clock(&[("edge.yaml", edge)], Clock::System, fast).await;
    s.wait_serving(Duration::from_secs(5)).await;
    let mut stream = Raw::open(&s).await.unwrap();
    let search: Entries<'_> = &[("path", "/search")];
    let api_key: Entries<'_> = &[("api_key", "k-123")];
    let global: Entries<'_> = &[("generic_key", "global")];
    stream.report(
        "edge",
        &[(search, 0, 1, 0), (api_key, 0, 1, 0), (global, 0, 1, 0)],
    );
    let mut got = HashMap::new();
    while got.len() < 3 {
        got.extend(actions(&stream.next().await));
    }
    let rate = |bucket: Entries<'_>| {
        let (strategy, _) = got[&key(bucket)].unwrap();
        let b = token_bucket(&strategy);
        f64::from(b.tokens_per_fill.unwrap()) / b.fill_interval.unwrap().seconds as f64
    };
    // search: 50 per second; per_api_key: 1 000 per hour; global: 10 000 per second.
    assert!((45.0..=50.0).contains(&rate(search)), "{}", rate(search));
    let per_key = 1_000.0 / 3_600.0;
    assert!(
        (per_key * 0.9..=per_key).contains(&rate(api_key)),
        "{}",
        rate(api_key)
    );
    assert!(
        (9_000.0..=10_000.0).contains(&rate(global)),
        "{}",
        rate(global)
    );
    s.stop().await;
}

async fn write(dir: &Path, text: &str) {
    std::fs::write(dir.join("edge.yaml"), text).unwrap();
}

/// A server on a rules folder, a stream subscribed to `SHARED`, then the folder rewritten without its rule
/// and the stream's next report answered with an abandon: the server, the stream, the folder and when
/// that report was sent (the server's abandon is later).
async fn subscribed_then_abandoned(
    tweak: impl FnOnce(&mut Settings) + Send + 'static,
) -> (TestServer, Raw, tempfile::TempDir, std::time::Instant) {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), RULES).await;
    let root = dir.path().to_path_buf();
    let s = TestServer::start_with_clock(&[], Clock::System, move |s| {
        fast(s);
        s.rules.path = Some(root);
        s.rules.reload_delay = Duration::from_millis(50);
        tweak(s);
    })
    .await;
    s.wait_serving(Duration::from_secs(5)).await;
    let mut stream = Raw::open(&s).await.unwrap();
    stream.report("edge", &[(SHARED, 0, 1, 0)]);
    assert!(matches!(
        actions(&stream.next().await)[&key(SHARED)],
        Some((Strategy::TokenBucket(_), _))
    ));
    write(dir.path(), "domain: edge\ndescriptors:\n  - key: other\n").await;
    wait_for("the new rules", Duration::from_secs(5), async || {
        let (_, text) = s.http("GET", "/rlconfig", "").await;
        (!text.contains("generic_key_shared")).then_some(())
    })
    .await;
    tokio::time::sleep(APART).await;
    let sent = std::time::Instant::now();
    stream.report("edge", &[(SHARED, 1, 5, 0)]);
    assert_eq!(
        actions(&stream.next().await)[&key(SHARED)],
        None,
        "abandoned"
    );
    (s, stream, dir, sent)
}

#[tokio::test]
async fn a_bucket_whose_rule_is_removed_is_abandoned_then_allowed() {
    let (s, mut stream, _rules, _) = subscribed_then_abandoned(|_| {}).await;
    // Traffic creates the bucket again: not limited any more.
    stream.report("edge", &[(SHARED, 0, 1, 0)]);
    assert_eq!(
        actions(&stream.next().await)[&key(SHARED)],
        Some((Strategy::BlanketRule(0), 1))
    );
    assert_eq!(s.metric("ratelimitd_rlqs_abandoned_total").await, Some(1.0));
    // The removed rule's series leave /metrics.
    wait_for("its series gone", Duration::from_secs(5), async || {
        let (_, text) = s.http("GET", "/metrics", "").await;
        (!text.contains("rule=\"generic_key_shared\"")).then_some(())
    })
    .await;
    s.stop().await;
}

/// Reports `bucket` on `stream`, after `meanwhile`, every 200 ms until the stream answers (within 10 s):
/// its answer.
async fn reported_until_answered(
    stream: &mut Raw,
    bucket: Entries<'_>,
    mut meanwhile: impl AsyncFnMut(),
) -> RateLimitQuotaResponse {
    let answered = async {
        loop {
            meanwhile().await;
            stream.report("edge", &[(bucket, 0, 1, 0)]);
            let next = tokio::time::timeout(Duration::from_millis(200), stream.rx.message());
            if let Ok(Ok(Some(r))) = next.await {
                return r;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), answered)
        .await
        .expect("answered within 10 s")
}

/// An abandoned bucket the Envoy never reports again is forgotten one TTL after it was abandoned, like any
/// bucket not reported: it does not hold a place among the replica's buckets for the stream's life.
#[tokio::test]
async fn an_abandoned_bucket_not_reported_again_is_forgotten() {
    let (s, mut stream, _rules, abandoned) =
        subscribed_then_abandoned(|s| s.rlqs.max_buckets = 1).await;
    // The Envoy has forgotten it and reports another bucket: the replica's one place is taken until the
    // abandoned one is forgotten, one TTL (1 s) later.
    let other: Entries<'_> = &[("other", "x")];
    let answered = reported_until_answered(&mut stream, other, async || {}).await;
    assert!(actions(&answered).contains_key(&key(other)));
    assert!(
        abandoned.elapsed() >= Duration::from_secs(1),
        "{:?}",
        abandoned.elapsed()
    );
    s.stop().await;
}

#[tokio::test]
async fn bounds_leave_buckets_unanswered_and_refuse_streams_and_huge_reports() {
    let s = start(|s| {
        s.rlqs.max_buckets_per_stream = 2;
        s.rlqs.max_streams = 1;
        s.rlqs.max_message_bytes = 4096;
    })
    .await;
    s.wait_serving(Duration::from_secs(5)).await;
    let mut stream = Raw::open(&s).await.unwrap();
    let (a, b, c): (Entries<'_>, Entries<'_>, Entries<'_>) =
        (&[("tenant", "a")], &[("tenant", "b")], &[("tenant", "c")]);
    let empty: Entries<'_> = &[];
    let long = "x".repeat(2000);
    let too_long: Entries<'_> = &[("tenant", &long)];
    stream.report(
        "edge",
        &[
            (a, 0, 1, 0),
            (b, 0, 1, 0),
            (c, 0, 1, 0),
            (empty, 0, 1, 0),
            (too_long, 0, 1, 0),
        ],
    );
    let got = actions(&stream.next().await);
    assert_eq!(got.len(), 2, "two buckets a stream at most: {got:?}");
    assert!(got.contains_key(&key(a)) && got.contains_key(&key(b)));
    assert_eq!(unanswered(&s, "too_many_buckets").await, Some(1.0));
    assert_eq!(unanswered(&s, "invalid_bucket").await, Some(2.0));

    // One stream at most.
    let mut second = Raw::open(&s).await;
    let refused = match &mut second {
        Err(status) => status.clone(),
        Ok(raw) => raw.end(Duration::from_secs(5)).await.expect("refused"),
    };
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(
        refused.message().contains("rlqs.max_streams"),
        "{refused:?}"
    );

    // A report past rlqs.max_message_bytes ends the stream.
    let many: Vec<(String, String)> = (0..200)
        .map(|i| ("tenant".to_string(), format!("t{i}")))
        .collect();
    let huge = RateLimitQuotaUsageReports {
        domain: "edge".into(),
        bucket_quota_usages: many
            .iter()
            .map(|(k, v)| BucketQuotaUsage {
                bucket_id: Some(id(&[(k.as_str(), v.as_str())])),
                time_elapsed: None,
                num_requests_allowed: u64::MAX,
                num_requests_denied: u64::MAX,
            })
            .collect(),
    };
    stream.tx.send(huge).unwrap();
    let ended = stream
        .end(Duration::from_secs(5))
        .await
        .expect("an error status");
    assert_eq!(ended.code(), Code::ResourceExhausted, "{ended:?}");
    assert_eq!(
        ended.message(),
        "usage report larger than 4096 bytes (rlqs.max_message_bytes)"
    );
    // The service still answers the next stream.
    drop(stream);
    let mut next = wait_for("a stream again", Duration::from_secs(5), async || {
        Raw::open(&s).await.ok()
    })
    .await;
    next.report("edge", &[(a, 0, 1, 0)]);
    assert!(actions(&next.next().await).contains_key(&key(a)));
    s.stop().await;
}

/// A report is charged no more than the Envoy's token bucket can have admitted: a stream claiming
/// 2^64 - 1 requests for someone's bucket does not spend that descriptor's limit for its
/// `ShouldRateLimit` callers, and the usage counters do not wrap.
#[tokio::test]
async fn a_report_of_more_than_the_envoy_could_admit_is_not_charged_in_full() {
    let s = start(|_| {}).await;
    s.wait_serving(Duration::from_secs(5)).await;
    let mut stream = Raw::open(&s).await.unwrap();
    // 600 a minute: the Envoy is sent about 10 per second.
    let login: Entries<'_> = &[("path", "/login"), ("remote_address", "203.0.113.7")];
    stream.report("edge", &[(login, 0, 1, 0)]);
    assert!(matches!(
        actions(&stream.next().await)[&key(login)],
        Some((Strategy::TokenBucket(_), _))
    ));
    for _ in 0..2 {
        tokio::time::sleep(APART).await;
        stream.report("edge", &[(login, 1, u64::MAX, u64::MAX)]);
        stream.next().await;
    }
    let mut client = s.client().await;
    let answer = ask(
        &mut client,
        request(
            "edge",
            vec![descriptor(&[
                ("remote_address", "203.0.113.7"),
                ("path", "/login"),
            ])],
        ),
    )
    .await;
    let status = &answer.statuses[0];
    assert_eq!(
        answer.overall_code,
        ratelimitd::proto::rate_limit_response::Code::Ok as i32,
        "{answer:?}"
    );
    // Two reports, each at most a token bucket's fill and burst and the time since the last.
    assert!(status.limit_remaining >= 500, "{answer:?}");
    let (_, text) = s.http("GET", "/metrics", "").await;
    let series = |name: &str| {
        let want = format!("{name}{{domain=\"edge\",rule=\"remote_address.path_/login\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&want)?.trim().parse::<f64>().ok())
    };
    // What the Envoy said, saturated: a counter that wrapped would read as a reset.
    assert_eq!(
        series("ratelimitd_rlqs_allowed_total"),
        Some(u64::MAX as f64),
        "{text}"
    );
    assert_eq!(
        series("ratelimitd_rlqs_denied_total"),
        Some(u64::MAX as f64)
    );
    s.stop().await;
}

/// A stream keeps the domain of its first report, and a domain is no longer than a descriptor key: one
/// client cannot make a replica hold a new copy of a megabyte-long domain for each of its buckets.
#[tokio::test]
async fn a_stream_keeps_one_domain_of_bounded_length() {
    let s = start(|_| {}).await;
    s.wait_serving(Duration::from_secs(5)).await;
    let mut stream = Raw::open(&s).await.unwrap();
    stream.report("edge", &[(SHARED, 0, 1, 0)]);
    stream.next().await;
    stream.report("other", &[(SHARED, 0, 1, 0)]);
    let ended = stream.end(Duration::from_secs(5)).await.expect("a status");
    assert_eq!(ended.code(), Code::InvalidArgument, "{ended:?}");
    assert!(
        ended.message().contains("\"other\"") && ended.message().contains("\"edge\""),
        "{ended:?}"
    );

    let mut long = Raw::open(&s).await.unwrap();
    long.report(&"d".repeat(1025), &[(SHARED, 0, 1, 0)]);
    let ended = long.end(Duration::from_secs(5)).await.expect("a status");
    assert_eq!(ended.code(), Code::InvalidArgument, "{ended:?}");
    assert!(
        ended.message().contains("request_limits.max_key_bytes"),
        "{ended:?}"
    );
    s.stop().await;
}

/// `rlqs.max_buckets` bounds the buckets of all streams together, and a bucket an Envoy stopped
/// reporting gives its place back after the assignment TTL.
#[tokio::test]
async fn the_replica_tracks_at_most_max_buckets_and_forgets_idle_ones() {
    let s = start(|s| s.rlqs.max_buckets = 2).await;
    s.wait_serving(Duration::from_secs(5)).await;
    let (a, b, c): (Entries<'_>, Entries<'_>, Entries<'_>) =
        (&[("tenant", "a")], &[("tenant", "b")], &[("tenant", "c")]);
    let mut first = Raw::open(&s).await.unwrap();
    first.report("edge", &[(a, 0, 1, 0), (b, 0, 1, 0)]);
    let mut got = HashMap::new();
    while got.len() < 2 {
        got.extend(actions(&first.next().await));
    }
    let b_reported = std::time::Instant::now();
    let mut second = Raw::open(&s).await.unwrap();
    second.report("edge", &[(c, 0, 1, 0)]);
    wait_for("c refused", Duration::from_secs(5), async || {
        (unanswered(&s, "too_many_buckets").await == Some(1.0)).then_some(())
    })
    .await;
    // The first Envoy goes on with `a` alone; `b` is forgotten one TTL (1 s) after its last report.
    let answered = reported_until_answered(&mut second, c, async || {
        first.report("edge", &[(a, 1, 1, 0)]);
        first.next().await;
    })
    .await;
    assert!(actions(&answered).contains_key(&key(c)));
    assert!(
        b_reported.elapsed() >= Duration::from_secs(1),
        "{:?}",
        b_reported.elapsed()
    );
    s.stop().await;
}

/// When Redis loses a bucket's shares (a restart, FLUSHALL, eviction, an outage longer than the TTL), the
/// Envoy keeps being answered: the member is created again above the version its stream last sent,
/// rather than from 0 (which the stream would drop as older, for as many reports as it had had).
#[tokio::test]
async fn a_bucket_whose_shares_redis_lost_is_answered_on_its_next_report() {
    let redis = common::redis::RedisProcess::start(&[]);
    let url = redis.addr();
    let s = start(move |s| s.redis.url = url).await;
    s.wait_serving(Duration::from_secs(10)).await;
    let mut stream = Raw::open(&s).await.unwrap();
    stream.report("edge", &[(SHARED, 0, 1, 0)]);
    stream.next().await;
    // Nothing allowed: the counter stays empty, so the pool stays whole once the shares are gone.
    for _ in 0..4 {
        tokio::time::sleep(APART).await;
        stream.report("edge", &[(SHARED, 1, 0, 0)]);
        stream.next().await;
    }
    let keys = redis.cli(&["KEYS", "*:rlqs"]);
    let shares = keys.lines().next().expect("the bucket's shares in Redis");
    assert_eq!(redis.cli(&["DEL", shares]).trim(), "1");
    tokio::time::sleep(APART).await;
    stream.report("edge", &[(SHARED, 1, 0, 0)]);
    let got = actions(&stream.next().await);
    assert!(
        matches!(got[&key(SHARED)], Some((Strategy::TokenBucket(_), _))),
        "{got:?}"
    );
    s.stop().await;
}

/// A share one Envoy gives back goes to another Envoy, on another replica, only once the lower assignment
/// has had time to arrive (half a report period, at most a second): until then the first Envoy may still
/// enforce its old share, and both at once would go above the limit.
#[tokio::test]
async fn a_share_given_back_goes_to_another_replica_only_once_the_lower_one_had_time_to_arrive() {
    let redis = common::redis::RedisProcess::start(&[]);
    // Reports every 2 s: the hold is its cap, 1 s, ample for the calls below on a loaded machine.
    let on_redis = |url: String| {
        move |s: &mut Settings| {
            s.redis.url = url;
            s.rlqs.report_period = Duration::from_secs(2);
            s.rlqs.assignment_ttl = Duration::from_secs(4);
        }
    };
    let (one, two) = (
        start(on_redis(redis.addr())).await,
        start(on_redis(redis.addr())).await,
    );
    one.wait_serving(Duration::from_secs(10)).await;
    two.wait_serving(Duration::from_secs(10)).await;
    let rate = |r: &RateLimitQuotaResponse| {
        let b = token_bucket(&actions(r)[&key(SHARED)].unwrap().0);
        f64::from(b.tokens_per_fill.unwrap_or(1)) / b.fill_interval.unwrap().seconds as f64
    };
    let (mut a, mut b) = (
        Raw::open(&one).await.unwrap(),
        Raw::open(&two).await.unwrap(),
    );
    a.report("edge", &[(SHARED, 0, 1, 0)]);
    let a_before = rate(&a.next().await);
    b.report("edge", &[(SHARED, 0, 1, 0)]);
    let b_before = rate(&b.next().await);
    assert!(a_before > 90.0 && b_before < 5.0, "{a_before} {b_before}");
    // Later than a tenth of the period (sooner, a report is merged into the next): a asks for little
    // and comes down; b asks for far more at once, before a can have applied its lower share.
    tokio::time::sleep(Duration::from_millis(250)).await;
    let sent = tokio::time::Instant::now();
    a.report("edge", &[(SHARED, 1, 1, 0)]);
    let a_after = rate(&a.next().await);
    // a's hold began when its report was decided, before this answer reached the test.
    let a_answered = tokio::time::Instant::now();
    b.report("edge", &[(SHARED, 1, 3, 300)]);
    let b_meanwhile = rate(&b.next().await);
    let asked = sent.elapsed();
    assert!(a_after < a_before / 2.0, "a comes down: {a_after}");
    assert!(
        asked < Duration::from_secs(1),
        "both answered within the hold: {asked:?}"
    );
    assert!(
        a_before + b_meanwhile <= 100.0,
        "b got what a still enforces: {a_before} + {b_meanwhile}"
    );
    // Once the hold is over, b's next report gets what a gave back (a's grant is still sized for b's
    // demand as it was: it comes down further at a's next report).
    tokio::time::sleep_until(a_answered + Duration::from_millis(1_100)).await;
    b.report("edge", &[(SHARED, 1, 3, 300)]);
    let b_after = rate(&b.next().await);
    assert!(
        b_after > 60.0 && a_after + b_after <= 100.0,
        "{a_after} + {b_after}"
    );
    one.stop().await;
    two.stop().await;
}

/// A report covering more than a fixed window charges that window only its part of the report, not all
/// of it: a 5 s report of a per-second rule would otherwise fill that second's counter and deny its
/// `ShouldRateLimit` callers for the rest of it.
#[tokio::test]
async fn a_report_longer_than_a_window_charges_the_window_its_part() {
    let s = start(|s| {
        s.rlqs.report_period = Duration::from_millis(500);
        s.rlqs.assignment_ttl = Duration::from_secs(3);
    })
    .await;
    s.wait_serving(Duration::from_secs(5)).await;
    let mut stream = Raw::open(&s).await.unwrap();
    stream.report("edge", &[(SHARED, 0, 1, 0)]);
    stream.next().await;
    // The Envoy's next report comes 2.5 s later (the time this test stands for Envoy's 5 s): 100
    // requests admitted over it, 40 a second on a rule of 100 a second.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    stream.report("edge", &[(SHARED, 2, 100, 0)]);
    stream.next().await;
    let mut client = s.client().await;
    let answer = ask(
        &mut client,
        request("edge", vec![descriptor(&[("generic_key", "shared")])]),
    )
    .await;
    assert_eq!(
        answer.overall_code,
        ratelimitd::proto::rate_limit_response::Code::Ok as i32,
        "{answer:?}"
    );
    // The window's part of 100 over 2.5 s is 40 (or nothing, had the window turned since).
    assert!(answer.statuses[0].limit_remaining >= 55, "{answer:?}");
    s.stop().await;
}

async fn unanswered(s: &TestServer, reason: &str) -> Option<f64> {
    let want = format!("ratelimitd_rlqs_unanswered_total{{reason=\"{reason}\"}} ");
    let (_, text) = s.http("GET", "/metrics", "").await;
    text.lines()
        .find_map(|l| l.strip_prefix(&want)?.trim().parse::<f64>().ok())
}

#[tokio::test]
async fn a_silent_stream_is_closed_after_ten_report_periods() {
    let s = start(|_| {}).await;
    s.wait_serving(Duration::from_secs(5)).await;
    let mut stream = Raw::open(&s).await.unwrap();
    let started = std::time::Instant::now();
    let ended = stream.end(Duration::from_secs(10)).await.expect("a status");
    assert_eq!(ended.code(), Code::Unavailable, "{ended:?}");
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(1900), "{waited:?}");
    s.stop().await;
}

#[tokio::test]
async fn shutdown_ends_the_streams_at_once_so_envoys_move_to_another_replica() {
    let s = start(|s| s.shutdown.grace_period = Duration::from_secs(20)).await;
    s.wait_serving(Duration::from_secs(5)).await;
    let mut stream = Raw::open(&s).await.unwrap();
    stream.report("edge", &[(SHARED, 0, 1, 0)]);
    stream.next().await;
    let started = std::time::Instant::now();
    s.shutdown.cancel();
    let ended = stream.end(Duration::from_secs(5)).await.expect("a status");
    assert_eq!(ended.code(), Code::Unavailable, "{ended:?}");
    s.handle.await.unwrap().unwrap();
    // Well within the 20 s grace period: the stream did not hold the drain.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn metrics_by_domain_and_rule_show_subscribers_assignments_and_usage() {
    let s = start(|_| {}).await;
    s.wait_serving(Duration::from_secs(5)).await;
    let mut stream = Raw::open(&s).await.unwrap();
    stream.report("edge", &[(SHARED, 0, 1, 0)]);
    stream.next().await;
    tokio::time::sleep(APART).await;
    stream.report("edge", &[(SHARED, 0, 30, 7)]);
    stream.next().await;
    let (_, text) = s.http("GET", "/metrics", "").await;
    let series = |name: &str| {
        let want = format!("{name}{{domain=\"edge\",rule=\"generic_key_shared\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&want)?.trim().parse::<f64>().ok())
    };
    assert_eq!(series("ratelimitd_rlqs_subscribers"), Some(1.0), "{text}");
    assert_eq!(series("ratelimitd_rlqs_allowed_total"), Some(31.0));
    assert_eq!(series("ratelimitd_rlqs_denied_total"), Some(7.0));
    let assigned = series("ratelimitd_rlqs_assigned_tokens_per_second").unwrap();
    assert!(assigned > 0.0 && assigned <= 100.0, "{assigned}");
    assert!(text.contains("ratelimitd_rlqs_streams 1"), "{text}");
    drop(stream);
    wait_for("the stream gone", Duration::from_secs(5), async || {
        (s.metric("ratelimitd_rlqs_streams").await == Some(0.0)).then_some(())
    })
    .await;
    s.stop().await;
}

#[tokio::test]
async fn with_rlqs_off_the_service_is_not_there_and_reflection_lists_it_when_on() {
    let off = start(|s| s.rlqs.enabled = false).await;
    off.wait_serving(Duration::from_secs(5)).await;
    match Raw::open(&off).await {
        Err(status) => assert_eq!(status.code(), Code::Unimplemented),
        Ok(mut raw) => assert_eq!(
            raw.end(Duration::from_secs(5)).await.map(|s| s.code()),
            Some(Code::Unimplemented)
        ),
    }
    off.stop().await;

    use tonic_reflection::pb::v1::{
        server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
        ServerReflectionRequest,
    };
    let on = start(|_| {}).await;
    let mut reflection = ServerReflectionClient::new(on.channel().await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut replies = reflection
        .server_reflection_info(futures_util::stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let reply = replies.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = reply.message_response else {
        panic!("{reply:?}")
    };
    assert!(
        list.service
            .iter()
            .any(|s| s.name == "envoy.service.rate_limit_quota.v3.RateLimitQuotaService"),
        "{list:?}"
    );
    on.stop().await;
}

/// The fixed window of a rule (a minute) starts and runs on the Redis server's clock, as the counters
/// do: an Envoy on a replica whose clock is two hours ahead and one on a replica on time share one
/// window of the bucket, and what their reports added to it is told apart from what others spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_with_a_skewed_clock_shares_the_window_the_counters_use() {
    let redis = common::redis::RedisProcess::start(&[]);
    let on_redis = |url: String| {
        move |s: &mut Settings| {
            fast(s);
            s.redis.url = url;
        }
    };
    // The replica ahead uses a clock that stands still two hours ahead.
    let on_time = start(on_redis(redis.addr())).await;
    let ahead = Clock::manual(Clock::System.now_millis() + 2 * 3_600_000);
    let skewed =
        TestServer::start_with_clock(&[("edge.yaml", RULES)], ahead, on_redis(redis.addr())).await;
    on_time.wait_serving(Duration::from_secs(10)).await;
    skewed.wait_serving(Duration::from_secs(10)).await;
    let minute_of = |redis: &common::redis::RedisProcess| {
        let time = redis.cli(&["TIME"]);
        let secs: u64 = time.lines().next().unwrap().trim().parse().unwrap();
        secs / 60 * 60_000
    };
    // Tried again with another bucket when the minute turns during a try.
    for attempt in 0..3 {
        let address = format!("203.0.113.{attempt}");
        let bucket: Entries<'_> = &[("remote_address", &address), ("path", "/login")];
        let before = minute_of(&redis);
        let mut a = Raw::open(&skewed).await.unwrap();
        a.report("edge", &[(bucket, 0, 5, 0)]);
        a.next().await;
        // The second, on the replica on time, is counted and shared in the same window state.
        let b = Raw::open(&on_time).await.unwrap();
        b.report("edge", &[(bucket, 0, 7, 0)]);
        let window_of = || {
            let keys = redis.cli(&["KEYS", &format!("*{address}*:rlqs")]);
            let shares = keys.lines().next()?.to_owned();
            let window = redis.cli(&["HGET", &shares, "~0"]);
            let fields: Vec<f64> = window
                .split_whitespace()
                .map(|f| f.parse().ok())
                .collect::<Option<_>>()?;
            Some((window, fields))
        };
        let (window, fields) = wait_for(
            "the second report shared",
            Duration::from_secs(5),
            // The first's 5 alone, until the second's are in: 12 in one window, or 7 had its
            // window started apart.
            async || window_of().filter(|(_, f)| f.get(1).is_some_and(|added| *added > 5.0)),
        )
        .await;
        if minute_of(&redis) != before {
            continue;
        }
        assert_eq!(
            fields[0], before as f64,
            "the window starts on the Redis clock: {window:?}"
        );
        assert_eq!(
            fields[1], 12.0,
            "both Envoys' hits added to one window: {window:?}"
        );
        on_time.stop().await;
        skewed.stop().await;
        return;
    }
    panic!("the minute turned during every try");
}

/// With the Redis that keeps the shares down, a report is answered at once by `on_backend_error`, as a
/// `ShouldRateLimit` call is: the shares' call goes through the store's breaker and deadline rather than
/// waiting for the client's own timeout. (The bucket's counters are on a per-second Redis that stays
/// up, so that only the shares' call meets the outage.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_shares_redis_down_a_report_is_answered_at_once() {
    let mut main = common::redis::RedisProcess::start(&[]);
    let per_second = common::redis::RedisProcess::start(&[]);
    let (main_url, second_url) = (main.addr(), per_second.addr());
    let s = start(move |s| {
        s.redis.url = main_url;
        // A client timeout far longer than the answer may take: a call that waited for it would show.
        s.redis.timeout = Duration::from_secs(10);
        s.redis_per_second = Some(ratelimitd::store::redis::RedisSettings {
            url: second_url,
            ..Default::default()
        });
        s.on_backend_error = ratelimitd::limiter::OnBackendError::Deny;
    })
    .await;
    s.wait_serving(Duration::from_secs(10)).await;
    let mut stream = Raw::open(&s).await.unwrap();
    stream.report("edge", &[(SHARED, 0, 1, 0)]);
    assert!(matches!(
        actions(&stream.next().await)[&key(SHARED)],
        Some((Strategy::TokenBucket(_), _))
    ));
    main.kill();
    // `ShouldRateLimit` of a minute rule (counted on the main Redis) meets the outage: denied at once.
    let mut client = s.client().await;
    let minute = request(
        "edge",
        vec![descriptor(&[("remote_address", "a"), ("path", "/login")])],
    );
    wait_for("the outage seen", Duration::from_secs(5), async || {
        let answer = ask(&mut client, minute.clone()).await;
        (answer.overall_code == ratelimitd::proto::rate_limit_response::Code::OverLimit as i32)
            .then_some(())
    })
    .await;
    // Not so soon that it is merged into the next (the lost connections open the breaker at once).
    tokio::time::sleep(APART).await;
    let started = std::time::Instant::now();
    stream.report("edge", &[(SHARED, 1, 3, 0)]);
    let got = actions(&stream.next().await);
    let waited = started.elapsed();
    assert_eq!(
        got[&key(SHARED)],
        Some((Strategy::BlanketRule(1), 1)),
        "DENY_ALL by on_backend_error"
    );
    assert!(waited < Duration::from_secs(2), "answered after {waited:?}");
    s.stop().await;
}

/// The quota service labels a rule as `ShouldRateLimit` does (`detailed_metric` puts the value in the
/// label), so that both protocols' series of a rule join.
#[tokio::test]
async fn a_rule_is_labelled_alike_over_both_protocols() {
    const DETAILED: &str = "domain: edge\ndescriptors:\n  - key: team\n    detailed_metric: true\n    rate_limit: {unit: minute, requests_per_unit: 600}\n";
    let s = TestServer::start_with_clock(&[("edge.yaml", DETAILED)], Clock::System, fast).await;
    s.wait_serving(Duration::from_secs(5)).await;
    let mut client = s.client().await;
    ask(
        &mut client,
        request("edge", vec![descriptor(&[("team", "blue")])]),
    )
    .await;
    let mut stream = Raw::open(&s).await.unwrap();
    let blue: Entries<'_> = &[("team", "blue")];
    stream.report("edge", &[(blue, 0, 4, 0)]);
    stream.next().await;
    let (_, text) = s.http("GET", "/metrics", "").await;
    let labels = "{domain=\"edge\",rule=\"team_blue\"} ";
    for name in [
        "ratelimit_service_rate_limit_total_hits",
        "ratelimitd_rlqs_allowed_total",
        "ratelimitd_rlqs_subscribers",
    ] {
        let want = format!("{name}{labels}");
        assert!(
            text.lines().any(|l| l.starts_with(&want)),
            "{want} in:\n{text}"
        );
    }
    s.stop().await;
}

/// A rule kept by a reload that now hashes the values it labels (`hash_value` turned on) takes its
/// plain-value series out of the quota service's metrics too, not only out of `ShouldRateLimit`'s.
#[tokio::test]
async fn a_rule_that_hashes_its_values_after_a_reload_leaves_no_plain_quota_series() {
    const DETAILED: &str = "domain: edge\ndescriptors:\n  - key: team\n    detailed_metric: true\n    rate_limit: {unit: minute, requests_per_unit: 600}\n";
    const HASHED: &str = "domain: edge\ndescriptors:\n  - key: team\n    detailed_metric: true\n    hash_value: true\n    rate_limit: {unit: minute, requests_per_unit: 601}\n";
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), DETAILED).await;
    let root = dir.path().to_path_buf();
    let s = TestServer::start_with_clock(&[], Clock::System, move |s| {
        fast(s);
        s.rules.path = Some(root);
        s.rules.reload_delay = Duration::from_millis(50);
    })
    .await;
    s.wait_serving(Duration::from_secs(5)).await;
    let mut stream = Raw::open(&s).await.unwrap();
    let blue: Entries<'_> = &[("team", "blue")];
    stream.report("edge", &[(blue, 0, 4, 0)]);
    stream.next().await;
    let (_, text) = s.http("GET", "/metrics", "").await;
    assert!(
        text.contains("ratelimitd_rlqs_allowed_total{domain=\"edge\",rule=\"team_blue\"}"),
        "{text}"
    );

    write(dir.path(), HASHED).await;
    wait_for("the new rules", Duration::from_secs(5), async || {
        let (_, text) = s.http("GET", "/rlconfig", "").await;
        text.contains("requests_per_unit=601").then_some(())
    })
    .await;
    tokio::time::sleep(APART).await;
    stream.report("edge", &[(blue, 2, 0, 0)]);
    stream.next().await;
    let text = wait_for(
        "the plain series gone",
        Duration::from_secs(5),
        async || {
            let (_, text) = s.http("GET", "/metrics", "").await;
            (!text.contains("team_blue")).then_some(text)
        },
    )
    .await;
    assert!(
        text.contains("ratelimitd_rlqs_allowed_total{domain=\"edge\",rule=\"team_sha256-"),
        "{text}"
    );
    s.stop().await;
}

/// An Envoy refused by a full bucket holds no share: it is not counted a subscriber.
#[tokio::test]
async fn an_envoy_refused_by_a_full_bucket_is_no_subscriber() {
    let s = start(|s| s.rlqs.max_envoys_per_bucket = 1).await;
    s.wait_serving(Duration::from_secs(5)).await;
    let mut first = Raw::open(&s).await.unwrap();
    first.report("edge", &[(SHARED, 0, 1, 0)]);
    first.next().await;
    let second = Raw::open(&s).await.unwrap();
    second.report("edge", &[(SHARED, 0, 1, 0)]);
    wait_for("the bucket full", Duration::from_secs(5), async || {
        unanswered(&s, "bucket_full").await.filter(|n| *n >= 1.0)
    })
    .await;
    let subscribers = "ratelimitd_rlqs_subscribers{domain=\"edge\",rule=\"generic_key_shared\"}";
    assert_eq!(s.metric(subscribers).await, Some(1.0));
    s.stop().await;
}

/// A token bucket shared by `ShouldRateLimit` callers and quota Envoys: a report of more than the
/// bucket has left is still counted (into bounded debt, as usage reported after the fact), so the
/// callers are denied what the Envoys admitted, rather than the report being dropped and both admitting
/// the limit.
#[tokio::test]
async fn a_report_past_what_a_token_bucket_has_left_is_counted() {
    let s = start(|_| {}).await;
    s.wait_serving(Duration::from_secs(5)).await;
    let bucketed = &[("generic_key", "bucketed")];
    let mut client = s.client().await;
    let rls = || request("edge", vec![descriptor(bucketed)]);
    let first = ask(&mut client, rls()).await;
    assert_eq!(first.statuses[0].limit_remaining, 9, "{first:?}");
    let mut stream = Raw::open(&s).await.unwrap();
    stream.report("edge", &[(bucketed, 0, 1, 0)]);
    stream.next().await;
    // Nine admitted, with 8 left: counted all the same.
    tokio::time::sleep(APART).await;
    stream.report("edge", &[(bucketed, 1, 9, 0)]);
    stream.next().await;
    let after = ask(&mut client, rls()).await;
    assert_eq!(
        after.overall_code,
        ratelimitd::proto::rate_limit_response::Code::OverLimit as i32,
        "{after:?}"
    );
    s.stop().await;
}
