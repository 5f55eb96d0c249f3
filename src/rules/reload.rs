//! What the rules reloader last did: successes, failures, the last error and
//! when the current rules were loaded. The composition root's reload loop
//! writes it; /rules and /status read it.

use std::sync::atomic::AtomicU64;

use parking_lot::Mutex;

#[derive(Debug, Default)]
pub struct ReloadStatus {
    pub successes: AtomicU64,
    pub failures: AtomicU64,
    pub last_error: Mutex<Option<String>>,
    pub loaded_at_ms: AtomicU64,
}
