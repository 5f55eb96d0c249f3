//! The shutdown order: report NOT_SERVING (gRPC health and /readyz) so
//! balancers move away, wait `shutdown_delay_ms` for them to notice, stop
//! accepting and drain in-flight calls within `shutdown_grace_ms`, then the
//! engine's last round (a bounded replay of lease grants, a last journal
//! write: it covers the drain), then leave the member set, stop the other
//! loops and close Redis.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinSet;
use tonic_health::ServingStatus;

use crate::http::Health;
use crate::redis::Redis;
use crate::settings::Settings;

use super::engine::RedisLoops;
use super::serve::Servers;

/// What runs behind the servers, stopped after them.
pub(super) struct Background {
    /// Rules reload and the expiry sweep (they stop with the servers).
    pub tasks: JoinSet<super::supervise::Outcome>,
    pub redis_loops: Option<RedisLoops>,
    pub redis: Option<Arc<Redis>>,
}

pub(super) async fn in_order(
    settings: &Settings,
    mut servers: Servers,
    health: &Health,
    stop: watch::Sender<bool>,
    background: Background,
) {
    let Background {
        mut tasks,
        redis_loops,
        redis,
    } = background;
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
    if let Some(loops) = redis_loops {
        loops.stop().await;
    }
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
