//! TLS with certificates the tests make (openssl): gRPC over TLS and mutual
//! TLS against grpcurl and a tonic client, certificate rotation without a
//! restart, and a real Envoy calling leasehold over mutual TLS.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::{desc, request, require, test_dir, wait_until, write_rules, Leasehold};
use leasehold::proto::rls::rate_limit_response::Code;
use leasehold::proto::rls::rate_limit_service_client::RateLimitServiceClient;

const RULES: &str = "domain: edge\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 3}\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1000000}\n";

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new(require("openssl"))
        .current_dir(dir)
        .args(args)
        .output()
        .expect("run openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA (`<name>.pem`, `<name>.key`) in `dir`.
fn ca(dir: &Path, name: &str) -> PathBuf {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.pem"),
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
        ],
    );
    dir.join(format!("{name}.pem"))
}

/// A leaf certificate signed by CA `ca`: `<name>.pem` and `<name>.key`.
/// `usage` is serverAuth (with SANs localhost and 127.0.0.1) or clientAuth.
fn leaf(dir: &Path, ca: &str, name: &str, usage: &str) -> (PathBuf, PathBuf) {
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
            "-subj",
            &format!("/CN={name}"),
        ],
    );
    let ext = format!("{name}.ext");
    std::fs::write(
        dir.join(&ext),
        format!("subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage={usage}\n"),
    )
    .expect("write ext");
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-out",
            &format!("{name}.pem"),
            "-days",
            "2",
            "-extfile",
            &ext,
        ],
    );
    (
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}.key")),
    )
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// grpcurl against `addr` with `tls` flags; true when the call succeeded.
fn grpcurl_call(addr: std::net::SocketAddr, tls: &[String]) -> (bool, String) {
    let body = r#"{"domain":"edge","descriptors":[{"entries":[{"key":"k","value":"v"}]}]}"#;
    let out = Command::new(require("grpcurl"))
        .args(tls)
        .args(["-max-time", "5", "-d", body])
        .arg(addr.to_string())
        .arg("envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit")
        .output()
        .expect("run grpcurl");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success() && text.contains("\"OK\""), text)
}

fn flags(pairs: &[(&str, &Path)]) -> Vec<String> {
    pairs
        .iter()
        .flat_map(|(f, p)| [f.to_string(), s(p)])
        .collect()
}

/// TLS on the gRPC port: grpcurl with the CA succeeds, plaintext is
/// refused; the largest request is answered well under Envoy's 20 ms over
/// TLS too (socket options kept on the TLS path); replacing the files
/// switches certificates without a restart, and a broken replacement keeps
/// the previous ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_over_tls_rotates_certificates_without_a_restart() {
    let dir = test_dir("tls");
    let certs = dir.join("certs");
    std::fs::create_dir_all(&certs).expect("certs dir");
    let ca1 = ca(&certs, "ca1");
    let ca2 = ca(&certs, "ca2");
    let (s1, k1) = leaf(&certs, "ca1", "server1", "serverAuth");
    let (s2, k2) = leaf(&certs, "ca2", "server2", "serverAuth");
    let cert = certs.join("server.pem");
    let key = certs.join("server.key");
    std::fs::copy(&s1, &cert).expect("copy");
    std::fs::copy(&k1, &key).expect("copy");
    let rules = write_rules(&dir, "edge.yaml", RULES);
    let server = Leasehold::start(
        "leasehold",
        &rules,
        &["--grpc-tls-cert", &s(&cert), "--grpc-tls-key", &s(&key)],
        &[],
        &dir,
    );
    let addr = server.grpc;
    let (ok, text) = grpcurl_call(addr, &flags(&[("-cacert", &ca1)]));
    assert!(ok, "TLS with the CA: {text}");
    let (ok, text) = grpcurl_call(addr, &["-plaintext".to_string()]);
    assert!(!ok, "plaintext on a TLS port must fail: {text}");
    let (ok, _) = grpcurl_call(addr, &flags(&[("-cacert", &ca2)]));
    assert!(!ok, "a CA that did not sign the certificate");

    // The largest request over TLS, on one connection.
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(
            std::fs::read(&ca1).expect("ca"),
        ))
        .domain_name("localhost");
    let channel = tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
        .expect("uri")
        .tls_config(tls)
        .expect("tls")
        .connect()
        .await
        .expect("connect over TLS");
    let mut client = RateLimitServiceClient::new(channel);
    let descriptors: Vec<_> = (0..64)
        .map(|i| desc(&[("k", &format!("{i:0>100}"))]))
        .collect();
    let mut took = Vec::new();
    for i in 0..23 {
        let started = Instant::now();
        let reply = client
            .should_rate_limit(request("edge", descriptors.clone()))
            .await
            .expect("call")
            .into_inner();
        assert_eq!(reply.overall_code, Code::Ok as i32);
        if i >= 3 {
            took.push(started.elapsed());
        }
    }
    took.sort();
    let median = took[took.len() / 2];
    assert!(
        median < Duration::from_millis(10),
        "TLS: median {median:?} for 64 descriptors, all: {took:?}"
    );

    // A broken replacement (a key that does not match) keeps the old pair.
    std::fs::copy(&s2, &cert).expect("copy");
    std::fs::copy(&k1, &key).expect("copy");
    let kept = tokio::task::spawn_blocking({
        let proc_log = dir.join("leasehold.log");
        move || {
            wait_until(Duration::from_secs(10), || {
                std::fs::read_to_string(&proc_log)
                    .is_ok_and(|l| l.contains("do not load; keeping the previous ones"))
            })
        }
    })
    .await
    .expect("join");
    assert!(
        kept,
        "broken pair not reported:\n{}",
        server.proc.log_tail(10)
    );
    let (ok, text) = grpcurl_call(addr, &flags(&[("-cacert", &ca1)]));
    assert!(ok, "the previous certificate still serves: {text}");

    // The matching key arrives: the new certificate is served.
    std::fs::copy(&k2, &key).expect("copy");
    let rotated = tokio::task::spawn_blocking(move || {
        wait_until(Duration::from_secs(10), || {
            grpcurl_call(addr, &flags(&[("-cacert", &ca2)])).0
        })
    })
    .await
    .expect("join");
    assert!(
        rotated,
        "rotation not picked up:\n{}",
        server.proc.log_tail(10)
    );
    let (ok, _) = grpcurl_call(addr, &flags(&[("-cacert", &ca1)]));
    assert!(!ok, "the old certificate is gone");
}

/// leasehold under mutual TLS: a CA `ca1` (also the client CA) and a
/// server certificate it signed, in `<dir>/certs`. Returns the server, the
/// certificate directory and the CA's file.
fn start_mtls(dir: &Path) -> (Leasehold, PathBuf, PathBuf) {
    let certs = dir.join("certs");
    std::fs::create_dir_all(&certs).expect("certs dir");
    let ca1 = ca(&certs, "ca1");
    let (cert, key) = leaf(&certs, "ca1", "server", "serverAuth");
    let rules = write_rules(dir, "edge.yaml", RULES);
    let tls = [
        "--grpc-tls-cert".to_string(),
        s(&cert),
        "--grpc-tls-key".to_string(),
        s(&key),
        "--grpc-tls-client-ca".to_string(),
        s(&ca1),
    ];
    let args: Vec<&str> = tls.iter().map(String::as_str).collect();
    let server = Leasehold::start("leasehold", &rules, &args, &[], dir);
    (server, certs, ca1)
}

/// Mutual TLS: no client certificate, or one from another CA, is refused;
/// one signed by `grpc_tls_client_ca` is answered.
#[test]
fn mutual_tls_refuses_clients_without_a_trusted_certificate() {
    let dir = test_dir("mtls");
    let (server, certs, ca1) = start_mtls(&dir);
    ca(&certs, "other");
    let (ccert, ckey) = leaf(&certs, "ca1", "client", "clientAuth");
    let (xcert, xkey) = leaf(&certs, "other", "stranger", "clientAuth");
    let (ok, text) = grpcurl_call(server.grpc, &flags(&[("-cacert", &ca1)]));
    assert!(!ok, "no client certificate must be refused: {text}");
    let (ok, text) = grpcurl_call(
        server.grpc,
        &flags(&[("-cacert", &ca1), ("-cert", &xcert), ("-key", &xkey)]),
    );
    assert!(!ok, "a client certificate from another CA: {text}");
    let (ok, text) = grpcurl_call(
        server.grpc,
        &flags(&[("-cacert", &ca1), ("-cert", &ccert), ("-key", &ckey)]),
    );
    assert!(ok, "a trusted client certificate: {text}");
}

/// The deployment template's mutual-TLS option: a real Envoy presents its
/// client certificate to leasehold and limits as over plaintext.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_calls_leasehold_over_mutual_tls() {
    let dir = test_dir("envoy-mtls");
    let (server, certs, ca1) = start_mtls(&dir);
    let (ccert, ckey) = leaf(&certs, "ca1", "envoy", "clientAuth");
    let rls_tls =
        leasehold::ops::deploy::envoy_rls_mtls(&s(&ca1), &s(&ccert), &s(&ckey), "localhost");
    let (envoy_proc, admin, ingress, upstream) =
        crate::e2e::start_envoy(&dir, server.grpc.port(), &rls_tls).await;
    let results = tokio::task::spawn_blocking(move || {
        let statuses: Vec<u16> = (0..5)
            .map(|_| {
                crate::common::http("GET", ingress, "/hello", &[("x-user", "tls-user")], "")
                    .expect("request through envoy")
                    .status
            })
            .collect();
        let stats = crate::common::get(admin, "/stats").expect("stats").body;
        drop(envoy_proc);
        (statuses, stats)
    })
    .await
    .expect("join");
    upstream.abort();
    let (statuses, stats) = results;
    assert_eq!(statuses, [200, 200, 200, 429, 429], "{stats}");
    let handshakes = stats
        .lines()
        .find(|l| l.starts_with("cluster.leasehold.ssl.handshake:"))
        .unwrap_or_default();
    assert!(
        !handshakes.ends_with(": 0") && !handshakes.is_empty(),
        "Envoy made TLS handshakes to leasehold: {handshakes:?}"
    );
}

/// A real TLS redis-server that requires client certificates: leasehold
/// reaches it with `redis_tls_ca`, `redis_tls_cert` and `redis_tls_key`
/// and counts there; without its client certificate Redis refuses it and
/// the replica decides on its lease instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_over_mutual_tls() {
    let dir = test_dir("redis-tls");
    let certs = dir.join("certs");
    std::fs::create_dir_all(&certs).expect("certs dir");
    let ca1 = ca(&certs, "ca1");
    let (rcert, rkey) = leaf(&certs, "ca1", "redis", "serverAuth");
    let (ccert, ckey) = leaf(&certs, "ca1", "replica", "clientAuth");
    let port = crate::common::free_port();
    let mut cmd = Command::new(require("redis-server"));
    cmd.args([
        "--port",
        "0",
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
    ])
    .args(["--tls-port", &port.to_string()])
    .args(["--tls-cert-file", &s(&rcert), "--tls-key-file", &s(&rkey)])
    .args(["--tls-ca-cert-file", &s(&ca1), "--tls-auth-clients", "yes"])
    .arg("--dir")
    .arg(&dir);
    let redis = crate::common::spawn("redis-tls", &mut cmd, &dir);
    let cli = |args: &[&str]| {
        Command::new(require("redis-cli"))
            .args([
                "--tls",
                "--cacert",
                &s(&ca1),
                "--cert",
                &s(&ccert),
                "--key",
                &s(&ckey),
            ])
            .args(["-p", &port.to_string()])
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    };
    let up = wait_until(Duration::from_secs(10), || cli(&["ping"]) == "PONG");
    assert!(up, "TLS redis did not start:\n{}", redis.log_text());

    let url = format!("rediss://127.0.0.1:{port}");
    let rules = write_rules(&dir, "edge.yaml", RULES);
    let tls_env = [
        ("LEASEHOLD_REDIS_URL", url.as_str()),
        // A generous budget because the test asserts that all four
        // decisions were made on Redis (a first TLS handshake can outlast
        // the 5 ms default, and that call would go to the lease); TLS, not
        // the budget, is what is tested here.
        ("LEASEHOLD_REDIS_DEADLINE_MS", "250"),
        ("LEASEHOLD_REDIS_TLS_CA", &s(&ca1)),
        ("LEASEHOLD_REDIS_TLS_CERT", &s(&ccert)),
        ("LEASEHOLD_REDIS_TLS_KEY", &s(&ckey)),
    ];
    let ca_only: Vec<(&str, &str)> = tls_env[..3].to_vec();
    let env: Vec<(&str, String)> = tls_env.iter().map(|(k, v)| (*k, v.to_string())).collect();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let server = Leasehold::start("leasehold", &rules, &[], &env, &dir);
    let mut client = RateLimitServiceClient::connect(server.grpc_uri())
        .await
        .expect("connect");
    let mut codes = Vec::new();
    for _ in 0..4 {
        let r = client
            .should_rate_limit(request("edge", vec![desc(&[("user", "tls")])]))
            .await
            .expect("call")
            .into_inner();
        codes.push(r.overall_code);
    }
    assert_eq!(
        codes,
        [
            Code::Ok as i32,
            Code::Ok as i32,
            Code::Ok as i32,
            Code::OverLimit as i32
        ]
    );
    let status: serde_json::Value = serde_json::from_str(
        &crate::common::get(server.admin, "/status")
            .expect("status")
            .body,
    )
    .expect("json");
    assert_eq!(
        status["engine"]["decisions"]["redis"].as_u64(),
        Some(4),
        "decided on Redis: {status}"
    );
    let keys = cli(&["--scan", "--pattern", "lh:*"]);
    assert!(
        keys.contains("user=tls"),
        "counted in the TLS Redis: {keys:?}"
    );
    drop(server);

    // The CA alone: Redis requires a client certificate, so the replica
    // cannot reach it and decides on its lease, without errors.
    let other = Leasehold::start("no-client-cert", &rules, &[], &ca_only, &dir);
    let mut client = RateLimitServiceClient::connect(other.grpc_uri())
        .await
        .expect("connect");
    let r = client
        .should_rate_limit(request("edge", vec![desc(&[("user", "lease")])]))
        .await
        .expect("a decision, not an error")
        .into_inner();
    assert_eq!(r.overall_code, Code::Ok as i32);
    let status: serde_json::Value = serde_json::from_str(
        &crate::common::get(other.admin, "/status")
            .expect("status")
            .body,
    )
    .expect("json");
    assert_eq!(
        status["engine"]["decisions"]["redis"].as_u64(),
        Some(0),
        "{status}"
    );
    drop(redis);
}
