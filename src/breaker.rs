//! The Redis breaker: a small state machine fed by call outcomes, with time
//! passed in (milliseconds), so its timing is tested exactly.
//!
//! - `healthy`: decisions go to Redis. Consecutive failures (errors or calls
//!   that missed the deadline, which is how a hung Redis shows) reaching
//!   `failures_to_trip` trip it; a success resets the count, so one slow call
//!   never trips it.
//! - `tripped`: every decision is local (leases); Redis is probed with PING
//!   on a jittered interval.
//! - `probing`: a probe succeeded and this replica's outage usage is being
//!   replayed; decisions stay local. Only when the replay has finished does it
//!   return to `healthy`; a failed replay trips it again.

use std::collections::VecDeque;

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    Healthy,
    Tripped,
    Probing,
}

impl BreakerState {
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Healthy => "healthy",
            BreakerState::Tripped => "tripped",
            BreakerState::Probing => "probing",
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct BreakerConfig {
    pub failures_to_trip: u32,
    pub probe_interval_ms: u64,
    pub probe_jitter_ms: u64,
}

/// One state change, for logs, metrics and /status.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Transition {
    pub from: BreakerState,
    pub to: BreakerState,
    pub at_ms: u64,
    pub reason: String,
}

const HISTORY: usize = 32;

#[derive(Debug)]
pub struct Breaker {
    cfg: BreakerConfig,
    state: BreakerState,
    consecutive_failures: u32,
    since_ms: u64,
    history: VecDeque<Transition>,
    transitions: u64,
}

impl Breaker {
    pub fn new(cfg: BreakerConfig, now_ms: u64) -> Self {
        Breaker {
            cfg,
            state: BreakerState::Healthy,
            consecutive_failures: 0,
            since_ms: now_ms,
            history: VecDeque::new(),
            transitions: 0,
        }
    }

    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// Since when the current state holds.
    pub fn since_ms(&self) -> u64 {
        self.since_ms
    }

    pub fn allows_redis(&self) -> bool {
        self.state == BreakerState::Healthy
    }

    pub fn history(&self) -> impl Iterator<Item = &Transition> {
        self.history.iter()
    }

    pub fn transitions(&self) -> u64 {
        self.transitions
    }

    pub fn consecutive_failures(&self) -> u32 {
        self.consecutive_failures
    }

    fn go(&mut self, to: BreakerState, now_ms: u64, reason: &str) -> Option<Transition> {
        if self.state == to {
            return None;
        }
        let t = Transition {
            from: self.state,
            to,
            at_ms: now_ms,
            reason: reason.to_owned(),
        };
        self.state = to;
        self.since_ms = now_ms;
        self.transitions += 1;
        if self.history.len() == HISTORY {
            self.history.pop_front();
        }
        self.history.push_back(t.clone());
        Some(t)
    }

    pub fn on_success(&mut self) {
        if self.state == BreakerState::Healthy {
            self.consecutive_failures = 0;
        }
    }

    /// A Redis-path call failed or missed its deadline.
    pub fn on_failure(&mut self, now_ms: u64, reason: &str) -> Option<Transition> {
        if self.state != BreakerState::Healthy {
            return None;
        }
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        if self.consecutive_failures >= self.cfg.failures_to_trip {
            let why = format!(
                "{} consecutive failures, last: {reason}",
                self.consecutive_failures
            );
            return self.go(BreakerState::Tripped, now_ms, &why);
        }
        None
    }

    /// A probe answered: start replaying.
    pub fn on_probe_ok(&mut self, now_ms: u64) -> Option<Transition> {
        if self.state != BreakerState::Tripped {
            return None;
        }
        self.go(
            BreakerState::Probing,
            now_ms,
            "probe answered; replaying outage usage",
        )
    }

    /// The replay finished: back to the Redis path.
    pub fn on_replay_done(&mut self, now_ms: u64) -> Option<Transition> {
        if self.state != BreakerState::Probing {
            return None;
        }
        self.consecutive_failures = 0;
        self.go(BreakerState::Healthy, now_ms, "replay finished")
    }

    pub fn on_replay_failed(&mut self, now_ms: u64, reason: &str) -> Option<Transition> {
        if self.state != BreakerState::Probing {
            return None;
        }
        self.go(
            BreakerState::Tripped,
            now_ms,
            &format!("replay failed: {reason}"),
        )
    }

    /// Delay before the next probe: the interval ± jitter, from a uniform
    /// `unit` in [0, 1), so replicas do not probe in lockstep.
    pub fn probe_delay_ms(&self, unit: f64) -> u64 {
        let jitter = self.cfg.probe_jitter_ms as f64 * (2.0 * unit.clamp(0.0, 1.0) - 1.0);
        (self.cfg.probe_interval_ms as f64 + jitter).max(1.0) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker() -> Breaker {
        Breaker::new(
            BreakerConfig {
                failures_to_trip: 3,
                probe_interval_ms: 500,
                probe_jitter_ms: 100,
            },
            0,
        )
    }

    #[test]
    fn trips_after_consecutive_failures_only() {
        let mut b = breaker();
        assert!(b.on_failure(10, "timeout").is_none());
        assert!(b.on_failure(11, "timeout").is_none());
        b.on_success();
        assert!(
            b.on_failure(12, "timeout").is_none(),
            "a success resets the count"
        );
        assert!(b.on_failure(13, "timeout").is_none());
        let t = b
            .on_failure(14, "timeout")
            .expect("trips on the third in a row");
        assert_eq!(
            (t.from, t.to, t.at_ms),
            (BreakerState::Healthy, BreakerState::Tripped, 14)
        );
        assert!(!b.allows_redis());
        assert!(b.on_failure(15, "timeout").is_none(), "already tripped");
    }

    #[test]
    fn returns_to_healthy_only_after_replay() {
        let mut b = breaker();
        for i in 0..3 {
            b.on_failure(i, "x");
        }
        assert!(b.on_replay_done(5).is_none(), "no shortcut from tripped");
        assert_eq!(
            b.on_probe_ok(100).map(|t| t.to),
            Some(BreakerState::Probing)
        );
        assert!(!b.allows_redis(), "still local while replaying");
        assert_eq!(
            b.on_replay_failed(120, "timeout").map(|t| t.to),
            Some(BreakerState::Tripped)
        );
        b.on_probe_ok(600);
        assert_eq!(
            b.on_replay_done(650).map(|t| t.to),
            Some(BreakerState::Healthy)
        );
        assert!(b.allows_redis());
        assert_eq!(b.transitions(), 5);
        let states: Vec<_> = b.history().map(|t| t.to.as_str()).collect();
        assert_eq!(
            states,
            ["tripped", "probing", "tripped", "probing", "healthy"]
        );
    }

    #[test]
    fn a_single_slow_call_does_not_flap() {
        let mut b = breaker();
        for i in 0..100 {
            b.on_failure(i * 2, "slow");
            b.on_success();
        }
        assert_eq!(b.state(), BreakerState::Healthy);
        assert_eq!(b.transitions(), 0);
    }

    #[test]
    fn probe_delay_is_jittered_within_bounds() {
        let b = breaker();
        assert_eq!(b.probe_delay_ms(0.0), 400);
        assert_eq!(b.probe_delay_ms(0.5), 500);
        assert_eq!(b.probe_delay_ms(0.999_999), 599);
    }
}
