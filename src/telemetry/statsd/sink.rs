//! Sending lines to the statsd server, over UDP (datagrams of whole lines) or TCP (one connection, kept
//! open and re-opened when it breaks). Every step has a deadline, so that a statsd server that is gone
//! or stalled costs the flush task a bounded wait and never anything else.

use std::{io, net::SocketAddr, time::Duration};

use tokio::{
    io::AsyncWriteExt,
    net::{lookup_host, TcpStream, UdpSocket},
};

use crate::telemetry::StatsdProtocol;

/// Largest datagram sent: what fits in one packet on any usual path (the size statsd clients use).
const MAX_DATAGRAM: usize = 1432;

/// Longest a connection, a resolution or a write may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(1);

/// How far a send went, when it failed.
#[derive(Debug)]
pub enum SendError {
    /// Nothing reached the server: the counts are sent again with the next flush.
    NothingSent(io::Error),
    /// Part of the lines may have reached it: sending them again could count them twice.
    Partly(io::Error),
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendError::NothingSent(e) => write!(f, "{e}"),
            SendError::Partly(e) => write!(f, "{e} (part of the flush was lost)"),
        }
    }
}

/// Where lines go.
pub struct Sink {
    host: String,
    port: u16,
    protocol: StatsdProtocol,
    udp: Option<UdpSocket>,
    tcp: Option<TcpStream>,
}

impl Sink {
    pub fn new(host: &str, port: u16, protocol: StatsdProtocol) -> Self {
        Self {
            host: host.to_owned(),
            port,
            protocol,
            udp: None,
            tcp: None,
        }
    }

    /// `host:port`, for logs.
    pub fn target(&self) -> String {
        format!("{}:{} ({:?})", self.host, self.port, self.protocol).to_lowercase()
    }

    /// Sends whole lines (each ending in a newline).
    pub async fn send(&mut self, lines: &[String]) -> Result<(), SendError> {
        let result = match self.protocol {
            StatsdProtocol::Udp => self.send_udp(lines).await,
            StatsdProtocol::Tcp => self.send_tcp(lines).await,
        };
        if result.is_err() {
            // Resolve and connect afresh next time: the server may have moved or restarted.
            self.udp = None;
            self.tcp = None;
        }
        result
    }

    /// The server's addresses, IPv4 first (statsd servers commonly listen on IPv4 only, while
    /// `localhost` often resolves to `::1` first).
    async fn resolve(&self) -> io::Result<Vec<SocketAddr>> {
        let found = step(lookup_host((self.host.as_str(), self.port))).await?;
        let mut addrs: Vec<SocketAddr> = found.collect();
        addrs.sort_by_key(|a| a.is_ipv6());
        if addrs.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("{} has no address", self.host),
            ));
        }
        Ok(addrs)
    }

    async fn send_udp(&mut self, lines: &[String]) -> Result<(), SendError> {
        if self.udp.is_none() {
            let addr = self.resolve().await.map_err(SendError::NothingSent)?[0];
            let local: SocketAddr = if addr.is_ipv6() {
                "[::]:0".parse()
            } else {
                "0.0.0.0:0".parse()
            }
            .map_err(|e| SendError::NothingSent(io::Error::other(e)))?;
            let socket = UdpSocket::bind(local)
                .await
                .map_err(SendError::NothingSent)?;
            socket.connect(addr).await.map_err(SendError::NothingSent)?;
            self.udp = Some(socket);
        }
        let Some(socket) = &self.udp else {
            return Ok(());
        };
        let mut sent_any = false;
        for datagram in datagrams(lines) {
            if let Err(err) = step(socket.send(datagram.as_bytes())).await {
                return Err(if sent_any {
                    SendError::Partly(err)
                } else {
                    SendError::NothingSent(err)
                });
            }
            sent_any = true;
        }
        Ok(())
    }

    async fn send_tcp(&mut self, lines: &[String]) -> Result<(), SendError> {
        if self.tcp.is_none() {
            let mut last = io::Error::other("no address");
            for addr in self.resolve().await.map_err(SendError::NothingSent)? {
                match step(TcpStream::connect(addr)).await {
                    Ok(stream) => {
                        let _ = stream.set_nodelay(true);
                        self.tcp = Some(stream);
                        break;
                    }
                    Err(err) => last = err,
                }
            }
            if self.tcp.is_none() {
                return Err(SendError::NothingSent(last));
            }
        }
        let Some(stream) = &mut self.tcp else {
            return Ok(());
        };
        let text = lines.concat();
        let mut written = 0;
        while written < text.len() {
            match step(stream.write(&text.as_bytes()[written..])).await {
                Ok(0) => {
                    let err = io::Error::new(io::ErrorKind::WriteZero, "connection closed");
                    return Err(partly(written, err));
                }
                Ok(n) => written += n,
                Err(err) => return Err(partly(written, err)),
            }
        }
        Ok(())
    }
}

fn partly(written: usize, err: io::Error) -> SendError {
    if written == 0 {
        SendError::NothingSent(err)
    } else {
        SendError::Partly(err)
    }
}

/// Runs one step within [`STEP_TIMEOUT`].
async fn step<T>(work: impl std::future::Future<Output = io::Result<T>>) -> io::Result<T> {
    tokio::time::timeout(STEP_TIMEOUT, work)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "timed out"))?
}

/// The lines packed into datagrams of at most [`MAX_DATAGRAM`] bytes, never splitting a line (a longer
/// line goes alone).
fn datagrams(lines: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in lines {
        if !current.is_empty() && current.len() + line.len() > MAX_DATAGRAM {
            out.push(std::mem::take(&mut current));
        }
        current.push_str(line);
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datagrams_hold_whole_lines() {
        let line = format!("{}:1|c\n", "x".repeat(100));
        let lines = vec![line.clone(); 30];
        let packed = datagrams(&lines);
        assert!(packed.iter().all(|d| d.len() <= MAX_DATAGRAM));
        assert!(packed.iter().all(|d| d.len() % line.len() == 0));
        assert_eq!(packed.concat(), lines.concat());
        let long = vec!["y".repeat(2000)];
        assert_eq!(datagrams(&long), long);
    }
}
