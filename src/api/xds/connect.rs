//! Reaching the control plane: its address, the TLS configuration (the CA, the client certificate for
//! mTLS, the name checked), and the gRPC channel over plain TCP or TLS.
//!
//! The TLS files are read at every connection: a certificate rotated on disk (a Kubernetes Secret, as
//! Envoy Gateway's certgen writes it) is used from the next reconnect on, without a restart.

use std::{sync::Arc, time::Duration};

use hyper_util::rt::TokioIo;
use rustls::{pki_types::ServerName, ClientConfig, RootCertStore};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tonic::transport::{Channel, Endpoint, Uri};

use super::{XdsError, XdsSettings};
use crate::tls::{certificates, private_key, provider, roots};

/// Longest wait for a TCP connection and TLS handshake with the control plane.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// HTTP/2 PINGs on the stream while it is quiet, so that a control plane that vanished (a node lost, a
/// network cut) is noticed within `KEEPALIVE_INTERVAL + KEEPALIVE_TIMEOUT` and ratelimitd reconnects.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// The control plane's address, `host:port` as `CONFIG_GRPC_XDS_SERVER_URL` gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Target {
    /// The host, without the brackets of an IPv6 address: the name a certificate is checked against.
    pub host: String,
    /// The `host:port` authority, as dialled.
    pub authority: String,
}

impl Target {
    pub fn parse(url: &str) -> Result<Self, XdsError> {
        const NAME: &str = "CONFIG_GRPC_XDS_SERVER_URL";
        let bad = |reason: &str| XdsError::setting(NAME, url, reason);
        // gRPC target syntax: `dns:///host:port` names the same address.
        let authority = url.trim().strip_prefix("dns:///").unwrap_or(url.trim());
        let uri: Uri = format!("http://{authority}/")
            .parse()
            .map_err(|_| bad("expected host:port"))?;
        let (Some(host), Some(_port)) = (uri.host(), uri.port_u16()) else {
            return Err(bad("expected host:port"));
        };
        if uri.authority().map(|a| a.as_str()) != Some(authority) {
            return Err(bad("expected host:port, without a scheme or a path"));
        }
        Ok(Self {
            host: host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned(),
            authority: authority.to_owned(),
        })
    }
}

/// The TLS configuration for the control plane: its CA (or the system's roots), the client certificate
/// when one is set, HTTP/2 by ALPN.
pub(super) fn tls_config(settings: &XdsSettings) -> Result<ClientConfig, XdsError> {
    let roots = match &settings.server_ca {
        Some(path) => roots("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", path)?,
        None => {
            let mut store = RootCertStore::empty();
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = store.add(cert);
            }
            store
        }
    };
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| XdsError::Tls(e.to_string()))?
        .with_root_certificates(roots);
    let mut config = match (&settings.client_cert, &settings.client_key) {
        (Some(cert), Some(key)) => {
            let chain = certificates("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", cert)?;
            let key = private_key("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", key)?;
            builder.with_client_auth_cert(chain, key).map_err(|e| {
                XdsError::Tls(format!(
                    "CONFIG_GRPC_XDS_CLIENT_TLS_CERT and CONFIG_GRPC_XDS_CLIENT_TLS_KEY: {e}"
                ))
            })?
        }
        _ => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// Opens a gRPC channel to the control plane (TCP, then TLS when asked for).
pub(super) async fn channel(settings: &XdsSettings) -> Result<Channel, XdsError> {
    let target = Target::parse(&settings.server_url)?;
    let endpoint = Endpoint::from_shared(format!("http://{}", target.authority))
        .map_err(|e| XdsError::setting("CONFIG_GRPC_XDS_SERVER_URL", &settings.server_url, e))?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true);
    if !settings.tls {
        return endpoint
            .connect()
            .await
            .map_err(|e| XdsError::Connect(transport_error(&e)));
    }
    let connector = TlsConnector::from(Arc::new(tls_config(settings)?));
    let name = settings.server_san.as_deref().unwrap_or(&target.host);
    let server_name = ServerName::try_from(name.to_owned()).map_err(|_| {
        XdsError::setting(
            "CONFIG_GRPC_XDS_SERVER_TLS_SAN",
            name,
            "not a DNS name or an IP address",
        )
    })?;
    let authority = target.authority.clone();
    let dial = tower::service_fn(move |_: Uri| {
        let (connector, server_name, authority) =
            (connector.clone(), server_name.clone(), authority.clone());
        async move {
            let tcp = TcpStream::connect(&authority).await?;
            tcp.set_nodelay(true)?;
            let tls = connector.connect(server_name, tcp).await?;
            Ok::<_, std::io::Error>(TokioIo::new(tls))
        }
    });
    endpoint
        .connect_with_connector(dial)
        .await
        .map_err(|e| XdsError::Connect(transport_error(&e)))
}

/// A transport error with its causes, which hold what went wrong (refused, a certificate not trusted),
/// each said once (layers often repeat the one below them).
fn transport_error(err: &tonic::transport::Error) -> String {
    with_causes(err.to_string(), std::error::Error::source(err))
}

/// `text`, then each cause from `source` down that says something new: a TLS alert or a refused
/// connection sits causes deep under the transport's own words.
pub(super) fn with_causes(
    text: String,
    source: Option<&(dyn std::error::Error + 'static)>,
) -> String {
    let mut text = text;
    let mut last = text.clone();
    let mut source = source;
    while let Some(cause) = source {
        let said = cause.to_string();
        if said != last {
            text.push_str(": ");
            text.push_str(&said);
        }
        last = said;
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_host_and_port() {
        for (url, host) in [
            ("localhost:18000", "localhost"),
            ("envoy-gateway:18001", "envoy-gateway"),
            ("10.0.0.7:18000", "10.0.0.7"),
            ("[::1]:18000", "::1"),
            ("dns:///envoy-gateway:18001", "envoy-gateway"),
        ] {
            assert_eq!(Target::parse(url).unwrap().host, host, "{url}");
        }
        for bad in [
            "localhost",
            "http://localhost:18000",
            "localhost:18000/x",
            "",
            "host:port",
        ] {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
    }
}
