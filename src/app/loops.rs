//! The server's own background loops, each ending on the stop signal: the
//! rules reloader (poll a fingerprint, load on change, swap atomically) and
//! the in-memory engine's expiry sweep.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::clock::{Clock, SystemClock};
use crate::decision::RulesHandle;
use crate::engine::{Engine, MemoryEngine};
use crate::metrics::Metrics;
use crate::rules::{self, ReloadStatus};
use crate::settings::Settings;

/// Polls the rules paths; a changed fingerprint triggers a full load. A good
/// load is swapped in atomically; a bad one keeps the old rules and is
/// recorded for /rules.
pub(super) async fn reload(
    settings: Settings,
    handle: RulesHandle,
    engine: Arc<dyn Engine>,
    status: Arc<ReloadStatus>,
    metrics: Arc<Metrics>,
    mut stop: watch::Receiver<bool>,
) {
    let mut seen = handle.load().hash.clone();
    let mut tick = tokio::time::interval(Duration::from_millis(settings.rules_poll_interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let paths = settings.rules.clone();
        let opts = settings.load_options();
        let fingerprint =
            match tokio::task::spawn_blocking(move || rules::fingerprint(&paths)).await {
                Ok(f) => f,
                Err(_) => continue,
            };
        if fingerprint == seen {
            continue;
        }
        seen = fingerprint;
        let paths = settings.rules.clone();
        let loaded = tokio::task::spawn_blocking(move || rules::load_paths(&paths, opts)).await;
        match loaded {
            Ok(Ok(set)) => {
                tracing::info!(hash = %set.hash, domains = set.domains.len(), "rules reloaded");
                seen = set.hash.clone();
                metrics.reload(true, &set.hash);
                handle.store(Arc::new(set));
                engine.rules_changed();
                status.successes.fetch_add(1, Ordering::Relaxed);
                status
                    .loaded_at_ms
                    .store(SystemClock.now_ms(), Ordering::Relaxed);
                *status.last_error.lock() = None;
            }
            Ok(Err(errors)) => {
                tracing::error!(errors = %errors, "rules reload failed; keeping the previous rules");
                status.failures.fetch_add(1, Ordering::Relaxed);
                metrics.reload(false, "");
                *status.last_error.lock() = Some(errors.to_string());
            }
            Err(e) => tracing::error!(error = %e, "rules reload task failed"),
        }
    }
}

pub(super) async fn sweep(
    memory: Arc<MemoryEngine>,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let now = memory.clock().now_ms();
        let mut removed = 0;
        // A shard at a time: this runs on a thread that also serves
        // connections, which would otherwise wait for every key's check.
        for i in 0..memory.shard_count() {
            removed += memory.sweep_shard(i, now);
            tokio::task::yield_now().await;
        }
        if removed > 0 {
            tracing::debug!(removed, "expired counters dropped");
        }
    }
}
