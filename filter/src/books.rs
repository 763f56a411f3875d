//! The request path's load books: the layered load a decision reads (own books, the fleet's
//! totals, the engines' samples), the booking of a routed request and its two releases, and
//! the speculative holders of recent decisions.

use kvroute::lookup::WorkerMatch;
use kvroute::mirror::{
    self, spec_insert, spec_lookup, stored_depths, Depth, Fleet, Insert, LoadDelta, LoadId,
    PrefixView, RateNote, Store,
};
use kvroute::route::{fleet_view, Counts, EngineLoad, InstanceLoad, Policy, Replica};

use crate::config::{millis, Config};
use crate::host::{self, HostStore};
use crate::vm::VmRef;

/// Shards of the speculative table, by the prompt's first block key: a decision reads and
/// writes one shard of 1.5 KiB instead of a 24 KiB table (siblings share their first block,
/// so they meet in the same shard).
pub const SPECULATIVE_SHARDS: u32 = 16;
/// Entries of one shard; all shards together hold about 200 recent requests of 32 to 64
/// blocks (five or six stored depths each), 24 KiB of shared data.
pub const SPECULATIVE_ENTRIES: u32 = 64;

/// The speculative shard of `view`'s prompt (`None` without a full block).
fn speculative_shard<S: Store>(view: &PrefixView<'_, S>) -> Option<u32> {
    view.key_at(Depth(0))
        .map(|k| (k.0 % u64::from(SPECULATIVE_SHARDS)) as u32)
}

/// The load picture of one decision, read once.
pub(crate) struct Picture {
    table: Vec<u8>,
    /// The table's CAS token (0: there was none): the booking writes over this read.
    cas: u32,
    fleet: Option<Fleet>,
    fleet_counts: bool,
    now: u64,
    ttl: u64,
    fresh_ms: u64,
}

impl Picture {
    pub fn read(vm: &VmRef, cfg: &Config, now: u64) -> Picture {
        let (table, cas) = match HostStore.get(&vm.keys.load()) {
            Ok((Some(v), cas)) => (v, cas),
            _ => (Vec::new(), 0),
        };
        let fresh_ms = millis(cfg.stale_after);
        // Totals and samples older than the index's own staleness bound are not trusted.
        let fleet = Some(mirror::read_fleet(&HostStore, &vm.keys))
            .filter(|f| !f.workers.is_empty() && now.saturating_sub(f.received_ms) <= fresh_ms);
        Picture {
            table,
            cas,
            fleet,
            fleet_counts: cfg.fleet,
            now,
            ttl: millis(cfg.load_ttl),
            fresh_ms,
        }
    }

    /// The decision's policy: the configured one, with this gateway's place among the live
    /// replicas when it shares the fleet's load (otherwise it decides alone).
    pub fn policy(&self, cfg: &Config) -> Policy {
        let replica = match &self.fleet {
            Some(f) if self.fleet_counts => f.replica,
            _ => Replica::default(),
        };
        Policy {
            replica,
            ..cfg.policy
        }
    }

    /// The load of one load-table id: this Envoy's books, plus (slots only) the other
    /// gateways' share of the fleet totals and the engine's fresh sample.
    pub fn load(&self, id: LoadId) -> InstanceLoad {
        let own = mirror::load_get(&self.table, id, self.now, self.ttl);
        let mut l = InstanceLoad::of(own);
        let (Some(f), Some(slot)) = (&self.fleet, id.as_slot()) else {
            return l;
        };
        let w = f.worker(slot);
        if self.fleet_counts {
            let mine = Counts {
                requests: own.requests.into(),
                prefill_tokens: own.backlog.into(),
                decode_tokens: own.decode_tokens.into(),
            };
            let v = fleet_view(w.total, w.reported, mine);
            l.requests = v.requests.min(u32::MAX.into()) as u32;
            l.prefill_tokens = v.prefill_tokens;
            l.decode_tokens = v.decode_tokens;
        }
        let since = self.now.saturating_sub(f.received_ms);
        if let Some(e) = w
            .engine
            .filter(|e| !e.stale && u64::from(e.age_ms) + since <= self.fresh_ms)
        {
            l.engine = Some(EngineLoad {
                waiting: e.waiting,
                kv_usage: f32::from(e.kv_permille) / 1000.0,
            });
        }
        l
    }
}

/// Load booked for a routed request.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Booked {
    pub id: LoadId,
    pub prefill: u32,
    pub decode: u32,
    /// The prefill tokens are still booked (no response bytes yet).
    pub prefill_open: bool,
    /// When it was booked (host milliseconds).
    pub at_ms: u64,
    /// The engine had no prefill ahead of it by the books: its time to first bytes measures
    /// the engine's prefill rate.
    pub idle: bool,
}

/// Applies `delta` to `id`'s entry at `now`; `seen`: the decision's picture, whose table
/// (with its CAS token) is written over without being read again.
fn update(
    vm: &VmRef,
    cfg: &Config,
    id: LoadId,
    delta: LoadDelta,
    now: u64,
    seen: Option<Picture>,
) -> bool {
    if cfg!(feature = "bench-unbooked") {
        return true;
    }
    let ok = mirror::load_update_seen(
        &HostStore,
        &vm.keys,
        seen.map(|p| (p.table, p.cas)),
        cfg.limits.max_workers,
        id,
        delta,
        now,
        millis(cfg.load_ttl),
    );
    if !matches!(ok, Ok(true)) {
        host::increment_metric(vm.metrics.load_errors, 1);
        return false;
    }
    true
}

/// Books a routed request: one request, its uncached prefill and its decode budget, as of
/// the decision's `picture` (done with). `idle`: the decision saw no prefill ahead of it on
/// that engine.
pub fn book(
    vm: &VmRef,
    cfg: &Config,
    picture: Picture,
    id: LoadId,
    prefill: u32,
    decode: u32,
    idle: bool,
) -> Option<Booked> {
    let delta = LoadDelta {
        requests: 1,
        prefill_tokens: prefill.into(),
        decode_tokens: decode.into(),
        rate: cfg.prefill_rate.map_or(RateNote::Keep, RateNote::Set),
    };
    let now = picture.now;
    update(vm, cfg, id, delta, now, Some(picture)).then_some(Booked {
        id,
        prefill,
        decode,
        prefill_open: true,
        at_ms: now,
        idle,
    })
}

/// The first response bytes: the engine has prefilled, the prefill tokens are no longer
/// work ahead of the next request.
pub fn release_prefill(vm: &VmRef, cfg: &Config, b: &mut Booked) {
    if !b.prefill_open {
        return;
    }
    b.prefill_open = false;
    if b.prefill > 0 {
        let now = host::now_ms();
        // Learned only from requests that found the engine idle (see `mirror::rate_sample`).
        let sample = match cfg.prefill_rate {
            None if b.idle => mirror::rate_sample(b.prefill, now.saturating_sub(b.at_ms)),
            _ => None,
        };
        let delta = LoadDelta {
            prefill_tokens: -i64::from(b.prefill),
            rate: sample.map_or(RateNote::Keep, RateNote::Sample),
            ..LoadDelta::default()
        };
        update(vm, cfg, b.id, delta, now, None);
    }
}

/// The end of the request: everything still booked.
pub fn release(vm: &VmRef, cfg: &Config, b: Booked) {
    let delta = LoadDelta {
        requests: -1,
        prefill_tokens: if b.prefill_open {
            -i64::from(b.prefill)
        } else {
            0
        },
        decode_tokens: -i64::from(b.decode),
        rate: RateNote::Keep,
    };
    update(vm, cfg, b.id, delta, host::now_ms(), None);
}

/// The speculative table as read for a decision, kept for the write after it (one copy of
/// the value less per request when no other VM wrote meanwhile).
pub(crate) struct SpecRead {
    shard: u32,
    table: Vec<u8>,
    cas: u32,
}

/// Adds the speculative holders of `view`'s prompt to `matches` (GPU tier): for each slot,
/// the deepest stored depth whose key it shares. Stops at the first stored depth nobody
/// holds, so a cold prompt costs one lookup.
pub fn speculative_matches<S: Store>(
    vm: &VmRef,
    view: &PrefixView<'_, S>,
    blocks: u32,
    now: u64,
    matches: &mut Vec<WorkerMatch>,
) -> Option<SpecRead> {
    let shard = speculative_shard(view)?;
    let (value, cas) = HostStore.get(&vm.keys.speculative(shard)).ok()?;
    let read = SpecRead {
        shard,
        table: value.unwrap_or_default(),
        cas,
    };
    let table = &read.table;
    for d in stored_depths(blocks) {
        let Some(key) = view.key_at(Depth(d - 1)) else {
            break;
        };
        let Some((slot, held)) = spec_lookup(table, key, now) else {
            break;
        };
        let depth = held.min(d);
        match matches.iter_mut().find(|m| m.worker.0 == slot) {
            Some(m) => {
                for b in &mut m.blocks {
                    *b = (*b).max(depth);
                }
            }
            None => matches.push(WorkerMatch {
                worker: kvroute::event::WorkerId(slot),
                blocks: [depth; 3],
            }),
        }
    }
    Some(read)
}

/// Records `slot` as the holder of `view`'s prompt at its stored depths, starting from the
/// table `read` for the decision.
pub fn remember<S: Store>(
    vm: &VmRef,
    cfg: &Config,
    view: &PrefixView<'_, S>,
    read: Option<SpecRead>,
    blocks: u32,
    slot: u32,
    now: u64,
) {
    let ttl = millis(cfg.speculative_ttl);
    let keys: Vec<(u32, _)> = stored_depths(blocks)
        .filter_map(|d| view.key_at(Depth(d - 1)).map(|k| (d, k)))
        .collect();
    if keys.is_empty() {
        return;
    }
    let Some(shard) = read
        .as_ref()
        .map(|r| r.shard)
        .or_else(|| speculative_shard(view))
    else {
        return;
    };
    let mut evicted = 0;
    let wrote = mirror::update_value(
        &HostStore,
        &vm.keys.speculative(shard),
        read.map(|r| (r.table, r.cas)),
        |table| {
            evicted = 0;
            for &(d, k) in &keys {
                let ins = spec_insert(table, SPECULATIVE_ENTRIES, k, slot, d, now, ttl);
                evicted += i64::from(ins == Insert::Evicted);
            }
            true
        },
    );
    match wrote {
        Ok(_) if evicted > 0 => host::increment_metric(vm.metrics.speculative_evictions, evicted),
        Ok(_) => {}
        Err(_) => host::increment_metric(vm.metrics.load_errors, 1),
    }
}
