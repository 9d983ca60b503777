//! `/metrics` after known traffic: names, labels and values.

mod common;

use std::time::Duration;

use common::{ask, descriptor, request, statsd::StatsdListener, wait_for, TestServer};
use ratelimitd::proto::RateLimitServiceClient;

const RULES: &str = r#"
domain: web
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: preview
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: api_key
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: route
    value_to_metric: true
    descriptors:
      - key: method
        rate_limit: {unit: minute, requests_per_unit: 10}
"#;

/// The value of one sample line `name{labels} value`.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.strip_prefix(' '))
        })
        .unwrap_or_else(|| panic!("no sample {series} in:\n{text}"))
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_known_traffic_by_rule() {
    let s = TestServer::start(&[("web.yaml", RULES)], |_| {}).await;
    let mut c = s.client().await;
    for (entries, times) in [
        (&[("user", "u1")][..], 3),
        (&[("preview", "p")], 2),
        (&[("api_key", "sk_live_RAW")], 1),
        (&[("route", "/orders"), ("method", "POST")], 1),
    ] {
        for _ in 0..times {
            ask(&mut c, request("web", vec![descriptor(entries)])).await;
        }
    }
    c.should_rate_limit(request("", vec![descriptor(&[("user", "x")])]))
        .await
        .unwrap_err();
    ask(
        &mut c,
        request(
            "nowhere",
            vec![descriptor(&[("user", "x")]), descriptor(&[("user", "y")])],
        ),
    )
    .await;
    // A /json body that is no request is an invalid request too, answered with an error.
    assert_eq!(s.http("POST", "/json", "{not json").await.0, 400);

    let (code, text) = s.http("GET", "/metrics", "").await;
    assert_eq!(code, 200);
    let rule = |name: &str, rule: &str| {
        sample(&text, &format!("{name}{{domain=\"web\",rule=\"{rule}\"}}"))
    };
    assert_eq!(rule("ratelimit_service_rate_limit_total_hits", "user"), 3.0);
    assert_eq!(
        rule("ratelimit_service_rate_limit_within_limit", "user"),
        2.0
    );
    assert_eq!(rule("ratelimit_service_rate_limit_over_limit", "user"), 1.0);
    // Limit 2, ratio 0.8: the threshold is 1, so the second hit is near the limit.
    assert_eq!(rule("ratelimit_service_rate_limit_near_limit", "user"), 1.0);
    assert_eq!(rule("rate_limit_exceeded_total", "user"), 1.0);
    assert_eq!(
        rule("ratelimit_service_rate_limit_shadow_mode", "preview"),
        1.0
    );
    assert_eq!(
        rule(
            "ratelimit_service_rate_limit_within_limit",
            "route_/orders.method"
        ),
        1.0
    );
    // A rule's counters from its first hit on: its first denial shows in rate() then. Those it cannot
    // move (shadow mode for a rule that is not in it) are not exported until they do.
    assert_eq!(
        rule(
            "ratelimit_service_rate_limit_over_limit",
            "route_/orders.method"
        ),
        0.0
    );
    for absent in [
        "ratelimit_service_rate_limit_shadow_mode{domain=\"web\",rule=\"route_/orders.method\"}",
        "ratelimit_service_rate_limit_over_limit_with_local_cache{domain=\"web\",rule=\"route_/orders.method\"}",
    ] {
        assert!(!text.contains(absent), "{absent} in:\n{text}");
    }
    assert!(
        !text.contains("sk_live_RAW"),
        "raw API key in /metrics:\n{text}"
    );
    assert!(text.contains("rule=\"api_key_sha256-"), "{text}");

    for (metric, want) in [
        ("ratelimitd_requests_total{result=\"ok\"}", 7.0),
        ("ratelimitd_requests_total{result=\"over_limit\"}", 1.0),
        ("ratelimitd_requests_total{result=\"error\"}", 2.0),
        (
            "ratelimitd_request_errors_total{kind=\"invalid_request\"}",
            2.0,
        ),
        // The /json body that is no request was never read as one: not timed.
        ("rate_limit_check_duration_seconds_count", 9.0),
        (
            "ratelimitd_backend_call_duration_seconds_count{backend=\"memory\"}",
            7.0,
        ),
        // Each descriptor of the request, as the reference counts them.
        ("ratelimit_service_rate_limit_domain_not_found", 2.0),
        // Exported before their first event, which rate() would not see otherwise.
        ("ratelimitd_request_errors_total{kind=\"backend\"}", 0.0),
        ("ratelimitd_backend_failures_total{answer=\"error\"}", 0.0),
        ("ratelimit_service_global_shadow_mode", 0.0),
        ("ratelimit_service_config_load_success", 1.0),
        ("ratelimit_service_config_load_error", 0.0),
        ("ratelimitd_backend_up{backend=\"memory\"}", 1.0),
        ("ratelimitd_backend_breaker_open{backend=\"memory\"}", 0.0),
        // Every gRPC call by method, as the reference's Prometheus mapping names it: the refused one too.
        (
            "ratelimit_service_total_requests{grpc_method=\"ShouldRateLimit\"}",
            9.0,
        ),
        (
            "ratelimit_service_response_time_seconds_count{grpc_method=\"ShouldRateLimit\"}",
            9.0,
        ),
    ] {
        assert_eq!(sample(&text, metric), want, "{metric}");
    }
    assert!(text.contains("rate_limit_check_duration_seconds_bucket{le=\"0.0001\"}"));
    assert!(
        text.contains("ratelimitd_rules_info{fingerprint=\""),
        "{text}"
    );
    assert!(text.contains(&format!(
        "ratelimitd_build_info{{version=\"{}\"}} 1",
        env!("CARGO_PKG_VERSION")
    )));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_top_lists_the_most_denied_descriptors_hashed() {
    let s = TestServer::start(&[("web.yaml", RULES)], |_| {}).await;
    let mut c = s.client().await;
    for (key, value, times) in [
        ("user", "attacker", 12),
        ("user", "other", 4),
        ("api_key", "sk_live_RAW", 13),
    ] {
        for _ in 0..times {
            ask(&mut c, request("web", vec![descriptor(&[(key, value)])])).await;
        }
    }
    let (code, body) = s.http("GET", "/debug/top?limit=5", "").await;
    assert_eq!(code, 200);
    let json: serde_json::Value = serde_json::from_str(&body).unwrap();
    let offenders = json["offenders"].as_array().unwrap();
    assert_eq!(offenders[0]["descriptor"], "web user=attacker");
    assert_eq!(offenders[0]["denied"], 10);
    let api = offenders
        .iter()
        .find(|o| {
            o["descriptor"]
                .as_str()
                .unwrap()
                .starts_with("web api_key=sha256-")
        })
        .unwrap_or_else(|| panic!("{body}"));
    assert_eq!(api["denied"], 3);
    assert_eq!(
        offenders
            .iter()
            .find(|o| o["descriptor"] == "web user=other")
            .unwrap()["denied"],
        2
    );
    assert!(!body.contains("sk_live_RAW"), "{body}");
    assert_eq!(json["capacity"], 100);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hash_value_rules_are_hashed_even_with_no_hashed_keys() {
    let rules = "domain: api\ndescriptors:\n  - key: token\n    hash_value: true\n    rate_limit: {unit: minute, requests_per_unit: 1}\n";
    let s = TestServer::start(&[("api.yaml", rules)], |s| s.hashed_keys.clear()).await;
    let mut c = s.client().await;
    for _ in 0..3 {
        ask(
            &mut c,
            request("api", vec![descriptor(&[("token", "RAW-TOKEN-123")])]),
        )
        .await;
    }
    let (_, top) = s.http("GET", "/debug/top", "").await;
    assert!(top.contains("api token=sha256-"), "{top}");
    assert!(!top.contains("RAW-TOKEN-123"), "{top}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_cannot_grow_metrics_without_bound() {
    let s = TestServer::start(&[("web.yaml", RULES)], |s| {
        s.metrics.max_values_per_rule = 50;
    })
    .await;
    let (_, before) = s.http("GET", "/metrics", "").await;
    let mut c = s.client().await;
    // 3 000 requests each with an override and entry keys never seen before, and 3 000 distinct
    // values on a `detailed_metric` rule.
    for i in 0..3000 {
        let key = format!("k{i}");
        let over = common::with_override(descriptor(&[(key.as_str(), "v")]), 10, 2);
        ask(&mut c, request("web", vec![over])).await;
        let value = format!("key-{i}");
        ask(
            &mut c,
            request("web", vec![descriptor(&[("api_key", &value)])]),
        )
        .await;
    }
    let (_, after) = s.http("GET", "/metrics", "").await;
    eprintln!(
        "/metrics: {} bytes before, {} after",
        before.len(),
        after.len()
    );
    assert!(
        after.len() < before.len() + 64 * 1024,
        "/metrics grew from {} to {} bytes",
        before.len(),
        after.len()
    );
    assert!(
        !after.contains("k2999"),
        "caller-chosen keys are no label values"
    );
    // Every override shares one label; the detailed rule has its 50 values, then one for the rest.
    assert_eq!(
        sample(
            &after,
            "ratelimit_service_rate_limit_total_hits{domain=\"web\",rule=\"override\"}"
        ),
        3000.0
    );
    assert_eq!(
        sample(
            &after,
            "ratelimit_service_rate_limit_total_hits{domain=\"web\",rule=\"api_key (other values)\"}"
        ),
        2950.0
    );
    let api_key_series = after
        .lines()
        .filter(|l| {
            l.starts_with("ratelimit_service_rate_limit_total_hits{domain=\"web\",rule=\"api_key_")
        })
        .count();
    assert_eq!(api_key_series, 50);
    s.stop().await;
}

/// A caller's `hits_addend` near 2^64 counts as the most its limit is decided on (the limit plus one), as
/// the store sees it: the rule's hit counters neither wrap (a counter that went down reads as a reset)
/// nor reach their end and stay there (where later traffic would no longer show).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_hits_addend_counts_as_its_limits_bound_and_counters_keep_counting() {
    let s = TestServer::start(&[("web.yaml", RULES)], |_| {}).await;
    let mut c = s.client().await;
    let counters = async || {
        let (_, text) = s.http("GET", "/metrics", "").await;
        // A series shows from its first count on.
        ["total_hits", "over_limit"].map(|name| {
            let series =
                format!("ratelimit_service_rate_limit_{name}{{domain=\"web\",rule=\"user\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(series.as_str())?.parse::<f64>().ok())
                .unwrap_or(0.0)
        })
    };
    common::far_from_a_minute_end().await;
    for _ in 0..5 {
        ask(&mut c, request("web", vec![descriptor(&[("user", "u1")])])).await;
    }
    assert_eq!(counters().await, [5.0, 3.0]);
    for _ in 0..2 {
        let huge = common::with_hits(descriptor(&[("user", "u1")]), u64::MAX - 2);
        ask(&mut c, request("web", vec![huge])).await;
    }
    // A limit of 2: each counts 3.
    assert_eq!(counters().await, [11.0, 9.0]);
    ask(&mut c, request("web", vec![descriptor(&[("user", "u1")])])).await;
    assert_eq!(counters().await, [12.0, 10.0], "later traffic still shows");
    s.stop().await;
}

/// A call not answered within the deadline its caller sent (`grpc-timeout`) is counted as one Envoy
/// gave up on; one answered within it, or sent without one, is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_decided_after_their_deadline_are_counted() {
    let s = TestServer::start(&[("web.yaml", RULES)], |_| {}).await;
    let mut c = s.client().await;
    let late = r#"ratelimitd_calls_past_deadline_total{grpc_method="ShouldRateLimit"}"#;
    // The deadline as a header alone, so that the client's own timer cuts nothing.
    let sent = |timeout: Option<&'static str>| {
        let mut call = tonic::Request::new(request("web", vec![descriptor(&[("user", "u")])]));
        if let Some(timeout) = timeout {
            call.metadata_mut()
                .insert("grpc-timeout", timeout.parse().unwrap());
        }
        call
    };
    c.should_rate_limit(sent(Some("10S"))).await.unwrap();
    c.should_rate_limit(sent(None)).await.unwrap();
    assert_eq!(sample(&s.http("GET", "/metrics", "").await.1, late), 0.0);
    // A nanosecond: no decision fits in it (answered or not, it is late). A call cut by tonic's timer
    // is counted when hyper drops it, which can be just after its answer has gone out: waited for.
    let _ = c.should_rate_limit(sent(Some("1n"))).await;
    common::wait_for(
        "the late call counted",
        std::time::Duration::from_secs(5),
        async || {
            let text = s.http("GET", "/metrics", "").await.1;
            (sample(&text, late) == 1.0).then_some(())
        },
    )
    .await;
    s.stop().await;
}

/// A value written in a rules file under a hashed key is hashed wherever the rule is named, since it is
/// someone's key; a wildcard or `cidr:` pattern there is no one's value, and is named as written, as it is
/// under any other key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn written_patterns_under_hashed_keys_are_named_as_written_and_written_values_hashed() {
    const PARTNERS: &str = r#"
domain: web
descriptors:
  - key: x-api-key
    value: "partner-*"
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: x-api-key
    value: "sk_live_WRITTEN"
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: x-api-key
    value: "cidr:10.0.0.0/8"
    rate_limit: {unit: minute, requests_per_unit: 10}
"#;
    let s = TestServer::start(&[("web.yaml", PARTNERS)], |_| {}).await;
    let mut c = s.client().await;
    for key in ["partner-7", "sk_live_WRITTEN", "10.1.2.3"] {
        ask(
            &mut c,
            request("web", vec![descriptor(&[("x-api-key", key)])]),
        )
        .await;
    }
    let (_, text) = s.http("GET", "/metrics", "").await;
    let hits = |rule: &str| {
        sample(
            &text,
            &format!("ratelimit_service_rate_limit_total_hits{{domain=\"web\",rule=\"{rule}\"}}"),
        )
    };
    assert_eq!(hits("x-api-key_partner-*"), 1.0);
    assert_eq!(hits("x-api-key_cidr:10.0.0.0/8"), 1.0);
    assert!(
        !text.contains("WRITTEN") && !text.contains("partner-7"),
        "{text}"
    );
    assert!(text.contains("rule=\"x-api-key_sha256-"), "{text}");
    let (_, rlconfig) = s.http("GET", "/rlconfig", "").await;
    assert!(
        rlconfig.contains("web.x-api-key_partner-*: unit=MINUTE"),
        "{rlconfig}"
    );
    assert!(
        rlconfig.contains("web.x-api-key_cidr:10.0.0.0/8: unit=MINUTE"),
        "{rlconfig}"
    );
    assert!(!rlconfig.contains("WRITTEN"), "{rlconfig}");
    s.stop().await;
}

/// A request whose value is empty is labelled by the rule as written; the requests after it still get a
/// label of their own value (a caller sending an empty header once no longer folds every later value
/// into the rule's label until the next reload).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_value_leaves_the_next_values_their_own_labels() {
    const RULES: &str = r#"
domain: web
descriptors:
  - key: team
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: route
    value_to_metric: true
    descriptors:
      - key: method
        rate_limit: {unit: minute, requests_per_unit: 10}
"#;
    let s = TestServer::start(&[("web.yaml", RULES)], |_| {}).await;
    let mut c = s.client().await;
    for value in ["", "alice", "bob"] {
        for entries in [
            &[("team", value)][..],
            &[("route", value), ("method", "GET")],
        ] {
            ask(&mut c, request("web", vec![descriptor(entries)])).await;
        }
    }
    let (_, text) = s.http("GET", "/metrics", "").await;
    let hits = |rule: &str| {
        sample(
            &text,
            &format!("ratelimit_service_rate_limit_total_hits{{domain=\"web\",rule=\"{rule}\"}}"),
        )
    };
    for (rule, want) in [
        ("team", 1.0),
        ("team_alice", 1.0),
        ("team_bob", 1.0),
        ("route.method", 1.0),
        ("route_alice.method", 1.0),
        ("route_bob.method", 1.0),
    ] {
        assert_eq!(hits(rule), want, "rule {rule} in:\n{text}");
    }
    s.stop().await;
}

/// Long request values take a rule's labels too, but not without bound: a `detailed_metric` rule's
/// labels of request values hold 128 bytes each on average besides the rule's own name (the default
/// 1 000 labels of rule `team`: 132 000 bytes), and the values past that share the rule's
/// `(other values)` label.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_values_share_a_label_once_a_rule_holds_its_bytes() {
    const RULES: &str = r#"
domain: web
descriptors:
  - key: team
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 10}
"#;
    let s = TestServer::start(&[("web.yaml", RULES)], |_| {}).await;
    let mut c = s.client().await;
    for i in 0..200 {
        // "team_" and 1 000 bytes: 1 005 a label, 131 of them in 132 000 bytes.
        let value = format!("{i:0>1000}");
        ask(
            &mut c,
            request("web", vec![descriptor(&[("team", &value)])]),
        )
        .await;
    }
    let (_, text) = s.http("GET", "/metrics", "").await;
    let own = text
        .lines()
        .filter(|l| {
            l.starts_with("ratelimit_service_rate_limit_total_hits{domain=\"web\",rule=\"team_")
        })
        .count();
    assert_eq!(own, 131, "labels of their own value");
    assert_eq!(
        sample(
            &text,
            "ratelimit_service_rate_limit_total_hits{domain=\"web\",rule=\"team (other values)\"}"
        ),
        69.0
    );
    assert!(text.len() < 1 << 20, "/metrics is {} bytes", text.len());
    s.stop().await;
}

/// `/debug/top` lists what was denied: not a quota descriptor over its limit in a request another quota
/// descriptor let through. A value that could read as several words of a name is quoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_top_lists_only_denials_and_quotes_ambiguous_values() {
    const RULES: &str = r#"
domain: web
descriptors:
  - key: plan
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: org
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1}
"#;
    let s = TestServer::start(&[("web.yaml", RULES)], |_| {}).await;
    let mut c = s.client().await;
    for _ in 0..3 {
        // `plan` is over its limit from the second request on; `org` is not, so each request passes.
        let both = vec![
            descriptor(&[("plan", "free")]),
            descriptor(&[("org", "acme")]),
        ];
        let answer = ask(&mut c, request("web", both)).await;
        assert_eq!(answer.overall_code, 1, "OK");
        ask(
            &mut c,
            request("web", vec![descriptor(&[("user", "alice method=POST")])]),
        )
        .await;
    }
    let (_, body) = s.http("GET", "/debug/top?limit=10", "").await;
    let json: serde_json::Value = serde_json::from_str(&body).unwrap();
    let offenders = json["offenders"].as_array().unwrap();
    assert_eq!(offenders.len(), 1, "{body}");
    assert_eq!(
        offenders[0]["descriptor"],
        r#"web user="alice method=POST""#
    );
    assert_eq!(offenders[0]["denied"], 2);
    s.stop().await;
}

/// A bucket is near its limit near its capacity: with a burst of 20 over 10 a minute and the ratio 0.8,
/// the hits past 16 of 20, not past 8 of 10 (of which a full bucket's first 20 hits showed only 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn near_limit_is_measured_against_a_buckets_burst() {
    const RULES: &str = r#"
domain: web
descriptors:
  - key: bucket
    rate_limit: {unit: minute, requests_per_unit: 10, algorithm: token_bucket, burst: 20}
  - key: gcra
    rate_limit: {unit: minute, requests_per_unit: 10, algorithm: gcra, burst: 20}
"#;
    let s = TestServer::start(&[("web.yaml", RULES)], |_| {}).await;
    let mut c = s.client().await;
    for key in ["bucket", "gcra"] {
        for _ in 0..20 {
            ask(&mut c, request("web", vec![descriptor(&[(key, "b")])])).await;
        }
    }
    let (_, text) = s.http("GET", "/metrics", "").await;
    for key in ["bucket", "gcra"] {
        let series = |name: &str| {
            sample(
                &text,
                &format!("ratelimit_service_rate_limit_{name}{{domain=\"web\",rule=\"{key}\"}}"),
            )
        };
        assert_eq!(series("within_limit"), 20.0, "{key}");
        assert_eq!(series("near_limit"), 4.0, "{key}");
    }
    s.stop().await;
}

/// A server on the rules file `web.yaml` in `dir` (written as `rules`), reloading it as it changes,
/// sending statsd to `statsd` every `flush`.
async fn reloading_with_statsd(
    dir: &std::path::Path,
    rules: &str,
    statsd: &StatsdListener,
    flush: Duration,
) -> TestServer {
    std::fs::write(dir.join("web.yaml"), rules).unwrap();
    let (root, port) = (dir.to_owned(), statsd.addr.port());
    TestServer::start(&[], move |s| {
        s.rules.path = Some(root);
        s.rules.reload_delay = Duration::from_millis(100);
        s.statsd.enabled = true;
        s.statsd.host = "127.0.0.1".into();
        s.statsd.port = port;
        s.statsd.flush_interval = flush;
    })
    .await
}

/// A reload takes away the series of the rules it removed, with xDS as routes come and go: a removed
/// rule's series and a rule's labels of request values once it no longer asks for them leave
/// `/metrics`, the rules still there keep their counts, and statsd is sent a rule written back again
/// from its new first hit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_removes_the_series_of_the_rules_it_took_away() {
    const BEFORE: &str = r#"
domain: web
descriptors:
  - key: kept
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: gone
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: team
    detailed_metric: true
    rate_limit: {unit: hour, requests_per_unit: 10}
"#;
    // `gone` removed, `team` no longer detailed; a limit changed so that /rlconfig shows the swap.
    const AFTER: &str = r#"
domain: web
descriptors:
  - key: kept
    rate_limit: {unit: hour, requests_per_unit: 11}
  - key: team
    rate_limit: {unit: hour, requests_per_unit: 10}
"#;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("web.yaml");
    let statsd = StatsdListener::start().await;
    let s = reloading_with_statsd(dir.path(), BEFORE, &statsd, Duration::from_millis(50)).await;
    let series = |text: &str, rule: &str| {
        let label = format!("rule=\"{rule}\"");
        text.lines().filter(|l| l.contains(&label)).count()
    };
    let hit = |key: &'static str, value: &'static str| {
        let grpc_addr = s.grpc_addr;
        async move {
            let mut c = RateLimitServiceClient::connect(format!("http://{grpc_addr}"))
                .await
                .unwrap();
            ask(&mut c, request("web", vec![descriptor(&[(key, value)])])).await;
        }
    };
    let swap = async |text: &str, limit: &str| {
        std::fs::write(&file, text).unwrap();
        wait_for("the rules swapped", Duration::from_secs(10), async || {
            s.http("GET", "/rlconfig", "")
                .await
                .1
                .contains(limit)
                .then_some(())
        })
        .await;
    };
    for (key, value) in [
        ("kept", "a"),
        ("gone", "a"),
        ("gone", "b"),
        ("team", "alice"),
    ] {
        hit(key, value).await;
    }
    let gone_hits = "ratelimit.service.rate_limit.web.gone.total_hits";
    statsd
        .wait_counter(gone_hits, 2, Duration::from_secs(10))
        .await;
    let (_, text) = s.http("GET", "/metrics", "").await;
    assert!(
        series(&text, "gone") > 0 && series(&text, "team_alice") > 0,
        "{text}"
    );

    swap(AFTER, "web.kept: unit=HOUR requests_per_unit=11,").await;
    hit("kept", "a").await;
    hit("team", "bob").await;
    let (_, text) = s.http("GET", "/metrics", "").await;
    assert_eq!(
        series(&text, "gone"),
        0,
        "the removed rule's series:\n{text}"
    );
    assert_eq!(
        series(&text, "team_alice"),
        0,
        "a value label of a rule no longer detailed:\n{text}"
    );
    let hits = |rule: &str| {
        sample(
            &text,
            &format!("ratelimit_service_rate_limit_total_hits{{domain=\"web\",rule=\"{rule}\"}}"),
        )
    };
    assert_eq!(hits("kept"), 2.0, "a kept rule counts on:\n{text}");
    assert_eq!(hits("team"), 1.0, "{text}");

    // Written back, the rule counts from zero, and statsd is sent its new hits (more of them than it
    // was sent before the removal).
    swap(BEFORE, "web.kept: unit=HOUR requests_per_unit=10,").await;
    for value in ["c", "d", "e"] {
        hit("gone", value).await;
    }
    let (_, text) = s.http("GET", "/metrics", "").await;
    assert_eq!(
        sample(
            &text,
            "ratelimit_service_rate_limit_total_hits{domain=\"web\",rule=\"gone\"}"
        ),
        3.0,
        "{text}"
    );
    s.stop().await;
    let sent = statsd
        .wait_counter(gone_hits, 5, Duration::from_secs(10))
        .await;
    assert_eq!(sent[gone_hits], 5, "statsd was sent every hit once");
}

/// A rule kept by a reload that now hashes the values its labels carry (`hash_value` turned on, as an
/// operator does on finding customers' names in /metrics) no longer shows the values it labelled
/// before: those series go, and its new labels are hashed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_that_hashes_its_values_after_a_reload_shows_no_value_it_labelled_before() {
    const PLAIN: &str = "domain: web\ndescriptors:\n  - key: tenant\n    detailed_metric: true\n    rate_limit: {unit: hour, requests_per_unit: 10}\n";
    const HASHED: &str = "domain: web\ndescriptors:\n  - key: tenant\n    detailed_metric: true\n    hash_value: true\n    rate_limit: {unit: hour, requests_per_unit: 11}\n";
    let dir = tempfile::tempdir().unwrap();
    let statsd = StatsdListener::start().await;
    let s = reloading_with_statsd(dir.path(), PLAIN, &statsd, Duration::from_secs(3_600)).await;
    let mut c = s.client().await;
    let hit = async |c: &mut _| {
        ask(
            c,
            request("web", vec![descriptor(&[("tenant", "acme-corp-42")])]),
        )
        .await;
    };
    hit(&mut c).await;
    let (_, text) = s.http("GET", "/metrics", "").await;
    assert!(text.contains("rule=\"tenant_acme-corp-42\""), "{text}");

    std::fs::write(dir.path().join("web.yaml"), HASHED).unwrap();
    wait_for("the rules swapped", Duration::from_secs(10), async || {
        let rules = s.http("GET", "/rlconfig", "").await.1;
        rules.contains("requests_per_unit=11").then_some(())
    })
    .await;
    hit(&mut c).await;
    let (_, text) = s.http("GET", "/metrics", "").await;
    assert!(
        !text.contains("acme-corp-42"),
        "the value labelled before the reload:\n{text}"
    );
    let hashed: Vec<&str> = text
        .lines()
        .filter(|l| {
            l.starts_with("ratelimit_service_rate_limit_total_hits{domain=\"web\",rule=\"tenant_")
        })
        .collect();
    assert_eq!(hashed.len(), 1, "{text}");
    assert!(hashed[0].ends_with(" 1"), "{hashed:?}");
    s.stop().await;
}

/// The hits a rule took since statsd's last flush are sent even when a reload removes the rule before
/// the next one: here no flush runs until the server stops, by which time the rule was removed and
/// written back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statsd_is_sent_the_hits_of_a_rule_removed_before_its_flush() {
    const WITH: &str = "domain: web\ndescriptors:\n  - key: gone\n    rate_limit: {unit: hour, requests_per_unit: 10}\n";
    const WITHOUT: &str = "domain: web\ndescriptors:\n  - key: other\n    rate_limit: {unit: hour, requests_per_unit: 10}\n";
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("web.yaml");
    let statsd = StatsdListener::start().await;
    let s = reloading_with_statsd(dir.path(), WITH, &statsd, Duration::from_secs(3_600)).await;
    let mut c = s.client().await;
    for (text, shows) in [
        (None, "web.gone"),
        (Some(WITHOUT), "web.other"),
        (Some(WITH), "web.gone"),
    ] {
        if let Some(text) = text {
            std::fs::write(&file, text).unwrap();
        }
        wait_for(shows, Duration::from_secs(10), async || {
            let rules = s.http("GET", "/rlconfig", "").await.1;
            rules.contains(shows).then_some(())
        })
        .await;
        if shows == "web.gone" {
            for _ in 0..2 {
                ask(&mut c, request("web", vec![descriptor(&[("gone", "x")])])).await;
            }
        }
    }
    s.stop().await;
    let name = "ratelimit.service.rate_limit.web.gone.total_hits";
    let hits = statsd.wait_counter(name, 4, Duration::from_secs(10)).await;
    assert_eq!(hits[name], 4, "every hit once");
}
