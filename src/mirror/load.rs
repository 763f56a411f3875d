//! The in-flight load table: requests and prefill tokens routed to each worker and not yet
//! finished, shared by every VM under one key with a time-to-live.
//!
//! # Prefill backlog
//!
//! Booked prefill tokens are released only when the request's first response bytes come
//! back, so until then they count in full, even when the engine has nearly worked through
//! them. Engines prefill their queue first come, first served, so the gateway also keeps an
//! estimate of the work the engine has *not* done yet, the backlog: it grows by each booked
//! request's prefill and drains at the engine's prefill rate, and never exceeds the booked
//! tokens. Deciding on the backlog instead of the booked tokens sends a request to the engine
//! whose prefill queue frees first (on the benchmark's trace, ~15 % off the TTFT median in a
//! replay of the engines' model; `README.md` has the measured figures).
//!
//! The rate is per worker, in tokens per second: set from the configuration
//! ([`RateNote::Set`]), or learned from requests that found the engine idle
//! ([`RateNote::Sample`], their prefill over their time to first byte, which includes the
//! network and so errs low: a low rate drains less and falls back to the booked tokens).
//! A rate of 0 disables the drain.

use crate::codec::le_u64;
use crate::router::load::InstanceLoad;

use super::keys::{Keys, LAYOUT_VERSION};
use super::store::{update_value, Store, StoreError};

/// In-flight load of one worker (local mode: a slot; remote mode: an instance).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Load {
    /// Requests routed and not finished.
    pub requests: u32,
    /// Their uncached prompt tokens: prefill work queued (released at the first response
    /// bytes).
    pub prefill_tokens: u32,
    /// Their decode work still to come, in tokens (released at the end of the request).
    pub decode_tokens: u32,
    /// Of `prefill_tokens`, the part the engine has not worked through yet by the gateway's
    /// estimate (see the module docs); equal to `prefill_tokens` without a rate.
    pub backlog: u32,
}

/// A load-table entry as the decision reads it: its prefill backlog is the work queued.
impl From<Load> for InstanceLoad {
    fn from(l: Load) -> InstanceLoad {
        InstanceLoad {
            requests: l.requests,
            prefill_tokens: l.backlog.into(),
            decode_tokens: l.decode_tokens.into(),
            others_requests: 0,
            engine: None,
        }
    }
}

impl Load {
    /// A load whose prefill is all ahead (no drain).
    pub fn booked(requests: u32, prefill_tokens: u32, decode_tokens: u32) -> Load {
        Load {
            requests,
            prefill_tokens,
            decode_tokens,
            backlog: prefill_tokens,
        }
    }
}

/// What a change says about the worker's prefill rate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RateNote {
    /// Nothing: the rate stays.
    #[default]
    Keep,
    /// The configured rate, tokens per second (0: no drain).
    Set(u32),
    /// One measured rate, folded into the learned one (a quarter weight each).
    Sample(u32),
}

/// The backlog `backlog` left `elapsed_ms` later at `rate` tokens per second.
pub fn drain(backlog: u32, rate: u32, elapsed_ms: u64) -> u32 {
    let done = u64::from(rate).saturating_mul(elapsed_ms) / 1000;
    u64::from(backlog).saturating_sub(done) as u32
}

/// Fewest prefill tokens of a request whose time to first bytes is a rate sample: shorter
/// prefills are mostly fixed overhead (scheduling, the first token, the network).
pub const RATE_SAMPLE_MIN_TOKENS: u32 = 4096;

/// The rate sample of a request that found its engine's prefill idle: its `prefill_tokens`
/// over its time to first bytes `elapsed_ms`. That time includes the network and the first
/// decode step, so the sample errs low, the safe side. `None` for short prefills.
pub fn rate_sample(prefill_tokens: u32, elapsed_ms: u64) -> Option<u32> {
    (prefill_tokens >= RATE_SAMPLE_MIN_TOKENS && elapsed_ms > 0)
        .then(|| (u64::from(prefill_tokens) * 1000 / elapsed_ms).min(u32::MAX.into()) as u32)
}

/// Most a sample may stand above the learned rate, as a factor. Samples err low (see
/// [`rate_sample`]); one far above the rate was no prefill of the booked tokens (a prefix the
/// engine held that the books did not know of). Uncapped, one such sample (56× the true rate,
/// seen in the uneven bench) multiplied the learned rate by 15 and let the engine's backlog
/// drain in the books while it was busy, and cold prompts queued behind it for seconds.
pub const RATE_SAMPLE_MAX_STEP: u32 = 2;

/// The learned rate after one more `sample` (tokens per second): a quarter weight each, a
/// sample counted at most `RATE_SAMPLE_MAX_STEP` times the rate (so one sample raises it by
/// at most a quarter; lowering it, the safe side, is not capped).
pub fn learn_rate(rate: u32, sample: u32) -> u32 {
    if rate == 0 {
        return sample;
    }
    let sample = sample.min(rate.saturating_mul(RATE_SAMPLE_MAX_STEP));
    ((3 * u64::from(rate) + u64::from(sample)) / 4) as u32
}

/// Who a load-table entry counts for: a worker slot of the mirror (local mode) or an
/// instance named by the collector (remote mode). The two kinds never share an id: instance
/// ids carry the top bit, slot ids never do; 0 is never an id (it marks a free entry).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LoadId(u64);

impl LoadId {
    const INSTANCE_BIT: u64 = 1 << 63;

    /// The id of worker slot `slot`.
    pub fn slot(slot: u32) -> LoadId {
        LoadId(slot as u64 + 1)
    }

    /// The id of the instance named `instance_id` (an FNV-1a hash of the name: every VM
    /// computes the same id without sharing a table of names).
    pub fn instance(instance_id: &str) -> LoadId {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &c in instance_id.as_bytes() {
            h ^= c as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        LoadId(h | Self::INSTANCE_BIT)
    }

    /// The id as stored in the table.
    pub fn get(self) -> u64 {
        self.0
    }

    /// The worker slot, when this is a slot's id.
    pub fn as_slot(self) -> Option<u32> {
        (self.0 & Self::INSTANCE_BIT == 0 && self.0 != 0).then(|| (self.0 - 1) as u32)
    }
}

const LOAD_ENTRY: usize = 40;
/// The table's first byte: the mirror's layout with the top two bits set, so a table of the
/// older 24-byte entries (first byte `LAYOUT_VERSION`) or 32-byte entries (`LAYOUT_VERSION |
/// 0x80`) reads as empty and is rebuilt.
const LOAD_FORMAT: u8 = LAYOUT_VERSION | 0xC0;

/// The load of `id` (nonzero) in a load table value: zero when absent or not updated for
/// `ttl_ms` (a VM that died never releases its counts; the time-to-live forgets them).
///
/// # Layout
/// `format u8`, then `capacity × (id u64, requests u32, prefill_tokens u32, decode_tokens u32,
/// backlog u32, updated_ms u64, rate u32, 0 u32)`, open addressing from `id % capacity`; id 0
/// is a free entry. `backlog` is as of `updated_ms`, drained at `rate` when read.
pub fn load_get(table: &[u8], id: LoadId, now_ms: u64, ttl_ms: u64) -> Load {
    match load_find(table, id) {
        Some((at, true)) => entry_at(table, at, now_ms, ttl_ms),
        _ => Load::default(),
    }
}

fn entry_at(table: &[u8], at: usize, now_ms: u64, ttl_ms: u64) -> Load {
    let updated = le_u64(table, at + 24);
    if now_ms.saturating_sub(updated) > ttl_ms {
        return Load::default();
    }
    let prefill_tokens = (le_u64(table, at + 8) >> 32) as u32;
    let backlog = (le_u64(table, at + 16) >> 32) as u32;
    Load {
        requests: le_u64(table, at + 8) as u32,
        prefill_tokens,
        decode_tokens: le_u64(table, at + 16) as u32,
        backlog: drain(backlog, rate_at(table, at), now_ms.saturating_sub(updated))
            .min(prefill_tokens),
    }
}

/// Whether the entry at `at` counts nothing in flight (no requests, prefill, decode or
/// backlog; its rate may stay).
fn holds_nothing(table: &[u8], at: usize) -> bool {
    le_u64(table, at + 8) == 0 && le_u64(table, at + 16) == 0
}

/// The worker's prefill rate stored in the entry at `at` (tokens per second, 0: unknown).
fn rate_at(table: &[u8], at: usize) -> u32 {
    le_u64(table, at + 32) as u32
}

/// The prefill rate of `id` in a load table value (tokens per second; 0 when unknown).
pub fn load_rate(table: &[u8], id: LoadId) -> u32 {
    match load_find(table, id) {
        Some((at, true)) => rate_at(table, at),
        _ => 0,
    }
}

/// Every live entry of a table: `(id, load, updated_ms)`, skipping free and expired ones.
pub fn load_entries(table: &[u8], now_ms: u64, ttl_ms: u64) -> Vec<(LoadId, Load, u64)> {
    if table.first() != Some(&LOAD_FORMAT) {
        return Vec::new();
    }
    let cap = (table.len() - 1) / LOAD_ENTRY;
    (0..cap)
        .map(|i| 1 + i * LOAD_ENTRY)
        .filter_map(|at| {
            let id = le_u64(table, at);
            let load = entry_at(table, at, now_ms, ttl_ms);
            (id != 0 && load != Load::default()).then(|| (LoadId(id), load, le_u64(table, at + 24)))
        })
        .collect()
}

/// Finds `id`'s entry: `(offset, true)`, or the first free entry `(offset, false)`.
fn load_find(table: &[u8], id: LoadId) -> Option<(usize, bool)> {
    let id = id.0;
    if table.first() != Some(&LOAD_FORMAT) || id == 0 {
        return None;
    }
    let cap = (table.len() - 1) / LOAD_ENTRY;
    if cap == 0 {
        return None;
    }
    let start = (id % cap as u64) as usize;
    let mut free = None;
    for p in 0..cap {
        let at = 1 + ((start + p) % cap) * LOAD_ENTRY;
        let e = le_u64(table, at);
        if e == id {
            return Some((at, true));
        }
        if e == 0 {
            return Some((free.unwrap_or(at), false));
        }
        if free.is_none() && holds_nothing(table, at) {
            // An entry with nothing in flight can be reused.
            free = Some(at);
        }
    }
    free.map(|at| (at, false))
}

/// A change to one entry: signed deltas (negative to release).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadDelta {
    /// Requests.
    pub requests: i32,
    /// Prefill tokens.
    pub prefill_tokens: i64,
    /// Decode tokens.
    pub decode_tokens: i64,
    /// The prefill rate.
    pub rate: RateNote,
}

/// Entries of a new table. Every request copies the table out of shared data and back (a
/// read for its decision, a read and a write for its booking and each release), so it starts
/// small and grows with the engines it counts, up to the configured capacity.
pub const LOAD_MIN_ENTRIES: usize = 16;

/// The entries of a well-formed table, `None` for a missing or foreign value.
fn table_entries(table: &[u8]) -> Option<usize> {
    let body = table.len().checked_sub(1)?;
    (table.first() == Some(&LOAD_FORMAT) && body.is_multiple_of(LOAD_ENTRY) && body > 0)
        .then_some(body / LOAD_ENTRY)
}

/// `table` rebuilt with `entries` entries, every id (idle ones too, for their learned rates)
/// at its place for the new size.
fn resized(table: &[u8], entries: usize) -> Vec<u8> {
    let mut out = vec![0u8; 1 + entries * LOAD_ENTRY];
    out[0] = LOAD_FORMAT;
    for at in (1..table.len().saturating_sub(LOAD_ENTRY - 1)).step_by(LOAD_ENTRY) {
        let id = LoadId(le_u64(table, at));
        if id.0 == 0 {
            continue;
        }
        if let Some((to, false)) = load_find(&out, id) {
            out[to..to + LOAD_ENTRY].copy_from_slice(&table[at..at + LOAD_ENTRY]);
        }
    }
    out
}

/// Adds `delta` to `id`'s load in `table`, saturating at zero. Expired counts restart from
/// zero. A new table has `LOAD_MIN_ENTRIES` entries (at most `capacity`); it doubles, up to
/// `capacity`, when a new id would fill it beyond three quarters. Returns `false` when the
/// table is full of busy entries.
pub fn load_add(
    table: &mut Vec<u8>,
    capacity: u32,
    id: LoadId,
    delta: LoadDelta,
    now_ms: u64,
    ttl_ms: u64,
) -> bool {
    let max = capacity.max(1) as usize;
    let mut cap = match table_entries(table) {
        Some(n) if n <= max => n,
        _ => {
            *table = resized(&[], LOAD_MIN_ENTRIES.min(max));
            LOAD_MIN_ENTRIES.min(max)
        }
    };
    // Slot ids are dense from 1, so below three quarters full they land in place, and idle
    // entries (which keep a learned rate) are not reused for another id.
    let grow = cap < max
        && match load_find(table, id) {
            Some((_, true)) => false,
            Some((_, false)) => {
                let ids = (0..cap)
                    .filter(|i| le_u64(table, 1 + i * LOAD_ENTRY) != 0)
                    .count();
                (ids + 1) * 4 > cap * 3
            }
            None => true,
        };
    if grow {
        cap = (cap * 2).min(max);
        *table = resized(table, cap);
    }
    let Some((at, found)) = load_find(table, id) else {
        return false;
    };
    let (cur, rate) = if found {
        (entry_at(table, at, now_ms, ttl_ms), rate_at(table, at))
    } else {
        (Load::default(), 0)
    };
    let clamp = |cur: u32, d: i64| (cur as i64).saturating_add(d).clamp(0, u32::MAX as i64) as u32;
    let req = clamp(cur.requests, delta.requests as i64);
    let pre = clamp(cur.prefill_tokens, delta.prefill_tokens);
    let dec = clamp(cur.decode_tokens, delta.decode_tokens);
    // Booked prefill joins the end of the queue; a release leaves what is left of it.
    let backlog = clamp(cur.backlog, delta.prefill_tokens.max(0)).min(pre);
    let rate = match delta.rate {
        RateNote::Keep => rate,
        RateNote::Set(r) => r,
        RateNote::Sample(s) => learn_rate(rate, s),
    };
    write_entry(
        table,
        at,
        id,
        Load {
            requests: req,
            prefill_tokens: pre,
            decode_tokens: dec,
            backlog,
        },
        rate,
        now_ms,
    )
}

fn write_entry(table: &mut [u8], at: usize, id: LoadId, l: Load, rate: u32, now_ms: u64) -> bool {
    let Some(e) = table.get_mut(at..at + LOAD_ENTRY) else {
        return false;
    };
    e[..8].copy_from_slice(&id.0.to_le_bytes());
    let counts = (l.requests as u64) | (l.prefill_tokens as u64) << 32;
    e[8..16].copy_from_slice(&counts.to_le_bytes());
    let decode = (l.decode_tokens as u64) | (l.backlog as u64) << 32;
    e[16..24].copy_from_slice(&decode.to_le_bytes());
    e[24..32].copy_from_slice(&now_ms.to_le_bytes());
    e[32..40].copy_from_slice(&u64::from(rate).to_le_bytes());
    true
}

/// Clears `id`'s counts when its entry was last changed before `older_than_ms`: the engine
/// says it is idle while the books still hold requests, which leaked (a lost `on_log`).
/// A change after that instant is a request booked since, which the engine may not have
/// seen yet. Returns whether anything was cleared.
pub fn load_clear_stale(table: &mut [u8], id: LoadId, older_than_ms: u64) -> bool {
    match load_find(table, id) {
        // Counts already at zero are nothing to clear (an engine idle since this gateway's
        // last request there), so they are not reported as a leak repaired.
        Some((at, true)) if le_u64(table, at + 24) < older_than_ms && !holds_nothing(table, at) => {
            let rate = rate_at(table, at);
            write_entry(table, at, id, Load::default(), rate, older_than_ms)
        }
        _ => false,
    }
}

/// [`load_add`] on the shared load key, with CAS retries.
///
/// # Errors
/// A host failure, or [`StoreError::CasMismatch`] after [`CAS_RETRIES`](super::CAS_RETRIES) lost races.
pub fn load_update<S: Store>(
    store: &S,
    keys: &Keys,
    capacity: u32,
    id: LoadId,
    delta: LoadDelta,
    now_ms: u64,
    ttl_ms: u64,
) -> Result<bool, StoreError> {
    load_update_seen(store, keys, None, capacity, id, delta, now_ms, ttl_ms)
}

/// [`load_update`] starting from the table as `seen` (read for the decision, and no longer
/// needed) and its CAS token: while no other VM has written since, the change costs one
/// write and no read. `None`, a token of 0 (no table was seen) or a lost race falls back to
/// reading it.
///
/// # Errors
/// As [`load_update`].
#[allow(clippy::too_many_arguments)]
pub fn load_update_seen<S: Store>(
    store: &S,
    keys: &Keys,
    seen: Option<(Vec<u8>, u32)>,
    capacity: u32,
    id: LoadId,
    delta: LoadDelta,
    now_ms: u64,
    ttl_ms: u64,
) -> Result<bool, StoreError> {
    let first = seen.filter(|(_, cas)| *cas != 0);
    update_value(store, keys.load(), first, |t| {
        load_add(t, capacity, id, delta, now_ms, ttl_ms)
    })
}
