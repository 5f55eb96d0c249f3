//! The ledger's read side and housekeeping: lease inputs, the busiest keys
//! for /status, pending totals for metrics, the journal's snapshot and
//! restore, and the sweep of dead windows.

use std::sync::atomic::Ordering;

use super::{replayable, window_live, window_of, Ledger};
use crate::key::CounterKey;
use crate::limit::Algorithm;
use crate::limit::LimitSpec;

/// What probably remains of a window now, from what Redis said remained at
/// `at`: the key kept being admitted after that, on every replica still on
/// Redis, at about the pace the window had until then. Replicas that last
/// heard from Redis at different moments would otherwise lease from
/// different remainders, and the stale ones would hand out what the others
/// had already granted. Only the window in which Redis went away uses it;
/// a window that starts during the outage has no remainder and leases from
/// the limit.
fn decayed_remaining(spec: &LimitSpec, window: u64, remaining: u64, at: u64, now: u64) -> u64 {
    let start = window * spec.unit.millis();
    let used = u64::from(spec.requests_per_unit).saturating_sub(remaining) as f64;
    // At least a tenth of the unit as the elapsed time, so a reply at the
    // very start of the window does not make the pace look infinite.
    let elapsed = (at.saturating_sub(start) as f64).max(spec.unit.millis() as f64 / 10.0);
    let since = now.saturating_sub(at) as f64;
    let spent = (used / elapsed * since).ceil();
    (remaining as f64 - spent).max(0.0) as u64
}

impl Ledger {
    /// Lease inputs at Redis time `redis_now_ms`: (demand share, what
    /// remains of the limit as Redis last said, decayed by the pace of
    /// admission since, see [`decayed_remaining`]). For windowed algorithms
    /// that is the last remaining of the current window; for a token bucket,
    /// the tokens left at last contact plus what has refilled since.
    pub fn lease_inputs(
        &self,
        key: &CounterKey,
        spec: &LimitSpec,
        redis_now_ms: u64,
    ) -> (Option<f64>, Option<u64>) {
        self.shard(key).lock().get(key).map_or((None, None), |e| {
            let remaining = e.last_remaining.and_then(|(w, r, at)| {
                if spec.algorithm == Algorithm::TokenBucket {
                    let refilled = redis_now_ms.saturating_sub(at) as f64
                        * f64::from(spec.requests_per_unit)
                        / spec.unit.millis() as f64;
                    Some(((r as f64 + refilled).min(f64::from(spec.burst))) as u64)
                } else {
                    (w == window_of(spec, redis_now_ms))
                        .then(|| decayed_remaining(spec, w, r, at, redis_now_ms))
                }
            });
            (e.demand_share(), remaining)
        })
    }

    /// Drops dead windows and entries with nothing left to remember.
    pub fn sweep(&self, redis_now_ms: u64, margin_ms: u64) {
        for i in 0..self.shard_count() {
            self.sweep_shard(i, redis_now_ms, margin_ms);
        }
    }

    /// [`Self::sweep`] of one shard, so that a caller on a runtime thread
    /// can let other tasks run between shards.
    pub fn sweep_shard(&self, i: usize, redis_now_ms: u64, margin_ms: u64) {
        if let Some(shard) = self.shards.get(i) {
            let mut map = shard.lock();
            let before = map.len();
            let mut freed = 0;
            map.retain(|k, e| {
                e.windows
                    .retain(|w| window_live(&e.spec, w.window, redis_now_ms, margin_ms));
                // A call still in flight, or one that made the key suspect,
                // can have landed in a window the ledger never tallied: the
                // entry stays for its repair (which clears `unsure_from_ms`).
                let keep = !e.windows.is_empty()
                    || e.calls_in_flight > 0
                    || (e.suspect && e.unsure_from_ms.is_some());
                if !keep {
                    // Nothing live is left to repair.
                    e.suspect = false;
                    freed += super::entry_cost(k);
                }
                keep
            });
            self.len.fetch_sub(before - map.len(), Ordering::Relaxed);
            self.bytes.fetch_sub(freed, Ordering::Relaxed);
        }
    }
    /// The `n` busiest keys with their specs, for /status: keys used in
    /// the window that is current at `now_ms` (per their own unit) first,
    /// by this replica's use in it (Redis path plus local), then the most
    /// recently touched.
    pub fn busiest(&self, n: usize, now_ms: u64) -> Vec<(CounterKey, LimitSpec)> {
        let mut all: Vec<((bool, i64, u64), CounterKey, LimitSpec)> = Vec::new();
        for shard in &self.shards {
            for (key, e) in shard.lock().iter() {
                let current = window_of(&e.spec, now_ms);
                let used = e
                    .windows
                    .iter()
                    .find(|w| w.window == current)
                    .map(|w| w.redis_own + w.local_own);
                all.push((
                    (used.is_some(), used.unwrap_or(0), e.touched_ms),
                    key.clone(),
                    e.spec,
                ));
            }
        }
        let by_rank =
            |a: &((bool, i64, u64), CounterKey, LimitSpec),
             b: &((bool, i64, u64), CounterKey, LimitSpec)| b.0.cmp(&a.0);
        // Only the top n need ordering; the ledger may hold many keys.
        if all.len() > n && n > 0 {
            all.select_nth_unstable_by(n - 1, by_rank);
            all.truncate(n);
        }
        all.sort_unstable_by(by_rank);
        all.into_iter().take(n).map(|(_, k, s)| (k, s)).collect()
    }

    /// Every (key, spec, window, cumulative local count, the part Redis
    /// confirmed) with something unconfirmed: the journal's snapshot.
    ///
    /// A replica restarted from it writes the unconfirmed part on top of
    /// what the previous run's local field holds. After a failed replay
    /// that field may hold a lower count than Redis last confirmed (a
    /// take-back written, its reply lost), so an unsure window counts from
    /// the lowest it may hold: the restarted replica then writes at least
    /// what was granted (too much by the take-back at worst, which only
    /// denies), never less.
    pub fn unreplayed_snapshot(&self) -> Vec<(CounterKey, LimitSpec, u64, i64, i64)> {
        let mut out = Vec::new();
        for i in 0..self.shard_count() {
            self.unreplayed_snapshot_shard(i, &mut out);
        }
        out
    }

    /// [`Self::unreplayed_snapshot`] of one shard, added to `out`.
    pub fn unreplayed_snapshot_shard(
        &self,
        i: usize,
        out: &mut Vec<(CounterKey, LimitSpec, u64, i64, i64)>,
    ) {
        if let Some(shard) = self.shards.get(i) {
            for (key, e) in shard.lock().iter() {
                for w in &e.windows {
                    let confirmed = if w.unsure {
                        w.local_replayed.min(w.unsure_low)
                    } else {
                        w.local_replayed
                    };
                    if w.local_own != confirmed {
                        out.push((key.clone(), e.spec, w.window, w.local_own, confirmed));
                    }
                }
            }
        }
    }

    /// Restores a journaled local count (after a restart): it is replayed
    /// like any other local usage.
    pub fn restore_local(
        &self,
        key: &CounterKey,
        spec: &LimitSpec,
        window: u64,
        now_ms: u64,
        local_own: i64,
    ) {
        if !replayable(spec) {
            return;
        }
        self.with_entry(key, spec, now_ms, |e| {
            let w = e.window_mut(window);
            w.local_own = w.local_own.max(local_own);
            w.local_replayed = 0;
        });
        self.mark_dirty();
    }

    /// (keys needing replay, unreplayed hits, suspect keys) for /status
    /// and metrics.
    pub fn pending(&self) -> (usize, i64, usize) {
        let (mut keys, mut hits, mut suspect) = (0, 0, 0);
        for shard in &self.shards {
            for e in shard.lock().values() {
                if e.needs_replay() {
                    keys += 1;
                    hits = e.unreplayed().saturating_add(hits);
                }
                suspect += usize::from(e.suspect);
            }
        }
        (keys, hits, suspect)
    }
}
