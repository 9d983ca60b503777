//! Bounded resources under overload: requests past `overload.max_in_flight` are refused at once,
//! a store slower than `overload.deadline` is answered by the policy before it, and connections past
//! `overload.max_connections` wait until one closes. A paused Redis makes requests slow on purpose.

mod common;

use std::time::{Duration, Instant};

use common::{descriptor, redis::RedisProcess, request, TestServer};
use ratelimitd::settings::{BackendKind, RedisTopology, Secret, Settings};
use tonic::transport::Endpoint;

const RULES: &str = "domain: o\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 1000}\n";

async fn on_redis(
    redis: &RedisProcess,
    tweak: impl FnOnce(&mut Settings) + Send + 'static,
) -> TestServer {
    let url = redis.addr();
    let s = TestServer::start(&[("o.yaml", RULES)], move |s| {
        s.backend = Some(BackendKind::Redis);
        s.redis.url = url;
        s.redis.topology = RedisTopology::Single;
        s.hash_secret = Secret("o".into());
        tweak(s);
    })
    .await;
    s.wait_serving(Duration::from_secs(20)).await;
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_past_max_in_flight_are_refused_at_once_with_resource_exhausted() {
    let redis = RedisProcess::start(&[]);
    let server = on_redis(&redis, |s| {
        s.redis.timeout = Duration::from_secs(2);
        // The pause stands for slow work here, not for a hung Redis.
        s.redis.unresponsive_after = Duration::from_secs(5);
        s.overload.max_in_flight = 4;
        s.overload.deadline = Duration::from_secs(5);
    })
    .await;
    // Connected first: every call starts within the pause, however long connecting takes.
    let mut clients = Vec::new();
    for _ in 0..20 {
        clients.push(server.client().await);
    }
    assert_eq!(redis.cli(&["CLIENT", "PAUSE", "1000", "ALL"]), "OK");
    let mut calls = Vec::new();
    for (i, mut client) in clients.into_iter().enumerate() {
        calls.push(tokio::spawn(async move {
            let started = Instant::now();
            let user = format!("u{i}");
            let answer = client
                .should_rate_limit(request("o", vec![descriptor(&[("user", &user)])]))
                .await;
            (answer.err(), started.elapsed())
        }));
    }
    let mut exhausted = 0;
    let mut waited = 0;
    for call in calls {
        let (err, took) = call.await.unwrap();
        match err {
            Some(status) if status.code() == tonic::Code::ResourceExhausted => {
                assert!(
                    status.message().contains("overload.max_in_flight"),
                    "{}",
                    status.message()
                );
                assert!(took < Duration::from_millis(300), "refused after {took:?}");
                exhausted += 1;
            }
            other => {
                assert!(other.is_none(), "{other:?}");
                waited += 1;
            }
        }
    }
    assert_eq!(waited, 4, "as many decided as max_in_flight");
    assert_eq!(exhausted, 16);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_slower_than_the_deadline_is_answered_by_the_policy_before_it() {
    let redis = RedisProcess::start(&[]);
    let server = on_redis(&redis, |s| {
        s.redis.timeout = Duration::from_secs(3);
        s.redis.unresponsive_after = Duration::from_secs(3);
        s.overload.deadline = Duration::from_secs(1);
    })
    .await;
    assert_eq!(redis.cli(&["CLIENT", "PAUSE", "2500", "ALL"]), "OK");
    let mut client = server.client().await;
    let started = Instant::now();
    let status = client
        .should_rate_limit(request("o", vec![descriptor(&[("user", "slow")])]))
        .await
        .unwrap_err();
    let took = started.elapsed();
    // REDIS_TIMEOUT (3 s) would wait longer: overload.deadline bounds the whole decision, and the
    // policy (`error`) answers before it rather than DEADLINE_EXCEEDED at it. The store stops waiting
    // 100 ms before the second is up, the room the service keeps for the answer's way back (a
    // deadline of 200 ms would leave it 30 ms, less than a busy machine may hold a debug build).
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(
        status
            .message()
            .contains("did not answer before the answer was due"),
        "{}",
        status.message()
    );
    assert!(
        took >= Duration::from_millis(700) && took < Duration::from_secs(1),
        "answered after {took:?}"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_max_connections_wait_until_one_closes() {
    let server = TestServer::start(&[("o.yaml", RULES)], |s| {
        s.overload.max_connections = 2;
    })
    .await;
    let connect = || async {
        let channel = Endpoint::from_shared(format!("http://{}", server.grpc_addr))
            .unwrap()
            .connect_lazy();
        ratelimitd::proto::RateLimitServiceClient::new(channel)
    };
    let call =
        |mut client: ratelimitd::proto::RateLimitServiceClient<tonic::transport::Channel>,
         within: Duration| async move {
            tokio::time::timeout(
                within,
                client.should_rate_limit(request("o", vec![descriptor(&[("user", "c")])])),
            )
            .await
        };
    let first = connect().await;
    let second = connect().await;
    assert!(call(first.clone(), Duration::from_secs(5))
        .await
        .unwrap()
        .is_ok());
    assert!(call(second.clone(), Duration::from_secs(5))
        .await
        .unwrap()
        .is_ok());
    // A third connection is not served while the two stay open...
    let third = connect().await;
    let waiting = tokio::spawn(call(third, Duration::from_secs(10)));
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!waiting.is_finished(), "a third connection was served");
    // ...and is, once one of them closes.
    drop(first);
    let answer = waiting
        .await
        .unwrap()
        .expect("served after a connection closed");
    assert!(answer.is_ok(), "{answer:?}");
    drop(second);
    server.stop().await;
}
