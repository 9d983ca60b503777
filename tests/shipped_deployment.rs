//! The binary started as deploy/kubernetes/base runs it: the Deployment's own environment (read from the
//! manifest, nothing added but loopback ports and the mount's place) and the ConfigMap's rules laid out as
//! the kubelet mounts them.

mod common;

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use common::{http_request, start_binary, Running};

fn repository(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

/// The base Deployment's first container, as JSON.
fn base_container() -> serde_json::Value {
    let text = fs::read_to_string(repository("deploy/kubernetes/base/deployment.yaml")).unwrap();
    let deployment: serde_json::Value = serde_saphyr::from_str(&text).unwrap();
    deployment["spec"]["template"]["spec"]["containers"][0].clone()
}

/// The container's plain environment values (none of the base's comes from a Secret).
fn base_environment() -> Vec<(String, String)> {
    let container = base_container();
    let env = container["env"].as_array().expect("the container's env");
    env.iter()
        .map(|e| {
            let value = e["value"].as_str().expect("plain values only in the base");
            (e["name"].as_str().unwrap().to_owned(), value.to_owned())
        })
        .collect()
}

/// The ConfigMap's files under `root`, where the Deployment's RUNTIME_* variables point; `root` stands
/// in for RUNTIME_ROOT.
fn mount_rules(root: &Path, env: &[(String, String)]) -> PathBuf {
    let get = |name: &str| &env.iter().find(|(n, _)| n == name).unwrap().1;
    let folder = root
        .join(get("RUNTIME_SUBDIRECTORY"))
        .join(get("RUNTIME_APPDIRECTORY"));
    fs::create_dir_all(&folder).unwrap();
    for entry in fs::read_dir(repository("deploy/kubernetes/base/rules")).unwrap() {
        let entry = entry.unwrap();
        fs::copy(entry.path(), folder.join(entry.file_name())).unwrap();
    }
    folder
}

/// The base's environment with RUNTIME_ROOT at `root` and loopback listeners on free ports.
fn base_deployment(root: &Path, env: &[(String, String)]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ratelimitd"));
    cmd.arg("serve")
        .env_clear()
        .envs(env.iter().map(|(n, v)| (n.as_str(), v.as_str())))
        .env("RUNTIME_ROOT", root)
        .envs(common::LOOPBACK);
    cmd
}

fn healthcheck(running: &Running) -> u16 {
    http_request(running.http, "GET", "/healthcheck", "").0
}

#[test]
fn a_replica_of_the_base_whose_rules_fail_to_load_is_not_ready() {
    let env = base_environment();
    let root = tempfile::tempdir().unwrap();
    let folder = mount_rules(root.path(), &env);
    fs::write(
        folder.join("edge.yaml"),
        "domain: edge\ndescriptors:\n  - key: [\n",
    )
    .unwrap();
    let broken = start_binary(&mut base_deployment(root.path(), &env));
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !broken.log.lock().unwrap().contains("edge.yaml") {
        assert!(
            std::time::Instant::now() < deadline,
            "no word of the broken file; log:\n{}",
            broken.log.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // What the RateLimitNoRules alert reads.
    let (_, metrics) = http_request(broken.http, "GET", "/metrics", "");
    assert_eq!(domains_served(&metrics), 0.0, "{metrics}");
    // Held for a while: never ready with its rules refused.
    for _ in 0..10 {
        assert_eq!(
            healthcheck(&broken),
            500,
            "a replica with no rules reported ready; log:\n{}",
            broken.log.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(broken);

    // The same Deployment with the shipped rules is ready.
    let root = tempfile::tempdir().unwrap();
    mount_rules(root.path(), &env);
    let good = start_binary(&mut base_deployment(root.path(), &env));
    assert!(
        good.serving_within(Duration::from_secs(20)),
        "the shipped rules did not make the replica ready; log:\n{}",
        good.log.lock().unwrap()
    );
    let (_, metrics) = http_request(good.http, "GET", "/metrics", "");
    assert_eq!(domains_served(&metrics), 3.0, "{metrics}");
}

/// The value of `ratelimitd_rules_info` (the domains served) in a Prometheus scrape.
fn domains_served(metrics: &str) -> f64 {
    let line = metrics
        .lines()
        .find(|l| l.starts_with("ratelimitd_rules_info{"))
        .expect("ratelimitd_rules_info is exported");
    line.rsplit(' ').next().unwrap().parse().unwrap()
}
