//! Liveness and readiness: /healthz (the process answers), /healthcheck (the
//! reference's path: 200 "OK" while serving) and /readyz (rules loaded and
//! not draining), from one [`Health`] state the composition root flips.

use std::sync::atomic::{AtomicBool, Ordering};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::HttpState;

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

pub(super) async fn healthz() -> &'static str {
    "OK"
}

/// The reference's health endpoint: 200 "OK" when serving, 500 otherwise.
pub(super) async fn healthcheck(State(s): State<HttpState>) -> Response {
    if s.health.is_ready() {
        (StatusCode::OK, "OK").into_response()
    } else {
        (StatusCode::INTERNAL_SERVER_ERROR, "NOT OK").into_response()
    }
}

pub(super) async fn readyz(State(s): State<HttpState>) -> Response {
    if s.health.is_ready() {
        (StatusCode::OK, "ready").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready").into_response()
    }
}
