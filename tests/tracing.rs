//! Traces: ratelimitd (the binary) exports spans over OTLP/gRPC to an in-process collector, continuing
//! the caller's W3C trace context.

mod common;

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use opentelemetry_proto::tonic::{
    collector::trace::v1::{
        trace_service_server::{TraceService, TraceServiceServer},
        ExportTraceServiceRequest, ExportTraceServiceResponse,
    },
    common::v1::any_value::Value,
    trace::v1::Span,
};
use tokio_stream::wrappers::TcpListenerStream;

#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<Span>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for resource in request.into_inner().resource_spans {
            for scope in resource.scope_spans {
                spans.extend(scope.spans);
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_the_collector_under_the_callers_trace() {
    let collector = Collector::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(collector.clone()))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );

    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("config")).unwrap();
    std::fs::write(
        dir.path().join("config/web.yaml"),
        "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 5}\n",
    )
    .unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_ratelimitd"));
    cmd.env_clear().current_dir(dir.path()).envs([
        ("GRPC_HOST", "127.0.0.1"),
        ("GRPC_PORT", "0"),
        ("HOST", "127.0.0.1"),
        ("PORT", "0"),
        ("TRACING_ENABLED", "true"),
        ("TRACING_SERVICE_NAME", "ratelimitd-test"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
    ]);
    let mut running = common::start_binary(&mut cmd);

    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent_id = "00f067aa0ba902b7";
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
        format!("00-{trace_id}-{parent_id}-01").parse().unwrap(),
    );
    client.should_rate_limit(req).await.unwrap();

    // Stopping flushes the batch of spans.
    let pid = running.child.id().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let deadline = Instant::now() + Duration::from_secs(15);
    let (call, backend) = loop {
        {
            let spans = collector.spans.lock().unwrap();
            let call = spans.iter().find(|s| s.name == "ShouldRateLimit").cloned();
            let backend = spans.iter().find(|s| s.name == "backend call").cloned();
            if let (Some(call), Some(backend)) = (call, backend) {
                break (call, backend);
            }
        }
        assert!(Instant::now() < deadline, "no spans received");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(running.child.wait().unwrap().code(), Some(0));
    assert_eq!(
        hex(&call.trace_id),
        trace_id,
        "continues the caller's trace"
    );
    assert_eq!(hex(&call.parent_span_id), parent_id);
    assert_eq!(attribute(&call, "domain").as_deref(), Some("web"));
    assert_eq!(attribute(&call, "decision").as_deref(), Some("OK"));
    assert_eq!(
        backend.parent_span_id, call.span_id,
        "the backend call is a child of the check"
    );
    assert_eq!(attribute(&backend, "backend").as_deref(), Some("memory"));
}
