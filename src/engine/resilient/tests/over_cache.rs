//! The over-limit cache against the fake backend: what it answers, for how
//! long, and what clears it.

use std::sync::atomic::Ordering;

use super::rig::*;
use crate::clock::Clock;
use crate::domain::{Batch, Charge, DecisionPath};
use crate::engine::Engine;
use crate::limit::{LimitSpec, Role, Unit};

const LIFETIME_MS: u64 = 250;

/// A rig with a 3-per-minute limit and the cache on.
fn rig() -> Rig {
    let mut rig = Rig::with_over_cache(LIFETIME_MS);
    rig.spec = LimitSpec::fixed(3, Unit::Minute);
    rig
}

fn charge(rig: &Rig, v: &str, spec: LimitSpec, hits: u64, refund: bool, role: Role) -> Batch {
    Batch {
        charges: vec![Charge {
            key: rig.key(v),
            spec,
            hits,
            refund,
            role,
        }],
        never_deny: false,
    }
}

async fn path(rig: &Rig, batch: &Batch) -> DecisionPath {
    rig.engine.apply(batch).await.expect("never an error").path
}

fn calls(rig: &Rig) -> usize {
    rig.fake.decide_calls.load(Ordering::SeqCst)
}

/// Fills the key to its limit and takes the first denial from Redis.
async fn over(rig: &mut Rig, v: &str) {
    for _ in 0..3 {
        assert!(rig.hit_admitted(v).await);
    }
    assert_eq!(
        rig.hit(v).await,
        DecisionPath::Redis,
        "the first denial is Redis's"
    );
}

#[tokio::test]
async fn an_over_key_is_denied_without_a_call_until_the_entry_ends() {
    let mut rig = rig();
    over(&mut rig, "a").await;
    let before = calls(&rig);
    for _ in 0..10 {
        assert_eq!(rig.hit("a").await, DecisionPath::Cached);
    }
    assert_eq!(calls(&rig), before, "no Redis call for cached denials");
    assert_eq!(rig.engine.stats.cached_denials.load(Ordering::SeqCst), 10);
    // The entry lives LIFETIME_MS: then Redis is asked again (still over),
    // and the answer is cached again.
    rig.clock.advance(LIFETIME_MS);
    assert_eq!(rig.hit("a").await, DecisionPath::Redis);
    assert_eq!(rig.hit("a").await, DecisionPath::Cached);
    rig.assert_exact();
}

#[tokio::test]
async fn a_new_window_is_asked_of_redis() {
    let mut rig = rig();
    over(&mut rig, "a").await;
    let into = rig.clock.now_ms() % 60_000;
    rig.clock.advance(60_000 - into);
    assert_eq!(rig.hit("a").await, DecisionPath::Redis);
    assert!(rig.hit_admitted("a").await, "the new window admits");
}

#[tokio::test]
async fn a_refund_on_this_replica_clears_the_key_at_once() {
    let mut rig = rig();
    over(&mut rig, "a").await;
    let spec = rig.spec;
    let refund = charge(&rig, "a", spec, 1, true, Role::Enforce);
    assert_eq!(path(&rig, &refund).await, DecisionPath::Redis);
    assert_ne!(
        rig.hit("a").await,
        DecisionPath::Cached,
        "asked of Redis after a refund"
    );
}

#[tokio::test]
async fn a_refund_elsewhere_is_seen_when_the_entry_ends_and_counted_as_refuted() {
    let mut rig = rig();
    over(&mut rig, "a").await;
    // Another replica refunds two hits: this one does not know.
    let w = rig.clock_window();
    rig.fake
        .store
        .lock()
        .redis_field
        .insert((rig.key("a"), w), 1);
    assert_eq!(rig.hit("a").await, DecisionPath::Cached, "within the bound");
    rig.clock.advance(LIFETIME_MS);
    assert!(rig.hit_admitted("a").await, "seen once the entry ended");
    assert_eq!(rig.engine.stats.cache_refuted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn another_limit_shadow_and_quota_and_smaller_charges_go_to_redis() {
    let mut rig = rig();
    over(&mut rig, "a").await;
    let spec = rig.spec;
    let raised = LimitSpec::fixed(10, Unit::Minute);
    let other_limit = charge(&rig, "a", raised, 1, false, Role::Enforce);
    assert_eq!(
        path(&rig, &other_limit).await,
        DecisionPath::Redis,
        "a limit override is its own entry"
    );
    for role in [Role::Shadow, Role::Quota] {
        let b = charge(&rig, "a", spec, 1, false, role);
        assert_eq!(path(&rig, &b).await, DecisionPath::Redis, "{role:?}");
    }
    // A denial of 3 hits says fewer than 3 remained, not that none did.
    let mut rig = self::rig();
    assert!(rig.hit_admitted("b").await);
    let three = charge(&rig, "b", spec, 3, false, Role::Enforce);
    assert_eq!(path(&rig, &three).await, DecisionPath::Redis);
    assert_eq!(path(&rig, &three).await, DecisionPath::Cached);
    assert_eq!(
        rig.hit("b").await,
        DecisionPath::Redis,
        "1 hit may still fit"
    );
}

#[tokio::test]
async fn a_rules_reload_clears_the_cache() {
    let mut rig = rig();
    over(&mut rig, "a").await;
    assert_eq!(rig.hit("a").await, DecisionPath::Cached);
    rig.engine.rules_changed();
    assert_eq!(rig.hit("a").await, DecisionPath::Redis);
}

#[tokio::test]
async fn off_when_the_lifetime_is_zero() {
    let mut rig = Rig::with_over_cache(0);
    rig.spec = LimitSpec::fixed(3, Unit::Minute);
    over(&mut rig, "a").await;
    assert_eq!(rig.hit("a").await, DecisionPath::Redis);
}
