//! The HTTP side port, gRPC health and reflection, over real sockets.

mod common;

use std::time::{Duration, Instant};

use common::TestServer;
use ratelimitd::api::health::SERVICE_NAME;
use tokio_stream::StreamExt;
use tonic_health::pb::{
    health_check_response::ServingStatus, health_client::HealthClient, HealthCheckRequest,
};
use tonic_reflection::pb::v1::{
    server_reflection_client::ServerReflectionClient, server_reflection_request::MessageRequest,
    server_reflection_response::MessageResponse, ServerReflectionRequest, ServerReflectionResponse,
};

const RULES: &str = "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 1, name: per_user}\n";

#[tokio::test]
async fn json_endpoint_answers_200_429_and_400() {
    let s = TestServer::start(&[("web.yaml", RULES)], |_| {}).await;
    let body = r#"{"domain":"web","descriptors":[{"entries":[{"key":"user","value":"u1"}]}]}"#;
    let (code, text) = s.http("POST", "/json", body).await;
    assert_eq!(code, 200);
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(json["overallCode"], "OK");
    assert_eq!(json["statuses"][0]["currentLimit"]["name"], "per_user");
    assert_eq!(json["statuses"][0]["durationUntilReset"], "58s");

    let (code, text) = s.http("POST", "/json", body).await;
    assert_eq!(code, 429);
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(json["overallCode"], "OVER_LIMIT");

    let (code, text) = s.http("POST", "/json", "{not json").await;
    assert_eq!(code, 400);
    assert!(
        text.starts_with("Bad Request: ") && text.contains("column"),
        "{text}"
    );
    let (code, text) = s.http("POST", "/json", r#"{"domian":"web"}"#).await;
    assert_eq!(code, 400);
    assert!(
        text.starts_with("Bad Request: ") && text.contains("domian"),
        "{text}"
    );
    let many: Vec<String> = (0..70)
        .map(|i| format!(r#"{{"entries":[{{"key":"user","value":"u{i}"}}]}}"#))
        .collect();
    let body = format!(r#"{{"domain":"web","descriptors":[{}]}}"#, many.join(","));
    let (code, text) = s.http("POST", "/json", &body).await;
    assert_eq!(code, 400);
    assert!(
        text.contains("request_limits.max_descriptors"),
        "the reason names the bound: {text}"
    );
    let (code, text) = s
        .http("POST", "/json", r#"{"domain":"web","descriptors":[]}"#)
        .await;
    assert_eq!(
        (code, text.as_str()),
        (400, "rate limit descriptor list must not be empty\n")
    );
    s.stop().await;
}

#[tokio::test]
async fn rlconfig_lists_the_loaded_rules() {
    let s = TestServer::start(&[("web.yaml", RULES)], |_| {}).await;
    let (code, text) = s.http("GET", "/rlconfig", "").await;
    assert_eq!(code, 200);
    assert_eq!(
        text,
        "web.user: unit=MINUTE requests_per_unit=1, shadow_mode: false, quota_mode: false\n"
    );
    s.stop().await;
}

async fn grpc_health(s: &TestServer, service: &str) -> ServingStatus {
    let mut health = HealthClient::new(s.channel().await);
    let resp = health
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .unwrap()
        .into_inner();
    ServingStatus::try_from(resp.status).unwrap()
}

#[tokio::test]
async fn health_is_serving_on_both_names_and_on_healthcheck() {
    let s = TestServer::start(&[("web.yaml", RULES)], |_| {}).await;
    assert_eq!(grpc_health(&s, "").await, ServingStatus::Serving);
    assert_eq!(grpc_health(&s, SERVICE_NAME).await, ServingStatus::Serving);
    assert_eq!(s.http("GET", "/healthcheck", "").await, (200, "OK".into()));
    // Any method, as the reference answers: HAProxy's httpchk sends OPTIONS.
    for method in ["OPTIONS", "POST", "PUT"] {
        assert_eq!(
            s.http(method, "/healthcheck", "").await,
            (200, "OK".into()),
            "{method}"
        );
        assert_eq!(s.http(method, "/rlconfig", "").await.0, 200, "{method}");
    }
    s.stop().await;
}

#[tokio::test]
async fn health_waits_for_a_domain_when_asked_to() {
    let s = TestServer::start(&[], |s| s.healthy_with_at_least_one_config_loaded = true).await;
    assert_eq!(
        grpc_health(&s, SERVICE_NAME).await,
        ServingStatus::NotServing
    );
    assert_eq!(s.http("GET", "/healthcheck", "").await.0, 500);
    s.stop().await;
}

#[tokio::test]
async fn drain_reports_not_serving_while_still_answering() {
    let s = TestServer::start(&[("web.yaml", RULES)], |s| {
        s.shutdown.drain_delay = Duration::from_secs(2);
    })
    .await;
    let mut client = s.client().await;
    s.shutdown.cancel();
    // Seen well within the drain delay, so that what follows still happens during the drain.
    s.wait_health(ServingStatus::NotServing, Duration::from_secs(1))
        .await;
    assert_eq!(s.http("GET", "/healthcheck", "").await.0, 500);
    let resp = client
        .should_rate_limit(common::request(
            "web",
            vec![common::descriptor(&[("user", "d")])],
        ))
        .await;
    assert!(
        resp.is_ok(),
        "calls during the drain delay are still answered"
    );
    let started = Instant::now();
    s.handle.await.unwrap().unwrap();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        std::net::TcpStream::connect(s.http_addr).is_err(),
        "the HTTP listener is closed after the drain"
    );
}

/// One reflection question and its first reply.
async fn reflect(
    reflection: &mut ServerReflectionClient<tonic::transport::Channel>,
    question: MessageRequest,
) -> ServerReflectionResponse {
    let outbound = tokio_stream::iter(vec![ServerReflectionRequest {
        host: String::new(),
        message_request: Some(question),
    }]);
    let mut inbound = reflection
        .server_reflection_info(outbound)
        .await
        .unwrap()
        .into_inner();
    inbound.next().await.unwrap().unwrap()
}

#[tokio::test]
async fn reflection_lists_the_services() {
    let s = TestServer::start(&[("web.yaml", RULES)], |_| {}).await;
    let mut reflection = ServerReflectionClient::new(s.channel().await);
    let reply = reflect(&mut reflection, MessageRequest::ListServices(String::new())).await;
    let Some(MessageResponse::ListServicesResponse(list)) = reply.message_response else {
        panic!("unexpected reflection reply: {reply:?}");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    for want in [
        "envoy.service.ratelimit.v3.RateLimitService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "{want} missing from {names:?}"
        );
    }

    // The service's file descriptor resolves with its imports (what grpcurl needs to call it).
    let symbol = "envoy.service.ratelimit.v3.RateLimitService".into();
    let reply = reflect(
        &mut reflection,
        MessageRequest::FileContainingSymbol(symbol),
    )
    .await;
    let Some(MessageResponse::FileDescriptorResponse(files)) = reply.message_response else {
        panic!("unexpected reflection reply: {reply:?}");
    };
    assert!(!files.file_descriptor_proto.is_empty());
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_watches_and_reflection_sessions_end_at_the_drain_instead_of_holding_the_shutdown() {
    // The default grace period: what a replica with a watching client waited at every shutdown.
    let s = TestServer::start(&[("web.yaml", RULES)], |s| {
        s.shutdown.grace_period = ratelimitd::settings::Settings::default()
            .shutdown
            .grace_period;
    })
    .await;
    let channel = s.channel().await;
    let mut watch = HealthClient::new(channel.clone())
        .watch(HealthCheckRequest {
            service: SERVICE_NAME.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().unwrap();
    assert_eq!(first.status, ServingStatus::Serving as i32);
    // A reflection session whose client keeps its side open, as an interactive tool does.
    let (questions, outbound) = tokio::sync::mpsc::channel(1);
    let mut session = ServerReflectionClient::new(channel)
        .server_reflection_info(tokio_stream::wrappers::ReceiverStream::new(outbound))
        .await
        .unwrap()
        .into_inner();
    questions
        .send(ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        })
        .await
        .unwrap();
    assert!(session.next().await.unwrap().is_ok());

    let began = Instant::now();
    s.shutdown.cancel();
    let within = Duration::from_secs(5);
    let not_serving = tokio::time::timeout(within, watch.message()).await;
    let not_serving = not_serving.expect("NOT_SERVING pushed to the watcher");
    assert_eq!(
        not_serving.unwrap().unwrap().status,
        ServingStatus::NotServing as i32
    );
    let ended = tokio::time::timeout(within, watch.message())
        .await
        .expect("the watch ends at the drain");
    let status = ended.expect_err("ended with a status");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(status.message().contains("shutting down"), "{status:?}");
    let ended = tokio::time::timeout(within, session.next())
        .await
        .expect("the reflection session ends at the drain");
    let status = ended.unwrap().expect_err("ended with a status");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    tokio::time::timeout(within, s.handle)
        .await
        .expect("the server stops without waiting for the grace period")
        .unwrap()
        .unwrap();
    assert!(began.elapsed() < within, "{:?}", began.elapsed());
    drop(questions);
}
