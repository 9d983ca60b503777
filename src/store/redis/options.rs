//! How ratelimitd reaches Redis: address, topology, credentials, TLS, pool and the waits. Part of the
//! process settings (`settings` assembles them from the settings file, `RATELIMITD_REDIS__*` and the
//! reference's `REDIS_*` / `REDIS_PERSECOND_*` variables); defaults here are the service's.

use std::{fmt, path::PathBuf, time::Duration};

use serde::{Deserialize, Serialize};

use super::StoreError;

/// How ratelimitd reaches Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RedisTopology {
    /// One server (`host:port`, a `redis://` URL, or a unix socket path).
    Single,
    /// A master found through Sentinel (`mastername,host:port,host:port...`).
    Sentinel,
    /// Redis Cluster (`host:port,host:port...` seed nodes).
    Cluster,
}

/// How the Redis address is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SocketType {
    Tcp,
    Unix,
}

/// A secret setting: kept out of `Debug` output, logs and error messages.
#[derive(Clone, Default, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Secret(pub String);

/// Text only: a settings file's `token: 98765432109876543210` is a number to its YAML parser, which
/// keeps 17 of its digits (and `00123` loses its zeros), so the secret the replica would hold is not
/// the one written. Such a value stops the start, asking for quotes; environment values are text.
impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Text;
        impl<'v> serde::de::Visitor<'v> for Text {
            type Value = Secret;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("text")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Secret, E> {
                Ok(Secret(v.to_owned()))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Secret, E> {
                Ok(Secret(v))
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<Secret, E> {
                Ok(Secret::default())
            }
        }
        // Every refusal in the same words, never serde's own, which would quote the value: a secret
        // never reaches the log, not even one written wrong.
        d.deserialize_any(Text).map_err(|_| {
            serde::de::Error::custom(
                "a secret must be text: written as a number, a boolean, a list or a map it is not kept as written; put it in quotes",
            )
        })
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_empty() {
            "\"\""
        } else {
            "\"<redacted>\""
        })
    }
}

/// One Redis client: the main one, or the per-second one.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisSettings {
    /// Env `REDIS_URL`: `host:port`, `redis://` or `rediss://` URL, a unix socket path,
    /// `mastername,host:port,...` for Sentinel, or comma-separated seed nodes for Cluster. Setting it makes
    /// `redis` the default backend.
    pub url: String,
    /// Env `REDIS_TYPE` (`single`, `sentinel`, `cluster`); default `single`.
    pub topology: RedisTopology,
    /// Env `REDIS_SOCKET_TYPE` (`tcp` or `unix`). Unset: `unix` when the URL is a path, else `tcp`.
    pub socket_type: Option<SocketType>,
    /// Env `REDIS_AUTH`: `password` or `user:password` (Redis ACL user).
    pub auth: Secret,
    /// Env `REDIS_SENTINEL_AUTH`: the Sentinels' own `password` or `user:password`, for Sentinels with
    /// `requirepass` (`auth` is the master's and is not sent to them). Unset: the Sentinels are asked
    /// without authentication, as the reference does.
    pub sentinel_auth: Secret,
    /// Env `REDIS_TLS`: connect with TLS (also implied by a `rediss://` URL). The server certificate is
    /// checked against `tls_ca_cert`, or the system's roots when unset.
    pub tls: bool,
    /// Env `REDIS_TLS_CACERT`: PEM CA certificates that sign the Redis server certificates.
    pub tls_ca_cert: Option<PathBuf>,
    /// Env `REDIS_TLS_CLIENT_CERT`, `REDIS_TLS_CLIENT_KEY`: a PEM client certificate and key, for a Redis
    /// that requires them (`tls-auth-clients yes`).
    pub tls_client_cert: Option<PathBuf>,
    pub tls_client_key: Option<PathBuf>,
    /// Env `REDIS_TLS_SKIP_HOSTNAME_VERIFICATION`: accept a server certificate that does not name the
    /// host connected to (it must still be signed by a trusted CA). Default false.
    pub tls_skip_hostname_verification: bool,
    /// Env `REDIS_POOL_SIZE` (default 10): connections per Redis node; commands are pipelined on each.
    /// On Cluster each master also gets `calls_in_flight` connections of its own, which carry its
    /// decisions.
    pub pool_size: usize,
    /// Script calls in flight per Redis server (default 2). Requests that arrive while every one is busy
    /// wait, and go together in the next call that ends: an idle service sends each request at once, a
    /// busy one fewer, larger calls.
    pub calls_in_flight: usize,
    /// Most requests one script call decides (default 64), each still all-or-nothing.
    pub batch_max_requests: usize,
    /// About the most bytes of keys and arguments one script call carries (default 64 KiB); a request
    /// larger than that alone still goes, in a call of its own.
    pub batch_max_bytes: usize,
    /// Hits per second on one fixed- or sliding-window counter, at this replica, from which it takes
    /// quota leases (default 64; 0: never): part of the counter's remaining quota counted at once and
    /// admitted here without asking Redis, so that a counter every request carries stops costing a
    /// Redis call per request. The fleet still never admits more than the limit.
    pub lease_after: u64,
    /// How long a lease lasts unused (default `200ms`) before what is left of it is given back; it
    /// also ends with its window. A lease asks for about what the counter takes in this time.
    #[serde(with = "crate::duration")]
    pub lease_for: Duration,
    /// Env `REDIS_TIMEOUT` (default `1s`): the longest a request that carries no deadline of its own
    /// waits for Redis before the `on_backend_error` policy answers (never past `overload.deadline`). A
    /// gRPC call with a deadline (Envoy sends its filter timeout as `grpc-timeout`) waits until shortly
    /// before that deadline instead. A dead or hung Redis is not waited for: see `unresponsive_after`.
    #[serde(with = "crate::duration")]
    pub timeout: Duration,
    /// A Redis server that answers nothing at all for this long while commands wait for it is
    /// unresponsive (hung, paused, stopped, or its connection lost): its circuit breaker opens
    /// (default `300ms`). Answers that merely queue behind a burst never count: they keep arriving.
    #[serde(with = "crate::duration")]
    pub unresponsive_after: Duration,
    /// Longest wait for a connection to be set up (default `2s`).
    #[serde(with = "crate::duration")]
    pub connect_timeout: Duration,
    /// Consecutive connection failures (refused, a call's connection lost, TLS, cluster routing) that
    /// open the circuit breaker of a Redis server (default 5). While open, requests are answered at once
    /// by the `on_backend_error` policy, without waiting for Redis. Error replies (a script refusing a
    /// request) are answers, never failures; a connection the server closes counts only if the server
    /// then refuses a new one, which opens the breaker at once.
    pub breaker_failures: u32,
    /// How long the breaker stays open before one request probes Redis again (default `500ms`).
    #[serde(with = "crate::duration")]
    pub breaker_open_for: Duration,
}

impl Default for RedisSettings {
    fn default() -> Self {
        Self {
            url: String::new(),
            topology: RedisTopology::Single,
            socket_type: None,
            auth: Secret::default(),
            sentinel_auth: Secret::default(),
            tls: false,
            tls_ca_cert: None,
            tls_client_cert: None,
            tls_client_key: None,
            tls_skip_hostname_verification: false,
            pool_size: 10,
            calls_in_flight: 2,
            batch_max_requests: 64,
            batch_max_bytes: 64 * 1024,
            lease_after: 64,
            lease_for: Duration::from_millis(200),
            timeout: Duration::from_secs(1),
            unresponsive_after: Duration::from_millis(300),
            connect_timeout: Duration::from_secs(2),
            breaker_failures: 5,
            breaker_open_for: Duration::from_millis(500),
        }
    }
}

impl RedisSettings {
    /// Builds the client configuration without connecting: the address parses and the TLS files read,
    /// so that a wrong one stops the start before any port is bound.
    pub fn check(&self) -> Result<(), StoreError> {
        super::config::client_config(self).map(drop)
    }
}
