//! Lease sizing: a replica's lease for a key's window is `share × base`.
//!
//! - `base` is what Redis last said remained in that window when this
//!   replica last reached it (mid-window), else the full limit;
//! - `share` comes from demand when known: `d × (1 − N·f) + f`, where `d` is
//!   this replica's part of the key's recent traffic (from script replies),
//!   `N` the live members (frozen when Redis went away; a configured hint
//!   before first contact) and `f` the floor (`lease_min_share`), so a
//!   replica that suddenly gets traffic is not starved. Summed over replicas
//!   whose `d` add up to 1, the shares add up to exactly 1. Their `d` add
//!   up to 1 only when they come from one window that every replica decided
//!   on Redis: the ledger uses a demand only from the demand window of its
//!   latest reply (the previous window, or for a fixed window of a second
//!   or less the last one before its block of five, the same for every
//!   replica), and the script reports none for a window in which some
//!   replica decided off Redis. Without demand data the share is `1/N`.
//!
//! Local decisions run the same algorithm as Redis on the lease, on the
//! replica's estimate of Redis time (its last measured offset), so windows
//! line up with Redis's.

use crate::limit::{Algorithm, LimitSpec};

/// A replica's share of a limit (see the module docs).
pub fn lease_share(demand: Option<f64>, members: usize, min_share: f64) -> f64 {
    let n = members.max(1) as f64;
    match demand {
        Some(d) => {
            let f = min_share.clamp(0.0, 1.0 / n);
            d.clamp(0.0, 1.0) * (1.0 - n * f) + f
        }
        None => 1.0 / n,
    }
}

/// The spec a replica enforces locally: the limit scaled to its lease.
pub fn lease_spec(spec: &LimitSpec, share: f64, remaining: Option<u64>) -> LimitSpec {
    let scale = |v: u64| (v as f64 * share).floor().min(f64::from(u32::MAX)) as u32;
    match spec.algorithm {
        Algorithm::TokenBucket => LimitSpec {
            requests_per_unit: scale(u64::from(spec.requests_per_unit)),
            burst: scale(
                remaining
                    .unwrap_or(u64::from(spec.burst))
                    .min(u64::from(spec.burst)),
            ),
            ..*spec
        },
        _ => {
            let base = remaining
                .unwrap_or(u64::from(spec.requests_per_unit))
                .min(u64::from(spec.requests_per_unit));
            LimitSpec {
                requests_per_unit: scale(base),
                burst: scale(base),
                ..*spec
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::Unit;

    #[test]
    fn shares_sum_to_one_and_have_a_floor() {
        let f = 0.025;
        let demands = [0.7, 0.1, 0.1, 0.1];
        let sum: f64 = demands.iter().map(|d| lease_share(Some(*d), 4, f)).sum();
        assert!((sum - 1.0).abs() < 1e-9, "{sum}");
        assert!((lease_share(Some(0.7), 4, f) - 0.655).abs() < 1e-9);
        assert!(
            (lease_share(Some(0.0), 4, f) - 0.025).abs() < 1e-9,
            "an idle replica keeps the floor"
        );
        assert_eq!(lease_share(None, 4, f), 0.25);
        assert_eq!(
            lease_share(None, 0, f),
            1.0,
            "no members known: the whole limit"
        );
        // A floor too large for N is capped at an even split.
        assert!((lease_share(Some(0.9), 4, 0.5) - 0.25).abs() < 1e-9);
    }

    #[test]
    fn leases_scale_the_limit_or_what_remained() {
        let spec = LimitSpec::fixed(1_000, Unit::Second);
        assert_eq!(lease_spec(&spec, 0.25, None).requests_per_unit, 250);
        assert_eq!(
            lease_spec(&spec, 0.25, Some(400)).requests_per_unit,
            100,
            "mid-window: share of what remained"
        );
        assert_eq!(
            lease_spec(&spec, 0.25, Some(5_000)).requests_per_unit,
            250,
            "never above the limit"
        );
        let bucket = LimitSpec {
            requests_per_unit: 100,
            unit: Unit::Second,
            algorithm: Algorithm::TokenBucket,
            burst: 40,
        };
        let l = lease_spec(&bucket, 0.5, None);
        assert_eq!((l.requests_per_unit, l.burst), (50, 20));
        assert_eq!(lease_spec(&bucket, 0.5, Some(10)).burst, 5);
    }
}
