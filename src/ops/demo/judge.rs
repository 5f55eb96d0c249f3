//! The demo's verdict: per-window admissions, client errors, fail-open and
//! Redis's counts turned into the [`Report`] the checks are read from.

use std::collections::{BTreeMap, BTreeSet};

use super::{Check, ReplicaView, Report, Second, LIMIT, UNIT_MS};
use crate::ops::load::{Sample, Seen};

pub(super) fn judge(
    samples: Vec<Sample>,
    views: BTreeMap<u64, Vec<ReplicaView>>,
    redis: BTreeMap<u64, u64>,
    start_ms: u64,
    kill_ms: u64,
    restart_ms: u64,
) -> Report {
    let first = start_ms / UNIT_MS * UNIT_MS;
    let (mut seconds, replicas_seen) = tally(&samples, first);
    for (w, s) in seconds.iter_mut() {
        s.redis_up = w + UNIT_MS <= kill_ms || *w >= restart_ms;
        s.phase = phase(*w, kill_ms, restart_ms).into();
        if let Some(v) = views.get(w) {
            s.redis_decisions = v.iter().map(|r| r.redis_decisions).sum();
            s.local_decisions = v.iter().map(|r| r.local_decisions).sum();
            s.replicas = v.clone();
        }
        s.redis_count = redis.get(w).copied();
    }
    // The first and last windows are partly outside the load.
    let last = seconds.keys().next_back().copied();
    let judged: Vec<&Second> = seconds
        .values()
        .filter(|s| s.window_ms > first && Some(s.window_ms) != last)
        .collect();
    let mut checks = window_checks(&judged);
    checks.extend(client_checks(&samples));
    let total_admitted = samples.iter().filter(|s| s.seen == Seen::Admitted).count() as u64;
    let total_redis: u64 = seconds.keys().filter_map(|w| redis.get(w)).sum();
    checks.push(redis_check(&seconds, total_redis, total_admitted));
    let pass = checks.iter().all(|c| c.pass);
    Report {
        limit: LIMIT,
        kill_ms,
        restart_ms,
        seconds: seconds.into_values().collect(),
        checks,
        pass,
        total_admitted,
        total_redis,
        replicas_seen: replicas_seen.into_iter().collect(),
        samples,
    }
}

/// Every sample counted into the window the server reported for it.
fn tally(samples: &[Sample], first: u64) -> (BTreeMap<u64, Second>, BTreeSet<String>) {
    let mut seconds: BTreeMap<u64, Second> = BTreeMap::new();
    let mut replicas_seen = BTreeSet::new();
    let blank = |w: u64| Second {
        window_ms: w,
        t: w.saturating_sub(first) / UNIT_MS,
        redis_up: true,
        admitted: 0,
        denied: 0,
        fail_open: 0,
        errors: 0,
        uncertain: 0,
        redis_decisions: 0,
        local_decisions: 0,
        replicas: Vec::new(),
        envoy_healthy: None,
        phase: String::new(),
        redis_count: None,
    };
    for s in samples {
        let (w, certain) = s.window(UNIT_MS);
        let e = seconds.entry(w).or_insert_with(|| blank(w));
        match s.seen {
            Seen::Admitted => e.admitted += 1,
            Seen::Denied => e.denied += 1,
            Seen::FailOpen => e.fail_open += 1,
            Seen::Error(_) => e.errors += 1,
        }
        // A call near a window edge may have been charged in either window:
        // both get a tolerance of one for it.
        if !certain && s.seen == Seen::Admitted {
            for c in s.candidates(UNIT_MS) {
                seconds.entry(c).or_insert_with(|| blank(c)).uncertain += 1;
            }
        }
        if let Some(r) = &s.replica {
            replicas_seen.insert(r.clone());
        }
    }
    (seconds, replicas_seen)
}

/// Breaker detection takes up to the deadline plus a probe interval; a
/// window is "outage" when Redis was down for all of it and at least one
/// second had passed since the kill.
fn phase(w: u64, kill_ms: u64, restart_ms: u64) -> &'static str {
    let end = w + UNIT_MS;
    if end <= kill_ms {
        "before"
    } else if w >= kill_ms + 1000 && end <= restart_ms {
        "outage"
    } else if w < restart_ms + 3000 {
        "transition"
    } else {
        "after"
    }
}

/// The per-window bounds of each phase (docs/guarantees.md).
fn window_checks(judged: &[&Second]) -> Vec<Check> {
    let l = LIMIT as f64;
    let bound = |name: &str, phase: &[&str], lo: f64, hi: f64| {
        let in_phase: Vec<&&Second> = judged
            .iter()
            .filter(|s| phase.contains(&s.phase.as_str()))
            .collect();
        let bad: Vec<String> = in_phase
            .iter()
            .filter(|s| {
                let slack = s.uncertain as f64;
                (s.admitted as f64) + slack < lo || (s.admitted as f64) - slack > hi
            })
            .map(|s| format!("t={} admitted {} (±{})", s.t, s.admitted, s.uncertain))
            .collect();
        let n = in_phase.len();
        Check {
            name: name.into(),
            pass: bad.is_empty() && n > 0,
            detail: if bad.is_empty() {
                format!("{n} windows within [{lo:.0}, {hi:.0}]")
            } else {
                bad.join(", ")
            },
        }
    };
    vec![
        bound(
            "Redis up: admitted ≤ L per window",
            &["before", "after"],
            0.0,
            l,
        ),
        bound(
            "Redis down: admitted within [0.95 L, 1.05 L] per window",
            &["outage"],
            0.95 * l,
            1.05 * l,
        ),
        bound(
            "Failing over and recovering: admitted ≤ 1.05 L per window",
            &["transition"],
            0.0,
            1.05 * l,
        ),
    ]
}

/// What callers saw: no errors, and never a pass without a decision.
fn client_checks(samples: &[Sample]) -> Vec<Check> {
    let errors: Vec<String> = samples
        .iter()
        .filter_map(|s| match &s.seen {
            Seen::Error(e) => Some(format!("{:?}: {e}", s.via)),
            _ => None,
        })
        .take(5)
        .collect();
    let fail_open = samples.iter().filter(|s| s.seen == Seen::FailOpen).count();
    vec![
        Check {
            name: "No client errors (no Envoy 5xx, no gRPC error through nginx)".into(),
            pass: errors.is_empty(),
            detail: if errors.is_empty() {
                format!("{} calls", samples.len())
            } else {
                errors.join("; ")
            },
        },
        Check {
            name: "Envoy never failed open (every call got a decision)".into(),
            pass: fail_open == 0,
            detail: format!("{fail_open} calls without a decision"),
        },
    ]
}

/// After recovery Redis counts exactly what was granted, in total and in
/// every window (within the edge tolerance).
fn redis_check(seconds: &BTreeMap<u64, Second>, total_redis: u64, total_admitted: u64) -> Check {
    let window_mismatch: Vec<String> = seconds
        .values()
        .filter(|s| s.redis_count.unwrap_or(0).abs_diff(s.admitted) > s.uncertain)
        .map(|s| format!("t={} redis {:?} granted {}", s.t, s.redis_count, s.admitted))
        .collect();
    Check {
        name: "After recovery Redis holds exactly the grants".into(),
        pass: total_redis == total_admitted && window_mismatch.is_empty(),
        detail: format!(
            "total: redis {total_redis}, granted {total_admitted}{}",
            if window_mismatch.is_empty() {
                "; every window matches".to_string()
            } else {
                format!("; windows off: {}", window_mismatch.join(", "))
            }
        ),
    }
}
