//! The move of an older layout's live windows to their current names
//! ([`super::keys`], "Layout versions"), run once per dataset by the first
//! replica that finds no live member of an older layout, before any
//! replica counts in the current one.
//!
//! One replica migrates at a time (a lock with a TTL, renewed as it goes);
//! the others stay on their leases until the `layout` key says the current
//! layout is in place. Each key moves in one script call ([`MIGRATE_LUA`]):
//! renamed, so its fields, fences and expiry are kept exactly, or merged
//! when the current name already exists. A migration cut short (Redis went
//! away, this replica stopped) is picked up by the next one: a key moved
//! is no longer found under its old name.

use std::time::Duration;

use fred::prelude::*;

use super::{keys, CallError, Redis};

/// The migration script.
pub const MIGRATE_LUA: &str = include_str!("migrate.lua");

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

/// What [`Redis::ensure_layout`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutState {
    /// The current layout's windows are in place.
    Ready(Moved),
    /// Another replica is migrating.
    Busy,
}

impl Redis {
    /// Makes sure the live windows of older layouts are in their current
    /// place: nothing to do when the `layout` key says so; otherwise
    /// migrates, unless another replica holds the lock.
    pub async fn ensure_layout(&self, prefix: &str, nonce: &str) -> Result<LayoutState, CallError> {
        let [done, lock] = keys::layout_keys(prefix);
        let client = self.pool.next_connected();
        let current = keys::LAYOUT.to_string();
        let mark: Option<String> = client.get(&done).await.map_err(call_error)?;
        if mark.as_deref() == Some(current.as_str()) {
            return Ok(LayoutState::Ready(Moved::default()));
        }
        let locked: Option<String> = client
            .set(
                &lock,
                nonce,
                Some(Expiration::PX(LOCK_MS as i64)),
                Some(SetOptions::NX),
                false,
            )
            .await
            .map_err(call_error)?;
        if locked.is_none() {
            let holder: Option<String> = client.get(&lock).await.map_err(call_error)?;
            if holder.as_deref() != Some(nonce) {
                return Ok(LayoutState::Busy);
            }
        }
        let moved = if self.is_cluster() {
            // The older layout never ran on a Cluster: nothing to move.
            Moved::default()
        } else {
            self.migrate_layout1(prefix, &lock).await?
        };
        let _: () = client
            // Like the registry: kept while replicas beat (members.lua),
            // gone a day after the last.
            .set(
                &done,
                current,
                Some(Expiration::PX(86_400_000)),
                None,
                false,
            )
            .await
            .map_err(call_error)?;
        let _: i64 = client.del(&lock).await.map_err(call_error)?;
        Ok(LayoutState::Ready(moved))
    }

    async fn migrate_layout1(&self, prefix: &str, lock: &str) -> Result<Moved, CallError> {
        let client = self.pool.next_connected();
        let pattern = keys::layout1_pattern(prefix);
        let mut cursor = "0".to_owned();
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
            // Still ours: a migration that outlives its lock must not run
            // beside another one.
            let _: bool = client
                .pexpire(lock, LOCK_MS as i64, None)
                .await
                .map_err(call_error)?;
            cursor = page.0;
            if cursor == "0" {
                return Ok(moved);
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
