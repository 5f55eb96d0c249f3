//! The composition root: settings and rules are validated before any port
//! is bound ([`prepare`]); [`run`] builds the engine (`engine`), the
//! decision layer and the servers (`serve`), runs the background loops
//! (`loops`) under one stop signal, and shuts down in order
//! (`shutdown`). Signal handling for every long-running command lives in
//! [`signals`].

mod engine;
mod loops;
mod serve;
mod shutdown;
pub mod signals;
mod supervise;

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use arc_swap::ArcSwap;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::clock::{Clock, SystemClock};
use crate::decision::{Limiter, RulesHandle};
use crate::engine::MemoryEngine;
use crate::http::{Health, HttpState};
use crate::metrics::Metrics;
use crate::rules::{self, ReloadStatus, RuleErrors, RuleSet};
use crate::settings::Settings;

pub use engine::redis_engine;
pub use signals::{stop_signal, Stop};

/// Everything that can fail before a port is bound: settings and rules.
pub struct Prepared {
    pub settings: Settings,
    pub rules: RuleSet,
    /// TLS on the gRPC port, its files loaded.
    pub grpc_tls: Option<Arc<crate::grpc::tls::Reloading>>,
}

/// Validates settings and loads the rules; errors here mean "exit non-zero
/// without binding anything".
pub fn prepare(settings: Settings) -> anyhow::Result<Prepared> {
    settings.validate()?;
    let rules = rules::load_paths(&settings.rules, settings.load_options())
        .map_err(|e: RuleErrors| anyhow::anyhow!("invalid rules:\n{e}"))?;
    let grpc_tls = match settings.grpc_tls() {
        Some(files) => Some(crate::grpc::tls::Reloading::new(files).map_err(anyhow::Error::msg)?),
        None => None,
    };
    Ok(Prepared {
        settings,
        rules,
        grpc_tls,
    })
}

/// Runs the server on already-bound listeners until `shutdown` resolves.
pub async fn run(
    prepared: Prepared,
    grpc_listener: TcpListener,
    http_listener: TcpListener,
    admin_listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let Prepared {
        settings,
        rules,
        grpc_tls,
    } = prepared;
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
        Metrics::new(settings.metrics_detailed_max_series)
            .context("registering metrics")?
            .with_redaction(settings.redact_values),
    );
    let memory = Arc::new(MemoryEngine::with_max_bytes(
        Arc::new(SystemClock),
        settings.memory_max_bytes,
    ));
    let built = engine::build(&settings, &replica_id, memory.clone(), &metrics).await?;

    let reload = Arc::new(ReloadStatus::default());
    reload
        .loaded_at_ms
        .store(SystemClock.now_ms(), Ordering::Relaxed);
    reload.successes.fetch_add(1, Ordering::Relaxed);
    tracing::info!(hash = %rules.hash, files = rules.files.len(), domains = rules.domains.len(), "rules loaded");
    metrics.reload(true, &rules.hash);
    let handle: RulesHandle = Arc::new(ArcSwap::from_pointee(rules));
    let engine = built.engine.clone();
    let limiter = Arc::new(
        Limiter::new(handle.clone(), built.engine, settings.decision())
            .with_metrics(metrics.clone()),
    );
    let health = Arc::new(Health::default());
    health.set_rules_loaded();
    tasks.spawn(supervise::supervised(
        "rules reload",
        loops::reload(
            settings.clone(),
            handle,
            engine,
            reload.clone(),
            metrics,
            stop_rx.clone(),
        ),
    ));
    tasks.spawn(supervise::supervised(
        "expiry sweep",
        loops::sweep(
            memory,
            Duration::from_millis(settings.sweep_interval_ms),
            stop_rx.clone(),
        ),
    ));

    let state = HttpState {
        limiter: limiter.clone(),
        bounds: settings.bounds(),
        max_body_bytes: settings.max_request_bytes,
        allow_adjustments: settings.json_allow_adjustments,
        health: health.clone(),
        reload,
        replica_id,
        redact: settings.redact_values,
    };
    if let Some(tls) = &grpc_tls {
        tasks.spawn(supervise::supervised(
            "TLS certificate reload",
            tls.clone().watch(Duration::from_secs(1), stop_rx.clone()),
        ));
    }
    let listeners = serve::Listeners {
        grpc: grpc_listener,
        http: http_listener,
        admin: admin_listener,
        grpc_tls,
    };
    let mut servers = serve::start(&settings, limiter, state, listeners, &stop_rx).await?;
    let mut redis_loops = built.loops;
    // Every task is watched: one that ends (or panics) before the stop
    // signal leaves the replica unable to keep its promises, so it stops
    // in order and exits non-zero.
    let failure = tokio::select! {
        () = shutdown => None,
        r = &mut servers.grpc => anyhow::bail!("gRPC server stopped unexpectedly: {r:?}"),
        r = &mut servers.http => anyhow::bail!("HTTP server stopped unexpectedly: {r:?}"),
        r = &mut servers.admin => anyhow::bail!("admin HTTP server stopped unexpectedly: {r:?}"),
        Some(r) = tasks.join_next() => Some(match r {
            Ok(outcome) => supervise::describe(&outcome),
            Err(e) => format!("a background task failed: {e}"),
        }),
        outcome = async {
            match redis_loops.as_mut() {
                Some(loops) => loops.ended().await,
                None => std::future::pending().await,
            }
        } => Some(supervise::describe(&outcome)),
    };
    if let Some(failure) = &failure {
        tracing::error!(%failure, "stopping: reporting NOT_SERVING, then exiting non-zero");
    }
    let background = shutdown::Background {
        tasks,
        redis_loops,
        redis: built.redis,
    };
    shutdown::in_order(&settings, servers, &health, stop_tx, background).await;
    match failure {
        Some(failure) => anyhow::bail!("{failure}"),
        None => Ok(()),
    }
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
