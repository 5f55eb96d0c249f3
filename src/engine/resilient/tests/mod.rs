//! The resilient engine without Redis: a scripted fake backend and a manual
//! clock ([`rig`]) drive trip → probe → replay → settle → healthy, lost and
//! late replies, and flaps, with no sleeping.

mod budget;
mod holds;
mod local_path;
mod over_cache;
mod rig;

use std::sync::atomic::Ordering;

use super::breaker::BreakerState;
use crate::domain::backend::ReplayKind;
use crate::domain::DecisionPath;
use rig::*;

#[tokio::test]
async fn trips_after_consecutive_failures_deciding_each_locally() {
    let mut rig = Rig::new();
    assert_eq!(rig.hit("a").await, DecisionPath::Redis);
    rig.fake.set(Mode::Refused);
    for i in 1..=3 {
        assert_eq!(rig.hit("a").await, DecisionPath::Local, "call {i}");
        let want = if i < 3 {
            BreakerState::Healthy
        } else {
            BreakerState::Tripped
        };
        assert_eq!(rig.state(), want, "after {i} refused calls");
    }
    // Refused calls never left: nothing is suspect, three local grants wait.
    assert_eq!(rig.pending(), (1, 3, 0));
    let calls = rig.fake.decide_calls.load(Ordering::SeqCst);
    assert_eq!(rig.hit("a").await, DecisionPath::Local);
    assert_eq!(
        rig.fake.decide_calls.load(Ordering::SeqCst),
        calls,
        "tripped: no call to Redis"
    );
    assert_eq!(rig.pending(), (1, 4, 0));
    // A probe that fails keeps it tripped.
    rig.clock.advance(700);
    rig.tick().await;
    assert_eq!(rig.state(), BreakerState::Tripped);
}

#[tokio::test]
async fn probe_then_replay_then_settle_then_healthy() {
    let mut rig = Rig::new();
    rig.fake.set(Mode::Refused);
    for _ in 0..5 {
        rig.hit("a").await;
    }
    assert_eq!(rig.state(), BreakerState::Tripped);
    rig.fake.set(Mode::Up);
    rig.clock.advance(700);
    rig.tick().await;
    assert_eq!(rig.state(), BreakerState::Probing);
    assert_eq!(rig.hit("a").await, DecisionPath::Local, "probing is local");
    assert_eq!(rig.pending(), (1, 6, 0));
    rig.tick().await;
    assert_eq!(rig.state(), BreakerState::Settling);
    assert_eq!(rig.fake.replays(), [vec![(ReplayKind::Local, 6)]]);
    assert_eq!(rig.pending(), (0, 0, 0));
    rig.assert_exact();
    // Settling stays local and replays once more when the period is over.
    assert_eq!(rig.hit("a").await, DecisionPath::Local);
    rig.clock.advance(SETTLE_MS - 1);
    rig.tick().await;
    assert_eq!(rig.state(), BreakerState::Settling, "not before the period");
    rig.clock.advance(1);
    rig.tick().await;
    assert_eq!(rig.state(), BreakerState::Healthy);
    assert_eq!(rig.fake.replays()[1], [(ReplayKind::Local, 7)]);
    assert_eq!(rig.pending(), (0, 0, 0));
    assert_eq!(rig.hit("a").await, DecisionPath::Redis);
    rig.assert_exact();
    let status = rig.engine.snapshot();
    assert_eq!((status.breaker.state, status.path), ("healthy", "redis"));
    assert_eq!(status.breaker.transitions, 4);
}

#[tokio::test]
async fn a_reply_lost_after_the_script_ran_is_repaired_once() {
    let mut rig = Rig::new();
    for _ in 0..3 {
        rig.hit("a").await;
    }
    rig.fake.set(Mode::LoseReply);
    assert_eq!(rig.hit("a").await, DecisionPath::Local);
    // Redis counted it, and so did the local decision: the key is suspect
    // and stays local until repaired; one failure does not trip.
    assert_eq!(rig.state(), BreakerState::Healthy);
    assert_eq!(rig.pending(), (1, 1, 1));
    assert_eq!(rig.fake.total(&rig.key("a"), &rig.spec), 4);
    rig.fake.set(Mode::Up);
    let calls = rig.fake.decide_calls.load(Ordering::SeqCst);
    assert_eq!(rig.hit("a").await, DecisionPath::Local, "suspect: local");
    assert_eq!(rig.hit("b").await, DecisionPath::Redis, "other keys: Redis");
    assert_eq!(rig.fake.decide_calls.load(Ordering::SeqCst), calls + 1);
    // Within the quiet time only the local usage is replayed.
    rig.tick().await;
    assert_eq!(rig.fake.replays(), [vec![(ReplayKind::Local, 2)]]);
    assert_eq!(rig.pending(), (1, 0, 1));
    // Then the repair sets the Redis-path field to the confirmed 3.
    rig.clock.advance(DEADLINE_MS + 10);
    rig.tick().await;
    assert_eq!(rig.fake.replays()[1], [(ReplayKind::Repair, 3)]);
    assert_eq!(rig.pending(), (0, 0, 0));
    assert_eq!(rig.hit("a").await, DecisionPath::Redis);
    rig.assert_exact();
    assert_eq!(rig.granted[&rig.key("a")], 6);
}

#[tokio::test]
async fn a_late_execution_after_the_deadline_counts_once() {
    let mut rig = Rig::new();
    rig.hit("a").await;
    rig.fake.set(Mode::Late);
    assert_eq!(rig.hit("a").await, DecisionPath::Local);
    assert_eq!(rig.pending(), (1, 1, 1));
    rig.fake.set(Mode::Up);
    // The script Redis had queued runs after the caller gave up.
    rig.fake.run_late();
    assert_eq!(rig.fake.total(&rig.key("a"), &rig.spec), 2, "late run");
    rig.clock.advance(DEADLINE_MS + 10);
    rig.tick().await;
    let replayed = rig.fake.replays();
    assert_eq!(
        replayed,
        [vec![(ReplayKind::Local, 1), (ReplayKind::Repair, 1)]]
    );
    assert_eq!(rig.pending(), (0, 0, 0));
    rig.assert_exact();
    assert_eq!(rig.fake.total(&rig.key("a"), &rig.spec), 2);
}

#[tokio::test]
async fn ten_flaps_end_healthy_with_redis_holding_the_grants() {
    let mut rig = Rig::new();
    for flap in 0..10 {
        for _ in 0..4 {
            assert_eq!(rig.hit("a").await, DecisionPath::Redis, "flap {flap}");
        }
        rig.fake.set(Mode::Refused);
        for _ in 0..5 {
            assert_eq!(rig.hit("a").await, DecisionPath::Local);
        }
        assert_eq!(rig.state(), BreakerState::Tripped, "flap {flap}");
        assert_eq!(rig.pending(), (1, 5, 0), "flap {flap}");
        rig.clock.advance(700);
        rig.tick().await;
        assert_eq!(rig.state(), BreakerState::Tripped, "probe refused");
        rig.recover().await;
        assert_eq!(rig.pending(), (0, 0, 0), "flap {flap}");
        rig.assert_exact();
    }
    assert_eq!(rig.granted[&rig.key("a")], 90);
    let status = rig.engine.snapshot();
    assert_eq!(status.breaker.transitions, 40);
    assert_eq!(status.ledger.dropped_usage, 0);
    assert_eq!(status.decisions.local, 50);
}
