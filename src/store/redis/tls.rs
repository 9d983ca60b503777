//! TLS to Redis: the CA that signs the servers (or the system's roots), an optional client certificate,
//! and optionally no hostname check (for Redis nodes reached by IP that present a certificate for a name).

use std::sync::Arc;

use fred::types::config::TlsConnector;
use rustls::{
    client::{
        danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
        WebPkiServerVerifier,
    },
    pki_types::{CertificateDer, ServerName, UnixTime},
    ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};

use super::{RedisSettings, StoreError};
use crate::tls::{certificates, private_key, provider, roots};

/// The connector for `settings`: fred's default (system roots, no client certificate) unless a CA, a
/// client certificate or skipping the hostname check is asked for.
pub fn connector(settings: &RedisSettings) -> Result<TlsConnector, StoreError> {
    let custom = settings.tls_ca_cert.is_some()
        || settings.tls_client_cert.is_some()
        || settings.tls_skip_hostname_verification;
    if !custom {
        return TlsConnector::default_rustls()
            .map_err(|e| StoreError::Config(format!("REDIS_TLS: {e}")));
    }
    let config_error = |e: &dyn std::fmt::Display| StoreError::Config(format!("REDIS_TLS: {e}"));
    let roots = match &settings.tls_ca_cert {
        Some(path) => roots("REDIS_TLS_CACERT", path).map_err(|e| config_error(&e))?,
        None => {
            let mut store = RootCertStore::empty();
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = store.add(cert);
            }
            store
        }
    };
    let roots = Arc::new(roots);
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| config_error(&e))?;
    let builder = if settings.tls_skip_hostname_verification {
        let inner = WebPkiServerVerifier::builder_with_provider(roots, provider())
            .build()
            .map_err(|e| config_error(&e))?;
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyHostname(inner)))
    } else {
        builder.with_root_certificates(roots)
    };
    let config = match (&settings.tls_client_cert, &settings.tls_client_key) {
        (Some(cert), Some(key)) => {
            let chain =
                certificates("REDIS_TLS_CLIENT_CERT", cert).map_err(|e| config_error(&e))?;
            let key = private_key("REDIS_TLS_CLIENT_KEY", key).map_err(|e| config_error(&e))?;
            builder.with_client_auth_cert(chain, key).map_err(|e| {
                config_error(&format!(
                    "REDIS_TLS_CLIENT_KEY does not go with REDIS_TLS_CLIENT_CERT: {e}"
                ))
            })?
        }
        _ => builder.with_no_client_auth(),
    };
    Ok(TlsConnector::from(config))
}

/// Checks the chain and signatures like the standard verifier, and accepts any host name.
#[derive(Debug)]
struct AnyHostname(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyHostname {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName
                | rustls::CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}
