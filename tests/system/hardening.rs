//! Hostile callers against the real binary: slow and idle HTTP connections,
//! the HTTP connection limit.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::common::{get, http, single, test_dir, write_rules, Leasehold};
use leasehold::proto::rls::rate_limit_response::Code;
use leasehold::proto::rls::rate_limit_service_client::RateLimitServiceClient;

const RULES: &str = "domain: h\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 1000}\n";

/// True once the server has closed `stream` (EOF or reset); false while it
/// is still open (the read times out).
fn closed_by_server(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 512];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            // A 408 or similar before the close: keep reading.
            Ok(_) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return false
            }
            Err(_) => return true,
        }
    }
}

fn open_partial(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_millis(5)))
        .expect("timeout");
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: leasehold\r\n")
        .expect("partial request");
    s
}

/// 300 connections that send part of a request and then trickle a header
/// line a second are closed once the header timeout passes; meanwhile a
/// fresh /json call and gRPC calls are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickled_headers_are_cut_off_and_starve_nothing() {
    let dir = test_dir("slowloris");
    let rules = write_rules(&dir, "h.yaml", RULES);
    let server = Leasehold::start(
        "leasehold",
        &rules,
        &[],
        // 2 s instead of the default 30 s only to keep the test short; the
        // default's bound is a settings unit test.
        &[("LEASEHOLD_HTTP_HEADER_TIMEOUT_MS", "2000")],
        &dir,
    );
    let http_addr = server.http;
    let started = Instant::now();
    let trickle = tokio::task::spawn_blocking(move || {
        let mut conns: Vec<Option<TcpStream>> =
            (0..300).map(|_| Some(open_partial(http_addr))).collect();
        let mut closed_at = Vec::new();
        let mut fresh_json = None;
        let deadline = Instant::now() + Duration::from_secs(10);
        while conns.iter().any(Option::is_some) && Instant::now() < deadline {
            for slot in conns.iter_mut() {
                let Some(stream) = slot.as_mut() else {
                    continue;
                };
                let gone =
                    stream.write_all(b"X-Trickle: 1\r\n").is_err() || closed_by_server(stream);
                if gone {
                    closed_at.push(started.elapsed());
                    *slot = None;
                }
            }
            if fresh_json.is_none() {
                let body =
                    r#"{"domain":"h","descriptors":[{"entries":[{"key":"user","value":"u"}]}]}"#;
                fresh_json = Some(http("POST", http_addr, "/json", &[], body).map(|r| r.status));
            }
            std::thread::sleep(Duration::from_secs(1));
        }
        let open = conns.iter().filter(|c| c.is_some()).count();
        (closed_at, open, fresh_json)
    });
    // gRPC keeps answering while the HTTP connections are held.
    let mut client = RateLimitServiceClient::connect(server.grpc_uri())
        .await
        .expect("connect");
    for _ in 0..10 {
        let r = client
            .should_rate_limit(single("h", &[("user", "g")]))
            .await
            .expect("gRPC answers")
            .into_inner();
        assert_eq!(r.overall_code, Code::Ok as i32);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (closed_at, open, fresh_json) = trickle.await.expect("join");
    assert_eq!(open, 0, "trickling connections still open after 10 s");
    assert_eq!(closed_at.len(), 300);
    let first = closed_at.iter().min().copied().unwrap_or_default();
    let last = closed_at.iter().max().copied().unwrap_or_default();
    assert!(
        first >= Duration::from_millis(1500),
        "closed before the timeout: {first:?}"
    );
    assert!(last <= Duration::from_secs(5), "closed late: {last:?}");
    assert_eq!(
        fresh_json.map(|r| r.ok()),
        Some(Some(200)),
        "/json answered"
    );
    assert_eq!(get(server.http, "/healthz").expect("healthz").status, 200);
    // An idle keep-alive connection is closed by the same timeout.
    let mut idle = TcpStream::connect(server.http).expect("connect");
    idle.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: leasehold\r\n\r\n")
        .expect("request");
    let mut buf = [0u8; 256];
    let n = idle.read(&mut buf).expect("response");
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
    let since = Instant::now();
    idle.set_read_timeout(Some(Duration::from_secs(6)))
        .expect("timeout");
    let eof = idle.read(&mut buf).map(|n| n == 0).unwrap_or(true);
    let after = since.elapsed();
    assert!(eof, "the idle connection got data instead of a close");
    assert!(
        after >= Duration::from_millis(1500) && after < Duration::from_secs(5),
        "idle connection closed after {after:?}"
    );
}

/// Past `http_max_connections` a new connection is closed at once; the
/// connections being served keep working, and a freed slot is reused.
#[test]
fn connections_past_the_limit_are_closed_at_once() {
    let dir = test_dir("connlimit");
    let rules = write_rules(&dir, "h.yaml", RULES);
    let server = Leasehold::start(
        "leasehold",
        &rules,
        &[],
        // 20 instead of 1024 so the test opens few sockets; the mechanism
        // is the same.
        &[("LEASEHOLD_HTTP_MAX_CONNECTIONS", "20")],
        &dir,
    );
    // 20 connections, each answered once and kept alive.
    let mut held: Vec<TcpStream> = (0..20)
        .map(|_| {
            let mut s = TcpStream::connect(server.http).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(5)))
                .expect("timeout");
            s.write_all(b"GET /healthz HTTP/1.1\r\nHost: leasehold\r\n\r\n")
                .expect("request");
            let mut buf = [0u8; 256];
            let n = s.read(&mut buf).expect("response");
            assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
            s
        })
        .collect();
    // The 21st is closed without an answer.
    let mut extra = TcpStream::connect(server.http).expect("the kernel accepts");
    extra
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let _ = extra.write_all(b"GET /healthz HTTP/1.1\r\nHost: leasehold\r\n\r\n");
    let mut buf = [0u8; 256];
    let n = extra.read(&mut buf).unwrap_or(0);
    assert_eq!(n, 0, "over the limit: {:?}", &buf[..n]);
    // The held ones still work.
    let s = &mut held[0];
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: leasehold\r\n\r\n")
        .expect("request");
    let n = s.read(&mut buf).expect("response");
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
    // Freed slots are reused.
    drop(held);
    let ok = crate::common::wait_until(Duration::from_secs(5), || {
        get(server.http, "/healthz").is_ok_and(|r| r.status == 200)
    });
    assert!(ok, "a freed slot was not reused");
}

/// A background task that panics (injected in test builds) stops the
/// replica in order: NOT_SERVING first, then a non-zero exit that names the
/// task. Once for a loop of the server itself, once for the engine's, once
/// for the journal writer (which has its own task).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_background_task_reports_not_serving_and_exits_non_zero() {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    let dir = test_dir("supervise");
    let rules = write_rules(&dir, "h.yaml", RULES);
    let redis = crate::common::RedisServer::start("redis", &dir);
    let url = redis.url();
    let journal = dir.join("journal").display().to_string();
    let on_redis = [("LEASEHOLD_REDIS_URL", url.as_str())];
    let journaled = [
        ("LEASEHOLD_REDIS_URL", url.as_str()),
        ("LEASEHOLD_JOURNAL_DIR", journal.as_str()),
    ];
    let cases: [(&str, &[(&str, &str)]); 3] = [
        ("rules reload", &[]),
        ("engine loop", &on_redis),
        ("journal writer", &journaled),
    ];
    for (task, extra) in cases {
        let mut env = vec![("LH_FAULT_PANIC_TASK", task)];
        env.extend_from_slice(extra);
        let mut server = Leasehold::start(task, &rules, &[], &env, &dir);
        let channel = tonic::transport::Endpoint::from_shared(server.grpc_uri())
            .expect("uri")
            .connect()
            .await
            .expect("connect");
        let mut health = HealthClient::new(channel);
        let mut saw_not_serving = false;
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            match health
                .check(HealthCheckRequest {
                    service: String::new(),
                })
                .await
            {
                Ok(r) if r.get_ref().status == 2 => {
                    saw_not_serving = true;
                    break;
                }
                Ok(_) => {}
                Err(_) => break,
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let status = server.proc.wait_exit_async(Duration::from_secs(15)).await;
        let log = server.proc.log_text();
        assert!(
            saw_not_serving,
            "{task}: NOT_SERVING was never reported:\n{log}"
        );
        assert!(
            status.is_some_and(|s| s.code().is_some_and(|c| c != 0)),
            "{task}: must exit non-zero, got {status:?}:\n{log}"
        );
        assert!(
            log.contains(&format!("background task '{task}' panicked")),
            "{task}:\n{log}"
        );
    }
}

/// A SIGTERM that arrives while the replica is still starting (here: its
/// Redis accepts connections and never answers) is an orderly stop, not a
/// kill by the signal.
#[test]
fn sigterm_during_startup_is_an_orderly_stop() {
    let dir = test_dir("early-term");
    let rules = write_rules(&dir, "h.yaml", RULES);
    // Accepts (the kernel completes the handshake) and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let redis_url = format!("redis://{}", silent.local_addr().expect("addr"));
    let [g, h, a] = crate::common::free_ports();
    let mut cmd = std::process::Command::new(crate::common::leasehold_bin());
    cmd.args(["serve", "--rules"])
        .arg(&rules)
        .args(["--grpc-addr", &format!("127.0.0.1:{g}")])
        .args(["--http-addr", &format!("127.0.0.1:{h}")])
        .args(["--admin-addr", &format!("127.0.0.1:{a}")])
        .args(["--redis-url", &redis_url]);
    let mut proc = crate::common::spawn("leasehold", &mut cmd, &dir);
    std::thread::sleep(Duration::from_millis(300));
    assert!(proc.try_wait().is_none(), "still starting");
    proc.signal("TERM").expect("signal TERM");
    let status = proc.wait_exit(Duration::from_secs(20));
    let log = proc.log_text();
    assert!(
        status.is_some_and(|s| s.code() == Some(0)),
        "an orderly stop exits 0 (not killed by the signal): {status:?}\n{log}"
    );
    assert!(log.contains("stopped"), "{log}");
}

/// The variables Kubernetes injects for Services named `leasehold` and
/// `leasehold-redis` are ignored with a warning; the replica serves.
#[test]
fn kubernetes_service_links_are_ignored_with_a_warning() {
    let dir = test_dir("service-links");
    let rules = write_rules(&dir, "h.yaml", RULES);
    let server = Leasehold::start(
        "leasehold",
        &rules,
        &[],
        &[
            ("LEASEHOLD_SERVICE_HOST", "10.0.0.7"),
            ("LEASEHOLD_PORT", "tcp://10.0.0.7:8081"),
            ("LEASEHOLD_PORT_8081_TCP_ADDR", "10.0.0.7"),
            ("LEASEHOLD_REDIS_SERVICE_PORT", "6379"),
            ("LEASEHOLD_REDIS_PORT_6379_TCP", "tcp://10.0.0.8:6379"),
            ("LEASEHOLD_REPLICA_ID", "007"),
        ],
        &dir,
    );
    let log = server.proc.log_text();
    for key in ["LEASEHOLD_SERVICE_HOST", "LEASEHOLD_REDIS_PORT_6379_TCP"] {
        assert!(
            log.lines()
                .any(|l| l.contains("service-link") && l.contains(key)),
            "no warning for {key}:\n{log}"
        );
    }
    assert_eq!(get(server.http, "/healthz").expect("healthz").status, 200);
    let status = get(server.admin, "/status").expect("status").body;
    assert!(
        status.contains("\"007\""),
        "the id keeps its text: {status}"
    );
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Hostile rules dropped into the watched directory: an alias bomb, a
/// file nested past the depth bound, a file past the size bound. Each
/// reload fails, the old rules keep deciding, and memory stays flat (an
/// alias bomb took a replica to 1 GB before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_rules_on_reload_keep_the_old_rules_without_a_memory_spike() {
    let dir = test_dir("bad-reload");
    let rules = write_rules(&dir, "h.yaml", RULES);
    let server = Leasehold::start("leasehold", &rules, &[], &[], &dir);
    let pid = server.proc.pid();
    let before = rss_kib(pid);
    let mut bomb = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
    for i in 1..10 {
        let refs = vec![format!("*a{}", i - 1); 10].join(", ");
        bomb.push_str(&format!("a{i}: &a{i} [{refs}]\n"));
    }
    let deep = format!("{}x{}\n", "[".repeat(100), "]".repeat(100));
    let huge = format!("# {}\ndomain: huge\n", "x".repeat(5 * 1024 * 1024));
    let cases = [
        ("bomb.yaml", bomb, "YAML nodes"),
        ("deep.yaml", deep, "nested deeper"),
        ("huge.yaml", huge, "larger than"),
    ];
    let admin = server.admin;
    let mut peak = before;
    for (n, (file, text, needle)) in cases.into_iter().enumerate() {
        let path = rules.join(file);
        std::fs::write(&path, text).expect("write hostile rules");
        let want = format!("\"reload_failures\":{}", n + 1);
        let needle = needle.to_string();
        let seen = tokio::task::spawn_blocking(move || {
            let mut peak = 0;
            let ok = crate::common::wait_until(Duration::from_secs(10), || {
                peak = peak.max(rss_kib(pid));
                get(admin, "/rules")
                    .map(|r| r.body.contains(&want) && r.body.contains(&needle))
                    .unwrap_or(false)
            });
            (ok, peak)
        })
        .await
        .expect("join");
        assert!(
            seen.0,
            "{file}: reload failure not reported:\n{}",
            server.proc.log_tail(20)
        );
        peak = peak.max(seen.1);
        std::fs::remove_file(&path).expect("remove");
    }
    // Still alive and deciding with the old rules.
    let mut client = RateLimitServiceClient::connect(server.grpc_uri())
        .await
        .expect("connect");
    let r = client
        .should_rate_limit(single("h", &[("user", "after")]))
        .await
        .expect("decides")
        .into_inner();
    assert_eq!(r.statuses[0].limit_remaining, 999, "old rules in force");
    let grown = peak.saturating_sub(before);
    assert!(
        grown < 64 * 1024,
        "RSS grew by {grown} KiB ({before} → {peak} KiB)"
    );
    println!("RSS before {before} KiB, peak during hostile reloads {peak} KiB");
}

/// The gRPC port advertises its concurrent-stream limit in its HTTP/2
/// SETTINGS (`grpc_max_concurrent_streams`, 1024 by default): past it a
/// client's new calls wait for a stream instead of piling up in the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_advertises_its_concurrent_stream_limit() {
    let dir = test_dir("streams");
    let rules = write_rules(&dir, "h.yaml", RULES);
    for (setting, want) in [(None, 1024), (Some("7"), 7)] {
        let env: Vec<(&str, &str)> = setting
            .map(|v| vec![("LEASEHOLD_GRPC_MAX_CONCURRENT_STREAMS", v)])
            .unwrap_or_default();
        let server = Leasehold::start("leasehold", &rules, &[], &env, &dir);
        let tcp = tokio::net::TcpStream::connect(server.grpc)
            .await
            .expect("connect");
        let (_send, mut conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
        let deadline = Instant::now() + Duration::from_secs(5);
        while conn.max_concurrent_send_streams() != want && Instant::now() < deadline {
            // Drives the connection so the server's SETTINGS are read.
            let _ = tokio::time::timeout(Duration::from_millis(50), &mut conn).await;
        }
        assert_eq!(conn.max_concurrent_send_streams(), want, "{setting:?}");
    }
}

/// A gRPC peer that opens a connection and then stops answering (it sent
/// its HTTP/2 preface and reads nothing more) is cut off by the keepalive
/// PING going unanswered; here with a 300 ms interval and timeout.
#[test]
fn a_grpc_peer_that_stops_answering_is_cut_off_by_keepalive() {
    let dir = test_dir("keepalive");
    let rules = write_rules(&dir, "h.yaml", RULES);
    let server = Leasehold::start(
        "leasehold",
        &rules,
        &[],
        // 300 ms instead of 30 s / 10 s only to keep the test short.
        &[
            ("LEASEHOLD_GRPC_KEEPALIVE_INTERVAL_MS", "300"),
            ("LEASEHOLD_GRPC_KEEPALIVE_TIMEOUT_MS", "300"),
        ],
        &dir,
    );
    let mut peer = TcpStream::connect(server.grpc).expect("connect");
    // The client preface and an empty SETTINGS frame, then silence: no
    // SETTINGS ACK and no PING ACK ever.
    peer.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .expect("preface");
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    // Whatever the server wrote meanwhile (its SETTINGS, PINGs, a GOAWAY)
    // is read now; the connection must be closed by the end of it.
    peer.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut buf = [0u8; 4096];
    let closed = loop {
        match peer.read(&mut buf) {
            Ok(0) => break true,
            Ok(_) => continue,
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                break false
            }
            Err(_) => break true,
        }
    };
    assert!(
        closed,
        "the silent peer still holds its connection after {:?}",
        started.elapsed()
    );
}
