//! Sensitive descriptor values (API keys, tokens): replaced by a hash before they reach a counter key, a
//! log line or `/rlconfig`.
//!
//! A value is sensitive when its entry key is one of the `hashed_keys` setting (case-insensitive) or the
//! rule node matching it says `hash_value: true`. The hash is truncated to 128 bits and depends on the
//! value alone (and the secret), so the same value gives the same counter on every replica and after every
//! restart:
//! - with the `hash_secret` setting: HMAC-SHA256 under it, written `hmac-<32 hex digits>`; without the
//!   secret nobody can tell which value a key stands for, even by trying guesses;
//! - without it: plain SHA-256, written `sha256-<32 hex digits>`. The raw value is still never stored, but
//!   anyone who can read the keys can confirm a guessed value by hashing it. The two prefixes keep the
//!   forms apart, so keys made under one are never read as the other.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// Decides which values are sensitive and hashes them.
#[derive(Clone)]
pub struct Sensitive {
    keys: Vec<String>,
    hasher: Hasher,
}

/// How a sensitive value becomes its stand-in.
#[derive(Clone)]
enum Hasher {
    /// HMAC-SHA256 under the configured secret.
    Keyed(Hmac<Sha256>),
    /// SHA-256 of the value alone, when no secret is configured.
    Unkeyed,
}

impl std::fmt::Debug for Sensitive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sensitive")
            .field("keys", &self.keys)
            .field("keyed", &matches!(self.hasher, Hasher::Keyed(_)))
            .finish_non_exhaustive()
    }
}

impl Sensitive {
    /// Hashes the values of `hashed_keys` (and of `hash_value` nodes): with HMAC-SHA256 under `secret`,
    /// or with unkeyed SHA-256 when there is none.
    pub fn new(hashed_keys: &[String], secret: Option<&[u8]>) -> Self {
        let hasher = match secret {
            // HMAC takes keys of any length.
            Some(secret) => Hasher::Keyed(
                Hmac::new_from_slice(secret)
                    .unwrap_or_else(|_| unreachable!("HMAC accepts any key")),
            ),
            None => Hasher::Unkeyed,
        };
        Self {
            keys: hashed_keys.iter().map(|k| k.to_ascii_lowercase()).collect(),
            hasher,
        }
    }

    /// Whether the value of an entry with this key is sensitive.
    pub fn is_sensitive(&self, key: &str, hash_value: bool) -> bool {
        hash_value || self.keys.iter().any(|k| k.eq_ignore_ascii_case(key))
    }

    /// The hash standing for a sensitive value: `hmac-...` when keyed, `sha256-...` when not.
    pub fn hash(&self, value: &str) -> String {
        let (prefix, digest) = match &self.hasher {
            Hasher::Keyed(mac) => {
                let mut mac = mac.clone();
                mac.update(value.as_bytes());
                ("hmac-", mac.finalize().into_bytes())
            }
            Hasher::Unkeyed => ("sha256-", Sha256::digest(value.as_bytes())),
        };
        let mut out = String::with_capacity(prefix.len() + 32);
        out.push_str(prefix);
        for byte in &digest[..16] {
            use std::fmt::Write;
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
    fn keyed_hashes_are_hmac_sha256_stable_and_hide_the_value() {
        let a = Sensitive::new(&["api_key".into()], Some(b"secret-one"));
        let b = Sensitive::new(&["api_key".into()], Some(b"secret-two"));
        assert_eq!(a.hash("sk_live_1"), a.hash("sk_live_1"));
        assert_ne!(a.hash("sk_live_1"), a.hash("sk_live_2"));
        assert_ne!(
            a.hash("sk_live_1"),
            b.hash("sk_live_1"),
            "keyed by the secret"
        );
        assert!(!a.hash("sk_live_1").contains("sk_live"));
        assert_eq!(a.hash("x").len(), 37);
        // RFC 4231 test case 2, truncated to 128 bits.
        let jefe = Sensitive::new(&[], Some(b"Jefe"));
        assert_eq!(
            jefe.hash("what do ya want for nothing?"),
            "hmac-5bdcc146bf60754e6a042426089575c7"
        );
        assert!(a.is_sensitive("API_KEY", false));
        assert!(a.is_sensitive("user", true));
        assert_eq!(a.show("user", "bob", false), "bob");
    }

    #[test]
    fn without_a_secret_hashes_are_sha256_the_same_everywhere_and_apart_from_keyed_ones() {
        // Two processes (replicas, or one before and after a restart) without a secret agree.
        let replica_one = Sensitive::new(&["api_key".into()], None);
        let replica_two = Sensitive::new(&["api_key".into()], None);
        assert_eq!(replica_one.hash("sk_live_1"), replica_two.hash("sk_live_1"));
        assert_ne!(replica_one.hash("sk_live_1"), replica_one.hash("sk_live_2"));
        // SHA-256("abc") from FIPS 180-2, truncated to 128 bits.
        assert_eq!(
            replica_one.hash("abc"),
            "sha256-ba7816bf8f01cfea414140de5dae2223"
        );
        assert_eq!(
            replica_one.show("API_KEY", "sk_live_1", false),
            replica_one.hash("sk_live_1")
        );
        assert!(!replica_one.hash("sk_live_1").contains("sk_live"));
        let keyed = Sensitive::new(&["api_key".into()], Some(b""));
        assert!(keyed.hash("abc").starts_with("hmac-"));
        assert_ne!(
            keyed.hash("abc")["hmac-".len()..],
            replica_one.hash("abc")["sha256-".len()..],
            "an empty key is still a key"
        );
    }
}
