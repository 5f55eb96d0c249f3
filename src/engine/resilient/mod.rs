//! The resilient engine: the only place that decides to degrade. It routes
//! each request either to the shared store (a [`Backend`]: Redis in
//! production, a scripted fake in unit tests) or to local leases:
//!
//! - While the breaker is healthy and none of the request's keys is
//!   suspect, the request goes to the backend within a budget that follows
//!   what Redis is doing (`call`): a busy Redis gets the long budget and a
//!   request it does not answer in time is denied (its late reply folded
//!   in), a silent one the short budget and a lease decision. A client never
//!   waits on a dead or hung Redis and never sees an error because of it; a
//!   call that may have run and never answers leaves its keys suspect
//!   (decided locally until repaired, see [`ledger`]).
//! - Off Redis, a replica holds there what it may still grant of its leases
//!   (holds, see `ResilientEngine::update_holds`), so replicas back on Redis do not
//!   grant it too; until it can write them, the others presume it holds its
//!   share ([`presume`]).
//! - Otherwise (tripped, probing, settling, or a suspect key) it is decided
//!   locally on leases ([`lease`]): this replica's share of each limit.
//! - The recovery loop (`recovery`) probes when tripped, replays local
//!   usage and repairs suspect keys, and lets the breaker ([`breaker`])
//!   return to healthy only after a replay round has finished and the
//!   settle period has passed.
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

pub mod breaker;
pub(crate) mod call;
pub mod journal;
mod journaling;
pub mod lease;
pub mod ledger;
mod over_cache;
mod presume;
mod recovery;
mod status;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use async_trait::async_trait;
use parking_lot::{Mutex, RwLock};
use tokio::sync::Notify;

use super::{Engine, EngineStatus, MemoryEngine};
use crate::clock::Clock;
use crate::domain::backend::Backend;
use crate::domain::{Batch, BatchOutcome, Charge, DecisionPath, EngineError, MAX_HITS};
use crate::limit::Role;
use breaker::{Breaker, BreakerConfig, BreakerState, Transition};
use journal::Journal;
use lease::{lease_share, lease_spec};
use ledger::{window_of, Ledger};

use journaling::JournalWriter;
pub use recovery::{Recovery, FINAL_REPLAY_MS};
pub use status::{BreakerView, DecisionCounts, LeaseView, LedgerView, ReplayView, ResilientStatus};

#[derive(Clone, Copy, Debug)]
pub struct ResilientConfig {
    pub deadline_ms: u64,
    pub expiry_margin_ms: u64,
    pub lease_min_share: f64,
    pub replicas_hint: usize,
    pub ledger_max_keys: usize,
    pub ledger_max_bytes: usize,
    /// Byte cap of the lease state's counters (`memory_max_bytes`).
    pub local_max_bytes: usize,
    pub breaker: BreakerConfig,
    /// How long a call waits for its own reply while Redis is answering
    /// (see [`call`]); `deadline_ms` applies when it is not.
    pub budget_max_ms: u64,
    /// How long an OVER from Redis answers locally (0: never; see
    /// [`over_cache`]).
    pub over_cache_ms: u64,
}

impl ResilientConfig {
    /// How long a recovered replica stays on leases: long enough for every
    /// other replica to have probed, replayed and come back too.
    pub fn settle_ms(probe_interval_ms: u64, probe_jitter_ms: u64, deadline_ms: u64) -> u64 {
        2 * (probe_interval_ms + probe_jitter_ms) + deadline_ms
    }
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
    /// "Lost" answers not taken as data loss because a refund of this
    /// replica may have run on the key first.
    pub loss_checks_skipped: AtomicU64,
    /// Requests denied because Redis, though answering, did not answer
    /// them within the budget.
    pub unanswered_denials: AtomicU64,
    /// Of those, the ones Redis admitted when their reply came late: the
    /// denials that were wrong (their count is taken back in Redis).
    pub wrong_denials: AtomicU64,
    /// Replies that came after the budget and were folded in.
    pub late_replies: AtomicU64,
    /// Requests denied from the over-limit cache.
    pub cached_denials: AtomicU64,
    /// Cache entries a later Redis reply showed were no longer true (a
    /// refund elsewhere, or Redis lost data).
    pub cache_refuted: AtomicU64,
}

pub struct ResilientEngine {
    backend: Arc<dyn Backend>,
    local: MemoryEngine,
    ledger: Ledger,
    breaker: Mutex<Breaker>,
    clock: Arc<dyn Clock>,
    /// Redis time minus local time, from the last reply.
    offset_ms: AtomicI64,
    /// Live members as last seen while Redis was reachable.
    members: AtomicUsize,
    cfg: ResilientConfig,
    wake: Notify,
    journal: Option<Journal>,
    /// The journal writer's state; the lock keeps its task and the last
    /// write at shutdown from writing at once.
    journal_writer: tokio::sync::Mutex<JournalWriter>,
    pub stats: Stats,
    /// Latency of Redis decision calls, seconds, once /metrics provides it.
    redis_call_seconds: OnceLock<prometheus::Histogram>,
    /// When the oldest call sent since Redis last answered was sent (local
    /// ms; 0: none waiting). Redis is silent past [`call::ALIVE_MS`] of it.
    unanswered_since_ms: AtomicU64,
    /// The backend's answer count when last looked at ([`Backend::heard`]).
    heard: AtomicU64,
    /// Calls past their budget, answered or failed since.
    late: Arc<call::LateQueue>,
    /// Where calls and their late ends run (see [`crate::tasks`]).
    home: crate::tasks::Home,
    /// When this replica last had trouble with Redis (local ms; 0 never),
    /// and the failure episode it belongs to (see [`presume`]).
    last_trouble_ms: AtomicU64,
    episode: AtomicU64,
    /// Peers and silent members, from membership (peers frozen while off
    /// Redis, like `members`).
    presence: RwLock<presume::Presence>,
    over: over_cache::OverCache,
}

/// Where one request is decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    Backend,
    Lease,
}

impl ResilientEngine {
    /// With a journal, the lease grants a previous run of this replica had
    /// not replayed are restored first and replayed like any others.
    pub fn new(
        backend: Arc<dyn Backend>,
        clock: Arc<dyn Clock>,
        cfg: ResilientConfig,
        journal: Option<Journal>,
    ) -> Self {
        let now = clock.now_ms();
        let engine = ResilientEngine {
            local: MemoryEngine::with_max_bytes(clock.clone(), cfg.local_max_bytes),
            ledger: Ledger::with_max_bytes(cfg.ledger_max_keys, cfg.ledger_max_bytes),
            breaker: Mutex::new(Breaker::new(cfg.breaker, now)),
            offset_ms: AtomicI64::new(0),
            members: AtomicUsize::new(cfg.replicas_hint.max(1)),
            backend,
            clock,
            cfg,
            wake: Notify::new(),
            journal,
            journal_writer: tokio::sync::Mutex::new(JournalWriter::default()),
            stats: Stats::default(),
            redis_call_seconds: OnceLock::new(),
            unanswered_since_ms: AtomicU64::new(0),
            heard: AtomicU64::new(0),
            late: Arc::new(call::LateQueue::default()),
            home: crate::tasks::Home::here(),
            last_trouble_ms: AtomicU64::new(0),
            episode: AtomicU64::new(0),
            presence: RwLock::new(presume::Presence::default()),
            over: over_cache::OverCache::new(cfg.over_cache_ms),
        };
        if let Some(journal) = &engine.journal {
            let restored = journal::restore(journal, &engine.ledger, now, cfg.expiry_margin_ms);
            engine.seed_leases(&restored, now);
        }
        engine
    }

    /// Where to record the latency of Redis decision calls.
    pub fn set_redis_call_histogram(&self, h: prometheus::Histogram) {
        let _ = self.redis_call_seconds.set(h);
    }

    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    pub fn breaker_state(&self) -> BreakerState {
        self.breaker.lock().state()
    }

    /// A restarted replica's leases start from what it had already granted
    /// in the current window, not from zero: otherwise every restart during
    /// an outage would admit another full share. The ledger already holds
    /// the same usage for replay, so nothing is recorded twice.
    fn seed_leases(&self, restored: &[journal::Restored], now_ms: u64) {
        for r in restored {
            if r.local_own <= 0 || r.window != window_of(&r.spec, now_ms) {
                continue;
            }
            let seed = Batch {
                charges: vec![Charge {
                    key: r.key.clone(),
                    spec: r.spec,
                    hits: (r.local_own as u64).min(MAX_HITS),
                    refund: false,
                    role: Role::Shadow,
                }],
                never_deny: true,
            };
            let _ = self.local.apply_detailed(&seed, now_ms);
        }
    }

    fn redis_now(&self, local_ms: u64) -> u64 {
        (local_ms as i64 + self.offset_ms.load(Ordering::Relaxed)).max(0) as u64
    }

    /// The one place that says whether a request may use the backend. A
    /// suspect key is turned to the lease by the ledger itself, under the
    /// lock that counts the call ([`Ledger::note_issue`]): looking here as
    /// well cost a second lookup per charge and proved nothing, since the
    /// key can turn suspect in between.
    fn route(&self) -> Route {
        if self.breaker.lock().allows_redis() {
            Route::Backend
        } else {
            Route::Lease
        }
    }

    fn log_transition(t: &Transition) {
        match t.to {
            BreakerState::Tripped => {
                tracing::warn!(from = t.from.as_str(), reason = %t.reason, "breaker tripped: deciding locally on leases")
            }
            BreakerState::Probing => {
                tracing::info!(reason = %t.reason, "breaker probing: Redis answers, replaying")
            }
            BreakerState::Settling => {
                tracing::info!(reason = %t.reason, "breaker settling: waiting for the other replicas' replays")
            }
            BreakerState::Healthy => {
                tracing::info!(reason = %t.reason, "breaker healthy: deciding on Redis again")
            }
        }
    }

    fn transition(&self, f: impl FnOnce(&mut Breaker) -> Option<Transition>) {
        let t = f(&mut self.breaker.lock());
        if let Some(t) = t {
            if t.to != BreakerState::Healthy {
                self.mark_trouble(self.clock.now_ms());
            }
            self.backend
                .deciding_on_redis(t.to == BreakerState::Healthy);
            Self::log_transition(&t);
            self.wake.notify_one();
        }
    }

    /// Holds in Redis what this replica may still grant on its leases, in
    /// the current and the next window of every key it serves locally
    /// (fixed and sliding window): the replicas on Redis count it as used,
    /// so a replica that comes back to Redis while others are still on
    /// leases does not grant what they may grant too.
    pub(super) fn update_holds(&self, now_ms: u64) {
        let redis_now = self.redis_now(now_ms);
        let members = self.members.load(Ordering::Relaxed);
        for (key, spec) in self.ledger.leased_keys(|s| window_of(s, redis_now)) {
            let (demand, remaining) = self.ledger.lease_inputs(&key, &spec, redis_now);
            let share = lease_share(demand, members, self.cfg.lease_min_share);
            let w = window_of(&spec, redis_now);
            let now_cap = lease_spec(&spec, share, remaining).requests_per_unit;
            let next_cap = lease_spec(&spec, share, None).requests_per_unit;
            self.ledger.hold(&key, &spec, w, now_ms, i64::from(now_cap));
            self.ledger
                .hold(&key, &spec, w + 1, now_ms, i64::from(next_cap));
        }
    }

    /// Decides on leases, without any network.
    fn decide_local(&self, batch: &Batch, now_ms: u64) -> BatchOutcome {
        self.mark_trouble(now_ms);
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
                        // As on the Redis path, so that local sums stay far
                        // inside i64 and replay never overflows a field.
                        hits: c.hits.min(MAX_HITS),
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
}

#[async_trait]
impl Engine for ResilientEngine {
    async fn apply(&self, batch: &Batch) -> Result<BatchOutcome, EngineError> {
        let now = self.clock.now_ms();
        if let Some(outcome) = self.over.answer(batch, now, self.redis_now(now)) {
            self.stats.cached_denials.fetch_add(1, Ordering::Relaxed);
            return Ok(outcome);
        }
        if self.route() == Route::Backend {
            match self.decide_on_backend(batch, now).await {
                call::Decided::Answered(outcome) => return Ok(outcome),
                call::Decided::Unanswered => return Ok(call::unanswered(batch)),
                call::Decided::Failed => {}
            }
        }
        Ok(self.decide_local(batch, now))
    }

    fn name(&self) -> &'static str {
        "resilient"
    }

    fn rules_changed(&self) {
        self.over.clear();
    }

    fn status(&self) -> EngineStatus {
        EngineStatus::Resilient(Box::new(self.snapshot()))
    }
}
