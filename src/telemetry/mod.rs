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
    let filter = EnvFilter::new(format!("{filter},fred::router::responses=error"));
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
    let mut exporter = opentelemetry_otlp::SpanExporter::builder().with_tonic();
    if let Some(endpoint) = &traces.endpoint {
        exporter = exporter.with_endpoint(endpoint.clone());
    }
    let exporter = exporter
        .build()
        .map_err(|e| format!("cannot set up the OTLP trace exporter: {e}"))?;
    let sampler = Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(traces.sampling_rate)));
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_sampler(sampler)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(traces.service_name.clone())
                .build(),
        )
        .build())
}
