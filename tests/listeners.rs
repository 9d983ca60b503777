//! What hostile or broken callers can do to the listeners, over real sockets: silent, slow and idle
//! connections are dropped within their documented bounds while new callers are served, the HTTP port
//! cannot use up the file descriptors that gRPC and health checks need, and `/json` says 503 when the
//! service cannot decide (400 only for a request that cannot be decided as sent).

mod common;

use std::time::{Duration, Instant};

use common::{ask, descriptor, redis::RedisProcess, request, TestServer};
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

/// Reads until the server closes the connection (end of stream or an error); when that was, or `None`
/// if it was still open after `within`.
async fn closed_within(stream: &mut tokio::net::TcpStream, within: Duration) -> Option<Instant> {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 1024];
    tokio::time::timeout(within, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return Instant::now(),
                Ok(_) => {}
            }
        }
    })
    .await
    .ok()
}

fn grpc_client(
    addr: std::net::SocketAddr,
) -> ratelimitd::proto::RateLimitServiceClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy();
    ratelimitd::proto::RateLimitServiceClient::new(channel)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_grpc_connections_are_dropped_at_the_handshake_bound_and_new_callers_get_in() {
    let handshake = Duration::from_millis(500);
    let server = TestServer::start(&[("l.yaml", RULES)], move |s| {
        s.overload.max_connections = 20;
        s.grpc.handshake_timeout = handshake;
    })
    .await;
    // 25 connections that never say a word: 20 take every place, 5 wait in the backlog.
    let opened = Instant::now();
    let mut silent = Vec::new();
    for _ in 0..25 {
        silent.push(
            tokio::net::TcpStream::connect(server.grpc_addr)
                .await
                .unwrap(),
        );
    }
    let mut caller = grpc_client(server.grpc_addr);
    let answered = tokio::time::timeout(
        Duration::from_secs(10),
        caller.should_rate_limit(request("l", vec![descriptor(&[("user", "c")])])),
    )
    .await
    .expect("a new caller is served while silent connections are open");
    let served_after = opened.elapsed();
    assert!(answered.is_ok(), "{answered:?}");
    // The caller waited for places to free up: the first 20 silent ones dropped at the bound.
    assert!(
        served_after >= handshake && served_after < handshake * 4,
        "served after {served_after:?}"
    );
    // Every silent connection is dropped, each within the bound of its own accept (the last five were
    // accepted once the first twenty were dropped), and none before it.
    for (i, stream) in silent.iter_mut().enumerate() {
        let closed = closed_within(stream, Duration::from_secs(5))
            .await
            .unwrap_or_else(|| panic!("silent connection {i} still open"));
        let after = closed - opened;
        assert!(
            after >= handshake && after < handshake * 4,
            "silent connection {i} closed after {after:?}"
        );
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_grpc_connection_is_closed_and_its_client_reconnects_but_a_call_in_flight_keeps_it()
{
    let idle = Duration::from_millis(700);
    let server = TestServer::start(&[("l.yaml", RULES)], move |s| {
        // One place: a second client is served only once the first one's connection is closed.
        s.overload.max_connections = 1;
        s.grpc.idle_timeout = idle;
    })
    .await;
    let question = |user: &str| request("l", vec![descriptor(&[("user", user)])]);
    let mut first = grpc_client(server.grpc_addr);
    ask(&mut first, question("a")).await;
    let idle_from = Instant::now();

    let mut second = grpc_client(server.grpc_addr);
    let answered = tokio::time::timeout(
        Duration::from_secs(10),
        second.should_rate_limit(question("b")),
    )
    .await
    .expect("the idle connection is closed and frees its place");
    assert!(answered.is_ok(), "{answered:?}");
    let after = idle_from.elapsed();
    assert!(
        after >= idle * 9 / 10,
        "served after {after:?}: before the idle bound"
    );
    // The first client's connection is gone; the same client opens a new one by itself (once the
    // second client's connection idles out in turn). The close carries no GOAWAY: a call the client
    // sends before it has read the close fails as on any lost connection (here, right after the
    // close, that can happen), and the one after it goes over a new connection. Which code the lost
    // call gets depends on how far the client had taken it: Unknown once it was written ("connection
    // closed before message completed"), Cancelled while it still waited in the client's queue.
    let again = tokio::time::timeout(Duration::from_secs(10), async {
        match first.should_rate_limit(question("a")).await {
            Err(status)
                if matches!(status.code(), tonic::Code::Unknown | tonic::Code::Cancelled) =>
            {
                first.should_rate_limit(question("a")).await
            }
            answered => answered,
        }
    })
    .await
    .expect("the first client reconnects");
    assert!(again.is_ok(), "{again:?}");

    // A call in flight (a health Watch stream, open until the client ends it) is not idleness.
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.grpc_addr))
        .unwrap()
        .connect_lazy();
    let mut watch = tokio::time::timeout(
        Duration::from_secs(10),
        HealthClient::new(channel).watch(HealthCheckRequest {
            service: String::new(),
        }),
    )
    .await
    .expect("a place for the watcher")
    .unwrap()
    .into_inner();
    let first_status = watch.message().await.unwrap();
    assert!(first_status.is_some());
    let held = tokio::time::timeout(idle * 3, watch.message()).await;
    assert!(
        held.is_err(),
        "the stream ended or failed within three idle bounds: {held:?}"
    );
    server.stop().await;
}

/// Sends `bytes` one at a time, `every` apart, on a new connection to `addr`, and returns what the
/// server answered and how long after the first byte it closed the connection (`None`: still open
/// after `within`).
async fn trickle(
    addr: std::net::SocketAddr,
    bytes: &[u8],
    every: Duration,
    within: Duration,
) -> (String, Option<Duration>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut read, mut write) = stream.into_split();
    let bytes = bytes.to_vec();
    let started = Instant::now();
    let writer = tokio::spawn(async move {
        for b in bytes {
            if write.write_all(&[b]).await.is_err() {
                return;
            }
            tokio::time::sleep(every).await;
        }
        // Everything sent: keep the connection open, saying nothing more.
        std::future::pending::<()>().await;
    });
    let mut answer = Vec::new();
    let closed = tokio::time::timeout(within, async {
        let mut buf = [0u8; 1024];
        loop {
            match read.read(&mut buf).await {
                Ok(0) | Err(_) => return started.elapsed(),
                Ok(n) => answer.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .ok();
    writer.abort();
    (String::from_utf8_lossy(&answer).into_owned(), closed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_client_sending_its_headers_a_byte_a_second_is_dropped_at_the_header_bound() {
    let header_read = Duration::from_secs(2);
    let server = TestServer::start(&[("l.yaml", RULES)], move |s| {
        s.http.header_read_timeout = header_read;
    })
    .await;
    let headers = format!(
        "GET /healthcheck HTTP/1.1\r\nHost: l\r\nX-Slow: {}\r\n\r\n",
        "a".repeat(60)
    );
    let (answer, closed) = trickle(
        server.http_addr,
        headers.as_bytes(),
        Duration::from_secs(1),
        Duration::from_secs(10),
    )
    .await;
    let closed = closed.expect("dropped while still sending its headers");
    assert!(
        closed >= header_read && closed < header_read * 2,
        "dropped after {closed:?}"
    );
    assert!(!answer.contains("200 OK"), "{answer}");
    // The same bound ends a keep-alive connection that sends no further request after its answer.
    let (answer, closed) = trickle(
        server.http_addr,
        b"GET /healthcheck HTTP/1.1\r\nHost: l\r\n\r\n",
        Duration::ZERO,
        Duration::from_secs(10),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let closed = closed.expect("an idle keep-alive connection is closed");
    assert!(
        closed >= header_read && closed < header_read * 2,
        "idle keep-alive connection closed after {closed:?}"
    );
    // Nobody else noticed.
    assert_eq!(
        server.http("GET", "/healthcheck", "").await,
        (200, "OK".into())
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_request_whose_body_trickles_is_answered_408_at_the_request_bound() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let request_timeout = Duration::from_secs(2);
    let server = TestServer::start(&[("l.yaml", RULES)], move |s| {
        s.http.request_timeout = request_timeout;
    })
    .await;
    let head = format!(
        "POST /json HTTP/1.1\r\nHost: l\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        ASK.len()
    );
    // The headers at once, then the body a byte a second: it would take over a minute.
    let stream = tokio::net::TcpStream::connect(server.http_addr)
        .await
        .unwrap();
    let (mut read, mut write) = stream.into_split();
    write.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    let writer = tokio::spawn(async move {
        for b in ASK.bytes() {
            if write.write_all(&[b]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    let mut answer = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), read.read_to_end(&mut answer))
        .await
        .ok()
        .map(|_| started.elapsed());
    writer.abort();
    let answer = String::from_utf8_lossy(&answer);
    let closed = closed.expect("answered and closed while the body still trickled");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("http.request_timeout"), "{answer}");
    assert!(
        closed >= request_timeout && closed < request_timeout * 2,
        "answered and closed after {closed:?}"
    );
    // The whole request at once is answered as usual.
    assert_eq!(server.http("POST", "/json", ASK).await.0, 200);
    server.stop().await;
}

/// Where util-linux's `prlimit` is, to start the binary with a low file-descriptor limit.
fn prlimit() -> String {
    let out = std::process::Command::new("sh")
        .args(["-c", "command -v prlimit"])
        .output()
        .expect("sh runs");
    let path = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(
        !path.is_empty(),
        "prlimit not found: install util-linux (scripts/test does)"
    );
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_http_connections_cannot_use_up_the_descriptors_of_grpc_and_health() {
    // 64 descriptors for the whole process (about 16 in use at rest), 16 of them at most for HTTP
    // connections; 60 idle HTTP connections would take every descriptor left without the cap.
    let rules = tempfile::tempdir().unwrap();
    std::fs::write(rules.path().join("l.yaml"), RULES).unwrap();
    let prlimit = prlimit();
    let mut cmd = common::binary_under(&[&prlimit, "--nofile=64:64", "--"], rules.path());
    cmd.env("RATELIMITD_HTTP__MAX_CONNECTIONS", "16")
        .env("RATELIMITD_HTTP__HEADER_READ_TIMEOUT", "1s");
    let running = common::start_binary(&mut cmd);
    assert!(running.serving_within(Duration::from_secs(10)));

    let opened = Instant::now();
    let mut idle = Vec::new();
    for _ in 0..60 {
        idle.push(tokio::net::TcpStream::connect(running.http).await.unwrap());
    }
    // gRPC is served at once meanwhile.
    let mut caller = grpc_client(running.grpc);
    for user in ["a", "b", "c"] {
        let asked = Instant::now();
        let answered = tokio::time::timeout(
            Duration::from_secs(2),
            caller.should_rate_limit(request("l", vec![descriptor(&[("user", user)])])),
        )
        .await
        .expect("gRPC answers while the HTTP port is full");
        assert!(answered.is_ok(), "{answered:?}");
        assert!(asked.elapsed() < Duration::from_secs(1));
    }
    // A new health check waits behind the idle connections, which leave 16 at a time as their header
    // bound passes (about 4 s for 60), and is then answered.
    let health = tokio::time::timeout(Duration::from_secs(20), async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(running.http).await.unwrap();
        stream
            .write_all(b"GET /healthcheck HTTP/1.1\r\nHost: l\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = String::new();
        let _ = stream.read_to_string(&mut answer).await;
        answer
    })
    .await
    .expect("health answered once the idle connections timed out");
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    let waited = opened.elapsed();
    assert!(
        waited >= Duration::from_secs(3),
        "answered after {waited:?}"
    );
    // Every idle connection was closed by the server.
    for (i, stream) in idle.iter_mut().enumerate() {
        assert!(
            closed_within(stream, Duration::from_secs(5))
                .await
                .is_some(),
            "idle connection {i} still open"
        );
    }
    let log = running.log.lock().unwrap().clone();
    assert!(!log.contains("panicked"), "{log}");
}

#[test]
fn the_soft_open_files_limit_is_raised_to_the_hard_one_at_start() {
    let rules = tempfile::tempdir().unwrap();
    std::fs::write(rules.path().join("l.yaml"), RULES).unwrap();
    let prlimit = prlimit();
    let mut cmd = common::binary_under(&[&prlimit, "--nofile=256:4096", "--"], rules.path());
    let running = common::start_binary(&mut cmd);
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", running.child.id())).unwrap();
    let open_files = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap_or_default();
    let numbers: Vec<&str> = open_files.split_whitespace().skip(3).take(2).collect();
    assert_eq!(numbers, ["4096", "4096"], "{open_files}");
    // 4 096 is below the default overload.max_connections: the log says what that means.
    let log = running.log.lock().unwrap().clone();
    assert!(log.contains("RLIMIT_NOFILE"), "{log}");
}

/// A gRPC call opened on `client` to `path` that sends `first` as its request's only bytes so far;
/// its answer, and the stream to send more on.
fn open_call(
    client: &mut h2::client::SendRequest<bytes::Bytes>,
    path: &str,
    first: &[u8],
) -> (h2::client::ResponseFuture, h2::SendStream<bytes::Bytes>) {
    let head = tonic::codegen::http::Request::post(format!("http://ratelimitd{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (answer, mut send) = client.send_request(head, false).unwrap();
    send.send_data(bytes::Bytes::copy_from_slice(first), false)
        .unwrap();
    (answer, send)
}

/// The grpc-status an answer ends with: in its head (an error answered at once), else its trailers.
async fn grpc_status(answer: h2::client::ResponseFuture) -> Option<String> {
    let answer = answer.await.ok()?;
    if let Some(status) = answer.headers().get("grpc-status") {
        return Some(status.to_str().unwrap().to_owned());
    }
    let mut body = answer.into_body();
    while let Some(data) = body.data().await {
        let _ = body.flow_control().release_capacity(data.ok()?.len());
    }
    let trailers = body.trailers().await.ok()??;
    Some(trailers.get("grpc-status")?.to_str().unwrap().to_owned())
}

/// A gRPC message: the prefix (not compressed, its length) and `payload`.
fn grpc_message(payload: &[u8]) -> Vec<u8> {
    let mut message = vec![0];
    message.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    message.extend_from_slice(payload);
    message
}

/// The binary started with nothing set (its rules in the folder kept with it), and an HTTP/2 connection
/// to its gRPC port.
async fn on_the_defaults() -> (
    common::Running,
    h2::client::SendRequest<bytes::Bytes>,
    tempfile::TempDir,
) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("l.yaml"), RULES).unwrap();
    let running = common::start_binary(&mut common::binary(dir.path()));
    assert!(running.serving_within(Duration::from_secs(20)));
    let tcp = tokio::net::TcpStream::connect(running.grpc).await.unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    (running, client, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_that_declare_large_messages_and_send_nothing_more_hold_no_memory_and_end_in_time() {
    // The service as started with nothing set: its default bounds.
    let (running, client, _rules) = on_the_defaults().await;

    // 400 calls on one connection, each sending the 5-byte prefix of its message and nothing more.
    const HEALTH: &str = "/grpc.health.v1.Health/Check";
    const DECIDE: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
    const QUOTA: &str =
        "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas";
    let kinds: [(&str, u32, &str); 4] = [
        // Past the 16 KiB a health check takes: refused at once, as tonic answers (OUT_OF_RANGE).
        (HEALTH, 1 << 20, "11"),
        // Within their bounds (16 KiB, 64 KiB, 1 MiB): waited for until grpc.message_timeout (10 s by
        // default), then DEADLINE_EXCEEDED.
        (HEALTH, 10, "4"),
        (DECIDE, 60_000, "4"),
        (QUOTA, 1 << 20, "4"),
    ];
    let before = common::measure::peak_bytes(running.child.id());
    let began = Instant::now();
    let mut calls = Vec::new();
    for i in 0..400 {
        let (path, declared, _) = kinds[i % 4];
        let mut prefix = vec![0];
        prefix.extend_from_slice(&declared.to_be_bytes());
        let mut ready = client.clone().ready().await.unwrap();
        calls.push(open_call(&mut ready, path, &prefix));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let grown = common::measure::peak_bytes(running.child.id()).saturating_sub(before);
    eprintln!("400 calls declaring up to 1 MiB each: the process grew by {grown} bytes");
    assert!(
        grown < 64 << 20,
        "400 calls declaring up to 1 MiB each grew the process by {grown} bytes"
    );

    for (i, (answer, _send)) in calls.into_iter().enumerate() {
        let (path, declared, want) = kinds[i % 4];
        let status = tokio::time::timeout(Duration::from_secs(30), grpc_status(answer))
            .await
            .expect("answered within 30 s");
        assert_eq!(status.as_deref(), Some(want), "{path} declaring {declared}");
        if want == "4" {
            let took = began.elapsed();
            assert!(
                took >= Duration::from_secs(9) && took < Duration::from_secs(25),
                "{path} declaring {declared} ended {took:?} after the calls began"
            );
        }
    }
    // The 100 decisions that never arrived are counted as invalid requests, as /json counts a body cut
    // short.
    let (_, metrics) = common::http_request(running.http, "GET", "/metrics", "");
    assert!(
        metrics.contains("ratelimitd_requests_total{result=\"error\"} 100\n"),
        "{metrics}"
    );
    // Nothing was decided: the ten seconds their senders took are not a time to decide.
    assert!(
        metrics.contains("rate_limit_check_duration_seconds_count 0\n"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_that_send_most_of_large_messages_and_wait_hold_no_more_than_grpc_max_held_bytes() {
    // The service as started with nothing set: 64 MiB held at most.
    let (running, client, _rules) = on_the_defaults().await;
    const QUOTA: &str =
        "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas";
    // 400 streams each send a 1 MiB report but its last 6 bytes: 400 MiB the server would hold.
    let mut almost = grpc_message(&vec![0; 1 << 20]);
    almost.truncate(almost.len() - 6);
    let before = common::measure::peak_bytes(running.child.id());
    let mut calls = Vec::new();
    for _ in 0..400 {
        let mut ready = client.clone().ready().await.unwrap();
        calls.push(open_call(&mut ready, QUOTA, &almost));
    }
    let mut refused = 0;
    for (answer, _send) in calls.drain(..300) {
        let status = tokio::time::timeout(Duration::from_secs(30), grpc_status(answer))
            .await
            .expect("answered within 30 s");
        refused += usize::from(status.as_deref() == Some("8"));
    }
    let grown = common::measure::peak_bytes(running.child.id()).saturating_sub(before);
    eprintln!(
        "400 MiB of messages not yet whole: the process grew by {grown} bytes, {refused} refused"
    );
    assert!(refused >= 200, "{refused} of the first 300 refused");
    assert!(grown < 256 << 20, "the process grew by {grown} bytes");
    drop(calls);
    // Other calls go on.
    let mut c =
        ratelimitd::proto::RateLimitServiceClient::connect(format!("http://{}", running.grpc))
            .await
            .unwrap();
    let ok = c
        .should_rate_limit(request("l", vec![descriptor(&[("user", "after")])]))
        .await
        .unwrap();
    assert_eq!(ok.into_inner().overall_code, 1, "OK");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_sent_in_pieces_is_decided_once_it_is_whole() {
    use prost::Message;
    let server = TestServer::start(&[("l.yaml", RULES)], |_| {}).await;
    let tcp = tokio::net::TcpStream::connect(server.grpc_addr)
        .await
        .unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let message =
        grpc_message(&request("l", vec![descriptor(&[("user", "pieces")])]).encode_to_vec());
    let mut client = client.ready().await.unwrap();
    // The prefix and 3 bytes, then the rest 300 ms later, then the end of the request.
    let (answer, mut send) = open_call(
        &mut client,
        "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        &message[..8],
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    send.send_data(bytes::Bytes::copy_from_slice(&message[8..]), true)
        .unwrap();
    let answer = answer.await.unwrap();
    assert_eq!(answer.status(), 200);
    let mut body = answer.into_body();
    let mut bytes = Vec::new();
    while let Some(data) = body.data().await {
        bytes.extend_from_slice(&data.unwrap());
    }
    let trailers = body.trailers().await.unwrap().unwrap();
    assert_eq!(trailers["grpc-status"], "0");
    let response = ratelimitd::proto::RateLimitResponse::decode(&bytes[5..]).unwrap();
    assert_eq!(response.statuses[0].limit_remaining, 999);
    server.stop().await;
}
