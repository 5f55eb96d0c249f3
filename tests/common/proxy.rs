//! A fault-injection TCP proxy for tests: put one between a replica and
//! Redis and switch it at run time. Modes apply to new and existing
//! connections alike (checked per chunk), except `Refuse`, which only turns
//! away new connections. [`FaultProxy::stall_existing`] leaves the
//! connections open so far swallowing bytes for good, whatever the mode:
//! a path that healed for new connections only.
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Forward both ways.
    Pass,
    /// Close new connections at once (existing ones keep passing).
    Refuse,
    /// Accept and read, never forward and never answer.
    Blackhole,
    /// Forward both ways after a delay per chunk.
    Latency(Duration),
    /// Forward requests to Redis but drop its replies: Redis applies the
    /// call, the client never hears back.
    DropReplies,
}

/// Drop the reply to the next request whose bytes contain a pattern (or,
/// with `swallow`, that request itself).
#[derive(Default)]
struct ReplyTrap {
    pattern: Option<Vec<u8>>,
    /// The connection that carried the request: its next reply is the one
    /// dropped. Armed for any connection, a reply on another pooled
    /// connection (a heartbeat's) could be dropped in its place, and the
    /// trapped reply pass (seen: the test's replay confirmed).
    armed: Option<u64>,
    swallow: bool,
    dropped: u64,
}

pub struct FaultProxy {
    pub port: u16,
    mode: Arc<Mutex<Mode>>,
    trap: Arc<Mutex<ReplyTrap>>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
    /// Connections numbered below this swallow everything.
    stalled_below: Arc<AtomicU64>,
    accepted: Arc<AtomicU64>,
    /// Close new connections at once, whatever the mode.
    refuse_new: Arc<AtomicBool>,
}

impl FaultProxy {
    pub async fn start(target_port: u16) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().expect("addr").port();
        let mode = Arc::new(Mutex::new(Mode::Pass));
        let trap = Arc::new(Mutex::new(ReplyTrap::default()));
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::new(Mutex::new(Vec::new()));
        let stalled_below = Arc::new(AtomicU64::new(0));
        let accepted = Arc::new(AtomicU64::new(0));
        let refuse_new = Arc::new(AtomicBool::new(false));
        let accept = {
            let refuse_new = refuse_new.clone();
            let mode = mode.clone();
            let trap = trap.clone();
            let conns = conns.clone();
            let stalled_below = stalled_below.clone();
            let accepted = accepted.clone();
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    if *mode.lock() == Mode::Refuse || refuse_new.load(Ordering::SeqCst) {
                        drop(client);
                        continue;
                    }
                    let number = accepted.fetch_add(1, Ordering::SeqCst);
                    let stall = Stall {
                        number,
                        below: stalled_below.clone(),
                    };
                    let mode = mode.clone();
                    let trap = trap.clone();
                    let task = tokio::spawn(async move {
                        let Ok(server) = TcpStream::connect(("127.0.0.1", target_port)).await
                        else {
                            return;
                        };
                        let _ = client.set_nodelay(true);
                        let _ = server.set_nodelay(true);
                        let (cr, cw) = client.into_split();
                        let (sr, sw) = server.into_split();
                        let up = pump(cr, sw, mode.clone(), trap.clone(), stall.clone(), true);
                        let down = pump(sr, cw, mode, trap, stall, false);
                        tokio::select! {
                            _ = up => {}
                            _ = down => {}
                        }
                    });
                    conns.lock().push(task);
                }
            })
        };
        FaultProxy {
            port,
            mode,
            trap,
            conns,
            accept,
            stalled_below,
            accepted,
            refuse_new,
        }
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::SeqCst)
    }

    /// From now on close new connections at once (existing ones follow the
    /// mode), or stop doing so.
    pub fn refuse_new(&self, refuse: bool) {
        self.refuse_new.store(refuse, Ordering::SeqCst);
    }

    /// Cuts every connection but the first one accepted.
    pub fn cut_all_but_first(&self) {
        for task in self.conns.lock().iter().skip(1) {
            task.abort();
        }
    }

    /// Every connection open now swallows whatever it gets from here on
    /// (never forwarded, never closed); connections accepted later follow
    /// the mode.
    pub fn stall_existing(&self) {
        self.stalled_below
            .store(self.accepted.load(Ordering::SeqCst), Ordering::SeqCst);
    }

    /// From now on, drop Redis's reply to each request containing
    /// `pattern` and close that connection (Redis still executes the
    /// request): a lost reply at an exact step.
    pub fn drop_replies_to(&self, pattern: &str) {
        let mut t = self.trap.lock();
        t.pattern = Some(pattern.as_bytes().to_vec());
        t.armed = None;
        t.swallow = false;
    }

    /// Once: swallow the next chunk of requests containing `pattern` and
    /// keep the connection open, as a broken path between two TCP stacks
    /// may (Redis never sees those requests; their replies never come).
    pub fn swallow_next_request_to(&self, pattern: &str) {
        let mut t = self.trap.lock();
        t.pattern = Some(pattern.as_bytes().to_vec());
        t.armed = None;
        t.swallow = true;
    }

    /// How many replies the trap dropped.
    pub fn dropped_replies(&self) -> u64 {
        self.trap.lock().dropped
    }

    pub fn clear_trap(&self) {
        let mut t = self.trap.lock();
        t.pattern = None;
        t.armed = None;
        t.swallow = false;
    }

    pub fn set(&self, mode: Mode) {
        *self.mode.lock() = mode;
    }

    pub fn mode(&self) -> Mode {
        *self.mode.lock()
    }

    /// Cuts every existing connection.
    pub fn cut(&self) {
        for task in self.conns.lock().drain(..) {
            task.abort();
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// A connection's number and the shared stall mark.
#[derive(Clone)]
struct Stall {
    number: u64,
    below: Arc<AtomicU64>,
}

impl Stall {
    fn stalled(&self) -> bool {
        self.number < self.below.load(Ordering::SeqCst)
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mode: Arc<Mutex<Mode>>,
    trap: Arc<Mutex<ReplyTrap>>,
    stall: Stall,
    upstream: bool,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        {
            let mut t = trap.lock();
            if upstream {
                if let Some(p) = &t.pattern {
                    if buf[..n].windows(p.len()).any(|w| w == p.as_slice()) {
                        if t.swallow {
                            t.pattern = None;
                            t.dropped += 1;
                            continue;
                        }
                        t.armed = Some(stall.number);
                    }
                }
            } else if t.armed == Some(stall.number) {
                // A reply lost on TCP means the connection is gone: drop it
                // and close, so the client cannot pair later replies with
                // the wrong requests.
                t.armed = None;
                t.dropped += 1;
                return;
            }
        }
        if stall.stalled() {
            continue;
        }
        let current = *mode.lock();
        match current {
            Mode::Blackhole => continue,
            Mode::DropReplies if !upstream => continue,
            Mode::Latency(d) => tokio::time::sleep(d).await,
            _ => {}
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
