//! The operators' API settings (part of the process settings): its own listener, off unless enabled,
//! the bearer token every call must carry, and TLS with optional client certificates.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::super::tls::TlsFiles;
use crate::store::redis::Secret;

/// The operators' API (`admin.*`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminSettings {
    /// Serve the operators' API (default false: no listener at all).
    pub enabled: bool,
    /// IP address to bind (default `127.0.0.1`: only this host, e.g. `kubectl exec ... ratelimitd admin`
    /// or a port-forward; set `0.0.0.0` to reach it from elsewhere, then with TLS).
    pub host: String,
    /// TCP port (default 8082); 0 picks a free one.
    pub port: u16,
    /// The bearer token every call must carry (`Authorization: Bearer <token>`), at least 16 bytes.
    /// Never logged. Env `RATELIMITD_ADMIN__TOKEN`; or use `token_file` (not both).
    pub token: Secret,
    /// A file holding the token (a mounted Secret), read at start and again when it changes, so that a
    /// rotated token applies without a restart; removed, emptied or too short, every call is refused
    /// until it holds a usable token again. Surrounding whitespace is ignored.
    pub token_file: Option<PathBuf>,
    /// TLS on the listener, and client certificates (mTLS) when `tls.client_ca` is set.
    pub tls: AdminTlsSettings,
    /// Open connections at most (default 16); more wait in the kernel's backlog.
    pub max_connections: usize,
    /// Largest request body (default 65 536 bytes); larger ones are answered 413 unread.
    pub max_body_bytes: usize,
}

impl Default for AdminSettings {
    fn default() -> Self {
        Self {
            enabled: false,
            host: "127.0.0.1".into(),
            port: 8082,
            token: Secret::default(),
            token_file: None,
            tls: AdminTlsSettings::default(),
            max_connections: 16,
            max_body_bytes: 64 * 1024,
        }
    }
}

/// TLS on the operators' API listener. The files are read at start (an unusable one stops the start)
/// and again when they change.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminTlsSettings {
    pub enabled: bool,
    /// The server's PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// Its PEM private key.
    pub key: PathBuf,
    /// When set, clients must present a certificate these PEM CAs signed (mTLS), besides the token.
    pub client_ca: Option<PathBuf>,
}

impl AdminTlsSettings {
    /// The files, named by their settings, for HTTP/1.1.
    pub fn files(&self) -> TlsFiles {
        TlsFiles {
            cert: ("admin.tls.cert", self.cert.clone()),
            key: ("admin.tls.key", self.key.clone()),
            client_ca: self.client_ca.clone().map(|ca| ("admin.tls.client_ca", ca)),
            client_san: None,
            alpn: b"http/1.1",
        }
    }
}
