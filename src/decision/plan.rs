//! Planning: what each descriptor of a request is limited by, before any
//! engine runs. Matches every descriptor first (`replaces` needs all matched
//! rules), resolves request overrides, unlimited and replaced rules and
//! shadow/quota roles, and builds the request's one [`Batch`] of charges.

use std::collections::HashSet;

use crate::domain::{Batch, Charge, MAX_HITS};
use crate::key::CounterKey;
use crate::limit::{LimitSpec, Role};
use crate::rules::{Domain, Matched};

use super::types::{CurrentLimit, DecisionSettings, Descriptor, Request};

/// What one descriptor resolved to.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Plan {
    /// No rule applies (no match, or the rule was replaced).
    None,
    /// An `unlimited` rule: OK, with no counter.
    Unlimited,
    Limited {
        /// Index of its charge in the batch.
        charge: usize,
        info: CurrentLimit,
        shadow: bool,
        quota: bool,
        /// The rule has `detailed_metric`.
        detailed: bool,
    },
}

impl Plan {
    #[cfg(feature = "server")]
    pub(super) fn detailed(&self) -> bool {
        matches!(self, Plan::Limited { detailed: true, .. })
    }
}

/// A request's plan: one entry per descriptor, and the charges for the engine.
#[derive(Debug)]
pub(super) struct Planned {
    pub plans: Vec<Plan>,
    pub batch: Batch,
}

/// The counter a limited descriptor charges, before it becomes a [`Charge`].
struct Target {
    key: CounterKey,
    spec: LimitSpec,
    info: CurrentLimit,
    shadow: bool,
    quota: bool,
    detailed: bool,
}

enum Resolution {
    None,
    Unlimited,
    Limited(Target),
}

pub(super) fn plan(req: &Request, domain: &Domain, settings: &DecisionSettings) -> Planned {
    // A descriptor with a request override is never matched against rules.
    let matched: Vec<Option<Matched>> = req
        .descriptors
        .iter()
        .map(|d| match d.limit_override {
            Some(_) => None,
            None => domain.find(entries(d)),
        })
        .collect();
    let replaced: HashSet<&str> = matched
        .iter()
        .flatten()
        .flat_map(|m| m.rule.replaces.iter().map(String::as_str))
        .collect();
    let mut batch = Batch {
        charges: Vec::new(),
        never_deny: settings.global_shadow_mode,
    };
    let plans = req
        .descriptors
        .iter()
        .zip(&matched)
        .map(|(d, m)| {
            match resolve(
                &req.domain,
                d,
                m.as_ref(),
                &replaced,
                settings.global_quota_mode,
            ) {
                Resolution::None => Plan::None,
                Resolution::Unlimited => Plan::Unlimited,
                Resolution::Limited(t) => {
                    batch.charges.push(Charge {
                        key: t.key,
                        spec: t.spec,
                        hits: req.hits_of(d).min(MAX_HITS),
                        refund: d.refund,
                        role: role(t.shadow, t.quota),
                    });
                    Plan::Limited {
                        charge: batch.charges.len() - 1,
                        info: t.info,
                        shadow: t.shadow,
                        quota: t.quota,
                        detailed: t.detailed,
                    }
                }
            }
        })
        .collect();
    Planned { plans, batch }
}

fn entries(d: &Descriptor) -> impl Iterator<Item = (&str, &str)> {
    d.entries.iter().map(|(k, v)| (k.as_str(), v.as_str()))
}

/// A shadow rule counts but never denies; quota mode (the rule's or the
/// global setting) never denies the request as a whole either.
fn role(shadow: bool, quota: bool) -> Role {
    if shadow {
        Role::Shadow
    } else if quota {
        Role::Quota
    } else {
        Role::Enforce
    }
}

fn resolve(
    domain: &str,
    d: &Descriptor,
    matched: Option<&Matched>,
    replaced: &HashSet<&str>,
    global_quota: bool,
) -> Resolution {
    if let Some((rpu, unit)) = d.limit_override {
        // An override is a fixed window of its own, keyed by the request's
        // values, with no name and no rule flags.
        let spec = LimitSpec::fixed(rpu, unit);
        return Resolution::Limited(Target {
            key: CounterKey::new(domain, entries(d), &spec),
            spec,
            info: CurrentLimit {
                requests_per_unit: rpu,
                unit,
                name: String::new(),
            },
            shadow: false,
            quota: global_quota,
            detailed: false,
        });
    }
    let Some(m) = matched else {
        return Resolution::None;
    };
    let rule = m.rule;
    if rule.name.as_deref().is_some_and(|n| replaced.contains(n)) {
        return Resolution::None;
    }
    if rule.unlimited {
        return Resolution::Unlimited;
    }
    // A `share_threshold` wildcard keys the counter by its pattern, so every
    // matching value shares one count.
    let values = d.entries.iter().enumerate().map(|(i, (k, v))| {
        let shared = m.shared.iter().find(|(at, _)| *at == i);
        (k.as_str(), shared.map_or(v.as_str(), |(_, p)| &**p))
    });
    Resolution::Limited(Target {
        key: CounterKey::new(domain, values, &rule.spec),
        spec: rule.spec,
        info: CurrentLimit {
            requests_per_unit: rule.spec.requests_per_unit,
            unit: rule.spec.unit,
            name: rule.name.clone().unwrap_or_default(),
        },
        shadow: rule.shadow_mode,
        quota: rule.quota_mode || global_quota,
        detailed: rule.detailed_metric,
    })
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
