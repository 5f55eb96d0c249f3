//! The failover demonstration: load through Envoy and nginx, Redis killed
//! part-way and started again (empty), a per-second timeline of what clients
//! saw and what the replicas did, a verdict against the guarantees of
//! `docs/guarantees.md` (G5) and an SVG chart of admitted calls per window
//! against the limit.
//!
//! The verdict ([`judge`]) is computed from the raw samples, the replicas'
//! /status and Redis itself: admitted per window within the bounds (G5.2,
//! G5.0), no client errors (G5.8), no fail-open (G1.3), and after recovery
//! each window's Redis count equal to what clients were granted in it
//! (G5.7). [`report`] renders it.

mod judge;
mod report;

use report::{header, row};
pub use report::{svg, timeline, verdict};

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;
use tokio::sync::mpsc;

use super::deploy::REPLICAS;
use super::load::{unix_ms, Load, LoadSpec, Sample, Seen};
use super::runner::{Topology, REDIS};
use judge::judge;

/// The demo's shape.
#[derive(Debug, Clone)]
pub struct FailoverOptions {
    /// Seconds of load before Redis is killed.
    pub before_s: u64,
    /// Seconds Redis stays down.
    pub outage_s: u64,
    /// Seconds of load after Redis is back.
    pub after_s: u64,
    pub envoy_rate: u32,
    pub nginx_rate: u32,
    /// Print timeline rows as they happen.
    pub live: bool,
}

impl Default for FailoverOptions {
    fn default() -> Self {
        FailoverOptions {
            before_s: 5,
            outage_s: 8,
            after_s: 7,
            envoy_rate: 200,
            nginx_rate: 100,
            live: true,
        }
    }
}

/// The limit the demo drives: `user` in domain `edge`, per second
/// (deploy/rules/edge.yaml).
pub const LIMIT: u64 = 100;
pub const UNIT_MS: u64 = 1000;
pub const USER: &str = "demo";

/// What each replica reported in one second.
#[derive(Debug, Clone, Serialize, Default)]
pub struct ReplicaView {
    pub path: String,
    pub breaker: String,
    pub redis_decisions: u64,
    pub local_decisions: u64,
    pub unreplayed_hits: u64,
}

/// One second of the timeline.
#[derive(Debug, Clone, Serialize)]
pub struct Second {
    /// Window start, unix ms.
    pub window_ms: u64,
    /// Seconds since the load started.
    pub t: u64,
    pub redis_up: bool,
    pub admitted: u64,
    pub denied: u64,
    pub fail_open: u64,
    pub errors: u64,
    /// HTTP calls that straddled a window boundary (attribution uncertain).
    pub uncertain: u64,
    /// Decisions made in this second on each path, over all replicas.
    pub redis_decisions: u64,
    pub local_decisions: u64,
    pub replicas: Vec<ReplicaView>,
    /// Replicas Envoy's gRPC health checks counted healthy at the window's end.
    pub envoy_healthy: Option<u64>,
    /// The phase used for the verdict: before, outage, recovery, after.
    pub phase: String,
    /// Redis's count for this window after recovery.
    pub redis_count: Option<u64>,
}

/// One line of the verdict.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: String,
    pub pass: bool,
    pub detail: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub limit: u64,
    pub kill_ms: u64,
    pub restart_ms: u64,
    pub seconds: Vec<Second>,
    pub checks: Vec<Check>,
    pub pass: bool,
    pub total_admitted: u64,
    pub total_redis: u64,
    pub replicas_seen: Vec<String>,
    #[serde(skip)]
    pub samples: Vec<Sample>,
}

/// Runs the demonstration on a started topology (replicas started with a long
/// `redis_expiry_margin_ms`, so every window of the run is still in Redis for
/// the final comparison).
pub async fn failover(topo: &mut Topology, opts: &FailoverOptions) -> anyhow::Result<Report> {
    let spec = LoadSpec {
        envoy_url: format!("http://127.0.0.1:{}", topo.ports.envoy),
        nginx_uri: format!("http://127.0.0.1:{}", topo.ports.nginx),
        domain: "edge".into(),
        user: USER.into(),
        path: "/hello".into(),
        envoy_rate: opts.envoy_rate,
        nginx_rate: opts.nginx_rate,
        workers: 8,
        unit_ms: UNIT_MS,
    };
    let (tap, mut tapped) = mpsc::unbounded_channel();
    let start_ms = unix_ms();
    let load = Load::start(spec, Some(tap));
    let mut views: BTreeMap<u64, Vec<ReplicaView>> = BTreeMap::new();
    let mut envoy: BTreeMap<u64, Option<u64>> = BTreeMap::new();
    let mut live = LiveTable::default();
    let total = opts.before_s + opts.outage_s + opts.after_s;
    let mut kill_ms = 0;
    let mut restart_ms = 0;
    if opts.live {
        println!("{}", header());
    }
    // Tick just after each window boundary, so each /status difference
    // covers one window.
    let base = (start_ms / UNIT_MS + 1) * UNIT_MS;
    sleep_until(base + 50).await;
    let mut prev = snapshot(topo).await;
    for t in 1..=total {
        sleep_until(base + t * UNIT_MS + 50).await;
        let now = snapshot(topo).await;
        views.insert(base + (t - 1) * UNIT_MS, diff(Some(&prev), &now));
        envoy.insert(
            base + (t - 1) * UNIT_MS,
            topo.envoy_healthy_replicas().await,
        );
        prev = now;
        if t == opts.before_s {
            kill_ms = unix_ms();
            topo.kill9(REDIS).await?;
        }
        if t == opts.before_s + opts.outage_s {
            restart_ms = unix_ms();
            topo.launch(REDIS).await?;
        }
        while let Ok(s) = tapped.try_recv() {
            live.count(&s);
        }
        if opts.live {
            let outage = (kill_ms, restart_ms);
            live.print_ready(start_ms, outage, &views, &envoy);
        }
    }
    let samples = load.finish().await;
    let settled_at = unix_ms();
    let settled = settle(topo).await;
    let settle_ms = unix_ms() - settled_at;
    let redis_counts = redis_counts(topo).await?;
    let mut report = judge(samples, views, redis_counts, start_ms, kill_ms, restart_ms);
    for s in &mut report.seconds {
        s.envoy_healthy = envoy.get(&s.window_ms).copied().flatten();
    }
    report.checks.push(envoy_health_check(&report.seconds));
    report.checks.push(Check {
        name: "Every replica back on Redis with nothing left to replay".into(),
        pass: settled,
        detail: if settled {
            format!("{settle_ms} ms after the load stopped")
        } else {
            "not within 30 s".into()
        },
    });
    report.pass = report.checks.iter().all(|c| c.pass);
    Ok(report)
}

/// gRPC health stays SERVING through the outage: Envoy never takes a
/// replica out because Redis is down.
fn envoy_health_check(seconds: &[Second]) -> Check {
    let unhealthy: Vec<String> = seconds
        .iter()
        .filter(|s| s.envoy_healthy.is_some_and(|n| n < REPLICAS as u64))
        .map(|s| format!("t={}: {:?}", s.t, s.envoy_healthy))
        .collect();
    let polled = seconds.iter().filter(|s| s.envoy_healthy.is_some()).count();
    Check {
        name: "Envoy's health checks kept every replica in (SERVING through the outage)".into(),
        pass: unhealthy.is_empty() && polled > 0,
        detail: if unhealthy.is_empty() {
            format!("{polled} seconds with {REPLICAS}/{REPLICAS} healthy")
        } else {
            unhealthy.join(", ")
        },
    }
}

/// The live table of `--live`: calls counted per window as they come back
/// (admitted, denied, fail-open, errors), each row printed once complete.
#[derive(Default)]
struct LiveTable {
    counts: BTreeMap<u64, [u64; 4]>,
    printed: u64,
}

impl LiveTable {
    fn count(&mut self, s: &Sample) {
        let (w, _) = s.window(UNIT_MS);
        let c = self.counts.entry(w).or_default();
        match s.seen {
            Seen::Admitted => c[0] += 1,
            Seen::Denied => c[1] += 1,
            Seen::FailOpen => c[2] += 1,
            Seen::Error(_) => c[3] += 1,
        }
    }

    /// Prints the windows before last: their calls have all come back.
    fn print_ready(
        &mut self,
        start_ms: u64,
        (kill_ms, restart_ms): (u64, u64),
        views: &BTreeMap<u64, Vec<ReplicaView>>,
        envoy: &BTreeMap<u64, Option<u64>>,
    ) {
        let ready: Vec<u64> = self
            .counts
            .keys()
            .copied()
            .filter(|w| *w + 2 * UNIT_MS <= unix_ms() && *w > self.printed)
            .collect();
        for w in ready {
            let v = views.get(&w).cloned().unwrap_or_default();
            let redis_up =
                !(kill_ms > 0 && w + UNIT_MS > kill_ms && (restart_ms == 0 || w < restart_ms));
            let t = w.saturating_sub(start_ms / UNIT_MS * UNIT_MS) / UNIT_MS;
            let healthy = envoy.get(&w).copied().flatten();
            println!("{}", row(t, redis_up, self.counts[&w], healthy, &v));
            self.printed = w;
        }
    }
}

async fn sleep_until(unix: u64) {
    let now = unix_ms();
    if unix > now {
        tokio::time::sleep(Duration::from_millis(unix - now)).await;
    }
}

/// Every replica's /status now (cumulative counters).
async fn snapshot(topo: &Topology) -> Vec<ReplicaView> {
    let mut out = Vec::new();
    for r in &topo.ports.replicas {
        let url = format!("http://127.0.0.1:{}/status", r.admin);
        let v = match topo.http().get(&url, &[]).await {
            Ok(r) => serde_json::from_str::<serde_json::Value>(&r.body).unwrap_or_default(),
            Err(_) => serde_json::Value::Null,
        };
        let e = &v["engine"];
        out.push(ReplicaView {
            path: e["path"].as_str().unwrap_or("down").to_string(),
            breaker: e["breaker"]["state"].as_str().unwrap_or("-").to_string(),
            redis_decisions: e["decisions"]["redis"].as_u64().unwrap_or(0),
            local_decisions: e["decisions"]["local"].as_u64().unwrap_or(0),
            unreplayed_hits: e["ledger"]["unreplayed_hits"].as_u64().unwrap_or(0),
        });
    }
    out
}

fn diff(prev: Option<&Vec<ReplicaView>>, now: &[ReplicaView]) -> Vec<ReplicaView> {
    now.iter()
        .enumerate()
        .map(|(i, n)| {
            let p = prev.and_then(|p| p.get(i));
            ReplicaView {
                redis_decisions: n
                    .redis_decisions
                    .saturating_sub(p.map_or(0, |p| p.redis_decisions)),
                local_decisions: n
                    .local_decisions
                    .saturating_sub(p.map_or(0, |p| p.local_decisions)),
                ..n.clone()
            }
        })
        .collect()
}

/// Waits (bounded) until every replica decides on Redis again with nothing
/// left to replay; false when they did not within 30 s.
async fn settle(topo: &Topology) -> bool {
    let deadline = unix_ms() + 30_000;
    while unix_ms() < deadline {
        let s = snapshot(topo).await;
        if s.iter()
            .all(|r| r.path == "redis" && r.breaker == "healthy" && r.unreplayed_hits == 0)
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    false
}

/// Redis's total per window (start unix ms) of the demo's counter: the sum of
/// every replica's fields (`<idx>` Redis-path counts, `o<idx>` lease grants).
async fn redis_counts(topo: &Topology) -> anyhow::Result<BTreeMap<u64, u64>> {
    let key = crate::key::CounterKey::new(
        "edge",
        [("user", USER)],
        &crate::limit::LimitSpec::fixed(LIMIT as u32, crate::limit::Unit::Second),
    );
    // The topology uses the default key prefix.
    let prefix = crate::settings::Settings::default().redis_prefix;
    let url = format!("redis://127.0.0.1:{}", topo.ports.redis);
    let totals = crate::redis::inspect::window_totals(&url, &prefix, &key, Duration::from_secs(10))
        .await
        .map_err(anyhow::Error::msg)?;
    Ok(totals
        .into_iter()
        .map(|(w, total)| (w * UNIT_MS, total.max(0) as u64))
        .collect())
}
