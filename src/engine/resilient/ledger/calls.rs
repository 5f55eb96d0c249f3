//! The Redis-path calls the ledger follows per key: issued and answered
//! (none in flight before a repair), refunds in flight and sent (a "lost"
//! answer proves nothing while one may have run first), the confirmed count
//! the data-loss check expects, and suspect keys.

use super::Ledger;
use crate::key::CounterKey;
use crate::limit::LimitSpec;
use std::sync::atomic::Ordering;

impl Ledger {
    /// This replica's confirmed Redis-path count for `key` in `window`, or
    /// -1 when unknown (the script's data-loss check).
    /// This replica's confirmed count for the data-loss check, or -1 (no
    /// check) when unknown or while a refund for the key is in flight.
    pub fn expected(&self, key: &CounterKey, window: u64) -> i64 {
        self.shard(key)
            .lock()
            .get(key)
            .filter(|e| e.refunds_in_flight == 0)
            .and_then(|e| {
                e.windows
                    .iter()
                    .find(|w| w.window == window)
                    .map(|w| w.redis_own)
            })
            .unwrap_or(-1)
    }

    /// Suspect keys are decided locally until repaired.
    pub fn is_suspect(&self, key: &CounterKey) -> bool {
        self.shard(key).lock().get(key).is_some_and(|e| e.suspect)
    }

    /// A Redis-path call for the key is about to be sent.
    /// Returns the key's refund mark as it stood before this call (see
    /// [`Self::refund_mark`]), read under the same lock.
    pub fn note_issue(
        &self,
        key: &CounterKey,
        spec: &LimitSpec,
        now_ms: u64,
        refund: bool,
    ) -> (u64, bool) {
        let noted = self.with_entry(key, spec, now_ms, |e| {
            let mark = (e.refunds_sent, e.refunds_in_flight > 0);
            e.last_issue_ms = now_ms;
            e.refunds_in_flight += u32::from(refund);
            e.refunds_sent += u64::from(refund);
            e.calls_in_flight += 1;
            mark
        });
        noted.unwrap_or_else(|| {
            self.untracked.fetch_add(1, Ordering::Relaxed);
            (0, false)
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
