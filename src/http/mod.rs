//! The HTTP surface, one file per job: liveness and readiness
//! ([`health`]), POST /json ([`json`]), /metrics (here), and the admin pages
//! that show descriptor values ([`admin`]: /rules, /status, and
//! [`status_page`]'s /status.html). The admin pages live on their own
//! listener (`admin_addr`, loopback by default) and can redact values
//! (`redact_values`).

mod admin;
mod health;
mod json;
pub mod listener;
mod status_page;

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

use crate::decision::Limiter;
use crate::rls::Bounds;
use crate::rules::ReloadStatus;

pub use health::Health;

#[derive(Clone)]
pub struct HttpState {
    pub limiter: Arc<Limiter>,
    pub bounds: Bounds,
    /// Largest `POST /json` body; larger ones get 413 before they are read.
    pub max_body_bytes: usize,
    /// Answer refunds and limit overrides on `/json` (`json_allow_adjustments`).
    pub allow_adjustments: bool,
    pub health: Arc<Health>,
    pub reload: Arc<ReloadStatus>,
    pub replica_id: Arc<str>,
    /// Hide descriptor values on the admin pages.
    pub redact: bool,
}

/// What load balancers, Prometheus and callers use.
pub fn public_router(state: HttpState) -> Router {
    Router::new()
        .route("/healthz", get(health::healthz))
        .route("/healthcheck", get(health::healthcheck))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(metrics))
        .route(
            "/json",
            post(json::decide).layer(DefaultBodyLimit::max(state.max_body_bytes)),
        )
        .with_state(state)
}

/// The pages that show descriptor values (and /healthz, so the admin
/// listener can be probed on its own).
pub fn admin_router(state: HttpState) -> Router {
    admin_pages(state).route("/healthz", get(health::healthz))
}

fn admin_pages(state: HttpState) -> Router {
    Router::new()
        .route("/rules", get(admin::rules))
        .route("/status", get(admin::status))
        .route("/status.html", get(admin::status_html))
        .with_state(state)
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
