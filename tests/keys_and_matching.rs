//! Requests that the reference service cannot tell apart, told apart: an entry key only ever matches rules
//! written with exactly that key, and descriptors whose parts join to the same text count in their own
//! counters (every algorithm but the fixed window, which keeps the reference's Redis layout).

mod common;

use common::{descriptor, request, TestServer};
use ratelimitd::proto::{rate_limit_response::Code, RateLimitResponse, RateLimitServiceClient};
use tonic::transport::Channel;

async fn ask(
    c: &mut RateLimitServiceClient<Channel>,
    entries: &[(&str, &str)],
) -> RateLimitResponse {
    common::ask(c, request("web", vec![descriptor(entries)])).await
}

const MATCHING: &str = r#"
domain: web
descriptors:
  - key: api
    value: "*"
    rate_limit: {unit: minute, requests_per_unit: 5, name: any_api}
  - key: a
    value: b_c
    rate_limit: {unit: minute, requests_per_unit: 5, name: a_is_b_c}
"#;

#[tokio::test]
async fn an_entry_key_never_reaches_the_rules_of_a_shorter_key() {
    let s = TestServer::start(&[("web.yaml", MATCHING)], |_| {}).await;
    let mut c = s.client().await;
    let mut limit_name = async |entries: &[(&str, &str)]| {
        let resp = ask(&mut c, entries).await;
        resp.statuses[0]
            .current_limit
            .as_ref()
            .map(|l| l.name.clone())
    };
    // The reference joins key and value before looking up: `api_key_x` fits `api_*`, and `a_b_c` is
    // `a_b_c` whichever `_` separates the key from the value.
    assert_eq!(limit_name(&[("api_key", "x")]).await, None);
    assert_eq!(limit_name(&[("a_b", "c")]).await, None);
    // The entries the rules were written for match as before.
    assert_eq!(
        limit_name(&[("api", "key_x")]).await.as_deref(),
        Some("any_api")
    );
    assert_eq!(
        limit_name(&[("a", "b_c")]).await.as_deref(),
        Some("a_is_b_c")
    );
    s.stop().await;
}

/// One limit of 1 per minute on `user`, and one on `user` + `path`, with the given algorithm.
fn joined_rules(algorithm: &str) -> String {
    format!(
        r#"
domain: web
descriptors:
  - key: user
    rate_limit: {{unit: minute, requests_per_unit: 1, algorithm: {algorithm}}}
    descriptors:
      - key: path
        rate_limit: {{unit: minute, requests_per_unit: 1, algorithm: {algorithm}}}
"#
    )
}

/// Sends `[user="u_path_/login"]`, then `[user=u, path=/login]`: the same counter key under the reference
/// layout. Returns both overall codes.
async fn joined_then_apart(s: &TestServer) -> (i32, i32) {
    let mut c = s.client().await;
    let joined = ask(&mut c, &[("user", "u_path_/login")]).await;
    let apart = ask(&mut c, &[("user", "u"), ("path", "/login")]).await;
    (joined.overall_code, apart.overall_code)
}

#[tokio::test]
async fn descriptors_joining_to_the_same_text_count_apart_in_memory() {
    for algorithm in ["sliding_window", "sliding_log", "token_bucket", "gcra"] {
        let s = TestServer::start(&[("web.yaml", &joined_rules(algorithm))], |_| {}).await;
        assert_eq!(
            joined_then_apart(&s).await,
            (Code::Ok as i32, Code::Ok as i32),
            "{algorithm}: each descriptor has its own limit of 1"
        );
        s.stop().await;
    }
}

#[tokio::test]
async fn fixed_windows_keep_the_reference_layout_and_its_ambiguity() {
    // Documented: a fleet moving from the reference service shares its counters, ambiguity included.
    let s = TestServer::start(&[("web.yaml", &joined_rules("fixed_window"))], |_| {}).await;
    assert_eq!(
        joined_then_apart(&s).await,
        (Code::Ok as i32, Code::OverLimit as i32)
    );
    s.stop().await;
}

/// A value YAML would read as a number or a boolean matches the request value written the same way, as
/// with the reference (whose decoder gives a text field the scalar as written): `0x1F`, not `31`.
#[tokio::test]
async fn rules_written_as_numbers_or_booleans_match_their_text() {
    const RULES: &str = r#"
domain: web
descriptors:
  - {key: status, value: 0x1F, rate_limit: {unit: minute, requests_per_unit: 5, name: hex}}
  - {key: beta, value: True, rate_limit: {unit: minute, requests_per_unit: 5, name: beta}}
  - {key: phone, value: +441234567890, rate_limit: {unit: minute, requests_per_unit: 5, name: phone}}
"#;
    let s = TestServer::start(&[("web.yaml", RULES)], |_| {}).await;
    let mut c = s.client().await;
    for (key, as_written, as_typed, name) in [
        ("status", "0x1F", "31", "hex"),
        ("beta", "True", "true", "beta"),
        ("phone", "+441234567890", "441234567890", "phone"),
    ] {
        let limit = |resp: RateLimitResponse| {
            resp.statuses[0]
                .current_limit
                .as_ref()
                .map(|l| l.name.clone())
        };
        let written = limit(ask(&mut c, &[(key, as_written)]).await);
        assert_eq!(written.as_deref(), Some(name), "{key}={as_written}");
        let typed = limit(ask(&mut c, &[(key, as_typed)]).await);
        assert_eq!(typed, None, "{key}={as_typed}");
    }
    s.stop().await;
}
