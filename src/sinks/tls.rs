//! TLS towards a broker: the certificate files every sink reads, and the check of their pairing.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The PEM files of a TLS connection to the servers.
#[derive(Debug, Clone, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    /// PEM file of the CA that signed the servers' certificates; unset means the system roots.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate, for mutual TLS (with `key_file`).
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    /// PEM private key of `cert_file`.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
}

impl TlsFiles {
    /// What is wrong with the files' combination, if anything: a client certificate and its
    /// key go together.
    pub fn problem(&self) -> Option<String> {
        (self.cert_file.is_some() != self.key_file.is_some())
            .then(|| "cert_file and key_file go together".to_owned())
    }

    /// The client certificate and its key, when mutual TLS is set.
    pub fn client_pair(&self) -> Option<(&PathBuf, &PathBuf)> {
        self.cert_file.as_ref().zip(self.key_file.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_certificate_without_its_key_is_a_problem_and_a_pair_is_not() {
        let cert = TlsFiles {
            cert_file: Some("c.pem".into()),
            ..TlsFiles::default()
        };
        assert_eq!(
            cert.problem().as_deref(),
            Some("cert_file and key_file go together")
        );
        let pair = TlsFiles {
            key_file: Some("k.pem".into()),
            ..cert
        };
        assert_eq!(pair.problem(), None);
        assert!(pair.client_pair().is_some());
        assert_eq!(TlsFiles::default().problem(), None);
    }
}
