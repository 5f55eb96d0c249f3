//! A real Redis Sentinel deployment for the tests: a primary, one replica
//! and three sentinels (`redis-server --sentinel`) on free loopback ports,
//! stopped with the test (by pid).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use super::{free_ports, require, spawn, wait_until, Proc, RedisServer};

/// The service name the sentinels monitor.
pub const SERVICE: &str = "main";

pub struct RedisSentinel {
    pub primary: RedisServer,
    pub replica: RedisServer,
    pub sentinels: Vec<(u16, Proc)>,
}

impl RedisSentinel {
    /// The primary fails over once it has been down for `down_after_ms`.
    pub fn start(dir: &Path, down_after_ms: u64) -> RedisSentinel {
        let primary_dir = dir.join("primary");
        let replica_dir = dir.join("replica");
        for d in [&primary_dir, &replica_dir] {
            std::fs::create_dir_all(d).expect("mkdir");
        }
        let primary = RedisServer::start("redis-primary", &primary_dir);
        let replica = RedisServer::start_with(
            "redis-replica",
            &replica_dir,
            &["--replicaof", "127.0.0.1", &primary.port.to_string()],
        );
        let synced = wait_until(Duration::from_secs(10), || {
            replica
                .cli(&["INFO", "replication"])
                .contains("master_link_status:up")
        });
        assert!(
            synced,
            "the replica did not sync: {}",
            replica.proc.log_text()
        );
        let ports: [u16; 3] = free_ports();
        let mut sentinels = Vec::new();
        for port in ports {
            let conf = dir.join(format!("sentinel-{port}.conf"));
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor {SERVICE} 127.0.0.1 {} 2\nsentinel down-after-milliseconds {SERVICE} {down_after_ms}\nsentinel failover-timeout {SERVICE} 5000\nsentinel parallel-syncs {SERVICE} 1\n",
                    dir.display(),
                    primary.port
                ),
            )
            .expect("sentinel config");
            let mut cmd = Command::new(require("redis-server"));
            cmd.arg(&conf).arg("--sentinel");
            sentinels.push((port, spawn(&format!("sentinel-{port}"), &mut cmd, dir)));
        }
        let s = RedisSentinel {
            primary,
            replica,
            sentinels,
        };
        // Every sentinel knows the replica and the two other sentinels.
        let ready = wait_until(Duration::from_secs(20), || {
            s.sentinels.iter().all(|(port, _)| {
                let info = sentinel_cli(*port, &["SENTINEL", "MASTER", SERVICE]);
                field(&info, "num-slaves") == Some("1")
                    && field(&info, "num-other-sentinels") == Some("2")
            })
        });
        assert!(
            ready,
            "the sentinels did not find each other: {}",
            sentinel_cli(s.sentinels[0].0, &["SENTINEL", "MASTER", SERVICE])
        );
        s
    }

    /// `redis-sentinel://` naming every sentinel.
    pub fn url(&self) -> String {
        let mut url = format!(
            "redis-sentinel://127.0.0.1:{}?sentinelServiceName={SERVICE}",
            self.sentinels[0].0
        );
        for (port, _) in &self.sentinels[1..] {
            url.push_str(&format!("&node=127.0.0.1:{port}"));
        }
        url
    }

    /// The port of the primary the sentinels name now.
    pub fn primary_port(&self) -> Option<u16> {
        self.sentinels.iter().find_map(|(port, _)| {
            let out = sentinel_cli(*port, &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE]);
            out.lines().nth(1).and_then(|p| p.trim().parse().ok())
        })
    }

    /// Waits until the replica has every write the primary took.
    pub fn wait_replicated(&self) -> bool {
        wait_until(Duration::from_secs(10), || {
            let offset = |s: &RedisServer, name: &str| {
                s.cli(&["INFO", "replication"])
                    .lines()
                    .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_owned()))
            };
            let p = offset(&self.primary, "master_repl_offset:");
            p.is_some() && p == offset(&self.replica, "slave_repl_offset:")
        })
    }
}

impl Drop for RedisSentinel {
    fn drop(&mut self) {
        // A paused replica would not stop on SIGTERM.
        let _ = self.replica.proc.signal("CONT");
        for (_, p) in &mut self.sentinels {
            p.kill();
        }
    }
}

fn sentinel_cli(port: u16, args: &[&str]) -> String {
    Command::new(require("redis-cli"))
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// The value after `name` in redis-cli's line-per-item output.
fn field<'a>(out: &'a str, name: &str) -> Option<&'a str> {
    let mut lines = out.lines();
    while let Some(l) = lines.next() {
        if l.trim() == name {
            return lines.next().map(str::trim);
        }
    }
    None
}
