//! Requests that the reference service cannot tell apart, told apart: an entry key only ever matches rules
//! written with exactly that key.

mod common;

use common::{descriptor, request, TestServer};
use ratelimitd::proto::{RateLimitResponse, RateLimitServiceClient};
use tonic::transport::Channel;

async fn ask(
    c: &mut RateLimitServiceClient<Channel>,
    entries: &[(&str, &str)],
) -> RateLimitResponse {
    c.should_rate_limit(request("web", vec![descriptor(entries)]))
        .await
        .unwrap()
        .into_inner()
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
