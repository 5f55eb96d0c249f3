//! /status.html: the /status facts as one self-contained page (inline CSS, no
//! scripts, no external assets), rendered on the server so it reads the same
//! in a browser, in curl and in a screenshot, and refreshes itself every two
//! seconds. Built for a glance during an outage: which path decides, whether
//! the breaker is tripped, what is waiting to be replayed.

use std::fmt::Write as _;

use serde_json::Value;

/// Escapes text for HTML element content and attribute values.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn text(v: &Value) -> String {
    match v {
        Value::Null => "–".into(),
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        other => other.to_string(),
    }
}

fn number(v: &Value) -> String {
    match v.as_f64() {
        Some(f) if v.is_f64() => format!("{f:.2}"),
        _ => text(v),
    }
}

/// "12.3 s ago" for a unix-milliseconds timestamp, else the raw value.
fn ago(v: &Value) -> String {
    let (Some(at), Ok(now)) = (
        v.as_u64(),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH),
    ) else {
        return text(v);
    };
    let now = now.as_millis() as u64;
    if at > now || at < 1_000_000_000_000 {
        return text(v);
    }
    format!("{:.1} s ago", (now - at) as f64 / 1000.0)
}

const STYLE: &str = "
body{font-family:system-ui,sans-serif;margin:1.5rem;color:#1d1d1f;background:#fafafa}
h1{font-size:1.4rem;margin:0 0 .2rem} h2{font-size:1.05rem;margin:1.4rem 0 .4rem}
.sub{color:#666;margin-bottom:1rem}
.cards{display:flex;gap:1rem;flex-wrap:wrap}
.card{background:#fff;border:1px solid #ddd;border-radius:8px;padding:.8rem 1.1rem;min-width:10rem}
.card .label{font-size:.8rem;color:#666;text-transform:uppercase;letter-spacing:.04em}
.card .value{font-size:1.6rem;font-weight:600;margin-top:.2rem}
.ok{color:#137333} .warn{color:#b06000} .bad{color:#c5221f}
.badge{display:inline-block;padding:.1rem .6rem;border-radius:1rem;color:#fff;font-weight:600}
.badge.ok{background:#137333;color:#fff} .badge.warn{background:#b06000;color:#fff} .badge.bad{background:#c5221f;color:#fff}
table{border-collapse:collapse;background:#fff;font-size:.9rem}
td,th{border:1px solid #ddd;padding:.3rem .6rem;text-align:left} th{background:#f0f0f0}
td.num{text-align:right;font-variant-numeric:tabular-nums}
code{font-size:.85rem;word-break:break-all}
";

fn card(out: &mut String, label: &str, value: &str, class: &str) {
    let _ = write!(
        out,
        r#"<div class="card"><div class="label">{}</div><div class="value {}">{}</div></div>"#,
        esc(label),
        class,
        esc(value)
    );
}

/// The page for one /status document.
pub fn render(status: &Value) -> String {
    let e = &status["engine"];
    let replica = text(&status["replica_id"]);
    let engine = e["engine"].as_str().unwrap_or("unknown");
    let mut out = String::with_capacity(8 * 1024);
    let _ = write!(
        out,
        r#"<!doctype html><html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="2"><title>leasehold {}</title><style>{STYLE}</style></head><body>"#,
        esc(&replica)
    );
    let _ = write!(
        out,
        r#"<h1>leasehold <span id="replica">{}</span></h1><div class="sub">engine {} · rules {} · {}{}</div>"#,
        esc(&replica),
        esc(engine),
        esc(&text(&status["rules_hash"])
            .chars()
            .take(12)
            .collect::<String>()),
        if status["ready"].as_bool() == Some(true) {
            "ready"
        } else {
            "NOT READY"
        },
        if status["redacted"].as_bool() == Some(true) {
            " · values redacted"
        } else {
            ""
        }
    );
    if let Some(err) = status["rules_last_error"].as_str() {
        let _ = write!(
            out,
            r#"<p class="bad">last rules reload failed (old rules kept): <code>{}</code></p>"#,
            esc(err)
        );
    }

    cards(&mut out, e, engine);
    breaker_section(&mut out, &e["breaker"]);
    redis_section(&mut out, &e["redis"]);
    leases_section(&mut out, &e["leases"]);
    out.push_str(r#"<p class="sub">refreshes every 2 s · JSON: <a href="/status">/status</a> · <a href="/rules">/rules</a></p></body></html>"#);
    out
}

/// The summary cards: which path decides, the breaker, the ledger, counts.
fn cards(out: &mut String, e: &Value, engine: &str) {
    out.push_str(r#"<div class="cards">"#);
    let path = e["path"].as_str().unwrap_or(engine);
    let path_class = match path {
        "redis" | "memory" => "ok",
        _ => "warn",
    };
    card(out, "deciding on", &path.to_uppercase(), path_class);
    let breaker = &e["breaker"];
    if let Some(state) = breaker["state"].as_str() {
        let class = match state {
            "healthy" => "ok",
            "probing" | "settling" => "warn",
            _ => "bad",
        };
        card(out, "breaker", state, class);
    }
    let ledger = &e["ledger"];
    if !ledger.is_null() {
        let unreplayed = ledger["unreplayed_hits"].as_u64().unwrap_or(0);
        card(
            out,
            "unreplayed hits",
            &unreplayed.to_string(),
            if unreplayed > 0 { "warn" } else { "ok" },
        );
        card(out, "keys to replay", &text(&ledger["keys_to_replay"]), "");
        let dropped = ledger["dropped_usage"].as_u64().unwrap_or(0);
        card(
            out,
            "dropped usage",
            &dropped.to_string(),
            if dropped > 0 { "bad" } else { "ok" },
        );
    }
    if !e["members_for_leases"].is_null() {
        card(out, "members", &text(&e["members_for_leases"]), "");
    }
    if !e["decisions"].is_null() {
        card(out, "redis decisions", &text(&e["decisions"]["redis"]), "");
        card(out, "local decisions", &text(&e["decisions"]["local"]), "");
    } else if !e["tracked_keys"].is_null() {
        card(out, "tracked keys", &text(&e["tracked_keys"]), "");
    }
    out.push_str("</div>");
}

/// The breaker's state and its last transitions.
fn breaker_section(out: &mut String, breaker: &Value) {
    if !breaker.is_null() {
        let _ = write!(
            out,
            r#"<h2>Breaker</h2><p><span class="badge {}" id="breaker-state">{}</span> entered {} · {} consecutive failures · {} transitions</p>"#,
            match breaker["state"].as_str() {
                Some("healthy") => "ok",
                Some("probing" | "settling") => "warn",
                _ => "bad",
            },
            esc(&text(&breaker["state"])),
            esc(&ago(&breaker["since_ms"])),
            esc(&text(&breaker["consecutive_failures"])),
            esc(&text(&breaker["transitions"]))
        );
        if let Some(history) = breaker["history"].as_array().filter(|h| !h.is_empty()) {
            out.push_str("<table><tr><th>when</th><th>from</th><th>to</th><th>why</th></tr>");
            for t in history.iter().rev().take(10) {
                let _ = write!(
                    out,
                    "<tr><td class=\"num\">{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                    esc(&ago(&t["at_ms"])),
                    esc(&text(&t["from"])),
                    esc(&text(&t["to"])),
                    esc(&text(&t["reason"]))
                );
            }
            out.push_str("</table>");
        }
    }
}

/// The Redis topology: each node, whether it is connected, its failures;
/// and members of another key layout, if any.
fn redis_section(out: &mut String, redis: &Value) {
    let topology = &redis["topology"];
    let Some(nodes) = topology["nodes"].as_array() else {
        return;
    };
    let _ = write!(
        out,
        r#"<h2>Redis</h2><p id="redis-mode">{} · <code>{}</code></p>"#,
        esc(&text(&topology["mode"])),
        esc(&text(&redis["redis"]))
    );
    out.push_str("<table><tr><th>node</th><th>role</th><th>slots</th><th>connected</th><th>failed calls</th></tr>");
    for n in nodes {
        let connected = n["connected"] == true;
        let _ = write!(
            out,
            "<tr><td><code>{}</code></td><td>{}</td><td class=\"num\">{}</td><td><span class=\"badge {}\">{}</span></td><td class=\"num\">{}</td></tr>",
            esc(&text(&n["node"])),
            esc(&text(&n["role"])),
            esc(&text(&n["slots"])),
            if connected { "ok" } else if n["role"] == "sentinel" { "" } else { "bad" },
            if connected { "yes" } else { "no" },
            esc(&text(&n["failures"]))
        );
    }
    out.push_str("</table>");
    if let Some(older) = redis["membership"]["older_layouts"]
        .as_array()
        .filter(|a| !a.is_empty())
    {
        let names: Vec<String> = older.iter().map(text).collect();
        let _ = write!(
            out,
            r#"<p class="bad">Deciding on leases: live replicas count in an older key layout ({})</p>"#,
            esc(&names.join(", "))
        );
    }
}

/// The busiest keys with their leases.
fn leases_section(out: &mut String, leases: &Value) {
    if let Some(leases) = leases.as_array() {
        out.push_str("<h2>Busiest keys</h2>");
        if leases.is_empty() {
            out.push_str("<p>no keys yet</p>");
        } else {
            out.push_str("<table><tr><th>key</th><th>limit</th><th>algorithm</th><th>remaining (Redis, last seen)</th><th>demand share</th><th>lease if Redis fails</th></tr>");
            for l in leases {
                let _ = write!(
                    out,
                    "<tr><td><code>{}</code></td><td class=\"num\">{} / {}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td></tr>",
                    esc(&text(&l["key"])),
                    esc(&text(&l["limit"])),
                    esc(&text(&l["unit"])),
                    esc(&text(&l["algorithm"])),
                    esc(&text(&l["redis_remaining"])),
                    esc(&number(&l["demand_share"])),
                    esc(&text(&l["lease"]))
                );
            }
            out.push_str("</table>");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_values_and_shows_the_breaker() {
        let status = serde_json::json!({
            "replica_id": "r<1>",
            "ready": true,
            "engine": {
                "engine": "resilient",
                "path": "local",
                "breaker": {"state": "tripped", "history": [{"at_ms": 5, "from": "healthy", "to": "tripped", "reason": "3 failures"}]},
                "ledger": {"unreplayed_hits": 7, "keys_to_replay": 1, "dropped_usage": 0},
                "leases": [{"key": "d|k=<script>#1:fw", "limit": 10, "unit": "second"}],
            },
        });
        let html = render(&status);
        assert!(
            html.contains("r&lt;1&gt;") && !html.contains("<script>"),
            "{html}"
        );
        assert!(html.contains(r#"id="breaker-state">tripped<"#), "{html}");
        assert!(html.contains("LOCAL") && html.contains(">7<"), "{html}");
    }

    #[test]
    fn shows_the_redis_nodes_and_a_layout_wait() {
        let status = serde_json::json!({
            "engine": {
                "engine": "resilient",
                "redis": {
                    "redis": "redis-cluster://u:***@a:7000",
                    "topology": {"mode": "cluster", "nodes": [
                        {"node": "a:7000", "role": "primary", "slots": 5461, "connected": true, "failures": 0},
                        {"node": "b:7001", "role": "primary", "slots": 5462, "connected": false, "failures": 3},
                    ]},
                    "membership": {"older_layouts": ["old (layout 1)"]},
                },
            },
        });
        let html = render(&status);
        assert!(html.contains(r#"id="redis-mode">cluster"#), "{html}");
        assert!(
            html.contains("b:7001") && html.contains(">5462<") && html.contains(">3<"),
            "{html}"
        );
        assert!(html.contains("old (layout 1)"), "{html}");
    }
}
