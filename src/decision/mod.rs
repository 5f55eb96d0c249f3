//! The decision layer between transports and engines: matches a request's
//! descriptors against the current rules (`plan`), hands the charges to
//! the engine as one batch, and turns the outcome into per-descriptor
//! statuses, the overall code and the optional RateLimit-* headers
//! (`respond`). Transport-neutral: gRPC and `POST /json` both call
//! [`Limiter::decide`].

mod plan;
mod respond;
mod types;

use std::sync::Arc;
#[cfg(feature = "server")]
use std::time::Instant;

use arc_swap::ArcSwap;

use crate::domain::EngineError;
use crate::engine::Engine;
#[cfg(feature = "server")]
use crate::metrics::Metrics;
use crate::rules::RuleSet;

pub use types::{Code, CurrentLimit, Decision, DecisionSettings, Descriptor, Request, Status};

/// The current rules, swapped atomically: a request loads one snapshot and
/// sees the old rules or the new, never a mix.
pub type RulesHandle = Arc<ArcSwap<RuleSet>>;

pub struct Limiter {
    rules: RulesHandle,
    engine: Arc<dyn Engine>,
    settings: DecisionSettings,
    #[cfg(feature = "server")]
    metrics: Option<Arc<Metrics>>,
}

impl Limiter {
    pub fn new(rules: RulesHandle, engine: Arc<dyn Engine>, settings: DecisionSettings) -> Self {
        Limiter {
            rules,
            engine,
            settings,
            #[cfg(feature = "server")]
            metrics: None,
        }
    }

    /// Records decisions in `metrics`.
    #[cfg(feature = "server")]
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    #[cfg(feature = "server")]
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
        let planned = {
            let rules = self.rules.load();
            let Some(domain) = rules.domain(&req.domain) else {
                return Ok(self.unknown_domain(req));
            };
            plan::plan(req, domain, &self.settings)
        };
        #[cfg(feature = "server")]
        let started = Instant::now();
        let outcome = if planned.batch.charges.is_empty() {
            None
        } else {
            match self.engine.apply(&planned.batch).await {
                Ok(o) => Some(o),
                Err(e) => {
                    #[cfg(feature = "server")]
                    if let Some(m) = &self.metrics {
                        m.request("error");
                    }
                    return Err(e);
                }
            }
        };
        #[cfg(feature = "server")]
        let detailed: Vec<bool> = planned.plans.iter().map(plan::Plan::detailed).collect();
        let decision = respond::decision(planned.plans, outcome, &self.settings);
        #[cfg(feature = "server")]
        if let Some(m) = &self.metrics {
            record(
                m,
                req,
                &decision,
                &detailed,
                started.elapsed().as_secs_f64(),
            );
        }
        Ok(decision)
    }

    /// A domain no rules file declares: every descriptor is unlimited, as in
    /// the reference.
    fn unknown_domain(&self, req: &Request) -> Decision {
        #[cfg(feature = "server")]
        if let Some(m) = &self.metrics {
            m.request("ok");
            m.descriptor_unknown_domain(req.descriptors.len());
        }
        Decision {
            overall: Code::Ok,
            statuses: vec![Status::no_limit(); req.descriptors.len()],
            headers: Vec::new(),
            path: None,
        }
    }
}

/// Decision metrics. Only configured domains become label values.
#[cfg(feature = "server")]
fn record(m: &Metrics, req: &Request, d: &Decision, detailed: &[bool], seconds: f64) {
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
        let near = outcome == "ok"
            && u64::from(s.limit_remaining) * 5 < u64::from(limit.requests_per_unit);
        m.descriptor(&req.domain, outcome, path, req.hits_of(desc), near);
        if detailed.get(i).copied().unwrap_or(false) {
            let mut label = req.domain.clone();
            for (k, v) in &desc.entries {
                label.push('.');
                label.push_str(k);
                label.push('_');
                label.push_str(&m.label_value(v));
            }
            m.detailed(&req.domain, &label, outcome);
        }
    }
}
