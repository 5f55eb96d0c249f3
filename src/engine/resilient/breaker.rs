//! The Redis breaker: one state machine fed by call outcomes, with time
//! passed in (milliseconds), so its timing is tested exactly. Only
//! `healthy` sends decisions to Redis; each transition is documented at
//! its match arm.
//!
//! - `healthy`: decisions go to Redis.
//! - `tripped`: every decision is local (leases); Redis is probed on a
//!   jittered interval.
//! - `probing`: a probe succeeded and this replica's outage usage is being
//!   replayed; decisions stay local.
//! - `settling`: the replay finished, but the other replicas may still be
//!   deciding on their leases and Redis does not hold those grants yet, so
//!   this replica stays local until `settle_ms` has passed and one final
//!   replay round has run.

use std::collections::VecDeque;

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    Healthy,
    Tripped,
    Probing,
    Settling,
}

impl BreakerState {
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Healthy => "healthy",
            BreakerState::Tripped => "tripped",
            BreakerState::Probing => "probing",
            BreakerState::Settling => "settling",
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct BreakerConfig {
    pub failures_to_trip: u32,
    pub probe_interval_ms: u64,
    pub probe_jitter_ms: u64,
    /// How long a recovered replica stays local before Redis (0: none).
    pub settle_ms: u64,
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

    /// A Redis call on the Redis path (a decision, or a replay while
    /// healthy) failed or missed its deadline.
    pub fn on_failure(&mut self, now_ms: u64, reason: &str) -> Option<Transition> {
        match self.state {
            // Healthy → tripped only after `failures_to_trip` in a row: a
            // success in between resets the count, so one slow call never
            // trips it.
            BreakerState::Healthy => {
                self.consecutive_failures = self.consecutive_failures.saturating_add(1);
                if self.consecutive_failures < self.cfg.failures_to_trip {
                    return None;
                }
                let why = format!(
                    "{} consecutive failures, last: {reason}",
                    self.consecutive_failures
                );
                self.go(BreakerState::Tripped, now_ms, &why)
            }
            // Elsewhere it is a decision call sent before the trip that
            // failed late: it says nothing new. A failed replay while
            // probing or settling is `on_replay_failed`.
            BreakerState::Tripped | BreakerState::Probing | BreakerState::Settling => None,
        }
    }

    /// A probe answered.
    pub fn on_probe_ok(&mut self, now_ms: u64) -> Option<Transition> {
        match self.state {
            // Tripped → probing: Redis answers; replay before using it.
            BreakerState::Tripped => self.go(
                BreakerState::Probing,
                now_ms,
                "probe answered; replaying outage usage",
            ),
            _ => None,
        }
    }

    /// A replay round finished with nothing left waiting.
    pub fn on_replay_done(&mut self, now_ms: u64) -> Option<Transition> {
        match self.state {
            // Probing → settling: this replica's usage is in Redis, the
            // others' may not be yet. Without a settle period, straight on
            // to healthy.
            BreakerState::Probing if self.cfg.settle_ms > 0 => {
                self.go(BreakerState::Settling, now_ms, "replay finished; settling")
            }
            BreakerState::Probing => {
                self.consecutive_failures = 0;
                self.go(BreakerState::Healthy, now_ms, "replay finished")
            }
            // Settling → healthy: the settle period is over and this final
            // replay round ran after it.
            BreakerState::Settling if now_ms >= self.since_ms + self.cfg.settle_ms => {
                self.consecutive_failures = 0;
                self.go(BreakerState::Healthy, now_ms, "settled")
            }
            _ => None,
        }
    }

    /// How long a recovered replica stays local before Redis.
    pub fn settle_ms(&self) -> u64 {
        self.cfg.settle_ms
    }

    /// Whether a settling breaker's period is over (time for the final
    /// replay round).
    pub fn settle_due(&self, now_ms: u64) -> bool {
        self.state == BreakerState::Settling && now_ms >= self.since_ms + self.cfg.settle_ms
    }

    pub fn on_replay_failed(&mut self, now_ms: u64, reason: &str) -> Option<Transition> {
        match self.state {
            // Probing or settling → tripped: Redis went away again before
            // this replica's usage was confirmed; back to leases and probes.
            BreakerState::Probing | BreakerState::Settling => self.go(
                BreakerState::Tripped,
                now_ms,
                &format!("replay failed: {reason}"),
            ),
            _ => None,
        }
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
                settle_ms: 0,
            },
            0,
        )
    }

    #[test]
    fn settling_is_a_state_between_replay_and_healthy() {
        let mut b = Breaker::new(
            BreakerConfig {
                failures_to_trip: 1,
                probe_interval_ms: 500,
                probe_jitter_ms: 0,
                settle_ms: 300,
            },
            0,
        );
        b.on_failure(10, "refused");
        b.on_probe_ok(500);
        let t = b.on_replay_done(520).expect("probing → settling");
        assert_eq!(
            (t.from, t.to),
            (BreakerState::Probing, BreakerState::Settling)
        );
        assert!(!b.allows_redis(), "settling decides locally");
        assert!(!b.settle_due(819));
        assert!(b.on_replay_done(819).is_none(), "not before the period");
        assert!(b.settle_due(820));
        assert_eq!(
            b.on_replay_done(820).map(|t| t.to),
            Some(BreakerState::Healthy)
        );
        assert!(b.allows_redis());
        // A late decision failure while settling changes nothing; a failed
        // final replay trips it again.
        b.on_failure(900, "refused");
        b.on_probe_ok(1_400);
        b.on_replay_done(1_410);
        assert!(b.on_failure(1_450, "late").is_none());
        assert_eq!(
            b.on_replay_failed(1_500, "timeout").map(|t| t.to),
            Some(BreakerState::Tripped)
        );
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
