//! The gRPC serving threads: one accept loop hands each new connection, in
//! turn, to one of `grpc_threads` threads, and that thread serves it to the
//! end on a single-threaded runtime of its own (the model of Envoy's and
//! nginx's workers).
//!
//! Why not the shared work-stealing runtime: a unary call is a few
//! microseconds of work split over three tasks (the connection, the
//! stream, the engine call). Spread over worker threads, every hand-off is
//! a cross-thread wake (a futex, often a context switch), and measured on
//! two cores that cost a quarter of the CPU per call and most of the p99:
//! the tail came from threads waking each other, not from deciding. On a
//! thread of its own a connection's tasks wake each other without a
//! syscall. The engine's background work (Redis clients, replay, sweeps)
//! stays on the main runtime; see [`crate::tasks`]. When that runtime is
//! single-threaded (small machines), it serves the first share of the
//! connections itself, so their calls to Redis never change threads.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use futures::StreamExt as _;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::server::Router;

use super::tls::{Handshakes, Reloading};

/// How many serving threads `grpc_threads = 0` means: one per CPU this
/// process may run on.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// Serves `router` on `threads` threads (at least one) for connections
/// accepted on `listener` until `stop`, over TLS when `tls` is set. The
/// handle ends when every thread has drained, with the first error; a
/// thread that cannot start is an error at once.
///
/// Called on a single-threaded runtime, that runtime's thread is the first
/// of the `threads`: its share of the connections is served by a task
/// there, beside the Redis connections and batches the engine keeps on
/// that runtime. A decision on one of those connections is then queued,
/// sent, answered and replied to without a wake across threads (measured
/// on two cores: 10% more Redis-path decisions per second, 13% less CPU
/// each, 40% fewer context switches).
pub fn serve(
    listener: TcpListener,
    threads: usize,
    tls: Option<Arc<Reloading>>,
    router: Router,
    stop: watch::Receiver<bool>,
) -> std::io::Result<JoinHandle<anyhow::Result<()>>> {
    let threads = threads.max(1);
    let handshakes = Handshakes::new();
    let mut queues = Vec::with_capacity(threads);
    let mut ends = Vec::with_capacity(threads);
    let share_this_thread = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread);
    for i in 0..threads {
        let (tx, rx) = mpsc::unbounded_channel::<std::net::TcpStream>();
        let (done_tx, done_rx) = oneshot::channel();
        // Not started until polled, here or on a thread of its own.
        let share = serve_thread(
            rx,
            router.clone(),
            tls.clone(),
            handshakes.clone(),
            stop.clone(),
        );
        if i == 0 && share_this_thread {
            tokio::spawn(async move {
                let _ = done_tx.send(share.await);
            });
        } else {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            std::thread::Builder::new()
                // Linux keeps 15 bytes of a thread name: short enough to show
                // whole in `top -H` and `perf`.
                .name(format!("lh-grpc-{i}"))
                .spawn(move || {
                    let _ = done_tx.send(runtime.block_on(share));
                })?;
        }
        queues.push(tx);
        ends.push(done_rx);
    }
    let acceptor = tokio::spawn(accept(listener, queues, stop));
    Ok(tokio::spawn(async move {
        let mut ends: futures::stream::FuturesUnordered<_> = ends.into_iter().collect();
        while let Some(end) = ends.next().await {
            match end {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(anyhow::anyhow!("gRPC serving thread: {e}")),
                Err(_) => anyhow::bail!("a gRPC serving thread ended without a word (panicked)"),
            }
        }
        acceptor.abort();
        Ok(())
    }))
}

/// Accepts until `stop`, handing the connections out in turn. A socket
/// leaves this runtime's reactor here and joins its thread's there.
async fn accept(
    listener: TcpListener,
    queues: Vec<mpsc::UnboundedSender<std::net::TcpStream>>,
    mut stop: watch::Receiver<bool>,
) {
    let next = AtomicUsize::new(0);
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.wait_for(|s| *s) => return,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, say: wait rather than spin.
                tracing::debug!(error = %e, "gRPC accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        super::socket_options(&stream);
        let std_stream = match stream.into_std() {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(error = %e, "cannot hand a gRPC connection to its thread");
                continue;
            }
        };
        let i = next.fetch_add(1, Ordering::Relaxed) % queues.len();
        // A thread whose queue is closed has stopped; its error reaches the
        // caller through its end.
        let _ = queues[i].send(std_stream);
    }
}

/// One thread's server: its connections, over TLS when set, until `stop`,
/// then drained.
async fn serve_thread(
    rx: mpsc::UnboundedReceiver<std::net::TcpStream>,
    router: Router,
    tls: Option<Arc<Reloading>>,
    handshakes: Handshakes,
    stop: watch::Receiver<bool>,
) -> Result<(), String> {
    let conns = UnboundedReceiverStream::new(rx).filter_map(|s| async move {
        match TcpStream::from_std(s) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::debug!(error = %e, "cannot serve a gRPC connection on its thread");
                None
            }
        }
    });
    let mut signal_rx = stop.clone();
    let signal = async move {
        let _ = signal_rx.wait_for(|s| *s).await;
    };
    let result = match tls {
        None => {
            router
                .serve_with_incoming_shutdown(conns.map(Ok::<_, std::io::Error>), signal)
                .await
        }
        Some(tls) => {
            let incoming = super::tls::incoming(Box::pin(conns), tls, handshakes, stop);
            router.serve_with_incoming_shutdown(incoming, signal).await
        }
    };
    result.map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    /// Serves six connections over three shares and checks each is
    /// answered, that the threads started are `spawned` (under names `top
    /// -H` shows whole), and that the stop signal drains every share.
    async fn six_connections_over_three_shares(spawned: &[usize]) {
        let (_reporter, health) = tonic_health::server::health_reporter();
        let router = tonic::transport::Server::builder().add_service(health);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop_tx, stop) = watch::channel(false);
        let served = serve(listener, 3, None, router, stop).unwrap();

        let mut clients = Vec::new();
        for _ in 0..6 {
            let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
                .unwrap()
                .connect()
                .await
                .unwrap();
            let mut client = HealthClient::new(channel);
            // A share that is never served would leave its calls hanging.
            let reply = tokio::time::timeout(
                std::time::Duration::from_secs(10),
                client.check(HealthCheckRequest::default()),
            )
            .await
            .expect("every share answers")
            .unwrap()
            .into_inner();
            assert_eq!(reply.status, 1, "SERVING");
            clients.push(client);
        }
        let names: HashSet<String> = spawned.iter().map(|i| format!("lh-grpc-{i}")).collect();
        let running: HashSet<String> = std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .map(|c| c.trim().to_string())
            .filter(|c| c.starts_with("lh-grpc-"))
            .collect();
        assert_eq!(running, names);

        drop(clients);
        stop_tx.send(true).unwrap();
        let ended = tokio::time::timeout(std::time::Duration::from_secs(10), served)
            .await
            .expect("every share drains")
            .unwrap();
        assert!(ended.is_ok(), "{ended:?}");
    }

    /// From a work-stealing runtime, every share gets a thread of its own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connections_are_handed_out_in_turn_and_all_threads_drain() {
        six_connections_over_three_shares(&[0, 1, 2]).await;
    }

    /// From a single-threaded runtime, that thread serves the first share:
    /// two threads start, and the connections handed to the first share
    /// are answered all the same.
    #[tokio::test(flavor = "current_thread")]
    async fn a_single_threaded_caller_serves_the_first_share_itself() {
        six_connections_over_three_shares(&[1, 2]).await;
    }
}
