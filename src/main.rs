//! The `ratelimitd` binary: parse the command line, load settings, start logging, run.

use std::{collections::HashMap, path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand};
use ratelimitd::{rules, server, settings::Settings, telemetry};
use tokio_util::sync::CancellationToken;

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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let env: HashMap<String, String> = std::env::vars().collect();
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
    }
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
        Ok(_) => {
            println!("all rate limit configs ok");
            ExitCode::SUCCESS
        }
        Err(err) => {
            println!("error loading rate limit configs: {err}");
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

/// Cancels `shutdown` on SIGTERM or SIGINT.
async fn cancel_on_signal(shutdown: CancellationToken) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(err) => {
                tracing::warn!("cannot watch SIGTERM ({err}); only SIGINT stops the service");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
    shutdown.cancel();
}
