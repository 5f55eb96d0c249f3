//! Requests whose counters live in different Redis Cluster slots. A script
//! may only touch one slot, so such a request is decided as one call per
//! slot, all at once, and still ends up all-or-nothing:
//!
//! - each call is atomic and all-or-nothing within its slot, as always;
//! - when any call denies, the calls that charged are taken back at once
//!   by a refund of exactly what they charged, on the same connection (so
//!   Redis runs it after the charge), and the request is denied with
//!   nothing charged;
//! - when a call fails, the others' charges are taken back the same way and
//!   the failure is reported as it came (a call that may have run is
//!   repaired like any other, see the resilient engine's ledger); when a
//!   refund itself fails, the request reports a call that may have run, so
//!   its keys are repaired to what this replica knows it was granted.
//!
//! What a concurrent request can observe: between a charge and its refund
//! (one round trip), the charged counter reads higher by the hits of a
//! request that ends up denied, so a request on that counter in that
//! moment may be denied although it would fit. Never the other way: no
//! request is admitted because of a refund. `cross_slot_refunds` counts how
//! often it happens. On one Redis (or Sentinel) none of this applies: one
//! call decides any request.

use std::collections::HashMap;

use super::RedisEngine;
use crate::domain::backend::{CallError, Presume, RawItem, RawReply};
use crate::domain::{Batch, Charge};
use crate::redis::keys;

/// The charges of a batch grouped by slot, in order of first appearance;
/// one group when they share a slot.
pub(super) fn slot_groups(batch: &Batch) -> Vec<Vec<usize>> {
    let mut at: HashMap<u16, usize> = HashMap::new();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (i, c) in batch.charges.iter().enumerate() {
        let slot = keys::counter_slot(&c.key);
        let g = *at.entry(slot).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[g].push(i);
    }
    groups
}

/// One slot's part of a request: its charges, expected counts and
/// presumptions, picked by index.
struct Part {
    batch: Batch,
    expected: Vec<(i64, u64)>,
    presume: Presume,
    indices: Vec<usize>,
}

fn part(batch: &Batch, expected: &[(i64, u64)], presume: &Presume, indices: &[usize]) -> Part {
    Part {
        batch: Batch {
            charges: indices.iter().map(|&i| batch.charges[i].clone()).collect(),
            never_deny: batch.never_deny,
        },
        expected: indices
            .iter()
            .map(|&i| expected.get(i).copied().unwrap_or((-1, 0)))
            .collect(),
        presume: Presume {
            charges: indices
                .iter()
                .map(|&i| presume.charges.get(i).copied().unwrap_or_default())
                .collect(),
            ..presume.clone()
        },
        indices: indices.to_vec(),
    }
}

/// The refund that takes back what a part's reply says it charged.
fn take_back(part: &Part, reply: &RawReply) -> Option<Batch> {
    let charges: Vec<Charge> = part
        .batch
        .charges
        .iter()
        .zip(&reply.items)
        .filter(|(_, item)| item.delta > 0)
        .map(|(c, item)| Charge {
            hits: item.delta as u64,
            refund: true,
            ..c.clone()
        })
        .collect();
    (!charges.is_empty()).then_some(Batch {
        charges,
        never_deny: true,
    })
}

impl RedisEngine {
    /// Decides a request whose charges are in several slots (`groups`,
    /// from [`slot_groups`]); see the module docs.
    pub(super) async fn decide_across_slots(
        &self,
        batch: &Batch,
        groups: &[Vec<usize>],
        index: u64,
        expected: &[(i64, u64)],
        presume: &Presume,
    ) -> Result<RawReply, CallError> {
        let parts: Vec<Part> = groups
            .iter()
            .map(|g| part(batch, expected, presume, g))
            .collect();
        let replies = futures::future::join_all(
            parts
                .iter()
                .map(|p| self.decide_in_slot(&p.batch, index, &p.expected, &p.presume)),
        )
        .await;
        let failed = replies.iter().find_map(|r| r.as_ref().err().cloned());
        let denied = replies
            .iter()
            .any(|r| r.as_ref().is_ok_and(|reply| reply.denied));
        let mut merged = RawReply {
            now_ms: 0,
            denied: denied || failed.is_some(),
            lost: false,
            items: vec![
                RawItem {
                    over: false,
                    remaining: 0,
                    reset_ms: 0,
                    own: -1,
                    total: 0,
                    delta: 0,
                };
                batch.charges.len()
            ],
        };
        let mut refunds = Vec::new();
        for (p, reply) in parts.iter().zip(&replies) {
            let Ok(reply) = reply else { continue };
            merged.now_ms = merged.now_ms.max(reply.now_ms);
            merged.lost |= reply.lost;
            for (&i, item) in p.indices.iter().zip(&reply.items) {
                merged.items[i] = *item;
            }
            if merged.denied && !reply.denied {
                if let Some(back) = take_back(p, reply) {
                    refunds.push((p, back));
                }
            }
        }
        if !refunds.is_empty() {
            self.stats_cross_slot_refund();
            let none = &Presume::default();
            let results = futures::future::join_all(refunds.iter().map(|(_, back)| {
                let unknown = vec![(-1, 0); back.charges.len()];
                async move { self.decide_in_slot(back, index, &unknown, none).await }
            }))
            .await;
            if let Some(e) = results.into_iter().find_map(Result::err) {
                // Charged, and maybe not taken back: repaired like a call
                // that may have run.
                return Err(match e {
                    CallError::NotConnected(m) => {
                        CallError::Redis(format!("taking back a cross-slot charge failed: {m}"))
                    }
                    other => other,
                });
            }
            for (p, _) in &refunds {
                for &i in &p.indices {
                    let item = &mut merged.items[i];
                    // What remained before this request, as for any denial.
                    item.remaining = item.remaining.saturating_add(item.delta.max(0) as u64);
                    item.delta = 0;
                }
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(merged),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::CounterKey;
    use crate::limit::{LimitSpec, Role, Unit};

    fn charge(user: &str) -> Charge {
        let spec = LimitSpec::fixed(10, Unit::Minute);
        Charge {
            key: CounterKey::new("edge", [("user", user)], &spec),
            spec,
            hits: 1,
            refund: false,
            role: Role::Enforce,
        }
    }

    #[test]
    fn charges_group_by_slot_in_order() {
        let batch = Batch {
            charges: vec![charge("a"), charge("b"), charge("a"), charge("c")],
            never_deny: false,
        };
        let groups = slot_groups(&batch);
        let slot = |i: usize| keys::counter_slot(&batch.charges[i].key);
        assert_eq!(groups.iter().map(Vec::len).sum::<usize>(), 4);
        assert!(
            groups[0].contains(&0) && groups[0].contains(&2),
            "{groups:?}"
        );
        for g in &groups {
            assert!(g.iter().all(|&i| slot(i) == slot(g[0])));
        }
        let one = Batch {
            charges: vec![charge("a"), charge("a")],
            never_deny: false,
        };
        assert_eq!(slot_groups(&one), vec![vec![0, 1]]);
    }

    #[test]
    fn only_what_was_charged_is_taken_back() {
        let batch = Batch {
            charges: vec![charge("a"), charge("b")],
            never_deny: false,
        };
        let p = part(&batch, &[(3, 7)], &Presume::default(), &[1, 0]);
        assert_eq!(p.expected, vec![(-1, 0), (3, 7)]);
        let item = |delta| RawItem {
            over: false,
            remaining: 1,
            reset_ms: 1,
            own: 0,
            total: 0,
            delta,
        };
        let reply = RawReply {
            now_ms: 1,
            denied: false,
            lost: false,
            items: vec![item(2), item(0)],
        };
        let back = take_back(&p, &reply).expect("a refund");
        assert_eq!(back.charges.len(), 1);
        assert!(back.charges[0].refund && back.charges[0].hits == 2);
        assert_eq!(back.charges[0].key, batch.charges[1].key);
        let nothing = RawReply {
            items: vec![item(0), item(0)],
            ..reply
        };
        assert!(take_back(&p, &nothing).is_none());
    }
}
