//! The Redis engine behind Redis Sentinel (a primary, one replica, three
//! sentinels): a failover that loses acknowledged writes is detected and
//! healed. Run one test at a time.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::common::sentinel::RedisSentinel;
use crate::common::{get, now_ms, single, test_dir, wait_until, write_rules, Leasehold};
use leasehold::proto::rls::rate_limit_response::Code;
use leasehold::proto::rls::rate_limit_service_client::RateLimitServiceClient;
use tonic::transport::Channel;

fn rules(dir: &Path, text: &str) -> PathBuf {
    write_rules(dir, "rules.yaml", text)
}

/// `n` requests for user `u`, one after the other: (admitted, errors).
async fn send(c: &mut RateLimitServiceClient<Channel>, n: usize) -> (u64, u64) {
    let (mut ok, mut errors) = (0, 0);
    for _ in 0..n {
        match c.should_rate_limit(single("edge", &[("user", "u")])).await {
            Ok(r) if r.get_ref().overall_code == Code::Ok as i32 => ok += 1,
            Ok(_) => {}
            Err(_) => errors += 1,
        }
    }
    (ok, errors)
}

/// The primary takes 20 writes its replica never sees (the replica paused
/// with SIGSTOP and its link closed first), then dies (SIGKILL); the sentinels promote the
/// replica, which lacks them. leasehold finds its own field below what it
/// knows it wrote, re-asserts its counts, and the limit holds: at most 5%
/// over it in all, and afterwards the new primary holds exactly the
/// grants. Two replicas, default settings, load throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_lost_in_a_failover_are_detected_and_healed() {
    let dir = test_dir("sentinel");
    let mut deployment = tokio::task::block_in_place(|| RedisSentinel::start(&dir, 1_000));
    let url = deployment.url();
    let limit = 100u64;
    let r = rules(
        &dir,
        &format!("domain: edge\ndescriptors:\n  - key: user\n    rate_limit: {{unit: minute, requests_per_unit: {limit}}}\n"),
    );
    let env = [("LEASEHOLD_REDIS_URL", url.as_str())];
    let a = tokio::task::block_in_place(|| {
        Leasehold::start("a", &r, &["--replica-id", "a"], &env, &dir)
    });
    let b = tokio::task::block_in_place(|| {
        Leasehold::start("b", &r, &["--replica-id", "b"], &env, &dir)
    });
    // A steady fleet: each replica has seen the other's heartbeat (a
    // replica that has not yet would lease the whole limit alone).
    let both = tokio::task::block_in_place(|| {
        wait_until(Duration::from_secs(10), || {
            [&a, &b].iter().all(|rep| {
                rep.status()["engine"]["redis"]["membership"]["live"]
                    .as_array()
                    .is_some_and(|l| l.len() == 2)
                    && rep.status()["engine"]["members_for_leases"] == 2
            })
        })
    });
    assert!(both, "two live members");
    let topology = &a.status()["engine"]["redis"]["topology"];
    assert_eq!(topology["mode"], "sentinel", "{topology}");
    let into = now_ms() % 60_000;
    if into > 20_000 {
        tokio::time::sleep(Duration::from_millis(60_000 - into + 50)).await;
    }
    let window = now_ms() / 60_000;
    let key = format!("lh:v2{{edge|user=u#60:fw}}@{window}");
    let mut ca = RateLimitServiceClient::connect(a.grpc_uri())
        .await
        .expect("a");
    let mut cb = RateLimitServiceClient::connect(b.grpc_uri())
        .await
        .expect("b");

    // 30 grants, replicated, from both replicas.
    let (a1, e1) = send(&mut ca, 15).await;
    let (b1, f1) = send(&mut cb, 15).await;
    let first = a1 + b1;
    assert_eq!((first, e1 + f1), (30, 0));
    assert!(tokio::task::block_in_place(|| deployment.wait_replicated()));
    // 20 more that only the primary ever sees: the replica is paused and
    // its link closed, so the primary has no replica to send them to.
    deployment
        .replica
        .proc
        .signal("STOP")
        .expect("pause the replica");
    deployment
        .primary
        .cli(&["CLIENT", "KILL", "TYPE", "replica"]);
    let (a2, e2) = send(&mut ca, 10).await;
    let (b2, f2) = send(&mut cb, 10).await;
    let unreplicated = a2 + b2;
    assert_eq!((unreplicated, e2 + f2), (20, 0));
    assert_eq!(deployment.primary.window_total(&key), Some(50));
    let old_primary = deployment.primary.port;
    tokio::task::block_in_place(|| deployment.primary.kill());
    deployment
        .replica
        .proc
        .signal("CONT")
        .expect("resume the replica");

    // Load on both replicas through the failover and after it.
    let mut admitted = first + unreplicated;
    let mut errors = 0;
    let until = Instant::now() + Duration::from_secs(15);
    while Instant::now() < until {
        for c in [&mut ca, &mut cb] {
            let (ok, e) = send(c, 5).await;
            admitted += ok;
            errors += e;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let promoted = deployment.primary_port();
    assert_ne!(
        promoted,
        Some(old_primary),
        "the sentinels promoted the replica"
    );
    assert_eq!(promoted, Some(deployment.replica.port));
    let settled = tokio::task::block_in_place(|| {
        wait_until(Duration::from_secs(20), || {
            [&a, &b].iter().all(|rep| {
                let s = rep.status();
                s["engine"]["ledger"]["keys_to_replay"] == 0 && s["engine"]["path"] == "redis"
            })
        })
    });
    // Found either way: a decision whose reply shows this replica's field
    // below what it knew, or the repair after the outage raising it.
    let (sa, sb) = (a.status(), b.status());
    let found = |s: &serde_json::Value| {
        s["engine"]["replay"]["data_loss_detected"]
            .as_u64()
            .unwrap_or(0)
            + s["engine"]["redis"]["repairs_raised"].as_u64().unwrap_or(0)
    };
    let report = format!(
        "admitted {admitted}, errors {errors}, settled {settled}, Redis {:?}, loss found by a {} b {}; a: {} {}, b: {} {}",
        deployment.replica.window_total(&key),
        found(&sa),
        found(&sb),
        sa["engine"]["decisions"],
        sa["engine"]["replay"],
        sb["engine"]["decisions"],
        sb["engine"]["replay"]
    );
    eprintln!("{report}");
    assert_eq!(errors, 0, "{report}");
    assert!(found(&sa) + found(&sb) >= 1, "the loss was found: {report}");
    assert!(admitted <= limit + limit / 20, "{report}");
    assert!(admitted >= limit, "the limit is reached: {report}");
    assert!(settled, "{report}");
    assert_eq!(
        deployment.replica.window_total(&key),
        Some(admitted as i64),
        "the new primary holds every grant: {report}"
    );
}

/// Every password in a Sentinel URL (the primary's in the authority, the
/// sentinels' in the query) is redacted on /status, the status page and in
/// the log, here with no sentinel answering.
#[test]
fn passwords_in_a_sentinel_url_never_show() {
    let dir = test_dir("sentinel-secrets");
    let r = rules(&dir, "domain: edge\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 10}\n");
    let port = crate::common::free_port();
    let url = format!(
        "redis-sentinel://app:first-secret@127.0.0.1:{port}/0?sentinelServiceName=main&sentinelUsername=s&sentinelPassword=second-secret&node=127.0.0.1:{port}"
    );
    let server = Leasehold::start("s", &r, &[], &[("LEASEHOLD_REDIS_URL", url.as_str())], &dir);
    let s = server.status();
    let shown = s["engine"]["redis"]["redis"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        shown.contains("app:***@") && shown.contains("sentinelPassword=***"),
        "{shown}"
    );
    assert_eq!(s["engine"]["redis"]["topology"]["mode"], "sentinel", "{s}");
    let page = get(server.admin, "/status.html").expect("page").body;
    std::thread::sleep(Duration::from_millis(500));
    for text in [s.to_string(), page, server.proc.log_text()] {
        assert!(
            !text.contains("first-secret") && !text.contains("second-secret"),
            "{text}"
        );
    }
    // A URL leasehold cannot use is a settings error, also redacted.
    let out = std::process::Command::new(crate::common::leasehold_bin())
        .args(["serve", "--rules"])
        .arg(&r)
        .args([
            "--redis-url",
            "redis-sentinel://u:third-secret@h:1?sentinelPassword=fourth-secret",
        ])
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("redis_url")
            && !err.contains("third-secret")
            && !err.contains("fourth-secret"),
        "{err}"
    );
}
