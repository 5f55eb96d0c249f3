//! The in-memory engine: the whole limiter when no Redis is configured, and
//! the embedded default. Counters live in sharded maps; a request locks the
//! shards of its keys in index order (so two requests can never deadlock),
//! evaluates every charge on a scratch copy, and commits only when the request
//! is admitted. Expired state is removed by [`MemoryEngine::sweep`], which the
//! application calls periodically; the engine spawns nothing itself.
//!
//! Bounded in bytes (`memory_max_bytes`, key sizes included): counter keys
//! come from client-chosen values, so a day rule keyed by a fresh value per
//! request would otherwise grow without bound until its window ends. A new
//! key that takes its shard past its part of the cap evicts, in O(1), the
//! soonest to expire of a few sampled keys (an expired one first). An
//! evicted key starts again from zero if it comes back: evictions are
//! counted (`evictions` on /status, `leasehold_memory_evictions_total`).

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use parking_lot::{Mutex, MutexGuard};

use super::{Engine, EngineStatus};
use crate::clock::Clock;
use crate::domain::{Batch, BatchOutcome, DecisionPath, EngineError, ItemOutcome};
use crate::key::CounterKey;
use crate::limit::{evaluate, request_denied, State};

const SHARDS: usize = 64;
/// Default byte cap of tracked counters.
pub const DEFAULT_MAX_BYTES: usize = 128 * 1024 * 1024;
/// Keys looked at to choose one to evict.
const EVICTION_SAMPLE: usize = 16;

struct Slot {
    state: State,
    expires_at_ms: u64,
    /// What this slot costs in memory (see [`slot_cost`]).
    cost: usize,
}

#[derive(Default)]
struct Shard {
    map: HashMap<CounterKey, Slot, ahash::RandomState>,
    /// Sum of the slots' costs.
    bytes: usize,
}

/// An estimate of one slot's memory: the key's bytes and its allocation
/// header, the map's entry (at its load factor) and a log's entries.
fn slot_cost(key: &CounterKey, state: &State) -> usize {
    let entry = std::mem::size_of::<(CounterKey, Slot)>() * 8 / 7 + 1;
    let heap = match state {
        State::Log { entries } => entries.capacity() * std::mem::size_of::<(u64, u64)>(),
        _ => 0,
    };
    key.as_str().len() + 16 + entry + heap
}

/// Counters in process memory.
pub struct MemoryEngine {
    shards: Vec<Mutex<Shard>>,
    hasher: ahash::RandomState,
    clock: Arc<dyn Clock>,
    /// Each shard's part of the byte cap.
    shard_cap: usize,
    evictions: AtomicU64,
}

impl MemoryEngine {
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self::with_max_bytes(clock, DEFAULT_MAX_BYTES)
    }

    /// An engine whose counters take at most about `max_bytes`.
    pub fn with_max_bytes(clock: Arc<dyn Clock>, max_bytes: usize) -> Self {
        MemoryEngine {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            hasher: ahash::RandomState::new(),
            clock,
            shard_cap: (max_bytes / SHARDS).max(1),
            evictions: AtomicU64::new(0),
        }
    }

    fn shard_of(&self, key: &CounterKey) -> usize {
        (self.hasher.hash_one(key) as usize) % SHARDS
    }

    /// Applies a batch at `now_ms`. Synchronous and lock-bounded: it never
    /// awaits while holding a shard.
    pub fn apply_at(&self, batch: &Batch, now_ms: u64) -> BatchOutcome {
        self.apply_detailed(batch, now_ms).0
    }

    /// [`Self::apply_at`], also returning what each charge changed its
    /// key's count by (all zero when the request was denied).
    pub fn apply_detailed(&self, batch: &Batch, now_ms: u64) -> (BatchOutcome, Vec<i64>) {
        let mut shard_ids: Vec<usize> = batch
            .charges
            .iter()
            .map(|c| self.shard_of(&c.key))
            .collect();
        let mut order = shard_ids.clone();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<(usize, MutexGuard<'_, Shard>)> =
            order.iter().map(|&i| (i, self.shards[i].lock())).collect();

        // Evaluate on scratch state so a denied request changes nothing and a
        // key charged twice in one request sees its first charge.
        let mut scratch: Vec<(CounterKey, State, u64)> = Vec::with_capacity(batch.charges.len());
        let mut results = Vec::with_capacity(batch.charges.len());
        for (charge, shard) in batch.charges.iter().zip(shard_ids.iter_mut()) {
            let current = match scratch.iter().position(|(k, _, _)| *k == charge.key) {
                Some(i) => scratch[i].1.clone(),
                None => {
                    let guard = guard_for(&mut guards, *shard);
                    guard
                        .map
                        .get(&charge.key)
                        .map(|s| s.state.clone())
                        .unwrap_or_else(|| State::fresh(&charge.spec, now_ms))
                }
            };
            let (outcome, next) =
                evaluate(&charge.spec, &current, now_ms, charge.hits, charge.refund);
            match scratch.iter_mut().find(|(k, _, _)| *k == charge.key) {
                Some(slot) => {
                    slot.1 = next;
                    slot.2 = outcome.expires_at_ms;
                }
                None => scratch.push((charge.key.clone(), next, outcome.expires_at_ms)),
            }
            results.push(outcome);
        }
        let denied = request_denied(
            batch
                .charges
                .iter()
                .zip(&results)
                .map(|(c, o)| (c.role, o.over)),
            batch.never_deny,
        );
        if !denied {
            for (key, state, expires_at_ms) in scratch {
                let shard = self.shard_of(&key);
                let guard = guard_for(&mut guards, shard);
                let cost = slot_cost(&key, &state);
                let slot = Slot {
                    state,
                    expires_at_ms,
                    cost,
                };
                // Only a new key can take the shard past its cap (and only
                // it needs its key kept for the eviction that follows).
                match guard.map.entry(key) {
                    Entry::Occupied(mut o) => {
                        let old = std::mem::replace(o.get_mut(), slot);
                        guard.bytes = guard.bytes + cost - old.cost;
                    }
                    Entry::Vacant(v) => {
                        let key = v.key().clone();
                        v.insert(slot);
                        guard.bytes += cost;
                        self.evict_over_cap(guard, &key, now_ms);
                    }
                }
            }
        }
        let items = results
            .iter()
            .map(|o| ItemOutcome::reported(o, denied))
            .collect();
        let deltas = results
            .iter()
            .map(|o| if denied { 0 } else { o.delta })
            .collect();
        (
            BatchOutcome {
                items,
                denied,
                path: DecisionPath::Memory,
            },
            deltas,
        )
    }

    /// While the shard is over its cap, evicts the soonest to expire of a
    /// few sampled keys other than `new` (the one just inserted).
    fn evict_over_cap(&self, shard: &mut Shard, new: &CounterKey, now_ms: u64) {
        while shard.bytes > self.shard_cap {
            let victim = shard
                .map
                .iter()
                .filter(|(k, _)| *k != new)
                .take(EVICTION_SAMPLE)
                .min_by_key(|(_, slot)| slot.expires_at_ms)
                .map(|(k, slot)| (k.clone(), slot.expires_at_ms));
            let Some((key, expires_at_ms)) = victim else {
                return;
            };
            if let Some(slot) = shard.map.remove(&key) {
                shard.bytes -= slot.cost;
            }
            // An expired key is only swept early; a live one loses its count.
            if expires_at_ms > now_ms {
                self.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Drops state that has expired by `now_ms`; returns how many keys went.
    pub fn sweep(&self, now_ms: u64) -> usize {
        (0..self.shard_count())
            .map(|i| self.sweep_shard(i, now_ms))
            .sum()
    }

    /// The number of shards ([`Self::sweep_shard`]).
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// [`Self::sweep`] of one shard: a sweep on a runtime thread goes a
    /// shard at a time and lets the thread's other tasks run in between,
    /// rather than holding the thread for every key at once.
    pub fn sweep_shard(&self, i: usize, now_ms: u64) -> usize {
        let Some(shard) = self.shards.get(i) else {
            return 0;
        };
        let mut shard = shard.lock();
        let before = shard.map.len();
        let mut freed = 0;
        shard.map.retain(|_, slot| {
            let keep = slot.expires_at_ms > now_ms;
            if !keep {
                freed += slot.cost;
            }
            keep
        });
        shard.bytes -= freed;
        before - shard.map.len()
    }

    /// Number of tracked keys.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().map.len()).sum()
    }

    /// Estimated bytes of the tracked keys.
    pub fn bytes(&self) -> usize {
        self.shards.iter().map(|s| s.lock().bytes).sum()
    }

    /// Live keys evicted to stay within the byte cap, so far.
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }
}

fn guard_for<'a, 'g>(
    guards: &'a mut [(usize, MutexGuard<'g, Shard>)],
    shard: usize,
) -> &'a mut MutexGuard<'g, Shard> {
    // `guards` holds every shard the batch touches, sorted by index.
    let at = guards.partition_point(|(i, _)| *i < shard);
    &mut guards[at.min(guards.len().saturating_sub(1))].1
}

#[async_trait]
impl Engine for MemoryEngine {
    async fn apply(&self, batch: &Batch) -> Result<BatchOutcome, EngineError> {
        Ok(self.apply_at(batch, self.clock.now_ms()))
    }

    fn name(&self) -> &'static str {
        "memory"
    }

    fn status(&self) -> EngineStatus {
        EngineStatus::Memory {
            tracked_keys: self.len(),
            tracked_bytes: self.bytes(),
            evictions: self.evictions(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::domain::Charge;
    use crate::limit::{LimitSpec, Role, Unit};

    fn charge(key: &CounterKey, spec: &LimitSpec) -> Batch {
        Batch {
            charges: vec![Charge {
                key: key.clone(),
                spec: *spec,
                hits: 1,
                refund: false,
                role: Role::Enforce,
            }],
            never_deny: false,
        }
    }

    #[test]
    fn the_byte_cap_holds_under_fresh_keys_and_evicts_the_soonest_to_expire() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let engine = MemoryEngine::with_max_bytes(clock, 1024 * 1024);
        let day = LimitSpec::fixed(5, Unit::Day);
        let minute = LimitSpec::fixed(5, Unit::Minute);
        let value = "v".repeat(1024);
        // A minute key first: it expires soonest, so it goes first.
        let soon = CounterKey::new("d", [("k", "soon")], &minute);
        engine.apply_at(&charge(&soon, &minute), 1_000_000);
        for i in 0..5_000 {
            let v = format!("{value}{i}");
            let key = CounterKey::new("d", [("k", v.as_str())], &day);
            let out = engine.apply_at(&charge(&key, &day), 1_000_000);
            assert!(!out.denied, "every request is answered");
            assert!(engine.bytes() <= 1024 * 1024 + 4096, "{}", engine.bytes());
        }
        assert!(engine.evictions() > 3_000, "{}", engine.evictions());
        assert!(engine.len() < 1_000, "{}", engine.len());
        let shard = engine.shards[engine.shard_of(&soon)].lock();
        assert!(!shard.map.contains_key(&soon), "the soonest to expire went");
        drop(shard);
        // Sweeping keeps the byte count in step.
        engine.sweep(u64::MAX);
        assert_eq!((engine.len(), engine.bytes()), (0, 0));
    }
}
