//! What a caller sees of the limiter's decisions, as one table: each row is a rules file and the
//! questions asked of it in order, with the answer each must get. The table runs unchanged against a
//! server on the memory store, on standalone Redis and on a 3-master Redis Cluster (where the counters
//! of one request land on different nodes), so every row must get the same answers from each.
//!
//! Only rows whose answers go through the store are here; what the rules alone decide (unknown domains,
//! allow-list entries, `unlimited`, `replaces`, global shadow mode, headers, exact reset times under a
//! manual clock) is covered by the limiter's unit tests and `grpc_api.rs`. Windows are an hour or longer,
//! so the real clock the Redis stores use never refills a limit while a row runs.

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{
    ask, descriptor,
    redis::{RedisCluster, RedisProcess},
    request, request_costing, with_hits, with_override, TestServer,
};
use ratelimitd::{
    clock::Clock,
    proto::{
        rate_limit_response::{rate_limit::Unit, Code},
        RateLimitDescriptor, RateLimitResponse,
    },
    settings::{BackendKind, RedisTopology},
};

/// One rules file (its domain is the row's name) and the questions asked of it, in order.
#[derive(Clone)]
struct Row {
    name: &'static str,
    /// Whether the server counts every descriptor of a denied request (`consume_on_deny`).
    consume_on_deny: bool,
    /// The `descriptors:` of the row's rules file.
    rules: String,
    steps: Vec<Step>,
}

/// One question and the answer it must get, as [`read`] writes it.
#[derive(Clone)]
struct Step {
    descriptors: Vec<RateLimitDescriptor>,
    /// The request's `hits_addend` (0 means 1).
    hits: u32,
    want: &'static str,
}

fn step(descriptors: Vec<RateLimitDescriptor>, want: &'static str) -> Step {
    step_costing(descriptors, 0, want)
}

fn step_costing(descriptors: Vec<RateLimitDescriptor>, hits: u32, want: &'static str) -> Step {
    Step {
        descriptors,
        hits,
        want,
    }
}

fn one(entries: &[(&str, &str)]) -> Vec<RateLimitDescriptor> {
    vec![descriptor(entries)]
}

/// The same question asked once for each answer in `wants`, in turn.
fn again(descriptors: impl Fn() -> Vec<RateLimitDescriptor>, wants: &[&'static str]) -> Vec<Step> {
    wants.iter().map(|want| step(descriptors(), want)).collect()
}

/// Questions on one entry each, `(key, value, the answer it must get)`, asked in turn.
fn each(questions: &[(&str, &str, &'static str)]) -> Vec<Step> {
    questions
        .iter()
        .map(|&(key, value, want)| step(one(&[(key, value)]), want))
        .collect()
}

fn pair(a: &[(&str, &str)], b: &[(&str, &str)]) -> Vec<RateLimitDescriptor> {
    vec![descriptor(a), descriptor(b)]
}

/// One descriptor limited by its request override.
fn overridden(
    entries: &[(&str, &str)],
    requests_per_unit: u32,
    unit: Unit,
) -> Vec<RateLimitDescriptor> {
    vec![with_override(
        descriptor(entries),
        requests_per_unit,
        unit as i32,
    )]
}

fn row(name: &'static str, rules: &str, steps: Vec<Step>) -> Row {
    Row {
        name,
        consume_on_deny: false,
        rules: rules.to_owned(),
        steps,
    }
}

/// Each algorithm with a capacity of 3: a cost above the capacity is denied and changes nothing, a cost
/// that uses the quota up exactly is allowed, and a cost of 0 checks without counting.
fn algorithm_row(name: &'static str, rate_limit: &str) -> Row {
    let d = || one(&[("user", "u")]);
    let check_only = || vec![with_hits(descriptor(&[("user", "u")]), 0)];
    row(
        name,
        &format!("\n  - key: user\n    rate_limit: {rate_limit}\n"),
        vec![
            step_costing(d(), 4, "OVER: OVER 0 left of three"),
            step_costing(d(), 2, "OK: OK 1 left of three"),
            step_costing(d(), 2, "OVER: OVER 0 left of three"),
            step(d(), "OK: OK 0 left of three"),
            step(d(), "OVER: OVER 0 left of three"),
            step(check_only(), "OK: OK 0 left of three"),
            step(one(&[("user", "other")]), "OK: OK 2 left of three"),
        ],
    )
}

/// Each algorithm as a budget of 10 fed usage reports of 3 after each response (`count_over_limit`):
/// the fourth report takes it past its limit, is answered over and counted, and the checks after it
/// (cost 0 before a request, or 1) are over; a report beside another descriptor is counted even when
/// that one denies the request, which consumes nothing else.
fn budget_row(name: &'static str, rate_limit: &str) -> Row {
    let d = || one(&[("user", "u")]);
    let check_only = || vec![with_hits(descriptor(&[("user", "u")]), 0)];
    let beside = |user: &str| pair(&[("user", user)], &[("closed", "c")]);
    row(
        name,
        &format!(
            "\n  - key: user\n    rate_limit: {rate_limit}\n  - key: closed\n    rate_limit: {{unit: hour, requests_per_unit: 0, name: closed}}\n"
        ),
        vec![
            step(check_only(), "OK: OK 10 left of budget"),
            step_costing(d(), 3, "OK: OK 7 left of budget"),
            step_costing(d(), 3, "OK: OK 4 left of budget"),
            step_costing(d(), 3, "OK: OK 1 left of budget"),
            step_costing(d(), 3, "OVER: OVER 0 left of budget"),
            step(check_only(), "OVER: OVER 0 left of budget"),
            step(d(), "OVER: OVER 0 left of budget"),
            step_costing(beside("v"), 4, "OVER: OK 6 left of budget, OVER 0 left of closed"),
            step(vec![with_hits(descriptor(&[("user", "v")]), 0)], "OK: OK 6 left of budget"),
        ],
    )
}

/// A request on a wide limit (10) and a narrow one (1), then one the narrow limit denies (`then[0]`),
/// then one on the wide limit alone (`then[1]`).
fn wide_and_narrow_row(name: &'static str, consume_on_deny: bool, then: [&'static str; 2]) -> Row {
    let both = || pair(&[("wide", "w")], &[("narrow", "n")]);
    Row {
        consume_on_deny,
        ..row(
            name,
            r#"
  - key: wide
    rate_limit: {unit: hour, requests_per_unit: 10, name: wide}
  - key: narrow
    rate_limit: {unit: hour, requests_per_unit: 1, name: narrow}
"#,
            vec![
                step(both(), "OK: OK 9 left of wide, OK 0 left of narrow"),
                step(both(), then[0]),
                step(one(&[("wide", "w")]), then[1]),
            ],
        )
    }
}

fn table() -> Vec<Row> {
    [
        matching_rows(),
        algorithm_rows(),
        request_rows(),
        several_descriptor_rows(),
    ]
    .concat()
}

/// Which rule a request matches, shown by the limit it reports and the counter it shares.
fn matching_rows() -> Vec<Row> {
    vec![
        row(
            "match_value_then_key",
            r#"
  - key: plan
    value: gold
    rate_limit: {unit: hour, requests_per_unit: 3, name: gold}
  - key: plan
    rate_limit: {unit: hour, requests_per_unit: 1, name: any_plan}
  - key: route
    value: /login
    descriptors:
      - key: method
        value: POST
        rate_limit: {unit: hour, requests_per_unit: 1, name: login_post}
"#,
            [
                each(&[
                    ("plan", "gold", "OK: OK 2 left of gold"),
                    ("plan", "free", "OK: OK 0 left of any_plan"),
                    ("plan", "trial", "OK: OK 0 left of any_plan"),
                    ("plan", "free", "OVER: OVER 0 left of any_plan"),
                    ("plan", "gold", "OK: OK 1 left of gold"),
                ]),
                // Nested rules: both entries make the counter.
                again(
                    || one(&[("route", "/login"), ("method", "POST")]),
                    &[
                        "OK: OK 0 left of login_post",
                        "OVER: OVER 0 left of login_post",
                    ],
                ),
                each(&[("route", "/login", "OK: OK no limit")]),
            ]
            .concat(),
        ),
        row(
            "match_wildcards",
            r#"
  - key: path
    value: /api/*
    rate_limit: {unit: hour, requests_per_unit: 2, name: api}
  - key: path
    value: /static/*
    share_threshold: true
    rate_limit: {unit: hour, requests_per_unit: 2, name: static}
  - key: addr
    value: "cidr:10.0.0.0/8"
    rate_limit: {unit: hour, requests_per_unit: 1, name: per_address}
  - key: addr
    value: "cidr:192.168.0.0/16"
    share_threshold: true
    rate_limit: {unit: hour, requests_per_unit: 1, name: per_network}
"#,
            each(&[
                ("path", "/api/a", "OK: OK 1 left of api"),
                ("path", "/api/b", "OK: OK 1 left of api"),
                ("path", "/static/a", "OK: OK 1 left of static"),
                ("path", "/static/b", "OK: OK 0 left of static"),
                ("path", "/static/c", "OVER: OVER 0 left of static"),
                ("path", "/other", "OK: OK no limit"),
                ("addr", "10.0.0.1", "OK: OK 0 left of per_address"),
                ("addr", "10.0.0.2", "OK: OK 0 left of per_address"),
                ("addr", "10.0.0.1", "OVER: OVER 0 left of per_address"),
                ("addr", "192.168.1.1", "OK: OK 0 left of per_network"),
                ("addr", "192.168.2.2", "OVER: OVER 0 left of per_network"),
            ]),
        ),
    ]
}

/// Each algorithm, through the same questions.
fn algorithm_rows() -> Vec<Row> {
    vec![
        algorithm_row(
            "fixed_window",
            "{unit: hour, requests_per_unit: 3, name: three}",
        ),
        algorithm_row(
            "sliding_window",
            "{unit: hour, requests_per_unit: 3, name: three, algorithm: sliding_window}",
        ),
        algorithm_row(
            "sliding_log",
            "{unit: hour, requests_per_unit: 3, name: three, algorithm: sliding_log}",
        ),
        algorithm_row(
            "token_bucket",
            "{unit: hour, requests_per_unit: 3, name: three, algorithm: token_bucket}",
        ),
        algorithm_row(
            "gcra_with_a_burst",
            "{unit: day, requests_per_unit: 1, burst: 3, name: three, algorithm: gcra}",
        ),
        budget_row(
            "fixed_window_budget",
            "{unit: hour, requests_per_unit: 10, name: budget, count_over_limit: true}",
        ),
        budget_row(
            "sliding_window_budget",
            "{unit: hour, requests_per_unit: 10, name: budget, algorithm: sliding_window, count_over_limit: true}",
        ),
        budget_row(
            "sliding_log_budget",
            "{unit: hour, requests_per_unit: 10, name: budget, algorithm: sliding_log, count_over_limit: true}",
        ),
        budget_row(
            "token_bucket_budget",
            "{unit: hour, requests_per_unit: 10, name: budget, algorithm: token_bucket, count_over_limit: true}",
        ),
        budget_row(
            "gcra_budget",
            "{unit: hour, requests_per_unit: 10, name: budget, algorithm: gcra, count_over_limit: true}",
        ),
    ]
}

/// What a request carries: costs and limit overrides.
fn request_rows() -> Vec<Row> {
    vec![
        row(
            "hits_addend",
            r#"
  - key: a
    rate_limit: {unit: hour, requests_per_unit: 10, name: a}
  - key: b
    rate_limit: {unit: hour, requests_per_unit: 10, name: b}
"#,
            vec![
                // The request's cost applies to each descriptor; a descriptor's own wins over it.
                step_costing(
                    vec![
                        descriptor(&[("a", "x")]),
                        with_hits(descriptor(&[("b", "x")]), 5),
                    ],
                    2,
                    "OK: OK 8 left of a, OK 5 left of b",
                ),
                step_costing(
                    pair(&[("a", "x")], &[("b", "x")]),
                    5,
                    "OK: OK 3 left of a, OK 0 left of b",
                ),
            ],
        ),
        row(
            "overrides",
            r#"
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 100, name: from_rules}
"#,
            [
                again(
                    || overridden(&[("user", "o")], 2, Unit::Hour),
                    &[
                        "OK: OK 1 left of 2/Hour",
                        "OK: OK 0 left of 2/Hour",
                        "OVER: OVER 0 left of 2/Hour",
                    ],
                ),
                // A descriptor no rule matches is limited by its override alone.
                again(
                    || overridden(&[("nobody", "n")], 1, Unit::Day),
                    &["OK: OK 0 left of 1/Day", "OVER: OVER 0 left of 1/Day"],
                ),
            ]
            .concat(),
        ),
    ]
}

/// Several descriptors in one request, and the rule flags that change how they are counted.
fn several_descriptor_rows() -> Vec<Row> {
    vec![
        row(
            "shadow_rule",
            r#"
  - key: trial
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1, name: trial}
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 5, name: user}
"#,
            // Over its limit, the shadow rule still says OK, and the request is counted.
            again(
                || pair(&[("trial", "t")], &[("user", "u")]),
                &[
                    "OK: OK 0 left of trial, OK 4 left of user",
                    "OK: OK 0 left of trial, OK 3 left of user",
                ],
            ),
        ),
        // A denied request takes nothing from its other descriptors' quotas...
        wide_and_narrow_row(
            "several_descriptors",
            false,
            [
                "OVER: OK 9 left of wide, OVER 0 left of narrow",
                "OK: OK 8 left of wide",
            ],
        ),
        // ...unless the server is told to count every descriptor of every request.
        wide_and_narrow_row(
            "several_descriptors_consume_on_deny",
            true,
            [
                "OVER: OK 8 left of wide, OVER 0 left of narrow",
                "OK: OK 7 left of wide",
            ],
        ),
        row(
            "quota_mode",
            r#"
  - key: quota_a
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1, name: quota_a}
  - key: quota_b
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 2, name: quota_b}
"#,
            // Denied only when no quota is left; one quota left is enough.
            again(
                || pair(&[("quota_a", "")], &[("quota_b", "")]),
                &[
                    "OK: OK 0 left of quota_a, OK 1 left of quota_b",
                    "OK: OVER 0 left of quota_a, OK 0 left of quota_b",
                    "OVER: OVER 0 left of quota_a, OVER 0 left of quota_b",
                ],
            ),
        ),
        row(
            "quota_with_several_limits",
            r#"
  - key: quota_a
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1, name: a_hourly}
    rate_limits:
      - {unit: day, requests_per_unit: 100, name: a_daily}
  - key: quota_b
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1, name: quota_b}
"#,
            // A quota descriptor is over when any of its limits is: here both are, and so the request.
            again(
                || pair(&[("quota_a", "")], &[("quota_b", "")]),
                &[
                    "OK: OK 0 left of a_hourly, OK 0 left of quota_b",
                    "OVER: OVER 0 left of a_hourly, OVER 0 left of quota_b",
                ],
            ),
        ),
        row(
            "quota_in_shadow_mode",
            r#"
  - key: quota_shadow
    quota_mode: true
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1, name: quota_shadow}
  - key: quota_c
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1, name: quota_c}
"#,
            // A shadow rule's status is OK: as a quota descriptor, it always has quota left.
            again(
                || pair(&[("quota_shadow", "")], &[("quota_c", "")]),
                &[
                    "OK: OK 0 left of quota_shadow, OK 0 left of quota_c",
                    "OK: OK 0 left of quota_shadow, OVER 0 left of quota_c",
                ],
            ),
        ),
        row(
            "several_limits_on_one_rule",
            r#"
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 2, name: per_hour}
    rate_limits:
      - {unit: day, requests_per_unit: 5, name: per_day}
"#,
            // The status reports the limit closest to denying.
            [
                again(
                    || one(&[("user", "u")]),
                    &[
                        "OK: OK 1 left of per_hour",
                        "OK: OK 0 left of per_hour",
                        "OVER: OVER 0 left of per_hour",
                    ],
                ),
                vec![step_costing(
                    one(&[("user", "v")]),
                    2,
                    "OK: OK 0 left of per_hour",
                )],
            ]
            .concat(),
        ),
    ]
}

/// An answer as the table writes it: `OVERALL: CODE <remaining> left of <limit>, ...`, the limit by its
/// name, or `<requests>/<Unit>` when it has none.
fn read(answer: &RateLimitResponse) -> String {
    let code = |c: i32| match Code::try_from(c) {
        Ok(Code::Ok) => "OK",
        Ok(Code::OverLimit) => "OVER",
        other => panic!("unexpected code {other:?}"),
    };
    let statuses: Vec<String> = answer
        .statuses
        .iter()
        .map(|s| match &s.current_limit {
            None => format!("{} no limit", code(s.code)),
            Some(limit) if limit.name.is_empty() => format!(
                "{} {} left of {}/{:?}",
                code(s.code),
                s.limit_remaining,
                limit.requests_per_unit,
                Unit::try_from(limit.unit).unwrap()
            ),
            Some(limit) => format!(
                "{} {} left of {}",
                code(s.code),
                s.limit_remaining,
                limit.name
            ),
        })
        .collect();
    format!("{}: {}", code(answer.overall_code), statuses.join(", "))
}

/// Waits out the last seconds of an hour, so that no row's counters start in one hour window and end
/// in the next (the day limits above turn over with an hour too).
async fn clear_of_an_hour_end() {
    let into_hour = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
        % 3_600_000;
    let left = 3_600_000 - into_hour;
    if left < 5_000 {
        tokio::time::sleep(Duration::from_millis(left as u64 + 100)).await;
    }
}

/// Runs the whole table on servers on the memory store, or on Redis at `redis` (a URL and how it is
/// deployed): one server that keeps a denied request's counters untouched, and one with `consume_on_deny`.
async fn run_table(store: &str, redis: Option<(String, RedisTopology)>) {
    let rows = table();
    let files: Vec<(String, String)> = rows
        .iter()
        .map(|r| {
            let text = format!("domain: {}\ndescriptors:{}", r.name, r.rules);
            (format!("{}.yaml", r.name), text)
        })
        .collect();
    let files: Vec<(&str, &str)> = files.iter().map(|(n, t)| (&n[..], &t[..])).collect();
    let mut servers = Vec::new();
    for consume_on_deny in [false, true] {
        let redis = redis.clone();
        let s = TestServer::start_with_clock(&files, Clock::System, move |s| {
            s.consume_on_deny = Some(consume_on_deny);
            if let Some((url, topology)) = redis {
                s.backend = Some(BackendKind::Redis);
                s.redis.url = url;
                s.redis.topology = topology;
                s.redis.timeout = Duration::from_millis(500);
                s.redis.pool_size = 2;
            }
        })
        .await;
        s.wait_serving(Duration::from_secs(20)).await;
        servers.push(s);
    }
    for r in &rows {
        clear_of_an_hour_end().await;
        let mut client = servers[usize::from(r.consume_on_deny)].client().await;
        let mut answers = Vec::new();
        for st in &r.steps {
            let question = request_costing(r.name, st.descriptors.clone(), st.hits);
            answers.push(read(&ask(&mut client, question).await));
        }
        let wanted: Vec<&str> = r.steps.iter().map(|st| st.want).collect();
        assert_eq!(answers, wanted, "{store}: row {}", r.name);
    }
    for s in servers {
        s.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_table_on_the_memory_store() {
    run_table("memory", None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_table_on_standalone_redis() {
    let redis = RedisProcess::start(&[]);
    run_table("redis", Some((redis.addr(), RedisTopology::Single))).await;
    assert_ne!(redis.cli(&["DBSIZE"]), "0", "the counters are in Redis");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_table_on_a_redis_cluster() {
    let cluster = RedisCluster::start(false);
    run_table("cluster", Some((cluster.url(), RedisTopology::Cluster))).await;
    let holding = cluster
        .masters
        .iter()
        .filter(|m| m.cli(&["DBSIZE"]) != "0")
        .count();
    assert_eq!(holding, 3, "the counters are spread over every master");
}

/// A caller that puts an override of another unit between its plain requests: the override has the key
/// of the rule's limit, and each must keep its own count. On the memory store (the default) the
/// override's window once took the shared counter over, and the rule's next request started anew.
async fn overrides_of_another_unit_leave_the_rule_alone(store: &str, server: &TestServer) {
    let mut client = server.client().await;
    let plain = || request("alternating", one(&[("user", "u")]));
    let overriding = || {
        request(
            "alternating",
            overridden(&[("user", "u")], 1_000, Unit::Minute),
        )
    };
    let mut codes = Vec::new();
    for question in [
        plain(),
        plain(),
        plain(),
        plain(),
        overriding(),
        plain(),
        overriding(),
        plain(),
    ] {
        codes.push(read(&ask(&mut client, question).await)[..2].to_owned());
    }
    assert_eq!(
        codes,
        ["OK", "OK", "OK", "OV", "OK", "OV", "OK", "OV"],
        "{store}: three an hour, however many overrides come between"
    );
}

const ALTERNATING: (&str, &str) = (
    "alternating.yaml",
    "domain: alternating\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 3}\n",
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_of_another_unit_does_not_restart_the_rules_window() {
    let memory = TestServer::start(&[ALTERNATING], |_| {}).await;
    overrides_of_another_unit_leave_the_rule_alone("memory", &memory).await;
    memory.stop().await;

    let redis = RedisProcess::start(&[]);
    let on_redis = TestServer::start_with_clock(&[ALTERNATING], Clock::System, |s| {
        s.backend = Some(BackendKind::Redis);
        s.redis.url = redis.addr();
    })
    .await;
    on_redis.wait_serving(Duration::from_secs(20)).await;
    clear_of_an_hour_end().await;
    overrides_of_another_unit_leave_the_rule_alone("redis", &on_redis).await;
    on_redis.stop().await;
}
