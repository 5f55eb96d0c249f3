//! The shutdown order: report NOT_SERVING (gRPC health and /readyz) so
//! balancers move away, wait `shutdown_delay_ms` for them to notice, stop
//! accepting and drain in-flight calls within `shutdown_grace_ms`, then stop
//! the background loops (membership leaves the member set) and close Redis.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinSet;
use tonic_health::ServingStatus;

use crate::http::Health;
use crate::redis::Redis;
use crate::settings::Settings;

use super::serve::Servers;

pub(super) async fn in_order(
    settings: &Settings,
    mut servers: Servers,
    health: &Health,
    stop: watch::Sender<bool>,
    mut tasks: JoinSet<()>,
    redis: Option<Arc<Redis>>,
) {
    tracing::info!("shutting down: reporting NOT_SERVING");
    health.set_draining();
    servers.report(ServingStatus::NotServing).await;
    tokio::time::sleep(Duration::from_millis(settings.shutdown_delay_ms)).await;
    let _ = stop.send(true);
    let grace = Duration::from_millis(settings.shutdown_grace_ms);
    let drained = tokio::time::timeout(grace, async {
        let _ = (&mut servers.grpc).await;
        let _ = (&mut servers.http).await;
        let _ = (&mut servers.admin).await;
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            grace_ms = settings.shutdown_grace_ms,
            "in-flight calls did not finish within the grace period"
        );
        servers.grpc.abort();
        servers.http.abort();
        servers.admin.abort();
    }
    // Background loops see the stop signal; membership leaves the member set.
    if tokio::time::timeout(Duration::from_secs(2), async {
        while tasks.join_next().await.is_some() {}
    })
    .await
    .is_err()
    {
        tasks.shutdown().await;
    }
    if let Some(redis) = redis {
        redis.quit().await;
    }
    tracing::info!("stopped");
}
