//! TLS end to end, with certificates made here (rcgen): the gRPC listener with TLS and mTLS (a CA, a
//! required client SAN, a certificate rotated on disk while serving), and Redis over TLS (a redis-server
//! started with --tls-port, with and without client certificates) and as a Redis ACL user.

mod common;

use std::{
    path::Path,
    time::{Duration, Instant},
};

use common::{
    certs::{write, Ca, Leaf},
    descriptor,
    redis::{free_port, RedisProcess},
    request, start_binary, wait_for, Running,
};
use ratelimitd::proto::{rate_limit_response::Code, RateLimitServiceClient};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

const RULES: &str = "domain: tls\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n";

fn rules_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "tls.yaml", RULES);
    dir
}

/// Starts the binary with gRPC TLS from files in `certs`, plus `env`.
fn start_tls(rules: &Path, certs: &Path, env: &[(&str, &str)]) -> Running {
    let mut cmd = common::binary(rules);
    cmd.env("LOG_LEVEL", "debug")
        .env("GRPC_SERVER_USE_TLS", "true")
        .env("GRPC_SERVER_TLS_CERT", certs.join("server.pem"))
        .env("GRPC_SERVER_TLS_KEY", certs.join("server.key"));
    for (k, v) in env {
        cmd.env(k, v);
    }
    start_binary(&mut cmd)
}

/// One ShouldRateLimit call over TLS trusting `ca`, presenting `client` if given.
async fn call_tls(
    running: &Running,
    ca: &str,
    client: Option<&Leaf>,
    user: &str,
) -> Result<Code, String> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .domain_name("localhost");
    if let Some(client) = client {
        tls = tls.identity(Identity::from_pem(&client.cert, &client.key));
    }
    let channel = Channel::from_shared(format!("https://{}", running.grpc))
        .unwrap()
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| format!("connect: {e:?}"))?;
    let answer = RateLimitServiceClient::new(channel)
        .should_rate_limit(request("tls", vec![descriptor(&[("user", user)])]))
        .await
        .map_err(|e| format!("call: {e:?}"))?;
    Ok(answer.into_inner().overall_code())
}

async fn call_plaintext(running: &Running) -> Result<Code, String> {
    let channel = Channel::from_shared(format!("http://{}", running.grpc))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| format!("connect: {e:?}"))?;
    let answer = RateLimitServiceClient::new(channel)
        .should_rate_limit(request("tls", vec![descriptor(&[("user", "plain")])]))
        .await
        .map_err(|e| format!("call: {e:?}"))?;
    Ok(answer.into_inner().overall_code())
}

fn server_files(dir: &Path, ca: &Ca) {
    let server = ca.leaf(&["localhost"], false);
    write(dir, "server.pem", &server.cert);
    write(dir, "server.key", &server.key);
}

#[tokio::test]
async fn grpc_tls_answers_clients_that_trust_the_server_and_refuses_plaintext() {
    let (rules, certs) = (rules_dir(), tempfile::tempdir().unwrap());
    let ca = Ca::new("server ca");
    server_files(certs.path(), &ca);
    let running = start_tls(rules.path(), certs.path(), &[]);

    assert_eq!(call_tls(&running, &ca.pem(), None, "a").await, Ok(Code::Ok));
    assert_eq!(call_tls(&running, &ca.pem(), None, "a").await, Ok(Code::Ok));
    assert_eq!(
        call_tls(&running, &ca.pem(), None, "a").await,
        Ok(Code::OverLimit),
        "the limit holds over TLS"
    );
    assert!(call_plaintext(&running).await.is_err(), "plaintext refused");
    let other = Ca::new("someone else");
    assert!(
        call_tls(&running, &other.pem(), None, "a").await.is_err(),
        "a client that does not trust the server's CA cannot call"
    );
}

/// Reads until the server closes the connection; how long after `since` that was, or `None` if it was
/// still open after `within`.
async fn closed_after(
    io: &mut (impl tokio::io::AsyncRead + Unpin),
    since: Instant,
    within: Duration,
) -> Option<Duration> {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 1024];
    tokio::time::timeout(within, async {
        while let Ok(1..) = io.read(&mut buf).await {}
        since.elapsed()
    })
    .await
    .ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_silent_before_or_after_its_tls_handshake_is_dropped_at_the_handshake_bound() {
    let (rules, certs) = (rules_dir(), tempfile::tempdir().unwrap());
    let ca = Ca::new("server ca");
    server_files(certs.path(), &ca);
    let bound = Duration::from_secs(1);
    let running = start_tls(
        rules.path(),
        certs.path(),
        &[("RATELIMITD_GRPC__HANDSHAKE_TIMEOUT", "1s")],
    );

    // A connection that never starts its TLS handshake.
    let opened = Instant::now();
    let mut silent = tokio::net::TcpStream::connect(running.grpc).await.unwrap();
    let closed = closed_after(&mut silent, opened, Duration::from_secs(5))
        .await
        .expect("dropped without a TLS handshake");
    assert!(closed >= bound && closed < bound * 2, "after {closed:?}");

    // A connection that completes its TLS handshake, then never sends the HTTP/2 preface: the same
    // bound, counted from the accept, covers both.
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.der()).unwrap();
    let mut config = rustls::ClientConfig::builder_with_provider(
        rustls::crypto::ring::default_provider().into(),
    )
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let opened = Instant::now();
    let tcp = tokio::net::TcpStream::connect(running.grpc).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut tls = connector
        .connect(name, tcp)
        .await
        .expect("the TLS handshake itself succeeds");
    let closed = closed_after(&mut tls, opened, Duration::from_secs(5))
        .await
        .expect("dropped without an HTTP/2 preface after the handshake");
    assert!(closed >= bound && closed < bound * 2, "after {closed:?}");

    // Clients that speak are served as before.
    assert_eq!(call_tls(&running, &ca.pem(), None, "s").await, Ok(Code::Ok));
}

#[tokio::test]
async fn mtls_admits_only_client_certificates_from_the_ca_with_the_required_san() {
    let (rules, certs) = (rules_dir(), tempfile::tempdir().unwrap());
    let server_ca = Ca::new("server ca");
    let client_ca = Ca::new("client ca");
    server_files(certs.path(), &server_ca);
    let ca_file = write(certs.path(), "clients.pem", &client_ca.pem());
    let running = start_tls(
        rules.path(),
        certs.path(),
        &[
            ("GRPC_CLIENT_TLS_CACERT", ca_file.to_str().unwrap()),
            ("GRPC_CLIENT_TLS_SAN", "envoy.gateway.svc"),
        ],
    );
    let ca = server_ca.pem();

    let envoy = client_ca.leaf(&["envoy.gateway.svc"], true);
    assert_eq!(
        call_tls(&running, &ca, Some(&envoy), "m").await,
        Ok(Code::Ok)
    );

    assert!(
        call_tls(&running, &ca, None, "m").await.is_err(),
        "no client certificate"
    );
    let stranger = Ca::new("rogue ca").leaf(&["envoy.gateway.svc"], true);
    assert!(
        call_tls(&running, &ca, Some(&stranger), "m").await.is_err(),
        "a client certificate from another CA"
    );
    let wrong_san = client_ca.leaf(&["batch.jobs.svc"], true);
    assert!(
        call_tls(&running, &ca, Some(&wrong_san), "m")
            .await
            .is_err(),
        "a client certificate from the CA without the required SAN"
    );
    // Refused connections are counted, and the right client still gets through afterwards.
    assert_eq!(
        call_tls(&running, &ca, Some(&envoy), "m").await,
        Ok(Code::Ok)
    );
    let (_, metrics) = common::http_request(running.http, "GET", "/metrics", "");
    let refused = metrics
        .lines()
        .find_map(|l| l.strip_prefix("ratelimitd_tls_handshake_failures_total "))
        .unwrap_or("0");
    assert!(
        refused.parse::<u64>().unwrap() >= 3,
        "handshake failures counted: {refused}"
    );
}

#[tokio::test]
async fn a_rotated_server_certificate_is_served_without_a_restart_and_a_broken_one_is_not() {
    let (rules, certs) = (rules_dir(), tempfile::tempdir().unwrap());
    let old_ca = Ca::new("old ca");
    server_files(certs.path(), &old_ca);
    let running = start_tls(rules.path(), certs.path(), &[]);
    assert_eq!(
        call_tls(&running, &old_ca.pem(), None, "r1").await,
        Ok(Code::Ok)
    );

    // A half-written rotation (a key that is not PEM) keeps the old certificate serving.
    write(certs.path(), "server.key", "not a key");
    running.wait_log("not reloaded", Duration::from_secs(10));
    assert_eq!(
        call_tls(&running, &old_ca.pem(), None, "r2").await,
        Ok(Code::Ok)
    );
    let log = running.log.lock().unwrap().clone();
    assert!(
        log.contains("not reloaded") && log.contains("GRPC_SERVER_TLS_KEY"),
        "{log}"
    );

    let new_ca = Ca::new("new ca");
    server_files(certs.path(), &new_ca);
    wait_for(
        "the new certificate served",
        Duration::from_secs(10),
        async || {
            let answer = call_tls(&running, &new_ca.pem(), None, "r3").await;
            (answer == Ok(Code::Ok)).then_some(())
        },
    )
    .await;
    assert!(
        call_tls(&running, &old_ca.pem(), None, "r4").await.is_err(),
        "new connections get the new certificate"
    );
}

#[test]
fn unusable_tls_settings_stop_the_start_with_the_setting_named() {
    let rules = rules_dir();
    let certs = tempfile::tempdir().unwrap();
    write(
        certs.path(),
        "server.pem",
        "-----BEGIN PRIVATE KEY-----\nk3y-mat3rial\n",
    );
    write(certs.path(), "server.key", "whatever");
    let run = |env: &[(&str, &str)]| {
        let mut cmd = common::binary(rules.path());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (code, err) = run(&[("GRPC_SERVER_USE_TLS", "true")]);
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("GRPC_SERVER_TLS_CERT"), "{err}");

    let cert = certs.path().join("server.pem");
    let key = certs.path().join("server.key");
    let (code, err) = run(&[
        ("GRPC_SERVER_USE_TLS", "true"),
        ("GRPC_SERVER_TLS_CERT", cert.to_str().unwrap()),
        ("GRPC_SERVER_TLS_KEY", key.to_str().unwrap()),
    ]);
    assert_eq!(code, Some(64), "checked before any port is bound: {err}");
    assert!(err.contains("GRPC_SERVER_TLS_CERT"), "{err}");
    assert!(
        !err.contains("k3y-mat3rial") && !err.contains("[80, 82"),
        "file contents in the message: {err}"
    );
}

/// A redis-server with a TLS port (the plain port stays for the test's own redis-cli).
fn redis_tls(
    certs: &Path,
    ca: &Ca,
    server_names: &[&str],
    client_certs: bool,
) -> (RedisProcess, u16) {
    let server = ca.leaf(server_names, false);
    let cert = write(certs, "redis.pem", &server.cert);
    let key = write(certs, "redis.key", &server.key);
    let ca_file = write(certs, "redis-ca.pem", &ca.pem());
    let tls_port = free_port();
    let tls_port_text = tls_port.to_string();
    let redis = RedisProcess::start(&[
        "--tls-port",
        &tls_port_text,
        "--tls-cert-file",
        cert.to_str().unwrap(),
        "--tls-key-file",
        key.to_str().unwrap(),
        "--tls-ca-cert-file",
        ca_file.to_str().unwrap(),
        "--tls-auth-clients",
        if client_certs { "yes" } else { "no" },
    ]);
    (redis, tls_port)
}

fn start_redis_client(rules: &Path, env: &[(&str, &str)]) -> Running {
    let mut cmd = common::binary(rules);
    cmd.env("LOG_LEVEL", "warn")
        .env("RATELIMITD_HASH_SECRET", "tls-test")
        .env("REDIS_TIMEOUT", "500ms");
    for (k, v) in env {
        cmd.env(k, v);
    }
    start_binary(&mut cmd)
}

fn json_call(running: &Running, user: &str) -> u16 {
    let body = format!(
        r#"{{"domain":"tls","descriptors":[{{"entries":[{{"key":"user","value":"{user}"}}]}}]}}"#
    );
    common::http_request(running.http, "POST", "/json", &body).0
}

#[test]
fn redis_over_tls_with_a_client_certificate_counts_and_without_one_is_refused() {
    let rules = rules_dir();
    let certs = tempfile::tempdir().unwrap();
    let ca = Ca::new("redis ca");
    let (redis, tls_port) = redis_tls(certs.path(), &ca, &["localhost"], true);
    let client = ca.leaf(&["ratelimitd"], true);
    let client_cert = write(certs.path(), "client.pem", &client.cert);
    let client_key = write(certs.path(), "client.key", &client.key);
    let ca_file = certs.path().join("redis-ca.pem");
    let url = format!("rediss://localhost:{tls_port}");

    let running = start_redis_client(
        rules.path(),
        &[
            ("REDIS_URL", &url),
            ("REDIS_TLS_CACERT", ca_file.to_str().unwrap()),
            ("REDIS_TLS_CLIENT_CERT", client_cert.to_str().unwrap()),
            ("REDIS_TLS_CLIENT_KEY", client_key.to_str().unwrap()),
        ],
    );
    assert!(
        running.serving_within(Duration::from_secs(15)),
        "connected over TLS"
    );
    std::thread::sleep(common::until_far_from_a_minute_end());
    assert_eq!(json_call(&running, "t"), 200);
    assert_eq!(json_call(&running, "t"), 200);
    assert_eq!(json_call(&running, "t"), 429);
    let keys = redis.cli(&["--scan"]);
    assert!(keys.contains("tls_user_t_"), "counted in Redis: {keys}");

    // The same Redis, no client certificate: never reaches it.
    let refused = start_redis_client(
        rules.path(),
        &[
            ("REDIS_URL", &url),
            ("REDIS_TLS_CACERT", ca_file.to_str().unwrap()),
        ],
    );
    assert!(
        !refused.serving_within(Duration::from_secs(3)),
        "connected without a client certificate"
    );
}

#[test]
fn redis_tls_checks_the_host_name_unless_told_not_to() {
    let rules = rules_dir();
    let certs = tempfile::tempdir().unwrap();
    let ca = Ca::new("redis ca");
    // A certificate for another name only (and 127.0.0.1, which the URL below does not use).
    let (_redis, tls_port) = redis_tls(certs.path(), &ca, &["redis.internal"], false);
    let ca_file = certs.path().join("redis-ca.pem");
    let url = format!("localhost:{tls_port}");
    let base = [
        ("REDIS_URL", url.as_str()),
        ("REDIS_TLS", "true"),
        ("REDIS_TLS_CACERT", ca_file.to_str().unwrap()),
    ];
    let strict = start_redis_client(rules.path(), &base);
    assert!(
        !strict.serving_within(Duration::from_secs(3)),
        "a certificate for another host name was accepted"
    );
    strict.wait_log(
        "or set REDIS_TLS_SKIP_HOSTNAME_VERIFICATION=true",
        Duration::from_secs(5),
    );
    let mut relaxed_env = base.to_vec();
    relaxed_env.push(("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", "true"));
    let relaxed = start_redis_client(rules.path(), &relaxed_env);
    assert!(relaxed.serving_within(Duration::from_secs(15)));
    assert_eq!(json_call(&relaxed, "h"), 200);

    // Skipping the host name still checks the CA.
    let other = Ca::new("other ca");
    let other_file = write(certs.path(), "other.pem", &other.pem());
    let mut wrong_ca = relaxed_env.clone();
    wrong_ca[2] = ("REDIS_TLS_CACERT", other_file.to_str().unwrap());
    let untrusted = start_redis_client(rules.path(), &wrong_ca);
    assert!(
        !untrusted.serving_within(Duration::from_secs(3)),
        "an unknown CA was accepted"
    );
    untrusted.wait_log(
        "not signed by a CA in REDIS_TLS_CACERT",
        Duration::from_secs(5),
    );

    // A plain connection to the TLS port: the server drops it, and the log says what may be missing.
    let plain = start_redis_client(rules.path(), &[("REDIS_URL", url.as_str())]);
    assert!(!plain.serving_within(Duration::from_secs(2)));
    plain.wait_log("set REDIS_TLS=true", Duration::from_secs(5));
}

#[test]
fn a_redis_acl_user_with_only_the_commands_ratelimitd_needs_is_enough() {
    let rules = rules_dir();
    let redis = RedisProcess::start(&[]);
    // Least privilege: the scripts and what they call, nothing else (SECURITY.md lists the same).
    let acl = redis.cli(&[
        "ACL",
        "SETUSER",
        "ratelimitd",
        "on",
        ">s3cret-acl-pass",
        "resetkeys",
        "~*",
        "resetchannels",
        "-@all",
        // The list of earlier versions, without MGET: a user set up then keeps working.
        "+evalsha",
        "+eval",
        "+script|load",
        "+script|exists",
        "+ping",
        "+time",
        "+get",
        "+set",
        "+incrby",
        "+expire",
        "+pexpire",
        "+del",
        "+hmget",
        "+hset",
        "+zadd",
        "+zrangebyscore",
        "+zremrangebyscore",
        "+zcard",
        "+info",
        "+client|setname",
        "+hello",
        "+select",
        "+cluster|slots",
    ]);
    assert_eq!(acl, "OK");
    let url = format!("127.0.0.1:{}", redis.port);
    let running = start_redis_client(
        rules.path(),
        &[
            ("REDIS_URL", &url),
            ("REDIS_AUTH", "ratelimitd:s3cret-acl-pass"),
        ],
    );
    assert!(
        running.serving_within(Duration::from_secs(15)),
        "the ACL user connects"
    );
    std::thread::sleep(common::until_far_from_a_minute_end());
    let first = json_call(&running, "acl");
    assert_eq!(first, 200, "{}", running.log.lock().unwrap());
    assert_eq!(json_call(&running, "acl"), 200);
    assert_eq!(json_call(&running, "acl"), 429);

    let wrong = start_redis_client(
        rules.path(),
        &[
            ("REDIS_URL", &url),
            ("REDIS_AUTH", "ratelimitd:wrong-password"),
        ],
    );
    assert!(!wrong.serving_within(Duration::from_secs(3)));
    let log = wrong.log.lock().unwrap().clone();
    assert!(
        !log.contains("wrong-password"),
        "the password is in the log: {log}"
    );
}
