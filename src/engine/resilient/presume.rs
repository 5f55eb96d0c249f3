//! Presumed holds: what a replica on Redis counts as used for the replicas
//! it cannot see deciding on their leases (`decide.lua` applies it).
//!
//! A replica off Redis grants on its lease and writes nothing until Redis
//! answers it again, so the replicas on Redis see those grants only after
//! its replay. Two cases, one mechanism:
//!
//! - **After trouble of its own** (a lease decision, a failed call, a trip)
//!   a replica presumes every peer (every member that beat within the
//!   hold-back horizon, live or not) to hold its share of each charge's window
//!   unless the peer has proved since that it decides the key on Redis with
//!   nothing unreplayed. Trouble with Redis is rarely one replica's alone (a
//!   flap, a restart, a network blip): whoever comes back first must not
//!   hand out what the others granted meanwhile. This lasts while the
//!   trouble is recent for the charge: since the start of the previous
//!   window, so a window that starts while a peer is still away is covered
//!   too. Proofs are per failure episode: a peer that proved and then went
//!   away again is presumed again once anyone announces a new episode.
//! - **Silent members** (not deciding on Redis for longer than the
//!   membership TTL: heartbeats stopped, or beating while still on their
//!   leases; within `membership_holdback_ms`) are presumed in every window
//!   by every replica until their first heartbeat back on Redis, after
//!   their replay: a replica cut off from
//!   Redis alone cannot tell a partition from an outage and keeps serving
//!   on its lease, so the fleet would otherwise admit L plus its share for
//!   as long as the partition lasts. Until its heartbeats have been missing
//!   for the membership TTL nobody can know, which is why the bound is L +
//!   its share for the TTL plus one window, and within [0.90 L, 1.05 L]
//!   after. A member that crashed costs its share for the horizon; one that
//!   stops cleanly leaves the membership and costs nothing.
//!
//! The presumed amount per member is `fraction × limit`, with `fraction`
//! what this replica's own share leaves to each of the others: `(1 − s) /
//! (N − 1)`. Under even load that is each member's lease; under skewed load
//! it spreads the others' part evenly, so a heavy member that is cut off may
//! still cost more than is held back for it (documented, not bounded). A
//! presumed member's own hold counts towards its presumption, not on top.
//! Only fixed and sliding windows are presumed; token buckets and sliding
//! logs keep their own bounds (see the engine's module docs).

use std::sync::atomic::Ordering;

use super::call::ALIVE_MS;
use super::lease::lease_share;
use super::ledger::window_of;
use super::ResilientEngine;
use crate::domain::backend::{Presume, PresumedCharge};
use crate::domain::Batch;
use crate::limit::Algorithm;

/// Who may be deciding unseen, as membership last said.
#[derive(Clone, Debug, Default)]
pub(super) struct Presence {
    pub peers: Vec<u64>,
    pub silent: Vec<u64>,
}

impl ResilientEngine {
    /// Something made this replica doubt Redis (it decided on a lease, a
    /// call failed, the breaker left healthy). Trouble after a calm of
    /// [`ALIVE_MS`] starts a new failure episode.
    pub(super) fn mark_trouble(&self, now_ms: u64) {
        let prev = self.last_trouble_ms.swap(now_ms.max(1), Ordering::Relaxed);
        if now_ms.saturating_sub(prev) > ALIVE_MS {
            self.episode.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The presumptions of one decision call; `pending[i]`: this replica's
    /// local count in charge i's window that Redis lacks, and whether it may
    /// prove itself there.
    pub(super) fn presume(
        &self,
        batch: &Batch,
        redis_now: u64,
        pending: &[(i64, bool, bool)],
    ) -> Presume {
        let trouble = self.last_trouble_ms.load(Ordering::Relaxed);
        let trouble_at = (trouble != 0).then(|| self.redis_now(trouble));
        let presence = self.presence.read();
        // A silent member may be live too (beating while off Redis): count
        // each member once.
        let unlisted = presence
            .silent
            .iter()
            .filter(|j| !presence.peers.contains(j))
            .count();
        let members = presence.peers.len() + unlisted + 1;
        let mut recent_any = false;
        let charges = batch
            .charges
            .iter()
            .zip(pending)
            .map(|(c, &(unreplayed, settled, demand_known))| {
                let windowed = matches!(
                    c.spec.algorithm,
                    Algorithm::FixedWindow | Algorithm::SlidingWindow
                );
                let unit = c.spec.unit.millis();
                let previous_start = window_of(&c.spec, redis_now).saturating_sub(1) * unit;
                let recent = trouble_at.is_some_and(|t| t >= previous_start);
                recent_any |= recent && windowed;
                let presumes = windowed
                    && members > 1
                    && (!presence.silent.is_empty() || (recent && !presence.peers.is_empty()));
                let fraction = if presumes {
                    let (demand, _) = self.ledger.lease_inputs(&c.key, &c.spec, redis_now);
                    let own = lease_share(demand, members, self.cfg.lease_min_share);
                    ((1.0 - own) / (members - 1) as f64).max(0.0)
                } else {
                    0.0
                };
                PresumedCharge {
                    fraction,
                    prove: settled,
                    // Only what adds to the count. A take-back not written
                    // yet (a wrongly denied request's grant, folded back)
                    // makes this negative, and the call may run after the
                    // replay has written it: subtracted again there, it
                    // would free the grant twice and admit past the limit
                    // (seen: a limit of 1 admitted twice under the default
                    // budget). Until written, Redis counts the grant as used.
                    // A positive count that went stale only over-counts.
                    pending: unreplayed.max(0),
                    demand_known,
                }
            })
            .collect();
        Presume {
            episode: recent_any.then(|| self.episode.load(Ordering::Relaxed)),
            peers: if recent_any {
                presence.peers.clone()
            } else {
                Vec::new()
            },
            silent: presence.silent.clone(),
            charges,
        }
    }
}
