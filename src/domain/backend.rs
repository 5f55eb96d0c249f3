//! The contract between the resilient engine and the shared store it
//! degrades from: decide a batch (with this replica's expected counts, for
//! data-loss detection), replay per-window fields, probe with a heartbeat,
//! and report membership. The Redis adapter implements it on top of
//! `crate::redis`; unit tests implement it with a scripted fake.

use std::time::Duration;

use async_trait::async_trait;

use super::{BatchOutcome, DecisionPath, ItemOutcome};
use crate::domain::Batch;
use crate::key::CounterKey;
use crate::limit::LimitSpec;

/// [`RawItem::own`]: the demand window (the previous one, or a demand
/// block's, see [`LimitSpec::demand_window`]) was read and some replica
/// decided off Redis in it, so it gives no demand share; or, in a demand
/// block, the current window has such marks, which voids the share the
/// replica holds.
pub const DEMAND_TROUBLED: i64 = -1;

/// [`RawItem::own`]: the call did not read the demand window.
pub const DEMAND_NOT_READ: i64 = -2;

/// One charge's part of a decision reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawItem {
    pub over: bool,
    pub remaining: u64,
    pub reset_ms: u64,
    /// This replica's count in the key's demand window (complete: the
    /// previous window, or a demand block's), for its demand share: [`DEMAND_TROUBLED`] when some replica decided off
    /// Redis in that window, [`DEMAND_NOT_READ`] when the call did not read
    /// it (the replica holds it already, or the algorithm keeps none).
    pub own: i64,
    /// The key's total in that window (0 with either mark above).
    pub total: i64,
    /// What the call changed this replica's field by (0 when denied).
    pub delta: i64,
    /// The store's time this charge was decided at, when it is not the
    /// reply's (a request decided across Redis Cluster slots, one call
    /// and one clock per slot); 0: the reply's `now_ms`.
    pub at_ms: u64,
}

impl RawItem {
    /// The store's time this charge was decided at.
    pub fn decided_at(&self, reply_now_ms: u64) -> u64 {
        if self.at_ms > 0 {
            self.at_ms
        } else {
            reply_now_ms
        }
    }
}

/// A decoded decision reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawReply {
    /// The store's time of the call.
    pub now_ms: u64,
    pub denied: bool,
    /// An own field was below what this replica knew: the store lost data.
    pub lost: bool,
    pub items: Vec<RawItem>,
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

/// Which of its fields replay sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayKind {
    /// `o<idx>`: cumulative grants made locally in the window.
    Local,
    /// `<idx>` and its fence: the confirmed Redis-path count.
    Repair,
    /// `h<idx>`: the part of this replica's lease for the window it has not
    /// granted yet. Decisions on Redis by the other replicas count it as
    /// used, so what a replica off Redis may still grant is not granted
    /// twice.
    Hold,
}

/// One (counter, window) field that replay sets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayEntry {
    pub key: CounterKey,
    pub spec: LimitSpec,
    pub window: u64,
    pub kind: ReplayKind,
    pub value: i64,
}

/// A failed call. `maybe_applied` is true when the store may still execute
/// (or has executed) the call: a timeout or a lost reply, as opposed to a
/// call that provably never left.
#[derive(Clone, Debug, thiserror::Error)]
pub enum CallError {
    #[error("Redis call timed out after {0:?}")]
    Timeout(Duration),
    #[error("Redis is not connected: {0}")]
    NotConnected(String),
    #[error("Redis error: {0}")]
    Redis(String),
    #[error("unexpected reply from Redis: {0}")]
    Reply(String),
    /// A Redis Cluster refused the call, for as long as it was retried,
    /// because its slot is being moved: it never ran, and Redis answered.
    #[error("Redis Cluster slot still moving: {0}")]
    SlotMoving(String),
}

impl CallError {
    pub fn maybe_applied(&self) -> bool {
        // Only a call that never left is known not to have run; an odd reply
        // may belong to a call that did.
        !matches!(self, CallError::NotConnected(_) | CallError::SlotMoving(_))
    }

    /// Whether the call says Redis is in trouble (the breaker counts it): a
    /// slot being moved is a busy Cluster, not a failing one.
    pub fn is_failure(&self) -> bool {
        !matches!(self, CallError::SlotMoving(_))
    }
}

/// Membership as last seen in the store.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Members {
    /// Live replicas (heartbeat within the TTL).
    pub live: usize,
    /// Times the store turned out to be a new dataset (lost its data).
    pub reregistrations: u64,
    /// Field indices of the other replicas seen within the hold-back
    /// horizon (live or not): whom a replica back from trouble presumes.
    pub peers: Vec<u64>,
    /// Field indices of replicas not deciding on Redis for longer than
    /// the TTL, within the hold-back horizon: they may be deciding on their
    /// leases.
    pub silent: Vec<u64>,
}

/// Replicas a decision call presumes to be deciding on their leases where
/// the store cannot see it, so that what they may grant is counted as used
/// (`decide.lua`, "presumed holds"). Empty on a healthy fleet.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Presume {
    /// Set while this replica had a Redis failure recently (since the start
    /// of the previous window of a charge): a number unique per failure
    /// episode of this incarnation. The store then counts every replica in
    /// `peers` as holding its share of each charge's window unless it has
    /// proved, since the latest such episode of any replica, that it
    /// decides that key on Redis with nothing unreplayed.
    pub episode: Option<u64>,
    pub peers: Vec<u64>,
    /// Replicas whose heartbeats stopped: held back in every window until
    /// the hold-back horizon has passed, whatever they proved before.
    pub silent: Vec<u64>,
    pub charges: Vec<PresumedCharge>,
}

/// One charge's part of [`Presume`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PresumedCharge {
    /// The fraction of the limit presumed per replica (0: none).
    pub fraction: f64,
    /// Whether this replica may prove itself in the charge's window: it
    /// granted nothing there that the store does not hold yet.
    pub prove: bool,
    /// This replica's own local count in the window that the store does
    /// not hold yet (its replay is due): counted as used.
    pub pending: i64,
    /// This replica already holds the demand share of the window before
    /// this one, so the store need not read that window for it (fixed
    /// windows; a sliding window reads it anyway for its count).
    pub demand_known: bool,
}

impl Presume {
    /// Whether the call carries anything to presume.
    pub fn is_active(&self) -> bool {
        (self.episode.is_some() && !self.peers.is_empty()) || !self.silent.is_empty()
    }
}

/// The store behind the resilient engine.
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// One decision within the call budget. `expected[i]` is this replica's
    /// confirmed (count, window) for charge i, count -1 when unknown;
    /// `presume` says whose unseen lease grants to count as used.
    async fn decide(
        &self,
        batch: &Batch,
        expected: &[(i64, u64)],
        presume: &Presume,
    ) -> Result<RawReply, CallError>;

    /// Sets this replica's fields for each (counter, window), behind a fresh
    /// fence; returns how many entries were live and written.
    async fn replay(&self, entries: &[ReplayEntry], budget: Duration) -> Result<u64, CallError>;

    /// A probe: one heartbeat round trip through the scripting path.
    /// `Ok(true)` when this replica holds a field index (may write).
    async fn probe(&self) -> Result<bool, CallError>;

    /// Membership as of the last heartbeat.
    fn members(&self) -> Members;

    /// Told on every breaker transition whether this replica now decides
    /// on Redis, so its heartbeats can say so to the others.
    fn deciding_on_redis(&self, _on: bool) {}

    /// A count of the store's answers to decision calls, rising each time
    /// one arrives, whether or not its caller is still waiting (a refusal
    /// that says "try again", such as a Cluster's for a slot being moved,
    /// counts). A store whose count rises is answering, not silent.
    fn heard(&self) -> u64 {
        0
    }

    /// Facts for /status (`"redis"` section).
    fn status(&self) -> serde_json::Value;
}
