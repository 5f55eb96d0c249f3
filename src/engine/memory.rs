//! The in-memory engine: the whole limiter when no Redis is configured, and
//! the embedded default. Counters live in sharded maps; a request locks the
//! shards of its keys in index order (so two requests can never deadlock),
//! evaluates every charge on a scratch copy, and commits only when the request
//! is admitted. Expired state is removed by [`MemoryEngine::sweep`], which the
//! application calls periodically; the engine spawns nothing itself.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use parking_lot::{Mutex, MutexGuard};

use super::{Engine, EngineStatus};
use crate::clock::Clock;
use crate::domain::{Batch, BatchOutcome, DecisionPath, EngineError, ItemOutcome};
use crate::key::CounterKey;
use crate::limit::{evaluate, request_denied, State};

const SHARDS: usize = 64;

struct Slot {
    state: State,
    expires_at_ms: u64,
}

type Shard = HashMap<CounterKey, Slot, ahash::RandomState>;

/// Counters in process memory.
pub struct MemoryEngine {
    shards: Vec<Mutex<Shard>>,
    hasher: ahash::RandomState,
    clock: Arc<dyn Clock>,
}

impl MemoryEngine {
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        MemoryEngine {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            hasher: ahash::RandomState::new(),
            clock,
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
                guard_for(&mut guards, shard).insert(
                    key,
                    Slot {
                        state,
                        expires_at_ms,
                    },
                );
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

    /// Drops state that has expired by `now_ms`; returns how many keys went.
    pub fn sweep(&self, now_ms: u64) -> usize {
        let mut removed = 0;
        for shard in &self.shards {
            let mut map = shard.lock();
            let before = map.len();
            map.retain(|_, slot| slot.expires_at_ms > now_ms);
            removed += before - map.len();
        }
        removed
    }

    /// Number of tracked keys.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
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
        }
    }
}
