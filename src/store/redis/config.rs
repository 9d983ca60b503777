//! The fred client configuration for the Redis settings: the reference service's address forms
//! (`host:port`, a Unix socket path, `redis://` URLs, Sentinel's `mastername,host:port,...`, Cluster
//! seed lists), credentials (a password or an ACL `user:password`) and TLS.

use std::path::PathBuf;

use fred::{
    prelude::*,
    types::config::{Server, ServerConfig},
};

use super::{super::StoreError, tls, RedisSettings, RedisTopology, SocketType};

/// `url` as it may be shown in a message: the credentials of a `redis://user:password@host` form left
/// out.
pub(super) fn shown(url: &str) -> String {
    url.split(',')
        .map(|part| match part.rsplit_once('@') {
            Some((before, host)) => match before.split_once("://") {
                Some((scheme, _)) => format!("{scheme}://***@{host}"),
                None => format!("***@{host}"),
            },
            None => part.to_owned(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Splits `host:port` (IPv6 in brackets allowed).
fn host_port(written: &str, default_port: u16) -> Result<(String, u16), StoreError> {
    let written = written.trim();
    let quoted = shown(written);
    let text = written
        .strip_prefix("redis://")
        .or_else(|| written.strip_prefix("rediss://"))
        .unwrap_or(written);
    if let Some((scheme, _)) = text.split_once("://") {
        return Err(StoreError::Config(format!(
            "REDIS_URL: {scheme}:// is not a Redis address; write host:port, redis://, rediss:// or a socket path, in {quoted:?}"
        )));
    }
    let text = text.rsplit_once('@').map_or(text, |(_, host)| host);
    let text = text.split('/').next().unwrap_or(text);
    let (host, port) = match text.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && !port.contains(']') => (
            host,
            port.parse()
                .map_err(|_| StoreError::Config(format!("REDIS_URL: bad port in {quoted:?}")))?,
        ),
        _ => (text, default_port),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(StoreError::Config(format!(
            "REDIS_URL: no host in {quoted:?}"
        )));
    }
    Ok((host.to_owned(), port))
}

/// The address of a single server: a list is a Cluster's seed nodes or a Sentinel set, which
/// REDIS_TYPE names.
fn single_host_port(written: &str) -> Result<(String, u16), StoreError> {
    let quoted = shown(written);
    if written.starts_with('/') {
        return Err(StoreError::Config(format!(
            "REDIS_URL: {quoted:?} is a socket path, and REDIS_SOCKET_TYPE is tcp: set it to unix, or leave it unset"
        )));
    }
    if written.contains(',') {
        return Err(StoreError::Config(format!(
            "REDIS_URL: {quoted:?} is a list, and REDIS_TYPE is single: set REDIS_TYPE=cluster for a Cluster's nodes, or REDIS_TYPE=sentinel for mastername,host:port,..."
        )));
    }
    host_port(written, 6379)
}

/// The fred configuration for the settings.
pub fn client_config(settings: &RedisSettings) -> Result<Config, StoreError> {
    let url = settings.url.trim();
    let tls = settings.tls || url.starts_with("rediss://");
    let is_path = url.starts_with('/');
    let unix = match settings.socket_type {
        Some(SocketType::Unix) => true,
        Some(SocketType::Tcp) => false,
        None => is_path,
    };
    let mut config = match settings.topology {
        RedisTopology::Single if unix => Config {
            server: ServerConfig::Unix {
                path: PathBuf::from(url),
            },
            ..Config::default()
        },
        RedisTopology::Single if url.starts_with("redis://") || url.starts_with("rediss://") => {
            Config::from_url(url).map_err(|e| StoreError::Config(format!("REDIS_URL: {e}")))?
        }
        RedisTopology::Single => {
            let (host, port) = single_host_port(url)?;
            Config {
                server: ServerConfig::new_centralized(host, port),
                ..Config::default()
            }
        }
        RedisTopology::Sentinel => Config {
            server: sentinel_server(url, &settings.sentinel_auth.0)?,
            ..Config::default()
        },
        RedisTopology::Cluster => Config {
            server: cluster_server(url)?,
            ..Config::default()
        },
    };
    config.fail_fast = false;
    // Without REDIS_AUTH, credentials in a `redis://user:password@...` URL stay.
    if !settings.auth.0.is_empty() {
        (config.username, config.password) = credentials(&settings.auth.0);
    }
    if tls {
        config.tls = Some(tls::connector(settings)?.into());
    }
    Ok(config)
}

/// `mastername,host:port[,host:port...]`, asked with the sentinels' own credentials.
fn sentinel_server(url: &str, sentinel_auth: &str) -> Result<ServerConfig, StoreError> {
    let (username, password) = credentials(sentinel_auth);
    let mut parts = url.split(',').map(str::trim).filter(|p| !p.is_empty());
    let service_name = parts.next().unwrap_or_default().to_owned();
    let hosts = parts
        .map(|p| host_port(p, 26379).map(|(h, p)| Server::new(h, p)))
        .collect::<Result<Vec<_>, _>>()?;
    if service_name.is_empty() || hosts.is_empty() {
        return Err(StoreError::Config(
            "REDIS_URL: Sentinel needs `mastername,host:port[,host:port...]`".into(),
        ));
    }
    Ok(ServerConfig::Sentinel {
        hosts,
        service_name,
        username,
        password,
    })
}

/// `host:port[,host:port...]` seed nodes.
fn cluster_server(url: &str) -> Result<ServerConfig, StoreError> {
    let hosts = url
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| host_port(p, 6379))
        .collect::<Result<Vec<_>, _>>()?;
    if hosts.is_empty() {
        return Err(StoreError::Config(
            "REDIS_URL: Cluster needs `host:port[,host:port...]` seed nodes".into(),
        ));
    }
    Ok(ServerConfig::new_clustered(hosts))
}

/// `password` or `user:password` (a Redis ACL user); empty: no authentication.
fn credentials(auth: &str) -> (Option<String>, Option<String>) {
    match auth.split_once(':') {
        _ if auth.is_empty() => (None, None),
        Some((user, password)) => (Some(user.to_owned()), Some(password.to_owned())),
        None => (None, Some(auth.to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(url: &str, topology: RedisTopology) -> RedisSettings {
        RedisSettings {
            url: url.into(),
            topology,
            ..RedisSettings::default()
        }
    }

    #[test]
    fn addresses_in_every_reference_form() {
        let c = client_config(&settings("redis.internal:6380", RedisTopology::Single)).unwrap();
        assert_eq!(
            c.server,
            ServerConfig::new_centralized("redis.internal", 6380)
        );
        let c = client_config(&settings("/var/run/redis.sock", RedisTopology::Single)).unwrap();
        assert!(matches!(c.server, ServerConfig::Unix { .. }));
        let c = client_config(&settings("redis://u:p@h:7000/0", RedisTopology::Single)).unwrap();
        assert_eq!(c.server, ServerConfig::new_centralized("h", 7000));
        let c = client_config(&settings(
            "mymaster, s1:26379, s2:26380",
            RedisTopology::Sentinel,
        ))
        .unwrap();
        assert_eq!(
            c.server,
            ServerConfig::new_sentinel(vec![("s1", 26379), ("s2", 26380)], "mymaster")
        );
        let c = client_config(&settings("a:7000,b:7001", RedisTopology::Cluster)).unwrap();
        assert_eq!(
            c.server,
            ServerConfig::new_clustered(vec![("a", 7000), ("b", 7001)])
        );
        assert!(client_config(&settings("mymaster", RedisTopology::Sentinel)).is_err());
        assert!(client_config(&settings("h:port", RedisTopology::Single)).is_err());
    }

    /// Addresses that cannot be one server's say what to set, quoting the whole value.
    #[test]
    fn addresses_of_another_kind_name_the_setting_that_fits() {
        let refused = |url: &str, socket_type| {
            let mut s = settings(url, RedisTopology::Single);
            s.socket_type = socket_type;
            client_config(&s).unwrap_err().to_string()
        };
        let list = refused("127.0.0.1:7000,127.0.0.1:7001", None);
        assert!(list.contains("REDIS_TYPE=cluster"), "{list}");
        assert!(list.contains("\"127.0.0.1:7000,127.0.0.1:7001\""), "{list}");
        let sentinel = refused("mymaster,10.0.0.5:26379", None);
        assert!(sentinel.contains("REDIS_TYPE=sentinel"), "{sentinel}");
        let http = refused("http://127.0.0.1:6379", None);
        assert!(http.contains("http:// is not a Redis address"), "{http}");
        assert!(http.contains("\"http://127.0.0.1:6379\""), "{http}");
        let path = refused("/tmp/redis.sock", Some(SocketType::Tcp));
        assert!(path.contains("REDIS_SOCKET_TYPE is tcp"), "{path}");
        let port = refused("127.0.0.1:bad", None);
        assert!(port.contains("bad port in \"127.0.0.1:bad\""), "{port}");
        // Never the password of a URL.
        let mut cluster = settings(
            "redis://u:secret@a:1,redis://u:secret@b:x",
            RedisTopology::Cluster,
        );
        cluster.socket_type = None;
        let err = client_config(&cluster).unwrap_err().to_string();
        assert!(
            !err.contains("secret") && err.contains("redis://***@b:x"),
            "{err}"
        );
        let list = refused("redis://u:secret@a:1,b:2", None);
        assert!(!list.contains("secret"), "{list}");
    }

    #[test]
    fn auth_takes_a_password_or_an_acl_user() {
        let mut s = settings("h:1", RedisTopology::Single);
        s.auth = super::super::Secret("pw".into());
        let c = client_config(&s).unwrap();
        assert_eq!((c.username, c.password.as_deref()), (None, Some("pw")));
        s.auth = super::super::Secret("app:pw".into());
        let c = client_config(&s).unwrap();
        assert_eq!(
            (c.username.as_deref(), c.password.as_deref()),
            (Some("app"), Some("pw"))
        );
        let c = client_config(&settings("redis://u:p@h:7000", RedisTopology::Single)).unwrap();
        assert_eq!(
            (c.username.as_deref(), c.password.as_deref()),
            (Some("u"), Some("p")),
            "without REDIS_AUTH the URL's credentials stay"
        );
    }

    #[test]
    fn sentinels_get_their_own_credentials_and_the_master_its_own() {
        let mut s = settings("mymaster,s1:26379", RedisTopology::Sentinel);
        s.auth = super::super::Secret("master-pw".into());
        let c = client_config(&s).unwrap();
        assert_eq!(c.password.as_deref(), Some("master-pw"));
        assert!(
            matches!(
                &c.server,
                ServerConfig::Sentinel {
                    username: None,
                    password: None,
                    ..
                }
            ),
            "no REDIS_SENTINEL_AUTH: the sentinels are asked without the master's password"
        );
        s.sentinel_auth = super::super::Secret("watcher:sentinel-pw".into());
        let c = client_config(&s).unwrap();
        assert_eq!(
            (c.username, c.password.as_deref()),
            (None, Some("master-pw"))
        );
        let ServerConfig::Sentinel {
            username, password, ..
        } = &c.server
        else {
            panic!("not a sentinel config: {:?}", c.server);
        };
        assert_eq!(
            (username.as_deref(), password.as_deref()),
            (Some("watcher"), Some("sentinel-pw"))
        );
    }
}
