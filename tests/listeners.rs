//! What hostile or broken callers can do to the listeners, over real sockets: silent, slow and idle
//! connections are dropped within their documented bounds while new callers are served, the HTTP port
//! cannot use up the file descriptors that gRPC and health checks need, and `/json` says 503 when the
//! service cannot decide (400 only for a request that cannot be decided as sent).

mod common;

use std::time::Duration;

use common::{redis::RedisProcess, TestServer};
use ratelimitd::settings::{BackendKind, RedisTopology, Secret};

const RULES: &str =
    "domain: l\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 1000}\n";
const ASK: &str = r#"{"domain":"l","descriptors":[{"entries":[{"key":"user","value":"u"}]}]}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_answers_503_while_redis_is_down_and_400_only_for_a_bad_request() {
    let mut redis = RedisProcess::start(&[]);
    let url = redis.addr();
    let server = TestServer::start(&[("l.yaml", RULES)], move |s| {
        s.backend = Some(BackendKind::Redis);
        s.redis.url = url;
        s.redis.topology = RedisTopology::Single;
        s.hash_secret = Secret("l".into());
    })
    .await;
    server.wait_serving(Duration::from_secs(20)).await;
    assert_eq!(server.http("POST", "/json", ASK).await.0, 200);

    redis.kill();
    // The first calls meet the lost connection, later ones the open breaker: all are the service's
    // trouble, none the caller's.
    for _ in 0..5 {
        let (code, text) = server.http("POST", "/json", ASK).await;
        assert_eq!(code, 503, "{text}");
        assert!(
            !text.contains("ERR") && !text.contains("IO Error") && text.len() < 200,
            "a short reason of ratelimitd's own: {text}"
        );
    }
    let (code, text) = server
        .http("POST", "/json", r#"{"domain":"l","descriptors":[]}"#)
        .await;
    assert_eq!(
        (code, text.as_str()),
        (400, "rate limit descriptor list must not be empty\n")
    );
    server.stop().await;
}

#[tokio::test]
async fn json_answers_503_with_no_rules_loaded() {
    let server = TestServer::start(
        &[(
            "broken.yaml",
            "domain: l\ndescriptors:\n  - key: a\n    rate_limit: {unit: parsec}\n",
        )],
        |_| {},
    )
    .await;
    assert_eq!(
        server.http("POST", "/json", ASK).await,
        (503, "no rate limit configuration loaded\n".into())
    );
    assert_eq!(server.http("POST", "/json", "{not json").await.0, 400);
    server.stop().await;
}
