//! TLS and mutual TLS on the gRPC port: the PEM files (`grpc_tls_cert`,
//! `grpc_tls_key`, and `grpc_tls_client_ca` to require and verify client
//! certificates), reloaded when they change without a restart, and the
//! stream of connections a serving thread hands tonic (their sockets got
//! TCP_NODELAY and keepalive when accepted, see [`super::threads`]).
//! Handshakes run in their own tasks with a timeout, so a client that
//! stalls one holds no one else up.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use futures::{Stream, StreamExt as _};
use parking_lot::Mutex;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use sha2::{Digest as _, Sha256};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch, Semaphore};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_stream::wrappers::ReceiverStream;

/// A handshake not finished in this long is abandoned.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most handshakes in progress at once; past it a new connection is closed.
const MAX_HANDSHAKES: usize = 1024;

/// The PEM files of the gRPC listener.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Set: clients must present a certificate signed by one of these.
    pub client_ca: Option<PathBuf>,
}

fn named(setting: &str, path: &Path, e: impl std::fmt::Display) -> String {
    format!("{setting} {}: {e}", path.display())
}

impl TlsFiles {
    /// A server configuration from the files; the error names the setting
    /// and the file.
    pub fn server_config(&self) -> Result<rustls::ServerConfig, String> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&self.cert)
            .map_err(|e| named("grpc_tls_cert", &self.cert, e))?
            .collect::<Result<_, _>>()
            .map_err(|e| named("grpc_tls_cert", &self.cert, e))?;
        if certs.is_empty() {
            return Err(named(
                "grpc_tls_cert",
                &self.cert,
                "no certificate in the file",
            ));
        }
        let key = PrivateKeyDer::from_pem_file(&self.key)
            .map_err(|e| named("grpc_tls_key", &self.key, e))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS: {e}"))?;
        let builder = match &self.client_ca {
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                let cas = CertificateDer::pem_file_iter(ca)
                    .map_err(|e| named("grpc_tls_client_ca", ca, e))?;
                for cert in cas {
                    let cert = cert.map_err(|e| named("grpc_tls_client_ca", ca, e))?;
                    roots
                        .add(cert)
                        .map_err(|e| named("grpc_tls_client_ca", ca, e))?;
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                        .build()
                        .map_err(|e| named("grpc_tls_client_ca", ca, e))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config = builder
            .with_single_cert(certs, key)
            .map_err(|e| named("grpc_tls_key", &self.key, e))?;
        // gRPC is HTTP/2 only.
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }

    /// A digest of the files' contents (a file that cannot be read hashes
    /// its error), to notice a change.
    fn fingerprint(&self) -> Vec<u8> {
        let mut h = Sha256::new();
        let paths = [Some(&self.cert), Some(&self.key), self.client_ca.as_ref()];
        for path in paths.into_iter().flatten() {
            match std::fs::read(path) {
                Ok(bytes) => h.update(&bytes),
                Err(e) => h.update(e.to_string().as_bytes()),
            }
            h.update([0]);
        }
        h.finalize().to_vec()
    }
}

/// The acceptor in use, replaced when the files change and still load.
pub struct Reloading {
    files: TlsFiles,
    acceptor: ArcSwap<TlsAcceptor>,
    seen: Mutex<Vec<u8>>,
}

impl Reloading {
    /// Loads the files; an error here stops startup.
    pub fn new(files: TlsFiles) -> Result<Arc<Reloading>, String> {
        let seen = files.fingerprint();
        let config = files.server_config()?;
        Ok(Arc::new(Reloading {
            files,
            acceptor: ArcSwap::from_pointee(TlsAcceptor::from(Arc::new(config))),
            seen: Mutex::new(seen),
        }))
    }

    pub fn requires_client_certs(&self) -> bool {
        self.files.client_ca.is_some()
    }

    /// Reloads when the files changed. A change that does not load (a key
    /// that does not match, a half-written file) keeps the previous
    /// certificates and is tried again on the next change.
    fn check(&self) {
        let now = self.files.fingerprint();
        if *self.seen.lock() == now {
            return;
        }
        *self.seen.lock() = now;
        match self.files.server_config() {
            Ok(config) => {
                self.acceptor
                    .store(Arc::new(TlsAcceptor::from(Arc::new(config))));
                tracing::info!(cert = %self.files.cert.display(), "gRPC TLS certificates reloaded");
            }
            Err(e) => {
                tracing::error!(error = %e, "gRPC TLS certificates changed but do not load; keeping the previous ones");
            }
        }
    }

    /// Checks the files every `every` until `stop`.
    pub async fn watch(self: Arc<Self>, every: Duration, mut stop: watch::Receiver<bool>) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.wait_for(|s| *s) => return,
            }
            let this = self.clone();
            let _ = tokio::task::spawn_blocking(move || this.check()).await;
        }
    }
}

/// The bound on handshakes in progress at once, shared by the serving
/// threads: past [`MAX_HANDSHAKES`] a new connection is closed.
#[derive(Clone)]
pub struct Handshakes(Arc<Semaphore>);

impl Handshakes {
    pub fn new() -> Self {
        Handshakes(Arc::new(Semaphore::new(MAX_HANDSHAKES)))
    }
}

/// The TLS connections made of `conns` (accepted sockets, their options
/// already set) until `stop`, each handshake in its own task under
/// [`HANDSHAKE_TIMEOUT`].
pub fn incoming(
    mut conns: Pin<Box<dyn Stream<Item = TcpStream> + Send>>,
    tls: Arc<Reloading>,
    handshakes: Handshakes,
    mut stop: watch::Receiver<bool>,
) -> ReceiverStream<std::io::Result<TlsStream<TcpStream>>> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let stream = tokio::select! {
                s = conns.next() => match s {
                    Some(s) => s,
                    None => return,
                },
                _ = stop.wait_for(|s| *s) => return,
            };
            let Ok(permit) = handshakes.0.clone().try_acquire_owned() else {
                tracing::debug!("too many TLS handshakes in progress; closing a new connection");
                continue;
            };
            let acceptor = tls.acceptor.load_full();
            let tx = tx.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(tls_stream)) => {
                        let _ = tx.send(Ok(tls_stream)).await;
                    }
                    Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!("TLS handshake timed out"),
                }
                drop(permit);
            });
        }
    });
    ReceiverStream::new(rx)
}
