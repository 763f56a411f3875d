//! The lease holder's side of fleet-wide load: it posts this Envoy's in-flight counts to the
//! collector (`POST /v1/load`, absolute values, one entry per worker slot with load), stores
//! the fleet totals each feed page carries (op `Load`) in shared data for every VM, and
//! repairs leaked counts of engines that say they are idle.

use kvroute::feed::Page;
use kvroute::mirror::{self, Counts, LoadId, Replica, Store};
use proxy_wasm::types::MapType;
use serde::Serialize;

use crate::config::millis;
use crate::host::{self, HostStore};
use crate::vm::Vm;

/// Books older than this are cleared when the engine reports idle twice in a row: a request
/// booked within it may not have reached the engine yet.
const LEAK_AGE_MS: u64 = 1000;

#[derive(Serialize)]
struct Report<'a> {
    gateway: &'a str,
    epoch: u64,
    workers: Vec<WorkerReport>,
}

#[derive(Serialize)]
struct WorkerReport {
    worker: u32,
    requests: u64,
    prefill_tokens: u64,
    decode_tokens: u64,
}

/// This Envoy's gateway id: configured; else made once (Envoy's node id with a random suffix,
/// as two replicas may share a node id) and kept in shared data so every VM (and the next
/// lease holder) reports under the same name.
pub fn gateway_id(vm: &Vm) -> Option<String> {
    if let Some(id) = &vm.config().gateway_id {
        return Some(id.clone());
    }
    let key = vm.keys.gateway();
    let (value, cas) = HostStore.get(&key).ok()?;
    if let Some(v) = value.and_then(|v| String::from_utf8(v).ok()) {
        return Some(v);
    }
    let r = vm.rng.try_borrow_mut().ok().map(|mut r| {
        use kvroute::select::Random;
        r.next_u64()
    })?;
    let node = host::get_property(&["node", "id"])
        .and_then(|n| String::from_utf8(n).ok())
        .filter(|n| !n.is_empty() && n.len() <= 100)
        .unwrap_or_else(|| "envoy".to_owned());
    // The clock too: test setups give every replica the same fixed random seed.
    let id = format!("{node}-{:016x}", r ^ host::now_ms().rotate_left(32));
    match HostStore.set(&key, id.as_bytes(), cas) {
        Ok(()) => Some(id),
        // Another VM made one first: use theirs.
        Err(_) => HostStore
            .get(&key)
            .ok()
            .and_then(|(v, _)| v)
            .and_then(|v| String::from_utf8(v).ok()),
    }
}

/// The counts of a report sent: `(worker slot, counts)`.
pub type Sent = Vec<(u32, Counts)>;

/// Sends the report; returns the callout token and the counts sent.
pub fn send(vm: &Vm, now: u64) -> Option<(u32, Sent)> {
    let cfg = vm.config();
    let state = mirror::read_state(&HostStore, &vm.keys).ok()?.0;
    if !state.has_index {
        return None;
    }
    let gateway = gateway_id(vm)?;
    let table = HostStore
        .get(&vm.keys.load())
        .ok()
        .and_then(|(v, _)| v)
        .unwrap_or_default();
    let mut counts: Vec<(u32, Counts)> = mirror::load_entries(&table, now, millis(cfg.load_ttl))
        .into_iter()
        .filter_map(|(id, l, _)| {
            let slot = id.as_slot().filter(|s| *s < cfg.limits.max_workers)?;
            Some((
                slot,
                Counts {
                    requests: l.requests.into(),
                    // What the engine has left to prefill by this gateway's estimate.
                    prefill_tokens: l.backlog.into(),
                    decode_tokens: l.decode_tokens.into(),
                },
            ))
        })
        .collect();
    counts.sort_by_key(|c| c.0);
    let body = Report {
        gateway: &gateway,
        epoch: state.epoch,
        workers: counts
            .iter()
            .map(|(w, c)| WorkerReport {
                worker: *w,
                requests: c.requests,
                prefill_tokens: c.prefill_tokens,
                decode_tokens: c.decode_tokens,
            })
            .collect(),
    };
    let body = serde_json::to_vec(&body).ok()?;
    let auth = cfg.read_token.as_ref().map(|t| format!("Bearer {t}"));
    let mut headers = vec![
        (":method", "POST"),
        (":path", "/v1/load"),
        (":authority", cfg.authority.as_str()),
        ("content-type", "application/json"),
    ];
    if let Some(a) = auth.as_deref() {
        headers.push(("authorization", a));
    }
    match host::http_call(&cfg.cluster, headers, Some(&body), cfg.feed_timeout) {
        Some(token) => Some((token, counts)),
        None => {
            host::increment_metric(vm.metrics.load_report_errors, 1);
            None
        }
    }
}

/// Appends `s` to a URL query, percent-encoding every byte but RFC 3986's unreserved ones.
pub fn push_url_encoded(out: &mut String, s: &str) {
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
}

/// The collector's answer: on 200 the report is part of the fleet totals from now on.
/// `keep_share`: record it as this gateway's share of the totals, to be subtracted from them
/// (false when the collector's totals already leave this gateway out).
pub fn on_answer(vm: &Vm, num_headers: usize, sent: &[(u32, Counts)], keep_share: bool) {
    let status = (num_headers > 0)
        .then(|| host::get_header(MapType::HttpCallResponseHeaders, ":status"))
        .flatten();
    if status.as_deref() != Some(b"200") {
        host::increment_metric(vm.metrics.load_report_errors, 1);
        log::debug!(
            "kvroute: load report refused (status {:?})",
            status.map(|s| String::from_utf8_lossy(&s).into_owned())
        );
        return;
    }
    host::increment_metric(vm.metrics.load_reports, 1);
    let max = vm.config().limits.max_workers;
    if !keep_share {
        return;
    }
    if mirror::update_fleet(&HostStore, &vm.keys, |f| {
        f.set_reported(sent, max);
        true
    })
    .is_err()
    {
        host::increment_metric(vm.metrics.load_errors, 1);
    }
}

/// Stores a page's fleet totals, then clears this Envoy's books of engines idle for two
/// samples while the books still hold work for them.
/// `excludes_own`: the totals leave this gateway's report out, so no share of them is ours.
/// `replica`: this gateway's place among the live replicas, from the same answer.
pub fn take_fleet(vm: &Vm, page: &Page, now: u64, excludes_own: bool, replica: Replica) {
    let max = vm.config().limits.max_workers;
    let mut idle = Vec::new();
    let r = mirror::update_fleet(&HostStore, &vm.keys, |f| {
        if !f.apply_ops(&page.ops, max, now) {
            return false;
        }
        f.replica = replica;
        if excludes_own {
            f.set_reported(&[], max);
        }
        idle = f
            .workers
            .iter()
            .enumerate()
            .filter(|(_, w)| w.idle_samples >= 2)
            .map(|(i, _)| i as u32)
            .collect();
        true
    });
    if r.is_err() {
        host::increment_metric(vm.metrics.load_errors, 1);
        return;
    }
    if idle.is_empty() {
        return;
    }
    let cut = now.saturating_sub(LEAK_AGE_MS);
    let mut cleared = 0;
    // A missing table clears nothing, so nothing is written.
    let wrote = mirror::update_value(&HostStore, &vm.keys.load(), None, |table| {
        cleared = idle
            .iter()
            .filter(|s| mirror::load_clear_stale(table, LoadId::slot(**s), cut))
            .count();
        cleared > 0
    });
    if matches!(wrote, Ok(true)) {
        host::increment_metric(vm.metrics.leaks_repaired, cleared as i64);
    }
}
