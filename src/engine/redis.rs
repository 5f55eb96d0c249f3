//! The Redis engine: one script call per request evaluates every charge
//! atomically and all-or-nothing on Redis time (`redis.call('TIME')`), so any
//! number of replicas enforce one limit exactly and replica clock skew
//! changes nothing.
//!
//! # Counting twice is impossible by construction
//!
//! Every counter window is a hash with one field per replica (its net
//! count); the total is their sum (layout in [`crate::redis::keys`]). A
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

use async_trait::async_trait;

use super::{Batch, BatchOutcome, CounterKey, DecisionPath, Engine, EngineError, ItemOutcome};
use crate::limit::{Algorithm, Role};
use crate::redis::membership::Membership;
use crate::redis::{keys, CallError, Redis};

/// Hits above this are clamped before they reach Lua (whose numbers are
/// doubles and whose integer formatting stops at 10^14): such a charge is
/// over any u32 limit anyway.
pub const MAX_HITS: u64 = 1_000_000_000_000;

pub struct RedisEngine {
    redis: Arc<Redis>,
    membership: Arc<Membership>,
    prefix: String,
    margin_ms: u64,
    epoch: AtomicU64,
    calls: AtomicU64,
    /// Distinguishes this incarnation's call ids from a previous one's.
    boot: String,
}

fn algorithm_code(a: Algorithm) -> u8 {
    match a {
        Algorithm::FixedWindow => 1,
        Algorithm::SlidingWindow => 2,
        Algorithm::SlidingLog => 3,
        Algorithm::TokenBucket => 4,
    }
}

fn role_code(r: Role) -> u8 {
    match r {
        Role::Enforce => 0,
        Role::Shadow => 1,
        Role::Quota => 2,
    }
}

/// One charge's part of a script reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawItem {
    pub over: bool,
    pub remaining: u64,
    pub reset_ms: u64,
    /// This replica's count for the key's window(s) after the call; -1 when
    /// the algorithm keeps none (sliding log).
    pub own: i64,
    pub total: i64,
    /// What the call changed this replica's field by (0 when denied).
    pub delta: i64,
}

/// A decoded script reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawReply {
    /// Redis time of the call.
    pub now_ms: u64,
    pub denied: bool,
    /// An own field was below what this replica knew: Redis lost data.
    pub lost: bool,
    pub items: Vec<RawItem>,
}

/// Which of its fields replay sets (see `replay.lua`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayKind {
    /// `o<idx>`: cumulative grants made locally in the window.
    Local,
    /// `<idx>` and its fence: the confirmed Redis-path count.
    Repair,
}

impl RawReply {
    /// The decision part of the reply.
    pub fn outcome(&self) -> BatchOutcome {
        BatchOutcome {
            items: self
                .items
                .iter()
                .map(|i| ItemOutcome {
                    over: i.over,
                    remaining: i.remaining,
                    reset_ms: i.reset_ms,
                })
                .collect(),
            denied: self.denied,
            path: DecisionPath::Redis,
        }
    }
}

/// One (counter, window) field that replay sets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayEntry {
    pub key: CounterKey,
    pub spec: crate::limit::LimitSpec,
    pub window: u64,
    pub kind: ReplayKind,
    pub value: i64,
}

/// Replay entries per script call (one call holds one hash slot's keys).
const REPLAY_BATCH: usize = 200;

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
        }
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

    fn args(
        &self,
        batch: &Batch,
        index: u64,
        expected: &[(i64, u64)],
    ) -> (Vec<String>, Vec<String>) {
        let keys = batch
            .charges
            .iter()
            .map(|c| keys::counter_base(&self.prefix, &c.key))
            .collect();
        let call = self.calls.fetch_add(1, Ordering::Relaxed);
        let mut args = Vec::with_capacity(5 + 8 * batch.charges.len());
        args.push(index.to_string());
        args.push(self.epoch().to_string());
        args.push(if batch.never_deny { "1" } else { "0" }.to_string());
        args.push(self.margin_ms.to_string());
        args.push(format!("{}.{call}", self.boot));
        for (i, c) in batch.charges.iter().enumerate() {
            args.push(algorithm_code(c.spec.algorithm).to_string());
            args.push(c.spec.requests_per_unit.to_string());
            args.push(c.spec.unit.millis().to_string());
            args.push(c.spec.burst.to_string());
            args.push(c.hits.min(MAX_HITS).to_string());
            args.push((u8::from(c.refund) + 2 * role_code(c.role)).to_string());
            let (count, window) = expected.get(i).copied().unwrap_or((-1, 0));
            args.push(count.to_string());
            args.push(window.to_string());
        }
        (keys, args)
    }

    async fn call(
        &self,
        batch: &Batch,
        index: u64,
        expected: &[(i64, u64)],
    ) -> Result<Vec<i64>, CallError> {
        let (keys, args) = self.args(batch, index, expected);
        let result = self.redis.decide(keys, args).await;
        if let Err(e) = &result {
            if e.maybe_applied() {
                // This call may still run: later rewrites must fence it out.
                self.epoch.fetch_add(1, Ordering::SeqCst);
            }
        }
        result
    }

    /// One decision in Redis. `expected[i]` is this replica's confirmed
    /// count for charge i in a window (-1 unknown), for data-loss detection.
    pub async fn decide_raw(
        &self,
        batch: &Batch,
        expected: &[(i64, u64)],
    ) -> Result<RawReply, CallError> {
        let Some(index) = self.membership.index() else {
            return Err(CallError::NotConnected(
                "this replica is not registered with Redis yet".into(),
            ));
        };
        let mut reply = self.call(batch, index, expected).await?;
        if reply.first() == Some(&-1) {
            // Fenced: a rewrite happened after this call's epoch was read.
            reply = self.call(batch, index, expected).await?;
            if reply.first() == Some(&-1) {
                return Err(CallError::Reply(
                    "call fenced twice by a concurrent rewrite".into(),
                ));
            }
        }
        let n = batch.charges.len();
        if reply.len() != 4 + 6 * n {
            return Err(CallError::Reply(format!(
                "script reply has {} items, expected {}",
                reply.len(),
                4 + 6 * n
            )));
        }
        let mut items = Vec::with_capacity(n);
        for i in 0..n {
            let r = &reply[4 + 6 * i..10 + 6 * i];
            items.push(RawItem {
                over: r[0] == 1,
                remaining: r[1].max(0) as u64,
                reset_ms: r[2].max(0) as u64,
                own: r[3],
                total: r[4],
                delta: r[5],
            });
        }
        Ok(RawReply {
            now_ms: reply[1].max(0) as u64,
            denied: reply[2] == 1,
            lost: reply[3] == 1,
            items,
        })
    }

    /// Sets this replica's fields for each (counter, window); repairs are
    /// fenced at a fresh epoch. Returns how many entries were still live and
    /// written.
    pub async fn replay(
        &self,
        entries: &[ReplayEntry],
        deadline: std::time::Duration,
    ) -> Result<u64, CallError> {
        let Some(index) = self.membership.index() else {
            return Err(CallError::NotConnected(
                "this replica is not registered with Redis yet".into(),
            ));
        };
        let epoch = self.bump_epoch();
        // Group by hash tag (the domain) so each call stays in one slot.
        let mut groups: HashMap<&str, Vec<&ReplayEntry>> = HashMap::new();
        for e in entries {
            let s = e.key.as_str();
            let tag = &s[..s.find(['|', '#']).unwrap_or(s.len())];
            groups.entry(tag).or_default().push(e);
        }
        let mut applied = 0;
        for group in groups.values() {
            for chunk in group.chunks(REPLAY_BATCH) {
                let keys = chunk
                    .iter()
                    .map(|e| keys::counter_base(&self.prefix, &e.key))
                    .collect();
                let mut args = vec![
                    index.to_string(),
                    epoch.to_string(),
                    self.margin_ms.to_string(),
                ];
                for e in chunk {
                    args.push(
                        match e.kind {
                            ReplayKind::Local => "1",
                            ReplayKind::Repair => "2",
                        }
                        .to_string(),
                    );
                    args.push(algorithm_code(e.spec.algorithm).to_string());
                    args.push(e.spec.unit.millis().to_string());
                    args.push(e.window.to_string());
                    args.push(e.value.to_string());
                    args.push(e.spec.requests_per_unit.to_string());
                    args.push(e.spec.burst.to_string());
                }
                let reply = self.redis.replay(keys, args, deadline).await?;
                applied += reply.first().copied().unwrap_or(0).max(0) as u64;
            }
        }
        Ok(applied)
    }
}

fn unavailable(e: CallError) -> EngineError {
    EngineError::Unavailable(e.to_string())
}

#[async_trait]
impl Engine for RedisEngine {
    async fn apply(&self, batch: &Batch) -> Result<BatchOutcome, EngineError> {
        Ok(self
            .decide_raw(batch, &[])
            .await
            .map_err(unavailable)?
            .outcome())
    }

    fn name(&self) -> &'static str {
        "redis"
    }

    fn status(&self) -> serde_json::Value {
        serde_json::json!({
            "engine": "redis",
            "redis": self.redis.display_url,
            "replica_id": self.membership.id(),
            "membership": self.membership.state(),
            "epoch": self.epoch(),
        })
    }
}
