//! Traces: ratelimitd (the binary) exports spans over OTLP/gRPC to an in-process collector, continuing
//! the caller's trace context, W3C (`traceparent`) or B3 (single `b3` header or `x-b3-*` headers), and
//! its sampling decision.

mod common;

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use opentelemetry_proto::tonic::{
    collector::trace::v1::{
        trace_service_server::{TraceService, TraceServiceServer},
        ExportTraceServiceRequest, ExportTraceServiceResponse,
    },
    common::v1::any_value::Value,
    resource::v1::Resource,
    trace::v1::Span,
};
use tokio_stream::wrappers::TcpListenerStream;

#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<Span>>>,
    /// The resource of each batch exported.
    resources: Arc<Mutex<Vec<Resource>>>,
}

impl Collector {
    /// A collector serving OTLP/gRPC on a free loopback port; returns it and its endpoint.
    async fn start() -> (Self, String) {
        Self::start_with(None).await
    }

    /// [`Collector::start`], over TLS with `tls` (an `https://localhost:<port>` endpoint) when given.
    async fn start_with(tls: Option<tonic::transport::ServerTlsConfig>) -> (Self, String) {
        let collector = Self::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let mut server = tonic::transport::Server::builder();
        let endpoint = match tls {
            Some(tls) => {
                server = server.tls_config(tls).unwrap();
                format!("https://localhost:{port}")
            }
            None => format!("http://127.0.0.1:{port}"),
        };
        tokio::spawn(
            server
                .add_service(TraceServiceServer::new(collector.clone()))
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );
        (collector, endpoint)
    }

    /// A resource attribute of the exported batches, as text.
    fn resource_attribute(&self, key: &str) -> Option<String> {
        let resources = self.resources.lock().unwrap();
        resources
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|a| a.key == key)
            .and_then(|a| match a.value.as_ref()?.value.as_ref()? {
                Value::StringValue(s) => Some(s.clone()),
                _ => None,
            })
    }
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for resource in request.into_inner().resource_spans {
            if let Some(r) = resource.resource {
                self.resources.lock().unwrap().push(r);
            }
            for scope in resource.scope_spans {
                spans.extend(scope.spans);
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// The binary with traces on and one rule, in `dir` (its rules in `dir/config`).
fn traced(dir: &std::path::Path) -> std::process::Command {
    std::fs::create_dir(dir.join("config")).unwrap();
    std::fs::write(
        dir.join("config/web.yaml"),
        "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 5}\n",
    )
    .unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_ratelimitd"));
    cmd.env_clear()
        .current_dir(dir)
        .envs(common::LOOPBACK)
        .env("TRACING_ENABLED", "true");
    cmd
}

fn attribute(span: &Span, key: &str) -> Option<String> {
    span.attributes.iter().find(|a| a.key == key).and_then(|a| {
        match a.value.as_ref()?.value.as_ref()? {
            Value::StringValue(s) => Some(s.clone()),
            Value::IntValue(i) => Some(i.to_string()),
            other => Some(format!("{other:?}")),
        }
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The server span of the call made under `trace_id`, if one was exported.
fn call_span(spans: &[Span], trace_id: &str) -> Option<Span> {
    spans
        .iter()
        .find(|s| s.name == "ShouldRateLimit" && hex(&s.trace_id) == trace_id)
        .cloned()
}

/// A trace a caller sent: how it was carried, and (trace id, the caller's span id).
type Traced<'a> = (&'a str, (&'a str, &'a str));

/// Each sampled call's span continues the caller's trace under the caller's span, with the store's
/// call beneath it; nothing at all is exported under an unsampled trace.
fn assert_traces_followed(spans: &[Span], sampled: &[Traced], unsampled: &[Traced]) {
    let names: Vec<(String, String)> = spans
        .iter()
        .filter(|s| s.name == "ShouldRateLimit" || s.name == "backend call")
        .map(|s| (s.name.clone(), hex(&s.trace_id)))
        .collect();

    for &(how, (trace_id, parent_id)) in sampled {
        let call = call_span(spans, trace_id)
            .unwrap_or_else(|| panic!("no span continues the {how} trace: {names:?}"));
        assert_eq!(
            hex(&call.parent_span_id),
            parent_id,
            "{how}: the caller's span is the parent"
        );
        assert_eq!(attribute(&call, "domain").as_deref(), Some("web"));
        assert_eq!(attribute(&call, "decision").as_deref(), Some("OK"));
        let backend = spans
            .iter()
            .find(|s| s.name == "backend call" && s.parent_span_id == call.span_id)
            .unwrap_or_else(|| panic!("{how}: no backend call under the check: {names:?}"));
        assert_eq!(attribute(backend, "backend").as_deref(), Some("memory"));
    }
    for &(how, (trace_id, _)) in unsampled {
        assert!(
            spans.iter().all(|s| hex(&s.trace_id) != trace_id),
            "{how}: the caller's decision not to sample is honoured: {names:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_the_collector_under_the_callers_w3c_or_b3_trace() {
    let (collector, endpoint) = Collector::start().await;

    let dir = tempfile::tempdir().unwrap();
    let mut cmd = traced(dir.path());
    cmd.envs([
        ("TRACING_SERVICE_NAME", "ratelimitd-test"),
        ("TRACING_SERVICE_NAMESPACE", "edge"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
    ]);
    let mut running = common::start_binary(&mut cmd);
    let mut client =
        ratelimitd::proto::RateLimitServiceClient::connect(format!("http://{}", running.grpc))
            .await
            .unwrap();

    // One call per way of carrying the caller's trace: (trace id, caller's span id, headers).
    let w3c = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let b3_single = ("80f198ee56343ba864fe8b2a57d3eff7", "e457b5a2e4d86bd1");
    let b3_multi = ("463ac35c9f6413ad48485a3953bb6124", "a2fb4a1d1a96d312");
    let b3_unsampled = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
    let b3_multi_unsampled = ("5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174");
    let calls: Vec<Vec<(&str, String)>> = vec![
        vec![("traceparent", format!("00-{}-{}-01", w3c.0, w3c.1))],
        vec![(
            "b3",
            format!("{}-{}-1-05e3ac9a4f6e3b90", b3_single.0, b3_single.1),
        )],
        vec![
            ("x-b3-traceid", b3_multi.0.to_string()),
            ("x-b3-spanid", b3_multi.1.to_string()),
            ("x-b3-parentspanid", "05e3ac9a4f6e3b90".to_string()),
            ("x-b3-sampled", "1".to_string()),
        ],
        vec![("b3", format!("{}-{}-0", b3_unsampled.0, b3_unsampled.1))],
        vec![
            ("x-b3-traceid", b3_multi_unsampled.0.to_string()),
            ("x-b3-spanid", b3_multi_unsampled.1.to_string()),
            ("x-b3-sampled", "0".to_string()),
        ],
    ];
    for headers in calls {
        let mut req = tonic::Request::new(common::request(
            "web",
            vec![common::descriptor(&[("user", "u")])],
        ));
        for (name, value) in headers {
            req.metadata_mut().insert(name, value.parse().unwrap());
        }
        client.should_rate_limit(req).await.unwrap();
    }

    // Stopping flushes the batch of spans; once the process is gone, everything has been exported.
    let exit = running.terminate(Duration::from_secs(15)).await;
    assert_eq!(exit.code(), Some(0));
    let spans = collector.spans.lock().unwrap().clone();
    let sampled = [
        ("W3C traceparent", w3c),
        ("B3 single header", b3_single),
        ("B3 multiple headers", b3_multi),
    ];
    let unsampled = [
        ("B3 single header", b3_unsampled),
        ("B3 multiple headers", b3_multi_unsampled),
    ];
    assert_traces_followed(&spans, &sampled, &unsampled);
    // The service, its namespace and this replica, as the reference names them.
    assert_eq!(
        collector.resource_attribute("service.name").as_deref(),
        Some("ratelimitd-test")
    );
    assert_eq!(
        collector.resource_attribute("service.namespace").as_deref(),
        Some("edge")
    );
    let instance = collector.resource_attribute("service.instance.id").unwrap();
    assert!(
        instance.len() == 36 && instance.chars().nth(14) == Some('4'),
        "not a random UUID: {instance}"
    );
    assert_eq!(
        spans.iter().filter(|s| s.name == "ShouldRateLimit").count(),
        3,
        "unsampled calls export nothing, not even a trace of their own"
    );
    // Only ratelimitd's own spans: not the HTTP/2, gRPC and Redis client internals beneath them.
    let foreign: Vec<&str> = spans
        .iter()
        .map(|s| s.name.as_str())
        .filter(|name| !["ShouldRateLimit", "backend call"].contains(name))
        .collect();
    assert!(
        foreign.is_empty(),
        "{} other spans: {:?}",
        foreign.len(),
        &foreign[..foreign.len().min(10)]
    );
}

/// A collector reached over TLS (an `https://` endpoint, the usual form for a collector outside the
/// pod) gets the spans; the service used to refuse to start on such an endpoint. The collector's CA is
/// trusted the way the system's are (`SSL_CERT_FILE`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_a_collector_over_tls() {
    let ca = common::certs::Ca::new("collector ca");
    let leaf = ca.leaf(&["localhost"], false);
    let identity = tonic::transport::Identity::from_pem(&leaf.cert, &leaf.key);
    let tls = tonic::transport::ServerTlsConfig::new().identity(identity);
    let (collector, endpoint) = Collector::start_with(Some(tls)).await;
    let dir = tempfile::tempdir().unwrap();
    let ca_file = common::certs::write(dir.path(), "ca.pem", &ca.pem());
    let mut cmd = traced(dir.path());
    cmd.envs([
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("SSL_CERT_FILE", ca_file.to_str().unwrap()),
        // A pod naming itself the standard way keeps its name.
        ("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=pod-7"),
    ]);
    let mut running = common::start_binary(&mut cmd);
    let mut client =
        ratelimitd::proto::RateLimitServiceClient::connect(format!("http://{}", running.grpc))
            .await
            .unwrap();
    let mut req = tonic::Request::new(common::request(
        "web",
        vec![common::descriptor(&[("user", "u")])],
    ));
    req.metadata_mut().insert(
        "traceparent",
        "00-3ce929d0e0e4736a4bf92f3577b34da6-00f067aa0ba902b7-01"
            .parse()
            .unwrap(),
    );
    client.should_rate_limit(req).await.unwrap();
    let exit = running.terminate(Duration::from_secs(15)).await;
    assert_eq!(exit.code(), Some(0), "{}", running.log.lock().unwrap());
    let spans = collector.spans.lock().unwrap().clone();
    assert!(
        spans.iter().any(|s| s.name == "ShouldRateLimit"),
        "no span over TLS; log:\n{}",
        running.log.lock().unwrap()
    );
    assert_eq!(
        collector
            .resource_attribute("service.instance.id")
            .as_deref(),
        Some("pod-7")
    );
}

/// A collector that cannot be reached loses the spans, and the log says so (once a minute at most),
/// naming the setting: the exporter's own diagnostics are off, and its failures were silent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_that_cannot_be_exported_are_logged_as_lost() {
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("http://127.0.0.1:{port}");
    let mut cmd = traced(dir.path());
    cmd.envs([
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ]);
    let running = common::start_binary(&mut cmd);
    let body = r#"{"domain":"web","descriptors":[{"entries":[{"key":"user","value":"u"}]}]}"#;
    assert_eq!(
        common::http_request(running.http, "POST", "/json", body).0,
        200
    );
    running.wait_log("trace export failed", Duration::from_secs(20));
    let log = running.log.lock().unwrap().clone();
    assert_eq!(log.matches("trace export failed").count(), 1, "{log}");
    assert!(log.contains("OTEL_EXPORTER_OTLP_ENDPOINT"), "{log}");
}
