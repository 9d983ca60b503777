//! Real redis-server processes for tests: standalone, a 3-master Cluster (optionally with replicas),
//! and Sentinel (one master, one replica, three sentinels). Each process is killed when its guard drops.
#![allow(dead_code)]

use std::{
    io::{Read, Write},
    net::{Shutdown, TcpListener, TcpStream},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    thread::sleep,
    time::{Duration, Instant},
};

/// A free loopback TCP port, below the ports the kernel gives outgoing connections (32 768 and up by
/// default): between this check and the server binding it, none of the suite's many client connections
/// can take it.
pub fn free_port() -> u16 {
    free_port_in(15_000..32_000)
}

/// A free port for a Cluster node: Redis also listens on the port + 10 000 (the cluster bus), which must
/// be free too, and below the outgoing connections' ports as well.
pub fn free_cluster_port() -> u16 {
    loop {
        let port = free_port_in(12_000..22_000);
        if TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

fn free_port_in(range: std::ops::Range<u16>) -> u16 {
    loop {
        let port = rand::random_range(range.clone());
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

fn require(binary: &str) {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {binary}")])
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        found,
        "{binary} not found: run scripts/test, which installs redis-server, redis-tools and redis-sentinel"
    );
}

/// Runs redis-cli against a port and returns its output.
pub fn cli(port: u16, args: &[&str]) -> String {
    cli_as(port, None, args)
}

fn cli_as(port: u16, password: Option<&str>, args: &[&str]) -> String {
    let mut cmd = Command::new("redis-cli");
    if let Some(password) = password {
        cmd.env("REDISCLI_AUTH", password);
    }
    let out = cmd
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli runs");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// One redis-server (or redis-sentinel) process.
pub struct RedisProcess {
    pub port: u16,
    args: Vec<String>,
    dir: tempfile::TempDir,
    child: Option<Child>,
    sentinel: bool,
}

impl RedisProcess {
    /// A standalone server on a free port, no persistence. A server started as a Cluster node gets a
    /// port whose cluster bus (the port + 10 000) is free too: without it the server does not start.
    pub fn start(extra: &[&str]) -> Self {
        let port = if extra.contains(&"--cluster-enabled") {
            free_cluster_port()
        } else {
            free_port()
        };
        Self::spawn(port, extra, false)
    }

    /// A standalone server on the given port.
    pub fn start_on(port: u16) -> Self {
        Self::spawn(port, &[], false)
    }

    fn spawn(port: u16, extra: &[&str], sentinel: bool) -> Self {
        require(if sentinel {
            "redis-sentinel"
        } else {
            "redis-server"
        });
        require("redis-cli");
        let dir = tempfile::tempdir().unwrap();
        let mut process = Self {
            port,
            args: extra.iter().map(|s| s.to_string()).collect(),
            dir,
            child: None,
            sentinel,
        };
        process.launch();
        process
    }

    fn launch(&mut self) {
        let mut cmd;
        if self.sentinel {
            let conf = self.dir.path().join("sentinel.conf");
            if !conf.exists() {
                std::fs::write(&conf, self.args.join("\n") + "\n").unwrap();
            }
            cmd = Command::new("redis-sentinel");
            cmd.arg(&conf)
                .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"]);
        } else {
            cmd = Command::new("redis-server");
            cmd.args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir.path().to_str().unwrap(),
            ])
            .args(&self.args);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis starts");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.cli(&["PING"]) != "PONG" {
            assert!(
                Instant::now() < deadline,
                "redis on {} did not answer PING",
                self.port
            );
            sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL, as a crash.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends a signal to the server process (`STOP` freezes it as a hung host would: its connections
    /// stay open and nothing answers; `CONT` wakes it).
    pub fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("running").id();
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &pid.to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -{signal} {pid}");
    }

    /// Starts again on the same port (empty: no persistence).
    pub fn restart(&mut self) {
        self.kill();
        self.launch();
    }

    /// redis-cli against this server, with its password if it has one (`--requirepass`, or a
    /// `requirepass` line of a sentinel's configuration).
    pub fn cli(&self, args: &[&str]) -> String {
        let password = self.args.iter().enumerate().find_map(|(i, arg)| {
            if arg == "--requirepass" {
                self.args.get(i + 1).map(String::as_str)
            } else {
                arg.strip_prefix("requirepass ")
            }
        });
        cli_as(self.port, password, args)
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn dir(&self) -> PathBuf {
        self.dir.path().to_owned()
    }
}

impl Drop for RedisProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A Redis Cluster of three masters, each optionally with one replica.
pub struct RedisCluster {
    pub masters: Vec<RedisProcess>,
    pub replicas: Vec<RedisProcess>,
}

impl RedisCluster {
    pub fn start(with_replicas: bool) -> Self {
        let node = || {
            RedisProcess::spawn(
                free_cluster_port(),
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "1000",
                ],
                false,
            )
        };
        let masters: Vec<RedisProcess> = (0..3).map(|_| node()).collect();
        let replicas: Vec<RedisProcess> = if with_replicas {
            (0..3).map(|_| node()).collect()
        } else {
            Vec::new()
        };
        let mut args = vec!["--cluster".to_string(), "create".to_string()];
        args.extend(masters.iter().chain(&replicas).map(|n| n.addr()));
        args.extend([
            "--cluster-replicas".to_string(),
            if with_replicas { "1" } else { "0" }.to_string(),
            "--cluster-yes".to_string(),
        ]);
        let out = Command::new("redis-cli")
            .args(&args)
            .output()
            .expect("redis-cli --cluster create runs");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = Self { masters, replicas };
        cluster.wait_ok();
        cluster
    }

    /// Waits until every live node reports `cluster_state:ok` and every replica is in sync (a replica
    /// that never synced refuses to take over its master's slots).
    pub fn wait_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let all_ok = self
                .masters
                .iter()
                .chain(&self.replicas)
                .filter(|n| n.child.is_some())
                .all(|n| n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"))
                && self.replicas.iter().filter(|n| n.child.is_some()).all(|n| {
                    let info = n.cli(&["INFO", "replication"]);
                    !info.contains("role:slave") || info.contains("master_link_status:up")
                });
            if all_ok {
                return;
            }
            assert!(Instant::now() < deadline, "cluster did not become ok");
            sleep(Duration::from_millis(100));
        }
    }

    /// Seed nodes for REDIS_URL.
    pub fn url(&self) -> String {
        self.masters
            .iter()
            .map(RedisProcess::addr)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Sums INFO commandstats calls of a command over the masters.
    pub fn calls(&self, command: &str) -> u64 {
        self.masters
            .iter()
            .filter(|n| n.child.is_some())
            .map(|n| command_calls(&n.cli(&["INFO", "commandstats"]), command))
            .sum()
    }
}

/// A Sentinel set: one master, one replica, three sentinels watching `mymaster`.
pub struct SentinelSet {
    pub master: RedisProcess,
    pub replica: RedisProcess,
    pub sentinels: Vec<RedisProcess>,
}

/// The passwords of a Sentinel set; `None`: no password.
#[derive(Debug, Default, Clone, Copy)]
pub struct SentinelPasswords<'a> {
    /// The master's and the replica's `requirepass` (the sentinels and the replica are given it too).
    pub master: Option<&'a str>,
    /// The sentinels' own `requirepass` (each sentinel is given it to talk to the others).
    pub sentinels: Option<&'a str>,
}

impl SentinelSet {
    /// A set without passwords.
    pub fn start() -> Self {
        Self::start_with(SentinelPasswords::default())
    }

    pub fn start_with(passwords: SentinelPasswords<'_>) -> Self {
        let mut auth: Vec<&str> = Vec::new();
        if let Some(password) = passwords.master {
            auth.extend(["--requirepass", password, "--masterauth", password]);
        }
        let master = RedisProcess::start(&auth);
        let master_port = master.port.to_string();
        let mut replica_args = vec!["--replicaof", "127.0.0.1", &master_port];
        replica_args.extend(&auth);
        let replica = RedisProcess::start(&replica_args);
        let sentinels = (0..3)
            .map(|_| {
                let mut conf = vec![
                    format!("sentinel monitor mymaster 127.0.0.1 {} 2", master.port),
                    "sentinel down-after-milliseconds mymaster 1000".to_string(),
                    "sentinel failover-timeout mymaster 3000".to_string(),
                    "sentinel parallel-syncs mymaster 1".to_string(),
                ];
                if let Some(password) = passwords.master {
                    conf.push(format!("sentinel auth-pass mymaster {password}"));
                }
                if let Some(password) = passwords.sentinels {
                    conf.push(format!("requirepass {password}"));
                    conf.push(format!("sentinel sentinel-pass {password}"));
                }
                let conf: Vec<&str> = conf.iter().map(String::as_str).collect();
                RedisProcess::spawn(free_port(), &conf, true)
            })
            .collect();
        let set = Self {
            master,
            replica,
            sentinels,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !set
            .replica
            .cli(&["INFO", "replication"])
            .contains("master_link_status:up")
        {
            assert!(Instant::now() < deadline, "replica did not sync");
            sleep(Duration::from_millis(100));
        }
        set
    }

    pub fn url(&self) -> String {
        let mut parts = vec!["mymaster".to_string()];
        parts.extend(self.sentinels.iter().map(RedisProcess::addr));
        parts.join(",")
    }

    /// The port Sentinel currently names as master.
    pub fn master_port(&self) -> u16 {
        let out = self.sentinels[0].cli(&["SENTINEL", "get-master-addr-by-name", "mymaster"]);
        out.lines()
            .nth(1)
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or(0)
    }
}

/// Calls of `command` in an `INFO commandstats` text.
pub fn command_calls(info: &str, command: &str) -> u64 {
    info.lines()
        .find(|l| l.starts_with(&format!("cmdstat_{command}:")))
        .and_then(|l| l.split("calls=").nth(1))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// A TCP proxy in front of a Redis that, once armed with a command's name, passes the next command
/// that carries it on to Redis and closes that client's connection instead of passing the answer back:
/// a command that ran and whose answer was lost with its connection.
pub struct AnswerDropper {
    addr: String,
    armed: Arc<Mutex<Option<String>>>,
}

impl AnswerDropper {
    pub fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let armed: Arc<Mutex<Option<String>>> = Arc::default();
        let watch = armed.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let (Ok(client), Ok(server)) = (client, TcpStream::connect(&upstream)) else {
                    continue;
                };
                let dropping = Arc::new(std::sync::atomic::AtomicBool::new(false));
                let (mut from_client, mut to_server) =
                    (client.try_clone().unwrap(), server.try_clone().unwrap());
                let (watch, marked) = (watch.clone(), dropping.clone());
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 65536];
                    while let Ok(n @ 1..) = from_client.read(&mut buf) {
                        let sent = &buf[..n];
                        let mut armed = watch.lock().unwrap();
                        if armed.as_ref().is_some_and(|word| carries(sent, word)) {
                            *armed = None;
                            marked.store(true, std::sync::atomic::Ordering::SeqCst);
                        }
                        drop(armed);
                        if to_server.write_all(sent).is_err() {
                            break;
                        }
                    }
                    let _ = to_server.shutdown(Shutdown::Both);
                });
                let (mut from_server, mut to_client) = (server, client);
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 65536];
                    while let Ok(n @ 1..) = from_server.read(&mut buf) {
                        if dropping.load(std::sync::atomic::Ordering::SeqCst)
                            || to_client.write_all(&buf[..n]).is_err()
                        {
                            break;
                        }
                    }
                    // The client sees its connection close, the answer unsent.
                    let _ = to_client.shutdown(Shutdown::Both);
                    let _ = from_server.shutdown(Shutdown::Both);
                });
            }
        });
        Self { addr, armed }
    }

    /// Where clients reach Redis through the proxy.
    pub fn addr(&self) -> String {
        self.addr.clone()
    }

    /// Drops the answer to the next command named `command` (any case), with its connection.
    pub fn arm(&self, command: &str) {
        *self.armed.lock().unwrap() = Some(command.to_owned());
    }

    /// Whether the armed command went through and its answer was dropped.
    pub fn fired(&self) -> bool {
        self.armed.lock().unwrap().is_none()
    }
}

fn carries(sent: &[u8], word: &str) -> bool {
    sent.windows(word.len())
        .any(|w| w.eq_ignore_ascii_case(word.as_bytes()))
}
