//! A router-independent floor for a trace's TTFT: every request's TTFT had it waited for
//! nothing, with the cache hits it would find were the fleet's caches one LRU cache of their
//! combined size.
//!
//! Why this reference: a router picks engines, not what they keep. Engines evict the least
//! recently used blocks, and sending a prefix to two engines only spends room twice, so the
//! fleet as one LRU is about the most hits routing can buy, and no queue is the least wait.
//! It is not a strict bound (four separate caches fed by a router keep other prefixes than
//! one shared cache would, so a policy's own hits can land elsewhere), but a TTFT target
//! well below it asks for something routing cannot give at that load. The targets table
//! prints it beside the bound it concerns, next to the policy's own no-wait TTFT.

use std::collections::{BTreeMap, HashMap};

use kvroute_sim::replay::quantile;
use kvroute_sim::trace::TraceRecord;

/// Tokens per trace block (Mooncake's `hash_ids`).
const TRACE_BLOCK: usize = 512;

/// The fleet the floor is computed for.
#[derive(Clone, Copy, Debug)]
pub struct FleetShape {
    /// All engines' KV capacity together, tokens.
    pub capacity_tokens: usize,
    /// One engine's prefill rate, tokens per second.
    pub prefill_tokens_per_s: f64,
    /// The fixed time from the prefill's end to the first token, seconds.
    pub overhead_s: f64,
}

/// The floor's TTFT p50 and p90, seconds, and the token hit rate behind it.
pub fn fleet_lru_ttft(records: &[TraceRecord], fleet: FleetShape) -> ([f64; 2], f64) {
    let capacity = fleet.capacity_tokens / TRACE_BLOCK;
    // A prefix node per distinct (parent, block id): equal nodes are equal prefixes, exactly.
    let mut nodes: HashMap<(usize, u64), usize> = HashMap::new();
    let mut last_use: HashMap<usize, u64> = HashMap::new();
    let mut by_age: BTreeMap<u64, usize> = BTreeMap::new();
    let mut tick = 0u64;
    let (mut hit, mut total) = (0usize, 0usize);
    let mut ttft = Vec::with_capacity(records.len());
    for r in records {
        // Only whole blocks inside the prompt are cached, here as in the engines.
        let blocks = &r.hash_ids[..r.hash_ids.len().min(r.input_length / TRACE_BLOCK)];
        let mut parent = usize::MAX;
        let mut path = Vec::with_capacity(blocks.len());
        for &id in blocks {
            let fresh = nodes.len();
            parent = *nodes.entry((parent, id)).or_insert(fresh);
            path.push(parent);
        }
        let matched = path.iter().take_while(|n| last_use.contains_key(n)).count();
        let cached = matched * TRACE_BLOCK;
        hit += cached;
        total += r.input_length;
        let uncached = r.input_length - cached;
        ttft.push(uncached as f64 / fleet.prefill_tokens_per_s.max(1.0) + fleet.overhead_s);
        for n in path {
            tick += 1;
            if let Some(old) = last_use.insert(n, tick) {
                by_age.remove(&old);
            }
            by_age.insert(tick, n);
        }
        while last_use.len() > capacity {
            let Some((_, n)) = by_age.pop_first() else {
                break;
            };
            last_use.remove(&n);
        }
    }
    ttft.sort_by(f64::total_cmp);
    let rate = if total == 0 {
        0.0
    } else {
        hit as f64 / total as f64
    };
    ([quantile(&ttft, 0.5), quantile(&ttft, 0.9)], rate)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ids: &[u64], input_length: usize) -> TraceRecord {
        TraceRecord {
            timestamp: 0,
            input_length,
            output_length: 1,
            hash_ids: ids.to_vec(),
        }
    }

    const FLEET: FleetShape = FleetShape {
        capacity_tokens: 4 * TRACE_BLOCK,
        prefill_tokens_per_s: 512.0,
        overhead_s: 0.5,
    };

    #[test]
    fn a_repeated_prefix_is_a_hit_up_to_where_it_forks() {
        // Two blocks shared, the third differs: the second request prefills one block + 100.
        let t = [rec(&[1, 2, 3], 1536), rec(&[1, 2, 4], 1636)];
        let ([p50, p90], rate) = fleet_lru_ttft(&t, FLEET);
        assert_eq!(
            p90, 3.5,
            "the first request, all uncached: 3 blocks at a block a second"
        );
        assert!((p50 - (0.5 + 612.0 / 512.0)).abs() < 1e-9, "{p50}");
        assert_eq!(rate, 1024.0 / 3172.0);
    }

    #[test]
    fn the_same_block_id_under_another_parent_is_not_a_hit() {
        let t = [rec(&[1, 2], 1024), rec(&[9, 2], 1024)];
        let (_, rate) = fleet_lru_ttft(&t, FLEET);
        assert_eq!(rate, 0.0);
    }

    #[test]
    fn the_least_recently_used_prefix_is_evicted_first() {
        // Capacity 4 blocks: [1,2] then [3,4] fill it; [1,2] again refreshes it; [5,6] evicts
        // [3,4], so [1,2] still hits and [3,4] does not.
        let t = [
            rec(&[1, 2], 1024),
            rec(&[3, 4], 1024),
            rec(&[1, 2], 1024),
            rec(&[5, 6], 1024),
            rec(&[1, 2], 1024),
            rec(&[3, 4], 1024),
        ];
        let (_, rate) = fleet_lru_ttft(&t, FLEET);
        assert_eq!(rate, 4.0 / 12.0, "two of six requests hit, whole");
    }

    #[test]
    fn a_partial_last_block_is_not_cached() {
        let t = [rec(&[1, 2], 700), rec(&[1, 2], 700)];
        let (_, rate) = fleet_lru_ttft(&t, FLEET);
        assert_eq!(rate, 512.0 / 1400.0);
    }
}
