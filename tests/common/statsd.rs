//! A statsd server for tests: listens on UDP and TCP on one free loopback port (as statsd_exporter
//! does) and keeps every line it receives, to be summed per stat name.
#![allow(dead_code)]

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{
    io::{AsyncBufReadExt, BufReader},
    net::{TcpListener, UdpSocket},
    task::JoinHandle,
};

use super::wait_for;

/// A running statsd listener.
pub struct StatsdListener {
    pub addr: SocketAddr,
    lines: Arc<Mutex<Vec<String>>>,
    tasks: Vec<JoinHandle<()>>,
}

impl StatsdListener {
    /// Listens on UDP and TCP on the same free port.
    pub async fn start() -> Self {
        Self::start_on(0).await
    }

    /// Listens on UDP and TCP on `port` of 127.0.0.1 (0: a free one, the same for both).
    pub async fn start_on(port: u16) -> Self {
        let (udp, tcp) = loop {
            let udp = UdpSocket::bind(("127.0.0.1", port)).await.unwrap();
            let addr = udp.local_addr().unwrap();
            match TcpListener::bind(addr).await {
                Ok(tcp) => break (udp, tcp),
                Err(err) if port != 0 => panic!("TCP port {port} is taken: {err}"),
                Err(_) => continue,
            }
        };
        let addr = udp.local_addr().unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let from_udp = {
            let lines = lines.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65_536];
                while let Ok(n) = udp.recv(&mut buf).await {
                    let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                    let mut lines = lines.lock().unwrap();
                    lines.extend(text.lines().filter(|l| !l.is_empty()).map(str::to_owned));
                }
            })
        };
        let from_tcp = {
            let lines = lines.clone();
            tokio::spawn(async move {
                while let Ok((stream, _)) = tcp.accept().await {
                    let lines = lines.clone();
                    tokio::spawn(async move {
                        let mut reader = BufReader::new(stream).lines();
                        while let Ok(Some(line)) = reader.next_line().await {
                            lines.lock().unwrap().push(line);
                        }
                    });
                }
            })
        };
        Self {
            addr,
            lines,
            tasks: vec![from_udp, from_tcp],
        }
    }

    /// Every line received so far.
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// The counters received, summed by name (as written before the `:`, tags in the name included).
    pub fn counters(&self) -> BTreeMap<String, u64> {
        let mut sums = BTreeMap::new();
        for line in self.lines() {
            let Some((name, rest)) = line.split_once(':') else {
                continue;
            };
            let mut parts = rest.split('|');
            let (Some(value), Some("c")) = (parts.next(), parts.next()) else {
                continue;
            };
            *sums.entry(name.to_owned()).or_insert(0) += value.parse::<u64>().unwrap();
        }
        sums
    }

    /// Waits until the counter `name` has summed to `value` at least, and returns every counter then.
    pub async fn wait_counter(
        &self,
        name: &str,
        value: u64,
        within: Duration,
    ) -> BTreeMap<String, u64> {
        wait_for(
            &format!("statsd counter {name} at {value}"),
            within,
            async || {
                let counters = self.counters();
                (counters.get(name).copied().unwrap_or(0) >= value).then_some(counters)
            },
        )
        .await
    }
}

impl Drop for StatsdListener {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}
