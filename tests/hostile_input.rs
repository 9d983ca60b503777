//! Hostile input, generated: rules files and requests built to break the parser and the limiter, run
//! for a bounded number of cases in every test run. Nothing may panic, hang or grow without bound;
//! every refusal must say what is wrong. Inputs that once broke something stay here as named cases.

mod common;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use proptest::prelude::*;
use ratelimitd::{
    clock::Clock,
    limiter::{Descriptor, Entry, LimitError, LimitOverride, Limiter, Options, Request},
    rules::{parse_file, RuleSet, Rules, Unit},
    settings::RequestLimits,
    store::{MemoryStore, Store},
};

/// Parses and builds one rules file; `Err` is fine, a panic is not.
fn load(text: &str) -> Result<(), String> {
    let file = parse_file(text).map_err(|e| e.to_string())?;
    RuleSet::build(&[("fuzz.yaml".into(), file)], false)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Words the rules format knows, so generated documents reach past the YAML parser into validation.
const WORDS: &[&str] = &[
    "domain",
    "descriptors",
    "key",
    "value",
    "rate_limit",
    "rate_limits",
    "unit",
    "requests_per_unit",
    "unlimited",
    "name",
    "replaces",
    "shadow_mode",
    "quota_mode",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    "algorithm",
    "burst",
    "unit_multiplier",
    "second",
    "minute",
    "hour",
    "day",
    "week",
    "month",
    "year",
    "sliding_log",
    "gcra",
    "token_bucket",
    "true",
    "false",
    "-1",
    "0",
    "4294967296",
    "cidr:10.0.0.0/8",
    "cidr:::/0",
    "cidr:300.1.1.1/99",
    "*",
    "a*b*",
    "",
    "~",
    "null",
    "&a",
    "*a",
    "!!binary",
];

/// YAML-shaped text: nested maps and lists of the format's words and random scalars.
fn yamlish() -> impl Strategy<Value = String> {
    let scalar = prop_oneof![
        prop::sample::select(WORDS).prop_map(str::to_owned),
        "[a-z_]{0,12}",
        any::<i64>().prop_map(|n| n.to_string()),
        "\\PC{0,20}",
    ];
    let leaf = scalar.prop_map(|s| format!("{s:?}"));
    leaf.prop_recursive(6, 64, 6, |inner| {
        prop_oneof![
            prop::collection::vec((prop::sample::select(WORDS), inner.clone()), 0..6).prop_map(
                |pairs| {
                    let body: Vec<String> = pairs
                        .into_iter()
                        .map(|(k, v)| format!("{k:?}: {v}"))
                        .collect();
                    format!("{{{}}}", body.join(", "))
                }
            ),
            prop::collection::vec(inner, 0..6).prop_map(|items| format!("[{}]", items.join(", "))),
        ]
    })
    .prop_map(|body| format!("domain: fuzz\ndescriptors: {body}\n"))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, .. ProptestConfig::default() })]

    #[test]
    fn the_rules_parser_survives_arbitrary_text(text in "\\PC{0,400}") {
        let _ = load(&text);
    }

    #[test]
    fn the_rules_parser_survives_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        let _ = load(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn the_rules_parser_survives_rules_shaped_documents(text in yamlish()) {
        if let Err(message) = load(&text) {
            prop_assert!(!message.trim().is_empty(), "an empty error message for {}", text);
        }
    }
}

#[test]
fn alias_bombs_and_deep_nesting_are_refused_quickly() {
    // Billion laughs: nine levels of ten aliases each.
    let mut bomb = String::from("a: &a [\"lol\"]\n");
    for level in 1..10 {
        let prev = (b'a' + level - 1) as char;
        let name = (b'a' + level) as char;
        let refs = vec![format!("*{prev}"); 10].join(", ");
        bomb.push_str(&format!("{name}: &{name} [{refs}]\n"));
    }
    bomb.push_str("domain: bomb\ndescriptors: *j\n");
    let deep_lists = format!(
        "domain: deep\ndescriptors: {}{}\n",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let deep_rules = {
        let mut text = String::from("domain: deep\ndescriptors:\n");
        for depth in 0..2_000 {
            let pad = "  ".repeat(depth);
            text.push_str(&format!("{pad}- key: k{depth}\n{pad}  descriptors:\n"));
        }
        text
    };
    for (name, text) in [
        ("alias bomb", bomb),
        ("deep lists", deep_lists),
        ("deep rules", deep_rules),
    ] {
        let started = Instant::now();
        let result = load(&text);
        let took = started.elapsed();
        assert!(took < Duration::from_secs(5), "{name} took {took:?}");
        if let Err(message) = &result {
            assert!(!message.is_empty(), "{name}");
        }
        eprintln!(
            "{name}: {took:?}, {:?}",
            result.as_ref().map_err(|m| &m[..m.len().min(120)])
        );
    }
}

const RULES: &str = r#"
domain: d
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: api_key
    value: "k*"
    rate_limit: {unit: minute, requests_per_unit: 10, algorithm: sliding_log}
  - key: remote_address
    value: "cidr:10.0.0.0/8"
    rate_limit: {unit: hour, requests_per_unit: 5, algorithm: gcra, burst: 2}
  - key: remote_address
    descriptors:
      - key: path
        rate_limit: {unit: day, requests_per_unit: 100, algorithm: token_bucket}
"#;

fn limiter() -> Limiter {
    let rules = Rules::default();
    rules.replace(RuleSet::build(&[("d.yaml".into(), parse_file(RULES).unwrap())], false).unwrap());
    Limiter::new(
        Arc::new(rules),
        Arc::new(Store::Memory(MemoryStore::new(10_000))),
        Clock::System,
        Options {
            request_limits: RequestLimits {
                max_descriptors: 8,
                max_entries: 4,
                max_key_bytes: 32,
                max_value_bytes: 64,
                ..RequestLimits::default()
            },
            ..Options::default()
        },
    )
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(
            &[
                "user",
                "api_key",
                "remote_address",
                "path",
                "10.1.2.3",
                "k1",
                "",
                "d"
            ][..]
        )
        .prop_map(str::to_owned),
        "\\PC{0,80}",
    ]
}

fn requests() -> impl Strategy<Value = Request> {
    let unit = prop_oneof![
        Just(None),
        prop::sample::select(
            &[
                Unit::Second,
                Unit::Minute,
                Unit::Hour,
                Unit::Day,
                Unit::Week
            ][..]
        )
        .prop_map(Some),
    ];
    let descriptor = (
        prop::collection::vec((text(), text()), 0..6),
        prop::option::of((any::<u32>(), unit)),
        prop::option::of(prop_oneof![Just(0u64), Just(u64::MAX), any::<u64>()]),
    )
        .prop_map(|(entries, limit, hits_addend)| Descriptor {
            entries: entries
                .into_iter()
                .map(|(key, value)| Entry { key, value })
                .collect(),
            limit: limit.map(|(requests_per_unit, unit)| LimitOverride {
                requests_per_unit,
                unit,
            }),
            hits_addend,
        });
    (
        prop_oneof![Just("d".to_owned()), text()],
        prop::collection::vec(descriptor, 0..10),
        prop_oneof![Just(0u32), Just(u32::MAX), any::<u32>()],
    )
        .prop_map(|(domain, descriptors, hits_addend)| Request {
            domain,
            descriptors,
            hits_addend,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, failure_persistence: None, .. ProptestConfig::default() })]

    #[test]
    fn any_request_is_decided_or_refused_with_a_reason(request in requests()) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        let limiter = limiter();
        match runtime.block_on(limiter.should_rate_limit(&request)) {
            Ok(response) => prop_assert_eq!(response.statuses.len(), request.descriptors.len()),
            Err(err) => {
                prop_assert!(
                    err.is_invalid_request() || matches!(err, LimitError::Store(_)),
                    "unexpected error {:?}", err
                );
                prop_assert!(!err.to_string().is_empty());
            }
        }
    }
}

/// The limits of [`COUNTERS`]' rules: 10 per window, each with its own algorithm.
const COUNTERS: &str = r#"
domain: c
descriptors:
  - key: fixed
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: sliding
    rate_limit: {unit: hour, requests_per_unit: 10, algorithm: sliding_window}
  - key: log
    rate_limit: {unit: hour, requests_per_unit: 10, algorithm: sliding_log}
  - key: bucket
    rate_limit: {unit: hour, requests_per_unit: 10, algorithm: token_bucket}
  - key: gcra
    rate_limit: {unit: hour, requests_per_unit: 10, algorithm: gcra}
"#;

/// A request of one to four descriptors on a few counters (so that counters repeat within and across
/// requests), each with a cost from the small to the absurd.
fn costly_requests() -> impl Strategy<Value = Vec<(usize, usize, u64)>> {
    let cost = prop_oneof![
        Just(0u64),
        Just(1),
        Just(2),
        Just(10),
        Just(11),
        Just(1 << 63),
        Just(u64::MAX),
        any::<u64>(),
    ];
    prop::collection::vec((0usize..5, 0usize..2, cost), 1..5)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, .. ProptestConfig::default() })]

    /// Sequences of costly requests on repeated counters: every one decided, and no counter ever admits
    /// more than its limit of 10 (an hour is longer than the test).
    #[test]
    fn costs_and_repeated_counters_never_break_or_exceed_a_limit(
        requests in prop::collection::vec(costly_requests(), 1..30)
    ) {
        let keys = ["fixed", "sliding", "log", "bucket", "gcra"];
        let rules = Rules::default();
        rules.replace(RuleSet::build(&[("c.yaml".into(), parse_file(COUNTERS).unwrap())], false).unwrap());
        let limiter = Limiter::new(
            Arc::new(rules),
            Arc::new(Store::Memory(MemoryStore::new(1_000))),
            Clock::manual(1_000_000),
            Options::default(),
        );
        let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        let mut admitted = std::collections::HashMap::<(usize, usize), u64>::new();
        for descriptors in requests {
            let request = Request {
                domain: "c".into(),
                descriptors: descriptors
                    .iter()
                    .map(|&(key, value, cost)| Descriptor {
                        entries: vec![Entry { key: keys[key].into(), value: format!("v{value}") }],
                        limit: None,
                        hits_addend: Some(cost),
                    })
                    .collect(),
                hits_addend: 0,
            };
            let response = runtime.block_on(limiter.should_rate_limit(&request));
            let response = match response {
                Ok(response) => response,
                Err(err) => return Err(TestCaseError::fail(format!("{err}"))),
            };
            prop_assert_eq!(response.statuses.len(), descriptors.len());
            if response.overall_code == ratelimitd::limiter::Code::Ok {
                for &(key, value, cost) in &descriptors {
                    let total = admitted.entry((key, value)).or_default();
                    *total = total.saturating_add(cost);
                    prop_assert!(*total <= 10, "{} v{} admitted {} hits", keys[key], value, total);
                }
            }
        }
    }
}

/// Raw bytes as the body of ShouldRateLimit over a real socket, and of `/json`: a refusal, never a
/// dropped connection or a dead server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_the_wire_is_refused_and_the_server_keeps_serving() {
    use proptest::{
        strategy::ValueTree,
        test_runner::{Config, TestRunner},
    };
    use prost::Message;

    let server = common::TestServer::start(&[("d.yaml", RULES)], |_| {}).await;
    let channel = server.channel().await;
    let mut runner = TestRunner::new(Config {
        cases: 300,
        failure_persistence: None,
        ..Config::default()
    });
    let mut refused = 0;
    let mut decided = 0;
    let valid = common::request(
        "d",
        vec![
            common::descriptor(&[("user", "u1")]),
            common::descriptor(&[("remote_address", "10.0.0.1"), ("path", "/a")]),
        ],
    )
    .encode_to_vec();
    for case in 0..300 {
        let noise = prop::collection::vec(any::<u8>(), 0..300)
            .new_tree(&mut runner)
            .unwrap()
            .current();
        // Half pure noise, half a valid request with bytes overwritten: past the first bytes of decoding.
        let bytes = if case % 2 == 0 {
            noise
        } else {
            let mut b = valid.clone();
            for (i, n) in noise.iter().take(1 + case % 3).enumerate() {
                let at = (*n as usize * 7 + i * 13) % b.len();
                b[at] = noise[(i + 4) % noise.len().max(1)].wrapping_add(*n);
            }
            b
        };
        let mut grpc = tonic::client::Grpc::new(channel.clone());
        grpc.ready().await.unwrap();
        let path = tonic::codegen::http::uri::PathAndQuery::from_static(
            "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        );
        let answer = grpc
            .unary::<Vec<u8>, Vec<u8>, _>(tonic::Request::new(bytes.clone()), path, RawCodec)
            .await;
        match answer {
            Ok(reply) => {
                ratelimitd::proto::RateLimitResponse::decode(&reply.into_inner()[..]).unwrap();
                decided += 1;
            }
            Err(status) => {
                assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
                assert!(!status.message().is_empty());
                refused += 1;
            }
        }
        let (code, _) = server
            .http("POST", "/json", &String::from_utf8_lossy(&bytes))
            .await;
        assert!([200, 400, 429].contains(&code), "/json answered {code}");
    }
    eprintln!("garbage: {decided} decoded and decided, {refused} refused");
    assert!(refused > 0);
    // Oversized: over request_limits.max_message_bytes, refused naming the setting.
    let mut client = server.client().await;
    let big = common::request(
        "d",
        vec![common::descriptor(&[("user", &"x".repeat(100_000))])],
    );
    let status = client.should_rate_limit(big).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(
        status
            .message()
            .contains("request_limits.max_message_bytes"),
        "{}",
        status.message()
    );
    let (code, text) = server.http("POST", "/json", &"x".repeat(1 << 20)).await;
    assert_eq!(code, 413);
    assert!(text.contains("request_limits.max_message_bytes"), "{text}");
    // A body declared past the bound is refused at once, not waited for.
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(server.http_addr)
            .await
            .unwrap();
        let head = "POST /json HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000000\r\n\r\n{";
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut answer = vec![0; 512];
        let n = tokio::time::timeout(std::time::Duration::from_secs(2), stream.read(&mut answer))
            .await
            .expect("answered at once")
            .unwrap();
        let answer = String::from_utf8_lossy(&answer[..n]);
        assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    }
    // Still serving.
    let ok = client
        .should_rate_limit(common::request(
            "d",
            vec![common::descriptor(&[("user", "after")])],
        ))
        .await
        .unwrap();
    assert_eq!(ok.into_inner().overall_code, 1);
    // Every request is counted, those refused before they could be read among the errors: 300 and 300
    // of garbage, the three oversized ones, the last.
    let mut total = 0.0;
    for result in ["ok", "over_limit", "error"] {
        let series = format!("ratelimitd_requests_total{{result=\"{result}\"}}");
        total += server.metric(&series).await.unwrap_or(0.0);
    }
    assert_eq!(total, 604.0);
    let invalid = server
        .metric("ratelimitd_request_errors_total{kind=\"invalid_request\"}")
        .await;
    let error = server
        .metric("ratelimitd_requests_total{result=\"error\"}")
        .await;
    assert_eq!(invalid, error);
    assert!(invalid.unwrap() >= refused as f64 + 2.0, "{invalid:?}");
    server.stop().await;
}

/// Sends and receives protobuf bytes as they are.
#[derive(Debug, Clone, Copy, Default)]
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }
    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        use bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        use bytes::Buf;
        let mut out = vec![0; src.remaining()];
        src.copy_to_slice(&mut out);
        Ok(Some(out))
    }
}
