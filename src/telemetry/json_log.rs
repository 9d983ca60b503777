//! `LOG_FORMAT=json` as the reference writes it (logrus's JSON formatter): one object per line with
//! `@timestamp` (RFC 3339, nanoseconds), `level` (`error`, `warning`, `info`, `debug`, `trace`) and
//! `@message`, then the event's own fields by name, so that log pipelines built on the reference's
//! lines read ours unchanged.

use std::fmt;

use serde_json::{Map, Value};
use tracing::{field::Field, Event, Level, Subscriber};
use tracing_subscriber::{
    fmt::{format::Writer, FmtContext, FormatEvent, FormatFields},
    registry::LookupSpan,
};

/// The formatter of [`super::init`] for JSON lines.
pub struct ReferenceJson;

impl<S, N> FormatEvent<S, N> for ReferenceJson
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut line = Map::new();
        line.insert(
            "@timestamp".into(),
            humantime::format_rfc3339_nanos(std::time::SystemTime::now())
                .to_string()
                .into(),
        );
        line.insert("level".into(), level(event.metadata().level()).into());
        line.insert("@message".into(), Value::String(String::new()));
        event.record(&mut Fields(&mut line));
        line.insert("target".into(), event.metadata().target().into());
        let text = serde_json::to_string(&line).map_err(|_| fmt::Error)?;
        writeln!(writer, "{text}")
    }
}

/// logrus's names of the levels.
fn level(level: &Level) -> &'static str {
    match *level {
        Level::ERROR => "error",
        Level::WARN => "warning",
        Level::INFO => "info",
        Level::DEBUG => "debug",
        Level::TRACE => "trace",
    }
}

/// Collects an event's fields: `message` as `@message`, the others by their names (a field named like
/// one of the line's own is written with `fields.` before it, as logrus does).
struct Fields<'a>(&'a mut Map<String, Value>);

impl Fields<'_> {
    fn put(&mut self, field: &Field, value: Value) {
        let name = match field.name() {
            "message" => "@message".to_owned(),
            name @ ("@timestamp" | "level" | "@message" | "target") => format!("fields.{name}"),
            name => name.to_owned(),
        };
        self.0.insert(name, value);
    }
}

impl tracing::field::Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, value.into());
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, value.into());
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, value.into());
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field, value.into());
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.put(field, value.into());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.put(field, format!("{value:?}").into());
    }
}
