//! The over-limit cache: a fixed-window counter that Redis reported over
//! its limit answers OVER_LIMIT on this replica without a Redis call, for a
//! bounded time within that window.
//!
//! Why a cached OVER is right: within one fixed window a counter only
//! grows, except by refunds (`is_negative_hits`) and by Redis losing data.
//! A reply that denied `h` hits says fewer than `h` remained, so any later
//! charge of at least `h` hits in the same window is over too. The entry
//! keeps that bound (`h − 1` remaining at most) and answers only charges
//! above it; smaller charges still go to Redis.
//!
//! What bounds a wrong OVER:
//! - a refund made on this replica removes the key's entries before it is
//!   decided;
//! - a refund on another replica, or Redis losing data, is seen when the
//!   entry ends: at most `over_limit_cache_ms` after it was written (or
//!   the window's end, if sooner). The next Redis reply that admits more
//!   than the entry allowed counts the entry as refuted (a metric), when
//!   Redis decided it after the OVER: replies of calls in flight together
//!   are learned in any order, and an admission Redis made before the
//!   OVER (the first of a window's requests, say) refutes nothing;
//! - a rules reload clears the cache, and the effective limit (a request's
//!   `limit` override included) is part of the entry's key.
//!
//! Only enforcing fixed-window charges are cached: shadow and quota
//! descriptors must reach Redis to be counted, and sliding windows and
//! token buckets recover continuously as time passes, so an OVER of theirs
//! is not known to last. A request is answered from the cache only when
//! every one of its charges is: each request stays all-or-nothing, and the
//! statuses of its other descriptors would otherwise be unknown.

use std::collections::HashMap;

use parking_lot::RwLock;

use crate::domain::{Batch, BatchOutcome, Charge, DecisionPath, ItemOutcome};
use crate::key::CounterKey;
use crate::limit::{Algorithm, Role};

use super::ledger::window_of;

/// Counters kept at most; past it, ended entries are dropped and new
/// counters are not added until there is room.
const MAX_KEYS: usize = 10_000;

#[derive(Clone, Copy, Debug)]
struct Entry {
    /// The effective limit: requests per unit and the unit in ms.
    limit: u32,
    unit_ms: u64,
    /// The window the OVER was seen in (Redis time).
    window: u64,
    /// At most this much remained then.
    remaining_at_most: u64,
    /// Local ms until which the entry answers.
    until_ms: u64,
    /// Redis time when the window ends.
    window_end_ms: u64,
    /// Redis time of the latest OVER the entry learned: only an admission
    /// Redis made later contradicts it.
    seen_ms: u64,
}

/// See the module docs.
pub(super) struct OverCache {
    /// Per counter, one entry per effective limit.
    /// ahash: every cacheable charge looks its key up here.
    entries: RwLock<HashMap<CounterKey, Vec<Entry>, ahash::RandomState>>,
    lifetime_ms: u64,
}

fn cacheable(c: &Charge) -> bool {
    c.role == Role::Enforce && c.spec.algorithm == Algorithm::FixedWindow && !c.refund && c.hits > 0
}

fn entry_for<'a>(entries: &'a [Entry], c: &Charge) -> Option<&'a Entry> {
    entries
        .iter()
        .find(|e| e.limit == c.spec.requests_per_unit && e.unit_ms == c.spec.unit.millis())
}

impl OverCache {
    /// `lifetime_ms` 0 turns the cache off.
    pub fn new(lifetime_ms: u64) -> Self {
        OverCache {
            entries: RwLock::new(HashMap::with_hasher(ahash::RandomState::new())),
            lifetime_ms,
        }
    }

    /// The whole request's answer when every charge is known to be over;
    /// a refund in the batch removes its key's entries first.
    pub fn answer(&self, batch: &Batch, now_ms: u64, redis_now: u64) -> Option<BatchOutcome> {
        if self.lifetime_ms == 0 {
            return None;
        }
        if batch.charges.iter().any(|c| c.refund) {
            let mut entries = self.entries.write();
            for c in batch.charges.iter().filter(|c| c.refund) {
                entries.remove(&c.key);
            }
            return None;
        }
        if batch.never_deny || batch.charges.is_empty() {
            return None;
        }
        let entries = self.entries.read();
        if entries.is_empty() {
            return None;
        }
        let mut items = Vec::with_capacity(batch.charges.len());
        for c in &batch.charges {
            if !cacheable(c) {
                return None;
            }
            let e = entry_for(entries.get(&c.key)?, c)?;
            let live = e.window == window_of(&c.spec, redis_now) && now_ms < e.until_ms;
            if !live || c.hits <= e.remaining_at_most {
                return None;
            }
            items.push(ItemOutcome {
                over: true,
                remaining: 0,
                reset_ms: e.window_end_ms.saturating_sub(redis_now),
            });
        }
        Some(BatchOutcome {
            items,
            denied: true,
            path: DecisionPath::Cached,
        })
    }

    /// Learns from a Redis reply: OVERs start entries (or tighten them);
    /// an admission above what an entry of the same window allowed
    /// refutes it. Returns how many entries were refuted.
    pub fn learn(&self, batch: &Batch, outcome: &BatchOutcome, now_ms: u64, redis_now: u64) -> u64 {
        if self.lifetime_ms == 0 {
            return 0;
        }
        // Most replies start nothing and refute nothing: tell under one
        // read lock, and take the write lock only when there is work.
        {
            let entries = self.entries.read();
            let holds = |c: &Charge| {
                entries
                    .get(&c.key)
                    .is_some_and(|list| entry_for(list, c).is_some())
            };
            let relevant =
                |c: &Charge, over: bool| cacheable(c) && (over || (!outcome.denied && holds(c)));
            if !batch
                .charges
                .iter()
                .zip(&outcome.items)
                .any(|(c, i)| relevant(c, i.over))
            {
                return 0;
            }
        }
        let mut refuted = 0;
        let mut entries = self.entries.write();
        if entries.len() >= MAX_KEYS {
            entries.retain(|_, list| {
                list.retain(|e| e.until_ms > now_ms);
                !list.is_empty()
            });
        }
        for (c, item) in batch.charges.iter().zip(&outcome.items) {
            if !cacheable(c) {
                continue;
            }
            let window = window_of(&c.spec, redis_now);
            let (limit, unit_ms) = (c.spec.requests_per_unit, c.spec.unit.millis());
            let same = |e: &Entry| e.limit == limit && e.unit_ms == unit_ms;
            if !item.over {
                if outcome.denied {
                    continue;
                }
                if let Some(list) = entries.get_mut(&c.key) {
                    let before = list.len();
                    list.retain(|e| {
                        !(same(e)
                            && e.window == window
                            && c.hits > e.remaining_at_most
                            && redis_now > e.seen_ms)
                    });
                    refuted += (before - list.len()) as u64;
                    if list.is_empty() {
                        entries.remove(&c.key);
                    }
                }
                continue;
            }
            let window_end_ms = (window + 1) * unit_ms;
            let entry = Entry {
                limit,
                unit_ms,
                window,
                remaining_at_most: c.hits - 1,
                until_ms: now_ms
                    + self
                        .lifetime_ms
                        .min(window_end_ms.saturating_sub(redis_now)),
                window_end_ms,
                seen_ms: redis_now,
            };
            if let Some(list) = entries.get_mut(&c.key) {
                match list.iter_mut().find(|e| same(e)) {
                    Some(e) if e.window == window => {
                        e.remaining_at_most = e.remaining_at_most.min(entry.remaining_at_most);
                        e.until_ms = entry.until_ms;
                        e.seen_ms = e.seen_ms.max(redis_now);
                    }
                    Some(e) => *e = entry,
                    None => list.push(entry),
                }
            } else if entries.len() < MAX_KEYS {
                entries.insert(c.key.clone(), vec![entry]);
            }
        }
        refuted
    }

    /// Forgets everything (a rules reload).
    pub fn clear(&self) {
        self.entries.write().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::{LimitSpec, Unit};

    const MINUTE: u64 = 60_000;

    fn batch() -> Batch {
        let spec = LimitSpec::fixed(1, Unit::Minute);
        Batch {
            charges: vec![Charge {
                key: CounterKey::new("d", [("user", "a")], &spec),
                spec,
                hits: 1,
                refund: false,
                role: Role::Enforce,
            }],
            never_deny: false,
        }
    }

    fn outcome(over: bool) -> BatchOutcome {
        BatchOutcome {
            items: vec![ItemOutcome {
                over,
                remaining: 0,
                reset_ms: 1,
            }],
            denied: over,
            path: DecisionPath::Redis,
        }
    }

    /// Replies of calls in flight together reach the cache in any order:
    /// the window's first request, admitted by Redis before another was
    /// denied, is no evidence against the OVER even when learned after it
    /// (the benchmark's over-limit row counted one such false refutation
    /// at the start of a window). An admission Redis made after the OVER
    /// still refutes it.
    #[test]
    fn only_an_admission_redis_made_after_the_over_refutes_it() {
        let cache = OverCache::new(250);
        let b = batch();
        let t = 10 * MINUTE + 5_000;
        assert_eq!(cache.learn(&b, &outcome(true), 0, t), 0);
        assert_eq!(
            cache.learn(&b, &outcome(false), 1, t - 2),
            0,
            "admitted before the OVER: not a refutation"
        );
        assert!(
            cache.answer(&b, 2, t + 1).is_some(),
            "the entry still answers"
        );
        assert_eq!(
            cache.learn(&b, &outcome(false), 3, t),
            0,
            "the same call's admission is not after it"
        );
        assert_eq!(
            cache.learn(&b, &outcome(false), 4, t + 3),
            1,
            "admitted after the OVER: refuted"
        );
        assert!(cache.answer(&b, 5, t + 4).is_none(), "and dropped");
        // A later OVER moves the entry's time on: an admission between the
        // two no longer refutes it.
        assert_eq!(cache.learn(&b, &outcome(true), 6, t + 10), 0);
        assert_eq!(cache.learn(&b, &outcome(true), 7, t + 20), 0);
        assert_eq!(cache.learn(&b, &outcome(false), 8, t + 15), 0);
        assert!(cache.answer(&b, 9, t + 21).is_some());
    }
}
