//! Speculative holders passed between gateway replicas. A gateway's speculative table only
//! knows its own decisions; another gateway learns that an engine now holds a prefix when the
//! engine's KV events reach it through the collector, a prefill later. Meanwhile a sibling
//! prompt arriving there goes wherever load sends it and computes the prefix again. So each
//! gateway posts its new own entries with its load report ([`own_holds`]), the collector hands
//! them to every other gateway once (feed op `Held`), and each adds them to its own table
//! ([`take_peer_holds`]), marked as another's so they are never reported back.

use super::matches::{SPECULATIVE_ENTRIES, SPECULATIVE_SHARDS};
use crate::event::WorkerId;
use crate::feed::Op;
use crate::mirror::{self, spec_own_since, spec_share, Insert, Keys, Store, StoreError};
use crate::scope::BlockKey;

/// One speculative entry as it travels between gateways.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerHold {
    /// The speculative table shard it belongs to.
    pub shard: u32,
    /// The key of the prompt's first `blocks` blocks.
    pub key: BlockKey,
    /// The worker slot the request went to.
    pub slot: u32,
    /// How many leading blocks `key` covers.
    pub blocks: u32,
    /// What is left of its time-to-live, ms.
    pub ttl_ms: u32,
}

/// This gateway's own speculative entries that expire after `after_ms` (written since
/// `after_ms − ttl`), at most `max`, the latest first when there are more.
pub fn own_holds<S: Store>(
    store: &S,
    keys: &Keys,
    after_ms: u64,
    now_ms: u64,
    max: usize,
) -> Vec<PeerHold> {
    let mut out = Vec::new();
    for shard in 0..SPECULATIVE_SHARDS {
        let Ok((Some(table), _)) = store.get(&keys.speculative(shard)) else {
            continue;
        };
        out.extend(
            spec_own_since(&table, after_ms, now_ms).map(|(key, slot, blocks, expires)| PeerHold {
                shard,
                key,
                slot,
                blocks,
                ttl_ms: expires.saturating_sub(now_ms).min(u32::MAX.into()) as u32,
            }),
        );
    }
    if out.len() > max {
        out.sort_by_key(|h| std::cmp::Reverse(h.ttl_ms));
        out.truncate(max);
    }
    out
}

/// What [`take_peer_holds`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Taken {
    /// Entries stored.
    pub stored: u32,
    /// Live entries evicted to make room.
    pub evicted: u32,
    /// Ops refused: a shard this gateway does not have, or a time-to-live of 0.
    pub refused: u32,
}

/// Adds the `Held` ops among `ops` to this gateway's speculative table, one write per shard.
/// Their worker slots must be of the index this gateway routes on (the caller checks the
/// page's epoch).
///
/// # Errors
/// The shared data refused a write; the shards before it are stored.
pub fn take_peer_holds<'a, S: Store>(
    store: &S,
    keys: &Keys,
    ops: impl IntoIterator<Item = &'a Op>,
    now_ms: u64,
) -> Result<Taken, StoreError> {
    let mut taken = Taken::default();
    let mut by_shard: Vec<Vec<(BlockKey, WorkerId, u32, u32)>> =
        vec![Vec::new(); SPECULATIVE_SHARDS as usize];
    for op in ops {
        let &Op::Held {
            worker,
            shard,
            key,
            blocks,
            ttl_ms,
        } = op
        else {
            continue;
        };
        match by_shard.get_mut(shard as usize) {
            Some(holds) if ttl_ms > 0 => holds.push((key, worker, blocks, ttl_ms)),
            _ => taken.refused += 1,
        }
    }
    for (shard, holds) in by_shard.iter().enumerate() {
        if holds.is_empty() {
            continue;
        }
        let (mut stored, mut evicted) = (0, 0);
        mirror::update_value(store, &keys.speculative(shard as u32), None, |table| {
            (stored, evicted) = (0, 0);
            for &(key, worker, blocks, ttl) in holds {
                let ins = spec_share(
                    table,
                    SPECULATIVE_ENTRIES,
                    key,
                    worker.0,
                    blocks,
                    now_ms,
                    ttl.into(),
                );
                stored += 1;
                evicted += u32::from(ins == Insert::Evicted);
            }
            true
        })?;
        taken.stored += stored;
        taken.evicted += evicted;
    }
    Ok(taken)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lookup::WorkerMatch;
    use crate::mirror::{BucketView, MemStore, PrefixView, SyncState};
    use crate::router::{remember, speculative};

    fn held(worker: u32, shard: u32, key: u64, blocks: u32, ttl_ms: u32) -> Op {
        Op::Held {
            worker: WorkerId(worker),
            shard,
            key: BlockKey(key),
            blocks,
            ttl_ms,
        }
    }

    #[test]
    fn a_peers_holds_are_read_like_own_ones_and_never_passed_back() {
        let (store, keys) = (MemStore::new(), Keys::new("kv"));
        let ops = [
            held(2, 3, 11, 1, 500),
            held(2, 3, 12, 2, 500),
            held(1, 99, 13, 1, 500),
            held(1, 4, 14, 1, 0),
            Op::WorkerGone { id: WorkerId(7) },
        ];
        let t = take_peer_holds(&store, &keys, &ops, 1000).unwrap();
        assert_eq!(
            t,
            Taken {
                stored: 2,
                evicted: 0,
                refused: 2
            }
        );
        let table = store.get(&keys.speculative(3)).unwrap().0.unwrap();
        assert_eq!(
            mirror::spec_lookup(&table, BlockKey(12), 1499),
            Some((2, 2))
        );
        assert_eq!(mirror::spec_lookup(&table, BlockKey(12), 1500), None);
        assert!(own_holds(&store, &keys, 0, 1000, 100).is_empty());
    }

    fn view<'a>(
        store: &'a MemStore,
        keys: &'a Keys,
        tokens: &'a [u32],
    ) -> PrefixView<'a, MemStore> {
        let state = SyncState::default();
        PrefixView::new(
            BucketView::new(store, keys, &state, 8),
            tokens,
            16,
            crate::hash::seed(None, None),
            crate::scope::ScopeId::of("default", "m", None, None),
            Vec::new(),
        )
    }

    #[test]
    fn own_decisions_are_passed_on_once() {
        let (store, keys) = (MemStore::new(), Keys::new("kv"));
        let tokens: Vec<u32> = (0..64).collect();
        let view = view(&store, &keys, &tokens);
        let read = speculative(&store, &keys, &view, 4, 100, &mut Vec::new());
        remember(&store, &keys, &view, read, 4, 5, 100, 2000).unwrap();
        let holds = own_holds(&store, &keys, 0, 150, 100);
        // Stored at depths 1, 2 and 4.
        assert_eq!(holds.len(), 3);
        assert!(holds.iter().all(|h| h.slot == 5 && h.ttl_ms == 1950));
        // The next report asks from the last one's time plus the time-to-live: nothing new.
        assert!(own_holds(&store, &keys, 150 + 2000, 200, 100).is_empty());
        // At most `max`, the freshest kept.
        assert_eq!(own_holds(&store, &keys, 0, 150, 2).len(), 2);
        // Another gateway takes them, and a sibling prompt there finds the holder.
        let other = MemStore::new();
        let ops: Vec<Op> = holds
            .iter()
            .map(|h| held(h.slot, h.shard, h.key.0, h.blocks, h.ttl_ms))
            .collect();
        take_peer_holds(&other, &keys, &ops, 160).unwrap();
        let view = super::tests::view(&other, &keys, &tokens);
        let mut matches: Vec<WorkerMatch> = Vec::new();
        speculative(&other, &keys, &view, 4, 170, &mut matches);
        assert_eq!(matches.len(), 1);
        assert_eq!(
            (matches[0].worker, matches[0].blocks),
            (WorkerId(5), [4; 3])
        );
    }
}
