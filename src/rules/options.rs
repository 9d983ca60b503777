//! Where the rules live and how they are read: the options (part of the process settings, assembled by
//! `settings`), and the [`Source`] they resolve to, which loading and watching work from.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use serde::{Deserialize, Serialize};

use crate::algorithm::Algorithm;

/// Default of `rules.max_yaml_nodes`: room for rules files of some 90 000 descriptors with a limit each.
pub const DEFAULT_MAX_YAML_NODES: usize = 1_000_000;

/// Where the rules live. With `path` set, every file under it is a rules file. Otherwise, when
/// `runtime_root` is set, the reference layout applies (see [`RulesSettings::source`]); with neither,
/// rules come from `./config` when that folder exists.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RulesSettings {
    /// Where the rules come from. Env `CONFIG_TYPE`: `FILE` (the default) reads the rules folder below;
    /// `GRPC_XDS_SOTW` takes them from an xDS control plane (the `xds` settings) and reads no files.
    pub config_type: ConfigType,
    /// A folder of rules files, read recursively.
    pub path: Option<PathBuf>,
    /// Env `RUNTIME_ROOT`: root of the reference layout.
    pub runtime_root: Option<PathBuf>,
    /// Env `RUNTIME_SUBDIRECTORY`: folder under the root.
    pub runtime_subdirectory: String,
    /// Env `RUNTIME_APPDIRECTORY` (default `config`): folder holding the rules files.
    pub runtime_appdirectory: String,
    /// Env `RUNTIME_WATCH_ROOT` (default true): read `root/subdirectory` and keep the files whose dotted
    /// path starts with `appdirectory.`; false reads `root/subdirectory/appdirectory` directly
    /// (the layout of a Kubernetes ConfigMap mount).
    pub runtime_watch_root: bool,
    /// Env `RUNTIME_IGNOREDOTFILES` (default false): skip files and folders whose name starts with a dot.
    pub ignore_dotfiles: bool,
    /// Env `MERGE_DOMAIN_CONFIG` (default false): files naming the same domain are merged instead of
    /// rejected.
    pub merge_domains: bool,
    /// The algorithm of limits that do not name one (default `fixed_window`, the reference's).
    pub default_algorithm: Algorithm,
    /// Reload the rules when files under the rules folder change (default true).
    pub watch: bool,
    /// Quiet time after the last change before reloading (default `250ms`): changes come in bursts.
    #[serde(with = "crate::duration")]
    pub reload_delay: Duration,
    /// Most YAML nodes (maps, lists and scalars, aliases expanded) one rules file may hold (default
    /// 1 000 000, some 90 000 descriptors with a limit each); a larger file is refused, naming this setting.
    pub max_yaml_nodes: usize,
}

impl Default for RulesSettings {
    fn default() -> Self {
        Self {
            config_type: ConfigType::File,
            path: None,
            runtime_root: None,
            runtime_subdirectory: String::new(),
            runtime_appdirectory: "config".into(),
            runtime_watch_root: true,
            ignore_dotfiles: false,
            merge_domains: false,
            default_algorithm: Algorithm::FixedWindow,
            watch: true,
            reload_delay: Duration::from_millis(250),
            max_yaml_nodes: DEFAULT_MAX_YAML_NODES,
        }
    }
}

/// Where the rules come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConfigType {
    /// The rules files.
    File,
    /// A state-of-the-world xDS control plane.
    GrpcXdsSotw,
}

/// How the rules directory is walked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// The folder walked recursively.
    pub root: PathBuf,
    /// With the reference `RUNTIME_WATCH_ROOT=true` layout: only files whose dotted relative path starts
    /// with this prefix (e.g. `config.`) are rules, and they are named by that dotted path.
    pub key_prefix: Option<String>,
    /// Skip names starting with a dot.
    pub ignore_dotfiles: bool,
    /// Merge files of the same domain.
    pub merge_domains: bool,
    /// The algorithm of limits that do not name one.
    pub default_algorithm: Algorithm,
    /// The path a deployment swaps whole to publish new rules (`RUNTIME_ROOT`, often a symlink), when it
    /// differs from `root`; its parent folder is watched too.
    pub swap_point: Option<PathBuf>,
    /// Most YAML nodes one file may hold (`rules.max_yaml_nodes`).
    pub max_yaml_nodes: usize,
}

/// The reference's `RUNTIME_ROOT` when it is not set.
pub const REFERENCE_RUNTIME_ROOT: &str = "/srv/runtime_data/current";

impl RulesSettings {
    /// The reference layout's root: `RUNTIME_ROOT`, or the reference's default when only
    /// `RUNTIME_SUBDIRECTORY` is set (a deployment of the reference that relies on that default).
    fn runtime_root(&self) -> Option<PathBuf> {
        self.runtime_root.clone().or_else(|| {
            (!self.runtime_subdirectory.is_empty()).then(|| PathBuf::from(REFERENCE_RUNTIME_ROOT))
        })
    }

    /// Resolves the settings into the folder to read.
    pub fn source(&self) -> Source {
        let runtime_root = self.runtime_root();
        let swap_point = match (&self.path, &runtime_root) {
            (None, Some(runtime_root)) => Some(runtime_root.clone()),
            _ => None,
        };
        let (root, key_prefix) = match (&self.path, &runtime_root) {
            (Some(path), _) => (path.clone(), None),
            (None, Some(runtime_root)) => {
                let base = join_nonempty(runtime_root, &self.runtime_subdirectory);
                if self.runtime_watch_root {
                    (base, Some(format!("{}.", self.runtime_appdirectory)))
                } else {
                    (join_nonempty(&base, &self.runtime_appdirectory), None)
                }
            }
            (None, None) => (PathBuf::from("config"), None),
        };
        Source {
            root,
            key_prefix,
            ignore_dotfiles: self.ignore_dotfiles,
            merge_domains: self.merge_domains,
            default_algorithm: self.default_algorithm,
            swap_point,
            max_yaml_nodes: self.max_yaml_nodes,
        }
    }
}

/// `base/part`, as the reference joins its runtime folders (Go's `filepath.Join`): a `part` written with
/// a leading `/` (`RUNTIME_SUBDIRECTORY=/ratelimit`) stays under `base`, where `Path::join` would put
/// it at the file system's root.
fn join_nonempty(base: &Path, part: &str) -> PathBuf {
    let part = part.trim_start_matches('/');
    if part.is_empty() {
        base.to_path_buf()
    } else {
        base.join(part)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `RUNTIME_SUBDIRECTORY=/ratelimit` and `RUNTIME_APPDIRECTORY=/config` are folders under
    /// `RUNTIME_ROOT`, as the reference joins them, not at the file system's root.
    #[test]
    fn runtime_folders_written_with_a_leading_slash_stay_under_the_root() {
        let mut settings = RulesSettings {
            path: None,
            runtime_root: Some("/data".into()),
            runtime_subdirectory: "/ratelimit".into(),
            runtime_appdirectory: "/config".into(),
            runtime_watch_root: false,
            ..RulesSettings::default()
        };
        assert_eq!(settings.source().root, Path::new("/data/ratelimit/config"));
        settings.runtime_subdirectory = "/".into();
        assert_eq!(settings.source().root, Path::new("/data/config"));
    }
}
