//! The in-flight load table: requests and prefill tokens routed to each worker and not yet
//! finished, shared by every VM under one key with a time-to-live.

use crate::codec::le_u64;

use super::keys::{Keys, CAS_RETRIES, LAYOUT_VERSION};
use super::store::{Store, StoreError};

/// In-flight load of one worker (local mode: a slot; remote mode: an instance).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Load {
    /// Requests routed and not finished.
    pub requests: u32,
    /// Their uncached prompt tokens: prefill work queued.
    pub prefill_tokens: u32,
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
}

const LOAD_ENTRY: usize = 24;

/// The load of `id` (nonzero) in a load table value: zero when absent or not updated for
/// `ttl_ms` (a VM that died never releases its counts; the time-to-live forgets them).
///
/// # Layout
/// `version u8`, then `capacity × (id u64, requests u32, prefill_tokens u32, updated_ms u64)`,
/// open addressing from `id % capacity`; id 0 is a free entry.
pub fn load_get(table: &[u8], id: LoadId, now_ms: u64, ttl_ms: u64) -> Load {
    match load_find(table, id) {
        Some((at, true)) => {
            let updated = le_u64(table, at + 16);
            if now_ms.saturating_sub(updated) > ttl_ms {
                Load::default()
            } else {
                Load {
                    requests: le_u64(table, at + 8) as u32,
                    prefill_tokens: (le_u64(table, at + 8) >> 32) as u32,
                }
            }
        }
        _ => Load::default(),
    }
}

/// Finds `id`'s entry: `(offset, true)`, or the first free entry `(offset, false)`.
fn load_find(table: &[u8], id: LoadId) -> Option<(usize, bool)> {
    let id = id.0;
    if table.first() != Some(&LAYOUT_VERSION) || id == 0 {
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
        if free.is_none() && le_u64(table, at + 8) == 0 {
            // An entry with nothing in flight can be reused.
            free = Some(at);
        }
    }
    free.map(|at| (at, false))
}

/// Adds `requests` and `prefill_tokens` (negative to release) to `id`'s load in `table`
/// (made with `capacity` entries when empty), saturating at zero. Expired counts restart
/// from zero. Returns `false` when the table is full of busy entries.
pub fn load_add(
    table: &mut Vec<u8>,
    capacity: u32,
    id: LoadId,
    requests: i32,
    prefill_tokens: i64,
    now_ms: u64,
    ttl_ms: u64,
) -> bool {
    let cap = capacity.max(1) as usize;
    if table.first() != Some(&LAYOUT_VERSION)
        || !(table.len() - 1).is_multiple_of(LOAD_ENTRY)
        || (table.len() - 1) / LOAD_ENTRY != cap
    {
        table.clear();
        table.push(LAYOUT_VERSION);
        table.resize(1 + cap * LOAD_ENTRY, 0);
    }
    let Some((at, found)) = load_find(table, id) else {
        return false;
    };
    let cur = if found {
        load_get(table, id, now_ms, ttl_ms)
    } else {
        Load::default()
    };
    let req = (cur.requests as i64 + requests as i64).clamp(0, u32::MAX as i64) as u32;
    let pre = (cur.prefill_tokens as i64 + prefill_tokens).clamp(0, u32::MAX as i64) as u32;
    let Some(e) = table.get_mut(at..at + LOAD_ENTRY) else {
        return false;
    };
    e[..8].copy_from_slice(&id.0.to_le_bytes());
    e[8..16].copy_from_slice(&((req as u64) | (pre as u64) << 32).to_le_bytes());
    e[16..24].copy_from_slice(&now_ms.to_le_bytes());
    true
}

/// [`load_add`] on the shared load key, with CAS retries.
///
/// # Errors
/// A host failure, or [`StoreError::CasMismatch`] after [`CAS_RETRIES`] lost races.
#[allow(clippy::too_many_arguments)]
pub fn load_update<S: Store>(
    store: &S,
    keys: &Keys,
    capacity: u32,
    id: LoadId,
    requests: i32,
    prefill_tokens: i64,
    now_ms: u64,
    ttl_ms: u64,
) -> Result<bool, StoreError> {
    let key = keys.load();
    for _ in 0..CAS_RETRIES {
        let (value, cas) = store.get(&key)?;
        let mut table = value.unwrap_or_default();
        if !load_add(
            &mut table,
            capacity,
            id,
            requests,
            prefill_tokens,
            now_ms,
            ttl_ms,
        ) {
            return Ok(false);
        }
        match store.set(&key, &table, cas) {
            Ok(()) => return Ok(true),
            Err(StoreError::CasMismatch) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(StoreError::CasMismatch)
}
