//! The engine abstraction: the one trait the gRPC and HTTP layers reach
//! through [`crate::limiter::Limiter`]. An engine receives a request's charges
//! (one per matched limited descriptor), applies them atomically and
//! all-or-nothing, and reports each one's outcome. The in-memory engine
//! implements it here; the Redis and resilient engines implement the same
//! trait.

pub mod memory;
pub mod redis;
pub mod resilient;

use std::fmt::Write as _;
use std::sync::Arc;

use async_trait::async_trait;

use crate::limit::{LimitSpec, Role};

pub use memory::MemoryEngine;
pub use redis::RedisEngine;
pub use resilient::ResilientEngine;

/// The identity of one counter: domain, the request's entries (with shared
/// wildcard patterns substituted), unit and algorithm. Every component is
/// escaped so two different descriptors can never produce the same key.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CounterKey(Arc<str>);

impl CounterKey {
    /// Builds the key. Layout: `domain|k=v|k=v#unit_seconds:algorithm`, with
    /// `%`, `|`, `=`, `#`, `:`, `{`, `}`, space and control bytes
    /// percent-escaped, so the separators are unambiguous and no `{...}` hash
    /// tag can be smuggled in by a value.
    pub fn new<'a>(
        domain: &str,
        entries: impl IntoIterator<Item = (&'a str, &'a str)>,
        spec: &LimitSpec,
    ) -> Self {
        let mut s = String::with_capacity(64);
        escape_into(&mut s, domain);
        for (k, v) in entries {
            s.push('|');
            escape_into(&mut s, k);
            s.push('=');
            escape_into(&mut s, v);
        }
        let _ = write!(s, "#{}:{}", spec.unit.seconds(), spec.algorithm.tag());
        CounterKey(Arc::from(s))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A key as [`CounterKey::as_str`] printed it (journal restore).
    pub fn from_raw(raw: &str) -> Self {
        CounterKey(Arc::from(raw))
    }
}

fn escape_into(out: &mut String, text: &str) {
    for c in text.chars() {
        match c {
            '%' | '|' | '=' | '#' | ':' | '{' | '}' | ' ' => {
                let _ = write!(out, "%{:02X}", c as u32);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "%{:02X}", c as u32);
            }
            c => out.push(c),
        }
    }
}

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
    pub fn reported(o: &crate::limit::Outcome, denied: bool) -> Self {
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
}

impl DecisionPath {
    pub fn as_str(self) -> &'static str {
        match self {
            DecisionPath::Memory => "memory",
            DecisionPath::Redis => "redis",
            DecisionPath::Local => "local",
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

/// Engine facts for metrics, read at scrape time (zero where an engine has
/// no such thing).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineFacts {
    /// "healthy", "tripped" or "probing" for engines with a breaker.
    pub breaker_state: Option<&'static str>,
    pub breaker_transitions: u64,
    pub live_members: usize,
    pub tracked_keys: usize,
    pub keys_to_replay: usize,
    pub unreplayed_hits: i64,
    pub suspect_keys: usize,
    pub dropped_usage: u64,
    pub replay_runs: u64,
    pub replay_entries: u64,
    pub redis_failures: u64,
    /// Total time spent replaying, seconds.
    pub replay_seconds: f64,
    /// Replicas a limit is split across for leases (frozen during outages).
    pub lease_members: usize,
}

#[async_trait]
pub trait Engine: Send + Sync + 'static {
    /// Evaluates and (unless denied) applies a batch atomically.
    async fn apply(&self, batch: &Batch) -> Result<BatchOutcome, EngineError>;

    /// A short name for logs and /status.
    fn name(&self) -> &'static str;

    /// Engine facts for /status.
    fn status(&self) -> serde_json::Value {
        serde_json::json!({ "engine": self.name() })
    }

    /// Engine facts for /metrics.
    fn facts(&self) -> EngineFacts {
        EngineFacts::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::Unit;

    #[test]
    fn keys_are_injective_over_separators() {
        let spec = LimitSpec::fixed(1, Unit::Second);
        let a = CounterKey::new("d", [("a_b", "c")], &spec);
        let b = CounterKey::new("d", [("a", "b_c")], &spec);
        assert_ne!(a, b);
        let c = CounterKey::new("d", [("k", "x|y=z")], &spec);
        let d = CounterKey::new("d", [("k", "x"), ("y", "z")], &spec);
        assert_ne!(c, d);
        let e = CounterKey::new("d", [("k", "{tag}\n%")], &spec);
        assert_eq!(e.as_str(), "d|k=%7Btag%7D%0A%25#1:fw");
        let f = CounterKey::new("d", [("k", "v")], &LimitSpec::fixed(1, Unit::Minute));
        assert_ne!(CounterKey::new("d", [("k", "v")], &spec), f);
    }
}
