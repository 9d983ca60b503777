//! The xDS client's options (part of the process settings, assembled by `settings` from the settings
//! file and the reference's `CONFIG_GRPC_XDS_*`, `XDS_CLIENT_*` and `FORCE_START_WITHOUT_INITIAL_CONFIG`
//! variables), and the checks they pass before any port is bound.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use serde::{Deserialize, Serialize};
use tonic::metadata::{AsciiMetadataKey, AsciiMetadataValue};

use super::XdsError;
use crate::store::redis::Secret;

/// Largest response ratelimitd takes from the control plane when `XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES` is
/// unset or 0: gRPC's usual 4 MiB, as the reference's client has.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// Where the rules come from with `CONFIG_TYPE=GRPC_XDS_SOTW`, and how ratelimitd talks to it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct XdsSettings {
    /// The control plane's aggregated discovery service, `host:port`. Env `CONFIG_GRPC_XDS_SERVER_URL`;
    /// default `localhost:18000`.
    pub server_url: String,
    /// The node id ratelimitd presents: a snapshot cache serves what it holds for exactly this id. Env
    /// `CONFIG_GRPC_XDS_NODE_ID`; default `default`.
    pub node_id: String,
    /// The node's metadata, string values. Env `CONFIG_GRPC_XDS_NODE_METADATA` (`k=v,k2=v2`).
    pub node_metadata: BTreeMap<String, String>,
    /// gRPC metadata sent with the stream (an authorization token, a tenant); the values are kept out of
    /// `Debug` output and logs. Env `CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS` (`k:v,k2:v2`).
    pub additional_headers: BTreeMap<String, Secret>,
    /// TLS to the control plane. Env `CONFIG_GRPC_XDS_SERVER_USE_TLS`; default false.
    pub tls: bool,
    /// The client certificate presented to a control plane that requires one (mTLS). Env
    /// `CONFIG_GRPC_XDS_CLIENT_TLS_CERT`, with its key in `CONFIG_GRPC_XDS_CLIENT_TLS_KEY`. Re-read at
    /// every connection, so a rotated certificate is used from the next reconnect on.
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
    /// The CAs that sign the control plane's certificate; unset: the system's roots. Env
    /// `CONFIG_GRPC_XDS_SERVER_TLS_CACERT`.
    pub server_ca: Option<PathBuf>,
    /// The name the control plane's certificate must carry, instead of the host of `server_url`. Env
    /// `CONFIG_GRPC_XDS_SERVER_TLS_SAN`.
    pub server_san: Option<String>,
    /// The waits between attempts to reach the control plane.
    pub backoff: BackoffSettings,
    /// Largest response taken from the control plane, in bytes; 0: 4 MiB. Env
    /// `XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES`.
    pub max_message_bytes: usize,
    /// Report SERVING before the first rule set has arrived (requests are answered UNAVAILABLE, `no rate
    /// limit configuration loaded`, until it does). Env `FORCE_START_WITHOUT_INITIAL_CONFIG`; default
    /// false: NOT_SERVING until the first rule set is applied.
    pub force_start_without_initial_config: bool,
}

impl Default for XdsSettings {
    fn default() -> Self {
        Self {
            server_url: "localhost:18000".into(),
            node_id: "default".into(),
            node_metadata: BTreeMap::new(),
            additional_headers: BTreeMap::new(),
            tls: false,
            client_cert: None,
            client_key: None,
            server_ca: None,
            server_san: None,
            backoff: BackoffSettings::default(),
            max_message_bytes: 0,
            force_start_without_initial_config: false,
        }
    }
}

/// The waits between attempts to reach the control plane: `initial` after the first failure, doubling
/// up to `max`; each varied at random by up to `random_factor` of itself when `jitter` is on, so that a
/// fleet restarted together does not reconnect together. A stream that delivered a response starts the
/// sequence again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BackoffSettings {
    /// Env `XDS_CLIENT_BACKOFF_INITIAL_INTERVAL`; default `10s`.
    #[serde(with = "crate::duration")]
    pub initial: Duration,
    /// Env `XDS_CLIENT_BACKOFF_MAX_INTERVAL`; default `60s`.
    #[serde(with = "crate::duration")]
    pub max: Duration,
    /// Env `XDS_CLIENT_BACKOFF_RANDOM_FACTOR`; default 0.5 (each wait between half and one and a half
    /// times its value).
    pub random_factor: f64,
    /// Env `XDS_CLIENT_BACKOFF_JITTER`; default true.
    pub jitter: bool,
}

impl Default for BackoffSettings {
    fn default() -> Self {
        Self {
            initial: Duration::from_secs(10),
            max: Duration::from_secs(60),
            random_factor: 0.5,
            jitter: true,
        }
    }
}

impl XdsSettings {
    /// The largest response taken, in bytes.
    pub fn max_message_bytes(&self) -> usize {
        match self.max_message_bytes {
            0 => DEFAULT_MAX_MESSAGE_BYTES,
            n => n,
        }
    }

    /// Checks everything the client will use, without connecting: the address, the headers and node
    /// metadata, the backoff, and the TLS files (read and parsed now, so that a wrong one stops the start).
    pub fn check(&self) -> Result<(), XdsError> {
        super::connect::Target::parse(&self.server_url)?;
        self.headers()?;
        let backoff = &self.backoff;
        if backoff.initial.is_zero() {
            return Err(XdsError::setting(
                "XDS_CLIENT_BACKOFF_INITIAL_INTERVAL",
                "0s",
                "must be longer than zero",
            ));
        }
        if backoff.max < backoff.initial {
            return Err(XdsError::setting(
                "XDS_CLIENT_BACKOFF_MAX_INTERVAL",
                humantime::format_duration(backoff.max),
                "must be at least XDS_CLIENT_BACKOFF_INITIAL_INTERVAL",
            ));
        }
        if !(0.0..=1.0).contains(&backoff.random_factor) {
            return Err(XdsError::setting(
                "XDS_CLIENT_BACKOFF_RANDOM_FACTOR",
                backoff.random_factor,
                "must be between 0 and 1",
            ));
        }
        if self.client_cert.is_some() != self.client_key.is_some() {
            return Err(XdsError::setting(
                "CONFIG_GRPC_XDS_CLIENT_TLS_CERT",
                self.client_cert
                    .as_ref()
                    .map_or_else(String::new, |p| p.display().to_string()),
                "CONFIG_GRPC_XDS_CLIENT_TLS_CERT and CONFIG_GRPC_XDS_CLIENT_TLS_KEY go together",
            ));
        }
        if self.tls {
            super::connect::tls_config(self)?;
        }
        Ok(())
    }

    /// The additional headers as gRPC metadata.
    pub(super) fn headers(&self) -> Result<Vec<(AsciiMetadataKey, AsciiMetadataValue)>, XdsError> {
        const NAME: &str = "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS";
        self.additional_headers
            .iter()
            .map(|(key, value)| {
                let name = AsciiMetadataKey::from_bytes(key.to_ascii_lowercase().as_bytes())
                    .map_err(|_| XdsError::setting(NAME, key, "not a valid gRPC metadata name"))?;
                if key.ends_with("-bin") {
                    return Err(XdsError::setting(
                        NAME,
                        key,
                        "binary (-bin) metadata is not supported",
                    ));
                }
                let value = AsciiMetadataValue::try_from(value.0.as_str()).map_err(|_| {
                    XdsError::setting(NAME, key, "the value is not valid in gRPC metadata")
                })?;
                Ok((name, value))
            })
            .collect()
    }
}
