//! Holds: a replica deciding off Redis holds there what it may still grant
//! of its lease (current and next window), and releases it when back.

use super::rig::*;
use crate::engine::resilient::breaker::BreakerState;

#[tokio::test]
async fn a_replica_off_redis_holds_its_unspent_lease_until_it_is_back() {
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
    rig.tick().await;
    assert_eq!(rig.state(), BreakerState::Settling);
    let w = rig.clock_window();
    let key = rig.key("a");
    // One member, no demand known: the lease is the whole limit, 5 of it
    // granted locally.
    assert_eq!(rig.fake.hold(&key, w), Some(995));
    assert_eq!(rig.fake.hold(&key, w + 1), Some(1_000));
    // Granting more while settling lowers the hold.
    rig.hit("a").await;
    rig.tick().await;
    assert_eq!(rig.fake.hold(&key, w), Some(994));
    // Back on Redis: nothing is held any more.
    rig.clock.advance(SETTLE_MS);
    rig.tick().await;
    assert_eq!(rig.state(), BreakerState::Healthy);
    rig.tick().await;
    assert_eq!(rig.fake.hold(&key, w), Some(0));
    assert_eq!(rig.fake.hold(&key, w + 1), Some(0));
    rig.assert_exact();
}
