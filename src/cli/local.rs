//! `leasehold local` (the runner: the compose topology as processes on
//! loopback), `leasehold demo failover` and `leasehold health` (the probe the
//! container image uses, as it has no shell or curl).

use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, Subcommand};

use crate::ops::demo::{self, FailoverOptions};
use crate::ops::deploy::{self, Layout};
use crate::ops::runner::{Binaries, Options, Ports, Topology};

#[derive(Args, Debug)]
pub struct LocalArgs {
    #[command(subcommand)]
    pub command: LocalCommand,
}

#[derive(Subcommand, Debug)]
pub enum LocalCommand {
    /// Start Redis, four replicas, the upstream, nginx and Envoy on loopback;
    /// stop them all on Ctrl-C or SIGTERM.
    Up(UpArgs),
    /// Render the deploy templates (envoy.yaml, nginx.conf, upstream.conf).
    Render(RenderArgs),
}

#[derive(Args, Debug, Clone)]
pub struct TopologyArgs {
    /// Run directory for configs, logs and Redis files.
    #[arg(long, default_value = "target/local")]
    pub dir: PathBuf,
    /// First of 13 consecutive ports (1024 or above); free ports when not given.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1024..=65000))]
    pub base_port: Option<u16>,
    /// The redis-server to run [default: from PATH].
    #[arg(long)]
    pub redis_bin: Option<PathBuf>,
    /// The envoy to run [default: from PATH].
    #[arg(long)]
    pub envoy_bin: Option<PathBuf>,
    /// The nginx to run [default: from PATH].
    #[arg(long)]
    pub nginx_bin: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct UpArgs {
    #[command(flatten)]
    pub topology: TopologyArgs,
}

#[derive(Args, Debug)]
pub struct RenderArgs {
    /// `compose` (service names) is the only fixed layout.
    #[arg(long, default_value = "compose")]
    pub target: String,
    /// Output directory.
    #[arg(long, default_value = "deploy/compose")]
    pub out: PathBuf,
}

#[derive(Args, Debug)]
pub struct DemoArgs {
    #[command(subcommand)]
    pub command: DemoCommand,
}

#[derive(Subcommand, Debug)]
pub enum DemoCommand {
    /// Load through Envoy and nginx, kill Redis, start it again, print the
    /// timeline and a verdict against docs/guarantees.md (G5).
    Failover(FailoverArgs),
}

#[derive(Args, Debug)]
pub struct FailoverArgs {
    #[command(flatten)]
    pub topology: TopologyArgs,
    /// Seconds of load before Redis is killed (at least 2).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(2..=600))]
    pub before: u64,
    /// Seconds Redis stays down (at least 4: detection and whole outage windows).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(4..=600))]
    pub outage: u64,
    /// Seconds of load after Redis is back (at least 5: replay, settling, windows on Redis).
    #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u64).range(5..=600))]
    pub after: u64,
    /// Write the chart here.
    #[arg(long, default_value = "target/failover.svg")]
    pub svg: PathBuf,
    /// Write the full report (timeline, checks) as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct HealthArgs {
    /// gRPC address of the replica.
    #[arg(long, default_value = "127.0.0.1:8081")]
    pub addr: String,
}

/// Starts the topology on `--base-port`, or on free ports (retried when one
/// is taken before it is bound).
async fn start(
    args: &TopologyArgs,
    replica_env: Vec<(String, String)>,
) -> anyhow::Result<Topology> {
    let bins = Binaries::find_with(
        std::env::current_exe()?,
        args.redis_bin.clone(),
        args.envoy_bin.clone(),
        args.nginx_bin.clone(),
    )?;
    let options = |ports: Ports| Options {
        bins: bins.clone(),
        dir: args.dir.clone(),
        ports,
        replica_env: replica_env.clone(),
        report: Arc::new(|line: &str| println!("{line}")),
    };
    match args.base_port {
        Some(b) => Topology::start(options(Ports::from_base(b)?)).await,
        None => Topology::start_on_free_ports(options).await,
    }
}

pub async fn local(args: LocalArgs) -> anyhow::Result<()> {
    match args.command {
        LocalCommand::Up(up) => {
            // Signals are caught from before the first process starts, so a
            // stop during startup still stops what was started.
            let mut stop = crate::app::Stop::new()?;
            let mut topo = tokio::select! {
                t = start(&up.topology, Vec::new()) => t?,
                _ = stop.wait() => anyhow::bail!("interrupted during startup"),
            };
            println!("\nall healthy; listening on:\n{}", topo.describe());
            println!("Ctrl-C (or SIGTERM) stops everything started above.");
            stop.wait().await;
            topo.stop().await;
            Ok(())
        }
        LocalCommand::Render(r) => {
            let layout = match r.target.as_str() {
                "compose" => Layout::compose(),
                other => anyhow::bail!("unknown --target {other:?} (expected: compose)"),
            };
            std::fs::create_dir_all(&r.out)?;
            for (name, text) in deploy::files(&layout)? {
                let path = r.out.join(name);
                std::fs::write(&path, text)?;
                println!("wrote {}", path.display());
            }
            Ok(())
        }
    }
}

pub async fn demo(args: DemoArgs) -> anyhow::Result<()> {
    let DemoCommand::Failover(f) = args.command;
    let mut stop = crate::app::Stop::new()?;
    // Keep every window of the run in Redis so the final comparison can
    // read them all.
    let env = vec![(
        "LEASEHOLD_REDIS_EXPIRY_MARGIN_MS".to_string(),
        "600000".to_string(),
    )];
    let mut topo = tokio::select! {
        t = start(&f.topology, env) => t?,
        _ = stop.wait() => anyhow::bail!("interrupted during startup"),
    };
    let opts = FailoverOptions {
        before_s: f.before,
        outage_s: f.outage,
        after_s: f.after,
        ..FailoverOptions::default()
    };
    let result = tokio::select! {
        r = demo::failover(&mut topo, &opts) => r,
        _ = stop.wait() => Err(anyhow::anyhow!("interrupted")),
    };
    topo.stop().await;
    let report = result?;
    println!("\n{}", demo::timeline(&report));
    if let Some(parent) = f.svg.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&f.svg, demo::svg(&report))?;
    println!("chart: {}", f.svg.display());
    if let Some(path) = &f.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
        println!("report: {}", path.display());
    }
    if report.pass {
        Ok(())
    } else {
        anyhow::bail!("the verdict failed")
    }
}

pub async fn health(args: HealthArgs) -> anyhow::Result<()> {
    let uri = super::query::endpoint_uri(&args.addr);
    if crate::ops::http_client::grpc_serving(&uri).await {
        println!("SERVING");
        Ok(())
    } else {
        anyhow::bail!("{} is not SERVING", args.addr)
    }
}
