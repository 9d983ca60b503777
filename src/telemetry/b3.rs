//! B3 trace context (Zipkin's headers), read beside W3C `traceparent`, as the reference service does:
//! Envoy with its Zipkin tracer, and services traced with Zipkin or Brave, send B3 rather than W3C.
//!
//! Both forms of the B3 specification are read: the single header
//! `b3: {trace id}-{span id}[-{sampling}[-{parent span id}]]` first, else the multiple headers
//! `x-b3-traceid`, `x-b3-spanid`, `x-b3-sampled`, `x-b3-flags` (and `x-b3-parentspanid`, checked but not
//! needed: our span's parent is the caller's span). Ids are lower-case hex; a 64-bit trace id is
//! left-padded with zeros. Sampling `1` (`true` in the multiple form) or debug (`d`, `x-b3-flags: 1`)
//! marks the caller's trace sampled; `0`, `false` or no decision leave it unsampled, as the reference
//! reads them. A malformed value is ignored, so the call starts a trace of its own.
//!
//! Injection (unused by the service, which calls no one with a trace) writes the single header.

use std::sync::OnceLock;

use opentelemetry::{
    propagation::{text_map_propagator::FieldIter, Extractor, Injector, TextMapPropagator},
    trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState},
    Context,
};

const SINGLE: &str = "b3";
const TRACE_ID: &str = "x-b3-traceid";
const SPAN_ID: &str = "x-b3-spanid";
const PARENT_SPAN_ID: &str = "x-b3-parentspanid";
const SAMPLED: &str = "x-b3-sampled";
const FLAGS: &str = "x-b3-flags";

/// Reads (and writes) B3 headers.
#[derive(Debug, Default)]
pub struct B3Propagator {
    _private: (),
}

fn fields() -> &'static [String; 6] {
    static FIELDS: OnceLock<[String; 6]> = OnceLock::new();
    FIELDS.get_or_init(|| {
        [SINGLE, TRACE_ID, SPAN_ID, PARENT_SPAN_ID, SAMPLED, FLAGS].map(String::from)
    })
}

impl TextMapPropagator for B3Propagator {
    fn inject_context(&self, cx: &Context, injector: &mut dyn Injector) {
        let span = cx.span();
        let context = span.span_context();
        if context.is_valid() {
            let sampling = if context.is_sampled() { "1" } else { "0" };
            injector.set(
                SINGLE,
                format!("{}-{}-{sampling}", context.trace_id(), context.span_id()),
            );
        }
    }

    fn extract_with_context(&self, cx: &Context, extractor: &dyn Extractor) -> Context {
        match extract(extractor) {
            Some(remote) => cx.with_remote_span_context(remote),
            None => cx.clone(),
        }
    }

    fn fields(&self) -> FieldIter<'_> {
        FieldIter::new(fields())
    }
}

/// The caller's span from the single header when it is valid, else from the multiple headers.
fn extract(extractor: &dyn Extractor) -> Option<SpanContext> {
    extractor
        .get(SINGLE)
        .and_then(single)
        .or_else(|| multiple(extractor))
}

fn single(value: &str) -> Option<SpanContext> {
    let mut parts = value.trim().split('-');
    let trace_id = trace_id(parts.next()?)?;
    let span_id = span_id(parts.next()?)?;
    let sampled = match parts.next() {
        None => false,
        Some("1" | "d") => true,
        Some("0") => false,
        Some(_) => return None,
    };
    if let Some(parent) = parts.next() {
        self::span_id(parent)?;
    }
    if parts.next().is_some() {
        return None;
    }
    remote(trace_id, span_id, sampled)
}

fn multiple(extractor: &dyn Extractor) -> Option<SpanContext> {
    let get = |name| extractor.get(name).map(str::trim);
    let trace_id = trace_id(get(TRACE_ID)?)?;
    let span_id = span_id(get(SPAN_ID)?)?;
    if let Some(parent) = get(PARENT_SPAN_ID) {
        self::span_id(parent)?;
    }
    let sampled = match get(SAMPLED) {
        None | Some("0" | "false") => false,
        Some("1" | "true") => true,
        Some(_) => return None,
    };
    // Debug implies sampled; any other flags value is ignored, as the specification says.
    let debug = get(FLAGS) == Some("1");
    remote(trace_id, span_id, sampled || debug)
}

/// Lower-case hex of exactly one of the given widths.
fn hex(text: &str, widths: &[usize]) -> Option<u128> {
    let lower_hex = text
        .bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if !lower_hex || !widths.contains(&text.len()) {
        return None;
    }
    u128::from_str_radix(text, 16).ok()
}

fn trace_id(text: &str) -> Option<TraceId> {
    hex(text, &[16, 32]).map(TraceId::from)
}

fn span_id(text: &str) -> Option<SpanId> {
    hex(text, &[16]).and_then(|id| u64::try_from(id).ok().map(SpanId::from))
}

fn remote(trace_id: TraceId, span_id: SpanId, sampled: bool) -> Option<SpanContext> {
    let flags = if sampled {
        TraceFlags::SAMPLED
    } else {
        TraceFlags::default()
    };
    let context = SpanContext::new(trace_id, span_id, flags, true, TraceState::default());
    // All-zero ids are invalid in B3 as in W3C.
    context.is_valid().then_some(context)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const SPAN: &str = "00f067aa0ba902b7";
    const PARENT: &str = "e457b5a2e4d86bd1";

    fn read(headers: &[(&str, &str)]) -> Option<(String, String, bool)> {
        let map: HashMap<String, String> = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let cx = B3Propagator::default().extract_with_context(&Context::new(), &map);
        let span = cx.span();
        let context = span.span_context();
        context.is_valid().then(|| {
            (
                context.trace_id().to_string(),
                context.span_id().to_string(),
                context.is_sampled(),
            )
        })
    }

    fn continued(sampled: bool) -> Option<(String, String, bool)> {
        Some((TRACE.into(), SPAN.into(), sampled))
    }

    #[test]
    fn the_single_header_in_each_of_its_forms() {
        let b3 = |v: String| read(&[("b3", &v)]);
        assert_eq!(b3(format!("{TRACE}-{SPAN}-1")), continued(true));
        assert_eq!(b3(format!("{TRACE}-{SPAN}-d")), continued(true));
        assert_eq!(b3(format!("{TRACE}-{SPAN}-0")), continued(false));
        assert_eq!(b3(format!("{TRACE}-{SPAN}")), continued(false));
        assert_eq!(b3(format!("{TRACE}-{SPAN}-1-{PARENT}")), continued(true));
        assert_eq!(
            b3(format!("a3ce929d0e0e4736-{SPAN}-1")),
            Some(("0000000000000000a3ce929d0e0e4736".into(), SPAN.into(), true)),
            "a 64-bit trace id is padded"
        );
    }

    #[test]
    fn the_multiple_headers() {
        let sampled = |v: &'static str| {
            read(&[
                ("x-b3-traceid", TRACE),
                ("x-b3-spanid", SPAN),
                ("x-b3-parentspanid", PARENT),
                ("x-b3-sampled", v),
            ])
        };
        assert_eq!(sampled("1"), continued(true));
        assert_eq!(sampled("true"), continued(true));
        assert_eq!(sampled("0"), continued(false));
        assert_eq!(
            read(&[
                ("x-b3-traceid", TRACE),
                ("x-b3-spanid", SPAN),
                ("x-b3-flags", "1")
            ]),
            continued(true),
            "debug is sampled"
        );
        assert_eq!(
            read(&[("x-b3-traceid", TRACE), ("x-b3-spanid", SPAN)]),
            continued(false),
            "no decision: not sampled, as the reference"
        );
    }

    #[test]
    fn the_single_header_wins_and_a_bad_one_falls_back_to_the_multiple_headers() {
        let other = "0af7651916cd43dd8448eb211c80319c";
        let single = format!("{other}-{SPAN}-1");
        assert_eq!(
            read(&[
                ("b3", &single),
                ("x-b3-traceid", TRACE),
                ("x-b3-spanid", SPAN)
            ])
            .map(|c| c.0),
            Some(other.to_string())
        );
        assert_eq!(
            read(&[
                ("b3", "garbage"),
                ("x-b3-traceid", TRACE),
                ("x-b3-spanid", SPAN),
                ("x-b3-sampled", "1")
            ]),
            continued(true)
        );
    }

    #[test]
    fn malformed_values_start_a_trace_of_their_own() {
        for single in [
            "0".to_string(),
            TRACE.to_string(),
            format!("{TRACE}-{SPAN}-"),
            format!("{TRACE}-{SPAN}-x"),
            format!("{TRACE}-{SPAN}-1-{PARENT}-extra"),
            format!("{TRACE}-{SPAN}-1-zz"),
            format!("{}-{SPAN}-1", TRACE.to_uppercase()),
            format!("{TRACE}-{}-1", "0".repeat(16)),
            format!("{}-{SPAN}-1", "0".repeat(32)),
            format!("{TRACE}-{SPAN}1-1"),
        ] {
            assert_eq!(read(&[("b3", &single)]), None, "{single}");
        }
        assert_eq!(read(&[("x-b3-traceid", TRACE)]), None);
        assert_eq!(
            read(&[
                ("x-b3-traceid", TRACE),
                ("x-b3-spanid", SPAN),
                ("x-b3-sampled", "yes")
            ]),
            None
        );
        assert_eq!(
            read(&[
                ("x-b3-traceid", "abc"),
                ("x-b3-spanid", SPAN),
                ("x-b3-sampled", "1")
            ]),
            None
        );
    }

    #[test]
    fn injects_the_single_header() {
        let remote = remote(
            TraceId::from_hex(TRACE).unwrap(),
            SpanId::from_hex(SPAN).unwrap(),
            true,
        )
        .unwrap();
        let cx = Context::new().with_remote_span_context(remote);
        let mut headers = HashMap::new();
        B3Propagator::default().inject_context(&cx, &mut headers);
        assert_eq!(headers.get("b3"), Some(&format!("{TRACE}-{SPAN}-1")));
        assert_eq!(
            read(&[("b3", &headers["b3"])]),
            continued(true),
            "reads what it writes"
        );
    }
}
