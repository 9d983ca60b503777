//! `LOG_FORMAT=json` as the reference writes it (logrus's JSON formatter): one object per line with
//! `@timestamp` (RFC 3339, nanoseconds), `level` (`error`, `warning`, `info`, `debug`, `trace`) and
//! `@message`, then the event's own fields by name, so that log pipelines built on the reference's
//! lines read ours unchanged. A line written within a span (a `ShouldRateLimit` call, a store call)
//! carries that span's fields too, by name, unless the event has a field of that name. Those spans are
//! at info level: at the default `LOG_LEVEL` (warn) they are not made, which keeps them off the
//! request path, and lines have only their own fields.

use std::fmt;

use serde_json::{Map, Value};
use tracing::{field::Field, Event, Level, Subscriber};
use tracing_subscriber::{
    fmt::{format::Writer, FmtContext, FormatEvent, FormatFields, FormattedFields},
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
        ctx: &FmtContext<'_, S, N>,
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
        let mut fields = Fields {
            line: &mut line,
            log_target: None,
        };
        event.record(&mut fields);
        // A line of a library that logs through the `log` crate names its module in `log.target`.
        let target = fields
            .log_target
            .take()
            .unwrap_or_else(|| event.metadata().target().to_owned());
        line.insert("target".into(), target.into());
        // The spans' fields, as the layer's field formatter (`JsonFields`) keeps them: the innermost
        // span's first.
        for span in ctx.event_scope().into_iter().flatten() {
            let extensions = span.extensions();
            let Some(recorded) = extensions.get::<FormattedFields<N>>() else {
                continue;
            };
            if let Ok(Value::Object(fields)) = serde_json::from_str::<Value>(recorded) {
                for (name, value) in fields {
                    line.entry(field_name(&name)).or_insert(value);
                }
            }
        }
        let text = serde_json::to_string(&line).map_err(|_| fmt::Error)?;
        writeln!(writer, "{text}")
    }
}

/// The name a field is written under: its own, or with `fields.` before it when the line's own fields
/// have that name, as logrus does.
fn field_name(name: &str) -> String {
    match name {
        "@timestamp" | "level" | "@message" | "target" => format!("fields.{name}"),
        name => name.to_owned(),
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
/// one of the line's own is written with `fields.` before it, as logrus does). Of the fields the `log`
/// bridge adds, the target is kept and the source file, line and module are not.
struct Fields<'a> {
    line: &'a mut Map<String, Value>,
    log_target: Option<String>,
}

impl Fields<'_> {
    fn put(&mut self, field: &Field, value: Value) {
        let name = match field.name() {
            "message" => "@message".to_owned(),
            "log.target" => {
                self.log_target = value.as_str().map(str::to_owned);
                return;
            }
            name if name.starts_with("log.") => return,
            name => field_name(name),
        };
        self.line.insert(name, value);
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

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::fmt::MakeWriter;

    use super::ReferenceJson;

    /// Where the lines go: one buffer.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Lines {
        type Writer = Lines;

        fn make_writer(&'a self) -> Lines {
            self.clone()
        }
    }

    #[test]
    fn lines_carry_the_references_names_and_a_bridged_librarys_own_target() {
        let lines = Lines::default();
        let subscriber = tracing_subscriber::fmt()
            .event_format(ReferenceJson)
            .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
            .with_writer(lines.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(domain = "edge", files = 3, "rules loaded");
            tracing::warn_span!(
                "ShouldRateLimit",
                domain = "api",
                descriptors = 2,
                target = "x"
            )
            .in_scope(|| {
                tracing::warn_span!("backend call", backend = "redis", descriptors = 9).in_scope(
                    || {
                        tracing::warn!(
                            checks = 1,
                            backend = "main",
                            "the counter store could not decide"
                        )
                    },
                )
            });
            // As the `log` bridge writes a library's line.
            tracing::error!(
                log.target = "fred::router",
                log.file = "/root/.cargo/registry/src/fred/router.rs",
                log.line = 7,
                level = "mine",
                "Broadcasting error"
            );
        });
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        let parsed: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(parsed[0]["@message"], "rules loaded");
        assert_eq!(parsed[0]["level"], "warning");
        assert_eq!(parsed[0]["domain"], "edge");
        assert_eq!(parsed[0]["files"], 3);
        assert!(parsed[0]["@timestamp"].as_str().unwrap().ends_with('Z'));
        // Within spans: theirs by name, the event's own and the innermost span's first.
        assert_eq!(parsed[1]["domain"], "api");
        assert_eq!(parsed[1]["backend"], "main");
        assert_eq!(parsed[1]["checks"], 1);
        assert_eq!(parsed[1]["descriptors"], 9);
        assert_eq!(parsed[1]["fields.target"], "x");
        assert_eq!(parsed[2]["level"], "error");
        assert_eq!(parsed[2]["target"], "fred::router");
        assert_eq!(parsed[2]["fields.level"], "mine");
        assert!(
            !text.contains(".cargo") && !text.contains("log.line"),
            "{text}"
        );
    }
}
