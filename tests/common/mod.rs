//! Shared test support on top of the ops tooling's own helpers
//! (`leasehold::ops::process` for processes owned by pid and programs on
//! PATH, `leasehold::ops::http_client` for HTTP): required commands fail
//! loudly, a leasehold server started from the built binary, a real
//! redis-server on a free port, and request builders.
#![allow(dead_code)]

pub mod cluster;
pub mod netns;
pub mod proxy;
pub mod sentinel;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use leasehold::ops::http_client::{blocking_request, HttpReply};
pub use leasehold::ops::process::Process as Proc;
use leasehold::proto::common::rate_limit_descriptor::Entry;
use leasehold::proto::common::RateLimitDescriptor;
use leasehold::proto::rls::RateLimitRequest;

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    leasehold::ops::process::free_port().expect("bind a free loopback port")
}

/// `N` distinct loopback ports that were free a moment ago: each is held
/// until all are chosen, so two of them can never be the same.
pub fn free_ports<const N: usize>() -> [u16; N] {
    let held: Vec<std::net::TcpListener> = (0..N)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free loopback port"))
        .collect();
    std::array::from_fn(|i| held[i].local_addr().expect("local addr").port())
}

/// Path of an external command the test needs; panics with the install hint
/// when it is missing, so a test never skips silently.
pub fn require(cmd: &str) -> PathBuf {
    leasehold::ops::process::find_program(cmd).unwrap_or_else(|e| {
        panic!("{e}: run the README's test command (tests/run.sh), which installs it")
    })
}

/// Starts `cmd` as `name`, its output in `<log_dir>/<name>.log`; the
/// process is killed by pid when the returned value drops.
pub fn spawn(name: &str, cmd: &mut Command, log_dir: &Path) -> Proc {
    Proc::spawn(name, cmd, &log_dir.join(format!("{name}.log")))
        .unwrap_or_else(|e| panic!("spawn {name}: {e:#}"))
}

/// Polls `check` every 50 ms until it returns true or `limit` passes.
pub fn wait_until(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

pub type HttpResponse = HttpReply;

/// One HTTP/1.1 request, bounded by 10 s.
pub fn http(
    method: &str,
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> std::io::Result<HttpResponse> {
    let url = format!("http://{addr}{path}");
    blocking_request(method, &url, headers, body, Duration::from_secs(10))
        .map_err(|e| std::io::Error::other(format!("{e:#}")))
}

pub fn get(addr: SocketAddr, path: &str) -> std::io::Result<HttpResponse> {
    http("GET", addr, path, &[], "")
}

/// A leasehold server process on free loopback ports.
pub struct Leasehold {
    pub proc: Proc,
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    /// The admin listener (/status, /status.html, /rules).
    pub admin: SocketAddr,
}

pub fn leasehold_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_leasehold"))
}

impl Leasehold {
    /// Starts `leasehold serve` and waits until /readyz answers 200.
    pub fn start(
        name: &str,
        rules: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
        log_dir: &Path,
    ) -> Leasehold {
        // Distinct ports: two listeners on one port is a settings error.
        let [grpc_port, http_port, admin_port] = free_ports();
        let grpc: SocketAddr = format!("127.0.0.1:{grpc_port}").parse().expect("addr");
        let http: SocketAddr = format!("127.0.0.1:{http_port}").parse().expect("addr");
        // A free admin port, unless the caller chose one.
        let chosen = extra.iter().position(|a| *a == "--admin-addr");
        let admin: SocketAddr = match chosen {
            Some(i) => extra[i + 1].parse().expect("admin addr"),
            None => format!("127.0.0.1:{admin_port}").parse().expect("addr"),
        };
        let mut cmd = Command::new(leasehold_bin());
        cmd.arg("serve")
            .arg("--rules")
            .arg(rules)
            .arg("--grpc-addr")
            .arg(grpc.to_string())
            .arg("--http-addr")
            .arg(http.to_string())
            .args(extra)
            .env("LEASEHOLD_RULES_POLL_INTERVAL_MS", "200");
        if chosen.is_none() {
            cmd.arg("--admin-addr").arg(admin.to_string());
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut proc = spawn(name, &mut cmd, log_dir);
        let ready = wait_until(Duration::from_secs(20), || {
            if let Some(status) = proc.try_wait() {
                panic!("{name} exited early ({status}):\n{}", proc.log_text());
            }
            get(http, "/readyz")
                .map(|r| r.status == 200)
                .unwrap_or(false)
        });
        assert!(ready, "{name} did not become ready:\n{}", proc.log_text());
        Leasehold {
            proc,
            grpc,
            http,
            admin,
        }
    }

    /// /status, parsed (null when it cannot be read).
    pub fn status(&self) -> serde_json::Value {
        get(self.admin, "/status")
            .ok()
            .and_then(|r| serde_json::from_str(&r.body).ok())
            .unwrap_or_default()
    }

    pub fn grpc_uri(&self) -> String {
        format!("http://{}", self.grpc)
    }
}

/// Writes one rules file, `<dir>/rules/<file>`, and returns the rules
/// directory to pass to `--rules`.
pub fn write_rules(dir: &Path, file: &str, text: &str) -> PathBuf {
    let rules = dir.join("rules");
    std::fs::create_dir_all(&rules).expect("mkdir rules");
    std::fs::write(rules.join(file), text).expect("write rules");
    rules
}

/// Wall-clock milliseconds since the epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Waits until at least `need_ms` remain in the current `unit_ms` window,
/// so a counting run never straddles two windows.
pub async fn wait_for_room(unit_ms: u64, need_ms: u64) {
    let into = now_ms() % unit_ms;
    if unit_ms - into < need_ms {
        tokio::time::sleep(Duration::from_millis(unit_ms - into + 50)).await;
    }
}

/// A directory for logs and configs that survives for inspection when the
/// test fails (under target/), removed on success by the caller if wanted.
pub fn test_dir(name: &str) -> PathBuf {
    let dir =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create test dir");
    dir
}

/// A real redis-server on a free loopback port, without persistence,
/// killed by pid when dropped.
pub struct RedisServer {
    pub proc: Proc,
    pub port: u16,
    pub dir: PathBuf,
    extra: Vec<String>,
    /// The address it listens on, and the network namespace it runs in.
    host: String,
    netns: Option<String>,
}

impl RedisServer {
    pub fn start(name: &str, dir: &Path) -> RedisServer {
        Self::start_with(name, dir, &[])
    }

    pub fn start_with(name: &str, dir: &Path, extra: &[&str]) -> RedisServer {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        Self::launch(name, dir, free_port(), extra, "127.0.0.1".into(), None)
    }

    /// A redis-server inside the test's network namespace, on its veth
    /// address (the namespace is fresh, so any port is free there).
    pub fn start_in(name: &str, dir: &Path, ns: &netns::Netns) -> RedisServer {
        Self::launch(
            name,
            dir,
            6379,
            Vec::new(),
            ns.addr.clone(),
            Some(ns.name.clone()),
        )
    }

    fn launch(
        name: &str,
        dir: &Path,
        port: u16,
        extra: Vec<String>,
        host: String,
        netns: Option<String>,
    ) -> RedisServer {
        let proc = Self::spawn(name, dir, port, &extra, &host, netns.as_deref());
        let server = RedisServer {
            proc,
            port,
            dir: dir.to_path_buf(),
            extra,
            host,
            netns,
        };
        server.wait_ready();
        server
    }

    fn spawn(
        name: &str,
        dir: &Path,
        port: u16,
        extra: &[String],
        host: &str,
        netns: Option<&str>,
    ) -> Proc {
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new(require("ip"));
                c.args(["netns", "exec", ns]).arg(require("redis-server"));
                // Reached over the veth pair, not loopback: protected mode
                // would refuse the host's connections.
                c.args(["--protected-mode", "no"]);
                c
            }
            None => Command::new(require("redis-server")),
        };
        cmd.args([
            "--port",
            &port.to_string(),
            "--bind",
            host,
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .arg("--dir")
        .arg(dir)
        .args(extra);
        spawn(name, &mut cmd, dir)
    }

    fn wait_ready(&self) {
        let ok = wait_until(Duration::from_secs(10), || {
            self.cli(&["PING"]).trim() == "PONG"
        });
        assert!(
            ok,
            "redis-server did not answer PING:\n{}",
            self.proc.log_text()
        );
    }

    pub fn url(&self) -> String {
        format!("redis://{}:{}", self.host, self.port)
    }

    /// Runs redis-cli against this server and returns stdout.
    pub fn cli(&self, args: &[&str]) -> String {
        let mut cmd = Command::new(require("redis-cli"));
        cmd.args(["-h", &self.host, "-p", &self.port.to_string()]);
        if let Some(pos) = self.extra.iter().position(|a| a == "--requirepass") {
            if let Some(pass) = self.extra.get(pos + 1) {
                cmd.args(["--no-auth-warning", "-a", pass]);
            }
        }
        let out = cmd.args(args).output().expect("run redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A counter window's total over every count field (the local `o<idx>`
    /// ones included), as leasehold's key layout defines it; None when the
    /// key does not exist.
    pub fn window_total(&self, key: &str) -> Option<i64> {
        window_total_of(&self.cli(&["HGETALL", key]))
    }

    /// Every key (SCAN), sorted, each once (SCAN may return a key twice).
    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.cli(&["--scan"]).lines().map(str::to_owned).collect();
        keys.sort();
        keys.dedup();
        keys
    }

    /// Kills (SIGKILL) and starts a new, empty redis-server on the same port.
    pub fn restart_empty(&mut self) {
        self.kill();
        self.start_again();
    }

    /// SIGKILL, and wait until it is gone.
    pub fn kill(&mut self) {
        self.proc.signal("KILL").expect("kill redis-server");
        let _ = self.proc.wait_exit(Duration::from_secs(5));
    }

    /// Starts a new, empty redis-server on the same port.
    pub fn start_again(&mut self) {
        let name = self.proc.name.clone();
        self.proc = Self::spawn(
            &format!("{name}-again"),
            &self.dir,
            self.port,
            &self.extra,
            &self.host,
            self.netns.as_deref(),
        );
        self.wait_ready();
    }
}

/// A window's total from redis-cli's HGETALL output; None when empty (no
/// such key).
pub fn window_total_of(hgetall: &str) -> Option<i64> {
    let lines: Vec<&str> = hgetall.lines().collect();
    if lines.is_empty() {
        return None;
    }
    Some(leasehold::redis::keys::window_total(
        lines.chunks_exact(2).map(|p| (p[0], p[1])),
    ))
}

/// One descriptor of (key, value) entries.
pub fn desc(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect(),
        ..Default::default()
    }
}

/// A request with these descriptors and no request-level hits.
pub fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: 0,
    }
}

/// A request with one descriptor.
pub fn single(domain: &str, entries: &[(&str, &str)]) -> RateLimitRequest {
    request(domain, vec![desc(entries)])
}
