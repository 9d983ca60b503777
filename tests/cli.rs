//! The `ratelimitd` binary: command line, settings errors, serving with defaults, SIGTERM.

use std::{
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

mod common;

use common::start_binary as start;

const BIN: &str = env!("CARGO_BIN_EXE_ratelimitd");
const RULES: &str = "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n";

fn ratelimitd(args: &[&str], env: &[(&str, &str)], cwd: &Path) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(args).env_clear().current_dir(cwd);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// The binary serving the rules in `cwd/config` on loopback, with `env` added.
fn serve(env: &[(&str, &str)], cwd: &Path) -> common::Running {
    start(ratelimitd(&[], env, cwd).envs(common::LOOPBACK))
}

#[test]
fn help_and_version() {
    let dir = tempfile::tempdir().unwrap();
    let out = ratelimitd(&["--help"], &[], dir.path()).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    for word in ["serve", "check-config", "--config", "--version"] {
        assert!(text.contains(word), "--help lacks {word}: {text}");
    }
    let out = ratelimitd(&["--version"], &[], dir.path())
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("ratelimitd {}", env!("CARGO_PKG_VERSION"))
    );
}

/// `limits delete` with entries but no `--domain` says what is missing (exit 2, usage), never that
/// `--id` is (which cannot be given with entries).
#[test]
fn limits_delete_without_its_domain_asks_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let delete = |args: &[&str]| {
        let out = ratelimitd(
            &[
                &["admin", "--url", "http://127.0.0.1:1", "limits", "delete"],
                args,
            ]
            .concat(),
            &[],
            dir.path(),
        )
        .output()
        .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for args in [&["tenant=a"][..], &[]] {
        let (code, err) = delete(args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains("--domain <DOMAIN>"), "{args:?}: {err}");
        assert!(!err.contains("cannot be used"), "{args:?}: {err}");
        assert!(
            err.contains("(--id <ID> | --domain <DOMAIN> <KEY=VALUE>...)"),
            "{args:?}: {err}"
        );
    }
    let (code, err) = delete(&["--domain", "api"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("<KEY=VALUE>"), "{err}");
}

/// `ratelimitd check-config <folder>` run in `cwd`, as it ended.
fn check_config_output(folder: &Path, env: &[(&str, &str)], cwd: &Path) -> std::process::Output {
    ratelimitd(&["check-config", folder.to_str().unwrap()], env, cwd)
        .output()
        .unwrap()
}

/// `ratelimitd check-config <folder>` run in `cwd`: its exit code and what it printed.
fn check_config(folder: &Path, env: &[(&str, &str)], cwd: &Path) -> (Option<i32>, String) {
    let out = check_config_output(folder, env, cwd);
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    (out.status.code(), printed)
}

#[test]
fn check_config_reports_ok_or_the_first_error() {
    let dir = tempfile::tempdir().unwrap();
    let here = Path::new(".");
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/config");
    assert_eq!(
        check_config(&examples, &[], dir.path()),
        (Some(0), "all rate limit configs ok\n".into())
    );

    std::fs::write(dir.path().join("a.yaml"), RULES).unwrap();
    std::fs::write(
        dir.path().join("b.yaml"),
        "domain: other\ndescriptors:\n  - key: k\n    rate_limit: {unit: eon, requests_per_unit: 1}\n",
    )
    .unwrap();
    assert_eq!(
        check_config(here, &[], dir.path()),
        (
            Some(1),
            "error loading rate limit configs: b.yaml: invalid rate limit unit 'eon'\n".into()
        )
    );

    // Duplicate domains pass only with MERGE_DOMAIN_CONFIG.
    std::fs::write(
        dir.path().join("b.yaml"),
        "domain: web\ndescriptors:\n  - key: other\n",
    )
    .unwrap();
    let (code, printed) = check_config(here, &[], dir.path());
    assert_eq!(code, Some(1));
    assert!(printed.contains("duplicate domain 'web'"), "{printed}");
    let merged = check_config(here, &[("MERGE_DOMAIN_CONFIG", "true")], dir.path());
    assert_eq!(merged.0, Some(0));
}

/// A field written where it means nothing (shadow mode inside the rate limit, a burst beside it) is
/// accepted, as the reference accepts it, and said: a rule the operator believes in shadow mode would
/// otherwise deny without a word.
#[test]
fn check_config_names_fields_written_where_they_are_ignored() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("web.yaml"),
        "domain: web\ndescriptors:\n  - key: user\n    burst: 5\n    rate_limit: {unit: hour, requests_per_unit: 1, shadow_mode: true}\n",
    )
    .unwrap();
    let out = check_config_output(Path::new("."), &[], dir.path());
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "all rate limit configs ok\n"
    );
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("web.yaml: descriptor 'user': 'burst' is ignored: a field of rate_limit"),
        "{said}"
    );
    assert!(
        said.contains("web.yaml: descriptor 'user': 'shadow_mode' in its rate limit is ignored: a field of the descriptor"),
        "{said}"
    );
    // The examples have none.
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/config");
    let out = check_config_output(&examples, &[], dir.path());
    assert_eq!(String::from_utf8_lossy(&out.stderr), "");
}

/// Rules nested 17 levels deep: a descriptor of 17 entries, one more than a request may carry with the
/// default `request_limits.max_entries`.
fn rules_nested_17_deep() -> String {
    let mut text = String::from("domain: deep\ndescriptors:\n");
    for level in 0..17 {
        let pad = "    ".repeat(level);
        text.push_str(&format!("{pad}  - key: k{level}\n"));
        if level < 16 {
            text.push_str(&format!("{pad}    descriptors:\n"));
        } else {
            text.push_str(&format!(
                "{pad}    rate_limit: {{unit: minute, requests_per_unit: 1}}\n"
            ));
        }
    }
    text
}

/// A rule no request can reach (every request with 17 entries is refused by `request_limits`) loads,
/// as the reference loads it, and is said at check-config and at every load of the service, naming the
/// setting that serves it.
#[test]
fn a_rule_deeper_than_a_request_may_carry_is_said_with_the_setting_to_raise() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("config")).unwrap();
    std::fs::write(dir.path().join("config/deep.yaml"), rules_nested_17_deep()).unwrap();
    let warning = "rule 'deep.k0.k1.k2.k3.k4.k5.k6.k7.k8.k9.k10.k11.k12.k13.k14.k15.k16' is nested deeper than request_limits.max_entries (16)";
    let out = check_config_output(Path::new("config"), &[], dir.path());
    assert_eq!(out.status.code(), Some(0));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains(warning), "{said}");
    let raised = [("RATELIMITD_REQUEST_LIMITS__MAX_ENTRIES", "17")];
    let out = check_config_output(Path::new("config"), &raised, dir.path());
    assert_eq!(String::from_utf8_lossy(&out.stderr), "");

    let running = serve(&[], dir.path());
    running.wait_log(warning, Duration::from_secs(10));
}

/// The reference's messages name neither the line nor, mostly, the rule: check-config prints them as
/// they are, and says where beside them; the service's log says it with the error.
#[test]
fn a_rules_error_is_placed_by_line_and_rule_beside_the_references_message() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("config")).unwrap();
    let file = dir.path().join("config/web.yaml");
    let rules = |unit: &str, requests: &str| {
        format!("domain: web\ndescriptors:\n  - key: path\n    value: /a\n    rate_limit: {{unit: minute, requests_per_unit: 1}}\n  - key: user\n    descriptors:\n      - key: plan\n        value: free\n        rate_limit:\n          unit: {unit}\n          requests_per_unit: {requests}\n")
    };
    for (unit, requests, message, place) in [
        (
            "minutes",
            "5",
            "web.yaml: invalid rate limit unit 'minutes'",
            "web.yaml: the rule starting at line 8 ('web.user.plan_free')",
        ),
        (
            "minute",
            "five",
            "web.yaml: error loading config file: yaml: unmarshal errors: cannot unmarshal `five` into requests_per_unit (expected a uint32)",
            "web.yaml: the map starting at line 11",
        ),
        (
            "minute",
            "5\n          ratelimit: 2",
            "web.yaml: config error, unknown key 'ratelimit'",
            "web.yaml: the map starting at line 11",
        ),
    ] {
        std::fs::write(&file, rules(unit, requests)).unwrap();
        let out = check_config_output(Path::new("config"), &[], dir.path());
        assert_eq!(out.status.code(), Some(1));
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            format!("error loading rate limit configs: {message}\n")
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stderr),
            format!("ratelimitd: the error is in {place}\n")
        );
    }
    let running = serve(&[], dir.path());
    running.wait_log("the map starting at line 11", Duration::from_secs(10));
}

#[test]
fn check_config_refuses_a_window_longer_than_ten_years_naming_the_rule() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("web.yaml"),
        "domain: web\ndescriptors:\n  - key: user\n    value: forever\n    rate_limit: {unit: year, requests_per_unit: 1, unit_multiplier: 4294967295, algorithm: token_bucket}\n",
    )
    .unwrap();
    assert_eq!(
        check_config(Path::new("."), &[], dir.path()),
        (
            Some(1),
            "error loading rate limit configs: web.yaml: rule 'web.user_forever': rate_limit.unit_multiplier: a window of 4294967295 x YEAR (135446088615120000 seconds) is longer than the longest a limit may have, 10 years (315360000 seconds)\n".into()
        )
    );
}

/// Quota settings too long to be meant (and long enough to overflow time arithmetic) are refused before
/// a port is bound, not a panic at start or at the first stream.
#[test]
fn rlqs_periods_past_their_bounds_exit_64_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    for (name, setting, value) in [
        (
            "RATELIMITD_RLQS__REPORT_PERIOD",
            "rlqs.report_period",
            "10000000000000000000s",
        ),
        ("RATELIMITD_RLQS__REPORT_PERIOD", "rlqs.report_period", "2m"),
        (
            "RATELIMITD_RLQS__ASSIGNMENT_TTL",
            "rlqs.assignment_ttl",
            "2h",
        ),
    ] {
        let mut child = ratelimitd(&[], &[(name, value)], dir.path())
            .envs(common::LOOPBACK)
            .stderr(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if std::time::Instant::now() > deadline {
                child.kill().unwrap();
                child.wait().unwrap();
                break None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
        let status = status.unwrap_or_else(|| panic!("{name}={value}: still running: {err}"));
        assert_eq!(status.code(), Some(64), "{name}={value}: {err}");
        assert!(err.contains(setting), "{name}={value}: {err}");
        assert!(err.contains("at most"), "{name}={value}: {err}");
    }
}

#[test]
fn a_wrong_setting_exits_64_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    for (name, value) in [
        ("GRPC_PORT", "eighty"),
        ("LOG_LEVEL", "loud"),
        ("RATELIMITD_SHUTDOWN__GRACE_PERIOD", "soon"),
    ] {
        let out = ratelimitd(&[], &[(name, value)], dir.path())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{name}: {err}");
        assert!(err.contains(value), "{name}: {err}");
        assert_eq!(err.lines().count(), 1, "one line: {err}");
    }
    let out = ratelimitd(&["--config", "missing.yaml"], &[], dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing.yaml"));
}

#[test]
fn with_no_settings_it_serves_reference_ports_and_local_config_rules() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("config")).unwrap();
    std::fs::write(dir.path().join("config/web.yaml"), RULES).unwrap();
    let running = start(&mut ratelimitd(&[], &[], dir.path()));
    assert_eq!(running.grpc.to_string(), "0.0.0.0:8081");
    assert_eq!(running.http.to_string(), "0.0.0.0:8080");
    let body = r#"{"domain":"web","descriptors":[{"entries":[{"key":"user","value":"x"}]}]}"#;
    std::thread::sleep(common::until_far_from_a_minute_end());
    let local = "127.0.0.1:8080".parse().unwrap();
    assert_eq!(common::http_request(local, "POST", "/json", body).0, 200);
    assert_eq!(common::http_request(local, "POST", "/json", body).0, 200);
    assert_eq!(common::http_request(local, "POST", "/json", body).0, 429);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_and_exits_zero_within_the_grace_period() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("config")).unwrap();
    std::fs::write(dir.path().join("config/web.yaml"), RULES).unwrap();
    let mut running = serve(&[("RATELIMITD_SHUTDOWN__GRACE_PERIOD", "3s")], dir.path());

    // Load from 8 callers, each on its own connection, until the server goes away.
    let mut callers = Vec::new();
    let answered_once = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for i in 0..8 {
        let addr = running.grpc;
        let answered_once = answered_once.clone();
        callers.push(tokio::spawn(async move {
            let mut client =
                ratelimitd::proto::RateLimitServiceClient::connect(format!("http://{addr}"))
                    .await
                    .unwrap();
            let mut answered = 0u32;
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                let user = format!("caller{i}");
                let r = common::request("web", vec![common::descriptor(&[("user", &user)])]);
                match client.should_rate_limit(r).await {
                    Ok(_) => {
                        answered += 1;
                        if answered == 1 {
                            answered_once.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                    Err(status) => {
                        eprintln!("caller {i} ended with {status:?}");
                        // A status the server sent has no source; one made by the client from a
                        // failed connection (reset as the process closes it) carries the transport error.
                        let from_connection = std::error::Error::source(&status).is_some();
                        return (answered, Some((status.code(), from_connection)));
                    }
                }
            }
            (answered, None)
        }));
    }
    common::wait_for(
        "every caller answered",
        Duration::from_secs(10),
        async || {
            let all = answered_once.load(std::sync::atomic::Ordering::Relaxed) == 8;
            all.then_some(())
        },
    )
    .await;
    let status = running.terminate(Duration::from_secs(6)).await;
    assert_eq!(status.code(), Some(0));
    for caller in callers {
        let (answered, ended) = caller.await.unwrap();
        assert!(
            answered > 0,
            "every caller was answered before the shutdown"
        );
        // After the shutdown, calls fail because the connection is gone, never with a server error.
        assert!(
            matches!(
                ended,
                Some((tonic::Code::Unavailable | tonic::Code::Cancelled, _) | (_, true))
            ),
            "{ended:?}"
        );
    }
}

#[test]
fn use_prometheus_serves_metrics_on_its_own_address_and_path() {
    let dir = tempfile::tempdir().unwrap();
    let addr = format!("127.0.0.1:{}", common::redis::free_port());
    let running = serve(
        &[
            ("USE_PROMETHEUS", "true"),
            ("PROMETHEUS_ADDR", &addr),
            ("PROMETHEUS_PATH", "/prom"),
        ],
        dir.path(),
    );
    let (code, text) = common::http_request(addr.parse().unwrap(), "GET", "/prom", "");
    assert_eq!(code, 200);
    assert!(
        text.contains("# TYPE ratelimitd_build_info gauge"),
        "{text}"
    );
    // The HTTP port keeps its own /metrics.
    assert_eq!(
        common::http_request(running.http, "GET", "/metrics", "").0,
        200
    );
}

#[test]
fn json_logs_are_one_object_per_line_with_the_references_time_level_and_message() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("config")).unwrap();
    std::fs::write(dir.path().join("config/web.yaml"), RULES).unwrap();
    let running = serve(&[("LOG_FORMAT", "json"), ("LOG_LEVEL", "info")], dir.path());
    let log = running.log.lock().unwrap().clone();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    for line in &lines {
        // The reference's (logrus's) names: log pipelines built on its lines read these.
        for field in ["@timestamp", "level", "@message"] {
            assert!(line.get(field).is_some(), "{field} missing: {line}");
        }
        let time = line["@timestamp"].as_str().unwrap();
        assert!(humantime::parse_rfc3339(time).is_ok(), "{time}");
        let level = line["level"].as_str().unwrap();
        assert!(["info", "warning"].contains(&level), "{line}");
    }
    let loads: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l["@message"] == "rules loaded")
        .collect();
    assert_eq!(loads.len(), 1, "one line per rules load");
    assert_eq!(loads[0]["domains"], 1);
    assert!(lines
        .iter()
        .any(|l| l["@message"] == "loading domain: web" && l["domain"] == "web"));
}
