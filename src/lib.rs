//! leasehold: an Envoy RLS v3 rate-limit decision server that keeps limiting
//! correctly when its shared Redis is slow, down or partitioned away.
//!
//! Layout (dependencies point down):
//!
//! - [`grpc`], [`http`]: transports. Translate proto/JSON ↔ domain types.
//! - [`limiter`]: matches descriptors to rules, builds one batch of charges,
//!   turns the engine's outcome into statuses and headers.
//! - [`engine`]: the [`engine::Engine`] trait and its implementations.
//! - [`redis`]: the only module that knows fred: scripts, keys, membership.
//! - [`rules`]: envoyproxy/ratelimit YAML → validated tree; matching.
//! - [`limit`]: pure algorithm math with `now` passed in.
//! - [`app`]: the composition root; [`settings`]: typed settings;
//!   [`cli`]: the `query` and `bench` client commands; [`clock`]: time.

pub mod app;
pub mod breaker;
pub mod cli;
pub mod clock;
pub mod deploy;
pub mod engine;
pub mod grpc;
pub mod http;
pub mod journal;
pub mod limit;
pub mod limiter;
pub mod metrics;
pub mod proto;
pub mod reconcile;
pub mod redact;
pub mod redis;
pub mod rules;
pub mod settings;
pub mod status_page;
pub mod telemetry;
pub mod topology;
