//! A big rules file through `ratelimitd check-config`: within the default YAML node budget it loads, past
//! `rules.max_yaml_nodes` it is refused naming the file and the setting. In a file of its own because
//! parsing some 330 000 YAML nodes keeps a core busy for seconds in a debug build, which would disturb the
//! timing-sensitive tests of `tests/cli.rs` running beside it.

use std::process::Command;

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
