//! A fault-injection TCP proxy for tests: put one between a replica and
//! Redis and switch it at run time. Modes apply to new and existing
//! connections alike (checked per chunk), except `Refuse`, which only turns
//! away new connections.
#![allow(dead_code)]

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

/// Drop the reply to the next request whose bytes contain a pattern.
#[derive(Default)]
struct ReplyTrap {
    pattern: Option<Vec<u8>>,
    armed: bool,
    dropped: u64,
}

pub struct FaultProxy {
    pub port: u16,
    mode: Arc<Mutex<Mode>>,
    trap: Arc<Mutex<ReplyTrap>>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl FaultProxy {
    pub async fn start(target_port: u16) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().expect("addr").port();
        let mode = Arc::new(Mutex::new(Mode::Pass));
        let trap = Arc::new(Mutex::new(ReplyTrap::default()));
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::new(Mutex::new(Vec::new()));
        let accept = {
            let mode = mode.clone();
            let trap = trap.clone();
            let conns = conns.clone();
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    if *mode.lock() == Mode::Refuse {
                        drop(client);
                        continue;
                    }
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
                        let up = pump(cr, sw, mode.clone(), trap.clone(), true);
                        let down = pump(sr, cw, mode, trap, false);
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
        }
    }

    /// From now on, drop Redis's reply to each request containing
    /// `pattern` and close that connection (Redis still executes the
    /// request): a lost reply at an exact step.
    pub fn drop_replies_to(&self, pattern: &str) {
        let mut t = self.trap.lock();
        t.pattern = Some(pattern.as_bytes().to_vec());
        t.armed = false;
    }

    /// How many replies the trap dropped.
    pub fn dropped_replies(&self) -> u64 {
        self.trap.lock().dropped
    }

    pub fn clear_trap(&self) {
        let mut t = self.trap.lock();
        t.pattern = None;
        t.armed = false;
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

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mode: Arc<Mutex<Mode>>,
    trap: Arc<Mutex<ReplyTrap>>,
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
                        t.armed = true;
                    }
                }
            } else if t.armed {
                // A reply lost on TCP means the connection is gone: drop it
                // and close, so the client cannot pair later replies with
                // the wrong requests.
                t.armed = false;
                t.dropped += 1;
                return;
            }
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
