//! Signal handling, in one place for every long-running command: SIGTERM,
//! SIGINT (Ctrl-C) and SIGHUP (the terminal went away) all mean "stop in
//! order".

/// The stop signals, caught from the moment this is created: the handlers
/// stay installed, so a second signal during an orderly stop is not lost or
/// fatal either.
pub struct Stop {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Stop {
    pub fn new() -> std::io::Result<Stop> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Stop {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            hup: signal(SignalKind::hangup())?,
        })
    }

    pub async fn wait(&mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
            _ = self.hup.recv() => {}
        }
    }
}

/// Resolves on the first stop signal; if the handlers cannot be installed,
/// on Ctrl-C alone.
pub async fn stop_signal() {
    match Stop::new() {
        Ok(mut stop) => stop.wait().await,
        Err(e) => {
            tracing::warn!(error = %e, "cannot install signal handlers; stopping on Ctrl-C only");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
