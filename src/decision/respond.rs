//! From the engine's outcome back to the caller's answer: one status per
//! descriptor (shadow rules report OK, unlimited rules report an unlimited
//! remainder), the overall code, and the optional RateLimit-* headers from
//! the most restrictive status.

use crate::domain::BatchOutcome;

use super::plan::Plan;
use super::types::{Code, Decision, DecisionSettings, Status};

pub(super) fn decision(
    plans: Vec<Plan>,
    outcome: Option<BatchOutcome>,
    settings: &DecisionSettings,
) -> Decision {
    let statuses: Vec<Status> = plans
        .into_iter()
        .map(|plan| status(plan, outcome.as_ref()))
        .collect();
    let overall = if outcome.as_ref().is_some_and(|o| o.denied) {
        Code::OverLimit
    } else {
        Code::Ok
    };
    let headers = if settings.response_headers {
        headers(settings, &statuses)
    } else {
        Vec::new()
    };
    Decision {
        overall,
        statuses,
        headers,
        path: outcome.map(|o| o.path),
    }
}

fn status(plan: Plan, outcome: Option<&BatchOutcome>) -> Status {
    match plan {
        Plan::None => Status::no_limit(),
        Plan::Unlimited => Status {
            limit_remaining: u32::MAX,
            ..Status::no_limit()
        },
        Plan::Limited {
            charge,
            info,
            shadow,
            quota,
            ..
        } => {
            let item = outcome.and_then(|o| o.items.get(charge).copied());
            let (over, remaining, reset_ms) =
                item.map_or((false, 0, 0), |i| (i.over, i.remaining, i.reset_ms));
            Status {
                // A shadow rule reports OK even when over (the reference's
                // per-rule shadow_mode).
                code: if over && !shadow {
                    Code::OverLimit
                } else {
                    Code::Ok
                },
                current_limit: Some(info),
                limit_remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
                reset_ms: Some(reset_ms),
                quota,
                shadowed: over && shadow,
            }
        }
    }
}

/// RateLimit-* headers from the most restrictive status: the lowest
/// remaining among limited statuses, with a non-quota OVER_LIMIT winning.
fn headers(settings: &DecisionSettings, statuses: &[Status]) -> Vec<(String, String)> {
    let pick = statuses
        .iter()
        .filter(|s| s.current_limit.is_some())
        .min_by_key(|s| (s.code != Code::OverLimit || s.quota, s.limit_remaining));
    let Some((s, limit)) = pick.and_then(|s| Some((s, s.current_limit.as_ref()?))) else {
        return Vec::new();
    };
    let reset_s = s.reset_ms.unwrap_or(0).div_ceil(1000);
    vec![
        (
            settings.header_limit.clone(),
            limit.requests_per_unit.to_string(),
        ),
        (
            settings.header_remaining.clone(),
            s.limit_remaining.to_string(),
        ),
        (settings.header_reset.clone(), reset_s.to_string()),
    ]
}
