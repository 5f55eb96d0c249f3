//! Replica membership: each replica heartbeats (id, last seen) into Redis, so
//! every replica knows how many live replicas share a limit, and owns its id
//! exclusively through an owner key holding its incarnation nonce: a second
//! live process with the same id is refused, because two writers of one
//! counter field would corrupt replay.
//!
//! Each beat also announces this replica's key layout and learns the live
//! members' ([`super::keys`], "Layout versions"): while one of them counts
//! in an older layout, or the older layout's windows have not been moved
//! yet ([`super::migrate`]), this replica holds no index to count with, so
//! it decides on its lease, and its beats say "held" so the others hold
//! its share back.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fred::prelude::Value;
use parking_lot::RwLock;
use serde::Serialize;
use tokio::sync::watch;

use super::migrate::{LayoutState, Moved};
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
    /// The key layout this replica counts in.
    pub layout: u32,
    /// Live members that count in an older layout (`id (layout n)`): this
    /// replica does not count on Redis while there are any.
    pub older_layouts: Vec<String>,
    /// Live members that count in a newer layout: they wait for this one.
    pub newer_layouts: Vec<String>,
    /// The current layout's windows are in place (migrated or nothing to
    /// migrate).
    pub layout_ready: bool,
    /// Keys moved from an older layout by this replica.
    pub migrated_keys: u64,
}

/// The live members announcing an older and a newer layout than `mine`
/// (`id (layout n)` each), from the ids and layouts of a beat's reply.
fn compare_layouts(live: &[String], layouts: &[u64], mine: u32) -> (Vec<String>, Vec<String>) {
    let mut older = Vec::new();
    let mut newer = Vec::new();
    for (id, &layout) in live.iter().zip(layouts) {
        let described = format!("{id} (layout {layout})");
        match layout.cmp(&u64::from(mine)) {
            std::cmp::Ordering::Less => older.push(described),
            std::cmp::Ordering::Greater => newer.push(described),
            std::cmp::Ordering::Equal => {}
        }
    }
    (older, newer)
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
    prefix: String,
    keys: [String; 9],
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
    /// Held while a migration runs, so beats from the heartbeat loop and
    /// from a probe never start two.
    migrating: tokio::sync::Mutex<()>,
    /// Bumped by every beat that sees a live member of an older layout: a
    /// move that ran meanwhile is not marked done.
    layout_generation: std::sync::atomic::AtomicU64,
    /// Where the move of an older layout's windows goes on from.
    migration_cursor: parking_lot::Mutex<String>,
}

/// The layout this replica announces: [`keys::LAYOUT`]; test builds only
/// may announce another (`LH_FAULT_LAYOUT`), so the tests can run replicas
/// of two layouts with one binary.
fn announced_layout() -> u32 {
    #[cfg(debug_assertions)]
    if let Some(n) = std::env::var("LH_FAULT_LAYOUT")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return n;
    }
    keys::LAYOUT
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
            prefix: prefix.to_owned(),
            redis,
            id,
            nonce,
            ttl,
            every,
            holdback,
            on_redis: AtomicBool::new(true),
            state: RwLock::new(MemberState {
                layout: announced_layout(),
                ..MemberState::default()
            }),
            migrating: tokio::sync::Mutex::new(()),
            layout_generation: std::sync::atomic::AtomicU64::new(0),
            migration_cursor: parking_lot::Mutex::new("0".to_owned()),
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

    /// The field index to count with: None while another incarnation
    /// owns the id, or the layout keeps this replica off Redis.
    pub fn index(&self) -> Option<u64> {
        let s = self.state.read();
        (s.conflict.is_none() && s.older_layouts.is_empty() && s.layout_ready)
            .then_some(s.index)
            .flatten()
    }

    /// Why [`Membership::index`] is None, for errors and /status.
    pub fn not_counting_reason(&self) -> String {
        let s = self.state.read();
        if let Some(other) = &s.conflict {
            format!(
                "replica id '{}' is owned by another live incarnation ({other})",
                self.id
            )
        } else if !s.older_layouts.is_empty() {
            format!(
                "live replicas count in an older key layout than this one's ({}): {}; this replica decides on its lease until they have left",
                s.layout,
                s.older_layouts.join(", ")
            )
        } else if s.index.is_some() && !s.layout_ready {
            "the older layout's windows are being moved to their current names".to_owned()
        } else {
            "this replica is not registered with Redis yet".to_owned()
        }
    }

    async fn call(&self, action: &str) -> Result<Vec<Value>, CallError> {
        let args = super::scripts::members_args(
            &self.id,
            &self.nonce,
            self.ttl.as_millis(),
            action,
            self.state.read().index.unwrap_or(0),
            self.holdback.as_millis(),
            self.state.read().layout,
        );
        // Membership is off the request path: give it a budget that a slow
        // but healthy Redis meets.
        let budget = self.every.max(self.redis.deadline());
        self.redis.members(self.keys.to_vec(), args, budget).await
    }

    /// One heartbeat: registers or refreshes, and updates the live list.
    pub async fn beat(&self) -> Result<(), MembershipError> {
        // Until its layout is known to be in place a replica counts
        // nothing on Redis, so it says so from its very first beat.
        let held = {
            let s = self.state.read();
            !s.older_layouts.is_empty() || !s.layout_ready
        };
        let action = if held {
            "held"
        } else if self.on_redis.load(Ordering::Relaxed) {
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
                let live: Vec<String> = list(4).iter().filter_map(|v| v.as_string()).collect();
                let numbers = |i: usize| -> Vec<u64> {
                    list(i)
                        .iter()
                        .filter_map(|v| v.as_i64())
                        .map(|v| v.max(0) as u64)
                        .collect()
                };
                let incarnation = reply.get(3).and_then(|v| v.as_string());
                let (older, newer) = compare_layouts(&live, &numbers(8), self.layout());
                let migrate = {
                    let mut s = self.state.write();
                    if s.incarnation.is_some()
                        && incarnation.is_some()
                        && s.incarnation != incarnation
                    {
                        s.reregistrations += 1;
                        tracing::warn!(replica_id = %self.id, "Redis is a new dataset (restarted empty or failed over): its data is lost");
                    }
                    if incarnation.is_some() {
                        s.incarnation = incarnation;
                    }
                    if older != s.older_layouts {
                        if older.is_empty() {
                            tracing::info!(replica_id = %self.id, "no live replica counts in an older key layout any more");
                        } else {
                            tracing::error!(replica_id = %self.id, layout = s.layout, older = ?older, "live replicas count in an older key layout: deciding on leases until they have left, then moving their windows to the current layout");
                        }
                    }
                    if newer != s.newer_layouts && !newer.is_empty() {
                        tracing::warn!(replica_id = %self.id, layout = s.layout, newer = ?newer, "live replicas count in a newer key layout; they decide on their leases until this replica has left (an upgrade in progress)");
                    }
                    if !older.is_empty() {
                        // Their windows must be moved again once they have left.
                        s.layout_ready = false;
                        self.layout_generation.fetch_add(1, Ordering::SeqCst);
                    }
                    s.older_layouts = older;
                    s.newer_layouts = newer;
                    s.index = int(reply.get(1)).map(|i| i as u64);
                    s.last_beat_ms = int(reply.get(2)).map(|i| i as u64);
                    s.live = live;
                    s.live_indices = numbers(5);
                    s.silent_indices = numbers(6);
                    s.known_indices = numbers(7);
                    s.conflict = None;
                    s.last_error = None;
                    s.older_layouts.is_empty() && !s.layout_ready
                };
                if migrate {
                    self.ensure_layout().await?;
                }
                Ok(())
            }
            _ => {
                let other = reply.get(1).and_then(|v| v.as_string()).unwrap_or_default();
                self.state.write().conflict = Some(other);
                Err(MembershipError::Conflict(self.id.clone()))
            }
        }
    }

    fn layout(&self) -> u32 {
        self.state.read().layout
    }

    /// Moves an older layout's windows when no live member counts in it
    /// any more (or finds them moved), a heartbeat's worth at a time; until
    /// they are in place this replica has no index to count with. The move
    /// is marked done only if no beat saw a member of an older layout while
    /// it ran (one that starts in its last heartbeat is seen at the next,
    /// which unmarks it, and its windows are moved again once it leaves).
    async fn ensure_layout(&self) -> Result<(), MembershipError> {
        let Ok(_running) = self.migrating.try_lock() else {
            return Ok(());
        };
        let generation = self.layout_generation.load(Ordering::SeqCst);
        let cursor = self.migration_cursor.lock().clone();
        let budget = self.every.max(Duration::from_secs(1));
        let attempt = self
            .redis
            .migrate_layout(&self.prefix, &self.nonce, &cursor, budget);
        // Bounded even if Redis stops answering in the middle of a page.
        let state = match tokio::time::timeout(budget * 4, attempt).await {
            Ok(r) => r?,
            Err(_) => return Ok(()),
        };
        let moved = match state {
            LayoutState::InPlace => {
                self.state.write().layout_ready = true;
                return Ok(());
            }
            LayoutState::Busy => return Ok(()),
            LayoutState::Partial(moved, next) => {
                *self.migration_cursor.lock() = next;
                self.count_moved(moved);
                return Ok(());
            }
            LayoutState::Moved(moved) => moved,
        };
        self.count_moved(moved);
        *self.migration_cursor.lock() = "0".to_owned();
        let unchanged = generation == self.layout_generation.load(Ordering::SeqCst)
            && self.state.read().older_layouts.is_empty();
        if unchanged && self.redis.mark_layout(&self.prefix, &self.nonce).await? {
            let mut s = self.state.write();
            if s.migrated_keys > 0 {
                tracing::info!(replica_id = %self.id, moved = s.migrated_keys, layout = s.layout, "the older layout's live windows are in their current place");
            }
            s.layout_ready = true;
        } else {
            self.redis
                .release_layout_lock(&self.prefix, &self.nonce)
                .await?;
        }
        Ok(())
    }

    fn count_moved(&self, moved: Moved) {
        self.state.write().migrated_keys += moved.renamed + moved.merged;
    }

    /// Startup registration. A conflict is retried for a little longer than
    /// the TTL (a crashed predecessor's claim expires by then) and is then
    /// fatal. Redis being unreachable is not fatal: the heartbeat loop keeps
    /// trying.
    pub async fn register(&self) -> Result<(), MembershipError> {
        let start = Instant::now();
        loop {
            match self.beat().await {
                Ok(()) => {
                    if self.index().is_some() {
                        // The first beat said "held" (the layout was not
                        // known yet); say at once that it decides on Redis.
                        let _ = self.beat().await;
                    }
                    return Ok(());
                }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_of_other_layouts_are_told_apart() {
        let live = ["a", "b", "c", "d"].map(String::from);
        let (older, newer) = compare_layouts(&live, &[2, 1, 3, 2], 2);
        assert_eq!(older, ["b (layout 1)"]);
        assert_eq!(newer, ["c (layout 3)"]);
        assert_eq!(compare_layouts(&live, &[2, 2, 2, 2], 2), (vec![], vec![]));
    }
}
