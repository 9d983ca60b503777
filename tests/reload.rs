//! Live reload of the rules folder, with real files, renames and symlinks.

mod common;

use std::{
    fs,
    os::unix::fs::symlink,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use common::{descriptor, request, TestServer};

const V1: &str = "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 1}\n";
const V2: &str = "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 7}\n";
const OTHER: &str = "domain: other\ndescriptors:\n  - key: ip\n    rate_limit: {unit: hour, requests_per_unit: 3}\n";

async fn start(root: &Path, ignore_dotfiles: bool) -> TestServer {
    let root = root.to_path_buf();
    TestServer::start(&[], move |s| {
        s.rules.path = Some(root);
        s.rules.ignore_dotfiles = ignore_dotfiles;
        s.rules.reload_delay = Duration::from_millis(100);
    })
    .await
}

/// Waits until /rlconfig satisfies `ok`; returns its text.
async fn wait_rules(s: &TestServer, what: &str, ok: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, text) = s.http("GET", "/rlconfig", "").await;
        if ok(&text) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: /rlconfig is still:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn user_limit(n: u32) -> String {
    format!("web.user: unit=MINUTE requests_per_unit={n},")
}

/// What kubelet does for a ConfigMap volume: files in a hidden timestamped folder, a `..data` symlink to
/// it, and per-file symlinks through `..data`. An update writes a new folder and renames a new link
/// over `..data` in one step.
fn configmap_publish(root: &Path, version: u32, files: &[(&str, &str)]) {
    let stamp = format!("..2026_11_29_00_00_{version:02}.000");
    fs::create_dir(root.join(&stamp)).unwrap();
    for (name, text) in files {
        fs::write(root.join(&stamp).join(name), text).unwrap();
        let link = root.join(name);
        if fs::symlink_metadata(&link).is_err() {
            symlink(PathBuf::from("..data").join(name), &link).unwrap();
        }
    }
    let tmp = root.join("..data_tmp");
    symlink(&stamp, &tmp).unwrap();
    fs::rename(&tmp, root.join("..data")).unwrap();
    if version > 1 {
        let old = format!("..2026_11_29_00_00_{:02}.000", version - 1);
        fs::remove_dir_all(root.join(old)).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_update_swaps_the_rules_in() {
    let dir = tempfile::tempdir().unwrap();
    configmap_publish(dir.path(), 1, &[("web.yaml", V1)]);
    let s = start(dir.path(), true).await;
    wait_rules(&s, "initial", |t| t.contains(&user_limit(1))).await;

    configmap_publish(dir.path(), 2, &[("web.yaml", V2)]);
    wait_rules(&s, "after the ..data swap", |t| t.contains(&user_limit(7))).await;
    let mut c = s.client().await;
    let resp = c
        .should_rate_limit(request("web", vec![descriptor(&[("user", "u")])]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        resp.statuses[0].limit_remaining, 6,
        "requests use the new limit"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_file_keeps_the_old_rules_until_it_is_fixed() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("web.yaml"), V1).unwrap();
    let s = start(dir.path(), false).await;
    wait_rules(&s, "initial", |t| t.contains(&user_limit(1))).await;

    fs::write(
        dir.path().join("web.yaml"),
        "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: parsec}\n",
    )
    .unwrap();
    fs::write(dir.path().join("other.yaml"), OTHER).unwrap();
    tokio::time::sleep(Duration::from_millis(800)).await;
    let text = wait_rules(&s, "old rules kept", |t| t.contains(&user_limit(1))).await;
    assert!(
        !text.contains("other.ip"),
        "nothing of the broken set is used:\n{text}"
    );
    let mut c = s.client().await;
    let resp = c
        .should_rate_limit(request("web", vec![descriptor(&[("user", "b")])]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        resp.statuses[0].limit_remaining, 0,
        "still the old limit of 1"
    );

    fs::write(dir.path().join("web.yaml"), V2).unwrap();
    wait_rules(&s, "fixed", |t| {
        t.contains(&user_limit(7)) && t.contains("other.ip")
    })
    .await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_and_deleted_files_add_and_remove_domains() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("web.yaml"), V1).unwrap();
    let s = start(dir.path(), false).await;
    wait_rules(&s, "initial", |t| t.contains(&user_limit(1))).await;

    fs::write(dir.path().join("other.yaml"), OTHER).unwrap();
    wait_rules(&s, "new domain", |t| {
        t.contains("other.ip: unit=HOUR requests_per_unit=3")
    })
    .await;
    let mut c = s.client().await;
    let resp = c
        .should_rate_limit(request("other", vec![descriptor(&[("ip", "1.2.3.4")])]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.statuses[0].limit_remaining, 2);

    fs::remove_file(dir.path().join("web.yaml")).unwrap();
    wait_rules(&s, "deleted domain", |t| {
        !t.contains("web.user") && t.contains("other.ip")
    })
    .await;
    let resp = c
        .should_rate_limit(request("web", vec![descriptor(&[("user", "u")])]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        resp.statuses[0].current_limit, None,
        "an unknown domain again"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_editor_saving_through_a_rename_is_picked_up() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("web.yaml"), V1).unwrap();
    let s = start(dir.path(), true).await;
    wait_rules(&s, "initial", |t| t.contains(&user_limit(1))).await;
    // Write a hidden temporary file, then rename it over the original, as vim and most editors do.
    let tmp = dir.path().join(".web.yaml.swp");
    fs::write(&tmp, V2).unwrap();
    fs::rename(&tmp, dir.path().join("web.yaml")).unwrap();
    wait_rules(&s, "after the rename", |t| t.contains(&user_limit(7))).await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reference_layout_reloads_when_runtime_root_is_swapped() {
    // RUNTIME_ROOT=<dir>/current -> v1, RUNTIME_SUBDIRECTORY=ratelimit, files under config/.
    let dir = tempfile::tempdir().unwrap();
    for (version, text) in [("v1", V1), ("v2", V2)] {
        let config = dir.path().join(version).join("ratelimit/config");
        fs::create_dir_all(&config).unwrap();
        fs::write(config.join("web.yaml"), text).unwrap();
    }
    symlink("v1", dir.path().join("current")).unwrap();
    let root = dir.path().join("current");
    let s = TestServer::start(&[], move |s| {
        s.rules.path = None;
        s.rules.runtime_root = Some(root);
        s.rules.runtime_subdirectory = "ratelimit".into();
        s.rules.runtime_watch_root = true;
        s.rules.reload_delay = Duration::from_millis(100);
    })
    .await;
    wait_rules(&s, "initial", |t| t.contains(&user_limit(1))).await;
    symlink("v2", dir.path().join("current.tmp")).unwrap();
    fs::rename(dir.path().join("current.tmp"), dir.path().join("current")).unwrap();
    wait_rules(&s, "after swapping RUNTIME_ROOT", |t| {
        t.contains(&user_limit(7))
    })
    .await;
    s.stop().await;
}
