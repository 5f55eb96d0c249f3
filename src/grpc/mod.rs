//! The gRPC surface: RateLimitService (the tonic glue around [`crate::rls`],
//! which converts messages to and from decisions), grpc.health.v1 and
//! reflection (v1 and v1alpha). The only server module that knows tonic
//! types besides the composition root.
//!
//! Status codes: bad input is INVALID_ARGUMENT with a message; a refund or
//! limit override with `grpc_allow_adjustments` off is PERMISSION_DENIED. An engine
//! failure is UNAVAILABLE; with Envoy's `failure_mode_deny: false` (its
//! default) the request is let through, with `true` it is denied. The
//! resilient engine decides locally instead of failing, so in normal
//! operation no Redis fault reaches this layer.

pub mod threads;
pub mod tls;

use std::sync::Arc;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::{Request, Response, Status};
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use crate::decision::Limiter;
use crate::proto::rls::rate_limit_response::Code as ProtoCode;
use crate::proto::rls::rate_limit_service_server::{RateLimitService, RateLimitServiceServer};
use crate::proto::rls::{RateLimitRequest, RateLimitResponse};
use crate::rls::{self, Bounds};

/// The health service names leasehold answers for: the overall server (""),
/// the reference's name, and the RLS service itself.
pub const HEALTH_NAMES: [&str; 3] = [
    "",
    "ratelimit",
    "envoy.service.ratelimit.v3.RateLimitService",
];

/// Response metadata naming the replica that decided, so a caller behind a
/// balancer (grpcurl -v through nginx) can see which one answered.
pub const REPLICA_HEADER: &str = "x-leasehold-replica";

/// Socket options for an accepted gRPC connection on a custom acceptor:
/// TCP_NODELAY (a response's last small write would otherwise wait for
/// the client's delayed ACK, 40 ms) and TCP keepalive (finds peers that
/// vanished without a FIN).
pub fn socket_options(stream: &tokio::net::TcpStream) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(error = %e, "cannot set TCP_NODELAY on a gRPC connection");
    }
    let keepalive = socket2::TcpKeepalive::new().with_time(std::time::Duration::from_secs(60));
    if let Err(e) = socket2::SockRef::from(stream).set_tcp_keepalive(&keepalive) {
        tracing::debug!(error = %e, "cannot set TCP keepalive on a gRPC connection");
    }
}

pub struct RlsService {
    limiter: Arc<Limiter>,
    bounds: Bounds,
    replica: Option<MetadataValue<Ascii>>,
    /// Also ask Envoy to add the replica id to the HTTP response.
    replica_http_header: Option<String>,
    /// Refunds and limit overrides are answered, not refused
    /// (`grpc_allow_adjustments`).
    allow_adjustments: bool,
}

impl RlsService {
    pub fn new(limiter: Arc<Limiter>, bounds: Bounds) -> Self {
        RlsService {
            limiter,
            bounds,
            replica: None,
            replica_http_header: None,
            allow_adjustments: true,
        }
    }

    /// Adds the replica id to every response (skipped if it is not a valid
    /// header value).
    pub fn with_replica(mut self, id: &str) -> Self {
        self.replica = MetadataValue::try_from(id).ok();
        self
    }

    /// Puts `x-leasehold-replica` into `response_headers_to_add` as well, so
    /// Envoy shows HTTP clients which replica decided (setting
    /// `replica_response_header`).
    pub fn with_replica_http_header(mut self, id: &str) -> Self {
        self.replica_http_header = Some(id.to_string());
        self
    }

    /// Refuses refunds and limit overrides with PERMISSION_DENIED (setting
    /// `grpc_allow_adjustments = false`).
    pub fn refusing_adjustments(mut self) -> Self {
        self.allow_adjustments = false;
        self
    }

    pub fn into_server(self) -> RateLimitServiceServer<Self> {
        RateLimitServiceServer::new(self)
    }
}

#[tonic::async_trait]
impl RateLimitService for RlsService {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        // One span per call, parented to the caller's W3C trace context, with
        // the domain and the outcome as attributes.
        // Debug level: with the default log level no layer wants it, so
        // without trace export the span costs nothing per call; the OTLP
        // layer enables leasehold's debug spans.
        let span = tracing::debug_span!(
            "ShouldRateLimit",
            otel.kind = "server",
            rpc.system = "grpc",
            rpc.service = "envoy.service.ratelimit.v3.RateLimitService",
            rpc.method = "ShouldRateLimit",
            // Bounded: the domain is not validated yet.
            domain = %request.get_ref().domain.chars().take(128).collect::<String>(),
            descriptors = request.get_ref().descriptors.len(),
            outcome = tracing::field::Empty,
        );
        if !span.is_disabled() {
            let _ = span.set_parent(crate::telemetry::parent_context(request.metadata()));
        }
        let result = self.decide(request).instrument(span.clone()).await;
        let outcome = match &result {
            Ok(r) if r.get_ref().overall_code == ProtoCode::OverLimit as i32 => "over_limit",
            Ok(_) => "ok",
            Err(s) if s.code() == tonic::Code::InvalidArgument => "invalid",
            Err(_) => "error",
        };
        span.record("outcome", outcome);
        result
    }
}

impl RlsService {
    async fn decide(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let req = rls::to_domain(request.into_inner(), &self.bounds).map_err(|e| {
            if let Some(m) = self.limiter.metrics() {
                m.request("invalid");
            }
            Status::invalid_argument(e.to_string())
        })?;
        if !self.allow_adjustments {
            if let Some(what) = rls::adjustment(&req) {
                return Err(Status::permission_denied(format!(
                    "{what}: refunds and limit overrides are refused on this port (grpc_allow_adjustments)"
                )));
            }
        }
        let decision = self
            .limiter
            .decide(&req)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let mut proto = rls::to_response(decision);
        if let Some(id) = &self.replica_http_header {
            proto
                .response_headers_to_add
                .push(rls::header(REPLICA_HEADER.to_string(), id.clone()));
        }
        let mut response = Response::new(proto);
        if let Some(id) = &self.replica {
            response.metadata_mut().insert(REPLICA_HEADER, id.clone());
        }
        Ok(response)
    }
}
