//! Reading a rules folder into a [`RuleSet`], all or nothing.
//!
//! Files are named by their path relative to the walked root with `/` replaced by `.` (e.g.
//! `config.basic.yaml`), as the reference service names them in error messages. Symlinked files are
//! read; symlinked folders are not entered (a Kubernetes ConfigMap mount shows its files twice otherwise:
//! once through the `..data` link and once in the hidden timestamped folder, which `ignore_dotfiles` skips).
//!
//! Only what lies inside the rules folder is ever read. The root is resolved once (it may itself be a
//! symlink swapped whole, as `RUNTIME_ROOT` is) and walked through its real path, so one load sees one
//! version of it; a file or folder that is a symlink must resolve inside that real root (a ConfigMap's
//! `web.yaml -> ..data/web.yaml -> ..2026_.../web.yaml` does). One that resolves elsewhere is refused as
//! `<file>: points outside the rules folder`, before anything is read from it: a link to a secret cannot
//! make its content appear in an error message or a log line.

use std::{
    fs,
    path::{Path, PathBuf},
};

use sha2::{Digest, Sha256};

use crate::algorithm::Algorithm;

use super::{
    error::{BuildError, LoadError},
    model::RuleSet,
    yaml::{parse_file_within, DomainFile},
    Source,
};

/// The result of a successful load.
#[derive(Debug)]
pub struct Loaded {
    pub rules: RuleSet,
    /// Names of the files read (or of the resources received), in load order.
    pub files: Vec<String>,
    /// A hash of the files' names and contents: equal fingerprints, equal rules.
    pub fingerprint: u64,
    /// Fields the files have where they mean nothing, each with its file: ignored, and said.
    pub ignored: Vec<String>,
}

/// The fingerprint of a rule set's sources: a hash of their names and contents, in load order.
#[derive(Default)]
pub struct Fingerprint(Sha256);

impl Fingerprint {
    /// Adds one part (a name, a file's text, an encoded resource).
    pub fn add(&mut self, part: &[u8]) {
        self.0.update(part);
        // A separator, so that parts moving between neighbours change the hash.
        self.0.update([0]);
    }

    /// The first 64 bits of the hash.
    pub fn finish(self) -> u64 {
        let digest = self.0.finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        u64::from_be_bytes(first)
    }
}

/// What the walk found under one dotted name.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Found {
    /// A rules file, at its real path inside the root.
    File(PathBuf),
    /// A symlink (to a file or a folder) that resolves outside the root.
    Outside,
    /// A symlink that resolves to nothing (dangling, or through a folder that cannot be entered).
    Unresolved(String),
}

/// Loads every rules file of the source; all or nothing. A root folder that is not there is
/// [`LoadError::Missing`].
pub fn load(source: &Source) -> Result<Loaded, LoadError> {
    let mut parsed = Vec::new();
    let mut fingerprint = Fingerprint::default();
    for (name, what) in find(source)? {
        if let Some(prefix) = &source.key_prefix {
            if !selected(&name, &what, prefix) {
                continue;
            }
        }
        let path = match what {
            Found::File(path) => path,
            Found::Outside => return Err(LoadError::Outside { file: name }),
            Found::Unresolved(reason) => return Err(LoadError::Unresolved { file: name, reason }),
        };
        let (text, file) = read(&name, &path, source.max_yaml_nodes)?;
        fingerprint.add(name.as_bytes());
        fingerprint.add(text.as_bytes());
        parsed.push((name, file));
    }
    Ok(Loaded::build(
        parsed,
        fingerprint.finish(),
        source.merge_domains,
        source.default_algorithm,
    )?)
}

impl Loaded {
    /// The rule set of files (or a control plane's resources) already parsed, compiled in the order
    /// given, all or nothing; `fingerprint` identifies their content. The error names the file.
    pub fn build(
        parsed: Vec<(String, DomainFile)>,
        fingerprint: u64,
        merge_domains: bool,
        default_algorithm: Algorithm,
    ) -> Result<Loaded, BuildError> {
        let rules = RuleSet::build_with(&parsed, merge_domains, default_algorithm)?;
        let ignored = parsed
            .iter()
            .flat_map(|(name, file)| {
                file.ignored
                    .iter()
                    .map(move |what| format!("{name}: {what}"))
            })
            .collect();
        Ok(Loaded {
            rules,
            files: parsed.into_iter().map(|(name, _)| name).collect(),
            fingerprint,
            ignored,
        })
    }
}

/// Everything under the source's root by dotted name, sorted: the load order.
fn find(source: &Source) -> Result<Vec<(String, Found)>, LoadError> {
    let shown = || source.root.display().to_string();
    // The root's real path, resolved once: a swap of the root during the load does not mix versions.
    let root = match fs::canonicalize(&source.root) {
        Ok(root) => root,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            return Err(LoadError::Missing { root: shown() });
        }
        Err(source) => {
            return Err(LoadError::Walk {
                folder: shown(),
                source,
            })
        }
    };
    if !root.is_dir() {
        return Err(LoadError::NotAFolder { root: shown() });
    }
    let mut found = Vec::new();
    let walk = Walk {
        root: &root,
        ignore_dotfiles: source.ignore_dotfiles,
        key_prefix: source.key_prefix.as_deref(),
    };
    walk.folder(&root, &mut found)
        .map_err(|(folder, source)| LoadError::Walk {
            folder: folder.display().to_string(),
            source,
        })?;
    found.sort();
    Ok(found)
}

/// Whether what was found under `name` is under the `key_prefix` the source reads.
fn selected(name: &str, what: &Found, prefix: &str) -> bool {
    // A link to a folder is named like the folder: `config` would hold the files `config.*`.
    name.starts_with(prefix)
        || (*what == Found::Outside
            && prefix
                .strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('.')))
}

/// Reads and parses the rules file `name` at `path`: its text and what it says.
fn read(name: &str, path: &Path, max_yaml_nodes: usize) -> Result<(String, DomainFile), LoadError> {
    let file = || name.to_owned();
    let text = fs::read(path).map_err(|source| LoadError::Read {
        file: file(),
        source,
    })?;
    let text = decode(text).ok_or_else(|| LoadError::NotUtf8 { file: file() })?;
    let parsed = parse_file_within(&text, max_yaml_nodes).map_err(|source| LoadError::Parse {
        file: file(),
        source,
    })?;
    Ok((text, parsed))
}

/// The text of a rules file: UTF-8 (with or without a byte order mark, which the YAML parser skips), or
/// UTF-16 starting with one, as an editor on Windows may save it and as the reference's YAML decoder
/// reads it.
fn decode(bytes: Vec<u8>) -> Option<String> {
    let utf16 = |from_pair: fn([u8; 2]) -> u16| {
        let units = bytes[2..].chunks_exact(2);
        if !units.remainder().is_empty() {
            return None;
        }
        char::decode_utf16(units.map(|pair| from_pair([pair[0], pair[1]])))
            .collect::<Result<String, _>>()
            .ok()
    };
    match bytes.get(..2) {
        Some([0xFF, 0xFE]) => utf16(u16::from_le_bytes),
        Some([0xFE, 0xFF]) => utf16(u16::from_be_bytes),
        _ => String::from_utf8(bytes).ok(),
    }
}

/// A walk of the rules root. `root` is a real path (no symlinks), so every path built under it is real
/// too, except at the symlinks themselves, which are resolved here.
struct Walk<'a> {
    root: &'a Path,
    ignore_dotfiles: bool,
    /// Only the files whose dotted names start with it are read: folders that cannot hold one are not
    /// entered (another application's folder beside ours, a `lost+found` only root may read).
    key_prefix: Option<&'a str>,
}

impl Walk<'_> {
    /// Collects the files under `dir` by dotted name; an error names the folder that failed.
    fn folder(
        &self,
        dir: &Path,
        out: &mut Vec<(String, Found)>,
    ) -> Result<(), (PathBuf, std::io::Error)> {
        let failed = |err| (dir.to_owned(), err);
        for entry in fs::read_dir(dir).map_err(failed)? {
            let entry = entry.map_err(failed)?;
            let name = entry.file_name();
            if self.ignore_dotfiles && name.to_string_lossy().starts_with('.') {
                continue;
            }
            let path = entry.path();
            let file_type = entry.file_type().map_err(failed)?;
            if file_type.is_dir() {
                if self.may_hold_rules(&self.dotted(&path)) {
                    self.folder(&path, out)?;
                }
            } else if file_type.is_file() {
                out.push((self.dotted(&path), Found::File(path)));
            } else if file_type.is_symlink() {
                let found = match fs::canonicalize(&path) {
                    // An editor's lock (Emacs' `.#web.yaml` links to nothing by design).
                    Err(_) if name.to_string_lossy().starts_with('.') => continue,
                    Err(err) => Found::Unresolved(err.to_string()),
                    Ok(target) if !target.starts_with(self.root) => Found::Outside,
                    Ok(target) if target.is_file() => Found::File(target),
                    // A link to a folder inside the root is not entered: its files are walked where
                    // they are.
                    Ok(_) => continue,
                };
                out.push((self.dotted(&path), found));
            }
        }
        Ok(())
    }

    /// `path`'s name in the rules: its path under the root, dotted.
    fn dotted(&self, path: &Path) -> String {
        let relative = path.strip_prefix(self.root).unwrap_or(path);
        relative
            .components()
            .map(|c| c.as_os_str().to_string_lossy())
            .collect::<Vec<_>>()
            .join(".")
    }

    /// Whether the folder named `dotted` is, or may hold, a file read under the key prefix (one whose
    /// dotted name starts with it); any is with no prefix.
    fn may_hold_rules(&self, dotted: &str) -> bool {
        let Some(prefix) = self.key_prefix else {
            return true;
        };
        dotted.starts_with(prefix) || prefix.starts_with(&format!("{dotted}."))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(root: &Path, prefix: Option<&str>, ignore_dotfiles: bool) -> Source {
        Source {
            root: root.to_owned(),
            key_prefix: prefix.map(str::to_owned),
            ignore_dotfiles,
            merge_domains: false,
            default_algorithm: crate::algorithm::Algorithm::FixedWindow,
            swap_point: None,
            max_yaml_nodes: crate::rules::DEFAULT_MAX_YAML_NODES,
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
        let err = load(&source(dir.path(), None, false))
            .unwrap_err()
            .to_string();
        assert_eq!(err, "two.yaml: invalid rate limit unit 'lightyear'");
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
        let err = load(&source(dir.path(), None, false))
            .unwrap_err()
            .to_string();
        assert!(err.contains("duplicate domain 'one'"), "{}", err);
        // Both files named, and what to set.
        assert!(
            err.contains("first declared in ") && err.ends_with("set RUNTIME_IGNOREDOTFILES=true"),
            "{err}"
        );
    }

    /// A folder outside the rules folder holding a file with a recognisable secret, which no message
    /// may ever repeat: YAML-wise a list item the reference's messages would quote in full.
    #[cfg(unix)]
    fn outside_secret() -> (tempfile::TempDir, PathBuf) {
        let outside = tempfile::tempdir().unwrap();
        let secret = outside.path().join("secret.yaml");
        fs::write(&secret, "domain: x\ndescriptors:\n  - TOP-SECRET-42\n").unwrap();
        (outside, secret)
    }

    #[cfg(unix)]
    #[test]
    fn links_resolving_outside_the_folder_are_refused_before_anything_is_read() {
        use std::os::unix::fs::symlink;
        let (outside, secret) = outside_secret();
        let cases: [(&str, PathBuf, &str); 4] = [
            ("leak.yaml", secret.clone(), "leak.yaml"),
            (
                "up.yaml",
                PathBuf::from("../")
                    .join(outside.path().file_name().unwrap())
                    .join("secret.yaml"),
                "up.yaml",
            ),
            ("shared", outside.path().to_owned(), "shared"),
            ("nested/deep.yaml", secret.clone(), "nested.deep.yaml"),
        ];
        for (link, target, name) in cases {
            let dir = tempfile::tempdir_in(outside.path().parent().unwrap()).unwrap();
            fs::write(dir.path().join("one.yaml"), ONE).unwrap();
            let link = dir.path().join(link);
            fs::create_dir_all(link.parent().unwrap()).unwrap();
            symlink(&target, &link).unwrap();
            let err = load(&source(dir.path(), None, false))
                .unwrap_err()
                .to_string();
            assert_eq!(err, format!("{name}: points outside the rules folder"));
            assert!(!err.contains("SECRET"));
        }
    }

    #[test]
    fn a_missing_root_and_a_root_that_is_a_file_are_told_apart_from_an_empty_folder() {
        let dir = tempfile::tempdir().unwrap();
        let empty = load(&source(dir.path(), None, false)).unwrap();
        assert!(empty.files.is_empty());
        let gone = dir.path().join("gone");
        let err = load(&source(&gone, None, false)).unwrap_err();
        assert!(matches!(err, LoadError::Missing { .. }), "{err}");
        assert_eq!(
            err.to_string(),
            format!("{}: the rules folder does not exist", gone.display())
        );
        let file = dir.path().join("web.yaml");
        fs::write(&file, ONE).unwrap();
        let err = load(&source(&file, None, false)).unwrap_err().to_string();
        assert!(
            err.ends_with("web.yaml: the rules folder is not a folder"),
            "{err}"
        );
    }

    #[cfg(unix)]
    #[test]
    fn a_link_to_nothing_is_refused_by_name_where_its_name_is_read() {
        use std::os::unix::fs::symlink;
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir_all(dir.path().join("config")).unwrap();
        fs::create_dir_all(dir.path().join("other")).unwrap();
        fs::write(dir.path().join("config/one.yaml"), ONE).unwrap();
        // Another application's dangling link beside the rules is none of theirs.
        symlink("releases/41/app.yaml", dir.path().join("other/app.yaml")).unwrap();
        let loaded = load(&source(dir.path(), Some("config."), false)).unwrap();
        assert_eq!(loaded.files, vec!["config.one.yaml"]);

        // An editor's lock beside a file being edited links to nothing by design.
        symlink(
            "root@host.4242:1700000000",
            dir.path().join("config/.#one.yaml"),
        )
        .unwrap();
        assert!(load(&source(dir.path(), Some("config."), false)).is_ok());

        symlink("releases/42/web.yaml", dir.path().join("config/web.yaml")).unwrap();
        let err = load(&source(dir.path(), Some("config."), false))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("config.web.yaml: a link that cannot be followed: "),
            "{err}"
        );
    }

    #[cfg(unix)]
    #[test]
    fn links_inside_the_folder_and_a_symlinked_root_load() {
        use std::os::unix::fs::symlink;
        let dir = tempfile::tempdir().unwrap();
        let v1 = dir.path().join("v1");
        fs::create_dir_all(v1.join("config/.versions")).unwrap();
        fs::write(v1.join("config/.versions/one.yaml"), ONE).unwrap();
        symlink(".versions/one.yaml", v1.join("config/one.yaml")).unwrap();
        // A link to a folder inside the root is not entered, wherever it points there.
        symlink(".versions", v1.join("config/current")).unwrap();
        symlink("v1", dir.path().join("current")).unwrap();
        let loaded = load(&source(&dir.path().join("current"), Some("config."), true)).unwrap();
        assert_eq!(loaded.files, vec!["config.one.yaml"]);
    }

    #[cfg(unix)]
    #[test]
    fn with_the_reference_layout_only_links_under_the_app_directory_matter() {
        use std::os::unix::fs::symlink;
        let (outside, secret) = outside_secret();
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("config")).unwrap();
        fs::write(dir.path().join("config/one.yaml"), ONE).unwrap();
        // Not under `config.`: never read, so never refused either.
        symlink(&secret, dir.path().join("elsewhere.yaml")).unwrap();
        assert!(load(&source(dir.path(), Some("config."), false)).is_ok());
        symlink(&secret, dir.path().join("config/leak.yaml")).unwrap();
        let err = load(&source(dir.path(), Some("config."), false))
            .unwrap_err()
            .to_string();
        assert_eq!(err, "config.leak.yaml: points outside the rules folder");
        // The app directory itself linked outside the root.
        fs::remove_dir_all(dir.path().join("config")).unwrap();
        symlink(outside.path(), dir.path().join("config")).unwrap();
        let err = load(&source(dir.path(), Some("config."), false))
            .unwrap_err()
            .to_string();
        assert_eq!(err, "config: points outside the rules folder");
    }

    #[test]
    fn a_file_is_read_as_utf8_or_as_utf16_after_its_byte_order_mark() {
        let text = "domain: caf\u{e9}\n";
        let utf16 = |bom: [u8; 2], unit: fn(u16) -> [u8; 2]| {
            let mut bytes = bom.to_vec();
            bytes.extend(text.encode_utf16().flat_map(unit));
            bytes
        };
        assert_eq!(decode(text.into()).as_deref(), Some(text));
        let le = utf16([0xFF, 0xFE], u16::to_le_bytes);
        assert_eq!(decode(le).as_deref(), Some(text));
        let be = utf16([0xFE, 0xFF], u16::to_be_bytes);
        assert_eq!(decode(be.clone()).as_deref(), Some(text));
        // Cut in the middle of a unit, a lone surrogate, Latin-1 without a mark: refused.
        assert_eq!(decode(be[..be.len() - 1].to_vec()), None);
        assert_eq!(decode(vec![0xFE, 0xFF, 0xD8, 0x00]), None);
        assert_eq!(decode(b"domain: caf\xe9".to_vec()), None);
    }
}
