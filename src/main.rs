//! The `ratelimitd` binary: parse the command line, load settings, start logging, run.

use std::{collections::HashMap, path::PathBuf, process::ExitCode, time::Duration};

use clap::{Args, Parser, Subcommand};
use ratelimitd::{
    api::admin::client::{self, Call, ClientSettings, Named},
    rules, server,
    settings::Settings,
    telemetry,
};
use tokio_util::sync::CancellationToken;

/// mimalloc instead of the system allocator: a request allocates and frees a few dozen small blocks
/// (futures, buffers, tonic's and hyper's frames), and mimalloc's per-thread free lists take less CPU
/// for them (BENCHMARKS.md, "The allocator").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Exit code for a wrong setting (EX_USAGE), as linkerd and sysexits use it.
const EXIT_BAD_SETTINGS: u8 = 64;

#[derive(Debug, Parser)]
#[command(
    name = "ratelimitd",
    version,
    about = "Envoy-compatible rate limit decision service"
)]
struct Cli {
    /// Settings file (YAML or TOML); environment variables override it.
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the service (the default).
    Serve,
    /// Load every rules file in DIR as `serve` would, and report the first error.
    CheckConfig {
        /// Folder of rules files.
        dir: PathBuf,
    },
    /// Ask a running ratelimitd's operators' API (admin.* settings): inspect and reset counters, set,
    /// list and delete runtime limits. Prints the API's JSON answer.
    Admin(Box<AdminArgs>),
}

/// How to reach the operators' API. Without flags, the settings (file and environment, as `serve`
/// reads them) say where it listens and its token.
#[derive(Debug, Args)]
struct AdminArgs {
    /// The API's address, http://host:port or https://host:port [default: from admin.host,
    /// admin.port and admin.tls.enabled]
    #[arg(long, value_name = "URL")]
    url: Option<String>,
    /// A file holding the bearer token [default: admin.token_file, or admin.token]
    #[arg(long, value_name = "FILE")]
    token_file: Option<PathBuf>,
    /// PEM CAs that sign the API's certificate [default: the system's roots]
    #[arg(long, value_name = "FILE")]
    ca_cert: Option<PathBuf>,
    /// A client certificate (PEM), for an API that asks for one (admin.tls.client_ca)
    #[arg(long, value_name = "FILE", requires = "client_key")]
    client_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM)
    #[arg(long, value_name = "FILE", requires = "client_cert")]
    client_key: Option<PathBuf>,
    /// Who acts, for the audit log [default: $USER]
    #[arg(long = "as", value_name = "NAME")]
    operator: Option<String>,
    /// The longest the call may take
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    timeout: Duration,
    #[command(subcommand)]
    command: AdminCommand,
}

#[derive(Debug, Subcommand)]
enum AdminCommand {
    /// Every limit a descriptor is counted against, with its counter now (nothing is counted)
    Inspect(DescriptorArgs),
    /// Clear the counters of every limit a descriptor is counted against, for every replica
    Reset(DescriptorArgs),
    /// Runtime limits: limits for one descriptor, held in the store and applied by every replica
    #[command(subcommand)]
    Limits(LimitsCommand),
}

/// A descriptor: its domain and its entries, in order, with raw values.
#[derive(Debug, Args)]
struct DescriptorArgs {
    /// The rules domain
    #[arg(long)]
    domain: String,
    /// The descriptor's entries in order, as KEY=VALUE (e.g. api_key=abc123 path=/v1/chat)
    #[arg(value_name = "KEY=VALUE", required = true, value_parser = entry)]
    entries: Vec<(String, String)>,
}

impl DescriptorArgs {
    fn named(self) -> Named {
        Named {
            domain: self.domain,
            entries: self.entries,
        }
    }
}

#[derive(Debug, Subcommand)]
enum LimitsCommand {
    /// Set a descriptor's runtime limit (replacing the one it has), until an expiry or a delete
    Set {
        #[command(flatten)]
        descriptor: DescriptorArgs,
        /// Hits allowed per window
        #[arg(long)]
        requests_per_unit: u32,
        /// second, minute, hour, day, week, month or year
        #[arg(long)]
        unit: String,
        /// The window is this many units
        #[arg(long)]
        unit_multiplier: Option<u32>,
        /// fixed_window, sliding_window, sliding_log, token_bucket or gcra [default:
        /// rules.default_algorithm]
        #[arg(long)]
        algorithm: Option<String>,
        /// Capacity of token_bucket and gcra
        #[arg(long)]
        burst: Option<u32>,
        /// Count every hit, also past the limit (usage reported after the response)
        #[arg(long)]
        count_over_limit: bool,
        /// Reported as current_limit.name
        #[arg(long)]
        name: Option<String>,
        /// How long it lasts from now (30m, 72h, 7days)
        #[arg(long, conflicts_with = "expires_at")]
        expires_in: Option<String>,
        /// When it ends, RFC 3339 with Z or its offset (2026-12-04T18:00:00Z, 2026-12-04T19:00:00+01:00)
        #[arg(long)]
        expires_at: Option<String>,
    },
    /// The runtime limits in force
    List {
        /// Only those of this domain
        #[arg(long)]
        domain: Option<String>,
    },
    /// Delete a runtime limit, by id or by its descriptor
    #[command(
        group(clap::ArgGroup::new("which").required(true).args(["id", "domain"])),
        override_usage = "ratelimitd admin limits delete (--id <ID> | --domain <DOMAIN> <KEY=VALUE>...)"
    )]
    Delete {
        /// The id `list` shows
        #[arg(long, conflicts_with_all = ["domain", "entries"])]
        id: Option<String>,
        /// The rules domain
        #[arg(long, requires = "entries")]
        domain: Option<String>,
        /// The descriptor's entries in order, as KEY=VALUE
        #[arg(value_name = "KEY=VALUE", value_parser = entry, requires = "domain")]
        entries: Vec<(String, String)>,
    },
}

/// One KEY=VALUE entry (split at the first `=`).
fn entry(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => Err(format!("{text:?} is not KEY=VALUE")),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut env: HashMap<String, String> = std::env::vars().collect();
    if let Some(Command::Admin(args)) = &cli.command {
        if let Some(path) = &args.token_file {
            // The flag's token stands in for the settings' own, which then need none of their own
            // (and one they name is not in the way).
            env.insert(
                "RATELIMITD_ADMIN__TOKEN_FILE".into(),
                path.display().to_string(),
            );
            env.insert("RATELIMITD_ADMIN__TOKEN".into(), String::new());
        }
    }
    let settings = match Settings::load(cli.config.as_deref(), &env) {
        Ok(s) => s,
        Err(err) => {
            eprintln!("ratelimitd: {err}");
            return ExitCode::from(EXIT_BAD_SETTINGS);
        }
    };
    match cli.command.unwrap_or(Command::Serve) {
        Command::CheckConfig { dir } => {
            for warning in &settings.warnings {
                eprintln!("ratelimitd: {warning}");
            }
            check_config(&settings, dir)
        }
        Command::Serve => serve(settings),
        Command::Admin(args) => admin(&settings, *args),
    }
}

/// Exit code when the API could not be reached (EX_UNAVAILABLE).
const EXIT_UNREACHABLE: u8 = 69;

fn admin(settings: &Settings, args: AdminArgs) -> ExitCode {
    let client = match admin_client(settings, &args) {
        Ok(c) => c,
        Err(err) => {
            eprintln!("ratelimitd admin: {err}");
            return ExitCode::from(EXIT_BAD_SETTINGS);
        }
    };
    let call = match args.command {
        AdminCommand::Inspect(d) => Call::Inspect(d.named()),
        AdminCommand::Reset(d) => Call::Reset(d.named()),
        AdminCommand::Limits(LimitsCommand::List { domain }) => Call::ListLimits { domain },
        AdminCommand::Limits(LimitsCommand::Delete {
            id,
            domain,
            entries,
        }) => Call::DeleteLimit {
            id,
            descriptor: domain.map(|domain| Named { domain, entries }),
        },
        AdminCommand::Limits(LimitsCommand::Set {
            descriptor,
            requests_per_unit,
            unit,
            unit_multiplier,
            algorithm,
            burst,
            count_over_limit,
            name,
            expires_in,
            expires_at,
        }) => {
            let mut limit =
                serde_json::json!({ "requests_per_unit": requests_per_unit, "unit": unit });
            let optional = [
                (
                    "unit_multiplier",
                    unit_multiplier.map(serde_json::Value::from),
                ),
                ("algorithm", algorithm.map(serde_json::Value::from)),
                ("burst", burst.map(serde_json::Value::from)),
                ("name", name.map(serde_json::Value::from)),
                ("count_over_limit", count_over_limit.then_some(true.into())),
            ];
            for (field, value) in optional {
                if let Some(value) = value {
                    limit[field] = value;
                }
            }
            Call::SetLimit {
                descriptor: descriptor.named(),
                limit,
                expires_in,
                expires_at,
            }
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("ratelimitd admin: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(client::call(&client, &call)) {
        Ok(answer) => {
            let text = serde_json::to_string_pretty(&answer).unwrap_or_else(|_| answer.to_string());
            println!("{text}");
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("ratelimitd admin: {err}");
            match err {
                client::ClientError::Unreachable { .. } => ExitCode::from(EXIT_UNREACHABLE),
                // Its own flags (a URL, TLS files) cannot be used: as a wrong setting.
                client::ClientError::Setup(_) => ExitCode::from(EXIT_BAD_SETTINGS),
                client::ClientError::Refused { .. } => ExitCode::FAILURE,
            }
        }
    }
}

/// Where the API is and its token: the flags, else the settings.
fn admin_client(settings: &Settings, args: &AdminArgs) -> Result<ClientSettings, String> {
    let admin = &settings.admin;
    let url = args.url.clone().unwrap_or_else(|| {
        // A listener on every address is reached on this host's loopback.
        let host = match admin.host.as_str() {
            "0.0.0.0" => "127.0.0.1".to_owned(),
            "::" => "[::1]".to_owned(),
            h if h.contains(':') => format!("[{h}]"),
            h => h.to_owned(),
        };
        let scheme = if admin.tls.enabled { "https" } else { "http" };
        format!("{scheme}://{host}:{}", admin.port)
    });
    let file = args.token_file.as_ref().or(admin.token_file.as_ref());
    let token = match file {
        Some(path) => std::fs::read_to_string(path)
            .map(|t| t.trim().to_owned())
            .map_err(|e| format!("cannot read the token file {}: {e}", path.display()))?,
        None => admin.token.0.trim().to_owned(),
    };
    if token.is_empty() {
        return Err("no bearer token: give --token-file, or set admin.token_file or RATELIMITD_ADMIN__TOKEN".into());
    }
    if token.len() < ratelimitd::api::admin::MIN_TOKEN_BYTES {
        return Err(format!(
            "the bearer token is {} bytes: the operators' API takes tokens of at least {} bytes",
            token.len(),
            ratelimitd::api::admin::MIN_TOKEN_BYTES
        ));
    }
    let operator = args
        .operator
        .clone()
        .or_else(|| std::env::var("USER").ok())
        .unwrap_or_else(|| "unnamed".into());
    Ok(ClientSettings {
        url,
        token,
        ca_cert: args.ca_cert.clone(),
        client_cert: args.client_cert.clone().zip(args.client_key.clone()),
        operator,
        timeout: args.timeout,
    })
}

fn check_config(settings: &Settings, dir: PathBuf) -> ExitCode {
    let mut source = settings.rules.source();
    source.root = dir;
    source.key_prefix = None;
    if !source.root.is_dir() {
        println!(
            "error loading rate limit configs: {}: not a directory",
            source.root.display()
        );
        return ExitCode::FAILURE;
    }
    match rules::load(&source) {
        Ok(loaded) => {
            for what in &loaded.ignored {
                eprintln!("ratelimitd: warning: {what}");
            }
            for what in loaded
                .rules
                .unreachable(settings.request_limits.entry_bounds())
            {
                eprintln!("ratelimitd: warning: {what}");
            }
            println!("all rate limit configs ok");
            ExitCode::SUCCESS
        }
        Err(err) => {
            println!("error loading rate limit configs: {err}");
            if let Some(place) = err.place() {
                eprintln!("ratelimitd: the error is in {place}");
            }
            ExitCode::FAILURE
        }
    }
}

/// Raises the soft limit on open files to the hard one: every connection costs a file descriptor, and
/// the usual soft default (1 024) is far below what the connection bounds allow. Says so when even the
/// hard limit is below them: when descriptors run out, new connections wait (see SECURITY.md).
fn raise_open_files_limit(settings: &Settings) {
    let limit = match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => limit,
        Err(err) => {
            tracing::warn!("cannot raise the open files limit (RLIMIT_NOFILE): {err}");
            return;
        }
    };
    // Room for Redis connections, the rules watcher, logs and the runtime itself.
    const OWN: usize = 64;
    let http = settings.http.max_connections * if settings.prometheus.enabled { 2 } else { 1 };
    let wanted = settings
        .overload
        .max_connections
        .saturating_add(http)
        .saturating_add(OWN);
    if limit < wanted as u64 {
        tracing::warn!(
            limit,
            "the open files limit (RLIMIT_NOFILE) is below overload.max_connections plus http.max_connections plus {OWN}: past it new connections wait until descriptors free up"
        );
    } else {
        tracing::info!(limit, "open files limit (RLIMIT_NOFILE)");
    }
}

fn serve(settings: Settings) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("ratelimitd: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let telemetry = match telemetry::init(&settings.log, &settings.tracing) {
            Ok(t) => t,
            Err(err) => {
                eprintln!("ratelimitd: {err}");
                return ExitCode::from(EXIT_BAD_SETTINGS);
            }
        };
        // Noticed while loading the settings, before there was a log to write to.
        for warning in &settings.warnings {
            tracing::warn!("{warning}");
        }
        raise_open_files_limit(&settings);
        let listeners = match server::Listeners::bind(&settings).await {
            Ok(l) => l,
            Err(err) => {
                tracing::error!("{err}");
                eprintln!("ratelimitd: {err}");
                return ExitCode::FAILURE;
            }
        };
        let shutdown = CancellationToken::new();
        tokio::spawn(cancel_on_signal(shutdown.clone()));
        let result = server::run(settings, listeners, shutdown).await;
        telemetry.shutdown();
        match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                tracing::error!("{err}");
                eprintln!("ratelimitd: {err}");
                ExitCode::FAILURE
            }
        }
    })
}

/// Cancels `shutdown` on SIGTERM or SIGINT. The signals are taken over when this is called, before the
/// service answers its first call, not when the returned future first runs: a SIGTERM in between (a
/// busy machine, a pod stopped as it starts) would otherwise end the process at once, undrained.
fn cancel_on_signal(shutdown: CancellationToken) -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let term = signal(SignalKind::terminate())
            .map_err(|err| {
                tracing::warn!("cannot watch SIGTERM ({err}); only SIGINT stops the service")
            })
            .ok();
        let interrupt = signal(SignalKind::interrupt()).ok();
        async move {
            let received = |signal: Option<tokio::signal::unix::Signal>| async move {
                match signal {
                    Some(mut signal) => {
                        signal.recv().await;
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = received(term) => {}
                _ = received(interrupt) => {}
            }
            shutdown.cancel();
        }
    }
    #[cfg(not(unix))]
    async move {
        let _ = tokio::signal::ctrl_c().await;
        shutdown.cancel();
    }
}
