//! The counter key schema, in one place.
//!
//! Fixed-window keys keep the reference service's layout so that both can share one Redis:
//! `CACHE_KEY_PREFIX + domain + "_" + (key + "_" + value + "_")... + window_start`. The stores append the
//! window start; this module builds the rest. That layout joins its parts with a bare `_`, so it is
//! ambiguous exactly as the reference's is (`user=u_path_/login` and `user=u, path=/login` share a
//! counter); it stays so because a fleet moving from the reference service counts in the same keys.
//!
//! Every other algorithm keeps its state under
//! `<prefix>{<domain>_<key>_<value>_...}:<algorithm>:<window seconds>:<index>`, where the domain, every
//! key and every value are escaped: `%`, `_`, `{` and `}` are written `%25`, `%5F`, `%7B` and `%7D`. A bare
//! `_` then only ever separates parts, so two different descriptors never share a key, and no part can
//! open or close the hash tag, which is therefore always the whole descriptor: all limits of one
//! descriptor (and nothing else by accident) share a Cluster slot. Parts without those characters read
//! as written (`{edge_path_/login_}`).
//!
//! The rate limit quota service keeps each bucket's shares under the same hash tag, with `:rlqs` after
//! it (`{edge_path_/login_}:rlqs`).

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
    push_descriptor(out, domain, entries, |out, part| out.push_str(part));
}

/// Appends `domain_` then `key_value_` for each entry, each part written by `push`: the descriptor part
/// of every key.
fn push_descriptor<'a>(
    out: &mut String,
    domain: &str,
    entries: impl IntoIterator<Item = (&'a str, &'a str)>,
    push: impl Fn(&mut String, &str),
) {
    push(out, domain);
    out.push('_');
    for (key, value) in entries {
        push(out, key);
        out.push('_');
        push(out, value);
        out.push('_');
    }
}

/// Characters of a descriptor part that the escaped layout writes as `%XX`: the separator, the hash-tag
/// braces, and the escape character itself.
fn needs_escape(c: char) -> bool {
    matches!(c, '%' | '_' | '{' | '}')
}

/// Appends `part` with [`needs_escape`] characters written as `%XX`.
fn push_escaped(out: &mut String, part: &str) {
    // Most parts (addresses, paths, hashes) have nothing to escape: copy them whole.
    let Some(first) = part.find(needs_escape) else {
        out.push_str(part);
        return;
    };
    out.push_str(&part[..first]);
    for c in part[first..].chars() {
        match c {
            '%' => out.push_str("%25"),
            '_' => out.push_str("%5F"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            c => out.push(c),
        }
    }
}

/// The `index` of a limit that is no rule's (an operator's runtime limit whose algorithm and window no
/// limit of the descriptor's rule has): a fixed window's key then carries its window's length
/// (`#<seconds>s_`), since the reference layout's key does not, and windows that start together (a
/// second's and two seconds', an hour's and a day's at midnight) would share one counter, each
/// expiring it at its own end. The other algorithms' keys carry the window already; they take index 0.
pub const OWN_WINDOW: usize = usize::MAX;

/// Builds the key of one limit of a descriptor into `out`. Fixed windows keep the reference layout (the
/// first limit of a rule exactly, further ones with a `#<index>_` marker, see [`OWN_WINDOW`] for
/// others) and get the window start appended by the store. The other algorithms keep their state under
/// one key whose hash tag is the escaped descriptor, so all limits of a descriptor share a Cluster slot:
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
        match index {
            0 => {}
            OWN_WINDOW => {
                let _ = write!(out, "#{window_secs}s_");
            }
            index => {
                let _ = write!(out, "#{index}_");
            }
        }
        return;
    }
    let index = if index == OWN_WINDOW { 0 } else { index };
    out.clear();
    out.push_str(prefix);
    out.push('{');
    push_descriptor(out, domain, entries, push_escaped);
    let _ = write!(out, "}}:{}:{window_secs}:{index}", algorithm.name());
}

/// Builds the key of a rate limit quota bucket's shares into `out`: the descriptor the bucket matched,
/// escaped and hash-tagged as the counters of the other algorithms are (so they share its Cluster slot),
/// then `:rlqs`: `<prefix>{<domain>_<key>_<value>_...}:rlqs`.
pub fn bucket_key<'a>(
    out: &mut String,
    prefix: &str,
    domain: &str,
    entries: impl IntoIterator<Item = (&'a str, &'a str)>,
) {
    out.clear();
    out.push_str(prefix);
    out.push('{');
    push_descriptor(out, domain, entries, push_escaped);
    out.push_str("}:rlqs");
}

/// Appends the window start to a key built by [`counter_key`].
pub fn with_window(key: &str, window_start: u64) -> String {
    let mut digits = itoa::Buffer::new();
    let digits = digits.format(window_start);
    let mut out = String::with_capacity(key.len() + digits.len());
    out.push_str(key);
    out.push_str(digits);
    out
}

/// Writes [`with_window`]'s key at the end of `out` (the Redis store writes a request's keys into
/// one buffer this way, several per request: without the formatting machinery of `write!`).
pub fn push_with_window(out: &mut bytes::BytesMut, key: &str, window_start: u64) {
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(itoa::Buffer::new().format(window_start).as_bytes());
}

/// The name of the mark an operator's reset leaves beside a counter that quota leases may hold hits
/// of (see `decide.lua`, which builds the same name): in the counter's Cluster slot, so one script call
/// reads both, and starting with the counter's key, so with `CACHE_KEY_PREFIX` (an ACL user limited to
/// `~<prefix>*` may write it). A key with a hash tag keeps it (`<key>:reset`); one without gets itself
/// as the tag (`<key>{<key>}:reset`). `None` for a key without a tag that holds a `{` or a `}`, which
/// no such name shares a slot with for certain: its counter is not leased.
pub fn reset_mark(key: &[u8]) -> Option<Vec<u8>> {
    let tagged = mark_form(key)?;
    let mut mark = Vec::with_capacity(key.len() * 2 + 8);
    mark.extend_from_slice(key);
    if !tagged {
        mark.push(b'{');
        mark.extend_from_slice(key);
        mark.push(b'}');
    }
    mark.extend_from_slice(b":reset");
    Some(mark)
}

/// Whether `key` can have a [`reset_mark`], without building it (asked for every leasable check).
pub fn has_reset_mark(key: &[u8]) -> bool {
    mark_form(key).is_some()
}

/// How a key's reset mark is named: `Some(true)` it keeps the key's hash tag, `Some(false)` it makes
/// the key the tag, `None` it has none.
fn mark_form(key: &[u8]) -> Option<bool> {
    let tagged = key.iter().position(|&b| b == b'{').is_some_and(|open| {
        key[open + 1..]
            .iter()
            .position(|&b| b == b'}')
            .is_some_and(|len| len > 0)
    });
    if tagged {
        Some(true)
    } else if key.is_empty() || key.iter().any(|&b| b == b'{' || b == b'}') {
        None
    } else {
        Some(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_reset_mark_shares_its_counters_cluster_slot() {
        let slot = |k: &[u8]| fred::util::redis_keyslot(k);
        for key in [
            &b"edge_user_alice_1733000000"[..],
            b"{edge_path_/login_}:sliding_window:60:0",
            b"edge_path_/a/{id}_1733000000",
        ] {
            assert!(has_reset_mark(key));
            let mark = reset_mark(key).expect("a mark");
            assert_eq!(slot(&mark), slot(key), "{}", String::from_utf8_lossy(key));
            assert!(mark.starts_with(key) && mark.ends_with(b":reset"));
        }
        // Redis hashes these whole (an empty tag does not count), and no longer name shares their slot
        // for certain.
        for key in [
            &b"edge_path_/a}_60"[..],
            b"edge_path_/a/{}/{id}_60",
            b"p{}q",
        ] {
            assert_eq!(reset_mark(key), None);
            assert!(!has_reset_mark(key));
        }
    }

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
        assert_eq!(
            k, "p:{d_ip_1.2.3.4_}:token_bucket:60:0",
            "nothing to escape"
        );
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
        limit_key(
            &mut k,
            "",
            "d",
            [("ip", "1.2.3.4")],
            Algorithm::FixedWindow,
            86_400,
            OWN_WINDOW,
        );
        assert_eq!(with_window(&k, 86_400), "d_ip_1.2.3.4_#86400s_86400");
        limit_key(
            &mut k,
            "p:",
            "d",
            [("ip", "1.2.3.4")],
            Algorithm::Gcra,
            60,
            OWN_WINDOW,
        );
        assert_eq!(k, "p:{d_ip_1.2.3.4_}:gcra:60:0");
    }

    /// The escaped key of one limit (token bucket, 60 s, index 0) of a descriptor.
    fn escaped(domain: &str, entries: &[(String, String)]) -> String {
        let mut k = String::new();
        limit_key(
            &mut k,
            "p:",
            domain,
            entries.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            Algorithm::TokenBucket,
            60,
            0,
        );
        k
    }

    fn owned(entries: &[(&str, &str)]) -> Vec<(String, String)> {
        entries
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn escaped_keys_tell_apart_what_the_reference_layout_joins() {
        let joined = escaped("d", &owned(&[("user", "u_path_/login")]));
        let apart = escaped("d", &owned(&[("user", "u"), ("path", "/login")]));
        assert_ne!(joined, apart);
        assert_eq!(joined, "p:{d_user_u%5Fpath%5F/login_}:token_bucket:60:0");
        assert_eq!(apart, "p:{d_user_u_path_/login_}:token_bucket:60:0");
        assert_eq!(
            escaped("my_d", &owned(&[("api_key", "{x}%_:\\")])),
            "p:{my%5Fd_api%5Fkey_%7Bx%7D%25%5F:\\_}:token_bucket:60:0"
        );
        // The reference layout keeps its ambiguity, for fleets sharing Redis with the reference service.
        let (mut a, mut b) = (String::new(), String::new());
        counter_key(&mut a, "", "d", [("user", "u_path_/login")]);
        counter_key(&mut b, "", "d", [("user", "u"), ("path", "/login")]);
        assert_eq!(a, b);
    }

    /// The hash tag Redis Cluster hashes: between the first `{` and the first `}` after it.
    fn hash_tag(key: &str) -> &str {
        let open = key.find('{').expect("a hash tag");
        let close = key[open..].find('}').expect("a closed hash tag") + open;
        &key[open + 1..close]
    }

    type Descriptor = (String, Vec<(String, String)>);

    fn part() -> impl Strategy<Value = String> {
        // The characters that matter to the layout (escapes written out included), and one that does not.
        proptest::string::string_regex("[_%5F{}:\\\\a]{0,5}").expect("a valid pattern")
    }

    fn descriptor() -> impl Strategy<Value = Descriptor> {
        (part(), prop::collection::vec((part(), part()), 0..4))
    }

    /// A descriptor and another cut from the same text at other `_`s: the pairs the reference layout
    /// cannot tell apart.
    fn same_joined_text() -> impl Strategy<Value = (Descriptor, Descriptor)> {
        descriptor()
            .prop_flat_map(|a| {
                let mut joined = a.0.clone();
                for (k, v) in &a.1 {
                    joined.push('_');
                    joined.push_str(k);
                    joined.push('_');
                    joined.push_str(v);
                }
                let cuts: Vec<usize> = joined.match_indices('_').map(|(at, _)| at).collect();
                let n = cuts.len();
                (
                    Just(a),
                    Just(joined),
                    prop::sample::subsequence(cuts, 0..=n),
                )
            })
            .prop_map(|(a, joined, mut cuts)| {
                // A domain, then key and value pairs: an even number of cuts.
                if cuts.len() % 2 == 1 {
                    cuts.pop();
                }
                let mut parts = Vec::with_capacity(cuts.len() + 1);
                let mut from = 0;
                for at in cuts {
                    parts.push(joined[from..at].to_owned());
                    from = at + 1;
                }
                parts.push(joined[from..].to_owned());
                let domain = parts.remove(0);
                let entries = parts
                    .chunks(2)
                    .map(|kv| (kv[0].clone(), kv[1].clone()))
                    .collect();
                (a, (domain, entries))
            })
    }

    /// The descriptor of a key built by [`escaped`], or `None` when the key is not of that shape.
    fn read_back(key: &str) -> Option<Descriptor> {
        let inner = key
            .strip_prefix("p:{")?
            .strip_suffix("}:token_bucket:60:0")?;
        let mut parts = Vec::new();
        for part in inner.strip_suffix('_')?.split('_') {
            let mut text = String::new();
            let mut rest = part;
            while let Some(at) = rest.find('%') {
                text.push_str(&rest[..at]);
                text.push(match rest.get(at..at + 3)? {
                    "%25" => '%',
                    "%5F" => '_',
                    "%7B" => '{',
                    "%7D" => '}',
                    _ => return None,
                });
                rest = &rest[at + 3..];
            }
            text.push_str(rest);
            parts.push(text);
        }
        let domain = parts.remove(0);
        if parts.len() % 2 == 1 {
            return None;
        }
        let entries = parts
            .chunks(2)
            .map(|kv| (kv[0].clone(), kv[1].clone()))
            .collect();
        Some((domain, entries))
    }

    proptest! {
        #[test]
        fn an_escaped_key_reads_back_as_its_descriptor(a in descriptor()) {
            // A key that can be read back into its descriptor is shared by no other descriptor.
            let key = escaped(&a.0, &a.1);
            prop_assert_eq!(read_back(&key), Some(a), "{}", key);
        }

        #[test]
        fn descriptors_the_reference_layout_joins_get_escaped_keys_apart((a, b) in same_joined_text()) {
            let reference = |d: &Descriptor| {
                let mut k = String::new();
                counter_key(&mut k, "", &d.0, d.1.iter().map(|(k, v)| (k.as_str(), v.as_str())));
                k
            };
            prop_assert_eq!(reference(&a), reference(&b));
            prop_assert_eq!(a == b, escaped(&a.0, &a.1) == escaped(&b.0, &b.1), "{:?} {:?}", a, b);
        }

        #[test]
        fn every_limit_of_a_descriptor_hashes_to_the_descriptors_slot(a in descriptor(), index in 0usize..3) {
            let entries = || a.1.iter().map(|(k, v)| (k.as_str(), v.as_str()));
            let mut keys = Vec::new();
            for (algorithm, window) in [(Algorithm::Gcra, 1), (Algorithm::SlidingLog, 86_400), (Algorithm::SlidingWindow, 60)] {
                let mut k = String::new();
                limit_key(&mut k, "p:", &a.0, entries(), algorithm, window, index);
                keys.push(k);
            }
            // The tag is the whole escaped descriptor: no part closed it early.
            let tag = hash_tag(&keys[0]).to_owned();
            let braces = &keys[0]["p:{".len()..keys[0].rfind('}').unwrap_or(0)];
            prop_assert_eq!(tag.as_str(), braces);
            for k in &keys {
                prop_assert_eq!(hash_tag(k), tag.as_str());
                prop_assert_eq!(
                    fred::util::redis_keyslot(k.as_bytes()),
                    fred::util::redis_keyslot(keys[0].as_bytes())
                );
            }
        }
    }
}
