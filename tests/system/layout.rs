//! Key layout versions on a real Redis: a replica does not count on Redis
//! beside live replicas of an older layout (it decides on its lease, held
//! back by them), and once they have left it moves their live windows to
//! the current layout before it counts. Run one test at a time.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::{
    now_ms, single, test_dir, wait_for_room, wait_until, write_rules, Leasehold, RedisServer,
};
use leasehold::proto::rls::rate_limit_response::Code;
use leasehold::proto::rls::rate_limit_service_client::RateLimitServiceClient;

fn rules(dir: &Path, limit: u32) -> PathBuf {
    let text = format!(
        "domain: edge\ndescriptors:\n  - key: user\n    rate_limit: {{unit: minute, requests_per_unit: {limit}}}\n"
    );
    write_rules(dir, "rules.yaml", &text)
}

fn membership(server: &Leasehold) -> serde_json::Value {
    server.status()["engine"]["redis"]["membership"].clone()
}

/// Short heartbeats so the test does not wait out the 5 s default TTL; the
/// mechanism is the same at any TTL.
fn env(url: &str) -> Vec<(&str, &str)> {
    vec![
        ("LEASEHOLD_REDIS_URL", url),
        ("LEASEHOLD_MEMBERSHIP_HEARTBEAT_MS", "200"),
        ("LEASEHOLD_MEMBERSHIP_TTL_MS", "1000"),
    ]
}

/// `n` requests for `user`; how many were admitted.
async fn admitted(server: &Leasehold, user: &str, n: usize) -> usize {
    let mut c = RateLimitServiceClient::connect(server.grpc_uri())
        .await
        .expect("connect");
    let mut ok = 0;
    for _ in 0..n {
        let resp = c
            .should_rate_limit(single("edge", &[("user", user)]))
            .await
            .expect("no client error")
            .into_inner();
        if resp.overall_code == Code::Ok as i32 {
            ok += 1;
        }
    }
    ok
}

fn healthy(server: &Leasehold) -> bool {
    server.status()["engine"]["breaker"]["state"] == "healthy"
}

/// A replica of the releases before layout versions, as Redis sees it: its
/// membership entries (it announces no layout) and the window hashes it
/// writes under the old key names. Kept live by refreshing its heartbeat.
struct OldReplica {
    live: Arc<AtomicBool>,
    beat: Option<std::thread::JoinHandle<()>>,
    port: u16,
    id: String,
}

impl OldReplica {
    fn register(redis: &RedisServer, id: &str, index: &str) -> OldReplica {
        let now = now_ms().to_string();
        redis.cli(&["ZADD", "lh:{leasehold}:members", &now, id]);
        redis.cli(&["ZADD", "lh:{leasehold}:on-redis", &now, id]);
        redis.cli(&["HSET", "lh:{leasehold}:index", id, index]);
        redis.cli(&["HSET", "lh:{leasehold}:index-owner", index, id]);
        redis.cli(&["SET", "lh:{leasehold}:next-index", index]);
        // A layout this id announced long ago (a newer release ran under
        // it, then was rolled back): the old release's beats do not renew
        // it, so it must not count.
        redis.cli(&["HSET", "lh:{leasehold}:layouts", id, "2:1000"]);
        let live = Arc::new(AtomicBool::new(true));
        let (flag, port, id) = (live.clone(), redis.port.to_string(), id.to_owned());
        let beat_id = id.clone();
        let beat = std::thread::spawn(move || {
            // Bounded: a test that fails leaves this loop within 2 minutes.
            for _ in 0..600 {
                if !flag.load(Ordering::SeqCst) {
                    return;
                }
                let now = now_ms().to_string();
                for key in ["lh:{leasehold}:members", "lh:{leasehold}:on-redis"] {
                    let _ = Command::new("redis-cli")
                        .args(["-p", &port, "ZADD", key, &now, &beat_id])
                        .output();
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        OldReplica {
            live,
            beat: Some(beat),
            port: redis.port,
            id,
        }
    }

    /// Stops beating and leaves the membership, as an old replica shut
    /// down cleanly in a rolling upgrade does.
    fn stop(&mut self) {
        self.live.store(false, Ordering::SeqCst);
        if let Some(beat) = self.beat.take() {
            let _ = beat.join();
            for key in ["lh:{leasehold}:members", "lh:{leasehold}:on-redis"] {
                let _ = Command::new("redis-cli")
                    .args(["-p", &self.port.to_string(), "ZREM", key, &self.id])
                    .output();
            }
        }
    }
}

impl Drop for OldReplica {
    fn drop(&mut self) {
        self.stop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_waits_for_an_older_layout_then_moves_its_windows() {
    let dir = test_dir("layout-move");
    let redis = RedisServer::start("redis", &dir);
    let url = redis.url();
    let r = rules(&dir, 10);
    wait_for_room(60_000, 30_000).await;
    let mut old = OldReplica::register(&redis, "old-1", "1");
    // The old replica admitted 7 of the 10 in this window, on Redis.
    let w = now_ms() / 60_000;
    let old_key = format!("lh:{{edge}}|user=a#60:fw@{w}");
    let new_key = format!("lh:v2{{edge|user=a#60:fw}}@{w}");
    redis.cli(&["HSET", &old_key, "1", "7", "f1", "5"]);
    redis.cli(&["PEXPIRE", &old_key, "180000"]);

    let server = Leasehold::start("new", &r, &[], &env(&url), &dir);
    let m = membership(&server);
    assert_eq!(
        m["older_layouts"],
        serde_json::json!(["old-1 (layout 1)"]),
        "{m}"
    );
    assert_eq!(m["layout"], 2, "{m}");
    // Beside it, on its lease: 2 admitted, none decided on Redis.
    assert_eq!(admitted(&server, "a", 2).await, 2);
    let s = server.status();
    assert_eq!(s["engine"]["decisions"]["redis"], 0, "{s}");
    assert_eq!(s["engine"]["decisions"]["local"], 2, "{s}");
    // Held back: recorded as not on Redis for longer than the TTL at once,
    // so the old replica's decisions count its share as used.
    let id = s["engine"]["redis"]["replica_id"]
        .as_str()
        .expect("replica id")
        .to_owned();
    let score: u64 = redis
        .cli(&["ZSCORE", "lh:{leasehold}:on-redis", &id])
        .trim()
        .parse()
        .expect("on-redis score");
    assert!(score + 1_000 < now_ms(), "held replicas read as silent");
    assert_eq!(
        redis.cli(&["EXISTS", &old_key]).trim(),
        "1",
        "not moved yet"
    );
    assert!(
        server.proc.log_text().contains("older key layout"),
        "the log says why it is on its lease"
    );

    // The old replica goes away: its windows move, then this replica counts.
    old.stop();
    let moved = wait_until(Duration::from_secs(10), || {
        let m = membership(&server);
        m["layout_ready"] == true && m["migrated_keys"] == 1
    });
    assert!(moved, "{}", membership(&server));
    assert_eq!(redis.cli(&["EXISTS", &old_key]).trim(), "0");
    assert_eq!(redis.cli(&["HGET", &new_key, "1"]).trim(), "7");
    assert_eq!(
        redis.cli(&["HGET", &new_key, "f1"]).trim(),
        "5",
        "fences move too"
    );
    let ttl: i64 = redis.cli(&["PTTL", &new_key]).trim().parse().unwrap_or(-1);
    // Kept, or set again by the replay to the window's natural life.
    assert!(ttl > 0, "the moved key expires: {ttl}");
    assert!(
        wait_until(Duration::from_secs(20), || healthy(&server)),
        "{}",
        server.status()
    );
    // Its lease grants were replayed into the moved window: 7 + 2.
    assert_eq!(
        redis.window_total(&new_key),
        Some(9),
        "{}",
        redis.cli(&["HGETALL", &new_key])
    );
    assert_eq!(
        admitted(&server, "a", 3).await,
        1,
        "the limit goes on from 9"
    );
    assert_eq!(redis.window_total(&new_key), Some(10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_announcing_two_layouts_share_one_limit() {
    let dir = test_dir("layout-two");
    let redis = RedisServer::start("redis", &dir);
    let url = redis.url();
    let r = rules(&dir, 20);
    wait_for_room(60_000, 40_000).await;
    let older = Leasehold::start("older", &r, &[], &env(&url), &dir);
    let mut newer_env = env(&url);
    newer_env.push(("LH_FAULT_LAYOUT", "3"));
    let newer = Leasehold::start("newer", &r, &[], &newer_env, &dir);
    let older_id = older.status()["engine"]["redis"]["replica_id"]
        .as_str()
        .expect("id")
        .to_owned();
    let newer_index = membership(&newer)["index"].as_u64().expect("index");
    let topology = &older.status()["engine"]["redis"]["topology"];
    assert_eq!(topology["mode"], "standalone", "{topology}");
    assert_eq!(topology["nodes"][0]["connected"], true, "{topology}");
    // Each sees the other, and only the newer one stays off Redis.
    let seen = wait_until(Duration::from_secs(5), || {
        let (o, n) = (membership(&older), membership(&newer));
        n["older_layouts"] == serde_json::json!([format!("{older_id} (layout 2)")])
            && o["newer_layouts"].as_array().is_some_and(|a| a.len() == 1)
            && o["silent_indices"]
                .as_array()
                .is_some_and(|a| a.contains(&newer_index.into()))
    });
    assert!(
        seen,
        "older: {}\nnewer: {}",
        membership(&older),
        membership(&newer)
    );
    assert!(older
        .proc
        .log_text()
        .contains("live replicas count in a newer key layout"));

    let window = now_ms() / 60_000;
    let key = format!("lh:v2{{edge|user=u#60:fw}}@{window}");
    let on_lease = admitted(&newer, "u", 8).await;
    assert_eq!(on_lease, 8, "within its share of 20");
    let on_redis = admitted(&older, "u", 30).await;
    let so = older.status();
    let sn = newer.status();
    assert_eq!(sn["engine"]["decisions"]["redis"], 0, "{sn}");
    assert_eq!(so["engine"]["decisions"]["local"], 0, "{so}");
    assert!(
        on_lease + on_redis <= 20,
        "the older replica held back the newer one's share: {on_redis} + {on_lease}"
    );
    assert!(on_redis >= 9, "but no more than that share: {on_redis}");

    // The older one leaves; the newer one replays and counts on Redis.
    older.proc.signal("TERM").expect("TERM");
    let mut older = older;
    assert!(older.proc.wait_exit(Duration::from_secs(15)).is_some());
    assert!(
        wait_until(Duration::from_secs(20), || healthy(&newer)),
        "{}",
        newer.status()
    );
    assert_eq!(
        redis.window_total(&key),
        Some((on_lease + on_redis) as i64),
        "Redis holds both replicas' grants: {}",
        redis.cli(&["HGETALL", &key])
    );
    let rest = admitted(&newer, "u", 25).await;
    assert_eq!(on_lease + on_redis + rest, 20, "exactly the limit in all");
}
