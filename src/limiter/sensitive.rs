//! Sensitive descriptor values (API keys, tokens): replaced by a keyed hash before they reach a counter
//! key, a log line or `/rlconfig`.
//!
//! A value is sensitive when its entry key is one of the `hashed_keys` setting (case-insensitive) or the
//! rule node matching it says `hash_value: true`. The hash is HMAC-SHA256 under the `hash_secret`
//! setting, truncated to 128 bits and written `hmac-<32 hex digits>`: the same value always gives the
//! same counter on every replica sharing the secret, and the value cannot be recovered from Redis.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Decides which values are sensitive and hashes them.
#[derive(Clone)]
pub struct Sensitive {
    keys: Vec<String>,
    mac: Hmac<Sha256>,
}

impl std::fmt::Debug for Sensitive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sensitive")
            .field("keys", &self.keys)
            .finish_non_exhaustive()
    }
}

impl Sensitive {
    pub fn new(hashed_keys: &[String], secret: &[u8]) -> Self {
        Self {
            keys: hashed_keys.iter().map(|k| k.to_ascii_lowercase()).collect(),
            // HMAC takes keys of any length.
            mac: Hmac::new_from_slice(secret)
                .unwrap_or_else(|_| unreachable!("HMAC accepts any key")),
        }
    }

    /// Whether the value of an entry with this key is sensitive.
    pub fn is_sensitive(&self, key: &str, hash_value: bool) -> bool {
        hash_value || self.keys.iter().any(|k| k.eq_ignore_ascii_case(key))
    }

    /// The keyed hash standing for a sensitive value.
    pub fn hash(&self, value: &str) -> String {
        use std::fmt::Write;
        let mut mac = self.mac.clone();
        mac.update(value.as_bytes());
        let digest = mac.finalize().into_bytes();
        let mut out = String::with_capacity(37);
        out.push_str("hmac-");
        for byte in &digest[..16] {
            let _ = write!(out, "{byte:02x}");
        }
        out
    }

    /// `value` itself, or its hash when sensitive.
    pub fn show<'a>(
        &self,
        key: &str,
        value: &'a str,
        hash_value: bool,
    ) -> std::borrow::Cow<'a, str> {
        if self.is_sensitive(key, hash_value) {
            self.hash(value).into()
        } else {
            value.into()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_are_keyed_stable_and_hide_the_value() {
        let a = Sensitive::new(&["api_key".into()], b"secret-one");
        let b = Sensitive::new(&["api_key".into()], b"secret-two");
        assert_eq!(a.hash("sk_live_1"), a.hash("sk_live_1"));
        assert_ne!(a.hash("sk_live_1"), a.hash("sk_live_2"));
        assert_ne!(
            a.hash("sk_live_1"),
            b.hash("sk_live_1"),
            "keyed by the secret"
        );
        assert!(!a.hash("sk_live_1").contains("sk_live"));
        assert_eq!(a.hash("x").len(), 37);
        assert!(a.is_sensitive("API_KEY", false));
        assert!(a.is_sensitive("user", true));
        assert_eq!(a.show("user", "bob", false), "bob");
    }
}
