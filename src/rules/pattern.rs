//! The value patterns a rule may be written with besides a plain value: `cidr:` networks matched against
//! client addresses, and `*` wildcards.

use std::net::IpAddr;

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

#[cfg(test)]
mod tests {
    use super::*;

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
