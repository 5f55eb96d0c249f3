//! The Redis deployment as this replica sees it, for `/status`, `/metrics`
//! and the status page: the mode (one Redis, Cluster, Sentinel), each
//! primary (with its slots on a Cluster) and whether this replica holds a
//! connection to it, and the decision calls that failed per node.

use std::collections::BTreeMap;

use fred::prelude::*;
use fred::types::config::ServerConfig;
use serde::Serialize;

use super::Redis;

/// What `/status` shows under `redis.topology`.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Topology {
    /// "standalone", "cluster" or "sentinel".
    pub mode: &'static str,
    pub nodes: Vec<NodeView>,
    /// Pool clients that stopped and were started again (see
    /// `supervise` in the Redis module).
    pub clients_restarted: u64,
}

/// One node.
#[derive(Clone, Debug, Default, Serialize)]
pub struct NodeView {
    /// host:port.
    pub node: String,
    /// "primary" or "sentinel".
    pub role: &'static str,
    /// Hash slots it serves (a Cluster primary), else 0.
    pub slots: u32,
    /// Whether a connection of this replica's pool is up to it (sentinels
    /// are asked only to find the primary, so none is kept to them).
    pub connected: bool,
    /// Decision calls bound for it that failed.
    pub failures: u64,
}

fn name(server: &Server) -> String {
    format!("{}:{}", server.host, server.port)
}

impl Redis {
    /// The node a call with this first key goes to, as far as this
    /// replica knows (the Cluster's slot map; the one server otherwise).
    pub(super) fn node_of(&self, first_key: Option<&Key>) -> String {
        match &self.config.server {
            ServerConfig::Clustered { .. } => {
                let slot = first_key.map(|k| fred::util::redis_keyslot(k.as_bytes()));
                self.pool
                    .next()
                    .cached_cluster_state()
                    .and_then(|state| slot.and_then(|s| state.get_server(s).map(name)))
                    .unwrap_or_else(|| "unknown".to_owned())
            }
            ServerConfig::Centralized { server } => name(server),
            _ => self
                .pool
                .active_connections()
                .first()
                .map(name)
                .unwrap_or_else(|| "primary".to_owned()),
        }
    }

    /// Counts a failed decision call against its node.
    pub(super) fn node_failed(&self, node: String) {
        *self.node_failures.lock().entry(node).or_default() += 1;
    }

    pub fn topology(&self) -> Topology {
        let connected: Vec<String> = self.pool.active_connections().iter().map(name).collect();
        let failures = self.node_failures.lock().clone();
        let view = |node: String, role, slots| NodeView {
            connected: connected.contains(&node),
            failures: failures.get(&node).copied().unwrap_or(0),
            node,
            role,
            slots,
        };
        let mut topology = match &self.config.server {
            ServerConfig::Centralized { server } => Topology {
                mode: "standalone",
                clients_restarted: 0,
                nodes: vec![view(name(server), "primary", 0)],
            },
            ServerConfig::Clustered { hosts, .. } => {
                let mut slots: BTreeMap<String, u32> = BTreeMap::new();
                if let Some(state) = self.pool.next().cached_cluster_state() {
                    for range in state.slots() {
                        *slots.entry(name(&range.primary)).or_default() +=
                            u32::from(range.end - range.start) + 1;
                    }
                } else {
                    for h in hosts {
                        slots.entry(name(h)).or_default();
                    }
                }
                Topology {
                    mode: "cluster",
                    clients_restarted: 0,
                    nodes: slots
                        .into_iter()
                        .map(|(node, n)| view(node, "primary", n))
                        .collect(),
                }
            }
            ServerConfig::Sentinel { hosts, .. } => {
                let mut nodes: Vec<NodeView> = connected
                    .iter()
                    .collect::<std::collections::BTreeSet<_>>()
                    .into_iter()
                    .map(|n| view(n.clone(), "primary", 0))
                    .collect();
                nodes.extend(hosts.iter().map(|h| NodeView {
                    node: name(h),
                    role: "sentinel",
                    ..NodeView::default()
                }));
                Topology {
                    mode: "sentinel",
                    clients_restarted: 0,
                    nodes,
                }
            }
            #[allow(unreachable_patterns)]
            _ => Topology {
                mode: "other",
                clients_restarted: 0,
                nodes: Vec::new(),
            },
        };
        topology.clients_restarted = self.restarts.load(std::sync::atomic::Ordering::Relaxed);
        topology
    }
}
