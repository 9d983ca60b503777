//! Serving the HTTP routes over HTTP/1.1 from an [`Acceptor`]: the accept loop of the HTTP listener and
//! of the separate Prometheus listener.
//!
//! What bounds a connection here: its place (`http.max_connections`: past it new clients wait in the
//! kernel's backlog), hyper's header read timeout (`http.header_read_timeout`, counted whenever the
//! connection waits for a request's headers, so it also ends idle keep-alive connections), a time limit
//! on each request from its headers to its answer (`http.request_timeout`, reading the body included:
//! then 408), and the stall bound of the connection itself (`http.idle_timeout`, see `api::conn`).
//!
//! Shutdown: once `stop` is cancelled the listener closes, each connection finishes the request it is
//! answering and closes, and [`serve`] returns when all have.

use std::{convert::Infallible, time::Duration};

use axum::{
    http::{header, Extensions, HeaderValue, Request, Response, StatusCode},
    response::IntoResponse,
    Router,
};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tower::ServiceExt;

use super::conn::Acceptor;

/// The per-request bounds of an HTTP listener (its per-connection ones are the [`Acceptor`]'s).
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// `http.header_read_timeout`.
    pub header_read: Duration,
    /// `http.request_timeout`.
    pub request: Duration,
}

/// Serves `router` on the connections of `acceptor` until `stop`, then drains them.
pub async fn serve(
    acceptor: Acceptor,
    router: Router,
    timeouts: Timeouts,
    stop: CancellationToken,
) {
    let connections = TaskTracker::new();
    while let Some((tcp, place)) = acceptor.accept(&stop).await {
        connections.spawn(serve_connection(
            place.connection(tcp),
            router.clone(),
            Extensions::new(),
            timeouts,
            stop.clone(),
        ));
    }
    // Closes the listening socket before the drain: new clients are refused instead of left waiting.
    drop(acceptor);
    connections.close();
    connections.wait().await;
}

/// Serves `router` on one connection (over TCP, or TLS over it) until the client closes it, or until
/// `stop`, when it finishes the request it is answering. Every request carries `extensions` (what the
/// listener knows of the connection) into the router.
pub async fn serve_connection<IO>(
    io: IO,
    router: Router,
    extensions: Extensions,
    timeouts: Timeouts,
    stop: CancellationToken,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(timeouts.header_read)
        .keep_alive(true);
    let service = hyper::service::service_fn(move |mut request: Request<Incoming>| {
        request.extensions_mut().extend(extensions.clone());
        answer(router.clone(), request, timeouts.request)
    });
    let connection = builder.serve_connection(TokioIo::new(io), service);
    let mut connection = std::pin::pin!(connection);
    let served = tokio::select! {
        served = connection.as_mut() => served,
        _ = stop.cancelled() => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(err) = served {
        // A client that went away or timed out: its business, not the server's.
        tracing::debug!("HTTP connection closed: {err}");
    }
}

/// The router's answer, or 408 (and the connection closed) when it takes longer than `within`.
async fn answer(
    router: Router,
    request: Request<Incoming>,
    within: Duration,
) -> Result<Response<axum::body::Body>, Infallible> {
    let request = request.map(axum::body::Body::new);
    match tokio::time::timeout(within, router.oneshot(request)).await {
        Ok(answered) => answered,
        Err(_) => {
            let mut response = (
                StatusCode::REQUEST_TIMEOUT,
                "request not answered within http.request_timeout\n",
            )
                .into_response();
            // The request's body may be half read: the connection cannot carry another request.
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            Ok(response)
        }
    }
}
