//! The recovery loop: probe when tripped, replay local usage and repair
//! suspect keys, keep membership and the ledger current; the journal is
//! written by a task of its own (`journaling.rs`) beside it.
//! One [`ResilientEngine::tick`] does one round and says how long to wait
//! before the next, so unit tests drive trip → probe → replay → settle →
//! healthy with a manual clock and no sleeping; [`ResilientEngine::run`]
//! is that tick in a loop until stopped.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::breaker::BreakerState;
use super::ResilientEngine;

/// Ledger sweeps happen at most this often.
const SWEEP_EVERY_MS: u64 = 1_000;
/// The bound on the last replay attempt at shutdown.
pub const FINAL_REPLAY_MS: u64 = 1_000;

/// What the loop remembers between ticks.
#[derive(Debug, Default)]
pub struct Recovery {
    last_sweep_ms: u64,
    reregistrations: Option<u64>,
}

impl ResilientEngine {
    /// The background loop until `stop`.
    /// `stop` comes after the servers have drained, so the final round
    /// ([`Self::finish`]) covers every grant made while draining.
    pub async fn run(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let mut recovery = Recovery::default();
        loop {
            let delay = self.tick(&mut recovery).await;
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = self.wake.notified() => {}
                _ = self.late.notify.notified() => {}
                _ = stop.wait_for(|s| *s) => break,
            }
        }
        self.finish().await;
    }

    /// The last round before exit: one attempt, bounded by
    /// [`FINAL_REPLAY_MS`], to replay what the leases granted (probing first
    /// when tripped), then a last journal write, and one log line saying
    /// what neither saved.
    pub async fn finish(&self) {
        let attempt = async {
            // Calls past their budget may still answer: their counts must be
            // folded in before the last replay.
            while self.late.pending() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            self.absorb_late();
            if self.breaker_state() == BreakerState::Tripped {
                self.probe().await;
            }
            let state = self.breaker_state();
            if state != BreakerState::Tripped {
                self.ledger.rescan();
                self.replay_round(state).await;
            }
        };
        let _ = tokio::time::timeout(Duration::from_millis(FINAL_REPLAY_MS), attempt).await;
        self.absorb_late();
        if self.journal.is_some() {
            self.last_journal_write().await;
        }
        let (keys, hits, _) = self.ledger.pending();
        let dropped = self
            .ledger
            .dropped_usage
            .load(std::sync::atomic::Ordering::Relaxed);
        match (hits, &self.journal) {
            (0, _) => tracing::info!("stopping: every lease grant is in Redis"),
            (_, Some(j)) => tracing::warn!(
                hits,
                keys,
                journal = %j.path().display(),
                "stopping: lease grants not replayed to Redis; journaled for the next start"
            ),
            (_, None) => tracing::error!(
                hits,
                keys,
                "stopping: lease grants could not be saved (Redis did not take them and no journal_dir is set); they are lost"
            ),
        }
        if dropped > 0 {
            tracing::error!(
                hits = dropped,
                "stopping: usage the full ledger could not keep was lost"
            );
        }
    }

    /// One round of the loop; returns the delay before the next.
    pub async fn tick(&self, r: &mut Recovery) -> Duration {
        self.absorb_late();
        let now = self.clock.now_ms();
        let state = self.breaker_state();
        self.follow_membership(state, r);
        if now >= r.last_sweep_ms + SWEEP_EVERY_MS {
            r.last_sweep_ms = now;
            let redis_now = self.redis_now(now);
            let margin = self.cfg.expiry_margin_ms;
            each_shard(self.ledger.shard_count(), |i| {
                self.ledger.sweep_shard(i, redis_now, margin);
            })
            .await;
            each_shard(self.local.shard_count(), |i| {
                self.local.sweep_shard(i, redis_now);
            })
            .await;
            // The backstop for the healthy rounds' skipped scans.
            self.ledger.rescan();
        }
        match state {
            BreakerState::Tripped => self.probe().await,
            // Settling replays too, every round: its lease grants must reach
            // Redis while the replicas already back there decide on it. The
            // first round after the period is the final one, which returns
            // the breaker to healthy. Grants made after it are replayed by
            // the next rounds (within a loop tick); waiting for none at all
            // would never end under load, since settling decisions are lease
            // grants.
            BreakerState::Probing | BreakerState::Settling | BreakerState::Healthy => {
                self.replay_round(state).await
            }
        }
        self.next_delay()
    }

    fn next_delay(&self) -> Duration {
        let b = self.breaker.lock();
        let ms = match b.state() {
            BreakerState::Tripped => {
                let unit = (self.clock.now_ms() % 1_000) as f64 / 1_000.0;
                b.probe_delay_ms(unit)
            }
            BreakerState::Probing => 5,
            // Replay rounds as while healthy, and one as soon as the settle
            // period is over.
            BreakerState::Settling => {
                let due = b.since_ms() + b.settle_ms();
                due.saturating_sub(self.clock.now_ms()).clamp(5, 50)
            }
            BreakerState::Healthy => 50,
        };
        Duration::from_millis(ms)
    }

    /// Members for lease shares are taken while healthy and frozen during an
    /// outage; a new dataset means Redis lost its data, so every live window
    /// is re-asserted.
    fn follow_membership(&self, state: BreakerState, r: &mut Recovery) {
        let members = self.backend.members();
        if state == BreakerState::Healthy && members.live > 0 {
            self.members.store(members.live, Ordering::Relaxed);
            self.presence.write().peers = members.peers.clone();
        }
        self.presence.write().silent = members.silent.clone();
        match r.reregistrations {
            Some(seen) if seen != members.reregistrations => {
                self.stats
                    .data_loss_detected
                    .fetch_add(1, Ordering::Relaxed);
                self.ledger.reassert_all();
            }
            _ => {}
        }
        r.reregistrations = Some(members.reregistrations);
    }

    /// The probe is a membership heartbeat: a round trip through the same
    /// script path decisions use, which also tells whether Redis still
    /// knows this replica.
    async fn probe(&self) {
        match self.backend.probe().await {
            Ok(true) => {
                self.note_answer();
                self.transition(|b| b.on_probe_ok(self.clock.now_ms()))
            }
            Ok(false) => tracing::debug!("probe answered but this replica has no index yet"),
            Err(e) => tracing::debug!(error = %e, "probe failed"),
        }
    }

    /// Replays what the ledger plans. While probing or settling, a round
    /// that leaves nothing waiting moves the breaker on; a failed one trips
    /// it (while healthy, it counts as one failure).
    pub(super) async fn replay_round(&self, state: BreakerState) {
        let now = self.clock.now_ms();
        let recovering = matches!(state, BreakerState::Probing | BreakerState::Settling);
        // Off Redis, what this replica may still grant is held there; back
        // on it, nothing is.
        if recovering {
            self.update_holds(now);
        } else {
            self.ledger.release_holds();
        }
        // A healthy replica scans the ledger only when an entry may have
        // come to need replay since the last scan (a lease grant, a hold,
        // a suspect key), a scan left work, or a second has passed: with
        // many keys a scan every round cost a share of a core and held
        // the ledger's shards against the serving threads. Recovering, it
        // scans every round, since the plan moves the breaker on.
        if !self.ledger.take_dirty() && !recovering {
            return;
        }
        // Past a deadline (plus a little scheduling slack) no call sent
        // before can still be in flight.
        let quiet = self.cfg.deadline_ms + 10;
        let (redis_now, margin) = (self.redis_now(now), self.cfg.expiry_margin_ms);
        let mut plan = Vec::new();
        let mut waiting = 0;
        each_shard(self.ledger.shard_count(), |i| {
            waiting += self
                .ledger
                .replay_plan_shard(i, now, redis_now, quiet, margin, &mut plan);
        })
        .await;
        if !plan.is_empty() || waiting > 0 {
            self.ledger.rescan();
        }
        if plan.is_empty() {
            if waiting == 0 && recovering {
                self.transition(|b| b.on_replay_done(self.clock.now_ms()));
            }
            return;
        }
        let entries: Vec<_> = plan
            .iter()
            .flat_map(|p| p.entries.iter().cloned())
            .collect();
        let budget = Duration::from_millis((self.cfg.deadline_ms * 20).max(1_000));
        let started = std::time::Instant::now();
        let result = self.backend.replay(&entries, budget).await;
        self.stats
            .replay_micros
            .fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        match result {
            Ok(written) => {
                self.ledger.mark_replayed(&plan);
                self.stats.replay_runs.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .replayed_entries
                    .fetch_add(written, Ordering::Relaxed);
                tracing::info!(
                    keys = plan.len(),
                    entries = entries.len(),
                    written,
                    took_ms = started.elapsed().as_millis() as u64,
                    "replayed"
                );
                if waiting == 0 && recovering {
                    self.transition(|b| b.on_replay_done(self.clock.now_ms()));
                }
            }
            Err(e) => {
                // Some of it may have been written: what Redis holds for
                // those windows is unknown until a replay succeeds.
                self.ledger.mark_unsure(&plan);
                tracing::warn!(error = %e, "replay failed; will retry");
                if !e.is_failure() {
                    // A slot being moved: the next round tries again.
                    return;
                }
                let reason = e.to_string();
                let now = self.clock.now_ms();
                if recovering {
                    self.transition(|b| b.on_replay_failed(now, &reason));
                } else {
                    self.transition(|b| b.on_failure(now, &reason));
                }
            }
        }
    }
}

/// Runs `f` for each of `shards` shards, letting the thread's other tasks
/// (connections, Redis calls) run between them: the engine loop shares its
/// thread with them, and a scan of a large ledger at once held them all
/// (200,000 keys: about 15 ms, the p99.9 of four replicas at 34–41 ms).
pub(super) async fn each_shard(shards: usize, mut f: impl FnMut(usize)) {
    for i in 0..shards {
        f(i);
        tokio::task::yield_now().await;
    }
}
