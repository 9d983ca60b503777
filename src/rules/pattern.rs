//! The value patterns a rule may be written with besides a plain value: `cidr:` networks matched against
//! client addresses, and `*` wildcards.

use std::{collections::HashMap, net::IpAddr};

use aho_corasick::{AhoCorasick, MatchKind};

/// Rule values starting with this are networks matched against client addresses.
pub const CIDR_PREFIX: &str = "cidr:";

/// Why a `cidr:` value is not a network.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CidrError {
    #[error("'{0}' is not an IP address")]
    NotAnAddress(String),
    #[error("prefix '/{prefix}' must be 0 to {max}")]
    Prefix { prefix: String, max: u8 },
    #[error("host bits are set; the network is {network}/{prefix}")]
    HostBits { network: IpAddr, prefix: u8 },
}

/// An IPv4 or IPv6 network written `cidr:<address>/<prefix>` as a rule value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    network: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Parses `10.0.0.0/8`, `2001:db8::/32` or a bare address (a /32 or /128).
    pub fn parse(text: &str) -> Result<Self, CidrError> {
        let (addr, prefix) = match text.split_once('/') {
            Some((addr, prefix)) => (addr, Some(prefix)),
            None => (text, None),
        };
        let network: IpAddr = addr
            .trim()
            .parse()
            .map_err(|_| CidrError::NotAnAddress(addr.into()))?;
        let max = if network.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => p
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| CidrError::Prefix {
                    prefix: p.into(),
                    max,
                })?,
        };
        let cidr = Self { network, prefix };
        if cidr.mask(network) != network {
            return Err(CidrError::HostBits {
                network: cidr.mask(network),
                prefix,
            });
        }
        Ok(cidr)
    }

    /// The prefix length: how many leading bits the network fixes.
    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    fn mask(&self, addr: IpAddr) -> IpAddr {
        match addr {
            IpAddr::V4(a) => {
                let bits = u32::from(a);
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                IpAddr::V4((bits & mask).into())
            }
            IpAddr::V6(a) => {
                let bits = u128::from(a);
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                IpAddr::V6((bits & mask).into())
            }
        }
    }

    /// Whether the address lies in the network (IPv4-mapped IPv6 addresses count as IPv4).
    pub fn contains(&self, addr: IpAddr) -> bool {
        let addr = addr.to_canonical();
        addr.is_ipv4() == self.network.is_ipv4() && self.mask(addr) == self.network
    }
}

/// A value pattern with `*` standing for any run of characters (possibly empty), matched against a
/// request entry's value.
#[derive(Debug, Clone)]
pub struct Wildcard {
    pattern: Box<str>,
    /// The pattern split on `*`: the first part is a prefix, the last a suffix, the others must appear in
    /// order between them.
    parts: Box<[Box<str>]>,
}

impl Wildcard {
    /// The pattern of a rule value containing `*`.
    pub fn new(pattern: &str) -> Self {
        Self {
            pattern: pattern.into(),
            parts: pattern.split('*').map(Into::into).collect(),
        }
    }

    /// The value pattern as written.
    pub fn pattern(&self) -> &str {
        &self.pattern
    }

    /// The longest of the pattern's literal parts: any text it matches contains it.
    fn anchor(&self) -> &str {
        self.parts.iter().max_by_key(|p| p.len()).map_or("", |p| p)
    }

    /// Whether the whole of `text` fits the pattern.
    pub fn matches(&self, text: &str) -> bool {
        let parts = &self.parts;
        let (first, last) = (&parts[0], &parts[parts.len() - 1]);
        if parts.len() == 1 {
            return text == &**first;
        }
        if text.len() < first.len() + last.len()
            || !text.starts_with(&**first)
            || !text.ends_with(&**last)
        {
            return false;
        }
        let mut middle = &text[first.len()..text.len() - last.len()];
        for part in &parts[1..parts.len() - 1] {
            match middle.find(&**part) {
                Some(at) => middle = &middle[at + part.len()..],
                None => return false,
            }
        }
        true
    }
}

/// The wildcards of one level, indexed by the literal part each needs (its anchor), so that a value is
/// tried only against the patterns whose anchor it contains: one pass over the value, not one per
/// pattern. Built for levels of many wildcards; a few are tried one by one.
#[derive(Debug, Clone)]
pub struct WildcardIndex {
    anchors: AhoCorasick,
    /// For each anchor, the patterns that need it (their places in file order, ascending).
    patterns: Vec<Vec<u32>>,
    /// The first pattern, in file order, without any literal part (`*`): it matches every value.
    any: Option<u32>,
}

impl WildcardIndex {
    /// Fewer wildcards than this are tried one by one.
    pub const FROM: usize = 32;

    pub fn build<'a>(wildcards: impl ExactSizeIterator<Item = &'a Wildcard>) -> Option<Self> {
        if wildcards.len() < Self::FROM {
            return None;
        }
        let (mut texts, mut patterns, mut any) = (Vec::new(), Vec::<Vec<u32>>::new(), None);
        let mut at: HashMap<&str, usize> = HashMap::new();
        for (i, wildcard) in wildcards.enumerate() {
            let i = u32::try_from(i).ok()?;
            let anchor = wildcard.anchor();
            if anchor.is_empty() {
                any = any.or(Some(i));
                continue;
            }
            let slot = *at.entry(anchor).or_insert_with(|| {
                texts.push(anchor);
                patterns.push(Vec::new());
                texts.len() - 1
            });
            patterns[slot].push(i);
        }
        let anchors = AhoCorasick::builder()
            .match_kind(MatchKind::Standard)
            .build(&texts)
            .ok()?;
        Some(Self {
            anchors,
            patterns,
            any,
        })
    }

    /// The place, in file order, of the first of `wildcards` (the ones this index was built from) that
    /// matches `value`.
    pub fn first_match<T>(&self, wildcards: &[(Wildcard, T)], value: &str) -> Option<usize> {
        let mut best = self.any;
        // An anchor found again (it occurs more than once) has had its patterns tried.
        let mut tried = vec![0u64; 0];
        for found in self.anchors.find_overlapping_iter(value) {
            let anchor = found.pattern().as_usize();
            if tried.is_empty() {
                tried.resize(self.patterns.len().div_ceil(64), 0);
            }
            let (word, bit) = (anchor / 64, 1u64 << (anchor % 64));
            if tried[word] & bit != 0 {
                continue;
            }
            tried[word] |= bit;
            for &i in &self.patterns[anchor] {
                if best.is_some_and(|best| i >= best) {
                    break;
                }
                if wildcards[i as usize].0.matches(value) {
                    best = Some(i);
                    break;
                }
            }
        }
        best.map(|i| i as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_index_finds_the_first_matching_wildcard_in_file_order() {
        use rand::{rngs::SmallRng, Rng, SeedableRng};
        let mut rng = SmallRng::seed_from_u64(3);
        let word = |rng: &mut SmallRng, most: usize| -> String {
            (0..rng.random_range(0..=most))
                .map(|_| ['a', 'b', 'c', '*'][rng.random_range(0..4)])
                .collect()
        };
        for round in 0..200 {
            let wildcards: Vec<(Wildcard, ())> = (0..rng.random_range(32..80))
                .map(|_| {
                    let mut pattern = word(&mut rng, 6);
                    pattern.insert(rng.random_range(0..=pattern.len()), '*');
                    (Wildcard::new(&pattern), ())
                })
                .collect();
            let index = WildcardIndex::build(wildcards.iter().map(|(w, _)| w)).unwrap();
            for _ in 0..50 {
                let value: String = word(&mut rng, 12).replace('*', "");
                let plain = wildcards.iter().position(|(w, _)| w.matches(&value));
                assert_eq!(
                    index.first_match(&wildcards, &value),
                    plain,
                    "round {round}, {value:?} against {:?}",
                    wildcards
                        .iter()
                        .map(|(w, _)| w.pattern())
                        .collect::<Vec<_>>()
                );
            }
        }
        let few: Vec<Wildcard> = (0..WildcardIndex::FROM - 1)
            .map(|_| Wildcard::new("a*"))
            .collect();
        assert!(
            WildcardIndex::build(few.iter()).is_none(),
            "a few are tried one by one"
        );
    }

    #[test]
    fn wildcard_patterns_follow_the_reference_examples() {
        let cases = [
            ("foo*", "foo1", true),
            ("foo*", "foo", true),
            ("foo*", "fo", false),
            ("bar*b", "barab", true),
            ("bar*b", "bar123b", true),
            ("bar*b", "barb", true),
            ("bar*b", "bara", false),
            ("bar*b", "xbarb", false),
            ("foo*bar*baz", "foobarbaz", true),
            ("foo*bar*baz", "foo1bar2baz", true),
            ("foo*bar*baz", "foo123baz", false),
            ("a*a", "a", false),
            ("*", "", true),
            ("k_*", "k_", true),
        ];
        for (pattern, text, want) in cases {
            assert_eq!(
                Wildcard::new(pattern).matches(text),
                want,
                "{pattern} ~ {text}"
            );
        }
    }

    #[test]
    fn cidrs_parse_strictly_and_contain_v4_and_v6() {
        let net = Cidr::parse("10.0.0.0/8").unwrap();
        assert!(net.contains("10.200.1.2".parse().unwrap()));
        assert!(net.contains("::ffff:10.1.2.3".parse().unwrap()));
        assert!(!net.contains("11.0.0.1".parse().unwrap()));
        assert!(!net.contains("::1".parse().unwrap()));
        let v6 = Cidr::parse("2001:db8::/32").unwrap();
        assert!(v6.contains("2001:db8:1::5".parse().unwrap()));
        assert!(Cidr::parse("0.0.0.0/0")
            .unwrap()
            .contains("8.8.8.8".parse().unwrap()));
        assert_eq!(Cidr::parse("192.168.1.7").unwrap().prefix(), 32);
        for bad in ["10.0.0.0/33", "10.0.0/8", "10.1.0.0/8", "fe80::/129", "x/1"] {
            assert!(Cidr::parse(bad).is_err(), "{bad}");
        }
    }
}
