//! Each algorithm's arithmetic at window edges, with `now` passed in.
use super::*;
use crate::limit::Unit;

fn spec(algorithm: Algorithm, rpu: u32, unit: Unit) -> LimitSpec {
    LimitSpec {
        requests_per_unit: rpu,
        unit,
        algorithm,
        burst: rpu,
    }
}

/// Charges `hits` and commits when not over, like an engine would.
fn charge(spec: &LimitSpec, state: &mut State, now: u64, hits: u64) -> Outcome {
    let (out, next) = evaluate(spec, state, now, hits, false);
    if !out.over {
        *state = next;
    }
    out
}

const T0: u64 = 1_700_000_000_000; // a minute boundary: 1_700_000_000 % 60 == 20

#[test]
fn fixed_window_counts_to_limit_then_resets_at_boundary() {
    let s = spec(Algorithm::FixedWindow, 3, Unit::Second);
    let now = 5_000_250;
    let mut st = State::fresh(&s, now);
    let rem: Vec<_> = (0..4)
        .map(|_| charge(&s, &mut st, now, 1))
        .map(|o| (o.over, o.remaining_after))
        .collect();
    assert_eq!(rem, vec![(false, 2), (false, 1), (false, 0), (true, 0)]);
    let o = charge(&s, &mut st, now, 0);
    assert!(!o.over, "check-only at the limit is OK with 0 remaining");
    assert_eq!(o.reset_ms, 750);
    // Next window: fresh quota.
    let o = charge(&s, &mut st, 5_001_000, 1);
    assert_eq!((o.over, o.remaining_after, o.reset_ms), (false, 2, 1_000));
}

#[test]
fn fixed_window_refund_clamps_at_zero_and_is_never_over() {
    let s = spec(Algorithm::FixedWindow, 2, Unit::Minute);
    let mut st = State::fresh(&s, T0);
    charge(&s, &mut st, T0, 2);
    let (o, next) = evaluate(&s, &st, T0, 5, true);
    assert!(!o.over);
    assert_eq!(
        next,
        State::Fixed {
            window_start_ms: window_start(T0, 60_000),
            count: 0
        }
    );
    assert_eq!(o.remaining_after, 2);
}

#[test]
fn huge_hits_saturate_and_are_over() {
    for a in Algorithm::ALL {
        let s = spec(a, 10, Unit::Hour);
        let st = State::fresh(&s, T0);
        let (o, _) = evaluate(&s, &st, T0, u64::MAX, false);
        assert!(o.over, "{a}");
        assert_eq!(o.remaining_now, 10, "{a}");
        let (o, _) = evaluate(&s, &st, T0, u64::from(u32::MAX), false);
        assert!(o.over, "{a}");
    }
}

#[test]
fn sliding_window_weights_previous_window() {
    let s = spec(Algorithm::SlidingWindow, 10, Unit::Second);
    let mut st = State::fresh(&s, 1_000);
    assert_eq!(charge(&s, &mut st, 1_000, 10).remaining_after, 0);
    // 250 ms into the next window 75% of the previous 10 still counts.
    let o = charge(&s, &mut st, 2_250, 0);
    assert_eq!(o.remaining_now, 3);
    assert!(charge(&s, &mut st, 2_250, 4).over);
    assert!(!charge(&s, &mut st, 2_250, 3).over);
    // Two windows later everything has slid out.
    let o = charge(&s, &mut st, 4_100, 0);
    assert_eq!(o.remaining_now, 10);
}

#[test]
fn sliding_log_releases_grants_one_unit_later() {
    let s = spec(Algorithm::SlidingLog, 3, Unit::Second);
    let mut st = State::fresh(&s, 0);
    charge(&s, &mut st, 10_000, 1);
    charge(&s, &mut st, 10_400, 2);
    let o = charge(&s, &mut st, 10_900, 1);
    assert!(o.over);
    assert_eq!(o.reset_ms, 100, "oldest grant leaves at 11_000");
    assert!(!charge(&s, &mut st, 11_001, 1).over);
    assert!(charge(&s, &mut st, 11_001, 1).over);
    // Refund takes the newest grant back.
    let (o, next) = evaluate(&s, &st, 11_002, 1, true);
    assert!(!o.over);
    st = next;
    assert!(!charge(&s, &mut st, 11_002, 1).over);
}

#[test]
fn sliding_log_coalesces_same_millisecond() {
    let s = spec(Algorithm::SlidingLog, 1_000, Unit::Minute);
    let mut st = State::fresh(&s, T0);
    for _ in 0..100 {
        charge(&s, &mut st, T0, 1);
    }
    match st {
        State::Log { entries } => assert_eq!(entries, VecDeque::from(vec![(T0, 100)])),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn token_bucket_bursts_then_refills() {
    let s = LimitSpec {
        requests_per_unit: 10,
        unit: Unit::Second,
        algorithm: Algorithm::TokenBucket,
        burst: 5,
    };
    let mut st = State::fresh(&s, T0);
    for i in 0..5 {
        assert_eq!(charge(&s, &mut st, T0, 1).remaining_after, 4 - i);
    }
    let o = charge(&s, &mut st, T0, 1);
    assert!(o.over);
    assert_eq!(o.reset_ms, 500, "5 tokens at 10/s");
    // 100 ms refills exactly one token.
    assert!(!charge(&s, &mut st, T0 + 100, 1).over);
    assert!(charge(&s, &mut st, T0 + 100, 1).over);
    // Refund never exceeds the burst.
    let (_, next) = evaluate(&s, &st, T0 + 100, 100, true);
    assert_eq!(
        next,
        State::Bucket {
            tokens: 5.0,
            updated_ms: T0 + 100
        }
    );
}

#[test]
fn zero_limit_bans_every_algorithm() {
    for a in Algorithm::ALL {
        let s = spec(a, 0, Unit::Minute);
        let st = State::fresh(&s, T0);
        let (o, _) = evaluate(&s, &st, T0, 1, false);
        assert!(o.over, "{a}");
    }
}

#[test]
fn sliding_log_stays_compact_and_never_releases_early() {
    let s = spec(Algorithm::SlidingLog, 1_000_000, Unit::Hour);
    let mut st = State::fresh(&s, T0);
    // A grant every millisecond for 100 s: merged per 360 ms granule.
    for t in 0..100_000 {
        charge(&s, &mut st, T0 + t, 1);
    }
    match &st {
        State::Log { entries } => assert!(entries.len() <= 100_000 / 360 + 1, "{}", entries.len()),
        other => panic!("unexpected {other:?}"),
    }
    // Merged grants are stamped with the latest of them: released late,
    // never early.
    let s = spec(Algorithm::SlidingLog, 2, Unit::Hour);
    let mut st = State::fresh(&s, T0);
    charge(&s, &mut st, T0, 1);
    charge(&s, &mut st, T0 + 300, 1);
    assert!(
        charge(&s, &mut st, T0 + 3_600_001, 1).over,
        "not released early"
    );
    assert!(!charge(&s, &mut st, T0 + 3_600_301, 1).over);
}
