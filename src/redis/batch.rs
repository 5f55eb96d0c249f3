//! Coalescing: decision calls bound for one connection that arrive while
//! a call is in flight on it are sent together, as one script call that
//! decides them one after the other (`decide.lua`; a lone call is a batch
//! of one), each all-or-nothing on its own. An idle connection sends a
//! call at once.
//!
//! A script call carries what its requests share (the replica's index,
//! epoch, failure episode and presumed members) once, so only calls with
//! the same header go together; on a Redis Cluster a script call must also
//! keep to one slot. A connection has at most one batch in flight per
//! slot: a slot's calls queue while its batch is out and leave together
//! when it is answered (its first queued call and the later ones with its
//! header); the others stay queued, in their order. Batches for different
//! slots are pipelined on the connection and never wait for each other, so
//! a slot that is slow (say being moved to another node) holds up only its
//! own calls.
//!
//! What stays true per request: the order of calls for one key (they share
//! a connection and its queue is first in, first out, with one batch per
//! slot in flight at a time), the epoch fence (each request carries its
//! own), and what a failure means: a batch that fails or times out fails
//! each of its requests the same way, so each is handled as if it had been
//! sent alone (possibly applied, fenced out by the next rewrite, repaired).

use std::sync::Arc;

use fred::types::Value;
use parking_lot::Mutex;
use tokio::sync::oneshot;

use super::scripts::DecideArgs;
use super::{integers, CallError, Redis};

/// Requests per batch at most (and so per script call).
pub const MAX_BATCH: usize = 32;

type Reply = Result<Vec<i64>, CallError>;

struct Queued {
    /// The Cluster slot of every key (0 on one Redis).
    slot: u16,
    call: DecideArgs,
    reply: oneshot::Sender<Reply>,
}

#[derive(Default)]
struct State {
    queue: Vec<Queued>,
    /// The slots with a batch in flight on this connection.
    busy: Vec<u16>,
}

impl State {
    /// The batches that can leave now (one per slot not in flight), their
    /// slots marked in flight.
    fn take_ready(&mut self) -> Vec<Vec<Queued>> {
        let ready = take_batches(&mut self.queue, &self.busy);
        self.busy
            .extend(ready.iter().filter_map(|b| b.first()).map(|q| q.slot));
        ready
    }
}

/// One queue per connection of the pool.
#[derive(Default)]
pub(super) struct Queues {
    conns: Vec<Mutex<State>>,
}

impl Queues {
    pub fn new(connections: usize) -> Self {
        Queues {
            conns: (0..connections.max(1))
                .map(|_| Mutex::new(State::default()))
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
        let ready = {
            let mut s = self.queues.conns[conn].lock();
            s.queue.push(Queued {
                slot: slot_of_keys,
                call,
                reply: tx,
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
    async fn run(self: Arc<Self>, conn: usize, mut batch: Vec<Queued>) {
        loop {
            let slot = batch.first().map(|q| q.slot);
            self.send_batch(conn, batch).await;
            let mut ready = {
                let mut s = self.queues.conns[conn].lock();
                s.busy.retain(|b| Some(*b) != slot);
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
        let mut keys = Vec::with_capacity(batch.iter().map(|q| q.call.keys.len()).sum());
        let mut args =
            Vec::with_capacity(7 + batch.iter().map(|q| q.call.body.len()).sum::<usize>());
        let mut replies = Vec::with_capacity(batch.len());
        let count = batch.len();
        for (i, q) in batch.into_iter().enumerate() {
            let Queued { call, reply, .. } = q;
            if i == 0 {
                args.extend(call.header);
                args.push(Value::Integer(count as i64));
            }
            keys.extend(call.keys);
            args.extend(call.body);
            replies.push(reply);
        }
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
        match result.and_then(|flat| split(&flat, replies.len())) {
            Ok(parts) => {
                for (tx, part) in replies.into_iter().zip(parts) {
                    let _ = tx.send(Ok(part));
                }
            }
            Err(e) => {
                for tx in replies {
                    let _ = tx.send(Err(e.clone()));
                }
            }
        }
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
                Some(i)
                    if ready[i].len() < MAX_BATCH && ready[i][0].call.header == q.call.header =>
                {
                    ready[i].push(q)
                }
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

/// A batch reply, `{len, reply...}` per request then the call's Redis
/// time, split into `n` replies, each with that time put after its status
/// (`{status, now_ms, items...}`).
fn split(flat: &[i64], n: usize) -> Result<Vec<Vec<i64>>, CallError> {
    let (&now, flat) = flat
        .split_last()
        .ok_or_else(|| CallError::Reply("batch reply is empty".to_owned()))?;
    let mut out = Vec::with_capacity(n);
    let mut rest = flat;
    for _ in 0..n {
        let (&len, tail) = rest
            .split_first()
            .ok_or_else(|| CallError::Reply("batch reply too short".to_owned()))?;
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        if len > tail.len() {
            return Err(CallError::Reply(format!(
                "batch reply announces {len} items, {} left",
                tail.len()
            )));
        }
        let part = &tail[..len];
        let Some((&status, items)) = part.split_first() else {
            return Err(CallError::Reply("a request's reply is empty".to_owned()));
        };
        let mut reply = Vec::with_capacity(len + 1);
        reply.push(status);
        reply.push(now);
        reply.extend_from_slice(items);
        out.push(reply);
        rest = &tail[len..];
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

    #[test]
    fn a_batch_reply_splits_per_request_or_says_why_not() {
        // Three requests (the second one fenced), then Redis's time.
        let flat = [2, 0, 8, 1, -1, 3, 1, 2, 3, 5_000];
        assert_eq!(
            split(&flat, 3).ok(),
            Some(vec![
                vec![0, 5_000, 8],
                vec![-1, 5_000],
                vec![1, 5_000, 2, 3]
            ])
        );
        assert!(split(&flat, 2).is_err(), "items left over");
        assert!(split(&flat, 4).is_err(), "too short");
        assert!(split(&[5, 1, 9], 1).is_err(), "announces more than it has");
        assert!(split(&[0, 9], 1).is_err(), "a request without a status");
        assert!(split(&[], 0).is_err(), "no time");
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
            },
            reply: oneshot::channel().0,
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
        };
        assert_eq!(orders(&state.take_ready()), [vec![1, 3]]);
        assert_eq!(state.busy, [9, 7]);
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
