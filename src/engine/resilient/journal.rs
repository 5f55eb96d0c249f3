//! The optional outage journal (`journal_dir`): lease grants that Redis has
//! not seen yet are written to a file per replica, so they survive a crash
//! or restart of the replica and are replayed when it starts again.
//!
//! The file holds a snapshot (not a log): for each (key, window) with
//! unreplayed local usage, the cumulative count. Replay sets Redis fields to
//! these values, so replaying a snapshot twice, or one a little older than
//! the last replay, never counts anything twice. It is written atomically
//! (temporary file, fsync, rename) whenever the snapshot changes.
//!
//! Without a journal, a replica that crashes during an outage loses its
//! unreplayed usage: at most its lease (its share of the limit) per key and
//! live window; the limit still held while it granted them.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::ledger::{window_live, Ledger};
use crate::key::CounterKey;
use crate::limit::{Algorithm, LimitSpec, Unit};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalEntry {
    pub key: String,
    pub requests_per_unit: u32,
    pub unit: String,
    pub algorithm: String,
    pub burst: u32,
    pub window: u64,
    /// This run's cumulative local grants in the window.
    pub local_own: i64,
    /// The part of them Redis has not confirmed. Absent in journals of
    /// earlier versions, which are read as all unconfirmed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unreplayed: Option<i64>,
}

impl JournalEntry {
    pub fn new(key: &CounterKey, spec: &LimitSpec, window: u64, local_own: i64) -> Self {
        JournalEntry {
            key: key.as_str().to_owned(),
            requests_per_unit: spec.requests_per_unit,
            unit: spec.unit.as_str().to_owned(),
            algorithm: spec.algorithm.as_str().to_owned(),
            burst: spec.burst,
            window,
            local_own,
            unreplayed: Some(local_own),
        }
    }

    /// With `replayed` of `local_own` already confirmed by Redis.
    pub fn with_replayed(mut self, replayed: i64) -> Self {
        self.unreplayed = Some(self.local_own - replayed);
        self
    }

    /// Back to ledger terms; None for an entry this version cannot read.
    pub fn decode(&self) -> Option<(CounterKey, LimitSpec, u64, i64)> {
        let spec = LimitSpec {
            requests_per_unit: self.requests_per_unit,
            unit: self.unit.parse::<Unit>().ok()?,
            algorithm: self.algorithm.parse::<Algorithm>().ok()?,
            burst: self.burst,
        };
        Some((
            CounterKey::from_raw(&self.key),
            spec,
            self.window,
            self.local_own,
        ))
    }
}

#[derive(Clone, Debug)]
pub struct Journal {
    path: PathBuf,
}

impl Journal {
    /// The journal of `replica_id` under `dir` (created if needed).
    pub fn open(dir: &Path, replica_id: &str) -> std::io::Result<Journal> {
        std::fs::create_dir_all(dir)?;
        let name: String = replica_id
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        Ok(Journal {
            path: dir.join(format!("{name}.journal.json")),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The last snapshot; empty when there is none.
    pub fn load(&self) -> Result<Vec<JournalEntry>, String> {
        match std::fs::read(&self.path) {
            Ok(bytes) => {
                serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", self.path.display()))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(format!("{}: {e}", self.path.display())),
        }
    }

    /// Replaces the snapshot atomically.
    pub fn store(&self, entries: &[JournalEntry]) -> std::io::Result<()> {
        let tmp = self.path.with_extension("json.tmp");
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&serde_json::to_vec(entries).map_err(std::io::Error::other)?)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &self.path)
    }
}

/// One restored window of lease grants.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Restored {
    pub key: CounterKey,
    pub spec: LimitSpec,
    pub window: u64,
    /// What the previous run granted locally in the window (its lease used).
    pub local_own: i64,
}

/// Restores a previous run's unreplayed lease grants into the ledger (live
/// windows only), where they are replayed like any others, and returns them
/// so that the leases can start from them too.
pub fn restore(journal: &Journal, ledger: &Ledger, now_ms: u64, margin_ms: u64) -> Vec<Restored> {
    let mut restored = Vec::new();
    match journal.load() {
        Ok(entries) => {
            for e in &entries {
                match e.decode() {
                    Some((key, spec, window, local_own)) => {
                        if window_live(&spec, window, now_ms, margin_ms) {
                            // Only the unconfirmed part is this run's to
                            // replay: replay adds it to what the previous
                            // run's replays left in Redis.
                            let unreplayed = e.unreplayed.unwrap_or(local_own);
                            ledger.restore_local(&key, &spec, window, now_ms, unreplayed);
                            restored.push(Restored {
                                key,
                                spec,
                                window,
                                local_own,
                            });
                        }
                    }
                    None => {
                        tracing::error!(key = %e.key, "journal entry not understood; its usage is dropped")
                    }
                }
            }
            if !entries.is_empty() {
                tracing::info!(path = %journal.path().display(), restored = restored.len(), "restored unreplayed lease grants from the journal");
            }
        }
        Err(e) => tracing::error!(error = %e, "cannot read the journal; starting without it"),
    }
    restored
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_round_trip_and_replace_atomically() {
        let dir = tempfile::tempdir().expect("tempdir");
        let j = Journal::open(dir.path(), "host:8081").expect("open");
        assert!(j.path().ends_with("host_8081.journal.json"));
        assert_eq!(j.load(), Ok(Vec::new()));
        let spec = LimitSpec::fixed(100, Unit::Minute);
        let key = CounterKey::new("d", [("k", "v|x")], &spec);
        let e = JournalEntry::new(&key, &spec, 42, 7);
        j.store(std::slice::from_ref(&e)).expect("store");
        let loaded = j.load().expect("load");
        assert_eq!(loaded, vec![e.clone()]);
        assert_eq!(loaded[0].decode(), Some((key, spec, 42, 7)));
        // The confirmed part is kept apart; an entry of an earlier version
        // (no `unreplayed`) reads as all unconfirmed.
        assert_eq!(e.clone().with_replayed(3).unreplayed, Some(4));
        let old: JournalEntry = serde_json::from_str(
            r#"{"key":"d|k=v#60:fw","requests_per_unit":100,"unit":"minute","algorithm":"fixed_window","burst":100,"window":42,"local_own":7}"#,
        )
        .expect("old entry");
        assert_eq!((old.local_own, old.unreplayed), (7, None));
        j.store(&[]).expect("store empty");
        assert_eq!(j.load(), Ok(Vec::new()));
    }
}
