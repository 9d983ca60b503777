//! Rules from an xDS control plane (`CONFIG_TYPE=GRPC_XDS_SOTW`): a state-of-the-world client of the
//! aggregated discovery service, subscribed to every `RateLimitConfig` resource, as Envoy Gateway serves
//! them to envoyproxy/ratelimit.
//!
//! - `options`: the settings and their checks; `connect`: the address, TLS and the channel;
//!   `convert`: a response's resources to a rule set; `backoff`: the waits between attempts.
//!
//! The protocol, per stream: the first request carries the node and the type and no version or nonce;
//! each response is the whole rule set, compiled as the rules files are. One that compiles is
//! published (swapped in when it differs from what is served) and ACKed: its version and nonce. One
//! that does not is NACKed: the version last applied, the response's nonce, and the error a rules file
//! would get, prefixed by the resource's name; the rules served stay as they were. When the stream ends
//! (the control plane restarts, the connection drops, the TLS handshake fails), ratelimitd keeps
//! serving the last rules and opens a new stream after the backoff; a new stream starts from an empty
//! version, so the control plane sends the whole set again, whatever it restarted with.

mod backoff;
mod connect;
mod convert;
mod options;

use std::{
    fmt,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

pub use self::{
    backoff::Backoff,
    convert::{domain_file, fingerprint, rule_set, Compile, RefusedSet},
    options::{BackoffSettings, XdsSettings, DEFAULT_MAX_MESSAGE_BYTES},
};
use crate::{
    proto::xds::{
        AggregatedDiscoveryServiceClient, DiscoveryRequest, DiscoveryResponse, Node, Status,
        RATE_LIMIT_CONFIG_TYPE,
    },
    rules::Publisher,
    tls::TlsFileError,
};

/// Why the client cannot talk to the control plane, or a setting it needs is wrong.
#[derive(Debug, thiserror::Error)]
pub enum XdsError {
    #[error("invalid setting {name}={value:?}: {reason}")]
    Setting {
        name: &'static str,
        value: String,
        reason: String,
    },
    #[error("invalid setting {0}")]
    TlsFile(#[from] TlsFileError),
    #[error("TLS to the xDS server (CONFIG_GRPC_XDS_SERVER_USE_TLS): {0}")]
    Tls(String),
    #[error("cannot connect: {0}")]
    Connect(String),
}

impl XdsError {
    fn setting(name: &'static str, value: impl fmt::Display, reason: impl fmt::Display) -> Self {
        Self::Setting {
            name,
            value: value.to_string(),
            reason: reason.to_string(),
        }
    }
}

/// The `google.rpc.Code` a NACK carries: the rule set is invalid.
const INVALID_ARGUMENT: i32 = 3;

/// The client: streams rule sets from the control plane into the [`Publisher`] until stopped.
pub struct XdsClient {
    settings: XdsSettings,
    publisher: Arc<Publisher>,
    compile: Compile,
    /// True while a stream is open and answered: `ratelimitd_xds_connected`.
    connected: Arc<AtomicBool>,
    /// The last set refused: the same set sent again is refused again without compiling it, and its
    /// NACK held back longer each time.
    refused: std::sync::Mutex<Option<Refused>>,
}

/// A rule set refused, by fingerprint, and why.
struct Refused {
    fingerprint: u64,
    message: String,
    /// Times it was refused in a row, nothing else applied between.
    times: u32,
}

/// How long the NACK of a set refused `times` times in a row is held back: none the first time, then
/// one second, doubling up to [`MOST_NACK_HOLD`]. A control plane that answers a NACK by sending the
/// set again at once (go-control-plane's cache, whose version differs from the one a NACK names)
/// would otherwise make both sides spin, a refusal and an error line each turn.
fn nack_hold(times: u32) -> std::time::Duration {
    if times <= 1 {
        return std::time::Duration::ZERO;
    }
    let doubled = std::time::Duration::from_secs(1 << (times - 2).min(16));
    doubled.min(MOST_NACK_HOLD)
}

/// Longest a NACK is held back (see [`nack_hold`]): a control plane waiting for it sends the set that
/// mends the rules no later than this after it is ready.
const MOST_NACK_HOLD: std::time::Duration = std::time::Duration::from_secs(16);

/// How long a stream may stay unanswered before the log says so: a control plane that serves nothing
/// for this node id (a `CONFIG_GRPC_XDS_NODE_ID` it does not know) leaves it open and silent.
const UNANSWERED_WARNING: std::time::Duration = std::time::Duration::from_secs(30);

/// What to send for a response.
struct Reply {
    request: DiscoveryRequest,
    /// How long to wait before sending it (a NACK of a set refused again).
    hold: std::time::Duration,
}

impl Reply {
    fn now(request: DiscoveryRequest) -> Self {
        Self {
            request,
            hold: std::time::Duration::ZERO,
        }
    }
}

/// How one stream ended.
struct Ended {
    /// Whether the control plane sent anything on it: then the backoff starts over.
    answered: bool,
    reason: String,
}

impl XdsClient {
    pub fn new(settings: XdsSettings, publisher: Arc<Publisher>, compile: Compile) -> Self {
        Self {
            settings,
            publisher,
            compile,
            connected: Arc::default(),
            refused: Default::default(),
        }
    }

    /// Whether a stream is open and answered, for metrics.
    pub fn connected(&self) -> Arc<AtomicBool> {
        self.connected.clone()
    }

    /// Keeps a stream to the control plane open, reconnecting after the backoff whenever it ends,
    /// until `stop`.
    pub async fn run(self, stop: CancellationToken) {
        let mut backoff = Backoff::new(&self.settings.backoff);
        // The version last applied, which a NACK names; it survives reconnects.
        let mut applied = String::new();
        tracing::warn!(
            server = %self.settings.server_url,
            node = %self.settings.node_id,
            tls = self.settings.tls,
            "taking the rules from the xDS server {}",
            self.settings.server_url
        );
        loop {
            let ended = tokio::select! {
                _ = stop.cancelled() => return,
                ended = self.stream(&mut applied) => ended,
            };
            self.connected.store(false, Ordering::Relaxed);
            if ended.answered {
                backoff.reset();
            }
            let wait = backoff.next_wait();
            let serving = if applied.is_empty() {
                "no rule set received yet".to_owned()
            } else {
                format!("the rules of version {applied} keep serving")
            };
            tracing::warn!(
                server = %self.settings.server_url,
                "xDS stream ended: {}{}; {serving}; reconnecting in {wait:?}",
                ended.reason,
                self.hint(&ended)
            );
            tokio::select! {
                _ = stop.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// One stream, from connecting to its end.
    async fn stream(&self, applied: &mut String) -> Ended {
        let not_answered = |reason: String| Ended {
            answered: false,
            reason,
        };
        let channel = match connect::channel(&self.settings).await {
            Ok(channel) => channel,
            Err(err) => return not_answered(err.to_string()),
        };
        let mut client = AggregatedDiscoveryServiceClient::new(channel)
            .max_decoding_message_size(self.settings.max_message_bytes());
        let (requests, outgoing) = mpsc::channel(4);
        // The subscription: no version and no nonce, so the control plane sends what it has.
        if requests
            .send(self.request(RATE_LIMIT_CONFIG_TYPE, "", "", None))
            .await
            .is_err()
        {
            return not_answered("the request stream closed".into());
        }
        let mut call = tonic::Request::new(ReceiverStream::new(outgoing));
        match self.settings.headers() {
            Ok(headers) => {
                for (name, value) in headers {
                    call.metadata_mut().insert(name, value);
                }
            }
            Err(err) => return not_answered(err.to_string()),
        }
        let opened = tokio::time::Instant::now();
        let mut warned = false;
        // A server that never answers may not even send the stream's headers.
        let call = client.stream_aggregated_resources(call);
        tokio::pin!(call);
        let opening = tokio::select! {
            opening = &mut call => opening,
            () = tokio::time::sleep_until(opened + UNANSWERED_WARNING) => {
                self.warn_unanswered();
                warned = true;
                call.await
            }
        };
        let mut responses = match opening {
            Ok(response) => response.into_inner(),
            Err(status) => return not_answered(status_text(&status)),
        };
        let mut answered = false;
        // A NACK held back, and when it is due: a response that comes first makes it stale.
        let mut held: Option<(tokio::time::Instant, DiscoveryRequest)> = None;
        let reason = loop {
            let due = match &held {
                Some((due, _)) => Some(*due),
                None if !answered && !warned => Some(opened + UNANSWERED_WARNING),
                None => None,
            };
            let message = match due {
                None => responses.message().await,
                Some(due) => tokio::select! {
                    message = responses.message() => message,
                    () = tokio::time::sleep_until(due) => {
                        if let Some((_, nack)) = held.take() {
                            if requests.send(nack).await.is_err() {
                                break "the request stream closed".to_owned();
                            }
                        } else {
                            warned = true;
                            self.warn_unanswered();
                        }
                        continue;
                    }
                },
            };
            match message {
                Ok(Some(response)) => {
                    if !answered {
                        answered = true;
                        self.connected.store(true, Ordering::Relaxed);
                    }
                    // A response of a type not asked for leaves a held NACK as it is.
                    let Some(reply) = self.answer(response, applied).await else {
                        continue;
                    };
                    if reply.hold.is_zero() {
                        held = None;
                        if requests.send(reply.request).await.is_err() {
                            break "the request stream closed".to_owned();
                        }
                    } else {
                        // The newest nonce, due no later than the NACK held already: a control plane
                        // that resends faster than the hold still gets its answer.
                        let mut due = tokio::time::Instant::now() + reply.hold;
                        if let Some((held_due, _)) = &held {
                            due = due.min(*held_due);
                        }
                        held = Some((due, reply.request));
                    }
                }
                Ok(None) => break "the xDS server closed the stream".to_owned(),
                Err(status) => break status_text(&status),
            }
        };
        Ended { answered, reason }
    }

    /// Applies one response and returns its ACK, or its NACK when the rule set is refused. A set the
    /// service already serves (sent again on a new stream, or by a control plane that resends) is ACKed
    /// without being compiled, and the set refused last is refused again with its message, its NACK
    /// held back longer each time in a row (see [`nack_hold`]); another is compiled off the runtime's
    /// workers, since a large one takes seconds that requests would otherwise wait through. A response
    /// of a type ratelimitd never asked for is ignored, as Envoy ignores one: on an aggregated stream
    /// any request of that type, a NACK too, would subscribe to it.
    async fn answer(&self, response: DiscoveryResponse, applied: &mut String) -> Option<Reply> {
        let version = response.version_info.as_str();
        if response.type_url != RATE_LIMIT_CONFIG_TYPE {
            tracing::warn!(
                version,
                type_url = %response.type_url,
                "xDS response ignored: ratelimitd subscribes to {RATE_LIMIT_CONFIG_TYPE} only, not {}",
                response.type_url
            );
            return None;
        }
        let print = fingerprint(&response.resources);
        if self.publisher.already_serves(print) {
            tracing::info!(
                version,
                changed = false,
                "xDS rules version {version} applied: the rules served already"
            );
            *applied = response.version_info.clone();
            self.forget_refusals();
            let ack = self.request(RATE_LIMIT_CONFIG_TYPE, version, &response.nonce, None);
            return Some(Reply::now(ack));
        }
        let known = (self.refused.lock().unwrap_or_else(|p| p.into_inner()))
            .as_ref()
            .filter(|refused| refused.fingerprint == print)
            .map(|refused| refused.message.clone());
        let compiled = match known {
            Some(message) => Err(message),
            None => {
                let compile = self.compile;
                let resources = response.resources;
                tokio::task::spawn_blocking(move || rule_set(&resources, compile))
                    .await
                    .unwrap_or_else(|join| Err(RefusedSet::Interrupted(join.to_string())))
                    .map_err(|err| err.to_string())
            }
        };
        match compiled {
            Ok(loaded) => {
                let domains = loaded.rules.domains.len();
                let changed = self.publisher.publish(loaded);
                tracing::info!(
                    version,
                    domains,
                    changed,
                    "xDS rules version {version} applied"
                );
                *applied = response.version_info.clone();
                self.forget_refusals();
                let ack = self.request(RATE_LIMIT_CONFIG_TYPE, version, &response.nonce, None);
                Some(Reply::now(ack))
            }
            Err(message) => {
                self.publisher.refuse();
                let times = {
                    let mut refused = self.refused.lock().unwrap_or_else(|p| p.into_inner());
                    let times = match refused.as_ref() {
                        Some(last) if last.fingerprint == print => last.times.saturating_add(1),
                        _ => 1,
                    };
                    *refused = Some(Refused {
                        fingerprint: print,
                        message: message.clone(),
                        times,
                    });
                    times
                };
                let hold = nack_hold(times);
                if times == 1 {
                    tracing::error!(
                        version,
                        applied = %applied,
                        "Error loading new configuration: {message}"
                    );
                } else {
                    tracing::warn!(
                        version,
                        applied = %applied,
                        times,
                        "the same refused rule set again ({times} times in a row), NACKed in {hold:?}: {message}"
                    );
                }
                let nack = self.request(
                    RATE_LIMIT_CONFIG_TYPE,
                    applied,
                    &response.nonce,
                    Some(message),
                );
                Some(Reply {
                    request: nack,
                    hold,
                })
            }
        }
    }

    /// A likely cause of a stream that ended unanswered, when the error itself cannot say it: over TLS
    /// without a client certificate, a server that requires one closes the connection after the
    /// handshake, and the client sees only the connection closed.
    fn hint(&self, ended: &Ended) -> &'static str {
        let closed = ended.reason.contains("connection closed")
            || ended.reason.contains("close_notify")
            || ended.reason.contains("reset by peer");
        if !ended.answered && self.settings.tls && self.settings.client_cert.is_none() && closed {
            " (the server closed the TLS connection: does it require a client certificate? set CONFIG_GRPC_XDS_CLIENT_TLS_CERT and CONFIG_GRPC_XDS_CLIENT_TLS_KEY)"
        } else {
            ""
        }
    }

    /// The stream is open and unanswered for [`UNANSWERED_WARNING`].
    fn warn_unanswered(&self) {
        tracing::warn!(
            server = %self.settings.server_url,
            node = %self.settings.node_id,
            "the xDS server has sent nothing in {UNANSWERED_WARNING:?} on this stream: does it serve rules for the node id {:?} (CONFIG_GRPC_XDS_NODE_ID)?",
            self.settings.node_id
        );
    }

    /// A set was applied: a refused one sent again later is answered at once, as a first refusal.
    fn forget_refusals(&self) {
        if let Some(refused) = self
            .refused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
        {
            refused.times = 0;
        }
    }

    /// A request on the stream: the subscription, an ACK, or (with `error`) a NACK.
    fn request(
        &self,
        type_url: &str,
        version: &str,
        nonce: &str,
        error: Option<String>,
    ) -> DiscoveryRequest {
        DiscoveryRequest {
            version_info: version.to_owned(),
            node: Some(self.node()),
            resource_names: Vec::new(),
            type_url: type_url.to_owned(),
            response_nonce: nonce.to_owned(),
            error_detail: error.map(|message| Status {
                code: INVALID_ARGUMENT,
                message,
                details: Vec::new(),
            }),
        }
    }

    /// Who ratelimitd is to the control plane.
    fn node(&self) -> Node {
        use prost_types::{value::Kind, Struct, Value};
        let fields = self
            .settings
            .node_metadata
            .iter()
            .map(|(k, v)| {
                let value = Value {
                    kind: Some(Kind::StringValue(v.clone())),
                };
                (k.clone(), value)
            })
            .collect();
        Node {
            id: self.settings.node_id.clone(),
            metadata: Some(Struct { fields }),
            user_agent_name: "ratelimitd".into(),
            user_agent_version_type: Some(
                crate::proto::envoy::config::core::v3::node::UserAgentVersionType::UserAgentVersion(
                    env!("CARGO_PKG_VERSION").into(),
                ),
            ),
        }
    }
}

/// A gRPC status in a log line: its code and message, and what caused it (a client certificate the
/// server wanted shows only there: the status itself says "transport error").
fn status_text(status: &tonic::Status) -> String {
    let text = format!("{:?}: {}", status.code(), status.message());
    connect::with_causes(text, std::error::Error::source(status))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nack_is_held_back_longer_each_time_in_a_row_up_to_sixteen_seconds() {
        let held: Vec<u64> = (1..=8).map(|n| nack_hold(n).as_secs()).collect();
        assert_eq!(held, [0, 1, 2, 4, 8, 16, 16, 16]);
        assert_eq!(nack_hold(u32::MAX), MOST_NACK_HOLD);
    }
}
