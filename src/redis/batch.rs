//! Coalescing: decision calls that arrive while a call is in flight are
//! sent together, as one script call that decides them one after the
//! other (`decide.lua`; a lone call is a batch of one), each all-or-nothing
//! on its own. An idle queue sends a call at once.
//!
//! A script call carries what its requests share (the replica's index,
//! epoch, failure episode and presumed members) once, so only calls with
//! the same header go together.
//!
//! On one Redis (or Sentinel) a replica has one queue, on one connection
//! of the pool, whatever the pool's size: every queued call can join the
//! next batch, so batches are as large as the load makes them (split over
//! four connections, a spread of distinct keys went 6 requests to a call,
//! against about 20 on one; Redis spent 28% less CPU per decision and
//! leasehold 22% less). Calls fall in ordering groups (a hash of their
//! first key): a batch may mix groups, but no two batches in flight share
//! one, so a group's calls leave in order and none passes another that is
//! sent again (after NOSCRIPT, say). While a batch is in flight, the next
//! leaves only when it is full, at most [`MAX_IN_FLIGHT`] in all: a Redis
//! across a network is not held to one batch per round trip.
//!
//! On a Redis Cluster a script call must keep to one slot, so a slot is
//! the group and a batch holds one slot's calls; there is one queue per
//! connection (the call's key picks it), each with at most one batch in
//! flight per slot: a slot's calls queue while its batch is out and leave
//! together when it is answered (its first queued call and the later ones
//! with its header); the others stay queued, in their order. Batches for
//! different slots are pipelined on the connection and never wait for
//! each other, so a slot that is slow (say being moved to another node)
//! holds up only its own calls.
//!
//! A batch's answers go back to its callers by thread: those waiting on
//! the thread that read the reply are woken there, and those of each other
//! serving thread are handed to that thread in one task, where they wake
//! each other without a syscall and their responses leave in fewer
//! writes. (Woken one by one from here, each cost an eventfd write and
//! often a context switch: measured on two cores, about half a syscall per
//! decision, and responses that left two to a write instead of five.)
//!
//! What stays true per request: the order of calls for one key (its
//! group's calls share a connection and leave first in, first out, with
//! one batch of the group in flight at a time), the epoch fence (each
//! request carries its own), and what a failure means: a batch that fails
//! or times out fails each of its requests the same way, so each is
//! handled as if it had been sent alone (possibly applied, fenced out by
//! the next rewrite, repaired).

use std::collections::HashMap;
use std::sync::Arc;

use fred::types::Value;
use parking_lot::Mutex;
use tokio::sync::oneshot;

use super::scripts::{Answer, DecideArgs};
use super::{integers, CallError, Redis};
use crate::domain::backend::DEMAND_NOT_READ;

/// Requests per batch at most (and so per script call).
pub const MAX_BATCH: usize = 32;

/// On one Redis: the ordering groups (see the module docs). Many, so that
/// a batch of distinct keys holds few of them and the next full batch
/// finds its calls free to go (with 64, one of 32 distinct keys held
/// about 25, and most of the calls queued behind it waited).
const GROUPS: u64 = 1024;

/// On one Redis: batches in flight at most, each after the first full.
pub const MAX_IN_FLIGHT: usize = 4;

type Reply = Result<Vec<i64>, CallError>;

struct Queued {
    /// The Cluster slot of every key (0 on one Redis).
    slot: u16,
    call: DecideArgs,
    reply: oneshot::Sender<Reply>,
    /// Where the caller waits (see [`Answers`]).
    caller: Caller,
}

/// The ordering groups of a batch's calls (slots on a Cluster), each once.
fn groups_of(batch: &[Queued]) -> Vec<u16> {
    let mut groups: Vec<u16> = Vec::new();
    for q in batch {
        if !groups.contains(&q.slot) {
            groups.push(q.slot);
        }
    }
    groups
}

/// A set of ordering groups (below [`GROUPS`]), as bits.
#[derive(Clone, Copy, Default)]
struct GroupSet([u64; (GROUPS / 64) as usize]);

impl GroupSet {
    fn of(groups: impl IntoIterator<Item = u16>) -> Self {
        let mut set = GroupSet::default();
        for g in groups {
            set.insert(g);
        }
        set
    }

    fn at(g: u16) -> (usize, u64) {
        let g = u64::from(g) % GROUPS;
        ((g / 64) as usize, 1 << (g % 64))
    }

    fn insert(&mut self, g: u16) {
        let (i, bit) = Self::at(g);
        self.0[i] |= bit;
    }

    fn contains(&self, g: u16) -> bool {
        let (i, bit) = Self::at(g);
        self.0[i] & bit != 0
    }
}

/// The thread and runtime a queued call's caller waits on.
#[derive(Clone)]
struct Caller {
    thread: std::thread::ThreadId,
    runtime: Option<tokio::runtime::Handle>,
}

impl Caller {
    fn here() -> Self {
        Caller {
            thread: std::thread::current().id(),
            runtime: tokio::runtime::Handle::try_current().ok(),
        }
    }
}

/// The answers of one batch for callers waiting on one other thread,
/// handed to that thread's runtime in one go: waking each caller from
/// here would cost a cross-thread wake (an eventfd write, often a context
/// switch) per request; there they wake each other for free, and their
/// responses leave together. The answers are given when this is dropped,
/// so a runtime that shuts down before running the hand-off (dropping the
/// task) still delivers them.
struct Answers(Vec<(oneshot::Sender<Reply>, Reply)>);

impl Drop for Answers {
    fn drop(&mut self) {
        for (tx, reply) in self.0.drain(..) {
            let _ = tx.send(reply);
        }
    }
}

#[derive(Default)]
struct State {
    queue: Vec<Queued>,
    /// The slots (on one Redis, the groups) with a batch in flight on this
    /// connection, once per batch.
    busy: Vec<u16>,
    /// One Redis: batches mix groups (see the module docs).
    mixed: bool,
    /// Batches in flight (kept when `mixed`).
    in_flight: usize,
    /// When `mixed`: the groups in `busy`, and how many queued calls are
    /// of other groups. With a batch in flight only a full batch leaves, so
    /// while fewer than [`MAX_BATCH`] calls could go, a call joining the
    /// queue is not walked past all the others (a hot key's calls, all of
    /// one group, pile up behind its batch while Redis is slow).
    busy_set: GroupSet,
    free: usize,
}

impl State {
    fn push(&mut self, q: Queued) {
        if self.mixed && !self.busy_set.contains(q.slot) {
            self.free += 1;
        }
        self.queue.push(q);
    }

    /// Counts `busy_set` and `free` again, after the queue or the groups
    /// in flight changed (once per batch, not per call).
    fn recount(&mut self) {
        if self.mixed {
            self.busy_set = GroupSet::of(self.busy.iter().copied());
            let busy = self.busy_set;
            self.free = self.queue.iter().filter(|q| !busy.contains(q.slot)).count();
        }
    }

    /// The batches that can leave now, their slots or groups marked in
    /// flight: on a Cluster one per slot not in flight; on one Redis the
    /// next batch (see [`take_mixed`]), and more while full ones can go.
    fn take_ready(&mut self) -> Vec<Vec<Queued>> {
        if !self.mixed {
            let ready = take_batches(&mut self.queue, &self.busy);
            self.busy
                .extend(ready.iter().filter_map(|b| b.first()).map(|q| q.slot));
            return ready;
        }
        let mut ready = Vec::new();
        if self.in_flight > 0 && self.free < MAX_BATCH {
            return ready;
        }
        while let Some(batch) = take_mixed(&mut self.queue, &self.busy, self.in_flight) {
            self.busy.extend(groups_of(&batch));
            self.in_flight += 1;
            ready.push(batch);
        }
        if !ready.is_empty() {
            self.recount();
        }
        ready
    }

    /// Adds to `batch`, which has not left yet, the calls queued since it
    /// was taken that may go with it.
    fn top_up(&mut self, batch: &mut Vec<Queued>) {
        if self.mixed {
            top_up_mixed(&mut self.queue, &mut self.busy, batch);
            self.recount();
        } else {
            top_up(&mut self.queue, batch);
        }
    }

    /// A batch with these groups (or slot) was answered, or failed.
    fn done(&mut self, groups: &[u16]) {
        for g in groups {
            if let Some(i) = self.busy.iter().position(|b| b == g) {
                self.busy.swap_remove(i);
            }
        }
        if self.mixed {
            self.in_flight = self.in_flight.saturating_sub(1);
            self.recount();
        }
    }
}

/// The decision queues: one on one Redis, one per connection of the pool
/// on a Cluster (see the module docs).
#[derive(Default)]
pub(super) struct Queues {
    conns: Vec<Mutex<State>>,
}

impl Queues {
    pub fn new(connections: usize, cluster: bool) -> Self {
        let n = if cluster { connections.max(1) } else { 1 };
        Queues {
            conns: (0..n)
                .map(|_| {
                    Mutex::new(State {
                        mixed: !cluster,
                        ..State::default()
                    })
                })
                .collect(),
        }
    }
}

impl Redis {
    /// Queues one decision call for the connection `affinity` picks and
    /// waits for its reply: `{status, now_ms, items...}` (see
    /// [`super::scripts::decode_decide`]).
    pub(super) async fn decide_coalesced(
        self: &Arc<Self>,
        slot_of_keys: u16,
        call: DecideArgs,
        affinity: u64,
    ) -> Reply {
        let conn = (affinity % self.queues.conns.len() as u64) as usize;
        let (tx, rx) = oneshot::channel();
        // Read before the lock: the queue is shared by every serving thread.
        let caller = Caller::here();
        let ready = {
            let mut s = self.queues.conns[conn].lock();
            let slot = if s.mixed {
                (affinity % GROUPS) as u16
            } else {
                slot_of_keys
            };
            s.push(Queued {
                slot,
                call,
                reply: tx,
                caller,
            });
            s.take_ready()
        };
        self.start(conn, ready);
        // The sender always answers; a dropped sender means the runtime
        // is shutting down, and the call may have left.
        rx.await
            .unwrap_or(Err(CallError::Timeout(self.reply_timeout)))
    }

    fn start(self: &Arc<Self>, conn: usize, batches: Vec<Vec<Queued>>) {
        for batch in batches {
            let redis = self.clone();
            self.home.spawn(async move { redis.run(conn, batch).await });
        }
    }

    /// Sends `batch`, then, while its slot's calls keep coming, the next
    /// batch of that slot (or another ready one), until none is ready.
    ///
    /// A batch takes on the calls queued for its slot between its being
    /// formed and its task first running, without waiting for any: the
    /// task is spawned, so it runs after the tasks that were ready before
    /// it, and under load those are the rest of the wave of requests the
    /// serving threads have just read. Formed at the first of them, a
    /// batch left with that one alone and the rest waited a round trip
    /// behind it. On an idle runtime nothing is queued and nothing waits.
    async fn run(self: Arc<Self>, conn: usize, mut batch: Vec<Queued>) {
        self.queues.conns[conn].lock().top_up(&mut batch);
        loop {
            let groups = groups_of(&batch);
            self.send_batch(conn, batch).await;
            let mut ready = {
                let mut s = self.queues.conns[conn].lock();
                s.done(&groups);
                s.take_ready()
            };
            let Some(next) = ready.pop() else {
                return;
            };
            self.start(conn, ready);
            batch = next;
        }
    }

    /// One batch as one script call; every request of it hears the result.
    async fn send_batch(&self, conn: usize, batch: Vec<Queued>) {
        self.batches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.batched
            .fetch_add(batch.len() as u64, std::sync::atomic::Ordering::Relaxed);
        let batch = cluster(batch);
        let mut calls = Vec::with_capacity(batch.len());
        let mut replies = Vec::with_capacity(batch.len());
        let mut answers = Vec::with_capacity(batch.len());
        for mut q in batch {
            answers.push(std::mem::take(&mut q.call.answers));
            calls.push(q.call);
            replies.push((q.reply, q.caller));
        }
        let (keys, args) = pack(calls);
        let result = self
            .eval(
                &self.decide,
                keys,
                args,
                self.reply_timeout,
                Some(conn as u64),
            )
            .await
            .and_then(integers);
        let parts: Vec<Reply> = match result.and_then(|flat| split(&flat, &answers)) {
            Ok(parts) => parts.into_iter().map(Ok).collect(),
            Err(e) => vec![Err(e); replies.len()],
        };
        answer(replies, parts);
    }
}

/// A batch's requests with those of the same shape and charge strings
/// next to each other, and within them those of the same keys, so that
/// they go as runs and groups ([`pack`]): in the order each such set first
/// appears, each set in its own order. The requests of a batch were all
/// waiting at once, so Redis may decide them in any order, except that
/// two requests sharing a key keep theirs (a replica's repair or take-back
/// follows the call it repairs): when the new order would swap such a
/// pair, the batch keeps its order. On a spread of distinct keys under one
/// rule, where a request whose replica lacks the previous window's demand
/// (the key's first in a window) has other charge strings than the rest,
/// Redis spent 6% fewer instructions per decision (callgrind, batches of
/// 32 with 30% of them so); this costs the replica 0.3% of its time there
/// (`perf`).
fn cluster(batch: Vec<Queued>) -> Vec<Queued> {
    let n = batch.len();
    // Two requests are in order whatever they are.
    if n < 3 {
        return batch;
    }
    // Per request: the first request of its set (shape and charge
    // strings), then the first of the same keys in that set. The sets are
    // few (compared with each), the keys many (hashed).
    let mut sets: Vec<usize> = Vec::new();
    let mut same: HashMap<(usize, &[String]), usize, ahash::RandomState> =
        HashMap::with_capacity_and_hasher(n, ahash::RandomState::new());
    let mut first: Vec<(usize, usize)> = Vec::with_capacity(n);
    for (i, q) in batch.iter().enumerate() {
        let body = &q.call.body;
        let set = match sets
            .iter()
            .copied()
            .find(|&s| same_charges(&batch[s].call.body, body))
        {
            Some(s) => s,
            None => {
                sets.push(i);
                i
            }
        };
        let keys = *same.entry((set, q.call.keys.as_slice())).or_insert(i);
        first.push((set, keys));
    }
    if first.windows(2).all(|w| w[0] <= w[1]) {
        return batch;
    }
    let shares_key = |a: &Queued, b: &Queued| a.call.keys.iter().any(|k| b.call.keys.contains(k));
    for j in 0..n {
        for i in 0..j {
            if first[j] < first[i] && shares_key(&batch[i], &batch[j]) {
                return batch;
            }
        }
    }
    let mut tagged: Vec<((usize, usize), Queued)> = first.into_iter().zip(batch).collect();
    // Stable: each set keeps its own order.
    tagged.sort_by_key(|t| t.0);
    tagged.into_iter().map(|t| t.1).collect()
}

/// One script call's keys and arguments for a batch's requests, in
/// order: the header once, the number of entries, then each entry. A run
/// of requests equal in keys and body bar the call id and expected counts
/// (the usual case for a hot key; see [`keep_lowest_expected`]) goes as
/// one entry, a group whose shape says how many it
/// stands for: Redis decides its members one after the other as if each
/// had been sent alone, and replies for each, but reads their arguments
/// once and decides the members after the first without redoing what
/// they share (measured on the hot key, a batch of 16 cost Redis about
/// half as much as 16 entries). Only neighbours group, so the order of
/// requests is kept. Neighbours that do not group but share their shape
/// and charge strings (a spread of distinct keys under one rule) go as a
/// run ([`runs`]).
fn pack(calls: Vec<DecideArgs>) -> (Vec<String>, Vec<Value>) {
    let mut keys = Vec::with_capacity(calls.iter().map(|c| c.keys.len()).sum());
    let mut args = Vec::with_capacity(7 + calls.iter().map(|c| c.body.len()).sum::<usize>());
    let mut entries: Vec<Entry> = Vec::with_capacity(calls.len());
    for call in calls {
        if args.is_empty() {
            args.extend(call.header);
            // The number of entries, known at the end.
            args.push(Value::Null);
        } else if let Some(e) = entries.last_mut() {
            if call.repeatable && same_request(&e.keys, &e.body, &call) {
                e.times += 1;
                keep_lowest_expected(&mut e.body, &call.body);
                continue;
            }
        }
        entries.push(Entry {
            keys: call.keys,
            body: call.body,
            times: 1,
            repeatable: call.repeatable,
        });
    }
    let count = runs(entries, &mut keys, &mut args);
    if let Some(n) = args.get_mut(6) {
        *n = Value::Integer(count as i64);
    }
    (keys, args)
}

/// One entry of a script call while it is packed: a request, or a group
/// of `times` equal ones.
struct Entry {
    keys: Vec<String>,
    body: Vec<Value>,
    times: usize,
    repeatable: bool,
}

/// Appends the entries' keys and arguments, neighbours that are single
/// requests with the same shape and charge strings (no call id, so
/// repeatable) as one run: its shape `<keys>,<charges>,<flags + 4>,<n>`,
/// the charge strings once, then each member's expected counts in turn
/// (decide.lua decides and answers each as if sent alone). On a spread
/// of distinct keys this sends two arguments a request instead of four,
/// and each argument costs Redis about 1,150 instructions (callgrind).
/// Returns how many entries the call has.
fn runs(entries: Vec<Entry>, keys: &mut Vec<String>, args: &mut Vec<Value>) -> usize {
    let mut count = 0;
    let mut entries = entries.into_iter().peekable();
    while let Some(first) = entries.next() {
        count += 1;
        let mut run = Vec::new();
        if first.times == 1 && first.repeatable {
            while let Some(next) = entries
                .next_if(|n| n.times == 1 && n.repeatable && same_charges(&first.body, &n.body))
            {
                run.push(next);
            }
        }
        let run_shape = (!run.is_empty())
            .then(|| {
                let shape = first.body.first()?.as_str()?.into_owned();
                let (rest, flags) = shape.rsplit_once(',')?;
                let flags: u8 = flags.parse().ok()?;
                Some(format!("{rest},{},{}", flags + 4, run.len() + 1))
            })
            .flatten();
        let Some(shape) = run_shape else {
            // A request or a group, as it is; or (never here: its shape
            // comes from decide_args) a run whose shape cannot be read,
            // as requests on their own.
            push_entry(first, keys, args);
            for e in run {
                count += 1;
                push_entry(e, keys, args);
            }
            continue;
        };
        let mut body = first.body.into_iter();
        body.next();
        args.push(Value::from(shape));
        let mut expected = Vec::with_capacity(body.len() / 2);
        while let Some(charge) = body.next() {
            args.push(charge);
            expected.extend(body.next());
        }
        args.extend(expected);
        keys.extend(first.keys);
        for e in run {
            args.extend(e.body.into_iter().skip(2).step_by(2));
            keys.extend(e.keys);
        }
    }
    count
}

/// A request or a group, its shape saying how many a group stands for.
fn push_entry(e: Entry, keys: &mut Vec<String>, args: &mut Vec<Value>) {
    let at = args.len();
    keys.extend(e.keys);
    args.extend(e.body);
    if e.times > 1 {
        let shape = args
            .get(at)
            .and_then(|v| v.as_str())
            .map(|s| format!("{s},{}", e.times));
        if let Some(shape) = shape {
            args[at] = Value::from(shape);
        }
    }
}

/// Whether two repeatable requests' bodies have the same shape and charge
/// strings (every other item from the second on), whatever their expected
/// counts.
fn same_charges(a: &[Value], b: &[Value]) -> bool {
    a.len() == b.len()
        && a.first() == b.first()
        && a.iter().zip(b).skip(1).step_by(2).all(|(x, y)| x == y)
}

/// Whether `call`, a request without a call id (repeatable), is the
/// request whose keys and body are `keys` and `body`, bar its expected
/// counts (every other item from the third on). Its shape says it has no
/// call id, so an equal one has none either; the charges are every other
/// item from the second on.
fn same_request(keys: &[String], body: &[Value], call: &DecideArgs) -> bool {
    keys == call.keys.as_slice()
        && body.len() == call.body.len()
        && body.first() == call.body.first()
        && call
            .body
            .iter()
            .zip(body)
            .skip(1)
            .step_by(2)
            .all(|(a, b)| a == b)
}

/// A group carries, per charge, the lowest expected count of its members.
/// Each member's expected count is a floor this replica knows its field
/// to be at or above (or -1, unknown), read when its request was made; a
/// hot key's requests each read a higher one as answers come in, and
/// would never group if it had to be equal. The lowest is a floor for
/// every member and at most the first member's (the one Redis checks it
/// for), so a loss it reports is one the first member alone would have
/// reported: it may miss a loss smaller than the members' spread (the
/// next call sees it), never report one that did not happen.
fn keep_lowest_expected(group: &mut [Value], member: &[Value]) {
    for (g, m) in group.iter_mut().zip(member).skip(2).step_by(2) {
        if let (Value::Integer(a), Value::Integer(b)) = (&*g, m) {
            if b < a {
                *g = Value::Integer(*b);
            }
        }
    }
}

/// Gives each caller its answer: directly to those waiting on this
/// thread (or on no runtime), in one hand-off per other thread (see
/// [`Answers`]).
fn answer(replies: Vec<(oneshot::Sender<Reply>, Caller)>, answers: Vec<Reply>) {
    let here = std::thread::current().id();
    let mut away: Vec<(std::thread::ThreadId, tokio::runtime::Handle, Answers)> = Vec::new();
    for ((tx, caller), reply) in replies.into_iter().zip(answers) {
        let Some(runtime) = caller.runtime.filter(|_| caller.thread != here) else {
            let _ = tx.send(reply);
            continue;
        };
        match away
            .iter_mut()
            .find(|(thread, ..)| *thread == caller.thread)
        {
            Some((.., group)) => group.0.push((tx, reply)),
            None => away.push((caller.thread, runtime, Answers(vec![(tx, reply)]))),
        }
    }
    for (_, runtime, group) in away {
        drop(runtime.spawn(async move { drop(group) }));
    }
}

/// The batches that can leave now: for each slot not in `busy` (in the
/// order of their first call), its first call queued and up to
/// [`MAX_BATCH`] − 1 later ones with its header, in order; the rest stay
/// queued in order. Calls for one slot never pass each other: a slot with
/// a batch in flight sends nothing more until it is answered, and a
/// slot's batch stops at the first of its calls with another header (say
/// a refund made after the epoch was raised), which would otherwise run
/// after the calls queued behind it, a refund before the charge it
/// reverses.
fn take_batches(queue: &mut Vec<Queued>, busy: &[u16]) -> Vec<Vec<Queued>> {
    let Some(first) = queue.first() else {
        return Vec::new();
    };
    // The common case under load on one Redis: every queued call waits
    // for a batch in flight (nothing moves, nothing is allocated).
    if queue.iter().all(|q| busy.contains(&q.slot)) {
        return Vec::new();
    }
    let (slot, header) = (first.slot, &first.call.header);
    if busy.is_empty()
        && queue
            .iter()
            .all(|q| q.slot == slot && q.call.header == *header)
    {
        let n = queue.len().min(MAX_BATCH);
        return vec![queue.drain(..n).collect()];
    }
    // Per slot seen: its batch's index, or None once it can take no more.
    let mut open: Vec<(u16, Option<usize>)> = busy.iter().map(|&s| (s, None)).collect();
    let mut ready: Vec<Vec<Queued>> = Vec::new();
    let mut rest = Vec::with_capacity(queue.len());
    for q in queue.drain(..) {
        match open.iter_mut().find(|(s, _)| *s == q.slot) {
            None => {
                open.push((q.slot, Some(ready.len())));
                ready.push(vec![q]);
            }
            Some((_, at)) => match *at {
                Some(i) if takes(&ready[i], &q) => ready[i].push(q),
                _ => {
                    *at = None;
                    rest.push(q);
                }
            },
        }
    }
    *queue = rest;
    ready
}

/// Whether `batch`, with `q`'s slot, can take `q`: it has room, and `q`
/// shares its header (see [`take_batches`]).
fn takes(batch: &[Queued], q: &Queued) -> bool {
    batch.len() < MAX_BATCH
        && batch
            .first()
            .is_some_and(|f| f.call.header == q.call.header)
}

/// Moves into `batch` the calls queued behind it for its slot, in order,
/// while they share its header and it has room: its slot is in flight,
/// so nothing of that slot has left since the batch was taken, and the
/// first call with another header stops it (as in [`take_batches`]).
fn top_up(queue: &mut Vec<Queued>, batch: &mut Vec<Queued>) {
    let Some(slot) = batch.first().map(|q| q.slot) else {
        return;
    };
    if batch.len() >= MAX_BATCH || !queue.iter().any(|q| q.slot == slot) {
        return;
    }
    let mut open = true;
    let mut rest = Vec::with_capacity(queue.len());
    for q in queue.drain(..) {
        if open && q.slot == slot {
            if takes(batch, &q) {
                batch.push(q);
                continue;
            }
            open = false;
        }
        rest.push(q);
    }
    *queue = rest;
}

/// On one Redis, the next batch: the queued calls, in order, of the groups
/// not in flight (`busy`), up to [`MAX_BATCH`], with the header of the
/// first of them; a call with another header stays, and so do the later
/// calls of its group. With a batch in flight only a full batch leaves
/// (the others wait for its answer and go with the calls that come
/// meanwhile), and never more than [`MAX_IN_FLIGHT`] are in flight.
fn take_mixed(queue: &mut Vec<Queued>, busy: &[u16], in_flight: usize) -> Option<Vec<Queued>> {
    // The common case under load: a batch is out and too few calls wait
    // for a full one (nothing moves, nothing is allocated).
    if queue.is_empty() || in_flight >= MAX_IN_FLIGHT || (in_flight > 0 && queue.len() < MAX_BATCH)
    {
        return None;
    }
    let mut closed = GroupSet::of(busy.iter().copied());
    let mut take = Vec::with_capacity(MAX_BATCH.min(queue.len()));
    let mut header = None;
    for (i, q) in queue.iter().enumerate() {
        if take.len() == MAX_BATCH {
            break;
        }
        if closed.contains(q.slot) {
            continue;
        }
        match header {
            None => {
                header = Some(&q.call.header);
                take.push(i);
            }
            Some(h) if *h == q.call.header => take.push(i),
            Some(_) => closed.insert(q.slot),
        }
    }
    if take.is_empty() || (in_flight > 0 && take.len() < MAX_BATCH) {
        return None;
    }
    let mut batch = Vec::with_capacity(take.len());
    let mut rest = Vec::with_capacity(queue.len() - take.len());
    let mut next = take.into_iter().peekable();
    for (i, q) in queue.drain(..).enumerate() {
        if next.peek() == Some(&i) {
            next.next();
            batch.push(q);
        } else {
            rest.push(q);
        }
    }
    *queue = rest;
    Some(batch)
}

/// On one Redis, moves into `batch` (not sent yet) the calls queued since
/// it was taken, in order, while it has room: those of its own groups and
/// of groups not in flight (then marked in flight, with this batch), with
/// its header; a call that stays keeps the later calls of its group.
fn top_up_mixed(queue: &mut Vec<Queued>, busy: &mut Vec<u16>, batch: &mut Vec<Queued>) {
    let Some(header) = batch.first().map(|q| q.call.header.clone()) else {
        return;
    };
    if batch.len() >= MAX_BATCH || queue.is_empty() {
        return;
    }
    let mut mine = GroupSet::of(batch.iter().map(|q| q.slot));
    // No other batch holds this one's groups.
    let mut closed = GroupSet::of(busy.iter().copied().filter(|&g| !mine.contains(g)));
    let mut rest = Vec::with_capacity(queue.len());
    for q in queue.drain(..) {
        if batch.len() < MAX_BATCH && !closed.contains(q.slot) && q.call.header == header {
            if !mine.contains(q.slot) {
                mine.insert(q.slot);
                busy.push(q.slot);
            }
            batch.push(q);
        } else {
            closed.insert(q.slot);
            rest.push(q);
        }
    }
    *queue = rest;
}

/// A batch reply, per request its status and, unless stale (-1), per
/// charge `remaining, reset, own, total, delta` with `total` only when
/// `own` is 0 or more (or `remaining, delta` for a short one, see
/// [`Answer`]; a request of one short charge: its remaining alone, or
/// `-2 - status`, remaining and delta). A status with 4 (void: a short
/// charge's demand share is void, `own` -1) answers every charge in full
/// (for a request of one short charge, `-2 - status` is then -6 or
/// below). Then the call's Redis time: split
/// into one reply per request (`answers[i]` for request i's charges), each
/// in the shape [`super::scripts::decode_decide`] reads, `{status, now_ms}`
/// then five items per charge (`total` 0 where the script left it out,
/// `reset` and `own` made here for a short one).
fn split(flat: &[i64], answers: &[Vec<Answer>]) -> Result<Vec<Vec<i64>>, CallError> {
    let short = || CallError::Reply("batch reply too short".to_owned());
    let (&now, mut rest) = flat
        .split_last()
        .ok_or_else(|| CallError::Reply("batch reply is empty".to_owned()))?;
    // The time to the end of the window the call landed in.
    let reset = |unit_ms: u64| {
        let unit = i64::try_from(unit_ms).unwrap_or(i64::MAX).max(1);
        unit - now.rem_euclid(unit)
    };
    let mut out = Vec::with_capacity(answers.len());
    for request in answers {
        let (&first, tail) = rest.split_first().ok_or_else(short)?;
        rest = tail;
        let mut reply = Vec::with_capacity(2 + 5 * request.len());
        // A status with 4 (void): every charge answered in full. A request
        // of one short charge then goes as `-2 - status`, -6 or below (0
        // or more is its remaining).
        let one_short = matches!(request.as_slice(), [Answer::Short { .. }]);
        let void = if one_short { first <= -6 } else { first >= 4 };
        if let ([Answer::Short { unit_ms, hits }], false) = (request.as_slice(), void) {
            if first >= 0 {
                // Admitted as asked, with `first` remaining.
                reply.extend_from_slice(&[0, now, first, reset(*unit_ms), DEMAND_NOT_READ, 0]);
                reply.push(*hits);
            } else if first == -1 {
                reply.extend_from_slice(&[-1, now]);
            } else {
                let [remaining, delta, tail @ ..] = rest else {
                    return Err(short());
                };
                let status = -2 - first;
                reply.extend_from_slice(&[status, now, *remaining, reset(*unit_ms)]);
                reply.extend_from_slice(&[DEMAND_NOT_READ, 0, *delta]);
                rest = tail;
            }
            out.push(reply);
            continue;
        }
        // A request of one short charge answered in full goes as
        // `-2 - status`.
        let status = match (one_short, void) {
            (true, true) => (-2 - first) & 3,
            (false, true) => first & 3,
            _ => first,
        };
        reply.push(status);
        reply.push(now);
        if status != -1 {
            for answer in request {
                if let (Answer::Short { unit_ms, .. }, false) = (*answer, void) {
                    let [remaining, delta, tail @ ..] = rest else {
                        return Err(short());
                    };
                    reply.extend_from_slice(&[*remaining, reset(unit_ms), DEMAND_NOT_READ, 0]);
                    reply.push(*delta);
                    rest = tail;
                    continue;
                }
                let [remaining, reset, own, tail @ ..] = rest else {
                    return Err(short());
                };
                let (total, tail) = match (own, tail) {
                    (o, [total, tail @ ..]) if *o >= 0 => (*total, tail),
                    (o, _) if *o >= 0 => return Err(short()),
                    _ => (0, tail),
                };
                let [delta, tail @ ..] = tail else {
                    return Err(short());
                };
                reply.extend_from_slice(&[*remaining, *reset, *own, total, *delta]);
                rest = tail;
            }
        }
        out.push(reply);
    }
    if !rest.is_empty() {
        return Err(CallError::Reply(format!(
            "batch reply has {} items too many",
            rest.len()
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(key: &str, id: &str, charge: &str, repeatable: bool) -> DecideArgs {
        let header = [1, 7, 0].map(Value::Integer);
        DecideArgs {
            keys: vec![key.to_owned()],
            header: [
                header[0].clone(),
                header[1].clone(),
                header[2].clone(),
                Value::from(""),
                Value::from(""),
                Value::from(""),
            ],
            // A call id only with a sliding-log charge (not repeatable).
            body: if repeatable {
                vec![Value::from("1,1,0"), Value::from(charge), Value::Integer(5)]
            } else {
                vec![
                    Value::from("1,1,2"),
                    Value::from(id),
                    Value::from(charge),
                    Value::Integer(5),
                ]
            },
            repeatable,
            answers: vec![Answer::Full],
        }
    }

    fn texts(args: &[Value]) -> Vec<String> {
        args.iter()
            .map(|v| match v {
                Value::Integer(n) => n.to_string(),
                other => other.as_str().map(|s| s.into_owned()).unwrap_or_default(),
            })
            .collect()
    }

    #[test]
    fn equal_neighbours_go_as_groups_and_neighbours_of_one_rule_as_runs() {
        let fixed = "1,10,1000,10,1,0,0,0,0";
        let log = "3,10,1000,10,1,0,0,0,0";
        let calls = vec![
            request("a", "c1", fixed, true),
            request("a", "c2", fixed, true),
            request("a", "c3", fixed, true),
            // Another key breaks the group; the same key after it starts a
            // new one (order is kept). The two, each alone, go as a run.
            request("b", "c4", fixed, true),
            request("a", "c5", fixed, true),
            // Other hits: another request, and not of the run.
            request("a", "c6", "1,10,1000,10,2,0,0,0,0", true),
            // Sliding-log charges never group (their ids come from the
            // call id).
            request("a", "c7", log, false),
            request("a", "c8", log, false),
        ];
        let (keys, args) = pack(calls);
        assert_eq!(keys, ["a", "b", "a", "a", "a", "a"]);
        let entry = |shape: &str, charge: &str| [shape, charge, "5"].map(str::to_owned).to_vec();
        let logged = |id: &str| ["1,1,2", id, log, "5"].map(str::to_owned).to_vec();
        let mut want: Vec<String> = ["1", "7", "0", "", "", "", "5"].map(str::to_owned).to_vec();
        want.extend(entry("1,1,0,3", fixed));
        // The run: its shape (flag 4, two members), the charge once, then
        // each member's expected count.
        want.extend(entry("1,1,4,2", fixed));
        want.push("5".to_owned());
        want.extend(entry("1,1,0", "1,10,1000,10,2,0,0,0,0"));
        want.extend(logged("c7"));
        want.extend(logged("c8"));
        assert_eq!(texts(&args), want);
        // Another expected count is the same request: the group carries
        // the lowest (a floor for each member), -1 (unknown) included.
        let expecting = |id: &str, n: i64| {
            let mut r = request("a", id, fixed, true);
            r.body[2] = Value::Integer(n);
            r
        };
        let (_, args) = pack(vec![
            expecting("c1", 6),
            expecting("c2", 4),
            expecting("c3", 9),
        ]);
        assert_eq!(texts(&args)[6..], ["1", "1,1,0,3", fixed, "4"]);
        let (_, args) = pack(vec![expecting("c1", 6), expecting("c2", -1)]);
        assert_eq!(texts(&args)[9], "-1");
    }

    #[test]
    fn a_run_sends_its_charge_strings_once_and_each_members_keys_and_counts() {
        // Three requests of two charges each on distinct keys (a spread
        // under one pair of rules), each with its own expected counts; a
        // shadow-mode request after them (another shape) is not of the run.
        let pair = |key: &str, n: i64, shape: &str| DecideArgs {
            keys: vec![format!("{key}1"), format!("{key}2")],
            body: vec![
                Value::from(shape),
                Value::from("1,10,1000,10,1,8,0,0,0"),
                Value::Integer(n),
                Value::from("2,5,60000,5,1,0,0,0,0"),
                Value::Integer(n + 100),
            ],
            ..request("x", "", "", true)
        };
        let (keys, args) = pack(vec![
            pair("a", 1, "2,2,0"),
            pair("b", 2, "2,2,0"),
            pair("c", 3, "2,2,0"),
            pair("d", 4, "2,2,1"),
        ]);
        assert_eq!(keys, ["a1", "a2", "b1", "b2", "c1", "c2", "d1", "d2"]);
        let want = [
            "1",
            "7",
            "0",
            "",
            "",
            "",
            "2", //
            "2,2,4,3",
            "1,10,1000,10,1,8,0,0,0",
            "2,5,60000,5,1,0,0,0,0", //
            "1",
            "101",
            "2",
            "102",
            "3",
            "103", //
            "2,2,1",
            "1,10,1000,10,1,8,0,0,0",
            "4",
            "2,5,60000,5,1,0,0,0,0",
            "104",
        ];
        assert_eq!(texts(&args), want);
        // A request with a call id (a sliding-log charge) never joins one.
        let (_, args) = pack(vec![
            request("a", "c1", "3,10,1000,10,1,0,0,0,0", false),
            request("b", "c2", "3,10,1000,10,1,0,0,0,0", false),
        ]);
        assert_eq!(texts(&args)[6], "2");
    }

    /// Requests of `n` charges each, every one answered in full.
    fn full(ns: &[usize]) -> Vec<Vec<Answer>> {
        ns.iter().map(|&n| vec![Answer::Full; n]).collect()
    }

    #[test]
    fn a_batch_reply_splits_per_request_or_says_why_not() {
        // Three requests: one charge with its previous window read (a
        // total follows its own count), one fenced (no items), and two
        // charges whose previous windows were not read (-2) or not whole
        // (-1), without a total; then Redis's time.
        let flat = [
            0, 8, 900, 3, 10, 1,  //
            -1, //
            1, -1, 500, -2, 0, 4, 500, -1, 0, //
            5_000,
        ];
        assert_eq!(
            split(&flat, &full(&[1, 1, 2])).ok(),
            Some(vec![
                vec![0, 5_000, 8, 900, 3, 10, 1],
                vec![-1, 5_000],
                vec![1, 5_000, -1, 500, -2, 0, 0, 4, 500, -1, 0, 0]
            ])
        );
        assert!(split(&flat, &full(&[1, 1, 1])).is_err(), "items left over");
        assert!(split(&flat, &full(&[1, 1])).is_err(), "requests left over");
        assert!(split(&flat, &full(&[1, 1, 3])).is_err(), "too short");
        assert!(
            split(&flat, &full(&[1, 1, 2, 1])).is_err(),
            "a request too many"
        );
        assert!(
            split(&[0, 8, 900, 3, 1, 5_000], &full(&[1])).is_err(),
            "a total announced by its own count is missing"
        );
        assert!(
            split(&[9], &full(&[1])).is_err(),
            "a request without a status"
        );
        assert!(split(&[], &[]).is_err(), "no time");
    }

    #[test]
    fn a_short_answer_gets_its_reset_from_redis_time_and_no_demand() {
        // At 5,300 ms on Redis's clock: a request of a short charge (a 1 s
        // window) then a full one; requests of one short charge each (a
        // 1 min window, 2 hits): denied, admitted with 5 remaining (its
        // remaining alone), stale, and lost (admitted, 1 remaining).
        let second = Answer::Short {
            unit_ms: 1_000,
            hits: 1,
        };
        let minute = Answer::Short {
            unit_ms: 60_000,
            hits: 2,
        };
        let flat = [
            0, 7, 1, 4, 900, 3, 10, 1, //
            -3, -1, 0,  //
            5,  //
            -1, //
            -4, 1, 2, //
            5_300,
        ];
        let answers = vec![
            vec![second, Answer::Full],
            vec![minute],
            vec![minute],
            vec![minute],
            vec![minute],
        ];
        assert_eq!(
            split(&flat, &answers).ok(),
            Some(vec![
                vec![0, 5_300, 7, 700, DEMAND_NOT_READ, 0, 1, 4, 900, 3, 10, 1],
                vec![1, 5_300, -1, 54_700, DEMAND_NOT_READ, 0, 0],
                vec![0, 5_300, 5, 54_700, DEMAND_NOT_READ, 0, 2],
                vec![-1, 5_300],
                vec![2, 5_300, 1, 54_700, DEMAND_NOT_READ, 0, 2],
            ])
        );
        // Read as full, the same items run out.
        assert!(split(&flat, &full(&[2, 1, 1, 1, 1])).is_err());
        // A short answer missing its delta, alone and beside a full one.
        assert!(split(&[-2, 7, 5_300], &[vec![second]]).is_err());
        assert!(split(&[0, 7, 5_300], &[vec![second, Answer::Full]]).is_err());
    }

    #[test]
    fn a_void_request_is_answered_in_full() {
        // Status + 4 (void): a short charge's current window has some
        // replica's decisions off Redis, so every charge of its request
        // comes in full, own -1 where the share is void. A request of one
        // short charge admitted (-6), then one denied and lost (-9), then
        // two short charges, the second void, admitted (4).
        let second = Answer::Short {
            unit_ms: 1_000,
            hits: 1,
        };
        let flat = [
            -6, 7, 700, -1, 1, //
            -9, -1, 700, -1, 0, //
            4, 5, 700, -2, 1, 3, 700, -1, 1, //
            5_300,
        ];
        let answers = vec![vec![second], vec![second], vec![second, second]];
        assert_eq!(
            split(&flat, &answers).ok(),
            Some(vec![
                vec![0, 5_300, 7, 700, -1, 0, 1],
                vec![3, 5_300, -1, 700, -1, 0, 0],
                vec![0, 5_300, 5, 700, -2, 0, 1, 3, 700, -1, 0, 1],
            ])
        );
        // Without the void status, the same items read short run over.
        assert!(split(&[-2, 7, 700, -1, 1, 5_300], &[vec![second]]).is_err());
    }

    /// A queued request on `key` with charge string `charge`, its
    /// expected count `n` telling it apart.
    fn on(key: &str, charge: &str, n: i64) -> Queued {
        let mut call = request(key, "", charge, true);
        call.body[2] = Value::Integer(n);
        Queued {
            slot: 0,
            call,
            reply: oneshot::channel().0,
            caller: Caller::here(),
        }
    }

    fn expected(batch: &[Queued]) -> Vec<i64> {
        batch
            .iter()
            .filter_map(|q| q.call.body.last().and_then(|v| v.as_i64()))
            .collect()
    }

    #[test]
    fn a_batch_puts_equal_charge_strings_and_keys_together_but_never_swaps_a_keys_calls() {
        // Distinct keys under two charge strings ("a", and "b" for a key's
        // first request in a window), and a hot key "h" among them.
        let batch = vec![
            on("k1", "a", 1),
            on("k2", "b", 2),
            on("h", "a", 3),
            on("k3", "a", 4),
            on("h", "a", 5),
            on("k4", "b", 6),
            on("h", "a", 7),
        ];
        assert_eq!(expected(&cluster(batch)), vec![1, 3, 5, 7, 4, 2, 6]);
        // Already in order: unchanged.
        let batch = vec![on("k1", "a", 1), on("k2", "a", 2), on("k3", "b", 3)];
        assert_eq!(expected(&cluster(batch)), vec![1, 2, 3]);
        // k2's "b" call comes before its "a" call: moving the "a" calls
        // together would swap them, so the batch keeps its order.
        let batch = vec![on("k1", "a", 1), on("k2", "b", 2), on("k2", "a", 3)];
        assert_eq!(expected(&cluster(batch)), vec![1, 2, 3]);
        // The same with a key that only the moved call's second charge
        // shares.
        let mut second = on("k9", "a", 3);
        second.call.keys.push("k2".to_owned());
        let batch = vec![on("k1", "a", 1), on("k2", "b", 2), second];
        assert_eq!(expected(&cluster(batch)), vec![1, 2, 3]);
    }

    fn queued(slot: u16, epoch: i64, n: i64) -> Queued {
        let header = [
            Value::Integer(1),
            Value::Integer(epoch),
            Value::Integer(0),
            Value::from(""),
            Value::from(""),
            Value::from(""),
        ];
        Queued {
            slot,
            call: DecideArgs {
                keys: Vec::new(),
                header,
                body: vec![Value::Integer(n)],
                repeatable: true,
                answers: vec![Answer::Full],
            },
            reply: oneshot::channel().0,
            caller: Caller::here(),
        }
    }

    fn order(calls: &[Queued]) -> Vec<i64> {
        calls
            .iter()
            .filter_map(|q| q.call.body[0].as_i64())
            .collect()
    }

    fn orders(round: &[Vec<Queued>]) -> Vec<Vec<i64>> {
        round.iter().map(|b| order(b)).collect()
    }

    #[test]
    fn one_batch_per_slot_leaves_and_none_for_a_slot_in_flight() {
        let call = |slot: u16, n: i64| queued(slot, 1, n);
        let mut queue = vec![call(7, 1), call(9, 2), call(7, 3), call(9, 4), call(7, 5)];
        let ready = take_batches(&mut queue, &[]);
        assert_eq!(orders(&ready), [vec![1, 3, 5], vec![2, 4]]);
        assert!(queue.is_empty() && take_batches(&mut queue, &[]).is_empty());
        let mut many: Vec<Queued> = (0..40).map(|n| call(1, n)).collect();
        let ready = take_batches(&mut many, &[]);
        assert_eq!((ready.len(), ready[0].len()), (1, MAX_BATCH));
        assert_eq!(many.len(), 40 - MAX_BATCH);
        // A full batch closes its slot: the calls after it wait, in order.
        let mut mixed: Vec<Queued> = (0..MAX_BATCH as i64 + 1).map(|n| call(1, n)).collect();
        mixed.push(call(2, 100));
        mixed.push(call(1, 101));
        let ready = take_batches(&mut mixed, &[]);
        assert_eq!(orders(&ready)[1], [100]);
        assert_eq!(order(&mixed), [MAX_BATCH as i64, 101]);
        // A slot with a batch in flight sends nothing; the others go.
        let mut queue = vec![call(7, 1), call(9, 2), call(7, 3)];
        assert_eq!(orders(&take_batches(&mut queue, &[7])), [vec![2]]);
        assert_eq!(order(&queue), [1, 3]);
        assert!(take_batches(&mut queue, &[7, 9]).is_empty());
        let mut state = State {
            queue,
            busy: vec![9],
            ..State::default()
        };
        assert_eq!(orders(&state.take_ready()), [vec![1, 3]]);
        assert_eq!(state.busy, [9, 7]);
    }

    fn one_redis() -> State {
        State {
            mixed: true,
            ..State::default()
        }
    }

    /// Queues `calls` as callers do, one by one.
    fn fill(state: &mut State, calls: Vec<Queued>) {
        for q in calls {
            state.push(q);
        }
    }

    /// One Redis: an idle queue sends everything queued (any groups, up
    /// to MAX_BATCH, in order); with a batch in flight only a full batch
    /// of other groups leaves, at most MAX_IN_FLIGHT in all, and the
    /// rest waits for an answer.
    #[test]
    fn on_one_redis_a_batch_mixes_groups_and_only_full_ones_follow() {
        let mut state = one_redis();
        fill(
            &mut state,
            (0..40).map(|n| queued((n % 5) as u16, 1, n)).collect(),
        );
        let ready = state.take_ready();
        assert_eq!(orders(&ready), [(0..32).collect::<Vec<_>>()]);
        // Its groups are in flight: the 8 left wait, in order.
        assert_eq!((state.in_flight, state.busy.len()), (1, 5));
        assert_eq!(order(&state.queue), (32..40).collect::<Vec<_>>());
        assert!(state.take_ready().is_empty());
        state.done(&groups_of(&ready[0]));
        assert_eq!(orders(&state.take_ready()), [(32..40).collect::<Vec<_>>()]);

        // Full batches of distinct groups pipeline, up to the bound.
        let mut state = one_redis();
        let per = MAX_BATCH as i64;
        fill(
            &mut state,
            (0..per * (MAX_IN_FLIGHT as i64 + 1))
                .map(|n| queued((n / per) as u16, 1, n))
                .collect(),
        );
        let ready = state.take_ready();
        assert_eq!(ready.len(), MAX_IN_FLIGHT);
        assert!(ready.iter().all(|b| b.len() == MAX_BATCH));
        assert_eq!(state.queue.len(), MAX_BATCH);
        state.done(&groups_of(&ready[0]));
        assert_eq!(
            state.take_ready().len(),
            1,
            "a full batch, once one is answered"
        );

        // A batch in flight and fewer than a full batch queued: nothing.
        let mut state = one_redis();
        fill(&mut state, vec![queued(1, 1, 1)]);
        let first = state.take_ready();
        fill(
            &mut state,
            (2..20).map(|n| queued((n % 3) as u16, 1, n)).collect(),
        );
        assert!(state.take_ready().is_empty());
        state.done(&groups_of(&first[0]));
        assert_eq!(orders(&state.take_ready()), [(2..20).collect::<Vec<_>>()]);
    }

    /// One Redis: a group in flight keeps its calls queued even when a
    /// full batch of the others leaves; a call with another header stays
    /// with the later calls of its group, and the other groups go.
    #[test]
    fn on_one_redis_no_two_batches_in_flight_share_a_group() {
        let mut state = one_redis();
        fill(&mut state, vec![queued(9, 1, 0)]);
        let first = state.take_ready();
        // 44 calls, every fourth in group 9 (in flight): 33 of others, so
        // a full batch of them leaves and the 11 of group 9 stay, in order.
        let group = |n: i64| if n % 4 == 0 { 9 } else { (n % 4) as u16 };
        fill(
            &mut state,
            (1..=44).map(|n| queued(group(n), 1, n)).collect(),
        );
        let ready = state.take_ready();
        let others: Vec<i64> = (1..=44).filter(|n| n % 4 != 0).collect();
        assert_eq!(orders(&ready), [others[..MAX_BATCH].to_vec()]);
        let mut left: Vec<i64> = (1..=44).filter(|n| n % 4 == 0).collect();
        left.push(others[MAX_BATCH]);
        left.sort_unstable();
        assert_eq!(order(&state.queue), left);
        // Group 9's batch answered, the other still out: not a full
        // batch's worth, so they wait for it, then all go, in order.
        state.done(&groups_of(&first[0]));
        assert!(state.take_ready().is_empty());
        state.done(&groups_of(&ready[0]));
        assert_eq!(orders(&state.take_ready()), [left]);
        assert!(state.queue.is_empty());

        let mut state = one_redis();
        fill(
            &mut state,
            vec![
                queued(1, 1, 1),
                queued(2, 2, 2),
                queued(2, 1, 3),
                queued(3, 1, 4),
            ],
        );
        let ready = state.take_ready();
        assert_eq!(orders(&ready), [vec![1, 4]]);
        assert_eq!(order(&state.queue), [2, 3]);
        state.done(&groups_of(&ready[0]));
        let ready = state.take_ready();
        assert_eq!(orders(&ready), [vec![2]]);
        state.done(&groups_of(&ready[0]));
        assert_eq!(orders(&state.take_ready()), [vec![3]]);
    }

    /// One Redis: calls of a group in flight are counted as unable to go,
    /// so they wait without being walked; the count follows the batches.
    #[test]
    fn on_one_redis_calls_behind_a_group_in_flight_are_counted_not_walked() {
        let mut state = one_redis();
        fill(&mut state, vec![queued(4, 1, 0)]);
        let first = state.take_ready();
        fill(&mut state, (1..=100).map(|n| queued(4, 1, n)).collect());
        assert_eq!((state.free, state.queue.len()), (0, 100));
        assert!(state.take_ready().is_empty());
        fill(&mut state, (101..=131).map(|n| queued(5, 1, n)).collect());
        assert_eq!(state.free, 31);
        assert!(
            state.take_ready().is_empty(),
            "31 free calls: not a full batch"
        );
        fill(&mut state, vec![queued(6, 1, 132)]);
        let full = state.take_ready();
        assert_eq!(orders(&full), [(101..=132).collect::<Vec<_>>()]);
        assert_eq!(state.free, 0);
        state.done(&groups_of(&first[0]));
        assert_eq!(state.free, 100);
        // Group 4's calls go, in order, once no batch of theirs is out
        // (the other batch in flight leaves only a full one to follow).
        assert_eq!(orders(&state.take_ready()), [(1..=32).collect::<Vec<_>>()]);
    }

    /// One Redis: a batch not sent yet takes on the calls queued since, of
    /// its own groups and of groups not in flight, up to another header.
    #[test]
    fn on_one_redis_a_batch_takes_on_later_calls_of_free_groups() {
        let mut state = one_redis();
        state.busy = vec![5, 1];
        state.in_flight = 2;
        let mut batch = vec![queued(1, 1, 1)];
        fill(
            &mut state,
            vec![
                queued(5, 1, 2),
                queued(1, 1, 3),
                queued(2, 1, 4),
                queued(2, 2, 5),
                queued(2, 1, 6),
                queued(3, 1, 7),
            ],
        );
        state.top_up(&mut batch);
        assert_eq!(order(&batch), [1, 3, 4, 7]);
        assert_eq!(order(&state.queue), [2, 5, 6]);
        assert_eq!(state.busy, [5, 1, 2, 3]);
        state.done(&groups_of(&batch));
        assert_eq!(state.busy, [5]);
        assert_eq!(state.in_flight, 1);
    }

    #[test]
    fn a_batch_takes_on_its_slots_later_calls_in_order_up_to_another_header() {
        let mut batch = vec![queued(7, 1, 1)];
        let mut queue = vec![
            queued(9, 1, 2),
            queued(7, 1, 3),
            queued(7, 1, 4),
            queued(7, 2, 5),
            queued(7, 1, 6),
            queued(9, 1, 7),
        ];
        top_up(&mut queue, &mut batch);
        assert_eq!(order(&batch), [1, 3, 4]);
        // The call with another header and every later call of the slot
        // stay, in order, as do the other slots' calls.
        assert_eq!(order(&queue), [2, 5, 6, 7]);
        // A batch is never topped up past its bound.
        let mut full: Vec<Queued> = (0..MAX_BATCH as i64 - 1).map(|n| queued(1, 1, n)).collect();
        let mut queue: Vec<Queued> = (100..103).map(|n| queued(1, 1, n)).collect();
        top_up(&mut queue, &mut full);
        assert_eq!(full.len(), MAX_BATCH);
        assert_eq!(order(&queue), [101, 102]);
        top_up(&mut queue, &mut full);
        assert_eq!(order(&queue), [101, 102]);
    }

    #[test]
    fn a_batch_keeps_to_the_header_of_its_first_call() {
        // A request made after the epoch was raised is fenced by the new
        // epoch, so it cannot ride with one that carries the old; and
        // calls for one slot keep their order, so a call with another
        // header ends its slot's batch (other slots' calls still go).
        let mut queue = vec![
            queued(1, 1, 1),
            queued(1, 1, 2),
            queued(1, 2, 3),
            queued(1, 1, 4),
            queued(5, 1, 5),
        ];
        assert_eq!(
            orders(&take_batches(&mut queue, &[])),
            [vec![1, 2], vec![5]]
        );
        assert_eq!(order(&queue), [3, 4]);
        assert_eq!(orders(&take_batches(&mut queue, &[])), [vec![3]]);
        assert_eq!(orders(&take_batches(&mut queue, &[])), [vec![4]]);
        assert!(queue.is_empty());
    }
}

#[cfg(test)]
mod answer_tests {
    use super::*;
    use std::time::Duration;

    /// A caller waiting on a thread of its own, on a single-threaded runtime
    /// (a gRPC serving thread), until `stop`.
    fn serving_thread() -> (Caller, oneshot::Sender<()>, std::thread::JoinHandle<()>) {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                ready_tx.send(Caller::here()).unwrap();
                let _ = stop_rx.await;
            });
        });
        (ready_rx.recv().unwrap(), stop_tx, thread)
    }

    fn waiting(caller: &Caller) -> ((oneshot::Sender<Reply>, Caller), oneshot::Receiver<Reply>) {
        let (tx, rx) = oneshot::channel();
        ((tx, caller.clone()), rx)
    }

    #[test]
    fn each_caller_hears_its_own_answer_here_or_on_its_thread() {
        let (away, stop, thread) = serving_thread();
        let here = Caller::here();
        assert!(here.runtime.is_none(), "a plain test thread has no runtime");
        let (a, rx_a) = waiting(&here);
        let (b, rx_b) = waiting(&away);
        let (c, rx_c) = waiting(&away);
        answer(
            vec![a, b, c],
            vec![Ok(vec![1]), Ok(vec![2]), Err(CallError::Reply("x".into()))],
        );
        let wait = |rx: oneshot::Receiver<Reply>| {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            let mut rx = rx;
            loop {
                match rx.try_recv() {
                    Ok(r) => return r,
                    Err(oneshot::error::TryRecvError::Empty)
                        if std::time::Instant::now() < deadline =>
                    {
                        std::thread::sleep(Duration::from_millis(1))
                    }
                    Err(e) => panic!("no answer: {e}"),
                }
            }
        };
        assert_eq!(wait(rx_a).ok(), Some(vec![1]));
        assert_eq!(wait(rx_b).ok(), Some(vec![2]));
        assert!(wait(rx_c).is_err(), "a failed batch fails each request");
        stop.send(()).unwrap();
        thread.join().unwrap();
    }

    /// A runtime that ended before its hand-off ran drops the task, and the
    /// answers are given all the same (a call moved to the engine's runtime
    /// when its client went away still waits for them).
    #[test]
    fn answers_for_a_thread_whose_runtime_ended_are_still_given() {
        let (away, stop, thread) = serving_thread();
        stop.send(()).unwrap();
        thread.join().unwrap();
        let (a, rx) = waiting(&away);
        answer(vec![a], vec![Ok(vec![7])]);
        let mut rx = rx;
        assert_eq!(rx.try_recv().ok().and_then(Result::ok), Some(vec![7]));
    }
}
