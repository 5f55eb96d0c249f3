//! The decision layer between transports and engines: matches a request's
//! descriptors against the current rules, works out hits, overrides,
//! `replaces` and unlimited rules, hands the charges to the engine as one
//! batch, and turns the outcome into per-descriptor statuses, the overall code
//! and the optional RateLimit-* headers. Transport-neutral: gRPC and
//! `POST /json` both call [`Limiter::decide`].

use std::collections::HashSet;
use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::domain::{Batch, Charge, DecisionPath, EngineError};
use crate::engine::Engine;
use crate::key::CounterKey;
use crate::limit::{LimitSpec, Role, Unit};
use crate::metrics::Metrics;
use crate::rules::{Rule, RuleSet};

/// One descriptor of a request.
#[derive(Clone, Debug, Default)]
pub struct Descriptor {
    pub entries: Vec<(String, String)>,
    /// A request-supplied limit (requests_per_unit, unit).
    pub limit_override: Option<(u32, Unit)>,
    /// Per-descriptor hits; `Some(0)` is a check without a charge.
    pub hits: Option<u64>,
    /// `is_negative_hits`: the hits are a refund.
    pub refund: bool,
}

/// A validated request.
#[derive(Clone, Debug, Default)]
pub struct Request {
    pub domain: String,
    pub descriptors: Vec<Descriptor>,
    /// Request-level hits; 0 means 1.
    pub hits_addend: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    Ok,
    OverLimit,
}

/// The limit reported back in a status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CurrentLimit {
    pub requests_per_unit: u32,
    pub unit: Unit,
    pub name: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    pub code: Code,
    pub current_limit: Option<CurrentLimit>,
    pub limit_remaining: u32,
    pub reset_ms: Option<u64>,
    /// The status came from a quota-mode rule.
    pub quota: bool,
    /// Over its limit but not enforced (a shadow-mode rule).
    pub shadowed: bool,
}

impl Status {
    fn no_limit() -> Self {
        Status {
            code: Code::Ok,
            current_limit: None,
            limit_remaining: 0,
            reset_ms: None,
            quota: false,
            shadowed: false,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub overall: Code,
    pub statuses: Vec<Status>,
    pub headers: Vec<(String, String)>,
    /// None when no descriptor reached an engine.
    pub path: Option<DecisionPath>,
}

/// Decision settings that can change on reload.
#[derive(Clone, Debug)]
pub struct DecisionSettings {
    pub global_shadow_mode: bool,
    pub global_quota_mode: bool,
    pub response_headers: bool,
    pub header_limit: String,
    pub header_remaining: String,
    pub header_reset: String,
}

impl Default for DecisionSettings {
    fn default() -> Self {
        DecisionSettings {
            global_shadow_mode: false,
            global_quota_mode: false,
            response_headers: false,
            header_limit: "RateLimit-Limit".into(),
            header_remaining: "RateLimit-Remaining".into(),
            header_reset: "RateLimit-Reset".into(),
        }
    }
}

/// The current rules, swapped atomically: a request loads one snapshot and
/// sees the old rules or the new, never a mix.
pub type RulesHandle = Arc<ArcSwap<RuleSet>>;

pub struct Limiter {
    rules: RulesHandle,
    engine: Arc<dyn Engine>,
    settings: DecisionSettings,
    metrics: Option<Arc<Metrics>>,
}

/// What each descriptor resolved to before the engine runs.
enum Plan {
    None,
    Unlimited,
    Limited {
        charge: usize,
        info: CurrentLimit,
        shadow: bool,
        quota: bool,
        /// The rule has `detailed_metric`.
        detailed: bool,
    },
}

impl Limiter {
    pub fn new(rules: RulesHandle, engine: Arc<dyn Engine>, settings: DecisionSettings) -> Self {
        Limiter {
            rules,
            engine,
            settings,
            metrics: None,
        }
    }

    /// Records decisions in `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    pub fn metrics(&self) -> Option<&Arc<Metrics>> {
        self.metrics.as_ref()
    }

    pub fn rules(&self) -> &RulesHandle {
        &self.rules
    }

    pub fn engine(&self) -> &Arc<dyn Engine> {
        &self.engine
    }

    pub async fn decide(&self, req: &Request) -> Result<Decision, EngineError> {
        let rules = self.rules.load();
        let Some(domain) = rules.domain(&req.domain) else {
            if let Some(m) = &self.metrics {
                m.request("ok");
                m.descriptor_unknown_domain(req.descriptors.len());
            }
            return Ok(Decision {
                overall: Code::Ok,
                statuses: vec![Status::no_limit(); req.descriptors.len()],
                headers: Vec::new(),
                path: None,
            });
        };

        // Match every descriptor first: `replaces` needs all matched rules.
        let matched: Vec<Option<(Arc<Rule>, CounterKey)>> = req
            .descriptors
            .iter()
            .map(|d| {
                if d.limit_override.is_some() {
                    return None;
                }
                let entries = d.entries.iter().map(|(k, v)| (k.as_str(), v.as_str()));
                domain.find(entries).map(|m| {
                    let key = CounterKey::new(
                        &req.domain,
                        d.entries.iter().enumerate().map(|(i, (k, v))| {
                            let shared = m.shared.iter().find(|(at, _)| *at == i);
                            (k.as_str(), shared.map_or(v.as_str(), |(_, p)| &**p))
                        }),
                        &m.rule.spec,
                    );
                    (m.rule.clone(), key)
                })
            })
            .collect();
        let replaced: HashSet<&str> = matched
            .iter()
            .flatten()
            .flat_map(|(r, _)| r.replaces.iter().map(String::as_str))
            .collect();

        let mut batch = Batch {
            charges: Vec::new(),
            never_deny: self.settings.global_shadow_mode,
        };
        let mut plans = Vec::with_capacity(req.descriptors.len());
        for (d, m) in req.descriptors.iter().zip(&matched) {
            let hits = d.hits.unwrap_or(u64::from(req.hits_addend.max(1)));
            let plan = if let Some((rpu, unit)) = d.limit_override {
                let spec = LimitSpec::fixed(rpu, unit);
                let key = CounterKey::new(
                    &req.domain,
                    d.entries.iter().map(|(k, v)| (k.as_str(), v.as_str())),
                    &spec,
                );
                let role = if self.settings.global_quota_mode {
                    Role::Quota
                } else {
                    Role::Enforce
                };
                batch.charges.push(Charge {
                    key,
                    spec,
                    hits,
                    refund: d.refund,
                    role,
                });
                Plan::Limited {
                    charge: batch.charges.len() - 1,
                    info: CurrentLimit {
                        requests_per_unit: rpu,
                        unit,
                        name: String::new(),
                    },
                    shadow: false,
                    quota: role == Role::Quota,
                    detailed: false,
                }
            } else {
                match m {
                    None => Plan::None,
                    Some((rule, _))
                        if rule.name.as_deref().is_some_and(|n| replaced.contains(n)) =>
                    {
                        Plan::None
                    }
                    Some((rule, _)) if rule.unlimited => Plan::Unlimited,
                    Some((rule, key)) => {
                        let quota = rule.quota_mode || self.settings.global_quota_mode;
                        let role = if rule.shadow_mode {
                            Role::Shadow
                        } else if quota {
                            Role::Quota
                        } else {
                            Role::Enforce
                        };
                        batch.charges.push(Charge {
                            key: key.clone(),
                            spec: rule.spec,
                            hits,
                            refund: d.refund,
                            role,
                        });
                        Plan::Limited {
                            charge: batch.charges.len() - 1,
                            info: CurrentLimit {
                                requests_per_unit: rule.spec.requests_per_unit,
                                unit: rule.spec.unit,
                                name: rule.name.clone().unwrap_or_default(),
                            },
                            shadow: rule.shadow_mode,
                            quota,
                            detailed: rule.detailed_metric,
                        }
                    }
                }
            };
            plans.push(plan);
        }
        drop(rules);

        let started = std::time::Instant::now();
        let outcome = if batch.charges.is_empty() {
            None
        } else {
            match self.engine.apply(&batch).await {
                Ok(o) => Some(o),
                Err(e) => {
                    if let Some(m) = &self.metrics {
                        m.request("error");
                    }
                    return Err(e);
                }
            }
        };
        let detailed: Vec<bool> = plans
            .iter()
            .map(|p| matches!(p, Plan::Limited { detailed: true, .. }))
            .collect();

        let statuses: Vec<Status> = plans
            .into_iter()
            .map(|plan| match plan {
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
                    let item = outcome.as_ref().and_then(|o| o.items.get(charge).copied());
                    let (over, remaining, reset_ms) =
                        item.map_or((false, 0, 0), |i| (i.over, i.remaining, i.reset_ms));
                    Status {
                        // A shadow rule reports OK even when over (the
                        // reference's per-rule shadow_mode).
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
            })
            .collect();
        let overall = if outcome.as_ref().is_some_and(|o| o.denied) {
            Code::OverLimit
        } else {
            Code::Ok
        };
        let headers = if self.settings.response_headers {
            self.headers(&statuses)
        } else {
            Vec::new()
        };
        let decision = Decision {
            overall,
            statuses,
            headers,
            path: outcome.map(|o| o.path),
        };
        if let Some(m) = &self.metrics {
            self.record(
                m,
                req,
                &decision,
                &detailed,
                started.elapsed().as_secs_f64(),
            );
        }
        Ok(decision)
    }

    /// Decision metrics. Only configured domains become label values.
    fn record(&self, m: &Metrics, req: &Request, d: &Decision, detailed: &[bool], seconds: f64) {
        let path = d.path.map_or("none", |p| p.as_str());
        m.request(if d.overall == Code::OverLimit {
            "over_limit"
        } else {
            "ok"
        });
        m.decision_latency(path, seconds);
        for (i, s) in d.statuses.iter().enumerate() {
            let Some(limit) = &s.current_limit else {
                continue;
            };
            let outcome = if s.shadowed {
                "shadow"
            } else if s.code == Code::OverLimit {
                "over_limit"
            } else {
                "ok"
            };
            let desc = &req.descriptors[i];
            let hits = desc.hits.unwrap_or(u64::from(req.hits_addend.max(1)));
            let near = outcome == "ok"
                && u64::from(s.limit_remaining) * 5 < u64::from(limit.requests_per_unit);
            m.descriptor(&req.domain, outcome, path, hits, near);
            if detailed.get(i).copied().unwrap_or(false) {
                let mut label = req.domain.clone();
                for (k, v) in &desc.entries {
                    label.push('.');
                    label.push_str(k);
                    label.push('_');
                    label.push_str(v);
                }
                m.detailed(&req.domain, &label, outcome);
            }
        }
    }

    /// RateLimit-* headers from the most restrictive status: the lowest
    /// remaining among limited statuses, with a non-quota OVER_LIMIT winning.
    fn headers(&self, statuses: &[Status]) -> Vec<(String, String)> {
        let pick = statuses
            .iter()
            .filter(|s| s.current_limit.is_some())
            .min_by_key(|s| (s.code != Code::OverLimit || s.quota, s.limit_remaining));
        let Some(s) = pick else { return Vec::new() };
        let Some(limit) = &s.current_limit else {
            return Vec::new();
        };
        let reset_s = s.reset_ms.unwrap_or(0).div_ceil(1000);
        vec![
            (
                self.settings.header_limit.clone(),
                limit.requests_per_unit.to_string(),
            ),
            (
                self.settings.header_remaining.clone(),
                s.limit_remaining.to_string(),
            ),
            (self.settings.header_reset.clone(), reset_s.to_string()),
        ]
    }
}
