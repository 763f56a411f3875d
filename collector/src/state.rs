//! `--state-dir`: the collector's state (registrations, index, last sequence number per
//! worker) in one JSON file, `state.json`.
//!
//! Writes are atomic: the file is written to `state.json.tmp`, synced and renamed over the old
//! one, so a crash leaves either the old or the new snapshot. A snapshot that does not parse,
//! or that the hub refuses as inconsistent, is moved aside by [`move_aside`] under a name no
//! earlier one has (`state.json.rejected-<unix secs>-<n>`), for inspection, and the collector
//! starts empty: the engines' replay buffers refill what they still hold.

use std::path::{Path, PathBuf};

use std::io::Write;

use kvroute::index::WorkerDump;

use crate::hub::{SavedWorker, StateFile};

pub const FILE: &str = "state.json";

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a collector state snapshot: {source}")]
    Corrupt {
        path: PathBuf,
        source: serde_json::Error,
    },
}

/// Loads the snapshot in `dir`, if there is one.
///
/// # Errors
/// An unreadable or corrupt file (left in place: see [`move_aside`]).
pub fn load(dir: &Path) -> Result<Option<StateFile>, StateError> {
    let path = dir.join(FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(StateError::Io { path, source }),
    };
    serde_json::from_slice::<StateFile>(&bytes)
        .map(Some)
        .map_err(|source| StateError::Corrupt { path, source })
}

/// Moves the snapshot in `dir` aside under a name no earlier one has, and returns that name.
/// A hard link claims the name (it fails on an existing file, unlike a rename), so an earlier
/// rejected file is never overwritten, even by a concurrent start.
///
/// # Errors
/// The file could not be linked or removed; it is then left where it is.
pub fn move_aside(dir: &Path) -> Result<PathBuf, StateError> {
    let path = dir.join(FILE);
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    for n in 0..10_000u32 {
        let aside = dir.join(format!("{FILE}.rejected-{secs}-{n}"));
        match std::fs::hard_link(&path, &aside) {
            Ok(()) => {
                std::fs::remove_file(&path).map_err(|source| StateError::Io {
                    path: path.clone(),
                    source,
                })?;
                return Ok(aside);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(source) => return Err(StateError::Io { path, source }),
        }
    }
    Err(StateError::Io {
        path,
        source: std::io::Error::other("no free name to move it aside to"),
    })
}

/// Writes `state` atomically into `dir` (created if missing). Returns the bytes written.
///
/// # Errors
/// Any I/O failure; the previous snapshot is then left as it was.
pub fn save(dir: &Path, state: &StateFile) -> Result<usize, StateError> {
    write_atomically(dir, |w| serde_json::to_writer(w, state).map_err(Into::into))
}

/// Writes `FILE` in `dir` through `body`: to a temporary file, synced, then renamed over.
fn write_atomically(
    dir: &Path,
    body: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<usize, StateError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| StateError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tmp = dir.join(format!("{FILE}.tmp"));
    let path = dir.join(FILE);
    // Streamed to the file: the whole index as one JSON buffer every snapshot interval was a
    // transient allocation as large as the file, which the allocator keeps as resident memory.
    let f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 16, f);
    body(&mut w).map_err(io(&tmp))?;
    let f = w.into_inner().map_err(|e| StateError::Io {
        path: tmp.clone(),
        source: e.into_error(),
    })?;
    f.sync_all().map_err(io(&tmp))?;
    let written = f.metadata().map_err(io(&tmp))?.len();
    drop(f);
    std::fs::rename(&tmp, &path).map_err(io(&path))?;
    Ok(usize::try_from(written).unwrap_or(usize::MAX))
}

/// Writes the state atomically into `dir` like [`save`], taking the index's blocks one worker
/// at a time from `blocks` (for each registration of `head`, whose own `index.workers` is not
/// written): the caller never holds a copy of the whole index, which for 300k blocks is
/// ~17 MB live for as long as the file takes to write (soak 6 Dec: index replicas at 53 or
/// 71 MB depending on whether a save was running). The bytes are those [`save`] writes for
/// the same state.
///
/// # Errors
/// Any I/O failure; the previous snapshot is then left as it was.
pub fn save_streamed(
    dir: &Path,
    head: &StateFile,
    mut blocks: impl FnMut(&SavedWorker) -> Option<WorkerDump>,
) -> Result<usize, StateError> {
    write_atomically(dir, |w| {
        // The field order of `StateFile` and `IndexDump`, as serde writes them.
        w.write_all(b"{\"version\":")?;
        serde_json::to_writer(&mut *w, &head.version)?;
        w.write_all(b",\"workers\":")?;
        serde_json::to_writer(&mut *w, &head.workers)?;
        w.write_all(b",\"aliases\":")?;
        serde_json::to_writer(&mut *w, &head.aliases)?;
        w.write_all(b",\"index\":{\"version\":")?;
        serde_json::to_writer(&mut *w, &head.index.version)?;
        w.write_all(b",\"workers\":[")?;
        let mut first = true;
        for saved in &head.workers {
            let Some(dump) = blocks(saved) else { continue };
            if !first {
                w.write_all(b",")?;
            }
            first = false;
            serde_json::to_writer(&mut *w, &dump)?;
        }
        w.write_all(b"]}}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute::index::{Index, IndexConfig};

    #[test]
    fn corrupt_snapshots_are_errors_and_move_aside_under_unique_names() {
        let dir = tempfile::tempdir().unwrap();
        assert!(load(dir.path()).unwrap().is_none());
        let mut asides = Vec::new();
        for body in [&b"{not json"[..], b"second"] {
            std::fs::write(dir.path().join(FILE), body).unwrap();
            assert!(matches!(load(dir.path()), Err(StateError::Corrupt { .. })));
            let aside = move_aside(dir.path()).unwrap();
            assert_eq!(std::fs::read(&aside).unwrap(), body, "moved whole");
            asides.push(aside);
            assert!(load(dir.path()).unwrap().is_none());
        }
        assert_ne!(
            asides[0], asides[1],
            "the second never overwrites the first"
        );
        assert!(asides[0].exists());
        assert!(move_aside(dir.path()).is_err(), "nothing left to move");
    }

    #[test]
    fn streamed_saves_write_what_whole_saves_write() {
        use kvroute::api::RegisterRequest;
        use kvroute::index::NodeDump;
        let reg: RegisterRequest = serde_json::from_value(serde_json::json!({
            "instance_id": "a", "endpoint": "tcp://127.0.0.1:1", "model_name": "m",
            "block_size": 4, "tenant_id": "t"
        }))
        .unwrap();
        let saved = |id| crate::hub::SavedWorker {
            id,
            reg: reg.clone(),
            source: None,
            last_seq: Some(7),
            last_hash: None,
        };
        let dump = |worker, engine| WorkerDump {
            worker,
            tenant: "t".into(),
            model: "m".into(),
            block_size: 4,
            nodes: vec![NodeDump {
                engine,
                parent: None,
                key: engine * 3,
                scope: 1,
                seed: 2,
                tiers: 1,
            }],
        };
        let mut whole = StateFile {
            version: crate::hub::STATE_VERSION,
            workers: vec![saved(0), saved(1), saved(2)],
            aliases: vec![],
            index: Index::new(IndexConfig::default()).export(),
        };
        // Worker 1 left between the head and its blocks: no entry, as in a whole export.
        whole.index.workers = vec![dump(0, 10), dump(2, 30)];
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        save(a.path(), &whole).unwrap();
        let mut head = whole.clone();
        head.index.workers.clear();
        save_streamed(b.path(), &head, |w| {
            whole
                .index
                .workers
                .iter()
                .find(|d| d.worker == w.id)
                .cloned()
        })
        .unwrap();
        let read = |d: &tempfile::TempDir| std::fs::read(d.path().join(FILE)).unwrap();
        assert_eq!(
            String::from_utf8(read(&b)).unwrap(),
            String::from_utf8(read(&a)).unwrap()
        );
        assert_eq!(load(b.path()).unwrap().unwrap().index, whole.index);
    }

    #[test]
    fn save_then_load_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateFile {
            version: crate::hub::STATE_VERSION,
            workers: vec![],
            aliases: vec![],
            index: Index::new(IndexConfig::default()).export(),
        };
        save(dir.path(), &state).unwrap();
        let back = load(dir.path()).unwrap().unwrap();
        assert_eq!(back.version, 1);
        assert!(!dir.path().join("state.json.tmp").exists());
    }
}
