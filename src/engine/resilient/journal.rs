//! The optional outage journal (`journal_dir`): lease grants that Redis has
//! not seen yet are written to a file per replica, so they survive a crash
//! or restart of the replica and are replayed when it starts again.
//!
//! The file holds a snapshot (not a log): for each (key, window) with
//! unreplayed local usage, the cumulative count. Replay sets Redis fields to
//! these values, so replaying a snapshot twice, or one a little older than
//! the last replay, never counts anything twice. It is written atomically
//! (temporary file, fsync, rename, fsync of the directory so the rename
//! itself survives a power loss) when the snapshot changes, at a rate
//! bounded by its size (the journal writer's paced interval). The
//! file is readable by its owner only (0600): it holds raw descriptor
//! values. Its name is the replica id percent-escaped, so two ids never
//! share a file.
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
    dir: PathBuf,
    path: PathBuf,
}

/// A replica id as a file name: ASCII letters, digits, `-`, `.` and `_`
/// as they are, every other byte `%XX`, so distinct ids give distinct
/// names (and `..` cannot escape the directory: `.` alone is kept, but a
/// name always ends in `.journal.json`).
fn file_name(replica_id: &str) -> String {
    let mut out = String::with_capacity(replica_id.len());
    for b in replica_id.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The name earlier versions used (every other character `_`).
fn legacy_file_name(replica_id: &str) -> String {
    replica_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

impl Journal {
    /// The journal of `replica_id` under `dir` (created if needed).
    pub fn open(dir: &Path, replica_id: &str) -> std::io::Result<Journal> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join(format!("{}.journal.json", file_name(replica_id)));
        let legacy = dir.join(format!("{}.journal.json", legacy_file_name(replica_id)));
        if legacy != path && !path.exists() && legacy.exists() {
            // The old naming mapped `a:b` and `a_b` to one file, so whose
            // it is cannot be told: replaying another replica's grants as
            // this one's would count them twice.
            tracing::warn!(
                legacy = %legacy.display(),
                journal = %path.display(),
                "a journal under this replica's old file name is not read (names were not unique); rename it if it is this replica's"
            );
        }
        Ok(Journal {
            dir: dir.to_owned(),
            path,
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

    /// Replaces the snapshot atomically; returns the bytes written.
    pub fn store(&self, entries: &[JournalEntry]) -> std::io::Result<usize> {
        use std::os::unix::fs::OpenOptionsExt as _;
        let tmp = self.path.with_extension("json.tmp");
        let bytes = serde_json::to_vec(entries).map_err(std::io::Error::other)?;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &self.path)?;
        std::fs::File::open(&self.dir)?.sync_all()?;
        Ok(bytes.len())
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
        assert!(j.path().ends_with("host%3A8081.journal.json"));
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

    #[test]
    fn files_are_private_and_names_never_collide() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().expect("tempdir");
        let ids = ["a:b", "a_b", "a%3Ab", "a/b", "../x", "é"];
        let paths: std::collections::HashSet<PathBuf> = ids
            .iter()
            .map(|id| {
                Journal::open(dir.path(), id)
                    .expect("open")
                    .path()
                    .to_owned()
            })
            .collect();
        assert_eq!(paths.len(), ids.len(), "{paths:?}");
        for p in &paths {
            assert_eq!(
                p.parent(),
                Some(dir.path()),
                "stays in the directory: {p:?}"
            );
        }
        let j = Journal::open(dir.path(), "a:b").expect("open");
        let spec = LimitSpec::fixed(100, Unit::Minute);
        let key = CounterKey::new("d", [("api_key", "secret")], &spec);
        let written = j
            .store(&[JournalEntry::new(&key, &spec, 1, 2)])
            .expect("store");
        assert!(written > 0);
        let mode = std::fs::metadata(j.path())
            .expect("meta")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
    }
}
