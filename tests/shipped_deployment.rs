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

use common::{descriptor, http_request, start_binary, Running};
use ratelimitd::proto::{RateLimitDescriptor, RateLimitServiceClient};

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

/// The container's memory limit in bytes (`512Mi`).
fn memory_limit() -> u64 {
    let container = base_container();
    let limit = container["resources"]["limits"]["memory"].as_str().unwrap();
    let mebibytes: u64 = limit
        .strip_suffix("Mi")
        .expect("a limit in Mi")
        .parse()
        .unwrap();
    mebibytes << 20
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
    broken.wait_log("edge.yaml", Duration::from_secs(20));
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

/// Peak resident memory of a process, from /proc.
fn peak_resident_bytes(pid: u32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib << 10
}

/// A memory store filled by callers who choose their counters' keys (a new tenant of the ai rules each
/// time, as long as a counter key may be: two counters each, its hour and its day, which outlive the
/// test) stays within the base's memory limit, with room left for the gRPC buffers' bound: the store
/// says it is full before the kernel kills the replica and every count it held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_base_memory_store_fills_up_within_the_pods_memory_limit() {
    const BUFFERS: u64 = 2 * (64 << 20); // Twice grpc.max_held_bytes' default.
    const PER_REQUEST: usize = 48; // 48 values of ~1 KiB: within a request's 64 KiB.
    let env = base_environment();
    let max_keys: usize = env
        .iter()
        .find(|(n, _)| n == "RATELIMITD_MEMORY__MAX_KEYS")
        .expect("the base bounds its memory store")
        .1
        .parse()
        .unwrap();
    let root = tempfile::tempdir().unwrap();
    mount_rules(root.path(), &env);
    let running = start_binary(&mut base_deployment(root.path(), &env));
    assert!(running.serving_within(Duration::from_secs(20)));

    let mut client = RateLimitServiceClient::connect(format!("http://{}", running.grpc))
        .await
        .unwrap();
    // The counter key holds the domain, key and window besides the value: keep it under 1 KiB, where
    // it still counts once against max_keys. Each tenant takes two counters.
    const COUNTERS: usize = 2;
    let value = |i: usize| format!("tenant-{i:08}-{}", "t".repeat(960));
    let mut sent = 0;
    let mut full = None;
    while sent * COUNTERS < max_keys + PER_REQUEST {
        let descriptors: Vec<RateLimitDescriptor> = (sent..sent + PER_REQUEST)
            .map(|i| descriptor(&[("tenant", &value(i))]))
            .collect();
        sent += PER_REQUEST;
        match client
            .should_rate_limit(common::request("ai", descriptors))
            .await
        {
            Ok(_) => {}
            Err(status) => {
                full = Some(status);
                break;
            }
        }
    }
    let counters = sent * COUNTERS;
    let full = full.unwrap_or_else(|| panic!("{counters} new counters were all taken"));
    assert!(
        full.message().contains("memory store full"),
        "refused for another reason: {full:?}"
    );
    assert!(
        counters >= max_keys,
        "full after {counters} counters, below max_keys {max_keys}"
    );
    let peak = peak_resident_bytes(running.child.id());
    let limit = memory_limit();
    eprintln!("peak resident {} MiB at {counters} counters", peak >> 20);
    assert!(
        peak + BUFFERS <= limit,
        "peak resident {} MiB + the buffers' {} MiB is over the pod's limit of {} MiB",
        peak >> 20,
        BUFFERS >> 20,
        limit >> 20
    );
}
