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
//! - [`limit`]: pure algorithm math with `now` passed in; [`clock`]: time;
//!   [`tasks`]: the runtime work spawned on a request's path runs on.
//! - [`proto`]: the generated Envoy RLS v3 types; [`redact`]: value hashing.
//!
//! Without the `server` feature (on by default) only the core is built:
//! `rules`, `key`, `limit`, `decision`, `domain`, the in-memory engine,
//! `rls` and `proto` (messages, no services); the fuzz targets build that.

#[cfg(feature = "server")]
pub mod app;
#[cfg(feature = "server")]
pub mod cli;
pub mod clock;
pub mod decision;
pub mod domain;
pub mod engine;
#[cfg(feature = "server")]
mod grpc;
#[cfg(feature = "server")]
mod http;
pub mod key;
#[cfg(test)]
#[cfg(feature = "server")]
mod layers;
pub mod limit;
#[cfg(feature = "server")]
mod metrics;
#[cfg(feature = "server")]
pub mod ops;
pub mod proto;
pub mod redact;
#[cfg(feature = "server")]
pub mod redis;
pub mod rls;
pub mod rules;
#[cfg(feature = "server")]
pub mod settings;
#[cfg(feature = "server")]
pub mod tasks;
#[cfg(feature = "server")]
pub mod telemetry;

#[cfg(feature = "server")]
pub use grpc::REPLICA_HEADER;
