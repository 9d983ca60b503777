//! Logging (`LOG_LEVEL`, `LOG_FORMAT`: text, or JSON lines with the reference's `@timestamp`, `level` and
//! `@message`), traces
//! (OpenTelemetry over OTLP/gRPC when `TRACING_ENABLED`, continuing the caller's W3C or B3 trace context),
//! metrics (Prometheus), and the statsd stream that sends them under the reference's stat names.

pub mod b3;
mod json_log;
pub mod metrics;
mod options;
pub mod statsd;
pub mod top;

pub use metrics::Metrics;
pub use options::{
    LogFormat, LogLevel, LogSettings, MetricsSettings, StatsdProtocol, StatsdSettings,
    TopOffendersSettings, TracingSettings,
};
pub use top::TopOffenders;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing_subscriber::{fmt, layer::SubscriberExt, util::SubscriberInitExt, EnvFilter, Layer};

/// Keeps the trace exporter alive; [`Telemetry::shutdown`] flushes the spans not yet sent.
#[derive(Debug, Default)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Sends the spans still buffered and stops the exporter.
    pub fn shutdown(self) {
        if let Some(provider) = self.provider {
            if let Err(err) = provider.shutdown() {
                tracing::warn!("flushing traces failed: {err}");
            }
        }
    }
}

/// Installs the global log subscriber (text or JSON) and, when enabled, the OpenTelemetry layer. Must run
/// inside the tokio runtime (the OTLP exporter's connection lives there). Later calls are no-ops.
pub fn init(log: &LogSettings, traces: &TracingSettings) -> Result<Telemetry, String> {
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt_layer = match log.format {
        LogFormat::Text => fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(ansi)
            .boxed(),
        LogFormat::Json => fmt::layer()
            .event_format(json_log::ReferenceJson)
            .fmt_fields(fmt::format::JsonFields::new())
            .with_writer(std::io::stderr)
            .boxed(),
    };
    // At debug and trace, ratelimitd's own lines: the HTTP/2, gRPC, TLS and Redis libraries beneath
    // would write several per call (frames, build paths of their sources), and keep their info and up.
    // The Redis client warns of each connection it loses, a line per pooled connection, for every
    // connection an idle timeout closes too: ratelimitd reports lost connections itself (see
    // `store::redis::node`), once the server has said whether it still takes connections.
    let filter = match log.level {
        LogLevel::Debug | LogLevel::Trace => format!("info,ratelimitd={}", log.level.as_str()),
        level => level.as_str().to_owned(),
    };
    // The file watcher warns when it cannot unwatch a folder the kernel already dropped, which is
    // every reload after a swapped RUNTIME_ROOT whose last target was deleted; the rules watcher
    // reports the watches that matter itself.
    let filter = EnvFilter::new(format!(
        "{filter},fred::router::responses=error,notify::inotify=error"
    ));
    let mut telemetry = Telemetry::default();
    let otel_layer = if traces.enabled {
        let provider = tracer_provider(traces)?;
        let tracer = provider.tracer("ratelimitd");
        telemetry.provider = Some(provider);
        // The composite asks each propagator in turn, and one that finds a context replaces what an
        // earlier one found: W3C `traceparent` when the caller sends one, else B3.
        opentelemetry::global::set_text_map_propagator(
            opentelemetry::propagation::TextMapCompositePropagator::new(vec![
                Box::new(b3::B3Propagator::default()),
                Box::new(opentelemetry_sdk::propagation::TraceContextPropagator::new()),
            ]),
        );
        // ratelimitd's own spans, whatever LOG_LEVEL says about log lines; not the spans of the HTTP/2,
        // gRPC and Redis libraries beneath them (hundreds per call, each a trace of its own).
        Some(
            tracing_opentelemetry::layer()
                .with_tracer(tracer)
                .with_filter(tracing_subscriber::filter::filter_fn(|m| {
                    m.is_span() && m.target().starts_with("ratelimitd")
                })),
        )
    } else {
        None
    };
    let _ = tracing_subscriber::registry()
        .with(fmt_layer.with_filter(filter))
        .with(otel_layer)
        .try_init();
    Ok(telemetry)
}

fn tracer_provider(traces: &TracingSettings) -> Result<SdkTracerProvider, String> {
    use opentelemetry_otlp::WithExportConfig;
    use opentelemetry_otlp::WithTonicConfig;
    let mut exporter = opentelemetry_otlp::SpanExporter::builder().with_tonic();
    // TLS only where the exporter will use it: setting it loads the system's CA certificates, and an
    // image without any would refuse a plain endpoint for that.
    let var = |name: &str| std::env::var(name).ok();
    if over_tls(&traces.resolved_endpoint(var), var) {
        exporter =
            exporter.with_tls_config(tonic::transport::ClientTlsConfig::new().with_native_roots());
    }
    if let Some(endpoint) = &traces.endpoint {
        exporter = exporter.with_endpoint(endpoint.clone());
    }
    let exporter = exporter
        .build()
        .map_err(|e| format!("cannot set up the OTLP trace exporter: {e}"))?;
    let sampler = Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(traces.sampling_rate)));
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(Logged::new(exporter))
        .with_sampler(sampler)
        .with_resource(resource(traces))
        .build())
}

/// A span exporter whose failures are logged: the SDK's own diagnostics are off in this build, so a
/// collector that is unreachable or refuses the spans would otherwise lose them all without a word. One
/// warning a minute at most, with the spans lost since the last.
#[derive(Debug)]
struct Logged<E> {
    inner: E,
    /// Seconds since the epoch of the last warning, and the spans lost since it.
    last_warned: std::sync::atomic::AtomicU64,
    lost: std::sync::atomic::AtomicU64,
}

impl<E> Logged<E> {
    fn new(inner: E) -> Self {
        Self {
            inner,
            last_warned: std::sync::atomic::AtomicU64::new(0),
            lost: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn failed(&self, spans: usize, err: &opentelemetry_sdk::error::OTelSdkError) {
        use std::sync::atomic::Ordering;
        let lost = self.lost.fetch_add(spans as u64, Ordering::Relaxed) + spans as u64;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let last = self.last_warned.load(Ordering::Relaxed);
        if now >= last + 60
            && self
                .last_warned
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.lost.fetch_sub(lost, Ordering::Relaxed);
            tracing::warn!(
                spans_lost = lost,
                "trace export failed: {err} (the collector is the tracing endpoint, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT; at most one such line a minute)"
            );
        }
    }
}

impl<E: opentelemetry_sdk::trace::SpanExporter> opentelemetry_sdk::trace::SpanExporter
    for Logged<E>
{
    async fn export(
        &self,
        batch: Vec<opentelemetry_sdk::trace::SpanData>,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        let spans = batch.len();
        let result = self.inner.export(batch).await;
        if let Err(err) = &result {
            self.failed(spans, err);
        }
        result
    }

    fn shutdown_with_timeout(
        &self,
        timeout: std::time::Duration,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

/// Whether the exporter reaches the collector at `endpoint` (as [`TracingSettings::resolved_endpoint`]
/// gives it) over TLS: `https://`, or no scheme unless `OTEL_EXPORTER_OTLP_(TRACES_)INSECURE` is true.
fn over_tls(endpoint: &str, var: impl Fn(&str) -> Option<String>) -> bool {
    let endpoint = endpoint.trim().to_ascii_lowercase();
    if endpoint.starts_with("https://") {
        return true;
    }
    if endpoint.contains("://") {
        return false;
    }
    let insecure = var("OTEL_EXPORTER_OTLP_TRACES_INSECURE")
        .or_else(|| var("OTEL_EXPORTER_OTLP_INSECURE"))
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
    !insecure
}

/// What the spans say of their service: its name, namespace and this replica's instance id, the last
/// drawn at random unless set (`TRACING_SERVICE_INSTANCE_ID`, or `OTEL_RESOURCE_ATTRIBUTES`).
fn resource(traces: &TracingSettings) -> opentelemetry_sdk::Resource {
    use opentelemetry::{Key, KeyValue};
    let mut attributes = Vec::new();
    if let Some(namespace) = &traces.service_namespace {
        attributes.push(KeyValue::new("service.namespace", namespace.clone()));
    }
    let from_environment = opentelemetry_sdk::Resource::builder()
        .build()
        .get(&Key::new("service.instance.id"))
        .is_some();
    match &traces.service_instance_id {
        Some(id) => attributes.push(KeyValue::new("service.instance.id", id.clone())),
        None if !from_environment => {
            attributes.push(KeyValue::new("service.instance.id", random_instance_id()));
        }
        None => {}
    }
    opentelemetry_sdk::Resource::builder()
        .with_service_name(traces.service_name.clone())
        .with_attributes(attributes)
        .build()
}

/// A random UUID (version 4), written as UUIDs are.
fn random_instance_id() -> String {
    let mut bytes: [u8; 16] = rand::random();
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

#[cfg(test)]
mod tests {
    use super::{over_tls, TracingSettings};

    #[test]
    fn the_collector_is_reached_over_tls_as_the_exporter_resolves_its_endpoint() {
        let none = |_: &str| None;
        let traces = |endpoint: Option<&str>| TracingSettings {
            endpoint: endpoint.map(str::to_owned),
            ..TracingSettings::default()
        };
        let tls = |endpoint: Option<&str>, var: &dyn Fn(&str) -> Option<String>| {
            over_tls(&traces(endpoint).resolved_endpoint(var), var)
        };
        assert!(!tls(None, &none), "the default is http://localhost:4317");
        assert!(tls(Some("https://otel:4317"), &none));
        assert!(!tls(Some("http://otel:4317"), &none));
        assert!(tls(Some("otel-collector.observability:4317"), &none));
        let insecure = |name: &str| (name == "OTEL_EXPORTER_OTLP_INSECURE").then(|| "true".into());
        assert!(!tls(Some("otel-collector:4317"), &insecure));
        let from_env =
            |name: &str| (name == "OTEL_EXPORTER_OTLP_ENDPOINT").then(|| "https://c:4317".into());
        assert!(tls(None, &from_env));
    }
}
