//! The journal on a real Redis when a replay's outcome is unknown: what a
//! restarted replica writes must cover every grant whatever Redis kept.

use std::time::Duration;

use crate::common::proxy::{FaultProxy, Mode};
use crate::common::{single, test_dir, wait_until, Leasehold, RedisServer};
use crate::fault_e2e::{now_ms, on_leases, status};
use leasehold::proto::rls::rate_limit_response::Code;
use leasehold::proto::rls::rate_limit_service_client::RateLimitServiceClient;
use leasehold::redis::scripts::{DECIDE_LUA, REPLAY_LUA};

/// A take-back replayed with its reply lost, then lease grants, then a
/// crash: the restart from the journal leaves Redis holding exactly what
/// was granted. The steps:
/// 1. a call answers past its 15 ms budget (the proxy delays it): denied,
///    yet Redis counted it, so its late reply takes it back locally, and
///    the local count goes to -1;
/// 2. the replay that writes -1 runs in Redis, but its reply is lost:
///    Redis may hold -1 or 0, and the replica cannot tell which;
/// 3. Redis goes silent (black hole) and the replica grants on its lease;
/// 4. kill -9, Redis back, a restart from the journal.
///
/// A journal that counted only from the last confirmed local count (0)
/// made the restart build on Redis's -1 and undercount by one: one grant
/// too many allowed, with no bound. Default settings, but a journal
/// directory and faster membership and probes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_from_the_journal_after_a_replay_in_doubt_counts_exactly() {
    let dir = test_dir("journal-doubt");
    let redis = RedisServer::start("redis", &dir);
    let proxy = FaultProxy::start(redis.port).await;
    let rules = dir.join("rules");
    std::fs::create_dir_all(&rules).expect("mkdir");
    std::fs::write(rules.join("d.yaml"), "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 1000}\n").expect("write");
    let journal = dir.join("journal");
    let url = proxy.url();
    let journal_s = journal.display().to_string();
    let env = [
        ("LEASEHOLD_REDIS_URL", url.as_str()),
        ("LEASEHOLD_MEMBERSHIP_HEARTBEAT_MS", "200"),
        ("LEASEHOLD_MEMBERSHIP_TTL_MS", "1000"),
        ("LEASEHOLD_BREAKER_PROBE_INTERVAL_MS", "200"),
        ("LEASEHOLD_BREAKER_PROBE_JITTER_MS", "50"),
        ("LEASEHOLD_JOURNAL_DIR", journal_s.as_str()),
    ];
    // The replay script's name in Redis: only replay calls carry it.
    let replay_sha = redis.cli(&["SCRIPT", "LOAD", REPLAY_LUA]).trim().to_owned();
    assert_eq!(replay_sha.len(), 40, "SCRIPT LOAD: {replay_sha:?}");
    // Loaded ahead, so that the first call needs no second round trip
    // (NOSCRIPT, then a load) to stay inside its budget.
    redis.cli(&["SCRIPT", "LOAD", DECIDE_LUA]);
    // Stay inside one minute window for the whole test.
    let into = now_ms() % 60_000;
    if into > 30_000 {
        tokio::time::sleep(Duration::from_millis(60_050 - into)).await;
    }
    let window = now_ms() / 60_000;
    let key = format!("lh:v2{{d|k=v#60:fw}}@{window}");
    let first = tokio::task::block_in_place(|| {
        Leasehold::start("first", &rules, &["--replica-id", "d1"], &env, &dir)
    });
    let index = status(first.admin)
        .and_then(|s| s["engine"]["redis"]["membership"]["index"].as_u64())
        .expect("registered");
    let client = RateLimitServiceClient::connect(first.grpc_uri())
        .await
        .expect("connect");
    let ask = || {
        let mut client = client.clone();
        async move {
            let r = client
                .should_rate_limit(single("d", &[("k", "v")]))
                .await
                .expect("answered")
                .into_inner();
            u64::from(r.overall_code == Code::Ok as i32)
        }
    };
    let mut granted = ask().await;
    assert_eq!(granted, 1, "on Redis");
    // 1-2: the late call, and its take-back's replay with the reply lost.
    proxy.drop_replies_to(&replay_sha);
    proxy.set(Mode::Latency(Duration::from_millis(20)));
    let late = ask().await;
    proxy.set(Mode::Pass);
    assert_eq!(late, 0, "past its budget: denied");
    let local_field = format!("o{index}");
    // Redis holds -1 and the replica saw its replay fail (a reply dropped
    // elsewhere would leave the replay confirmed, and nothing in doubt).
    let applied = tokio::task::block_in_place(|| {
        wait_until(Duration::from_secs(5), || {
            redis.cli(&["HGET", &key, &local_field]).trim() == "-1"
                && first.proc.log_text().contains("replay failed")
        })
    });
    let s = status(first.admin);
    assert!(
        applied,
        "the take-back's replay ran and its reply was lost: dropped {}, {}, status {s:?}\n{}",
        proxy.dropped_replies(),
        redis.cli(&["HGETALL", &key]),
        first.proc.log_text()
    );
    // 3: Redis silent before a replay can confirm -1 (every replay's reply
    // is still dropped until then).
    proxy.set(Mode::Blackhole);
    granted += on_leases(&first, single("d", &[("k", "v")])).await as u64;
    for _ in 0..5 {
        granted += ask().await;
    }
    assert!(granted >= 6, "granted on the lease: {granted}");
    let wrong = status(first.admin)
        .and_then(|s| s["engine"]["decisions"]["wrong_denials"].as_u64())
        .unwrap_or(0);
    assert_eq!(
        wrong, 1,
        "the late call was counted by Redis and taken back"
    );
    // The journal is written at most every 100 ms.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    // 4: crash, Redis back, restart.
    let mut first = first;
    first.proc.signal("KILL").expect("signal KILL");
    let _ = tokio::task::block_in_place(|| first.proc.wait_exit(Duration::from_secs(5)));
    proxy.clear_trap();
    proxy.set(Mode::Pass);
    proxy.cut();
    let second = tokio::task::block_in_place(|| {
        Leasehold::start("second", &rules, &["--replica-id", "d1"], &env, &dir)
    });
    let exact = tokio::task::block_in_place(|| {
        wait_until(Duration::from_secs(15), || {
            redis.window_total(&key) == Some(granted as i64)
                && status(second.admin)
                    .is_some_and(|s| s["engine"]["ledger"]["keys_to_replay"] == 0)
        })
    });
    assert!(
        exact,
        "Redis holds the {granted} grants: {}\n{}",
        redis.cli(&["HGETALL", &key]),
        second.proc.log_text()
    );
}
