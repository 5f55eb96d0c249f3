//! The composition root: builds the engine, limiter and servers from validated
//! settings, runs the background loops (rules reload, expiry sweep) under one
//! stop signal, and shuts down in order: NOT_SERVING first, then stop
//! accepting, then drain in-flight calls under the grace timeout.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use arc_swap::ArcSwap;
use axum::serve::ListenerExt as _;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;

use crate::clock::{Clock, SystemClock};
use crate::engine::{Engine, MemoryEngine, RedisEngine, ResilientEngine};
use crate::grpc::{RlsService, HEALTH_NAMES};
use crate::http::{self, Health, HttpState, ReloadStatus};
use crate::limiter::{Limiter, RulesHandle};
use crate::metrics::Metrics;
use crate::redis::membership::Membership;
use crate::redis::{Redis, RedisConfig};
use crate::rules::{self, RuleErrors, RuleSet};
use crate::settings::Settings;

/// Everything that can fail before a port is bound: settings and rules.
pub struct Prepared {
    pub settings: Settings,
    pub rules: RuleSet,
}

/// Validates settings and loads the rules; errors here mean "exit non-zero
/// without binding anything".
pub fn prepare(settings: Settings) -> anyhow::Result<Prepared> {
    settings.validate()?;
    let rules = rules::load_paths(&settings.rules, settings.load_options())
        .map_err(|e: RuleErrors| anyhow::anyhow!("invalid rules:\n{e}"))?;
    Ok(Prepared { settings, rules })
}

/// Runs the server on already-bound listeners until `shutdown` resolves.
pub async fn run(
    prepared: Prepared,
    grpc_listener: TcpListener,
    http_listener: TcpListener,
    admin_listener: Option<TcpListener>,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let Prepared { settings, rules } = prepared;
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let memory = Arc::new(MemoryEngine::new(clock.clone()));
    let grpc_port = grpc_listener.local_addr()?.port();
    let replica_id: Arc<str> = Arc::from(
        settings
            .replica_id
            .clone()
            .unwrap_or_else(|| format!("{}:{grpc_port}", hostname())),
    );
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    let metrics = Arc::new(
        Metrics::new(settings.metrics_detailed_max_series).context("registering metrics")?,
    );
    let (engine, redis): (Arc<dyn Engine>, Option<Arc<Redis>>) = match &settings.redis_url {
        None => (memory.clone(), None),
        Some(url) => {
            let boot = format!("{:x}", clock.now_ms());
            let (redis_engine, redis) = redis_engine(&settings, url, &replica_id, boot).await?;
            tasks.spawn(redis_engine.membership().clone().run(stop_rx.clone()));
            let journal = match &settings.journal_dir {
                Some(dir) => Some(
                    crate::engine::resilient::journal::Journal::open(dir, &replica_id)
                        .with_context(|| format!("journal_dir {}", dir.display()))?,
                ),
                None => None,
            };
            let resilient = Arc::new(ResilientEngine::new(
                redis_engine.clone(),
                clock.clone(),
                settings.resilient(),
                journal,
            ));
            resilient.set_redis_call_histogram(metrics.redis_call_histogram());
            tasks.spawn(resilient.clone().run(stop_rx.clone()));
            (resilient, Some(redis))
        }
    };

    let reload = Arc::new(ReloadStatus::default());
    reload.loaded_at_ms.store(clock.now_ms(), Ordering::Relaxed);
    reload.successes.fetch_add(1, Ordering::Relaxed);
    tracing::info!(hash = %rules.hash, files = rules.files.len(), domains = rules.domains.len(), "rules loaded");
    metrics.reload(true, &rules.hash);
    let handle: RulesHandle = Arc::new(ArcSwap::from_pointee(rules));
    let limiter = Arc::new(
        Limiter::new(handle.clone(), engine, settings.decision()).with_metrics(metrics.clone()),
    );
    let health = Arc::new(Health::default());
    health.set_rules_loaded();

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    for name in HEALTH_NAMES {
        health_reporter
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

    tasks.spawn(reload_loop(
        settings.clone(),
        handle.clone(),
        reload.clone(),
        metrics.clone(),
        stop_rx.clone(),
    ));
    tasks.spawn(sweep_loop(
        memory.clone(),
        Duration::from_millis(settings.sweep_interval_ms),
        stop_rx.clone(),
    ));

    let mut rls = RlsService::new(limiter.clone(), settings.bounds()).with_replica(&replica_id);
    if settings.replica_response_header {
        rls = rls.with_replica_http_header(&replica_id);
    }
    let rls = rls.into_server();
    let grpc_stop = stopped(stop_rx.clone());
    let grpc = tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(rls)
        .serve_with_incoming_shutdown(accept_nodelay(grpc_listener), grpc_stop);
    let state = HttpState {
        limiter,
        bounds: settings.bounds(),
        health: health.clone(),
        reload,
        replica_id,
        redact: settings.redact_values,
    };
    // With an admin listener, the pages that show descriptor values move
    // there; the main listener keeps health, metrics and /json.
    let (router, admin) = match admin_listener {
        Some(listener) => {
            tracing::info!(admin = %listener.local_addr()?, "admin pages on their own listener");
            (
                http::public_router(state.clone()),
                Some((listener, http::admin_router(state))),
            )
        }
        None => (http::router(state), None),
    };
    let http_stop = stopped(stop_rx.clone());
    let http =
        axum::serve(http_listener.tap_io(set_nodelay), router).with_graceful_shutdown(http_stop);
    let admin_stop = stopped(stop_rx.clone());
    let mut admin = tokio::spawn(async move {
        match admin {
            Some((listener, router)) => {
                axum::serve(listener.tap_io(set_nodelay), router)
                    .with_graceful_shutdown(admin_stop)
                    .await
            }
            // No admin listener: a task that ends only at shutdown.
            None => {
                admin_stop.await;
                Ok(())
            }
        }
    });
    let mut grpc = tokio::spawn(grpc);
    let mut http = tokio::spawn(async move { http.await });

    tokio::select! {
        () = shutdown => {}
        r = &mut grpc => anyhow::bail!("gRPC server stopped unexpectedly: {r:?}"),
        r = &mut http => anyhow::bail!("HTTP server stopped unexpectedly: {r:?}"),
        r = &mut admin => anyhow::bail!("admin HTTP server stopped unexpectedly: {r:?}"),
    }

    tracing::info!("shutting down: reporting NOT_SERVING");
    health.set_draining();
    for name in HEALTH_NAMES {
        health_reporter
            .set_service_status(name, ServingStatus::NotServing)
            .await;
    }
    tokio::time::sleep(Duration::from_millis(settings.shutdown_delay_ms)).await;
    let _ = stop_tx.send(true);
    let grace = Duration::from_millis(settings.shutdown_grace_ms);
    let drained = tokio::time::timeout(grace, async {
        let _ = (&mut grpc).await;
        let _ = (&mut http).await;
        let _ = (&mut admin).await;
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            grace_ms = settings.shutdown_grace_ms,
            "in-flight calls did not finish within the grace period"
        );
        grpc.abort();
        http.abort();
        admin.abort();
    }
    // Background loops see the stop signal; membership leaves the member set.
    if tokio::time::timeout(Duration::from_secs(2), async {
        while tasks.join_next().await.is_some() {}
    })
    .await
    .is_err()
    {
        tasks.shutdown().await;
    }
    if let Some(redis) = redis {
        redis.quit().await;
    }
    tracing::info!("stopped");
    Ok(())
}

/// Connects to Redis without waiting for it, logs clearly whether it
/// answers, and registers this replica (a live duplicate id is fatal). The
/// caller runs the membership heartbeat (`engine.membership().run`).
pub async fn redis_engine(
    settings: &Settings,
    url: &str,
    replica_id: &str,
    boot: String,
) -> anyhow::Result<(Arc<RedisEngine>, Arc<Redis>)> {
    let redis = Arc::new(
        Redis::connect(&RedisConfig {
            url: url.to_owned(),
            pool_size: settings.redis_pool_size,
            deadline: Duration::from_millis(settings.redis_deadline_ms),
        })
        .map_err(anyhow::Error::msg)?,
    );
    match redis.ping(Duration::from_secs(2)).await {
        Ok(()) => tracing::info!(redis = %redis.display_url, "connected to Redis"),
        Err(e) => tracing::warn!(
            redis = %redis.display_url,
            error = %e,
            "Redis is not answering; serving anyway and reconnecting in the background"
        ),
    }
    let nonce = format!("{}-{boot}", std::process::id());
    let membership = Arc::new(Membership::new(
        redis.clone(),
        &settings.redis_prefix,
        replica_id.to_owned(),
        nonce,
        Duration::from_millis(settings.membership_heartbeat_ms),
        Duration::from_millis(settings.membership_ttl_ms),
    ));
    membership.register().await?;
    if let Some(index) = membership.index() {
        tracing::info!(replica_id, index, live = ?membership.state().live, "registered with Redis");
    }
    let engine = RedisEngine::new(
        redis.clone(),
        membership,
        settings.redis_prefix.clone(),
        settings.redis_expiry_margin_ms,
        boot,
        SystemClock.now_ms().saturating_mul(1_000),
    );
    Ok((Arc::new(engine), redis))
}

/// Accepted gRPC connections with TCP_NODELAY. A response leaves as several
/// small writes (headers, data, trailers); with Nagle's algorithm the last
/// one waits for the client's delayed ACK, 40 ms on Linux, which is longer
/// than Envoy's default RLS timeout. Serving a bound listener bypasses
/// tonic's own default, so it is set here.
fn accept_nodelay(listener: TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// The same for HTTP connections (`/json` answers decisions too).
fn set_nodelay(stream: &mut tokio::net::TcpStream) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(error = %e, "cannot set TCP_NODELAY on an HTTP connection");
    }
}

async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

fn hostname() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|s| s.trim().to_owned())
        })
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// Polls the rules paths; a changed fingerprint triggers a full load. A good
/// load is swapped in atomically; a bad one keeps the old rules and is
/// recorded for /rules.
async fn reload_loop(
    settings: Settings,
    handle: RulesHandle,
    status: Arc<ReloadStatus>,
    metrics: Arc<Metrics>,
    mut stop: watch::Receiver<bool>,
) {
    let mut seen = handle.load().hash.clone();
    let mut tick = tokio::time::interval(Duration::from_millis(settings.rules_poll_interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let paths = settings.rules.clone();
        let opts = settings.load_options();
        let fingerprint =
            match tokio::task::spawn_blocking(move || rules::fingerprint(&paths)).await {
                Ok(f) => f,
                Err(_) => continue,
            };
        if fingerprint == seen {
            continue;
        }
        seen = fingerprint;
        let paths = settings.rules.clone();
        let loaded = tokio::task::spawn_blocking(move || rules::load_paths(&paths, opts)).await;
        match loaded {
            Ok(Ok(set)) => {
                tracing::info!(hash = %set.hash, domains = set.domains.len(), "rules reloaded");
                seen = set.hash.clone();
                metrics.reload(true, &set.hash);
                handle.store(Arc::new(set));
                status.successes.fetch_add(1, Ordering::Relaxed);
                status
                    .loaded_at_ms
                    .store(SystemClock.now_ms(), Ordering::Relaxed);
                *status.last_error.lock() = None;
            }
            Ok(Err(errors)) => {
                tracing::error!(errors = %errors, "rules reload failed; keeping the previous rules");
                status.failures.fetch_add(1, Ordering::Relaxed);
                metrics.reload(false, "");
                *status.last_error.lock() = Some(errors.to_string());
            }
            Err(e) => tracing::error!(error = %e, "rules reload task failed"),
        }
    }
}

async fn sweep_loop(memory: Arc<MemoryEngine>, every: Duration, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let removed = memory.sweep(memory.clock().now_ms());
        if removed > 0 {
            tracing::debug!(removed, "expired counters dropped");
        }
    }
}
