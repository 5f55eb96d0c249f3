//! The test rig: a scripted fake backend that keeps the per-replica fields
//! a real Redis would (the Redis-path field and the replayed local field per
//! window), so each test can check that the store ends up holding exactly
//! the grants; and a manual clock with the recovery loop ticked by hand.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;

use super::super::breaker::{BreakerConfig, BreakerState};
use super::super::journal::Journal;
use super::super::{Recovery, ResilientConfig, ResilientEngine};
use crate::clock::{Clock, ManualClock};
use crate::domain::backend::{
    Backend, CallError, Members, Presume, RawItem, RawReply, ReplayEntry, ReplayKind,
};
use crate::domain::{Batch, Charge, DecisionPath};
use crate::engine::Engine;
use crate::key::CounterKey;
use crate::limit::{LimitSpec, Role, Unit};

/// How the fake answers decision calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    Up,
    /// Connections refused: the call never left.
    Refused,
    /// The script runs, but its reply is lost (a timeout to the caller).
    LoseReply,
    /// The caller's budget runs out first; the script runs later, when
    /// [`Fake::run_late`] says so.
    Late,
    /// The call waits (Redis busy) until [`Fake::release`], then runs and
    /// answers.
    Slow,
    /// A Cluster refuses the call for as long as it is retried: its slot is
    /// being moved.
    Moving,
}

#[derive(Default)]
pub(super) struct Store {
    /// Per (key, window): the Redis-path field and the local field.
    pub(super) redis_field: HashMap<(CounterKey, u64), i64>,
    pub(super) local_field: HashMap<(CounterKey, u64), i64>,
    pub(super) hold_field: HashMap<(CounterKey, u64), i64>,
    pub(super) late: VecDeque<Batch>,
    pub(super) replays: Vec<Vec<ReplayEntry>>,
    /// The replica's incarnation (bumped by [`Rig::restarted`]), and per
    /// (key, window) the incarnation that last wrote the local field and
    /// the base it wrote on: as `replay.lua` does, a new incarnation's
    /// first local write keeps the field as it finds it as its base.
    pub(super) boot: u64,
    pub(super) local_base: HashMap<(CounterKey, u64), (u64, i64)>,
    /// Replays apply, then their reply is lost (a timeout to the caller).
    pub(super) replay_loses_reply: bool,
}

pub(super) struct Fake {
    pub(super) clock: Arc<ManualClock>,
    pub(super) mode: Mutex<Mode>,
    pub(super) store: Mutex<Store>,
    pub(super) decide_calls: AtomicUsize,
    pub(super) gate: tokio::sync::Notify,
    /// Answers the store gave that no caller has taken in yet (say a
    /// Cluster's refusals for a slot being moved): see [`Backend::heard`].
    pub(super) heard: AtomicUsize,
    /// A step of the wall clock (ms, either way) made while the next
    /// decision call is out, before the store runs it.
    pub(super) step_during_call: AtomicI64,
}

impl Fake {
    pub(super) fn new(clock: Arc<ManualClock>) -> Arc<Fake> {
        Arc::new(Fake {
            clock,
            mode: Mutex::new(Mode::Up),
            store: Mutex::new(Store::default()),
            decide_calls: AtomicUsize::new(0),
            gate: tokio::sync::Notify::new(),
            heard: AtomicUsize::new(0),
            step_during_call: AtomicI64::new(0),
        })
    }

    pub(super) fn set(&self, mode: Mode) {
        *self.mode.lock() = mode;
    }

    pub(super) fn window(&self, spec: &LimitSpec) -> u64 {
        self.clock.now_ms() / spec.unit.millis()
    }

    /// Runs a batch like the script: all-or-nothing, on the store's time.
    pub(super) fn execute(&self, batch: &Batch) -> RawReply {
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
                    at_ms: 0,
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

    /// Slow calls waiting now run and answer.
    pub(super) fn release(&self) {
        self.gate.notify_waiters();
    }

    /// The late calls run now.
    pub(super) fn run_late(&self) {
        let late: Vec<Batch> = self.store.lock().late.drain(..).collect();
        for b in &late {
            self.execute(b);
        }
    }

    /// The store's total for a key's current window.
    pub(super) fn total(&self, key: &CounterKey, spec: &LimitSpec) -> i64 {
        let store = self.store.lock();
        let k = (key.clone(), self.window(spec));
        store.redis_field.get(&k).copied().unwrap_or(0)
            + store.local_field.get(&k).copied().unwrap_or(0)
    }

    /// The count fields each replay call wrote (holds apart, see
    /// [`Fake::holds`]); calls that wrote only holds are left out.
    pub(super) fn replays(&self) -> Vec<Vec<(ReplayKind, i64)>> {
        self.store
            .lock()
            .replays
            .iter()
            .map(|r| {
                r.iter()
                    .filter(|e| e.kind != ReplayKind::Hold)
                    .map(|e| (e.kind, e.value))
                    .collect::<Vec<_>>()
            })
            .filter(|r| !r.is_empty())
            .collect()
    }

    /// The hold this replica last wrote for a key's window.
    pub(super) fn hold(&self, key: &CounterKey, window: u64) -> Option<i64> {
        self.store
            .lock()
            .hold_field
            .get(&(key.clone(), window))
            .copied()
    }
}

#[async_trait]
impl Backend for Fake {
    async fn decide(
        &self,
        batch: &Batch,
        _expected: &[(i64, u64)],
        _presume: &Presume,
    ) -> Result<RawReply, CallError> {
        self.decide_calls.fetch_add(1, Ordering::SeqCst);
        let step = self.step_during_call.swap(0, Ordering::SeqCst);
        if step != 0 {
            let stepped = i64::try_from(self.clock.now_ms()).unwrap_or(i64::MAX) + step;
            self.clock.set(u64::try_from(stepped).unwrap_or(0));
        }
        let mode = *self.mode.lock();
        match mode {
            Mode::Up => Ok(self.execute(batch)),
            Mode::Refused => Err(CallError::NotConnected("refused".into())),
            Mode::Moving => Err(CallError::SlotMoving("TRYAGAIN".into())),
            Mode::LoseReply => {
                self.execute(batch);
                Err(CallError::Timeout(Duration::from_millis(5)))
            }
            Mode::Late => {
                self.store.lock().late.push_back(batch.clone());
                Err(CallError::Timeout(Duration::from_millis(5)))
            }
            Mode::Slow => {
                self.gate.notified().await;
                Ok(self.execute(batch))
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
                ReplayKind::Local => {
                    let (boot, field) = (store.boot, store.local_field.get(&k).copied());
                    let base = match store.local_base.get(&k) {
                        Some(&(b, base)) if b == boot => base,
                        _ => field.unwrap_or(0),
                    };
                    store.local_base.insert(k.clone(), (boot, base));
                    store.local_field.insert(k, base + e.value)
                }
                ReplayKind::Repair => store.redis_field.insert(k, e.value),
                // One replica: its own holds never count for itself.
                ReplayKind::Hold => store.hold_field.insert(k, e.value),
            };
        }
        store.replays.push(entries.to_vec());
        if store.replay_loses_reply {
            return Err(CallError::Timeout(Duration::from_millis(5)));
        }
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
            ..Members::default()
        }
    }

    fn heard(&self) -> u64 {
        self.heard.load(Ordering::SeqCst) as u64
    }

    fn status(&self) -> serde_json::Value {
        serde_json::json!({ "engine": "fake" })
    }
}

pub(super) const DEADLINE_MS: u64 = 5;
pub(super) const BUDGET_MAX_MS: u64 = 15;
pub(super) const SETTLE_MS: u64 = 1_405;

pub(super) struct Rig {
    pub(super) clock: Arc<ManualClock>,
    pub(super) fake: Arc<Fake>,
    pub(super) engine: ResilientEngine,
    pub(super) recovery: Recovery,
    pub(super) spec: LimitSpec,
    /// Requests admitted so far, per key.
    pub(super) granted: HashMap<CounterKey, i64>,
}

impl Rig {
    pub(super) fn new() -> Rig {
        Rig::with_journal(None)
    }

    /// A rig whose engine restores (and writes) `journal`.
    pub(super) fn with_journal(journal: Option<Journal>) -> Rig {
        Rig::build(journal, 0)
    }

    /// A rig whose engine has the over-limit cache on, entries living
    /// `ms`.
    pub(super) fn with_over_cache(ms: u64) -> Rig {
        Rig::build(None, ms)
    }

    fn build(journal: Option<Journal>, over_cache_ms: u64) -> Rig {
        // Mid-window, so a test's requests share one minute window.
        let clock = Arc::new(ManualClock::new(60_000 * 1_000 + 1_000));
        let fake = Fake::new(clock.clone());
        Rig::build_on(clock, fake, journal, over_cache_ms)
    }

    /// The replica started again (after a crash: its engine is gone with
    /// whatever it had not replayed or journaled) on the same store and
    /// clock, restoring `journal`.
    pub(super) fn restarted(&self, journal: Journal) -> Rig {
        self.fake.store.lock().boot += 1;
        let mut rig = Rig::build_on(self.clock.clone(), self.fake.clone(), Some(journal), 0);
        rig.granted = self.granted.clone();
        rig
    }

    fn build_on(
        clock: Arc<ManualClock>,
        fake: Arc<Fake>,
        journal: Option<Journal>,
        over_cache_ms: u64,
    ) -> Rig {
        let cfg = ResilientConfig {
            deadline_ms: DEADLINE_MS,
            budget_max_ms: BUDGET_MAX_MS,
            expiry_margin_ms: 10_000,
            lease_min_share: 0.025,
            replicas_hint: 1,
            ledger_max_keys: 1_000,
            ledger_max_bytes: usize::MAX,
            local_max_bytes: crate::engine::memory::DEFAULT_MAX_BYTES,
            breaker: BreakerConfig {
                failures_to_trip: 3,
                probe_interval_ms: 500,
                probe_jitter_ms: 200,
                settle_ms: ResilientConfig::settle_ms(500, 200, DEADLINE_MS),
            },
            over_cache_ms,
        };
        let engine = ResilientEngine::new(fake.clone(), clock.clone(), cfg, journal);
        Rig {
            clock,
            fake,
            engine,
            recovery: Recovery::default(),
            spec: LimitSpec::fixed(1_000, Unit::Minute),
            granted: HashMap::new(),
        }
    }

    pub(super) fn key(&self, v: &str) -> CounterKey {
        CounterKey::new("d", [("user", v)], &self.spec)
    }

    /// One enforced hit on the rig's spec for value `v`.
    pub(super) fn batch(&self, v: &str) -> Batch {
        Batch {
            charges: vec![Charge {
                key: self.key(v),
                spec: self.spec,
                hits: 1,
                refund: false,
                role: Role::Enforce,
            }],
            never_deny: false,
        }
    }

    pub(super) async fn hit(&mut self, v: &str) -> DecisionPath {
        let key = self.key(v);
        let batch = self.batch(v);
        let outcome = self.engine.apply(&batch).await.expect("never an error");
        if !outcome.denied {
            *self.granted.entry(key).or_default() += 1;
        }
        outcome.path
    }

    /// One hit; true when admitted.
    pub(super) async fn hit_admitted(&mut self, v: &str) -> bool {
        let before = self.granted.get(&self.key(v)).copied().unwrap_or(0);
        self.hit(v).await;
        self.granted.get(&self.key(v)).copied().unwrap_or(0) > before
    }

    /// The window index of the rig's spec at the clock's time.
    pub(super) fn clock_window(&self) -> u64 {
        self.clock.now_ms() / self.spec.unit.millis()
    }

    /// One round of the recovery loop and one of the journal writer.
    pub(super) async fn tick(&mut self) {
        self.engine.tick(&mut self.recovery).await;
        self.engine.journal_round().await;
    }

    pub(super) fn state(&self) -> BreakerState {
        self.engine.breaker_state()
    }

    /// (keys to replay, unreplayed hits, suspect keys).
    pub(super) fn pending(&self) -> (usize, i64, usize) {
        self.engine.ledger().pending()
    }

    /// The store holds exactly what was granted, for every key.
    pub(super) fn assert_exact(&self) {
        for (key, granted) in &self.granted {
            assert_eq!(self.fake.total(key, &self.spec), *granted, "{key}");
        }
    }

    /// From tripped back to healthy with Redis up: probe, replay, settle.
    pub(super) async fn recover(&mut self) {
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
