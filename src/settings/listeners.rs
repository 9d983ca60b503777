//! The listeners ratelimitd binds (gRPC, HTTP, and the optional separate Prometheus one), the bounds on
//! their connections, and how they shut down. Only the server uses these.

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use serde::{Deserialize, Serialize};

use super::SettingsError;

/// The HTTP listener, and the bounds that keep slow or idle clients from holding its connections (and
/// the file descriptors that gRPC and health checks need). The separate Prometheus listener, when
/// enabled, has the same bounds, with places of its own.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpSettings {
    /// IP address to bind, e.g. `0.0.0.0` or `127.0.0.1`. Env `HOST`; default `0.0.0.0`.
    pub host: String,
    /// TCP port; 0 picks a free one. Env `PORT`; default 8080.
    pub port: u16,
    /// Open HTTP connections at most (default 256, well below the usual 1 024 file descriptors); beyond
    /// it new connections wait in the kernel's backlog until one closes.
    pub max_connections: usize,
    /// The longest a client may take to send a request's headers (default `10s`), counted from the
    /// moment the connection waits for them: from the accept, and after each answer on a keep-alive
    /// connection, so it is also how long an idle keep-alive connection stays open. Then the connection
    /// is closed.
    #[serde(with = "crate::duration")]
    pub header_read_timeout: Duration,
    /// The longest one request may take from its headers to its answer, reading its body included
    /// (default `10s`); then it is answered 408 and the connection closed.
    #[serde(with = "crate::duration")]
    pub request_timeout: Duration,
    /// A connection that moves no byte either way for this long is closed (default `30s`): a stalled
    /// upload, or a client that stops reading its answer.
    #[serde(with = "crate::duration")]
    pub idle_timeout: Duration,
}

impl Default for HttpSettings {
    fn default() -> Self {
        Self {
            host: "0.0.0.0".into(),
            port: 8080,
            max_connections: 256,
            header_read_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
        }
    }
}

impl HttpSettings {
    /// The socket address to bind.
    pub fn addr(&self, name: &str) -> Result<SocketAddr, SettingsError> {
        socket_addr(&self.host, self.port, name)
    }
}

/// `host` and `port` as an address to bind: `host` an IP address, or a name it resolves to (as the
/// reference binds `localhost`), its first IPv4 address when it has one.
fn socket_addr(host: &str, port: u16, name: &str) -> Result<SocketAddr, SettingsError> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    let resolved: Vec<SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(&(host, port))
        .map_err(|e| {
            SettingsError::invalid(
                name,
                host,
                format!("neither an IP address nor a name this host resolves ({e})"),
            )
        })?
        .collect();
    resolved
        .iter()
        .find(|a| a.is_ipv4())
        .or(resolved.first())
        .copied()
        .ok_or_else(|| SettingsError::invalid(name, host, "a name that resolves to no address"))
}

/// The gRPC listener, and when its connections are recycled so that new replicas get their share of
/// long-lived clients such as Envoy.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpcSettings {
    /// IP address (or name) to bind. Env `GRPC_HOST`; default `0.0.0.0`.
    pub host: String,
    /// TCP port; 0 picks a free one. Env `GRPC_PORT`; default 8081.
    pub port: u16,
    /// A connection this old is closed gracefully: HTTP/2 GOAWAY, so the client opens a new connection
    /// (possibly to another replica) for its next calls while the calls in flight finish. Varied by up to
    /// ±10 %, drawn once when the process starts (tonic takes one age for all connections): replicas
    /// spread their recycling, while connections one replica accepted together are recycled together.
    /// `0s`: never. Env `GRPC_MAX_CONNECTION_AGE`; default `24h`, as the reference.
    #[serde(with = "crate::duration")]
    pub max_connection_age: Duration,
    /// How long calls still in flight on a connection past its age may run; then the connection is
    /// closed whatever runs on it. `0s`: no bound. Env `GRPC_MAX_CONNECTION_AGE_GRACE`; default `1h`.
    #[serde(with = "crate::duration")]
    pub max_connection_age_grace: Duration,
    /// A new connection must finish its TLS handshake (with TLS) and send the HTTP/2 client preface
    /// within this long of its accept, or it is dropped (default `10s`): connections that say nothing
    /// cannot keep `overload.max_connections` full.
    #[serde(with = "crate::duration")]
    pub handshake_timeout: Duration,
    /// A connection on which no call has been in flight for this long is closed (default `5m`; grpc-go's
    /// MaxConnectionIdle). Clients such as Envoy reconnect by themselves on their next call. The close
    /// carries no GOAWAY: a call sent at the very moment of the close fails as on any lost connection.
    #[serde(with = "crate::duration")]
    pub idle_timeout: Duration,
    /// A call's request must arrive within this long (default `10s`): a unary request whole, to its
    /// end, from when the server first waits for it; in a stream (RLQS, reflection), each message from
    /// its first byte. Otherwise the call ends with DEADLINE_EXCEEDED.
    #[serde(with = "crate::duration")]
    pub message_timeout: Duration,
    /// Bytes of requests not yet whole the replica holds over all its calls (default 64 MiB): a message
    /// that arrives in pieces is held until whole, and past this bound the call that would hold more
    /// ends with RESOURCE_EXHAUSTED, so that calls sending most of a large message and then waiting
    /// cannot fill memory.
    pub max_held_bytes: usize,
    /// After this long without a frame from the client, the server sends an HTTP/2 PING (default `1m`)...
    #[serde(with = "crate::duration")]
    pub keepalive_interval: Duration,
    /// ...and closes the connection when the PING is not answered within this long (default `20s`): a
    /// peer that vanished (host gone, network cut) frees its connection.
    #[serde(with = "crate::duration")]
    pub keepalive_timeout: Duration,
}

impl Default for GrpcSettings {
    fn default() -> Self {
        Self {
            host: "0.0.0.0".into(),
            port: 8081,
            max_connection_age: Duration::from_secs(24 * 3600),
            max_connection_age_grace: Duration::from_secs(3600),
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
            message_timeout: Duration::from_secs(10),
            max_held_bytes: 64 << 20,
            keepalive_interval: Duration::from_secs(60),
            keepalive_timeout: Duration::from_secs(20),
        }
    }
}

impl GrpcSettings {
    /// The socket address to bind.
    pub fn addr(&self, name: &str) -> Result<SocketAddr, SettingsError> {
        socket_addr(&self.host, self.port, name)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrometheusSettings {
    /// Env `USE_PROMETHEUS` (default false): also serve metrics on `addr`.
    pub enabled: bool,
    /// Env `PROMETHEUS_ADDR` (default `:9090`): `host:port`, or `:port` for every address.
    pub addr: String,
    /// Env `PROMETHEUS_PATH` (default `/metrics`).
    pub path: String,
}

impl Default for PrometheusSettings {
    fn default() -> Self {
        Self {
            enabled: false,
            addr: ":9090".into(),
            path: "/metrics".into(),
        }
    }
}

impl PrometheusSettings {
    /// The socket address to bind.
    pub fn socket_addr(&self) -> Result<SocketAddr, SettingsError> {
        let invalid = || {
            SettingsError::invalid(
                "PROMETHEUS_ADDR",
                &self.addr,
                "expected <IP address or name>:<port>, or :<port> for every address",
            )
        };
        if let Ok(addr) = self.addr.parse() {
            return Ok(addr);
        }
        let (host, port) = self.addr.rsplit_once(':').ok_or_else(invalid)?;
        let port: u16 = port.parse().map_err(|_| invalid())?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        socket_addr(
            if host.is_empty() { "0.0.0.0" } else { host },
            port,
            "PROMETHEUS_ADDR",
        )
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShutdownSettings {
    /// After SIGTERM, keep answering (with health NOT_SERVING) this long before closing the listeners, so
    /// that load balancers stop sending traffic first (default `0s`).
    #[serde(with = "crate::duration")]
    pub drain_delay: Duration,
    /// Longest wait for in-flight calls once the listeners are closed (default `20s`).
    #[serde(with = "crate::duration")]
    pub grace_period: Duration,
}

impl Default for ShutdownSettings {
    fn default() -> Self {
        Self {
            drain_delay: Duration::ZERO,
            grace_period: Duration::from_secs(20),
        }
    }
}
