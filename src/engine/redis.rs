//! The Redis engine: one script call per request evaluates every charge
//! atomically and all-or-nothing on Redis time (`redis.call('TIME')`), so any
//! number of replicas enforce one limit exactly and replica clock skew
//! changes nothing. On a Redis Cluster a request whose counters are in
//! several slots takes one call per slot and stays all-or-nothing by taking
//! back what a denied request charged ([`slots`]).
//!
//! # Counting twice is impossible by construction
//!
//! Every counter window is a hash with one field per replica (its net
//! count); the total is their sum (layout in `crate::redis::keys`). A
//! replica writes only its own field, so the replay of what it granted while
//! Redis was away is "set my field to my count": repeatable, and it also
//! heals a Redis that came back empty.
//!
//! A script that Redis executes late, after this replica gave up on the
//! deadline and decided locally, is the dangerous case: it would add hits
//! that the local decision also counts. Two mechanisms close it:
//!
//! - **Epoch fence.** The replica keeps an epoch, bumped every time a call
//!   fails in a way that might still be applied (timeout, lost reply). Every
//!   call carries the epoch. When the replica rewrites its field for a key
//!   (replay), it also writes the fence `f<idx>` = its current epoch on that
//!   key, and the script refuses (reply "stale", nothing read or written) any
//!   call whose epoch is below the fence. A late call therefore either runs
//!   before the rewrite (and is overwritten by it) or after it (and is
//!   refused). A refused live call is retried once with the current epoch.
//! - **No resends.** The client never resends a script on reconnect
//!   (`max_command_attempts = 1`), so one decision is at most one execution.
//!
//! Sliding logs get the same from deterministic member ids
//! (`<idx>:<call id>:<charge>:<n>`, the call id unique per incarnation):
//! re-adding a member is a no-op.
//!
//! Refunds lower the replica's own field (which may go below zero; the total
//! is clamped at zero by the script), so they replay exactly like grants.
//!
//! # Demand shares
//!
//! Each charge's reply carries this replica's count and the key's total in
//! the previous (complete) window at no extra round trip; the resilient
//! engine's ledger keeps the fraction per key to size leases by demand.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;

use super::{Engine, EngineStatus};
use crate::domain::backend::{Backend, CallError, Members, Presume, RawReply, ReplayEntry};
use crate::domain::{Batch, BatchOutcome, EngineError};
use crate::limit::Algorithm;
use crate::redis::membership::{MemberState, Membership, MembershipError};
use crate::redis::scripts::{self, DecideCall, DecideReply, REPLAY_BATCH};
use crate::redis::{keys, Redis};

mod slots;

/// The Redis engine: the adapter from the [`Backend`] contract (and the
/// plain [`Engine`] one) to `crate::redis`.
pub struct RedisEngine {
    redis: Arc<Redis>,
    membership: Arc<Membership>,
    prefix: String,
    margin_ms: u64,
    epoch: AtomicU64,
    calls: AtomicU64,
    /// Distinguishes this incarnation's call ids from a previous one's.
    boot: String,
    /// Requests whose counters were in several Cluster slots, and those of
    /// them whose charges had to be taken back ([`slots`]).
    cross_slot: AtomicU64,
    cross_slot_refunds: AtomicU64,
    /// Redis time minus local time, from the last decision reply.
    offset_ms: std::sync::atomic::AtomicI64,
    /// Repairs that found this replica's field below what it had confirmed.
    repairs_raised: AtomicU64,
}

fn local_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The Redis engine's facts for /status.
#[derive(Clone, Debug, Serialize)]
pub struct RedisStatus {
    /// The URL with any password redacted.
    pub redis: String,
    pub replica_id: String,
    pub membership: MemberState,
    pub epoch: u64,
    /// Script calls that carried decisions, and the decisions they
    /// carried (more decisions than calls: requests were coalesced).
    pub decision_calls: u64,
    pub decisions_sent: u64,
    /// Requests decided across several Cluster slots, and those whose
    /// charges were taken back because one slot denied.
    pub cross_slot_requests: u64,
    pub cross_slot_refunds: u64,
    /// Mode, nodes, connections and failures per node.
    pub topology: crate::redis::topology::Topology,
    /// Repairs that found this replica's field below what it had
    /// confirmed: writes Redis lost (a failover to a replica that was
    /// behind), restored by the repair.
    pub repairs_raised: u64,
    /// Redis's configured hz, as last read (at startup and each minute;
    /// null until read): its expiry cycle can hold Redis up to 250/hz ms
    /// at once, and a call waits behind it.
    pub hz: Option<u64>,
}

impl RedisEngine {
    /// `epoch_start` must exceed any epoch a previous incarnation of this
    /// replica used (its fences and replay versions stay in Redis): the
    /// caller passes the start time in microseconds.
    pub fn new(
        redis: Arc<Redis>,
        membership: Arc<Membership>,
        prefix: String,
        margin_ms: u64,
        boot: String,
        epoch_start: u64,
    ) -> Self {
        RedisEngine {
            redis,
            membership,
            prefix,
            margin_ms,
            epoch: AtomicU64::new(epoch_start.max(1)),
            calls: AtomicU64::new(0),
            boot,
            cross_slot: AtomicU64::new(0),
            cross_slot_refunds: AtomicU64::new(0),
            offset_ms: std::sync::atomic::AtomicI64::new(0),
            repairs_raised: AtomicU64::new(0),
        }
    }

    /// This replica's field index, or why it may not count on Redis (a
    /// call that never left).
    fn not_counting(&self) -> Result<u64, CallError> {
        self.membership
            .index()
            .ok_or_else(|| CallError::NotConnected(self.membership.not_counting_reason()))
    }

    /// Redis's time as this replica reckons it from the last reply.
    fn redis_now_ms(&self) -> u64 {
        (local_ms() as i64 + self.offset_ms.load(Ordering::Relaxed)).max(0) as u64
    }

    fn stats_cross_slot_refund(&self) {
        self.cross_slot_refunds.fetch_add(1, Ordering::Relaxed);
    }

    pub fn membership(&self) -> &Arc<Membership> {
        &self.membership
    }

    pub fn redis(&self) -> &Arc<Redis> {
        &self.redis
    }

    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// Raises the epoch: every call issued before is fenced out of keys the
    /// next replay rewrites.
    pub fn bump_epoch(&self) -> u64 {
        self.epoch.fetch_add(1, Ordering::SeqCst) + 1
    }

    async fn call(
        &self,
        batch: &Batch,
        index: u64,
        expected: &[(i64, u64)],
        presume: &Presume,
        pinned: bool,
    ) -> Result<DecideReply, CallError> {
        // `<boot>.<n>`, without format! (a percent of a replica's CPU on
        // the Redis path). Only a sliding-log charge uses it (its members'
        // ids); otherwise "", which costs Redis less to take in.
        let mut call_id = String::new();
        if batch
            .charges
            .iter()
            .any(|c| c.spec.algorithm == Algorithm::SlidingLog)
        {
            call_id.reserve(self.boot.len() + 21);
            call_id.push_str(&self.boot);
            call_id.push('.');
            call_id
                .push_str(itoa::Buffer::new().format(self.calls.fetch_add(1, Ordering::Relaxed)));
        }
        let call = DecideCall {
            index,
            epoch: self.epoch(),
            margin_ms: self.margin_ms,
            call_id: &call_id,
            expected,
            presume,
            boot: &self.boot,
            windows_at: self.redis.is_cluster().then(|| self.redis_now_ms()),
            pinned,
        };
        let args = scripts::decide_args(&self.prefix, batch, &call);
        // Only a Cluster orders calls by slot; a CRC per call was 0.4% of a
        // replica's time on one Redis (perf).
        let slot = match batch.charges.first() {
            Some(c) if self.redis.is_cluster() => crate::redis::keys::counter_slot(&c.key),
            _ => 0,
        };
        match self.redis.decide(slot, args, affinity(batch)).await {
            Ok(reply) => {
                if let Some(&now) = reply.get(1) {
                    self.offset_ms
                        .store(now - local_ms() as i64, Ordering::Relaxed);
                }
                scripts::decode_decide(&reply, batch.charges.len()).map_err(CallError::Reply)
            }
            Err(e) => {
                if e.maybe_applied() {
                    // This call may still run: later rewrites must fence it out.
                    self.bump_epoch();
                }
                Err(e)
            }
        }
    }

    /// One decision in Redis. `expected[i]` is this replica's confirmed
    /// count for charge i in a window (-1 unknown), for data-loss detection.
    pub async fn decide_raw(
        &self,
        batch: &Batch,
        expected: &[(i64, u64)],
        presume: &Presume,
    ) -> Result<RawReply, CallError> {
        let index = self.not_counting()?;
        if self.redis.is_cluster() {
            let groups = slots::slot_groups(batch);
            if groups.len() > 1 {
                self.cross_slot.fetch_add(1, Ordering::Relaxed);
                return self
                    .decide_across_slots(batch, &groups, index, expected, presume)
                    .await;
            }
        }
        self.decide_in_slot(batch, index, expected, presume, false)
            .await
    }

    /// One script call for charges that share a slot (any charges on one
    /// Redis), retried once when fenced. `pinned`: a take-back, decided in
    /// the windows `expected` names ([`slots`]).
    async fn decide_in_slot(
        &self,
        batch: &Batch,
        index: u64,
        expected: &[(i64, u64)],
        presume: &Presume,
        pinned: bool,
    ) -> Result<RawReply, CallError> {
        match self.call(batch, index, expected, presume, pinned).await? {
            DecideReply::Decided(reply) => Ok(reply),
            // Fenced: a rewrite happened after this call's epoch was read.
            DecideReply::Fenced => {
                match self.call(batch, index, expected, presume, pinned).await? {
                    DecideReply::Decided(reply) => Ok(reply),
                    DecideReply::Fenced => Err(CallError::Reply(
                        "call fenced twice by a concurrent rewrite".into(),
                    )),
                }
            }
        }
    }

    /// Sets this replica's fields for each (counter, window); repairs are
    /// fenced at a fresh epoch. Returns how many entries were still live and
    /// written.
    pub async fn replay(
        &self,
        entries: &[ReplayEntry],
        deadline: Duration,
    ) -> Result<u64, CallError> {
        let index = self.not_counting()?;
        // On a Cluster each call keeps to one slot; one Redis takes any
        // keys in one call.
        let cluster = self.redis.is_cluster();
        let mut groups: HashMap<u16, Vec<&ReplayEntry>> = HashMap::new();
        for e in entries {
            let slot = if cluster {
                keys::counter_slot(&e.key)
            } else {
                0
            };
            groups.entry(slot).or_default().push(e);
        }
        let mut applied = 0;
        for group in groups.values() {
            for chunk in group.chunks(REPLAY_BATCH) {
                // Once more past a guard this replica never set (a previous
                // run's epoch from a clock that stepped back), with an epoch
                // above it: replay sets values, so writing twice is safe.
                let mut still_fenced = 0;
                for _ in 0..2 {
                    let epoch = self.bump_epoch();
                    let (keys, args) = scripts::replay_args(
                        &self.prefix,
                        index,
                        epoch,
                        self.margin_ms,
                        &self.boot,
                        chunk,
                        cluster,
                    );
                    let reply = self.redis.replay(keys, args, deadline).await?;
                    applied += reply.first().copied().unwrap_or(0).max(0) as u64;
                    let fenced = reply.get(2).copied().unwrap_or(0).max(0) as u64;
                    let raised = reply.get(3).copied().unwrap_or(0).max(0) as u64;
                    if raised > 0 {
                        self.repairs_raised.fetch_add(raised, Ordering::Relaxed);
                        tracing::warn!(raised, "Redis held less than this replica had confirmed (writes lost in a failover): the repair restored it");
                    }
                    still_fenced = fenced;
                    if fenced == 0 {
                        break;
                    }
                    tracing::warn!(fenced, epoch, "replay found a newer epoch than this replica's; raising it and replaying again");
                    self.epoch.fetch_max(fenced, Ordering::SeqCst);
                }
                if still_fenced != 0 {
                    // Not marked replayed: the next round tries again.
                    return Err(CallError::Reply(format!(
                        "replay still fenced at epoch {still_fenced}"
                    )));
                }
            }
        }
        Ok(applied)
    }

    pub fn redis_status(&self) -> RedisStatus {
        let (decision_calls, decisions_sent) = self.redis.batch_counts();
        RedisStatus {
            redis: self.redis.display_url.clone(),
            replica_id: self.membership.id().to_owned(),
            membership: self.membership.state(),
            epoch: self.epoch(),
            decision_calls,
            decisions_sent,
            cross_slot_requests: self.cross_slot.load(Ordering::Relaxed),
            cross_slot_refunds: self.cross_slot_refunds.load(Ordering::Relaxed),
            topology: self.redis.topology(),
            repairs_raised: self.repairs_raised.load(Ordering::Relaxed),
            hz: self.redis.hz(),
        }
    }
}

#[async_trait]
impl Backend for RedisEngine {
    async fn decide(
        &self,
        batch: &Batch,
        expected: &[(i64, u64)],
        presume: &Presume,
    ) -> Result<RawReply, CallError> {
        self.decide_raw(batch, expected, presume).await
    }

    async fn replay(&self, entries: &[ReplayEntry], budget: Duration) -> Result<u64, CallError> {
        RedisEngine::replay(self, entries, budget).await
    }

    async fn probe(&self) -> Result<bool, CallError> {
        // Off Redis anyway: a connection slower than this to answer a PING
        // costs nothing to replace.
        let ping_within = self.redis.deadline().max(Duration::from_millis(250));
        self.redis.check_connections(ping_within).await?;
        match self.membership.beat().await {
            Ok(()) => Ok(self.membership.index().is_some()),
            Err(MembershipError::Call(e)) => Err(e),
            Err(e @ MembershipError::Conflict(_)) => Err(CallError::Redis(e.to_string())),
        }
    }

    fn deciding_on_redis(&self, on: bool) {
        self.membership.set_on_redis(on);
    }

    fn heard(&self) -> u64 {
        self.redis.heard()
    }

    fn members(&self) -> Members {
        let state = self.membership.state();
        Members {
            live: state.live.len(),
            reregistrations: state.reregistrations,
            // Every member seen within the hold-back horizon, live or not:
            // one whose heartbeats lapsed in a flap may still be deciding
            // on its lease.
            peers: state
                .known_indices
                .iter()
                .copied()
                .filter(|i| Some(*i) != state.index)
                .collect(),
            // Never itself: its own beats may still read as silent for a
            // beat after it is back on Redis.
            silent: state
                .silent_indices
                .iter()
                .copied()
                .filter(|i| Some(*i) != state.index)
                .collect(),
        }
    }

    fn status(&self) -> serde_json::Value {
        serde_json::to_value(EngineStatus::Redis(Box::new(self.redis_status()))).unwrap_or_default()
    }
}

#[async_trait]
impl Engine for RedisEngine {
    async fn apply(&self, batch: &Batch) -> Result<BatchOutcome, EngineError> {
        self.decide_raw(batch, &[], &Presume::default())
            .await
            .map(|r| r.outcome())
            .map_err(|e| EngineError::Unavailable(e.to_string()))
    }

    fn name(&self) -> &'static str {
        "redis"
    }

    fn status(&self) -> EngineStatus {
        EngineStatus::Redis(Box::new(self.redis_status()))
    }
}

/// The connection affinity of a batch: a hash of its first counter key.
fn affinity(batch: &Batch) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    if let Some(c) = batch.charges.first() {
        c.key.as_str().hash(&mut h);
    }
    h.finish()
}
