//! The resilient engine: the only place that decides to degrade. It wraps the
//! Redis engine and a local lease engine:
//!
//! - While the breaker is healthy, a request goes to Redis with a deadline.
//!   A call that fails or misses the deadline is decided locally at once, so
//!   a client never waits on a dead or hung Redis and never sees an error
//!   because of it; if the call may still apply, its keys become suspect
//!   (decided locally until repaired, see [`crate::reconcile`]).
//! - While the breaker is tripped or probing, every request is decided
//!   locally on leases: this replica's share of each limit.
//! - A background loop ([`ResilientEngine::run`]) probes Redis when tripped,
//!   replays local usage and repairs suspect keys, and returns the breaker to
//!   healthy only after a replay round has finished.
//!
//! # Leases
//!
//! A replica's lease for a key's window is `share × base`:
//! - `base` is what Redis last said remained in that window when this
//!   replica last reached it (mid-window), else the full limit;
//! - `share` comes from demand when known: `d × (1 − N·f) + f`, where `d` is
//!   this replica's part of the key's recent traffic (from script replies),
//!   `N` the live members (frozen when Redis went away; a configured hint
//!   before first contact) and `f` the floor (`lease_min_share`), so a
//!   replica that suddenly gets traffic is not starved. Summed over replicas
//!   whose `d` add up to 1, the shares add up to exactly 1. Without demand
//!   data the share is `1/N`.
//!
//! Local decisions run the same algorithm as Redis on the lease, on the
//! replica's estimate of Redis time (its last measured offset), so windows
//! line up with Redis's.
//!
//! # What holds per algorithm
//!
//! fixed_window and sliding_window: leases per window, local usage replayed
//! into the window it happened in, suspect keys repaired: after recovery
//! Redis holds exactly the grants. token_bucket: local leases of
//! `share × burst` refilled at `share × rate`; replay draws the tokens used
//! locally from the Redis bucket once (the consumption field is the replay
//! marker). sliding_log: leases hold during an outage, but local grants are
//! not written back into the Redis log (they are kept locally only), so for
//! one unit after recovery up to a lease's worth can be admitted again.

use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use tokio::sync::{watch, Notify};

use super::redis::{RawReply, RedisEngine};
use super::{Batch, BatchOutcome, Charge, DecisionPath, Engine, EngineError, MemoryEngine};
use crate::breaker::{Breaker, BreakerConfig, BreakerState, Transition};
use crate::clock::Clock;
use crate::limit::{Algorithm, LimitSpec};
use crate::reconcile::{window_of, Ledger};

#[derive(Clone, Copy, Debug)]
pub struct ResilientConfig {
    pub deadline_ms: u64,
    pub expiry_margin_ms: u64,
    pub lease_min_share: f64,
    pub replicas_hint: usize,
    pub ledger_max_keys: usize,
    pub breaker: BreakerConfig,
}

/// Counters for /status and metrics.
#[derive(Debug, Default)]
pub struct Stats {
    pub redis_decisions: AtomicU64,
    pub local_decisions: AtomicU64,
    pub redis_failures: AtomicU64,
    pub replay_runs: AtomicU64,
    pub replayed_entries: AtomicU64,
    /// Time spent in replay calls, microseconds.
    pub replay_micros: AtomicU64,
    pub data_loss_detected: AtomicU64,
}

pub struct ResilientEngine {
    redis: Arc<RedisEngine>,
    local: MemoryEngine,
    ledger: Ledger,
    breaker: Mutex<Breaker>,
    clock: Arc<dyn Clock>,
    /// Redis time minus local time, from the last reply.
    offset_ms: AtomicI64,
    /// Live members as last seen while Redis was reachable.
    members: AtomicUsize,
    /// After recovery, stay on leases until this time (ms) and one final
    /// replay: the other replicas may still be deciding on their leases, and
    /// Redis does not hold those grants yet.
    settle_until_ms: AtomicU64,
    settling: std::sync::atomic::AtomicBool,
    cfg: ResilientConfig,
    wake: Notify,
    journal: Option<crate::journal::Journal>,
    pub stats: Stats,
    /// Latency of Redis decision calls, seconds, once /metrics provides it.
    redis_call_seconds: std::sync::OnceLock<prometheus::Histogram>,
}

/// A replica's share of a limit (see the module docs).
pub fn lease_share(demand: Option<f64>, members: usize, min_share: f64) -> f64 {
    let n = members.max(1) as f64;
    match demand {
        Some(d) => {
            let f = min_share.clamp(0.0, 1.0 / n);
            d.clamp(0.0, 1.0) * (1.0 - n * f) + f
        }
        None => 1.0 / n,
    }
}

/// The spec a replica enforces locally: the limit scaled to its lease.
pub fn lease_spec(spec: &LimitSpec, share: f64, remaining: Option<u64>) -> LimitSpec {
    let scale = |v: u64| (v as f64 * share).floor().min(f64::from(u32::MAX)) as u32;
    match spec.algorithm {
        Algorithm::TokenBucket => LimitSpec {
            requests_per_unit: scale(u64::from(spec.requests_per_unit)),
            burst: scale(
                remaining
                    .unwrap_or(u64::from(spec.burst))
                    .min(u64::from(spec.burst)),
            ),
            ..*spec
        },
        _ => {
            let base = remaining
                .unwrap_or(u64::from(spec.requests_per_unit))
                .min(u64::from(spec.requests_per_unit));
            LimitSpec {
                requests_per_unit: scale(base),
                burst: scale(base),
                ..*spec
            }
        }
    }
}

impl ResilientEngine {
    /// With a journal, the lease grants a previous run of this replica had
    /// not replayed are restored first and replayed like any others.
    pub fn new(
        redis: Arc<RedisEngine>,
        clock: Arc<dyn Clock>,
        cfg: ResilientConfig,
        journal: Option<crate::journal::Journal>,
    ) -> Self {
        let now = clock.now_ms();
        let engine = ResilientEngine {
            local: MemoryEngine::new(clock.clone()),
            ledger: Ledger::new(cfg.ledger_max_keys),
            breaker: Mutex::new(Breaker::new(cfg.breaker, now)),
            offset_ms: AtomicI64::new(0),
            members: AtomicUsize::new(cfg.replicas_hint.max(1)),
            settle_until_ms: AtomicU64::new(0),
            settling: std::sync::atomic::AtomicBool::new(false),
            redis,
            clock,
            cfg,
            wake: Notify::new(),
            journal,
            stats: Stats::default(),
            redis_call_seconds: std::sync::OnceLock::new(),
        };
        engine.restore_journal();
        engine
    }

    fn restore_journal(&self) {
        let Some(journal) = &self.journal else { return };
        match journal.load() {
            Ok(entries) => {
                let now = self.clock.now_ms();
                let mut restored = 0;
                for e in &entries {
                    match e.decode() {
                        Some((key, spec, window, local_own)) => {
                            if crate::reconcile::window_live(
                                &spec,
                                window,
                                now,
                                self.cfg.expiry_margin_ms,
                            ) {
                                self.ledger
                                    .restore_local(&key, &spec, window, now, local_own);
                                restored += 1;
                            }
                        }
                        None => {
                            tracing::error!(key = %e.key, "journal entry not understood; its usage is dropped")
                        }
                    }
                }
                if !entries.is_empty() {
                    tracing::info!(path = %journal.path().display(), restored, "restored unreplayed lease grants from the journal");
                }
            }
            Err(e) => tracing::error!(error = %e, "cannot read the journal; starting without it"),
        }
    }

    /// Writes the journal snapshot when it changed since the last write.
    async fn write_journal(&self, last: &mut Option<Vec<crate::journal::JournalEntry>>) {
        let Some(journal) = &self.journal else { return };
        let snapshot: Vec<_> = self
            .ledger
            .unreplayed_snapshot()
            .iter()
            .map(|(k, s, w, n)| crate::journal::JournalEntry::new(k, s, *w, *n))
            .collect();
        if last.as_ref() == Some(&snapshot) {
            return;
        }
        let journal = journal.clone();
        let data = snapshot.clone();
        let result = tokio::task::spawn_blocking(move || journal.store(&data)).await;
        match result {
            Ok(Ok(())) => *last = Some(snapshot),
            Ok(Err(e)) => tracing::error!(error = %e, "cannot write the journal"),
            Err(e) => tracing::error!(error = %e, "journal task failed"),
        }
    }

    /// Where to record the latency of Redis decision calls.
    pub fn set_redis_call_histogram(&self, h: prometheus::Histogram) {
        let _ = self.redis_call_seconds.set(h);
    }

    pub fn redis(&self) -> &Arc<RedisEngine> {
        &self.redis
    }

    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    pub fn breaker_state(&self) -> BreakerState {
        self.breaker.lock().state()
    }

    fn redis_now(&self, local_ms: u64) -> u64 {
        (local_ms as i64 + self.offset_ms.load(Ordering::Relaxed)).max(0) as u64
    }

    fn log_transition(t: &Transition) {
        match t.to {
            BreakerState::Tripped => {
                tracing::warn!(from = t.from.as_str(), reason = %t.reason, "breaker tripped: deciding locally on leases")
            }
            BreakerState::Probing => {
                tracing::info!(reason = %t.reason, "breaker probing: Redis answers, replaying")
            }
            BreakerState::Healthy => {
                tracing::info!(reason = %t.reason, "breaker healthy: back on Redis")
            }
        }
    }

    fn transition(&self, f: impl FnOnce(&mut Breaker) -> Option<Transition>) {
        let t = f(&mut self.breaker.lock());
        if let Some(t) = t {
            Self::log_transition(&t);
            if t.to == BreakerState::Healthy {
                self.settle_until_ms
                    .store(t.at_ms + self.settle_ms(), Ordering::Release);
                self.settling.store(true, Ordering::Release);
            }
            self.wake.notify_one();
        }
    }

    /// How long a recovered replica stays on leases: long enough for every
    /// other replica to have probed, replayed and come back too.
    fn settle_ms(&self) -> u64 {
        let b = self.cfg.breaker;
        2 * (b.probe_interval_ms + b.probe_jitter_ms) + self.cfg.deadline_ms
    }

    fn on_reply(&self, batch: &Batch, reply: &RawReply, sent_ms: u64) -> BatchOutcome {
        let now = self.clock.now_ms();
        let mid = (sent_ms + now) / 2;
        self.offset_ms
            .store(reply.now_ms as i64 - mid as i64, Ordering::Relaxed);
        for (c, item) in batch.charges.iter().zip(&reply.items) {
            self.ledger
                .record_redis(&c.key, &c.spec, reply.now_ms, now, item);
        }
        if reply.lost {
            self.stats
                .data_loss_detected
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!("Redis lost counts this replica had written (restarted empty or failed over): re-asserting");
            self.ledger.reassert_all();
            self.wake.notify_one();
        }
        self.stats.redis_decisions.fetch_add(1, Ordering::Relaxed);
        reply.outcome()
    }

    /// Decides on leases, without any network.
    fn decide_local(&self, batch: &Batch, now_ms: u64) -> BatchOutcome {
        let redis_now = self.redis_now(now_ms);
        let members = self.members.load(Ordering::Relaxed);
        let leased = Batch {
            charges: batch
                .charges
                .iter()
                .map(|c| {
                    let (demand, remaining) = self.ledger.lease_inputs(&c.key, &c.spec, redis_now);
                    let share = lease_share(demand, members, self.cfg.lease_min_share);
                    Charge {
                        spec: lease_spec(&c.spec, share, remaining),
                        ..c.clone()
                    }
                })
                .collect(),
            never_deny: batch.never_deny,
        };
        let (mut outcome, deltas) = self.local.apply_detailed(&leased, redis_now);
        for (c, delta) in batch.charges.iter().zip(deltas) {
            self.ledger.record_local(
                &c.key,
                &c.spec,
                window_of(&c.spec, redis_now),
                now_ms,
                delta,
            );
        }
        outcome.path = DecisionPath::Local;
        self.stats.local_decisions.fetch_add(1, Ordering::Relaxed);
        outcome
    }

    /// The background loop: probe when tripped, replay and repair, keep
    /// membership and the ledger current. Stops on `stop`.
    pub async fn run(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let mut last_sweep = 0u64;
        let mut reregistrations = self.redis.membership().state().reregistrations;
        let mut journaled = None;
        let mut last_journal = 0u64;
        loop {
            let state = self.breaker_state();
            let delay = match state {
                BreakerState::Tripped => {
                    let unit = (self.clock.now_ms() % 1_000) as f64 / 1_000.0;
                    self.breaker.lock().probe_delay_ms(unit)
                }
                BreakerState::Probing => 5,
                BreakerState::Healthy => 50,
            };
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(delay)) => {}
                _ = self.wake.notified() => {}
                _ = stop.wait_for(|s| *s) => return,
            }
            let now = self.clock.now_ms();
            let membership = self.redis.membership().state();
            if state == BreakerState::Healthy && !membership.live.is_empty() {
                self.members.store(membership.live.len(), Ordering::Relaxed);
            }
            if membership.reregistrations != reregistrations {
                // Redis came back without its data: re-assert every live window.
                reregistrations = membership.reregistrations;
                self.stats
                    .data_loss_detected
                    .fetch_add(1, Ordering::Relaxed);
                self.ledger.reassert_all();
            }
            if self.journal.is_some() && now >= last_journal + 100 {
                last_journal = now;
                self.write_journal(&mut journaled).await;
            }
            if now >= last_sweep + 1_000 {
                last_sweep = now;
                self.ledger
                    .sweep(self.redis_now(now), self.cfg.expiry_margin_ms);
                self.local.sweep(self.redis_now(now));
            }
            if state == BreakerState::Healthy
                && self.settling.load(Ordering::Acquire)
                && now >= self.settle_until_ms.load(Ordering::Acquire)
            {
                // One last replay of this replica's lease grants, then Redis.
                // Grants made after this round are replayed by the next ones
                // (within a loop tick); waiting for none at all would never
                // end under load, since settling decisions are lease grants.
                self.replay_round(state).await;
                if self.breaker_state() == BreakerState::Healthy {
                    self.settling.store(false, Ordering::Release);
                    tracing::info!("settled: deciding on Redis again");
                }
                continue;
            }
            match state {
                BreakerState::Tripped => {
                    // The probe is a membership heartbeat: a round trip
                    // through the same script path decisions use, which also
                    // tells whether Redis still knows this replica.
                    match self.redis.membership().beat().await {
                        Ok(()) if self.redis.membership().index().is_some() => {
                            self.transition(|b| b.on_probe_ok(self.clock.now_ms()));
                        }
                        Ok(()) => {
                            tracing::debug!("probe answered but this replica has no index yet")
                        }
                        Err(e) => tracing::debug!(error = %e, "probe failed"),
                    }
                }
                BreakerState::Probing | BreakerState::Healthy => self.replay_round(state).await,
            }
        }
    }

    async fn replay_round(&self, state: BreakerState) {
        let now = self.clock.now_ms();
        // Past a deadline (plus a little scheduling slack) no call sent
        // before can still be in flight.
        let quiet = self.cfg.deadline_ms + 10;
        let (plan, waiting) =
            self.ledger
                .replay_plan(now, self.redis_now(now), quiet, self.cfg.expiry_margin_ms);
        if plan.is_empty() {
            if waiting == 0 && state == BreakerState::Probing {
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
        let result = self.redis.replay(&entries, budget).await;
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
                if waiting == 0 && state == BreakerState::Probing {
                    self.transition(|b| b.on_replay_done(self.clock.now_ms()));
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "replay failed; will retry");
                let now = self.clock.now_ms();
                let reason = e.to_string();
                if state == BreakerState::Probing {
                    self.transition(|b| b.on_replay_failed(now, &reason));
                } else {
                    self.transition(|b| b.on_failure(now, &reason));
                }
            }
        }
    }
}

#[async_trait]
impl Engine for ResilientEngine {
    async fn apply(&self, batch: &Batch) -> Result<BatchOutcome, EngineError> {
        let now = self.clock.now_ms();
        let redis_now = self.redis_now(now);
        let use_redis = self.breaker.lock().allows_redis()
            && !self.settling.load(Ordering::Acquire)
            && !batch.charges.iter().any(|c| self.ledger.is_suspect(&c.key));
        if use_redis {
            let expected: Vec<(i64, u64)> = batch
                .charges
                .iter()
                .map(|c| {
                    let w = window_of(&c.spec, redis_now);
                    (self.ledger.expected(&c.key, w), w)
                })
                .collect();
            for c in &batch.charges {
                self.ledger.note_issue(&c.key, &c.spec, now);
            }
            let started = std::time::Instant::now();
            let result = self.redis.decide_raw(batch, &expected).await;
            if let Some(h) = self.redis_call_seconds.get() {
                h.observe(started.elapsed().as_secs_f64());
            }
            match result {
                Ok(reply) => {
                    self.breaker.lock().on_success();
                    return Ok(self.on_reply(batch, &reply, now));
                }
                Err(e) => {
                    self.stats.redis_failures.fetch_add(1, Ordering::Relaxed);
                    if e.maybe_applied() {
                        let at = self.clock.now_ms();
                        for c in &batch.charges {
                            self.ledger.mark_suspect(&c.key, &c.spec, at);
                        }
                    }
                    tracing::debug!(error = %e, "Redis call failed; deciding locally");
                    let reason = e.to_string();
                    self.transition(|b| b.on_failure(self.clock.now_ms(), &reason));
                }
            }
        }
        Ok(self.decide_local(batch, now))
    }

    fn name(&self) -> &'static str {
        "resilient"
    }

    fn facts(&self) -> super::EngineFacts {
        let (state, transitions) = {
            let b = self.breaker.lock();
            (b.state(), b.transitions())
        };
        let (keys_to_replay, unreplayed_hits, suspect_keys) = self.ledger.pending();
        super::EngineFacts {
            breaker_state: Some(state.as_str()),
            breaker_transitions: transitions,
            live_members: self.redis.membership().state().live.len(),
            tracked_keys: self.ledger.len(),
            keys_to_replay,
            unreplayed_hits,
            suspect_keys,
            dropped_usage: self.ledger.dropped_usage.load(Ordering::Relaxed),
            replay_runs: self.stats.replay_runs.load(Ordering::Relaxed),
            replay_entries: self.stats.replayed_entries.load(Ordering::Relaxed),
            redis_failures: self.stats.redis_failures.load(Ordering::Relaxed),
            replay_seconds: self.stats.replay_micros.load(Ordering::Relaxed) as f64 / 1e6,
            lease_members: self.members.load(Ordering::Relaxed),
        }
    }

    fn status(&self) -> serde_json::Value {
        // The key scan runs before the breaker lock is taken: the decision
        // path needs that lock, and this page is watched during outages.
        let (replay_keys, unreplayed_hits, suspect_keys) = self.ledger.pending();
        let members = self.members.load(Ordering::Relaxed);
        let redis_now = self.redis_now(self.clock.now_ms());
        let leases: Vec<_> = self
            .ledger
            .busiest(20, redis_now)
            .into_iter()
            .map(|(key, spec)| {
                let (demand, remaining) = self.ledger.lease_inputs(&key, &spec, redis_now);
                let share = lease_share(demand, members, self.cfg.lease_min_share);
                let lease = lease_spec(&spec, share, remaining);
                serde_json::json!({
                    "key": key.as_str(),
                    "limit": spec.requests_per_unit,
                    "unit": spec.unit.as_str(),
                    "algorithm": spec.algorithm.as_str(),
                    "demand_share": demand,
                    "lease_share": share,
                    "redis_remaining": remaining,
                    "lease": if spec.algorithm == Algorithm::TokenBucket { lease.burst } else { lease.requests_per_unit },
                })
            })
            .collect();
        let b = self.breaker.lock();
        let history: Vec<_> = b.history().cloned().collect();
        let path = if b.allows_redis() && !self.settling.load(Ordering::Acquire) {
            "redis"
        } else {
            "local"
        };
        serde_json::json!({
            "engine": "resilient",
            "path": path,
            "leases": leases,
            "settling": self.settling.load(Ordering::Acquire),
            "breaker": {
                "state": b.state().as_str(),
                "since_ms": b.since_ms(),
                "consecutive_failures": b.consecutive_failures(),
                "transitions": b.transitions(),
                "history": history,
            },
            "members_for_leases": self.members.load(Ordering::Relaxed),
            "ledger": {
                "tracked_keys": self.ledger.len(),
                "keys_to_replay": replay_keys,
                "unreplayed_hits": unreplayed_hits,
                "suspect_keys": suspect_keys,
                "dropped_usage": self.ledger.dropped_usage.load(Ordering::Relaxed),
            },
            "decisions": {
                "redis": self.stats.redis_decisions.load(Ordering::Relaxed),
                "local": self.stats.local_decisions.load(Ordering::Relaxed),
                "redis_failures": self.stats.redis_failures.load(Ordering::Relaxed),
            },
            "replay": {
                "runs": self.stats.replay_runs.load(Ordering::Relaxed),
                "entries": self.stats.replayed_entries.load(Ordering::Relaxed),
                "data_loss_detected": self.stats.data_loss_detected.load(Ordering::Relaxed),
            },
            "redis": self.redis.status(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::Unit;

    #[test]
    fn shares_sum_to_one_and_have_a_floor() {
        let f = 0.025;
        let demands = [0.7, 0.1, 0.1, 0.1];
        let sum: f64 = demands.iter().map(|d| lease_share(Some(*d), 4, f)).sum();
        assert!((sum - 1.0).abs() < 1e-9, "{sum}");
        assert!((lease_share(Some(0.7), 4, f) - 0.655).abs() < 1e-9);
        assert!(
            (lease_share(Some(0.0), 4, f) - 0.025).abs() < 1e-9,
            "an idle replica keeps the floor"
        );
        assert_eq!(lease_share(None, 4, f), 0.25);
        assert_eq!(
            lease_share(None, 0, f),
            1.0,
            "no members known: the whole limit"
        );
        // A floor too large for N is capped at an even split.
        assert!((lease_share(Some(0.9), 4, 0.5) - 0.25).abs() < 1e-9);
    }

    #[test]
    fn leases_scale_the_limit_or_what_remained() {
        let spec = LimitSpec::fixed(1_000, Unit::Second);
        assert_eq!(lease_spec(&spec, 0.25, None).requests_per_unit, 250);
        assert_eq!(
            lease_spec(&spec, 0.25, Some(400)).requests_per_unit,
            100,
            "mid-window: share of what remained"
        );
        assert_eq!(
            lease_spec(&spec, 0.25, Some(5_000)).requests_per_unit,
            250,
            "never above the limit"
        );
        let bucket = LimitSpec {
            requests_per_unit: 100,
            unit: Unit::Second,
            algorithm: Algorithm::TokenBucket,
            burst: 40,
        };
        let l = lease_spec(&bucket, 0.5, None);
        assert_eq!((l.requests_per_unit, l.burst), (50, 20));
        assert_eq!(lease_spec(&bucket, 0.5, Some(10)).burst, 5);
    }
}
