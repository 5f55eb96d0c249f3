//! The four-replica topology through the local runner: real redis-server,
//! four leasehold processes, nginx (gRPC balancer and dummy upstream), Envoy
//! and grpcurl. Also the static checks of compose.yaml and the Dockerfile,
//! which cannot run here (no Docker engine).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common;
use crate::common::{http, leasehold_bin, require, test_dir, wait_until};
use leasehold::ops::demo::{self, FailoverOptions, LIMIT, UNIT_MS};
use leasehold::ops::deploy::{self, Layout};
use leasehold::ops::load::{unix_ms, Load, LoadSpec, Seen, Via};
use leasehold::ops::runner::{replica_name, Binaries, Options, Ports, Topology};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A pid is gone when /proc has no live (non-zombie) process for it.
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

fn binaries() -> Binaries {
    for cmd in ["redis-server", "envoy", "nginx", "grpcurl"] {
        require(cmd);
    }
    Binaries::find_with(leasehold_bin(), None, None, None).expect("binaries")
}

async fn start(name: &str, replica_env: Vec<(String, String)>) -> Topology {
    let dir = test_dir(name);
    let bins = binaries();
    Topology::start_on_free_ports(|ports| Options {
        bins: bins.clone(),
        dir: dir.clone(),
        ports,
        replica_env: replica_env.clone(),
        report: Arc::new(|l: &str| eprintln!("{l}")),
    })
    .await
    .expect("the topology starts")
}

/// Lines the runner printed, as (name, pid) of everything it started.
fn started_pids(out: &str) -> Vec<(String, u32)> {
    out.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("started ")?;
            let mut parts = rest.split_whitespace();
            let name = parts.next()?.to_string();
            let pid = parts.nth(1)?.parse().ok()?;
            Some((name, pid))
        })
        .collect()
}

fn port_after(out: &str, label: &str, marker: &str) -> u16 {
    let line = out
        .lines()
        .find(|l| l.starts_with(label))
        .unwrap_or_else(|| panic!("no `{label}` line in:\n{out}"));
    let at = line.find(marker).expect("marker") + marker.len();
    line[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .expect("port")
}

/// `leasehold local up` as users run it: serves through Envoy (200 then 429
/// with x-ratelimit headers) and nginx (grpcurl reaches all four replicas),
/// and SIGTERM stops exactly what it started.
#[test]
fn runner_serves_through_envoy_and_nginx_and_stops_everything() {
    let grpcurl = require("grpcurl");
    let _ = binaries();
    let dir = test_dir("runner-up");
    let mut runner = Command::new(leasehold_bin())
        .args(["local", "up", "--dir"])
        .arg(&dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the runner");
    let runner_pid = runner.id();
    let stdout = runner.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut out = String::new();
    let ready = Instant::now() + Duration::from_secs(90);
    while !out.contains("Ctrl-C") && Instant::now() < ready {
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(200)) {
            out.push_str(&line);
            out.push('\n');
        }
    }
    let started = started_pids(&out);
    let guard = KillOnDrop(
        started
            .iter()
            .map(|(_, p)| *p)
            .chain([runner_pid])
            .collect(),
    );
    assert!(out.contains("all healthy"), "runner output:\n{out}");
    assert_eq!(started.len(), 8, "{out}");
    let envoy = port_after(&out, "envoy (HTTP", "127.0.0.1:");
    let nginx = port_after(&out, "nginx (gRPC", "127.0.0.1:");

    // Through Envoy: (user, /search) is limited to 10 per second. Start just
    // after a window boundary so the 14 calls share one window.
    let addr: std::net::SocketAddr = format!("127.0.0.1:{envoy}").parse().expect("addr");
    while unix_ms() % 1000 > 100 {
        std::thread::sleep(Duration::from_millis(5));
    }
    let replies: Vec<_> = (0..14)
        .map(|_| http("GET", addr, "/search", &[("x-user", "runner")], "").expect("envoy"))
        .collect();
    for (i, r) in replies.iter().enumerate() {
        let expected = if i < 10 { 200 } else { 429 };
        assert_eq!(r.status, expected, "call {i}: {r:?}");
        assert!(r.header("x-ratelimit-limit").is_some(), "{r:?}");
        assert!(r.header("x-ratelimit-reset").is_some(), "{r:?}");
        let remaining: u64 = r
            .header("x-ratelimit-remaining")
            .and_then(|v| v.parse().ok())
            .expect("x-ratelimit-remaining");
        assert_eq!(remaining, 9u64.saturating_sub(i as u64), "call {i}: {r:?}");
    }
    assert!(replies[0].body.contains("upstream ok"), "{:?}", replies[0]);
    // The topology sets replica_response_header: Envoy passes the deciding
    // replica's id to the client, on 200 and on 429.
    let deciders: BTreeSet<String> = replies
        .iter()
        .map(|r| {
            r.header("x-leasehold-replica")
                .unwrap_or_else(|| panic!("no x-leasehold-replica: {r:?}"))
                .to_string()
        })
        .collect();
    let known: BTreeSet<String> = (1..=4).map(replica_name).collect();
    assert!(
        deciders.is_subset(&known) && deciders.len() >= 2,
        "{deciders:?}"
    );

    // Through nginx with grpcurl (local proto files, so no reflection call
    // takes a turn of the round robin): every replica answers.
    let mut replicas = BTreeSet::new();
    for _ in 0..12 {
        let o = Command::new(&grpcurl)
            .args(["-plaintext", "-v", "-import-path"])
            .arg(repo().join("proto"))
            .args([
                "-proto",
                "envoy/service/ratelimit/v3/rls.proto",
                "-d",
                r#"{"domain":"edge","descriptors":[{"entries":[{"key":"user","value":"grpcurl"}]}]}"#,
            ])
            .arg(format!("127.0.0.1:{nginx}"))
            .arg("envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit")
            .output()
            .expect("grpcurl");
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(text.contains("\"overallCode\": \"OK\""), "{text}");
        if let Some(id) = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("x-leasehold-replica: "))
        {
            replicas.insert(id.to_string());
        }
    }
    let expected: BTreeSet<String> = (1..=4).map(replica_name).collect();
    assert_eq!(replicas, expected);

    // `leasehold health`, the container health check: 0 for a serving
    // replica, non-zero for a port nobody serves.
    let replica_grpc = port_after(&out, "leasehold-1 ", "grpc 127.0.0.1:");
    let health = |port: u16| {
        Command::new(leasehold_bin())
            .args(["health", "--addr", &format!("127.0.0.1:{port}")])
            .output()
            .expect("leasehold health")
    };
    let ok = health(replica_grpc);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&ok.stdout).trim(), "SERVING");
    assert!(!health(common::free_port()).status.success());

    // SIGTERM: the runner stops everything it started, then exits 0.
    let status = Command::new("kill")
        .args(["-TERM", &runner_pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let exited = wait_until(Duration::from_secs(40), || {
        matches!(runner.try_wait(), Ok(Some(_)))
    });
    assert!(exited, "the runner did not exit");
    let code = runner.wait().expect("wait");
    assert!(code.success(), "runner exit: {code}");
    for (name, pid) in &started {
        assert!(!alive(*pid), "{name} (pid {pid}) is still running");
    }
    drop(guard);
}

/// Kills leftover pids if an assertion failed half-way.
struct KillOnDrop(Vec<u32>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        for pid in &self.0 {
            if alive(*pid) {
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            }
        }
    }
}

/// A step that fails (Envoy exits at once) stops everything started before
/// it; the runner exits non-zero and names the failed step.
#[test]
fn runner_that_fails_a_step_leaves_nothing_behind() {
    let _ = binaries();
    let dir = test_dir("runner-fail");
    let o = Command::new(leasehold_bin())
        .args(["local", "up", "--envoy-bin", "false", "--dir"])
        .arg(&dir)
        .output()
        .expect("run the runner");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr);
    let started = started_pids(&out);
    let _guard = KillOnDrop(started.iter().map(|(_, p)| *p).collect());
    assert!(!o.status.success(), "{out}{err}");
    assert!(err.contains("envoy exited during startup"), "{err}");
    assert_eq!(
        started.len(),
        8,
        "everything up to Envoy was started:\n{out}"
    );
    for (name, pid) in &started {
        assert!(!alive(*pid), "{name} (pid {pid}) was left running");
    }
}

/// The failover demonstration on the local topology: Redis is killed under
/// load through Envoy and nginx and started again empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_under_load_through_envoy_and_nginx() {
    let env = vec![(
        "LEASEHOLD_REDIS_EXPIRY_MARGIN_MS".to_string(),
        "600000".to_string(),
    )];
    let mut topo = start("topology-failover", env).await;
    let pids = topo.pids();
    let opts = FailoverOptions {
        before_s: 4,
        outage_s: 7,
        after_s: 6,
        live: false,
        ..FailoverOptions::default()
    };
    let report = demo::failover(&mut topo, &opts)
        .await
        .expect("the demo runs");
    let text = demo::timeline(&report);
    let artifacts = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("artifacts");
    std::fs::create_dir_all(&artifacts).expect("artifacts dir");
    std::fs::write(artifacts.join("failover.txt"), &text).expect("write timeline");
    let svg = demo::svg(&report);
    std::fs::write(artifacts.join("failover.svg"), &svg).expect("write svg");
    eprintln!("{text}");

    // Independent of the demo's own verdict: Envoy's counters and Redis.
    // Envoy creates the rate-limit filter's counters on first use, so an
    // absent one is zero; over_limit must exist, which proves the lookup.
    let stat = |name: &'static str| {
        let topo = &topo;
        async move { topo.envoy_stat(name).await }
    };
    assert_eq!(
        stat("cluster.upstream.ratelimit.error").await.unwrap_or(0),
        0
    );
    assert_eq!(
        stat("cluster.upstream.ratelimit.failure_mode_allowed")
            .await
            .unwrap_or(0),
        0
    );
    assert_eq!(stat("http.ingress.downstream_rq_5xx").await, Some(0));
    let envoy_over = stat("cluster.upstream.ratelimit.over_limit")
        .await
        .expect("Envoy counted over-limit answers");
    let redis_total = redis_sum(&topo);
    topo.stop().await;
    for (name, pid) in pids {
        assert!(!alive(pid), "{name} (pid {pid}) still running");
    }

    let samples = &report.samples;
    let errors: Vec<_> = samples
        .iter()
        .filter(|s| matches!(s.seen, Seen::Error(_) | Seen::FailOpen))
        .collect();
    assert!(
        errors.is_empty(),
        "client errors: {:?}",
        &errors[..errors.len().min(5)]
    );
    let admitted = samples.iter().filter(|s| s.seen == Seen::Admitted).count() as u64;
    let http_denied = samples
        .iter()
        .filter(|s| s.via == Via::Envoy && s.seen == Seen::Denied)
        .count() as u64;
    assert_eq!(
        envoy_over, http_denied,
        "Envoy's over_limit counter = 429s seen"
    );
    assert_eq!(redis_total, admitted, "Redis holds exactly the grants");
    let outage: Vec<_> = report
        .seconds
        .iter()
        .filter(|s| s.phase == "outage")
        .collect();
    assert!(outage.len() >= 4, "{text}");
    for s in &outage {
        let (lo, hi) = (0.95 * LIMIT as f64, 1.05 * LIMIT as f64);
        let a = s.admitted as f64;
        let slack = s.uncertain as f64;
        assert!(
            a + slack >= lo && a - slack <= hi,
            "outage window t={}: {text}",
            s.t
        );
        assert!(
            s.local_decisions > 0 && s.redis_decisions == 0,
            "t={}: {text}",
            s.t
        );
        // gRPC health stays SERVING: Envoy keeps routing to every replica.
        assert_eq!(s.envoy_healthy, Some(4), "t={}: {text}", s.t);
    }
    for s in report.seconds.iter().filter(|s| s.phase == "before") {
        assert!(s.admitted <= LIMIT + s.uncertain, "t={}: {text}", s.t);
    }
    assert!(report.pass, "{text}");
    assert_eq!(report.replicas_seen.len(), 4, "{text}");
    // The chart: one admitted bar per second, the outage shaded, the limit drawn.
    assert_eq!(
        svg.matches("class=\"admitted\"").count(),
        report.seconds.len()
    );
    assert!(svg.contains("class=\"outage\"") && svg.contains("class=\"limit\""));
}

/// Sum of every count field of every window of the demo counter in Redis.
fn redis_sum(topo: &Topology) -> u64 {
    let cli = |args: &[&str]| {
        let o = Command::new("redis-cli")
            .args(["-p", &topo.ports.redis.to_string()])
            .args(args)
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let keys = cli(&["--scan", "--pattern", "lh:v2{edge|user=demo#1:*}@*"]);
    let mut total = 0i64;
    // SCAN may return a key twice: each counted once.
    let unique: std::collections::BTreeSet<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
    for key in unique {
        let flat = cli(&["HGETALL", key]);
        let lines: Vec<&str> = flat.lines().collect();
        total += leasehold::redis::keys::window_total(lines.chunks_exact(2).map(|p| (p[0], p[1])));
    }
    total.max(0) as u64
}

/// One replica killed under load: Envoy and nginx route around it, only calls
/// in flight on it at the kill may fail, and the limit still holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_killed_under_load_is_routed_around() {
    let mut topo = start("topology-replica-kill", Vec::new()).await;
    let spec = LoadSpec {
        envoy_url: format!("http://127.0.0.1:{}", topo.ports.envoy),
        nginx_uri: format!("http://127.0.0.1:{}", topo.ports.nginx),
        domain: "edge".into(),
        user: "kill".into(),
        path: "/hello".into(),
        envoy_rate: 200,
        nginx_rate: 100,
        workers: 8,
        unit_ms: UNIT_MS,
    };
    let load = Load::start(spec, None);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let kill_ms = unix_ms();
    topo.kill9(&replica_name(2)).await.expect("kill -9");
    let killed_ms = unix_ms();
    tokio::time::sleep(Duration::from_secs(6)).await;
    let samples = load.finish().await;
    let healthy_after = topo.envoy_healthy_replicas().await;
    // With no replica left, nginx answers a proper gRPC UNAVAILABLE.
    for i in [1, 3, 4] {
        topo.kill9(&replica_name(i)).await.expect("kill -9");
    }
    let mut client =
        leasehold::proto::rls::rate_limit_service_client::RateLimitServiceClient::connect(format!(
            "http://127.0.0.1:{}",
            topo.ports.nginx
        ))
        .await
        .expect("connect to nginx");
    let status = client
        .should_rate_limit(common::single("edge", &[("user", "nobody")]))
        .await
        .expect_err("no replica is left");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains("no leasehold replica"),
        "{status:?}"
    );
    topo.stop().await;

    let failed: Vec<_> = samples
        .iter()
        .filter(|s| matches!(s.seen, Seen::Error(_) | Seen::FailOpen))
        .collect();
    eprintln!(
        "replica kill: {} of {} calls failed: {:?}",
        failed.len(),
        samples.len(),
        failed.iter().map(|s| (s.via, &s.seen)).collect::<Vec<_>>()
    );
    // At most the calls in flight at the kill: 8 callers per door.
    assert!(failed.len() <= 16, "{} failed: {failed:?}", failed.len());
    for s in &failed {
        assert!(
            s.sent_ms <= killed_ms,
            "a call sent {} ms after the kill failed: {s:?}",
            s.sent_ms.saturating_sub(killed_ms)
        );
    }
    let after: BTreeSet<String> = samples
        .iter()
        .filter(|s| s.sent_ms > kill_ms + 1000)
        .filter_map(|s| s.replica.clone())
        .collect();
    assert!(!after.contains(&replica_name(2)), "{after:?}");
    assert_eq!(after.len(), 3, "the three live replicas answer: {after:?}");
    assert_eq!(healthy_after, Some(3), "Envoy's health checks see three");
    // The limit holds in every complete window, before and after the kill.
    let mut per_window: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    for s in samples.iter().filter(|s| s.seen == Seen::Admitted) {
        let (w, certain) = s.window(UNIT_MS);
        per_window.entry(w).or_default().0 += 1;
        if !certain {
            for c in s.candidates(UNIT_MS) {
                per_window.entry(c).or_default().1 += 1;
            }
        }
    }
    let windows: Vec<_> = per_window.iter().collect();
    // Once its heartbeats have been missing for the membership TTL (5 s by
    // default), the killed replica counts as silent: the others hold back
    // its share for `membership_holdback_ms` (it might be cut off and
    // serving on its lease), so a crash costs that share until then
    // (docs/guarantees.md G7.2): about a quarter under this even load.
    let silent_known_ms = kill_ms + 5_000;
    for (w, (admitted, uncertain)) in &windows[1..windows.len() - 1] {
        assert!(
            *admitted <= LIMIT + uncertain,
            "window {w}: {admitted} admitted (±{uncertain})"
        );
        let floor = if **w + UNIT_MS > silent_known_ms {
            LIMIT * 7 / 10
        } else {
            LIMIT
        };
        assert!(
            *admitted + uncertain >= floor,
            "window {w}: only {admitted} admitted (at least {floor} expected)"
        );
    }
}

/// compose.cluster.yaml, layered over compose.yaml, puts every replica on a
/// 3-master Redis Cluster: three cluster-enabled nodes, a one-shot service
/// that joins them, and each replica's redis_url naming every node (a URL
/// leasehold accepts), started only once the cluster is made.
#[test]
fn the_cluster_compose_file_puts_every_replica_on_a_cluster() {
    let compose = require("docker-compose");
    let o = Command::new(&compose)
        .arg("-f")
        .arg(repo().join("compose.yaml"))
        .arg("-f")
        .arg(repo().join("compose.cluster.yaml"))
        .arg("config")
        .output()
        .expect("docker-compose config");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    let docs = yaml_rust2::YamlLoader::load_from_str(&text).expect("compose config is YAML");
    let services = &docs[0]["services"];
    let nodes = ["redis-node-1", "redis-node-2", "redis-node-3"];
    for node in nodes {
        let command: Vec<&str> = services[node]["command"]
            .as_vec()
            .expect("node command")
            .iter()
            .filter_map(|c| c.as_str())
            .collect();
        assert!(
            command
                .windows(2)
                .any(|w| w == ["--cluster-enabled", "yes"]),
            "{node}: {command:?}"
        );
    }
    let init = format!("{:?}", services["redis-cluster-init"]["command"]);
    assert!(init.contains("--cluster create"), "{init}");
    for node in nodes {
        assert!(init.contains(node), "the init joins {node}: {init}");
        assert!(!services["redis-cluster-init"]["depends_on"][node].is_badvalue());
    }
    for e in &Layout::compose().replicas {
        let svc = &services[e.host.as_str()];
        let url = svc["environment"]["LEASEHOLD_REDIS_URL"]
            .as_str()
            .expect("redis url");
        assert!(url.starts_with("redis-cluster://"), "{}: {url}", e.host);
        for node in nodes {
            assert!(url.contains(&format!("{node}:6379")), "{}: {url}", e.host);
        }
        assert_eq!(leasehold::redis::check_url(url), Ok(()), "{url}");
        assert_eq!(
            svc["environment"]["LEASEHOLD_REPLICA_ID"].as_str(),
            Some(e.host.as_str()),
            "the base file's settings are kept"
        );
        assert_eq!(
            svc["depends_on"]["redis-cluster-init"]["condition"].as_str(),
            Some("service_completed_successfully"),
            "{}",
            e.host
        );
    }
}

/// compose.yaml and the Dockerfile, checked without an engine: Debian's
/// docker-compose parses the file (`config -q`); every mounted file exists;
/// the mounted configs are exactly what the templates render for compose;
/// the runner renders the same templates with only addresses differing.
#[test]
fn compose_and_dockerfile_are_consistent_with_the_runner() {
    let compose = require("docker-compose");
    let file = repo().join("compose.yaml");
    let o = Command::new(&compose)
        .args(["-f"])
        .arg(&file)
        .args(["config", "-q"])
        .output()
        .expect("docker-compose");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = Command::new(&compose)
        .args(["-f"])
        .arg(&file)
        .arg("config")
        .output()
        .expect("docker-compose config");
    assert!(o.status.success());
    let text = String::from_utf8_lossy(&o.stdout);
    let docs = yaml_rust2::YamlLoader::load_from_str(&text).expect("compose config is YAML");
    let services = &docs[0]["services"];
    let names: BTreeSet<String> = services
        .as_hash()
        .expect("services")
        .keys()
        .filter_map(|k| k.as_str().map(str::to_string))
        .collect();
    for required in ["redis", "upstream", "envoy", "nginx"] {
        assert!(names.contains(required), "{names:?}");
    }
    let layout = Layout::compose();
    // Every replica the configs name is a service with a distinct replica id.
    let mut ids = BTreeSet::new();
    for e in &layout.replicas {
        let svc = &services[e.host.as_str()];
        assert!(!svc.is_badvalue(), "no service {}", e.host);
        let env = &svc["environment"];
        assert_eq!(env["LEASEHOLD_REPLICA_ID"].as_str(), Some(e.host.as_str()));
        assert_eq!(
            env["LEASEHOLD_GRPC_ADDR"].as_str(),
            Some(format!("0.0.0.0:{}", e.port).as_str())
        );
        ids.insert(e.host.clone());
        let test = svc["healthcheck"]["test"].as_vec().expect("healthcheck");
        assert!(
            test.iter().any(|t| t.as_str() == Some("health")),
            "{test:?}"
        );
        assert!(svc["restart"].as_str().is_some());
    }
    assert_eq!(ids.len(), deploy::REPLICAS);
    // Mounted files exist, and the rendered configs are up to date.
    let rendered: HashMap<&str, String> = deploy::files(&layout)
        .expect("render")
        .into_iter()
        .collect();
    let mut mounted = 0;
    for (name, svc) in services.as_hash().expect("services") {
        let name = name.as_str().unwrap_or_default();
        for v in svc["volumes"].as_vec().into_iter().flatten() {
            let spec = v.as_str().expect("short volume syntax");
            let source = PathBuf::from(spec.split(':').next().unwrap_or_default());
            assert!(
                source.exists(),
                "{name}: mounted {} does not exist",
                source.display()
            );
            if let Some(file) = source.file_name().and_then(|f| f.to_str()) {
                if source
                    .parent()
                    .is_some_and(|p| p.ends_with("deploy/compose"))
                {
                    let on_disk = std::fs::read_to_string(&source).expect("read");
                    assert_eq!(
                        Some(&on_disk),
                        rendered.get(file),
                        "{} is stale: run `leasehold local render`",
                        source.display()
                    );
                    mounted += 1;
                }
            }
            assert!(spec.ends_with(":ro"), "{name}: {spec} should be read-only");
        }
    }
    assert_eq!(
        mounted, 3,
        "envoy.yaml, nginx.conf and upstream.conf are mounted"
    );
    // Published ports are the ones the configs listen on.
    let published = |svc: &str| -> Vec<String> {
        services[svc]["ports"]
            .as_vec()
            .into_iter()
            .flatten()
            // The container port: the last part of "[ip:]host:container[/tcp]"
            // or the long form's `target`.
            .map(|p| match p.as_str() {
                Some(s) => s
                    .trim_end_matches("/tcp")
                    .rsplit(':')
                    .next()
                    .unwrap_or_default()
                    .to_string(),
                None => format!("{}", p["target"].as_i64().unwrap_or(0)),
            })
            .collect()
    };
    assert!(published("envoy")
        .iter()
        .any(|p| *p == layout.envoy_listen.port.to_string()));
    assert!(published("nginx")
        .iter()
        .any(|p| *p == layout.nginx_listen.port.to_string()));

    // Envoy's RLS timeout is longer than the replicas' Redis budget, so a
    // slow Redis is absorbed by leasehold's local decision, not by Envoy.
    let settings: toml::Table = deploy::TOPOLOGY_SETTINGS.parse().expect("settings TOML");
    let deadline_ms = settings["redis_deadline_ms"]
        .as_integer()
        .expect("redis_deadline_ms");
    let envoy = yaml_rust2::YamlLoader::load_from_str(&rendered["envoy.yaml"]).expect("envoy yaml");
    let filters = &envoy[0]["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["http_filters"];
    let rl = filters
        .as_vec()
        .expect("http_filters")
        .iter()
        .find(|f| f["name"].as_str() == Some("envoy.filters.http.ratelimit"))
        .expect("the ratelimit filter");
    let timeout = rl["typed_config"]["timeout"].as_str().expect("timeout");
    let timeout_ms = (timeout
        .trim_end_matches('s')
        .parse::<f64>()
        .expect("seconds")
        * 1000.0) as i64;
    assert!(
        timeout_ms > deadline_ms,
        "Envoy timeout {timeout} vs Redis budget {deadline_ms} ms"
    );
    assert_eq!(
        rl["typed_config"]["failure_mode_deny"].as_bool(),
        Some(false)
    );
    assert!(rl["typed_config"]["enable_x_ratelimit_headers"]
        .as_str()
        .is_some());

    // The runner's render differs from compose's only in addresses.
    let local = Ports::from_base(20000)
        .expect("ports")
        .layout(Path::new("/run/x"));
    let local_files: HashMap<&str, String> =
        deploy::files(&local).expect("render").into_iter().collect();
    for (name, compose_text) in &rendered {
        let local_text = &local_files[name];
        let (a, b): (Vec<_>, Vec<_>) =
            (compose_text.lines().collect(), local_text.lines().collect());
        assert_eq!(a.len(), b.len(), "{name}: same shape");
        for (x, y) in a.iter().zip(&b) {
            if x != y {
                let about_addresses = [
                    "address",
                    "port_value",
                    "server ",
                    "listen ",
                    "pid ",
                    "_temp_path",
                ]
                .iter()
                .any(|k| x.contains(k));
                assert!(
                    about_addresses,
                    "{name}: `{x}` vs `{y}` differ beyond addresses"
                );
            }
        }
    }

    // The Dockerfile: multi-stage, non-root final image, builds the binary.
    let docker = std::fs::read_to_string(repo().join("Dockerfile")).expect("Dockerfile");
    let froms: Vec<&str> = docker.lines().filter(|l| l.starts_with("FROM ")).collect();
    assert!(froms.len() >= 2, "multi-stage: {froms:?}");
    assert!(froms[0].contains(" AS build"));
    assert!(
        docker.lines().any(|l| l.starts_with("USER nonroot")),
        "non-root"
    );
    assert!(docker.contains("cargo build --release --locked"));
    for copied in docker.lines().filter_map(|l| l.strip_prefix("COPY ")) {
        if copied.starts_with("--from") {
            continue;
        }
        for src in copied.split_whitespace().rev().skip(1) {
            assert!(repo().join(src).exists(), "Dockerfile copies missing {src}");
        }
    }
}
