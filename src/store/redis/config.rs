//! The fred client configuration for the Redis settings: the reference service's address forms
//! (`host:port`, a Unix socket path, `redis://` URLs, Sentinel's `mastername,host:port,...`, Cluster
//! seed lists), credentials (a password or an ACL `user:password`) and TLS.

use std::path::PathBuf;

use fred::{
    prelude::*,
    types::config::{Server, ServerConfig},
};

use super::{super::StoreError, tls, RedisSettings, RedisTopology, SocketType};

/// Splits `host:port` (IPv6 in brackets allowed).
fn host_port(text: &str, default_port: u16) -> Result<(String, u16), StoreError> {
    let text = text.trim();
    let text = text
        .strip_prefix("redis://")
        .or_else(|| text.strip_prefix("rediss://"))
        .unwrap_or(text);
    let text = text.rsplit_once('@').map_or(text, |(_, host)| host);
    let text = text.split('/').next().unwrap_or(text);
    let (host, port) = match text.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && !port.contains(']') => (
            host,
            port.parse()
                .map_err(|_| StoreError::Config(format!("REDIS_URL: bad port in {text:?}")))?,
        ),
        _ => (text, default_port),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(StoreError::Config(format!(
            "REDIS_URL: no host in {text:?}"
        )));
    }
    Ok((host.to_owned(), port))
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
            let (host, port) = host_port(url, 6379)?;
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
