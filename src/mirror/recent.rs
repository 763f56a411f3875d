//! The sync state and the fleet totals as one VM last read them, reused by the requests that
//! follow within a short window instead of read again for each.
//!
//! Both values change only when the lease holder applies a feed page or a load report is
//! answered: every `sync_interval` (25 ms by default) at most. Reading them costs two
//! shared-data reads per request (~1.4 µs each in Envoy's V8); a VM serving thousands of
//! requests a second reads them a few hundred times a second instead. What a reused value
//! costs: a page applied by another VM is seen up to the window later, as if the pull had come
//! that much later. The bucket cache is keyed by the state, so it follows unchanged.

use std::rc::Rc;

use super::fleet::{read_fleet, Fleet};
use super::keys::Keys;
use super::store::{Store, StoreError};
use super::sync::{read_state, SyncState};

/// One VM's recent reads of the sync state and the fleet totals.
#[derive(Debug, Default)]
pub struct Recent {
    /// When the state was read (host ms) and what it was.
    state: Option<(u64, SyncState)>,
    /// When the fleet totals were read (host ms) and what they were.
    fleet: Option<(u64, Rc<Fleet>)>,
}

/// Whether a value read at `at` may still be used at `now` under a `reuse_ms` window. A clock
/// that went back reads again.
fn fresh(at: u64, now: u64, reuse_ms: u64) -> bool {
    now >= at && now - at < reuse_ms
}

impl Recent {
    /// The sync state at `now`: the one read less than `reuse_ms` ago, else read from `store`.
    ///
    /// # Errors
    /// A host failure of the read (nothing is kept then).
    pub fn state<S: Store>(
        &mut self,
        store: &S,
        keys: &Keys,
        now: u64,
        reuse_ms: u64,
    ) -> Result<SyncState, StoreError> {
        if let Some((at, s)) = self.state {
            if fresh(at, now, reuse_ms) {
                return Ok(s);
            }
        }
        let (s, _) = read_state(store, keys)?;
        self.state = Some((now, s));
        Ok(s)
    }

    /// The fleet totals at `now`: the ones read less than `reuse_ms` ago, else read from
    /// `store` (empty when absent or unreadable, as [`read_fleet`]).
    pub fn fleet<S: Store>(
        &mut self,
        store: &S,
        keys: &Keys,
        now: u64,
        reuse_ms: u64,
    ) -> Rc<Fleet> {
        if let Some((at, f)) = &self.fleet {
            if fresh(*at, now, reuse_ms) {
                return f.clone();
            }
        }
        let f = Rc::new(read_fleet(store, keys));
        self.fleet = Some((now, f.clone()));
        f
    }

    /// Drops both values: the next request reads them. For the VM that has just written one
    /// of them, which knows they changed.
    pub fn forget(&mut self) {
        *self = Recent::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mirror::{update_fleet, FleetWorker, MemStore};

    fn keys() -> Keys {
        Keys::new("t")
    }

    fn write_state(store: &MemStore, keys: &Keys, cursor: u64) {
        let s = SyncState {
            has_index: true,
            cursor,
            ..SyncState::default()
        };
        store.set(keys.active(), &s.encode(), 0).unwrap();
    }

    fn write_fleet(store: &MemStore, keys: &Keys, workers: usize) {
        update_fleet(store, keys, |f| {
            f.workers = vec![FleetWorker::default(); workers];
            true
        })
        .unwrap();
    }

    #[test]
    fn a_state_is_reused_inside_the_window_and_read_again_after() {
        let (store, keys) = (MemStore::default(), keys());
        let mut r = Recent::default();
        write_state(&store, &keys, 1);
        assert_eq!(r.state(&store, &keys, 100, 2).unwrap().cursor, 1);
        write_state(&store, &keys, 2);
        // 1 ms later: the read of 100 still stands.
        assert_eq!(r.state(&store, &keys, 101, 2).unwrap().cursor, 1);
        // 2 ms later: read again.
        assert_eq!(r.state(&store, &keys, 102, 2).unwrap().cursor, 2);
        write_state(&store, &keys, 3);
        // A clock that went back does not keep a value alive.
        assert_eq!(r.state(&store, &keys, 50, 2).unwrap().cursor, 3);
    }

    #[test]
    fn a_window_of_zero_reads_every_time_and_forget_reads_at_once() {
        let (store, keys) = (MemStore::default(), keys());
        let mut r = Recent::default();
        write_state(&store, &keys, 1);
        assert_eq!(r.state(&store, &keys, 100, 0).unwrap().cursor, 1);
        write_state(&store, &keys, 2);
        assert_eq!(r.state(&store, &keys, 100, 0).unwrap().cursor, 2);
        assert_eq!(r.state(&store, &keys, 100, 1000).unwrap().cursor, 2);
        write_state(&store, &keys, 3);
        assert_eq!(r.state(&store, &keys, 100, 1000).unwrap().cursor, 2);
        r.forget();
        assert_eq!(r.state(&store, &keys, 100, 1000).unwrap().cursor, 3);
    }

    #[test]
    fn fleet_totals_are_reused_inside_the_window() {
        let (store, keys) = (MemStore::default(), keys());
        let mut r = Recent::default();
        assert!(r.fleet(&store, &keys, 10, 5).workers.is_empty());
        write_fleet(&store, &keys, 3);
        assert!(r.fleet(&store, &keys, 14, 5).workers.is_empty());
        assert_eq!(r.fleet(&store, &keys, 15, 5).workers.len(), 3);
        write_fleet(&store, &keys, 4);
        r.forget();
        assert_eq!(r.fleet(&store, &keys, 15, 5).workers.len(), 4);
    }
}
