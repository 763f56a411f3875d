//! The load picture of one decision, read once from shared data: this gateway's own books
//! (the load table), the fleet's totals from every gateway, and the engines' own samples.
//! Read through the [`Store`] trait, so the filter (host calls) and native callers
//! ([`MemStore`](crate::mirror::MemStore)) see the same picture.

use std::rc::Rc;

use super::load::{fleet_view, Counts, InstanceLoad, Replica};
use super::policy::Policy;
use crate::mirror::{self, Fleet, Keys, LoadId, Store};

/// How a picture is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PictureConfig {
    /// Fleet totals and engine samples older than this (milliseconds) are not trusted: the
    /// index's own staleness bound.
    pub fresh_ms: u64,
    /// Time-to-live of the load table's entries, milliseconds.
    pub load_ttl_ms: u64,
    /// Whether the fleet's totals count (the gateway shares load with the others).
    pub fleet_counts: bool,
}

/// The load picture of one decision.
#[derive(Clone, Debug)]
pub struct Picture {
    table: Vec<u8>,
    /// The table's CAS token (0: there was none): the booking writes over this read.
    cas: u32,
    fleet: Option<Rc<Fleet>>,
    cfg: PictureConfig,
    now: u64,
}

impl Picture {
    /// Reads the load table and the fleet value at `now` (host milliseconds). A failed read
    /// is an empty table: no load known, which the decision handles.
    pub fn read<S: Store>(store: &S, keys: &Keys, cfg: PictureConfig, now: u64) -> Picture {
        let fleet = Rc::new(mirror::read_fleet(store, keys));
        Picture::with_fleet(store, keys, fleet, cfg, now)
    }

    /// Reads the load table at `now`, with fleet totals the caller already holds (a VM's
    /// [`Recent`](mirror::Recent) read).
    pub fn with_fleet<S: Store>(
        store: &S,
        keys: &Keys,
        fleet: Rc<Fleet>,
        cfg: PictureConfig,
        now: u64,
    ) -> Picture {
        let (table, cas) = match store.get(keys.load()) {
            Ok((Some(v), cas)) => (v, cas),
            _ => (Vec::new(), 0),
        };
        let fleet = Some(fleet)
            .filter(|f| !f.workers.is_empty() && now.saturating_sub(f.received_ms) <= cfg.fresh_ms);
        Picture {
            table,
            cas,
            fleet,
            cfg,
            now,
        }
    }

    /// When it was read.
    pub fn now(&self) -> u64 {
        self.now
    }

    /// The load table as read and its CAS token, for the booking's write.
    pub(super) fn into_table(self) -> (Vec<u8>, u32) {
        (self.table, self.cas)
    }

    /// `base` with this gateway's place among the live replicas when it shares the fleet's
    /// load (otherwise it decides alone).
    pub fn policy(&self, base: &Policy) -> Policy {
        let replica = match &self.fleet {
            Some(f) if self.cfg.fleet_counts => f.replica,
            _ => Replica::default(),
        };
        Policy { replica, ..*base }
    }

    /// The load of one load-table id: this gateway's books, plus (slots only) the other
    /// gateways' share of the fleet totals and the engine's fresh sample.
    pub fn load(&self, id: LoadId) -> InstanceLoad {
        let own = mirror::load_get(&self.table, id, self.now, self.cfg.load_ttl_ms);
        let mut l = InstanceLoad::from(own);
        let (Some(f), Some(slot)) = (&self.fleet, id.as_slot()) else {
            return l;
        };
        let w = f.worker(slot);
        if self.cfg.fleet_counts {
            let mine = Counts {
                requests: own.requests.into(),
                prefill_tokens: own.backlog.into(),
                decode_tokens: own.decode_tokens.into(),
            };
            let v = fleet_view(w.total, w.reported, mine);
            l.requests = v.requests.min(u32::MAX.into()) as u32;
            l.others_requests = l.requests.saturating_sub(own.requests);
            l.prefill_tokens = v.prefill_tokens;
            l.decode_tokens = v.decode_tokens;
        }
        let since = self.now.saturating_sub(f.received_ms);
        if let Some(e) = w
            .engine
            .filter(|e| !e.stale && u64::from(e.age_ms) + since <= self.cfg.fresh_ms)
        {
            l.engine = Some(e.load);
        }
        l
    }
}
