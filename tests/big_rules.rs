//! A big rules file through `ratelimitd check-config`: within the default YAML node budget it loads, past
//! `rules.max_yaml_nodes` it is refused naming the file and the setting; and through a running service,
//! whose `/rlconfig` is written once for all the callers that ask, and `/metrics` once or twice for all
//! the scrapes that come at once. In a file of its own because parsing
//! some 330 000 YAML nodes keeps a core busy for seconds in a debug build, which would disturb the
//! timing-sensitive tests of `tests/cli.rs` running beside it.

mod common;

use std::{
    process::Command,
    time::{Duration, Instant},
};

use common::measure::{bytes_allocated, Measuring};

use ratelimitd::{
    limiter::Entry,
    rules::{DescriptorSpec, DomainFile, RateLimitSpec, RuleSet},
};

#[global_allocator]
static GLOBAL: Measuring = Measuring;

fn check_config(dir: &std::path::Path, env: &[(&str, &str)]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ratelimitd"))
        .args(["check-config", "."])
        .env_clear()
        .envs(env.iter().copied())
        .current_dir(dir)
        .output()
        .unwrap()
}

/// A rules file of `n` descriptors, each with a value and a limit: 11 YAML nodes apiece.
fn big_rules(n: usize) -> String {
    let mut text = String::from("domain: big\ndescriptors:\n");
    for i in 0..n {
        text.push_str(&format!(
            "  - key: user\n    value: u{i}\n    rate_limit: {{unit: minute, requests_per_unit: 10}}\n"
        ));
    }
    text
}

#[test]
fn a_big_rules_file_loads_within_the_default_yaml_budget_and_the_bound_is_a_setting() {
    // 30 000 descriptors are some 330 000 YAML nodes: over the parser's own default of 250 000, well
    // within rules.max_yaml_nodes (1 000 000).
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("big.yaml"), big_rules(30_000)).unwrap();
    let out = check_config(dir.path(), &[]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "all rate limit configs ok\n"
    );
    assert_eq!(out.status.code(), Some(0));

    // Past the bound, the file is refused with its name and the setting to raise.
    let out = check_config(
        dir.path(),
        &[("RATELIMITD_RULES__MAX_YAML_NODES", "300000")],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.starts_with(
            "error loading rate limit configs: big.yaml: error loading config file: yaml: line "
        ) && text.contains("the file has more than 300000 YAML nodes")
            && text.contains("raise rules.max_yaml_nodes"),
        "{text}"
    );
}

/// Many wildcard and `cidr:` rules under one key load too. Each rule used to be checked against all of
/// its siblings before it (and each network moved every shorter one), which made 30 000 of them take
/// 15 to 19 s in a debug build against 5 s now.
#[test]
fn a_level_of_many_wildcards_and_networks_loads() {
    let dir = tempfile::tempdir().unwrap();
    let mut text = String::from("domain: patterns\ndescriptors:\n");
    for i in 0..15_000 {
        // Networks of two prefix lengths, alternating, so that each must go before the other.
        let (prefix, host) = if i % 2 == 0 { (24, 0) } else { (32, 1) };
        text.push_str(&format!(
            "  - key: user\n    value: \"*{i}\"\n    rate_limit: {{unit: minute, requests_per_unit: 10}}\n  - key: remote_address\n    value: \"cidr:10.{}.{}.{host}/{prefix}\"\n    rate_limit: {{unit: minute, requests_per_unit: 10}}\n",
            i / 256,
            i % 256
        ));
    }
    std::fs::write(dir.path().join("patterns.yaml"), text).unwrap();
    let out = check_config(dir.path(), &[]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "all rate limit configs ok\n"
    );
    assert_eq!(out.status.code(), Some(0));
}

/// A rule costs its own key and value, however deep it is written and however long the keys above it
/// are. Each rule used to carry its own copy of every level above it, and its full key as a string: a
/// rules file of 589 KB (a 200 000-byte key with 20 000 rules under it) took 9.2 GB and 26 s to
/// check, and an xDS resource of a few megabytes could take the service's memory whole.
#[test]
fn a_rule_costs_what_is_written_of_it_not_its_depth() {
    let leaf = |i: usize| DescriptorSpec {
        key: format!("k{i}"),
        rate_limit: Some(RateLimitSpec {
            unit: "minute".into(),
            requests_per_unit: 10,
            ..RateLimitSpec::default()
        }),
        ..DescriptorSpec::default()
    };
    // A long key at the top, then a chain of 90 levels (as deep as an xDS resource can nest), then
    // 2 000 rules at the bottom.
    let long_key = "x".repeat(64 * 1024);
    let mut chain = DescriptorSpec {
        key: "bottom".into(),
        descriptors: (0..2_000).map(leaf).collect(),
        ..DescriptorSpec::default()
    };
    for depth in (0..90).rev() {
        chain = DescriptorSpec {
            key: format!("level{depth}"),
            descriptors: vec![chain],
            ..DescriptorSpec::default()
        };
    }
    let top = DescriptorSpec {
        key: long_key.clone(),
        descriptors: vec![chain],
        ..DescriptorSpec::default()
    };
    let file = DomainFile {
        domain: "deep".into(),
        descriptors: vec![top],
        ignored: Vec::new(),
    };
    let written = long_key.len() + 91 * "level00".len() + 2_000 * "k0000".len();

    let files = [("deep.yaml".to_owned(), file)];
    let (set, bytes) = bytes_allocated(|| RuleSet::build(&files, false).unwrap());
    eprintln!("{written} bytes written, {bytes} bytes allocated to build the rules");
    // What is written (twice over: the rules keep each key and value, and each level the composite
    // key it checks duplicates by), and some hundreds of bytes per rule for its node, limit and place
    // in its level (1.5 KB when this was written, with the levels' tables growing). With a copy of the
    // path above each rule, building these rules allocated 703 MB.
    let budget = 2 * written + 2_100 * 2_000;
    assert!(
        bytes < budget,
        "building the rules allocated {bytes} bytes, over {budget}"
    );

    // And the rules still match and name themselves in full.
    let entry = |key: &str| Entry {
        key: key.to_owned(),
        value: "v".to_owned(),
    };
    let mut entries = vec![entry(&long_key)];
    entries.extend((0..90).map(|depth| entry(&format!("level{depth}"))));
    entries.push(entry("bottom"));
    entries.push(entry("k1999"));
    let rule = set.domains["deep"]
        .find(&entries)
        .expect("the deepest rule");
    assert_eq!(rule.limit().map(|l| l.requests_per_unit), Some(10));
    let full_key = rule.full_key();
    assert!(full_key.starts_with(&format!("deep.{long_key}.level0.level1.")));
    assert!(full_key.ends_with(".level89.bottom.k1999"));
    assert_eq!(rule.path().len(), 93);
}

/// A key made of many `_`s loads at once. To find a duplicate written either as `key: a_b` or as `key: a,
/// value: b`, each `_` of a rule's key used to be tried as the place where key and value meet, hashing
/// the text on both sides each time: a key of 1 MB of `_`s took 17 s to check in a release build, and the
/// 4 MB an xDS message may carry some 5 minutes of a runtime worker. Duplicates are now found by the
/// whole composite key, in one lookup. The bound below only tells a hang from an answer.
#[test]
fn a_key_of_many_underscores_loads_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let key = "_".repeat(2 * 1024 * 1024);
    std::fs::write(
        dir.path().join("underscores.yaml"),
        format!("domain: d\ndescriptors:\n  - key: x\n  - key: a{key}\n  - key: x_{key}\n"),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_ratelimitd"))
        .args(["check-config", "."])
        .env_clear()
        .current_dir(dir.path())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("check-config still busy after 60 s with a key of 2 MB of '_'");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "all rate limit configs ok\n"
    );
}

/// 10 000 rules of two levels under keys of 200 bytes (`t...` = `v<i>`, then `p...`), started.
fn serving_wide_rules(dir: &std::path::Path) -> common::Running {
    let (tenant, path) = ("t".repeat(200), "p".repeat(200));
    let mut text = String::from("domain: big\ndescriptors:\n");
    for i in 0..10_000 {
        text.push_str(&format!(
            "  - key: {tenant}\n    value: v{i}\n    rate_limit: {{unit: second, requests_per_unit: 10}}\n    \
             descriptors:\n      - key: {path}\n        rate_limit: {{unit: minute, requests_per_unit: 100}}\n"
        ));
    }
    std::fs::write(dir.join("big.yaml"), text).unwrap();
    let running = common::start_binary(&mut common::binary(dir));
    assert!(running.serving_within(Duration::from_secs(60)));
    running
}

/// `path` asked by 32 callers at once after one caller: each is answered 200 with what `same` says of
/// the first answer; returns the first answer and how much the process's peak memory grew meanwhile.
fn asked_at_once(
    running: &common::Running,
    path: &'static str,
    same: impl Fn(&str, &str) -> bool,
) -> (String, u64) {
    let (code, one) = common::http_request(running.http, "GET", path, "");
    assert_eq!(code, 200);
    let before = common::measure::peak_bytes(running.child.id());
    let callers: Vec<_> = (0..32)
        .map(|_| {
            let http = running.http;
            std::thread::spawn(move || common::http_request(http, "GET", path, ""))
        })
        .collect();
    for caller in callers {
        let (code, text) = caller.join().unwrap();
        assert_eq!(code, 200);
        assert!(same(&one, &text), "{path}: an answer unlike the first");
    }
    let grown = common::measure::peak_bytes(running.child.id()).saturating_sub(before);
    eprintln!(
        "32 callers of a {} byte {path}: the process grew by {grown} bytes at most",
        one.len()
    );
    (one, grown)
}

#[test]
fn many_callers_of_rlconfig_at_once_share_one_text() {
    let dir = tempfile::tempdir().unwrap();
    let running = serving_wide_rules(dir.path());
    let (one, grown) = asked_at_once(&running, "/rlconfig", |a, b| a == b);
    assert_eq!(one.lines().count(), 20_000);
    assert!(
        grown < 4 * one.len() as u64,
        "32 callers of a {} byte /rlconfig grew the process by {grown} bytes",
        one.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_scrapes_at_once_cost_a_writing_or_two_and_each_holds_what_came_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let running = serving_wide_rules(dir.path());
    let (tenant, path) = ("t".repeat(200), "p".repeat(200));
    let mut client =
        ratelimitd::proto::RateLimitServiceClient::connect(format!("http://{}", running.grpc))
            .await
            .unwrap();
    // A hit on every nested rule: 10 000 rule series.
    for first in (0..10_000).step_by(32) {
        let descriptors = (first..first + 32)
            .map(|i| common::descriptor(&[(&tenant, &format!("v{i}")), (&path, "x")]))
            .collect();
        client
            .should_rate_limit(common::request("big", descriptors))
            .await
            .unwrap();
    }
    let series = |text: &str| {
        text.lines()
            .filter(|l| l.starts_with("ratelimit_service_rate_limit_total_hits{"))
            .count()
    };
    let (one, grown) = asked_at_once(&running, "/metrics", |a, b| series(a) == series(b));
    assert_eq!(series(&one), 10_000);
    assert!(
        grown < 4 * one.len() as u64,
        "32 scrapes of {} bytes grew the process by {grown} bytes",
        one.len()
    );

    // One after the other, each scrape shows the hit made just before it.
    let hits_line = format!("rule=\"{tenant}_v7\"}} ");
    for want in 1..4 {
        let request = common::request("big", vec![common::descriptor(&[(&tenant, "v7")])]);
        client.should_rate_limit(request).await.unwrap();
        let (_, text) = common::http_request(running.http, "GET", "/metrics", "");
        let total = text
            .lines()
            .find(|l| {
                l.starts_with("ratelimit_service_rate_limit_total_hits{") && l.contains(&hits_line)
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok());
        assert_eq!(total, Some(want), "after hit {want}");
    }
}
