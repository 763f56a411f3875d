//! Speculative block holders: after a decision the chosen worker is taken to hold the
//! request's blocks for a short time-to-live, so siblings that arrive before the engine's KV
//! events reach the mirror follow it (vllm-router and Dynamo do the same).
//!
//! Bounded: a fixed number of shared-data values (shards, by the prompt's first block key) of
//! fixed capacity each. A request stores its block keys at a few
//! depths only ([`stored_depths`]: powers of two and the last full block), not every block; a
//! sibling's speculative match is the deepest stored depth whose key it shares. An insert
//! probes [`PROBE`] entries from `key % capacity` and takes the same key, a free or expired
//! entry, or else evicts the entry that expires first (counted by the caller).
//!
//! Entries are this gateway's own decisions or another gateway's, passed on by the collector
//! (feed op `Booked`): [`spec_share`] marks the latter, so that only the former are reported
//! ([`spec_own_since`]) and nothing echoes between gateways.
//!
//! # Layout
//! `format u8`, then `capacity × (key u64, slot u32, blocks u32, expires_ms u64)`; key 0 is a
//! free entry; the slot's top bit marks another gateway's entry.

use crate::codec::le_u64;
use crate::scope::BlockKey;

use super::keys::LAYOUT_VERSION;

const ENTRY: usize = 24;
/// Entries an insert or lookup probes.
pub const PROBE: usize = 8;
const FORMAT: u8 = LAYOUT_VERSION | 0x40;
/// Slot bit of an entry another gateway booked (slots are far below it).
const SHARED: u32 = 1 << 31;

/// The depths (in blocks, 1-based) a prompt of `blocks` full blocks is stored at, ascending:
/// 1, 2, 4, ... up to `blocks`, and `blocks` itself.
pub fn stored_depths(blocks: u32) -> impl Iterator<Item = u32> {
    let pow = (0..32).map(|i| 1u32 << i).take_while(move |d| *d <= blocks);
    let last = (blocks > 0 && !blocks.is_power_of_two()).then_some(blocks);
    pow.chain(last)
}

fn capacity(table: &[u8]) -> usize {
    if table.first() != Some(&FORMAT) || !(table.len() - 1).is_multiple_of(ENTRY) {
        return 0;
    }
    (table.len() - 1) / ENTRY
}

fn read_u32(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .map_or(0, |s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

/// What an insert did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Insert {
    /// Stored in a free, expired or same-key entry.
    Stored,
    /// Stored over a live entry of another key.
    Evicted,
}

/// Records that `slot` holds `blocks` leading blocks whose last key is `key`, until
/// `now_ms + ttl_ms`. `table` is (re)made with `cap` entries when it has another shape.
pub fn spec_insert(
    table: &mut Vec<u8>,
    cap: u32,
    key: BlockKey,
    slot: u32,
    blocks: u32,
    now_ms: u64,
    ttl_ms: u64,
) -> Insert {
    let want = cap.max(1) as usize;
    if capacity(table) != want {
        table.clear();
        table.push(FORMAT);
        table.resize(1 + want * ENTRY, 0);
    }
    // Key 0 marks a free entry; a real key of 0 is stored as 1 (a rare, harmless alias).
    let k = key.0.max(1);
    let start = (k % want as u64) as usize;
    let mut victim: Option<(usize, u64)> = None;
    let mut at = None;
    for p in 0..PROBE.min(want) {
        let e = 1 + ((start + p) % want) * ENTRY;
        let (ek, expires) = (le_u64(table, e), le_u64(table, e + 16));
        if ek == k || ek == 0 || expires <= now_ms {
            at = Some(e);
            break;
        }
        if victim.is_none_or(|(_, v)| expires < v) {
            victim = Some((e, expires));
        }
    }
    let (e, result) = match (at, victim) {
        (Some(e), _) => (e, Insert::Stored),
        (None, Some((e, _))) => (e, Insert::Evicted),
        (None, None) => return Insert::Evicted,
    };
    if let Some(entry) = table.get_mut(e..e + ENTRY) {
        entry[..8].copy_from_slice(&k.to_le_bytes());
        entry[8..12].copy_from_slice(&slot.to_le_bytes());
        entry[12..16].copy_from_slice(&blocks.to_le_bytes());
        entry[16..24].copy_from_slice(&now_ms.saturating_add(ttl_ms).to_le_bytes());
    }
    result
}

/// [`spec_insert`] for another gateway's decision: read like an own entry, never reported.
pub fn spec_share(
    table: &mut Vec<u8>,
    cap: u32,
    key: BlockKey,
    slot: u32,
    blocks: u32,
    now_ms: u64,
    ttl_ms: u64,
) -> Insert {
    spec_insert(table, cap, key, slot | SHARED, blocks, now_ms, ttl_ms)
}

/// This gateway's own live entries that expire after `after_ms`: `(key, slot, blocks,
/// expires_ms)`. With one time-to-live for every entry, those written since `after_ms − ttl`.
pub fn spec_own_since(
    table: &[u8],
    after_ms: u64,
    now_ms: u64,
) -> impl Iterator<Item = (BlockKey, u32, u32, u64)> + '_ {
    (0..capacity(table)).filter_map(move |i| {
        let e = 1 + i * ENTRY;
        let (key, slot) = (le_u64(table, e), read_u32(table, e + 8));
        let expires = le_u64(table, e + 16);
        (key != 0 && slot & SHARED == 0 && expires > after_ms.max(now_ms))
            .then(|| (BlockKey(key), slot, read_u32(table, e + 12), expires))
    })
}

/// Whether the table already says what an insert of (`key`, `slot`, `blocks`) would, as an own
/// entry with more than `min_left_ms` to live: the insert can wait (the decision repeated a
/// recent one; writing would only push the expiry on).
pub fn spec_current(
    table: &[u8],
    key: BlockKey,
    slot: u32,
    blocks: u32,
    now_ms: u64,
    min_left_ms: u64,
) -> bool {
    entry_of(table, key).is_some_and(|e| {
        read_u32(table, e + 8) == slot
            && read_u32(table, e + 12) == blocks
            && le_u64(table, e + 16) > now_ms.saturating_add(min_left_ms)
    })
}

/// The live holder of `key`: `(slot, blocks)`.
pub fn spec_lookup(table: &[u8], key: BlockKey, now_ms: u64) -> Option<(u32, u32)> {
    spec_entry(table, key, now_ms).map(|(slot, blocks, _)| (slot, blocks))
}

/// The live entry of `key`: `(slot, blocks, expires_ms)` (its age is its time-to-live minus
/// what is left of it).
pub fn spec_entry(table: &[u8], key: BlockKey, now_ms: u64) -> Option<(u32, u32, u64)> {
    let e = entry_of(table, key)?;
    let expires = le_u64(table, e + 16);
    let slot = read_u32(table, e + 8) & !SHARED;
    (expires > now_ms).then(|| (slot, read_u32(table, e + 12), expires))
}

/// The offset of `key`'s entry among the [`PROBE`] entries an insert of it would probe, live or
/// not.
fn entry_of(table: &[u8], key: BlockKey) -> Option<usize> {
    let cap = capacity(table);
    if cap == 0 {
        return None;
    }
    let k = key.0.max(1);
    let start = (k % cap as u64) as usize;
    (0..PROBE.min(cap))
        .map(|p| 1 + ((start + p) % cap) * ENTRY)
        .find(|&e| le_u64(table, e) == k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depths_are_powers_of_two_and_the_last_block() {
        assert_eq!(stored_depths(0).collect::<Vec<_>>(), Vec::<u32>::new());
        assert_eq!(stored_depths(1).collect::<Vec<_>>(), [1]);
        assert_eq!(stored_depths(8).collect::<Vec<_>>(), [1, 2, 4, 8]);
        assert_eq!(stored_depths(11).collect::<Vec<_>>(), [1, 2, 4, 8, 11]);
    }

    #[test]
    fn entries_expire_and_the_soonest_to_expire_is_evicted() {
        let mut t = Vec::new();
        assert_eq!(
            spec_insert(&mut t, 4, BlockKey(8), 3, 5, 0, 100),
            Insert::Stored
        );
        assert_eq!(spec_lookup(&t, BlockKey(8), 50), Some((3, 5)));
        assert_eq!(spec_lookup(&t, BlockKey(8), 100), None, "expired");
        assert_eq!(spec_lookup(&t, BlockKey(9), 50), None);
        // Same key: overwritten in place.
        assert_eq!(
            spec_insert(&mut t, 4, BlockKey(8), 1, 6, 10, 100),
            Insert::Stored
        );
        assert_eq!(spec_lookup(&t, BlockKey(8), 50), Some((1, 6)));
        // Fill the other three, then a fifth key evicts the one expiring first (key 8, at 110).
        for (i, k) in [1u64, 2, 3].into_iter().enumerate() {
            let r = spec_insert(&mut t, 4, BlockKey(k), 0, 1, 20 + i as u64, 100);
            assert_eq!(r, Insert::Stored);
        }
        assert_eq!(
            spec_insert(&mut t, 4, BlockKey(5), 2, 2, 30, 100),
            Insert::Evicted
        );
        assert_eq!(spec_lookup(&t, BlockKey(8), 50), None);
        assert_eq!(spec_lookup(&t, BlockKey(5), 50), Some((2, 2)));
        assert_eq!(t.len(), 1 + 4 * ENTRY, "fixed size");
        // After everything expired, inserts reuse entries without evicting.
        assert_eq!(
            spec_insert(&mut t, 4, BlockKey(77), 0, 1, 1000, 100),
            Insert::Stored
        );
    }

    #[test]
    fn only_own_entries_written_since_a_time_are_reported() {
        let mut t = Vec::new();
        spec_insert(&mut t, 8, BlockKey(1), 3, 1, 0, 100);
        spec_insert(&mut t, 8, BlockKey(2), 3, 2, 50, 100);
        spec_share(&mut t, 8, BlockKey(3), 4, 4, 60, 100);
        // Shared entries read like own ones.
        assert_eq!(spec_lookup(&t, BlockKey(3), 70), Some((4, 4)));
        let own = |t: &[u8], after, now| spec_own_since(t, after, now).collect::<Vec<_>>();
        assert_eq!(
            own(&t, 0, 100),
            [(BlockKey(2), 3, 2, 150)],
            "key 1 expired, key 3 is another gateway's"
        );
        assert_eq!(own(&t, 0, 10).len(), 2);
        assert_eq!(
            own(&t, 120, 10),
            [(BlockKey(2), 3, 2, 150)],
            "written after 20"
        );
        assert!(own(&t, 150, 10).is_empty());
        // An own decision over a shared entry makes it own again.
        spec_insert(&mut t, 8, BlockKey(3), 1, 4, 70, 100);
        assert_eq!(own(&t, 160, 70), [(BlockKey(3), 1, 4, 170)]);
    }

    #[test]
    fn an_insert_is_current_only_for_the_same_own_holder_with_life_left() {
        let mut t = Vec::new();
        spec_insert(&mut t, 8, BlockKey(1), 3, 4, 0, 100);
        spec_share(&mut t, 8, BlockKey(2), 3, 4, 0, 100);
        assert!(spec_current(&t, BlockKey(1), 3, 4, 40, 50));
        assert!(
            !spec_current(&t, BlockKey(1), 3, 4, 60, 50),
            "half its life gone"
        );
        assert!(
            !spec_current(&t, BlockKey(1), 2, 4, 40, 50),
            "another holder"
        );
        assert!(
            !spec_current(&t, BlockKey(1), 3, 5, 40, 50),
            "another depth"
        );
        assert!(
            !spec_current(&t, BlockKey(2), 3, 4, 40, 50),
            "another gateway's entry"
        );
        assert!(!spec_current(&t, BlockKey(9), 3, 4, 40, 50), "absent");
        assert!(!spec_current(&[], BlockKey(1), 3, 4, 40, 50));
    }

    #[test]
    fn garbage_reads_as_empty() {
        assert_eq!(spec_lookup(&[FORMAT, 1, 2], BlockKey(1), 0), None);
        assert_eq!(spec_lookup(&[], BlockKey(1), 0), None);
        let mut t = vec![9u8; 7];
        assert_eq!(
            spec_insert(&mut t, 2, BlockKey(1), 0, 1, 0, 10),
            Insert::Stored
        );
        assert_eq!(spec_lookup(&t, BlockKey(1), 5), Some((0, 1)));
    }
}
