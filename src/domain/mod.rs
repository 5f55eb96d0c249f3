//! The shared vocabulary every layer may use: a request's charges as the
//! engines see them, their outcomes, which path decided, and (in
//! [`backend`]) the contract between the resilient engine and the store it
//! degrades from. Nothing here does I/O; nothing here imports upward.

pub mod backend;

use crate::key::CounterKey;
use crate::limit::{LimitSpec, Outcome, Role};

/// The most hits one charge counts, on every path (Redis, lease, memory):
/// larger requests are over any `u32` limit anyway, and the bound keeps
/// every sum of charges far inside `i64` (Redis's integers).
pub const MAX_HITS: u64 = 1_000_000_000_000;

/// One descriptor's part of a request, as the engine sees it.
#[derive(Clone, Debug)]
pub struct Charge {
    pub key: CounterKey,
    pub spec: LimitSpec,
    pub hits: u64,
    /// `is_negative_hits`: lower the count instead of raising it.
    pub refund: bool,
    pub role: Role,
}

/// A request's charges, evaluated and applied as one atomic step.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    pub charges: Vec<Charge>,
    /// Global shadow mode: count everything, never deny.
    pub never_deny: bool,
}

/// One charge's outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ItemOutcome {
    pub over: bool,
    /// Remaining after this request (what remained before it when the
    /// request was denied and nothing was charged).
    pub remaining: u64,
    pub reset_ms: u64,
}

impl ItemOutcome {
    /// The reported outcome of a charge: an over charge reports 0 remaining;
    /// in a denied request the others report what remains uncharged.
    pub fn reported(o: &Outcome, denied: bool) -> Self {
        ItemOutcome {
            over: o.over,
            remaining: if o.over {
                0
            } else if denied {
                o.remaining_now
            } else {
                o.remaining_after
            },
            reset_ms: o.reset_ms,
        }
    }
}

/// Which path decided; reported in metrics and /status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DecisionPath {
    Memory,
    Redis,
    Local,
    /// Redis answers, but not this request within the budget: denied
    /// without a grant anyone else could not see.
    Unanswered,
    /// Denied from the over-limit cache, without a Redis call.
    Cached,
}

impl DecisionPath {
    pub fn as_str(self) -> &'static str {
        match self {
            DecisionPath::Memory => "memory",
            DecisionPath::Redis => "redis",
            DecisionPath::Local => "local",
            DecisionPath::Unanswered => "unanswered",
            DecisionPath::Cached => "cache",
        }
    }
}

/// The engine's answer for a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchOutcome {
    pub items: Vec<ItemOutcome>,
    /// True when the request was denied and nothing was charged.
    pub denied: bool,
    pub path: DecisionPath,
}

/// An infrastructure failure. Being over a limit is never an error.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("backend unavailable: {0}")]
    Unavailable(String),
    #[error("backend error: {0}")]
    Backend(String),
}

impl EngineError {
    /// Whether retrying the same call may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, EngineError::Unavailable(_))
    }
}
