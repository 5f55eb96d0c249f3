//! The journal writer: a supervised task of its own that snapshots the
//! unreplayed lease grants into the journal within [`JOURNAL_EVERY_MS`] of
//! a change, whatever the recovery loop is waiting on. It used to be a step
//! of that loop, which on a silent Redis waits out a probe (a PING and a
//! heartbeat) and then the probe interval: lease grants made meanwhile
//! reached the file half a second or more later, and a kill -9 in that gap
//! lost them from the journal.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::journal::JournalEntry;
use super::recovery::each_shard;
use super::ResilientEngine;

/// How often the writer looks at the ledger's change count; a snapshot is
/// taken only when it moved.
pub const JOURNAL_EVERY_MS: u64 = 100;
/// Journal rewrites are paced to at most this many bytes per second on
/// average: a large snapshot is rewritten less often than every 100 ms.
const JOURNAL_BYTES_PER_SEC: u64 = 8 * 1024 * 1024;

/// What the writer remembers between rounds.
#[derive(Debug, Default)]
pub struct JournalWriter {
    last_ms: u64,
    /// Milliseconds the last write costs at the paced rate.
    interval_ms: u64,
    /// The snapshot last written, so an unchanged one is not rewritten.
    written: Option<Vec<JournalEntry>>,
    /// The ledger's change count the journal was last taken at.
    taken_at: u64,
}

impl ResilientEngine {
    /// The writer's loop until `stop`, a supervised task of its own beside
    /// the recovery loop (only with a journal). The last write is
    /// [`Self::finish`]'s, after the final replay.
    pub async fn run_journal(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        loop {
            self.journal_round().await;
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(JOURNAL_EVERY_MS)) => {}
                _ = stop.wait_for(|s| *s) => break,
            }
        }
    }

    /// One round: a write when the ledger changed since the last one and
    /// the paced interval has passed.
    pub async fn journal_round(&self) {
        if self.journal.is_none() {
            return;
        }
        let mut w = self.journal_writer.lock().await;
        let now = self.clock.now_ms();
        // Taken only when the ledger changed since (a snapshot walks every
        // entry): a lease grant, a replay, and once a second (the sweep).
        let changes = self.ledger.changes();
        if changes == w.taken_at || now < w.last_ms + w.interval_ms.max(JOURNAL_EVERY_MS) {
            return;
        }
        w.last_ms = now;
        match self.write_journal(&mut w.written).await {
            Ok(Some(bytes)) => {
                w.taken_at = changes;
                w.interval_ms = bytes as u64 * 1_000 / JOURNAL_BYTES_PER_SEC;
            }
            Ok(None) => w.taken_at = changes,
            // Tried again at the next round.
            Err(()) => {}
        }
    }

    /// Writes the journal snapshot when it changed since the last write:
    /// the bytes written, `None` when it had not changed, an error (logged
    /// here) when the write failed and is to be tried again.
    pub(super) async fn write_journal(
        &self,
        last: &mut Option<Vec<JournalEntry>>,
    ) -> Result<Option<usize>, ()> {
        let Some(journal) = self.journal.as_ref() else {
            return Ok(None);
        };
        let mut unreplayed = Vec::new();
        each_shard(self.ledger.shard_count(), |i| {
            self.ledger.unreplayed_snapshot_shard(i, &mut unreplayed);
        })
        .await;
        let snapshot: Vec<_> = unreplayed
            .iter()
            .map(|(k, s, w, n, replayed)| JournalEntry::new(k, s, *w, *n).with_replayed(*replayed))
            .collect();
        if last.as_ref() == Some(&snapshot) {
            return Ok(None);
        }
        let journal = journal.clone();
        // The snapshot goes to the blocking task and comes back to be kept
        // as the last one written, not copied (it can be megabytes).
        let result = tokio::task::spawn_blocking(move || {
            let stored = journal.store(&snapshot);
            (stored, snapshot)
        })
        .await;
        match result {
            Ok((Ok(bytes), snapshot)) => {
                *last = Some(snapshot);
                Ok(Some(bytes))
            }
            Ok((Err(e), _)) => {
                tracing::error!(error = %e, "cannot write the journal");
                Err(())
            }
            Err(e) => {
                tracing::error!(error = %e, "journal task failed");
                Err(())
            }
        }
    }

    /// The last write, after the final replay.
    pub(super) async fn last_journal_write(&self) {
        let mut w = self.journal_writer.lock().await;
        // Its errors are logged there; nothing is left to retry with.
        let _ = self.write_journal(&mut w.written).await;
    }
}
