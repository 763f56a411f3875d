//! `--state-dir`: the collector's state (registrations, index, last sequence number per
//! worker) in one JSON file, `state.json`.
//!
//! Writes are atomic: the file is written to `state.json.tmp`, synced and renamed over the old
//! one, so a crash leaves either the old or the new snapshot. A snapshot that does not parse is
//! reported, moved aside to `state.json.corrupt` for inspection, and ignored: the collector
//! starts empty and the engines' replay buffers refill what they still hold.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::hub::StateFile;

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
/// An unreadable or corrupt file (moved aside first when corrupt).
pub fn load(dir: &Path) -> Result<Option<StateFile>, StateError> {
    let path = dir.join(FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(StateError::Io { path, source }),
    };
    match serde_json::from_slice::<StateFile>(&bytes) {
        Ok(s) => Ok(Some(s)),
        Err(source) => {
            let _ = std::fs::rename(&path, dir.join(format!("{FILE}.corrupt")));
            Err(StateError::Corrupt { path, source })
        }
    }
}

/// Writes `state` atomically into `dir` (created if missing). Returns the bytes written.
///
/// # Errors
/// Any I/O failure; the previous snapshot is then left as it was.
pub fn save(dir: &Path, state: &StateFile) -> Result<usize, StateError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| StateError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tmp = dir.join(format!("{FILE}.tmp"));
    let path = dir.join(FILE);
    let bytes = serde_json::to_vec(state).map_err(|e| StateError::Io {
        path: tmp.clone(),
        source: e.into(),
    })?;
    let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(&bytes).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    drop(f);
    std::fs::rename(&tmp, &path).map_err(io(&path))?;
    Ok(bytes.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute::index::{Index, IndexConfig};

    #[test]
    fn corrupt_snapshot_is_an_error_and_moved_aside() {
        let dir = tempfile::tempdir().unwrap();
        assert!(load(dir.path()).unwrap().is_none());
        std::fs::write(dir.path().join(FILE), b"{not json").unwrap();
        assert!(matches!(load(dir.path()), Err(StateError::Corrupt { .. })));
        assert!(dir.path().join("state.json.corrupt").exists());
        assert!(load(dir.path()).unwrap().is_none());
    }

    #[test]
    fn save_then_load_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateFile {
            version: 1,
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
