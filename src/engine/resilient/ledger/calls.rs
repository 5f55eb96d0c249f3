//! The Redis-path calls the ledger follows per key: issued and answered
//! (none in flight before a repair), refunds in flight and sent (a "lost"
//! answer proves nothing while one may have run first), the confirmed count
//! the data-loss check expects, and suspect keys.

use super::Ledger;
use crate::key::CounterKey;
use crate::limit::LimitSpec;
use std::sync::atomic::Ordering;

/// What a Redis-path call carries per charge from the ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallInputs {
    /// The confirmed count for the data-loss check (-1: no check).
    pub expected: i64,
    /// Local grants in the window Redis does not hold yet.
    pub pending: i64,
    /// Nothing pending, not suspect, and the window's last replay not in
    /// doubt: the replica may prove itself.
    pub settled: bool,
    /// The demand share of the demand window is known already.
    pub demand_known: bool,
}

impl CallInputs {
    /// For a key the ledger does not track: nothing to check, nothing
    /// pending, demand unknown.
    const UNKNOWN: CallInputs = CallInputs {
        expected: -1,
        pending: 0,
        settled: true,
        demand_known: false,
    };
}

impl Ledger {
    // Views for the ledger's tests, read one lookup each: the decision path
    // reads all of them under the lock that counts a call (`note_issue`).

    /// This replica's confirmed count for the data-loss check, or -1 (no
    /// check) when unknown or while a refund for the key is in flight.
    #[cfg(test)]
    pub fn expected(&self, key: &CounterKey, window: u64) -> i64 {
        self.expected_and_pending(key, window).0
    }

    /// [`Self::expected`], and this replica's local count for `key` in
    /// `window` that Redis does not hold yet (replayed by the next round):
    /// a decision on Redis counts it, so the replica never grants on Redis
    /// what it already granted on its lease. Only with none pending (and
    /// the key not suspect) may it prove itself there (`decide.lua`,
    /// "presumed holds").
    #[cfg(test)]
    pub fn expected_and_pending(&self, key: &CounterKey, window: u64) -> (i64, i64, bool) {
        let i = self.call_inputs(key, window);
        (i.expected, i.pending, i.settled)
    }

    /// [`Self::expected_and_pending`], and whether the demand share of
    /// `window`'s demand window is known already (the script need not read
    /// that window again), under one lock.
    #[cfg(test)]
    pub fn call_inputs(&self, key: &CounterKey, window: u64) -> CallInputs {
        let map = self.shard(key).lock();
        let Some(e) = map.get(key) else {
            return CallInputs::UNKNOWN;
        };
        inputs(e, window)
    }

    /// Suspect keys are decided locally until repaired.
    #[cfg(test)]
    pub fn is_suspect(&self, key: &CounterKey) -> bool {
        self.shard(key).lock().get(key).is_some_and(|e| e.suspect)
    }

    /// A Redis-path call for the key, in `window`, is about to be sent.
    /// Returns the key's refund mark as it stood before this call (see
    /// [`Self::refund_mark`]) and what the call carries from the ledger
    /// ([`CallInputs`]), both read under the same lock; `None`,
    /// noting nothing, when the key is suspect (it is decided on the lease
    /// instead). The caller's earlier look at the key (routing) is not
    /// enough: between it and this, the key can turn suspect and its repair
    /// be planned (no call in flight), and a call sent then could run
    /// before the repair, which would overwrite its count while this
    /// replica keeps it as confirmed (seen: one grant missing from Redis
    /// after a reshard under load). Checked and counted under one lock, a
    /// key in flight is never repaired and a key being repaired is never
    /// called. (One lock and one lookup for all of it: per charge, on every
    /// Redis-path decision.)
    pub fn note_issue(
        &self,
        key: &CounterKey,
        spec: &LimitSpec,
        now_ms: u64,
        refund: bool,
        window: u64,
    ) -> Option<((u64, bool), CallInputs)> {
        let noted = self.with_entry(key, spec, now_ms, |e| {
            if e.suspect {
                return None;
            }
            let mark = (e.refunds_sent, e.refunds_in_flight > 0);
            e.last_issue_ms = now_ms;
            e.refunds_in_flight += u32::from(refund);
            e.refunds_sent += u64::from(refund);
            e.calls_in_flight += 1;
            // After counting this call's refund: a refund's own call
            // carries no expected count (it lowers the field first).
            Some((mark, inputs(e, window)))
        });
        noted.unwrap_or_else(|| {
            // Not tracked (the ledger is full of entries it may not
            // evict): nothing known of the key.
            self.untracked.fetch_add(1, Ordering::Relaxed);
            Some(((0, false), CallInputs::UNKNOWN))
        })
    }

    /// Where the key's refunds stand: (refund calls sent so far, whether one
    /// is in flight). A call's "lost" answer proves data loss only if the
    /// mark did not move between reading `expected` and the reply: a refund
    /// in flight meanwhile (this replica's own, on any connection) can have
    /// lowered the field first.
    pub fn refund_mark(&self, key: &CounterKey) -> (u64, bool) {
        self.shard(key)
            .lock()
            .get(key)
            .map_or((0, false), |e| (e.refunds_sent, e.refunds_in_flight > 0))
    }

    /// The call of [`Self::note_issue`] ended (answered or failed); a call
    /// that may still run late leaves the key suspect, and a suspect key
    /// makes no Redis-path calls until a fenced repair.
    pub fn note_answered(&self, key: &CounterKey, refund: bool) {
        if let Some(e) = self.shard(key).lock().get_mut(key) {
            e.calls_in_flight = e.calls_in_flight.saturating_sub(1);
            if refund {
                e.refunds_in_flight = e.refunds_in_flight.saturating_sub(1);
            }
        }
    }
}

/// What a call in `window` carries from the key's entry.
fn inputs(e: &super::Entry, window: u64) -> CallInputs {
    let w = e.windows.iter().find(|w| w.window == window);
    let expected = w
        .filter(|_| e.refunds_in_flight == 0)
        .map_or(-1, |w| w.redis_own);
    let pending = w.map_or(0, |w| w.local_own.saturating_sub(w.local_replayed));
    CallInputs {
        expected,
        pending,
        settled: !e.suspect && pending == 0 && !w.is_some_and(|w| w.unsure),
        demand_known: e
            .demand
            .is_some_and(|(_, dw)| dw == e.spec.demand_window(window)),
    }
}
