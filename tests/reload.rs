//! Live reload of the rules folder, with real files, renames and symlinks: each change is loaded exactly
//! once, and nothing else (reading the files, other files nearby) loads the rules again.

mod common;

use std::{
    fs,
    os::unix::fs::symlink,
    path::{Path, PathBuf},
    time::Duration,
};

use common::{ask, descriptor, request, wait_for, TestServer};

const V1: &str = "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 1}\n";
const V2: &str = "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 7}\n";
const OTHER: &str = "domain: other\ndescriptors:\n  - key: ip\n    rate_limit: {unit: hour, requests_per_unit: 3}\n";

/// The production default: long enough that one change, however many file system events it makes, is one
/// burst even on a busy machine.
const RELOAD_DELAY: Duration = Duration::from_millis(250);
/// How long a finished change is given to (wrongly) load the rules again.
const SETTLE: Duration = Duration::from_millis(1500);

/// A server on the rules under `root`, once it serves the first rules (a limit of 1).
async fn start(root: &Path, ignore_dotfiles: bool) -> TestServer {
    let root = root.to_path_buf();
    let s = TestServer::start(&[], move |s| {
        s.rules.path = Some(root);
        s.rules.ignore_dotfiles = ignore_dotfiles;
        s.rules.reload_delay = RELOAD_DELAY;
    })
    .await;
    wait_rules(&s, "initial", |t| t.contains(&user_limit(1))).await;
    s
}

/// The reference layout: `RUNTIME_ROOT=<dir>/current`, a symlink to `v1` (swapped whole to `v2` to publish),
/// `RUNTIME_SUBDIRECTORY=ratelimit`, the rules under `config/`; returns once `v1` is served.
async fn start_reference_layout(dir: &Path) -> TestServer {
    for (version, text) in [("v1", V1), ("v2", V2)] {
        let config = dir.join(version).join("ratelimit/config");
        fs::create_dir_all(&config).unwrap();
        fs::write(config.join("web.yaml"), text).unwrap();
    }
    symlink("v1", dir.join("current")).unwrap();
    let root = dir.join("current");
    let s = TestServer::start(&[], move |s| {
        s.rules.path = None;
        s.rules.runtime_root = Some(root);
        s.rules.runtime_subdirectory = "ratelimit".into();
        s.rules.runtime_watch_root = true;
        s.rules.reload_delay = RELOAD_DELAY;
    })
    .await;
    wait_rules(&s, "initial", |t| t.contains(&user_limit(1))).await;
    s
}

/// Publishes `v2` in the reference layout: `current` is renamed over by a link to it.
fn swap_reference_layout(dir: &Path) {
    symlink("v2", dir.join("current.tmp")).unwrap();
    fs::rename(dir.join("current.tmp"), dir.join("current")).unwrap();
}

/// Rules loads that ran, from `/metrics`: (`ratelimit_service_config_load_success`, `..._error`).
async fn loads(s: &TestServer) -> (u64, u64) {
    let (_, text) = s.http("GET", "/metrics", "").await;
    let sample = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
            .unwrap_or_else(|| panic!("no {name} in /metrics:\n{text}"))
            .parse()
            .unwrap()
    };
    (
        sample("ratelimit_service_config_load_success"),
        sample("ratelimit_service_config_load_error"),
    )
}

/// Waits until the load counts satisfy `ok`; returns them.
async fn wait_loads(s: &TestServer, what: &str, ok: impl Fn((u64, u64)) -> bool) -> (u64, u64) {
    let what = format!("{what}: rules loads (successes, errors) as expected");
    wait_for(&what, Duration::from_secs(10), async || {
        Some(loads(s).await).filter(|&counts| ok(counts))
    })
    .await
}

/// After a change was seen loaded: the counts stay where they are for one more quiet period.
async fn assert_settled(s: &TestServer, what: &str, expected: (u64, u64)) {
    tokio::time::sleep(SETTLE).await;
    assert_eq!(
        loads(s).await,
        expected,
        "{what}: (successes, errors) moved again after the change was loaded"
    );
}

/// Waits until /rlconfig satisfies `ok`; returns its text.
async fn wait_rules(s: &TestServer, what: &str, ok: impl Fn(&str) -> bool) -> String {
    let what = format!("{what}: /rlconfig as expected");
    wait_for(&what, Duration::from_secs(10), async || {
        Some(s.http("GET", "/rlconfig", "").await.1).filter(|text| ok(text))
    })
    .await
}

/// From the first rules (a limit of 1), makes `change`, and checks that it was loaded
/// (the limit is 7), once, and that nothing loads again afterwards.
async fn assert_loaded_once(s: &TestServer, what: &str, change: impl FnOnce()) {
    let before = wait_loads(s, "initial", |(ok, _)| ok >= 1).await;
    change();
    wait_rules(s, what, |t| t.contains(&user_limit(7))).await;
    let after = (before.0 + 1, before.1);
    wait_loads(s, what, |n| n == after).await;
    assert_settled(s, &format!("{what}: one change is one load"), after).await;
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
    assert_loaded_once(&s, "after the ..data swap", || {
        configmap_publish(dir.path(), 2, &[("web.yaml", V2)])
    })
    .await;
    let resp = ask(
        &mut s.client().await,
        request("web", vec![descriptor(&[("user", "u")])]),
    )
    .await;
    assert_eq!(
        resp.statuses[0].limit_remaining, 6,
        "requests use the new limit"
    );
    s.stop().await;
}

/// The reference layout's defaults (`RUNTIME_WATCH_ROOT=true`, files named `config.*`) over a ConfigMap
/// whose keys are `config.*.yaml`: the files read are links into the hidden folders, whose swap is the
/// change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_of_config_keys_in_the_reference_layout_swaps_the_rules_in() {
    let dir = tempfile::tempdir().unwrap();
    let mount = dir.path().join("ratelimit");
    fs::create_dir(&mount).unwrap();
    configmap_publish(&mount, 1, &[("config.web.yaml", V1)]);
    let root = dir.path().to_owned();
    let s = TestServer::start(&[], move |s| {
        s.rules.path = None;
        s.rules.runtime_root = Some(root);
        s.rules.runtime_subdirectory = "ratelimit".into();
        s.rules.runtime_watch_root = true;
        s.rules.ignore_dotfiles = true;
        s.rules.reload_delay = RELOAD_DELAY;
    })
    .await;
    wait_rules(&s, "initial", |t| t.contains(&user_limit(1))).await;
    assert_loaded_once(&s, "after the ..data swap", || {
        configmap_publish(&mount, 2, &[("config.web.yaml", V2)])
    })
    .await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_file_keeps_the_old_rules_until_it_is_fixed() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("web.yaml"), V1).unwrap();
    let s = start(dir.path(), false).await;

    fs::write(
        dir.path().join("web.yaml"),
        "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: parsec}\n",
    )
    .unwrap();
    fs::write(dir.path().join("other.yaml"), OTHER).unwrap();
    // The broken set was loaded and refused: only then does "the old rules are still served" mean anything.
    wait_loads(&s, "the broken file is refused", |(_, errors)| errors >= 1).await;
    let text = wait_rules(&s, "old rules kept", |t| t.contains(&user_limit(1))).await;
    assert!(
        !text.contains("other.ip"),
        "nothing of the broken set is used:\n{text}"
    );
    let mut c = s.client().await;
    let resp = ask(&mut c, request("web", vec![descriptor(&[("user", "b")])])).await;
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

    fs::write(dir.path().join("other.yaml"), OTHER).unwrap();
    wait_rules(&s, "new domain", |t| {
        t.contains("other.ip: unit=HOUR requests_per_unit=3")
    })
    .await;
    let mut c = s.client().await;
    let resp = ask(
        &mut c,
        request("other", vec![descriptor(&[("ip", "1.2.3.4")])]),
    )
    .await;
    assert_eq!(resp.statuses[0].limit_remaining, 2);

    fs::remove_file(dir.path().join("web.yaml")).unwrap();
    wait_rules(&s, "deleted domain", |t| {
        !t.contains("web.user") && t.contains("other.ip")
    })
    .await;
    let resp = ask(&mut c, request("web", vec![descriptor(&[("user", "u")])])).await;
    assert_eq!(
        resp.statuses[0].current_limit, None,
        "an unknown domain again"
    );
    s.stop().await;
}

/// A file under the rules folder rewritten all the time (a sidecar's status, a generator looping) never
/// leaves the quiet a reload waits for: a change is loaded anyway, after ten quiet periods at most.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_is_loaded_while_another_file_is_rewritten_all_the_time() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("web.yaml"), V1).unwrap();
    let s = start(dir.path(), false).await;
    let busy = dir.path().join("other.yaml");
    // Written beside the folder and renamed in: a load never reads it half written.
    let staging = tempfile::tempdir().unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (busy, stop) = (busy.clone(), stop.clone());
        let staged = staging.path().join("other.yaml");
        std::thread::spawn(move || {
            // Bounded: at most 15 s of rewriting, whatever the test does.
            for _ in 0..150 {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    return;
                }
                fs::write(&staged, OTHER).unwrap();
                fs::rename(&staged, &busy).unwrap();
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let changed = std::time::Instant::now();
    fs::write(dir.path().join("web.yaml"), V2).unwrap();
    wait_rules(&s, "changed while the other file is rewritten", |t| {
        t.contains(&user_limit(7))
    })
    .await;
    let took = changed.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.join().unwrap();
    // Ten quiet periods of 250 ms, at most twice (the change landing just after a load began), and
    // the loads.
    assert!(
        took < Duration::from_secs(8),
        "loaded {took:?} after the change"
    );
    s.stop().await;
}

/// A deploy that removes the rules folder and writes it anew: while it is gone the rules served stay (a
/// refused load, as for a broken file), and the new folder is loaded once it is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rules_folder_removed_and_written_anew_keeps_the_rules_meanwhile() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("rules");
    fs::create_dir(&dir).unwrap();
    fs::write(dir.join("web.yaml"), V1).unwrap();
    let s = start(&dir, false).await;

    fs::remove_dir_all(&dir).unwrap();
    wait_loads(&s, "the folder is gone", |(_, errors)| errors >= 1).await;
    wait_rules(&s, "old rules kept", |t| t.contains(&user_limit(1))).await;
    let mut c = s.client().await;
    let resp = ask(&mut c, request("web", vec![descriptor(&[("user", "g")])])).await;
    assert_eq!(
        resp.statuses[0]
            .current_limit
            .as_ref()
            .map(|l| l.requests_per_unit),
        Some(1),
        "still limited while the folder is gone"
    );

    fs::create_dir(&dir).unwrap();
    fs::write(dir.join("web.yaml"), V2).unwrap();
    wait_rules(&s, "written anew", |t| t.contains(&user_limit(7))).await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_editor_saving_through_a_rename_is_picked_up() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("web.yaml"), V1).unwrap();
    let s = start(dir.path(), true).await;
    // Write a hidden temporary file, then rename it over the original, as vim and most editors do.
    assert_loaded_once(&s, "after the rename", || {
        let tmp = dir.path().join(".web.yaml.swp");
        fs::write(&tmp, V2).unwrap();
        fs::rename(&tmp, dir.path().join("web.yaml")).unwrap();
    })
    .await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reference_layout_reloads_when_runtime_root_is_swapped() {
    let dir = tempfile::tempdir().unwrap();
    let s = start_reference_layout(dir.path()).await;
    assert_loaded_once(&s, "after swapping RUNTIME_ROOT", || {
        swap_reference_layout(dir.path())
    })
    .await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn editing_a_file_loads_the_rules_once() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("web.yaml"), V1).unwrap();
    let s = start(dir.path(), false).await;
    assert_loaded_once(&s, "after the edit", || {
        fs::write(dir.path().join("web.yaml"), V2).unwrap()
    })
    .await;
    s.stop().await;
}

/// Every file under `dir`, read whole (following symlinks, as `cat` does).
fn read_all(dir: &Path) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            read_all(&path);
        } else {
            let _ = fs::read(&path);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_service_loads_its_rules_once_even_when_they_are_read() {
    // A plain folder, a ConfigMap mount, and the reference layout under a symlinked RUNTIME_ROOT.
    let (plain, configmap, reference) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    fs::write(plain.path().join("web.yaml"), V1).unwrap();
    configmap_publish(configmap.path(), 1, &[("web.yaml", V1)]);
    let servers = [
        ("a plain folder", start(plain.path(), false).await),
        ("a ConfigMap mount", start(configmap.path(), true).await),
        (
            "the reference layout",
            start_reference_layout(reference.path()).await,
        ),
    ];
    // Others reading the rules (a backup, `kubectl exec cat`, check-config) change nothing.
    for dir in [&plain, &configmap, &reference] {
        read_all(dir.path());
    }
    // Absence can only be waited for: give the watchers ample time to (wrongly) react.
    tokio::time::sleep(Duration::from_secs(5)).await;
    for (what, s) in &servers {
        assert_eq!(
            loads(s).await,
            (1, 0),
            "{what}: an idle service loads its rules once, at start"
        );
    }
    // The watchers were listening all along: a real change is loaded.
    fs::write(plain.path().join("web.yaml"), V2).unwrap();
    configmap_publish(configmap.path(), 2, &[("web.yaml", V2)]);
    swap_reference_layout(reference.path());
    for (what, s) in &servers {
        wait_loads(s, &format!("{what}, changed"), |n| n == (2, 0)).await;
    }
    for (_, s) in servers {
        s.stop().await;
    }
}

/// A rules file the service cannot read (written by root, mode 0600, for a service running as another
/// user, as the image does) is refused at start; once its mode is fixed, it is loaded without a restart.
#[test]
fn a_rules_file_made_readable_is_loaded() {
    use std::os::unix::{fs::PermissionsExt, process::CommandExt};
    if !nix_is_root() {
        eprintln!("skipped: running the service as another user takes root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    // The binary where that user may run it (the build's folder may be closed to others).
    let bin = dir.path().join("ratelimitd");
    if fs::hard_link(env!("CARGO_BIN_EXE_ratelimitd"), &bin).is_err() {
        fs::copy(env!("CARGO_BIN_EXE_ratelimitd"), &bin).unwrap();
    }
    let rules = dir.path().join("rules");
    fs::create_dir(&rules).unwrap();
    fs::set_permissions(&rules, fs::Permissions::from_mode(0o755)).unwrap();
    let file = rules.join("web.yaml");
    fs::write(&file, V1).unwrap();
    fs::set_permissions(&file, fs::Permissions::from_mode(0o600)).unwrap();
    let mut cmd = std::process::Command::new(&bin);
    cmd.env_clear()
        .envs(common::LOOPBACK)
        .env("RATELIMITD_RULES__PATH", &rules)
        .uid(65534)
        .gid(65534);
    let running = common::start_binary(&mut cmd);
    running.wait_log("web.yaml: cannot read file", Duration::from_secs(10));

    fs::set_permissions(&file, fs::Permissions::from_mode(0o644)).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (_, served) = common::http_request(running.http, "GET", "/rlconfig", "");
        if served.contains(&user_limit(1)) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not loaded after its mode was fixed:\n{}",
            running.log.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Whether the tests run as root.
fn nix_is_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| out.stdout.trim_ascii() == b"0")
}

#[test]
fn a_link_to_a_file_outside_the_folder_is_refused_and_its_content_never_shown() {
    const SECRET: &str = "TOP-SECRET-7f3a9c";
    let outside = tempfile::tempdir().unwrap();
    // A list item: the reference's own message for it would quote it in full.
    let secret = outside.path().join("secret.yaml");
    fs::write(&secret, format!("domain: x\ndescriptors:\n  - {SECRET}\n")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("web.yaml"), V1).unwrap();
    let running = common::start_binary(
        common::binary(dir.path()).env("RATELIMITD_RULES__RELOAD_DELAY", "100ms"),
    );
    assert!(running.serving_within(Duration::from_secs(10)));

    symlink(&secret, dir.path().join("leak.yaml")).unwrap();
    let refused = "Error loading new configuration: leak.yaml: points outside the rules folder";
    running.wait_log(refused, Duration::from_secs(10));
    let (_, rules) = common::http_request(running.http, "GET", "/rlconfig", "");
    assert!(
        rules.contains(&user_limit(1)) && !rules.contains("x."),
        "the old rules keep serving:\n{rules}"
    );

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ratelimitd"))
        .args(["check-config", dir.path().to_str().unwrap()])
        .env_clear()
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "error loading rate limit configs: leak.yaml: points outside the rules folder\n"
    );
    let log = running.log.lock().unwrap().clone();
    for text in [
        &log,
        &String::from_utf8_lossy(&out.stdout).into_owned(),
        &String::from_utf8_lossy(&out.stderr).into_owned(),
    ] {
        assert!(
            !text.contains(SECRET),
            "the linked file's content shows:\n{text}"
        );
    }
}

/// A rules folder whose parent folders are not there at start either (a volume mounted later, a path
/// made with `mkdir -p`): the service warns and serves no rules, then loads them once the path is made,
/// and again after the path is removed several folders up and made anew. While it is missing, the
/// folders above it made one by one, or a change to the folder watched, are no failed loads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rules_folder_whose_parents_come_later_is_loaded_when_it_comes() {
    use std::os::unix::fs::PermissionsExt;
    let base = tempfile::tempdir().unwrap();
    let top = base.path().join("srv");
    let dir = top.join("runtime_data/current/config");
    let root = dir.clone();
    let s = TestServer::start(&[], move |s| {
        s.rules.path = Some(root);
        s.rules.reload_delay = RELOAD_DELAY;
    })
    .await;
    let started = wait_loads(&s, "nothing there", |(ok, _)| ok >= 1).await;

    fs::set_permissions(base.path(), fs::Permissions::from_mode(0o755)).unwrap();
    for folder in [
        top.clone(),
        top.join("runtime_data"),
        dir.parent().unwrap().into(),
    ] {
        fs::create_dir(&folder).unwrap();
        tokio::time::sleep(RELOAD_DELAY * 3).await;
    }
    assert_eq!(loads(&s).await, started, "the path made folder by folder");
    fs::create_dir(&dir).unwrap();
    fs::write(dir.join("web.yaml"), V1).unwrap();
    wait_rules(&s, "the path made", |t| t.contains(&user_limit(1))).await;
    assert_eq!(loads(&s).await.1, 0, "no failed load on the way");

    fs::remove_dir_all(&top).unwrap();
    wait_loads(&s, "the path removed", |(_, errors)| errors >= 1).await;
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join("web.yaml"), V2).unwrap();
    wait_rules(&s, "the path made anew", |t| t.contains(&user_limit(7))).await;
    s.stop().await;
}
