//! POST /json, the reference's JSON form of ShouldRateLimit: 200 when OK,
//! 429 when over the limit, 400 with a message on bad input, 403 for a
//! refund or a limit override unless `json_allow_adjustments` is set (the
//! HTTP port is often reachable by more than Envoy), 413 for a body over
//! `max_request_bytes`, 503 when the engine cannot decide. The protojson forms are [`crate::rls::json`]'s.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::decision::Code;
use crate::rls;

use super::HttpState;

fn bad_request(message: String) -> Response {
    (StatusCode::BAD_REQUEST, Json(json!({ "error": message }))).into_response()
}

pub(super) async fn decide(State(s): State<HttpState>, body: axum::body::Bytes) -> Response {
    let proto = match rls::json::parse_request(&body) {
        Ok(p) => p,
        Err(e) => return bad_request(e),
    };
    let req = match rls::to_domain(proto, &s.bounds) {
        Ok(r) => r,
        Err(e) => {
            if let Some(m) = s.limiter.metrics() {
                m.request("invalid");
            }
            return bad_request(e.to_string());
        }
    };
    if !s.allow_adjustments {
        if let Some(what) = rls::adjustment(&req) {
            let message = format!(
                "{what}: refunds and limit overrides are refused on /json unless json_allow_adjustments is set"
            );
            return (StatusCode::FORBIDDEN, Json(json!({ "error": message }))).into_response();
        }
    }
    match s.limiter.decide(&req).await {
        Ok(decision) => {
            let code = if decision.overall == Code::OverLimit {
                StatusCode::TOO_MANY_REQUESTS
            } else {
                StatusCode::OK
            };
            (code, Json(rls::json::decision_json(&decision))).into_response()
        }
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "error": e.to_string() })),
        )
            .into_response(),
    }
}
