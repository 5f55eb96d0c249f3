//! The local path's own bounds: hits clamped as on the Redis path, a
//! restarted replica's leases starting from what its journal says it had
//! already granted, and lease windows on Redis's time after a step of the
//! wall clock.

use std::sync::atomic::Ordering;

use super::rig::*;
use crate::clock::Clock;
use crate::domain::backend::ReplayKind;
use crate::domain::{Batch, Charge, DecisionPath, MAX_HITS};
use crate::engine::resilient::breaker::BreakerState;
use crate::engine::resilient::journal::{Journal, JournalEntry};
use crate::engine::Engine;
use crate::limit::Role;

fn huge(rig: &Rig, v: &str, role: Role) -> Batch {
    Batch {
        charges: vec![Charge {
            key: rig.key(v),
            spec: rig.spec,
            hits: u64::MAX,
            refund: false,
            role,
        }],
        never_deny: false,
    }
}

#[tokio::test]
async fn huge_hits_on_the_local_path_count_max_hits_and_replay_without_overflow() {
    let mut rig = Rig::new();
    rig.fake.set(Mode::Refused);
    for _ in 0..3 {
        rig.hit("a").await;
    }
    assert_eq!(rig.state(), BreakerState::Tripped);
    for (v, role) in [
        ("s1", Role::Shadow),
        ("s2", Role::Shadow),
        ("q", Role::Quota),
    ] {
        let batch = huge(&rig, v, role);
        for _ in 0..2 {
            rig.engine.apply(&batch).await.expect("decided locally");
        }
    }
    // The shadow charges count (a shadow rule never denies); the lone quota
    // charge is over its lease, so its request is denied and charges
    // nothing. Every charge counted at most MAX_HITS.
    let (keys, hits, suspect) = rig.pending();
    assert_eq!((keys, suspect), (3, 0), "a, s1 and s2 wait for replay");
    assert!(hits > 0, "the sum of unreplayed hits did not wrap: {hits}");
    assert!(hits <= 3 + 6 * MAX_HITS as i64, "{hits}");
    rig.recover().await;
    assert_eq!(rig.pending(), (0, 0, 0));
    for batch in rig.fake.replays() {
        for (kind, value) in batch {
            assert_eq!(kind, ReplayKind::Local);
            assert!(
                (0..=2 * MAX_HITS as i64).contains(&value),
                "replayed {value}"
            );
        }
    }
}

#[tokio::test]
async fn a_replica_restarted_from_its_journal_keeps_its_lease_used() {
    let dir = tempfile::tempdir().expect("temp dir");
    let first = Rig::new();
    let key = first.key("a");
    let window = first.clock_window();
    let journal = Journal::open(dir.path(), "r1").expect("journal");
    // The previous run granted 600 of its 1,000 lease in this window and
    // could not replay them before it stopped.
    journal
        .store(&[JournalEntry::new(&key, &first.spec, window, 600)])
        .expect("store");
    let mut rig = Rig::with_journal(Some(journal));
    rig.fake.set(Mode::Refused);
    let mut admitted = 0;
    for _ in 0..1_000 {
        if rig.hit_admitted("a").await {
            admitted += 1;
        }
    }
    assert_eq!(
        admitted, 400,
        "the restarted lease admits only what the previous run left"
    );
    assert_eq!(rig.pending(), (1, 1_000, 0), "600 restored + 400 new");
}

/// The fault model end to end, on the fake store: a call past its budget
/// is denied and runs late, so its count is taken back through the local
/// field; the replay of that take-back fails after the store applied it;
/// lease grants follow in an outage; the replica crashes and restarts from
/// its journal. The store must end up holding exactly what was admitted:
/// the restarted replica writes on top of the field as it finds it, which
/// is the take-back's lower count.
#[tokio::test]
async fn a_restart_from_the_journal_after_a_replay_in_doubt_counts_exactly() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut rig = Rig::with_journal(Some(Journal::open(dir.path(), "r1").expect("journal")));
    let key = rig.key("a");
    assert!(rig.hit_admitted("a").await, "on Redis");
    rig.fake.set(Mode::Slow);
    assert!(!rig.hit_admitted("a").await, "past its budget: denied");
    // The call runs now and answers late: Redis counted a request that was
    // denied, and the late reply takes it back locally.
    rig.fake.release();
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    rig.fake.set(Mode::Up);
    rig.fake.store.lock().replay_loses_reply = true;
    for _ in 0..3 {
        rig.clock.advance(DEADLINE_MS + 10);
        rig.tick().await;
    }
    let attempted = rig.fake.replays();
    assert!(
        attempted
            .iter()
            .flatten()
            .any(|&(kind, v)| kind == ReplayKind::Local && v == -1),
        "the take-back was replayed (and its reply lost): {attempted:?}"
    );
    assert_eq!(
        rig.fake
            .store
            .lock()
            .local_field
            .get(&(key.clone(), rig.clock_window())),
        Some(&-1)
    );
    // An outage: lease grants bring the local count back above zero.
    rig.fake.store.lock().replay_loses_reply = false;
    rig.fake.set(Mode::Refused);
    let mut local = 0;
    for _ in 0..6 {
        if rig.hit_admitted("a").await {
            local += 1;
        }
    }
    assert!(local >= 2, "granted on the lease: {local}");
    rig.clock.advance(200);
    rig.tick().await;
    // A crash, then a restart from the journal with Redis back.
    let mut second = rig.restarted(Journal::open(dir.path(), "r1").expect("journal"));
    drop(rig);
    second.fake.set(Mode::Up);
    for _ in 0..4 {
        second.clock.advance(700);
        second.tick().await;
    }
    assert_eq!(second.pending().1, 0, "replayed");
    second.assert_exact();
}

/// The wall clock stepped back 10 s (a time sync) while a call was out,
/// on the replica's host and Redis's alike. The replica's estimate of
/// Redis's time must follow the step, not half of it: from the midpoint of
/// its two wall-clock reads it put Redis 5 s behind, so decisions on its
/// leases fell in windows 5 s off the ones Redis and the clients use.
#[tokio::test]
async fn a_wall_clock_step_during_a_call_leaves_lease_windows_on_redis_time() {
    let mut rig = Rig::new();
    // 30 s into the rig's minute window; stepped back to 20 s into it.
    rig.clock.advance(29_000);
    rig.fake.step_during_call.store(-10_000, Ordering::SeqCst);
    assert_eq!(rig.hit("a").await, DecisionPath::Redis);
    assert_eq!(rig.clock.now_ms() % 60_000, 20_000, "the step happened");
    rig.fake.set(Mode::Refused);
    let outcome = rig
        .engine
        .apply(&rig.batch("a"))
        .await
        .expect("never an error");
    assert_eq!(outcome.path, DecisionPath::Local);
    assert_eq!(
        outcome.items[0].reset_ms, 40_000,
        "the lease's window ends when Redis's does, 40 s after the stepped clock"
    );
}
