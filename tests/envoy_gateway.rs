//! The ratelimitd binary in Envoy Gateway's deployment environment, variable for variable as Envoy
//! Gateway sets it for envoyproxy/ratelimit (`GRPC_SERVER_TLS_CA_CERT` included), with the test control
//! plane standing in for Envoy Gateway: it requires ratelimitd's client certificate, pushes a rule set
//! shaped as Envoy Gateway's translator writes one, and ratelimitd enforces it over TLS against Redis and
//! reports to a statsd listener on Envoy Gateway's statsd_exporter port (9125).
//!
//! What differs from a real pod, and only because a test machine is not one: the listeners are on
//! loopback at free ports (`GRPC_HOST`, `GRPC_PORT`, `HOST`, `PORT`), the control plane, Redis and the
//! certificate files are where the test put them.

mod common;

use std::time::Duration;

use common::{
    certs::{write, Ca},
    descriptor,
    redis::RedisProcess,
    request, start_binary,
    statsd::StatsdListener,
    wait_for,
    xds::{ControlPlane, ServerTls},
    LOOPBACK,
};
use ratelimitd::proto::{
    rate_limit_response::Code,
    xds::{RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit},
    RateLimitServiceClient,
};
use tonic::transport::{Certificate, Channel, ClientTlsConfig};

/// Envoy Gateway's statsd_exporter sidecar port.
const STATSD_PORT: u16 = 9125;

const WITHIN: Duration = Duration::from_secs(20);

/// A rule set as Envoy Gateway's translator writes one for a BackendTrafficPolicy: the listener as
/// domain and name, the route and the rule match as nested descriptors; and a token budget.
fn gateway_rules() -> RateLimitConfig {
    let route = "httproute/default/backend/rule/0/match/0/www_example_com";
    RateLimitConfig {
        name: "default/eg/http".into(),
        domain: "default/eg/http".into(),
        descriptors: vec![
            budget_rule(),
            RateLimitDescriptor {
                key: route.into(),
                value: route.into(),
                descriptors: vec![RateLimitDescriptor {
                    key: "rule-0-match-0".into(),
                    value: "rule-0-match-0".into(),
                    rate_limit: Some(RateLimitPolicy {
                        unit: RateLimitUnit::Hour as i32,
                        requests_per_unit: 3,
                        ..RateLimitPolicy::default()
                    }),
                    ..RateLimitDescriptor::default()
                }],
                ..RateLimitDescriptor::default()
            },
        ],
    }
}

/// The route of a policy whose cost comes from the response (an AI gateway's token count): 10 000 tokens
/// an hour.
const BUDGET_ROUTE: &str = "httproute/default/llm/rule/0/match/0/llm_example_com";

fn budget_rule() -> RateLimitDescriptor {
    RateLimitDescriptor {
        key: BUDGET_ROUTE.into(),
        value: BUDGET_ROUTE.into(),
        rate_limit: Some(RateLimitPolicy {
            unit: RateLimitUnit::Hour as i32,
            requests_per_unit: 10_000,
            ..RateLimitPolicy::default()
        }),
        ..RateLimitDescriptor::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_gateways_environment_serves_the_limit_its_control_plane_pushed() {
    // Its limits are hourly windows on the real clock.
    common::wait_for_room_in_the_hour_window();
    let statsd = StatsdListener::start_on(STATSD_PORT).await;
    let redis = RedisProcess::start(&[]);
    let ca = Ca::new("envoy-gateway");
    // Envoy Gateway's certgen: one certificate for the rate limit service, used both to serve gRPC and
    // as the xDS client certificate.
    let ratelimit = ca.leaf_for_both(&["envoy-ratelimit", "envoy-ratelimit.envoy-gateway-system"]);
    let gateway = ca.leaf(&["envoy-gateway"], false);
    let certs = tempfile::tempdir().unwrap();
    let cert = write(certs.path(), "tls.crt", &ratelimit.cert);
    let key = write(certs.path(), "tls.key", &ratelimit.key);
    let ca_file = write(certs.path(), "ca.crt", &ca.pem());
    let plane = ControlPlane::start_tls(ServerTls {
        cert: gateway.cert,
        key: gateway.key,
        client_ca: Some(ca.pem()),
    })
    .await;
    plane.push("1", vec![gateway_rules()]);

    let bin = env!("CARGO_BIN_EXE_ratelimitd");
    let mut cmd = std::process::Command::new(bin);
    cmd.env_clear().envs(LOOPBACK).envs([
        ("RUNTIME_ROOT", "/data"),
        ("RUNTIME_SUBDIRECTORY", "ratelimit"),
        ("RUNTIME_IGNOREDOTFILES", "true"),
        ("RUNTIME_WATCH_ROOT", "false"),
        ("LOG_LEVEL", "info"),
        ("USE_STATSD", "true"),
        ("STATSD_PORT", "9125"),
        ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
        ("CONFIG_GRPC_XDS_SERVER_URL", &plane.url()),
        ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
        ("GRPC_SERVER_USE_TLS", "true"),
        ("GRPC_SERVER_TLS_CERT", cert.to_str().unwrap()),
        ("GRPC_SERVER_TLS_KEY", key.to_str().unwrap()),
        ("GRPC_SERVER_TLS_CA_CERT", ca_file.to_str().unwrap()),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", cert.to_str().unwrap()),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", key.to_str().unwrap()),
        (
            "CONFIG_GRPC_XDS_SERVER_TLS_CACERT",
            ca_file.to_str().unwrap(),
        ),
        ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", &format!("127.0.0.1:{}", redis.port)),
    ]);
    let mut running = start_binary(&mut cmd);
    // The probes Envoy Gateway sets: GET /healthcheck on the HTTP port.
    assert!(
        running.serving_within(WITHIN),
        "{}",
        running.log.lock().unwrap()
    );

    // Envoy's view: the rate limit service over TLS, trusting Envoy Gateway's CA.
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca.pem()))
        .domain_name("envoy-ratelimit");
    let channel = Channel::from_shared(format!("https://{}", running.grpc))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = RateLimitServiceClient::new(channel);
    let route = "httproute/default/backend/rule/0/match/0/www_example_com";
    let ask = || {
        request(
            "default/eg/http",
            vec![descriptor(&[
                (route, route),
                ("rule-0-match-0", "rule-0-match-0"),
            ])],
        )
    };
    let first = wait_for("the pushed limit enforced", WITHIN, async || {
        let answer = client.should_rate_limit(ask()).await.ok()?.into_inner();
        answer.statuses[0].current_limit.is_some().then_some(answer)
    })
    .await;
    assert_eq!(first.overall_code(), Code::Ok);
    let mut codes = Vec::new();
    for _ in 0..3 {
        codes.push(
            client
                .should_rate_limit(ask())
                .await
                .unwrap()
                .into_inner()
                .overall_code(),
        );
    }
    assert_eq!(codes, [Code::Ok, Code::Ok, Code::OverLimit]);
    assert_eq!(redis.cli(&["DBSIZE"]), "1", "the counter lives in Redis");

    // A token budget, as Envoy asks for one: a check that counts nothing before each request, and the
    // tokens the response used reported after it (an answer Envoy ignores). The fourth report takes the
    // budget past its 10 000; from then on the check says OVER_LIMIT, as the reference says it.
    let budget = |tokens| {
        request(
            "default/eg/http",
            vec![common::with_hits(
                descriptor(&[(BUDGET_ROUTE, BUDGET_ROUTE)]),
                tokens,
            )],
        )
    };
    let mut checks = Vec::new();
    for _ in 0..5 {
        let check = client
            .should_rate_limit(budget(0))
            .await
            .unwrap()
            .into_inner();
        checks.push(check.overall_code());
        client.should_rate_limit(budget(3_000)).await.unwrap();
    }
    assert_eq!(
        checks,
        [Code::Ok, Code::Ok, Code::Ok, Code::Ok, Code::OverLimit],
        "the budget never ran out"
    );
    let ack = plane.answer_to("1", WITHIN).await.request;
    assert_eq!(
        (
            ack.version_info.as_str(),
            ack.error_detail,
            ack.node.map(|n| n.id)
        ),
        ("1", None, Some("envoy-ratelimit".into()))
    );

    // SIGTERM, as Kubernetes stops a pod: the last flush reaches the statsd_exporter sidecar.
    let status = running.terminate(WITHIN).await;
    assert!(status.success(), "{status:?}");
    let stat = format!("ratelimit.service.rate_limit.default/eg/http.{route}_{route}.rule-0-match-0_rule-0-match-0");
    let counters = statsd
        .wait_counter(&format!("{stat}.over_limit"), 1, WITHIN)
        .await;
    assert_eq!(counters[&format!("{stat}.total_hits")], 4);
    assert_eq!(counters[&format!("{stat}.within_limit")], 3);
    assert_eq!(counters["ratelimit.service.config_load_success"], 1);
}
