//! Faults under load, against real processes: Redis paused (CLIENT PAUSE), Redis busy (DEBUG SLEEP),
//! and one of three ratelimitd replicas SIGKILLed. Each test's name says what it proves, and it asserts
//! the numbers: every call answered, how fast, and never more admitted than the limit.
//! (Redis killed and restarted, Sentinel and Cluster failovers and slot migrations under traffic are in
//! tests/redis_backend.rs.)

mod common;

use std::{
    collections::BTreeMap,
    sync::Arc,
    time::{Duration, Instant},
};

use common::{descriptor, redis::RedisProcess, request, start_binary, TestServer};
use ratelimitd::{
    proto::{rate_limit_response::Code, RateLimitServiceClient},
    settings::{BackendKind, OnBackendError, RedisTopology},
};

const RULES: &str = "domain: faults\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 100}\n  - key: shared\n    rate_limit: {unit: hour, requests_per_unit: 300}\n";

/// The tests bound how long an answer may take; run side by side on two cores, one test's processes
/// would stall the other's callers. One at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What the callers saw: answers by code, transport errors, the slowest answer, and OKs on the shared key.
#[derive(Debug, Default)]
struct Seen {
    codes: BTreeMap<String, u32>,
    slowest: Duration,
    shared_ok: u32,
}

impl Seen {
    fn merge(&mut self, other: Seen) {
        for (k, v) in other.codes {
            *self.codes.entry(k).or_default() += v;
        }
        self.slowest = self.slowest.max(other.slowest);
        self.shared_ok += other.shared_ok;
    }
}

/// `callers` callers send, for `length`, requests that alternate between a fresh user (always under its
/// limit while Redis answers) and the shared key (limit 300).
async fn load(server: &TestServer, callers: usize, length: Duration) -> Seen {
    let mut tasks = Vec::new();
    for caller in 0..callers {
        let mut client = server.client().await;
        tasks.push(tokio::spawn(async move {
            let mut seen = Seen::default();
            let end = Instant::now() + length;
            let mut i = 0;
            while Instant::now() < end {
                i += 1;
                let fresh = format!("c{caller}-{i}");
                let shared = i % 2 == 0;
                let entries: &[(&str, &str)] = if shared {
                    &[("shared", "all")]
                } else {
                    &[("user", &fresh)]
                };
                let started = Instant::now();
                let answer = client
                    .should_rate_limit(request("faults", vec![descriptor(entries)]))
                    .await;
                seen.slowest = seen.slowest.max(started.elapsed());
                let code = match answer {
                    Ok(r) => {
                        let code = Code::try_from(r.into_inner().overall_code).unwrap();
                        if shared && code == Code::Ok {
                            seen.shared_ok += 1;
                        }
                        format!("{code:?}")
                    }
                    Err(status) => format!("{:?}", status.code()),
                };
                *seen.codes.entry(code).or_default() += 1;
            }
            seen
        }));
    }
    let mut all = Seen::default();
    for t in tasks {
        all.merge(t.await.unwrap());
    }
    all
}

async fn server_on(redis: &RedisProcess) -> TestServer {
    let url = redis.addr();
    let s = TestServer::start(&[("faults.yaml", RULES)], move |s| {
        s.backend = Some(BackendKind::Redis);
        s.redis.url = url;
        s.redis.topology = RedisTopology::Single;
        s.redis.timeout = Duration::from_millis(50);
        s.on_backend_error = OnBackendError::Deny;
        s.hash_secret = ratelimitd::settings::Secret("faults".into());
    })
    .await;
    s.wait_serving(Duration::from_secs(20)).await;
    s
}

fn shared_counter(redis: &RedisProcess) -> u32 {
    let key = redis.cli(&["--scan", "--pattern", "faults_shared_all_*"]);
    redis.cli(&["GET", key.trim()]).parse().unwrap_or(0)
}

/// Checks what every fault test promises: answers only OK or OVER_LIMIT (the deny policy while Redis
/// cannot answer), none slower than the bound, at most the limit admitted on the shared key, and the
/// Redis counter never above the limit nor below what was admitted.
fn assert_held(seen: &Seen, redis: &RedisProcess, bound: Duration) {
    assert!(
        seen.codes.keys().all(|c| c == "Ok" || c == "OverLimit"),
        "{:?}",
        seen.codes
    );
    assert!(seen.slowest < bound, "slowest answer {:?}", seen.slowest);
    let counted = shared_counter(redis);
    assert!(
        seen.shared_ok <= 300,
        "admitted {} over a limit of 300",
        seen.shared_ok
    );
    assert!(
        counted <= 300 && counted >= seen.shared_ok,
        "counter {counted}, admitted {}",
        seen.shared_ok
    );
}

/// Six callers for 3 s; `fault` starts 500 ms in. Then the promises of [`assert_held`], proof that the fault
/// showed (fresh users denied by the policy), and counting resumed after it.
async fn under_fault(
    redis: &RedisProcess,
    name: &str,
    fault: impl std::future::Future<Output = ()>,
) {
    let server = server_on(redis).await;
    let traffic = load(&server, 6, Duration::from_millis(3000));
    let fault = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        fault.await;
    };
    let (seen, ()) = tokio::join!(traffic, fault);
    eprintln!("{name}: {seen:?}");
    assert_held(&seen, redis, Duration::from_millis(400));
    let count = |seen: &Seen, code: &str| seen.codes.get(code).copied().unwrap_or(0);
    assert!(count(&seen, "OverLimit") > 0, "{:?}", seen.codes);
    let after = load(&server, 2, Duration::from_millis(300)).await;
    assert!(count(&after, "Ok") > 0, "{:?}", after.codes);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_under_client_pause_is_answered_by_policy_within_400ms_and_never_over_admits() {
    let _one = ONE_AT_A_TIME.lock().await;
    let redis = RedisProcess::start(&[]);
    let pause = async { assert_eq!(redis.cli(&["CLIENT", "PAUSE", "1500", "ALL"]), "OK") };
    under_fault(&redis, "client pause", pause).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_blocked_by_debug_sleep_is_answered_by_policy_within_400ms_and_never_over_admits() {
    let _one = ONE_AT_A_TIME.lock().await;
    let redis = Arc::new(RedisProcess::start(&["--enable-debug-command", "local"]));
    let sleeper = redis.clone();
    // Redis runs nothing else for a second; the command itself answers when it wakes.
    let sleep = async move {
        let answer = tokio::task::spawn_blocking(move || sleeper.cli(&["DEBUG", "SLEEP", "1"]))
            .await
            .unwrap();
        assert_eq!(answer, "OK");
    };
    under_fault(&redis, "debug sleep", sleep).await;
}

/// A folder holding the rules of these tests, kept as long as the replicas started on it run.
fn rules_folder() -> tempfile::TempDir {
    let rules = tempfile::tempdir().unwrap();
    std::fs::write(rules.path().join("faults.yaml"), RULES).unwrap();
    rules
}

/// The binary on `rules` and `redis`, as a reference Deployment points it at Redis.
fn replica_on(rules: &tempfile::TempDir, redis: &RedisProcess) -> std::process::Command {
    let mut cmd = common::binary(rules.path());
    cmd.env("REDIS_URL", redis.addr());
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_of_three_replicas_sigkilled_under_load_the_others_keep_serving_and_the_limit_holds() {
    let _one = ONE_AT_A_TIME.lock().await;
    let redis = RedisProcess::start(&[]);
    let rules = rules_folder();
    let mut replicas: Vec<_> = (0..3)
        .map(|_| {
            let mut cmd = replica_on(&rules, &redis);
            cmd.env("REDIS_TIMEOUT", "1s")
                .env("RATELIMITD_HASH_SECRET", "faults");
            start_binary(&mut cmd)
        })
        .collect();
    for r in &replicas {
        assert!(
            r.serving_within(Duration::from_secs(15)),
            "replica not serving"
        );
    }
    let addrs: Vec<_> = replicas.iter().map(|r| r.grpc).collect();

    // 10 callers per replica, 40 requests each on the shared key: 1 200 requests on a limit of 300.
    let mut callers = Vec::new();
    for (replica, addr) in addrs.iter().enumerate() {
        for _ in 0..10 {
            let mut client = RateLimitServiceClient::connect(format!("http://{addr}"))
                .await
                .unwrap();
            callers.push(tokio::spawn(async move {
                let (mut ok, mut denied, mut failed) = (0u32, 0u32, 0u32);
                for _ in 0..40 {
                    let answer = client
                        .should_rate_limit(request(
                            "faults",
                            vec![descriptor(&[("shared", "all")])],
                        ))
                        .await;
                    match answer {
                        Ok(r) if r.get_ref().overall_code == Code::Ok as i32 => ok += 1,
                        Ok(_) => denied += 1,
                        Err(_) => {
                            // The killed replica: its callers stop at the first failure.
                            failed += 1;
                            break;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                (replica, ok, denied, failed)
            }));
        }
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    replicas[0].child.kill().unwrap(); // SIGKILL
    let mut admitted = 0;
    let mut failures_on_survivors = 0;
    let mut survivor_answers = 0;
    for c in callers {
        let (replica, ok, denied, failed) = c.await.unwrap();
        admitted += ok;
        if replica != 0 {
            failures_on_survivors += failed;
            survivor_answers += ok + denied;
        }
    }
    let counted = shared_counter(&redis);
    eprintln!(
        "sigkill: admitted {admitted}, counted {counted}, survivors answered {survivor_answers}"
    );
    assert_eq!(
        failures_on_survivors, 0,
        "the surviving replicas failed calls"
    );
    assert_eq!(
        survivor_answers,
        2 * 10 * 40,
        "every call to a survivor was answered"
    );
    assert!(admitted <= 300, "admitted {admitted} over a limit of 300");
    // Only requests in flight on the killed replica (one per caller) can be counted without an answer.
    assert!(
        counted <= 300 && counted >= admitted && counted - admitted <= 10,
        "counter {counted}, admitted {admitted}"
    );
    assert_eq!(counted, 300, "1 200 requests fill the limit exactly");
}

/// A Redis that answers every call with an error while its connections are fine (here out of memory,
/// which refuses every script that may write): with `on_backend_error: allow` every caller gets OK, and
/// the failures still show, counted by the answer they got and in one warning per ten seconds.
#[test]
fn a_redis_refusing_every_call_shows_in_the_log_and_the_metrics_when_the_policy_allows() {
    let _one = ONE_AT_A_TIME.blocking_lock();
    let redis = RedisProcess::start(&[]);
    let rules = rules_folder();
    let mut cmd = replica_on(&rules, &redis);
    cmd.env("RATELIMITD_ON_BACKEND_ERROR", "allow");
    let running = start_binary(&mut cmd);
    assert!(
        running.serving_within(Duration::from_secs(15)),
        "not serving: {}",
        running.log.lock().unwrap()
    );
    redis.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    redis.cli(&["CONFIG", "SET", "maxmemory", "1"]);
    let body =
        r#"{"domain":"faults","descriptors":[{"entries":[{"key":"shared","value":"all"}]}]}"#;
    for _ in 0..30 {
        assert_eq!(
            common::http_request(running.http, "POST", "/json", body).0,
            200
        );
    }
    let (_, metrics) = common::http_request(running.http, "GET", "/metrics", "");
    assert!(
        metrics.contains("ratelimitd_backend_failures_total{answer=\"allow\"} 30\n"),
        "{metrics}"
    );
    let log = running.log.lock().unwrap().clone();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("the counter store could not decide"))
        .collect();
    assert_eq!(lines.len(), 1, "one line for the first ten seconds:\n{log}");
    assert!(
        lines[0].contains("OOM") && lines[0].contains("WARN"),
        "{log}"
    );
}

/// A Redis user that may connect and load scripts but not run them (no EVALSHA) could decide nothing:
/// the replica does not report SERVING, and its log says what the user lacks.
#[test]
fn a_redis_user_without_evalsha_is_not_served_and_named() {
    let _one = ONE_AT_A_TIME.blocking_lock();
    let redis = RedisProcess::start(&[]);
    redis.cli(&[
        "ACL", "SETUSER", "limited", "on", ">pw", "~*", "+@all", "-evalsha",
    ]);
    let rules = rules_folder();
    let mut cmd = replica_on(&rules, &redis);
    cmd.env("REDIS_AUTH", "limited:pw");
    let running = start_binary(&mut cmd);
    assert!(
        !running.serving_within(Duration::from_secs(3)),
        "serving with a user that cannot run scripts"
    );
    let log = running.log.lock().unwrap().clone();
    assert!(
        log.contains("Redis not ready") && log.contains("NOPERM") && log.contains("EVALSHA"),
        "{log}"
    );
}

/// Redis killed under a replica started with the reference's variables alone: the lost connections open
/// the breaker at once, so the very first requests after the kill are answered without waiting for
/// Redis; and while it stays down, the pooled connections' retries write one line per error, not one per
/// connection and retry.
#[test]
fn a_killed_redis_is_answered_at_once_and_logged_once_while_it_stays_down() {
    let _one = ONE_AT_A_TIME.blocking_lock();
    let mut redis = RedisProcess::start(&[]);
    let rules = rules_folder();
    let mut cmd = replica_on(&rules, &redis);
    // Silence alone would open the breaker only after 2 s: what opens it sooner is the lost connections.
    cmd.env("RATELIMITD_REDIS__UNRESPONSIVE_AFTER", "2s");
    let running = start_binary(&mut cmd);
    assert!(running.serving_within(Duration::from_secs(15)));
    let body = |i: usize| {
        format!(
            r#"{{"domain":"faults","descriptors":[{{"entries":[{{"key":"user","value":"u{i}"}}]}}]}}"#
        )
    };
    assert_eq!(
        common::http_request(running.http, "POST", "/json", &body(0)).0,
        200
    );
    redis.kill();
    std::thread::sleep(Duration::from_millis(50));
    let began = std::time::Instant::now();
    for i in 1..=5 {
        let (code, _) = common::http_request(running.http, "POST", "/json", &body(i));
        assert_eq!(code, 503, "request {i}");
    }
    let took = began.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "five requests took {took:?}: the breaker waited for silence"
    );
    // Down for 5 s: the ten pooled connections retry every 2 s at most.
    std::thread::sleep(Duration::from_secs(5));
    let log = running.log.lock().unwrap().clone();
    let errors = log
        .lines()
        .filter(|l| l.contains("Redis connection error"))
        .count();
    assert!(
        (1..=4).contains(&errors),
        "{errors} connection error lines in 5 s:\n{log}"
    );
}

/// A Redis whose `timeout` closes idle connections (a common setting; proxies' idle timeouts do the
/// same), under a replica started with the reference's variables alone: every pooled connection closed
/// while idle is nothing to report. The breaker stays closed, the log is quiet at its default level, and
/// the requests after the idle time are decided on Redis, also one sent while every connection is being
/// made again.
#[test]
fn connections_a_redis_closes_when_idle_open_no_breaker_and_write_no_warning() {
    let _one = ONE_AT_A_TIME.blocking_lock();
    let redis = RedisProcess::start(&["--timeout", "1"]);
    let rules = rules_folder();
    let running = start_binary(&mut replica_on(&rules, &redis));
    assert!(running.serving_within(Duration::from_secs(15)));
    // The replica's connections by id (not this listing's own).
    let pooled = || -> std::collections::BTreeSet<String> {
        redis
            .cli(&["CLIENT", "LIST"])
            .lines()
            .filter(|l| !l.contains("cmd=client|list"))
            .filter_map(|l| {
                l.split(' ')
                    .find_map(|f| f.strip_prefix("id="))
                    .map(str::to_owned)
            })
            .collect()
    };
    // Redis looks at idle clients a few at a time: within seconds, each of the ten pooled connections
    // is closed and made again.
    let first = pooled();
    assert!(first.len() >= 10, "{first:?}");
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        let now = pooled();
        if now.is_disjoint(&first) && now.len() >= 10 {
            break;
        }
        assert!(
            Instant::now() < until,
            "Redis did not close every idle connection: {first:?} then {now:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let body = r#"{"domain":"faults","descriptors":[{"entries":[{"key":"user","value":"idle"}]}]}"#;
    for i in 0..5 {
        let (code, answer) = common::http_request(running.http, "POST", "/json", body);
        assert_eq!(code, 200, "request {i}: {answer}");
        assert!(
            answer.contains(&format!("\"limitRemaining\":{}", 99 - i)),
            "{answer}"
        );
    }
    // Every connection closed at once, and a request at once, while the client waits to reconnect: it
    // waits for the reconnection, the breaker stays closed.
    redis.cli(&["CLIENT", "KILL", "TYPE", "normal"]);
    let (code, answer) = common::http_request(running.http, "POST", "/json", body);
    assert_eq!(
        code, 200,
        "just after the connections were closed: {answer}"
    );
    let log = running.log.lock().unwrap().clone();
    let warned: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("Redis") || l.contains("breaker") || l.contains("fred"))
        .filter(|l| !l.contains("Redis connected and scripts loaded"))
        .collect();
    assert!(warned.is_empty(), "{warned:#?}");
    let (_, metrics) = common::http_request(running.http, "GET", "/metrics", "");
    assert!(
        metrics.contains("ratelimitd_backend_failures_total{answer=\"error\"} 0\n"),
        "no request failed: {metrics}"
    );
}
