//! An xDS control plane for tests: a real tonic aggregated discovery service on 127.0.0.1, serving
//! `RateLimitConfig` snapshots state-of-the-world style, as Envoy Gateway's go-control-plane snapshot
//! cache does: the current snapshot to a request whose version differs from it (a subscription that
//! names an older version, or none), not to one that ACKs it or NACKs it, and to every subscribed stream
//! whenever a new snapshot is pushed; each response with a fresh nonce. Every request received is kept, with the stream's metadata, so tests can read the
//! node, the ACKs and the NACKs. It can require client certificates, and it can be stopped and started
//! again on the same port, to play a control plane restarting.
#![allow(dead_code)]

use std::{
    net::SocketAddr,
    pin::Pin,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use prost::Message;
use ratelimitd::proto::xds::{
    aggregated_discovery_service_server::{
        AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
    },
    DiscoveryRequest, DiscoveryResponse, RateLimitConfig, RateLimitDescriptor, RateLimitPolicy,
    RateLimitUnit, RATE_LIMIT_CONFIG_TYPE,
};
use tokio::{
    net::TcpListener,
    sync::{mpsc, watch},
    task::JoinHandle,
};
use tokio_stream::{wrappers::ReceiverStream, Stream};
use tokio_util::sync::CancellationToken;
use tonic::{
    transport::{Certificate, Identity, ServerTlsConfig},
    Request, Response, Status, Streaming,
};

use super::wait_for;

/// One version of the rules the control plane serves.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub version: String,
    pub resources: Vec<RateLimitConfig>,
    /// The responses' type: the rules' unless a test sends another.
    pub type_url: String,
}

/// A request the control plane received.
#[derive(Debug, Clone)]
pub struct Seen {
    /// Which stream it came on (0, 1, ... in the order streams opened).
    pub stream: usize,
    pub request: DiscoveryRequest,
    /// The stream's gRPC metadata, as (name, value) pairs.
    pub headers: Vec<(String, String)>,
}

impl Seen {
    pub fn nack(&self) -> Option<&str> {
        self.request
            .error_detail
            .as_ref()
            .map(|status| status.message.as_str())
    }
}

/// What the streams share.
#[derive(Default)]
struct Shared {
    seen: Mutex<Vec<Seen>>,
    streams: AtomicUsize,
    nonces: AtomicUsize,
    /// Nonces sent, with the version each carried.
    sent: Mutex<Vec<(String, String)>>,
    /// Whether a NACK is answered with the snapshot again at once, as a go-control-plane cache does
    /// (the NACK names another version than the snapshot's).
    resend_on_nack: AtomicBool,
}

/// Server TLS: the control plane's certificate and, for mTLS, the CA its clients' certificates must
/// chain to.
#[derive(Clone)]
pub struct ServerTls {
    pub cert: String,
    pub key: String,
    pub client_ca: Option<String>,
}

/// A running (or stopped) control plane.
pub struct ControlPlane {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    snapshots: watch::Sender<Option<Snapshot>>,
    tls: Option<ServerTls>,
    running: Option<(CancellationToken, JoinHandle<()>)>,
}

impl ControlPlane {
    /// Starts a plaintext control plane on a free port, serving nothing yet.
    pub async fn start() -> Self {
        Self::start_with(None).await
    }

    /// Starts a control plane with TLS (and mTLS when `tls.client_ca` is set).
    pub async fn start_tls(tls: ServerTls) -> Self {
        Self::start_with(Some(tls)).await
    }

    async fn start_with(tls: Option<ServerTls>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (snapshots, _) = watch::channel(None);
        let shared = Arc::new(Shared::default());
        let mut plane = Self {
            addr: listener.local_addr().unwrap(),
            shared,
            snapshots,
            tls,
            running: None,
        };
        plane.serve(listener);
        plane
    }

    fn serve(&mut self, listener: TcpListener) {
        let stop = CancellationToken::new();
        let service = Ads {
            shared: self.shared.clone(),
            snapshots: self.snapshots.clone(),
            stop: stop.clone(),
        };
        let mut builder = tonic::transport::Server::builder();
        if let Some(tls) = &self.tls {
            let mut config =
                ServerTlsConfig::new().identity(Identity::from_pem(&tls.cert, &tls.key));
            if let Some(ca) = &tls.client_ca {
                config = config.client_ca_root(Certificate::from_pem(ca));
            }
            builder = builder.tls_config(config).unwrap();
        }
        let router = builder.add_service(AggregatedDiscoveryServiceServer::new(service));
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let until = stop.clone();
        let handle = tokio::spawn(async move {
            let _ = router
                .serve_with_incoming_shutdown(incoming, until.cancelled_owned())
                .await;
        });
        self.running = Some((stop, handle));
    }

    /// The `host:port` to give `CONFIG_GRPC_XDS_SERVER_URL`.
    pub fn url(&self) -> String {
        self.addr.to_string()
    }

    /// Serves `snapshot` from now on, to the streams open and to those to come.
    pub fn push(&self, version: &str, resources: Vec<RateLimitConfig>) {
        self.snapshots.send_replace(Some(Snapshot {
            version: version.into(),
            resources,
            type_url: RATE_LIMIT_CONFIG_TYPE.into(),
        }));
    }

    /// Sends a response of `type_url`, which nobody asked for, to the streams open (as a control plane
    /// that pushes every type to every node does), holding the rules' resources.
    pub fn push_unrequested(&self, version: &str, type_url: &str, resources: Vec<RateLimitConfig>) {
        self.snapshots.send_replace(Some(Snapshot {
            version: version.into(),
            resources,
            type_url: type_url.into(),
        }));
    }

    /// Stops serving: open streams end and new connections are refused.
    pub async fn stop(&mut self) {
        if let Some((stop, handle)) = self.running.take() {
            stop.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(5), handle).await;
        }
    }

    /// Serves again on the same port, with the snapshot pushed last.
    pub async fn restart(&mut self) {
        self.stop().await;
        let listener = TcpListener::bind(self.addr).await.unwrap();
        self.serve(listener);
    }

    /// From now on, answers a NACK by sending the snapshot again at once, as a go-control-plane cache
    /// does.
    pub fn resend_on_nack(&self) {
        self.shared.resend_on_nack.store(true, Ordering::SeqCst);
    }

    /// Every request received so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.shared.seen.lock().unwrap().clone()
    }

    /// How many streams were opened so far.
    pub fn streams(&self) -> usize {
        self.shared.streams.load(Ordering::SeqCst)
    }

    /// The nonce of the response that carried `version` last.
    pub fn nonce_of(&self, version: &str) -> Option<String> {
        let sent = self.shared.sent.lock().unwrap();
        sent.iter()
            .rev()
            .find(|(_, v)| v == version)
            .map(|(nonce, _)| nonce.clone())
    }

    /// Waits until a request answering the response that carried `version` arrives, and returns it.
    pub async fn answer_to(&self, version: &str, within: Duration) -> Seen {
        wait_for(
            &format!("the answer to version {version}"),
            within,
            async || {
                let nonce = self.nonce_of(version)?;
                self.seen()
                    .into_iter()
                    .find(|s| s.request.response_nonce == nonce)
            },
        )
        .await
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        if let Some((stop, handle)) = self.running.take() {
            stop.cancel();
            handle.abort();
        }
    }
}

/// The service itself.
struct Ads {
    shared: Arc<Shared>,
    snapshots: watch::Sender<Option<Snapshot>>,
    /// Cancelled when the control plane stops: every stream ends.
    stop: CancellationToken,
}

type Responses = Pin<Box<dyn Stream<Item = Result<DiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = Responses;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Responses>, Status> {
        let headers: Vec<(String, String)> = request
            .metadata()
            .iter()
            .filter_map(|kv| match kv {
                tonic::metadata::KeyAndValueRef::Ascii(k, v) => {
                    Some((k.to_string(), v.to_str().ok()?.to_string()))
                }
                tonic::metadata::KeyAndValueRef::Binary(..) => None,
            })
            .collect();
        let mut inbound = request.into_inner();
        let stream = self.shared.streams.fetch_add(1, Ordering::SeqCst);
        let (tx, rx) = mpsc::channel(8);
        let (shared, stop) = (self.shared.clone(), self.stop.clone());
        let mut snapshots = self.snapshots.subscribe();
        tokio::spawn(async move {
            let mut subscribed = false;
            loop {
                let send_now = tokio::select! {
                    _ = stop.cancelled() => break,
                    message = inbound.message() => match message {
                        Ok(Some(request)) => {
                            subscribed = true;
                            let current = snapshots.borrow_and_update().clone();
                            // Behind the snapshot, and not refusing it (or resending anyway): send it.
                            let resend = shared.resend_on_nack.load(Ordering::SeqCst);
                            let send = current.is_some_and(|s| {
                                s.version != request.version_info
                                    && (request.error_detail.is_none() || resend)
                            });
                            shared.seen.lock().unwrap().push(Seen {
                                stream,
                                request,
                                headers: headers.clone(),
                            });
                            send
                        }
                        _ => break,
                    },
                    changed = snapshots.changed(), if subscribed => {
                        if changed.is_err() {
                            break;
                        }
                        true
                    }
                };
                if !send_now {
                    continue;
                }
                let current = snapshots.borrow_and_update().clone();
                let Some(snapshot) = current else { continue };
                let nonce = format!("n{}", shared.nonces.fetch_add(1, Ordering::SeqCst));
                shared
                    .sent
                    .lock()
                    .unwrap()
                    .push((nonce.clone(), snapshot.version.clone()));
                let response = DiscoveryResponse {
                    version_info: snapshot.version.clone(),
                    resources: snapshot.resources.iter().map(resource).collect(),
                    type_url: snapshot.type_url.clone(),
                    nonce,
                };
                if tx.send(Ok(response)).await.is_err() {
                    break;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// A `RateLimitConfig` as a response carries it.
pub fn resource(config: &RateLimitConfig) -> prost_types::Any {
    prost_types::Any {
        type_url: RATE_LIMIT_CONFIG_TYPE.into(),
        value: config.encode_to_vec(),
    }
}

/// A domain with one rule: `key` limited to `limit` per `unit`, named `name`.
pub fn one_rule(
    name: &str,
    domain: &str,
    key: &str,
    limit: u32,
    unit: RateLimitUnit,
) -> RateLimitConfig {
    RateLimitConfig {
        name: name.into(),
        domain: domain.into(),
        descriptors: vec![RateLimitDescriptor {
            key: key.into(),
            rate_limit: Some(RateLimitPolicy {
                unit: unit as i32,
                requests_per_unit: limit,
                name: format!("{key}_limit"),
                ..RateLimitPolicy::default()
            }),
            ..RateLimitDescriptor::default()
        }],
    }
}
