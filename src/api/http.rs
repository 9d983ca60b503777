//! The HTTP side port: `/healthcheck`, `/json` and `/rlconfig`, as the reference service serves them, and
//! `/metrics` (Prometheus text format).

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Weak,
    },
    time::Instant,
};

use axum::{
    body::Bytes,
    extract::State,
    http::{header, StatusCode},
    response::{IntoResponse, Response},
    routing::{any, get},
    Router,
};

use super::{health::Health, json, to_http_status};
use crate::{
    limiter::{Code, Limiter, RequestLimits},
    rules::RuleSet,
    telemetry::Metrics,
};

#[derive(Debug, Clone)]
struct AppState {
    limiter: Arc<Limiter>,
    health: Arc<Health>,
    metrics_text: MetricsText,
    rules_text: Arc<tokio::sync::Mutex<RulesText>>,
}

/// `/rlconfig`'s text and the rules it was written from: written once per rules snapshot, however many
/// callers ask for it, so that a caller asking again and again (or many at once) costs a copy of the
/// text's handle, not the rule set's lines each time.
#[derive(Debug, Default)]
struct RulesText {
    of: Weak<RuleSet>,
    text: Bytes,
}

/// The largest `/json` body: JSON spells a request out, so four times the gRPC message bound (413 past
/// it).
fn json_body_limit(limits: &RequestLimits) -> usize {
    limits.max_message_bytes.saturating_mul(4)
}

/// The HTTP routes.
pub fn router(limiter: Arc<Limiter>, health: Arc<Health>, metrics: Arc<Metrics>) -> Router {
    let json_limit = json_body_limit(limiter.request_limits());
    let state = AppState {
        limiter,
        health,
        metrics_text: MetricsText::new(metrics),
        rules_text: Arc::default(),
    };
    Router::new()
        // Any method, as the reference answers them: a load balancer's check may send OPTIONS.
        .route("/healthcheck", any(healthcheck))
        .route(
            "/json",
            any(decide_json)
                .layer(axum::extract::DefaultBodyLimit::max(json_limit))
                .layer(axum::middleware::from_fn_with_state(
                    state.clone(),
                    declared_too_long,
                )),
        )
        .route("/rlconfig", any(rlconfig))
        .route("/metrics", get(render_metrics))
        .route("/debug/top", get(top_offenders))
        .with_state(state)
}

/// The routes of the separate Prometheus listener: the metrics on `path`.
pub fn metrics_router(metrics: Arc<Metrics>, path: &str) -> Router {
    let text = MetricsText::new(metrics);
    Router::new().route(
        path,
        get(move || {
            let text = text.clone();
            async move { text.answer().await }
        }),
    )
}

/// The metrics in Prometheus's text format, written beside the request workers and one writing at a
/// time: a caller is answered with a writing that began after it asked (so it holds everything counted
/// before the call), and callers that ask during one share the next. However many ask at once, they
/// cost two writings at most and keep no request worker from deciding.
#[derive(Debug, Clone)]
struct MetricsText {
    metrics: Arc<Metrics>,
    /// The last writing, when callers were waiting for it: when it began, and its text.
    last: Arc<tokio::sync::Mutex<Option<(Instant, Bytes)>>>,
    /// Callers asking now.
    asking: Arc<AtomicUsize>,
}

impl MetricsText {
    fn new(metrics: Arc<Metrics>) -> Self {
        Self {
            metrics,
            last: Arc::default(),
            asking: Arc::default(),
        }
    }

    async fn answer(&self) -> Response {
        let asked = Instant::now();
        let _asking = Asking::new(&self.asking);
        let mut last = self.last.clone().lock_owned().await;
        let text = match last.take() {
            Some((began, text)) if began > asked => {
                if self.asking.load(Ordering::SeqCst) > 1 {
                    *last = Some((began, text.clone()));
                }
                Ok(text)
            }
            _ => {
                let (metrics, asking) = (self.metrics.clone(), self.asking.clone());
                // Run to its end even when the caller leaves, for those waiting on it.
                tokio::task::spawn_blocking(move || {
                    let began = Instant::now();
                    // Only callers that asked before it began may take it: kept while there are any.
                    let others = asking.load(Ordering::SeqCst) > 1;
                    let text = Bytes::from(metrics.render());
                    *last = others.then(|| (began, text.clone()));
                    text
                })
                .await
            }
        };
        match text {
            Ok(text) => (
                [(
                    header::CONTENT_TYPE,
                    "text/plain; version=0.0.4; charset=utf-8",
                )],
                text,
            )
                .into_response(),
            Err(err) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{err}\n")).into_response(),
        }
    }
}

/// One caller counted among those asking, until it is answered or leaves.
struct Asking(Arc<AtomicUsize>);

impl Asking {
    fn new(asking: &Arc<AtomicUsize>) -> Self {
        asking.fetch_add(1, Ordering::SeqCst);
        Self(asking.clone())
    }
}

impl Drop for Asking {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The most denied descriptors of the last one to two intervals, as JSON; `?limit=N` (default 20).
async fn top_offenders(
    State(state): State<AppState>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> Response {
    let limit = query
        .as_deref()
        .unwrap_or_default()
        .split('&')
        .find_map(|kv| kv.strip_prefix("limit="))
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(20);
    let top = state.limiter.top_offenders();
    let body = serde_json::json!({
        "interval_seconds": top.interval().as_secs(),
        "capacity": top.capacity(),
        "offenders": top.top(limit),
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// Prometheus text format.
async fn render_metrics(State(state): State<AppState>) -> Response {
    state.metrics_text.answer().await
}

/// 200 `OK` while serving, 500 otherwise.
async fn healthcheck(State(state): State<AppState>) -> Response {
    if state.health.is_serving() {
        (StatusCode::OK, "OK").into_response()
    } else {
        StatusCode::INTERNAL_SERVER_ERROR.into_response()
    }
}

/// 413 for a `/json` body past its bound, naming it.
fn too_large(limits: &RequestLimits) -> Response {
    let why = format!(
        "request body over {} bytes (four times request_limits.max_message_bytes)",
        json_body_limit(limits)
    );
    (StatusCode::PAYLOAD_TOO_LARGE, format!("{why}\n")).into_response()
}

/// A `/json` call that declares a body past the bound (`Content-Length`) is answered 413 at once, and
/// counted as the requests that cannot be read are, not waited for until `http.request_timeout`.
async fn declared_too_long(
    State(state): State<AppState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let limits = state.limiter.request_limits();
    let declared = request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|len| len > json_body_limit(limits) as u64) {
        state.limiter.record_unreadable();
        return too_large(limits);
    }
    next.run(request).await
}

/// A protobuf-JSON `RateLimitRequest` in, the response out: 200 for OK, 429 for OVER_LIMIT, 400 for a
/// request that cannot be read or decided as sent, 503 when the service cannot decide
/// ([`to_http_status`]).
async fn decide_json(
    State(state): State<AppState>,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    let body = match body {
        Ok(body) => body,
        // Larger than the bound, or cut short: counted as the requests that cannot be read are.
        Err(refused) => {
            state.limiter.record_unreadable();
            let status = refused.status();
            if status == StatusCode::PAYLOAD_TOO_LARGE {
                return too_large(state.limiter.request_limits());
            }
            return (status, format!("{}\n", refused.body_text())).into_response();
        }
    };
    let request = match json::parse_request(&body, state.limiter.request_limits()) {
        Ok(r) => r,
        Err(err) => {
            state.limiter.record_unreadable();
            tracing::debug!(error = %err, "bad /json request");
            // The reference's words, and why.
            return (StatusCode::BAD_REQUEST, format!("Bad Request: {err}\n")).into_response();
        }
    };
    match state.limiter.should_rate_limit(&request).await {
        Ok(response) => {
            let status = match response.overall_code {
                Code::Ok => StatusCode::OK,
                Code::OverLimit => StatusCode::TOO_MANY_REQUESTS,
            };
            let body = json::render_response(&response).to_string();
            (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
        }
        Err(err) => {
            let (status, reason) = to_http_status(&err);
            if status.is_server_error() {
                tracing::debug!(error = %err, "/json not decided");
            }
            (status, format!("{reason}\n")).into_response()
        }
    }
}

/// The loaded rules, one line each. Written beside the request workers (the lines of a large rule set
/// take a while to build and sort), once per rules snapshot: callers that ask meanwhile wait for it, and
/// a caller that leaves does not stop it.
async fn rlconfig(State(state): State<AppState>) -> Response {
    let mut cached = state.rules_text.clone().lock_owned().await;
    // The rules as they are once the lock is ours: a caller that waited never writes older rules over
    // the text of newer ones.
    let text = match state.limiter.rules_snapshot() {
        None => Ok(Bytes::new()),
        Some(rules) => {
            if Weak::ptr_eq(&cached.of, &Arc::downgrade(&rules)) {
                Ok(cached.text.clone())
            } else {
                let limiter = state.limiter.clone();
                tokio::task::spawn_blocking(move || {
                    let mut text = String::new();
                    for line in limiter.describe_rules(&rules) {
                        text.push_str(&line);
                        text.push('\n');
                    }
                    *cached = RulesText {
                        of: Arc::downgrade(&rules),
                        text: text.into(),
                    };
                    cached.text.clone()
                })
                .await
            }
        }
    };
    match text {
        Ok(text) => ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response(),
        Err(err) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{err}\n")).into_response(),
    }
}
