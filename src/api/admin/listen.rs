//! The operators' API listener: HTTP/1.1 over plaintext or TLS (with client certificates when
//! `admin.tls.client_ca` is set), each connection with a place among `admin.max_connections` and the
//! HTTP listener's timeouts. Every request carries what the listener knows of its connection (the
//! client's address, its certificate's fingerprint) for the audit log. The TLS files are checked for
//! changes at each new connection, so a rotated certificate applies to the next one.

use std::sync::Arc;

use axum::{http::Extensions, Router};
use sha2::{Digest, Sha256};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use super::Caller;
use crate::api::{
    conn::Acceptor,
    http1::{self, Timeouts},
    tls::ReloadingTls,
};

/// Serves `router` on the connections of `acceptor`, over TLS when `tls` is set, until `stop`; then the
/// requests being answered finish and it returns.
pub async fn serve(
    acceptor: Acceptor,
    tls: Option<Arc<ReloadingTls>>,
    router: Router,
    timeouts: Timeouts,
    stop: CancellationToken,
) {
    let connections = TaskTracker::new();
    while let Some((tcp, place)) = acceptor.accept(&stop).await {
        let peer = tcp.peer_addr().ok();
        let (router, stop) = (router.clone(), stop.clone());
        let Some(tls) = &tls else {
            let caller = extensions(Caller {
                peer,
                certificate: None,
            });
            connections.spawn(http1::serve_connection(
                place.http1().connection(tcp),
                router,
                caller,
                timeouts,
                stop,
            ));
            continue;
        };
        if let Some(Err(err)) = tls.reload_if_changed() {
            tracing::error!("admin TLS certificates not reloaded, the previous ones stay: {err}");
        }
        let handshake = tls.acceptor().accept(tcp);
        connections.spawn(async move {
            let handshake = match place.handshake_deadline() {
                Some(deadline) => tokio::time::timeout_at(deadline, handshake).await,
                None => Ok(handshake.await),
            };
            let stream = match handshake {
                Ok(Ok(stream)) => stream,
                Ok(Err(err)) => {
                    tracing::debug!("admin TLS connection refused: {err}");
                    return;
                }
                Err(_) => {
                    tracing::debug!("admin TLS connection refused: handshake timed out");
                    return;
                }
            };
            let certificate = stream
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|chain| chain.first())
                .map(|leaf| fingerprint(leaf.as_ref()));
            let caller = extensions(Caller { peer, certificate });
            http1::serve_connection(
                place.http1().connection(stream),
                router,
                caller,
                timeouts,
                stop,
            )
            .await;
        });
    }
    // Closes the listening socket before the drain: new clients are refused instead of left waiting.
    drop(acceptor);
    connections.close();
    connections.wait().await;
}

fn extensions(caller: Caller) -> Extensions {
    let mut extensions = Extensions::new();
    extensions.insert(caller);
    extensions
}

/// A certificate's fingerprint as the audit log shows it: the first 16 hex digits of its SHA-256.
fn fingerprint(der: &[u8]) -> String {
    Sha256::digest(der)[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
