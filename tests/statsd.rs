//! The statsd stream, into the UDP and TCP listener of `common::statsd`: the reference's stat names with
//! the right counts after known traffic, as plain statsd (over TCP, the default, and UDP) and as
//! DogStatsD with `EXTRA_TAGS`, on the memory store and on Redis; counts kept while the server is away
//! and delivered when it returns; and a dead statsd port that changes no decision, adds no latency
//! worth noting, and is logged once, not at every flush.

mod common;

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use common::{
    ask, descriptor,
    redis::{free_port, RedisProcess},
    request, start_binary,
    statsd::StatsdListener,
    wait_for, TestServer,
};
use ratelimitd::{
    clock::Clock,
    proto::rate_limit_response::Code,
    settings::{BackendKind, OnBackendError, Settings, StatsdProtocol},
};

const RULES: &str = r#"
domain: api
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: beta
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: tenant
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: route
    value_to_metric: true
    descriptors:
      - key: method
        rate_limit: {unit: minute, requests_per_unit: 10}
  - key: remote_address
    value: 10.1.2.3
    rate_limit: {unit: minute, requests_per_unit: 10}
"#;

const WITHIN: Duration = Duration::from_secs(10);

/// Statsd to `port` on loopback, flushed every 50 ms.
fn statsd_to(s: &mut Settings, port: u16, protocol: StatsdProtocol) {
    s.statsd.enabled = true;
    s.statsd.host = "127.0.0.1".into();
    s.statsd.port = port;
    s.statsd.protocol = Some(protocol);
    s.statsd.flush_interval = Duration::from_millis(50);
}

/// Sends the known traffic: 10 ShouldRateLimit calls, one of them refused.
async fn known_traffic(s: &TestServer) {
    let mut c = s.client().await;
    common::far_from_a_minute_end().await;
    for want in [Code::Ok, Code::Ok, Code::OverLimit] {
        let answer = ask(&mut c, request("api", vec![descriptor(&[("user", "u1")])])).await;
        assert_eq!(answer.overall_code(), want);
    }
    for _ in 0..2 {
        let answer = ask(&mut c, request("api", vec![descriptor(&[("beta", "b1")])])).await;
        assert_eq!(answer.overall_code(), Code::Ok, "shadow mode answers OK");
    }
    ask(
        &mut c,
        request("api", vec![descriptor(&[("tenant", "acme")])]),
    )
    .await;
    ask(
        &mut c,
        request(
            "api",
            vec![descriptor(&[("route", "/x"), ("method", "GET")])],
        ),
    )
    .await;
    ask(
        &mut c,
        request("api", vec![descriptor(&[("remote_address", "10.1.2.3")])]),
    )
    .await;
    ask(
        &mut c,
        request("elsewhere", vec![descriptor(&[("user", "u1")])]),
    )
    .await;
    let refused = c
        .should_rate_limit(request("", vec![descriptor(&[("user", "u1")])]))
        .await;
    assert!(refused.is_err());
}

/// What [`known_traffic`] counts, by the reference's names.
fn expected() -> BTreeMap<String, u64> {
    let rule = |path: &str, field: &str, n: u64| {
        (
            format!("ratelimit.service.rate_limit.api.{path}.{field}"),
            n,
        )
    };
    [
        rule("user", "total_hits", 3),
        rule("user", "within_limit", 2),
        rule("user", "near_limit", 1),
        rule("user", "over_limit", 1),
        rule("beta", "total_hits", 2),
        rule("beta", "within_limit", 1),
        rule("beta", "near_limit", 1),
        rule("beta", "over_limit", 1),
        rule("beta", "shadow_mode", 1),
        rule("tenant_acme", "total_hits", 1),
        rule("tenant_acme", "within_limit", 1),
        rule("route_/x.method", "total_hits", 1),
        rule("route_/x.method", "within_limit", 1),
        rule("remote_address_10_1_2_3", "total_hits", 1),
        rule("remote_address_10_1_2_3", "within_limit", 1),
        ("ratelimit.service.rate_limit.domain_not_found".into(), 1),
        (
            "ratelimit.service.call.should_rate_limit.service_error".into(),
            1,
        ),
        ("ratelimit.service.config_load_success".into(), 1),
        ("ratelimit_server.ShouldRateLimit.total_requests".into(), 10),
    ]
    .into_iter()
    .collect()
}

/// Checks what `statsd` received after [`known_traffic`] and the server's last flush: every expected
/// counter exactly (nothing sent twice, nothing else sent), the health checks counted, and the response
/// time timer standing for every call. The tags are `name_suffix` on each name (plain statsd) or
/// `line_suffix` at the end of each line (DogStatsD).
fn check_received(statsd: &StatsdListener, name_suffix: &str, line_suffix: &str) {
    let counters = statsd.counters();
    for (name, want) in expected() {
        let name = format!("{name}{name_suffix}");
        assert_eq!(counters.get(&name), Some(&want), "{name} in {counters:#?}");
    }
    let checks = format!("ratelimit_server.Check.total_requests{name_suffix}");
    assert!(counters.get(&checks).is_some_and(|n| *n >= 1), "{checks}");
    let known: Vec<String> = expected()
        .into_keys()
        .chain([checks.clone()])
        .map(|name| format!("{name}{name_suffix}"))
        .collect();
    for name in counters.keys() {
        assert!(
            known.contains(name) || *name == checks,
            "unexpected counter {name}"
        );
    }
    // A timer line stands for 1 / rate calls.
    let timer = format!("ratelimit_server.ShouldRateLimit.response_time{name_suffix}:");
    let mut calls = 0.0;
    for line in statsd.lines() {
        assert!(line.ends_with(line_suffix), "{line}");
        let Some(rest) = line.strip_prefix(&timer) else {
            continue;
        };
        let rest = rest.strip_suffix(line_suffix).unwrap_or(rest);
        let mut parts = rest.split('|');
        let ms: f64 = parts.next().unwrap().parse().unwrap();
        assert_eq!(parts.next(), Some("ms"), "{line}");
        assert!(ms > 0.0 && ms < 1000.0, "{line}");
        calls += parts
            .next()
            .and_then(|r| r.strip_prefix('@'))
            .map_or(1.0, |r| 1.0 / r.parse::<f64>().unwrap());
    }
    assert_eq!(calls.round(), 10.0, "response_time calls");
}

/// Runs the known traffic on a server built by `start` and checks what arrives, and that Prometheus
/// still counts beside it.
async fn reference_names_arrive(
    s: TestServer,
    statsd: &StatsdListener,
    name_suffix: &str,
    line_suffix: &str,
) {
    s.wait_serving(WITHIN).await;
    known_traffic(&s).await;
    let (_, prometheus) = s.http("GET", "/metrics", "").await;
    assert!(
        prometheus
            .contains("ratelimit_service_rate_limit_total_hits{domain=\"api\",rule=\"user\"} 3"),
        "Prometheus beside statsd:\n{prometheus}"
    );
    assert!(
        prometheus.contains("ratelimit_service_total_requests{grpc_method=\"ShouldRateLimit\"} 10"),
        "{prometheus}"
    );
    // Shutdown sends the last flush.
    s.stop().await;
    statsd
        .wait_counter(
            &format!("ratelimit_server.ShouldRateLimit.total_requests{name_suffix}"),
            10,
            WITHIN,
        )
        .await;
    check_received(statsd, name_suffix, line_suffix);
}

#[tokio::test]
async fn reference_names_arrive_over_tcp_from_the_memory_store() {
    let statsd = StatsdListener::start().await;
    let port = statsd.addr.port();
    let s = TestServer::start(&[("api.yaml", RULES)], |s| {
        statsd_to(s, port, StatsdProtocol::Tcp)
    })
    .await;
    reference_names_arrive(s, &statsd, "", "").await;
}

#[tokio::test]
async fn reference_names_arrive_over_udp_from_redis_with_tags_in_the_name() {
    let redis = RedisProcess::start(&[]);
    let statsd = StatsdListener::start().await;
    let port = statsd.addr.port();
    let s = TestServer::start_with_clock(&[("api.yaml", RULES)], Clock::System, |s| {
        s.redis.url = format!("127.0.0.1:{}", redis.port);
        statsd_to(s, port, StatsdProtocol::Udp);
        s.statsd.extra_tags = [("env".to_string(), "test".to_string())].into();
    })
    .await;
    reference_names_arrive(s, &statsd, ".__env=test", "").await;
}

#[tokio::test]
async fn dogstatsd_lines_carry_the_extra_tags() {
    let statsd = StatsdListener::start().await;
    let port = statsd.addr.port();
    let s = TestServer::start(&[("api.yaml", RULES)], |s| {
        statsd_to(s, port, StatsdProtocol::Udp);
        s.statsd.dogstatsd = true;
        s.statsd.extra_tags = [
            ("env".to_string(), "test".to_string()),
            ("team".to_string(), "edge".to_string()),
        ]
        .into();
    })
    .await;
    reference_names_arrive(s, &statsd, "", "|#env:test,team:edge").await;
}

#[tokio::test]
async fn counts_made_while_statsd_is_away_arrive_when_it_returns() {
    let port = free_port();
    let s = TestServer::start(&[("api.yaml", RULES)], |s| {
        statsd_to(s, port, StatsdProtocol::Tcp)
    })
    .await;
    let mut c = s.client().await;
    for _ in 0..2 {
        ask(&mut c, request("api", vec![descriptor(&[("user", "u1")])])).await;
    }
    wait_for("a failed flush", WITHIN, async || {
        let (_, text) = s.http("GET", "/metrics", "").await;
        text.lines()
            .any(|l| {
                l.strip_prefix("ratelimitd_statsd_send_failures_total ")
                    .is_some_and(|n| n != "0")
            })
            .then_some(())
    })
    .await;
    let statsd = StatsdListener::start_on(port).await;
    statsd
        .wait_counter(
            "ratelimit.service.rate_limit.api.user.total_hits",
            2,
            WITHIN,
        )
        .await;
    ask(&mut c, request("api", vec![descriptor(&[("user", "u1")])])).await;
    s.stop().await;
    let counters = statsd
        .wait_counter(
            "ratelimit.service.rate_limit.api.user.total_hits",
            3,
            WITHIN,
        )
        .await;
    assert_eq!(
        counters["ratelimit.service.rate_limit.api.user.total_hits"], 3,
        "every hit once"
    );
}

/// Requests Redis could not decide are the reference's `redis_error` whatever `on_backend_error`
/// answered them with; answered with the error, they are not also a `service_error`.
#[tokio::test]
async fn requests_redis_could_not_decide_are_redis_errors_whatever_the_answer() {
    for (policy, want) in [
        (OnBackendError::Allow, Code::Ok),
        (OnBackendError::Deny, Code::OverLimit),
        (OnBackendError::Error, Code::Unknown),
        // Decided from this replica's memory instead.
        (OnBackendError::Local, Code::Ok),
    ] {
        let statsd = StatsdListener::start().await;
        let port = statsd.addr.port();
        let nowhere = free_port();
        let s = TestServer::start_with_clock(&[("api.yaml", RULES)], Clock::System, |s| {
            s.backend = Some(BackendKind::Redis);
            s.redis.url = format!("127.0.0.1:{nowhere}");
            s.on_backend_error = policy;
            statsd_to(s, port, StatsdProtocol::Tcp);
        })
        .await;
        let mut c = s.client().await;
        for _ in 0..3 {
            let answer = c
                .should_rate_limit(request("api", vec![descriptor(&[("tenant", "t")])]))
                .await;
            let code = answer.map_or(Code::Unknown, |a| a.into_inner().overall_code());
            assert_eq!(code, want, "{policy:?}");
        }
        s.stop().await;
        let counters = statsd
            .wait_counter("ratelimit_server.ShouldRateLimit.total_requests", 3, WITHIN)
            .await;
        let errors = |kind: &str| {
            counters
                .get(&format!("ratelimit.service.call.should_rate_limit.{kind}"))
                .copied()
        };
        assert_eq!(
            (errors("redis_error"), errors("service_error")),
            (Some(3), None),
            "{policy:?}: {counters:#?}"
        );
    }
}

/// The median and the 99th percentile of `times`.
fn percentiles(mut times: Vec<Duration>) -> (Duration, Duration) {
    times.sort();
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_statsd_port_changes_no_decision_and_no_latency_worth_noting() {
    // Nothing listens on either port; flushes are attempted every 10 ms.
    let dead = |protocol| {
        let port = free_port();
        move |s: &mut Settings| {
            statsd_to(s, port, protocol);
            s.statsd.flush_interval = Duration::from_millis(10);
        }
    };
    let servers = [
        (
            "off",
            TestServer::start(&[("api.yaml", RULES)], |_| {}).await,
        ),
        (
            "dead udp",
            TestServer::start(&[("api.yaml", RULES)], dead(StatsdProtocol::Udp)).await,
        ),
        (
            "dead tcp",
            TestServer::start(&[("api.yaml", RULES)], dead(StatsdProtocol::Tcp)).await,
        ),
    ];
    let mut clients = Vec::new();
    for (_, s) in &servers {
        clients.push(s.client().await);
    }
    let mut times = vec![Vec::new(); servers.len()];
    for i in 0..300 {
        // Each user's limit of 2: OK, OK, OVER_LIMIT, on every server alike.
        let user = format!("u{}", i / 3);
        let mut codes = Vec::new();
        for (n, client) in clients.iter_mut().enumerate() {
            let started = Instant::now();
            let answer = ask(client, request("api", vec![descriptor(&[("user", &user)])])).await;
            times[n].push(started.elapsed());
            codes.push(answer.overall_code());
        }
        let want = if i % 3 == 2 {
            Code::OverLimit
        } else {
            Code::Ok
        };
        assert_eq!(codes, [want; 3], "request {i}");
    }
    for (_, s) in &servers[1..] {
        let (_, text) = s.http("GET", "/metrics", "").await;
        let failures: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("ratelimitd_statsd_send_failures_total "))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        assert!(failures >= 1.0, "the flushes did fail:\n{text}");
    }
    let (off_p50, off_p99) = percentiles(times[0].clone());
    for (n, (what, _)) in servers.iter().enumerate().skip(1) {
        let (p50, p99) = percentiles(times[n].clone());
        eprintln!(
            "statsd {what}: p50 {p50:?} p99 {p99:?}; statsd off: p50 {off_p50:?} p99 {off_p99:?}"
        );
        assert!(
            p50 < off_p50 + Duration::from_millis(1),
            "{what}: p50 {p50:?} against {off_p50:?} with statsd off"
        );
    }
    for (_, s) in servers {
        s.stop().await;
    }
}

#[test]
fn a_dead_statsd_port_is_logged_once_not_at_every_flush() {
    let rules = tempfile::tempdir().unwrap();
    std::fs::write(rules.path().join("api.yaml"), RULES).unwrap();
    let mut cmd = common::binary(rules.path());
    cmd.env("USE_STATSD", "true")
        .env("STATSD_HOST", "127.0.0.1")
        .env("STATSD_PORT", free_port().to_string())
        .env("STATS_FLUSH_INTERVAL", "20ms");
    let running = start_binary(&mut cmd);
    assert!(running.serving_within(WITHIN));
    // What the first flush owed stays owed: every flush has something to send, and fails.
    let deadline = Instant::now() + WITHIN;
    loop {
        let (_, text) = common::http_request(running.http, "GET", "/metrics", "");
        let failures: u64 = text
            .lines()
            .find_map(|l| l.strip_prefix("ratelimitd_statsd_send_failures_total "))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        if failures >= 5 {
            break;
        }
        assert!(Instant::now() < deadline, "{failures} failed flushes");
        std::thread::sleep(Duration::from_millis(20));
    }
    running.wait_log("cannot send stats to statsd", WITHIN);
    let log = running.log.lock().unwrap().clone();
    assert_eq!(
        log.matches("cannot send stats to statsd").count(),
        1,
        "one warning, not one per flush:\n{log}"
    );
}
