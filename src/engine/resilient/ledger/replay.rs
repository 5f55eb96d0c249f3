//! The replay plan: local usage Redis has not confirmed, holds to write,
//! and fenced repairs of quiet suspect keys; and marking a plan done.

use super::{window_live, window_of, Ledger, Planned};
use crate::domain::backend::{ReplayEntry, ReplayKind};
use std::sync::atomic::Ordering;

impl Ledger {
    /// What to replay now: local usage Redis has not confirmed, and repairs
    /// of suspect keys whose last Redis call is at least `quiet_ms` old (none
    /// can still be in flight). Also returns how many suspect keys are still
    /// waiting for quiet.
    pub fn replay_plan(
        &self,
        now_ms: u64,
        redis_now_ms: u64,
        quiet_ms: u64,
        margin_ms: u64,
    ) -> (Vec<Planned>, usize) {
        let mut plan = Vec::new();
        let mut waiting = 0;
        for i in 0..self.shard_count() {
            waiting +=
                self.replay_plan_shard(i, now_ms, redis_now_ms, quiet_ms, margin_ms, &mut plan);
        }
        (plan, waiting)
    }

    /// [`Self::replay_plan`] of one shard: its plan is added to `plan`, and
    /// it returns how many of its suspect keys wait for quiet.
    pub fn replay_plan_shard(
        &self,
        i: usize,
        now_ms: u64,
        redis_now_ms: u64,
        quiet_ms: u64,
        margin_ms: u64,
        plan: &mut Vec<Planned>,
    ) -> usize {
        let mut waiting = 0;
        if let Some(shard) = self.shards.get(i) {
            for (key, e) in shard.lock().iter() {
                if !e.needs_replay() {
                    continue;
                }
                let repairs =
                    e.suspect && e.calls_in_flight == 0 && now_ms >= e.last_issue_ms + quiet_ms;
                if e.suspect && !repairs {
                    waiting += 1;
                }
                let mut entries = Vec::new();
                for w in e
                    .windows
                    .iter()
                    .filter(|w| window_live(&e.spec, w.window, redis_now_ms, margin_ms))
                {
                    if w.unsure || w.local_own != w.local_replayed {
                        entries.push(ReplayEntry {
                            key: key.clone(),
                            spec: e.spec,
                            window: w.window,
                            kind: ReplayKind::Local,
                            value: w.local_own,
                        });
                    }
                    if w.unsure || w.hold != w.hold_written {
                        entries.push(ReplayEntry {
                            key: key.clone(),
                            spec: e.spec,
                            window: w.window,
                            kind: ReplayKind::Hold,
                            value: w.hold,
                        });
                    }
                    if repairs {
                        entries.push(ReplayEntry {
                            key: key.clone(),
                            spec: e.spec,
                            window: w.window,
                            kind: ReplayKind::Repair,
                            value: w.redis_own,
                        });
                    }
                }
                if let (true, Some(unsure)) = (repairs, e.unsure_from_ms) {
                    // A call that made the key suspect can have landed in a
                    // window where no call of this replica was confirmed (so
                    // the ledger has no tally there): its field is 0 of
                    // confirmed deltas, fenced like the others. Such a call
                    // was sent at `unsure_from_ms` or later and can run until
                    // `quiet_ms` after the key's last call (twice that from
                    // `unsure_from_ms`, which is early by a deadline, should
                    // the entry have been evicted and made anew meanwhile).
                    // Only where the tallies are complete: a window that began
                    // after the entry was made, or after this process began
                    // counting with no key's counts lost since. Elsewhere
                    // (a previous run of this replica, an evicted entry)
                    // the field may hold confirmed counts this entry never
                    // saw, and it is left as it is: Redis then counts too
                    // much rather than too little.
                    let offset = redis_now_ms as i64 - now_ms as i64;
                    let to_redis = |local: u64| (local as i64 + offset).max(0) as u64;
                    let complete_from = to_redis(e.created_ms).min(to_redis(
                        self.first_seen_ms
                            .load(Ordering::Relaxed)
                            .max(self.last_lost_ms.load(Ordering::Relaxed)),
                    ));
                    let last = to_redis(e.last_issue_ms)
                        .saturating_add(quiet_ms)
                        .max(unsure.saturating_add(2 * quiet_ms));
                    let to = window_of(&e.spec, last.min(redis_now_ms));
                    let unit = e.spec.unit.millis().max(1);
                    let first_live =
                        window_of(&e.spec, redis_now_ms.saturating_sub(margin_ms + 2 * unit));
                    let from = window_of(&e.spec, unsure).max(first_live).min(to);
                    for window in from..=to {
                        let untallied = !e.windows.iter().any(|w| w.window == window);
                        let complete = window.saturating_mul(unit) >= complete_from;
                        if untallied
                            && complete
                            && window_live(&e.spec, window, redis_now_ms, margin_ms)
                        {
                            entries.push(ReplayEntry {
                                key: key.clone(),
                                spec: e.spec,
                                window,
                                kind: ReplayKind::Repair,
                                value: 0,
                            });
                        }
                    }
                }
                if entries.is_empty() && !repairs {
                    continue;
                }
                plan.push(Planned {
                    entries,
                    key: key.clone(),
                    version: e.version,
                    repairs,
                });
            }
        }
        waiting
    }

    /// A plan's replay failed, and may have been written in part: until a
    /// replay of its windows succeeds, what Redis holds there is unknown.
    pub fn mark_unsure(&self, planned: &[Planned]) {
        for p in planned {
            if let Some(e) = self.shard(&p.key).lock().get_mut(&p.key) {
                for entry in &p.entries {
                    if entry.kind == ReplayKind::Repair {
                        continue;
                    }
                    if let Some(w) = e.windows.iter_mut().find(|w| w.window == entry.window) {
                        if !w.unsure {
                            w.unsure = true;
                            w.unsure_low = w.local_replayed;
                        }
                        if entry.kind == ReplayKind::Local {
                            w.unsure_low = w.unsure_low.min(entry.value);
                        }
                    }
                }
            }
        }
        self.mark_dirty();
    }

    /// Records that Redis confirmed a plan: local values are replayed, and a
    /// repaired key is clean unless it became suspect again meanwhile.
    pub fn mark_replayed(&self, planned: &[Planned]) {
        for p in planned {
            if let Some(e) = self.shard(&p.key).lock().get_mut(&p.key) {
                for entry in &p.entries {
                    let Some(w) = e.windows.iter_mut().find(|w| w.window == entry.window) else {
                        continue;
                    };
                    match entry.kind {
                        ReplayKind::Local => {
                            w.local_replayed = entry.value;
                            // Planned with the hold whenever it was unsure.
                            w.unsure = false;
                        }
                        ReplayKind::Hold => w.hold_written = entry.value,
                        ReplayKind::Repair => {}
                    }
                }
                if p.repairs && e.version == p.version {
                    e.suspect = false;
                    e.unsure_from_ms = None;
                }
            }
        }
        // What the journal holds changed (less is unreplayed).
        self.mark_dirty();
    }
}
