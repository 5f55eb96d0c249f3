//! What the runner starts and where: the programs (found on PATH or given)
//! and the loopback ports of every listener.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail};

use crate::ops::deploy::{Endpoint, Layout, REPLICAS};

/// The programs the runner starts.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub leasehold: PathBuf,
    pub redis_server: PathBuf,
    pub envoy: PathBuf,
    pub nginx: PathBuf,
}

impl Binaries {
    /// `leasehold` as given; the others as given or else from PATH, with a
    /// clear error naming the missing program and where it comes from.
    pub fn find_with(
        leasehold: PathBuf,
        redis_server: Option<PathBuf>,
        envoy: Option<PathBuf>,
        nginx: Option<PathBuf>,
    ) -> anyhow::Result<Binaries> {
        let find = |given: Option<PathBuf>, name: &str| match given {
            Some(p) => Ok(p),
            None => crate::ops::process::find_program(name),
        };
        Ok(Binaries {
            leasehold,
            redis_server: find(redis_server, "redis-server")?,
            envoy: find(envoy, "envoy")?,
            nginx: find(nginx, "nginx")?,
        })
    }
}

/// One replica's listeners.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaPorts {
    pub grpc: u16,
    pub http: u16,
    /// The admin pages (/status, /status.html, /rules).
    pub admin: u16,
}

/// Ports on loopback, one per listener.
#[derive(Debug, Clone)]
pub struct Ports {
    pub redis: u16,
    pub replicas: Vec<ReplicaPorts>,
    pub upstream: u16,
    pub envoy: u16,
    pub envoy_admin: u16,
    pub nginx: u16,
}

impl Ports {
    /// Consecutive ports from `base`: Redis, upstream, Envoy, Envoy admin,
    /// nginx, then (gRPC, HTTP, admin) per replica.
    pub fn from_base(base: u16) -> anyhow::Result<Ports> {
        if base < 1024 {
            bail!(
                "base port {base}: use 1024 or above (port 0 would disable Redis's TCP listener)"
            );
        }
        base.checked_add(5 + 3 * REPLICAS as u16)
            .ok_or_else(|| anyhow!("base port {base} leaves no room for the topology"))?;
        Ok(Ports {
            redis: base,
            upstream: base + 1,
            envoy: base + 2,
            envoy_admin: base + 3,
            nginx: base + 4,
            replicas: (0..REPLICAS as u16)
                .map(|i| ReplicaPorts {
                    grpc: base + 5 + 3 * i,
                    http: base + 6 + 3 * i,
                    admin: base + 7 + 3 * i,
                })
                .collect(),
        })
    }

    /// Ports the kernel reports free right now.
    pub fn free() -> anyhow::Result<Ports> {
        let mut held = Vec::new();
        let mut next = || -> anyhow::Result<u16> {
            let l = std::net::TcpListener::bind("127.0.0.1:0")?;
            let port = l.local_addr()?.port();
            held.push(l);
            Ok(port)
        };
        Ok(Ports {
            redis: next()?,
            upstream: next()?,
            envoy: next()?,
            envoy_admin: next()?,
            nginx: next()?,
            replicas: (0..REPLICAS)
                .map(|_| {
                    Ok(ReplicaPorts {
                        grpc: next()?,
                        http: next()?,
                        admin: next()?,
                    })
                })
                .collect::<anyhow::Result<_>>()?,
        })
    }

    /// The deploy layout these ports give on loopback.
    pub fn layout(&self, run_dir: &Path) -> Layout {
        let lo = |port| Endpoint::new("127.0.0.1", port);
        Layout {
            domain: "edge".into(),
            replicas: self.replicas.iter().map(|r| lo(r.grpc)).collect(),
            upstream: lo(self.upstream),
            upstream_listen: lo(self.upstream),
            envoy_listen: lo(self.envoy),
            envoy_admin: lo(self.envoy_admin),
            nginx_listen: lo(self.nginx),
            nginx_run_dir: run_dir.display().to_string(),
        }
    }
}
