//! What the decision layer takes in and gives back, in transport-neutral
//! form: a validated request of descriptors, and a decision of statuses, the
//! overall code and response headers. The `rls` module converts both to and
//! from the wire forms.

use crate::domain::DecisionPath;
use crate::limit::Unit;

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

impl Request {
    /// The hits a descriptor charges: its own `hits_addend` when set (0 is a
    /// check), else the request's, where 0 means 1, as in the reference.
    pub fn hits_of(&self, d: &Descriptor) -> u64 {
        d.hits.unwrap_or(u64::from(self.hits_addend.max(1)))
    }
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
    /// A descriptor no rule limits.
    pub fn no_limit() -> Self {
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
