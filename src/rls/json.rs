//! The protojson forms of `POST /json`, the reference's JSON ShouldRateLimit:
//! a request body (snake_case or camelCase names; 64-bit numbers and enums as
//! numbers or strings, as protojson writes them) into a `RateLimitRequest`,
//! and a decision into protojson (default values omitted, as protojson does).

use serde::Deserialize;
use serde_json::{json, Value};

use crate::decision::Decision;
use crate::proto::common::rate_limit_descriptor::{Entry, RateLimitOverride};
use crate::proto::common::RateLimitDescriptor;
use crate::proto::rls::RateLimitRequest;

use super::code_name;

#[derive(Deserialize)]
struct JsonRequest {
    #[serde(default)]
    domain: String,
    #[serde(default)]
    descriptors: Vec<JsonDescriptor>,
    #[serde(default, alias = "hitsAddend")]
    hits_addend: Option<NumberOrString>,
}

#[derive(Deserialize)]
struct JsonDescriptor {
    #[serde(default)]
    entries: Vec<JsonEntry>,
    #[serde(default)]
    limit: Option<JsonOverride>,
    #[serde(default, alias = "hitsAddend")]
    hits_addend: Option<NumberOrString>,
    #[serde(default, alias = "isNegativeHits")]
    is_negative_hits: bool,
}

#[derive(Deserialize)]
struct JsonEntry {
    #[serde(default)]
    key: String,
    #[serde(default)]
    value: String,
}

#[derive(Deserialize)]
struct JsonOverride {
    #[serde(default, alias = "requestsPerUnit")]
    requests_per_unit: u32,
    #[serde(default)]
    unit: Option<NumberOrString>,
}

/// protojson writes 64-bit integers and enums as strings; accept both forms.
#[derive(Deserialize)]
#[serde(untagged)]
enum NumberOrString {
    Number(u64),
    Text(String),
}

impl NumberOrString {
    fn as_u64(&self, field: &str) -> Result<u64, String> {
        match self {
            NumberOrString::Number(n) => Ok(*n),
            NumberOrString::Text(t) => t
                .parse()
                .map_err(|_| format!("{field}: '{t}' is not a number")),
        }
    }

    fn as_unit(&self) -> Result<i32, String> {
        match self {
            NumberOrString::Number(n) => {
                i32::try_from(*n).map_err(|_| format!("unit {n} is not defined"))
            }
            NumberOrString::Text(t) => {
                super::unit_number(t).ok_or_else(|| format!("unit '{t}' is not defined"))
            }
        }
    }
}

/// A JSON body → the request message it stands for; the message names what
/// is wrong. Bounds and semantic checks are [`super::validate`]'s.
pub fn parse_request(body: &[u8]) -> Result<RateLimitRequest, String> {
    let body: JsonRequest =
        serde_json::from_slice(body).map_err(|e| format!("invalid JSON request: {e}"))?;
    let hits_addend = match body.hits_addend {
        None => 0,
        Some(h) => u32::try_from(h.as_u64("hits_addend")?)
            .map_err(|_| "hits_addend is larger than 4294967295".to_string())?,
    };
    let mut descriptors = Vec::with_capacity(body.descriptors.len());
    for d in body.descriptors {
        let limit = match d.limit {
            None => None,
            Some(o) => Some(RateLimitOverride {
                requests_per_unit: o.requests_per_unit,
                unit: o.unit.map(|u| u.as_unit()).transpose()?.unwrap_or(0),
            }),
        };
        descriptors.push(RateLimitDescriptor {
            entries: d
                .entries
                .into_iter()
                .map(|e| Entry {
                    key: e.key,
                    value: e.value,
                })
                .collect(),
            limit,
            hits_addend: d.hits_addend.map(|h| h.as_u64("hits_addend")).transpose()?,
            is_negative_hits: d.is_negative_hits,
        });
    }
    Ok(RateLimitRequest {
        domain: body.domain,
        descriptors,
        hits_addend,
    })
}

/// The protojson rendering of a decision.
pub fn decision_json(d: &Decision) -> Value {
    let statuses: Vec<Value> = d
        .statuses
        .iter()
        .map(|s| {
            let mut o = serde_json::Map::new();
            o.insert("code".into(), json!(code_name(s.code)));
            if let Some(l) = &s.current_limit {
                let mut limit = serde_json::Map::new();
                if !l.name.is_empty() {
                    limit.insert("name".into(), json!(l.name));
                }
                limit.insert("requestsPerUnit".into(), json!(l.requests_per_unit));
                limit.insert(
                    "unit".into(),
                    json!(super::unit_to_wire(l.unit).as_str_name()),
                );
                o.insert("currentLimit".into(), Value::Object(limit));
            }
            if s.limit_remaining > 0 {
                o.insert("limitRemaining".into(), json!(s.limit_remaining));
            }
            if let Some(ms) = s.reset_ms {
                o.insert(
                    "durationUntilReset".into(),
                    json!(format!("{}s", ms as f64 / 1000.0)),
                );
            }
            Value::Object(o)
        })
        .collect();
    let mut out = serde_json::Map::new();
    out.insert("overallCode".into(), json!(code_name(d.overall)));
    out.insert("statuses".into(), Value::Array(statuses));
    if !d.headers.is_empty() {
        out.insert(
            "responseHeadersToAdd".into(),
            Value::Array(
                d.headers
                    .iter()
                    .map(|(k, v)| json!({ "key": k, "value": v }))
                    .collect(),
            ),
        );
    }
    Value::Object(out)
}
