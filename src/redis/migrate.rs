//! The move of an older layout's live windows to their current names
//! ([`super::keys`], "Layout versions"), run once per dataset by the first
//! replica that finds no live member of an older layout, before any
//! replica counts in the current one.
//!
//! One replica migrates at a time (a lock with a TTL, renewed as it goes
//! and checked: a migration that lost it stops); the others stay on their
//! leases until the `layout` key says the current layout is in place. The
//! key is set by the lock's holder only ([`LOCK_LUA`]), after membership
//! has seen no member of an older layout throughout the move. A large
//! keyspace is moved over several heartbeats, each going on from where
//! the last stopped. Each key moves in one script call ([`MIGRATE_LUA`]):
//! renamed, so its fields, fences and expiry are kept exactly, or merged
//! when the current name already exists. A migration cut short (Redis went
//! away, this replica stopped) is picked up by the next one: a key moved
//! is no longer found under its old name.

use std::time::Duration;

use fred::prelude::*;
use fred::types::Value;

use super::{keys, CallError, Redis};

/// The migration script.
pub const MIGRATE_LUA: &str = include_str!("migrate.lua");

/// The migration lock's script.
pub const LOCK_LUA: &str = include_str!("lock.lua");

/// How long the migration lock lives without renewal: a migrating replica
/// that dies holds up the others at most this long.
const LOCK_MS: u64 = 10_000;

/// Keys asked for per SCAN page.
const SCAN_COUNT: u32 = 1_000;

/// What a migration attempt found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Moved {
    pub renamed: u64,
    pub merged: u64,
}

/// What [`Redis::migrate_layout`] got to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayoutState {
    /// The current layout's windows are in place (the `layout` key says
    /// so): nothing to do.
    InPlace,
    /// Every older key found was moved; this replica still holds the lock,
    /// for [`Redis::mark_layout`].
    Moved(Moved),
    /// Moved some, not all, in the time given; go on from this cursor.
    Partial(Moved, String),
    /// Another replica holds the lock.
    Busy,
}

impl Redis {
    /// Moves the live windows of older layouts to their current names,
    /// unless the `layout` key says they are in place or another replica
    /// holds the lock. Goes on from `cursor` (a SCAN cursor, "0" to start)
    /// for at most `budget`, so a large keyspace is moved over several
    /// calls; a lock lost meanwhile stops it.
    pub async fn migrate_layout(
        &self,
        prefix: &str,
        nonce: &str,
        cursor: &str,
        budget: Duration,
    ) -> Result<LayoutState, CallError> {
        let [done, lock] = keys::layout_keys(prefix);
        let client = self.pool.next_connected();
        let mark: Option<String> = client.get(&done).await.map_err(call_error)?;
        if mark.as_deref() == Some(keys::LAYOUT.to_string().as_str()) {
            return Ok(LayoutState::InPlace);
        }
        if !self.lock_call(&lock, None, nonce, "take").await? {
            return Ok(LayoutState::Busy);
        }
        if self.is_cluster() {
            // The older layout never ran on a Cluster: nothing to move.
            return Ok(LayoutState::Moved(Moved::default()));
        }
        self.migrate_layout1(prefix, &lock, nonce, cursor, budget)
            .await
    }

    /// Records that the current layout's windows are in place and releases
    /// the lock, if this replica still holds it. False when it does not.
    pub async fn mark_layout(&self, prefix: &str, nonce: &str) -> Result<bool, CallError> {
        let [done, lock] = keys::layout_keys(prefix);
        self.lock_call(&lock, Some(&done), nonce, "mark").await
    }

    /// Releases the lock if this replica holds it.
    pub async fn release_layout_lock(&self, prefix: &str, nonce: &str) -> Result<bool, CallError> {
        let [_, lock] = keys::layout_keys(prefix);
        self.lock_call(&lock, None, nonce, "release").await
    }

    async fn lock_call(
        &self,
        lock: &str,
        done: Option<&str>,
        nonce: &str,
        action: &str,
    ) -> Result<bool, CallError> {
        let mut keys = vec![lock.to_owned()];
        let mut args = vec![
            Value::from(nonce),
            Value::from(action),
            Value::Integer(LOCK_MS as i64),
        ];
        if let Some(done) = done {
            keys.push(done.to_owned());
            args.push(Value::from(keys::LAYOUT.to_string()));
        }
        let reply = self
            .eval(
                &self.lock,
                keys,
                args,
                self.deadline.max(Duration::from_secs(2)),
                None,
            )
            .await?;
        Ok(super::integers(reply)?.first() == Some(&1))
    }

    async fn migrate_layout1(
        &self,
        prefix: &str,
        lock: &str,
        nonce: &str,
        from: &str,
        budget: Duration,
    ) -> Result<LayoutState, CallError> {
        let started = std::time::Instant::now();
        let client = self.pool.next_connected();
        let pattern = keys::layout1_pattern(prefix);
        let mut cursor = from.to_owned();
        let mut moved = Moved::default();
        loop {
            let page: (String, Vec<String>) = client
                .custom(
                    fred::cmd!("SCAN"),
                    vec![
                        cursor.clone(),
                        "MATCH".into(),
                        pattern.clone(),
                        "COUNT".into(),
                        SCAN_COUNT.to_string(),
                    ],
                )
                .await
                .map_err(call_error)?;
            for old in &page.1 {
                let Some(new) = keys::layout1_to_current(prefix, old) else {
                    continue;
                };
                let reply = self
                    .eval(
                        &self.migrate,
                        vec![old.clone(), new],
                        Vec::new(),
                        Duration::from_secs(2).max(self.deadline),
                        None,
                    )
                    .await?;
                match super::integers(reply)?.first() {
                    Some(1) => moved.renamed += 1,
                    Some(2) => moved.merged += 1,
                    _ => {}
                }
            }
            // Still ours: a migration whose lock lapsed must not run beside
            // the one that took it.
            if !self.lock_call(lock, None, nonce, "renew").await? {
                return Err(CallError::Redis(
                    "lost the layout migration's lock; another replica carries on".into(),
                ));
            }
            cursor = page.0;
            if cursor == "0" {
                return Ok(LayoutState::Moved(moved));
            }
            if started.elapsed() >= budget {
                return Ok(LayoutState::Partial(moved, cursor));
            }
        }
    }
}

fn call_error(e: fred::error::Error) -> CallError {
    match e.kind() {
        ErrorKind::IO | ErrorKind::Canceled | ErrorKind::Timeout => {
            CallError::Timeout(Duration::from_secs(0))
        }
        _ => CallError::Redis(e.to_string()),
    }
}
