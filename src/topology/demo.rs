//! The failover demonstration: load through Envoy and nginx, Redis killed
//! part-way and started again (empty), a per-second timeline of what clients
//! saw and what the replicas did, a verdict against design.md §5 and an SVG
//! chart of admitted calls per window against the limit.
//!
//! The verdict is computed from the raw samples, the replicas' /status and
//! Redis itself: admitted per window within the §5 bounds, no client errors,
//! no fail-open, and after recovery each window's Redis count equal to what
//! clients were granted in it.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use fred::prelude::*;
use serde::Serialize;
use tokio::sync::mpsc;

use super::load::{unix_ms, Load, LoadSpec, Sample, Seen};
use super::{Topology, REDIS};
use crate::deploy::REPLICAS;

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
    let mut live_counts: BTreeMap<u64, [u64; 4]> = BTreeMap::new();
    let total = opts.before_s + opts.outage_s + opts.after_s;
    let mut kill_ms = 0;
    let mut restart_ms = 0;
    let mut printed = 0u64;
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
            let (w, _) = s.window(UNIT_MS);
            let c = live_counts.entry(w).or_default();
            match s.seen {
                Seen::Admitted => c[0] += 1,
                Seen::Denied => c[1] += 1,
                Seen::FailOpen => c[2] += 1,
                Seen::Error(_) => c[3] += 1,
            }
        }
        if opts.live {
            // Print the second before last: its calls have all come back.
            let ready: Vec<u64> = live_counts
                .keys()
                .copied()
                .filter(|w| *w + 2 * UNIT_MS <= unix_ms() && *w > printed)
                .collect();
            for w in ready {
                let c = live_counts[&w];
                let v = views.get(&w).cloned().unwrap_or_default();
                let redis_up =
                    !(kill_ms > 0 && w + UNIT_MS > kill_ms && (restart_ms == 0 || w < restart_ms));
                println!(
                    "{}",
                    row(
                        (w.saturating_sub(start_ms / UNIT_MS * UNIT_MS)) / UNIT_MS,
                        redis_up,
                        c,
                        envoy.get(&w).copied().flatten(),
                        &v
                    )
                );
                printed = w;
            }
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
    // gRPC health stays SERVING through the outage: Envoy never takes a
    // replica out because Redis is down.
    let unhealthy: Vec<String> = report
        .seconds
        .iter()
        .filter(|s| s.envoy_healthy.is_some_and(|n| n < REPLICAS as u64))
        .map(|s| format!("t={}: {:?}", s.t, s.envoy_healthy))
        .collect();
    let polled = report
        .seconds
        .iter()
        .filter(|s| s.envoy_healthy.is_some())
        .count();
    report.checks.push(Check {
        name: "Envoy's health checks kept every replica in (SERVING through the outage)".into(),
        pass: unhealthy.is_empty() && polled > 0,
        detail: if unhealthy.is_empty() {
            format!("{polled} seconds with {REPLICAS}/{REPLICAS} healthy")
        } else {
            unhealthy.join(", ")
        },
    });
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

async fn sleep_until(unix: u64) {
    let now = unix_ms();
    if unix > now {
        tokio::time::sleep(Duration::from_millis(unix - now)).await;
    }
}

/// Every replica's /status now (cumulative counters).
async fn snapshot(topo: &Topology) -> Vec<ReplicaView> {
    let mut out = Vec::new();
    for (_, http) in &topo.ports.replicas {
        let url = format!("http://127.0.0.1:{http}/status");
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
    tokio::time::timeout(Duration::from_secs(10), read_counts(topo.ports.redis))
        .await
        .map_err(|_| anyhow::anyhow!("reading the counts from Redis timed out"))?
}

async fn read_counts(port: u16) -> anyhow::Result<BTreeMap<u64, u64>> {
    let config = Config::from_url(&format!("redis://127.0.0.1:{port}"))?;
    let client = Builder::from_config(config).build()?;
    client.init().await?;
    let key = crate::engine::CounterKey::new(
        "edge",
        [("user", USER)],
        &crate::limit::LimitSpec::fixed(LIMIT as u32, crate::limit::Unit::Second),
    );
    // The topology uses the default key prefix.
    let prefix = crate::settings::Settings::default().redis_prefix;
    let pattern = format!("{}@*", crate::redis::keys::counter_base(&prefix, &key));
    let keys: Vec<String> = client.custom(fred::cmd!("KEYS"), vec![pattern]).await?;
    let mut out = BTreeMap::new();
    for key in keys {
        let Some(w) = key.rsplit('@').next().and_then(|w| w.parse::<u64>().ok()) else {
            continue;
        };
        let fields: std::collections::HashMap<String, String> = client.hgetall(&key).await?;
        let total =
            crate::redis::keys::window_total(fields.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        out.insert(w * UNIT_MS, total.max(0) as u64);
    }
    let _ = client.quit().await;
    Ok(out)
}

fn judge(
    samples: Vec<Sample>,
    views: BTreeMap<u64, Vec<ReplicaView>>,
    redis: BTreeMap<u64, u64>,
    start_ms: u64,
    kill_ms: u64,
    restart_ms: u64,
) -> Report {
    let mut seconds: BTreeMap<u64, Second> = BTreeMap::new();
    let first = start_ms / UNIT_MS * UNIT_MS;
    let mut replicas_seen = std::collections::BTreeSet::new();
    let blank = |w: u64| Second {
        window_ms: w,
        t: w.saturating_sub(first) / UNIT_MS,
        redis_up: true,
        admitted: 0,
        denied: 0,
        fail_open: 0,
        errors: 0,
        uncertain: 0,
        redis_decisions: 0,
        local_decisions: 0,
        replicas: Vec::new(),
        envoy_healthy: None,
        phase: String::new(),
        redis_count: None,
    };
    for s in &samples {
        let (w, certain) = s.window(UNIT_MS);
        let e = seconds.entry(w).or_insert_with(|| blank(w));
        match s.seen {
            Seen::Admitted => e.admitted += 1,
            Seen::Denied => e.denied += 1,
            Seen::FailOpen => e.fail_open += 1,
            Seen::Error(_) => e.errors += 1,
        }
        // A call near a window edge may have been charged in either window:
        // both get a tolerance of one for it.
        if !certain && s.seen == Seen::Admitted {
            for c in s.candidates(UNIT_MS) {
                seconds.entry(c).or_insert_with(|| blank(c)).uncertain += 1;
            }
        }
        if let Some(r) = &s.replica {
            replicas_seen.insert(r.clone());
        }
    }
    // Breaker detection takes up to the deadline plus a probe interval; a
    // window is "outage" when Redis was down for all of it and at least one
    // second had passed since the kill.
    for (w, s) in seconds.iter_mut() {
        let end = w + UNIT_MS;
        s.redis_up = end <= kill_ms || *w >= restart_ms;
        s.phase = if end <= kill_ms {
            "before".into()
        } else if *w >= kill_ms + 1000 && end <= restart_ms {
            "outage".into()
        } else if *w < restart_ms + 3000 {
            "transition".into()
        } else {
            "after".into()
        };
        if let Some(v) = views.get(w) {
            s.redis_decisions = v.iter().map(|r| r.redis_decisions).sum();
            s.local_decisions = v.iter().map(|r| r.local_decisions).sum();
            s.replicas = v.clone();
        }
        s.redis_count = redis.get(w).copied();
    }
    // The first and last windows are partly outside the load.
    let last = seconds.keys().next_back().copied();
    let judged: Vec<&Second> = seconds
        .values()
        .filter(|s| s.window_ms > first && Some(s.window_ms) != last)
        .collect();
    let mut checks = Vec::new();
    let l = LIMIT as f64;
    let bound = |name: &str, phase: &[&str], lo: f64, hi: f64| {
        let bad: Vec<String> = judged
            .iter()
            .filter(|s| phase.contains(&s.phase.as_str()))
            .filter(|s| {
                let slack = s.uncertain as f64;
                (s.admitted as f64) + slack < lo || (s.admitted as f64) - slack > hi
            })
            .map(|s| format!("t={} admitted {} (±{})", s.t, s.admitted, s.uncertain))
            .collect();
        let n = judged
            .iter()
            .filter(|s| phase.contains(&s.phase.as_str()))
            .count();
        Check {
            name: name.into(),
            pass: bad.is_empty() && n > 0,
            detail: if bad.is_empty() {
                format!("{n} windows within [{lo:.0}, {hi:.0}]")
            } else {
                bad.join(", ")
            },
        }
    };
    checks.push(bound(
        "Redis up: admitted ≤ L per window",
        &["before", "after"],
        0.0,
        l,
    ));
    checks.push(bound(
        "Redis down: admitted within [0.95 L, 1.05 L] per window",
        &["outage"],
        0.95 * l,
        1.05 * l,
    ));
    checks.push(bound(
        "Failing over and recovering: admitted ≤ 1.05 L per window",
        &["transition"],
        0.0,
        1.05 * l,
    ));
    let errors: Vec<String> = samples
        .iter()
        .filter_map(|s| match &s.seen {
            Seen::Error(e) => Some(format!("{:?}: {e}", s.via)),
            _ => None,
        })
        .take(5)
        .collect();
    checks.push(Check {
        name: "No client errors (no Envoy 5xx, no gRPC error through nginx)".into(),
        pass: errors.is_empty(),
        detail: if errors.is_empty() {
            format!("{} calls", samples.len())
        } else {
            errors.join("; ")
        },
    });
    let fail_open = samples.iter().filter(|s| s.seen == Seen::FailOpen).count();
    checks.push(Check {
        name: "Envoy never failed open (every call got a decision)".into(),
        pass: fail_open == 0,
        detail: format!("{fail_open} calls without a decision"),
    });
    let total_admitted = samples.iter().filter(|s| s.seen == Seen::Admitted).count() as u64;
    let run_windows: Vec<u64> = seconds.keys().copied().collect();
    let total_redis: u64 = run_windows.iter().filter_map(|w| redis.get(w)).sum();
    let window_mismatch: Vec<String> = seconds
        .values()
        .filter(|s| {
            let r = s.redis_count.unwrap_or(0);
            r.abs_diff(s.admitted) > s.uncertain
        })
        .map(|s| format!("t={} redis {:?} granted {}", s.t, s.redis_count, s.admitted))
        .collect();
    checks.push(Check {
        name: "After recovery Redis holds exactly the grants".into(),
        pass: total_redis == total_admitted && window_mismatch.is_empty(),
        detail: format!(
            "total: redis {total_redis}, granted {total_admitted}{}",
            if window_mismatch.is_empty() {
                "; every window matches".to_string()
            } else {
                format!("; windows off: {}", window_mismatch.join(", "))
            }
        ),
    });
    let pass = checks.iter().all(|c| c.pass);
    Report {
        limit: LIMIT,
        kill_ms,
        restart_ms,
        seconds: seconds.into_values().collect(),
        checks,
        pass,
        total_admitted,
        total_redis,
        replicas_seen: replicas_seen.into_iter().collect(),
        samples,
    }
}

fn header() -> String {
    let names: Vec<String> = (1..=REPLICAS).map(|i| format!("r{i}")).collect();
    format!(
        "{:>4}  {:<5} {:>8} {:>7} {:>9} {:>6}  {:>6} {:>6}  {:>5}  breakers ({})",
        "t",
        "redis",
        "admitted",
        "denied",
        "fail-open",
        "errors",
        "redis",
        "local",
        "envoy",
        names.join(" ")
    )
}

/// One timeline row. `counts`: admitted, denied, fail-open, errors;
/// `envoy`: replicas Envoy's health checks count healthy.
fn row(t: u64, redis_up: bool, counts: [u64; 4], envoy: Option<u64>, v: &[ReplicaView]) -> String {
    let breakers: Vec<&str> = v.iter().map(|r| r.breaker.as_str()).collect();
    format!(
        "{:>4}  {:<5} {:>8} {:>7} {:>9} {:>6}  {:>6} {:>6}  {:>5}  {}",
        t,
        if redis_up { "up" } else { "DOWN" },
        counts[0],
        counts[1],
        counts[2],
        counts[3],
        v.iter().map(|r| r.redis_decisions).sum::<u64>(),
        v.iter().map(|r| r.local_decisions).sum::<u64>(),
        envoy.map_or("-".to_string(), |n| format!("{n}/{REPLICAS}")),
        breakers.join(" ")
    )
}

/// The timeline as text: one row per second, then the verdict.
pub fn timeline(report: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{}", header());
    for s in &report.seconds {
        // ±n: admitted calls that were within 10 ms of a window edge and
        // may belong to this window or its neighbour.
        let _ = writeln!(
            out,
            "{}  {}{}",
            row(
                s.t,
                s.redis_up,
                [s.admitted, s.denied, s.fail_open, s.errors],
                s.envoy_healthy,
                &s.replicas
            ),
            s.phase,
            if s.uncertain > 0 {
                format!(" (±{} at a window edge)", s.uncertain)
            } else {
                String::new()
            }
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "{}", verdict(report));
    out
}

/// The verdict against design.md §5, one line per check.
pub fn verdict(report: &Report) -> String {
    let mut out = format!(
        "verdict against design.md §5 (limit L = {} per second, {} replicas): {}\n",
        report.limit,
        REPLICAS,
        if report.pass { "PASS" } else { "FAIL" }
    );
    for c in &report.checks {
        let _ = writeln!(
            out,
            "  [{}] {}: {}",
            if c.pass { "ok" } else { "FAIL" },
            c.name,
            c.detail
        );
    }
    let _ = writeln!(
        out,
        "  replicas that answered through nginx: {}",
        report.replicas_seen.join(", ")
    );
    out
}

/// Admitted per window against the limit, the outage shaded, as a
/// self-contained SVG.
pub fn svg(report: &Report) -> String {
    let (w, h) = (760.0, 300.0);
    let (left, right, top, bottom) = (50.0, 56.0, 44.0, 40.0);
    let n = report.seconds.len().max(1) as f64;
    let max_y = report
        .seconds
        .iter()
        .map(|s| s.admitted + s.denied)
        .max()
        .unwrap_or(0)
        .max(report.limit * 2) as f64;
    let plot_w = w - left - right;
    let plot_h = h - top - bottom;
    let x = |i: f64| left + plot_w * i / n;
    let y = |v: f64| top + plot_h * (1.0 - v / max_y);
    let first = report.seconds.first().map_or(0, |s| s.window_ms);
    let xt = |ms: u64| x((ms.saturating_sub(first)) as f64 / UNIT_MS as f64);
    let mut out = String::new();
    let _ = writeln!(
        out,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"##
    );
    let _ = writeln!(out, r##"<rect width="{w}" height="{h}" fill="#ffffff"/>"##);
    if report.kill_ms > 0 {
        let (x0, x1) = (
            xt(report.kill_ms),
            xt(report.restart_ms.max(report.kill_ms)),
        );
        let _ = writeln!(
            out,
            r##"<rect class="outage" x="{x0:.1}" y="{top}" width="{:.1}" height="{plot_h}" fill="#f4c7c3" opacity="0.6"/>"##,
            (x1 - x0).max(1.0)
        );
        let _ = writeln!(
            out,
            r##"<text x="{:.1}" y="{:.1}" fill="#a33">Redis down (killed, then started empty)</text>"##,
            x0,
            top - 6.0
        );
    }
    let bar = plot_w / n * 0.7;
    for (i, s) in report.seconds.iter().enumerate() {
        let bx = x(i as f64) + plot_w / n * 0.15;
        let denied_top = y((s.admitted + s.denied) as f64);
        let admitted_top = y(s.admitted as f64);
        let _ = writeln!(
            out,
            r##"<rect class="denied" x="{bx:.1}" y="{denied_top:.1}" width="{bar:.1}" height="{:.1}" fill="#d0d0d0"><title>t={} denied {}</title></rect>"##,
            (admitted_top - denied_top).max(0.0),
            s.t,
            s.denied
        );
        let _ = writeln!(
            out,
            r##"<rect class="admitted" x="{bx:.1}" y="{admitted_top:.1}" width="{bar:.1}" height="{:.1}" fill="{}"><title>t={} admitted {}</title></rect>"##,
            (top + plot_h - admitted_top).max(0.0),
            if s.redis_up { "#3b7dd8" } else { "#e08a1e" },
            s.t,
            s.admitted
        );
    }
    for (v, label, dash, dy) in [
        (report.limit as f64, "L", "", 12.0),
        (
            report.limit as f64 * 1.05,
            "1.05 L",
            r#" stroke-dasharray="4 3""#,
            -3.0,
        ),
    ] {
        let _ = writeln!(
            out,
            r##"<line class="limit" x1="{left}" x2="{:.1}" y1="{:.1}" y2="{:.1}" stroke="#222"{dash}/><text x="{:.1}" y="{:.1}">{label}</text>"##,
            w - right,
            y(v),
            y(v),
            w - right + 4.0,
            y(v) + dy
        );
    }
    for (i, s) in report.seconds.iter().enumerate() {
        if s.t % 5 == 0 {
            let _ = writeln!(
                out,
                r##"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
                x(i as f64 + 0.5),
                top + plot_h + 14.0,
                s.t
            );
        }
    }
    let _ = writeln!(
        out,
        r##"<line x1="{left}" x2="{left}" y1="{top}" y2="{:.1}" stroke="#222"/><line x1="{left}" x2="{:.1}" y1="{:.1}" y2="{:.1}" stroke="#222"/>"##,
        top + plot_h,
        w - right,
        top + plot_h,
        top + plot_h
    );
    let _ = writeln!(
        out,
        r##"<text x="{left}" y="16">admitted per 1 s window (blue: Redis up, orange: Redis down; grey: denied), limit L = {}</text>"##,
        report.limit
    );
    let _ = writeln!(
        out,
        r##"<text x="{:.1}" y="{:.1}" text-anchor="middle">seconds</text><text x="8" y="{top}">{max_y:.0}</text>"##,
        left + plot_w / 2.0,
        h - 8.0
    );
    out.push_str("</svg>\n");
    out
}
