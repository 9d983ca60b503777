//! The operators' API: JSON over HTTP/1.1 on a listener of its own (`admin.*`, off unless enabled),
//! for what operators ask without editing a rules file or restarting anything.
//!
//! | call | body | does |
//! |---|---|---|
//! | `POST /v1/inspect` | `{domain, descriptor}` | every limit the descriptor is counted against, with its counter now |
//! | `POST /v1/reset` | `{domain, descriptor}` | clears those counters in the store, so for every replica |
//! | `GET /v1/limits` | (`?domain=`) | the runtime limits in force |
//! | `PUT /v1/limits` | `{domain, descriptor, limit, expires_in \| expires_at}` | sets one descriptor's runtime limit |
//! | `DELETE /v1/limits` | `{id}` or `{domain, descriptor}` | deletes one |
//!
//! A `descriptor` is a list of `{key, value}` entries, in order, with raw values (those of sensitive
//! keys are hashed before use, as requests' are). Every call must carry `Authorization: Bearer <token>`
//! (`auth`), checked before its body is read; bodies are bounded (`admin.max_body_bytes`). Every change,
//! and every change refused, is logged on the `ratelimitd::audit` target at WARN: who (the name in the
//! `X-Operator` header, the client's address and, with mTLS, its certificate's fingerprint), what (the
//! descriptor with sensitive values hashed, the limit, quoted and escaped), and the outcome; the log
//! line's time says when. Calls refused for their token are logged there too, at most once a second.
//! The token is never logged.
//!
//! `listen` serves the routes over plaintext or TLS (optionally with client certificates); `client` is
//! the other side, for `ratelimitd admin`.

mod auth;
pub mod client;
mod listen;
mod options;
mod timestamp;

pub use auth::{Token, TokenError, MIN_TOKEN_BYTES};
pub use listen::serve;
pub use options::{AdminSettings, AdminTlsSettings};

use std::{
    net::SocketAddr,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, UNIX_EPOCH},
};

use axum::{
    body::Bytes,
    extract::{DefaultBodyLimit, FromRequest, Request, State},
    http::{header, HeaderMap, StatusCode},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::{post, put},
    Extension, Router,
};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::limiter::{
    runtime::{Expiry, LimitSpec, RuntimeLimit},
    Entry, Inspection, Limiter, OperatorError, Target,
};

/// The header in which a caller names the operator it acts for, for the audit log.
pub const OPERATOR_HEADER: &str = "x-operator";

/// What the listener knows of a call's connection.
#[derive(Debug, Clone)]
pub struct Caller {
    pub peer: Option<SocketAddr>,
    /// The first 16 hex digits of the SHA-256 of the client certificate, with mTLS.
    pub certificate: Option<String>,
}

/// What the routes share.
#[derive(Debug, Clone)]
pub struct AdminState {
    pub limiter: Arc<Limiter>,
    pub token: Arc<Token>,
    /// Calls refused for a missing or wrong token.
    pub refused: Arc<AtomicU64>,
}

/// The routes, behind the token check and the body bound.
pub fn router(state: AdminState, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/v1/inspect", post(inspect))
        .route("/v1/reset", post(reset))
        .route(
            "/v1/limits",
            put(set_limit).get(list_limits).delete(delete_limit),
        )
        .fallback(|| async {
            error(
                StatusCode::NOT_FOUND,
                "no such call; see /v1/inspect, /v1/reset and /v1/limits",
            )
        })
        .layer(DefaultBodyLimit::max(max_body_bytes))
        // Every call, to a path of the API or not: a caller without the token learns nothing of it.
        .layer(middleware::from_fn_with_state(state.clone(), authorize))
        .with_state(state)
}

/// A call's body; one that cannot be read (larger than `admin.max_body_bytes`, cut short) is refused in
/// JSON, as every refusal of the API is.
struct Body(Bytes);

impl<S: Send + Sync> FromRequest<S> for Body {
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Response> {
        Bytes::from_request(request, state)
            .await
            .map(Body)
            .map_err(|refused| error(refused.status(), refused.body_text()))
    }
}

fn error(status: StatusCode, message: impl std::fmt::Display) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        json!({ "error": message.to_string() }).to_string() + "\n",
    )
        .into_response()
}

fn ok(body: Value) -> Response {
    ok_written(body.to_string() + "\n")
}

/// [`ok`] with its body written already.
fn ok_written(body: String) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}

/// A call refused, with the status and the message it answers.
#[derive(Debug)]
struct Refused(StatusCode, String);

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        error(self.0, self.1)
    }
}

impl From<&OperatorError> for Refused {
    fn from(err: &OperatorError) -> Self {
        let status = match err {
            OperatorError::Invalid(_) => StatusCode::BAD_REQUEST,
            OperatorError::UnknownDomain(_) | OperatorError::NotFound(_) => StatusCode::NOT_FOUND,
            OperatorError::TooMany { .. } => StatusCode::CONFLICT,
            OperatorError::Request(e) if e.is_invalid_request() => StatusCode::BAD_REQUEST,
            OperatorError::Request(_) | OperatorError::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
        };
        Refused(status, err.to_string())
    }
}

impl From<OperatorError> for Refused {
    fn from(err: OperatorError) -> Self {
        Self::from(&err)
    }
}

fn bad_request(message: impl Into<String>) -> Refused {
    Refused(StatusCode::BAD_REQUEST, message.into())
}

/// Refuses, before anything else is read, every call without the token.
async fn authorize(State(state): State<AdminState>, request: Request, next: Next) -> Response {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim_start().split_once(' '))
        // The scheme is case-insensitive (RFC 7235).
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim());
    if presented.is_some_and(|t| state.token.accepts(t.as_bytes())) {
        return next.run(request).await;
    }
    let refused_total = state.refused.fetch_add(1, Ordering::Relaxed) + 1;
    audit_refused_token(&request, refused_total);
    let mut refused = error(
        StatusCode::UNAUTHORIZED,
        "a bearer token is needed: Authorization: Bearer <admin.token>",
    );
    refused.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        header::HeaderValue::from_static("Bearer"),
    );
    refused
}

/// Logs a call refused for its token on the audit target, at most once a second (a client guessing
/// tokens must not flood the log): the peer, the path (escaped), and how many were refused so far.
fn audit_refused_token(request: &Request, refused_total: u64) {
    static LAST_LOGGED_SECS: AtomicU64 = AtomicU64::new(0);
    let now_secs = std::time::SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if LAST_LOGGED_SECS.swap(now_secs, Ordering::Relaxed) == now_secs {
        return;
    }
    let caller = request.extensions().get::<Caller>();
    let from = caller
        .and_then(|c| c.peer)
        .map_or_else(|| "unknown".to_owned(), |p| p.to_string());
    let certificate = caller
        .and_then(|c| c.certificate.as_deref())
        .unwrap_or("none");
    let path: String = request.uri().path().chars().take(256).collect();
    tracing::warn!(
        target: "ratelimitd::audit",
        from, certificate, refused_total,
        "operators' API: call from {from} refused: no valid bearer token ({:?} {path:?}; {refused_total} refused so far, at most one line a second)",
        request.method().as_str()
    );
}

/// A descriptor as calls name it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EntryIn {
    key: String,
    value: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TargetIn {
    domain: String,
    descriptor: Vec<EntryIn>,
}

fn target(domain: String, descriptor: Vec<EntryIn>) -> Result<Target, Refused> {
    if domain.is_empty() || descriptor.is_empty() {
        return Err(bad_request(
            "a domain and a descriptor of at least one {key, value} entry are needed",
        ));
    }
    if let Some(at) = descriptor.iter().position(|e| e.key.is_empty()) {
        return Err(bad_request(format!(
            "entry {at} of the descriptor has an empty key (a rule's key is never empty)"
        )));
    }
    Ok(Target {
        domain,
        entries: descriptor
            .into_iter()
            .map(|e| Entry {
                key: e.key,
                value: e.value,
            })
            .collect(),
    })
}

fn parse<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T, Refused> {
    serde_json::from_slice(body).map_err(|e| bad_request(format!("not a valid call: {e}")))
}

/// [`parse`] for a change, whose refusal is audited. The log gets where the body went wrong, not
/// serde's message, which can quote a value of the body (a raw API key).
fn parse_change<T: for<'de> Deserialize<'de>>(
    who: &Who<'_>,
    action: &str,
    body: &Bytes,
) -> Result<T, Refused> {
    serde_json::from_slice(body).map_err(|e| {
        let at = format!(
            "not a valid call ({:?} error at line {}, column {})",
            e.classify(),
            e.line(),
            e.column()
        );
        who.audit(action, "a malformed body", Err(&at));
        bad_request(format!("not a valid call: {e}"))
    })
}

/// The operator a call names (`X-Operator`), kept to a short plain name for the log.
fn operator(headers: &HeaderMap) -> String {
    let named: String = headers
        .get(OPERATOR_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || "._@-".contains(*c))
        .take(64)
        .collect();
    if named.is_empty() {
        "unnamed".into()
    } else {
        named
    }
}

/// Who makes a change, for the audit log.
struct Who<'a> {
    caller: &'a Caller,
    operator: String,
}

impl Who<'_> {
    /// One line of the audit log: who did what, and how it ended. `what` and the outcome hold text the
    /// caller chose (a domain, keys, a unit): they are written quoted and escaped, so that no call can
    /// write a line of its own.
    fn audit(&self, action: &str, what: &str, outcome: Result<&str, &str>) {
        let operator = self.operator.as_str();
        let from = self
            .caller
            .peer
            .map_or_else(|| "unknown".to_owned(), |p| p.to_string());
        let certificate = self.caller.certificate.as_deref().unwrap_or("none");
        match outcome {
            Ok(done) => tracing::warn!(
                target: "ratelimitd::audit",
                action, operator, from, certificate,
                "operators' API: {action} by {operator} from {from}: {what:?}: {done:?}"
            ),
            Err(refused) => tracing::warn!(
                target: "ratelimitd::audit",
                action, operator, from, certificate,
                "operators' API: {action} by {operator} from {from} refused: {what:?}: {refused:?}"
            ),
        }
    }

    /// Logs a refused change, and answers it.
    fn refuse(&self, action: &str, what: &str, refused: Refused) -> Refused {
        self.audit(action, what, Err(&refused.1));
        refused
    }
}

/// A descriptor as logs and answers show it (sensitive values hashed already).
fn shown(domain: &str, descriptor: &[(String, String)]) -> String {
    let entries: Vec<String> = descriptor.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("{} [{}]", short(domain), entries.join(", "))
}

/// A domain as the audit log shows it: at most 128 characters (a call's domain has no other bound but
/// the body's).
fn short(domain: &str) -> std::borrow::Cow<'_, str> {
    match domain.char_indices().nth(128) {
        Some((end, _)) => format!("{}...", &domain[..end]).into(),
        None => domain.into(),
    }
}

/// A target before the limiter has shown it: keys only, so that no raw value reaches the log.
fn keys_of(target: &Target) -> String {
    let keys: Vec<&str> = target.entries.iter().map(|e| e.key.as_str()).collect();
    format!("{} [{}]", short(&target.domain), keys.join(", "))
}

fn entries_json(descriptor: &[(String, String)]) -> Value {
    descriptor
        .iter()
        .map(|(k, v)| json!({ "key": k, "value": v }))
        .collect()
}

/// A time in ms since the epoch as RFC 3339; one RFC 3339 cannot write (past 9999, as a record written
/// before expiries were bounded may hold) as the number of ms, never a panic.
fn rfc3339(ms: u64) -> String {
    use std::fmt::Write;
    let mut text = String::new();
    match UNIX_EPOCH.checked_add(Duration::from_millis(ms)) {
        Some(t) if write!(text, "{}", humantime::format_rfc3339_seconds(t)).is_ok() => text,
        _ => format!("{ms} ms after 1970-01-01T00:00:00Z"),
    }
}

fn inspection_json(i: &Inspection) -> Value {
    let limits: Vec<Value> = i
        .limits
        .iter()
        .map(|l| {
            json!({
                "source": if l.runtime_id.is_some() { "runtime" } else { "rules" },
                "runtime_id": l.runtime_id,
                "applies": l.applies,
                "name": l.name,
                "algorithm": l.params.algorithm.name(),
                "requests_per_unit": l.requests_per_unit,
                "unit": l.unit.name(),
                "window_seconds": l.params.window_ms / 1000,
                "burst": l.params.algorithm.uses_burst().then_some(l.params.burst),
                "count_over_limit": l.params.count_over_limit,
                "used": (l.usage.used * 1000.0).round() / 1000.0,
                "remaining": l.usage.remaining,
                "reset_seconds": l.usage.reset_ms.div_ceil(1000),
                "over_limit": l.usage.over,
            })
        })
        .collect();
    json!({
        "domain": i.domain,
        "descriptor": entries_json(&i.descriptor),
        "rule": i.rule,
        "unlimited": i.unlimited,
        "limits": limits,
    })
}

fn limit_json(r: &RuntimeLimit) -> Value {
    json!({
        "id": r.id,
        "domain": r.domain,
        "descriptor": entries_json(&r.descriptor),
        "limit": r.limit,
        "expires_at": r.expires_at_ms.map(rfc3339),
        "set_at": rfc3339(r.set_at_ms),
        "set_by": r.set_by,
    })
}

fn limit_text(spec: &LimitSpec) -> String {
    let mut text = format!("{} per ", spec.requests_per_unit);
    if let Some(n) = spec.unit_multiplier.filter(|&n| n != 1) {
        text.push_str(&format!("{n} x "));
    }
    text.push_str(&spec.unit.to_ascii_uppercase());
    if let Some(algorithm) = spec.algorithm {
        text.push_str(&format!(", {}", algorithm.name()));
    }
    if let Some(burst) = spec.burst {
        text.push_str(&format!(", burst {burst}"));
    }
    if spec.count_over_limit {
        text.push_str(", count_over_limit");
    }
    text
}

async fn inspect(State(state): State<AdminState>, Body(body): Body) -> Result<Response, Refused> {
    let call: TargetIn = parse(&body)?;
    let target = target(call.domain, call.descriptor)?;
    let inspection = state.limiter.inspect(&target).await?;
    Ok(ok(inspection_json(&inspection)))
}

async fn reset(
    State(state): State<AdminState>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    Body(body): Body,
) -> Result<Response, Refused> {
    let who = Who {
        caller: &caller,
        operator: operator(&headers),
    };
    let call: TargetIn = parse_change(&who, "reset", &body)?;
    let target = target(call.domain, call.descriptor)
        .map_err(|refused| who.refuse("reset", "a call without a target", refused))?;
    match state.limiter.reset(&target).await {
        Ok(reset) => {
            let what = shown(&target.domain, &reset.descriptor);
            let done = format!(
                "{} limits, {} counters cleared",
                reset.limits, reset.counters
            );
            who.audit("reset", &what, Ok(&done));
            Ok(ok(
                json!({ "limits": reset.limits, "counters_cleared": reset.counters }),
            ))
        }
        Err(err) => Err(who.refuse("reset", &keys_of(&target), err.into())),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SetIn {
    domain: String,
    descriptor: Vec<EntryIn>,
    limit: LimitSpec,
    /// How long from now, e.g. `72h`.
    #[serde(default)]
    expires_in: Option<String>,
    /// When, RFC 3339, e.g. `2026-12-04T18:00:00Z`.
    #[serde(default)]
    expires_at: Option<String>,
}

/// When a runtime limit set now ends, as the call writes it; the limiter bounds it by its clock.
fn expiry(expires_in: Option<&str>, expires_at: Option<&str>) -> Result<Option<Expiry>, Refused> {
    match (expires_in, expires_at) {
        (Some(_), Some(_)) => Err(bad_request("give expires_in or expires_at, not both")),
        (Some(within), None) => humantime::parse_duration(within)
            .map(|d| Some(Expiry::In(d)))
            .map_err(|e| {
                bad_request(format!(
                    "expires_in {within:?}: {e}; write e.g. 30m, 72h, 7days"
                ))
            }),
        // Before the epoch reads as the epoch: long past, refused as such.
        (None, Some(at)) => timestamp::parse_ms(at)
            .map(|ms| Some(Expiry::At(Some(u64::try_from(ms).unwrap_or(0)))))
            .map_err(|e| {
                bad_request(format!(
                    "expires_at {at:?}: {e}; write e.g. 2026-12-04T18:00:00Z or 2026-12-04T19:00:00+01:00"
                ))
            }),
        (None, None) => Ok(None),
    }
}

async fn set_limit(
    State(state): State<AdminState>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    Body(body): Body,
) -> Result<Response, Refused> {
    let who = Who {
        caller: &caller,
        operator: operator(&headers),
    };
    let call: SetIn = parse_change(&who, "limit set", &body)?;
    let target = target(call.domain, call.descriptor)
        .map_err(|refused| who.refuse("limit set", "a call without a target", refused))?;
    let what = format!("{} to {}", keys_of(&target), limit_text(&call.limit));
    let expires = expiry(call.expires_in.as_deref(), call.expires_at.as_deref())
        .map_err(|refused| who.refuse("limit set", &what, refused))?;
    let record = state
        .limiter
        .set_runtime_limit(&target, call.limit, expires, &who.operator)
        .await
        .map_err(|err| who.refuse("limit set", &what, err.into()))?;
    let what = format!(
        "{} to {}",
        shown(&record.domain, &record.descriptor),
        limit_text(&record.limit)
    );
    let until = record.expires_at_ms.map_or_else(
        || "until deleted".to_owned(),
        |at| format!("until {}", rfc3339(at)),
    );
    who.audit(
        "limit set",
        &what,
        Ok(&format!("id {}, {until}", record.id)),
    );
    Ok(ok(limit_json(&record)))
}

/// The value of `name` in a query string, decoded as forms encode it (`+` for a space, as Python's
/// `requests` and HTML forms write one; `%2B` for a plus sign).
fn query_value(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (key, value) = pair.split_once('=')?;
        (key == name).then(|| {
            percent_encoding::percent_decode_str(&value.replace('+', " "))
                .decode_utf8_lossy()
                .into_owned()
        })
    })
}

async fn list_limits(
    State(state): State<AdminState>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> Result<Response, Refused> {
    let domain = query.as_deref().and_then(|q| query_value(q, "domain"));
    let limits = state.limiter.runtime_limits().await?;
    // Up to tens of megabytes of JSON at the bound: written off the threads that decide requests.
    let body = tokio::task::spawn_blocking(move || {
        let listed: Vec<Value> = limits
            .iter()
            .filter(|r| domain.as_ref().is_none_or(|d| &r.domain == d))
            .map(limit_json)
            .collect();
        json!({ "limits": listed }).to_string() + "\n"
    })
    .await
    .map_err(|e| {
        Refused(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("listing the runtime limits failed: {e}"),
        )
    })?;
    Ok(ok_written(body))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DeleteIn {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    domain: Option<String>,
    #[serde(default)]
    descriptor: Option<Vec<EntryIn>>,
}

async fn delete_limit(
    State(state): State<AdminState>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    Body(body): Body,
) -> Result<Response, Refused> {
    let who = Who {
        caller: &caller,
        operator: operator(&headers),
    };
    let call: DeleteIn = parse_change(&who, "limit delete", &body)?;
    let id = match call {
        DeleteIn {
            id: Some(id),
            domain: None,
            descriptor: None,
        } => id,
        DeleteIn {
            id: None,
            domain: Some(domain),
            descriptor: Some(descriptor),
        } => {
            let refuse = |refused| who.refuse("limit delete", "a call without a target", refused);
            let target = target(domain, descriptor).map_err(refuse)?;
            state
                .limiter
                .runtime_limit_id(&target)
                .map_err(|err| refuse(err.into()))?
        }
        _ => {
            return Err(who.refuse(
                "limit delete",
                "a call without a target",
                bad_request("name the runtime limit by its id, or by its domain and descriptor"),
            ))
        }
    };
    let what = format!("id {id}");
    let record = state
        .limiter
        .delete_runtime_limit(&id)
        .await
        .map_err(|err| who.refuse("limit delete", &what, err.into()))?;
    let Some(record) = record else {
        // A record that no longer read as a runtime limit (it was logged when left out).
        who.audit(
            "limit delete",
            &what,
            Ok(&format!("id {id} deleted (unreadable)")),
        );
        return Ok(ok(json!({ "deleted": { "id": id } })));
    };
    let what = format!(
        "{} ({})",
        shown(&record.domain, &record.descriptor),
        limit_text(&record.limit)
    );
    who.audit("limit delete", &what, Ok(&format!("id {id} deleted")));
    Ok(ok(json!({ "deleted": limit_json(&record) })))
}

#[cfg(test)]
mod tests {
    use super::query_value;

    #[test]
    fn query_values_are_decoded_as_forms_encode_them() {
        let value = |q| query_value(q, "domain");
        assert_eq!(value("domain=my+domain").as_deref(), Some("my domain"));
        assert_eq!(value("domain=a%2Bb").as_deref(), Some("a+b"));
        assert_eq!(value("x=1&domain=api%20v2").as_deref(), Some("api v2"));
        assert_eq!(value("subdomain=api"), None);
        assert_eq!(value("domain"), None);
    }
}
