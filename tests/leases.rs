//! Quota leases on a hot counter: three ratelimitd replicas on one Redis, 64 concurrent callers over gRPC
//! on one `generic_key: global` counter. Redis sees a small fraction of a call per request, and the fleet
//! admits exactly the limit: never more, and, once every lease ended, not less.

mod common;

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use common::{descriptor, redis::command_calls, redis::RedisProcess, request, TestServer};
use ratelimitd::{
    clock::Clock,
    proto::rate_limit_response::Code,
    settings::{BackendKind, RedisTopology},
};

const RULES: &str = r#"
domain: hot
descriptors:
  - key: generic_key
    value: busy
    rate_limit: {unit: day, requests_per_unit: 1000000000}
  - key: generic_key
    value: global
    rate_limit: {unit: day, requests_per_unit: 6000}
  - key: generic_key
    value: sliding
    rate_limit: {unit: day, requests_per_unit: 1000000000, algorithm: sliding_window}
  - key: generic_key
    value: windowed
    rate_limit: {unit: day, requests_per_unit: 6000, algorithm: sliding_window}
  - key: generic_key
    value: bucket
    rate_limit: {unit: day, requests_per_unit: 1000000000, algorithm: token_bucket}
  - key: caller
    rate_limit: {unit: second, requests_per_unit: 1000000000}
  - key: probe
    rate_limit: {unit: day, requests_per_unit: 1000000000, algorithm: sliding_window}
  - key: account
    rate_limit: {unit: day, requests_per_unit: 1000}
"#;

const ADMIN_TOKEN: &str = "leases-admin-token-0123456789abcdef";

/// Whether the first replica serves the operators' API, and how the others learn of its changes.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Admin {
    Off,
    /// Leases last longer than the refresh interval (500 ms): the replicas see a reset while they
    /// still hold the leases it must end.
    SeenWhileHeld,
    /// The other replicas read the operators' changes once a minute: their leases end by time (the
    /// default 200 ms) long before they learn of a reset.
    SeenLate,
}

/// Three replicas with the defaults, on one Redis.
async fn fleet(redis: &RedisProcess) -> Vec<TestServer> {
    fleet_with_admin(redis, Admin::Off).await
}

/// Three replicas on one Redis; the first serves the operators' API unless `admin` is off.
async fn fleet_with_admin(redis: &RedisProcess, admin: Admin) -> Vec<TestServer> {
    let mut fleet = Vec::new();
    for i in 0..3 {
        let url = redis.addr();
        let s = TestServer::start_with_clock(&[("hot.yaml", RULES)], Clock::System, move |s| {
            on_redis(s, url);
            match admin {
                Admin::SeenWhileHeld => s.redis.lease_for = Duration::from_secs(3),
                Admin::SeenLate if i > 0 => {
                    s.runtime_limits.refresh_interval = Duration::from_secs(60)
                }
                _ => {}
            }
            if admin != Admin::Off && i == 0 {
                s.admin.enabled = true;
                s.admin.token = ratelimitd::settings::Secret(ADMIN_TOKEN.into());
            }
        })
        .await;
        s.wait_serving(Duration::from_secs(20)).await;
        fleet.push(s);
    }
    fleet
}

/// A replica of the fleet: on the Redis at `url`, with the defaults.
fn on_redis(s: &mut ratelimitd::settings::Settings, url: String) {
    s.backend = Some(BackendKind::Redis);
    s.redis.url = url;
    s.redis.topology = RedisTopology::Single;
    s.hash_secret = ratelimitd::settings::Secret("leases".into());
}

/// 64 callers spread over the fleet send requests on `generic_key=value` until `stop` says so; returns
/// the requests sent and those allowed.
async fn hammer(
    fleet: &[TestServer],
    value: &'static str,
    stop: impl Fn(u64, u64) -> bool + Send + Sync + 'static,
) -> (u64, u64) {
    let (sent, allowed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let stop = Arc::new(stop);
    let done = Arc::new(AtomicBool::new(false));
    let mut callers = Vec::new();
    for i in 0..64 {
        let mut client = fleet[i % fleet.len()].client().await;
        let (sent, allowed, stop, done) =
            (sent.clone(), allowed.clone(), stop.clone(), done.clone());
        callers.push(tokio::spawn(async move {
            let mut denied_in_a_row = 0;
            while !done.load(Ordering::Relaxed) {
                let r = request("hot", vec![descriptor(&[("generic_key", value)])]);
                let answer = client
                    .should_rate_limit(r)
                    .await
                    .expect("answered")
                    .into_inner();
                let n = sent.fetch_add(1, Ordering::Relaxed) + 1;
                if answer.overall_code == Code::Ok as i32 {
                    allowed.fetch_add(1, Ordering::Relaxed);
                    denied_in_a_row = 0;
                } else {
                    denied_in_a_row += 1;
                }
                if stop(n, denied_in_a_row) {
                    done.store(true, Ordering::Relaxed);
                }
            }
        }));
    }
    for c in callers {
        c.await.unwrap();
    }
    (
        sent.load(Ordering::Relaxed),
        allowed.load(Ordering::Relaxed),
    )
}

/// Waits out the last two minutes of a UTC day, so that a test's counters live in one daily window.
async fn inside_one_day() {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let left = 86_400 - now % 86_400;
    if left < 120 {
        tokio::time::sleep(Duration::from_secs(left + 1)).await;
    }
}

fn evalsha(redis: &RedisProcess) -> u64 {
    command_calls(&redis.cli(&["INFO", "commandstats"]), "evalsha")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_global_counter_costs_redis_a_fraction_of_a_call_per_request() {
    inside_one_day().await;
    let redis = RedisProcess::start(&[]);
    let fleet = fleet(&redis).await;
    let before = evalsha(&redis);
    let (sent, allowed) = hammer(&fleet, "busy", |sent, _| sent >= 15_000).await;
    let calls = evalsha(&redis) - before;
    assert_eq!(allowed, sent, "every request within the limit is allowed");
    let per_request = calls as f64 / sent as f64;
    eprintln!("{calls} script calls for {sent} requests: {per_request:.4} per request");
    assert!(
        per_request <= 0.05,
        "{per_request:.4} Redis calls per request"
    );
    let mut answered = 0.0;
    for s in &fleet {
        answered += s
            .metric("ratelimitd_redis_lease_answers_total")
            .await
            .unwrap();
        assert!(
            s.metric("ratelimitd_redis_lease_granted_hits_total")
                .await
                .unwrap()
                > 0.0
        );
    }
    assert!(
        answered > sent as f64 * 0.9,
        "{answered} of {sent} answered from leases"
    );

    // Every hit counted in Redis was admitted, once the leases ended and gave back what was left.
    for s in &fleet {
        s.wait_leases_given_back(Duration::from_secs(5)).await;
    }
    let key = redis.cli(&["--scan", "--pattern", "hot_generic_key_busy_*"]);
    assert_eq!(redis.cli(&["GET", key.trim()]), sent.to_string());

    // A sliding window is leased too, and gets back what its leases did not admit.
    let before = evalsha(&redis);
    let (sent, allowed) = hammer(&fleet, "sliding", |sent, _| sent >= 5_000).await;
    assert_eq!(allowed, sent);
    assert!(evalsha(&redis) - before < sent / 10);
    for s in &fleet {
        s.wait_leases_given_back(Duration::from_secs(5)).await;
    }
    let key = redis.cli(&["--scan", "--pattern", "*generic%5Fkey_sliding_*"]);
    assert_eq!(redis.cli(&["HGET", key.trim(), "c"]), sent.to_string());

    // A token bucket is never leased: a hit taken early would be refilled by the time it is spent.
    let before = evalsha(&redis);
    let (sent, _) = hammer(&fleet, "bucket", |sent, _| sent >= 2_000).await;
    let calls = evalsha(&redis) - before;
    assert!(
        calls as f64 > sent as f64 * 0.05,
        "{calls} calls for {sent} requests"
    );
    for s in fleet {
        s.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_admits_exactly_the_limit_with_leases() {
    inside_one_day().await;
    let redis = RedisProcess::start(&[]);
    let fleet = fleet(&redis).await;
    // Until the limit is spent everywhere: every caller of a replica keeps going while its replica
    // admits, from a lease or from Redis.
    let (sent, mut allowed) =
        hammer(&fleet, "global", |_, denied_in_a_row| denied_in_a_row >= 50).await;
    assert!(allowed <= 6_000, "{allowed} admitted on a limit of 6 000");
    let mut granted = 0.0;
    for s in &fleet {
        granted += s
            .metric("ratelimitd_redis_lease_granted_hits_total")
            .await
            .unwrap();
    }
    assert!(granted > 0.0, "the counter was leased");
    // Leases that ended unspent gave their hits back; what is left is admitted, request by request.
    for s in &fleet {
        s.wait_leases_given_back(Duration::from_secs(5)).await;
    }
    let key = redis.cli(&["--scan", "--pattern", "hot_generic_key_global_*"]);
    let counted: u64 = redis.cli(&["GET", key.trim()]).parse().unwrap();
    assert_eq!(counted, allowed, "Redis counted what the fleet admitted");
    for s in &fleet {
        let mut client = s.client().await;
        for _ in 0..(6_000 - allowed).div_ceil(3) + 5 {
            let r = request("hot", vec![descriptor(&[("generic_key", "global")])]);
            if client
                .should_rate_limit(r)
                .await
                .unwrap()
                .into_inner()
                .overall_code
                == Code::Ok as i32
            {
                allowed += 1;
            }
        }
    }
    eprintln!("{sent} requests, {allowed} admitted, {granted} hits leased");
    assert_eq!(allowed, 6_000, "exactly the limit");
    assert_eq!(redis.cli(&["GET", key.trim()]), "6000");
    for s in fleet {
        s.stop().await;
    }
}

/// One replica on `redis`, with the defaults, serving.
async fn replica(redis: &RedisProcess) -> TestServer {
    let url = redis.addr();
    let s =
        TestServer::start_with_clock(&[("hot.yaml", RULES)], Clock::System, |s| on_redis(s, url))
            .await;
    s.wait_serving(Duration::from_secs(20)).await;
    s
}

/// 32 callers on the hot `busy` counter, each request with a 100 ms deadline, until stopped.
struct Impatient {
    ok: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    done: Arc<AtomicBool>,
    callers: Vec<tokio::task::JoinHandle<()>>,
}

/// What [`Impatient`] callers were answered: admitted, and answered by the policy (their deadline
/// passed first).
struct Answered {
    ok: u64,
    failed: u64,
}

impl Impatient {
    /// Callers on `s`, sending for a second before this returns: leases held and renewed.
    async fn start(s: &TestServer) -> Self {
        let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let done = Arc::new(AtomicBool::new(false));
        let mut callers = Vec::new();
        for _ in 0..32 {
            let mut client = s.client().await;
            let (ok, failed, done) = (ok.clone(), failed.clone(), done.clone());
            callers.push(tokio::spawn(async move {
                while !done.load(Ordering::Relaxed) {
                    let mut r = tonic::Request::new(request(
                        "hot",
                        vec![descriptor(&[("generic_key", "busy")])],
                    ));
                    r.set_timeout(Duration::from_millis(100));
                    match client.should_rate_limit(r).await {
                        Ok(a) if a.get_ref().overall_code == Code::Ok as i32 => &ok,
                        Ok(a) => panic!("denied under a limit of a billion: {a:?}"),
                        Err(_) => &failed,
                    }
                    .fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        Self {
            ok,
            failed,
            done,
            callers,
        }
    }

    async fn stop(self) -> Answered {
        self.done.store(true, Ordering::Relaxed);
        for c in self.callers {
            c.await.unwrap();
        }
        Answered {
            ok: self.ok.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
        }
    }
}

impl Answered {
    /// Once every lease ended, Redis counts the requests admitted and at most those answered by the
    /// policy (their calls may have run after they stopped waiting): never hits no replica holds.
    fn assert_counted_by(&self, redis: &RedisProcess) {
        let Self { ok, failed } = *self;
        let key = redis.cli(&["--scan", "--pattern", "hot_generic_key_busy_*"]);
        let counted: u64 = redis.cli(&["GET", key.trim()]).parse().unwrap();
        eprintln!("{ok} admitted, {failed} answered by the policy, {counted} counted");
        assert!(failed > 0, "some requests waited past their deadline");
        assert!(
            (ok..=ok + failed).contains(&counted),
            "{counted} counted for {ok} admitted and {failed} answered by the policy"
        );
    }
}

/// Leases granted by calls whose requests had stopped waiting (Redis paused past their deadline) are
/// given back: once every lease ended, Redis counts the requests admitted and at most those answered
/// by the policy while it was paused (their calls ran after it), never hits no replica holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_granted_after_their_requests_deadline_are_given_back() {
    inside_one_day().await;
    let redis = RedisProcess::start(&[]);
    let s = replica(&redis).await;
    let callers = Impatient::start(&s).await;
    // Redis paused twice past every request's deadline.
    for _ in 0..2 {
        assert_eq!(redis.cli(&["CLIENT", "PAUSE", "400", "ALL"]), "OK");
        tokio::time::sleep(Duration::from_millis(1_200)).await;
    }
    let answered = callers.stop().await;
    s.wait_leases_given_back(Duration::from_secs(5)).await;
    // The last give-backs, of leases granted after their deadline, are sent at once but not waited.
    tokio::time::sleep(Duration::from_millis(500)).await;
    answered.assert_counted_by(&redis);
    s.stop().await;
}

/// A replica that shuts down while Redis is slow: leases granted to requests that had stopped waiting
/// are given back before its connections close, not lost with them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_granted_as_a_replica_shuts_down_are_given_back() {
    inside_one_day().await;
    let redis = RedisProcess::start(&[]);
    let s = replica(&redis).await;
    let callers = Impatient::start(&s).await;
    // Redis pauses, the requests waiting on it pass their deadline, and the replica shuts down while
    // their calls are still out.
    assert_eq!(redis.cli(&["CLIENT", "PAUSE", "500", "ALL"]), "OK");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let answered = callers.stop().await;
    s.stop().await;
    answered.assert_counted_by(&redis);
}

/// A replica on `redis` and, for its per-second limits, on `per_second`, which then refuses every write
/// (out of memory).
async fn with_a_failing_per_second_redis(
    redis: &RedisProcess,
    per_second: &RedisProcess,
) -> TestServer {
    let (url, second_url) = (redis.addr(), per_second.addr());
    let s = TestServer::start_with_clock(&[("hot.yaml", RULES)], Clock::System, |s| {
        on_redis(s, url);
        s.redis_per_second = Some(ratelimitd::store::redis::RedisSettings {
            url: second_url,
            ..Default::default()
        });
    })
    .await;
    s.wait_serving(Duration::from_secs(20)).await;
    assert_eq!(per_second.cli(&["CONFIG", "SET", "maxmemory", "1"]), "OK");
    s
}

/// A request whose checks count on two servers (here the main Redis and the per-second one) is
/// answered by the policy when one of them fails; what the other leased it goes back rather than stay
/// counted for no replica. The per-second Redis refuses every write (out of memory): every request
/// that asks for a lease on the main one is answered by the policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_granted_to_a_request_another_server_failed_are_given_back() {
    inside_one_day().await;
    let (redis, per_second) = (RedisProcess::start(&[]), RedisProcess::start(&[]));
    let s = with_a_failing_per_second_redis(&redis, &per_second).await;
    let sent = Arc::new(AtomicU64::new(0));
    let mut callers = Vec::new();
    for i in 0..16 {
        let mut client = s.client().await;
        let sent = sent.clone();
        callers.push(tokio::spawn(async move {
            for n in 0..100 {
                // The hot daily counter, and a per-second one of this request alone (never leased).
                let caller = format!("{i}-{n}");
                let descriptors = vec![
                    descriptor(&[("generic_key", "busy")]),
                    descriptor(&[("caller", caller.as_str())]),
                ];
                // Answered UNAVAILABLE: the default policy on a Redis error.
                let answer = client.should_rate_limit(request("hot", descriptors)).await;
                assert_eq!(answer.unwrap_err().code(), tonic::Code::Unavailable);
                sent.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for c in callers {
        c.await.unwrap();
    }
    // Give-backs of leases no request holds are sent at once but not waited for.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The same traffic with the per-second Redis back: the counter is hot enough to be leased (and
    // may have been already: a request that goes again, after the per-second Redis's clock told it
    // another window, holds the grant the main one made).
    assert_eq!(per_second.cli(&["CONFIG", "SET", "maxmemory", "0"]), "OK");
    let failed = sent.load(Ordering::Relaxed);
    let mut client = s.client().await;
    let mut n = 0;
    while s.metric("ratelimitd_redis_lease_granted_hits_total").await == Some(0.0) {
        n += 1;
        assert!(n <= 2_000, "never leased");
        let caller = format!("after-{n}");
        let descriptors = vec![
            descriptor(&[("generic_key", "busy")]),
            descriptor(&[("caller", caller.as_str())]),
        ];
        let answer = client.should_rate_limit(request("hot", descriptors)).await;
        assert_eq!(answer.unwrap().get_ref().overall_code, Code::Ok as i32);
        sent.fetch_add(1, Ordering::Relaxed);
    }
    s.wait_leases_given_back(Duration::from_secs(5)).await;
    let sent = sent.load(Ordering::Relaxed);
    let key = redis.cli(&["--scan", "--pattern", "hot_generic_key_busy_*"]);
    let counted: u64 = redis.cli(&["GET", key.trim()]).parse().unwrap();
    let refused = per_second.cli(&["INFO", "errorstats"]);
    eprintln!("{sent} requests, {counted} counted; {refused}");
    assert!(refused.contains("errorstat_OOM"), "{refused}");
    // Every request answered OK counted one hit, and none of those the policy answered did.
    assert_eq!(
        counted,
        sent - failed,
        "{counted} hits counted for {} requests answered OK and {failed} answered UNAVAILABLE",
        sent - failed
    );
    s.stop().await;
}

/// Checks that count nothing (a descriptor's `hits_addend: 0`, as a token budget asks before the request)
/// on a hot sliding-window counter that holds nothing yet: no lease is asked for on them (a lease rides
/// on hits counted), so the script calls they share with other requests are answered, and nothing is
/// counted on the counter they only look at.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checks_that_count_nothing_on_a_hot_counter_take_no_lease() {
    inside_one_day().await;
    let redis = RedisProcess::start(&[]);
    let s = replica(&redis).await;
    let failed = Arc::new(AtomicU64::new(0));
    let mut callers = Vec::new();
    for i in 0..32 {
        let mut client = s.client().await;
        let failed = failed.clone();
        callers.push(tokio::spawn(async move {
            for n in 0..100 {
                // Half the callers look at the probe's counter, the others count on their own ones.
                let d = if i % 2 == 0 {
                    common::with_hits(descriptor(&[("probe", "fresh")]), 0)
                } else {
                    descriptor(&[("caller", format!("{i}-{n}").as_str())])
                };
                match client.should_rate_limit(request("hot", vec![d])).await {
                    Ok(answer) => assert_eq!(answer.get_ref().overall_code, Code::Ok as i32),
                    Err(status) => {
                        if failed.fetch_add(1, Ordering::Relaxed) == 0 {
                            eprintln!("first error: {status:?}");
                        }
                    }
                }
            }
        }));
    }
    for c in callers {
        c.await.unwrap();
    }
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "requests were answered with an error"
    );
    s.wait_leases_given_back(Duration::from_secs(5)).await;
    // One hit counted: the counter held nothing before it.
    let mut client = s.client().await;
    let answer = client
        .should_rate_limit(request("hot", vec![descriptor(&[("probe", "fresh")])]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        answer.statuses[0].limit_remaining,
        1_000_000_000 - 1,
        "{answer:?}"
    );
    s.stop().await;
}

/// A request whose limits count on two Redis servers, one of which fails it (out of memory), is answered
/// by the on_backend_error policy: what the other server counted for it goes back, so that a request
/// answered with an error (or denied, under `deny`) costs its caller nothing, and a retry is not counted
/// twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_one_server_counted_goes_back_when_another_fails_the_request() {
    inside_one_day().await;
    let (redis, per_second) = (RedisProcess::start(&[]), RedisProcess::start(&[]));
    let s = with_a_failing_per_second_redis(&redis, &per_second).await;
    let mut client = s.client().await;
    for n in 0..20 {
        let value = format!("failed-{n}");
        let descriptors = vec![
            descriptor(&[("account", value.as_str())]),
            descriptor(&[("caller", value.as_str())]),
        ];
        let answer = client.should_rate_limit(request("hot", descriptors)).await;
        assert_eq!(answer.unwrap_err().code(), tonic::Code::Unavailable);
    }
    // The give-backs are sent as the requests fail, not waited for.
    let counted = || -> u64 {
        let keys = redis.cli(&["--scan", "--pattern", "hot_account_*"]);
        keys.lines()
            .filter(|k| !k.is_empty())
            .map(|k| redis.cli(&["GET", k]).parse::<u64>().unwrap())
            .sum()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while counted() > 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(counted(), 0, "hits of failed requests stayed counted");
    // The main Redis was asked: the accounts' counters exist.
    let keys = redis.cli(&["--scan", "--pattern", "hot_account_*"]);
    assert_eq!(keys.lines().filter(|k| !k.is_empty()).count(), 20, "{keys}");
    s.stop().await;
}

/// One call of the operators' API: its status.
fn admin_call(addr: std::net::SocketAddr, method: &str, path: &str, body: &str) -> u16 {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).unwrap();
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// A reset of `generic_key=value` (6 000 a day) while the replicas hold leases on its counter (the first
/// serves the operators' API), then traffic until the new counter is spent: returns what the fleet
/// admitted after the reset, and a fixed window's counter as Redis holds it at the end.
async fn reset_while_leased(admin: Admin, value: &'static str) -> (u64, String) {
    inside_one_day().await;
    let redis = RedisProcess::start(&[]);
    let fleet = fleet_with_admin(&redis, admin).await;
    // Traffic until the other replicas hold leases on the counter: a replica leases a counter once it
    // sees 64 hits on it within a second, which a busy machine running a debug build may take a while
    // to reach. The reset follows at once, while they still hold what they leased.
    let (leased, over) = (Arc::new(AtomicBool::new(false)), AtomicBool::new(false));
    let stop = leased.clone();
    let ((sent, _), ()) = tokio::join!(
        async {
            let hammered = hammer(&fleet, value, move |sent, _| {
                stop.load(Ordering::Relaxed) || sent >= 5_000
            })
            .await;
            over.store(true, Ordering::Relaxed);
            hammered
        },
        async {
            while !leased.load(Ordering::Relaxed) && !over.load(Ordering::Relaxed) {
                let mut held = 0.0;
                for s in &fleet[1..] {
                    held += s.metric("ratelimitd_redis_leases").await.unwrap();
                }
                leased.store(held > 0.0, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    );
    assert!(
        leased.load(Ordering::Relaxed),
        "the other replicas hold no lease after {sent} requests"
    );

    let admin = fleet[0].admin_addr.unwrap();
    let target = format!(
        r#"{{"domain": "hot", "descriptor": [{{"key": "generic_key", "value": "{value}"}}]}}"#
    );
    assert_eq!(admin_call(admin, "POST", "/v1/reset", &target), 200);
    // Right after the reset, before the other replicas see it: traffic creates the counter again.
    let mut allowed = 0;
    let mut client = fleet[0].client().await;
    let until = std::time::Instant::now() + Duration::from_millis(1_500);
    while std::time::Instant::now() < until {
        let r = request("hot", vec![descriptor(&[("generic_key", value)])]);
        let answer = client.should_rate_limit(r).await.unwrap().into_inner();
        if answer.overall_code == Code::Ok as i32 {
            allowed += 1;
        }
    }
    let (_, more) = hammer(&fleet, value, |_, denied_in_a_row| denied_in_a_row >= 50).await;
    allowed += more;
    for s in &fleet {
        s.wait_leases_given_back(Duration::from_secs(5)).await;
    }
    for s in &fleet {
        let mut client = s.client().await;
        for _ in 0..(6_000u64.saturating_sub(allowed)).div_ceil(3) + 5 {
            let r = request("hot", vec![descriptor(&[("generic_key", value)])]);
            let answer = client.should_rate_limit(r).await.unwrap().into_inner();
            if answer.overall_code == Code::Ok as i32 {
                allowed += 1;
            }
        }
    }
    // A fixed window's counter, as Redis holds it (a sliding window's is a hash of two windows).
    let key = redis.cli(&["--scan", "--pattern", &format!("hot_generic_key_{value}_*")]);
    let counter = match key.lines().find(|k| !k.ends_with(":reset")) {
        Some(key) => redis.cli(&["GET", key]).trim().to_owned(),
        None => String::new(),
    };
    for s in fleet {
        s.stop().await;
    }
    (allowed, counter)
}

/// A reset while every replica holds leases on the counter: the leases end without giving their hits
/// back into the counter that requests create again after the reset, so from the reset on the fleet
/// admits exactly the limit, never more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_while_leases_are_held_admits_exactly_the_limit_after_it() {
    let (allowed, counter) = reset_while_leased(Admin::SeenWhileHeld, "global").await;
    assert_eq!(allowed, 6_000, "exactly the limit after the reset");
    assert_eq!(counter, "6000");
}

/// The same when the other replicas' leases end by time before they learn of the reset: what they
/// give back was counted in the counter the reset deleted, and Redis leaves it out of the new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_that_end_before_their_replica_sees_a_reset_give_nothing_to_the_new_counter() {
    let (allowed, counter) = reset_while_leased(Admin::SeenLate, "global").await;
    assert_eq!(allowed, 6_000, "exactly the limit after the reset");
    assert_eq!(counter, "6000");
    // A sliding window's key carries a hash tag: its mark is named differently, to the same effect.
    let (allowed, _) = reset_while_leased(Admin::SeenLate, "windowed").await;
    assert_eq!(
        allowed, 6_000,
        "exactly the sliding window's limit after the reset"
    );
}
