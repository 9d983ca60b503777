//! The operators' API and `ratelimitd admin`, on the real binary: inspect after known traffic and reset
//! on the memory store and on Redis (on every replica, deny caches included), the precedence of a runtime
//! limit over a request's override over the rules, runtime limits set on one replica and enforced by the others
//! of one Redis within the refresh bound, gone after their expiry or delete and kept across a restart;
//! calls without the token refused and changing nothing; the audit log; TLS with client certificates;
//! and the settings that must stop the start.

mod common;

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    process::{Command, Output},
    time::{Duration, Instant},
};

use common::{
    binary, certs, http_request, output_within,
    redis::{AnswerDropper, RedisProcess},
    start_binary, wait_for, Running,
};
use serde_json::{json, Value};

const TOKEN: &str = "admin-token-for-tests-0123456789";

const RULES: &str = r#"
domain: api
descriptors:
  - key: api_key
    rate_limit: {unit: hour, requests_per_unit: 3, name: per_key}
  - key: tenant
    rate_limit: {unit: hour, requests_per_unit: 2, name: per_tenant}
"#;

/// A rules folder with [`RULES`], and a file holding the token.
struct Files {
    dir: tempfile::TempDir,
}

impl Files {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("rules")).unwrap();
        std::fs::write(dir.path().join("rules/api.yaml"), RULES).unwrap();
        std::fs::write(dir.path().join("token"), format!("{TOKEN}\n")).unwrap();
        Self { dir }
    }

    fn rules(&self) -> std::path::PathBuf {
        self.dir.path().join("rules")
    }

    fn token(&self) -> std::path::PathBuf {
        self.dir.path().join("token")
    }
}

/// The binary with the operators' API on a free loopback port, its token in a file.
fn with_admin(files: &Files) -> Command {
    let mut cmd = binary(&files.rules());
    cmd.env("RATELIMITD_ADMIN__ENABLED", "true")
        .env("RATELIMITD_ADMIN__PORT", "0")
        .env("RATELIMITD_ADMIN__TOKEN_FILE", files.token())
        .env("RATELIMITD_HASH_SECRET", "hash-secret-for-tests")
        .env("LOG_LEVEL", "info");
    cmd
}

fn on_redis(cmd: &mut Command, redis: &RedisProcess) {
    cmd.env("REDIS_URL", redis.addr());
}

/// A replica on `redis` with the operators' API, and where it serves that API.
fn admin_on_redis(files: &Files, redis: &RedisProcess) -> (Running, SocketAddr) {
    let mut cmd = with_admin(files);
    on_redis(&mut cmd, redis);
    let running = start_binary(&mut cmd);
    let admin = admin_addr(&running);
    (running, admin)
}

/// Where a running binary serves the operators' API, from its log.
fn admin_addr(running: &Running) -> SocketAddr {
    running.wait_log("Operators' API listening on '", Duration::from_secs(10));
    let log = running.log.lock().unwrap();
    let rest = log.split("Operators' API listening on '").nth(1).unwrap();
    rest.split('\'').next().unwrap().parse().unwrap()
}

/// One call of the API with raw HTTP/1.1: the status and the JSON answer. `token` None sends no
/// Authorization header.
fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &Value,
) -> (u16, Value) {
    let body = if body.is_null() {
        String::new()
    } else {
        body.to_string()
    };
    let auth = token.map_or_else(String::new, |t| format!("Authorization: Bearer {t}\r\n"));
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n{auth}X-Operator: tester\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream.write_all(request.as_bytes()).unwrap();
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let text = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, serde_json::from_str(text).unwrap_or(Value::Null))
}

fn descriptor(key: &str, value: &str) -> Value {
    json!([{ "key": key, "value": value }])
}

/// One request of the rate limit service over `/json`: 200 (OK) or 429 (OVER_LIMIT).
fn ask(running: &Running, key: &str, value: &str) -> u16 {
    let body = json!({ "domain": "api", "descriptors": [{ "entries": descriptor(key, value) }] });
    http_request(running.http, "POST", "/json", &body.to_string()).0
}

/// `ratelimitd admin` against `addr`, with the token file.
fn cli(files: &Files, url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ratelimitd"))
        .env_clear()
        .arg("admin")
        .args(["--url", url])
        .arg("--token-file")
        .arg(files.token())
        .args(["--as", "cli-operator"])
        .args(args)
        .output()
        .unwrap()
}

fn succeeded(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "ratelimitd admin failed: {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Inspect after known traffic, reset, refused calls, bad calls and the audit log, on one replica of the
/// memory store or of a Redis.
async fn inspect_shows_the_counts_and_reset_frees_the_key(redis: Option<&RedisProcess>) {
    let files = Files::new();
    let mut cmd = with_admin(&files);
    if let Some(redis) = redis {
        on_redis(&mut cmd, redis);
    }
    let running = start_binary(&mut cmd);
    assert!(running.serving_within(Duration::from_secs(10)));
    let admin = admin_addr(&running);
    let url = format!("http://{admin}");
    for _ in 0..2 {
        assert_eq!(ask(&running, "api_key", "raw-secret-key"), 200);
    }
    let target = json!({ "domain": "api", "descriptor": descriptor("api_key", "raw-secret-key") });
    let (status, seen) = call(admin, "POST", "/v1/inspect", Some(TOKEN), &target);
    assert_eq!(status, 200, "{seen}");
    let limit = &seen["limits"][0];
    assert_eq!(
        (
            &limit["name"],
            &limit["used"],
            &limit["remaining"],
            &limit["over_limit"]
        ),
        (&json!("per_key"), &json!(2.0), &json!(1), &json!(false)),
        "{seen}"
    );
    assert_eq!(limit["source"], "rules");
    let shown = seen["descriptor"][0]["value"].as_str().unwrap();
    assert!(shown.starts_with("hmac-"), "the key is hashed: {shown}");
    assert_eq!(ask(&running, "api_key", "raw-secret-key"), 200);
    assert_eq!(ask(&running, "api_key", "raw-secret-key"), 429);

    // Without the token, or with another, nothing is done.
    for token in [None, Some("admin-token-for-tests-0123456788")] {
        let (status, answer) = call(admin, "POST", "/v1/reset", token, &target);
        assert_eq!(status, 401, "{answer}");
        let set = json!({ "domain": "api", "descriptor": descriptor("tenant", "t"),
                          "limit": { "requests_per_unit": 1000, "unit": "hour" } });
        assert_eq!(call(admin, "PUT", "/v1/limits", token, &set).0, 401);
    }
    assert_eq!(
        ask(&running, "api_key", "raw-secret-key"),
        429,
        "still over"
    );
    let (_, listed) = call(admin, "GET", "/v1/limits", Some(TOKEN), &Value::Null);
    assert_eq!(listed["limits"], json!([]), "nothing was set");

    let out = cli(
        &files,
        &url,
        &["reset", "--domain", "api", "api_key=raw-secret-key"],
    );
    assert_eq!(
        succeeded(&out),
        json!({ "limits": 1, "counters_cleared": 1 })
    );
    assert_eq!(
        ask(&running, "api_key", "raw-secret-key"),
        200,
        "free again"
    );

    // Bad calls get clear answers.
    let (status, answer) = call(
        admin,
        "POST",
        "/v1/inspect",
        Some(TOKEN),
        &json!({ "domain": "nope", "descriptor": descriptor("a", "b") }),
    );
    assert_eq!(status, 404, "{answer}");
    let (status, answer) = call(
        admin,
        "POST",
        "/v1/inspect",
        Some(TOKEN),
        &json!({ "domain": "api" }),
    );
    assert_eq!(status, 400, "{answer}");
    let big = json!({ "domain": "api", "descriptor": descriptor("k", &"v".repeat(70_000)) });
    let (status, answer) = call(admin, "POST", "/v1/inspect", Some(TOKEN), &big);
    assert_eq!(status, 413, "{answer}");
    // Refused in JSON, as every refusal of the API is.
    assert!(
        answer["error"]
            .as_str()
            .is_some_and(|e| e.contains("length limit")),
        "{answer}"
    );
    let out = cli(
        &files,
        &url,
        &["inspect", "--domain", "api", "not-an-entry"],
    );
    assert_eq!(out.status.code(), Some(2), "a usage error");

    running.wait_log(
        "operators' API: reset by cli-operator from 127.0.0.1",
        Duration::from_secs(5),
    );
    let log = running.log.lock().unwrap().clone();
    assert!(log.contains("api [api_key=hmac-"), "{log}");
    assert!(
        !log.contains("raw-secret-key"),
        "a raw key in the log:\n{log}"
    );
    assert!(!log.contains(TOKEN), "the token in the log:\n{log}");
}

#[tokio::test]
async fn on_the_memory_store_inspect_shows_the_counts_and_reset_frees_the_key() {
    inspect_shows_the_counts_and_reset_frees_the_key(None).await;
}

#[tokio::test]
async fn on_redis_inspect_shows_the_counts_and_reset_frees_the_key() {
    let redis = RedisProcess::start(&[]);
    inspect_shows_the_counts_and_reset_frees_the_key(Some(&redis)).await;
}

/// An operator's read whose answer is lost with its connection (Redis restarting, a proxy closing the
/// connection) is sent again on a new one: the inspection answers, with the right count.
#[test]
fn an_inspection_whose_answer_is_lost_with_its_connection_is_read_again() {
    let redis = RedisProcess::start(&[]);
    let proxy = AnswerDropper::start(redis.addr());
    let files = Files::new();
    let mut cmd = with_admin(&files);
    cmd.env("REDIS_URL", proxy.addr());
    let running = start_binary(&mut cmd);
    assert!(running.serving_within(Duration::from_secs(10)));
    let admin = admin_addr(&running);
    for _ in 0..2 {
        assert_eq!(ask(&running, "api_key", "lost-answer"), 200);
    }
    let target = json!({ "domain": "api", "descriptor": descriptor("api_key", "lost-answer") });
    // An inspection reads the server's time first.
    proxy.arm("TIME");
    let (status, seen) = call(admin, "POST", "/v1/inspect", Some(TOKEN), &target);
    assert!(proxy.fired(), "the proxy dropped the answer to TIME");
    assert_eq!(status, 200, "{seen}");
    assert_eq!(seen["limits"][0]["used"], json!(2.0), "{seen}");
    // The requests' own path is unchanged: a decision still goes once.
    assert_eq!(ask(&running, "api_key", "lost-answer"), 200);
    assert_eq!(ask(&running, "api_key", "lost-answer"), 429);
}

/// Waits until `ask` on each replica answers `want`; returns how long it took.
async fn until_each(replicas: &[&Running], value: &str, want: u16, within: Duration) -> Duration {
    let started = Instant::now();
    for running in replicas {
        wait_for(&format!("{want} for tenant {value}"), within, async || {
            (ask(running, "tenant", value) == want).then_some(())
        })
        .await;
    }
    started.elapsed()
}

#[tokio::test]
async fn runtime_limits_set_on_one_replica_apply_on_all_of_one_redis() {
    let redis = RedisProcess::start(&[]);
    let files = Files::new();
    let mut cmd = with_admin(&files);
    on_redis(&mut cmd, &redis);
    let first = start_binary(&mut cmd);
    let mut cmd = binary(&files.rules());
    on_redis(&mut cmd, &redis);
    cmd.env("RATELIMITD_HASH_SECRET", "hash-secret-for-tests");
    let second = start_binary(&mut cmd);
    // The third remembers denials locally: a reset must reach its deny cache too.
    cmd.env("LOCAL_CACHE_SIZE_IN_BYTES", "1000000");
    let mut third = start_binary(&mut cmd);
    for r in [&first, &second, &third] {
        assert!(r.serving_within(Duration::from_secs(20)));
    }
    let url = format!("http://{}", admin_addr(&first));
    // The rules allow 2 an hour.
    for want in [200, 200, 429] {
        assert_eq!(ask(&second, "tenant", "acme"), want);
    }
    assert_eq!(ask(&third, "tenant", "acme"), 429);

    // 100 an hour for 8 s, set on the first: the others apply it within the refresh bound (500 ms).
    // The expiry leaves the listing and the inspection below ample time on a loaded machine.
    let set = cli(
        &files,
        &url,
        &[
            "limits",
            "set",
            "--domain",
            "api",
            "tenant=acme",
            "--requests-per-unit",
            "100",
            "--unit",
            "hour",
            "--expires-in",
            "8s",
            "--name",
            "raised",
        ],
    );
    let record = succeeded(&set);
    let took = until_each(&[&second, &third], "acme", 200, Duration::from_secs(3)).await;
    assert!(took < Duration::from_millis(1500), "applied after {took:?}");
    let listed = succeeded(&cli(&files, &url, &["limits", "list"]));
    assert_eq!(listed["limits"][0]["id"], record["id"]);
    assert_eq!(listed["limits"][0]["set_by"], "cli-operator");
    let inspected = succeeded(&cli(
        &files,
        &url,
        &["inspect", "--domain", "api", "tenant=acme"],
    ));
    assert_eq!(inspected["limits"][0]["source"], "runtime", "{inspected}");
    assert_eq!(
        inspected["limits"][1]["applies"], false,
        "the rule's is replaced"
    );
    // Its expiry ends it (listed no more), then everywhere: the shared counter is past the rule's 2.
    wait_for("the expiry", Duration::from_secs(12), async || {
        let listed = succeeded(&cli(&files, &url, &["limits", "list"]));
        (listed["limits"] == json!([])).then_some(())
    })
    .await;
    until_each(
        &[&first, &second, &third],
        "acme",
        429,
        Duration::from_secs(3),
    )
    .await;

    // Set again without an expiry: kept across a restart, then deleted by its descriptor.
    succeeded(&cli(
        &files,
        &url,
        &[
            "limits",
            "set",
            "--domain",
            "api",
            "tenant=acme",
            "--requests-per-unit",
            "1000",
            "--unit",
            "hour",
        ],
    ));
    until_each(&[&second, &third], "acme", 200, Duration::from_secs(3)).await;
    third.terminate(Duration::from_secs(10)).await;
    let third = start_binary(&mut cmd);
    assert!(third.serving_within(Duration::from_secs(20)));
    until_each(&[&third], "acme", 200, Duration::from_secs(3)).await;
    // A replica that starts now (reading the store once a minute from then on) applies it from its
    // first answer: it reads the runtime limits before it reports SERVING.
    let mut late = binary(&files.rules());
    on_redis(&mut late, &redis);
    late.env("RATELIMITD_HASH_SECRET", "hash-secret-for-tests")
        .env("RATELIMITD_RUNTIME_LIMITS__REFRESH_INTERVAL", "60s");
    let mut late = start_binary(&mut late);
    assert!(late.serving_within(Duration::from_secs(20)));
    assert_eq!(ask(&late, "tenant", "acme"), 200, "applied from the start");
    late.terminate(Duration::from_secs(10)).await;
    succeeded(&cli(
        &files,
        &url,
        &["limits", "delete", "--domain", "api", "tenant=acme"],
    ));
    let took = until_each(&[&second, &third], "acme", 429, Duration::from_secs(3)).await;
    assert!(took < Duration::from_millis(1500), "deleted after {took:?}");
    let gone = cli(
        &files,
        &url,
        &["limits", "delete", "--domain", "api", "tenant=acme"],
    );
    assert_eq!(gone.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&gone.stderr).contains("404"),
        "{gone:?}"
    );

    // The third remembers the denial (for the rest of the hour, answering it without asking Redis); a
    // reset reaches it all the same. Its first request asked of Redis again counts 1 of the 2 left.
    assert_eq!(ask(&third, "tenant", "acme"), 429);
    succeeded(&cli(
        &files,
        &url,
        &["reset", "--domain", "api", "tenant=acme"],
    ));
    let took = until_each(&[&third], "acme", 200, Duration::from_secs(3)).await;
    assert!(
        took < Duration::from_millis(1500),
        "reset seen after {took:?}"
    );
    assert_eq!(ask(&second, "tenant", "acme"), 200);
    assert_eq!(
        ask(&first, "tenant", "acme"),
        429,
        "2 of 2 counted since the reset"
    );
}

/// The ACL user SECURITY.md documents, with exactly its command list (read from SECURITY.md).
fn documented_acl_user(redis: &RedisProcess, password: &str) {
    let security =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/SECURITY.md")).unwrap();
    let block = security
        .split("```text\n")
        .find(|b| b.starts_with("ACL SETUSER ratelimitd"))
        .and_then(|b| b.split("```").next())
        .expect("SECURITY.md lists the ACL user");
    let pass = format!(">{password}");
    let args: Vec<&str> = block
        .split_whitespace()
        .map(|word| {
            if word.starts_with('>') {
                pass.as_str()
            } else {
                word
            }
        })
        .collect();
    assert_eq!(redis.cli(&args), "OK", "{block}");
}

/// With the Redis ACL user SECURITY.md documents, and only its commands, the API sets, lists, resets and
/// deletes, and another replica of the same Redis applies what it set.
#[tokio::test]
async fn the_documented_redis_acl_user_is_enough_for_the_api() {
    let redis = RedisProcess::start(&[]);
    documented_acl_user(&redis, "acl-pass-for-admin-tests");
    let files = Files::new();
    let mut cmd = with_admin(&files);
    on_redis(&mut cmd, &redis);
    cmd.env("REDIS_AUTH", "ratelimitd:acl-pass-for-admin-tests");
    let first = start_binary(&mut cmd);
    let mut cmd = binary(&files.rules());
    on_redis(&mut cmd, &redis);
    cmd.env("REDIS_AUTH", "ratelimitd:acl-pass-for-admin-tests")
        .env("RATELIMITD_HASH_SECRET", "hash-secret-for-tests");
    let second = start_binary(&mut cmd);
    for r in [&first, &second] {
        assert!(r.serving_within(Duration::from_secs(20)));
    }
    let admin = admin_addr(&first);
    // The rules allow 2 an hour.
    for want in [200, 200, 429] {
        assert_eq!(ask(&second, "tenant", "acl"), want);
    }
    let target = json!({ "domain": "api", "descriptor": descriptor("tenant", "acl") });
    let mut set = target.clone();
    set["limit"] = json!({ "requests_per_unit": 100, "unit": "hour" });
    let (status, answer) = call(admin, "PUT", "/v1/limits", Some(TOKEN), &set);
    assert_eq!(status, 200, "{answer}\n{}", first.log.lock().unwrap());
    // The runtime limit allows 100 an hour, on the other replica too, counted in the same counter.
    wait_for(
        "the runtime limit on the second replica",
        Duration::from_secs(10),
        async || (ask(&second, "tenant", "acl") == 200).then_some(()),
    )
    .await;
    let (status, listed) = call(admin, "GET", "/v1/limits", Some(TOKEN), &Value::Null);
    assert_eq!(
        (status, listed["limits"].as_array().map(Vec::len)),
        (200, Some(1)),
        "{listed}"
    );
    let (status, inspected) = call(admin, "POST", "/v1/inspect", Some(TOKEN), &target);
    assert_eq!(status, 200, "{inspected}");
    assert_eq!(inspected["limits"][0]["used"], 3.0, "{inspected}");
    let (status, reset) = call(admin, "POST", "/v1/reset", Some(TOKEN), &target);
    assert_eq!(status, 200, "{reset}");
    let (status, deleted) = call(admin, "DELETE", "/v1/limits", Some(TOKEN), &target);
    assert_eq!(status, 200, "{deleted}");
    // Back to the rule's 2 an hour on the other replica, counted from the reset.
    wait_for(
        "the rule again on the second replica",
        Duration::from_secs(10),
        async || (ask(&second, "tenant", "acl") == 429).then_some(()),
    )
    .await;
}

/// A Redis that loses its data (FLUSHALL here; a restart without persistence is the same) loses the
/// runtime limits with the counters, and the limits set after it apply on every replica within the refresh
/// bound, although the store's changes start again from nothing.
#[tokio::test]
async fn runtime_limits_set_after_redis_lost_its_data_apply_everywhere() {
    let redis = RedisProcess::start(&[]);
    let files = Files::new();
    let mut cmd = with_admin(&files);
    on_redis(&mut cmd, &redis);
    let first = start_binary(&mut cmd);
    let mut cmd = binary(&files.rules());
    on_redis(&mut cmd, &redis);
    cmd.env("RATELIMITD_HASH_SECRET", "hash-secret-for-tests");
    let second = start_binary(&mut cmd);
    for r in [&first, &second] {
        assert!(r.serving_within(Duration::from_secs(20)));
    }
    let admin = admin_addr(&first);
    let set = |tenant: &str| {
        let body = json!({
            "domain": "api",
            "descriptor": descriptor("tenant", tenant),
            "limit": { "requests_per_unit": 100, "unit": "hour" },
        });
        let (status, answer) = call(admin, "PUT", "/v1/limits", Some(TOKEN), &body);
        assert_eq!(status, 200, "{answer}");
    };
    // The rules allow 2 an hour; a runtime limit 100.
    for want in [200, 200, 429] {
        assert_eq!(ask(&second, "tenant", "before"), want);
    }
    set("before");
    wait_for(
        "the first limit on the second replica",
        Duration::from_secs(10),
        async || (ask(&second, "tenant", "before") == 200).then_some(()),
    )
    .await;
    for _ in 0..3 {
        assert_eq!(ask(&second, "tenant", "before"), 200);
    }

    assert_eq!(redis.cli(&["FLUSHALL"]), "OK");
    for want in [200, 200, 429] {
        assert_eq!(ask(&second, "tenant", "after"), want);
    }
    set("after");
    wait_for(
        "the limit set after the loss, on the second replica",
        Duration::from_secs(10),
        async || (ask(&second, "tenant", "after") == 200).then_some(()),
    )
    .await;
    // The limit lost with the data no longer applies: the rule's 2 an hour again.
    for want in [200, 200, 429] {
        assert_eq!(ask(&second, "tenant", "before"), want);
    }
    let (status, listed) = call(admin, "GET", "/v1/limits", Some(TOKEN), &Value::Null);
    assert_eq!(status, 200);
    let tenants: Vec<&Value> = listed["limits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| &l["descriptor"][0]["value"])
        .collect();
    assert_eq!(tenants, [&json!("after")], "{listed}");
}

/// A runtime limit set on a value the rules did not hash, after a rules reload that hashes it
/// (`hash_value: true`): requests never write the raw value into a Redis key; the limit is ignored,
/// with a warning, and the rule counts the hashed value.
#[tokio::test]
async fn a_runtime_limit_on_a_value_the_rules_hash_since_is_ignored() {
    let redis = RedisProcess::start(&[]);
    let files = Files::new();
    let (running, admin) = admin_on_redis(&files, &redis);
    let body = json!({
        "domain": "api",
        "descriptor": descriptor("tenant", "raw-tenant-secret"),
        "limit": { "requests_per_unit": 100, "unit": "hour" },
    });
    let (status, answer) = call(admin, "PUT", "/v1/limits", Some(TOKEN), &body);
    assert_eq!(status, 200, "{answer}");

    let hashed = RULES.replace(
        "  - key: tenant\n",
        "  - key: tenant\n    hash_value: true\n",
    );
    assert_ne!(hashed, RULES);
    let new = files.dir.path().join("api.yaml.new");
    std::fs::write(&new, hashed).unwrap();
    std::fs::rename(&new, files.rules().join("api.yaml")).unwrap();
    running.wait_log("rules reloaded", Duration::from_secs(10));

    // The rule's 2 an hour, not the runtime limit's 100.
    for want in [200, 200, 429] {
        assert_eq!(ask(&running, "tenant", "raw-tenant-secret"), want);
    }
    let keys = redis.cli(&["--scan"]);
    let counters: Vec<&str> = keys
        .lines()
        .filter(|k| !k.contains("{ratelimitd}"))
        .collect();
    assert!(!counters.is_empty(), "{keys}");
    assert!(
        counters.iter().all(|k| !k.contains("raw-tenant-secret")),
        "a raw value in a Redis key: {counters:?}"
    );
    running.wait_log(
        "ignored: rule 'api.tenant' now hashes",
        Duration::from_secs(5),
    );
    let (status, inspected) = call(
        admin,
        "POST",
        "/v1/inspect",
        Some(TOKEN),
        &json!({
            "domain": "api", "descriptor": descriptor("tenant", "raw-tenant-secret"),
        }),
    );
    assert_eq!(status, 200, "{inspected}");
    assert_eq!(inspected["limits"][0]["source"], "rules", "{inspected}");
    assert_eq!(inspected["limits"][0]["used"], 2.0, "{inspected}");
}

/// The audit log records refused calls at WARN: a wrong or missing token (at most a line a second), a
/// malformed body, a change without a target; text a caller chose is escaped, so a domain holding a
/// newline cannot write a line of its own; a raw value quoted by a malformed body stays out of it.
#[tokio::test]
async fn the_audit_log_records_refusals_and_cannot_be_forged() {
    let files = Files::new();
    let running = start_binary(&mut with_admin(&files));
    let admin = admin_addr(&running);
    let audit_lines = || -> Vec<String> {
        running
            .log
            .lock()
            .unwrap()
            .lines()
            .filter(|l| l.contains("ratelimitd::audit"))
            .map(str::to_owned)
            .collect()
    };
    let target = json!({ "domain": "api", "descriptor": descriptor("tenant", "t") });
    assert_eq!(
        call(
            admin,
            "POST",
            "/v1/reset",
            Some("wrong-token-of-the-right-length!"),
            &target
        )
        .0,
        401
    );
    assert_eq!(call(admin, "POST", "/v1/reset", None, &target).0, 401);
    running.wait_log("refused: no valid bearer token", Duration::from_secs(5));
    // The scheme is case-insensitive (RFC 7235).
    let mut stream = TcpStream::connect(admin).unwrap();
    write!(
        stream,
        "GET /v1/limits HTTP/1.1\r\nHost: test\r\nConnection: close\r\nAuthorization: bearer {TOKEN}\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    let malformed = json!({ "domain": "api", "descriptor": [{ "key": "api_key", "value": 7 }], "raw": "raw-secret-in-a-bad-body" });
    assert_eq!(
        call(admin, "PUT", "/v1/limits", Some(TOKEN), &malformed).0,
        400
    );
    assert_eq!(
        call(
            admin,
            "POST",
            "/v1/reset",
            Some(TOKEN),
            &json!({ "domain": "api", "descriptor": [] })
        )
        .0,
        400
    );
    let forged = json!({
        "domain": "api\nFORGED WARN ratelimitd::audit: operators' API: limit set by admin",
        "descriptor": descriptor("tenant", "t"),
        "limit": { "requests_per_unit": 1, "unit": "hour\nFORGED too" },
    });
    assert_eq!(
        call(admin, "PUT", "/v1/limits", Some(TOKEN), &forged).0,
        404
    );
    running.wait_log("limit set by tester from 127.0.0.1", Duration::from_secs(5));
    running.wait_log("reset by tester from 127.0.0.1", Duration::from_secs(5));
    wait_for(
        "the forged call audited",
        Duration::from_secs(5),
        async || {
            (audit_lines()
                .iter()
                .filter(|l| l.contains("limit set by tester"))
                .count()
                >= 2)
                .then_some(())
        },
    )
    .await;

    let lines = audit_lines();
    let log = running.log.lock().unwrap().clone();
    assert!(lines.iter().all(|l| l.contains("WARN")), "{lines:#?}");
    assert!(
        lines.iter().any(|l| l.contains("no valid bearer token")),
        "{lines:#?}"
    );
    assert!(
        lines.iter().any(|l| l.contains("a malformed body")),
        "{lines:#?}"
    );
    assert!(
        lines.iter().any(|l| l.contains("a call without a target")),
        "{lines:#?}"
    );
    assert!(
        log.lines().all(|l| !l.starts_with("FORGED")),
        "a call wrote a line of its own:\n{log}"
    );
    assert!(!log.contains("raw-secret-in-a-bad-body"), "{log}");
    assert!(!log.contains(TOKEN), "{log}");
}

/// A DELETE of an id no record has answers 404 and changes nothing: the generation stays, so no replica
/// reads the records again nor forgets its denials and leases (a token holder repeating it would
/// otherwise keep the whole fleet flushing).
#[tokio::test]
async fn a_delete_of_nothing_moves_no_generation() {
    let files = Files::new();
    let redis = RedisProcess::start(&[]);
    let (_running, admin) = admin_on_redis(&files, &redis);
    let body = json!({
        "domain": "api",
        "descriptor": descriptor("tenant", "t"),
        "limit": { "requests_per_unit": 5, "unit": "hour" },
    });
    let (status, set) = call(admin, "PUT", "/v1/limits", Some(TOKEN), &body);
    assert_eq!(status, 200, "{set}");
    let generation = || redis.cli(&["GET", "{ratelimitd}:operator_changes"]);
    let before = generation();
    let (status, answer) = call(
        admin,
        "DELETE",
        "/v1/limits",
        Some(TOKEN),
        &json!({ "id": "0123456789abcdef" }),
    );
    assert_eq!(status, 404, "{answer}");
    assert_eq!(generation(), before, "nothing deleted, nothing announced");
    let (status, answer) = call(
        admin,
        "DELETE",
        "/v1/limits",
        Some(TOKEN),
        &json!({ "id": set["id"] }),
    );
    assert_eq!(status, 200, "{answer}");
    assert_ne!(generation(), before, "a delete that deleted moves it");
}

/// Expired runtime limits are deleted when a replica lists them, but a limit set again meanwhile under
/// the same id (its descriptor's), on another replica, stays: the store deletes a record only if it has
/// expired as stored, not as the listing replica last read it.
#[tokio::test]
async fn a_limit_set_again_is_not_purged_as_the_expired_one_it_replaced() {
    let files = Files::new();
    let redis = RedisProcess::start(&[]);
    let (_running, admin) = admin_on_redis(&files, &redis);
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let record = |expires_at_ms: u64, set_by: &str| {
        json!({
            "id": "00000000000000bb",
            "domain": "api",
            "descriptor": [["tenant", "again"]],
            "limit": { "requests_per_unit": 1, "unit": "hour" },
            "expires_at_ms": expires_at_ms,
            "set_at_ms": now_ms,
            "set_by": set_by,
        })
        .to_string()
    };
    let hash = "{ratelimitd}:runtime_limits";
    redis.cli(&[
        "HSET",
        hash,
        "00000000000000bb",
        &record(now_ms + 4_000, "first"),
    ]);
    redis.cli(&["INCR", "{ratelimitd}:operator_changes"]);
    wait_for("the record read", Duration::from_secs(10), async || {
        let (_, listed) = call(admin, "GET", "/v1/limits", Some(TOKEN), &Value::Null);
        (listed["limits"].as_array().map_or(0, Vec::len) == 1).then_some(())
    })
    .await;
    // Set again by another replica, whose change this one has not read yet.
    let again = record(now_ms + 3_600_000, "second");
    redis.cli(&["HSET", hash, "00000000000000bb", &again]);
    tokio::time::sleep(Duration::from_millis(4_100)).await;
    // This replica still holds the first, expired: its listing purges what it holds as expired.
    let (status, _) = call(admin, "GET", "/v1/limits", Some(TOKEN), &Value::Null);
    assert_eq!(status, 200);
    assert_eq!(redis.cli(&["HGET", hash, "00000000000000bb"]), again);
}

/// An expiry written with an offset from UTC (as `date --rfc-3339` and most programs write local times)
/// ends at that instant, and one without an offset is refused rather than taken as UTC.
#[tokio::test]
async fn an_expiry_with_an_offset_ends_at_that_instant() {
    let files = Files::new();
    let running = start_binary(&mut with_admin(&files));
    let admin = admin_addr(&running);
    // Two years ahead, whatever year the test runs in.
    let year: u32 = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
        [..4]
        .parse()
        .unwrap();
    let set = |at: String| {
        let body = json!({
            "domain": "api",
            "descriptor": descriptor("tenant", "paris"),
            "limit": { "requests_per_unit": 5, "unit": "hour" },
            "expires_at": at,
        });
        call(admin, "PUT", "/v1/limits", Some(TOKEN), &body)
    };
    let (status, answer) = set(format!("{}-06-01T12:00:00.250+02:00", year + 2));
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        answer["expires_at"],
        format!("{}-06-01T10:00:00Z", year + 2),
        "{answer}"
    );
    let (status, answer) = set(format!("{}-06-01T12:00:00", year + 2));
    assert_eq!(status, 400, "{answer}");
    let error = answer["error"].as_str().unwrap_or_default();
    assert!(error.contains("no offset"), "{error}");
}

/// Expiries the API cannot keep (past 10 years, past what a time or a `u64` of ms holds) are refused
/// with a 400 and set nothing; a record already stored with one (as earlier versions wrote) is still
/// listed and deleted, and the listener keeps answering.
#[tokio::test]
async fn expiries_out_of_bounds_are_refused_and_never_break_the_listing() {
    let files = Files::new();
    let redis = RedisProcess::start(&[]);
    let (_running, admin) = admin_on_redis(&files, &redis);
    let set = |expiry: Value| {
        let mut body = json!({
            "domain": "api",
            "descriptor": descriptor("tenant", "far"),
            "limit": { "requests_per_unit": 5, "unit": "hour" },
        });
        body.as_object_mut()
            .unwrap()
            .extend(expiry.as_object().unwrap().clone());
        call(admin, "PUT", "/v1/limits", Some(TOKEN), &body)
    };
    for expiry in [
        json!({ "expires_in": "10000years" }),
        json!({ "expires_in": "292277000000y" }),
        json!({ "expires_in": "18446744073709551615s" }),
        json!({ "expires_at": "9999-12-31T23:59:59Z" }),
        json!({ "expires_in": "11y" }),
    ] {
        let (status, answer) = set(expiry.clone());
        assert_eq!(status, 400, "{expiry}: {answer}");
        let error = answer["error"].as_str().unwrap_or_default();
        assert!(
            error.contains("10 years") || error.contains("expires_in"),
            "{expiry}: {error}"
        );
        let (status, listed) = call(admin, "GET", "/v1/limits", Some(TOKEN), &Value::Null);
        assert_eq!((status, &listed["limits"]), (200, &json!([])), "{expiry}");
    }
    // The most the README allows, as `expires_in` counts years (365.25 days).
    let (status, answer) = set(json!({ "expires_in": "10y" }));
    assert_eq!(status, 200, "{answer}");
    assert!(
        answer["expires_at"].as_str().unwrap().ends_with('Z'),
        "{answer}"
    );

    // A record stored before expiries were bounded, ending past year 9999.
    let record = json!({
        "id": "00000000000000aa",
        "domain": "api",
        "descriptor": [["tenant", "old"]],
        "limit": { "requests_per_unit": 1, "unit": "hour" },
        "expires_at_ms": u64::MAX,
        "set_at_ms": 1_700_000_000_000u64,
        "set_by": "earlier",
    });
    redis.cli(&[
        "HSET",
        "{ratelimitd}:runtime_limits",
        "00000000000000aa",
        &record.to_string(),
    ]);
    redis.cli(&["INCR", "{ratelimitd}:operator_changes"]);
    let listed = wait_for(
        "the stored record listed",
        Duration::from_secs(10),
        async || {
            let (status, listed) = call(admin, "GET", "/v1/limits", Some(TOKEN), &Value::Null);
            assert_eq!(status, 200, "{listed}");
            (listed["limits"].as_array().map_or(0, Vec::len) == 2).then_some(listed)
        },
    )
    .await;
    let old = listed["limits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["id"] == "00000000000000aa")
        .unwrap();
    assert_eq!(
        old["expires_at"],
        format!("{} ms after 1970-01-01T00:00:00Z", u64::MAX)
    );
    let (status, deleted) = call(
        admin,
        "DELETE",
        "/v1/limits",
        Some(TOKEN),
        &json!({ "id": "00000000000000aa" }),
    );
    assert_eq!(status, 200, "{deleted}");
    let (status, _) = call(admin, "GET", "/v1/limits", Some(TOKEN), &Value::Null);
    assert_eq!(status, 200);
}

#[tokio::test]
async fn over_tls_the_api_asks_for_a_client_certificate() {
    let files = Files::new();
    let dir = files.dir.path();
    let ca = certs::Ca::new("admin test CA");
    let server = ca.leaf(&["localhost"], false);
    let client = ca.leaf(&["operator"], true);
    let ca_file = certs::write(dir, "ca.pem", &ca.pem());
    let mut cmd = with_admin(&files);
    cmd.env("RATELIMITD_ADMIN__TLS__ENABLED", "true")
        .env(
            "RATELIMITD_ADMIN__TLS__CERT",
            certs::write(dir, "server.pem", &server.cert),
        )
        .env(
            "RATELIMITD_ADMIN__TLS__KEY",
            certs::write(dir, "server.key", &server.key),
        )
        .env("RATELIMITD_ADMIN__TLS__CLIENT_CA", &ca_file);
    let running = start_binary(&mut cmd);
    assert!(running.serving_within(Duration::from_secs(10)));
    let admin = admin_addr(&running);
    let url = format!("https://localhost:{}", admin.port());
    let ca_arg = ca_file.to_str().unwrap();
    let list = ["--ca-cert", ca_arg, "limits", "list"];

    let without = cli(&files, &url, &list);
    assert_eq!(without.status.code(), Some(69), "{without:?}");
    assert_eq!(
        call(admin, "GET", "/v1/limits", Some(TOKEN), &Value::Null).0,
        0,
        "no plaintext"
    );

    let cert = certs::write(dir, "client.pem", &client.cert);
    let key = certs::write(dir, "client.key", &client.key);
    let with = |args: &[&str]| {
        let mut all = vec![
            "--client-cert",
            cert.to_str().unwrap(),
            "--client-key",
            key.to_str().unwrap(),
        ];
        all.extend_from_slice(args);
        cli(&files, &url, &all)
    };
    assert_eq!(succeeded(&with(&list))["limits"], json!([]));
    succeeded(&with(&[
        "--ca-cert",
        ca_arg,
        "reset",
        "--domain",
        "api",
        "tenant=t",
    ]));
    running.wait_log(
        "operators' API: reset by cli-operator",
        Duration::from_secs(5),
    );
    let log = running.log.lock().unwrap().clone();
    let audit = log
        .lines()
        .find(|l| l.contains("operators' API: reset"))
        .unwrap();
    assert!(
        !audit.contains("certificate=none") && audit.contains("certificate="),
        "{audit}"
    );
}

fn refuses_to_start(files: &Files, env: &[(&str, &str)], says: &str) {
    let mut cmd = binary(&files.rules());
    cmd.env("RATELIMITD_ADMIN__ENABLED", "true")
        .envs(env.iter().copied());
    let out = output_within(&mut cmd, Duration::from_secs(20));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{err}");
    assert!(err.contains(says), "{err}");
}

#[test]
fn the_api_needs_a_usable_token_and_stays_off_unless_enabled() {
    let files = Files::new();
    refuses_to_start(&files, &[], "admin.token");
    refuses_to_start(
        &files,
        &[("RATELIMITD_ADMIN__TOKEN", "short")],
        "at least 16 bytes",
    );
    let missing = files.dir.path().join("missing");
    refuses_to_start(
        &files,
        &[("RATELIMITD_ADMIN__TOKEN_FILE", missing.to_str().unwrap())],
        "admin.token_file=",
    );
    refuses_to_start(
        &files,
        &[
            ("RATELIMITD_ADMIN__TOKEN", TOKEN),
            ("RATELIMITD_ADMIN__TLS__ENABLED", "true"),
        ],
        "admin.tls.cert",
    );
    refuses_to_start(
        &files,
        &[
            ("RATELIMITD_ADMIN__TOKEN", TOKEN),
            (
                "RATELIMITD_ADMIN__TOKEN_FILE",
                files.token().to_str().unwrap(),
            ),
        ],
        "admin.token and admin.token_file: both are set",
    );
    // Off by default: no listener, and the CLI says it cannot reach one.
    let running = start_binary(&mut binary(&files.rules()));
    assert!(running.serving_within(Duration::from_secs(10)));
    assert!(!running.log.lock().unwrap().contains("Operators' API"));
    let out = cli(&files, "http://127.0.0.1:1", &["limits", "list"]);
    assert_eq!(out.status.code(), Some(69), "{out:?}");
    // No usable token: the settings are unusable (64, as the README says), naming what to fix.
    let out = Command::new(env!("CARGO_BIN_EXE_ratelimitd"))
        .env_clear()
        .args(["admin", "--url", "http://127.0.0.1:1", "--token-file"])
        .arg(&missing)
        .args(["limits", "list"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{err}");
    assert!(err.contains("token"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_ratelimitd"))
        .env_clear()
        .args(["admin", "--url", "http://127.0.0.1:1", "limits", "list"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64), "{out:?}");
    // A token the API would refuse, and flags that cannot be used, are the same: 64, never sent.
    let short = files.dir.path().join("short");
    std::fs::write(&short, "short\n").unwrap();
    let admin = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_ratelimitd"))
            .env_clear()
            .arg("admin")
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let short = short.to_str().unwrap();
    let token = files.token();
    let token = token.to_str().unwrap();
    let missing = missing.to_str().unwrap();
    let down = "http://127.0.0.1:1";
    for (flags, says) in [
        (
            &["--url", down, "--token-file", short][..],
            "at least 16 bytes",
        ),
        (
            &[
                "--url",
                "https://127.0.0.1:1",
                "--token-file",
                token,
                "--ca-cert",
                missing,
            ],
            "--ca-cert",
        ),
        (&["--url", "notaurl", "--token-file", token], "--url"),
        // An operator name no header can carry.
        (
            &["--url", down, "--token-file", token, "--as", "two\nlines"],
            "",
        ),
    ] {
        let (code, err) = admin(&[flags, &["limits", "list"]].concat());
        assert_eq!(code, Some(64), "{flags:?}: {err}");
        assert!(err.contains(says), "{flags:?}: {err}");
    }
    // The settings a server runs with (its API on, its token given to it elsewhere) with the flag's
    // token: the flag stands in, and the call goes out (here to no one: 69).
    let settings = files.dir.path().join("settings.yaml");
    std::fs::write(&settings, "admin:\n  enabled: true\n").unwrap();
    let settings = settings.to_str().unwrap();
    let (code, err) = admin(&[
        "--config",
        settings,
        "--url",
        down,
        "--token-file",
        token,
        "limits",
        "list",
    ]);
    assert_eq!(code, Some(69), "{err}");
}

/// The limit a `/json` request was counted against (`current_limit`): requests per unit and name.
fn counted_against(running: &Running, value: &str, limit: Option<u32>) -> (u64, String) {
    let mut descriptor = json!({ "entries": descriptor("tenant", value) });
    if let Some(rpu) = limit {
        descriptor["limit"] = json!({ "requests_per_unit": rpu, "unit": "DAY" });
    }
    let body = json!({ "domain": "api", "descriptors": [descriptor] });
    let (_, text) = http_request(running.http, "POST", "/json", &body.to_string());
    let answer: Value = serde_json::from_str(&text).unwrap();
    let current = &answer["statuses"][0]["currentLimit"];
    (
        current["requestsPerUnit"].as_u64().unwrap_or(0),
        current["name"].as_str().unwrap_or_default().to_owned(),
    )
}

/// Precedence, as a user sees it in `current_limit`: a runtime limit wins over the request's own
/// override, which wins over the rules; deleting the runtime limit gives the override back.
#[tokio::test]
async fn a_runtime_limit_wins_over_the_override_which_wins_over_the_rules() {
    let files = Files::new();
    let running = start_binary(&mut with_admin(&files));
    assert!(running.serving_within(Duration::from_secs(10)));
    let url = format!("http://{}", admin_addr(&running));
    assert_eq!(
        counted_against(&running, "t", None),
        (2, "per_tenant".into())
    );
    assert_eq!(
        counted_against(&running, "t", Some(50)),
        (50, String::new())
    );
    succeeded(&cli(
        &files,
        &url,
        &[
            "limits",
            "set",
            "--domain",
            "api",
            "tenant=t",
            "--requests-per-unit",
            "700",
            "--unit",
            "day",
            "--name",
            "operator_set",
        ],
    ));
    // The replica that served the call applies it at once.
    for limit in [None, Some(50)] {
        assert_eq!(
            counted_against(&running, "t", limit),
            (700, "operator_set".into()),
            "override {limit:?}"
        );
    }
    // Another tenant is not concerned.
    assert_eq!(
        counted_against(&running, "u", None),
        (2, "per_tenant".into())
    );
    succeeded(&cli(
        &files,
        &url,
        &["limits", "delete", "--domain", "api", "tenant=t"],
    ));
    assert_eq!(
        counted_against(&running, "t", Some(50)),
        (50, String::new())
    );
    assert_eq!(
        counted_against(&running, "t", None),
        (2, "per_tenant".into())
    );
    // Each in its own series: the operators' limits apart from the callers' overrides.
    let (_, metrics) = http_request(running.http, "GET", "/metrics", "");
    for (rule, hits) in [("tenant", 3), ("override", 2), ("runtime", 2)] {
        let series = format!(
            "ratelimit_service_rate_limit_total_hits{{domain=\"api\",rule=\"{rule}\"}} {hits}\n"
        );
        assert!(metrics.contains(&series), "{series} in\n{metrics}");
    }
}

/// A replica whose operators' API cannot start after its settings were read (its token file went away
/// meanwhile) stops with the reason, rather than serve gRPC without that API and never exit.
#[tokio::test]
async fn an_operators_api_that_cannot_start_stops_the_replica() {
    let s = common::TestServer::start_with_clock(
        &[("api.yaml", RULES)],
        ratelimitd::clock::Clock::System,
        |s| {
            s.admin.enabled = true;
            s.admin.token_file = Some("/nonexistent/ratelimitd-admin-token".into());
        },
    )
    .await;
    let ended = tokio::time::timeout(Duration::from_secs(10), s.handle)
        .await
        .expect("the replica stopped")
        .unwrap();
    let err = ended.expect_err("stopped with an error").to_string();
    assert!(
        err.contains("admin.token_file=/nonexistent/ratelimitd-admin-token"),
        "{err}"
    );
}

/// One keep-alive connection to the operators' API outlives `grpc.handshake_timeout`, which bounds an
/// HTTP/2 connection's TLS handshake and preface: HTTP/1.1 sends no preface, and every admin connection
/// was cut that long after its accept, however busy.
#[test]
fn a_keep_alive_connection_to_the_api_outlives_the_handshake_bound() {
    let files = Files::new();
    let mut cmd = with_admin(&files);
    cmd.env("RATELIMITD_GRPC__HANDSHAKE_TIMEOUT", "1s");
    let running = start_binary(&mut cmd);
    let addr = admin_addr(&running);
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let request = format!(
        "GET /v1/limits HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {TOKEN}\r\nX-Operator: tester\r\n\r\n"
    );
    for n in 0..3 {
        if n > 0 {
            std::thread::sleep(Duration::from_millis(800));
        }
        stream.write_all(request.as_bytes()).unwrap();
        // The head, then the body its Content-Length gives.
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            let read = stream.read(&mut byte).unwrap();
            assert_eq!(
                read,
                1,
                "closed before answer {n}: {}",
                String::from_utf8_lossy(&head)
            );
            head.push(byte[0]);
        }
        let head = String::from_utf8(head).unwrap();
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        let length: usize = head
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length: ")
                    .map(str::to_owned)
            })
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let mut body = vec![0u8; length];
        stream.read_exact(&mut body).unwrap();
    }
}

/// What a caller without the token can learn, and what an entry of a limit must hold: a path that is
/// not the API's is refused for the token like the API's own (401, counted), and a limit on an entry
/// without a key is refused as a rule without one is.
#[test]
fn unknown_paths_need_the_token_and_entries_need_a_key() {
    let files = Files::new();
    let running = start_binary(&mut with_admin(&files));
    let admin = admin_addr(&running);
    let (status, answer) = call(admin, "GET", "/v1/nothing", None, &Value::Null);
    assert_eq!(status, 401, "{answer}");
    let (status, answer) = call(admin, "GET", "/v1/nothing", Some(TOKEN), &Value::Null);
    assert_eq!(status, 404, "{answer}");
    let (_, metrics) = http_request(running.http, "GET", "/metrics", "");
    assert!(
        metrics.contains("ratelimitd_admin_refused_total 1"),
        "{metrics}"
    );
    let (status, answer) = call(
        admin,
        "PUT",
        "/v1/limits",
        Some(TOKEN),
        &json!({
            "domain": "api",
            "descriptor": [{ "key": "", "value": "" }],
            "limit": { "requests_per_unit": 5, "unit": "hour" },
        }),
    );
    assert_eq!(status, 400, "{answer}");
    assert!(
        answer["error"].as_str().unwrap().contains("empty key"),
        "{answer}"
    );
}

/// A token is text as written: a settings file's unquoted number (which its YAML parser would keep
/// only 17 digits of) stops the start asking for quotes; an empty token file setting beside a token
/// is no second token.
#[test]
fn a_token_is_kept_as_written_or_refused() {
    let files = Files::new();
    for (file, text, key, digits) in [
        (
            "settings.yaml",
            "admin:\n  enabled: true\n  token: 98765432109876543210\n",
            "admin.token",
            "98765",
        ),
        (
            "redis.yaml",
            "redis:\n  auth: 31415926535\n",
            "redis.auth",
            "31415",
        ),
        (
            "secret.toml",
            "hash_secret = 27182818284\n",
            "hash_secret",
            "27182",
        ),
    ] {
        let settings = files.dir.path().join(file);
        std::fs::write(&settings, text).unwrap();
        let out = output_within(
            binary(&files.rules()).arg("--config").arg(&settings),
            Duration::from_secs(20),
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{file}: {err}");
        assert!(err.contains(key) && err.contains("quotes"), "{file}: {err}");
        // Refused without being quoted: a secret written wrong stays out of the log too.
        assert!(!err.contains(digits), "{file}: {err}");
    }

    let mut cmd = binary(&files.rules());
    cmd.env("RATELIMITD_ADMIN__ENABLED", "true")
        .env("RATELIMITD_ADMIN__PORT", "0")
        .env("RATELIMITD_ADMIN__TOKEN", TOKEN)
        .env("RATELIMITD_ADMIN__TOKEN_FILE", "");
    let running = start_binary(&mut cmd);
    let admin = admin_addr(&running);
    let (status, answer) = call(admin, "GET", "/v1/limits", Some(TOKEN), &Value::Null);
    assert_eq!(status, 200, "{answer}");
}

/// `/json` for one entry of `domain`: 200 (OK) or 429 (OVER_LIMIT).
fn ask_in(running: &Running, domain: &str, key: &str, value: &str) -> u16 {
    let body = json!({ "domain": domain, "descriptors": [{ "entries": descriptor(key, value) }] });
    http_request(running.http, "POST", "/json", &body.to_string()).0
}

/// On Redis, a fixed window's key does not carry its length (the reference's layout): a runtime limit
/// of two seconds over a rule of one second counted in the rule's counter whenever both windows began
/// together, and lost its count when the rule's second ended (5 admitted of 3). A runtime limit whose
/// window no limit of the rule has counts in a counter of its own.
#[tokio::test]
async fn a_runtime_limit_of_another_window_counts_apart_from_the_rule() {
    let files = Files::new();
    std::fs::write(
        files.rules().join("burst.yaml"),
        "domain: burst\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, requests_per_unit: 100}\n",
    )
    .unwrap();
    let redis = RedisProcess::start(&[]);
    let (running, admin) = admin_on_redis(&files, &redis);
    assert!(running.serving_within(Duration::from_secs(10)));
    // Just after an even second: a window of two seconds and one of one second begin together. A try
    // whose calls do not all fit in that window (a slow machine) is made again, on another user.
    let epoch_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis()
    };
    for user in ["u1", "u2", "u3"] {
        while epoch_ms() % 2000 > 50 {
            std::thread::sleep(Duration::from_millis(5));
        }
        let window_end = Instant::now() + Duration::from_millis(1900 - (epoch_ms() % 2000) as u64);
        assert_eq!(ask_in(&running, "burst", "user", user), 200);
        let (status, answer) = call(
            admin,
            "PUT",
            "/v1/limits",
            Some(TOKEN),
            &json!({
                "domain": "burst",
                "descriptor": descriptor("user", user),
                "limit": { "requests_per_unit": 3, "unit": "second", "unit_multiplier": 2 },
            }),
        );
        assert_eq!(status, 200, "{answer}");
        let answers: Vec<u16> = (0..4)
            .map(|_| ask_in(&running, "burst", "user", user))
            .collect();
        if Instant::now() < window_end {
            assert_eq!(answers, [200, 200, 200, 429], "3 of the runtime limit's 3");
            return;
        }
    }
    panic!("no try fitted in one window of two seconds");
}

/// A reset clears what the descriptor is counted against: with a runtime limit on one value of a rule
/// whose values share one counter (`share_threshold`), not that shared counter, which every other value
/// still counts against.
#[test]
fn a_reset_leaves_the_counters_a_runtime_limit_stands_in_for() {
    let files = Files::new();
    std::fs::write(
        files.rules().join("files.yaml"),
        "domain: files\ndescriptors:\n  - key: path\n    value: f/*\n    share_threshold: true\n    rate_limit: {unit: hour, requests_per_unit: 2}\n",
    )
    .unwrap();
    let running = start_binary(&mut with_admin(&files));
    let admin = admin_addr(&running);
    assert!(running.serving_within(Duration::from_secs(10)));
    for value in ["f/b", "f/c"] {
        assert_eq!(ask_in(&running, "files", "path", value), 200);
    }
    assert_eq!(ask_in(&running, "files", "path", "f/d"), 429);
    let target = json!({ "domain": "files", "descriptor": descriptor("path", "f/a") });
    let mut set = target.clone();
    set["limit"] = json!({ "requests_per_unit": 10, "unit": "hour" });
    let (status, answer) = call(admin, "PUT", "/v1/limits", Some(TOKEN), &set);
    assert_eq!(status, 200, "{answer}");
    let (status, answer) = call(admin, "POST", "/v1/reset", Some(TOKEN), &target);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["limits"], 1, "{answer}");
    assert_eq!(ask_in(&running, "files", "path", "f/d"), 429, "{answer}");

    // A rule whose counter is the value's own (2 an hour): the reset clears it beside the runtime
    // limit's, so the value is free again once the runtime limit is gone.
    for want in [200, 200, 429] {
        assert_eq!(ask(&running, "tenant", "t"), want);
    }
    let target = json!({ "domain": "api", "descriptor": descriptor("tenant", "t") });
    let mut set = target.clone();
    set["limit"] = json!({ "requests_per_unit": 10, "unit": "minute" });
    let (status, answer) = call(admin, "PUT", "/v1/limits", Some(TOKEN), &set);
    assert_eq!(status, 200, "{answer}");
    let (status, answer) = call(admin, "POST", "/v1/reset", Some(TOKEN), &target);
    assert_eq!((status, &answer["limits"]), (200, &json!(2)), "{answer}");
    let (status, answer) = call(admin, "DELETE", "/v1/limits", Some(TOKEN), &target);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(ask(&running, "tenant", "t"), 200);
}

/// `runtime_limits.max_limits` holds for the fleet: two replicas of one Redis asked at once for a new
/// limit each, with room for one, set one (the other is answered 409), round after round (the count and
/// the write were two steps, and both were set in about two rounds of five).
#[test]
fn max_limits_holds_when_replicas_set_limits_at_once() {
    let redis = RedisProcess::start(&[]);
    let files = Files::new();
    let replica = || {
        let mut cmd = with_admin(&files);
        on_redis(&mut cmd, &redis);
        cmd.env("RATELIMITD_RUNTIME_LIMITS__MAX_LIMITS", "1");
        let running = start_binary(&mut cmd);
        let admin = admin_addr(&running);
        (running, admin)
    };
    let (_one, first) = replica();
    let (_two, second) = replica();
    for round in 0..8 {
        // No limits, under a generation no replica has seen: each reads the empty set again.
        redis.cli(&["DEL", "{ratelimitd}:runtime_limits"]);
        let generation = format!("{}", 1_000_000 + round);
        redis.cli(&["SET", "{ratelimitd}:operator_changes", &generation]);
        let set = |admin: SocketAddr, tenant: String| {
            std::thread::spawn(move || {
                let body = json!({
                    "domain": "api",
                    "descriptor": descriptor("tenant", &tenant),
                    "limit": { "requests_per_unit": 5, "unit": "hour" },
                });
                call(admin, "PUT", "/v1/limits", Some(TOKEN), &body).0
            })
        };
        let a = set(first, format!("a{round}"));
        let b = set(second, format!("b{round}"));
        let mut statuses = [a.join().unwrap(), b.join().unwrap()];
        statuses.sort();
        assert_eq!(statuses, [200, 409], "round {round}");
        assert_eq!(redis.cli(&["HLEN", "{ratelimitd}:runtime_limits"]), "1");
    }
}
