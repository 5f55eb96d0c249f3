//! Requests whose counters live in different Redis Cluster slots. A script
//! may only touch one slot, so such a request is decided as one call per
//! slot, all at once, and still ends up all-or-nothing:
//!
//! - every call applies its charges without denying (as global shadow mode
//!   would), each atomic within its slot, and reports which are over;
//! - the request's outcome is then decided here by the one all-or-nothing
//!   rule every engine uses ([`crate::limit::request_denied`]: any
//!   enforcing charge over, or every quota charge over), over all slots
//!   together, exactly as one call would have decided it;
//! - when it is denied, everything the calls changed is taken back at once
//!   (charges refunded, client refunds re-applied), each in the window it
//!   landed in, on the same connection as the call that made it (so Redis
//!   runs it after), and the request is denied with nothing charged;
//! - when a call fails, what the others changed is taken back the same way
//!   and the failure is reported, one that may have run before one that
//!   provably did not (a call that may have run is repaired like any
//!   other, see the resilient engine's ledger, and a part still in flight
//!   when another could not be sent may have run); when a
//!   take-back itself fails, the request reports a call that may have run,
//!   so its keys are repaired to what this replica knows it was granted.
//!
//! What a concurrent request can observe: between a charge and its
//! take-back (one round trip), the counter reads higher by the hits of a
//! request that ends up denied, so a request on that counter in that
//! moment may be denied although it would fit. Never the other way: no
//! request is admitted because of a take-back. `cross_slot_refunds` counts
//! the requests taken back. On one Redis (or Sentinel) none of this
//! applies: one call decides any request.
//!
//! Each item keeps the time of the slot that decided it (`at_ms`), so the
//! ledger files it under the window it landed in even when the masters'
//! clocks differ.

use std::collections::HashMap;

use super::RedisEngine;
use crate::domain::backend::{CallError, Presume, RawItem, RawReply, DEMAND_NOT_READ};
use crate::domain::{Batch, Charge};
use crate::limit::{request_denied, Algorithm};
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

/// One slot's part of a request: its charges (applied without denying),
/// expected counts and presumptions, picked by index.
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
            never_deny: true,
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

/// The call that undoes what a part's reply says it changed: a refund of
/// what was charged, a charge of what was refunded, each pinned to the
/// window the part landed in (the `expected` pairs, count -1: no loss
/// check). None when it changed nothing.
fn take_back(part: &Part, reply: &RawReply) -> Option<(Batch, Vec<(i64, u64)>)> {
    let mut charges = Vec::new();
    let mut windows = Vec::new();
    for (c, item) in part.batch.charges.iter().zip(&reply.items) {
        if item.delta == 0 {
            continue;
        }
        charges.push(Charge {
            hits: item.delta.unsigned_abs(),
            refund: item.delta > 0,
            ..c.clone()
        });
        let unit = c.spec.unit.millis().max(1);
        windows.push((-1, item.decided_at(reply.now_ms) / unit));
    }
    (!charges.is_empty()).then_some((
        Batch {
            charges,
            never_deny: true,
        },
        windows,
    ))
}

/// Whether an algorithm's take-back restores the count exactly (a window
/// count does; a bucket's tokens and a log's members come back only
/// approximately, see the engine docs).
fn exact_take_back(a: Algorithm) -> bool {
    matches!(a, Algorithm::FixedWindow | Algorithm::SlidingWindow)
}

/// What a request whose parts failed reports: a failure that may have run
/// before one that provably did not, so that a part still in flight when
/// another could not even be sent (its node's client reconnecting) is
/// repaired, not taken for nothing charged.
fn failure_of(replies: &[Result<RawReply, CallError>]) -> Option<CallError> {
    let mut errors = replies.iter().filter_map(|r| r.as_ref().err());
    let first = errors.clone().next();
    errors.find(|e| e.maybe_applied()).or(first).cloned()
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
                .map(|p| self.decide_in_slot(&p.batch, index, &p.expected, &p.presume, false)),
        )
        .await;
        let failed = failure_of(&replies);
        let mut merged = RawReply {
            now_ms: u64::MAX,
            denied: false,
            lost: false,
            items: vec![
                RawItem {
                    over: false,
                    remaining: 0,
                    reset_ms: 0,
                    own: DEMAND_NOT_READ,
                    total: 0,
                    delta: 0,
                    at_ms: 0,
                };
                batch.charges.len()
            ],
        };
        for (p, reply) in parts.iter().zip(&replies) {
            let Ok(reply) = reply else { continue };
            // The earliest: an over-limit cache entry from it ends no later
            // than the window it was seen in.
            merged.now_ms = merged.now_ms.min(reply.now_ms);
            merged.lost |= reply.lost;
            for (&i, item) in p.indices.iter().zip(&reply.items) {
                merged.items[i] = RawItem {
                    at_ms: reply.now_ms,
                    ..*item
                };
            }
        }
        if merged.now_ms == u64::MAX {
            merged.now_ms = 0;
        }
        merged.denied = failed.is_some()
            || request_denied(
                batch
                    .charges
                    .iter()
                    .zip(&merged.items)
                    .map(|(c, item)| (c.role, item.over)),
                batch.never_deny,
            );
        if merged.denied {
            let backs: Vec<(Batch, Vec<(i64, u64)>)> = parts
                .iter()
                .zip(&replies)
                .filter_map(|(p, r)| r.as_ref().ok().and_then(|reply| take_back(p, reply)))
                .collect();
            if !backs.is_empty() {
                self.stats_cross_slot_refund();
                let none = &Presume::default();
                let results = futures::future::join_all(
                    backs
                        .iter()
                        .map(|(b, w)| self.decide_in_slot(b, index, w, none, true)),
                )
                .await;
                if let Some(e) = results.into_iter().find_map(Result::err) {
                    // Changed, and maybe not taken back: repaired like a call
                    // that may have run.
                    return Err(match e {
                        CallError::NotConnected(m) | CallError::SlotMoving(m) => CallError::Redis(
                            format!("taking back a cross-slot request failed: {m}"),
                        ),
                        other => other,
                    });
                }
            }
            for (c, item) in batch.charges.iter().zip(merged.items.iter_mut()) {
                if !item.over && item.delta > 0 && exact_take_back(c.spec.algorithm) {
                    // What remained before this request, as for any denial.
                    item.remaining = item.remaining.saturating_add(item.delta as u64);
                }
                if item.over {
                    item.remaining = 0;
                }
                item.delta = 0;
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
    fn a_part_that_may_have_run_decides_what_a_failed_request_reports() {
        let ok = || {
            Ok(RawReply {
                now_ms: 1,
                denied: false,
                lost: false,
                items: Vec::new(),
            })
        };
        let refused = || Err(CallError::NotConnected("reconnecting".into()));
        let timed_out = || Err(CallError::Timeout(std::time::Duration::from_millis(5)));
        assert!(failure_of(&[ok(), ok()]).is_none());
        let e = failure_of(&[refused(), ok()]);
        assert!(
            e.is_some_and(|e| !e.maybe_applied()),
            "only a part not sent"
        );
        for replies in [[refused(), timed_out()], [timed_out(), refused()]] {
            let e = failure_of(&replies);
            assert!(
                e.is_some_and(|e| e.maybe_applied()),
                "a part in flight may have run, whatever the order"
            );
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
    fn a_take_back_undoes_exactly_what_changed_in_its_window() {
        let batch = Batch {
            charges: vec![charge("a"), charge("b"), charge("c")],
            never_deny: false,
        };
        let p = part(&batch, &[(3, 7)], &Presume::default(), &[1, 0, 2]);
        assert_eq!(p.expected, vec![(-1, 0), (3, 7), (-1, 0)]);
        assert!(
            p.batch.never_deny,
            "parts apply; the request is decided here"
        );
        let item = |delta| RawItem {
            over: false,
            remaining: 1,
            reset_ms: 1,
            own: 0,
            total: 0,
            delta,
            at_ms: 0,
        };
        let reply = RawReply {
            now_ms: 120_500,
            denied: false,
            lost: false,
            items: vec![item(2), item(0), item(-1)],
        };
        let (back, windows) = take_back(&p, &reply).expect("a take-back");
        assert_eq!(back.charges.len(), 2);
        assert!(back.charges[0].refund && back.charges[0].hits == 2);
        assert_eq!(back.charges[0].key, batch.charges[1].key);
        assert!(
            !back.charges[1].refund && back.charges[1].hits == 1,
            "a refund is re-applied"
        );
        assert_eq!(
            windows,
            vec![(-1, 2), (-1, 2)],
            "the minute the part landed in"
        );
        let nothing = RawReply {
            items: vec![item(0), item(0), item(0)],
            ..reply
        };
        assert!(take_back(&p, &nothing).is_none());
    }
}
