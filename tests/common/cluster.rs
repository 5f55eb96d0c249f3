//! A real Redis Cluster for the tests: masters with replicas on loopback
//! ports whose cluster bus ports (port + 10000) are free too, created with
//! `redis-cli --cluster create`, stopped with the test (by pid).

use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use super::{require, wait_until, RedisServer};

pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

/// `n` loopback ports below 55536 whose bus ports are free as well, each
/// held until all are chosen.
fn cluster_ports(n: usize) -> Vec<u16> {
    let mut held = Vec::new();
    let mut ports = Vec::new();
    for _ in 0..10_000 {
        if ports.len() == n {
            break;
        }
        let Ok(l) = TcpListener::bind("127.0.0.1:0") else {
            continue;
        };
        let Ok(port) = l.local_addr().map(|a| a.port()) else {
            continue;
        };
        if port >= 55_536 {
            continue;
        }
        let Ok(bus) = TcpListener::bind(("127.0.0.1", port + 10_000)) else {
            continue;
        };
        ports.push(port);
        held.push((l, bus));
    }
    assert_eq!(ports.len(), n, "free cluster ports");
    ports
}

impl RedisCluster {
    /// `masters` masters with `replicas` replicas each; a node that misses
    /// `node_timeout_ms` is failed over by its replica.
    pub fn start(dir: &Path, masters: usize, replicas: usize, node_timeout_ms: u64) -> Self {
        let count = masters * (1 + replicas);
        let ports = cluster_ports(count);
        let mut nodes = Vec::new();
        for &port in &ports {
            let node_dir = dir.join(format!("node-{port}"));
            std::fs::create_dir_all(&node_dir).expect("mkdir");
            let extra: Vec<String> = [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                &format!("nodes-{port}.conf"),
                "--cluster-node-timeout",
                &node_timeout_ms.to_string(),
                // The slots of a master being failed over are unavailable
                // for a moment; the others keep serving (the tests show a
                // request that needs both).
                "--cluster-require-full-coverage",
                "no",
                // A replica syncs at once rather than after the default
                // five seconds of batching.
                "--repl-diskless-sync-delay",
                "0",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            nodes.push(RedisServer::launch(
                &format!("redis-{port}"),
                &node_dir,
                port,
                extra,
                "127.0.0.1".into(),
                None,
            ));
        }
        let mut create = Command::new(require("redis-cli"));
        create.arg("--cluster").arg("create");
        for p in &ports {
            create.arg(format!("127.0.0.1:{p}"));
        }
        let out = create
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = RedisCluster { nodes };
        let ok = wait_until(Duration::from_secs(20), || {
            cluster
                .nodes
                .iter()
                .all(|n| n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"))
                && cluster.masters().len() == masters
        });
        assert!(
            ok,
            "the cluster did not become ready: {}",
            cluster.nodes[0].cli(&["CLUSTER", "NODES"])
        );
        // A replica that never synced cannot take over from its master.
        let synced = wait_until(Duration::from_secs(20), || {
            cluster.nodes.iter().all(|n| {
                let info = n.cli(&["INFO", "replication"]);
                info.contains("role:master") || info.contains("master_link_status:up")
            })
        });
        assert!(synced, "the replicas did not sync");
        cluster
    }

    /// `redis-cluster://` with every node as a seed.
    pub fn url(&self) -> String {
        let mut url = format!("redis-cluster://127.0.0.1:{}", self.nodes[0].port);
        for (i, n) in self.nodes.iter().enumerate().skip(1) {
            url.push(if i == 1 { '?' } else { '&' });
            url.push_str(&format!("node=127.0.0.1:{}", n.port));
        }
        url
    }

    /// The live nodes that are masters with slots now (by CLUSTER NODES of
    /// a live node).
    pub fn masters(&self) -> Vec<&RedisServer> {
        let Some(live) = self
            .nodes
            .iter()
            .find(|n| n.cli(&["PING"]).trim() == "PONG")
        else {
            return Vec::new();
        };
        let table = live.cli(&["CLUSTER", "NODES"]);
        self.nodes
            .iter()
            .filter(|n| n.cli(&["PING"]).trim() == "PONG")
            .filter(|n| {
                table.lines().any(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    f.len() > 8
                        && f[1].starts_with(&format!("127.0.0.1:{}@", n.port))
                        && f[2].contains("master")
                        && !f[2].contains("fail")
                })
            })
            .collect()
    }

    /// redis-cli in cluster mode (follows redirections).
    pub fn cli(&self, args: &[&str]) -> String {
        for n in &self.nodes {
            let out = Command::new(require("redis-cli"))
                .args(["-c", "-p", &n.port.to_string()])
                .args(args)
                .output()
                .expect("redis-cli");
            if out.status.success() {
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                if !text.starts_with("Could not connect") {
                    return text;
                }
            }
        }
        String::new()
    }

    /// A window's total over its count fields, wherever it lives.
    pub fn window_total(&self, key: &str) -> Option<i64> {
        super::window_total_of(&self.cli(&["HGETALL", key]))
    }

    /// The counter keys on each master (matching `pattern`).
    pub fn keys_per_master(&self, pattern: &str) -> Vec<(u16, usize)> {
        self.masters()
            .iter()
            .map(|m| {
                let keys = m.cli(&["--scan", "--pattern", pattern]);
                // SCAN may return a key twice (while its table is rehashed).
                let unique: std::collections::HashSet<&str> =
                    keys.lines().filter(|l| !l.is_empty()).collect();
                (m.port, unique.len())
            })
            .collect()
    }
}
