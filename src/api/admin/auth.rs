//! The bearer token of the operators' API: from `admin.token`, or from `admin.token_file` (re-read when
//! the file's modification time or size changes, so a rotated Secret applies without a restart; a file
//! removed, emptied or too short refuses every call until it holds a usable token again). Every call is checked before
//! anything else is read of it; the comparison takes the same time whatever the token presented, and
//! the token itself is kept only as its digest.

use std::{
    path::{Path, PathBuf},
    sync::Mutex,
    time::SystemTime,
};

use sha2::{Digest, Sha256};

use super::AdminSettings;

/// The shortest token accepted, in bytes: a guessable token would make the API an open door.
pub const MIN_TOKEN_BYTES: usize = 16;

/// Why the token cannot be used; the message names the setting, never the token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("invalid setting admin.token: the operators' API needs a bearer token: set admin.token (RATELIMITD_ADMIN__TOKEN) or admin.token_file")]
    Missing,
    #[error("invalid setting {setting}: the token must be at least {MIN_TOKEN_BYTES} bytes")]
    TooShort { setting: String },
    #[error("invalid setting admin.token_file={}: {reason}", path.display())]
    Unreadable { path: PathBuf, reason: String },
    #[error("invalid settings admin.token and admin.token_file: both are set; set one (RATELIMITD_ADMIN__TOKEN or RATELIMITD_ADMIN__TOKEN_FILE)")]
    Both,
}

/// What says a token file changed: its modification time and its size.
type Stamp = Option<(Option<SystemTime>, u64)>;

fn stamp(path: &Path) -> Stamp {
    std::fs::metadata(path)
        .ok()
        .map(|m| (m.modified().ok(), m.len()))
}

/// The token's digest.
type Digested = [u8; 32];

fn digest(token: &[u8]) -> Digested {
    Sha256::digest(token).into()
}

/// Reads a token file: its contents, surrounding whitespace ignored.
fn read_file(path: &Path) -> Result<(Digested, Stamp), TokenError> {
    let unreadable = |reason: String| TokenError::Unreadable {
        path: path.to_owned(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| unreadable(e.to_string()))?;
    let token = text.trim();
    if token.len() < MIN_TOKEN_BYTES {
        return Err(TokenError::TooShort {
            setting: format!("admin.token_file={}", path.display()),
        });
    }
    Ok((digest(token.as_bytes()), stamp(path)))
}

/// The token every call must carry.
#[derive(Debug)]
pub struct Token {
    file: Option<PathBuf>,
    /// The digest in force (`None`: the file holds no usable token, every call is refused), and the
    /// file's stamp it was read at.
    current: Mutex<(Option<Digested>, Stamp)>,
}

impl Token {
    /// The token of the settings; an error when there is none, it is too short, or its file cannot be
    /// read.
    pub fn from_settings(settings: &AdminSettings) -> Result<Self, TokenError> {
        let token = settings.token.0.trim();
        // An empty path is no file, as an empty token is no token.
        let file = settings.token_file.as_ref();
        if let Some(path) = file.filter(|path| !path.as_os_str().is_empty()) {
            if !token.is_empty() {
                return Err(TokenError::Both);
            }
            let (digested, stamp) = read_file(path)?;
            return Ok(Self {
                file: Some(path.clone()),
                current: Mutex::new((Some(digested), stamp)),
            });
        }
        if token.is_empty() {
            return Err(TokenError::Missing);
        }
        if token.len() < MIN_TOKEN_BYTES {
            return Err(TokenError::TooShort {
                setting: "admin.token".into(),
            });
        }
        Ok(Self {
            file: None,
            current: Mutex::new((Some(digest(token.as_bytes())), None)),
        })
    }

    /// Whether `presented` is the token. A token file that changed is read again first; when the new
    /// one cannot be used, every call is refused until it can (a revoked token must not stay valid).
    pub fn accepts(&self, presented: &[u8]) -> bool {
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(path) = &self.file {
            let now = stamp(path);
            if now != current.1 {
                match read_file(path) {
                    Ok((digested, read_at)) => {
                        *current = (Some(digested), read_at);
                        tracing::warn!("admin.token_file changed: the new token is in force");
                    }
                    Err(err) => {
                        *current = (None, now);
                        tracing::error!(
                            "{err}; every call is refused until it holds a usable token"
                        );
                    }
                }
            }
        }
        let Some(token) = current.0 else {
            return false;
        };
        let presented = digest(presented);
        // Every byte compared, whatever differs first.
        presented
            .iter()
            .zip(token.iter())
            .fold(0u8, |diff, (a, b)| diff | (a ^ b))
            == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::redis::Secret;

    #[test]
    fn a_token_is_needed_and_must_not_be_short() {
        let mut settings = AdminSettings::default();
        assert_eq!(
            Token::from_settings(&settings).unwrap_err(),
            TokenError::Missing
        );
        settings.token = Secret("short".into());
        assert!(Token::from_settings(&settings)
            .unwrap_err()
            .to_string()
            .contains("at least 16 bytes"));
        settings.token = Secret("0123456789abcdef".into());
        let token = Token::from_settings(&settings).unwrap();
        assert!(token.accepts(b"0123456789abcdef"));
        assert!(!token.accepts(b"0123456789abcdeF"));
        assert!(!token.accepts(b""));
    }

    #[test]
    fn a_token_file_is_read_again_when_it_changes_and_a_bad_one_refuses_every_call() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "first-token-0123456789\n").unwrap();
        let settings = AdminSettings {
            token_file: Some(path.clone()),
            ..AdminSettings::default()
        };
        let token = Token::from_settings(&settings).unwrap();
        assert!(token.accepts(b"first-token-0123456789"));
        // A new modification time, whatever the file system's resolution.
        let later = SystemTime::now() + std::time::Duration::from_secs(10);
        std::fs::write(&path, "second-token-0123456789").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(later)
            .unwrap();
        assert!(token.accepts(b"second-token-0123456789"));
        assert!(!token.accepts(b"first-token-0123456789"));
        std::fs::write(&path, "tiny").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(later + std::time::Duration::from_secs(10))
            .unwrap();
        assert!(
            !token.accepts(b"second-token-0123456789"),
            "a revoked token"
        );
        assert!(!token.accepts(b"tiny"));
        std::fs::remove_file(&path).unwrap();
        assert!(!token.accepts(b"second-token-0123456789"), "a removed file");
        // Rewritten within the same modification time: the size tells.
        std::fs::write(&path, "third-token-0123456789").unwrap();
        assert!(token.accepts(b"third-token-0123456789"));
        std::fs::write(&path, "").unwrap();
        assert!(!token.accepts(b"third-token-0123456789"), "an emptied file");
        let both = AdminSettings {
            token: Secret("0123456789abcdef".into()),
            token_file: Some(path.clone()),
            ..AdminSettings::default()
        };
        assert_eq!(Token::from_settings(&both).unwrap_err(), TokenError::Both);
        let missing = AdminSettings {
            token_file: Some(dir.path().join("none")),
            ..AdminSettings::default()
        };
        let err = Token::from_settings(&missing).unwrap_err().to_string();
        assert!(
            err.starts_with("invalid setting admin.token_file="),
            "{err}"
        );
    }
}
