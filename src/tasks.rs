//! Where work spawned on a request's path runs: on the runtime that built
//! the engine, not on the serving thread the request arrived on.
//!
//! gRPC is served on threads with runtimes of their own
//! ([`crate::grpc::threads`]), and a runtime drops its tasks when its
//! thread ends. A Redis call past its budget, or a batch in flight, must
//! outlive the connection and the serving thread that started it: the
//! engine's last round waits for late calls and folds them in before its
//! final replay. So engines remember their home runtime and spawn there.

use std::future::Future;

use tokio::runtime::Handle;
use tokio::task::JoinHandle;

/// The runtime a component was built on (or, built outside one, whichever
/// runtime spawns).
#[derive(Clone, Debug)]
pub struct Home(Option<Handle>);

impl Home {
    /// The runtime of the caller, if it runs on one.
    pub fn here() -> Self {
        Home(Handle::try_current().ok())
    }

    pub fn spawn<F>(&self, future: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        match &self.0 {
            Some(handle) => handle.spawn(future),
            None => tokio::spawn(future),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The case it exists for: work spawned from a serving thread's
    /// runtime that ends before the work does still finishes.
    #[test]
    fn work_spawned_from_a_runtime_that_ends_finishes_at_home() {
        let home_rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let home = home_rt.block_on(async { Home::here() });
        let (tx, rx) = std::sync::mpsc::channel();
        let plain_tx = tx.clone();
        std::thread::spawn(move || {
            let serving = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            serving.block_on(async {
                drop(home.spawn(async move {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let _ = tx.send("done");
                }));
                // And a plain spawn, for contrast: dropped with its runtime.
                drop(tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    let _ = plain_tx.send("plain");
                }));
            });
            drop(serving);
        })
        .join()
        .unwrap();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok("done"));
        assert!(rx.recv_timeout(Duration::from_millis(100)).is_err());
    }
}
