//! What a `/json` body can make the service allocate while reading it: about its own size, whatever its
//! shape (a generic JSON tree costs up to a hundred times the body for small objects), and a body with
//! more descriptors or entries than allowed is refused as it is read.

mod common;

use common::measure::{bytes_allocated, Measuring};
use ratelimitd::{api::json::parse_request, limiter::RequestLimits};

#[global_allocator]
static GLOBAL: Measuring = Measuring;

/// The largest body `/json` takes with the default limits: four times `request_limits.max_message_bytes`.
const BODY: usize = 4 * 65_536;

/// `head`, then `item` repeated (comma-separated) until the body is about BODY bytes, then `tail`.
fn body(head: &str, item: &str, tail: &str) -> Vec<u8> {
    let mut out = head.to_string();
    while out.len() + item.len() + tail.len() < BODY {
        if !out.ends_with('[') {
            out.push(',');
        }
        out.push_str(item);
    }
    out.push_str(tail);
    out.into_bytes()
}

#[test]
fn reading_a_json_body_costs_about_its_size() {
    let limits = RequestLimits::default();
    let max_values = format!(r#"{{"key":"k","value":"{}"}}"#, "v".repeat(1024));
    let shapes = [
        // The biggest request that is decided: 64 descriptors of 16 entries with 1 KiB values.
        (
            "allowed",
            format!(
                r#"{{"domain":"d","descriptors":[{}]}}"#,
                vec![format!(r#"{{"entries":[{}]}}"#, [max_values.as_str(); 3].join(",")); 64]
                    .join(",")
            )
            .into_bytes(),
        ),
        // Shapes that cost the most per byte as a JSON tree: tiny objects, refused.
        ("many descriptors", body(r#"{"descriptors":["#, "{}", "]}")),
        (
            "many entries",
            body(r#"{"descriptors":[{"entries":["#, r#"{"key":"k"}"#, "]}]}"),
        ),
        (
            "an unknown field of small objects",
            body(r#"{"domain":"d","extra":["#, r#"{"a":0}"#, "]}"),
        ),
    ];
    for (name, body) in shapes {
        assert!(body.len() <= BODY, "{name}: {} bytes", body.len());
        let (parsed, bytes) = bytes_allocated(|| parse_request(&body, &limits));
        // For the record: what a generic JSON tree of the same body costs.
        let (_, tree) = bytes_allocated(|| serde_json::from_slice::<serde_json::Value>(&body));
        eprintln!(
            "{name}: {} bytes of body, {bytes} allocated ({tree} as a JSON tree), {:?}",
            body.len(),
            parsed.as_ref().map(|r| r.descriptors.len())
        );
        assert_eq!(parsed.is_ok(), name == "allowed", "{name}: {parsed:?}");
        assert!(
            bytes <= 2 * body.len() + (64 << 10),
            "{name}: {bytes} bytes allocated for {} bytes",
            body.len()
        );
    }
}
