//! Certificates made for tests (rcgen): a CA, and leaves it signs for servers, clients, or both (as
//! Envoy Gateway's certgen makes one certificate that ratelimitd serves with and presents to the control
//! plane).
#![allow(dead_code)]

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, SanType,
};

/// A certificate authority that signs leaf certificates.
pub struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

/// A PEM certificate and key.
pub struct Leaf {
    pub cert: String,
    pub key: String,
}

impl Ca {
    pub fn new(name: &str) -> Self {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params.self_signed(&key).unwrap();
        Self { cert, key }
    }

    pub fn pem(&self) -> String {
        self.cert.pem()
    }

    /// The CA certificate in DER, for a rustls trust store.
    pub fn der(&self) -> rustls::pki_types::CertificateDer<'static> {
        self.cert.der().clone()
    }

    /// A leaf for these DNS names (and 127.0.0.1), for servers or for clients.
    pub fn leaf(&self, dns: &[&str], client: bool) -> Leaf {
        let usage = if client {
            ExtendedKeyUsagePurpose::ClientAuth
        } else {
            ExtendedKeyUsagePurpose::ServerAuth
        };
        self.leaf_for(dns, vec![usage])
    }

    /// A leaf for these DNS names (and 127.0.0.1) that serves and also authenticates as a client.
    pub fn leaf_for_both(&self, dns: &[&str]) -> Leaf {
        self.leaf_for(
            dns,
            vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        )
    }

    fn leaf_for(&self, dns: &[&str], usages: Vec<ExtendedKeyUsagePurpose>) -> Leaf {
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(dns.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        params
            .subject_alt_names
            .push(SanType::IpAddress(IpAddr::from([127, 0, 0, 1])));
        params.distinguished_name.push(DnType::CommonName, dns[0]);
        params.extended_key_usages = usages;
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        Leaf {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }
}

/// Writes `text` to `dir/name` and returns the path.
pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}
