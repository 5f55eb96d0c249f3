//! The resilient engine's status as one typed snapshot: /status serializes
//! it (the JSON shape operators and the demo read), /metrics reads its
//! numbers. Taken without holding the breaker lock during the key scan: the
//! decision path needs that lock, and this page is watched during outages.

use std::sync::atomic::Ordering;

use serde::Serialize;

use super::breaker::Transition;
use super::lease::{lease_share, lease_spec};
use super::ResilientEngine;
use crate::limit::Algorithm;

#[derive(Clone, Debug, Serialize)]
pub struct ResilientStatus {
    /// "redis" or "local": where a request without suspect keys goes now.
    pub path: &'static str,
    pub leases: Vec<LeaseView>,
    /// The breaker is settling (kept for readers of the older shape).
    pub settling: bool,
    pub breaker: BreakerView,
    pub members_for_leases: usize,
    pub ledger: LedgerView,
    pub decisions: DecisionCounts,
    pub replay: ReplayView,
    /// Live members as last seen in Redis (metrics; also under `redis`).
    #[serde(skip)]
    pub live_members: usize,
    /// The backend's own facts.
    pub redis: serde_json::Value,
}

/// One of the busiest keys and the lease this replica would decide it on.
#[derive(Clone, Debug, Serialize)]
pub struct LeaseView {
    pub key: String,
    pub limit: u32,
    pub unit: &'static str,
    pub algorithm: &'static str,
    pub demand_share: Option<f64>,
    pub lease_share: f64,
    pub redis_remaining: Option<u64>,
    pub lease: u32,
}

#[derive(Clone, Debug, Serialize)]
pub struct BreakerView {
    pub state: &'static str,
    pub since_ms: u64,
    pub consecutive_failures: u32,
    pub transitions: u64,
    pub history: Vec<Transition>,
}

#[derive(Clone, Debug, Serialize)]
pub struct LedgerView {
    pub tracked_keys: usize,
    /// The lease state's counters: estimated bytes (capped by
    /// `memory_max_bytes`) and live keys evicted to stay within the cap.
    pub lease_state_bytes: usize,
    pub lease_state_evictions: u64,
    /// The ledger's estimated bytes, and clean entries it evicted.
    pub ledger_bytes: usize,
    pub ledger_evicted: u64,
    pub keys_to_replay: usize,
    pub unreplayed_hits: i64,
    pub suspect_keys: usize,
    pub dropped_usage: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct DecisionCounts {
    pub redis: u64,
    pub local: u64,
    pub redis_failures: u64,
    /// Denied because Redis, though answering, did not answer in time.
    pub unanswered_denials: u64,
    /// Of those, the ones Redis admitted when their reply came late.
    pub wrong_denials: u64,
    /// Denied from the over-limit cache, without a Redis call.
    pub cached_denials: u64,
    /// Over-limit cache entries a later Redis reply refuted.
    pub cache_refuted: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct ReplayView {
    pub runs: u64,
    pub entries: u64,
    pub data_loss_detected: u64,
    /// "Lost" answers set aside: a refund of this replica may have run first.
    pub loss_checks_skipped: u64,
    /// Calls whose reply came after their budget and was folded in.
    pub late_replies: u64,
    /// Time spent in replay calls.
    pub seconds: f64,
}

/// Keys listed with their leases on /status.
const BUSIEST: usize = 20;

impl ResilientEngine {
    pub fn snapshot(&self) -> ResilientStatus {
        let (keys_to_replay, unreplayed_hits, suspect_keys) = self.ledger.pending();
        let members = self.members.load(Ordering::Relaxed);
        let redis_now = self.redis_now(self.clock.now_ms());
        let leases = self
            .ledger
            .busiest(BUSIEST, redis_now)
            .into_iter()
            .map(|(key, spec)| {
                let (demand, remaining) = self.ledger.lease_inputs(&key, &spec, redis_now);
                let share = lease_share(demand, members, self.cfg.lease_min_share);
                let lease = lease_spec(&spec, share, remaining);
                LeaseView {
                    key: key.as_str().to_owned(),
                    limit: spec.requests_per_unit,
                    unit: spec.unit.as_str(),
                    algorithm: spec.algorithm.as_str(),
                    demand_share: demand,
                    lease_share: share,
                    redis_remaining: remaining,
                    lease: if spec.algorithm == Algorithm::TokenBucket {
                        lease.burst
                    } else {
                        lease.requests_per_unit
                    },
                }
            })
            .collect();
        let breaker = {
            let b = self.breaker.lock();
            BreakerView {
                state: b.state().as_str(),
                since_ms: b.since_ms(),
                consecutive_failures: b.consecutive_failures(),
                transitions: b.transitions(),
                history: b.history().cloned().collect(),
            }
        };
        let stat = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        ResilientStatus {
            path: if breaker.state == "healthy" {
                "redis"
            } else {
                "local"
            },
            leases,
            settling: breaker.state == "settling",
            breaker,
            members_for_leases: members,
            ledger: LedgerView {
                tracked_keys: self.ledger.len(),
                lease_state_bytes: self.local.bytes(),
                lease_state_evictions: self.local.evictions(),
                ledger_bytes: self.ledger.bytes(),
                ledger_evicted: stat(&self.ledger.evicted),
                keys_to_replay,
                unreplayed_hits,
                suspect_keys,
                dropped_usage: stat(&self.ledger.dropped_usage),
            },
            decisions: DecisionCounts {
                redis: stat(&self.stats.redis_decisions),
                local: stat(&self.stats.local_decisions),
                unanswered_denials: stat(&self.stats.unanswered_denials),
                wrong_denials: stat(&self.stats.wrong_denials),
                cached_denials: stat(&self.stats.cached_denials),
                cache_refuted: stat(&self.stats.cache_refuted),
                redis_failures: stat(&self.stats.redis_failures),
            },
            replay: ReplayView {
                runs: stat(&self.stats.replay_runs),
                entries: stat(&self.stats.replayed_entries),
                data_loss_detected: stat(&self.stats.data_loss_detected),
                loss_checks_skipped: stat(&self.stats.loss_checks_skipped),
                late_replies: stat(&self.stats.late_replies),
                seconds: stat(&self.stats.replay_micros) as f64 / 1e6,
            },
            live_members: self.backend.members().live,
            redis: self.backend.status(),
        }
    }
}
