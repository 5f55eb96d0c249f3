//! Validation and a decision on the in-memory engine for arbitrary JSON
//! requests against fixed rules: every valid request gets one status per
//! descriptor, and what remains never exceeds its limit.
#![no_main]

use std::path::Path;
use std::sync::{Arc, OnceLock};

use arc_swap::ArcSwap;
use leasehold::clock::ManualClock;
use leasehold::decision::{DecisionSettings, Limiter};
use leasehold::engine::MemoryEngine;
use libfuzzer_sys::fuzz_target;

const RULES: &str = "domain: f
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 5}
  - key: path
    value: /api/*
    rate_limit: {unit: minute, requests_per_unit: 3, algorithm: sliding_log}
  - key: tb
    rate_limit: {unit: hour, requests_per_unit: 100, algorithm: token_bucket, burst: 10}
  - key: sw
    rate_limit: {unit: day, requests_per_unit: 7, algorithm: sliding_window}
    descriptors:
      - key: inner
        rate_limit: {unit: second, requests_per_unit: 1}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 0}
";

fn limiter() -> &'static Limiter {
    static L: OnceLock<Limiter> = OnceLock::new();
    L.get_or_init(|| {
        let rules = leasehold::rules::load_text(Path::new("f.yaml"), RULES, Default::default())
            .expect("fuzz rules load");
        let engine = Arc::new(MemoryEngine::with_max_bytes(
            Arc::new(ManualClock::new(1_700_000_000_000)),
            1 << 20,
        ));
        Limiter::new(
            Arc::new(ArcSwap::from_pointee(rules)),
            engine,
            DecisionSettings::default(),
        )
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(proto) = leasehold::rls::json::parse_request(data) else {
        return;
    };
    let Ok(req) = leasehold::rls::to_domain(proto, &leasehold::rls::Bounds::default()) else {
        return;
    };
    let decision = futures_executor::block_on(limiter().decide(&req)).expect("memory never fails");
    assert_eq!(decision.statuses.len(), req.descriptors.len());
    for s in &decision.statuses {
        if let Some(l) = &s.current_limit {
            assert!(s.limit_remaining <= l.requests_per_unit);
        }
    }
});
