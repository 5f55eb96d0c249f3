//! The local path's own bounds: hits clamped as on the Redis path, and a
//! restarted replica's leases starting from what its journal says it had
//! already granted.

use super::rig::*;
use crate::domain::backend::ReplayKind;
use crate::domain::{Batch, Charge, MAX_HITS};
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
