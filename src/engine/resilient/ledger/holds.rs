//! Holds: what a replica off Redis may still grant of its leases, per
//! window, written to Redis (`h<idx>`) so replicas on Redis count it as used;
//! released once the replica is back.

use std::sync::atomic::Ordering;

use super::{Algorithm, Ledger};
use crate::key::CounterKey;
use crate::limit::LimitSpec;

/// Holds exist for the windowed algorithms, whose decisions read them.
fn holdable(spec: &LimitSpec) -> bool {
    matches!(
        spec.algorithm,
        Algorithm::FixedWindow | Algorithm::SlidingWindow
    )
}

impl Ledger {
    /// Keys this replica has granted on leases in their current window
    /// (`window_of_spec`): holds are kept for them, see [`Self::hold`].
    pub fn leased_keys(
        &self,
        window_of_spec: impl Fn(&LimitSpec) -> u64,
    ) -> Vec<(CounterKey, LimitSpec)> {
        let mut out = Vec::new();
        for shard in &self.shards {
            for (key, e) in shard.lock().iter() {
                let w = window_of_spec(&e.spec);
                if holdable(&e.spec) && e.windows.iter().any(|t| t.window == w && t.local_own > 0) {
                    out.push((key.clone(), e.spec));
                }
            }
        }
        out
    }

    /// Holds in Redis what is left of a lease of `capacity` in `window`:
    /// the capacity less what this replica granted locally there.
    pub fn hold(
        &self,
        key: &CounterKey,
        spec: &LimitSpec,
        window: u64,
        now_ms: u64,
        capacity: i64,
    ) {
        if !holdable(spec) {
            return;
        }
        self.with_entry(key, spec, now_ms, |e| {
            let w = e.window_mut(window);
            w.hold = capacity.saturating_sub(w.local_own).max(0);
        });
        self.holding.store(true, Ordering::Release);
        self.mark_dirty();
    }

    /// Back on Redis: every hold goes to 0 (written by the next replay).
    /// Runs every round of a healthy replica, so it scans the ledger only
    /// when a hold was set since the last release: with 200,000 keys two
    /// full scans every 50 ms (this and the replay plan's) took 17% of a
    /// core on an idle replica, and held each shard's lock against the
    /// serving threads while they ran.
    pub fn release_holds(&self) {
        if !self.holding.swap(false, Ordering::AcqRel) {
            return;
        }
        for shard in &self.shards {
            for e in shard.lock().values_mut() {
                for w in &mut e.windows {
                    w.hold = 0;
                }
            }
        }
        self.mark_dirty();
    }
}
