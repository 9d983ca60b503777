//! Following a Sentinel set's master switches as the Sentinels announce them.
//!
//! The Redis client asks the Sentinels for the master only when it connects. A planned failover
//! (`SENTINEL FAILOVER`, which Redis charts run before stopping a master) promotes a replica while the
//! old master stays up and takes writes until the Sentinels demote it, some ten seconds later; every
//! count written there meanwhile is lost when it resyncs from the new master, and replicas that
//! connected since count on the new one: the fleet admits too much. Each Sentinel announces the switch
//! on its `+switch-master` channel; subscribed to every Sentinel, a replica connects again at once and
//! the client finds the new master.

use std::{sync::Arc, time::Duration};

use fred::{
    prelude::*,
    types::config::{Server, ServerConfig},
};
use tokio::task::JoinHandle;

use super::StoreError;

/// The channel on which a Sentinel announces a new master: `name old-host old-port new-host new-port`.
const SWITCH_MASTER: &str = "+switch-master";

/// A subscription to every Sentinel of a set; ended by [`Switches::close`].
pub struct Switches {
    clients: Vec<(Client, JoinHandle<Result<(), Error>>)>,
}

impl Switches {
    /// Subscribes to the switches of the master the Sentinel `config` names; `switched` is called with
    /// the new master's address for every announcement (each Sentinel makes its own). A Sentinel that
    /// does not answer within `timeout` is tried again later.
    pub fn follow(
        config: &Config,
        timeout: Duration,
        switched: impl Fn(Server) + Send + Sync + 'static,
    ) -> Result<Option<Self>, StoreError> {
        let ServerConfig::Sentinel {
            hosts,
            service_name,
            username,
            password,
        } = &config.server
        else {
            return Ok(None);
        };
        let switched = Arc::new(switched);
        let mut clients = Vec::with_capacity(hosts.len());
        for host in hosts {
            let sentinel = Config {
                server: ServerConfig::Centralized {
                    server: host.clone(),
                },
                username: username.clone(),
                password: password.clone(),
                tls: config.tls.clone(),
                fail_fast: false,
                ..Config::default()
            };
            let client = Builder::from_config(sentinel)
                .with_connection_config(|c| {
                    c.connection_timeout = timeout;
                    c.internal_command_timeout = timeout;
                })
                .with_performance_config(|p| p.default_command_timeout = timeout)
                .set_policy(ReconnectPolicy::new_exponential(0, 100, 2_000, 2))
                .build()
                .map_err(|e| StoreError::Config(e.to_string()))?;
            let (name, switched) = (service_name.clone(), switched.clone());
            client.on_message(move |message| {
                if &*message.channel == SWITCH_MASTER {
                    let text = message.value.as_string().unwrap_or_default();
                    if let Some(to) = new_master(&text, &name) {
                        switched(to);
                    }
                }
                async { Ok(()) }
            });
            // Subscribed on every connection: a Sentinel restarted forgets its subscribers.
            let subscriber = client.clone();
            client.on_reconnect(move |_| {
                let subscriber = subscriber.clone();
                async move {
                    if let Err(err) = subscriber.subscribe(SWITCH_MASTER).await {
                        tracing::warn!("cannot follow the Sentinels' master switches: {err}");
                    }
                    Ok(())
                }
            });
            let task = client.connect();
            clients.push((client, task));
        }
        Ok(Some(Self { clients }))
    }

    /// Ends the subscriptions, waiting a moment at most for a Sentinel to take the QUIT: one that cannot
    /// be reached (its client still connecting) never reads it.
    pub async fn close(self) {
        for (client, task) in self.clients {
            let _ = tokio::time::timeout(Duration::from_secs(1), client.quit()).await;
            task.abort();
        }
    }
}

/// The new master a `+switch-master` message names, if it is `name`'s.
fn new_master(text: &str, name: &str) -> Option<Server> {
    let mut words = text.split_whitespace();
    if words.next()? != name {
        return None;
    }
    let (_old_host, _old_port) = (words.next()?, words.next()?);
    let (host, port) = (words.next()?, words.next()?.parse().ok()?);
    Some(Server::new(host, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_switch_names_the_new_master_of_its_own_set_only() {
        let text = "mymaster 10.0.0.5 6379 10.0.0.6 6380";
        assert_eq!(
            new_master(text, "mymaster"),
            Some(Server::new("10.0.0.6", 6380))
        );
        assert_eq!(new_master(text, "other"), None);
        assert_eq!(new_master("mymaster 10.0.0.5 6379", "mymaster"), None);
        assert_eq!(
            new_master("mymaster a 1 b port", "mymaster"),
            None,
            "a port that is not a number"
        );
    }
}
