//! The Redis engine on a real Redis Cluster (masters with replicas, made by
//! `redis-cli --cluster create` on free loopback ports): exactness across
//! replicas with the counters of one domain spread over every master, a
//! request across slots kept all-or-nothing, and a master killed under
//! load. Run one test at a time.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::common::cluster::RedisCluster;
use crate::common::{desc, get, request, single, test_dir, wait_until, Leasehold};
use leasehold::proto::rls::rate_limit_response::Code;
use leasehold::proto::rls::rate_limit_service_client::RateLimitServiceClient;
use leasehold::proto::rls::RateLimitRequest;
use tonic::transport::Channel;

fn rules(dir: &Path, text: &str) -> PathBuf {
    let d = dir.join("rules");
    std::fs::create_dir_all(&d).expect("mkdir");
    std::fs::write(d.join("rules.yaml"), text).expect("write");
    d
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

async fn wait_for_room(need_ms: u64) {
    let into = now_ms() % 60_000;
    if 60_000 - into < need_ms {
        tokio::time::sleep(Duration::from_millis(60_000 - into + 50)).await;
    }
}

fn status(server: &Leasehold) -> serde_json::Value {
    get(server.admin, "/status")
        .ok()
        .and_then(|r| serde_json::from_str(&r.body).ok())
        .unwrap_or_default()
}

/// Every replica back on Redis with nothing left to replay.
fn settled(replicas: &[Leasehold]) -> bool {
    wait_until(Duration::from_secs(20), || {
        replicas.iter().all(|rep| {
            let s = status(rep);
            s["engine"]["ledger"]["keys_to_replay"] == 0 && s["engine"]["path"] == "redis"
        })
    })
}

/// The outcome of a load run: admitted per user, and client errors.
#[derive(Default)]
struct Run {
    ok: HashMap<String, u64>,
    errors: Vec<String>,
}

/// How long a load run lasts: a number of calls, or a time.
#[derive(Clone, Copy)]
enum Until {
    Calls(u64),
    Elapsed(Duration),
}

/// Requests from 64 callers in flight spread over `clients`, call i made
/// by `make(i)`, until `until`.
async fn hammer(
    clients: &[RateLimitServiceClient<Channel>],
    make: impl Fn(usize) -> (String, RateLimitRequest) + Send + Sync + 'static,
    until: Until,
) -> Run {
    let make = Arc::new(make);
    let issued = Arc::new(AtomicU64::new(0));
    let started = std::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for caller in 0..64usize {
        let mut c = clients[caller % clients.len()].clone();
        let (issued, make) = (issued.clone(), make.clone());
        tasks.spawn(async move {
            let mut run = Run::default();
            loop {
                let i = issued.fetch_add(1, Ordering::SeqCst);
                let done = match until {
                    Until::Calls(n) => i >= n,
                    Until::Elapsed(d) => started.elapsed() >= d,
                };
                if done {
                    return run;
                }
                let (user, req) = make(i as usize);
                match c.should_rate_limit(req).await {
                    Ok(r) if r.get_ref().overall_code == Code::Ok as i32 => {
                        *run.ok.entry(user).or_default() += 1
                    }
                    Ok(_) => {
                        run.ok.entry(user).or_default();
                    }
                    Err(e) => run.errors.push(e.to_string()),
                }
            }
        });
    }
    let mut all = Run::default();
    while let Some(r) = tasks.join_next().await {
        let r = r.expect("join");
        for (u, n) in r.ok {
            *all.ok.entry(u).or_default() += n;
        }
        all.errors.extend(r.errors);
    }
    all
}

fn start_replicas(
    name: &str,
    n: usize,
    r: &Path,
    env: &[(&str, &str)],
    dir: &Path,
) -> Vec<Leasehold> {
    (1..=n)
        .map(|i| {
            let id = format!("{name}{i}");
            Leasehold::start(&id, r, &["--replica-id", &id], env, dir)
        })
        .collect()
}

/// SIGTERM to each, waiting for it to leave the membership and exit (a
/// killed replica would be held back by the next ones for the hold-back
/// horizon).
fn stop_all(replicas: Vec<Leasehold>) {
    for rep in &replicas {
        let _ = rep.proc.signal("TERM");
    }
    for mut rep in replicas {
        assert!(rep.proc.wait_exit(Duration::from_secs(15)).is_some());
    }
}

async fn clients(replicas: &[Leasehold]) -> Vec<RateLimitServiceClient<Channel>> {
    let mut out = Vec::new();
    for rep in replicas {
        out.push(
            RateLimitServiceClient::connect(rep.grpc_uri())
                .await
                .expect("connect"),
        );
    }
    out
}

const USERS: usize = 64;
const LIMIT: u64 = 50;

/// Four replicas × 64 in flight on a 3-master cluster, 64 users against a
/// limit of 50 each. With a 250 ms budget (every decision on Redis) each
/// user, sent 78 requests, is admitted exactly 50; with the default
/// settings, each hammered for 5 s, each is admitted at most 5% over and
/// the total within 1% of 64 × 50. Redis then holds exactly the grants. The counters spread
/// over all three masters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_replicas_on_a_cluster_admit_every_user_its_limit() {
    let dir = test_dir("cluster-exact");
    let cluster = tokio::task::block_in_place(|| RedisCluster::start(&dir, 3, 1, 2_000));
    let url = cluster.url();
    let r = rules(
        &dir,
        &format!("domain: edge\ndescriptors:\n  - key: user\n    rate_limit: {{unit: minute, requests_per_unit: {LIMIT}}}\n"),
    );
    let mut report = Vec::new();
    for (run, budget) in [("exact", Some("250")), ("default", None)] {
        let mut env = vec![("LEASEHOLD_REDIS_URL", url.as_str())];
        if let Some(b) = budget {
            // Every decision on Redis, so the count is exact.
            env.push(("LEASEHOLD_REDIS_DEADLINE_MS", b));
            env.push(("LEASEHOLD_REDIS_BUDGET_MAX_MS", b));
        }
        let replicas = tokio::task::block_in_place(|| start_replicas(run, 4, &r, &env, &dir));
        let cs = clients(&replicas).await;
        wait_for_room(30_000).await;
        let window = now_ms() / 60_000;
        let tag = run.to_owned();
        let result = hammer(
            &cs,
            move |i| {
                let user = format!("{tag}-{}", i % USERS);
                let req = single("edge", &[("user", &user)]);
                (user, req)
            },
            match budget {
                Some(_) => Until::Calls(USERS as u64 * 78),
                // The default budgets deny what a busy Redis does not answer
                // in time, so each user is hammered for a while, not a count.
                None => Until::Elapsed(Duration::from_secs(5)),
            },
        )
        .await;
        assert!(
            result.errors.is_empty(),
            "{run}: client errors {:?}",
            &result.errors[..result.errors.len().min(5)]
        );
        let total: u64 = result.ok.values().sum();
        let most = result.ok.values().max().copied().unwrap_or(0);
        let least = result.ok.values().min().copied().unwrap_or(0);
        let settled = tokio::task::block_in_place(|| settled(&replicas));
        let mut mismatched = Vec::new();
        for (user, ok) in &result.ok {
            let key = format!("lh:v2{{edge|user={user}#60:fw}}@{window}");
            let in_redis = cluster.window_total(&key).unwrap_or(0);
            if in_redis != *ok as i64 {
                mismatched.push(format!("{user}: admitted {ok}, Redis {in_redis}"));
            }
        }
        let cross: Vec<String> = replicas
            .iter()
            .map(|rep| {
                let d = &status(rep)["engine"]["decisions"];
                format!("redis {} local {}", d["redis"], d["local"])
            })
            .collect();
        report.push(format!(
            "{run}: users {} admitted {total} (per user {least}..={most}), settled {settled}, replicas {cross:?}",
            result.ok.len()
        ));
        assert_eq!(result.ok.len(), USERS, "{report:?}");
        if budget.is_some() {
            assert!(
                result.ok.values().all(|&n| n == LIMIT),
                "exactly the limit for every user: {report:?}"
            );
        } else {
            assert!(most <= LIMIT + LIMIT / 20, "{report:?}");
            let want = USERS as u64 * LIMIT;
            assert!(total.abs_diff(want) <= want / 100, "{report:?}");
        }
        assert!(settled, "{report:?}");
        assert!(mismatched.is_empty(), "Redis = grants: {mismatched:?}");
        tokio::task::block_in_place(|| stop_all(replicas));
    }
    // Spread: every master holds a fair part of the 128 counters.
    let spread = cluster.keys_per_master("lh:v2{edge|*");
    let counters: usize = spread.iter().map(|(_, n)| n).sum();
    report.push(format!("counters per master: {spread:?}"));
    assert_eq!(counters, 2 * USERS, "{report:?}");
    assert_eq!(spread.len(), 3, "{report:?}");
    for (_, n) in &spread {
        assert!(
            *n * 5 >= counters,
            "each master at least a fifth: {report:?}"
        );
    }
    eprintln!("{}", report.join("\n"));
}

/// Two descriptors in different slots (on different masters), the second
/// at its limit: a request denied by the second charges the first nothing,
/// alone and with 64 such requests in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_across_slots_is_all_or_nothing() {
    let dir = test_dir("cluster-slots");
    let cluster = tokio::task::block_in_place(|| RedisCluster::start(&dir, 3, 0, 2_000));
    let url = cluster.url();
    let r = rules(
        &dir,
        "domain: edge\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 100000}\n  - key: plan\n    rate_limit: {unit: minute, requests_per_unit: 20}\n",
    );
    let env = [
        ("LEASEHOLD_REDIS_URL", url.as_str()),
        // Every decision on Redis, so the counts are exact.
        ("LEASEHOLD_REDIS_DEADLINE_MS", "250"),
        ("LEASEHOLD_REDIS_BUDGET_MAX_MS", "250"),
    ];
    let replicas = tokio::task::block_in_place(|| start_replicas("s", 2, &r, &env, &dir));
    let cs = clients(&replicas).await;
    wait_for_room(30_000).await;
    let window = now_ms() / 60_000;
    let user_key = format!("lh:v2{{edge|user=a#60:fw}}@{window}");
    let plan_key = format!("lh:v2{{edge|plan=p#60:fw}}@{window}");
    let slot = |k: &str| cluster.cli(&["CLUSTER", "KEYSLOT", k]).trim().to_owned();
    assert_ne!(slot(&user_key), slot(&plan_key), "two slots");
    let both = || request("edge", vec![desc(&[("user", "a")]), desc(&[("plan", "p")])]);
    let result = hammer(&cs, move |_| ("a".to_owned(), both()), Until::Calls(200)).await;
    assert!(result.errors.is_empty(), "{:?}", result.errors);
    let admitted = result.ok.get("a").copied().unwrap_or(0);
    assert_eq!(admitted, 20, "the plan's limit");
    assert_eq!(cluster.window_total(&plan_key), Some(20));
    assert_eq!(
        cluster.window_total(&user_key),
        Some(20),
        "denied requests charged the user nothing: {}",
        cluster.cli(&["HGETALL", &user_key])
    );
    let refunds: u64 = replicas
        .iter()
        .map(|rep| {
            status(rep)["engine"]["redis"]["cross_slot_refunds"]
                .as_u64()
                .unwrap_or(0)
        })
        .sum();
    let requests: u64 = replicas
        .iter()
        .map(|rep| {
            status(rep)["engine"]["redis"]["cross_slot_requests"]
                .as_u64()
                .unwrap_or(0)
        })
        .sum();
    assert_eq!(requests, 200, "every request spanned two slots");
    // The topology, on /status and /metrics: three primaries, all slots.
    let s = status(&replicas[0]);
    let topology = &s["engine"]["redis"]["topology"];
    assert_eq!(topology["mode"], "cluster", "{topology}");
    let nodes = topology["nodes"].as_array().cloned().unwrap_or_default();
    assert_eq!(nodes.len(), 3, "{topology}");
    let slots: u64 = nodes.iter().filter_map(|n| n["slots"].as_u64()).sum();
    assert_eq!(slots, 16_384, "{topology}");
    assert!(nodes.iter().all(|n| n["connected"] == true), "{topology}");
    let metrics = get(replicas[0].http, "/metrics").expect("metrics").body;
    let up = metrics
        .lines()
        .filter(|l| l.starts_with("leasehold_redis_node_up{mode=\"cluster\"") && l.ends_with(" 1"))
        .count();
    assert_eq!(up, 3, "{metrics}");
    assert!(
        metrics.contains("leasehold_cross_slot_requests_total{result=\"taken_back\"}"),
        "{metrics}"
    );
    assert_eq!(refunds, 180, "every denial took the user's charge back");
    eprintln!("cross-slot requests {requests}, taken back {refunds}");
}
