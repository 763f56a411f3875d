//! The decision's shared data as this Envoy reaches it: the load picture and the books
//! ([`kvroute::router`]) over host calls, with the filter's configuration, its counters, and
//! the `bench-unbooked` build that books nothing.

use kvroute::lookup::WorkerMatch;
use kvroute::mirror::{PrefixView, Store};
use kvroute::router::{self, Booked, Books, Picture, PictureConfig, SpecRead};

use crate::config::{millis, Config};
use crate::host::{self, HostStore};
use crate::vm::VmRef;

/// The load picture of one decision at `now`.
pub fn picture(vm: &VmRef, cfg: &Config, now: u64) -> Picture {
    let pc = PictureConfig {
        fresh_ms: millis(cfg.stale_after),
        load_ttl_ms: millis(cfg.load_ttl),
        fleet_counts: cfg.fleet,
    };
    Picture::with_fleet(&HostStore, &vm.keys, vm.fleet(now), pc, now)
}

fn books<'a>(vm: &'a VmRef, cfg: &Config) -> Books<'a, HostStore> {
    Books {
        store: &HostStore,
        keys: &vm.keys,
        capacity: cfg.limits.max_workers,
        ttl_ms: millis(cfg.load_ttl),
        prefill_rate: cfg.prefill_rate,
    }
}

/// Counts a failed write of the books (the entries' time-to-live repairs them).
fn counted<T>(vm: &VmRef, r: Result<T, router::BookError>) -> Option<T> {
    r.map_err(|e| {
        log::debug!("kvroute: load books: {e}");
        host::increment_metric(vm.metrics.load_errors, 1);
    })
    .ok()
}

/// Books a routed request as of the decision's `picture`.
pub fn book(
    vm: &VmRef,
    cfg: &Config,
    picture: Picture,
    id: kvroute::mirror::LoadId,
    prefill: u32,
    decode: u32,
    idle: bool,
) -> Option<Booked> {
    if cfg!(feature = "bench-unbooked") {
        let now = picture.now();
        return Some(Booked {
            id,
            prefill,
            decode,
            prefill_open: true,
            at_ms: now,
            measures_rate: idle,
        });
    }
    counted(vm, books(vm, cfg).book(picture, id, prefill, decode, idle))
}

/// Counts a routed request for the truth check: `prompt` tokens, `matched` of them predicted
/// as cached on the worker `id` names ([`crate::report`] carries the sums to the collector).
pub fn note_routed(id: kvroute::mirror::LoadId, prompt: u32, matched: u32) {
    crate::report::note_routed(id.as_slot(), prompt, matched);
}

/// The first response bytes: the prefill is done.
pub fn release_prefill(vm: &VmRef, cfg: &Config, b: &mut Booked) {
    if cfg!(feature = "bench-unbooked") {
        b.prefill_open = false;
        return;
    }
    counted(vm, books(vm, cfg).release_prefill(b, host::now_ms()));
}

/// First response bytes that are also the last: both releases in one write.
pub fn release_whole(vm: &VmRef, cfg: &Config, b: Booked) {
    if cfg!(feature = "bench-unbooked") {
        return;
    }
    counted(vm, books(vm, cfg).release_whole(b, host::now_ms()));
}

/// The end of the request.
pub fn release(vm: &VmRef, cfg: &Config, b: Booked) {
    if cfg!(feature = "bench-unbooked") {
        return;
    }
    counted(vm, books(vm, cfg).release(b, host::now_ms()));
}

/// Adds the speculative holders of `view`'s prompt to `matches`.
pub fn speculative_matches<S: Store>(
    vm: &VmRef,
    view: &PrefixView<'_, S>,
    blocks: u32,
    now: u64,
    matches: &mut Vec<WorkerMatch>,
) -> Option<SpecRead> {
    router::speculative(&HostStore, &vm.keys, view, blocks, now, matches)
}

/// Records `slot` as the holder of `view`'s prompt.
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
    match router::remember(&HostStore, &vm.keys, view, read, blocks, slot, now, ttl) {
        Ok(0) => {}
        Ok(evicted) => host::increment_metric(vm.metrics.speculative_evictions, evicted.into()),
        Err(_) => host::increment_metric(vm.metrics.load_errors, 1),
    }
}
