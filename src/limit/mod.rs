//! Pure rate-limit math: units, the four algorithms and the all-or-nothing
//! deny rule. Nothing here reads a clock or touches I/O: `now_ms` (milliseconds
//! since the Unix epoch) is always passed in, so every engine (memory, Redis
//! Lua, local leases) can be checked against the same arithmetic, and tests
//! are exact without sleeping.

mod algorithms;

pub use algorithms::{evaluate, Outcome, State};

use std::fmt;
use std::str::FromStr;

/// A rate-limit unit. Windows are aligned to the Unix epoch; week, month and
/// year are fixed lengths (7, 30 and 365 days) as in envoyproxy/ratelimit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Unit {
    Second,
    Minute,
    Hour,
    Day,
    Week,
    Month,
    Year,
}

impl Unit {
    pub const ALL: [Unit; 7] = [
        Unit::Second,
        Unit::Minute,
        Unit::Hour,
        Unit::Day,
        Unit::Week,
        Unit::Month,
        Unit::Year,
    ];

    /// Length of one window in seconds.
    pub fn seconds(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 7 * 86_400,
            Unit::Month => 30 * 86_400,
            Unit::Year => 365 * 86_400,
        }
    }

    /// Length of one window in milliseconds.
    pub fn millis(self) -> u64 {
        self.seconds() * 1_000
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Unit::Second => "second",
            Unit::Minute => "minute",
            Unit::Hour => "hour",
            Unit::Day => "day",
            Unit::Week => "week",
            Unit::Month => "month",
            Unit::Year => "year",
        }
    }
}

impl fmt::Display for Unit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Unit {
    type Err = String;

    /// Case-insensitive, as the reference upper-cases before looking up.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Unit::ALL
            .into_iter()
            .find(|u| u.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                format!("invalid rate limit unit '{s}' (expected second, minute, hour, day, week, month or year)")
            })
    }
}

/// The counting algorithm of a limit (the `algorithm:` extension).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// Counter per epoch-aligned window (the reference's algorithm).
    #[default]
    FixedWindow,
    /// Current window plus the previous one weighted by how much of it still
    /// overlaps the sliding interval.
    SlidingWindow,
    /// Exact log of grants over the last unit.
    SlidingLog,
    /// Bucket of `burst` tokens refilled at `requests_per_unit` per unit.
    TokenBucket,
}

impl Algorithm {
    pub const ALL: [Algorithm; 4] = [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::SlidingLog,
        Algorithm::TokenBucket,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::SlidingLog => "sliding_log",
            Algorithm::TokenBucket => "token_bucket",
        }
    }

    /// Short tag used inside counter keys.
    pub fn tag(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fw",
            Algorithm::SlidingWindow => "sw",
            Algorithm::SlidingLog => "sl",
            Algorithm::TokenBucket => "tb",
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Algorithm {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Algorithm::ALL
            .into_iter()
            .find(|a| a.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                format!("invalid algorithm '{s}' (expected fixed_window, sliding_window, sliding_log or token_bucket)")
            })
    }
}

/// Everything an engine needs to know about one limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LimitSpec {
    pub requests_per_unit: u32,
    pub unit: Unit,
    pub algorithm: Algorithm,
    /// Bucket capacity for token_bucket (defaults to requests_per_unit);
    /// ignored by the other algorithms.
    pub burst: u32,
}

impl LimitSpec {
    pub fn fixed(requests_per_unit: u32, unit: Unit) -> Self {
        LimitSpec {
            requests_per_unit,
            unit,
            algorithm: Algorithm::FixedWindow,
            burst: requests_per_unit,
        }
    }

    /// The complete window whose demand shares a Redis-path decision in
    /// `window` takes (leases are sized from them): the previous window,
    /// or for a fixed window of a second or less the last one before its
    /// block of [`DEMAND_BLOCK`] windows. So `decide.lua` reads a busy
    /// per-second key's demand once per block rather than once per window
    /// (a spread's first request in each window was 29% of its requests,
    /// each reading the previous window for about 14,000 Redis
    /// instructions). Every replica derives the same window, so their
    /// shares still add up to 1; the script keeps that window's hash until
    /// its block ends, whatever the expiry margin. A sliding window reads
    /// the previous window anyway, for its weight, and a bucket's
    /// consumption windows keep it too.
    pub fn demand_window(&self, window: u64) -> u64 {
        let block = self.demand_block();
        (window - window % block).saturating_sub(1)
    }

    /// Windows per demand block: [`DEMAND_BLOCK`] for a fixed window of a
    /// second or less, else 1 (see [`Self::demand_window`]).
    pub fn demand_block(&self) -> u64 {
        if self.algorithm == Algorithm::FixedWindow && self.unit.millis() <= 1_000 {
            DEMAND_BLOCK
        } else {
            1
        }
    }
}

/// Windows per demand block (see [`LimitSpec::demand_window`]); the same
/// number is in `decide.lua`.
pub const DEMAND_BLOCK: u64 = 5;

/// How a charge takes part in the request's all-or-nothing decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Over the limit denies the whole request.
    Enforce,
    /// Counted, never denies (rule `shadow_mode`).
    Shadow,
    /// Denies only when every quota descriptor of the request is over
    /// (rule `quota_mode`, the reference's overall-code rule).
    Quota,
}

/// The all-or-nothing rule, shared by every engine so they cannot drift: a
/// request is denied when any enforcing charge would go over, or when it has
/// quota charges and all of them would go over. `never_deny` is the global
/// shadow mode.
pub fn request_denied(items: impl IntoIterator<Item = (Role, bool)>, never_deny: bool) -> bool {
    let mut enforce_over = false;
    let mut quota_seen = false;
    let mut quota_all_over = true;
    for (role, over) in items {
        match role {
            Role::Enforce => enforce_over |= over,
            Role::Shadow => {}
            Role::Quota => {
                quota_seen = true;
                quota_all_over &= over;
            }
        }
    }
    !never_deny && (enforce_over || (quota_seen && quota_all_over))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_parse_case_insensitively() {
        assert_eq!("SECOND".parse::<Unit>(), Ok(Unit::Second));
        assert_eq!("Minute".parse::<Unit>(), Ok(Unit::Minute));
        assert_eq!("week".parse::<Unit>().map(Unit::seconds), Ok(604_800));
        assert_eq!("month".parse::<Unit>().map(Unit::seconds), Ok(2_592_000));
        assert_eq!("year".parse::<Unit>().map(Unit::seconds), Ok(31_536_000));
        assert!("fortnight".parse::<Unit>().is_err());
        assert!("".parse::<Unit>().is_err());
    }

    #[test]
    fn a_per_second_fixed_window_takes_its_demand_from_the_window_before_its_block() {
        let second = LimitSpec::fixed(10, Unit::Second);
        let demand: Vec<u64> = (0..12).map(|w| second.demand_window(w)).collect();
        assert_eq!(demand, [0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 9, 9]);
        // Every other rule: the previous window.
        let minute = LimitSpec::fixed(10, Unit::Minute);
        let sliding = LimitSpec {
            algorithm: Algorithm::SlidingWindow,
            ..second
        };
        let bucket = LimitSpec {
            algorithm: Algorithm::TokenBucket,
            ..second
        };
        for spec in [minute, sliding, bucket] {
            assert_eq!(spec.demand_window(7), 6, "{spec:?}");
            assert_eq!(spec.demand_window(0), 0, "{spec:?}");
        }
    }

    #[test]
    fn deny_rule_follows_reference_overall_code() {
        use Role::*;
        assert!(!request_denied([(Enforce, false), (Shadow, true)], false));
        assert!(request_denied([(Enforce, true), (Shadow, false)], false));
        assert!(!request_denied([(Enforce, true)], true));
        // One quota over of two: passes; all quota over: denied.
        assert!(!request_denied([(Quota, true), (Quota, false)], false));
        assert!(request_denied([(Quota, true), (Quota, true)], false));
        assert!(!request_denied(std::iter::empty(), false));
    }
}
