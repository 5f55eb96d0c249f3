//! The pages that show descriptor values: /rules (the loaded rules and the
//! last reload), /status (the engine's typed snapshot as JSON) and
//! /status.html. With `redact_values` every value on them is hashed
//! ([`crate::redact`]), including those inside reload error messages.

use std::sync::atomic::Ordering;

use axum::extract::State;
use axum::response::Html;
use axum::Json;
use serde_json::{json, Value};

use super::HttpState;

pub(super) async fn rules(State(s): State<HttpState>) -> Json<Value> {
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
    let mut engine = s.limiter.engine().status();
    if s.redact {
        engine = engine.redacted();
    }
    json!({
        "replica_id": &*s.replica_id,
        "ready": s.health.is_ready(),
        "redacted": s.redact,
        "engine": serde_json::to_value(engine).unwrap_or_default(),
        "rules_hash": rules.hash,
        "rules_last_error": last_error(s),
    })
}

pub(super) async fn status(State(s): State<HttpState>) -> Json<Value> {
    Json(status_value(&s))
}

pub(super) async fn status_html(State(s): State<HttpState>) -> Html<String> {
    Html(super::status_page::render(&status_value(&s)))
}
