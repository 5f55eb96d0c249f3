//! The HTTP surface: /healthz and /healthcheck (liveness / the reference's
//! health path), /readyz, /metrics, POST /json (the reference's JSON form of
//! ShouldRateLimit: 200 when OK, 429 when over, 400 on bad input), and the
//! admin pages that show descriptor values: /rules, /status (JSON) and
//! /status.html. The admin pages can live on their own listener
//! (`admin_addr`) and redact values (`redact_values`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::grpc::{validate, Bounds};
use crate::limiter::{Code, Decision, Limiter};
use crate::proto::common::rate_limit_descriptor::{Entry, RateLimitOverride};
use crate::proto::common::RateLimitDescriptor;
use crate::proto::rls::RateLimitRequest;

/// Readiness: rules loaded and not draining.
#[derive(Debug, Default)]
pub struct Health {
    rules_loaded: AtomicBool,
    draining: AtomicBool,
}

impl Health {
    pub fn set_rules_loaded(&self) {
        self.rules_loaded.store(true, Ordering::SeqCst);
    }

    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub fn is_ready(&self) -> bool {
        self.rules_loaded.load(Ordering::SeqCst) && !self.draining.load(Ordering::SeqCst)
    }
}

/// What the rules reloader last did, for /rules and logs.
#[derive(Debug, Default)]
pub struct ReloadStatus {
    pub successes: AtomicU64,
    pub failures: AtomicU64,
    pub last_error: Mutex<Option<String>>,
    pub loaded_at_ms: AtomicU64,
}

#[derive(Clone)]
pub struct HttpState {
    pub limiter: Arc<Limiter>,
    pub bounds: Bounds,
    pub health: Arc<Health>,
    pub reload: Arc<ReloadStatus>,
    pub replica_id: Arc<str>,
    /// Hide descriptor values on the admin pages.
    pub redact: bool,
}

/// Every endpoint on one listener.
pub fn router(state: HttpState) -> Router {
    public_router(state.clone()).merge(admin_pages(state))
}

/// What load balancers, Prometheus and callers use.
pub fn public_router(state: HttpState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/healthcheck", get(healthcheck))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/json", post(json_decide))
        .with_state(state)
}

/// The pages that show descriptor values (and /healthz, so the admin
/// listener can be probed on its own).
pub fn admin_router(state: HttpState) -> Router {
    admin_pages(state).route("/healthz", get(healthz))
}

fn admin_pages(state: HttpState) -> Router {
    Router::new()
        .route("/rules", get(rules))
        .route("/status", get(status))
        .route("/status.html", get(status_html))
        .with_state(state)
}

async fn healthz() -> &'static str {
    "OK"
}

/// The reference's health endpoint: 200 "OK" when serving, 500 otherwise.
async fn healthcheck(State(s): State<HttpState>) -> Response {
    if s.health.is_ready() {
        (StatusCode::OK, "OK").into_response()
    } else {
        (StatusCode::INTERNAL_SERVER_ERROR, "NOT OK").into_response()
    }
}

async fn readyz(State(s): State<HttpState>) -> Response {
    if s.health.is_ready() {
        (StatusCode::OK, "ready").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready").into_response()
    }
}

async fn rules(State(s): State<HttpState>) -> Json<Value> {
    let rules = s.limiter.rules().load();
    let mut domains: Vec<_> = rules
        .domains
        .values()
        .map(|d| {
            json!({
                "domain": d.name,
                "rules": d.rules.iter().map(|r| json!({
                    "key": if s.redact { &r.redacted_key } else { &r.full_key },
                    "requests_per_unit": r.spec.requests_per_unit,
                    "unit": r.spec.unit.as_str(),
                    "algorithm": r.spec.algorithm.as_str(),
                    "burst": r.spec.burst,
                    "unlimited": r.unlimited,
                    "name": r.name,
                    "replaces": r.replaces,
                    "shadow_mode": r.shadow_mode,
                    "quota_mode": r.quota_mode,
                    "detailed_metric": r.detailed_metric,
                    "value_to_metric": r.value_to_metric,
                    "metadata": if s.redact { Value::Null } else { r.metadata.clone() },
                    "source": format!("{}:{}", r.file.display(), r.line),
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    domains.sort_by(|a, b| a["domain"].as_str().cmp(&b["domain"].as_str()));
    Json(json!({
        "hash": rules.hash,
        "files": rules.files,
        "loaded_at_ms": s.reload.loaded_at_ms.load(Ordering::Relaxed),
        "reload_successes": s.reload.successes.load(Ordering::Relaxed),
        "reload_failures": s.reload.failures.load(Ordering::Relaxed),
        "last_error": last_error(&s),
        "domains": domains,
    }))
}

/// Prometheus text exposition.
async fn metrics(State(s): State<HttpState>) -> Response {
    match s.limiter.metrics() {
        Some(m) => (
            StatusCode::OK,
            [(
                axum::http::header::CONTENT_TYPE,
                "text/plain; version=0.0.4",
            )],
            m.render(&s.limiter.engine().status()),
        )
            .into_response(),
        None => (StatusCode::NOT_FOUND, "metrics are not enabled").into_response(),
    }
}

/// The last rules reload error. Loader messages quote rule keys with their
/// values, so with redaction only the fact of the failure is shown.
fn last_error(s: &HttpState) -> Option<String> {
    let e = s.reload.last_error.lock().clone()?;
    Some(if s.redact {
        "the last rules reload failed; the message names descriptor values, so it is only in this replica's log (redact_values is on)".into()
    } else {
        e
    })
}

fn status_value(s: &HttpState) -> Value {
    let rules = s.limiter.rules().load();
    let mut engine = serde_json::to_value(s.limiter.engine().status()).unwrap_or_default();
    if s.redact {
        if let Some(leases) = engine.get_mut("leases").and_then(Value::as_array_mut) {
            for lease in leases {
                if let Some(key) = lease.get("key").and_then(Value::as_str) {
                    let redacted = crate::redact::counter_key(key);
                    lease["key"] = Value::String(redacted);
                }
            }
        }
    }
    json!({
        "replica_id": &*s.replica_id,
        "ready": s.health.is_ready(),
        "redacted": s.redact,
        "engine": engine,
        "rules_hash": rules.hash,
        "rules_last_error": last_error(s),
    })
}

async fn status(State(s): State<HttpState>) -> Json<Value> {
    Json(status_value(&s))
}

async fn status_html(State(s): State<HttpState>) -> axum::response::Html<String> {
    axum::response::Html(crate::status_page::render(&status_value(&s)))
}

// ---- POST /json: protojson in, protojson out --------------------------------

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
            NumberOrString::Text(t) => match t.to_ascii_uppercase().as_str() {
                "UNKNOWN" => Ok(0),
                "SECOND" => Ok(1),
                "MINUTE" => Ok(2),
                "HOUR" => Ok(3),
                "DAY" => Ok(4),
                "MONTH" => Ok(5),
                "YEAR" => Ok(6),
                "WEEK" => Ok(7),
                _ => Err(format!("unit '{t}' is not defined")),
            },
        }
    }
}

fn to_proto_request(body: JsonRequest) -> Result<RateLimitRequest, String> {
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

fn bad_request(message: String) -> Response {
    (StatusCode::BAD_REQUEST, Json(json!({ "error": message }))).into_response()
}

async fn json_decide(State(s): State<HttpState>, body: axum::body::Bytes) -> Response {
    let parsed: JsonRequest = match serde_json::from_slice(&body) {
        Ok(p) => p,
        Err(e) => return bad_request(format!("invalid JSON request: {e}")),
    };
    let proto = match to_proto_request(parsed) {
        Ok(p) => p,
        Err(e) => return bad_request(e),
    };
    let req = match validate::to_domain(proto, &s.bounds) {
        Ok(r) => r,
        Err(e) => {
            if let Some(m) = s.limiter.metrics() {
                m.request("invalid");
            }
            return bad_request(e.to_string());
        }
    };
    match s.limiter.decide(&req).await {
        Ok(decision) => {
            let code = if decision.overall == Code::OverLimit {
                StatusCode::TOO_MANY_REQUESTS
            } else {
                StatusCode::OK
            };
            (code, Json(decision_json(&decision))).into_response()
        }
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "error": e.to_string() })),
        )
            .into_response(),
    }
}

fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::OverLimit => "OVER_LIMIT",
    }
}

/// The protojson rendering of a response (default values omitted, as
/// protojson does).
fn decision_json(d: &Decision) -> Value {
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
                limit.insert("unit".into(), json!(l.unit.as_str().to_ascii_uppercase()));
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
