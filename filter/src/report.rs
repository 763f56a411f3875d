//! The lease holder's side of fleet-wide load: it posts this Envoy's in-flight counts to the
//! collector (`POST /v1/load`, absolute values, one entry per worker slot with load), stores
//! the fleet totals each feed page carries (op `Load`) in shared data for every VM, and
//! repairs leaked counts of engines that say they are idle.
//!
//! The same report carries what the collector's alarms need (issue 21), all cumulative since
//! this Envoy started: per worker the tokens predicted as cached for the requests routed
//! there and their prompt tokens (the truth check), requests for a model no engine is
//! registered for by model name (`no_model`), the text path's counters, the feed's lag, this
//! filter's version and hashing contract. Each VM counts its own routed requests and unknown
//! models in a VM-local [`Pending`] (no shared-data write on the request path) and adds them
//! on its tick to one shared-data table ([`Totals`], key `…/truth`), which the lease holder
//! reads into its report.

use std::cell::RefCell;
use std::collections::BTreeMap;

use kvroute::feed::Page;
use kvroute::mirror::{self, Counts, LoadId, Replica, Store};
use proxy_wasm::types::MapType;
use serde::{Deserialize, Serialize};

use crate::config::millis;
use crate::host::{self, HostStore};
use crate::vm::Vm;

/// Books older than this are cleared when the engine reports idle twice in a row: a request
/// booked within it may not have reached the engine yet.
const LEAK_AGE_MS: u64 = 1000;

/// Most model names counted for `no_model`; requests for others are not counted by name.
pub const MAX_NO_MODEL_NAMES: usize = 64;
/// Longest model name counted, bytes; longer ones are cut at a char boundary.
pub const MAX_MODEL_NAME_BYTES: usize = 128;
/// Highest worker slot counted (the collector's worker table has 4096 slots).
const MAX_SLOTS: usize = 4096;
/// Compare-and-swap attempts of one flush; past them the counts wait for the next tick.
const FLUSH_RETRIES: u32 = 4;

#[derive(Serialize)]
struct Report<'a> {
    gateway: &'a str,
    epoch: u64,
    workers: Vec<WorkerReport>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    no_model: &'a BTreeMap<String, u64>,
    version: &'static str,
    contract: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    feed_lag_ms: Option<u64>,
    text: TextCounts,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    held: Vec<HeldReport>,
}

/// One of this gateway's speculative entries, passed on to the other gateways.
#[derive(Serialize)]
struct HeldReport {
    worker: u32,
    shard: u32,
    key: u64,
    blocks: u32,
    ttl_ms: u32,
}

#[derive(Serialize)]
struct WorkerReport {
    worker: u32,
    requests: u64,
    prefill_tokens: u64,
    decode_tokens: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    predicted_cached_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    routed_prompt_tokens: Option<u64>,
}

/// The filter's `kvroute.text.*` counters, read back from the host (shared by every VM).
#[derive(Serialize, Default)]
struct TextCounts {
    exact: u64,
    approx: u64,
    no_tokenizer: u64,
    exact_errors: u64,
}

/// What this VM counted since its last flush.
#[derive(Debug, Default)]
struct Pending {
    /// By worker slot: `(predicted cached tokens, prompt tokens)`.
    workers: Vec<(u64, u64)>,
    /// By model name; at most [`MAX_NO_MODEL_NAMES`].
    no_model: Vec<(String, u64)>,
}

impl Pending {
    fn is_empty(&self) -> bool {
        self.workers.iter().all(|w| *w == (0, 0)) && self.no_model.is_empty()
    }
}

thread_local! {
    // A VM is one thread: this is the VM's own, touched only by its contexts.
    static PENDING: RefCell<Pending> = RefCell::new(Pending::default());
}

/// Every VM's counts added up, in shared data: cumulative since this Envoy started (worker
/// counts since the feed epoch `epoch`, as worker slots are an epoch's).
#[derive(Debug, Default, Serialize, Deserialize)]
struct Totals {
    epoch: u64,
    /// `(slot, predicted cached tokens, prompt tokens)`, by slot.
    workers: Vec<(u32, u64, u64)>,
    no_model: BTreeMap<String, u64>,
}

fn totals_key(vm: &Vm) -> String {
    format!("{}/truth", vm.keys.prefix())
}

fn read_totals(vm: &Vm) -> Option<(Totals, u32)> {
    let (value, cas) = HostStore.get(&totals_key(vm)).ok()?;
    let totals = value
        .and_then(|v| serde_json::from_slice(&v).ok())
        .unwrap_or_default();
    Some((totals, cas))
}

/// Counts a routed request: `prompt` tokens, `matched` of them predicted as cached, sent to
/// the worker in `slot` (none for an instance-level id).
pub fn note_routed(slot: Option<u32>, prompt: u32, matched: u32) {
    let Some(slot) = slot.map(|s| s as usize).filter(|s| *s < MAX_SLOTS) else {
        return;
    };
    PENDING.with(|p| {
        let Ok(mut p) = p.try_borrow_mut() else {
            return;
        };
        if p.workers.len() <= slot {
            p.workers.resize(slot + 1, (0, 0));
        }
        if let Some(w) = p.workers.get_mut(slot) {
            w.0 = w.0.saturating_add(matched.min(prompt).into());
            w.1 = w.1.saturating_add(prompt.into());
        }
    });
}

/// Counts a request for `model`, which no engine is registered for.
pub fn note_no_model(model: &str) {
    let mut end = model.len().min(MAX_MODEL_NAME_BYTES);
    while !model.is_char_boundary(end) {
        end -= 1;
    }
    let name = model.get(..end).unwrap_or_default();
    PENDING.with(|p| {
        let Ok(mut p) = p.try_borrow_mut() else {
            return;
        };
        if let Some(e) = p.no_model.iter_mut().find(|(m, _)| m == name) {
            e.1 = e.1.saturating_add(1);
        } else if p.no_model.len() < MAX_NO_MODEL_NAMES {
            p.no_model.push((name.to_owned(), 1));
        }
    });
}

/// Adds this VM's pending counts to the shared totals (on its tick). On a lost race after
/// every retry they stay pending for the next tick.
pub fn flush(vm: &Vm) {
    let pending = PENDING.with(|p| p.try_borrow_mut().ok().map(|mut p| std::mem::take(&mut *p)));
    let Some(pending) = pending.filter(|p| !p.is_empty()) else {
        return;
    };
    let epoch = mirror::read_state(&HostStore, &vm.keys)
        .ok()
        .map(|(s, _)| s.epoch);
    let max = (vm.config().limits.max_workers as usize).min(MAX_SLOTS);
    for _ in 0..FLUSH_RETRIES {
        let Some((mut t, cas)) = read_totals(vm) else {
            break;
        };
        if let Some(e) = epoch.filter(|e| *e != t.epoch) {
            // Slots of another epoch name other workers: start the worker counts again.
            t.epoch = e;
            t.workers.clear();
        }
        for (slot, &(p, r)) in pending.workers.iter().enumerate().take(max) {
            if (p, r) == (0, 0) {
                continue;
            }
            let slot = slot as u32;
            match t.workers.binary_search_by_key(&slot, |w| w.0) {
                Ok(i) => {
                    if let Some(w) = t.workers.get_mut(i) {
                        w.1 = w.1.saturating_add(p);
                        w.2 = w.2.saturating_add(r);
                    }
                }
                Err(i) => t.workers.insert(i, (slot, p, r)),
            }
        }
        for (model, n) in &pending.no_model {
            if let Some(c) = t.no_model.get_mut(model) {
                *c = c.saturating_add(*n);
            } else if t.no_model.len() < MAX_NO_MODEL_NAMES {
                t.no_model.insert(model.clone(), *n);
            }
        }
        let Ok(bytes) = serde_json::to_vec(&t) else {
            return;
        };
        if HostStore.set(&totals_key(vm), &bytes, cas).is_ok() {
            return;
        }
    }
    // Lost every race: put the counts back.
    PENDING.with(|p| {
        if let Ok(mut p) = p.try_borrow_mut() {
            for (slot, (pr, r)) in pending.workers.iter().enumerate() {
                if p.workers.len() <= slot {
                    p.workers.resize(slot + 1, (0, 0));
                }
                if let Some(w) = p.workers.get_mut(slot) {
                    w.0 = w.0.saturating_add(*pr);
                    w.1 = w.1.saturating_add(*r);
                }
            }
            for (model, n) in pending.no_model {
                if let Some(e) = p.no_model.iter_mut().find(|(m, _)| *m == model) {
                    e.1 = e.1.saturating_add(n);
                } else if p.no_model.len() < MAX_NO_MODEL_NAMES {
                    p.no_model.push((model, n));
                }
            }
        }
    });
}

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_get_metric(metric_id: u32, return_value: *mut u64) -> u32;
}

/// A metric's value across every VM of this plugin; 0 when the host has none.
fn metric(id: Option<u32>) -> u64 {
    let Some(id) = id else { return 0 };
    let mut v = 0u64;
    // SAFETY: the host writes one u64 through the pointer, which is valid for the call.
    let status = unsafe { proxy_get_metric(id, &mut v) };
    if status == 0 {
        v
    } else {
        0
    }
}

/// This Envoy's gateway id: configured; else made once (Envoy's node id with a random suffix,
/// as two replicas may share a node id) and kept in shared data so every VM (and the next
/// lease holder) reports under the same name.
pub fn gateway_id(vm: &Vm) -> Option<String> {
    if let Some(id) = &vm.config().gateway_id {
        return Some(id.clone());
    }
    let key = vm.keys.gateway();
    let (value, cas) = HostStore.get(key).ok()?;
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
    match HostStore.set(key, id.as_bytes(), cas) {
        Ok(()) => Some(id),
        // Another VM made one first: use theirs.
        Err(_) => HostStore
            .get(key)
            .ok()
            .and_then(|(v, _)| v)
            .and_then(|v| String::from_utf8(v).ok()),
    }
}

/// The counts of a report sent: `(worker slot, counts)`.
pub type Sent = Vec<(u32, Counts)>;

/// Most speculative entries one report passes on (the collector takes up to 1,024).
const MAX_HELD: usize = 1024;

/// Sends the report to `cluster` (the one the feed is pulled from: the totals come back in
/// its pages), with the own speculative entries expiring after `holds_after`; returns the
/// callout token and the counts sent.
pub fn send(vm: &Vm, cluster: &str, now: u64, holds_after: u64) -> Option<(u32, Sent)> {
    let cfg = vm.config();
    let state = mirror::read_state(&HostStore, &vm.keys).ok()?.0;
    if !state.has_index {
        return None;
    }
    let gateway = gateway_id(vm)?;
    let table = HostStore
        .get(vm.keys.load())
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
    let totals = read_totals(vm)
        .map(|(t, _)| t)
        .filter(|t| t.epoch == state.epoch)
        .unwrap_or_default();
    let truth_of = |slot: u32| {
        totals
            .workers
            .binary_search_by_key(&slot, |w| w.0)
            .ok()
            .and_then(|i| totals.workers.get(i))
            .map(|w| (w.1, w.2))
    };
    let mut workers: Vec<WorkerReport> = counts
        .iter()
        .map(|(w, c)| {
            let truth = truth_of(*w);
            WorkerReport {
                worker: *w,
                requests: c.requests,
                prefill_tokens: c.prefill_tokens,
                decode_tokens: c.decode_tokens,
                predicted_cached_tokens: truth.map(|t| t.0),
                routed_prompt_tokens: truth.map(|t| t.1),
            }
        })
        .collect();
    // Workers with counts but nothing in flight, if the roster still has them (the
    // collector refuses a report naming a worker it does not know).
    if let Ok(mut cache) = vm.cache.try_borrow_mut() {
        cache.refresh(&HostStore, &vm.keys, &state);
        for &(slot, p, r) in &totals.workers {
            if slot < cfg.limits.max_workers
                && cache.meta.worker(slot).is_some()
                && counts.binary_search_by_key(&slot, |c| c.0).is_err()
            {
                workers.push(WorkerReport {
                    worker: slot,
                    requests: 0,
                    prefill_tokens: 0,
                    decode_tokens: 0,
                    predicted_cached_tokens: Some(p),
                    routed_prompt_tokens: Some(r),
                });
            }
        }
    }
    workers.sort_by_key(|w| w.worker);
    let held = if cfg.speculative_ttl.is_zero() {
        Vec::new()
    } else {
        kvroute::router::own_holds(&HostStore, &vm.keys, holds_after, now, MAX_HELD)
    };
    let held = held
        .into_iter()
        .filter(|h| h.slot < cfg.limits.max_workers)
        .map(|h| HeldReport {
            worker: h.slot,
            shard: h.shard,
            key: h.key.0,
            blocks: h.blocks,
            ttl_ms: h.ttl_ms,
        })
        .collect();
    let text = &vm.metrics.text;
    let body = Report {
        gateway: &gateway,
        epoch: state.epoch,
        workers,
        no_model: &totals.no_model,
        version: env!("CARGO_PKG_VERSION"),
        contract: kvroute::hash::contract(),
        feed_lag_ms: Some(now.saturating_sub(state.synced_at_ms)),
        text: TextCounts {
            exact: metric(text.exact),
            approx: metric(text.approx),
            no_tokenizer: metric(text.no_tokenizer),
            exact_errors: metric(text.exact_errors),
        },
        held,
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
    match host::http_call(cluster, headers, Some(&body), cfg.feed_timeout) {
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
    let wrote = mirror::update_value(&HostStore, vm.keys.load(), None, |table| {
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
