//! The listeners: gRPC (RLS, grpc.health.v1, reflection v1 and v1alpha) and
//! HTTP (public endpoints on the main listener, the admin pages on their
//! own, both bounded by [`crate::http::listener`]), every accepted socket
//! with TCP_NODELAY, each server stopping to accept on the stop signal and
//! then draining. gRPC is served on threads of its own
//! ([`crate::grpc::threads`]).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use crate::decision::Limiter;
use crate::grpc::{RlsService, HEALTH_NAMES};
use crate::http::{self, HttpState};
use crate::settings::Settings;

/// The running servers.
pub(super) struct Servers {
    /// Ends when every gRPC serving thread has drained.
    pub grpc: JoinHandle<anyhow::Result<()>>,
    pub http: JoinHandle<std::io::Result<()>>,
    pub admin: JoinHandle<std::io::Result<()>>,
    /// grpc.health.v1 statuses, flipped to NOT_SERVING first on shutdown.
    pub health: HealthReporter,
}

impl Servers {
    /// Reports every health name as `status`.
    pub async fn report(&self, status: ServingStatus) {
        for name in HEALTH_NAMES {
            self.health.set_service_status(name, status).await;
        }
    }
}

pub(super) struct Listeners {
    pub grpc: TcpListener,
    pub http: TcpListener,
    pub admin: TcpListener,
    pub grpc_tls: Option<Arc<crate::grpc::tls::Reloading>>,
}

pub(super) async fn start(
    settings: &Settings,
    limiter: Arc<Limiter>,
    state: HttpState,
    listeners: Listeners,
    stop: &watch::Receiver<bool>,
) -> anyhow::Result<Servers> {
    let (health, health_service) = tonic_health::server::health_reporter();
    for name in HEALTH_NAMES {
        health
            .set_service_status(name, ServingStatus::Serving)
            .await;
    }
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("building reflection v1")?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .context("building reflection v1alpha")?;
    let mut rls = RlsService::new(limiter, settings.bounds()).with_replica(&state.replica_id);
    if settings.replica_response_header {
        rls = rls.with_replica_http_header(&state.replica_id);
    }
    if !settings.grpc_allow_adjustments {
        rls = rls.refusing_adjustments();
    }
    // Envoy multiplexes many calls over few connections, so the stream
    // limit is generous; keepalive pings end connections whose peer is gone.
    let grpc = tonic::transport::Server::builder()
        .max_concurrent_streams(Some(settings.grpc_max_concurrent_streams))
        .http2_keepalive_interval(Some(Duration::from_millis(
            settings.grpc_keepalive_interval_ms,
        )))
        .http2_keepalive_timeout(Some(Duration::from_millis(
            settings.grpc_keepalive_timeout_ms,
        )))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(
            rls.into_server()
                .max_decoding_message_size(settings.max_request_bytes),
        );
    let threads = match settings.grpc_threads {
        0 => crate::grpc::threads::default_threads(),
        n => n,
    };
    if let Some(tls) = &listeners.grpc_tls {
        tracing::info!(mutual = tls.requires_client_certs(), "gRPC over TLS");
    }
    let grpc = crate::grpc::threads::serve(
        listeners.grpc,
        threads,
        listeners.grpc_tls,
        grpc,
        stop.clone(),
    )
    .context("starting the gRPC serving threads")?;

    // The pages that show descriptor values live on the admin listener
    // only; the main listener keeps health, metrics and /json.
    let limits = http::listener::Limits {
        max_connections: settings.http_max_connections,
        header_timeout: Duration::from_millis(settings.http_header_timeout_ms),
    };
    let http = http::listener::serve(
        listeners.http,
        http::public_router(state.clone()),
        limits,
        stop.clone(),
    );
    let admin = http::listener::serve(
        listeners.admin,
        http::admin_router(state),
        limits,
        stop.clone(),
    );
    Ok(Servers {
        grpc,
        http: tokio::spawn(http),
        admin: tokio::spawn(admin),
        health,
    })
}
