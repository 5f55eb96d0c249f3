//! Serving a router on a listener within bounds: HTTP/1.1 only, every
//! accepted socket with TCP_NODELAY, at most `max_connections` open at once
//! (a connection past the limit is closed at once, so the ones being served
//! keep their share), and a header-read timeout that also ends idle
//! keep-alive connections, so a client that trickles a request or holds a
//! connection open cannot keep a file descriptor and its buffers forever.
//! On the stop signal it stops accepting and lets open requests finish.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

/// The bounds of one HTTP listener.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Most connections open at once.
    pub max_connections: usize,
    /// How long a request's headers may take to arrive, counted from when
    /// the connection starts waiting for them (so also the idle limit of a
    /// keep-alive connection).
    pub header_timeout: Duration,
}

/// Serves `router` until `stop` turns true, then waits for the connections
/// still answering a request (the caller bounds that wait).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    mut stop: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|s| *s) => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, or a connection reset before it
                // was accepted: back off briefly rather than spin.
                tracing::debug!(error = %e, "HTTP accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::debug!(
                max = limits.max_connections,
                "HTTP connection limit reached; closing a new connection"
            );
            drop(stream);
            continue;
        };
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY on an HTTP connection");
        }
        let service = TowerToHyperService::new(router.clone());
        let connection = builder.serve_connection(TokioIo::new(stream), service);
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "HTTP connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}
