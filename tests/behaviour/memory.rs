//! The behaviour suite on the in-memory engine, plus the cases that need a
//! controlled clock (window resets), which only the memory engine can inject.

use std::sync::Arc;

use crate::suite as behaviour;
use leasehold::clock::{Clock, ManualClock, SystemClock};
use leasehold::decision::Code;
use leasehold::engine::{Engine, MemoryEngine};

async fn memory() -> (Arc<dyn Engine>, ()) {
    (Arc::new(MemoryEngine::new(Arc::new(SystemClock))), ())
}

behaviour_suite!(memory());

/// 2023-11-14T22:13:00Z: a minute boundary.
const T0: u64 = 1_699_999_980_000;

#[tokio::test]
async fn fixed_window_resets_at_the_boundary() {
    let clock = Arc::new(ManualClock::new(T0 + 59_000));
    let engine = Arc::new(MemoryEngine::new(clock.clone()));
    let l = behaviour::limiter(engine);
    for _ in 0..20 {
        assert_eq!(behaviour::one(&l, &[("m20", "t")]).await.overall, Code::Ok);
    }
    let out = behaviour::one(&l, &[("m20", "t")]).await;
    assert_eq!(out.overall, Code::OverLimit);
    assert_eq!(out.statuses[0].reset_ms, Some(1_000));
    clock.advance(1_000);
    let out = behaviour::one(&l, &[("m20", "t")]).await;
    assert_eq!(
        (out.overall, out.statuses[0].limit_remaining),
        (Code::Ok, 19)
    );
    assert_eq!(out.statuses[0].reset_ms, Some(60_000));
}

#[tokio::test]
async fn sliding_window_carries_the_previous_window() {
    let clock = Arc::new(ManualClock::new(T0 + 30_000));
    let engine = Arc::new(MemoryEngine::new(clock.clone()));
    let l = behaviour::limiter(engine);
    for _ in 0..3 {
        assert_eq!(behaviour::one(&l, &[("sw", "t")]).await.overall, Code::Ok);
    }
    // 20 s into the next minute, 2/3 of the previous 3 still count: 2 used.
    clock.set(T0 + 80_000);
    let out = behaviour::one(&l, &[("sw", "t")]).await;
    assert_eq!(
        (out.overall, out.statuses[0].limit_remaining),
        (Code::Ok, 0)
    );
    assert_eq!(
        behaviour::one(&l, &[("sw", "t")]).await.overall,
        Code::OverLimit
    );
}

#[tokio::test]
async fn expired_counters_are_swept() {
    let clock = Arc::new(ManualClock::new(T0));
    let engine = Arc::new(MemoryEngine::new(clock.clone()));
    let l = behaviour::limiter(engine.clone());
    for i in 0..100 {
        behaviour::one(&l, &[("m20", &format!("v{i}"))]).await;
    }
    assert_eq!(engine.len(), 100);
    assert_eq!(engine.sweep(clock.now_ms() + 59_999), 0);
    assert_eq!(engine.sweep(clock.now_ms() + 60_000), 100);
    assert!(engine.is_empty());
}
