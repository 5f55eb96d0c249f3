//! TLS to Redis (`rediss://`) with a CA of the operator's choosing
//! (`redis_tls_ca`; otherwise the system's roots, fred's default) and a
//! client certificate for mutual TLS (`redis_tls_cert`, `redis_tls_key`).
//! The server's certificate must name the host of the URL (a DNS name or
//! an IP address).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The PEM files for TLS to Redis.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RedisTls {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

fn named(setting: &str, path: &Path, e: impl std::fmt::Display) -> String {
    format!("{setting} {}: {e}", path.display())
}

fn certs(setting: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs: Vec<_> = CertificateDer::pem_file_iter(path)
        .map_err(|e| named(setting, path, e))?
        .collect::<Result<_, _>>()
        .map_err(|e| named(setting, path, e))?;
    if certs.is_empty() {
        return Err(named(setting, path, "no certificate in the file"));
    }
    Ok(certs)
}

impl RedisTls {
    /// True when nothing is set (fred's own TLS defaults apply).
    pub fn is_default(&self) -> bool {
        self == &RedisTls::default()
    }

    /// A rustls client configuration; errors name the setting and the file.
    pub fn client_config(&self) -> Result<rustls::ClientConfig, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        match &self.ca {
            Some(ca) => {
                for cert in certs("redis_tls_ca", ca)? {
                    roots.add(cert).map_err(|e| named("redis_tls_ca", ca, e))?;
                }
            }
            None => {
                let found = rustls_native_certs::load_native_certs();
                for cert in found.certs {
                    // A system root rustls cannot parse is skipped.
                    let _ = roots.add(cert);
                }
            }
        }
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS: {e}"))?
            .with_root_certificates(roots);
        match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                let chain = certs("redis_tls_cert", cert)?;
                let key_der = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| named("redis_tls_key", key, e))?;
                builder
                    .with_client_auth_cert(chain, key_der)
                    .map_err(|e| named("redis_tls_key", key, e))
            }
            _ => Ok(builder.with_no_client_auth()),
        }
    }
}
