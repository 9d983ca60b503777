//! TLS on the gRPC listener: server certificates, optional client certificates (mTLS) with an optional
//! required SAN, all read from files and reloaded when the files change, without a restart.
//!
//! Connections are accepted on the TCP listener and their handshakes run in tasks of their own, so a slow
//! or hostile client cannot hold up the others; finished handshakes are handed to the gRPC server as a
//! stream. A handshake must end by the connection's handshake deadline (`grpc.handshake_timeout` from
//! the accept, see `api::conn`), which then also bounds the HTTP/2 preface that follows it. Every
//! handshake uses the configuration current at that moment: a rotated certificate (a Kubernetes Secret
//! update, cert-manager) applies to new connections as soon as it is read, while open connections keep
//! the one they started with.

use std::{
    path::PathBuf,
    sync::Arc,
    time::{Duration, SystemTime},
};

use arc_swap::ArcSwap;
use rustls::{pki_types::ServerName, server::WebPkiClientVerifier, ServerConfig};
use serde::{Deserialize, Serialize};
use tokio::net::TcpStream;
use tokio_rustls::{server::TlsStream, TlsAcceptor};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use super::conn::{Acceptor, Counted};
use crate::tls::{certificates, private_key, provider, roots, TlsFileError};

/// TLS on the gRPC listener (part of the process settings). The files are read at start (an unreadable
/// one stops the start) and again whenever they change, without a restart.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpcTlsSettings {
    /// Env `GRPC_SERVER_USE_TLS` (default false).
    pub enabled: bool,
    /// Env `GRPC_SERVER_TLS_CERT`: the server's PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// Env `GRPC_SERVER_TLS_KEY`: its PEM private key.
    pub key: PathBuf,
    /// Env `GRPC_CLIENT_TLS_CACERT`: when set, clients must present a certificate signed by these PEM CAs
    /// (mTLS).
    pub client_ca: Option<PathBuf>,
    /// Env `GRPC_CLIENT_TLS_SAN`: when set, the client certificate must also name this DNS SAN.
    pub client_san: Option<String>,
}

impl GrpcTlsSettings {
    /// Builds the configuration once without serving: the files read, parse and go together, so that a
    /// wrong one stops the start before any port is bound.
    pub fn check(&self) -> Result<(), TlsError> {
        build(&self.files()).map(drop)
    }

    /// The files, named by the reference's variables, for HTTP/2.
    pub fn files(&self) -> TlsFiles {
        TlsFiles {
            cert: ("GRPC_SERVER_TLS_CERT", self.cert.clone()),
            key: ("GRPC_SERVER_TLS_KEY", self.key.clone()),
            client_ca: self
                .client_ca
                .clone()
                .map(|ca| ("GRPC_CLIENT_TLS_CACERT", ca)),
            client_san: self.client_san.clone(),
            alpn: b"h2",
        }
    }
}

/// What a TLS listener is built from: each file with the setting that names it (for errors), the DNS
/// SAN a client certificate must carry (if any), and the one protocol it speaks (ALPN).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: (&'static str, PathBuf),
    pub key: (&'static str, PathBuf),
    /// Clients must present a certificate these CAs signed (mTLS).
    pub client_ca: Option<(&'static str, PathBuf)>,
    pub client_san: Option<String>,
    pub alpn: &'static [u8],
}

impl TlsFiles {
    /// Builds the configuration once without serving, as [`GrpcTlsSettings::check`] does.
    pub fn check(&self) -> Result<(), TlsError> {
        build(self).map(drop)
    }
}

/// Why a TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error(transparent)]
    File(#[from] TlsFileError),
    #[error("TLS configuration: {0}")]
    Config(String),
}

/// How often the certificate files are checked for changes.
const RELOAD_CHECK: Duration = Duration::from_secs(2);

/// The server's TLS configuration, rebuilt from its files when they change.
pub struct ReloadingTls {
    files: TlsFiles,
    current: ArcSwap<ServerConfig>,
    /// Modification times of the files the current configuration was built from.
    stamps: std::sync::Mutex<Vec<Option<SystemTime>>>,
}

impl std::fmt::Debug for ReloadingTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReloadingTls")
            .field("cert", &self.files.cert)
            .field("client_ca", &self.files.client_ca)
            .finish_non_exhaustive()
    }
}

impl ReloadingTls {
    /// Reads the files once; an error here stops the start (a server that cannot serve TLS must not
    /// serve at all).
    pub fn load(settings: &GrpcTlsSettings) -> Result<Self, TlsError> {
        Self::load_files(settings.files())
    }

    /// [`ReloadingTls::load`] for any listener's files.
    pub fn load_files(files: TlsFiles) -> Result<Self, TlsError> {
        let stamps = stamps(&files);
        let config = build(&files)?;
        Ok(Self {
            files,
            current: ArcSwap::from_pointee(config),
            stamps: std::sync::Mutex::new(stamps),
        })
    }

    /// Rebuilds the configuration if a file changed since the last build. A broken new file keeps the
    /// current configuration serving and says why; it is tried again when it changes again.
    pub fn reload_if_changed(&self) -> Option<Result<(), TlsError>> {
        let now = stamps(&self.files);
        let mut seen = self.stamps.lock().unwrap_or_else(|p| p.into_inner());
        if *seen == now {
            return None;
        }
        *seen = now;
        Some(build(&self.files).map(|config| self.current.store(Arc::new(config))))
    }

    /// Accepts TLS connections with the configuration current now.
    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.current.load_full())
    }

    /// Accepts connections from `acceptor` and yields those whose handshake succeeds (and whose client
    /// certificate carries the required SAN, when one is set), until `stop`; `closed` is cancelled once
    /// the listening socket is closed. Also reloads the files.
    pub fn incoming(
        self: Arc<Self>,
        acceptor: Acceptor,
        stop: CancellationToken,
        closed: CancellationToken,
        failures: Arc<std::sync::atomic::AtomicU64>,
    ) -> ReceiverStream<std::io::Result<Counted<TlsStream<TcpStream>>>> {
        let (tx, rx) = tokio::sync::mpsc::channel(128);
        let tls = self.clone();
        let reload_stop = stop.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(RELOAD_CHECK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = reload_stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                match tls.reload_if_changed() {
                    Some(Ok(())) => tracing::warn!("gRPC TLS certificates reloaded"),
                    Some(Err(err)) => {
                        tracing::error!(
                            "gRPC TLS certificates not reloaded, the previous ones stay: {err}"
                        )
                    }
                    None => {}
                }
            }
        });
        tokio::spawn(async move {
            let acceptor = acceptor.close_then(closed);
            while let Some((tcp, place)) = acceptor.accept(&stop).await {
                let tls_acceptor = self.acceptor();
                let required_san = self.files.client_san.clone();
                let tx = tx.clone();
                let failures = failures.clone();
                tokio::spawn(async move {
                    let handshake = tls_acceptor.accept(tcp);
                    let handshake = match place.handshake_deadline() {
                        Some(deadline) => tokio::time::timeout_at(deadline, handshake).await,
                        None => Ok(handshake.await),
                    };
                    let refused = match handshake {
                        Err(_) => Some("handshake timed out (grpc.handshake_timeout)".to_owned()),
                        Ok(Err(err)) => Some(err.to_string()),
                        Ok(Ok(stream)) => match required_san.as_deref() {
                            Some(san) if !client_has_san(&stream, san) => {
                                Some(format!("client certificate has no DNS SAN {san:?}"))
                            }
                            _ => {
                                let _ = tx.send(Ok(place.connection(stream))).await;
                                None
                            }
                        },
                    };
                    if let Some(reason) = refused {
                        failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        tracing::debug!("gRPC TLS connection refused: {reason}");
                    }
                });
            }
        });
        ReceiverStream::new(rx)
    }
}

fn stamps(files: &TlsFiles) -> Vec<Option<SystemTime>> {
    [
        Some(&files.cert.1),
        Some(&files.key.1),
        files.client_ca.as_ref().map(|(_, ca)| ca),
    ]
    .into_iter()
    .flatten()
    .map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
    .collect()
}

fn build(files: &TlsFiles) -> Result<ServerConfig, TlsError> {
    let chain = certificates(files.cert.0, &files.cert.1)?;
    let key = private_key(files.key.0, &files.key.1)?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = match &files.client_ca {
        Some((setting, ca)) => {
            let roots = roots(setting, ca)?;
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .build()
                .map_err(|e| TlsError::Config(format!("client verification: {e}")))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(chain, key).map_err(|e| {
        TlsFileError::new(
            files.key.0,
            &files.key.1,
            format!("does not go with {}: {e}", files.cert.0),
        )
    })?;
    config.alpn_protocols = vec![files.alpn.to_vec()];
    Ok(config)
}

/// Whether the verified client certificate names `san` among its DNS subject alternative names.
fn client_has_san<IO>(stream: &TlsStream<IO>, san: &str) -> bool {
    let Some(cert) = stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
    else {
        return false;
    };
    let Ok(name) = ServerName::try_from(san) else {
        return false;
    };
    webpki::EndEntityCert::try_from(cert)
        .is_ok_and(|ee| ee.verify_is_valid_for_subject_name(&name).is_ok())
}
