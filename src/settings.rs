//! Typed settings: defaults < settings file < `LEASEHOLD_*` environment <
//! command-line flags. Validated before any port is bound.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::decision::DecisionSettings;
use crate::rls::Bounds;
use crate::rules::LoadOptions;

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// Rules files or directories (envoyproxy/ratelimit YAML).
    pub rules: Vec<PathBuf>,
    /// gRPC listen address (RateLimitService, health, reflection).
    pub grpc_addr: SocketAddr,
    /// HTTP listen address (/healthz, /readyz, /rules, /status, /json).
    pub http_addr: SocketAddr,
    /// How often the rules path is checked for changes, in milliseconds.
    pub rules_poll_interval_ms: u64,
    /// Merge files that declare the same domain (MERGE_DOMAIN_CONFIG).
    pub merge_domains: bool,
    /// Global shadow mode: count everything, always answer OK overall (SHADOW_MODE).
    pub shadow_mode: bool,
    /// Treat every rule as quota_mode (QUOTA_MODE).
    pub quota_mode: bool,
    /// Add RateLimit-Limit/-Remaining/-Reset to responses (LIMIT_RESPONSE_HEADERS_ENABLED).
    pub response_headers: bool,
    pub header_limit: String,
    pub header_remaining: String,
    pub header_reset: String,
    /// Request bounds: descriptors per request.
    pub max_descriptors: usize,
    /// Request bounds: entries per descriptor.
    pub max_entries: usize,
    /// Request bounds: bytes in a domain or an entry key. Values are never
    /// refused for their length: a value over 4096 bytes is counted under
    /// its SHA-256.
    pub max_entry_bytes: usize,
    /// Largest gRPC message and `POST /json` body, in bytes, refused before
    /// it is decoded (gRPC OUT_OF_RANGE, HTTP 413).
    pub max_request_bytes: usize,
    /// Most HTTP connections open at once, per HTTP listener; past it a new
    /// connection is closed at once.
    pub http_max_connections: usize,
    /// How long an HTTP request's headers may take to arrive, and how long
    /// a keep-alive connection may sit idle, in milliseconds.
    pub http_header_timeout_ms: u64,
    /// Most concurrent gRPC calls on one connection (HTTP/2 streams).
    pub grpc_max_concurrent_streams: u32,
    /// An HTTP/2 PING is sent on a gRPC connection this often, in
    /// milliseconds, and the connection is closed when one goes unanswered
    /// for `grpc_keepalive_timeout_ms`: a peer that vanished (or stopped
    /// reading) does not hold its connection forever.
    pub grpc_keepalive_interval_ms: u64,
    pub grpc_keepalive_timeout_ms: u64,
    /// Threads serving gRPC connections, each connection served by one of
    /// them from start to end; 0: one per CPU the process may use.
    pub grpc_threads: usize,
    /// TLS on the gRPC port: certificate chain (PEM). With `grpc_tls_key`.
    /// The files are checked every second and reloaded when they change.
    pub grpc_tls_cert: Option<PathBuf>,
    /// TLS on the gRPC port: private key (PEM).
    pub grpc_tls_key: Option<PathBuf>,
    /// Mutual TLS: clients must present a certificate signed by one of
    /// these CAs (PEM).
    pub grpc_tls_client_ca: Option<PathBuf>,
    /// Answer refunds (`is_negative_hits`) and request limit overrides on
    /// `POST /json`; off, they get 403. The HTTP port is often reachable by
    /// more than Envoy, and either lets a caller rewrite counts.
    pub json_allow_adjustments: bool,
    /// The same on the gRPC port (on by default: Envoy sends them when its
    /// configuration asks for them); off, PERMISSION_DENIED.
    pub grpc_allow_adjustments: bool,
    /// How long in-flight calls may take to finish after SIGTERM, in milliseconds.
    pub shutdown_grace_ms: u64,
    /// How long to report NOT_SERVING before closing listeners, so balancers
    /// stop sending new calls first, in milliseconds. It must cover the
    /// health checker's detection time: interval × unhealthy threshold plus
    /// one check timeout (Envoy in this repository's template: 1 s × 1 +
    /// 1 s = 2 s; a Kubernetes readiness probe: periodSeconds ×
    /// failureThreshold).
    pub shutdown_delay_ms: u64,
    /// Most bytes the in-memory counters take (keys included), in the
    /// memory engine and in each replica's lease state; past it the soonest
    /// to expire are evicted (counted).
    pub memory_max_bytes: usize,
    /// How often expired in-memory counters are dropped, in milliseconds.
    pub sweep_interval_ms: u64,
    /// Redis URL: redis://[user:password@]host:port[/db] for one Redis,
    /// redis-cluster://…?node=host:port&… for a Cluster,
    /// redis-sentinel://…?sentinelServiceName=NAME&node=… for Sentinel;
    /// rediss… for TLS.
    /// Unset: the in-memory engine decides alone.
    pub redis_url: Option<String>,
    /// TLS to Redis (`rediss://`): the CA that signed Redis's certificate
    /// (PEM). Unset: the system's roots.
    pub redis_tls_ca: Option<PathBuf>,
    /// Mutual TLS to Redis: this replica's certificate chain (PEM).
    pub redis_tls_cert: Option<PathBuf>,
    /// Mutual TLS to Redis: its private key (PEM).
    pub redis_tls_key: Option<PathBuf>,
    /// Prefix of every Redis key leasehold writes (no braces).
    pub redis_prefix: String,
    /// Budget for one Redis call on the request path while Redis is silent
    /// (nothing answered for 100 ms), in milliseconds.
    pub redis_deadline_ms: u64,
    /// Budget while Redis is answering (a busy Redis is not an outage):
    /// a call waits up to this long for its own reply, then the request is
    /// denied, never granted unseen. At least `redis_deadline_ms`.
    pub redis_budget_max_ms: u64,
    /// How long a call past its budget is still awaited, so that its reply
    /// is folded in instead of leaving its keys in doubt.
    pub redis_reply_timeout_ms: u64,
    /// Pipelined Redis connections.
    pub redis_pool_size: usize,
    /// How long a fixed-window counter Redis reported over its limit is
    /// denied on this replica without a Redis call (within its window); it
    /// also bounds how long a refund made on another replica can go unseen
    /// here. 0 turns the over-limit cache off.
    pub over_limit_cache_ms: u64,
    /// Added to every Redis key's natural lifetime, in milliseconds.
    pub redis_expiry_margin_ms: u64,
    /// This replica's id (default hostname:grpc-port); unique among live replicas.
    pub replica_id: Option<String>,
    /// Membership heartbeat interval, in milliseconds.
    pub membership_heartbeat_ms: u64,
    /// A replica silent for this long is no longer a live member, in milliseconds.
    pub membership_ttl_ms: u64,
    /// How long the replicas on Redis keep holding back the share of a
    /// member whose heartbeats stopped (it may be cut off from Redis and
    /// still serving on its lease), in milliseconds. A member that really
    /// crashed costs its share for this long; one that stops cleanly
    /// leaves at once.
    pub membership_holdback_ms: u64,
    /// Consecutive failed or late Redis calls that trip the breaker.
    pub breaker_failures: u32,
    /// How often a tripped breaker probes Redis, in milliseconds.
    pub breaker_probe_interval_ms: u64,
    /// Random spread (±) on the probe interval, in milliseconds.
    pub breaker_probe_jitter_ms: u64,
    /// The floor of a replica's demand-based lease share (0..1/N).
    pub lease_min_share: f64,
    /// Live replicas to assume before first contact with Redis.
    pub replicas_hint: usize,
    /// Most keys the replay ledger tracks.
    pub ledger_max_keys: usize,
    /// Most bytes the replay ledger takes (keys included); with
    /// `ledger_max_keys`, whichever is reached first.
    pub ledger_max_bytes: usize,
    /// Directory for the outage journal: unreplayed lease grants survive a
    /// restart of this replica. Unset: no journal.
    pub journal_dir: Option<PathBuf>,
    /// Most distinct series of the per-limit metric (rules with
    /// detailed_metric); past it, one `overflow` series.
    pub metrics_detailed_max_series: usize,
    /// Log filter (tracing EnvFilter syntax), e.g. "info" or "leasehold=debug".
    pub log_level: String,
    /// "text" or "json".
    pub log_format: String,
    /// The admin listener: /status, /status.html and /rules, which show
    /// descriptor values (often API keys or user ids), are served only
    /// here. Loopback by default: exposing them is a deliberate setting.
    pub admin_addr: SocketAddr,
    /// Replace descriptor values on /status, /status.html and /rules by a
    /// short hash (values are often API keys or user ids).
    pub redact_values: bool,
    /// OTLP/gRPC endpoint for traces, e.g. http://127.0.0.1:4317. Unset: no export.
    pub otlp_endpoint: Option<String>,
    /// `service.name` of exported spans.
    pub otlp_service_name: String,
    /// Ask Envoy to add `x-leasehold-replica` to every HTTP response it
    /// decided (through `response_headers_to_add`).
    pub replica_response_header: bool,
}

/// Serving threads beyond this are a typo, not a machine (each is an OS
/// thread started before the first request).
const MAX_GRPC_THREADS: usize = 1024;

impl Default for Settings {
    fn default() -> Self {
        let d = DecisionSettings::default();
        let b = Bounds::default();
        Settings {
            rules: Vec::new(),
            grpc_addr: SocketAddr::from(([0, 0, 0, 0], 8081)),
            http_addr: SocketAddr::from(([0, 0, 0, 0], 8080)),
            rules_poll_interval_ms: 1_000,
            merge_domains: false,
            shadow_mode: false,
            quota_mode: false,
            response_headers: false,
            header_limit: d.header_limit,
            header_remaining: d.header_remaining,
            header_reset: d.header_reset,
            max_descriptors: b.max_descriptors,
            max_entries: b.max_entries,
            max_entry_bytes: b.max_entry_bytes,
            max_request_bytes: 256 * 1024,
            http_max_connections: 1024,
            http_header_timeout_ms: 30_000,
            grpc_max_concurrent_streams: 1024,
            grpc_keepalive_interval_ms: 30_000,
            grpc_keepalive_timeout_ms: 10_000,
            grpc_threads: 0,
            grpc_tls_cert: None,
            grpc_tls_key: None,
            grpc_tls_client_ca: None,
            json_allow_adjustments: false,
            grpc_allow_adjustments: true,
            shutdown_grace_ms: 10_000,
            shutdown_delay_ms: 3_000,
            memory_max_bytes: crate::engine::memory::DEFAULT_MAX_BYTES,
            sweep_interval_ms: 5_000,
            redis_url: None,
            redis_tls_ca: None,
            redis_tls_cert: None,
            redis_tls_key: None,
            redis_prefix: "lh:".into(),
            redis_deadline_ms: 5,
            redis_budget_max_ms: 15,
            redis_reply_timeout_ms: 1_000,
            redis_pool_size: 4,
            over_limit_cache_ms: 250,
            redis_expiry_margin_ms: 10_000,
            replica_id: None,
            membership_heartbeat_ms: 1_000,
            membership_ttl_ms: 5_000,
            membership_holdback_ms: 30_000,
            breaker_failures: 3,
            breaker_probe_interval_ms: 250,
            breaker_probe_jitter_ms: 100,
            lease_min_share: 0.025,
            replicas_hint: 1,
            ledger_max_keys: 200_000,
            ledger_max_bytes: 64 * 1024 * 1024,
            journal_dir: None,
            metrics_detailed_max_series: 1_000,
            log_level: "info".into(),
            log_format: "text".into(),
            admin_addr: SocketAddr::from(([127, 0, 0, 1], 8082)),
            redact_values: false,
            otlp_endpoint: None,
            otlp_service_name: "leasehold".into(),
            replica_response_header: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("settings: {0}")]
    Load(#[from] config::ConfigError),
    #[error("invalid setting {key}: {why}")]
    Invalid { key: &'static str, why: String },
}

fn invalid(key: &'static str, why: impl Into<String>) -> SettingsError {
    SettingsError::Invalid {
        key,
        why: why.into(),
    }
}

/// Kubernetes gives every pod of a namespace, for each Service, the
/// variables `<NAME>_SERVICE_HOST`, `<NAME>_SERVICE_PORT[_<port name>]`,
/// `<NAME>_PORT` and `<NAME>_PORT_<port>_<TCP|UDP|SCTP>[_PROTO|_PORT|_ADDR]`.
/// For Services named `leasehold`, `leasehold-redis` and the like they
/// start with `LEASEHOLD_`; they are not settings, and refusing them would
/// crash-loop every pod. No setting's name ends in `_PORT` or contains
/// `_SERVICE_HOST` or `_SERVICE_PORT`, so none is taken for one.
pub fn is_service_link(key: &str) -> bool {
    if key.ends_with("_SERVICE_HOST") || key.contains("_SERVICE_PORT") || key.ends_with("_PORT") {
        return true;
    }
    // `…_PORT_8081_TCP…`: a port number, then a protocol.
    key.match_indices("_PORT_").any(|(at, _)| {
        let mut rest = key[at + "_PORT_".len()..].split('_');
        let port = rest.next().unwrap_or_default();
        let proto = rest.next().unwrap_or_default();
        !port.is_empty()
            && port.bytes().all(|b| b.is_ascii_digit())
            && matches!(proto, "TCP" | "UDP" | "SCTP")
    })
}

/// The `LEASEHOLD_*` variables of `env` that are ignored as Kubernetes
/// service links, for a warning once logging is up.
pub fn ignored_service_links(env: impl IntoIterator<Item = (String, String)>) -> Vec<String> {
    let mut keys: Vec<String> = env
        .into_iter()
        .map(|(k, _)| k)
        .filter(|k| k.starts_with("LEASEHOLD_") && is_service_link(k))
        .collect();
    keys.sort();
    keys
}

impl Settings {
    /// Defaults, then the settings file (if any), then `LEASEHOLD_*`
    /// variables from `env`. Flags are applied by the caller afterwards.
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, SettingsError> {
        let mut builder = config::Config::builder();
        if let Some(path) = file {
            builder = builder.add_source(config::File::from(path).required(true));
        }
        let mut vars: config::Map<String, String> = env
            .into_iter()
            // LEASEHOLD_SETTINGS names the file itself (read by the CLI), not a setting.
            .filter(|(k, _)| {
                k.starts_with("LEASEHOLD_") && k != "LEASEHOLD_SETTINGS" && !is_service_link(k)
            })
            .collect();
        let rules = vars.remove("LEASEHOLD_RULES");
        // Values stay strings until each setting's own type reads them, so
        // a replica id "007" stays "007" (and "01" and "1" stay distinct).
        builder = builder.add_source(
            config::Environment::with_prefix("LEASEHOLD")
                .prefix_separator("_")
                .source(Some(vars)),
        );
        if let Some(rules) = rules {
            let paths: Vec<String> = rules.split(',').map(str::to_owned).collect();
            builder = builder.set_override("rules", paths)?;
        }
        Ok(builder.build()?.try_deserialize()?)
    }

    pub fn validate(&self) -> Result<(), SettingsError> {
        self.validate_requests()?;
        self.validate_redis()?;
        self.validate_process()
    }

    /// Rules, polling and the request bounds and header names.
    fn validate_requests(&self) -> Result<(), SettingsError> {
        if self.rules.is_empty() {
            return Err(invalid(
                "rules",
                "at least one rules file or directory is required (--rules PATH)",
            ));
        }
        for (key, v) in [
            ("rules_poll_interval_ms", self.rules_poll_interval_ms),
            ("sweep_interval_ms", self.sweep_interval_ms),
            ("memory_max_bytes", self.memory_max_bytes as u64),
        ] {
            if v == 0 {
                return Err(invalid(key, "must be greater than 0"));
            }
        }
        for (key, v) in [
            ("max_descriptors", self.max_descriptors),
            ("max_entries", self.max_entries),
            ("max_entry_bytes", self.max_entry_bytes),
        ] {
            if v == 0 {
                return Err(invalid(key, "must be greater than 0"));
            }
        }
        for (key, v) in [
            ("http_max_connections", self.http_max_connections as u64),
            ("http_header_timeout_ms", self.http_header_timeout_ms),
            (
                "grpc_max_concurrent_streams",
                u64::from(self.grpc_max_concurrent_streams),
            ),
            (
                "grpc_keepalive_interval_ms",
                self.grpc_keepalive_interval_ms,
            ),
            ("grpc_keepalive_timeout_ms", self.grpc_keepalive_timeout_ms),
        ] {
            if v == 0 {
                return Err(invalid(key, "must be greater than 0"));
            }
        }
        // Envoy's default header limit is 60 KiB: a request must hold at
        // least one such header value, or Envoy would fail open on it.
        if self.max_request_bytes < 64 * 1024 {
            return Err(invalid(
                "max_request_bytes",
                "must be at least 65536 (Envoy sends header values of up to 60 KiB by default)",
            ));
        }
        for (key, v) in [
            ("header_limit", &self.header_limit),
            ("header_remaining", &self.header_remaining),
            ("header_reset", &self.header_reset),
        ] {
            if v.is_empty()
                || !v
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                return Err(invalid(key, format!("'{v}' is not a valid header name")));
            }
        }
        Ok(())
    }

    /// The Redis URL and key prefix, the deadline, breaker, leases and
    /// membership.
    fn validate_redis(&self) -> Result<(), SettingsError> {
        if let Some(url) = &self.redis_url {
            crate::redis::check_url(url).map_err(|e| invalid("redis_url", e))?;
        }
        match (&self.redis_tls_cert, &self.redis_tls_key) {
            (Some(_), None) => {
                return Err(invalid(
                    "redis_tls_key",
                    "redis_tls_cert needs redis_tls_key",
                ))
            }
            (None, Some(_)) => {
                return Err(invalid(
                    "redis_tls_cert",
                    "redis_tls_key needs redis_tls_cert",
                ))
            }
            _ => {}
        }
        if !self.redis_tls().is_default()
            && !self
                .redis_url
                .as_deref()
                .is_some_and(crate::redis::is_tls_url)
        {
            return Err(invalid(
                "redis_tls_ca",
                "redis_tls_ca, redis_tls_cert and redis_tls_key need a TLS redis_url (rediss://, rediss-cluster:// or rediss-sentinel://)",
            ));
        }
        if self.redis_prefix.contains(['{', '}']) {
            return Err(invalid(
                "redis_prefix",
                "must not contain '{' or '}' (they would change the Redis Cluster hash tag)",
            ));
        }
        for (key, v) in [
            ("redis_deadline_ms", self.redis_deadline_ms),
            ("redis_budget_max_ms", self.redis_budget_max_ms),
            ("redis_reply_timeout_ms", self.redis_reply_timeout_ms),
            ("redis_pool_size", self.redis_pool_size as u64),
            ("membership_heartbeat_ms", self.membership_heartbeat_ms),
        ] {
            if v == 0 {
                return Err(invalid(key, "must be greater than 0"));
            }
        }
        if self.breaker_failures == 0 {
            return Err(invalid("breaker_failures", "must be at least 1"));
        }
        if self.breaker_probe_interval_ms == 0
            || self.breaker_probe_jitter_ms >= self.breaker_probe_interval_ms
        {
            return Err(invalid(
                "breaker_probe_interval_ms",
                "must be positive and larger than breaker_probe_jitter_ms",
            ));
        }
        if !(0.0..=1.0).contains(&self.lease_min_share) {
            return Err(invalid("lease_min_share", "must be between 0 and 1"));
        }
        if self.replicas_hint == 0 || self.ledger_max_keys == 0 || self.ledger_max_bytes == 0 {
            return Err(invalid(
                "replicas_hint",
                "replicas_hint, ledger_max_keys and ledger_max_bytes must be at least 1",
            ));
        }
        if self.membership_ttl_ms <= self.membership_heartbeat_ms {
            return Err(invalid(
                "membership_ttl_ms",
                "must be longer than membership_heartbeat_ms",
            ));
        }
        if self.membership_holdback_ms != 0 && self.membership_holdback_ms <= self.membership_ttl_ms
        {
            return Err(invalid(
                "membership_holdback_ms",
                "must be 0 (no hold-back) or longer than membership_ttl_ms",
            ));
        }
        Ok(())
    }

    /// Identity, logging, listeners and trace export.
    fn validate_process(&self) -> Result<(), SettingsError> {
        if self.replica_id.as_deref().is_some_and(str::is_empty) {
            return Err(invalid("replica_id", "must not be empty"));
        }
        if self.grpc_threads > MAX_GRPC_THREADS {
            return Err(invalid(
                "grpc_threads",
                format!("{} is more than {MAX_GRPC_THREADS}", self.grpc_threads),
            ));
        }
        if !matches!(self.log_format.as_str(), "text" | "json") {
            return Err(invalid(
                "log_format",
                format!("'{}' is not text or json", self.log_format),
            ));
        }
        if self.grpc_addr == self.http_addr && self.grpc_addr.port() != 0 {
            return Err(invalid("http_addr", "must differ from grpc_addr"));
        }
        let admin = self.admin_addr;
        if admin.port() != 0 && (admin == self.http_addr || admin == self.grpc_addr) {
            return Err(invalid(
                "admin_addr",
                "must differ from http_addr and grpc_addr",
            ));
        }
        match (&self.grpc_tls_cert, &self.grpc_tls_key) {
            (Some(_), None) => {
                return Err(invalid("grpc_tls_key", "grpc_tls_cert needs grpc_tls_key"))
            }
            (None, Some(_)) => {
                return Err(invalid("grpc_tls_cert", "grpc_tls_key needs grpc_tls_cert"))
            }
            _ => {}
        }
        if self.grpc_tls_client_ca.is_some() && self.grpc_tls_cert.is_none() {
            return Err(invalid(
                "grpc_tls_client_ca",
                "mutual TLS needs grpc_tls_cert and grpc_tls_key",
            ));
        }
        if let Some(e) = &self.otlp_endpoint {
            if !(e.starts_with("http://") || e.starts_with("https://")) {
                return Err(invalid(
                    "otlp_endpoint",
                    format!("'{e}' is not an http:// or https:// URL"),
                ));
            }
        }
        tracing_subscriber::EnvFilter::try_new(&self.log_level)
            .map_err(|e| invalid("log_level", format!("'{}': {e}", self.log_level)))?;
        Ok(())
    }

    pub fn decision(&self) -> DecisionSettings {
        DecisionSettings {
            global_shadow_mode: self.shadow_mode,
            global_quota_mode: self.quota_mode,
            response_headers: self.response_headers,
            header_limit: self.header_limit.clone(),
            header_remaining: self.header_remaining.clone(),
            header_reset: self.header_reset.clone(),
        }
    }

    /// TLS files for `rediss://`.
    pub fn redis_tls(&self) -> crate::redis::tls::RedisTls {
        crate::redis::tls::RedisTls {
            ca: self.redis_tls_ca.clone(),
            cert: self.redis_tls_cert.clone(),
            key: self.redis_tls_key.clone(),
        }
    }

    /// The gRPC listener's TLS files, when TLS is on.
    pub fn grpc_tls(&self) -> Option<crate::grpc::tls::TlsFiles> {
        Some(crate::grpc::tls::TlsFiles {
            cert: self.grpc_tls_cert.clone()?,
            key: self.grpc_tls_key.clone()?,
            client_ca: self.grpc_tls_client_ca.clone(),
        })
    }

    pub fn bounds(&self) -> Bounds {
        Bounds {
            max_descriptors: self.max_descriptors,
            max_entries: self.max_entries,
            max_entry_bytes: self.max_entry_bytes,
        }
    }

    pub fn resilient(&self) -> crate::engine::resilient::ResilientConfig {
        crate::engine::resilient::ResilientConfig {
            deadline_ms: self.redis_deadline_ms,
            budget_max_ms: self.redis_budget_max_ms.max(self.redis_deadline_ms),
            over_cache_ms: self.over_limit_cache_ms,
            expiry_margin_ms: self.redis_expiry_margin_ms,
            lease_min_share: self.lease_min_share,
            replicas_hint: self.replicas_hint,
            ledger_max_keys: self.ledger_max_keys,
            ledger_max_bytes: self.ledger_max_bytes,
            local_max_bytes: self.memory_max_bytes,
            breaker: crate::engine::resilient::breaker::BreakerConfig {
                failures_to_trip: self.breaker_failures,
                probe_interval_ms: self.breaker_probe_interval_ms,
                probe_jitter_ms: self.breaker_probe_jitter_ms,
                settle_ms: crate::engine::resilient::ResilientConfig::settle_ms(
                    self.breaker_probe_interval_ms,
                    self.breaker_probe_jitter_ms,
                    self.redis_deadline_ms,
                ),
            },
        }
    }

    pub fn load_options(&self) -> LoadOptions {
        LoadOptions {
            merge_domains: self.merge_domains,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_overrides_file_and_defaults() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("s.toml");
        std::fs::write(
            &file,
            "grpc_addr = \"127.0.0.1:9001\"\nshadow_mode = true\nrules = [\"a.yaml\"]\n",
        )
        .expect("write");
        let env = vec![
            (
                "LEASEHOLD_GRPC_ADDR".to_string(),
                "127.0.0.1:9002".to_string(),
            ),
            ("LEASEHOLD_RULES".to_string(), "x.yaml,y".to_string()),
            ("OTHER".to_string(), "1".to_string()),
            // Names the file (the CLI reads it); must not be taken for a key.
            ("LEASEHOLD_SETTINGS".to_string(), file.display().to_string()),
        ];
        let s = Settings::load(Some(&file), env).expect("load");
        assert_eq!(s.grpc_addr, "127.0.0.1:9002".parse().expect("addr"));
        assert!(s.shadow_mode);
        assert_eq!(s.rules, vec![PathBuf::from("x.yaml"), PathBuf::from("y")]);
        assert_eq!(s.http_addr, Settings::default().http_addr);
    }

    #[test]
    fn kubernetes_service_links_are_not_settings_and_values_keep_their_text() {
        let vars = [
            ("LEASEHOLD_SERVICE_HOST", "10.0.0.7"),
            ("LEASEHOLD_SERVICE_PORT", "8081"),
            ("LEASEHOLD_SERVICE_PORT_GRPC", "8081"),
            ("LEASEHOLD_PORT", "tcp://10.0.0.7:8081"),
            ("LEASEHOLD_PORT_8081_TCP", "tcp://10.0.0.7:8081"),
            ("LEASEHOLD_PORT_8081_TCP_PROTO", "tcp"),
            ("LEASEHOLD_PORT_8081_TCP_PORT", "8081"),
            ("LEASEHOLD_PORT_8081_TCP_ADDR", "10.0.0.7"),
            ("LEASEHOLD_REDIS_SERVICE_HOST", "10.0.0.8"),
            ("LEASEHOLD_REDIS_SERVICE_PORT_REDIS", "6379"),
            ("LEASEHOLD_REDIS_PORT", "tcp://10.0.0.8:6379"),
            ("LEASEHOLD_REDIS_PORT_6379_TCP_PROTO", "tcp"),
            ("LEASEHOLD_ADMIN_PORT_9090_UDP", "udp://10.0.0.9:9090"),
            ("LEASEHOLD_REPLICA_ID", "007"),
            ("LEASEHOLD_REDIS_POOL_SIZE", "8"),
            ("LEASEHOLD_LEASE_MIN_SHARE", "0.05"),
            ("LEASEHOLD_SHADOW_MODE", "true"),
            ("LEASEHOLD_RULES", "a.yaml,b"),
        ];
        let env = vars.iter().map(|(k, v)| (k.to_string(), v.to_string()));
        let s = Settings::load(None, env).expect("service links are ignored");
        assert_eq!(s.replica_id.as_deref(), Some("007"), "not coerced to 7");
        assert_eq!(s.redis_pool_size, 8);
        assert_eq!(s.lease_min_share, 0.05);
        assert!(s.shadow_mode);
        assert_eq!(s.rules, vec![PathBuf::from("a.yaml"), PathBuf::from("b")]);
        let ignored =
            ignored_service_links(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        assert_eq!(ignored.len(), 13, "{ignored:?}");
        assert!(!ignored.iter().any(|k| k == "LEASEHOLD_REPLICA_ID"));
        let typo = vec![("LEASEHOLD_REDIS_POOL".to_string(), "8".to_string())];
        let e = Settings::load(None, typo).expect_err("an unknown setting");
        assert!(e.to_string().contains("redis_pool"), "{e}");
        let bad = vec![("LEASEHOLD_REDIS_POOL_SIZE".to_string(), "many".to_string())];
        assert!(Settings::load(None, bad).is_err(), "not a number");
    }

    #[test]
    fn defaults_keep_values_and_adjustments_private() {
        let s = Settings::default();
        assert!(s.admin_addr.ip().is_loopback(), "{}", s.admin_addr);
        assert!(!s.json_allow_adjustments);
        assert!(s.grpc_allow_adjustments, "Envoy's own refunds work");
        assert!(s.max_request_bytes >= 4 * 60 * 1024);
        assert!(s.http_header_timeout_ms <= 30_000, "slow headers end");
    }

    #[test]
    fn grpc_threads_are_bounded_and_zero_means_one_per_cpu() {
        let env = |v: &str| vec![("LEASEHOLD_GRPC_THREADS".to_string(), v.to_string())];
        let with = |v: &str| {
            let mut s = Settings::load(None, env(v)).expect("a number");
            s.rules = vec!["r".into()];
            s
        };
        assert_eq!(with("0").grpc_threads, 0);
        assert!(with("0").validate().is_ok());
        assert!(with("3").validate().is_ok());
        assert!(with("100000")
            .validate()
            .is_err_and(|e| e.to_string().contains("grpc_threads")));
    }

    #[test]
    fn tls_settings_come_in_pairs_and_need_their_transport() {
        let base = Settings {
            rules: vec!["r".into()],
            ..Settings::default()
        };
        let cert_only = Settings {
            grpc_tls_cert: Some("c.pem".into()),
            ..base.clone()
        };
        assert!(cert_only
            .validate()
            .is_err_and(|e| e.to_string().contains("grpc_tls_key")));
        let ca_only = Settings {
            grpc_tls_client_ca: Some("ca.pem".into()),
            ..base.clone()
        };
        assert!(ca_only.validate().is_err());
        let redis_plain = Settings {
            redis_url: Some("redis://127.0.0.1:6379".into()),
            redis_tls_ca: Some("ca.pem".into()),
            ..base.clone()
        };
        assert!(redis_plain
            .validate()
            .is_err_and(|e| e.to_string().contains("rediss://")));
        let redis_tls = Settings {
            redis_url: Some("rediss://127.0.0.1:6379".into()),
            ..redis_plain
        };
        assert!(redis_tls.validate().is_ok());
    }

    #[test]
    fn unknown_and_invalid_settings_are_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("s.toml");
        std::fs::write(&file, "grpc_adr = \"127.0.0.1:9001\"\n").expect("write");
        let e = Settings::load(Some(&file), Vec::new()).expect_err("unknown key");
        assert!(e.to_string().contains("grpc_adr"), "{e}");
        let s = Settings {
            rules: vec!["r".into()],
            log_format: "xml".into(),
            ..Settings::default()
        };
        assert!(s
            .validate()
            .expect_err("bad format")
            .to_string()
            .contains("log_format"));
    }
}
