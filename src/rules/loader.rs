//! Reading a rules folder into a [`RuleSet`], all or nothing.
//!
//! Files are named by their path relative to the walked root with `/` replaced by `.` (e.g.
//! `config.basic.yaml`), as the reference service names them in error messages. Symlinked files are
//! read; symlinked folders are not entered (a Kubernetes ConfigMap mount shows its files twice otherwise:
//! once through the `..data` link and once in the hidden timestamped folder, which `ignore_dotfiles` skips).

use std::{
    fs,
    path::{Path, PathBuf},
};

use sha2::{Digest, Sha256};

use super::{model::RuleSet, yaml::parse_file_within};
use crate::settings::RulesSource;

/// Why a rules folder could not be loaded. The text is the reference service's message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct LoadError(pub String);

/// The result of a successful load.
#[derive(Debug)]
pub struct Loaded {
    pub rules: RuleSet,
    /// Names of the files read, in load order.
    pub files: Vec<String>,
    /// A hash of the files' names and contents: equal fingerprints, equal rules.
    pub fingerprint: u64,
}

/// Loads every rules file of the source. A missing root folder is an empty rule set.
pub fn load(source: &RulesSource) -> Result<Loaded, LoadError> {
    let mut found = Vec::new();
    if source.root.is_dir() {
        walk(
            &source.root,
            &source.root,
            source.ignore_dotfiles,
            &mut found,
        )
        .map_err(|e| LoadError(format!("{}: {e}", source.root.display())))?;
    }
    found.sort();
    let mut parsed = Vec::with_capacity(found.len());
    let mut digest = Sha256::new();
    for (name, path) in found {
        if let Some(prefix) = &source.key_prefix {
            if !name.starts_with(prefix.as_str()) {
                continue;
            }
        }
        let text =
            fs::read(&path).map_err(|e| LoadError(format!("{name}: cannot read file: {e}")))?;
        let text = String::from_utf8(text)
            .map_err(|_| LoadError(format!("{name}: error loading config file: not UTF-8 text")))?;
        let file = parse_file_within(&text, source.max_yaml_nodes)
            .map_err(|e| LoadError(format!("{name}: {e}")))?;
        digest.update(name.as_bytes());
        digest.update([0]);
        digest.update(text.as_bytes());
        digest.update([0]);
        parsed.push((name, file));
    }
    let rules = RuleSet::build_with(&parsed, source.merge_domains, source.default_algorithm)
        .map_err(LoadError)?;
    let digest = digest.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    Ok(Loaded {
        rules,
        files: parsed.into_iter().map(|(name, _)| name).collect(),
        fingerprint: u64::from_be_bytes(first),
    })
}

fn walk(
    root: &Path,
    dir: &Path,
    ignore_dotfiles: bool,
    out: &mut Vec<(String, PathBuf)>,
) -> std::io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        if ignore_dotfiles && name.to_string_lossy().starts_with('.') {
            continue;
        }
        let path = entry.path();
        let file_type = entry.file_type()?;
        if file_type.is_dir() {
            walk(root, &path, ignore_dotfiles, out)?;
        } else if file_type.is_file() || (file_type.is_symlink() && path.is_file()) {
            let relative = path.strip_prefix(root).unwrap_or(&path);
            let key = relative
                .components()
                .map(|c| c.as_os_str().to_string_lossy())
                .collect::<Vec<_>>()
                .join(".");
            out.push((key, path));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(root: &Path, prefix: Option<&str>, ignore_dotfiles: bool) -> RulesSource {
        RulesSource {
            root: root.to_owned(),
            key_prefix: prefix.map(str::to_owned),
            ignore_dotfiles,
            merge_domains: false,
            default_algorithm: crate::algorithm::Algorithm::FixedWindow,
            swap_point: None,
            max_yaml_nodes: crate::settings::DEFAULT_MAX_YAML_NODES,
        }
    }

    const ONE: &str = "domain: one\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n";
    const TWO: &str = "domain: two\ndescriptors:\n  - key: a\n";

    #[test]
    fn watch_root_layout_keeps_files_under_the_app_directory() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir_all(dir.path().join("config/nested")).unwrap();
        fs::create_dir_all(dir.path().join("other")).unwrap();
        fs::write(dir.path().join("config/one.yaml"), ONE).unwrap();
        fs::write(dir.path().join("config/nested/two.yaml"), TWO).unwrap();
        fs::write(dir.path().join("other/broken.yaml"), "{{{").unwrap();
        let loaded = load(&source(dir.path(), Some("config."), false)).unwrap();
        assert_eq!(
            loaded.files,
            vec!["config.nested.two.yaml", "config.one.yaml"]
        );
        assert_eq!(loaded.rules.domains.len(), 2);
    }

    #[test]
    fn errors_name_the_file_and_reject_the_whole_set() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("one.yaml"), ONE).unwrap();
        fs::write(
            dir.path().join("two.yaml"),
            "domain: two\ndescriptors:\n  - key: a\n    rate_limit: {unit: lightyear}\n",
        )
        .unwrap();
        let err = load(&source(dir.path(), None, false)).unwrap_err();
        assert_eq!(err.0, "two.yaml: invalid rate limit unit 'lightyear'");
    }

    #[cfg(unix)]
    #[test]
    fn configmap_layout_loads_once_with_dotfiles_ignored() {
        use std::os::unix::fs::symlink;
        // What kubelet writes for a ConfigMap volume.
        let dir = tempfile::tempdir().unwrap();
        let stamp = dir.path().join("..2026_11_29_10_00_00.1");
        fs::create_dir(&stamp).unwrap();
        fs::write(stamp.join("one.yaml"), ONE).unwrap();
        symlink("..2026_11_29_10_00_00.1", dir.path().join("..data")).unwrap();
        symlink("..data/one.yaml", dir.path().join("one.yaml")).unwrap();

        let loaded = load(&source(dir.path(), None, true)).unwrap();
        assert_eq!(loaded.files, vec!["one.yaml"]);
        // Without ignoring dotfiles the hidden copy is loaded too: a duplicate domain, as in the reference.
        let err = load(&source(dir.path(), None, false)).unwrap_err();
        assert!(err.0.contains("duplicate domain 'one'"), "{}", err.0);
    }

    #[test]
    fn a_missing_folder_is_an_empty_rule_set() {
        let dir = tempfile::tempdir().unwrap();
        let loaded = load(&source(&dir.path().join("absent"), None, false)).unwrap();
        assert!(loaded.rules.domains.is_empty());
    }
}
