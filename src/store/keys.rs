//! The counter key schema, in one place.
//!
//! Fixed-window keys keep the reference service's layout so that both can share one Redis:
//! `CACHE_KEY_PREFIX + domain + "_" + (key + "_" + value + "_")... + window_start`. The stores append the
//! window start; this module builds the rest.

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
    out.push_str(domain);
    out.push('_');
    for (key, value) in entries {
        out.push_str(key);
        out.push('_');
        out.push_str(value);
        out.push('_');
    }
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
}
