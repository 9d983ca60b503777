//! Every metric the alerts and the dashboard in deploy/monitoring/ use is one ratelimitd exports.

mod common;

use std::collections::BTreeSet;

use common::{ask, descriptor, request, TestServer};

const RULES: &str = "domain: web\ndescriptors:\n  - key: user\n    shadow_mode: false\n    rate_limit: {unit: minute, requests_per_unit: 1}\n  - key: preview\n    shadow_mode: true\n    rate_limit: {unit: minute, requests_per_unit: 1}\n";

/// Every `expr` string anywhere in a JSON/YAML tree.
fn exprs(value: &serde_json::Value, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v) {
                    ("expr", serde_json::Value::String(e)) => out.push(e.clone()),
                    _ => exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| exprs(v, out)),
        _ => {}
    }
}

/// Identifiers in a PromQL expression that name ratelimitd metrics.
fn metric_names(expr: &str) -> BTreeSet<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|w| w.starts_with("ratelimit") || w.starts_with("rate_limit"))
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alerts_and_dashboard_use_only_exported_metrics() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/monitoring");
    let alerts: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(root.join("alerts.yaml")).unwrap())
            .unwrap();
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("dashboard.json")).unwrap())
            .unwrap();
    let mut all = Vec::new();
    exprs(&alerts, &mut all);
    let alert_count = all.len();
    exprs(&dashboard, &mut all);
    assert_eq!(alert_count, 8, "the eight alerts");
    assert!(all.len() > alert_count + 8, "dashboard panels have queries");

    // Traffic that makes every family appear: allowed, denied, shadow and error answers.
    let s = TestServer::start(&[("web.yaml", RULES)], |_| {}).await;
    let mut c = s.client().await;
    for d in ["user", "user", "preview", "preview"] {
        ask(&mut c, request("web", vec![descriptor(&[(d, "x")])])).await;
    }
    c.should_rate_limit(request("", vec![descriptor(&[("user", "x")])]))
        .await
        .unwrap_err();
    let (_, mut text) = s.http("GET", "/metrics", "").await;
    // And what a replica taking its rules over xDS exports beside (its control plane unreachable).
    let xds = TestServer::start(&[], |s| {
        s.rules.config_type = ratelimitd::settings::ConfigType::GrpcXdsSotw;
        s.xds.server_url = "127.0.0.1:9".into();
        s.xds.force_start_without_initial_config = true;
    })
    .await;
    text.push_str(&xds.http("GET", "/metrics", "").await.1);
    xds.stop().await;
    let exported: BTreeSet<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .collect();

    for expr in &all {
        for name in metric_names(expr) {
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix))
                .unwrap_or(&name);
            assert!(
                exported.contains(family),
                "{name} (in `{expr}`) is not exported; exported: {exported:?}"
            );
        }
    }
    s.stop().await;
}
