//! The `leasehold` binary: parse the command line, load and validate settings
//! and rules before binding any port, set up logging, run, map the outcome to
//! an exit code.

use std::process::ExitCode;

use clap::Parser;
use leasehold::cli::{self, Cli, Command};
use tokio::net::TcpListener;

/// A unary call allocates and frees dozens of small buffers (HTTP/2
/// frames, protobuf messages, Redis replies) across threads; glibc's
/// allocator spent about a tenth of a Redis-path call's CPU on them
/// (`perf`). With jemalloc the call took 27 µs of CPU instead of 31–33,
/// for about 8% more peak RSS (mimalloc: 28 µs, 20–60% more RSS).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let serving = matches!(cli.command, Command::Serve(_));
    let mut builder = match (serving, std::env::var_os("TOKIO_WORKER_THREADS")) {
        (true, None) if engine_threads() == 1 => tokio::runtime::Builder::new_current_thread(),
        (true, None) => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(engine_threads());
            b
        }
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Serve(args) => serve(args).await,
            Command::Check(args) => check(args),
            Command::Query(args) => cli::query::run(args).await,
            Command::Bench(args) => leasehold::ops::bench::run(args).await,
            Command::Local(args) => cli::local::local(args).await,
            Command::Demo(args) => cli::local::demo(args).await,
            Command::Health(args) => cli::local::health(args).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The serving runtime's threads, when `serve` runs: gRPC has threads of
/// its own (`grpc_threads`), so this runtime only carries the Redis
/// connections, the engine's calls and the background loops. One thread
/// per four CPUs, at least one: on two cores a second thread here was
/// measured to double the context switches of a Redis-path call and cost
/// 5–8% of its throughput, its tasks waking each other across threads.
/// One thread means a single-threaded runtime, which then also serves the
/// first share of the gRPC connections ([`leasehold::grpc::threads`]):
/// their Redis calls never leave the thread, measured on two cores as 10%
/// more Redis-path decisions per second at 13% less CPU each.
/// `TOKIO_WORKER_THREADS` overrides it (and keeps a work-stealing runtime).
fn engine_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 4).max(1))
}

fn check(args: cli::CheckArgs) -> anyhow::Result<()> {
    let opts = leasehold::rules::LoadOptions {
        merge_domains: args.merge_domains,
    };
    match leasehold::rules::load_paths(&args.paths, opts) {
        Ok(set) => {
            let rules: usize = set.domains.values().map(|d| d.rules.len()).sum();
            println!(
                "ok: {} file(s), {} domain(s), {} rule(s), hash {}",
                set.files.len(),
                set.domains.len(),
                rules,
                set.hash
            );
            Ok(())
        }
        Err(errors) => anyhow::bail!("invalid rules:\n{errors}"),
    }
}

async fn serve(args: cli::ServeArgs) -> anyhow::Result<()> {
    // Before any startup work: a SIGTERM while rules load or Redis is
    // first reached is held and acted on (an orderly stop once startup is
    // done, bounded), instead of killing the process mid-way.
    let mut stop = leasehold::app::Stop::new()
        .map_err(|e| anyhow::anyhow!("cannot install signal handlers: {e}"))?;
    let settings = args.settings(std::env::vars())?;
    // Settings errors (an endpoint without a scheme, say) read as settings
    // errors, before logging or tracing is set up from them.
    settings.validate()?;
    let telemetry = leasehold::telemetry::init(
        &settings.log_level,
        &settings.log_format,
        settings.otlp_endpoint.as_deref(),
        &settings.otlp_service_name,
    )?;
    for key in leasehold::settings::ignored_service_links(std::env::vars()) {
        tracing::warn!(%key, "ignoring a Kubernetes service-link variable (not a setting)");
    }
    let result = async {
        let prepared = leasehold::app::prepare(settings)?;
        let grpc = TcpListener::bind(prepared.settings.grpc_addr).await?;
        let http = TcpListener::bind(prepared.settings.http_addr).await?;
        let addr = prepared.settings.admin_addr;
        let admin = TcpListener::bind(addr)
            .await
            .map_err(|e| anyhow::anyhow!("binding admin_addr {addr}: {e}"))?;
        tracing::info!(grpc = %grpc.local_addr()?, http = %http.local_addr()?, admin = %admin.local_addr()?, "listening");
        leasehold::app::run(prepared, grpc, http, admin, async move { stop.wait().await }).await
    }
    .await;
    telemetry.shutdown().await;
    result
}
