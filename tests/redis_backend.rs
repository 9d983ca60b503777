//! The Redis backend end to end: ratelimitd instances on real redis-server processes (standalone,
//! Cluster, Sentinel), called over gRPC, with Redis failing underneath.

mod common;

use std::{
    sync::{
        atomic::{AtomicU32, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use common::{
    ask, descriptor,
    redis::{
        command_calls, AnswerDropper, RedisCluster, RedisProcess, SentinelPasswords, SentinelSet,
    },
    request, TestServer,
};
use ratelimitd::{
    clock::Clock,
    proto::rate_limit_response::Code,
    settings::{OnBackendError, RedisTopology, Settings},
};

const RULES: &str = r#"
domain: fleet
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 200}
  - key: ip
    rate_limit: {unit: hour, requests_per_unit: 1000}
  - key: login
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: mover
    rate_limit: {unit: minute, requests_per_unit: 1000}
"#;

fn on_redis(url: String, topology: RedisTopology) -> impl FnOnce(&mut Settings) {
    move |s: &mut Settings| {
        s.redis.url = url;
        s.redis.topology = topology;
        s.redis.timeout = Duration::from_millis(500);
        s.redis.pool_size = 2;
        s.expiration_jitter_max_seconds = 0;
        s.hash_secret = ratelimitd::settings::Secret("test-hash-secret".into());
    }
}

async fn start(url: String, topology: RedisTopology) -> TestServer {
    start_tweaked(url, topology, |_| {}).await
}

async fn start_tweaked(
    url: String,
    topology: RedisTopology,
    more: impl FnOnce(&mut Settings),
) -> TestServer {
    let base = on_redis(url, topology);
    let s = TestServer::start_with_clock(&[("fleet.yaml", RULES)], Clock::System, |s| {
        base(s);
        more(s);
    })
    .await;
    s.wait_serving(Duration::from_secs(20)).await;
    s
}

/// 30 concurrent callers spread over the instances send `per_caller` requests each; returns how many
/// were allowed.
async fn hammer(
    servers: &[TestServer],
    descriptors: Vec<Vec<(&'static str, &'static str)>>,
    per_caller: u32,
) -> u32 {
    let allowed = Arc::new(AtomicU32::new(0));
    let mut callers = Vec::new();
    for i in 0..30 {
        let mut client = servers[i % servers.len()].client().await;
        let (allowed, descriptors) = (allowed.clone(), descriptors.clone());
        callers.push(tokio::spawn(async move {
            for _ in 0..per_caller {
                let r = request("fleet", descriptors.iter().map(|d| descriptor(d)).collect());
                let resp = client
                    .should_rate_limit(r)
                    .await
                    .expect("answered")
                    .into_inner();
                if resp.overall_code == Code::Ok as i32 {
                    allowed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for c in callers {
        c.await.unwrap();
    }
    allowed.load(Ordering::Relaxed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_on_one_redis_admit_exactly_the_limit() {
    let redis = RedisProcess::start(&[]);
    let mut fleet = Vec::new();
    for _ in 0..3 {
        fleet.push(start(redis.addr(), RedisTopology::Single).await);
    }
    let evalsha_before = command_calls(&redis.cli(&["INFO", "commandstats"]), "evalsha");
    // 30 callers x 10 requests = 300 requests on a limit of 200 per hour.
    let allowed = hammer(&fleet, vec![vec![("user", "shared")]], 10).await;
    assert_eq!(allowed, 200);

    // At most one script call per request (requests waiting for a busy server share one), the
    // counter created once with its TTL, and nothing written for denied requests: at most one write
    // per allowed request (one per call that allowed any).
    let stats = redis.cli(&["INFO", "commandstats"]);
    let script_calls = command_calls(&stats, "evalsha") - evalsha_before;
    assert!((1..=300).contains(&script_calls), "{script_calls}");
    assert_eq!(
        command_calls(&stats, "set"),
        1,
        "created once, with its TTL"
    );
    assert_eq!(command_calls(&stats, "expire"), 0);
    let writes = command_calls(&stats, "set") + command_calls(&stats, "incrby");
    assert!(writes <= 200, "denied requests wrote nothing: {writes}");
    let keys = redis.cli(&["--scan", "--pattern", "fleet_user_shared_*"]);
    assert_eq!(keys.lines().count(), 1);
    assert_eq!(redis.cli(&["GET", keys.trim()]), "200");
    for s in fleet {
        s.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_fleet_never_admits_more_than_the_limit_across_slots() {
    let cluster = RedisCluster::start(false);
    let mut fleet = Vec::new();
    for _ in 0..3 {
        fleet.push(start(cluster.url(), RedisTopology::Cluster).await);
    }
    // Two descriptors whose counters live in different hash slots.
    let allowed = hammer(
        &fleet,
        vec![vec![("user", "spread")], vec![("ip", "10.9.8.7")]],
        10,
    )
    .await;
    assert_eq!(allowed, 200);
    // Once the replicas' leases on the hot ip counter ended, it holds exactly the admitted requests:
    // what denied requests took was given back, and so was every leased hit not admitted.
    for s in &fleet {
        s.wait_leases_given_back(Duration::from_secs(5)).await;
    }
    let ip_count: u64 = cluster
        .masters
        .iter()
        .flat_map(|m| {
            let keys = m.cli(&["--scan", "--pattern", "fleet_ip_10.9.8.7_*"]);
            keys.lines()
                .map(|k| m.cli(&["GET", k]).parse::<u64>().unwrap_or(0))
                .collect::<Vec<_>>()
        })
        .sum();
    assert_eq!(ip_count, 200);
    for s in fleet {
        s.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_keep_the_reference_layout_for_a_shared_migration() {
    let redis = RedisProcess::start(&[]);
    let s = start(redis.addr(), RedisTopology::Single).await;
    common::far_from_a_minute_end().await;
    let mut c = s.client().await;
    let resp = ask(
        &mut c,
        request("fleet", vec![descriptor(&[("login", "alice")])]),
    )
    .await;
    assert_eq!(resp.statuses[0].limit_remaining, 4);
    let key = redis.cli(&["--scan", "--pattern", "fleet_login_alice_*"]);
    let window_start: u64 = key.trim().rsplit('_').next().unwrap().parse().unwrap();
    assert_eq!(
        window_start % 60,
        0,
        "epoch-aligned minute window in the key: {key}"
    );
    assert_eq!(redis.cli(&["GET", key.trim()]), "1");
    let ttl: u64 = redis.cli(&["TTL", key.trim()]).parse().unwrap();
    assert!((1..=60).contains(&ttl), "window + jitter 0: {ttl}");

    // A counter written by another service under the same layout (e.g. the reference service during a
    // migration) is counted against.
    redis.cli(&["INCRBY", key.trim(), "3"]);
    let resp = ask(
        &mut c,
        request("fleet", vec![descriptor(&[("login", "alice")])]),
    )
    .await;
    assert_eq!(resp.statuses[0].limit_remaining, 0);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descriptors_joining_to_the_same_text_count_apart_on_redis() {
    // `[user="u_path_/login"]` and `[user=u, path=/login]` share the reference layout's key; every
    // algorithm but the fixed window escapes its key parts, so each keeps its own counter.
    const JOINED: &str = r#"
domain: fleet
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 1, algorithm: token_bucket}
    descriptors:
      - key: path
        rate_limit: {unit: minute, requests_per_unit: 1, algorithm: token_bucket}
"#;
    let redis = RedisProcess::start(&[]);
    let s = TestServer::start_with_clock(
        &[("fleet.yaml", JOINED)],
        Clock::System,
        on_redis(redis.addr(), RedisTopology::Single),
    )
    .await;
    s.wait_serving(Duration::from_secs(20)).await;
    let mut c = s.client().await;
    for entries in [
        &[("user", "u_path_/login")][..],
        &[("user", "u"), ("path", "/login")][..],
    ] {
        let resp = ask(&mut c, request("fleet", vec![descriptor(entries)])).await;
        assert_eq!(resp.overall_code, Code::Ok as i32, "{entries:?}");
    }
    let keys = redis.cli(&["--scan", "--pattern", "*fleet*"]);
    let mut keys: Vec<&str> = keys.lines().collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "{fleet_user_u%5Fpath%5F/login_}:token_bucket:60:0",
            "{fleet_user_u_path_/login_}:token_bucket:60:0",
        ]
    );
    for key in keys {
        let ttl: i64 = redis.cli(&["PTTL", key]).trim().parse().unwrap();
        assert!(ttl > 0, "{key} has a TTL: {ttl}");
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_key_prefix_keeps_services_apart_on_one_redis() {
    let redis = RedisProcess::start(&[]);
    let a = start_tweaked(redis.addr(), RedisTopology::Single, |s| {
        s.cache_key_prefix = "svc_a:".into();
    })
    .await;
    let b = start_tweaked(redis.addr(), RedisTopology::Single, |s| {
        s.cache_key_prefix = "svc_b:".into();
    })
    .await;
    common::far_from_a_minute_end().await;
    let r = request("fleet", vec![descriptor(&[("login", "same")])]);
    for _ in 0..5 {
        a.client().await.should_rate_limit(r.clone()).await.unwrap();
    }
    let resp = ask(&mut b.client().await, r).await;
    assert_eq!(resp.statuses[0].limit_remaining, 4, "b counts apart from a");
    let keys = redis.cli(&["--scan", "--pattern", "svc_*"]);
    assert_eq!(keys.lines().count(), 2, "{keys}");
    assert!(
        keys.lines()
            .all(|k| k.starts_with("svc_a:fleet_login_same_")
                || k.starts_with("svc_b:fleet_login_same_")),
        "{keys}"
    );
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_with_skewed_clocks_count_in_the_redis_window() {
    let redis = RedisProcess::start(&[]);
    let on_time = start(redis.addr(), RedisTopology::Single).await;
    // A replica whose clock is two hours ahead.
    let skewed_clock = Clock::manual(Clock::System.now_millis() + 2 * 3_600_000);
    let base = on_redis(redis.addr(), RedisTopology::Single);
    let skewed = TestServer::start_with_clock(&[("fleet.yaml", RULES)], skewed_clock, base).await;
    skewed.wait_serving(Duration::from_secs(20)).await;

    common::far_from_a_minute_end().await;
    let r = request("fleet", vec![descriptor(&[("login", "skew")])]);
    let mut a = on_time.client().await;
    let mut b = skewed.client().await;
    for i in 0..5 {
        let c = if i % 2 == 0 { &mut a } else { &mut b };
        let resp = ask(c, r.clone()).await;
        assert_eq!(resp.overall_code, Code::Ok as i32);
    }
    let resp = ask(&mut b, r.clone()).await;
    assert_eq!(
        resp.overall_code,
        Code::OverLimit as i32,
        "both counted in one window"
    );
    assert_eq!(
        redis
            .cli(&["--scan", "--pattern", "fleet_login_skew_*"])
            .lines()
            .count(),
        1
    );
    on_time.stop().await;
    skewed.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_are_reloaded_after_a_flush() {
    let redis = RedisProcess::start(&[]);
    let s = start(redis.addr(), RedisTopology::Single).await;
    let mut c = s.client().await;
    common::far_from_a_minute_end().await;
    let r = request("fleet", vec![descriptor(&[("login", "flush")])]);
    ask(&mut c, r.clone()).await;
    redis.cli(&["SCRIPT", "FLUSH"]);
    let resp = ask(&mut c, r).await;
    assert_eq!(resp.statuses[0].limit_remaining, 3);
    s.stop().await;
}

/// Sends `n` requests one after another; returns (answers per code, slowest answer).
async fn probe(s: &TestServer, n: u32) -> (std::collections::BTreeMap<String, u32>, Duration) {
    let mut c = s.client().await;
    let mut codes = std::collections::BTreeMap::new();
    let mut slowest = Duration::ZERO;
    for i in 0..n {
        let user = format!("probe{i}");
        let r = request("fleet", vec![descriptor(&[("user", &user)])]);
        let started = Instant::now();
        let code = match c.should_rate_limit(r).await {
            Ok(resp) => format!(
                "{:?}",
                Code::try_from(resp.into_inner().overall_code).unwrap()
            ),
            Err(status) => {
                eprintln!("probe error: {}", status.message());
                format!("{:?}", status.code())
            }
        };
        slowest = slowest.max(started.elapsed());
        *codes.entry(code).or_default() += 1;
    }
    (codes, slowest)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_is_answered_promptly_by_policy_and_recovered_without_restart() {
    let mut redis = RedisProcess::start(&[]);
    let error = start_tweaked(redis.addr(), RedisTopology::Single, |s| {
        s.redis.timeout = Duration::from_millis(50);
    })
    .await;
    let allow = start_tweaked(redis.addr(), RedisTopology::Single, |s| {
        s.redis.timeout = Duration::from_millis(50);
        s.on_backend_error = OnBackendError::Allow;
    })
    .await;
    let deny = start_tweaked(redis.addr(), RedisTopology::Single, |s| {
        s.redis.timeout = Duration::from_millis(50);
        s.on_backend_error = OnBackendError::Deny;
    })
    .await;

    // Load on all three while Redis is killed under it.
    let mut loads = Vec::new();
    for server in [&error, &allow, &deny] {
        for caller in 0..5 {
            let mut c = server.client().await;
            loads.push(tokio::spawn(async move {
                let mut codes = std::collections::BTreeMap::<String, u32>::new();
                let mut slowest = Duration::ZERO;
                let end = Instant::now() + Duration::from_millis(1500);
                let mut i = 0;
                while Instant::now() < end {
                    i += 1;
                    let user = format!("load{caller}-{i}");
                    let r = request("fleet", vec![descriptor(&[("user", &user)])]);
                    let started = Instant::now();
                    let code = match c.should_rate_limit(r).await {
                        Ok(resp) => format!(
                            "{:?}",
                            Code::try_from(resp.into_inner().overall_code).unwrap()
                        ),
                        Err(status) => format!("{:?}", status.code()),
                    };
                    slowest = slowest.max(started.elapsed());
                    *codes.entry(code).or_default() += 1;
                }
                (codes, slowest)
            }));
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    redis.kill();
    let mut results = Vec::new();
    for load in loads {
        results.push(load.await.unwrap());
    }
    for (i, (codes, slowest)) in results.iter().enumerate() {
        let allowed: &[&str] = match i / 5 {
            0 => &["Ok", "Unavailable"],
            1 => &["Ok"],
            _ => &["Ok", "OverLimit"],
        };
        assert!(
            codes.keys().all(|c| allowed.contains(&c.as_str())),
            "caller {i}: {codes:?}"
        );
        assert!(
            slowest < &Duration::from_millis(400),
            "caller {i}: slowest answer {slowest:?}"
        );
    }

    for (server, want) in [
        (&error, "Unavailable"),
        (&allow, "Ok"),
        (&deny, "OverLimit"),
    ] {
        let (codes, slowest) = probe(server, 100).await;
        assert_eq!(codes.get(want), Some(&100), "{want}: {codes:?}");
        // At most the command timeout plus scheduling; the breaker answers the rest at once.
        assert!(
            slowest < Duration::from_millis(400),
            "slowest answer {slowest:?}"
        );
    }
    let mut c = error.client().await;
    let err = c
        .should_rate_limit(request("fleet", vec![descriptor(&[("user", "x")])]))
        .await
        .unwrap_err();
    assert!(err.message().contains("redis"), "{}", err.message());

    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (codes, _) = probe(&error, 1).await;
        if codes.contains_key("Ok") {
            break;
        }
        assert!(Instant::now() < deadline, "no recovery: {codes:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (codes, _) = probe(&allow, 20).await;
    assert_eq!(codes.get("Ok"), Some(&20));
    for s in [error, allow, deny] {
        s.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_before_redis_and_serves_once_it_is_up() {
    let port = common::redis::free_port();
    let s = TestServer::start_with_clock(
        &[("fleet.yaml", RULES)],
        Clock::System,
        on_redis(format!("127.0.0.1:{port}"), RedisTopology::Single),
    )
    .await;
    let (http_code, _) = s.http("GET", "/healthcheck", "").await;
    assert_eq!(http_code, 500, "NOT_SERVING until Redis is reached");
    let started = Instant::now();
    let (codes, _) = probe(&s, 3).await;
    assert_eq!(codes.get("Unavailable"), Some(&3));
    assert!(started.elapsed() < Duration::from_secs(3));

    let _redis = RedisProcess::start_on(port);
    s.wait_serving(Duration::from_secs(20)).await;
    let (codes, _) = probe(&s, 3).await;
    assert_eq!(codes.get("Ok"), Some(&3));
    s.stop().await;
}

/// The binary on a Sentinel set through the reference's variables alone: when the master dies and the
/// Sentinels promote its replica, requests are decided on the new master, and the log says once which
/// server the replica now counts on.
#[test]
fn follows_a_sentinel_failover_and_says_so_once() {
    let mut set = SentinelSet::start();
    let (running, _rules) = serving_on_sentinels(&set);
    assert_eq!(logins(&running, "before", 2), vec![200, 200]);

    let old_master = set.master.port;
    set.master.kill();
    let deadline = Instant::now() + Duration::from_secs(30);
    while set.master_port() == old_master {
        assert!(Instant::now() < deadline, "sentinel did not fail over");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(set.master_port(), set.replica.port);
    let deadline = Instant::now() + Duration::from_secs(30);
    while logins(&running, "probe", 1) != vec![200] {
        assert!(
            Instant::now() < deadline,
            "no recovery after failover: {}",
            running.log.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(common::until_far_from_a_minute_end());
    assert_eq!(
        logins(&running, "after", 6),
        vec![200, 200, 200, 200, 200, 429]
    );
    let keys = set
        .replica
        .cli(&["--scan", "--pattern", "fleet_login_after_*"]);
    assert_eq!(
        keys.lines().count(),
        1,
        "counted on the new master: {keys:?}"
    );
    let log = running.log.lock().unwrap().clone();
    let moved: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("Redis master is now"))
        .collect();
    assert_eq!(moved.len(), 1, "{log}");
    assert!(
        moved[0].contains(&format!(":{} (was ", set.replica.port))
            && moved[0].contains(&format!(":{old_master})")),
        "{log}"
    );
}

/// A planned failover (`SENTINEL FAILOVER`, as Redis charts run before stopping a master) promotes the
/// replica while the old master keeps taking writes until the Sentinels demote it, seconds later; what
/// is counted there meanwhile is lost when it resyncs from the new master. The replica follows the
/// Sentinels' announcement and counts on the new master from then on.
#[test]
fn a_planned_sentinel_failover_loses_no_count() {
    let set = SentinelSet::start();
    let (running, _rules) = serving_on_sentinels(&set);
    std::thread::sleep(common::until_far_from_a_minute_end());
    assert_eq!(logins(&running, "before", 1), vec![200]);

    assert_eq!(
        set.sentinels[0].cli(&["SENTINEL", "FAILOVER", "mymaster"]),
        "OK"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while set.master_port() != set.replica.port {
        assert!(Instant::now() < deadline, "sentinel did not fail over");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The switch is announced, and the replica follows it long before the Sentinels demote the old
    // master (some ten seconds): from then on every count goes to the new master.
    running.wait_log("Redis master is now", Duration::from_secs(5));
    let users: Vec<String> = (0..10).map(|i| format!("switched{i}")).collect();
    for user in &users {
        assert_eq!(logins(&running, user, 1), vec![200], "{user}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // The old master, demoted, has synced from the new one: what it alone held is gone.
    let deadline = Instant::now() + Duration::from_secs(40);
    while !set
        .master
        .cli(&["INFO", "replication"])
        .contains("master_link_status:up")
    {
        assert!(
            Instant::now() < deadline,
            "the old master was never demoted"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let lost: Vec<&String> = users
        .iter()
        .filter(|user| {
            let pattern = format!("fleet_login_{user}_*");
            set.replica
                .cli(&["--scan", "--pattern", &pattern])
                .trim()
                .is_empty()
        })
        .collect();
    assert!(
        lost.is_empty(),
        "counts lost in the failover: {lost:?}; log:\n{}",
        running.log.lock().unwrap()
    );
}

/// A Sentinel named in REDIS_URL that never answers (its client still connecting to it) does not hold up
/// the shutdown: the replica exits within moments of SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_that_never_answers_does_not_hold_up_the_shutdown() {
    let set = SentinelSet::start();
    let rules = tempfile::tempdir().unwrap();
    std::fs::write(rules.path().join("fleet.yaml"), RULES).unwrap();
    // A port nothing listens on, and one that takes connections and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!(
        "{},127.0.0.1:{},{}",
        set.url(),
        common::redis::free_port(),
        silent.local_addr().unwrap()
    );
    let mut cmd = common::binary(rules.path());
    cmd.envs([("REDIS_TYPE", "sentinel"), ("REDIS_URL", url.as_str())]);
    let mut running = common::start_binary(&mut cmd);
    assert!(
        running.serving_within(Duration::from_secs(20)),
        "{}",
        running.log.lock().unwrap()
    );
    let status = running.terminate(Duration::from_secs(8)).await;
    assert!(status.success(), "{status:?}");
}

/// The binary on a passwordless Sentinel set, serving; with the folder of its rules.
fn serving_on_sentinels(set: &SentinelSet) -> (common::Running, tempfile::TempDir) {
    let rules = tempfile::tempdir().unwrap();
    std::fs::write(rules.path().join("fleet.yaml"), RULES).unwrap();
    let running = on_sentinels(set, rules.path(), None, None);
    assert!(
        running.serving_within(Duration::from_secs(20)),
        "{}",
        running.log.lock().unwrap()
    );
    (running, rules)
}

/// The binary on a Sentinel set through the reference variables, with the given REDIS_AUTH and
/// REDIS_SENTINEL_AUTH.
fn on_sentinels(
    set: &SentinelSet,
    rules: &std::path::Path,
    auth: Option<&str>,
    sentinel_auth: Option<&str>,
) -> common::Running {
    let mut cmd = common::binary(rules);
    cmd.envs([
        ("REDIS_TYPE", "sentinel"),
        ("REDIS_URL", set.url().as_str()),
        ("REDIS_TIMEOUT", "500ms"),
        ("RATELIMITD_HASH_SECRET", "test-hash-secret"),
    ]);
    for (name, value) in [("REDIS_AUTH", auth), ("REDIS_SENTINEL_AUTH", sentinel_auth)] {
        if let Some(value) = value {
            cmd.env(name, value);
        }
    }
    common::start_binary(&mut cmd)
}

/// The HTTP statuses of `n` login checks for one user (limit 5 a minute).
fn logins(running: &common::Running, user: &str, n: usize) -> Vec<u16> {
    let body = format!(
        r#"{{"domain":"fleet","descriptors":[{{"entries":[{{"key":"login","value":"{user}"}}]}}]}}"#
    );
    (0..n)
        .map(|_| common::http_request(running.http, "POST", "/json", &body).0)
        .collect()
}

#[test]
fn sentinels_with_a_password_of_their_own_need_redis_sentinel_auth() {
    const MASTER_PASSWORD: &str = "master-password-41";
    const SENTINEL_PASSWORD: &str = "sentinel-password-73";
    let set = SentinelSet::start_with(SentinelPasswords {
        master: Some(MASTER_PASSWORD),
        sentinels: Some(SENTINEL_PASSWORD),
    });
    let rules = tempfile::tempdir().unwrap();
    std::fs::write(rules.path().join("fleet.yaml"), RULES).unwrap();

    let running = on_sentinels(
        &set,
        rules.path(),
        Some(MASTER_PASSWORD),
        Some(SENTINEL_PASSWORD),
    );
    assert!(
        running.serving_within(Duration::from_secs(20)),
        "not healthy with both passwords: {}",
        running.log.lock().unwrap()
    );
    std::thread::sleep(common::until_far_from_a_minute_end());
    assert_eq!(
        logins(&running, "eve", 6),
        vec![200, 200, 200, 200, 200, 429]
    );
    let keys = set
        .master
        .cli(&["--scan", "--pattern", "fleet_login_eve_*"]);
    assert_eq!(keys.lines().count(), 1, "counted on the master: {keys:?}");
    drop(running);

    // The master's password alone does not open the sentinels: never healthy, and the log says why.
    let running = on_sentinels(&set, rules.path(), Some(MASTER_PASSWORD), None);
    assert!(
        !running.serving_within(Duration::from_secs(4)),
        "healthy without the sentinels' password"
    );
    assert_ne!(logins(&running, "eve", 1), vec![200]);
    let log = running.log.lock().unwrap().clone();
    assert!(
        log.contains("Sentinel Error: NOAUTH Authentication required"),
        "{log}"
    );
    assert!(
        log.contains("the Sentinels want a password of their own: set REDIS_SENTINEL_AUTH"),
        "no hint of the setting in the log: {log}"
    );
    for secret in [MASTER_PASSWORD, SENTINEL_PASSWORD] {
        assert!(!log.contains(secret), "{secret} in the log: {log}");
    }
    drop(running);

    // The Sentinels' password alone: the master refuses, though the error reads as the Sentinels'.
    let running = on_sentinels(&set, rules.path(), None, Some(SENTINEL_PASSWORD));
    running.wait_log(
        "the Redis servers want a password: set REDIS_AUTH",
        Duration::from_secs(20),
    );
    assert!(!running.serving_within(Duration::from_secs(1)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovers_when_a_cluster_master_dies_and_its_replica_takes_over() {
    let mut cluster = RedisCluster::start(true);
    let s = start(cluster.url(), RedisTopology::Cluster).await;
    let (codes, _) = probe(&s, 30).await;
    assert_eq!(codes.get("Ok"), Some(&30));

    assert!(cluster.masters[0].cli(&["ROLE"]).starts_with("master"));
    cluster.masters[0].kill();
    let killed = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(40);
    let mut failures = 0;
    loop {
        let (codes, _) = probe(&s, 30).await;
        if codes.get("Ok") == Some(&30) {
            eprintln!(
                "recovered {:?} after the kill, {failures} failed rounds",
                killed.elapsed()
            );
            break;
        }
        failures += 1;
        assert!(
            Instant::now() < deadline,
            "no recovery after {failures} rounds: {codes:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    s.stop().await;
}

/// A Cluster master that dies with no replica to take over stops only the requests whose counters
/// live on it: the other masters' keys keep being decided, and the dead master's are answered at once
/// by the policy, not after waiting for it. (The Cluster is told to keep serving the slots it still
/// has, as the README says to; by default Redis stops it a `cluster-node-timeout` after the loss.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_cluster_master_stops_only_its_own_keys() {
    let mut cluster = RedisCluster::start(false);
    for master in &cluster.masters {
        master.cli(&["CONFIG", "SET", "cluster-require-full-coverage", "no"]);
    }
    // Silence alone would open the dead master's breaker only after 2 s, past REDIS_TIMEOUT (1 s): an
    // answer within it was not waited for.
    let s = start_tweaked(cluster.url(), RedisTopology::Cluster, |s| {
        s.redis.unresponsive_after = Duration::from_secs(2);
    })
    .await;
    let (codes, _) = probe(&s, 60).await;
    assert_eq!(codes.get("Ok"), Some(&60), "{codes:?}");

    // The 60 counters (keyed by the hour, so their spread over the masters changes with it): the
    // master killed holds some and not all of them.
    let held: Vec<u32> = cluster
        .masters
        .iter()
        .map(|m| {
            m.cli(&["--scan", "--pattern", "fleet_user_probe*"])
                .lines()
                .count() as u32
        })
        .collect();
    assert_eq!(held.iter().sum::<u32>(), 60, "{held:?}");
    let victim = (0..3)
        .filter(|&m| (1..60).contains(&held[m]))
        .max_by_key(|&m| held[m])
        .expect("the counters are on more than one master");
    cluster.masters[victim].kill();
    let expected = std::collections::BTreeMap::from([
        ("Ok".to_owned(), 60 - held[victim]),
        ("Unavailable".to_owned(), held[victim]),
    ]);
    let deadline = Instant::now() + Duration::from_secs(10);
    let (codes, slowest) = loop {
        let (codes, slowest) = probe(&s, 60).await;
        if codes == expected {
            break (codes, slowest);
        }
        assert!(
            Instant::now() < deadline,
            "the other masters' keys are not decided: {codes:?}, {held:?} held, master {victim} killed"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // Past the Cluster's own verdict on it (node timeout 1 s), the same: its keys are answered without
    // waiting for it, the others decided.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (later, slowest_after) = probe(&s, 60).await;
    assert_eq!(
        later, codes,
        "slowest {slowest_after:?} (first: {slowest:?})"
    );
    assert!(
        slowest_after < Duration::from_millis(700),
        "slowest {slowest_after:?} (first: {slowest:?})"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connects_with_a_password_an_acl_user_and_over_a_unix_socket() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("redis.sock");
    let redis = RedisProcess::start(&[
        "--requirepass",
        "topsecret",
        "--unixsocket",
        socket.to_str().unwrap(),
        "--unixsocketperm",
        "700",
    ]);
    assert_eq!(
        redis.cli(&[
            "ACL",
            "SETUSER",
            "limiter",
            "on",
            ">limiterpw",
            "~*",
            "+@all"
        ]),
        "OK"
    );
    let with_auth = |auth: &'static str| {
        move |s: &mut Settings| {
            s.redis.auth = ratelimitd::settings::Secret(auth.into());
        }
    };
    for (url, auth) in [
        (redis.addr(), "topsecret"),
        (redis.addr(), "limiter:limiterpw"),
        (socket.to_str().unwrap().to_string(), "topsecret"),
    ] {
        let s = start_tweaked(url.clone(), RedisTopology::Single, with_auth(auth)).await;
        let (codes, _) = probe(&s, 3).await;
        assert_eq!(codes.get("Ok"), Some(&3), "{url}: {codes:?}");
        s.stop().await;
    }

    // A wrong password keeps the service NOT_SERVING and answers by policy, without the password in
    // any message.
    let s = TestServer::start_with_clock(&[("fleet.yaml", RULES)], Clock::System, |s| {
        on_redis(redis.addr(), RedisTopology::Single)(s);
        s.redis.auth = ratelimitd::settings::Secret("wrong-password-123".into());
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(s.http("GET", "/healthcheck", "").await.0, 500);
    let mut c = s.client().await;
    let err = c
        .should_rate_limit(request("fleet", vec![descriptor(&[("user", "x")])]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);
    assert!(
        !err.message().contains("wrong-password-123"),
        "{}",
        err.message()
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follows_a_slot_migration_under_traffic_without_errors() {
    let cluster = RedisCluster::start(false);
    let s = start(cluster.url(), RedisTopology::Cluster).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut loads = Vec::new();
    for caller in 0..5 {
        let (mut c, stop) = (s.client().await, stop.clone());
        loads.push(tokio::spawn(async move {
            let mut codes = std::collections::BTreeMap::<String, u32>::new();
            let mut i = 0u32;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let user = format!("move{caller}-{}", i % 2000);
                let r = request("fleet", vec![descriptor(&[("user", &user)])]);
                let code = match c.should_rate_limit(r).await {
                    Ok(resp) => format!(
                        "{:?}",
                        Code::try_from(resp.into_inner().overall_code).unwrap()
                    ),
                    Err(status) => format!("{:?}: {}", status.code(), status.message()),
                };
                *codes.entry(code).or_default() += 1;
            }
            codes
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let from = cluster.masters[0].cli(&["CLUSTER", "MYID"]);
    let to = cluster.masters[1].cli(&["CLUSTER", "MYID"]);
    let reshard = tokio::task::spawn_blocking({
        let seed = cluster.masters[0].addr();
        move || {
            std::process::Command::new("redis-cli")
                .args([
                    "--cluster",
                    "reshard",
                    &seed,
                    "--cluster-from",
                    &from,
                    "--cluster-to",
                    &to,
                    "--cluster-slots",
                    "300",
                    "--cluster-yes",
                ])
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    assert!(
        reshard.status.success(),
        "{}",
        String::from_utf8_lossy(&reshard.stdout)
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let mut total = std::collections::BTreeMap::<String, u32>::new();
    for load in loads {
        for (code, n) in load.await.unwrap() {
            *total.entry(code).or_default() += n;
        }
    }
    assert_eq!(
        total.len(),
        1,
        "only OK answers while slots moved: {total:?}"
    );
    assert!(total.get("Ok").copied().unwrap_or(0) > 100, "{total:?}");
    cluster.wait_ok();
    s.stop().await;
}

/// A slot being migrated key by key: the keys already on the new master are asked there (Redis answers
/// ASK for them meanwhile). Held in that state for half a second per slot, under traffic on its keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_a_migration_has_moved_already_are_decided_at_once_and_counted_exactly() {
    const VALUES: u32 = 40;
    const LIMIT: u32 = 1000;
    let cluster = RedisCluster::start(false);
    let s = start(cluster.url(), RedisTopology::Cluster).await;
    common::far_from_a_minute_end().await;
    let mover = |caller: u32, j: u32| {
        let values: Vec<String> = (0..5).map(|d| format!("ask{caller}-{j}-{d}")).collect();
        let descriptors = values.iter().map(|v| descriptor(&[("mover", v)])).collect();
        request("fleet", descriptors)
    };
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut loads = Vec::new();
    for caller in 0..4 {
        let (mut c, stop) = (s.client().await, stop.clone());
        loads.push(tokio::spawn(async move {
            let mut hits = vec![0u32; VALUES as usize];
            let mut others = std::collections::BTreeMap::<String, u32>::new();
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let j = i % VALUES;
                i += 1;
                match c.should_rate_limit(mover(caller, j)).await {
                    Ok(resp) if resp.get_ref().overall_code == Code::Ok as i32 => {
                        hits[j as usize] += 1
                    }
                    Ok(resp) => *others.entry(format!("{resp:?}")).or_default() += 1,
                    Err(status) => *others.entry(format!("{status:?}")).or_default() += 1,
                }
            }
            (hits, others)
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    let (from, to) = (&cluster.masters[0], &cluster.masters[1]);
    let keys = from.cli(&["--scan", "--pattern", "fleet_mover_ask*"]);
    let mut slots: Vec<String> = keys
        .lines()
        .map(|key| from.cli(&["CLUSTER", "KEYSLOT", key]))
        .collect();
    slots.sort();
    slots.dedup();
    slots.truncate(8);
    assert!(
        slots.len() >= 4,
        "the callers' counters on master 0: {keys}"
    );
    let ids: Vec<String> = cluster
        .masters
        .iter()
        .map(|m| m.cli(&["CLUSTER", "MYID"]))
        .collect();
    for slot in &slots {
        assert_eq!(
            to.cli(&["CLUSTER", "SETSLOT", slot, "IMPORTING", &ids[0]]),
            "OK"
        );
        assert_eq!(
            from.cli(&["CLUSTER", "SETSLOT", slot, "MIGRATING", &ids[1]]),
            "OK"
        );
        let port = to.addr().rsplit_once(':').unwrap().1.to_owned();
        for key in from.cli(&["CLUSTER", "GETKEYSINSLOT", slot, "100"]).lines() {
            let moved = from.cli(&["MIGRATE", "127.0.0.1", &port, key, "0", "5000"]);
            assert_eq!(moved, "OK", "{key}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        // The new owner first, as Redis's documentation orders it.
        for master in [to, from, &cluster.masters[2]] {
            master.cli(&["CLUSTER", "SETSLOT", slot, "NODE", &ids[1]]);
        }
    }
    let asked: u64 = from
        .cli(&["INFO", "errorstats"])
        .lines()
        .find_map(|l| l.strip_prefix("errorstat_ASK:count="))
        .map_or(0, |n| n.trim().parse().unwrap());
    let asking = command_calls(&to.cli(&["INFO", "commandstats"]), "asking");
    stop.store(true, Ordering::Relaxed);
    let mut hits = Vec::new();
    for load in loads {
        let (caller_hits, others) = load.await.unwrap();
        assert!(others.is_empty(), "every request decided OK: {others:?}");
        hits.push(caller_hits);
    }
    assert!(
        asked > 0,
        "no request met a key already moved ({} slots moved)",
        slots.len()
    );
    assert!(
        asking > 0,
        "{asked} ASK replies, none followed to the new master"
    );

    // Each counter holds exactly its hits: the next request sees the rest of the limit.
    let mut c = s.client().await;
    for (caller, caller_hits) in hits.iter().enumerate() {
        for (j, &n) in caller_hits.iter().enumerate() {
            let resp = c
                .should_rate_limit(mover(caller as u32, j as u32))
                .await
                .unwrap()
                .into_inner();
            let remaining: Vec<u32> = resp.statuses.iter().map(|s| s.limit_remaining).collect();
            assert_eq!(
                remaining,
                vec![LIMIT - n - 1; 5],
                "caller {caller}, value {j}: {n} hits"
            );
        }
    }
    cluster.wait_ok();
    s.stop().await;
}

/// A Cluster that lost a master without a replica answers CLUSTERDOWN on every master (Redis's default
/// `cluster-require-full-coverage yes`), and the Redis client makes a new connection after each such
/// reply. The replica says so once per master and keeps their breakers open until the Cluster serves
/// again, then decides every request. A master no request reaches after that is not reported open.
#[test]
fn a_cluster_down_is_said_once_per_master_and_served_again_when_it_is_back() {
    let mut cluster = RedisCluster::start(false);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("fleet.yaml"), RULES).unwrap();
    let mut cmd = common::binary(dir.path());
    cmd.envs([
        ("REDIS_TYPE", "cluster"),
        ("REDIS_URL", &cluster.url()),
        ("RATELIMITD_HASH_SECRET", "test-hash-secret"),
    ]);
    let running = common::start_binary(&mut cmd);
    assert!(running.serving_within(Duration::from_secs(20)));
    let body = |i: u32| {
        format!(
            r#"{{"domain":"fleet","descriptors":[{{"entries":[{{"key":"user","value":"down{i}"}}]}}]}}"#
        )
    };
    let answers = |from: u32| -> std::collections::BTreeMap<u16, u32> {
        let mut codes = std::collections::BTreeMap::new();
        for i in from..from + 30 {
            let (code, _) = common::http_request(running.http, "POST", "/json", &body(i));
            *codes.entry(code).or_default() += 1;
        }
        codes
    };
    assert_eq!(answers(0), [(200, 30)].into());

    cluster.masters[0].kill();
    // Past the node timeout (1 s) the other masters answer CLUSTERDOWN: 4 s of requests.
    let breaker = || {
        let (_, metrics) = common::http_request(running.http, "GET", "/metrics", "");
        let line = "ratelimitd_backend_breaker_open{backend=\"redis\"} ";
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(line)?.parse::<u8>().ok())
            .expect("the breaker gauge")
    };
    let until = Instant::now() + Duration::from_secs(4);
    let mut while_down = std::collections::BTreeMap::<u16, u32>::new();
    let mut seen_open = false;
    while Instant::now() < until {
        for (code, n) in answers(0) {
            *while_down.entry(code).or_default() += n;
        }
        seen_open |= breaker() == 1;
    }
    assert!(while_down.contains_key(&503), "{while_down:?}");
    assert!(
        seen_open,
        "the gauge showed a breaker open while the Cluster was down"
    );

    cluster.masters[0].restart();
    cluster.wait_ok();
    // One counter, on one master: the others get no request.
    let deadline = Instant::now() + Duration::from_secs(10);
    while common::http_request(running.http, "POST", "/json", &body(100)).0 != 200 {
        assert!(Instant::now() < deadline, "not served again");
        std::thread::sleep(Duration::from_millis(100));
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    while breaker() != 0 {
        assert!(
            Instant::now() < deadline,
            "a breaker reported open 3 s after the Cluster served again"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while answers(100) != [(200, 30)].into() {
        assert!(Instant::now() < deadline, "not served again");
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = running.log.lock().unwrap().clone();
    let breaker: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("store::redis") && l.contains("breaker"))
        .collect();
    let refusing = breaker.iter().filter(|l| l.contains("refusing every key"));
    assert_eq!(
        refusing.count(),
        2,
        "one line per live master: {breaker:#?}"
    );
    // Beside those, the killed master's, and one line per master when it serves again.
    let opened = breaker
        .iter()
        .filter(|l| l.contains("breaker open"))
        .count();
    let closed = breaker
        .iter()
        .filter(|l| l.contains("breaker closed"))
        .count();
    assert!(
        opened <= 3 && closed <= 3,
        "each master's breaker opened and closed once: {breaker:#?}"
    );
}

/// A script that ran on Redis and whose answer was lost with its connection is not sent again on a new
/// one (it would count its hits twice): its request is answered by policy, its hits counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_whose_answer_is_lost_with_its_connection_is_not_counted_twice() {
    let redis = RedisProcess::start(&[]);
    let proxy = AnswerDropper::start(redis.addr());
    let s = start(proxy.addr(), RedisTopology::Single).await;
    common::far_from_a_minute_end().await;
    let mut c = s.client().await;
    let hit = || request("fleet", vec![descriptor(&[("mover", "lost-answer")])]);
    let first = c.should_rate_limit(hit()).await.unwrap().into_inner();
    assert_eq!(first.statuses[0].limit_remaining, 999);

    proxy.arm("EVALSHA");
    let lost = c.should_rate_limit(hit()).await;
    assert!(proxy.fired(), "the proxy dropped an answer");
    assert_eq!(
        lost.map(|r| r.into_inner().overall_code)
            .map_err(|e| e.code()),
        Err(tonic::Code::Unavailable),
        "its answer lost: answered by on_backend_error (error)"
    );
    let third = c.should_rate_limit(hit()).await.unwrap().into_inner();
    assert_eq!(
        third.statuses[0].limit_remaining, 997,
        "three hits counted, the lost one once"
    );
    let keys = redis.cli(&["--scan", "--pattern", "fleet_mover_lost-answer*"]);
    let key = keys.lines().next().expect("its counter");
    assert_eq!(redis.cli(&["GET", key]), "3");
    s.stop().await;
}

#[test]
fn sensitive_values_and_secrets_never_reach_redis_keys_logs_metrics_or_rlconfig() {
    const RAW_KEY: &str = "sk_live_RAWSECRET42";
    const CONFIGURED: &str = "tok_configured_SECRET7";
    const HASH_SECRET: &str = "hash-secret-NEVER-SHOWN";
    const PASSWORD: &str = "redis-password-NEVER-SHOWN";
    let mut redis = RedisProcess::start(&["--requirepass", PASSWORD]);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("api.yaml"),
        format!(
            "domain: api\ndescriptors:\n  - key: api_key\n    rate_limit: {{unit: minute, requests_per_unit: 2}}\n  - key: token\n    value: {CONFIGURED}\n    hash_value: true\n    rate_limit: {{unit: minute, requests_per_unit: 1, algorithm: token_bucket}}\n"
        ),
    )
    .unwrap();
    let mut cmd = common::binary(dir.path());
    cmd.envs([
        ("LOG_LEVEL", "debug"),
        ("REDIS_URL", &redis.addr()),
        ("REDIS_AUTH", PASSWORD),
        ("RATELIMITD_HASH_SECRET", HASH_SECRET),
    ]);
    let running = common::start_binary(&mut cmd);
    assert!(
        running.serving_within(Duration::from_secs(20)),
        "not healthy in time"
    );
    let body = |key: &str, value: &str| {
        format!(
            r#"{{"domain":"api","descriptors":[{{"entries":[{{"key":"{key}","value":"{value}"}}]}}]}}"#
        )
    };
    std::thread::sleep(common::until_far_from_a_minute_end());
    let mut codes = Vec::new();
    for _ in 0..3 {
        codes
            .push(common::http_request(running.http, "POST", "/json", &body("api_key", RAW_KEY)).0);
        codes.push(
            common::http_request(running.http, "POST", "/json", &body("token", CONFIGURED)).0,
        );
    }
    assert_eq!(
        codes,
        vec![200, 200, 200, 429, 429, 429],
        "the hashed keys still count"
    );
    // Errors too: a malformed request and an empty domain.
    common::http_request(
        running.http,
        "POST",
        "/json",
        &format!("{{\"bad\": \"{RAW_KEY}\"}}"),
    );
    common::http_request(
        running.http,
        "POST",
        "/json",
        r#"{"domain":"","descriptors":[]}"#,
    );
    let keys = redis.cli(&["--scan"]);
    assert!(keys.contains("api_api_key_hmac-"), "{keys}");
    // And backend errors: Redis gone mid-run, requests answered by the policy, reconnects logged.
    redis.kill();
    for _ in 0..3 {
        let (code, _) =
            common::http_request(running.http, "POST", "/json", &body("api_key", RAW_KEY));
        assert_ne!(code, 200, "answered without Redis");
    }
    // A refused reconnect is logged: the log checked below covers the outage.
    running.wait_log(
        "Redis connection error: IO Error: Os",
        Duration::from_secs(10),
    );
    let (_, rlconfig) = common::http_request(running.http, "GET", "/rlconfig", "");
    let (_, metrics) = common::http_request(running.http, "GET", "/metrics", "");
    let (_, top) = common::http_request(running.http, "GET", "/debug/top", "");
    assert!(
        metrics.contains("ratelimit_service_rate_limit_total_hits"),
        "{metrics}"
    );
    assert!(rlconfig.contains("api.token_hmac-"), "{rlconfig}");
    assert!(top.contains("hmac-"), "{top}");
    let log = running.log.lock().unwrap().clone();
    for (place, text) in [
        ("Redis keys", &keys),
        ("/rlconfig", &rlconfig),
        ("/metrics", &metrics),
        ("/debug/top", &top),
        ("log", &log),
    ] {
        for secret in [RAW_KEY, CONFIGURED, HASH_SECRET, PASSWORD] {
            assert!(
                !text.contains(secret),
                "{secret} appears in {place}:\n{text}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_hot_key_attack_the_deny_cache_keeps_redis_out_of_it() {
    let redis = RedisProcess::start(&[]);
    let s = start_tweaked(redis.addr(), RedisTopology::Single, |s| {
        s.local_cache_max_entries = 1000;
    })
    .await;
    let before = command_calls(&redis.cli(&["INFO", "commandstats"]), "evalsha");
    let mut c = s.client().await;
    // Every request below must fall in one minute window: a new one would allow 5 more.
    common::far_from_a_minute_end().await;
    let mut allowed = 0;
    for _ in 0..200 {
        let resp = ask(
            &mut c,
            request("fleet", vec![descriptor(&[("login", "victim")])]),
        )
        .await;
        if resp.overall_code == Code::Ok as i32 {
            allowed += 1;
        } else {
            assert!(
                resp.statuses[0]
                    .duration_until_reset
                    .as_ref()
                    .unwrap()
                    .seconds
                    >= 1
            );
        }
    }
    assert_eq!(allowed, 5, "the cache changes no decision");
    let calls = command_calls(&redis.cli(&["INFO", "commandstats"]), "evalsha") - before;
    assert!(calls <= 7, "Redis saw {calls} calls for 200 requests");
    // A request with another, uncached descriptor still reaches Redis, read-only for that one.
    let resp = ask(
        &mut c,
        request(
            "fleet",
            vec![
                descriptor(&[("login", "victim")]),
                descriptor(&[("user", "bystander")]),
            ],
        ),
    )
    .await;
    assert_eq!(resp.overall_code, Code::OverLimit as i32);
    assert_eq!(
        resp.statuses[1].limit_remaining, 200,
        "the bystander was not charged"
    );
    let (_, metrics) = s.http("GET", "/metrics", "").await;
    let cached_line = metrics
        .lines()
        .find(|l| l.starts_with("ratelimit_service_rate_limit_over_limit_with_local_cache{"))
        .unwrap_or_else(|| panic!("{metrics}"));
    // 200 - 5 allowed - 1 denied by Redis itself, plus the mixed request.
    assert!(cached_line.ends_with(" 195"), "{cached_line}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_limits_count_on_the_per_second_redis_only() {
    let main = RedisProcess::start(&[]);
    let per_second = RedisProcess::start(&[]);
    let rules = tempfile::tempdir().unwrap();
    std::fs::write(
        rules.path().join("pace.yaml"),
        "domain: pace\ndescriptors:\n  - key: burst\n    rate_limit: {unit: second, requests_per_unit: 5}\n  - key: steady\n    rate_limit: {unit: minute, requests_per_unit: 100}\n",
    )
    .unwrap();
    let mut cmd = common::binary(rules.path());
    cmd.envs([
        ("REDIS_URL", main.addr().as_str()),
        ("REDIS_PERSECOND", "true"),
        ("REDIS_PERSECOND_SOCKET_TYPE", "tcp"),
        ("REDIS_PERSECOND_URL", per_second.addr().as_str()),
        ("REDIS_PERSECOND_POOL_SIZE", "2"),
        ("EXPIRATION_JITTER_MAX_SECONDS", "0"),
    ]);
    let running = common::start_binary(&mut cmd);
    assert!(
        running.serving_within(Duration::from_secs(20)),
        "not serving: {}",
        running.log.lock().unwrap()
    );
    let mut client =
        ratelimitd::proto::RateLimitServiceClient::connect(format!("http://{}", running.grpc))
            .await
            .unwrap();
    let both = |burst_cost: Option<u64>| {
        let mut burst = descriptor(&[("burst", "b1")]);
        burst.hits_addend = burst_cost;
        request("pace", vec![burst, descriptor(&[("steady", "s1")])])
    };
    let answer = ask(&mut client, both(None)).await;
    assert_eq!(answer.overall_code, Code::Ok as i32);

    // Each limit where its unit says: the minute on the main Redis, the second on the other one.
    let scan = |redis: &RedisProcess| redis.cli(&["--scan", "--pattern", "pace_*"]);
    let (on_main, on_second) = (scan(&main), scan(&per_second));
    assert!(
        on_main.starts_with("pace_steady_s1_") && on_main.lines().count() == 1,
        "main Redis: {on_main:?}"
    );
    assert!(
        on_second.starts_with("pace_burst_b1_") && on_second.lines().count() == 1,
        "per-second Redis: {on_second:?}"
    );
    assert_eq!(main.cli(&["GET", on_main.trim()]), "1");

    // A request the per-second limit denies consumes nothing on the main Redis either.
    let answer = ask(&mut client, both(Some(10))).await;
    assert_eq!(answer.overall_code, Code::OverLimit as i32);
    assert_eq!(
        main.cli(&["GET", on_main.trim()]),
        "1",
        "the minute counter was given back"
    );
}
