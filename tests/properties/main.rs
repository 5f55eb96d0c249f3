//! Property tests: each algorithm against a simple reference model (never
//! admits more than the model allows, refunds clamp at 0, no overflow or
//! panic for any hits, unit or burst), and the counter-key encoding
//! (injective, and it splits back into what built it).

use std::collections::VecDeque;

use leasehold::key::{CounterKey, MAX_RAW_VALUE_BYTES};
use leasehold::limit::{evaluate, Algorithm, LimitSpec, State, Unit};
use proptest::prelude::*;

const UNITS: [Unit; 7] = Unit::ALL;
const T0: u64 = 1_700_000_000_000;

fn unit() -> impl Strategy<Value = Unit> {
    (0..UNITS.len()).prop_map(|i| UNITS[i])
}

/// One step: milliseconds since the previous one, hits, refund or not.
fn steps(max_hits: u64) -> impl Strategy<Value = Vec<(u64, u64, bool)>> {
    prop::collection::vec(
        (0u64..3_000, 0..=max_hits, prop::bool::weighted(0.2)),
        1..120,
    )
}

fn spec(algorithm: Algorithm, rpu: u32, unit: Unit, burst: u32) -> LimitSpec {
    LimitSpec {
        requests_per_unit: rpu,
        unit,
        algorithm,
        burst,
    }
}

/// Charges like an engine: commits only when not over.
fn run(spec: &LimitSpec, steps: &[(u64, u64, bool)]) -> Vec<(u64, u64, bool, bool)> {
    let mut now = T0;
    let mut state = State::fresh(spec, now);
    let mut out = Vec::new();
    for &(dt, hits, refund) in steps {
        now += dt;
        let (o, next) = evaluate(spec, &state, now, hits, refund);
        assert!(o.remaining_after <= u64::from(spec.requests_per_unit).max(u64::from(spec.burst)));
        if refund {
            assert!(!o.over, "a refund is never over");
        }
        if !o.over {
            state = next;
        }
        out.push((now, hits, refund, !o.over));
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Fixed window: exactly the model (a count per window, refunds clamped
    /// at 0).
    #[test]
    fn fixed_window_matches_the_model(rpu in 0u32..50, unit in unit(), steps in steps(20)) {
        let s = spec(Algorithm::FixedWindow, rpu, unit, rpu);
        let unit_ms = unit.millis();
        let mut window = u64::MAX;
        let mut count = 0u64;
        for (now, hits, refund, admitted) in run(&s, &steps) {
            let w = now / unit_ms;
            if w != window {
                window = w;
                count = 0;
            }
            let model = if refund {
                count = count.saturating_sub(hits);
                true
            } else if count + hits <= u64::from(rpu) {
                count += hits;
                true
            } else {
                false
            };
            prop_assert_eq!(admitted, model, "at {} hits {} refund {}", now, hits, refund);
        }
    }

    /// Sliding window and token bucket (no refunds): never more than the
    /// limit in any fixed window (sliding window), never more than burst
    /// plus what the elapsed time refills (token bucket).
    #[test]
    fn sliding_window_and_bucket_never_admit_past_their_bound(
        rpu in 1u32..50, burst in 1u32..80, unit in prop_oneof![Just(Unit::Second), Just(Unit::Minute)],
        steps in steps(10),
    ) {
        let charges: Vec<_> = steps.iter().map(|&(dt, h, _)| (dt, h, false)).collect();
        let s = spec(Algorithm::SlidingWindow, rpu, unit, rpu);
        let unit_ms = unit.millis();
        let mut per_window = std::collections::HashMap::<u64, u64>::new();
        for (now, hits, _, admitted) in run(&s, &charges) {
            if admitted {
                *per_window.entry(now / unit_ms).or_default() += hits;
            }
        }
        prop_assert!(per_window.values().all(|&n| n <= u64::from(rpu)), "{:?}", per_window);

        let b = spec(Algorithm::TokenBucket, rpu, unit, burst);
        let mut admitted_total = 0u64;
        for (now, hits, _, admitted) in run(&b, &charges) {
            if admitted {
                admitted_total += hits;
            }
            let refill = (now - T0) as f64 * f64::from(rpu) / unit_ms as f64;
            prop_assert!(admitted_total as f64 <= f64::from(burst) + refill + 1e-6,
                "{} admitted by {} ms", admitted_total, now - T0);
        }
    }

    /// Sliding log (no refunds): whenever it admits, an exact log would have
    /// too (merging grants only ever releases them later).
    #[test]
    fn sliding_log_never_admits_more_than_an_exact_log(
        rpu in 1u32..40, unit in prop_oneof![Just(Unit::Second), Just(Unit::Minute), Just(Unit::Hour)],
        steps in steps(8),
    ) {
        let charges: Vec<_> = steps.iter().map(|&(dt, h, _)| (dt, h, false)).collect();
        let s = spec(Algorithm::SlidingLog, rpu, unit, rpu);
        let unit_ms = unit.millis();
        let mut exact: VecDeque<(u64, u64)> = VecDeque::new();
        for (now, hits, _, admitted) in run(&s, &charges) {
            while exact.front().is_some_and(|&(at, _)| at + unit_ms <= now) {
                exact.pop_front();
            }
            let count: u64 = exact.iter().map(|&(_, h)| h).sum();
            if admitted {
                prop_assert!(count + hits <= u64::from(rpu), "admitted {} at {} over {}", hits, now, count);
                exact.push_back((now, hits));
            }
        }
    }

    /// Any hits, unit, limit and burst: no panic, no overflow, a refund is
    /// never over and a charge past u32 is over unless the limit allows it.
    #[test]
    fn no_input_overflows(
        alg in 0usize..4, rpu in any::<u32>(), burst in any::<u32>(), unit in unit(),
        hits in prop::collection::vec((any::<u64>(), any::<bool>(), any::<u64>()), 1..12),
    ) {
        let algorithm = [Algorithm::FixedWindow, Algorithm::SlidingWindow, Algorithm::SlidingLog, Algorithm::TokenBucket][alg];
        let s = spec(algorithm, rpu, unit, burst);
        let mut state = State::fresh(&s, T0);
        let mut now = T0;
        for (h, refund, dt) in hits {
            now = now.saturating_add(dt % (10 * unit.millis()));
            let (o, next) = evaluate(&s, &state, now, h, refund);
            if refund {
                prop_assert!(!o.over);
            }
            if !refund && h > u64::from(rpu.max(burst)) {
                prop_assert!(o.over, "{} hits over a limit of {}", h, rpu);
            }
            if !o.over {
                state = next;
            }
        }
    }

    /// Key encoding: splitting a key gives back its parts, and two
    /// different descriptors never share a key.
    #[test]
    fn keys_round_trip_and_are_injective(
        domain in "\\PC{0,12}", a in prop::collection::vec(("\\PC{1,8}", "\\PC{0,12}"), 0..4),
        b in prop::collection::vec(("\\PC{1,8}", "\\PC{0,12}"), 0..4), unit in unit(),
    ) {
        let s = LimitSpec::fixed(1, unit);
        let key_of = |e: &[(String, String)]| CounterKey::new(&domain, e.iter().map(|(k, v)| (k.as_str(), v.as_str())), &s);
        let ka = key_of(&a);
        let parts = ka.parts();
        prop_assert_eq!(&parts.domain, &domain);
        let plain = a.iter().all(|(_, v)| v.len() <= MAX_RAW_VALUE_BYTES && !v.starts_with('\0'));
        if plain {
            prop_assert_eq!(&parts.entries, &a);
        }
        if a != b {
            prop_assert_ne!(ka, key_of(&b));
        }
    }
}
