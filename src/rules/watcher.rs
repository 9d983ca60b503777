//! Live reload of the rules folder.
//!
//! The watcher listens for file system events under the rules root and in its parent (so that a root
//! which is itself a symlink, swapped whole, is noticed; while the parent is missing, in the nearest
//! folder above that exists), waits for a quiet moment (editors and kubelet
//! write in bursts), then loads the whole folder again. The new rule set replaces the current one only
//! when every file is valid; otherwise the current rules keep serving and the error is logged with the
//! file and the rule, and counted. Kubernetes ConfigMap updates (a new hidden timestamped folder, then an
//! atomic rename of the `..data` symlink), editors writing through a rename, deleted and new files all
//! arrive as events here. A content fingerprint skips swaps that change nothing.
//!
//! Only events that can change what is loaded start a load: creations, writes, renames and removals
//! under the root, and, in the root's parent folder, those naming the root or the swap point. Reading the
//! files raises events too (open, access, close without writing), the load's own reads among them: were
//! those counted, every load would start the next one, forever.

use std::{
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use notify::{
    event::{AccessKind, AccessMode, ModifyKind},
    EventKind, RecursiveMode, Watcher,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{load, Fingerprint, LoadError, Loaded, Rules, Source};

/// Outcomes of rules loads, for logs and metrics.
#[derive(Debug, Default)]
pub struct ReloadStats {
    pub successes: AtomicU64,
    pub errors: AtomicU64,
    /// Fingerprint of the rules files currently served.
    pub fingerprint: AtomicU64,
}

/// Called after every successful load that changes the rules, before they are swapped in.
pub type OnLoaded = Box<dyn Fn(&Loaded) + Send + Sync>;

/// Where every loaded rule set goes, whether read from the files or received from a control plane: it
/// is counted, announced and swapped in whole when it differs from the rules being served.
pub struct Publisher {
    rules: Arc<Rules>,
    stats: Arc<ReloadStats>,
    on_loaded: OnLoaded,
    /// The rules served are the empty set of a rules folder missing at start (see [`reload`]).
    missing_root: AtomicBool,
}

impl Publisher {
    pub fn new(rules: Arc<Rules>, stats: Arc<ReloadStats>, on_loaded: OnLoaded) -> Self {
        Self {
            rules,
            stats,
            on_loaded,
            missing_root: AtomicBool::new(false),
        }
    }

    /// Counts a successful load and swaps it in if it differs from the rules served (by fingerprint);
    /// returns whether the rules changed.
    pub fn publish(&self, loaded: Loaded) -> bool {
        if self.already_serves(loaded.fingerprint) {
            return false;
        }
        let stats = &self.stats;
        stats.successes.fetch_add(1, Ordering::Relaxed);
        stats
            .fingerprint
            .store(loaded.fingerprint, Ordering::Relaxed);
        (self.on_loaded)(&loaded);
        self.rules.replace(loaded.rules);
        true
    }

    /// Whether the rules served have this fingerprint: a load of the same sources would change nothing,
    /// so it is counted as a successful load without being compiled.
    pub fn already_serves(&self, fingerprint: u64) -> bool {
        let stats = &self.stats;
        let serves = self.rules.snapshot().is_some()
            && stats.fingerprint.load(Ordering::Relaxed) == fingerprint;
        if serves {
            stats.successes.fetch_add(1, Ordering::Relaxed);
        }
        serves
    }

    /// Whether a rule set is served (none before the first load).
    pub fn serves(&self) -> bool {
        self.rules.snapshot().is_some()
    }

    /// Counts a refused load; the rules served stay as they are.
    pub fn refuse(&self) {
        self.stats.errors.fetch_add(1, Ordering::Relaxed);
    }
}

/// Loads the rules files once and publishes them if valid; returns whether the rules changed. A rules
/// folder that is not there is an empty rule set while none is served (at start, where the server
/// warns of it), and while that empty set is served a folder still missing is no news (the folders
/// above it being made one by one, each watched in turn): later it is a deploy between removing the
/// folder and writing it anew, and the rules served stay.
pub fn reload(source: &Source, publisher: &Publisher) -> bool {
    let loaded = load(source);
    let missing = matches!(loaded, Err(LoadError::Missing { .. }));
    if missing && publisher.missing_root.load(Ordering::Relaxed) {
        return false;
    }
    let loaded = match loaded {
        Err(LoadError::Missing { .. }) if !publisher.serves() => Loaded::build(
            Vec::new(),
            Fingerprint::default().finish(),
            source.merge_domains,
            source.default_algorithm,
        )
        .map_err(LoadError::from),
        loaded => loaded,
    };
    match loaded {
        Ok(loaded) => {
            for what in &loaded.ignored {
                tracing::warn!(path = %source.root.display(), "rules file field ignored: {what}");
            }
            let changed = publisher.publish(loaded);
            publisher.missing_root.store(missing, Ordering::Relaxed);
            changed
        }
        Err(err) => {
            publisher.refuse();
            let at = err.place();
            tracing::error!(path = %source.root.display(), at, "Error loading new configuration: {err}");
            false
        }
    }
}

/// Most folders of the rules path made while [`RulesWatch::watch_paths`] watches the nearest one.
const MAX_PATH_STEPS: usize = 16;

/// A burst of changes is loaded after this many quiet periods (`rules.reload_delay`) at most.
const SETTLE_AT_MOST: u32 = 10;

/// Watches registered on the rules folder. Events are collected from [`RulesWatch::start`] on, so that a
/// change made while the first load runs is not missed; [`RulesWatch::run`] acts on them.
pub struct RulesWatch {
    source: Source,
    watched: Watched,
    watcher: notify::RecommendedWatcher,
    /// The folders [`Watched::parents`] gave at the last watch, watched without recursion.
    parents: Vec<PathBuf>,
    changes: mpsc::UnboundedReceiver<()>,
}

impl RulesWatch {
    /// Starts listening for changes to the rules. Call it before the first load. `None` (with the reason
    /// logged) when the platform cannot watch: the rules then never reload.
    pub fn start(source: &Source) -> Option<Self> {
        let Some(watched) = Watched::new(source) else {
            tracing::error!(path = %source.root.display(), "cannot resolve the rules folder, rules will not reload");
            return None;
        };
        let (tx, changes) = mpsc::unbounded_channel::<()>();
        let filter = watched.clone();
        let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            match event {
                Ok(event) if filter.may_change_rules(&event) => {
                    let _ = tx.send(());
                }
                Ok(_) => {}
                // A folder created under the root could not be watched (the watch limit): changes in it
                // go unnoticed, so it is said; the reload it may miss is tried at once.
                Err(err) => {
                    warn_unwatched(&err);
                    let _ = tx.send(());
                }
            }
        });
        let mut watch = match watcher {
            Ok(watcher) => Self {
                source: source.clone(),
                watched,
                watcher,
                parents: Vec::new(),
                changes,
            },
            Err(err) => {
                tracing::error!("cannot watch the rules folder, rules will not reload: {err}");
                return None;
            }
        };
        watch.watch_paths();
        Some(watch)
    }

    fn watch_paths(&mut self) {
        // A folder of the path made between finding the nearest one that exists and watching it is
        // seen by no watch: look again until the same folders are found.
        // Watched anew each time: a folder removed and made again under the same name lost its watch.
        let mut parents = self.watched.parents();
        for _ in 0..MAX_PATH_STEPS {
            // A folder that no longer exists lost its watch with it (and unwatching it is an error).
            let gone = self.parents.iter().filter(|p| !parents.contains(p));
            for folder in gone.filter(|p| p.is_dir()) {
                let _ = self.watcher.unwatch(folder);
            }
            for parent in &parents {
                let _ = self.watcher.watch(parent, RecursiveMode::NonRecursive);
            }
            self.parents = parents;
            parents = self.watched.parents();
            if parents == self.parents {
                break;
            }
        }
        match self
            .watcher
            .watch(&self.watched.root, RecursiveMode::Recursive)
        {
            Ok(()) => {}
            // Not there yet: its parent's watch sees it come.
            Err(err) if matches!(err.kind, notify::ErrorKind::PathNotFound) => {
                tracing::debug!(path = %self.source.root.display(), "not watching the rules root yet: {err}");
            }
            Err(err) => warn_unwatched(&err),
        }
    }

    /// Reloads the rules after each burst of changes, until `stop`.
    pub async fn run(
        mut self,
        publisher: Arc<Publisher>,
        quiet: Duration,
        stop: CancellationToken,
    ) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                event = self.changes.recv() => if event.is_none() { return },
            }
            // Let the burst settle: kubelet and editors write several files and links in a row. Changes
            // that never pause (a file rewritten all the time) are loaded every `SETTLE_AT_MOST` quiet
            // periods, not never.
            let settled_by = tokio::time::Instant::now() + quiet.saturating_mul(SETTLE_AT_MOST);
            loop {
                let left = settled_by.saturating_duration_since(tokio::time::Instant::now());
                if left.is_zero() {
                    break;
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    more = tokio::time::timeout(quiet.min(left), self.changes.recv()) => match more {
                        Ok(Some(())) => continue,
                        Ok(None) => return,
                        Err(_) => break,
                    },
                }
            }
            // The root may have been replaced (a swapped symlink, a recreated folder): watch it anew,
            // before loading, so that what changes from here on is noticed.
            if self.watched.root.exists() {
                let _ = self.watcher.unwatch(&self.watched.root);
            }
            self.watch_paths();
            // Reading, parsing and compiling a large folder takes a while: off the request workers.
            let (source, on) = (self.source.clone(), publisher.clone());
            match tokio::task::spawn_blocking(move || reload(&source, &on)).await {
                Ok(true) => {
                    tracing::warn!(path = %self.source.root.display(), "rules reloaded");
                }
                Ok(false) => {}
                // A bug in loading: the rules served stay, and the failure is counted and told.
                Err(err) => {
                    publisher.refuse();
                    tracing::error!(path = %self.source.root.display(), "Error loading new configuration: {err}");
                }
            }
        }
    }
}

/// Says that changes to the rules may go unnoticed, and why (most often the system's limit on inotify
/// watches, `fs.inotify.max_user_watches`, which every container of one user on a node shares).
fn warn_unwatched(err: &notify::Error) {
    let why = match err.kind {
        notify::ErrorKind::MaxFilesWatch => {
            "the system's limit on watched folders is reached (raise fs.inotify.max_user_watches)"
        }
        _ => "the watch failed",
    };
    tracing::warn!(paths = ?err.paths, "changes to the rules may go unnoticed, so they may not reload: {why}: {err}");
}

/// The paths the watcher listens to, absolute so that they compare with the paths of events.
#[derive(Debug, Clone)]
struct Watched {
    /// The rules root, watched recursively: any change under it may change the rules.
    root: PathBuf,
    /// The path a deployment swaps whole (`RUNTIME_ROOT`), when it is not the root.
    swap_point: Option<PathBuf>,
}

impl Watched {
    fn new(source: &Source) -> Option<Self> {
        Some(Self {
            root: std::path::absolute(&source.root).ok()?,
            swap_point: match &source.swap_point {
                Some(p) => Some(std::path::absolute(p).ok()?),
                None => None,
            },
        })
    }

    /// The folders watched without recursion so that replacing the root or the swap point whole (a
    /// symlink renamed over it, a folder created or removed) is noticed: the folder holding each, or,
    /// while that is missing too, the nearest folder above it that exists, which sees the path come
    /// back one folder at a time (each step a load, which watches the next).
    fn parents(&self) -> Vec<PathBuf> {
        let mut parents: Vec<PathBuf> = Vec::new();
        for path in std::iter::once(&self.root).chain(self.swap_point.as_ref()) {
            let existing = path.ancestors().skip(1).find(|folder| folder.is_dir());
            if let Some(folder) = existing {
                if !parents.iter().any(|p| p == folder) {
                    parents.push(folder.to_path_buf());
                }
            }
        }
        parents
    }

    /// Whether an event can change what a load would read: a change of content, name or existence, under
    /// the root or of the root or swap point itself. Reads (open, access, close without writing), the
    /// load's own included, cannot, and neither can anything else in the parent folders.
    fn may_change_rules(&self, event: &notify::Event) -> bool {
        let changes = match event.kind {
            EventKind::Create(_) | EventKind::Remove(_) => true,
            EventKind::Modify(ModifyKind::Data(_) | ModifyKind::Name(_) | ModifyKind::Any) => true,
            // A file's mode or owner changed: a file the service could not read may be readable now
            // (reads change no metadata the kernel reports, so loads do not start loads).
            EventKind::Modify(ModifyKind::Metadata(_)) => true,
            EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
            EventKind::Modify(_) | EventKind::Access(_) => false,
            // The kernel dropped events (queue overflow): anything may have changed.
            EventKind::Any | EventKind::Other => return true,
        };
        // Not filtered by the key prefix: a file read may be a link into any folder under the root
        // (a ConfigMap's `config.web.yaml` into `..data`), whose changes are then the file's.
        changes
            && event.paths.iter().any(|path| {
                path.starts_with(&self.root)
                    || self.root.starts_with(path)
                    || self.swap_point.as_deref() == Some(path.as_path())
            })
    }
}

#[cfg(test)]
mod tests {
    use notify::event::{CreateKind, DataChange, MetadataKind, RemoveKind, RenameMode};

    use super::*;

    fn event(kind: EventKind, path: &str) -> notify::Event {
        notify::Event::new(kind).add_path(PathBuf::from(path))
    }

    #[test]
    fn only_changes_under_the_root_or_of_the_swap_point_count() {
        let watched = Watched {
            root: "/srv/runtime/current/ratelimit".into(),
            swap_point: Some("/srv/runtime/current".into()),
        };
        let data = EventKind::Modify(ModifyKind::Data(DataChange::Any));
        for (kind, path) in [
            (data, "/srv/runtime/current/ratelimit/config/web.yaml"),
            (
                EventKind::Create(CreateKind::File),
                "/srv/runtime/current/ratelimit/config/new.yaml",
            ),
            (
                EventKind::Remove(RemoveKind::File),
                "/srv/runtime/current/ratelimit/config/web.yaml",
            ),
            (
                EventKind::Modify(ModifyKind::Name(RenameMode::To)),
                "/srv/runtime/current",
            ),
            (
                EventKind::Access(AccessKind::Close(AccessMode::Write)),
                "/srv/runtime/current/ratelimit/config/web.yaml",
            ),
            (
                EventKind::Modify(ModifyKind::Metadata(MetadataKind::Permissions)),
                "/srv/runtime/current/ratelimit/config/web.yaml",
            ),
            (
                EventKind::Create(CreateKind::Folder),
                "/srv/runtime/current/ratelimit/config",
            ),
            (
                EventKind::Remove(RemoveKind::Folder),
                "/srv/runtime/current/ratelimit",
            ),
            (data, "/srv/runtime/current/ratelimit/config.yaml"),
            // A folder above, watched while the root's parent is missing: the path coming back.
            (EventKind::Create(CreateKind::Folder), "/srv/runtime"),
            (EventKind::Other, "/anywhere"),
        ] {
            assert!(
                watched.may_change_rules(&event(kind, path)),
                "{kind:?} {path}"
            );
        }
        for (kind, path) in [
            (
                EventKind::Access(AccessKind::Open(AccessMode::Any)),
                "/srv/runtime/current/ratelimit/config/web.yaml",
            ),
            (
                EventKind::Access(AccessKind::Close(AccessMode::Read)),
                "/srv/runtime/current/ratelimit",
            ),
            // Neighbours in the watched parent folders.
            (data, "/srv/runtime/current/other.yaml"),
            (
                EventKind::Create(CreateKind::File),
                "/srv/runtime/current.tmp",
            ),
            (data, "/srv/runtime/current/ratelimit2"),
            (EventKind::Create(CreateKind::Folder), "/srv/runtime2"),
        ] {
            assert!(
                !watched.may_change_rules(&event(kind, path)),
                "{kind:?} {path}"
            );
        }
    }

    #[test]
    fn a_missing_folder_is_an_empty_rule_set_at_start_and_refused_once_rules_are_served() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("rules");
        let stats = Arc::new(ReloadStats::default());
        let rules = Arc::new(Rules::default());
        let publisher = Publisher::new(rules.clone(), stats.clone(), Box::new(|_| {}));
        let source = Source {
            root: root.clone(),
            key_prefix: None,
            ignore_dotfiles: false,
            merge_domains: false,
            default_algorithm: crate::algorithm::Algorithm::FixedWindow,
            swap_point: None,
            max_yaml_nodes: crate::rules::DEFAULT_MAX_YAML_NODES,
        };
        assert!(reload(&source, &publisher), "at start: no rules");
        assert_eq!(rules.snapshot().unwrap().domains.len(), 0);

        std::fs::create_dir(&root).unwrap();
        std::fs::write(
            root.join("web.yaml"),
            "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 1}\n",
        )
        .unwrap();
        assert!(reload(&source, &publisher));
        std::fs::remove_dir_all(&root).unwrap();
        assert!(!reload(&source, &publisher), "gone: the rules served stay");
        assert_eq!(rules.snapshot().unwrap().domains.len(), 1);
        assert_eq!(stats.errors.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_load_of_the_rules_served_changes_nothing_and_counts_as_a_success() {
        let rules = Arc::new(Rules::default());
        let stats = Arc::new(ReloadStats::default());
        let announced = Arc::new(AtomicU64::new(0));
        let seen = announced.clone();
        let on_loaded: OnLoaded = Box::new(move |_| {
            seen.fetch_add(1, Ordering::Relaxed);
        });
        let publisher = Publisher::new(rules.clone(), stats.clone(), on_loaded);
        let loaded = |fingerprint| Loaded {
            rules: super::super::RuleSet::default(),
            files: Vec::new(),
            fingerprint,
            ignored: Vec::new(),
        };
        // Nothing served yet: not even a fingerprint of 0 is served.
        assert!(!publisher.already_serves(0));
        assert!(publisher.publish(loaded(7)));
        assert!(publisher.already_serves(7));
        assert!(!publisher.already_serves(8));
        assert!(!publisher.publish(loaded(7)));
        assert!(publisher.publish(loaded(8)));
        // Four loads succeeded (two of them changed nothing); two were announced and swapped in.
        assert_eq!(stats.successes.load(Ordering::Relaxed), 4);
        assert_eq!(announced.load(Ordering::Relaxed), 2);
        assert_eq!(stats.fingerprint.load(Ordering::Relaxed), 8);
    }
}
