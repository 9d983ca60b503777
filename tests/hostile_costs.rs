//! Hostile costs, over the real gRPC socket and `/json`, on every algorithm and both stores: a caller's
//! `hits_addend` can be any 64-bit number, and none of them may panic, fail, block Redis for others,
//! write more than a request's worth, or open the breaker.

mod common;

use std::time::{Duration, Instant};

use common::{descriptor, redis::RedisProcess, request, start_binary, with_hits, TestServer};
use ratelimitd::{
    clock::Clock,
    proto::{rate_limit_response::Code, RateLimitDescriptor, RateLimitServiceClient},
    settings::{BackendKind, RedisTopology},
};
use tonic::transport::Channel;

const ALGORITHMS: [&str; 5] = [
    "fixed_window",
    "sliding_window",
    "sliding_log",
    "token_bucket",
    "gcra",
];

/// One rule per algorithm, each 10 an hour, keyed by the algorithm's name.
fn rules() -> String {
    let mut text = String::from("domain: costs\ndescriptors:\n");
    for algorithm in ALGORITHMS {
        text.push_str(&format!(
            "  - key: {algorithm}\n    rate_limit: {{unit: hour, requests_per_unit: 10, algorithm: {algorithm}}}\n"
        ));
    }
    text
}

fn costing(key: &str, value: &str, cost: u64) -> RateLimitDescriptor {
    with_hits(descriptor(&[(key, value)]), cost)
}

/// The overall code and per-descriptor codes of one request, or the error's code.
async fn ask(
    client: &mut RateLimitServiceClient<Channel>,
    descriptors: Vec<RateLimitDescriptor>,
) -> Result<(Code, Vec<Code>), tonic::Code> {
    let answer = client
        .should_rate_limit(request("costs", descriptors))
        .await
        .map_err(|status| status.code())?
        .into_inner();
    Ok((
        Code::try_from(answer.overall_code).unwrap(),
        answer
            .statuses
            .iter()
            .map(|s| Code::try_from(s.code).unwrap())
            .collect(),
    ))
}

async fn extreme_costs_on(server: &TestServer, store: &str) {
    let mut client = server.client().await;
    for algorithm in ALGORITHMS {
        let at = |what: &str| format!("{store}, {algorithm}: {what}");
        let user = format!("{store}-user");
        for cost in [1u64 << 63, u64::MAX, 11] {
            let answer = ask(&mut client, vec![costing(algorithm, &user, cost)]).await;
            assert_eq!(
                answer,
                Ok((Code::OverLimit, vec![Code::OverLimit])),
                "{}",
                at(&format!("cost {cost}"))
            );
        }
        let answer = ask(&mut client, vec![costing(algorithm, &user, 0)]).await;
        assert_eq!(answer, Ok((Code::Ok, vec![Code::Ok])), "{}", at("cost 0"));
        // The refused costs consumed nothing: the whole limit still fits, then nothing more.
        let answer = ask(&mut client, vec![costing(algorithm, &user, 10)]).await;
        assert_eq!(answer, Ok((Code::Ok, vec![Code::Ok])), "{}", at("cost 10"));
        let answer = ask(&mut client, vec![costing(algorithm, &user, 1)]).await;
        assert_eq!(answer.map(|a| a.0), Ok(Code::OverLimit), "{}", at("spent"));

        // The same counter twice: 1, then 2^64 - 1.
        let twice = format!("{store}-twice");
        let answer = ask(
            &mut client,
            vec![
                costing(algorithm, &twice, 1),
                costing(algorithm, &twice, u64::MAX),
            ],
        )
        .await;
        assert_eq!(
            answer,
            Ok((Code::OverLimit, vec![Code::Ok, Code::OverLimit])),
            "{}",
            at("the same counter twice")
        );
        let answer = ask(&mut client, vec![costing(algorithm, &twice, 10)]).await;
        assert_eq!(
            answer.map(|a| a.0),
            Ok(Code::Ok),
            "{}",
            at("nothing consumed")
        );

        // /json takes 64-bit numbers as strings, as protobuf JSON does.
        let body = format!(
            r#"{{"domain":"costs","descriptors":[{{"entries":[{{"key":"{algorithm}","value":"{store}-json"}}],"hitsAddend":"18446744073709551615"}}]}}"#
        );
        let (status, text) = server.http("POST", "/json", &body).await;
        assert_eq!(status, 429, "{}: {text}", at("/json"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extreme_costs_are_denied_on_every_algorithm_of_the_memory_store() {
    let server = TestServer::start(&[("costs.yaml", &rules())], |_| {}).await;
    extreme_costs_on(&server, "memory").await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extreme_costs_are_denied_on_every_algorithm_on_redis() {
    let redis = RedisProcess::start(&[]);
    let url = redis.addr();
    let server = TestServer::start_with_clock(&[("costs.yaml", &rules())], Clock::System, |s| {
        s.backend = Some(BackendKind::Redis);
        s.redis.url = url;
        s.redis.topology = RedisTopology::Single;
    })
    .await;
    server.wait_serving(Duration::from_secs(20)).await;
    extreme_costs_on(&server, "redis").await;
    server.stop().await;
}

/// PING round trips to `port` every 20 ms until `stop`, on one connection of its own (a new process
/// per PING would time its start rather than Redis); returns the slowest.
fn watch_ping(port: u16, stop: std::sync::Arc<std::sync::atomic::AtomicBool>) -> Duration {
    use std::io::{Read, Write};
    let mut connection = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    connection.set_nodelay(true).unwrap();
    let mut slowest = Duration::ZERO;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let started = Instant::now();
        connection.write_all(b"PING\r\n").unwrap();
        let mut pong = [0; 7];
        connection.read_exact(&mut pong).unwrap();
        assert_eq!(&pong, b"+PONG\r\n");
        slowest = slowest.max(started.elapsed());
        std::thread::sleep(Duration::from_millis(20));
    }
    slowest
}

fn used_memory(redis: &RedisProcess) -> u64 {
    redis
        .cli(&["INFO", "memory"])
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_costliest_sliding_log_request_leaves_redis_answering_everyone() {
    let redis = RedisProcess::start(&[]);
    let url = redis.addr();
    let rules = "domain: costs\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 100000, algorithm: sliding_log}\n";
    let server = TestServer::start_with_clock(&[("costs.yaml", rules)], Clock::System, |s| {
        s.backend = Some(BackendKind::Redis);
        s.redis.url = url;
        s.redis.topology = RedisTopology::Single;
    })
    .await;
    server.wait_serving(Duration::from_secs(20)).await;
    let mut client = server.client().await;
    let memory_before = used_memory(&redis);
    assert_eq!(redis.cli(&["CONFIG", "RESETSTAT"]), "OK");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (port, stop) = (redis.port, stop.clone());
        std::thread::spawn(move || watch_ping(port, stop))
    };
    std::thread::sleep(Duration::from_millis(50));
    // The worst a caller can ask of a sliding log: 64 descriptors (the most a request may carry), each
    // costing the whole limit of a fresh counter, so that every one of them is allowed and stored.
    let worst: Vec<RateLimitDescriptor> = (0..64)
        .map(|i| costing("user", &format!("u{i}"), 100_000))
        .collect();
    let started = Instant::now();
    let answer = common::ask(&mut client, request("costs", worst)).await;
    let took = started.elapsed();
    std::thread::sleep(Duration::from_millis(100));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let slowest_ping = watcher.join().unwrap();
    let stats = redis.cli(&["INFO", "commandstats"]);
    let script_usec = stats
        .lines()
        .find(|l| l.starts_with("cmdstat_evalsha:"))
        .and_then(|l| l.split("usec=").nth(1))
        .and_then(|v| v.split(',').next())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap();
    let grown = used_memory(&redis).saturating_sub(memory_before);
    eprintln!(
        "worst sliding-log request: answered in {took:?}, Redis ran it for {script_usec} us, memory +{grown} bytes, slowest PING {slowest_ping:?}"
    );
    assert_eq!(answer.overall_code, Code::Ok as i32);
    let members: u64 = (0..64)
        .map(|i| {
            let key = redis.cli(&["--scan", "--pattern", &format!("*user_u{i}_*")]);
            // The entries; the member `hits` beside them holds their sum, negated.
            assert_eq!(redis.cli(&["ZSCORE", key.trim(), "hits"]), "-100000");
            redis
                .cli(&["ZCOUNT", key.trim(), "(0", "+inf"])
                .parse::<u64>()
                .unwrap()
        })
        .sum();
    assert_eq!(
        members, 64,
        "one entry per request and counter, not one per hit"
    );
    assert!(script_usec < 50_000, "the script ran {script_usec} us");
    assert!(grown < 1 << 20, "Redis grew by {grown} bytes");
    assert!(
        slowest_ping < Duration::from_millis(100),
        "PING waited {slowest_ping:?}"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_huge_costs_leaves_other_callers_and_the_breaker_alone() {
    let redis = RedisProcess::start(&[]);
    let folder = tempfile::tempdir().unwrap();
    std::fs::write(folder.path().join("costs.yaml"), rules()).unwrap();
    // Denied requests counted too (the reference's default), and Redis failures answered OK: if the
    // flood could make the script fail or open the breaker, callers over their limit would pass.
    let mut cmd = common::binary(folder.path());
    cmd.env("REDIS_URL", redis.addr())
        .env("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", "false")
        .env("RATELIMITD_ON_BACKEND_ERROR", "allow");
    let replica = start_binary(&mut cmd);
    assert!(replica.serving_within(Duration::from_secs(20)));
    let mut client = RateLimitServiceClient::connect(format!("http://{}", replica.grpc))
        .await
        .unwrap();
    for _ in 0..10 {
        let answer = ask(&mut client, vec![costing("fixed_window", "victim", 1)]).await;
        assert_eq!(answer.map(|a| a.0), Ok(Code::Ok));
    }

    let mut attacks = Vec::new();
    for caller in 0..4 {
        let mut client = client.clone();
        attacks.push(tokio::spawn(async move {
            let mut answers = std::collections::BTreeMap::new();
            for i in 0..100usize {
                let algorithm = ALGORITHMS[i % ALGORITHMS.len()];
                let cost = [100_000_000_000_000_000u64, 1 << 63, u64::MAX][i % 3];
                let mine = format!("attacker{caller}");
                let answer = ask(&mut client, vec![costing(algorithm, &mine, cost)]).await;
                *answers.entry(format!("{answer:?}")).or_insert(0) += 1;
            }
            answers
        }));
    }
    let mut answers = std::collections::BTreeMap::new();
    for attack in attacks {
        for (answer, n) in attack.await.unwrap() {
            *answers.entry(answer).or_insert(0) += n;
        }
    }
    assert_eq!(
        answers.keys().collect::<Vec<_>>(),
        vec!["Ok((OverLimit, [OverLimit]))"],
        "every huge cost denied, never an error nor an OK: {answers:?}"
    );
    let victim = ask(&mut client, vec![costing("fixed_window", "victim", 1)]).await;
    assert_eq!(
        victim.map(|a| a.0),
        Ok(Code::OverLimit),
        "still over its limit"
    );
    let mut admitted = 0;
    for _ in 0..15 {
        if ask(&mut client, vec![costing("sliding_log", "bystander", 1)]).await
            == Ok((Code::Ok, vec![Code::Ok]))
        {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 10, "a bystander gets exactly its limit");
    let metrics = common::http_request(replica.http, "GET", "/metrics", "").1;
    assert!(
        metrics.contains("ratelimitd_backend_breaker_open{backend=\"redis\"} 0"),
        "{metrics}"
    );
    assert!(
        metrics.contains("ratelimitd_request_errors_total{kind=\"backend\"} 0\n"),
        "no request failed on Redis"
    );
}
