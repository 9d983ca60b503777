//! The counter key schema, in one place.
//!
//! Fixed-window keys keep the reference service's layout so that both can share one Redis:
//! `CACHE_KEY_PREFIX + domain + "_" + (key + "_" + value + "_")... + window_start`. The stores append the
//! window start; this module builds the rest.

use crate::algorithm::Algorithm;

/// Builds the key of a descriptor's counter into `out` (cleared first). `values` yields each entry's
/// key and the value to count under (the request's value, or a shared wildcard pattern).
pub fn counter_key<'a>(
    out: &mut String,
    prefix: &str,
    domain: &str,
    entries: impl IntoIterator<Item = (&'a str, &'a str)>,
) {
    out.clear();
    out.push_str(prefix);
    push_descriptor(out, domain, entries);
}

/// Appends `domain_` then `key_value_` for each entry: the descriptor part of every key.
fn push_descriptor<'a>(
    out: &mut String,
    domain: &str,
    entries: impl IntoIterator<Item = (&'a str, &'a str)>,
) {
    out.push_str(domain);
    out.push('_');
    for (key, value) in entries {
        out.push_str(key);
        out.push('_');
        out.push_str(value);
        out.push('_');
    }
}

/// Builds the key of one limit of a descriptor into `out`. Fixed windows keep the reference layout (the
/// first limit of a rule exactly, further ones with a `#<index>_` marker) and get the window start
/// appended by the store. The other algorithms keep their state under one key whose hash tag is the
/// descriptor, so all limits of a descriptor share a Cluster slot:
/// `<prefix>{<domain>_<key>_<value>_...}:<algorithm>:<window seconds>:<index>`.
pub fn limit_key<'a>(
    out: &mut String,
    prefix: &str,
    domain: &str,
    entries: impl IntoIterator<Item = (&'a str, &'a str)>,
    algorithm: Algorithm,
    window_secs: u64,
    index: usize,
) {
    use std::fmt::Write;
    if algorithm == Algorithm::FixedWindow {
        counter_key(out, prefix, domain, entries);
        if index > 0 {
            let _ = write!(out, "#{index}_");
        }
        return;
    }
    out.clear();
    out.push_str(prefix);
    out.push('{');
    push_descriptor(out, domain, entries);
    let _ = write!(out, "}}:{}:{window_secs}:{index}", algorithm.name());
}

/// Appends the window start to a key built by [`counter_key`].
pub fn with_window(key: &str, window_start: u64) -> String {
    format!("{key}{window_start}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_match_the_reference_layout() {
        let mut k = String::new();
        counter_key(&mut k, "", "domain", [("key", "value")]);
        assert_eq!(with_window(&k, 1234), "domain_key_value_1234");
        counter_key(
            &mut k,
            "",
            "domain",
            [("key2", "value2"), ("subkey2", "subvalue2")],
        );
        assert_eq!(
            with_window(&k, 1200),
            "domain_key2_value2_subkey2_subvalue2_1200"
        );
        counter_key(&mut k, "prefix:", "domain", [("key", "value")]);
        assert_eq!(with_window(&k, 1234), "prefix:domain_key_value_1234");
    }

    #[test]
    fn other_algorithms_keep_one_key_tagged_by_descriptor() {
        let mut k = String::new();
        limit_key(
            &mut k,
            "p:",
            "d",
            [("ip", "1.2.3.4")],
            Algorithm::TokenBucket,
            60,
            0,
        );
        assert_eq!(k, "p:{d_ip_1.2.3.4_}:token_bucket:60:0");
        limit_key(
            &mut k,
            "",
            "d",
            [("ip", "1.2.3.4")],
            Algorithm::FixedWindow,
            86_400,
            1,
        );
        assert_eq!(with_window(&k, 86_400), "d_ip_1.2.3.4_#1_86400");
    }
}
