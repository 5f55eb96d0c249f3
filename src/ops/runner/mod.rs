//! The local runner: the four-replica topology of compose.yaml (redis-server,
//! four leasehold replicas, the dummy upstream, the nginx gRPC balancer and
//! Envoy) as processes on loopback, configured from the same templates
//! ([`super::deploy`]). It owns exactly the processes it started and knows
//! them by pid, never by name: [`Topology::stop`] stops them in reverse
//! dependency order (SIGTERM, then SIGKILL after a grace period), also when a
//! start step fails; if a `Topology` (or a start in progress) is dropped
//! instead, say on a signal during startup, every child still running gets
//! SIGKILL by pid.

mod lifecycle;
mod setup;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};
use std::process::Command;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::ops::process::Process;

use super::deploy::{self, Layout, REPLICAS};

pub use setup::{Binaries, Ports, ReplicaPorts};

/// How to start the topology.
pub struct Options {
    pub bins: Binaries,
    /// Configs, logs and Redis files go here.
    pub dir: PathBuf,
    pub ports: Ports,
    /// Extra LEASEHOLD_* settings for every replica.
    pub replica_env: Vec<(String, String)>,
    /// Progress lines ("started redis pid 42 on 127.0.0.1:6379").
    pub report: Arc<dyn Fn(&str) + Send + Sync>,
}

/// One started process.
struct Component {
    name: String,
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    log: PathBuf,
    child: Option<Process>,
}

impl Component {
    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Process::pid)
    }
}

/// A running topology. Dropping it kills whatever is still running.
pub struct Topology {
    pub ports: Ports,
    pub layout: Layout,
    pub dir: PathBuf,
    report: Arc<dyn Fn(&str) + Send + Sync>,
    components: Vec<Component>,
    http: crate::ops::http_client::HttpClient,
}

/// The component names, in start order.
pub const REDIS: &str = "redis";
pub const UPSTREAM: &str = "upstream";
pub const NGINX: &str = "nginx";
pub const ENVOY: &str = "envoy";

/// The name of replica `i` (1-based), also its replica id.
pub fn replica_name(i: usize) -> String {
    format!("leasehold-{i}")
}

const START_LIMIT: Duration = Duration::from_secs(30);
const STOP_GRACE: Duration = Duration::from_secs(5);

impl Topology {
    /// [`Topology::start`] on ports that were free a moment ago. Between
    /// choosing them and binding them, another process (or one of the
    /// topology's own outgoing connections) can take one; then the start is
    /// retried on fresh ports, up to three times.
    pub async fn start_on_free_ports(make: impl Fn(Ports) -> Options) -> anyhow::Result<Topology> {
        let mut attempt = 1;
        loop {
            match Topology::start(make(Ports::free()?)).await {
                Err(e) if attempt < 3 && format!("{e:#}").contains("in use") => {
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    /// Writes the configs, starts every component in dependency order and
    /// waits until each is healthy. On any failure everything started so far
    /// is stopped before the error is returned.
    pub async fn start(opts: Options) -> anyhow::Result<Topology> {
        std::fs::create_dir_all(&opts.dir)
            .with_context(|| format!("creating {}", opts.dir.display()))?;
        let dir = std::fs::canonicalize(&opts.dir)?;
        let layout = opts.ports.layout(&dir);
        for (name, text) in deploy::files(&layout)? {
            std::fs::write(dir.join(name), text)?;
        }
        let rules_dir = dir.join("rules");
        std::fs::create_dir_all(&rules_dir)?;
        std::fs::write(rules_dir.join("edge.yaml"), deploy::TOPOLOGY_RULES)?;
        std::fs::write(dir.join("leasehold.toml"), deploy::TOPOLOGY_SETTINGS)?;
        std::fs::create_dir_all(dir.join("redis"))?;

        let mut topo = Topology {
            ports: opts.ports.clone(),
            layout,
            dir: dir.clone(),
            report: opts.report.clone(),
            components: Vec::new(),
            http: crate::ops::http_client::HttpClient::new(),
        };
        let result = topo.start_all(&opts, &rules_dir).await;
        match result {
            Ok(()) => Ok(topo),
            Err(e) => {
                (topo.report)(&format!("start failed: {e:#}; stopping what was started"));
                topo.stop().await;
                Err(e)
            }
        }
    }

    async fn start_all(&mut self, opts: &Options, rules_dir: &Path) -> anyhow::Result<()> {
        let dir = self.dir.clone();
        let p = &opts.ports;
        let b = &opts.bins;
        self.add(
            REDIS,
            &b.redis_server,
            vec![
                "--port".into(),
                p.redis.to_string(),
                "--bind".into(),
                "127.0.0.1".into(),
                "--save".into(),
                String::new(),
                "--appendonly".into(),
                "no".into(),
                // As compose.yaml: an expiry cycle of at most 2.5 ms.
                "--hz".into(),
                "100".into(),
                "--dir".into(),
                dir.join("redis").display().to_string(),
            ],
            vec![],
        );
        self.launch(REDIS).await?;
        for (i, r) in p.replicas.iter().enumerate() {
            let name = replica_name(i + 1);
            let mut env = vec![
                (
                    "LEASEHOLD_SETTINGS".to_string(),
                    dir.join("leasehold.toml").display().to_string(),
                ),
                ("LEASEHOLD_REPLICA_ID".into(), name.clone()),
                (
                    "LEASEHOLD_REDIS_URL".into(),
                    format!("redis://127.0.0.1:{}", p.redis),
                ),
                ("LEASEHOLD_RULES".into(), rules_dir.display().to_string()),
                (
                    "LEASEHOLD_GRPC_ADDR".into(),
                    format!("127.0.0.1:{}", r.grpc),
                ),
                (
                    "LEASEHOLD_HTTP_ADDR".into(),
                    format!("127.0.0.1:{}", r.http),
                ),
                // Set explicitly: every replica needs its own.
                (
                    "LEASEHOLD_ADMIN_ADDR".into(),
                    format!("127.0.0.1:{}", r.admin),
                ),
            ];
            env.extend(opts.replica_env.iter().cloned());
            self.add(&name, &b.leasehold, vec!["serve".into()], env);
        }
        for i in 1..=REPLICAS {
            self.launch(&replica_name(i)).await?;
        }
        let nginx_args = |conf: &str| {
            vec![
                "-p".into(),
                dir.display().to_string(),
                "-c".into(),
                dir.join(conf).display().to_string(),
                "-e".into(),
                "stderr".into(),
                "-g".into(),
                // One process per nginx, so the pid the runner holds is all
                // there is to stop.
                "daemon off; master_process off;".into(),
            ]
        };
        self.add(UPSTREAM, &b.nginx, nginx_args("upstream.conf"), vec![]);
        self.launch(UPSTREAM).await?;
        self.add(NGINX, &b.nginx, nginx_args("nginx.conf"), vec![]);
        self.launch(NGINX).await?;
        self.add(
            ENVOY,
            &b.envoy,
            vec![
                "-c".into(),
                dir.join("envoy.yaml").display().to_string(),
                "--disable-hot-restart".into(),
                "--log-level".into(),
                "warn".into(),
            ],
            vec![],
        );
        self.launch(ENVOY).await?;
        Ok(())
    }

    fn add(&mut self, name: &str, program: &Path, args: Vec<String>, env: Vec<(String, String)>) {
        self.components.push(Component {
            name: name.to_string(),
            program: program.to_path_buf(),
            args,
            env,
            log: self.dir.join(format!("{name}.log")),
            child: None,
        });
    }

    fn component(&mut self, name: &str) -> anyhow::Result<&mut Component> {
        self.components
            .iter_mut()
            .find(|c| c.name == name)
            .ok_or_else(|| anyhow!("no component {name}"))
    }

    /// Starts (or starts again) a component and waits until it is healthy.
    pub async fn launch(&mut self, name: &str) -> anyhow::Result<()> {
        let c = self.component(name)?;
        if c.child.is_some() {
            bail!("{name} is already running");
        }
        let mut cmd = Command::new(&c.program);
        cmd.args(&c.args).envs(c.env.iter().cloned());
        let child = Process::spawn(name, &mut cmd, &c.log)?;
        let pid = child.pid();
        c.child = Some(child);
        let msg = format!("started {name:<12} pid {pid:<7} log {}", c.log.display());
        (self.report)(&msg);
        let deadline = Instant::now() + START_LIMIT;
        loop {
            if let Some(status) = self.exited(name)? {
                bail!(
                    "{name} exited during startup ({status}); last log lines:\n{}",
                    self.log_tail(name, 15)
                );
            }
            if self.healthy(name).await {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "{name} did not become healthy within {}s; last log lines:\n{}",
                    START_LIMIT.as_secs(),
                    self.log_tail(name, 15)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn exited(&mut self, name: &str) -> anyhow::Result<Option<std::process::ExitStatus>> {
        let c = self.component(name)?;
        match c.child.as_mut() {
            Some(child) => {
                let status = child.try_wait();
                if status.is_some() {
                    c.child = None;
                }
                Ok(status)
            }
            None => Ok(None),
        }
    }
}

fn replica_index(name: &str) -> Option<usize> {
    let i: usize = name.strip_prefix("leasehold-")?.parse().ok()?;
    (1..=REPLICAS).contains(&i).then_some(i - 1)
}

/// Redis answers PING.
async fn redis_ping(port: u16) -> bool {
    let attempt = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(b"PING\r\n").await?;
        let mut buf = [0u8; 16];
        let n = s.read(&mut buf).await?;
        Ok::<bool, std::io::Error>(buf[..n].starts_with(b"+PONG"))
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(1), attempt).await,
        Ok(Ok(true))
    )
}
