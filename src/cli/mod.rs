//! The command line: `serve`, `check`, `query`, `bench`, `local`, `demo` and
//! `health`. Parsing and flag precedence live here; the server itself is
//! [`crate::app`], the ops tooling [`crate::ops`].

pub mod local;
pub mod query;

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::settings::Settings;

#[derive(Parser, Debug)]
#[command(
    name = "leasehold",
    version,
    about = "Envoy RLS v3 rate-limit server that keeps limiting when Redis fails"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Serve RateLimitService (gRPC) and the HTTP endpoints.
    Serve(ServeArgs),
    /// Validate rules files or directories; exit non-zero with the errors.
    Check(CheckArgs),
    /// Make one ShouldRateLimit call and print the decision.
    Query(query::QueryArgs),
    /// Closed-loop load generator against a running server.
    Bench(crate::ops::bench::BenchArgs),
    /// The four-replica topology as processes on loopback (no Docker needed).
    Local(local::LocalArgs),
    /// Demonstrations on the local topology.
    Demo(local::DemoArgs),
    /// Exit 0 when the replica at --addr reports gRPC SERVING (container health check).
    Health(local::HealthArgs),
}

#[derive(Args, Debug, Default)]
pub struct ServeArgs {
    /// Rules file or directory (repeatable). LEASEHOLD_RULES takes a comma-separated list.
    #[arg(long = "rules", value_name = "PATH")]
    pub rules: Vec<PathBuf>,
    /// gRPC listen address [default: 0.0.0.0:8081].
    #[arg(long, value_name = "ADDR")]
    pub grpc_addr: Option<SocketAddr>,
    /// HTTP listen address [default: 0.0.0.0:8080].
    #[arg(long, value_name = "ADDR")]
    pub http_addr: Option<SocketAddr>,
    /// Settings file (TOML or YAML); LEASEHOLD_* variables and flags override it.
    #[arg(long, value_name = "FILE", env = "LEASEHOLD_SETTINGS")]
    pub settings: Option<PathBuf>,
    /// Global shadow mode: count everything, always answer OK overall.
    #[arg(long)]
    pub shadow_mode: bool,
    /// Add RateLimit-Limit/-Remaining/-Reset headers to responses.
    #[arg(long)]
    pub response_headers: bool,
    /// Merge rules files that declare the same domain.
    #[arg(long)]
    pub merge_domains: bool,
    /// Count in Redis: redis://[user:password@]host:port[/db] or rediss://.
    #[arg(long, value_name = "URL")]
    pub redis_url: Option<String>,
    /// This replica's id [default: hostname:grpc-port].
    #[arg(long, value_name = "ID")]
    pub replica_id: Option<String>,
    /// Log filter, e.g. info or leasehold=debug.
    #[arg(long, value_name = "FILTER")]
    pub log_level: Option<String>,
    /// Log format: text or json.
    #[arg(long, value_name = "FORMAT")]
    pub log_format: Option<String>,
    /// The admin listener (/status, /status.html, /rules) [default: 127.0.0.1:8082].
    #[arg(long, value_name = "ADDR")]
    pub admin_addr: Option<SocketAddr>,
    /// Redact descriptor values on /status, /status.html and /rules.
    #[arg(long)]
    pub redact_values: bool,
    /// TLS on the gRPC port: certificate chain (PEM), reloaded when it changes.
    #[arg(long, value_name = "FILE")]
    pub grpc_tls_cert: Option<PathBuf>,
    /// TLS on the gRPC port: private key (PEM).
    #[arg(long, value_name = "FILE")]
    pub grpc_tls_key: Option<PathBuf>,
    /// Mutual TLS: require client certificates signed by these CAs (PEM).
    #[arg(long, value_name = "FILE")]
    pub grpc_tls_client_ca: Option<PathBuf>,
    /// Export traces over OTLP/gRPC to this endpoint (http://host:4317).
    #[arg(long, value_name = "URL")]
    pub otlp_endpoint: Option<String>,
}

impl ServeArgs {
    /// Settings with flags applied last (flags win).
    pub fn settings(
        &self,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> anyhow::Result<Settings> {
        let mut s = Settings::load(self.settings.as_deref(), env)?;
        if !self.rules.is_empty() {
            s.rules = self.rules.clone();
        }
        if let Some(a) = self.grpc_addr {
            s.grpc_addr = a;
        }
        if let Some(a) = self.http_addr {
            s.http_addr = a;
        }
        if let Some(u) = &self.redis_url {
            s.redis_url = Some(u.clone());
        }
        if let Some(id) = &self.replica_id {
            s.replica_id = Some(id.clone());
        }
        s.shadow_mode |= self.shadow_mode;
        s.response_headers |= self.response_headers;
        s.merge_domains |= self.merge_domains;
        if let Some(l) = &self.log_level {
            s.log_level = l.clone();
        }
        if let Some(f) = &self.log_format {
            s.log_format = f.clone();
        }
        if let Some(a) = self.admin_addr {
            s.admin_addr = a;
        }
        s.redact_values |= self.redact_values;
        if let Some(e) = &self.otlp_endpoint {
            s.otlp_endpoint = Some(e.clone());
        }
        for (flag, setting) in [
            (&self.grpc_tls_cert, &mut s.grpc_tls_cert),
            (&self.grpc_tls_key, &mut s.grpc_tls_key),
            (&self.grpc_tls_client_ca, &mut s.grpc_tls_client_ca),
        ] {
            if let Some(path) = flag {
                *setting = Some(path.clone());
            }
        }
        Ok(s)
    }
}

#[derive(Args, Debug)]
pub struct CheckArgs {
    /// Rules files or directories.
    #[arg(required = true, value_name = "PATH")]
    pub paths: Vec<PathBuf>,
    /// Merge files that declare the same domain.
    #[arg(long)]
    pub merge_domains: bool,
}
