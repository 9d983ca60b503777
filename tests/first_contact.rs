//! First contact: the binary started the way an existing envoyproxy/ratelimit Deployment starts it, with
//! the reference service's variables only (plus what Kubernetes adds to every pod), comes up and serves.

mod common;

use std::{fs, path::Path, process::Command, time::Duration};

use common::{descriptor, redis::RedisProcess, request, start_binary, Running};
use ratelimitd::proto::{rate_limit_response::Code, RateLimitServiceClient};

const RULES: &str = "domain: api\ndescriptors:\n  - key: api_key\n    rate_limit: {unit: hour, requests_per_unit: 3}\n";
const RAW_KEY: &str = "sk_live_FIRSTCONTACT_7f3a";

/// The binary with a clean environment and only the variables a reference Deployment on Redis sets, the
/// rules in `RUNTIME_ROOT/ratelimit/config` as a ConfigMap mount puts them. Loopback and free ports
/// stand in for the reference's 0.0.0.0:8081 and :8080, so tests can run side by side.
fn reference_deployment(runtime_root: &Path, redis: &RedisProcess) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ratelimitd"));
    cmd.env_clear()
        .envs([
            ("BACKEND_TYPE", "redis"),
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", redis.addr().as_str()),
            ("RUNTIME_ROOT", runtime_root.to_str().unwrap()),
            ("RUNTIME_SUBDIRECTORY", "ratelimit"),
            ("RUNTIME_APPDIRECTORY", "config"),
            ("RUNTIME_WATCH_ROOT", "false"),
            ("RUNTIME_IGNOREDOTFILES", "true"),
        ])
        .envs(common::LOOPBACK);
    cmd
}

fn start_serving(cmd: &mut Command) -> Running {
    let running = start_binary(cmd);
    assert!(
        running.serving_within(Duration::from_secs(20)),
        "/healthcheck not 200 within 20 s; log:\n{}",
        running.log.lock().unwrap()
    );
    running
}

/// One request with an `api_key` descriptor over gRPC; its overall code.
async fn ask(running: &Running, api_key: &str) -> Code {
    let mut client = RateLimitServiceClient::connect(format!("http://{}", running.grpc))
        .await
        .unwrap();
    let answer = client
        .should_rate_limit(request("api", vec![descriptor(&[("api_key", api_key)])]))
        .await
        .unwrap_or_else(|status| {
            panic!(
                "no decision: {status:?}; log:\n{}",
                running.log.lock().unwrap()
            )
        })
        .into_inner();
    Code::try_from(answer.overall_code).unwrap()
}

/// The keys in Redis, sorted.
fn redis_keys(redis: &RedisProcess) -> Vec<String> {
    let mut keys: Vec<String> = redis
        .cli(&["--scan"])
        .lines()
        .map(str::to_owned)
        .filter(|k| !k.is_empty())
        .collect();
    keys.sort();
    keys
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_with_only_the_reference_variables_serves_hashes_api_keys_and_keeps_counting_across_a_restart(
) {
    let redis = RedisProcess::start(&[]);
    let runtime = tempfile::tempdir().unwrap();
    let config = runtime.path().join("ratelimit/config");
    fs::create_dir_all(&config).unwrap();
    fs::write(config.join("api.yaml"), RULES).unwrap();
    common::wait_for_room_in_the_hour_window();

    let first = start_serving(&mut reference_deployment(runtime.path(), &redis));
    for hit in 1..=3 {
        assert_eq!(ask(&first, RAW_KEY).await, Code::Ok, "hit {hit} of 3");
    }
    assert_eq!(ask(&first, RAW_KEY).await, Code::OverLimit, "hit 4 of 3");
    let keys = redis_keys(&redis);
    assert!(!keys.is_empty(), "the count is in Redis");
    assert!(
        keys.iter().all(|k| !k.contains(RAW_KEY)),
        "the raw API key is in a Redis key: {keys:?}"
    );
    let log = first.log.lock().unwrap().clone();
    assert!(
        !log.contains(RAW_KEY),
        "the raw API key is in the log:\n{log}"
    );
    assert_eq!(
        log.lines()
            .filter(|l| l.contains("RATELIMITD_HASH_SECRET"))
            .count(),
        1,
        "one warning names the setting that makes the hash keyed:\n{log}"
    );
    drop(first);

    let second = start_serving(&mut reference_deployment(runtime.path(), &redis));
    assert_eq!(
        ask(&second, RAW_KEY).await,
        Code::OverLimit,
        "after a restart the count continues"
    );
    assert_eq!(
        redis_keys(&redis),
        keys,
        "after a restart the same Redis keys are used"
    );
}

#[test]
fn unknown_variables_from_kubernetes_or_the_reference_are_ignored_with_a_warning() {
    let rules = tempfile::tempdir().unwrap();
    fs::write(rules.path().join("api.yaml"), RULES).unwrap();
    let unknown = [
        // Service links Kubernetes adds to every pod when a Service is named ratelimitd.
        ("RATELIMITD_PORT", "tcp://10.0.0.1:8081"),
        ("RATELIMITD_PORT_8081_TCP", "tcp://10.0.0.1:8081"),
        ("RATELIMITD_PORT_8081_TCP_ADDR", "10.0.0.1"),
        ("RATELIMITD_SERVICE_HOST", "10.0.0.1"),
        ("RATELIMITD_SERVICE_PORT", "8081"),
        // A reference-style variable ratelimitd does not know, as Envoy Gateway sets it.
        ("GRPC_SERVER_TLS_CA_CERT", "/certs/ca.crt"),
    ];
    let running = start_serving(common::binary(rules.path()).envs(unknown));
    let body = r#"{"domain":"api","descriptors":[{"entries":[{"key":"api_key","value":"k"}]}]}"#;
    assert_eq!(
        common::http_request(running.http, "POST", "/json", body).0,
        200,
        "it serves"
    );
    let log = running.log.lock().unwrap().clone();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("RATELIMITD_PORT"))
        .collect();
    assert_eq!(warnings.len(), 1, "one warning names them:\n{log}");
    assert!(
        warnings[0].contains("WARN") && warnings[0].contains("RATELIMITD_SERVICE_HOST"),
        "{log}"
    );
    assert!(
        !log.contains("GRPC_SERVER_TLS_CA_CERT"),
        "unknown reference-style variables are ignored silently, as the reference does:\n{log}"
    );

    // A known setting with a bad value still stops the start, naming it.
    let out = common::binary(rules.path())
        .envs(unknown)
        .env("RATELIMITD_MEMORY__MAX_KEYS", "lots")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{err}");
    assert!(err.contains("max_keys") && err.contains("lots"), "{err}");
}

/// The reference's switches a Deployment may carry: `QUOTA_MODE` decides as it does there; those that
/// change nothing here start (a warning where a Deployment would miss a listener); `GRPC_UDS`, which would
/// leave Envoy without an answer, stops the start naming it.
#[test]
fn the_reference_switches_a_deployment_carries_decide_start_or_stop_as_they_say() {
    let root = tempfile::tempdir().unwrap();
    let config = root.path().join("ratelimit/config");
    fs::create_dir_all(&config).unwrap();
    fs::write(
        config.join("edge.yaml"),
        "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit: {unit: hour, requests_per_unit: 2}\n",
    )
    .unwrap();
    let reference = [
        ("RUNTIME_ROOT", root.path().to_str().unwrap()),
        ("RUNTIME_SUBDIRECTORY", "ratelimit"),
        ("RUNTIME_WATCH_ROOT", "false"),
        ("USE_STATSD", "false"),
        ("QUOTA_MODE", "true"),
        ("TRACING_EXPORTER_PROTOCOL", "http"),
        ("REDIS_PIPELINE_WINDOW", "150us"),
        ("REDIS_PIPELINE_LIMIT", "8"),
        ("REDIS_POOL_ON_EMPTY_BEHAVIOR", "WAIT"),
        ("DEBUG_PORT", "6070"),
    ];
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ratelimitd"));
    cmd.env_clear().envs(reference).envs(common::LOOPBACK);
    let running = start_serving(&mut cmd);
    let json = |addresses: &[&str]| {
        let descriptors: Vec<String> = addresses
            .iter()
            .map(|a| format!(r#"{{"entries":[{{"key":"remote_address","value":"{a}"}}]}}"#))
            .collect();
        let body = format!(
            r#"{{"domain":"edge","descriptors":[{}]}}"#,
            descriptors.join(",")
        );
        common::http_request(running.http, "POST", "/json", &body).0
    };
    // a's two are spent, then its status is over; each request also carries a fresh address with quota
    // left, so none is denied.
    for fresh in ["b1", "b2", "b3", "b4"] {
        assert_eq!(json(&["10.0.0.1", fresh]), 200, "with {fresh}");
    }
    // Every quota descriptor over: denied.
    assert_eq!(json(&["10.0.0.1"]), 429);
    let log = running.log.lock().unwrap().clone();
    assert!(
        log.contains("DEBUG_PORT=6070 is not served"),
        "the missing debug listener is named:\n{log}"
    );

    let out = Command::new(env!("CARGO_BIN_EXE_ratelimitd"))
        .env_clear()
        .envs(reference)
        .envs(common::LOOPBACK)
        .env("GRPC_UDS", "/var/run/ratelimit/grpc.sock")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{err}");
    assert!(
        err.contains("GRPC_UDS") && err.contains("unix socket"),
        "{err}"
    );
}

/// The reference's RUNTIME_SUBDIRECTORY without its RUNTIME_ROOT: the rules are looked for under the
/// reference's default root, as there, and not in ./config, where the image keeps its example rules
/// (they would be served instead of the deployment's own, without a word). The folder it looked for is
/// named at start.
#[test]
fn a_reference_subdirectory_without_its_root_reads_the_reference_default_root() {
    if std::path::Path::new("/srv/runtime_data/current/ratelimit").exists() {
        eprintln!("skipped: this machine has rules at the reference's default root");
        return;
    }
    let cwd = tempfile::tempdir().unwrap();
    std::fs::create_dir(cwd.path().join("config")).unwrap();
    std::fs::write(
        cwd.path().join("config/example.yaml"),
        "domain: example\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1}\n",
    )
    .unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ratelimitd"));
    cmd.env_clear()
        .current_dir(cwd.path())
        .env("RUNTIME_SUBDIRECTORY", "ratelimit")
        .envs(common::LOOPBACK);
    let running = start_serving(&mut cmd);
    let log = running.log.lock().unwrap().clone();
    assert!(
        log.contains("the rules folder /srv/runtime_data/current/ratelimit does not exist")
            && log.contains("RUNTIME_SUBDIRECTORY is set and RUNTIME_ROOT is not"),
        "{log}"
    );
}

/// A REDIS_TYPE that does not fit the server is named, not served: a Cluster node taken for a single
/// server would fail nearly every request (MOVED, CROSSSLOT) while reporting ready, and a single server
/// taken for a Cluster wrote a line every tenth of a second without naming the setting.
#[test]
fn a_redis_type_that_does_not_fit_the_server_is_named() {
    let runtime = tempfile::tempdir().unwrap();
    let config = runtime.path().join("ratelimit/config");
    fs::create_dir_all(&config).unwrap();
    fs::write(config.join("api.yaml"), RULES).unwrap();

    let cluster = common::redis::RedisCluster::start(false);
    let node = &cluster.masters[0];
    let as_single = start_binary(&mut reference_deployment(runtime.path(), node));
    as_single.wait_log(
        "is a Cluster node: set REDIS_TYPE=cluster",
        Duration::from_secs(20),
    );
    assert!(
        !as_single.serving_within(Duration::from_secs(2)),
        "ready on a Cluster node taken for a single server"
    );
    drop(as_single);

    // A Cluster of one node holds every slot: as a single server it answers every call.
    let alone = RedisProcess::start(&[
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
    ]);
    assert_eq!(alone.cli(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"]), "OK");
    let one_node = start_binary(&mut reference_deployment(runtime.path(), &alone));
    assert!(
        one_node.serving_within(Duration::from_secs(20)),
        "a Cluster of one node refused as a single server; log:\n{}",
        one_node.log.lock().unwrap()
    );
    drop(one_node);

    let plain = RedisProcess::start(&[]);
    let as_cluster =
        start_binary(reference_deployment(runtime.path(), &plain).env("REDIS_TYPE", "cluster"));
    as_cluster.wait_log(
        "the server is not in a Cluster: set REDIS_TYPE to single or sentinel",
        Duration::from_secs(20),
    );
    std::thread::sleep(Duration::from_secs(2));
    let log = as_cluster.log.lock().unwrap().clone();
    let lines = log.matches("Redis client stopped").count();
    assert!(lines <= 2, "{lines} lines in about 2 s:\n{log}");
}
