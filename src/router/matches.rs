//! Where matches come from, turned into one form once: the collector's `/query` answer as
//! remote contenders (per instance) or as worker-slot matches of the local roster, and the
//! speculative holders merged into the walk's matches.

use super::decide::{rank_by, Contender, RankRule};
use super::load::InstanceLoad;
use super::roster::Roster;
use crate::api::QueryResponse;
use crate::event::WorkerId;
use crate::lookup::WorkerMatch;
use crate::mirror::{
    self, spec_current, spec_insert, spec_lookup, stored_depths, Depth, Insert, Keys, LoadId,
    PrefixView, Store, StoreError,
};

/// Remote mode's contenders, one per instance of the collector's answer (in its order), all
/// eligible (the collector answered for the request's model), with their [`LoadId`]s.
pub fn remote_contenders(
    resp: &QueryResponse,
    load: impl Fn(LoadId) -> InstanceLoad,
) -> Vec<(Contender, LoadId)> {
    resp.instances
        .iter()
        .map(|(id, m)| {
            let load_id = LoadId::instance(id);
            let mut c = Contender::new(true, load(load_id));
            c.matched = answer_blocks(m, resp.block_size);
            c.dp_rank = answer_rank(m);
            (c, load_id)
        })
        .collect()
}

/// Matched blocks of one answer entry, per cumulative tier class.
fn answer_blocks(m: &crate::api::InstanceMatch, block_size: u32) -> [u32; 3] {
    let bs = u64::from(block_size.max(1));
    let blocks = |t: u64| (t / bs).min(u32::MAX as u64) as u32;
    [
        blocks(m.gpu),
        blocks(m.cpu),
        blocks(m.disk.max(m.longest_matched)),
    ]
}

/// The rank of an answer entry holding its match ([`RankRule::MostTokens`]).
fn answer_rank(m: &crate::api::InstanceMatch) -> u32 {
    rank_by(
        RankRule::MostTokens,
        m.dp.iter()
            .filter_map(|(r, t)| r.parse::<u32>().ok().map(|r| (r, *t))),
    )
}

/// The collector's answer as matches of the local roster's worker slots, so a local decision
/// sees every instance of the roster (cold ones too) and books per slot. `None` when the
/// answer names instances and none of them is in the roster (not synced yet).
pub fn answer_on_roster(resp: &QueryResponse, roster: &Roster) -> Option<Vec<WorkerMatch>> {
    let mut out = Vec::with_capacity(resp.instances.len());
    for (id, m) in &resp.instances {
        let Some(inst) = roster.instances.iter().find(|i| i.id == *id) else {
            continue;
        };
        if let Some(slot) = inst.slot_of_rank(answer_rank(m)) {
            out.push(WorkerMatch {
                worker: WorkerId(slot),
                blocks: answer_blocks(m, resp.block_size),
            });
        }
    }
    (!out.is_empty() || resp.instances.is_empty()).then_some(out)
}

/// Counts worker slot `slot` as holding the query's first `blocks` blocks in every tier (a
/// speculative holder: a recent decision, not an event), keeping the deeper of that and
/// what it already holds.
pub fn hold(matches: &mut Vec<WorkerMatch>, slot: u32, blocks: u32) {
    match matches.iter_mut().find(|m| m.worker.0 == slot) {
        Some(m) => {
            for b in &mut m.blocks {
                *b = (*b).max(blocks);
            }
        }
        None => matches.push(WorkerMatch {
            worker: WorkerId(slot),
            blocks: [blocks; 3],
        }),
    }
}

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

/// The speculative table as read for a decision, kept for the write after it (one copy of
/// the value less per request when no other VM wrote meanwhile).
#[derive(Clone, Debug)]
pub struct SpecRead {
    shard: u32,
    table: Vec<u8>,
    cas: u32,
}

/// Adds the speculative holders of `view`'s prompt (`blocks` full blocks) to `matches`: for
/// each slot, the deepest stored depth whose key it shares. Stops at the first stored depth
/// nobody holds, so a cold prompt costs one lookup. `None` when the shard cannot be read.
pub fn speculative<S: Store, T: Store>(
    store: &T,
    keys: &Keys,
    view: &PrefixView<'_, S>,
    blocks: u32,
    now: u64,
    matches: &mut Vec<WorkerMatch>,
) -> Option<SpecRead> {
    let shard = speculative_shard(view)?;
    let (value, cas) = store.get(&keys.speculative(shard)).ok()?;
    let read = SpecRead {
        shard,
        table: value.unwrap_or_default(),
        cas,
    };
    for d in stored_depths(blocks) {
        let Some(key) = view.key_at(Depth(d - 1)) else {
            break;
        };
        let Some((slot, held)) = spec_lookup(&read.table, key, now) else {
            break;
        };
        hold(matches, slot, held.min(d));
    }
    Some(read)
}

/// Records `slot` as the holder of `view`'s prompt at its stored depths for `ttl_ms`,
/// starting from the table `read` for the decision. Returns the entries evicted to make room.
///
/// # Errors
/// The shared data refused the write.
#[allow(clippy::too_many_arguments)]
pub fn remember<S: Store, T: Store>(
    store: &T,
    keys: &Keys,
    view: &PrefixView<'_, S>,
    read: Option<SpecRead>,
    blocks: u32,
    slot: u32,
    now: u64,
    ttl_ms: u64,
) -> Result<u32, StoreError> {
    let depths: Vec<(u32, _)> = stored_depths(blocks)
        .filter_map(|d| view.key_at(Depth(d - 1)).map(|k| (d, k)))
        .collect();
    if depths.is_empty() {
        return Ok(0);
    }
    // A decision that repeats a recent one (the same worker for the same prompt, the
    // entries with over half their time to live) writes nothing: the entries bridge the time
    // until the engine's own events arrive, which a refresh every request does not shorten.
    if read.as_ref().is_some_and(|r| {
        depths
            .iter()
            .all(|&(d, k)| spec_current(&r.table, k, slot, d, now, ttl_ms / 2))
    }) {
        return Ok(0);
    }
    let Some(shard) = read
        .as_ref()
        .map(|r| r.shard)
        .or_else(|| speculative_shard(view))
    else {
        return Ok(0);
    };
    let mut evicted = 0;
    mirror::update_value(
        store,
        &keys.speculative(shard),
        read.map(|r| (r.table, r.cas)),
        |table| {
            evicted = 0;
            for &(d, k) in &depths {
                let ins = spec_insert(table, SPECULATIVE_ENTRIES, k, slot, d, now, ttl_ms);
                evicted += u32::from(ins == Insert::Evicted);
            }
            true
        },
    )?;
    Ok(evicted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::InstanceMatch;
    use crate::router::{decide, Policy, Query};
    use crate::select::SplitMix64;

    #[test]
    fn remote_answers_keep_their_rank_rule() {
        let m = |tokens: u64, dp: &[(&str, u64)]| InstanceMatch {
            gpu: tokens,
            cpu: tokens,
            disk: tokens,
            longest_matched: tokens,
            dp: dp.iter().map(|(r, t)| (r.to_string(), *t)).collect(),
            ..InstanceMatch::default()
        };
        let resp = QueryResponse {
            block_size: 16,
            query_blocks: 4,
            instances: [
                ("x".to_string(), m(20, &[("0", 17), ("1", 20)])),
                ("y".to_string(), m(40, &[("2", 40), ("1", 40)])),
            ]
            .into_iter()
            .collect(),
        };
        let cs = remote_contenders(&resp, |_| InstanceLoad::default());
        // Rank 1 has more tokens though both ranks hold one full block.
        assert_eq!((cs[0].0.dp_rank, cs[0].0.matched), (1, [1, 1, 1]));
        assert_eq!(cs[1].0.dp_rank, 1, "the lowest rank on a tie");
        assert_eq!(cs[0].1, LoadId::instance("x"));
        assert_ne!(cs[0].1, LoadId::slot(0));
        assert_eq!(rank_by(RankRule::MostCredit, [(0, 17), (1, 17)]), 0);
        let only: Vec<Contender> = cs.iter().map(|c| c.0).collect();
        let d = decide(
            &only,
            Query {
                blocks: 4,
                block_size: 16,
            },
            &Policy::default(),
            &mut SplitMix64(1),
        )
        .unwrap();
        assert_eq!((d.best, d.matched_blocks), (1, 2));
    }
}
