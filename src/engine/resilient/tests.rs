//! The resilient engine without Redis: a scripted fake backend and a manual
//! clock drive trip → probe → replay → settle → healthy, lost and late
//! replies, and flaps, with no sleeping. The fake keeps the per-replica
//! fields a real Redis would (the Redis-path field and the replayed local
//! field per window), so each test can also check that the store ends up
//! holding exactly the grants.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;

use super::breaker::{BreakerConfig, BreakerState};
use super::{Recovery, ResilientConfig, ResilientEngine};
use crate::clock::{Clock, ManualClock};
use crate::domain::backend::{
    Backend, CallError, Members, RawItem, RawReply, ReplayEntry, ReplayKind,
};
use crate::domain::{Batch, Charge, DecisionPath};
use crate::engine::Engine;
use crate::key::CounterKey;
use crate::limit::{LimitSpec, Role, Unit};

/// How the fake answers decision calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Up,
    /// Connections refused: the call never left.
    Refused,
    /// The script runs, but its reply is lost (a timeout to the caller).
    LoseReply,
    /// The caller's budget runs out first; the script runs later, when
    /// [`Fake::run_late`] says so.
    Late,
}

#[derive(Default)]
struct Store {
    /// Per (key, window): the Redis-path field and the local field.
    redis_field: HashMap<(CounterKey, u64), i64>,
    local_field: HashMap<(CounterKey, u64), i64>,
    late: VecDeque<Batch>,
    replays: Vec<Vec<ReplayEntry>>,
}

struct Fake {
    clock: Arc<ManualClock>,
    mode: Mutex<Mode>,
    store: Mutex<Store>,
    decide_calls: AtomicUsize,
}

impl Fake {
    fn new(clock: Arc<ManualClock>) -> Arc<Fake> {
        Arc::new(Fake {
            clock,
            mode: Mutex::new(Mode::Up),
            store: Mutex::new(Store::default()),
            decide_calls: AtomicUsize::new(0),
        })
    }

    fn set(&self, mode: Mode) {
        *self.mode.lock() = mode;
    }

    fn window(&self, spec: &LimitSpec) -> u64 {
        self.clock.now_ms() / spec.unit.millis()
    }

    /// Runs a batch like the script: all-or-nothing, on the store's time.
    fn execute(&self, batch: &Batch) -> RawReply {
        let mut store = self.store.lock();
        let mut items = Vec::new();
        let mut denied = false;
        for c in &batch.charges {
            let w = self.window(&c.spec);
            let k = (c.key.clone(), w);
            let total = store.redis_field.get(&k).copied().unwrap_or(0)
                + store.local_field.get(&k).copied().unwrap_or(0);
            let over = total + c.hits as i64 > i64::from(c.spec.requests_per_unit);
            denied |= over;
            items.push((k, total, over, c.hits as i64, c.spec.requests_per_unit));
        }
        let items = items
            .into_iter()
            .map(|(k, total, over, hits, limit)| {
                let delta = if denied { 0 } else { hits };
                let own = store.redis_field.entry(k).or_insert(0);
                *own += delta;
                RawItem {
                    over,
                    remaining: (i64::from(limit) - total - delta).max(0) as u64,
                    reset_ms: 1_000,
                    own: *own,
                    total: total + delta,
                    delta,
                }
            })
            .collect();
        RawReply {
            now_ms: self.clock.now_ms(),
            denied,
            lost: false,
            items,
        }
    }

    /// The late calls run now.
    fn run_late(&self) {
        let late: Vec<Batch> = self.store.lock().late.drain(..).collect();
        for b in &late {
            self.execute(b);
        }
    }

    /// The store's total for a key's current window.
    fn total(&self, key: &CounterKey, spec: &LimitSpec) -> i64 {
        let store = self.store.lock();
        let k = (key.clone(), self.window(spec));
        store.redis_field.get(&k).copied().unwrap_or(0)
            + store.local_field.get(&k).copied().unwrap_or(0)
    }

    fn replays(&self) -> Vec<Vec<(ReplayKind, i64)>> {
        self.store
            .lock()
            .replays
            .iter()
            .map(|r| r.iter().map(|e| (e.kind, e.value)).collect())
            .collect()
    }
}

#[async_trait]
impl Backend for Fake {
    async fn decide(&self, batch: &Batch, _expected: &[(i64, u64)]) -> Result<RawReply, CallError> {
        self.decide_calls.fetch_add(1, Ordering::SeqCst);
        let mode = *self.mode.lock();
        match mode {
            Mode::Up => Ok(self.execute(batch)),
            Mode::Refused => Err(CallError::NotConnected("refused".into())),
            Mode::LoseReply => {
                self.execute(batch);
                Err(CallError::Timeout(Duration::from_millis(5)))
            }
            Mode::Late => {
                self.store.lock().late.push_back(batch.clone());
                Err(CallError::Timeout(Duration::from_millis(5)))
            }
        }
    }

    async fn replay(&self, entries: &[ReplayEntry], _budget: Duration) -> Result<u64, CallError> {
        if *self.mode.lock() == Mode::Refused {
            return Err(CallError::NotConnected("refused".into()));
        }
        let mut store = self.store.lock();
        for e in entries {
            let k = (e.key.clone(), e.window);
            match e.kind {
                ReplayKind::Local => store.local_field.insert(k, e.value),
                ReplayKind::Repair => store.redis_field.insert(k, e.value),
            };
        }
        store.replays.push(entries.to_vec());
        Ok(entries.len() as u64)
    }

    async fn probe(&self) -> Result<bool, CallError> {
        match *self.mode.lock() {
            Mode::Refused => Err(CallError::NotConnected("refused".into())),
            _ => Ok(true),
        }
    }

    fn members(&self) -> Members {
        Members {
            live: 1,
            reregistrations: 0,
        }
    }

    fn status(&self) -> serde_json::Value {
        serde_json::json!({ "engine": "fake" })
    }
}

const DEADLINE_MS: u64 = 5;
const SETTLE_MS: u64 = 1_405;

struct Rig {
    clock: Arc<ManualClock>,
    fake: Arc<Fake>,
    engine: ResilientEngine,
    recovery: Recovery,
    spec: LimitSpec,
    /// Requests admitted so far, per key.
    granted: HashMap<CounterKey, i64>,
}

impl Rig {
    fn new() -> Rig {
        // Mid-window, so a test's requests share one minute window.
        let clock = Arc::new(ManualClock::new(60_000 * 1_000 + 1_000));
        let fake = Fake::new(clock.clone());
        let cfg = ResilientConfig {
            deadline_ms: DEADLINE_MS,
            expiry_margin_ms: 10_000,
            lease_min_share: 0.025,
            replicas_hint: 1,
            ledger_max_keys: 1_000,
            breaker: BreakerConfig {
                failures_to_trip: 3,
                probe_interval_ms: 500,
                probe_jitter_ms: 200,
                settle_ms: ResilientConfig::settle_ms(500, 200, DEADLINE_MS),
            },
        };
        let engine = ResilientEngine::new(fake.clone(), clock.clone(), cfg, None);
        Rig {
            clock,
            fake,
            engine,
            recovery: Recovery::default(),
            spec: LimitSpec::fixed(1_000, Unit::Minute),
            granted: HashMap::new(),
        }
    }

    fn key(&self, v: &str) -> CounterKey {
        CounterKey::new("d", [("user", v)], &self.spec)
    }

    async fn hit(&mut self, v: &str) -> DecisionPath {
        let key = self.key(v);
        let batch = Batch {
            charges: vec![Charge {
                key: key.clone(),
                spec: self.spec,
                hits: 1,
                refund: false,
                role: Role::Enforce,
            }],
            never_deny: false,
        };
        let outcome = self.engine.apply(&batch).await.expect("never an error");
        if !outcome.denied {
            *self.granted.entry(key).or_default() += 1;
        }
        outcome.path
    }

    async fn tick(&mut self) {
        self.engine.tick(&mut self.recovery).await;
    }

    fn state(&self) -> BreakerState {
        self.engine.breaker_state()
    }

    /// (keys to replay, unreplayed hits, suspect keys).
    fn pending(&self) -> (usize, i64, usize) {
        self.engine.ledger().pending()
    }

    /// The store holds exactly what was granted, for every key.
    fn assert_exact(&self) {
        for (key, granted) in &self.granted {
            assert_eq!(self.fake.total(key, &self.spec), *granted, "{key}");
        }
    }

    /// From tripped back to healthy with Redis up: probe, replay, settle.
    async fn recover(&mut self) {
        self.fake.set(Mode::Up);
        self.clock.advance(700);
        self.tick().await;
        assert_eq!(self.state(), BreakerState::Probing);
        self.tick().await;
        assert_eq!(self.state(), BreakerState::Settling);
        self.clock.advance(SETTLE_MS);
        self.tick().await;
        assert_eq!(self.state(), BreakerState::Healthy);
    }
}

#[tokio::test]
async fn trips_after_consecutive_failures_deciding_each_locally() {
    let mut rig = Rig::new();
    assert_eq!(rig.hit("a").await, DecisionPath::Redis);
    rig.fake.set(Mode::Refused);
    for i in 1..=3 {
        assert_eq!(rig.hit("a").await, DecisionPath::Local, "call {i}");
        let want = if i < 3 {
            BreakerState::Healthy
        } else {
            BreakerState::Tripped
        };
        assert_eq!(rig.state(), want, "after {i} refused calls");
    }
    // Refused calls never left: nothing is suspect, three local grants wait.
    assert_eq!(rig.pending(), (1, 3, 0));
    let calls = rig.fake.decide_calls.load(Ordering::SeqCst);
    assert_eq!(rig.hit("a").await, DecisionPath::Local);
    assert_eq!(
        rig.fake.decide_calls.load(Ordering::SeqCst),
        calls,
        "tripped: no call to Redis"
    );
    assert_eq!(rig.pending(), (1, 4, 0));
    // A probe that fails keeps it tripped.
    rig.clock.advance(700);
    rig.tick().await;
    assert_eq!(rig.state(), BreakerState::Tripped);
}

#[tokio::test]
async fn probe_then_replay_then_settle_then_healthy() {
    let mut rig = Rig::new();
    rig.fake.set(Mode::Refused);
    for _ in 0..5 {
        rig.hit("a").await;
    }
    assert_eq!(rig.state(), BreakerState::Tripped);
    rig.fake.set(Mode::Up);
    rig.clock.advance(700);
    rig.tick().await;
    assert_eq!(rig.state(), BreakerState::Probing);
    assert_eq!(rig.hit("a").await, DecisionPath::Local, "probing is local");
    assert_eq!(rig.pending(), (1, 6, 0));
    rig.tick().await;
    assert_eq!(rig.state(), BreakerState::Settling);
    assert_eq!(rig.fake.replays(), [vec![(ReplayKind::Local, 6)]]);
    assert_eq!(rig.pending(), (0, 0, 0));
    rig.assert_exact();
    // Settling stays local and replays once more when the period is over.
    assert_eq!(rig.hit("a").await, DecisionPath::Local);
    rig.clock.advance(SETTLE_MS - 1);
    rig.tick().await;
    assert_eq!(rig.state(), BreakerState::Settling, "not before the period");
    rig.clock.advance(1);
    rig.tick().await;
    assert_eq!(rig.state(), BreakerState::Healthy);
    assert_eq!(rig.fake.replays()[1], [(ReplayKind::Local, 7)]);
    assert_eq!(rig.pending(), (0, 0, 0));
    assert_eq!(rig.hit("a").await, DecisionPath::Redis);
    rig.assert_exact();
    let status = rig.engine.snapshot();
    assert_eq!((status.breaker.state, status.path), ("healthy", "redis"));
    assert_eq!(status.breaker.transitions, 4);
}

#[tokio::test]
async fn a_reply_lost_after_the_script_ran_is_repaired_once() {
    let mut rig = Rig::new();
    for _ in 0..3 {
        rig.hit("a").await;
    }
    rig.fake.set(Mode::LoseReply);
    assert_eq!(rig.hit("a").await, DecisionPath::Local);
    // Redis counted it, and so did the local decision: the key is suspect
    // and stays local until repaired; one failure does not trip.
    assert_eq!(rig.state(), BreakerState::Healthy);
    assert_eq!(rig.pending(), (1, 1, 1));
    assert_eq!(rig.fake.total(&rig.key("a"), &rig.spec), 4);
    rig.fake.set(Mode::Up);
    let calls = rig.fake.decide_calls.load(Ordering::SeqCst);
    assert_eq!(rig.hit("a").await, DecisionPath::Local, "suspect: local");
    assert_eq!(rig.hit("b").await, DecisionPath::Redis, "other keys: Redis");
    assert_eq!(rig.fake.decide_calls.load(Ordering::SeqCst), calls + 1);
    // Within the quiet time only the local usage is replayed.
    rig.tick().await;
    assert_eq!(rig.fake.replays(), [vec![(ReplayKind::Local, 2)]]);
    assert_eq!(rig.pending(), (1, 0, 1));
    // Then the repair sets the Redis-path field to the confirmed 3.
    rig.clock.advance(DEADLINE_MS + 10);
    rig.tick().await;
    assert_eq!(rig.fake.replays()[1], [(ReplayKind::Repair, 3)]);
    assert_eq!(rig.pending(), (0, 0, 0));
    assert_eq!(rig.hit("a").await, DecisionPath::Redis);
    rig.assert_exact();
    assert_eq!(rig.granted[&rig.key("a")], 6);
}

#[tokio::test]
async fn a_late_execution_after_the_deadline_counts_once() {
    let mut rig = Rig::new();
    rig.hit("a").await;
    rig.fake.set(Mode::Late);
    assert_eq!(rig.hit("a").await, DecisionPath::Local);
    assert_eq!(rig.pending(), (1, 1, 1));
    rig.fake.set(Mode::Up);
    // The script Redis had queued runs after the caller gave up.
    rig.fake.run_late();
    assert_eq!(rig.fake.total(&rig.key("a"), &rig.spec), 2, "late run");
    rig.clock.advance(DEADLINE_MS + 10);
    rig.tick().await;
    let replayed = rig.fake.replays();
    assert_eq!(
        replayed,
        [vec![(ReplayKind::Local, 1), (ReplayKind::Repair, 1)]]
    );
    assert_eq!(rig.pending(), (0, 0, 0));
    rig.assert_exact();
    assert_eq!(rig.fake.total(&rig.key("a"), &rig.spec), 2);
}

#[tokio::test]
async fn ten_flaps_end_healthy_with_redis_holding_the_grants() {
    let mut rig = Rig::new();
    for flap in 0..10 {
        for _ in 0..4 {
            assert_eq!(rig.hit("a").await, DecisionPath::Redis, "flap {flap}");
        }
        rig.fake.set(Mode::Refused);
        for _ in 0..5 {
            assert_eq!(rig.hit("a").await, DecisionPath::Local);
        }
        assert_eq!(rig.state(), BreakerState::Tripped, "flap {flap}");
        assert_eq!(rig.pending(), (1, 5, 0), "flap {flap}");
        rig.clock.advance(700);
        rig.tick().await;
        assert_eq!(rig.state(), BreakerState::Tripped, "probe refused");
        rig.recover().await;
        assert_eq!(rig.pending(), (0, 0, 0), "flap {flap}");
        rig.assert_exact();
    }
    assert_eq!(rig.granted[&rig.key("a")], 90);
    let status = rig.engine.snapshot();
    assert_eq!(status.breaker.transitions, 40);
    assert_eq!(status.ledger.dropped_usage, 0);
    assert_eq!(status.decisions.local, 50);
}
