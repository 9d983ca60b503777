//! The client side of the operators' API, for `ratelimitd admin`: one HTTP/1.1 call over plaintext or
//! TLS (with a client certificate for mTLS), the bearer token in its `Authorization` header and the
//! operator's name in `X-Operator`, bounded in time. The answer is the API's JSON; a refusal is an
//! error carrying the API's own message.

use std::{path::PathBuf, sync::Arc, time::Duration};

use axum::{
    body::Body,
    http::{header, Method, Request},
};
use hyper_util::rt::TokioIo;
use rustls::{pki_types::ServerName, ClientConfig, RootCertStore};
use serde_json::{json, Value};
use tokio::net::TcpStream;

use super::OPERATOR_HEADER;
use crate::tls::{certificates, private_key, provider, roots};

/// Where the API is and how to reach it.
#[derive(Debug, Clone)]
pub struct ClientSettings {
    /// `http://host:port` or `https://host:port`.
    pub url: String,
    pub token: String,
    /// PEM CAs that sign the API's certificate; `None`: the system's roots.
    pub ca_cert: Option<PathBuf>,
    /// A client certificate and its key, for an API that asks for one.
    pub client_cert: Option<(PathBuf, PathBuf)>,
    /// Who acts, for the audit log.
    pub operator: String,
    /// The longest the whole call may take.
    pub timeout: Duration,
}

/// Why a call did not get an answer, or got a refusal.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{0}")]
    Setup(String),
    #[error("cannot reach the operators' API at {url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("the operators' API answered {status}: {message}")]
    Refused { status: u16, message: String },
}

impl ClientError {
    /// Whether the API was never reached (as opposed to answering with a refusal).
    pub fn is_unreachable(&self) -> bool {
        matches!(self, ClientError::Unreachable { .. })
    }
}

/// A descriptor as a call names it: a domain and its (key, value) entries, raw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Named {
    pub domain: String,
    pub entries: Vec<(String, String)>,
}

impl Named {
    fn json(&self) -> (Value, Value) {
        let entries: Vec<Value> = self
            .entries
            .iter()
            .map(|(k, v)| json!({ "key": k, "value": v }))
            .collect();
        (json!(self.domain), json!(entries))
    }
}

/// One call of the API.
#[derive(Debug, Clone)]
pub enum Call {
    Inspect(Named),
    Reset(Named),
    /// `limit` as the API takes it; `expires_in` or `expires_at` as written.
    SetLimit {
        descriptor: Named,
        limit: Value,
        expires_in: Option<String>,
        expires_at: Option<String>,
    },
    ListLimits {
        domain: Option<String>,
    },
    DeleteLimit {
        id: Option<String>,
        descriptor: Option<Named>,
    },
}

impl Call {
    fn request(&self) -> (Method, String, Option<Value>) {
        match self {
            Call::Inspect(d) | Call::Reset(d) => {
                let path = if matches!(self, Call::Inspect(_)) {
                    "/v1/inspect"
                } else {
                    "/v1/reset"
                };
                let (domain, descriptor) = d.json();
                let body = json!({ "domain": domain, "descriptor": descriptor });
                (Method::POST, path.into(), Some(body))
            }
            Call::SetLimit {
                descriptor,
                limit,
                expires_in,
                expires_at,
            } => {
                let (domain, entries) = descriptor.json();
                let mut body = json!({ "domain": domain, "descriptor": entries, "limit": limit });
                if let Some(within) = expires_in {
                    body["expires_in"] = json!(within);
                }
                if let Some(at) = expires_at {
                    body["expires_at"] = json!(at);
                }
                (Method::PUT, "/v1/limits".into(), Some(body))
            }
            Call::ListLimits { domain } => {
                let path = match domain {
                    Some(d) => format!(
                        "/v1/limits?domain={}",
                        percent_encoding::utf8_percent_encode(
                            d,
                            percent_encoding::NON_ALPHANUMERIC
                        )
                    ),
                    None => "/v1/limits".into(),
                };
                (Method::GET, path, None)
            }
            Call::DeleteLimit { id, descriptor } => {
                let body = match (id, descriptor) {
                    (Some(id), _) => json!({ "id": id }),
                    (None, Some(d)) => {
                        let (domain, entries) = d.json();
                        json!({ "domain": domain, "descriptor": entries })
                    }
                    (None, None) => json!({}),
                };
                (Method::DELETE, "/v1/limits".into(), Some(body))
            }
        }
    }
}

/// The parts of an `http://` or `https://` URL a call needs.
struct Url<'a> {
    tls: bool,
    host: &'a str,
    port: u16,
}

fn parse_url(url: &str) -> Result<Url<'_>, ClientError> {
    let bad = || {
        ClientError::Setup(format!(
            "invalid --url {url:?}: write http://host:port or https://host:port"
        ))
    };
    let (tls, rest) = if let Some(rest) = url.strip_prefix("https://") {
        (true, rest)
    } else if let Some(rest) = url.strip_prefix("http://") {
        (false, rest)
    } else {
        return Err(bad());
    };
    let authority = rest.trim_end_matches('/');
    let (host, port) = authority.rsplit_once(':').ok_or_else(bad)?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = port.parse().map_err(|_| bad())?;
    if host.is_empty() || authority.contains('/') {
        return Err(bad());
    }
    Ok(Url { tls, host, port })
}

fn tls_config(settings: &ClientSettings) -> Result<ClientConfig, ClientError> {
    let setup = |e: &dyn std::fmt::Display| ClientError::Setup(e.to_string());
    let roots = match &settings.ca_cert {
        Some(path) => roots("--ca-cert", path).map_err(|e| setup(&e))?,
        None => {
            let mut roots = RootCertStore::empty();
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(cert);
            }
            roots
        }
    };
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| setup(&e))?
        .with_root_certificates(roots);
    let mut config = match &settings.client_cert {
        Some((cert, key)) => {
            let chain = certificates("--client-cert", cert).map_err(|e| setup(&e))?;
            let key = private_key("--client-key", key).map_err(|e| setup(&e))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| setup(&format!("--client-key does not go with --client-cert: {e}")))?
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// Makes the call and returns the API's answer.
pub async fn call(settings: &ClientSettings, call: &Call) -> Result<Value, ClientError> {
    match tokio::time::timeout(settings.timeout, send(settings, call)).await {
        Ok(answer) => answer,
        Err(_) => Err(ClientError::Unreachable {
            url: settings.url.clone(),
            reason: format!("no answer within {:?}", settings.timeout),
        }),
    }
}

async fn send(settings: &ClientSettings, call: &Call) -> Result<Value, ClientError> {
    let url = parse_url(&settings.url)?;
    let unreachable = |reason: String| ClientError::Unreachable {
        url: settings.url.clone(),
        reason,
    };
    // The client's own files and the call first: what it cannot use is its configuration's fault,
    // wherever the API is.
    let tls = match url.tls {
        true => Some((
            ServerName::try_from(url.host.to_owned())
                .map_err(|e| ClientError::Setup(format!("invalid host in --url: {e}")))?,
            tokio_rustls::TlsConnector::from(Arc::new(tls_config(settings)?)),
        )),
        false => None,
    };
    let (method, path, body) = call.request();
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header(header::HOST, format!("{}:{}", url.host, url.port))
        .header(header::AUTHORIZATION, format!("Bearer {}", settings.token))
        .header(OPERATOR_HEADER, &settings.operator)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body.map_or_else(Body::empty, |b| Body::from(b.to_string())))
        .map_err(|e| ClientError::Setup(format!("cannot build the call: {e}")))?;
    let tcp = TcpStream::connect((url.host, url.port))
        .await
        .map_err(|e| unreachable(e.to_string()))?;
    let (status, answer) = if let Some((name, connector)) = tls {
        let stream = connector
            .connect(name, tcp)
            .await
            .map_err(|e| unreachable(format!("TLS: {e}")))?;
        exchange(stream, request).await.map_err(unreachable)?
    } else {
        exchange(tcp, request).await.map_err(unreachable)?
    };
    let value: Value = serde_json::from_slice(&answer)
        .unwrap_or_else(|_| json!({ "error": String::from_utf8_lossy(&answer).trim().to_owned() }));
    if (200..300).contains(&status) {
        Ok(value)
    } else {
        let message = value
            .get("error")
            .and_then(Value::as_str)
            .map_or_else(|| value.to_string(), str::to_owned);
        Err(ClientError::Refused { status, message })
    }
}

/// The largest answer read: a listing at `runtime_limits.max_limits` runs to tens of megabytes, more
/// with long descriptors.
const MOST_ANSWER_BYTES: usize = 1 << 30;

/// Sends one request on a new connection and reads the whole answer (at most [`MOST_ANSWER_BYTES`]).
async fn exchange<IO>(io: IO, request: Request<Body>) -> Result<(u16, Vec<u8>), String>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .map_err(|e| e.to_string())?;
    let driving = tokio::spawn(connection);
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| e.to_string());
    let answer = match response {
        Ok(response) => {
            let status = response.status().as_u16();
            axum::body::to_bytes(Body::new(response.into_body()), MOST_ANSWER_BYTES)
                .await
                .map(|b| (status, b.to_vec()))
                .map_err(|e| {
                    format!("its answer was not read in full ({e}; at most 1 GiB is read)")
                })
        }
        Err(err) => Err(err),
    };
    driving.abort();
    answer
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_a_scheme_a_host_and_a_port() {
        let u = parse_url("https://ratelimitd.example:8082/").unwrap();
        assert!(u.tls && u.host == "ratelimitd.example" && u.port == 8082);
        let u = parse_url("http://[::1]:9").unwrap();
        assert!(!u.tls && u.host == "::1" && u.port == 9);
        for bad in [
            "ratelimitd:8082",
            "http://host",
            "http://:80",
            "http://h:80/x",
            "ftp://h:1",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn each_call_is_one_request_of_the_api() {
        let d = Named {
            domain: "ai".into(),
            entries: vec![("tenant".into(), "a=b".into())],
        };
        let (method, path, body) = Call::Inspect(d.clone()).request();
        assert_eq!((method, path.as_str()), (Method::POST, "/v1/inspect"));
        assert_eq!(
            body.unwrap(),
            json!({"domain": "ai", "descriptor": [{"key": "tenant", "value": "a=b"}]})
        );
        let (_, path, _) = Call::ListLimits {
            domain: Some("a b".into()),
        }
        .request();
        assert_eq!(path, "/v1/limits?domain=a%20b");
        let (method, _, body) = Call::DeleteLimit {
            id: Some("abc".into()),
            descriptor: None,
        }
        .request();
        assert_eq!(
            (method, body.unwrap()),
            (Method::DELETE, json!({"id": "abc"}))
        );
    }
}
