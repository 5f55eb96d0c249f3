//! The journal (`journal_dir`) on a real Redis behind a fault proxy: lease
//! grants a replica made while cut off reach the journal promptly and
//! survive a kill -9, and what a restarted replica writes covers every
//! grant even when a replay's outcome was unknown.

use std::path::PathBuf;
use std::time::Duration;

use crate::common::proxy::{FaultProxy, Mode};
use crate::common::{single, test_dir, wait_until, Leasehold, RedisServer};
use crate::fault_e2e::{now_ms, on_leases, status};
use leasehold::proto::rls::rate_limit_response::Code;
use leasehold::proto::rls::rate_limit_service_client::RateLimitServiceClient;
use leasehold::redis::scripts::{DECIDE_LUA, REPLAY_LUA};
use tonic::transport::Channel;

/// A Redis behind a fault proxy, the rule `<domain>: k` at 1,000 a minute,
/// and a journal directory; started inside a minute window with at least
/// 30 s left, so a test stays in one window.
struct Journaled {
    dir: PathBuf,
    redis: RedisServer,
    proxy: FaultProxy,
    rules: PathBuf,
    url: String,
    journal: PathBuf,
    journal_s: String,
    /// The key of the counter `k=v` in the current minute window.
    key: String,
}

impl Journaled {
    async fn start(tag: &str, domain: &str) -> Journaled {
        let dir = test_dir(tag);
        let redis = RedisServer::start("redis", &dir);
        let proxy = FaultProxy::start(redis.port).await;
        let rules = dir.join("rules");
        std::fs::create_dir_all(&rules).expect("mkdir");
        let rule = format!("domain: {domain}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: minute, requests_per_unit: 1000}}\n");
        std::fs::write(rules.join(format!("{domain}.yaml")), rule).expect("write");
        let journal = dir.join("journal");
        let into = now_ms() % 60_000;
        if into > 30_000 {
            tokio::time::sleep(Duration::from_millis(60_050 - into)).await;
        }
        let window = now_ms() / 60_000;
        Journaled {
            url: proxy.url(),
            journal_s: journal.display().to_string(),
            key: format!("lh:v2{{{domain}|k=v#60:fw}}@{window}"),
            dir,
            redis,
            proxy,
            rules,
            journal,
        }
    }

    /// The replicas' settings: the defaults, through the proxy and with
    /// the journal. (These tests ran with faster membership and probes
    /// once; they wait a membership TTL longer without, and see the same.)
    fn env(&self) -> Vec<(&str, &str)> {
        vec![
            ("LEASEHOLD_REDIS_URL", self.url.as_str()),
            ("LEASEHOLD_JOURNAL_DIR", self.journal_s.as_str()),
        ]
    }

    /// Waits up to `limit` for replica `id`'s journal to hold `local_own`
    /// grants in the key's window: whether it did, and the journal's text.
    fn journal_holds(&self, id: &str, local_own: i64, limit: Duration) -> (bool, String) {
        let file = self.journal.join(format!("{id}.journal.json"));
        let want = format!("\"local_own\":{local_own}");
        let read = || std::fs::read_to_string(&file).unwrap_or_default();
        let held = tokio::task::block_in_place(|| wait_until(limit, || read().contains(&want)));
        (held, read())
    }

    fn replica(&self, name: &str, id: &str, env: &[(&str, &str)]) -> Leasehold {
        tokio::task::block_in_place(|| {
            Leasehold::start(name, &self.rules, &["--replica-id", id], env, &self.dir)
        })
    }
}

/// kill -9, and the exit waited for.
fn crash(mut replica: Leasehold) {
    replica.proc.signal("KILL").expect("signal KILL");
    let _ = tokio::task::block_in_place(|| replica.proc.wait_exit(Duration::from_secs(5)));
}

/// One call for `k=v` in `domain`: whether it was admitted.
async fn admitted(client: &RateLimitServiceClient<Channel>, domain: &str) -> bool {
    let r = client
        .clone()
        .should_rate_limit(single(domain, &[("k", "v")]))
        .await
        .expect("answered")
        .into_inner();
    r.overall_code == Code::Ok as i32
}

/// With `journal_dir`, lease grants a replica made while cut off from Redis
/// survive a kill -9 of the replica and reach Redis when it starts again.
/// Default settings, with a journal directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn journaled_outage_usage_survives_a_replica_crash() {
    let j = Journaled::start("journal", "j").await;
    let env = j.env();
    let (redis, proxy) = (&j.redis, &j.proxy);
    let first = j.replica("first", "j1", &env);
    let client = RateLimitServiceClient::connect(first.grpc_uri())
        .await
        .expect("connect");
    for _ in 0..5 {
        assert!(admitted(&client, "j").await, "on Redis");
    }
    proxy.set(Mode::Blackhole);
    // Until Redis has been silent long enough to count as an outage, calls
    // are denied, not granted unseen.
    let warm = on_leases(&first, single("j", &[("k", "v")])).await;
    for _ in 0..30 {
        assert!(admitted(&client, "j").await, "granted on the lease");
    }
    let (written, text) = j.journal_holds("j1", 30 + warm, Duration::from_secs(5));
    assert!(
        written,
        "journal holds the 30 lease grants and the warm-up ones admitted on leases: {text:?}"
    );
    crash(first);
    proxy.set(Mode::Pass);
    proxy.cut();
    let second = j.replica("second", "j1", &env);
    assert!(
        second
            .proc
            .log_text()
            .contains("restored unreplayed lease grants"),
        "{}",
        second.proc.log_text()
    );
    let key = &j.key;
    let exact = tokio::task::block_in_place(|| {
        wait_until(Duration::from_secs(15), || {
            redis.window_total(key) == Some(35 + warm)
        })
    });
    assert!(
        exact,
        "Redis holds the 5 Redis-path grants and the journaled ones: {:?}",
        redis.cli(&["HGETALL", key])
    );
    let emptied = tokio::task::block_in_place(|| {
        wait_until(Duration::from_secs(5), || {
            std::fs::read_to_string(j.journal.join("j1.journal.json"))
                .is_ok_and(|t| t.trim() == "[]")
        })
    });
    assert!(emptied, "the journal empties once replayed");
}

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
/// too many allowed, with no bound. Default settings, with a journal
/// directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_from_the_journal_after_a_replay_in_doubt_counts_exactly() {
    let j = Journaled::start("journal-doubt", "d").await;
    let env = j.env();
    let (redis, proxy, key) = (&j.redis, &j.proxy, &j.key);
    // The replay script's name in Redis: only replay calls carry it.
    let replay_sha = redis.cli(&["SCRIPT", "LOAD", REPLAY_LUA]).trim().to_owned();
    assert_eq!(replay_sha.len(), 40, "SCRIPT LOAD: {replay_sha:?}");
    // Loaded ahead, so that the first call needs no second round trip
    // (NOSCRIPT, then a load) to stay inside its budget.
    redis.cli(&["SCRIPT", "LOAD", DECIDE_LUA]);
    let first = j.replica("first", "d1", &env);
    let index = status(first.admin)
        .and_then(|s| s["engine"]["redis"]["membership"]["index"].as_u64())
        .expect("registered");
    let client = RateLimitServiceClient::connect(first.grpc_uri())
        .await
        .expect("connect");
    let ask = || async { u64::from(admitted(&client, "d").await) };
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
            redis.cli(&["HGET", key, &local_field]).trim() == "-1"
                && first.proc.log_text().contains("replay failed")
        })
    });
    let s = status(first.admin);
    assert!(
        applied,
        "the take-back's replay ran and its reply was lost: dropped {}, {}, status {s:?}\n{}",
        proxy.dropped_replies(),
        redis.cli(&["HGETALL", key]),
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
    // Every lease grant journaled: the local count is the grants but the
    // one on Redis, less the take-back. (Waiting for any entry let the
    // kill come before the last grants were written: seen, Redis 2 for 8.)
    let want = granted as i64 - 2;
    let (written, text) = j.journal_holds("d1", want, Duration::from_secs(5));
    assert!(written, "journaled, local_own {want}: {text:?}");
    // 4: crash, Redis back, restart.
    crash(first);
    proxy.clear_trap();
    proxy.set(Mode::Pass);
    proxy.cut();
    let second = j.replica("second", "d1", &env);
    let exact = tokio::task::block_in_place(|| {
        wait_until(Duration::from_secs(15), || {
            redis.window_total(key) == Some(granted as i64)
                && status(second.admin)
                    .is_some_and(|s| s["engine"]["ledger"]["keys_to_replay"] == 0)
        })
    });
    assert!(
        exact,
        "Redis holds the {granted} grants: {}\n{}",
        redis.cli(&["HGETALL", key]),
        second.proc.log_text()
    );
}

/// With the default settings (but a journal directory), lease grants made
/// while Redis is silent reach the journal within 250 ms, round after
/// round, and a kill -9 right after the last round loses none of them.
/// The journal was written by the recovery loop, which on a silent Redis
/// waits out a probe and the probe interval between rounds: grants reached
/// the file up to about half a second later (seen: the journal still empty
/// 1 s after lease grants), and a crash in that gap lost them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_grants_reach_the_journal_promptly_while_redis_is_silent() {
    let j = Journaled::start("journal-prompt", "p").await;
    let env = j.env();
    let first = j.replica("first", "p1", &env);
    let client = RateLimitServiceClient::connect(first.grpc_uri())
        .await
        .expect("connect");
    let ask = || admitted(&client, "p");
    for _ in 0..5 {
        assert!(ask().await, "on Redis");
    }
    j.proxy.set(Mode::Blackhole);
    let mut granted = on_leases(&first, single("p", &[("k", "v")])).await;
    let mut lags = Vec::new();
    for round in 0..8u64 {
        for _ in 0..2 {
            assert!(ask().await, "granted on the lease");
            granted += 1;
        }
        let since = std::time::Instant::now();
        let (seen, text) = j.journal_holds("p1", granted, Duration::from_millis(250));
        lags.push(since.elapsed().as_millis());
        assert!(
            seen,
            "round {round}: the journal holds {granted} lease grants within 250 ms (lags so far {lags:?} ms): {text:?}"
        );
        // A different phase against the engine's rounds each time.
        tokio::time::sleep(Duration::from_millis(37 * (round + 1))).await;
    }
    println!("journal lags per round: {lags:?} ms (polled every 50 ms)");
    crash(first);
    j.proxy.set(Mode::Pass);
    j.proxy.cut();
    let second = j.replica("second", "p1", &env);
    let key = &j.key;
    let exact = tokio::task::block_in_place(|| {
        wait_until(Duration::from_secs(20), || {
            j.redis.window_total(key) == Some(5 + granted)
        })
    });
    assert!(
        exact,
        "Redis holds the 5 grants on Redis and the {granted} on the lease: {}\n{}",
        j.redis.cli(&["HGETALL", key]),
        second.proc.log_text()
    );
}
