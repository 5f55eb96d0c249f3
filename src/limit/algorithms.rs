//! The four algorithms as pure state transitions. `evaluate` never mutates:
//! it returns the outcome and the state after the charge, so an engine can
//! evaluate every descriptor of a request first and commit only when the
//! request is admitted (all-or-nothing).
//!
//! The arithmetic is the contract the Redis Lua scripts mirror: integer counts,
//! and `f64` only where Lua (whose numbers are doubles) computes the same
//! expression in the same order.

use std::collections::VecDeque;

use super::{Algorithm, LimitSpec};

/// Per-key state. Which variant a key holds follows from its spec's algorithm;
/// a key never changes algorithm because the algorithm is part of the key.
#[derive(Clone, Debug, PartialEq)]
pub enum State {
    Fixed {
        window_start_ms: u64,
        count: u64,
    },
    Sliding {
        window_start_ms: u64,
        current: u64,
        previous: u64,
    },
    /// Grants in the last unit as (time, hits), oldest first.
    Log {
        entries: VecDeque<(u64, u64)>,
    },
    Bucket {
        tokens: f64,
        updated_ms: u64,
    },
}

impl State {
    /// The state of a key that has never been charged.
    pub fn fresh(spec: &LimitSpec, now_ms: u64) -> State {
        match spec.algorithm {
            Algorithm::FixedWindow => State::Fixed {
                window_start_ms: window_start(now_ms, spec.unit.millis()),
                count: 0,
            },
            Algorithm::SlidingWindow => State::Sliding {
                window_start_ms: window_start(now_ms, spec.unit.millis()),
                current: 0,
                previous: 0,
            },
            Algorithm::SlidingLog => State::Log {
                entries: VecDeque::new(),
            },
            Algorithm::TokenBucket => State::Bucket {
                tokens: f64::from(spec.burst),
                updated_ms: now_ms,
            },
        }
    }
}

/// What one charge did (or would do) to one key.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Outcome {
    /// The hits would take the key over its limit. Refunds are never over.
    pub over: bool,
    /// What remains before this charge.
    pub remaining_now: u64,
    /// What remains after this charge (0 when over).
    pub remaining_after: u64,
    /// Milliseconds until the window resets (fixed/sliding window), the oldest
    /// grant leaves the log, or the bucket is full again.
    pub reset_ms: u64,
    /// Time after which the returned state equals a fresh one and can be
    /// dropped.
    pub expires_at_ms: u64,
    /// What the charge changes the key's count by when committed (negative
    /// for refunds; tokens drawn for a bucket). Replay adds these up.
    pub delta: i64,
}

fn signed(after: u64, before: u64) -> i64 {
    if after >= before {
        i64::try_from(after - before).unwrap_or(i64::MAX)
    } else {
        -i64::try_from(before - after).unwrap_or(i64::MAX)
    }
}

/// Start of the epoch-aligned window containing `now_ms`.
pub fn window_start(now_ms: u64, unit_ms: u64) -> u64 {
    now_ms - now_ms % unit_ms
}

/// Evaluates `hits` against `state` at `now_ms`. With `refund` the hits lower
/// the count (clamped at zero) and are never over. The returned state includes
/// the charge even when `over` is true: the caller decides whether to commit
/// (shadow descriptors are charged past their limit).
pub fn evaluate(
    spec: &LimitSpec,
    state: &State,
    now_ms: u64,
    hits: u64,
    refund: bool,
) -> (Outcome, State) {
    let charge = Charge {
        limit: u64::from(spec.requests_per_unit),
        unit_ms: spec.unit.millis(),
        now_ms,
        hits,
        refund,
    };
    match (spec.algorithm, state) {
        (
            Algorithm::FixedWindow,
            State::Fixed {
                window_start_ms,
                count,
            },
        ) => fixed(&charge, *window_start_ms, *count),
        (
            Algorithm::SlidingWindow,
            State::Sliding {
                window_start_ms,
                current,
                previous,
            },
        ) => sliding(&charge, *window_start_ms, *current, *previous),
        (Algorithm::SlidingLog, State::Log { entries }) => log(&charge, entries),
        (Algorithm::TokenBucket, State::Bucket { tokens, updated_ms }) => {
            bucket(spec, &charge, *tokens, *updated_ms)
        }
        // A state of another algorithm cannot happen (the algorithm is in the
        // key); treat it as fresh rather than panic.
        _ => evaluate(spec, &State::fresh(spec, now_ms), now_ms, hits, refund),
    }
}

/// One evaluation's inputs, shared by the algorithms.
struct Charge {
    limit: u64,
    unit_ms: u64,
    now_ms: u64,
    hits: u64,
    refund: bool,
}

fn fixed(c: &Charge, window_start_ms: u64, count: u64) -> (Outcome, State) {
    let Charge {
        limit,
        unit_ms,
        now_ms,
        hits,
        refund,
    } = *c;
    let start = window_start(now_ms, unit_ms);
    let count = if window_start_ms == start { count } else { 0 };
    let after = if refund {
        count.saturating_sub(hits)
    } else {
        count.saturating_add(hits)
    };
    let over = !refund && after > limit;
    let end = start + unit_ms;
    (
        Outcome {
            over,
            remaining_now: limit.saturating_sub(count),
            remaining_after: if over { 0 } else { limit.saturating_sub(after) },
            reset_ms: end - now_ms,
            expires_at_ms: end,
            delta: signed(after, count),
        },
        State::Fixed {
            window_start_ms: start,
            count: after,
        },
    )
}

fn sliding(c: &Charge, window_start_ms: u64, current: u64, previous: u64) -> (Outcome, State) {
    let Charge {
        limit,
        unit_ms,
        now_ms,
        hits,
        refund,
    } = *c;
    let start = window_start(now_ms, unit_ms);
    let (current, previous) = if window_start_ms == start {
        (current, previous)
    } else if window_start_ms + unit_ms == start {
        (0, current)
    } else {
        (0, 0)
    };
    let weighted = sliding_weight(previous, now_ms - start, unit_ms);
    let estimate = weighted.saturating_add(current);
    let (current_after, estimate_after) = if refund {
        let c = current.saturating_sub(hits);
        (c, weighted.saturating_add(c))
    } else {
        (current.saturating_add(hits), estimate.saturating_add(hits))
    };
    let over = !refund && estimate_after > limit;
    let end = start + unit_ms;
    (
        Outcome {
            over,
            remaining_now: limit.saturating_sub(estimate),
            remaining_after: if over {
                0
            } else {
                limit.saturating_sub(estimate_after)
            },
            reset_ms: end - now_ms,
            // The current count still weighs on the next window.
            expires_at_ms: end + unit_ms,
            delta: signed(current_after, current),
        },
        State::Sliding {
            window_start_ms: start,
            current: current_after,
            previous,
        },
    )
}

/// Most hits one sliding_log charge may carry: Redis keeps one sorted-set
/// member per hit, so a larger charge would block Redis for every replica
/// (1,000,000 hits: about a second). A larger charge is OVER_LIMIT and
/// charges nothing; a larger refund refunds this many. Both engines apply
/// it, so a decision never depends on the path. Weighted charges belong
/// on sliding_window.
pub const LOG_MAX_HITS_PER_CALL: u64 = 10_000;

/// The log keeps at most about this many entries per key: grants closer
/// together than unit / this are merged into one entry stamped with the
/// latest of them, so each is released at most that much late (never
/// early: the log never admits more than an exact one).
const LOG_MAX_ENTRIES: u64 = 10_000;

fn log(c: &Charge, entries: &VecDeque<(u64, u64)>) -> (Outcome, State) {
    let Charge {
        limit,
        unit_ms,
        now_ms,
        hits,
        refund,
    } = *c;
    let hits = if refund {
        hits.min(LOG_MAX_HITS_PER_CALL)
    } else {
        hits
    };
    let too_big = !refund && hits > LOG_MAX_HITS_PER_CALL;
    let granule = (unit_ms / LOG_MAX_ENTRIES).max(1);
    let horizon = now_ms.saturating_sub(unit_ms);
    let mut entries: VecDeque<(u64, u64)> = entries
        .iter()
        .copied()
        .filter(|&(at, _)| at > horizon)
        .collect();
    let count = entries.iter().fold(0u64, |a, &(_, h)| a.saturating_add(h));
    let after;
    if refund {
        after = count.saturating_sub(hits);
        // Refund the newest grants first: they are the ones a
        // cancelled request most likely made.
        let mut left = hits;
        while left > 0 {
            let Some(last) = entries.back_mut() else {
                break;
            };
            if last.1 > left {
                last.1 -= left;
                left = 0;
            } else {
                left -= last.1;
                entries.pop_back();
            }
        }
    } else {
        after = count.saturating_add(hits);
        if hits > 0 && !too_big {
            match entries.back_mut() {
                // Within one granule: coalesce (stamped with the later
                // time) so the log grows with time, not with traffic.
                Some(last) if now_ms.saturating_sub(last.0) < granule => {
                    last.0 = last.0.max(now_ms);
                    last.1 = last.1.saturating_add(hits);
                }
                _ => entries.push_back((now_ms, hits)),
            }
        }
    }
    let over = !refund && (after > limit || too_big);
    let oldest = entries.front().map(|&(at, _)| at).unwrap_or(now_ms);
    let newest = entries.back().map(|&(at, _)| at).unwrap_or(now_ms);
    (
        Outcome {
            over,
            remaining_now: limit.saturating_sub(count),
            remaining_after: if over { 0 } else { limit.saturating_sub(after) },
            reset_ms: (oldest + unit_ms).saturating_sub(now_ms).max(1),
            expires_at_ms: newest + unit_ms,
            delta: signed(after, count),
        },
        State::Log { entries },
    )
}

fn bucket(spec: &LimitSpec, c: &Charge, tokens: f64, updated_ms: u64) -> (Outcome, State) {
    let Charge {
        now_ms,
        hits,
        refund,
        ..
    } = *c;
    let capacity = f64::from(spec.burst);
    let tokens_now = refill(tokens, updated_ms, now_ms, spec, capacity);
    let hits_f = hits as f64;
    let (over, tokens_after) = if refund {
        (false, (tokens_now + hits_f).min(capacity))
    } else {
        let over = hits_f > tokens_now;
        // Charged past empty (shadow) clamps at zero rather than
        // going into debt, so a shadow rule cannot starve a key.
        (over, (tokens_now - hits_f).max(0.0))
    };
    let full_in = time_to_full(tokens_after, capacity, spec);
    (
        Outcome {
            over,
            remaining_now: tokens_now.floor() as u64,
            remaining_after: if over { 0 } else { tokens_after.floor() as u64 },
            reset_ms: full_in.max(1),
            expires_at_ms: now_ms + full_in,
            delta: (tokens_now - tokens_after).round() as i64,
        },
        State::Bucket {
            tokens: tokens_after,
            updated_ms: now_ms,
        },
    )
}

/// The previous window's count weighted by how much of it the sliding
/// interval still covers, floored. Computed in f64 in this order because the
/// Lua script does exactly this with doubles.
pub fn sliding_weight(previous: u64, elapsed_ms: u64, unit_ms: u64) -> u64 {
    if previous == 0 {
        return 0;
    }
    let left = unit_ms.saturating_sub(elapsed_ms) as f64;
    ((previous as f64) * left / (unit_ms as f64)).floor() as u64
}

fn refill(tokens: f64, updated_ms: u64, now_ms: u64, spec: &LimitSpec, capacity: f64) -> f64 {
    let elapsed = now_ms.saturating_sub(updated_ms) as f64;
    let rate = f64::from(spec.requests_per_unit) / spec.unit.millis() as f64;
    (tokens + elapsed * rate).min(capacity)
}

fn time_to_full(tokens: f64, capacity: f64, spec: &LimitSpec) -> u64 {
    if tokens >= capacity || spec.requests_per_unit == 0 {
        return if spec.requests_per_unit == 0 {
            spec.unit.millis()
        } else {
            0
        };
    }
    let missing = capacity - tokens;
    (missing * spec.unit.millis() as f64 / f64::from(spec.requests_per_unit)).ceil() as u64
}

#[cfg(test)]
#[path = "algorithms_tests.rs"]
mod tests;
