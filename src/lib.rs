//! leasehold: an Envoy RLS v3 rate-limit decision server that keeps limiting
//! correctly when its shared Redis is slow, down or partitioned away.
//!
//! The crate map, top to bottom; imports only point down this list:
//!
//! - [`cli`]: the command line, one file per subcommand; `main.rs` only
//!   parses and maps the outcome to an exit code.
//! - [`ops`]: operations tooling (deploy templates, the local runner, paced
//!   load, the failover demo, the benchmark). Nothing below imports it.
//! - [`app`]: the composition root: settings and rules before any port,
//!   building the engine, serving, background loops, the shutdown order and
//!   signal handling.
//! - [`settings`], [`telemetry`]: typed settings; logs and OTLP traces.
//! - `grpc`, `http`: the transports (RLS, health, reflection; health,
//!   `/json`, `/metrics`, admin pages), glue only. `metrics` renders for
//!   them.
//! - `rls`: wire ↔ decision conversion both transports share: units,
//!   codes, validation with size bounds, the response, protojson.
//! - [`decision`]: rules matching and planning → one batch of charges →
//!   statuses, overall code and headers.
//! - [`engine`]: the [`engine::Engine`] trait; in-memory, Redis (the adapter
//!   over [`redis`]) and resilient engines, the last with its breaker,
//!   leases, ledger, recovery loop and journal in `engine/resilient/`.
//! - [`redis`]: the only module that knows fred: pool, scripts and their
//!   contracts, key layout, membership.
//! - [`rules`]: envoyproxy/ratelimit YAML → validated tree; matching.
//! - [`domain`]: charges, outcomes and the backend contract every layer
//!   shares; [`key`]: the counter key (encode, decode, hash tag, redaction).
//! - [`limit`]: pure algorithm math with `now` passed in; [`clock`]: time.
//! - [`proto`]: the generated Envoy RLS v3 types; [`redact`]: value hashing.

pub mod app;
pub mod cli;
pub mod clock;
pub mod decision;
pub mod domain;
pub mod engine;
mod grpc;
mod http;
pub mod key;
#[cfg(test)]
mod layers;
pub mod limit;
mod metrics;
pub mod ops;
pub mod proto;
pub mod redact;
pub mod redis;
mod rls;
pub mod rules;
pub mod settings;
pub mod telemetry;

pub use grpc::REPLICA_HEADER;
