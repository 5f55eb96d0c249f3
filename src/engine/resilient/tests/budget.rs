//! The budget against a busy Redis and a silent one: unanswered calls are
//! denied while Redis answers, their late replies folded in; a silent Redis
//! is an outage decided on leases.

use std::sync::atomic::Ordering;

use super::rig::*;
use crate::domain::backend::ReplayKind;
use crate::domain::DecisionPath;
use crate::engine::resilient::breaker::BreakerState;
use crate::engine::resilient::call::ALIVE_MS;

/// Lets spawned tasks (the late call's completion) run.
async fn settle_tasks() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_busy_redis_denies_unanswered_calls_and_takes_their_counts_back() {
    let mut rig = Rig::new();
    assert_eq!(rig.hit("a").await, DecisionPath::Redis);
    rig.fake.set(Mode::Slow);
    // Redis answered just now: the call waits the whole budget, then the
    // request is denied, not granted on a lease.
    assert_eq!(rig.hit("a").await, DecisionPath::Unanswered);
    assert_eq!(rig.state(), BreakerState::Healthy, "slowness is no failure");
    assert_eq!(
        rig.engine.stats.unanswered_denials.load(Ordering::SeqCst),
        1
    );
    assert_eq!(rig.engine.stats.redis_failures.load(Ordering::SeqCst), 0);
    // Redis gets to it and admits it: counted there, denied here.
    rig.fake.set(Mode::Up);
    rig.fake.release();
    settle_tasks().await;
    assert_eq!(rig.fake.total(&rig.key("a"), &rig.spec), 2);
    rig.tick().await;
    assert_eq!(rig.engine.stats.late_replies.load(Ordering::SeqCst), 1);
    assert_eq!(rig.engine.stats.wrong_denials.load(Ordering::SeqCst), 1);
    // The count is taken back through the local field: Redis = grants.
    assert_eq!(rig.fake.replays(), [vec![(ReplayKind::Local, -1)]]);
    assert_eq!(rig.pending(), (0, 0, 0), "nothing suspect, nothing left");
    rig.assert_exact();
    assert_eq!(rig.hit("a").await, DecisionPath::Redis);
    rig.assert_exact();
}

#[tokio::test(start_paused = true)]
async fn a_silent_redis_is_an_outage_decided_on_leases() {
    let mut rig = Rig::new();
    rig.hit("a").await;
    rig.fake.set(Mode::Slow);
    assert_eq!(rig.hit("a").await, DecisionPath::Unanswered);
    // Nothing answered for longer than ALIVE_MS: the short budget, a
    // failure per call, lease grants, and the breaker trips.
    rig.clock.advance(ALIVE_MS + 1);
    for i in 1..=3 {
        assert_eq!(rig.hit("a").await, DecisionPath::Local, "call {i}");
    }
    assert_eq!(rig.state(), BreakerState::Tripped);
    assert_eq!(rig.engine.stats.redis_failures.load(Ordering::SeqCst), 3);
    // The hung calls answer after all: each lease grant Redis also admitted
    // counts once, the denied one not at all.
    rig.fake.set(Mode::Up);
    rig.fake.release();
    settle_tasks().await;
    rig.recover().await;
    assert_eq!(rig.engine.stats.late_replies.load(Ordering::SeqCst), 4);
    assert_eq!(rig.pending(), (0, 0, 0));
    rig.assert_exact();
}

/// A store that answers something is not silent, even when no request
/// has taken an answer in: a Cluster refusing the calls for a slot it is
/// moving (all a closed-loop load's requests can end up waiting on such
/// slots) is busy, not down, so its calls are denied past the budget
/// rather than granted on leases the replicas on Redis cannot see.
#[tokio::test(start_paused = true)]
async fn a_store_that_refuses_calls_for_a_moving_slot_is_not_silent() {
    let mut rig = Rig::new();
    rig.hit("a").await;
    rig.fake.set(Mode::Slow);
    assert_eq!(rig.hit("a").await, DecisionPath::Unanswered);
    rig.clock.advance(ALIVE_MS + 1);
    for i in 1..=3 {
        rig.fake.heard.fetch_add(1, Ordering::SeqCst);
        assert_eq!(rig.hit("a").await, DecisionPath::Unanswered, "call {i}");
    }
    assert_eq!(rig.state(), BreakerState::Healthy);
    assert_eq!(rig.engine.stats.redis_failures.load(Ordering::SeqCst), 0);
    // Nothing heard for ALIVE_MS: silent, the short budget and leases.
    rig.clock.advance(ALIVE_MS + 1);
    assert_eq!(rig.hit("a").await, DecisionPath::Local);
    rig.fake.set(Mode::Up);
    rig.fake.release();
    settle_tasks().await;
    rig.tick().await;
}

/// A call refused because its slot is being moved never ran, and the
/// Cluster that refused it is busy, not failing: the request is denied
/// (never granted on a lease the replicas on Redis cannot see), nothing
/// turns suspect, and the breaker does not count it.
#[tokio::test(start_paused = true)]
async fn a_slot_being_moved_is_no_breaker_failure() {
    let mut rig = Rig::new();
    rig.hit("a").await;
    rig.fake.set(Mode::Moving);
    for i in 1..=5 {
        assert_eq!(rig.hit("a").await, DecisionPath::Unanswered, "call {i}");
    }
    assert_eq!(rig.state(), BreakerState::Healthy);
    assert_eq!(rig.engine.stats.redis_failures.load(Ordering::SeqCst), 0);
    assert_eq!(rig.pending(), (0, 0, 0), "nothing suspect");
    rig.fake.set(Mode::Up);
    assert_eq!(rig.hit("a").await, DecisionPath::Redis);
    rig.assert_exact();
}

/// A request routed to Redis whose key turns suspect before its call is
/// noted (its repair may be on its way) is decided on the lease, and no
/// call leaves: one that ran before the repair would be overwritten by it.
#[tokio::test(start_paused = true)]
async fn a_key_turned_suspect_after_routing_sends_no_call() {
    let rig = Rig::new();
    let batch = rig.batch("a");
    let now = crate::clock::Clock::now_ms(rig.clock.as_ref());
    let ledger = rig.engine.ledger();
    ledger.mark_suspect(&rig.key("a"), &rig.spec, now, now);
    let calls = rig.fake.decide_calls.load(Ordering::SeqCst);
    assert!(matches!(
        rig.engine.decide_on_backend(&batch, now).await,
        crate::engine::resilient::call::Decided::Failed
    ));
    assert_eq!(rig.fake.decide_calls.load(Ordering::SeqCst), calls);
    assert_eq!(rig.pending().2, 1, "still suspect, for its repair");
}

/// A client that goes away mid-call (its request's future dropped, as on
/// an HTTP/2 RST_STREAM) does not cut the call off: it finishes on the
/// engine's runtime, so multi-step calls (across Cluster slots, a fenced
/// retry) complete, and its keys are left suspect for repair.
#[tokio::test(start_paused = true)]
async fn a_call_whose_client_went_away_still_finishes() {
    let mut rig = Rig::new();
    assert_eq!(rig.hit("a").await, DecisionPath::Redis);
    rig.fake.set(Mode::Slow);
    let gone = tokio::time::timeout(
        std::time::Duration::from_millis(BUDGET_MAX_MS / 3),
        rig.hit("a"),
    )
    .await;
    assert!(gone.is_err(), "the client gave up before the budget");
    rig.fake.set(Mode::Up);
    rig.fake.release();
    settle_tasks().await;
    assert_eq!(
        rig.fake.total(&rig.key("a"), &rig.spec),
        2,
        "the abandoned call ran to its end"
    );
    assert_eq!(rig.pending().2, 1, "its key is suspect, to be repaired");
}

/// A take-back not replayed yet leaves the local count below what Redis
/// holds. The call carries only what adds to Redis's count: it may run
/// after the replay has written the take-back, and subtracting it again
/// there would free one grant twice (a limit of 1 admitted twice).
#[tokio::test(start_paused = true)]
async fn a_take_back_is_never_carried_as_a_negative_count() {
    let rig = Rig::new();
    let batch = rig.batch("a");
    let now = crate::clock::Clock::now_ms(rig.clock.as_ref());
    let taken_back = rig.engine.presume(&batch, now, &[(-1, false, false)]);
    assert_eq!(taken_back.charges[0].pending, 0);
    let granted_locally = rig.engine.presume(&batch, now, &[(3, false, false)]);
    assert_eq!(granted_locally.charges[0].pending, 3, "lease grants count");
}
