//! The engine behaviour suite: decisions the reference makes on its own
//! examples plus leasehold's semantics (all-or-nothing, refunds, algorithms),
//! written once against the `Engine` trait. Each engine's test file expands
//! `behaviour_suite!` with a future that builds a fresh engine, so every
//! engine runs exactly these cases.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use arc_swap::ArcSwap;
use leasehold::decision::{
    Code, CurrentLimit, Decision, DecisionSettings, Descriptor, Limiter, Request,
};
use leasehold::engine::Engine;
use leasehold::limit::Unit;
use leasehold::rules::{load_paths, LoadOptions};

pub fn rules_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/behaviour/rules.yaml")
}

pub fn limiter_with(engine: Arc<dyn Engine>, settings: DecisionSettings) -> Limiter {
    let rules = load_paths(&[rules_path()], LoadOptions::default()).expect("suite rules load");
    Limiter::new(Arc::new(ArcSwap::from_pointee(rules)), engine, settings)
}

pub fn limiter(engine: Arc<dyn Engine>) -> Limiter {
    limiter_with(engine, DecisionSettings::default())
}

pub fn d(entries: &[(&str, &str)]) -> Descriptor {
    Descriptor {
        entries: entries
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    }
}

pub fn req(descriptors: Vec<Descriptor>) -> Request {
    Request {
        domain: "suite".into(),
        descriptors,
        hits_addend: 0,
    }
}

pub async fn call(l: &Limiter, r: &Request) -> Decision {
    l.decide(r).await.expect("engine call")
}

pub async fn one(l: &Limiter, entries: &[(&str, &str)]) -> Decision {
    call(l, &req(vec![d(entries)])).await
}

fn limit(rpu: u32, unit: Unit, name: &str) -> Option<CurrentLimit> {
    Some(CurrentLimit {
        requests_per_unit: rpu,
        unit,
        name: name.into(),
    })
}

/// Expands one `#[tokio::test]` per case, each with a fresh engine from
/// `$make`, which yields `(engine, guard)`: the guard keeps whatever the
/// engine needs (a redis-server) alive for the case and stops it after.
#[macro_export]
macro_rules! behaviour_suite {
    ($make:expr) => {
        $crate::behaviour_suite!(@cases $make;
            unknown_domain_is_ok_without_limit,
            value_less_key_counts_per_value,
            twenty_per_minute_called_25_times,
            all_or_nothing_across_descriptors,
            limit_applies_only_at_last_entry_depth,
            wildcards_match_as_the_reference,
            wildcard_values_count_separately_unless_shared,
            replaces_drops_the_replaced_limit,
            unlimited_reports_max_remaining,
            shadow_rule_never_denies_but_counts,
            global_shadow_mode_counts_and_never_denies,
            quota_mode_denies_only_when_all_quota_over,
            hits_addend_rules,
            negative_hits_refund_and_clamp,
            request_override_is_honoured,
            huge_hits_are_over_not_errors,
            duplicate_descriptor_in_one_request_is_atomic,
            token_bucket_burst,
            sliding_window_limit,
            sliding_log_limit,
            sliding_log_caps_hits_per_call,
            zero_limit_bans,
            response_headers_pick_most_restrictive,
        );
    };
    (@cases $make:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                // `_guard` lives to the end of the case (and through unwinding).
                let (engine, _guard): (std::sync::Arc<dyn leasehold::engine::Engine>, _) = $make.await;
                $crate::suite::$case(engine).await;
            }
        )*
    };
}

pub async fn unknown_domain_is_ok_without_limit(e: Arc<dyn Engine>) {
    let l = limiter(e);
    let mut r = req(vec![d(&[("key1", "foo")]), d(&[("m20", "x")])]);
    r.domain = "no-such-domain".into();
    let out = call(&l, &r).await;
    assert_eq!(out.overall, Code::Ok);
    assert_eq!(out.statuses.len(), 2);
    for s in &out.statuses {
        assert_eq!(
            (
                s.code,
                s.current_limit.clone(),
                s.limit_remaining,
                s.reset_ms
            ),
            (Code::Ok, None, 0, None)
        );
    }
    // Known domain, unknown key: also OK without a limit.
    let out = one(&l, &[("nope", "x")]).await;
    assert_eq!(
        (out.overall, out.statuses[0].current_limit.clone()),
        (Code::Ok, None)
    );
}

pub async fn value_less_key_counts_per_value(e: Arc<dyn Engine>) {
    let l = limiter(e);
    let out = one(&l, &[("key1", "foo")]).await;
    assert_eq!(out.overall, Code::Ok);
    assert_eq!(out.statuses[0].current_limit, limit(50, Unit::Minute, ""));
    assert_eq!(out.statuses[0].limit_remaining, 49);
    assert!(out.statuses[0]
        .reset_ms
        .is_some_and(|ms| ms > 0 && ms <= 60_000));
    // Another value has its own counter.
    let out = one(&l, &[("key1", "bar")]).await;
    assert_eq!(out.statuses[0].limit_remaining, 49);
    let out = one(&l, &[("key1", "foo")]).await;
    assert_eq!(out.statuses[0].limit_remaining, 48);
}

pub async fn twenty_per_minute_called_25_times(e: Arc<dyn Engine>) {
    let l = limiter(e);
    for i in 1..=25u32 {
        let out = one(&l, &[("m20", "x")]).await;
        let s = &out.statuses[0];
        if i <= 20 {
            assert_eq!(
                (out.overall, s.code, s.limit_remaining),
                (Code::Ok, Code::Ok, 20 - i),
                "call {i}"
            );
        } else {
            assert_eq!(
                (out.overall, s.code, s.limit_remaining),
                (Code::OverLimit, Code::OverLimit, 0),
                "call {i}"
            );
        }
        assert_eq!(s.current_limit, limit(20, Unit::Minute, ""));
    }
}

pub async fn all_or_nothing_across_descriptors(e: Arc<dyn Engine>) {
    let l = limiter(e);
    let both = req(vec![d(&[("m20", "aon")]), d(&[("h10", "aon")])]);
    for i in 1..=15u32 {
        let out = call(&l, &both).await;
        if i <= 10 {
            assert_eq!(out.overall, Code::Ok, "call {i}");
            assert_eq!(out.statuses[0].limit_remaining, 20 - i);
            assert_eq!(out.statuses[1].limit_remaining, 10 - i);
        } else {
            assert_eq!(out.overall, Code::OverLimit, "call {i}");
            assert_eq!(out.statuses[1].code, Code::OverLimit);
            // The minute limit is not over; it reports what remains,
            // uncharged by the denied request.
            assert_eq!(out.statuses[0].code, Code::Ok);
            assert_eq!(out.statuses[0].limit_remaining, 10, "call {i}");
        }
    }
    // Denied requests charged nothing: 10 of 20 used.
    let out = one(&l, &[("m20", "aon")]).await;
    assert_eq!(out.statuses[0].limit_remaining, 9);
}

pub async fn limit_applies_only_at_last_entry_depth(e: Arc<dyn Engine>) {
    let l = limiter(e);
    let out = one(&l, &[("parent", "p"), ("child", "c")]).await;
    assert_eq!(out.statuses[0].current_limit, limit(5, Unit::Minute, ""));
    let out = one(&l, &[("parent", "p")]).await;
    assert_eq!(out.statuses[0].current_limit, limit(3, Unit::Minute, ""));
    // A two-entry request never picks up the one-entry limit.
    let out = one(&l, &[("parent", "p"), ("other", "z")]).await;
    assert_eq!(out.statuses[0].current_limit, None);
    let out = one(&l, &[("m20", "x"), ("child", "c")]).await;
    assert_eq!(out.statuses[0].current_limit, None);
}

pub async fn wildcards_match_as_the_reference(e: Arc<dyn Engine>) {
    let l = limiter(e);
    let cases: &[(&str, &str, Option<u32>)] = &[
        ("w", "foo", Some(1)),
        ("w", "foobar", Some(1)),
        ("w", "fo", None),
        ("w", "xfoo", None),
        ("w", "barb", Some(2)),
        ("w", "bar-anything-b", Some(2)),
        ("w", "barbx", None),
        ("w2", "foobarbaz", Some(3)),
        ("w2", "foo1bar2baz", Some(3)),
        ("w2", "foobaz", None),
        ("w2", "foo1baz2bar", None),
    ];
    for &(k, v, want) in cases {
        let out = one(&l, &[(k, v)]).await;
        let got = out.statuses[0]
            .current_limit
            .as_ref()
            .map(|c| c.requests_per_unit);
        assert_eq!(got, want, "{k}={v}");
    }
}

pub async fn wildcard_values_count_separately_unless_shared(e: Arc<dyn Engine>) {
    let l = limiter(e);
    assert_eq!(one(&l, &[("w", "fooA")]).await.overall, Code::Ok);
    assert_eq!(one(&l, &[("w", "fooA")]).await.overall, Code::OverLimit);
    assert_eq!(
        one(&l, &[("w", "fooB")]).await.overall,
        Code::Ok,
        "own counter per value"
    );
    assert_eq!(one(&l, &[("shared", "files/a")]).await.overall, Code::Ok);
    assert_eq!(one(&l, &[("shared", "files/b")]).await.overall, Code::Ok);
    let out = one(&l, &[("shared", "files/c")]).await;
    assert_eq!(
        out.overall,
        Code::OverLimit,
        "share_threshold: one counter for all values"
    );
}

pub async fn replaces_drops_the_replaced_limit(e: Arc<dyn Engine>) {
    let l = limiter(e);
    let r = req(vec![d(&[("named_a", "x")]), d(&[("named_b", "x")])]);
    for i in 1..=3u32 {
        let out = call(&l, &r).await;
        assert_eq!(out.overall, Code::Ok, "call {i}");
        assert_eq!(
            out.statuses[0].current_limit, None,
            "replaced limit is dropped"
        );
        assert_eq!(out.statuses[1].current_limit, limit(100, Unit::Minute, "b"));
        assert_eq!(out.statuses[1].limit_remaining, 100 - i);
    }
    // Alone, named_a still applies and was never charged.
    let out = one(&l, &[("named_a", "x")]).await;
    assert_eq!(
        (out.overall, out.statuses[0].limit_remaining),
        (Code::Ok, 0)
    );
    assert_eq!(one(&l, &[("named_a", "x")]).await.overall, Code::OverLimit);
}

pub async fn unlimited_reports_max_remaining(e: Arc<dyn Engine>) {
    let l = limiter(e);
    for _ in 0..3 {
        let out = one(&l, &[("unl", "x")]).await;
        assert_eq!(out.overall, Code::Ok);
        assert_eq!(out.statuses[0].limit_remaining, u32::MAX);
        assert_eq!(out.statuses[0].current_limit, None);
    }
}

pub async fn shadow_rule_never_denies_but_counts(e: Arc<dyn Engine>) {
    let l = limiter(e);
    for i in 1..=4u32 {
        let out = one(&l, &[("shadow", "x")]).await;
        assert_eq!(
            (out.overall, out.statuses[0].code),
            (Code::Ok, Code::Ok),
            "call {i}"
        );
        assert_eq!(out.statuses[0].limit_remaining, 0, "call {i}");
    }
    // A shadow descriptor next to an enforcing one that is over: nothing is charged.
    let r = req(vec![d(&[("shadow", "y")]), d(&[("ban", "y")])]);
    assert_eq!(call(&l, &r).await.overall, Code::OverLimit);
    let mut check = req(vec![d(&[("shadow", "y")])]);
    check.descriptors[0].hits = Some(0);
    let out = call(&l, &check).await;
    assert_eq!(
        (out.overall, out.statuses[0].limit_remaining),
        (Code::Ok, 1)
    );
}

pub async fn global_shadow_mode_counts_and_never_denies(e: Arc<dyn Engine>) {
    let settings = DecisionSettings {
        global_shadow_mode: true,
        ..DecisionSettings::default()
    };
    let l = limiter_with(e, settings);
    for i in 1..=22u32 {
        let out = one(&l, &[("m20", "gs")]).await;
        assert_eq!(out.overall, Code::Ok, "call {i}");
        // Statuses tell the truth.
        let want = if i <= 20 { Code::Ok } else { Code::OverLimit };
        assert_eq!(out.statuses[0].code, want, "call {i}");
    }
}

pub async fn quota_mode_denies_only_when_all_quota_over(e: Arc<dyn Engine>) {
    let l = limiter(e);
    assert_eq!(one(&l, &[("q1", "a")]).await.overall, Code::Ok);
    // The only quota descriptor is over: all quota over → denied.
    let out = one(&l, &[("q1", "a")]).await;
    assert_eq!(
        (out.overall, out.statuses[0].code),
        (Code::OverLimit, Code::OverLimit)
    );
    // One quota over, another not: the request passes; the over one still says so.
    let out = call(&l, &req(vec![d(&[("q1", "a")]), d(&[("q2", "a")])])).await;
    assert_eq!(out.overall, Code::Ok);
    assert_eq!(
        (out.statuses[0].code, out.statuses[1].code),
        (Code::OverLimit, Code::Ok)
    );
    // Now both are over.
    let out = call(&l, &req(vec![d(&[("q1", "a")]), d(&[("q2", "a")])])).await;
    assert_eq!(out.overall, Code::OverLimit);
}

pub async fn hits_addend_rules(e: Arc<dyn Engine>) {
    let l = limiter(e);
    let mut r = req(vec![d(&[("m20", "hits")])]);
    r.hits_addend = 5;
    assert_eq!(call(&l, &r).await.statuses[0].limit_remaining, 15);
    // Per-descriptor hits win over the request's.
    let mut r2 = r.clone();
    r2.descriptors[0].hits = Some(2);
    assert_eq!(call(&l, &r2).await.statuses[0].limit_remaining, 13);
    // Per-descriptor 0 is a check without a charge.
    r2.descriptors[0].hits = Some(0);
    assert_eq!(call(&l, &r2).await.statuses[0].limit_remaining, 13);
    // Request 0 means 1.
    r.hits_addend = 0;
    assert_eq!(call(&l, &r).await.statuses[0].limit_remaining, 12);
    // More than remains is OVER and charges nothing; exactly what remains is OK.
    r.hits_addend = 13;
    assert_eq!(call(&l, &r).await.overall, Code::OverLimit);
    r.hits_addend = 12;
    let out = call(&l, &r).await;
    assert_eq!(
        (out.overall, out.statuses[0].limit_remaining),
        (Code::Ok, 0)
    );
    // Check-only at exactly the limit is still OK.
    r2.descriptors[0].hits = Some(0);
    assert_eq!(call(&l, &r2).await.overall, Code::Ok);
}

pub async fn negative_hits_refund_and_clamp(e: Arc<dyn Engine>) {
    let l = limiter(e);
    let mut r = req(vec![d(&[("m20", "refund")])]);
    r.hits_addend = 5;
    assert_eq!(call(&l, &r).await.statuses[0].limit_remaining, 15);
    let mut refund = r.clone();
    refund.descriptors[0].refund = true;
    refund.descriptors[0].hits = Some(3);
    let out = call(&l, &refund).await;
    assert_eq!(
        (out.overall, out.statuses[0].limit_remaining),
        (Code::Ok, 18)
    );
    refund.descriptors[0].hits = Some(1_000);
    let out = call(&l, &refund).await;
    assert_eq!(
        (out.overall, out.statuses[0].limit_remaining),
        (Code::Ok, 20),
        "clamped at 0"
    );
    // A refund on an exhausted key is never denied.
    let mut all = r.clone();
    all.hits_addend = 20;
    assert_eq!(call(&l, &all).await.overall, Code::Ok);
    refund.descriptors[0].hits = Some(1);
    assert_eq!(call(&l, &refund).await.overall, Code::Ok);
    assert_eq!(one(&l, &[("m20", "refund")]).await.overall, Code::Ok);
    assert_eq!(one(&l, &[("m20", "refund")]).await.overall, Code::OverLimit);
}

pub async fn request_override_is_honoured(e: Arc<dyn Engine>) {
    let l = limiter(e);
    let mut desc = d(&[("anything", "ov")]);
    desc.limit_override = Some((2, Unit::Hour));
    let r = req(vec![desc.clone()]);
    let out = call(&l, &r).await;
    assert_eq!(out.statuses[0].current_limit, limit(2, Unit::Hour, ""));
    assert_eq!(out.statuses[0].limit_remaining, 1);
    assert_eq!(call(&l, &r).await.overall, Code::Ok);
    assert_eq!(call(&l, &r).await.overall, Code::OverLimit);
    // Unknown domain: no limit even with an override (the reference's rule).
    let mut r = req(vec![desc]);
    r.domain = "unknown".into();
    assert_eq!(call(&l, &r).await.statuses[0].current_limit, None);
}

pub async fn huge_hits_are_over_not_errors(e: Arc<dyn Engine>) {
    let l = limiter(e);
    let mut r = req(vec![d(&[("m20", "huge")])]);
    r.hits_addend = u32::MAX;
    let out = call(&l, &r).await;
    assert_eq!(
        (out.overall, out.statuses[0].limit_remaining),
        (Code::OverLimit, 0)
    );
    let mut r = req(vec![d(&[("m20", "huge")])]);
    r.descriptors[0].hits = Some(u64::MAX);
    assert_eq!(call(&l, &r).await.overall, Code::OverLimit);
    // Nothing was charged.
    assert_eq!(
        one(&l, &[("m20", "huge")]).await.statuses[0].limit_remaining,
        19
    );
    // A huge refund is fine too.
    r.descriptors[0].refund = true;
    assert_eq!(call(&l, &r).await.overall, Code::Ok);
    assert_eq!(
        one(&l, &[("m20", "huge")]).await.statuses[0].limit_remaining,
        19
    );
}

pub async fn duplicate_descriptor_in_one_request_is_atomic(e: Arc<dyn Engine>) {
    let l = limiter(e);
    let mut r = req(vec![d(&[("m20", "dup")]), d(&[("m20", "dup")])]);
    r.hits_addend = 8;
    let out = call(&l, &r).await;
    assert_eq!(out.overall, Code::Ok);
    assert_eq!(
        (
            out.statuses[0].limit_remaining,
            out.statuses[1].limit_remaining
        ),
        (12, 4)
    );
    // 8 + 8 more would be 32 > 20: denied, and nothing of it is charged.
    assert_eq!(call(&l, &r).await.overall, Code::OverLimit);
    assert_eq!(
        one(&l, &[("m20", "dup")]).await.statuses[0].limit_remaining,
        3
    );
}

pub async fn token_bucket_burst(e: Arc<dyn Engine>) {
    let l = limiter(e);
    for i in 1..=3u32 {
        let out = one(&l, &[("tb", "x")]).await;
        assert_eq!(
            (out.overall, out.statuses[0].limit_remaining),
            (Code::Ok, 3 - i),
            "call {i}"
        );
        assert_eq!(out.statuses[0].current_limit, limit(1, Unit::Hour, ""));
    }
    let out = one(&l, &[("tb", "x")]).await;
    assert_eq!(out.overall, Code::OverLimit);
    // Empty bucket refills at 1/hour: full again in about three hours.
    let reset = out.statuses[0].reset_ms.unwrap_or(0);
    assert!(
        reset > 3 * 3_600_000 - 60_000 && reset <= 3 * 3_600_000,
        "reset {reset}"
    );
}

pub async fn sliding_window_limit(e: Arc<dyn Engine>) {
    let l = limiter(e);
    for i in 1..=3u32 {
        let out = one(&l, &[("sw", "x")]).await;
        assert_eq!(
            (out.overall, out.statuses[0].limit_remaining),
            (Code::Ok, 3 - i),
            "call {i}"
        );
    }
    assert_eq!(one(&l, &[("sw", "x")]).await.overall, Code::OverLimit);
}

pub async fn sliding_log_limit(e: Arc<dyn Engine>) {
    let l = limiter(e);
    for i in 1..=3u32 {
        let out = one(&l, &[("sl", "x")]).await;
        assert_eq!(
            (out.overall, out.statuses[0].limit_remaining),
            (Code::Ok, 3 - i),
            "call {i}"
        );
    }
    let out = one(&l, &[("sl", "x")]).await;
    assert_eq!(out.overall, Code::OverLimit);
    let reset = out.statuses[0].reset_ms.unwrap_or(0);
    assert!(
        reset > 0 && reset <= 60_000,
        "oldest grant leaves within the minute: {reset}"
    );
}

/// One sorted-set member per hit in Redis: a sliding_log charge carries at
/// most 10,000 hits (more is OVER_LIMIT and charges nothing), even under a
/// 1,000,000/hour limit; a refund takes at most that many back.
pub async fn sliding_log_caps_hits_per_call(e: Arc<dyn Engine>) {
    let l = limiter(e);
    let with_hits = |hits: u64, refund: bool| {
        let mut desc = d(&[("slbig", "x")]);
        desc.hits = Some(hits);
        desc.refund = refund;
        req(vec![desc])
    };
    let out = call(&l, &with_hits(10_000, false)).await;
    assert_eq!(
        (out.overall, out.statuses[0].limit_remaining),
        (Code::Ok, 990_000)
    );
    let out = call(&l, &with_hits(1_000_000, false)).await;
    assert_eq!(out.overall, Code::OverLimit, "past the per-call cap");
    let out = call(&l, &with_hits(10_001, false)).await;
    assert_eq!(out.overall, Code::OverLimit, "past the per-call cap");
    let out = call(&l, &with_hits(0, false)).await;
    assert_eq!(
        out.statuses[0].limit_remaining, 990_000,
        "the refused charges added nothing"
    );
    call(&l, &with_hits(u64::MAX, true)).await;
    let out = call(&l, &with_hits(1, false)).await;
    assert_eq!(
        out.statuses[0].limit_remaining, 999_999,
        "a huge refund took back at most the cap (all 10,000 here)"
    );
}

pub async fn zero_limit_bans(e: Arc<dyn Engine>) {
    let l = limiter(e);
    let out = one(&l, &[("ban", "x")]).await;
    assert_eq!(
        (out.overall, out.statuses[0].limit_remaining),
        (Code::OverLimit, 0)
    );
}

pub async fn response_headers_pick_most_restrictive(e: Arc<dyn Engine>) {
    let settings = DecisionSettings {
        response_headers: true,
        ..DecisionSettings::default()
    };
    let l = limiter_with(e, settings);
    let out = call(&l, &req(vec![d(&[("key1", "hdr")]), d(&[("h10", "hdr")])])).await;
    let h: std::collections::HashMap<_, _> = out.headers.iter().cloned().collect();
    assert_eq!(h.get("RateLimit-Limit").map(String::as_str), Some("10"));
    assert_eq!(h.get("RateLimit-Remaining").map(String::as_str), Some("9"));
    let reset: u64 = h
        .get("RateLimit-Reset")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(reset > 0 && reset <= 3_600, "reset {reset}");
    // No limited descriptor: no headers.
    assert!(one(&l, &[("unl", "x")]).await.headers.is_empty());
}
