//! One call on the backend, within a budget that follows what Redis is
//! doing. A busy Redis is not an outage, and a decision made without its
//! answer must not grant what Redis does not account for:
//!
//! - While Redis is answering (some reply within [`ALIVE_MS`]; a Cluster's
//!   refusal of a call for a slot it is moving is an answer), a call waits
//!   up to `budget_max_ms` for its own reply. If that passes, the request is
//!   denied (never granted from a lease: the replicas still on Redis would
//!   not see the grant), counted in `unanswered_denials`, and the call is
//!   left running.
//! - When Redis has answered nothing for [`ALIVE_MS`], the budget is
//!   `deadline_ms`; a call that misses it is a breaker failure and the
//!   request is decided on a lease.
//! - Either way a call past its budget is not abandoned: its reply, when it
//!   comes (within the Redis layer's reply timeout), is folded in. Redis
//!   counted it as it decided; this replica decided otherwise, so the
//!   difference is written back through the local field (`o<idx>`):
//!   `local_own −= delta`. Redis then counts exactly what the client was
//!   told: a wrongly denied request costs nothing (counted in
//!   `wrong_denials`), a lease grant Redis also admitted counts once. Only
//!   a call that never answers leaves its keys suspect, for the fenced
//!   repair of [`super::ledger`].
//!
//! token_bucket and sliding_log cannot take a count back (the bucket
//! replay only draws; the log is not replayed): a wrongly denied request
//! there still uses its tokens or log entry.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Notify;

use super::ledger::window_of;
use super::ResilientEngine;
use crate::domain::backend::{CallError, RawReply};
use crate::domain::{Batch, BatchOutcome, DecisionPath, ItemOutcome};
use crate::limit::Role;

/// Redis counts as silent once a call has waited this long with no reply
/// to any call since it was sent; until then it counts as answering.
pub const ALIVE_MS: u64 = 100;

/// A decision call in progress, movable to another task once past its
/// budget.
type LateCall =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<RawReply, CallError>> + Send>>;

/// A call its request is waiting on. Dropped unfinished (the client went
/// away, the request's future with it), the call is not cut off midway (a
/// request across Cluster slots takes back what it charged; a fenced call
/// retries; a call that may have applied raises the epoch): it finishes
/// on the engine's runtime, its reply unread, as [`Waiting`] expects.
struct InFlight<'a> {
    call: Option<LateCall>,
    home: &'a crate::tasks::Home,
}

impl std::future::Future for InFlight<'_> {
    type Output = Result<RawReply, CallError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        match self.call.as_mut() {
            Some(call) => call.as_mut().poll(cx),
            // Taken once it finished or timed out; never polled after.
            None => std::task::Poll::Pending,
        }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            drop(self.home.spawn(async move {
                let _ = call.await;
            }));
        }
    }
}

/// What became of a request sent to the backend.
pub(super) enum Decided {
    Answered(BatchOutcome),
    /// Redis is answering, but not this call in time: deny.
    Unanswered,
    /// The call failed, or missed the short budget of a silent Redis:
    /// decide on a lease.
    Failed,
}

/// A call past its budget, with what its completion must do.
/// A decision call this replica is waiting on. Should the waiting future be
/// dropped (the client went away) while the call is out, the call may
/// still apply and its reply will never be read: its keys are left suspect,
/// and no longer counted in flight, so that they are repaired.
struct Waiting<'a> {
    engine: &'a ResilientEngine,
    batch: &'a Batch,
    sent_ms: u64,
    armed: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let e = self.engine;
        let now = e.clock.now_ms();
        let sent = e.redis_now(self.sent_ms).saturating_sub(e.cfg.deadline_ms);
        for c in &self.batch.charges {
            e.ledger.mark_suspect(&c.key, &c.spec, now, sent);
            e.ledger.note_answered(&c.key, c.refund);
        }
    }
}

struct Late {
    batch: Batch,
    result: Result<RawReply, CallError>,
    /// The request was denied unanswered (not decided on a lease).
    denied_unanswered: bool,
    /// The breaker already heard of this call as a failure.
    failure_counted: bool,
    started: Instant,
    /// Local time the call was sent.
    sent_ms: u64,
}

/// Late calls that have completed, for the recovery loop to fold in.
#[derive(Default)]
pub(super) struct LateQueue {
    done: Mutex<Vec<Late>>,
    /// Deferred calls not completed yet.
    pending: std::sync::atomic::AtomicUsize,
    pub notify: Notify,
}

impl LateQueue {
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::Relaxed)
    }
}

/// The answer to a request Redis did not answer in time: denied, every
/// enforcing charge reported over with nothing remaining. In global shadow
/// mode, or when no charge enforces, nothing is ever denied.
pub(super) fn unanswered(batch: &Batch) -> BatchOutcome {
    let denies = !batch.never_deny && batch.charges.iter().any(|c| c.role != Role::Shadow);
    BatchOutcome {
        items: batch
            .charges
            .iter()
            .map(|c| ItemOutcome {
                over: denies && c.role != Role::Shadow,
                remaining: 0,
                reset_ms: 0,
            })
            .collect(),
        denied: denies,
        path: DecisionPath::Unanswered,
    }
}

impl ResilientEngine {
    /// Answering unless a call sent after the last answer has waited
    /// longer than [`ALIVE_MS`]: a busy Redis answers something every few
    /// milliseconds, a hung or unreachable one answers nothing.
    fn redis_alive(&self, now: u64) -> bool {
        // Answers the store heard that no request has taken in yet count
        // too: a reply read but not yet processed (its request's task not
        // run), or a Cluster refusing calls for a slot it is moving. Under
        // a closed-loop load every request can end up waiting on moving
        // slots, and with nothing else answered for ALIVE_MS a reshard
        // would look like an outage (seen: breakers tripped mid-reshard,
        // and lease grants past the limit).
        let heard = self.backend.heard();
        if self.heard.swap(heard, Ordering::Relaxed) != heard {
            self.note_answer();
            return true;
        }
        let waiting_since = self.unanswered_since_ms.load(Ordering::Relaxed);
        waiting_since == 0 || now.saturating_sub(waiting_since) <= ALIVE_MS
    }

    /// A call is about to be sent: if none has been answered since the last
    /// answer, the silence is measured from now.
    fn note_sent(&self, now: u64) {
        let _ = self.unanswered_since_ms.compare_exchange(
            0,
            now.max(1),
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }

    /// Redis answered a call (any call: decision, late reply, probe,
    /// replay).
    pub(super) fn note_answer(&self) {
        self.unanswered_since_ms.store(0, Ordering::Relaxed);
    }

    pub(super) async fn decide_on_backend(&self, batch: &Batch, now: u64) -> Decided {
        let redis_now = self.redis_now(now);
        let n = batch.charges.len();
        let mut marks: Vec<(u64, bool)> = Vec::with_capacity(n);
        let mut pending = Vec::with_capacity(n);
        let mut expected: Vec<(i64, u64)> = Vec::with_capacity(n);
        for c in &batch.charges {
            let w = window_of(&c.spec, redis_now);
            match self.ledger.note_issue(&c.key, &c.spec, now, c.refund, w) {
                Some((mark, i)) => {
                    marks.push(mark);
                    pending.push((i.pending, i.settled, i.demand_known));
                    expected.push((i.expected, w));
                }
                None => {
                    // Suspect (its repair may be on its way): decided on
                    // the lease. Routing does not look, so this is where a
                    // suspect key leaves the Redis path.
                    for c in &batch.charges[..marks.len()] {
                        self.ledger.note_answered(&c.key, c.refund);
                    }
                    return Decided::Failed;
                }
            }
        }
        let presume = self.presume(batch, redis_now, &pending);
        let alive = self.redis_alive(now);
        self.note_sent(now);
        let budget = if alive {
            self.cfg.budget_max_ms
        } else {
            self.cfg.deadline_ms
        };
        let started = Instant::now();
        let backend = self.backend.clone();
        let owned = batch.clone();
        let mut waiting = Waiting {
            engine: self,
            batch,
            sent_ms: now,
            armed: true,
        };
        // Polled here, on the request's own task, while within its budget:
        // the reply then wakes the request directly (a task spawned per
        // call cost a cross-thread hand-off each way, measured at a tenth
        // of a call's CPU). Only a call past its budget, or one whose
        // request went away, moves to a task of its own on the engine's
        // runtime. Declared after `waiting`, so dropped before it.
        let mut call = InFlight {
            call: Some(Box::pin(async move {
                backend.decide(&owned, &expected, &presume).await
            })),
            home: &self.home,
        };
        let timed = tokio::time::timeout(Duration::from_millis(budget), &mut call).await;
        let late = call.call.take();
        let result = match (timed, late) {
            (Ok(result), _) => result,
            (Err(_), None) => Err(CallError::Reply("call lost its future".into())),
            (Err(_), Some(call)) => {
                let failure_counted = !alive;
                if failure_counted {
                    let reason = format!("no answer within {budget} ms");
                    self.stats.redis_failures.fetch_add(1, Ordering::Relaxed);
                    self.transition(|b| b.on_failure(self.clock.now_ms(), &reason));
                } else {
                    self.stats
                        .unanswered_denials
                        .fetch_add(1, Ordering::Relaxed);
                }
                self.defer(call, batch.clone(), alive, failure_counted, started, now);
                // The late queue answers for it from here.
                waiting.armed = false;
                return if alive {
                    Decided::Unanswered
                } else {
                    Decided::Failed
                };
            }
        };
        self.observe(started);
        let result = self.weigh_loss(batch, &marks, result);
        waiting.armed = false;
        let moving = matches!(result, Err(CallError::SlotMoving(_)));
        let outcome = self.settle_call(batch, result, now, started);
        // After the reply's deltas are recorded (or the key marked suspect),
        // so the confirmed count already includes this call's refund.
        for c in &batch.charges {
            self.ledger.note_answered(&c.key, c.refund);
        }
        match outcome {
            Some(o) => Decided::Answered(o),
            // Redis is busy moving the slot, not failing: denied, as a call
            // past its budget is while Redis answers.
            None if moving => {
                self.stats
                    .unanswered_denials
                    .fetch_add(1, Ordering::Relaxed);
                Decided::Unanswered
            }
            None => Decided::Failed,
        }
    }

    fn observe(&self, started: Instant) {
        if let Some(h) = self.redis_call_seconds.get() {
            h.observe(started.elapsed().as_secs_f64());
        }
    }

    /// A "lost" answer is evidence only if no refund of this replica can
    /// have run on the key between `expected` being read and the call.
    fn weigh_loss(
        &self,
        batch: &Batch,
        marks: &[(u64, bool)],
        result: Result<RawReply, CallError>,
    ) -> Result<RawReply, CallError> {
        // Only a "lost" answer needs the check (the common reply skips it).
        let refunds_moved = || {
            batch
                .charges
                .iter()
                .zip(marks)
                .any(|(c, &(sent, in_flight))| {
                    in_flight || c.refund || self.ledger.refund_mark(&c.key).0 != sent
                })
        };
        result.map(|mut reply| {
            if reply.lost && refunds_moved() {
                reply.lost = false;
                self.stats
                    .loss_checks_skipped
                    .fetch_add(1, Ordering::Relaxed);
            }
            reply
        })
    }

    /// Leaves a call past its budget running; its result lands in the late
    /// queue and wakes the recovery loop.
    fn defer(
        &self,
        call: LateCall,
        batch: Batch,
        denied_unanswered: bool,
        failure_counted: bool,
        started: Instant,
        sent_ms: u64,
    ) {
        let queue = self.late.clone();
        queue.pending.fetch_add(1, Ordering::Relaxed);
        self.home.spawn(async move {
            let result = call.await;
            queue.done.lock().push(Late {
                batch,
                result,
                denied_unanswered,
                failure_counted,
                started,
                sent_ms,
            });
            queue.pending.fetch_sub(1, Ordering::Relaxed);
            queue.notify.notify_one();
        });
    }

    /// Folds in every late call that has completed (see the module docs).
    pub(super) fn absorb_late(&self) {
        let done: Vec<Late> = std::mem::take(&mut *self.late.done.lock());
        for late in done {
            self.observe(late.started);
            self.stats.late_replies.fetch_add(1, Ordering::Relaxed);
            let now = self.clock.now_ms();
            match late.result {
                Ok(reply) => self.fold_late(&late.batch, &reply, late.denied_unanswered, now),
                Err(e) => self.on_call_failed(&late.batch, &e, !late.failure_counted, late.sent_ms),
            }
            for c in &late.batch.charges {
                self.ledger.note_answered(&c.key, c.refund);
            }
        }
    }

    /// A late reply: what Redis counted becomes confirmed, and is taken
    /// back through the local field, where this replica's own decision
    /// (a lease grant, or nothing) already stands.
    fn fold_late(&self, batch: &Batch, reply: &RawReply, denied_unanswered: bool, now: u64) {
        self.note_answer();
        if denied_unanswered && !reply.denied && reply.items.iter().any(|i| i.delta > 0) {
            self.stats.wrong_denials.fetch_add(1, Ordering::Relaxed);
        }
        for (c, item) in batch.charges.iter().zip(&reply.items) {
            let at = item.decided_at(reply.now_ms);
            self.ledger.record_redis(&c.key, &c.spec, at, now, item);
            let window = window_of(&c.spec, at);
            self.ledger
                .record_local(&c.key, &c.spec, window, now, -item.delta);
        }
        self.wake.notify_one();
    }

    /// A backend call's result: the outcome on a reply; on a failure the
    /// keys become suspect if the call may have run, and the breaker hears
    /// of it.
    fn settle_call(
        &self,
        batch: &Batch,
        result: Result<RawReply, CallError>,
        now: u64,
        started: Instant,
    ) -> Option<BatchOutcome> {
        match result {
            Ok(reply) => {
                self.breaker.lock().on_success();
                Some(self.on_reply(batch, &reply, started))
            }
            Err(e) => {
                tracing::debug!(error = %e, "Redis call failed; deciding locally");
                self.on_call_failed(batch, &e, true, now);
                None
            }
        }
    }

    /// A call that ended without a reply: its keys become suspect if it may
    /// have run, and (unless already told at its budget) the breaker hears
    /// of a failure.
    fn on_call_failed(&self, batch: &Batch, e: &CallError, count_failure: bool, sent_ms: u64) {
        let now = self.clock.now_ms();
        self.mark_trouble(now);
        if e.maybe_applied() {
            // Early by a deadline: the offset to Redis's clock is an
            // estimate, off by up to half a round trip.
            let sent = self.redis_now(sent_ms).saturating_sub(self.cfg.deadline_ms);
            for c in &batch.charges {
                self.ledger.mark_suspect(&c.key, &c.spec, now, sent);
            }
        }
        // A slot being moved is a busy Cluster, not a failing one: the
        // breaker does not hear of it (seen: a reshard under load tripping
        // breakers, and lease grants the replicas on Redis could not see).
        if count_failure && e.is_failure() {
            let reason = e.to_string();
            self.stats.redis_failures.fetch_add(1, Ordering::Relaxed);
            self.transition(|b| b.on_failure(now, &reason));
        }
    }

    fn on_reply(&self, batch: &Batch, reply: &RawReply, started: Instant) -> BatchOutcome {
        let now = self.clock.now_ms();
        self.note_answer();
        // When Redis ran the call, on this replica's clock: half the round
        // trip ago, the trip timed on the monotonic clock. The midpoint of
        // the wall clock's reads at sending and now would carry half of a
        // step of the wall clock during the call (a time sync correcting
        // it) into the offset, and keep it there until the next reply: on
        // leases, the replica's windows would start and end that much off
        // Redis's.
        let half_trip = u64::try_from(started.elapsed().as_millis() / 2).unwrap_or(u64::MAX);
        let mid = now.saturating_sub(half_trip);
        self.offset_ms
            .store(reply.now_ms as i64 - mid as i64, Ordering::Relaxed);
        for (c, item) in batch.charges.iter().zip(&reply.items) {
            let at = item.decided_at(reply.now_ms);
            self.ledger.record_redis(&c.key, &c.spec, at, now, item);
        }
        if reply.lost {
            self.stats
                .data_loss_detected
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!("Redis lost counts this replica had written (restarted empty or failed over): re-asserting");
            self.ledger.reassert_all();
            self.wake.notify_one();
        }
        self.stats.redis_decisions.fetch_add(1, Ordering::Relaxed);
        let outcome = reply.outcome();
        let refuted = self.over.learn(batch, &outcome, now, reply.now_ms);
        if refuted > 0 {
            self.stats
                .cache_refuted
                .fetch_add(refuted, Ordering::Relaxed);
        }
        outcome
    }
}
