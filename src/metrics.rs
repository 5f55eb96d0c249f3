//! Metric names, labels and units in one place, exposed on GET /metrics in
//! the Prometheus text format (the `prometheus` crate's encoder). Request
//! metrics are recorded as decisions happen; engine facts (breaker, members,
//! ledger, replay) are read from the engine at scrape time, so the two views
//! (/status and /metrics) cannot disagree.

use std::collections::HashSet;

use parking_lot::Mutex;
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::engine::EngineStatus;

/// Label value for domains that are not configured, and for detailed
/// series past the cap.
pub const UNKNOWN: &str = "unknown";
pub const OVERFLOW: &str = "overflow";

const LATENCY_BUCKETS: &[f64] = &[
    0.000_1, 0.000_25, 0.000_5, 0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.1, 0.25, 1.0,
];

pub struct Metrics {
    registry: Registry,
    decisions: IntCounterVec,
    hits: IntCounterVec,
    near_limit: IntCounterVec,
    detailed: IntCounterVec,
    detailed_series: Mutex<HashSet<String>>,
    detailed_cap: usize,
    /// Values in detailed labels are hashed (`redact_values`).
    redact: bool,
    decision_seconds: HistogramVec,
    requests: IntCounterVec,
    reloads: IntCounterVec,
    rules_info: IntGaugeVec,
    breaker_state: IntGaugeVec,
    breaker_transitions: IntCounter,
    live_members: IntGauge,
    tracked_keys: IntGauge,
    keys_to_replay: IntGauge,
    unreplayed_hits: IntGauge,
    suspect_keys: IntGauge,
    dropped_usage: IntCounter,
    memory_bytes: IntGauge,
    memory_evictions: IntCounter,
    replay_runs: IntCounter,
    replay_entries: IntCounter,
    redis_failures: IntCounter,
    unanswered_denials: IntCounter,
    wrong_denials: IntCounter,
    cache_refuted: IntCounter,
    redis_call_seconds: Histogram,
    replay_seconds: prometheus::Counter,
    lease_members: IntGauge,
    redis_nodes: IntGaugeVec,
    redis_node_failures: IntCounterVec,
    cross_slot: IntCounterVec,
    repairs_raised: IntCounter,
    redis_hz: IntGauge,
    clients_restarted: IntCounter,
}

fn counter_vec(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntCounterVec> {
    let c = IntCounterVec::new(Opts::new(name, help), labels)?;
    r.register(Box::new(c.clone()))?;
    Ok(c)
}

fn counter(r: &Registry, name: &str, help: &str) -> prometheus::Result<IntCounter> {
    let c = IntCounter::new(name, help)?;
    r.register(Box::new(c.clone()))?;
    Ok(c)
}

fn gauge(r: &Registry, name: &str, help: &str) -> prometheus::Result<IntGauge> {
    let g = IntGauge::new(name, help)?;
    r.register(Box::new(g.clone()))?;
    Ok(g)
}

/// Raises a counter that mirrors an engine count to `to`.
fn mirror(c: &IntCounter, to: u64) {
    let now = c.get();
    if to > now {
        c.inc_by(to - now);
    }
}

/// Longest detailed label value, in bytes.
pub const MAX_LABEL_BYTES: usize = 256;

fn bound_label(label: &str) -> String {
    use sha2::{Digest as _, Sha256};
    let mut cut = MAX_LABEL_BYTES - 17;
    while !label.is_char_boundary(cut) {
        cut -= 1;
    }
    let digest = hex::encode(Sha256::digest(label.as_bytes()));
    format!("{}~{}", &label[..cut], &digest[..16])
}

impl Metrics {
    /// `detailed_cap`: most distinct series of `leasehold_limit_decisions_total`
    /// (rules with `detailed_metric`); values past it share one series labelled
    /// `overflow`, so request values can never grow the exposition unboundedly.
    pub fn new(detailed_cap: usize) -> prometheus::Result<Metrics> {
        let r = Registry::new();
        let decision_seconds = HistogramVec::new(
            HistogramOpts::new(
                "leasehold_decision_duration_seconds",
                "Time to decide one ShouldRateLimit request, by deciding path.",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["path"],
        )?;
        r.register(Box::new(decision_seconds.clone()))?;
        let redis_call_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "leasehold_redis_call_duration_seconds",
                "Latency of Redis decision calls, failed and late ones included.",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
        )?;
        r.register(Box::new(redis_call_seconds.clone()))?;
        let build = IntGaugeVec::new(
            Opts::new(
                "leasehold_build_info",
                "Build information; the value is always 1.",
            ),
            &["version"],
        )?;
        r.register(Box::new(build.clone()))?;
        build.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        let rules_info = IntGaugeVec::new(
            Opts::new(
                "leasehold_rules_info",
                "The loaded rules' hash; the value is always 1.",
            ),
            &["hash"],
        )?;
        r.register(Box::new(rules_info.clone()))?;
        let breaker_state = IntGaugeVec::new(
            Opts::new(
                "leasehold_breaker_state",
                "1 for the breaker's current state (healthy, tripped, probing), 0 otherwise.",
            ),
            &["state"],
        )?;
        r.register(Box::new(breaker_state.clone()))?;
        let redis_nodes = IntGaugeVec::new(
            Opts::new(
                "leasehold_redis_node_up",
                "Redis nodes as this replica sees them (mode standalone, cluster or sentinel; role primary or sentinel): 1 when a connection to it is up.",
            ),
            &["mode", "node", "role"],
        )?;
        r.register(Box::new(redis_nodes.clone()))?;
        Ok(Metrics {
            decisions: counter_vec(&r, "leasehold_decisions_total", "Descriptor decisions by domain, outcome (ok, over_limit, shadow) and deciding path (memory, redis, local, none).", &["domain", "outcome", "path"])?,
            hits: counter_vec(&r, "leasehold_hits_total", "Hits asked for by limited descriptors, by domain and path.", &["domain", "path"])?,
            near_limit: counter_vec(&r, "leasehold_near_limit_total", "Admitted descriptors that left less than 20% of their limit, by domain.", &["domain"])?,
            detailed: counter_vec(&r, "leasehold_limit_decisions_total", "Decisions per limit for rules with detailed_metric (capped; see the overflow series).", &["domain", "limit", "outcome"])?,
            detailed_series: Mutex::new(HashSet::new()),
            detailed_cap,
            redact: false,
            decision_seconds,
            requests: counter_vec(&r, "leasehold_requests_total", "ShouldRateLimit requests by result (ok, over_limit, invalid, error).", &["result"])?,
            reloads: counter_vec(&r, "leasehold_rules_reloads_total", "Rules loads by result (success, failure).", &["result"])?,
            rules_info,
            breaker_state,
            breaker_transitions: counter(&r, "leasehold_breaker_transitions_total", "Breaker state changes.")?,
            live_members: gauge(&r, "leasehold_live_members", "Live replicas sharing the limits, as last seen in Redis.")?,
            tracked_keys: gauge(&r, "leasehold_ledger_keys", "Keys tracked by the replay ledger.")?,
            keys_to_replay: gauge(&r, "leasehold_ledger_keys_to_replay", "Keys with usage Redis has not confirmed yet.")?,
            unreplayed_hits: gauge(&r, "leasehold_unreplayed_hits", "Lease grants Redis has not confirmed yet.")?,
            suspect_keys: gauge(&r, "leasehold_suspect_keys", "Keys decided locally until a fenced repair.")?,
            dropped_usage: counter(&r, "leasehold_dropped_usage_hits_total", "Unreplayed usage dropped because the ledger was full.")?,
            memory_bytes: gauge(&r, "leasehold_memory_bytes", "Estimated bytes of the in-memory counters (capped by memory_max_bytes).")?,
            memory_evictions: counter(&r, "leasehold_memory_evictions_total", "Live in-memory counters evicted to stay within memory_max_bytes (an evicted key starts again from zero).")?,
            replay_runs: counter(&r, "leasehold_replay_runs_total", "Replay calls that Redis confirmed.")?,
            replay_entries: counter(&r, "leasehold_replay_entries_total", "(key, window) fields written by replay.")?,
            redis_failures: counter(&r, "leasehold_redis_failures_total", "Redis decision calls that failed or missed the deadline.")?,
            unanswered_denials: counter(&r, "leasehold_unanswered_denials_total", "Requests denied because Redis, though answering, did not answer them within the budget.")?,
            wrong_denials: counter(&r, "leasehold_wrong_denials_total", "Unanswered denials that Redis admitted when their reply came (their counts are taken back).")?,
            cache_refuted: counter(&r, "leasehold_over_cache_refuted_total", "Over-limit cache entries a later Redis reply showed were no longer true (a refund on another replica, or Redis lost data).")?,
            redis_call_seconds,
            replay_seconds: {
                let c = prometheus::Counter::new("leasehold_replay_duration_seconds_total", "Time spent in replay calls.")?;
                r.register(Box::new(c.clone()))?;
                c
            },
            lease_members: gauge(&r, "leasehold_lease_members", "Replicas each limit is split across for local leases (a replica's default share is 1/this).")?,
            redis_nodes,
            redis_node_failures: counter_vec(&r, "leasehold_redis_node_failures_total", "Redis calls that failed, by the node they were bound for.", &["node"])?,
            cross_slot: counter_vec(&r, "leasehold_cross_slot_requests_total", "Requests whose counters were in several Redis Cluster slots (decided per slot), and those whose charges were taken back because one slot denied (result taken_back).", &["result"])?,
            repairs_raised: counter(&r, "leasehold_redis_repairs_raised_total", "Repairs that found this replica's count in Redis below what it had confirmed (writes Redis lost, e.g. in a failover), and restored it.")?,
            redis_hz: gauge(&r, "leasehold_redis_hz", "Redis's configured hz as last read (0 until read): its expiry cycle can hold Redis up to 250/hz ms at once, and a call waits behind it; at the default 10 that is 25 ms, past the default 15 ms budget.")?,
            clients_restarted: counter(&r, "leasehold_redis_clients_restarted_total", "Redis pool clients that stopped (a Cluster redirection they could not follow) and were started again.")?,
            registry: r,
        })
    }

    /// The histogram the engine records Redis call latency in.
    pub fn redis_call_histogram(&self) -> Histogram {
        self.redis_call_seconds.clone()
    }

    pub fn request(&self, result: &str) {
        self.requests.with_label_values(&[result]).inc();
    }

    pub fn decision_latency(&self, path: &str, seconds: f64) {
        self.decision_seconds
            .with_label_values(&[path])
            .observe(seconds);
    }

    /// One limited descriptor's decision.
    pub fn descriptor(&self, domain: &str, outcome: &str, path: &str, hits: u64, near: bool) {
        self.decisions
            .with_label_values(&[domain, outcome, path])
            .inc();
        self.hits.with_label_values(&[domain, path]).inc_by(hits);
        if near {
            self.near_limit.with_label_values(&[domain]).inc();
        }
    }

    /// Descriptors of a request for a domain that is not configured.
    pub fn descriptor_unknown_domain(&self, n: usize) {
        self.decisions
            .with_label_values(&[UNKNOWN, "ok", "none"])
            .inc_by(n as u64);
    }

    /// Detailed labels show each value as its short hash (`redact_values`).
    pub fn with_redaction(mut self, redact: bool) -> Self {
        self.redact = redact;
        self
    }

    /// A request value as a detailed label shows it.
    pub fn label_value(&self, value: &str) -> String {
        if self.redact {
            crate::redact::value(value)
        } else {
            value.to_owned()
        }
    }

    /// A decision of a rule with `detailed_metric`, labelled by its full
    /// key with the request's values (each through [`Metrics::label_value`]),
    /// up to the cap; a label over [`MAX_LABEL_BYTES`] keeps its start and
    /// ends in a hash of the whole, so distinct ones stay distinct.
    pub fn detailed(&self, domain: &str, limit: &str, outcome: &str) {
        let bounded;
        let limit = if limit.len() > MAX_LABEL_BYTES {
            bounded = bound_label(limit);
            bounded.as_str()
        } else {
            limit
        };
        let label = {
            let mut seen = self.detailed_series.lock();
            if seen.contains(limit) || seen.len() < self.detailed_cap {
                seen.insert(limit.to_owned());
                limit
            } else {
                OVERFLOW
            }
        };
        self.detailed
            .with_label_values(&[domain, label, outcome])
            .inc();
    }

    pub fn reload(&self, ok: bool, hash: &str) {
        self.reloads
            .with_label_values(&[if ok { "success" } else { "failure" }])
            .inc();
        if ok {
            self.rules_info.reset();
            self.rules_info.with_label_values(&[hash]).set(1);
        }
    }

    /// The Redis topology and cross-slot counts from the Redis section of
    /// /status.
    fn redis_facts(&self, redis: &serde_json::Value) {
        let topology = &redis["topology"];
        let mode = topology["mode"].as_str().unwrap_or("unknown");
        self.redis_nodes.reset();
        for node in topology["nodes"].as_array().into_iter().flatten() {
            let name = node["node"].as_str().unwrap_or("unknown");
            let role = node["role"].as_str().unwrap_or("unknown");
            self.redis_nodes
                .with_label_values(&[mode, name, role])
                .set(i64::from(node["connected"] == true));
            if let Some(f) = node["failures"].as_u64() {
                mirror(&self.redis_node_failures.with_label_values(&[name]), f);
            }
        }
        if let Some(n) = redis["repairs_raised"].as_u64() {
            mirror(&self.repairs_raised, n);
        }
        self.redis_hz.set(redis["hz"].as_i64().unwrap_or(0));
        if let Some(n) = topology["clients_restarted"].as_u64() {
            mirror(&self.clients_restarted, n);
        }
        for (result, field) in [
            ("decided", "cross_slot_requests"),
            ("taken_back", "cross_slot_refunds"),
        ] {
            if let Some(n) = redis[field].as_u64() {
                mirror(&self.cross_slot.with_label_values(&[result]), n);
            }
        }
    }

    /// The exposition, with engine facts read now (only the resilient
    /// engine has a breaker, a ledger and replays; elsewhere they stay 0).
    pub fn render(&self, status: &EngineStatus) -> String {
        if let EngineStatus::Memory {
            tracked_bytes,
            evictions,
            ..
        } = status
        {
            self.memory_bytes.set(*tracked_bytes as i64);
            mirror(&self.memory_evictions, *evictions);
        }
        if let EngineStatus::Resilient(r) = status {
            for s in ["healthy", "tripped", "probing", "settling"] {
                self.breaker_state
                    .with_label_values(&[s])
                    .set(i64::from(s == r.breaker.state));
            }
            mirror(&self.breaker_transitions, r.breaker.transitions);
            self.live_members.set(r.live_members as i64);
            self.tracked_keys.set(r.ledger.tracked_keys as i64);
            self.keys_to_replay.set(r.ledger.keys_to_replay as i64);
            self.unreplayed_hits.set(r.ledger.unreplayed_hits);
            self.suspect_keys.set(r.ledger.suspect_keys as i64);
            mirror(&self.dropped_usage, r.ledger.dropped_usage);
            self.memory_bytes.set(r.ledger.lease_state_bytes as i64);
            mirror(&self.memory_evictions, r.ledger.lease_state_evictions);
            mirror(&self.replay_runs, r.replay.runs);
            mirror(&self.replay_entries, r.replay.entries);
            mirror(&self.redis_failures, r.decisions.redis_failures);
            mirror(&self.unanswered_denials, r.decisions.unanswered_denials);
            mirror(&self.wrong_denials, r.decisions.wrong_denials);
            mirror(&self.cache_refuted, r.decisions.cache_refuted);
            let seen = self.replay_seconds.get();
            if r.replay.seconds > seen {
                self.replay_seconds.inc_by(r.replay.seconds - seen);
            }
            self.lease_members.set(r.members_for_leases as i64);
            self.redis_facts(&r.redis);
        } else {
            for gauge in [
                &self.live_members,
                &self.tracked_keys,
                &self.keys_to_replay,
                &self.unreplayed_hits,
                &self.suspect_keys,
                &self.lease_members,
                &self.redis_hz,
            ] {
                gauge.set(0);
            }
        }
        let mut out = Vec::new();
        if TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .is_err()
        {
            return String::new();
        }
        String::from_utf8(out).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detailed_labels_are_bounded_distinct_and_redactable() {
        let m = Metrics::new(10).expect("metrics");
        let a = format!("edge.user_{}", "é".repeat(400));
        let b = format!("edge.user_{}x", "é".repeat(400));
        m.detailed("edge", &a, "ok");
        m.detailed("edge", &b, "ok");
        let text = m.registry.gather();
        let labels: Vec<String> = text
            .iter()
            .filter(|f| f.name() == "leasehold_limit_decisions_total")
            .flat_map(|f| f.get_metric().iter())
            .filter_map(|s| {
                s.get_label()
                    .iter()
                    .find(|l| l.name() == "limit")
                    .map(|l| l.value().to_owned())
            })
            .collect();
        assert_eq!(labels.len(), 2, "{labels:?}");
        assert_ne!(labels[0], labels[1]);
        assert!(
            labels.iter().all(|l| l.len() <= MAX_LABEL_BYTES),
            "{labels:?}"
        );
        let hidden = Metrics::new(10).expect("metrics").with_redaction(true);
        assert_eq!(hidden.label_value("secret"), crate::redact::value("secret"));
        assert_eq!(m.label_value("secret"), "secret");
    }
}
