//! Building the engine from settings: the in-memory engine without a Redis
//! URL; with one, the Redis engine (connected without waiting, this replica
//! registered) wrapped in the resilient engine with its journal, and the
//! loops they need ([`RedisLoops`]), stopped in their own order.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::clock::{Clock, SystemClock};
use crate::engine::resilient::journal::Journal;
use crate::engine::resilient::FINAL_REPLAY_MS;
use crate::engine::{Engine, MemoryEngine, RedisEngine, ResilientEngine};
use crate::metrics::Metrics;
use crate::redis::membership::Membership;
use crate::redis::{Redis, RedisConfig};
use crate::settings::Settings;

use super::supervise::{supervised, Outcome};

/// The engine decisions go to, and the Redis connection to close last.
pub(super) struct Built {
    pub engine: Arc<dyn Engine>,
    pub redis: Option<Arc<Redis>>,
    /// The Redis engine's own loops, stopped after the servers drained.
    pub loops: Option<RedisLoops>,
}

/// The resilient engine's loop, its journal writer (with `journal_dir`)
/// and the membership heartbeat: the engine's last round (replay, journal)
/// runs after the servers have drained and before this replica leaves the
/// member set. All are supervised: a handle is taken once its task has
/// ended.
pub(super) struct RedisLoops {
    /// Stops the engine loop and the journal writer.
    engine_stop: watch::Sender<bool>,
    engine: Option<JoinHandle<Outcome>>,
    journal: Option<JoinHandle<Outcome>>,
    members_stop: watch::Sender<bool>,
    members: Option<JoinHandle<Outcome>>,
}

impl RedisLoops {
    /// Resolves when either loop ends (before the stop signal, a failure).
    pub async fn ended(&mut self) -> Outcome {
        let RedisLoops {
            engine,
            journal,
            members,
            ..
        } = self;
        tokio::select! {
            r = wait(engine) => r,
            r = wait(journal) => r,
            r = wait(members) => r,
        }
    }

    pub async fn stop(self) {
        let _ = self.engine_stop.send(true);
        let limit = Duration::from_millis(FINAL_REPLAY_MS + 2_000);
        if let Some(engine) = self.engine {
            if tokio::time::timeout(limit, engine).await.is_err() {
                tracing::warn!("the engine's last round did not finish in time");
            }
        }
        if let Some(journal) = self.journal {
            let _ = tokio::time::timeout(Duration::from_secs(2), journal).await;
        }
        let _ = self.members_stop.send(true);
        if let Some(members) = self.members {
            let _ = tokio::time::timeout(Duration::from_secs(2), members).await;
        }
    }
}

/// A supervised task's end; the slot is emptied so it is never awaited
/// twice. Pending forever for an empty slot.
async fn wait(slot: &mut Option<JoinHandle<Outcome>>) -> Outcome {
    let Some(handle) = slot.as_mut() else {
        return std::future::pending().await;
    };
    let result = handle.await;
    *slot = None;
    result.unwrap_or_else(|e| ("redis loop", Err(e.to_string())))
}

pub(super) async fn build(
    settings: &Settings,
    replica_id: &str,
    memory: Arc<MemoryEngine>,
    metrics: &Metrics,
) -> anyhow::Result<Built> {
    let Some(url) = &settings.redis_url else {
        return Ok(Built {
            engine: memory,
            redis: None,
            loops: None,
        });
    };
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let boot = format!("{:x}", clock.now_ms());
    let (redis_engine, redis) = redis_engine(settings, url, replica_id, boot).await?;
    let (members_stop, members_rx) = watch::channel(false);
    // Not supervised: it only reads, and nothing the replica serves
    // depends on it; it ends with the membership heartbeat's stop.
    tokio::spawn(watch_hz(
        redis.clone(),
        settings.redis_budget_max_ms,
        members_rx.clone(),
    ));
    let members = tokio::spawn(supervised(
        "membership heartbeat",
        redis_engine.membership().clone().run(members_rx),
    ));
    let journal = match &settings.journal_dir {
        Some(dir) => Some(
            Journal::open(dir, replica_id)
                .with_context(|| format!("journal_dir {}", dir.display()))?,
        ),
        None => None,
    };
    let resilient = Arc::new(ResilientEngine::new(
        redis_engine,
        clock,
        settings.resilient(),
        journal,
    ));
    resilient.set_redis_call_histogram(metrics.redis_call_histogram());
    let (engine_stop, engine_rx) = watch::channel(false);
    let journal = settings.journal_dir.is_some().then(|| {
        tokio::spawn(supervised(
            "journal writer",
            resilient.clone().run_journal(engine_rx.clone()),
        ))
    });
    let engine = tokio::spawn(supervised("engine loop", resilient.clone().run(engine_rx)));
    Ok(Built {
        engine: resilient,
        redis: Some(redis),
        loops: Some(RedisLoops {
            engine_stop,
            engine: Some(engine),
            journal,
            members_stop,
            members: Some(members),
        }),
    })
}

/// Connects to Redis without waiting for it, logs clearly whether it
/// answers, and registers this replica (a live duplicate id is fatal). The
/// caller runs the membership heartbeat (`engine.membership().run`).
/// How often a replica reads Redis's hz again: a Redis restarted with
/// another configuration, or one that did not answer at startup, is seen
/// within this.
const HZ_EVERY: Duration = Duration::from_secs(60);

/// Reads Redis's hz now and every [`HZ_EVERY`] until `stop` (for /status
/// and /metrics), and warns each time it reads one whose expiry cycle can
/// hold Redis longer than a call's budget: the cycle runs up to a quarter
/// of each 1000/hz ms period at once, and with many keys expiring (a
/// window's hashes, thousands a second) it does. Measured at the default
/// hz of 10: cycles of 14-22 ms, and every request in flight then denied;
/// at hz 100 none past 6 ms. It writes nothing, so shutdown need not wait
/// for it.
async fn watch_hz(redis: Arc<Redis>, budget_ms: u64, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(HZ_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut warned = None;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => break,
        }
        let Some(hz) = redis.configured_hz(Duration::from_secs(2)).await else {
            continue;
        };
        let cycle_ms = 250.0 / hz.max(1) as f64;
        if cycle_ms < budget_ms as f64 {
            warned = None;
        } else if warned != Some(hz) {
            warned = Some(hz);
            tracing::warn!(
                redis = %redis.display_url,
                hz,
                expiry_cycle_ms = cycle_ms,
                redis_budget_max_ms = budget_ms,
                "Redis's expiry cycle can run {cycle_ms} ms at once at hz {hz}, past the {budget_ms} ms \
                 budget: with many keys expiring, the requests in flight then are denied. Set hz 100 in \
                 Redis (a cycle then runs at most 2.5 ms)"
            );
        }
    }
}

pub async fn redis_engine(
    settings: &Settings,
    url: &str,
    replica_id: &str,
    boot: String,
) -> anyhow::Result<(Arc<RedisEngine>, Arc<Redis>)> {
    let redis = Arc::new(
        Redis::connect(&RedisConfig {
            url: url.to_owned(),
            pool_size: settings.redis_pool_size,
            deadline: Duration::from_millis(settings.redis_deadline_ms),
            reply_timeout: Duration::from_millis(settings.redis_reply_timeout_ms),
            tls: settings.redis_tls(),
        })
        .map_err(anyhow::Error::msg)?,
    );
    match redis.ping(Duration::from_secs(2)).await {
        Ok(()) => {
            tracing::info!(redis = %redis.display_url, "connected to Redis");
        }
        Err(e) => tracing::warn!(
            redis = %redis.display_url,
            error = %e,
            "Redis is not answering; serving anyway and reconnecting in the background"
        ),
    }
    let nonce = format!("{}-{boot}", std::process::id());
    let membership = Arc::new(Membership::new(
        redis.clone(),
        &settings.redis_prefix,
        replica_id.to_owned(),
        nonce,
        Duration::from_millis(settings.membership_heartbeat_ms),
        Duration::from_millis(settings.membership_ttl_ms),
        Duration::from_millis(settings.membership_holdback_ms),
    ));
    membership.register().await?;
    if let Some(index) = membership.index() {
        tracing::info!(replica_id, index, live = ?membership.state().live, "registered with Redis");
    }
    // Epochs fence out older calls, so a new incarnation's must exceed any
    // epoch a previous one wrote. Redis's clock, when it answered, does not
    // step back with this machine's.
    let redis_ms = membership.state().last_beat_ms.unwrap_or(0);
    let epoch_start = SystemClock.now_ms().max(redis_ms).saturating_mul(1_000);
    let engine = RedisEngine::new(
        redis.clone(),
        membership,
        settings.redis_prefix.clone(),
        settings.redis_expiry_margin_ms,
        boot,
        epoch_start,
    );
    Ok((Arc::new(engine), redis))
}
