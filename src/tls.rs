//! PEM files for TLS, read the same way for the gRPC listener and the Redis client: certificates, private
//! keys and CA bundles, with errors that name the setting and the file but never a key's contents.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

use rustls::{
    crypto::CryptoProvider,
    pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer},
    RootCertStore,
};

/// A TLS file that cannot be used.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{setting} {path}: {reason}")]
pub struct TlsFileError {
    pub setting: &'static str,
    pub path: PathBuf,
    pub reason: String,
}

impl TlsFileError {
    pub fn new(setting: &'static str, path: &Path, reason: impl std::fmt::Display) -> Self {
        Self {
            setting,
            path: path.to_owned(),
            reason: reason.to_string(),
        }
    }
}

/// The cryptography every TLS configuration here uses.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read(setting: &'static str, path: &Path) -> Result<Vec<u8>, TlsFileError> {
    std::fs::read(path).map_err(|e| TlsFileError::new(setting, path, e))
}

/// Every certificate of a PEM file, in order; at least one.
pub fn certificates(
    setting: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsFileError> {
    let pem = read(setting, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        // The parser's error quotes parts of the file: say only what is expected.
        .map_err(|_| {
            TlsFileError::new(
                setting,
                path,
                "not PEM certificates (-----BEGIN CERTIFICATE----- blocks)",
            )
        })?;
    if certs.is_empty() {
        return Err(TlsFileError::new(
            setting,
            path,
            "no certificate in the file",
        ));
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn private_key(
    setting: &'static str,
    path: &Path,
) -> Result<PrivateKeyDer<'static>, TlsFileError> {
    let pem = read(setting, path)?;
    // The parser's own error could quote the file; say only what is wrong.
    PrivateKeyDer::from_pem_slice(&pem).map_err(|_| {
        TlsFileError::new(
            setting,
            path,
            "no PEM private key (PKCS#8, PKCS#1 or SEC1) in the file",
        )
    })
}

/// A trust store of the CA certificates of a PEM file.
pub fn roots(setting: &'static str, path: &Path) -> Result<RootCertStore, TlsFileError> {
    let mut roots = RootCertStore::empty();
    for cert in certificates(setting, path)? {
        roots
            .add(cert)
            .map_err(|e| TlsFileError::new(setting, path, e))?;
    }
    Ok(roots)
}
