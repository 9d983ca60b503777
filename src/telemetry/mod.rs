//! Logging (`LOG_LEVEL`, `LOG_FORMAT`: text or JSON lines with time, level and message) and metrics.

pub mod metrics;
pub mod top;

pub use metrics::Metrics;
pub use top::TopOffenders;

use tracing_subscriber::{fmt, EnvFilter};

use crate::settings::{LogFormat, LogSettings};

/// Installs the global log subscriber. Safe to call more than once (later calls are no-ops).
pub fn init_logging(settings: &LogSettings) {
    let filter = EnvFilter::new(settings.level.as_str());
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    let _ = match settings.format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}
