//! The engine abstraction: the one trait the decision layer reaches
//! through. An engine receives a request's charges (one per matched limited
//! descriptor), applies them atomically and all-or-nothing, and reports
//! each one's outcome. Three implementations: in memory ([`memory`]), in
//! Redis ([`redis`], the adapter over `crate::redis`) and the resilient
//! engine that degrades from a backend to local leases ([`resilient`]).

pub mod memory;
#[cfg(feature = "server")]
pub mod redis;
#[cfg(feature = "server")]
pub mod resilient;

use async_trait::async_trait;
use serde::Serialize;

use crate::domain::{Batch, BatchOutcome, EngineError};

pub use memory::MemoryEngine;
#[cfg(feature = "server")]
pub use redis::{RedisEngine, RedisStatus};
#[cfg(feature = "server")]
pub use resilient::{ResilientEngine, ResilientStatus};

/// What an engine reports on /status (tagged by `engine`) and /metrics.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "engine", rename_all = "snake_case")]
pub enum EngineStatus {
    Memory {
        tracked_keys: usize,
        /// Estimated bytes of the tracked keys (capped by `memory_max_bytes`).
        tracked_bytes: usize,
        /// Live keys evicted to stay within the cap.
        evictions: u64,
    },
    #[cfg(feature = "server")]
    Redis(Box<RedisStatus>),
    #[cfg(feature = "server")]
    Resilient(Box<ResilientStatus>),
}

impl EngineStatus {
    /// The same facts with every descriptor value hashed
    /// ([`crate::redact`]), for admin pages with `redact_values` on.
    pub fn redacted(self) -> Self {
        match self {
            #[cfg(feature = "server")]
            EngineStatus::Resilient(mut r) => {
                for lease in &mut r.leases {
                    lease.key = crate::redact::counter_key(&lease.key);
                }
                EngineStatus::Resilient(r)
            }
            other => other,
        }
    }
}

#[async_trait]
pub trait Engine: Send + Sync + 'static {
    /// Evaluates and (unless denied) applies a batch atomically.
    async fn apply(&self, batch: &Batch) -> Result<BatchOutcome, EngineError>;

    /// A short name for logs and /status.
    fn name(&self) -> &'static str;

    /// Engine facts for /status and /metrics.
    fn status(&self) -> EngineStatus;

    /// The rules were reloaded: forget anything derived from the old ones.
    fn rules_changed(&self) {}
}
