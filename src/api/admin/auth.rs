//! The bearer token of the operators' API: from `admin.token`, or from `admin.token_file` (re-read when
//! the file changes, so a rotated Secret applies without a restart). Every call is checked before
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
}

/// The token's digest.
type Digested = [u8; 32];

fn digest(token: &[u8]) -> Digested {
    Sha256::digest(token).into()
}

/// Reads a token file: its contents, surrounding whitespace ignored.
fn read_file(path: &Path) -> Result<(Digested, Option<SystemTime>), TokenError> {
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
    let modified = std::fs::metadata(path).and_then(|m| m.modified()).ok();
    Ok((digest(token.as_bytes()), modified))
}

/// The token every call must carry.
#[derive(Debug)]
pub struct Token {
    file: Option<PathBuf>,
    /// The digest in force, and the file's modification time it was read at.
    current: Mutex<(Digested, Option<SystemTime>)>,
}

impl Token {
    /// The token of the settings; an error when there is none, it is too short, or its file cannot be
    /// read.
    pub fn from_settings(settings: &AdminSettings) -> Result<Self, TokenError> {
        if let Some(path) = &settings.token_file {
            return Ok(Self {
                file: Some(path.clone()),
                current: Mutex::new(read_file(path)?),
            });
        }
        let token = settings.token.0.trim();
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
            current: Mutex::new((digest(token.as_bytes()), None)),
        })
    }

    /// Whether `presented` is the token. A token file that changed is read again first; when the new
    /// one cannot be used, the previous token stays in force.
    pub fn accepts(&self, presented: &[u8]) -> bool {
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(path) = &self.file {
            let modified = std::fs::metadata(path).and_then(|m| m.modified()).ok();
            if modified != current.1 {
                match read_file(path) {
                    Ok(read) => {
                        *current = read;
                        tracing::warn!("admin.token_file changed: the new token is in force");
                    }
                    Err(err) => {
                        current.1 = modified;
                        tracing::error!("{err}; the previous token stays in force");
                    }
                }
            }
        }
        let presented = digest(presented);
        // Every byte compared, whatever differs first.
        presented
            .iter()
            .zip(current.0.iter())
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
    fn a_token_file_is_read_again_when_it_changes_and_a_bad_one_keeps_the_old() {
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
        assert!(token.accepts(b"second-token-0123456789"), "kept");
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
