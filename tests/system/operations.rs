//! Operating leasehold: OTLP traces parented to the caller's W3C context (a
//! minimal OTLP/gRPC receiver stands in for the collector), JSON logs, the
//! admin listener with redaction, the status page in a real headless
//! chromium during an outage, and the Grafana dashboard's metrics in a
//! scrape that promtool accepts.

use std::collections::BTreeSet;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use crate::common;
use crate::common::{
    get, require, single, test_dir, wait_until, write_rules, Leasehold, RedisServer,
};
use leasehold::proto::rls::rate_limit_service_client::RateLimitServiceClient;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use parking_lot::Mutex;

fn artifacts() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("artifacts");
    std::fs::create_dir_all(&dir).expect("artifacts dir");
    dir
}

/// The OTLP/gRPC trace receiver the test runs in place of a collector.
#[derive(Default, Clone)]
struct Receiver(Arc<Mutex<Vec<ExportTraceServiceRequest>>>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.lock().push(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

fn attr(attrs: &[opentelemetry_proto::tonic::common::v1::KeyValue], key: &str) -> Option<String> {
    attrs.iter().find(|kv| kv.key == key).and_then(|kv| {
        match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
            Some(AnyValue::StringValue(s)) => Some(s.clone()),
            Some(AnyValue::IntValue(i)) => Some(i.to_string()),
            Some(AnyValue::BoolValue(b)) => Some(b.to_string()),
            _ => None,
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn should_rate_limit_span_is_exported_under_the_callers_trace() {
    let dir = test_dir("otlp");
    let receiver = Receiver::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let otlp: SocketAddr = listener.local_addr().expect("addr");
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(receiver.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let rules = write_rules(&dir, "ops.yaml",
        "domain: traced\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 1}\n",
    );
    let endpoint = format!("http://{otlp}");
    let lh = Leasehold::start(
        "leasehold",
        &rules,
        &["--otlp-endpoint", &endpoint, "--log-level", "warn"],
        &[],
        &dir,
    );
    let mut client = RateLimitServiceClient::connect(lh.grpc_uri())
        .await
        .expect("connect");
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent_id = "00f067aa0ba902b7";
    for _ in 0..2 {
        let mut req = tonic::Request::new(single("traced", &[("user", "ada")]));
        req.metadata_mut().insert(
            "traceparent",
            format!("00-{trace_id}-{parent_id}-01")
                .parse()
                .expect("ascii"),
        );
        client.should_rate_limit(req).await.expect("call");
    }
    let mut spans = Vec::new();
    let got = {
        let receiver = receiver.clone();
        tokio::task::spawn_blocking(move || {
            wait_until(Duration::from_secs(15), || {
                receiver
                    .0
                    .lock()
                    .iter()
                    .flat_map(|r| &r.resource_spans)
                    .flat_map(|r| &r.scope_spans)
                    .flat_map(|s| &s.spans)
                    .filter(|s| s.name == "ShouldRateLimit")
                    .count()
                    >= 2
            })
        })
        .await
        .expect("join")
    };
    assert!(got, "no spans arrived:\n{}", lh.proc.log_text());
    let mut service = None;
    for r in receiver.0.lock().iter().flat_map(|r| &r.resource_spans) {
        if let Some(res) = &r.resource {
            service = service.or(attr(&res.attributes, "service.name"));
        }
        for s in r.scope_spans.iter().flat_map(|s| &s.spans) {
            if s.name == "ShouldRateLimit" {
                spans.push(s.clone());
            }
        }
    }
    assert_eq!(service.as_deref(), Some("leasehold"));
    let mut outcomes = BTreeSet::new();
    for s in &spans {
        assert_eq!(
            hex::encode(&s.trace_id),
            trace_id,
            "same trace as the caller"
        );
        assert_eq!(
            hex::encode(&s.parent_span_id),
            parent_id,
            "parented to the caller's span"
        );
        assert_eq!(attr(&s.attributes, "domain").as_deref(), Some("traced"));
        outcomes.insert(attr(&s.attributes, "outcome").unwrap_or_default());
    }
    let expected: BTreeSet<String> = ["ok", "over_limit"].iter().map(|s| s.to_string()).collect();
    assert_eq!(
        outcomes, expected,
        "limit 1: the first is ok, the second over"
    );
    server.abort();
}

#[test]
fn json_logs_are_one_object_per_line() {
    let dir = test_dir("jsonlogs");
    let rules = write_rules(&dir, "ops.yaml", "domain: j\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n");
    let lh = Leasehold::start("leasehold", &rules, &["--log-format", "json"], &[], &dir);
    let text = lh.proc.log_text();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(!lines.is_empty());
    let mut saw_listening = false;
    for line in lines {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(
            v["level"].is_string() && v["timestamp"].is_string(),
            "{line}"
        );
        if v["fields"]["message"] == "listening" {
            saw_listening = true;
            assert!(v["fields"]["grpc"].is_string(), "{line}");
        }
    }
    assert!(saw_listening, "{text}");
}

/// With an admin address, /status, /status.html and /rules leave the main
/// listener; with redaction, descriptor values never appear on them.
#[test]
fn admin_pages_move_to_their_own_listener_and_redact_values() {
    let dir = test_dir("admin");
    let redis = RedisServer::start("redis", &dir);
    let rules = write_rules(&dir, "ops.yaml",
        "domain: adm\ndescriptors:\n  - key: api_key\n    rate_limit: {unit: minute, requests_per_unit: 5}\n  - key: api_key\n    value: vip-secret-key\n    rate_limit: {unit: minute, requests_per_unit: 500}\n",
    );
    let admin: SocketAddr = format!("127.0.0.1:{}", common::free_port())
        .parse()
        .expect("addr");
    let url = redis.url();
    let lh = Leasehold::start(
        "leasehold",
        &rules,
        &[
            "--redis-url",
            &url,
            "--admin-addr",
            &admin.to_string(),
            "--redact-values",
        ],
        &[("LEASEHOLD_REDIS_DEADLINE_MS", "250")],
        &dir,
    );
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let mut c = RateLimitServiceClient::connect(lh.grpc_uri())
            .await
            .expect("connect");
        for value in ["alice-secret", "vip-secret-key"] {
            c.should_rate_limit(single("adm", &[("api_key", value)]))
                .await
                .expect("call");
        }
    });
    // A broken reload: the loader's message quotes the rule key with its
    // value, so with redaction it must not reach the pages.
    std::fs::write(
        rules.join("ops.yaml"),
        "domain: adm\ndescriptors:\n  - key: api_key\n    value: vip-secret-key\n    rate_limit: {unlimited: true, unit: second, requests_per_unit: 5}\n",
    )
    .expect("break the rules");
    let failed = wait_until(Duration::from_secs(10), || {
        get(admin, "/rules")
            .map(|r| r.body.contains("\"reload_failures\":1"))
            .unwrap_or(false)
    });
    assert!(
        failed,
        "the broken reload was not noticed:\n{}",
        lh.proc.log_text()
    );
    assert!(
        lh.proc.log_text().contains("vip-secret-key"),
        "the log keeps the details"
    );
    for path in ["/status", "/status.html", "/rules"] {
        let main = get(lh.http, path).expect("main listener");
        assert_eq!(main.status, 404, "{path} must not be on the main listener");
        let r = get(admin, path).expect("admin listener");
        assert_eq!(r.status, 200, "{path}: {r:?}");
        for secret in ["alice-secret", "vip-secret-key"] {
            assert!(
                !r.body.contains(secret),
                "{path} leaks {secret}:\n{}",
                r.body
            );
        }
    }
    let status = get(admin, "/status").expect("status");
    let redacted = format!("api_key={}", leasehold::redact::value("alice-secret"));
    assert!(status.body.contains(&redacted), "{}", status.body);
    let rules_page = get(admin, "/rules").expect("rules");
    let redacted_rule = format!("api_key_{}", leasehold::redact::value("vip-secret-key"));
    assert!(
        rules_page.body.contains(&redacted_rule),
        "{}",
        rules_page.body
    );
    // The main listener keeps what balancers and Prometheus need.
    assert_eq!(get(lh.http, "/readyz").expect("readyz").status, 200);
    assert_eq!(get(lh.http, "/metrics").expect("metrics").status, 200);
    assert_eq!(get(admin, "/healthz").expect("healthz").status, 200);
}

/// Metric names a dashboard expression queries (histogram series included).
fn dashboard_metrics(dashboard: &serde_json::Value) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for t in panel["targets"].as_array().expect("targets") {
            let expr = t["expr"].as_str().expect("expr");
            let mut rest = expr;
            while let Some(i) = rest.find("leasehold_") {
                let name: String = rest[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                rest = &rest[i + name.len()..];
                names.insert(name);
            }
        }
    }
    names
}

/// A Redis outage seen from outside: the status page in a real headless
/// chromium shows the tripped breaker (screenshot kept); after recovery the
/// scrape holds every metric the Grafana dashboard queries, and promtool
/// accepts the exposition.
#[test]
fn outage_status_page_dashboard_metrics_and_promtool() {
    let chromium = require("chromium");
    let promtool = require("promtool");
    let dir = test_dir("ops-outage");
    let mut redis = RedisServer::start("redis", &dir);
    let rules = write_rules(&dir, "ops.yaml",
        "domain: ops\ndescriptors:\n  - key: user\n    detailed_metric: true\n    rate_limit: {unit: second, requests_per_unit: 5}\n  - key: plan\n    shadow_mode: true\n    rate_limit: {unit: minute, requests_per_unit: 1}\n",
    );
    let url = redis.url();
    let lh = Leasehold::start(
        "leasehold",
        &rules,
        &["--redis-url", &url, "--replica-id", "ops-1"],
        &[("LEASEHOLD_REDIS_DEADLINE_MS", "100")],
        &dir,
    );
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let calls = |n: usize| {
        rt.block_on(async {
            let mut c = RateLimitServiceClient::connect(lh.grpc_uri())
                .await
                .expect("connect");
            for i in 0..n {
                let user = format!("u{}", i % 3);
                let mut req = single("ops", &[("user", user.as_str())]);
                req.descriptors.push(common::desc(&[("plan", "free")]));
                c.should_rate_limit(req).await.expect("no client errors");
            }
        })
    };
    calls(30);
    redis.kill();
    calls(30);
    let status = |lh: &Leasehold| -> serde_json::Value {
        let r = get(lh.admin, "/status").expect("status");
        serde_json::from_str(&r.body).expect("status JSON")
    };
    let tripped = wait_until(Duration::from_secs(10), || {
        calls(3);
        status(&lh)["engine"]["breaker"]["state"] != "healthy"
    });
    assert!(tripped, "{}", status(&lh));

    // The page in a real browser: DOM and a screenshot.
    let page = format!("http://{}/status.html", lh.admin);
    let chrome = |args: &[&str]| {
        let o = Command::new(&chromium)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--window-size=1100,900",
            ])
            .args(args)
            .arg(&page)
            .stdin(Stdio::null())
            .output()
            .expect("run chromium");
        assert!(
            o.status.success(),
            "chromium: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        o
    };
    let dom = String::from_utf8_lossy(&chrome(&["--dump-dom"]).stdout).into_owned();
    assert!(
        dom.contains("id=\"breaker-state\">tripped<")
            || dom.contains("id=\"breaker-state\">probing<"),
        "{dom}"
    );
    assert!(dom.contains("LOCAL"), "the path in use: {dom}");
    assert!(dom.contains("ops-1"), "the replica: {dom}");
    assert!(dom.contains("unreplayed hits"), "{dom}");
    assert!(dom.contains("user=u0"), "the busiest keys: {dom}");
    let shot = artifacts().join("status-outage.png");
    let _ = std::fs::remove_file(&shot);
    chrome(&[&format!("--screenshot={}", shot.display())]);
    let png = std::fs::read(&shot).expect("screenshot written");
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 5_000,
        "{} bytes",
        png.len()
    );

    // Recovery, then the scrape.
    redis.start_again();
    let recovered = wait_until(Duration::from_secs(20), || {
        calls(2);
        let s = status(&lh);
        s["engine"]["path"] == "redis" && s["engine"]["replay"]["runs"].as_u64().unwrap_or(0) > 0
    });
    assert!(recovered, "{}", status(&lh));
    let scrape = get(lh.http, "/metrics").expect("scrape").body;
    std::fs::write(artifacts().join("metrics.txt"), &scrape).expect("write scrape");
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/grafana/dashboards/leasehold.json"),
        )
        .expect("dashboard"),
    )
    .expect("dashboard JSON");
    let queried = dashboard_metrics(&dashboard);
    assert!(queried.len() >= 20, "{queried:?}");
    let exposed: BTreeSet<String> = scrape
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next().map(str::to_string))
        .collect();
    let missing: Vec<_> = queried.difference(&exposed).collect();
    assert!(
        missing.is_empty(),
        "the dashboard queries metrics not in the scrape: {missing:?}"
    );
    let mut check = Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool");
    check
        .stdin
        .take()
        .expect("stdin")
        .write_all(scrape.as_bytes())
        .expect("feed promtool");
    let out = check.wait_with_output().expect("promtool");
    assert!(
        out.status.success(),
        "promtool: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Prometheus and Grafana are behind a compose profile, so the default `up`
/// stays small; their mounted configs exist.
#[test]
fn observability_services_are_behind_a_profile() {
    let compose = require("docker-compose");
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("compose.yaml");
    let services = |profile: Option<&str>| -> BTreeSet<String> {
        let mut cmd = Command::new(&compose);
        cmd.arg("-f").arg(&file);
        if let Some(p) = profile {
            cmd.args(["--profile", p]);
        }
        let o = cmd
            .args(["config", "--services"])
            .output()
            .expect("docker-compose");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(str::to_string)
            .collect()
    };
    let all = services(Some("observability"));
    assert!(
        all.contains("prometheus") && all.contains("grafana"),
        "{all:?}"
    );
    let text = std::fs::read_to_string(&file).expect("compose.yaml");
    let docs = yaml_rust2::YamlLoader::load_from_str(&text).expect("yaml");
    for svc in ["prometheus", "grafana"] {
        let profiles = docs[0]["services"][svc]["profiles"]
            .as_vec()
            .expect("profiles");
        assert_eq!(profiles[0].as_str(), Some("observability"));
    }
    for other in all.iter().filter(|s| *s != "prometheus" && *s != "grafana") {
        assert!(
            docs[0]["services"][other.as_str()]["profiles"].is_badvalue(),
            "{other}"
        );
    }
    let promtool = require("promtool");
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/prometheus/prometheus.yml");
    let o = Command::new(promtool)
        .args(["check", "config"])
        .arg(&config)
        .output()
        .expect("promtool");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
}
