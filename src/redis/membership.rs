//! Replica membership: each replica heartbeats (id, last seen) into Redis, so
//! every replica knows how many live replicas share a limit, and owns its id
//! exclusively through an owner key holding its incarnation nonce: a second
//! live process with the same id is refused, because two writers of one
//! counter field would corrupt replay.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fred::prelude::Value;
use parking_lot::RwLock;
use serde::Serialize;
use tokio::sync::watch;

use super::{keys, CallError, Redis};

/// What this replica knows about membership.
#[derive(Clone, Debug, Default, Serialize)]
pub struct MemberState {
    /// This replica's field index in counter hashes, once registered.
    pub index: Option<u64>,
    /// Live replica ids (heartbeat within the TTL), as of the last beat.
    pub live: Vec<String>,
    /// Their field indices.
    pub live_indices: Vec<u64>,
    /// Field indices of members whose heartbeats stopped within the
    /// hold-back horizon (see `membership_holdback_ms`).
    pub silent_indices: Vec<u64>,
    /// Field indices of every member that beat within the hold-back
    /// horizon (the TTL at least), live or not.
    pub known_indices: Vec<u64>,
    /// Redis time of the last successful beat.
    pub last_beat_ms: Option<u64>,
    /// Set when another live incarnation owns this id.
    pub conflict: Option<String>,
    pub last_error: Option<String>,
    /// The Redis dataset's incarnation token, as of the last beat.
    pub incarnation: Option<String>,
    /// Times the incarnation changed: each one means Redis lost its data.
    pub reregistrations: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum MembershipError {
    #[error("replica id '{0}' is already used by a live replica (another process heartbeats it); choose a distinct --replica-id")]
    Conflict(String),
    #[error(transparent)]
    Call(#[from] CallError),
}

pub struct Membership {
    redis: Arc<Redis>,
    keys: [String; 7],
    id: String,
    nonce: String,
    ttl: Duration,
    every: Duration,
    holdback: Duration,
    /// Whether this replica decides on Redis (its breaker is healthy): a
    /// beat made while it does not keeps it live but not "on Redis", so the
    /// others keep holding back its share (see members.lua).
    on_redis: AtomicBool,
    state: RwLock<MemberState>,
}

impl Membership {
    pub fn new(
        redis: Arc<Redis>,
        prefix: &str,
        id: String,
        nonce: String,
        every: Duration,
        ttl: Duration,
        holdback: Duration,
    ) -> Self {
        Membership {
            keys: keys::membership(prefix, &id),
            redis,
            id,
            nonce,
            ttl,
            every,
            holdback,
            on_redis: AtomicBool::new(true),
            state: RwLock::new(MemberState::default()),
        }
    }

    /// Says whether this replica decides on Redis; later beats report it.
    pub fn set_on_redis(&self, on: bool) {
        self.on_redis.store(on, Ordering::Relaxed);
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn state(&self) -> MemberState {
        self.state.read().clone()
    }

    pub fn index(&self) -> Option<u64> {
        let s = self.state.read();
        s.conflict.is_none().then_some(s.index).flatten()
    }

    async fn call(&self, action: &str) -> Result<Vec<Value>, CallError> {
        let args = super::scripts::members_args(
            &self.id,
            &self.nonce,
            self.ttl.as_millis(),
            action,
            self.state.read().index.unwrap_or(0),
            self.holdback.as_millis(),
        );
        // Membership is off the request path: give it a budget that a slow
        // but healthy Redis meets.
        let budget = self.every.max(self.redis.deadline());
        self.redis.members(self.keys.to_vec(), args, budget).await
    }

    /// One heartbeat: registers or refreshes, and updates the live list.
    pub async fn beat(&self) -> Result<(), MembershipError> {
        let action = if self.on_redis.load(Ordering::Relaxed) {
            "beat"
        } else {
            "away"
        };
        let reply = match self.call(action).await {
            Ok(r) => r,
            Err(e) => {
                self.state.write().last_error = Some(e.to_string());
                return Err(e.into());
            }
        };
        let int = |v: Option<&Value>| v.and_then(|v| v.as_i64());
        match int(reply.first()) {
            Some(1) => {
                let list = |i: usize| match reply.get(i) {
                    Some(Value::Array(items)) => items.clone(),
                    _ => Vec::new(),
                };
                let live = list(4).iter().filter_map(|v| v.as_string()).collect();
                let numbers = |i: usize| -> Vec<u64> {
                    list(i)
                        .iter()
                        .filter_map(|v| v.as_i64())
                        .map(|v| v.max(0) as u64)
                        .collect()
                };
                let incarnation = reply.get(3).and_then(|v| v.as_string());
                let mut s = self.state.write();
                if s.incarnation.is_some() && incarnation.is_some() && s.incarnation != incarnation
                {
                    s.reregistrations += 1;
                    tracing::warn!(replica_id = %self.id, "Redis is a new dataset (restarted empty or failed over): its data is lost");
                }
                if incarnation.is_some() {
                    s.incarnation = incarnation;
                }
                s.index = int(reply.get(1)).map(|i| i as u64);
                s.last_beat_ms = int(reply.get(2)).map(|i| i as u64);
                s.live = live;
                s.live_indices = numbers(5);
                s.silent_indices = numbers(6);
                s.known_indices = numbers(7);
                s.conflict = None;
                s.last_error = None;
                Ok(())
            }
            _ => {
                let other = reply.get(1).and_then(|v| v.as_string()).unwrap_or_default();
                self.state.write().conflict = Some(other);
                Err(MembershipError::Conflict(self.id.clone()))
            }
        }
    }

    /// Startup registration. A conflict is retried for a little longer than
    /// the TTL (a crashed predecessor's claim expires by then) and is then
    /// fatal. Redis being unreachable is not fatal: the heartbeat loop keeps
    /// trying.
    pub async fn register(&self) -> Result<(), MembershipError> {
        let start = Instant::now();
        loop {
            match self.beat().await {
                Ok(()) => return Ok(()),
                Err(MembershipError::Conflict(id)) => {
                    if start.elapsed() > self.ttl + self.ttl / 2 {
                        return Err(MembershipError::Conflict(id));
                    }
                    tracing::warn!(replica_id = %self.id, "replica id is held by another live incarnation; waiting for it to expire");
                    tokio::time::sleep(self.every).await;
                }
                Err(MembershipError::Call(e)) => {
                    tracing::warn!(error = %e, "cannot register with Redis yet; will keep trying");
                    return Ok(());
                }
            }
        }
    }

    /// Heartbeats until `stop`, then leaves.
    pub async fn run(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let mut tick = tokio::time::interval(self.every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut healthy = true;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.wait_for(|s| *s) => break,
            }
            match self.beat().await {
                Ok(()) => {
                    if !healthy {
                        tracing::info!(replica_id = %self.id, "membership heartbeat restored");
                    }
                    healthy = true;
                }
                Err(MembershipError::Conflict(_)) => {
                    tracing::error!(replica_id = %self.id, "another live replica uses this id; not writing to Redis under it");
                    healthy = false;
                }
                Err(e) => {
                    if healthy {
                        tracing::warn!(error = %e, "membership heartbeat failed");
                    }
                    healthy = false;
                }
            }
        }
        let _ = self.call("leave").await;
    }
}
