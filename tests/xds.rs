//! Rules from an xDS control plane (`CONFIG_TYPE=GRPC_XDS_SOTW`), against the in-process control plane
//! of `common::xds` over real sockets: sets applied and ACKed, new versions applied within a second, an
//! invalid set NACKed with the rules file's message while the old rules serve, a control plane restarted
//! mid-run, the node as configured, mTLS, and `FORCE_START_WITHOUT_INITIAL_CONFIG` both ways. The main
//! scenario runs on the memory store and on Redis.

mod common;

use std::time::{Duration, Instant};

use common::{
    certs::Ca,
    descriptor,
    redis::RedisProcess,
    request, wait_for,
    xds::{one_rule, ControlPlane, ServerTls},
    TestServer,
};
use ratelimitd::{
    clock::Clock,
    proto::{
        rate_limit_response::Code,
        xds::{
            AggregatedDiscoveryServiceClient, DiscoveryRequest, RateLimitConfig, RateLimitUnit,
            RATE_LIMIT_CONFIG_TYPE,
        },
        RateLimitServiceClient,
    },
    settings::{ConfigType, Secret, Settings},
};
use tonic::{
    transport::{Certificate, Channel, ClientTlsConfig},
    Code as GrpcCode,
};
use tonic_health::pb::health_check_response::ServingStatus;

const WITHIN: Duration = Duration::from_secs(10);

/// Settings for rules from `plane`, with quick reconnects.
fn from(plane: &ControlPlane, s: &mut Settings) {
    s.rules.config_type = ConfigType::GrpcXdsSotw;
    s.xds.server_url = plane.url();
    s.xds.backoff.initial = Duration::from_millis(100);
    s.xds.backoff.max = Duration::from_millis(400);
}

/// The store a scenario runs on: memory, or a redis-server of its own.
enum On {
    Memory,
    Redis(RedisProcess),
}

impl On {
    fn redis() -> Self {
        On::Redis(RedisProcess::start(&[]))
    }

    async fn server(&self, plane: &ControlPlane, tweak: impl FnOnce(&mut Settings)) -> TestServer {
        match self {
            On::Memory => {
                TestServer::start(&[], |s| {
                    from(plane, s);
                    tweak(s);
                })
                .await
            }
            On::Redis(redis) => {
                let url = format!("127.0.0.1:{}", redis.port);
                TestServer::start_with_clock(&[], Clock::System, |s| {
                    from(plane, s);
                    s.redis.url = url;
                    tweak(s);
                })
                .await
            }
        }
    }
}

/// The limit the rules give `user` in `domain` (`None`: no limit), and the answer's code.
async fn limit_of(
    client: &mut RateLimitServiceClient<Channel>,
    domain: &str,
    user: &str,
) -> Result<(Option<u32>, Code), tonic::Status> {
    let answer = client
        .should_rate_limit(request(domain, vec![descriptor(&[("user", user)])]))
        .await?
        .into_inner();
    let limit = answer.statuses[0]
        .current_limit
        .as_ref()
        .map(|l| l.requests_per_unit);
    Ok((limit, answer.overall_code()))
}

/// A value of `/metrics`.
async fn metric(s: &TestServer, name: &str) -> Option<f64> {
    let (_, text) = s.http("GET", "/metrics", "").await;
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.parse().ok())
}

/// The scenarios' rule set: `user` in domain `api` limited to `n` per minute, as the resource `api-route`.
fn user_limit(n: u32) -> Vec<RateLimitConfig> {
    vec![one_rule(
        "api-route",
        "api",
        "user",
        n,
        RateLimitUnit::Minute,
    )]
}

/// A control plane serving `user_limit(n)` as version "1", and a server on `on` taking its rules from it,
/// once health is SERVING and the control plane has the ACK; with a client of that server.
async fn serving_version_1(
    on: &On,
    n: u32,
) -> (ControlPlane, TestServer, RateLimitServiceClient<Channel>) {
    let plane = ControlPlane::start().await;
    plane.push("1", user_limit(n));
    let s = on.server(&plane, |_| {}).await;
    s.wait_serving(WITHIN).await;
    let client = s.client().await;
    let ack = plane.answer_to("1", WITHIN).await.request;
    assert_eq!(
        (ack.version_info.as_str(), ack.error_detail),
        ("1", None),
        "an ACK names the version applied"
    );
    (plane, s, client)
}

async fn rule_sets_are_applied_acked_and_replaced_within_a_second(on: On) {
    let (plane, s, mut client) = serving_version_1(&on, 2).await;
    let mut seen = Vec::new();
    common::far_from_a_minute_end().await;
    for _ in 0..3 {
        seen.push(limit_of(&mut client, "api", "a").await.unwrap());
    }
    assert_eq!(
        seen,
        [
            (Some(2), Code::Ok),
            (Some(2), Code::Ok),
            (Some(2), Code::OverLimit)
        ]
    );
    let (_, rlconfig) = s.http("GET", "/rlconfig", "").await;
    assert_eq!(
        rlconfig,
        "api.user: unit=MINUTE requests_per_unit=2, shadow_mode: false, quota_mode: false\n"
    );

    // A new version: decided under it within a second of the push.
    let pushed = Instant::now();
    plane.push("2", user_limit(5));
    let took = wait_for("the limit of version 2", WITHIN, async || {
        let (limit, _) = limit_of(&mut client, "api", "b").await.ok()?;
        (limit == Some(5)).then(|| pushed.elapsed())
    })
    .await;
    eprintln!("xDS: version 2 decided {took:?} after its push");
    assert!(took < Duration::from_secs(1), "{took:?}");
    // Counters are kept across the swap: "a" has used 3 of its 5.
    assert_eq!(
        limit_of(&mut client, "api", "a").await.unwrap(),
        (Some(5), Code::Ok)
    );
    let ack = plane.answer_to("2", WITHIN).await.request;
    assert_eq!((ack.version_info.as_str(), ack.error_detail), ("2", None));
    assert_eq!(
        metric(&s, "ratelimit_service_config_load_success").await,
        Some(2.0)
    );
    assert_eq!(metric(&s, "ratelimitd_xds_connected").await, Some(1.0));
    s.stop().await;
}

#[tokio::test]
async fn rule_sets_are_applied_acked_and_replaced_within_a_second_in_memory() {
    rule_sets_are_applied_acked_and_replaced_within_a_second(On::Memory).await;
}

#[tokio::test]
async fn rule_sets_are_applied_acked_and_replaced_within_a_second_in_redis() {
    rule_sets_are_applied_acked_and_replaced_within_a_second(On::redis()).await;
}

#[tokio::test]
async fn an_invalid_set_is_nacked_with_the_rules_file_message_and_the_old_rules_keep_serving() {
    let (plane, s, mut client) = serving_version_1(&On::Memory, 2).await;

    plane.push(
        "2",
        vec![
            one_rule("api-route", "api", "user", 9, RateLimitUnit::Minute),
            one_rule("bad-route", "web", "user", 9, RateLimitUnit::Unknown),
        ],
    );
    let nack = plane.answer_to("2", WITHIN).await.request;
    let status = nack.error_detail.expect("a NACK");
    assert_eq!(
        status.message,
        "bad-route: invalid rate limit unit 'UNKNOWN'"
    );
    assert_eq!(
        nack.version_info, "1",
        "a NACK names the version still applied"
    );
    assert_eq!(
        limit_of(&mut client, "api", "a").await.unwrap(),
        (Some(2), Code::Ok),
        "the old rules serve"
    );
    assert_eq!(
        metric(&s, "ratelimit_service_config_load_error").await,
        Some(1.0)
    );

    plane.push("3", user_limit(9));
    let ack = plane.answer_to("3", WITHIN).await.request;
    assert_eq!((ack.version_info.as_str(), ack.error_detail), ("3", None));
    assert_eq!(limit_of(&mut client, "api", "a").await.unwrap().0, Some(9));
    s.stop().await;
}

/// A control plane that answers every NACK by sending the refused set again at once (a go-control-plane
/// cache does) does not make ratelimitd spin: the same set refused again is NACKed 1 s later, then 2 s,
/// and so on, and the set that mends the rules is applied at once even while a NACK is held back.
#[tokio::test]
async fn a_refused_set_sent_again_and_again_is_nacked_ever_more_slowly() {
    let (plane, s, mut client) = serving_version_1(&On::Memory, 2).await;
    plane.resend_on_nack();
    plane.push(
        "2",
        vec![
            one_rule("a-route", "api", "user", 9, RateLimitUnit::Minute),
            one_rule("b-route", "api", "user", 9, RateLimitUnit::Minute),
        ],
    );
    let nacks = || plane.seen().iter().filter(|s| s.nack().is_some()).count();
    common::wait_for("a first NACK", WITHIN, async || (nacks() > 0).then_some(())).await;
    tokio::time::sleep(Duration::from_millis(4_500)).await;
    // Sent at once, then held 1 s, 2 s (4 s): the fourth is due at 7 s. Without the hold, thousands.
    let after = nacks();
    assert!((2..=4).contains(&after), "{after} NACKs in 4.5 s");
    assert_eq!(
        limit_of(&mut client, "api", "a").await.unwrap(),
        (Some(2), Code::Ok),
        "the old rules serve"
    );

    let began = std::time::Instant::now();
    plane.push("3", user_limit(9));
    let ack = plane.answer_to("3", WITHIN).await.request;
    assert_eq!((ack.version_info.as_str(), ack.error_detail), ("3", None));
    assert!(
        began.elapsed() < Duration::from_millis(900),
        "the mending set waited {:?} for a held NACK",
        began.elapsed()
    );
    assert_eq!(limit_of(&mut client, "api", "a").await.unwrap().0, Some(9));
    // The NACK held when the mending set came is never sent: its nonce is stale.
    tokio::time::sleep(Duration::from_millis(4_500)).await;
    assert_eq!(nacks(), after, "a stale NACK was sent");
    s.stop().await;
}

/// A response of a type ratelimitd never asked for is ignored, as Envoy ignores one: no NACK, which on
/// an aggregated stream would subscribe ratelimitd to that type, and the rules served stay.
#[tokio::test]
async fn a_response_of_a_type_not_asked_for_is_ignored() {
    let (plane, s, mut client) = serving_version_1(&On::Memory, 2).await;
    let cluster = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
    plane.push_unrequested("c1", cluster, user_limit(7));
    wait_for("the response sent", WITHIN, async || plane.nonce_of("c1")).await;
    // The next set of rules is applied as usual, and nothing on the stream named the other type.
    plane.push("2", user_limit(9));
    let ack = plane.answer_to("2", WITHIN).await.request;
    assert_eq!((ack.version_info.as_str(), ack.error_detail), ("2", None));
    assert_eq!(limit_of(&mut client, "api", "a").await.unwrap().0, Some(9));
    let seen: Vec<(String, String)> = plane
        .seen()
        .into_iter()
        .map(|s| (s.request.type_url, s.request.response_nonce))
        .collect();
    let c1 = plane.nonce_of("c1").unwrap();
    assert!(
        seen.iter()
            .all(|(type_url, nonce)| type_url == RATE_LIMIT_CONFIG_TYPE && *nonce != c1),
        "{seen:?}"
    );
    s.stop().await;
}

/// Control planes list a set's resources in no set order: the same set in another order is the set
/// served (one fingerprint across the fleet, nothing compiled again), and a refusal names the same
/// resources whichever came first.
#[tokio::test]
async fn a_set_sent_again_in_another_order_is_the_set_served() {
    let plane = ControlPlane::start().await;
    let api = one_rule("api-route", "api", "user", 2, RateLimitUnit::Minute);
    let web = one_rule("web-route", "web", "user", 3, RateLimitUnit::Minute);
    plane.push("1", vec![api.clone(), web.clone()]);
    let s = On::Memory.server(&plane, |_| {}).await;
    s.wait_serving(WITHIN).await;
    plane.answer_to("1", WITHIN).await;
    let rules_info = async || {
        let (_, text) = s.http("GET", "/metrics", "").await;
        let line = text
            .lines()
            .find(|l| l.starts_with("ratelimitd_rules_info{"));
        line.expect("the rules' info").to_owned()
    };
    let served = rules_info().await;

    plane.push("2", vec![web.clone(), api.clone()]);
    let ack = plane.answer_to("2", WITHIN).await.request;
    assert_eq!((ack.version_info.as_str(), ack.error_detail), ("2", None));
    assert_eq!(rules_info().await, served, "one set, one fingerprint");

    let twin = one_rule("api-other", "api", "user", 5, RateLimitUnit::Minute);
    plane.push("3", vec![api.clone(), twin.clone()]);
    let refused = plane.answer_to("3", WITHIN).await.request.error_detail;
    let refused = refused
        .expect("two resources of one domain are refused")
        .message;
    plane.push("4", vec![twin, api]);
    let again = plane.answer_to("4", WITHIN).await.request.error_detail;
    assert_eq!(again.expect("refused again").message, refused);
    assert_eq!(rules_info().await, served, "the set served stays");
    s.stop().await;
}

#[tokio::test]
async fn a_restarted_control_plane_is_reconnected_and_its_rules_applied() {
    let (mut plane, s, mut client) = serving_version_1(&On::Memory, 2).await;

    plane.stop().await;
    wait_for("the stream seen down", WITHIN, async || {
        (metric(&s, "ratelimitd_xds_connected").await == Some(0.0)).then_some(())
    })
    .await;
    // Meanwhile the last rules serve, and health stays SERVING.
    assert_eq!(
        limit_of(&mut client, "api", "a").await.unwrap(),
        (Some(2), Code::Ok)
    );
    s.wait_serving(Duration::from_secs(1)).await;

    // It comes back with its versions counted from 1 again, as a restarted Envoy Gateway does.
    plane.push("1", user_limit(10));
    plane.restart().await;
    wait_for(
        "the rules of the restarted control plane",
        WITHIN,
        async || {
            let (limit, _) = limit_of(&mut client, "api", "b").await.ok()?;
            (limit == Some(10)).then_some(())
        },
    )
    .await;
    let first_of_new_stream = plane
        .seen()
        .into_iter()
        .find(|seen| seen.stream > 0)
        .expect("a request on a new stream")
        .request;
    assert_eq!(
        (
            first_of_new_stream.version_info.as_str(),
            first_of_new_stream.response_nonce.as_str()
        ),
        ("", ""),
        "a new stream asks for everything"
    );
    s.stop().await;
}

#[tokio::test]
async fn the_node_id_metadata_and_headers_are_as_configured() {
    let plane = ControlPlane::start().await;
    plane.push("1", user_limit(2));
    let s = On::Memory
        .server(&plane, |s| {
            s.xds.node_id = "envoy-ratelimit".into();
            s.xds.node_metadata = [("zone".to_string(), "eu-west-1a".to_string())].into();
            s.xds.additional_headers =
                [("authorization".to_string(), Secret("Bearer t0k3n".into()))].into();
        })
        .await;
    s.wait_serving(WITHIN).await;
    let first = plane.seen().remove(0);
    let DiscoveryRequest {
        version_info,
        node,
        resource_names,
        type_url,
        response_nonce,
        error_detail,
    } = first.request.clone();
    let node = node.expect("a node");
    assert_eq!(node.id, "envoy-ratelimit");
    assert_eq!(node.user_agent_name, "ratelimitd");
    let metadata = node.metadata.expect("metadata").fields;
    assert_eq!(
        metadata.get("zone").and_then(|v| v.kind.clone()),
        Some(prost_types::value::Kind::StringValue("eu-west-1a".into()))
    );
    assert_eq!(type_url, RATE_LIMIT_CONFIG_TYPE);
    assert!(resource_names.is_empty(), "every resource of the type");
    assert_eq!(
        (version_info.as_str(), response_nonce.as_str(), error_detail),
        ("", "", None)
    );
    assert!(
        first
            .headers
            .contains(&("authorization".into(), "Bearer t0k3n".into())),
        "{:?}",
        first.headers
    );
    // The ACK carries the node too, as the reference's client sends it.
    let ack = plane.answer_to("1", WITHIN).await.request;
    assert_eq!(ack.node.map(|n| n.id).as_deref(), Some("envoy-ratelimit"));
    s.stop().await;
}

#[tokio::test]
async fn without_force_start_health_waits_for_the_first_set_and_with_it_serves_at_once() {
    let plane = ControlPlane::start().await;
    let waiting = On::Memory.server(&plane, |_| {}).await;
    let forced = On::Memory
        .server(&plane, |s| s.xds.force_start_without_initial_config = true)
        .await;
    forced.wait_serving(WITHIN).await;
    // Both are subscribed, and the control plane has nothing yet.
    wait_for("both subscribed", WITHIN, async || {
        (plane.streams() >= 2).then_some(())
    })
    .await;
    waiting
        .wait_health(ServingStatus::NotServing, Duration::from_secs(1))
        .await;
    assert_eq!(waiting.http("GET", "/healthcheck", "").await.0, 500);
    assert_eq!(forced.http("GET", "/healthcheck", "").await.0, 200);
    for s in [&waiting, &forced] {
        let status = limit_of(&mut s.client().await, "api", "a")
            .await
            .unwrap_err();
        assert_eq!(
            (status.code(), status.message()),
            (GrpcCode::Unavailable, "no rate limit configuration loaded")
        );
    }

    plane.push("1", user_limit(2));
    waiting.wait_serving(WITHIN).await;
    for s in [&waiting, &forced] {
        let mut client = s.client().await;
        wait_for("the first set applied", WITHIN, async || {
            limit_of(&mut client, "api", "a").await.ok()
        })
        .await;
    }
    waiting.stop().await;
    forced.stop().await;
}

#[tokio::test]
async fn a_control_plane_requiring_client_certificates_refuses_others_and_serves_ratelimitd() {
    let ca = Ca::new("envoy gateway ca");
    let control_plane = ca.leaf(&["envoy-gateway"], false);
    let ratelimit = ca.leaf_for_both(&["envoy-ratelimit"]);
    let plane = ControlPlane::start_tls(ServerTls {
        cert: control_plane.cert,
        key: control_plane.key,
        client_ca: Some(ca.pem()),
    })
    .await;
    plane.push(
        "1",
        vec![one_rule("r", "api", "user", 3, RateLimitUnit::Hour)],
    );

    // A client without a certificate gets no stream.
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca.pem()))
        .domain_name("envoy-gateway");
    let refused = async {
        let channel = Channel::from_shared(format!("https://{}", plane.addr))
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .connect()
            .await
            .map_err(|e| format!("{e:?}"))?;
        let first = DiscoveryRequest {
            type_url: RATE_LIMIT_CONFIG_TYPE.into(),
            ..DiscoveryRequest::default()
        };
        let mut stream = AggregatedDiscoveryServiceClient::new(channel)
            .stream_aggregated_resources(tokio_stream::iter([first]))
            .await
            .map_err(|e| format!("{e:?}"))?
            .into_inner();
        stream
            .message()
            .await
            .map_err(|e| format!("{e:?}"))?
            .ok_or_else(|| "no response".to_string())
    }
    .await;
    assert!(
        refused.is_err(),
        "served without a certificate: {refused:?}"
    );
    assert_eq!(plane.streams(), 0);

    let certs = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| common::certs::write(certs.path(), name, text);
    let (cert, key, ca_file) = (
        write("tls.crt", &ratelimit.cert),
        write("tls.key", &ratelimit.key),
        write("ca.crt", &ca.pem()),
    );
    let s = On::Memory
        .server(&plane, |s| {
            s.xds.tls = true;
            s.xds.client_cert = Some(cert);
            s.xds.client_key = Some(key);
            s.xds.server_ca = Some(ca_file);
            s.xds.server_san = Some("envoy-gateway".into());
        })
        .await;
    s.wait_serving(WITHIN).await;
    assert_eq!(
        limit_of(&mut s.client().await, "api", "a").await.unwrap(),
        (Some(3), Code::Ok)
    );
    s.stop().await;
}
