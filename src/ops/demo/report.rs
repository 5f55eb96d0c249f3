//! Renders a [`Report`]: the per-second timeline, the verdict and the SVG.

use std::fmt::Write as _;

use super::{ReplicaView, Report, UNIT_MS};
use crate::ops::deploy::REPLICAS;

pub(super) fn header() -> String {
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
pub(super) fn row(
    t: u64,
    redis_up: bool,
    counts: [u64; 4],
    envoy: Option<u64>,
    v: &[ReplicaView],
) -> String {
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

/// The verdict against docs/guarantees.md (G5), one line per check.
pub fn verdict(report: &Report) -> String {
    let mut out = format!(
        "verdict against docs/guarantees.md G5 (limit L = {} per second, {} replicas): {}\n",
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
    let p = Plot::new(report);
    let (w, h) = (p.w, p.h);
    let mut out = String::new();
    let _ = writeln!(
        out,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"##
    );
    let _ = writeln!(out, r##"<rect width="{w}" height="{h}" fill="#ffffff"/>"##);
    outage_band(&mut out, &p, report);
    bars(&mut out, &p, report);
    limit_lines(&mut out, &p, report);
    axes(&mut out, &p, report);
    out.push_str("</svg>\n");
    out
}

/// The chart's geometry: canvas, margins, and the scales of both axes.
struct Plot {
    w: f64,
    h: f64,
    left: f64,
    right: f64,
    top: f64,
    plot_w: f64,
    plot_h: f64,
    n: f64,
    max_y: f64,
    first: u64,
}

impl Plot {
    fn new(report: &Report) -> Plot {
        let (w, h) = (760.0, 300.0);
        let (left, right, top, bottom) = (50.0, 56.0, 44.0, 40.0);
        let max_y = report
            .seconds
            .iter()
            .map(|s| s.admitted + s.denied)
            .max()
            .unwrap_or(0)
            .max(report.limit * 2) as f64;
        Plot {
            w,
            h,
            left,
            right,
            top,
            plot_w: w - left - right,
            plot_h: h - top - bottom,
            n: report.seconds.len().max(1) as f64,
            max_y,
            first: report.seconds.first().map_or(0, |s| s.window_ms),
        }
    }

    fn x(&self, i: f64) -> f64 {
        self.left + self.plot_w * i / self.n
    }

    fn y(&self, v: f64) -> f64 {
        self.top + self.plot_h * (1.0 - v / self.max_y)
    }

    /// x of a unix time in ms.
    fn xt(&self, ms: u64) -> f64 {
        self.x(ms.saturating_sub(self.first) as f64 / UNIT_MS as f64)
    }
}

fn outage_band(out: &mut String, p: &Plot, report: &Report) {
    let (top, plot_h) = (p.top, p.plot_h);
    if report.kill_ms > 0 {
        let (x0, x1) = (
            p.xt(report.kill_ms),
            p.xt(report.restart_ms.max(report.kill_ms)),
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
}

fn bars(out: &mut String, p: &Plot, report: &Report) {
    let top = p.top;
    let bar = p.plot_w / p.n * 0.7;
    for (i, s) in report.seconds.iter().enumerate() {
        let bx = p.x(i as f64) + p.plot_w / p.n * 0.15;
        let denied_top = p.y((s.admitted + s.denied) as f64);
        let admitted_top = p.y(s.admitted as f64);
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
            (top + p.plot_h - admitted_top).max(0.0),
            if s.redis_up { "#3b7dd8" } else { "#e08a1e" },
            s.t,
            s.admitted
        );
    }
}

fn limit_lines(out: &mut String, p: &Plot, report: &Report) {
    let (w, left, right) = (p.w, p.left, p.right);
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
            p.y(v),
            p.y(v),
            w - right + 4.0,
            p.y(v) + dy
        );
    }
}

fn axes(out: &mut String, p: &Plot, report: &Report) {
    let (w, h, left, right, top, max_y) = (p.w, p.h, p.left, p.right, p.top, p.max_y);
    for (i, s) in report.seconds.iter().enumerate() {
        if s.t % 5 == 0 {
            let _ = writeln!(
                out,
                r##"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
                p.x(i as f64 + 0.5),
                top + p.plot_h + 14.0,
                s.t
            );
        }
    }
    let _ = writeln!(
        out,
        r##"<line x1="{left}" x2="{left}" y1="{top}" y2="{:.1}" stroke="#222"/><line x1="{left}" x2="{:.1}" y1="{:.1}" y2="{:.1}" stroke="#222"/>"##,
        top + p.plot_h,
        w - right,
        top + p.plot_h,
        top + p.plot_h
    );
    let _ = writeln!(
        out,
        r##"<text x="{left}" y="16">admitted per 1 s window (blue: Redis up, orange: Redis down; grey: denied), limit L = {}</text>"##,
        report.limit
    );
    let _ = writeln!(
        out,
        r##"<text x="{:.1}" y="{:.1}" text-anchor="middle">seconds</text><text x="8" y="{top}">{max_y:.0}</text>"##,
        left + p.plot_w / 2.0,
        h - 8.0
    );
}
