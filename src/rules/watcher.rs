//! Live reload of the rules folder.
//!
//! The watcher listens for file system events under the rules root and in its parent (so that a root
//! which is itself a symlink, swapped whole, is noticed), waits for a quiet moment (editors and kubelet
//! write in bursts), then loads the whole folder again. The new rule set replaces the current one only
//! when every file is valid; otherwise the current rules keep serving and the error is logged with the
//! file and the rule, and counted. Kubernetes ConfigMap updates (a new hidden timestamped folder, then an
//! atomic rename of the `..data` symlink), editors writing through a rename, deleted and new files all
//! arrive as events here. A content fingerprint skips reloads that change nothing.

use std::{
    path::Path,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{load, Loaded, Rules};
use crate::settings::RulesSource;

/// Outcomes of rules loads, for logs and metrics.
#[derive(Debug, Default)]
pub struct ReloadStats {
    pub successes: AtomicU64,
    pub errors: AtomicU64,
    /// Fingerprint of the rules files currently served.
    pub fingerprint: AtomicU64,
}

/// Called after every successful load with the new rule set's domain count.
pub type OnLoaded = Box<dyn Fn(&Loaded) + Send + Sync>;

/// Loads the rules once and swaps them in if valid and different; returns whether they changed.
pub fn reload(
    source: &RulesSource,
    rules: &Rules,
    stats: &ReloadStats,
    on_loaded: &OnLoaded,
) -> bool {
    match load(source) {
        Ok(loaded) => {
            stats.successes.fetch_add(1, Ordering::Relaxed);
            if rules.snapshot().is_some()
                && stats.fingerprint.load(Ordering::Relaxed) == loaded.fingerprint
            {
                return false;
            }
            stats
                .fingerprint
                .store(loaded.fingerprint, Ordering::Relaxed);
            on_loaded(&loaded);
            rules.replace(loaded.rules);
            true
        }
        Err(err) => {
            stats.errors.fetch_add(1, Ordering::Relaxed);
            tracing::error!(path = %source.root.display(), "Error loading new configuration: {err}");
            false
        }
    }
}

/// Watches the rules root until `stop`, reloading after each burst of changes.
pub async fn watch(
    source: RulesSource,
    rules: Arc<Rules>,
    stats: Arc<ReloadStats>,
    on_loaded: OnLoaded,
    quiet: Duration,
    stop: CancellationToken,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<()>();
    let mut watcher =
        match notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            if event.is_ok() {
                let _ = tx.send(());
            }
        }) {
            Ok(w) => w,
            Err(err) => {
                tracing::error!("cannot watch the rules folder, rules will not reload: {err}");
                return;
            }
        };
    let watch_paths = |watcher: &mut notify::RecommendedWatcher| {
        let swapped = std::iter::once(&source.root).chain(source.swap_point.as_ref());
        for path in swapped {
            if let Some(parent) = absolute_parent(path) {
                let _ = watcher.watch(&parent, RecursiveMode::NonRecursive);
            }
        }
        if let Err(err) = watcher.watch(&source.root, RecursiveMode::Recursive) {
            tracing::debug!(path = %source.root.display(), "not watching the rules root yet: {err}");
        }
    };
    watch_paths(&mut watcher);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            event = rx.recv() => if event.is_none() { return },
        }
        // Let the burst settle: kubelet and editors write several files and links in a row.
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                more = tokio::time::timeout(quiet, rx.recv()) => match more {
                    Ok(Some(())) => continue,
                    Ok(None) => return,
                    Err(_) => break,
                },
            }
        }
        // The root may have been replaced (a swapped symlink, a recreated folder): watch it anew.
        let _ = watcher.unwatch(&source.root);
        watch_paths(&mut watcher);
        let (source, rules, stats) = (&source, &rules, &stats);
        if reload(source, rules, stats, &on_loaded) {
            tracing::warn!(path = %source.root.display(), "rules reloaded");
        }
    }
}

fn absolute_parent(path: &Path) -> Option<std::path::PathBuf> {
    let absolute = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir().ok()?.join(path)
    };
    absolute.parent().map(Path::to_path_buf)
}
