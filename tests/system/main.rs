//! The system suite: real leasehold processes with their real peers
//! (redis-server, Envoy, nginx, grpcurl, chromium, promtool). Every test
//! starts processes, so nextest runs this binary one test at a time.
//!
//! - [`e2e`]: the binary's surfaces, Envoy's filter, reload, startup and shutdown;
//! - [`redis_e2e`]: the Redis engine across replicas, restarts and bad peers;
//! - [`cluster`]: the Redis engine on a real Redis Cluster: spread, slots, failover;
//! - [`script`]: decide.lua called directly: groups of equal requests;
//! - [`sentinel`]: behind Redis Sentinel: a failover that loses writes, healed;
//! - [`fault_e2e`]: the guarantees under faults (docs/guarantees.md);
//! - [`hardening`]: hostile callers (slow connections, connection limits);
//! - [`journal`]: the journal through a crash, and after a replay in doubt;
//! - [`layout`]: key layout versions: replicas of two layouts, the move of windows;
//! - [`tls`]: TLS and mutual TLS on the gRPC port, with Envoy too;
//! - [`operations`]: traces, logs, the admin listener, status page, metrics;
//! - [`topology`]: the four-replica topology through the local runner.

mod cluster;
#[path = "../common/mod.rs"]
mod common;
mod e2e;
mod fault_e2e;
mod hardening;
mod journal;
mod layout;
mod operations;
mod redis_e2e;
mod script;
mod sentinel;
mod tls;
mod topology;
