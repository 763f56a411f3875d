//! The longest-match walk, shared by the collector's in-memory [`Index`](crate::index::Index)
//! and the filter's shared-data view through the [`HolderView`] trait.
//!
//! The index is prefix-closed per worker: a worker that holds block `i` of a query holds
//! blocks `0..i` too. So the set of holders shrinks as the depth grows, and every worker's
//! match length can be found by bisection: read the holders at the middle depth, send the
//! workers found there to the deeper half and the others to the shallower half. With `k`
//! distinct match lengths that is about `k · log2(n)` reads instead of `n`, which matters when
//! every read is a lock and a copy of a shared-data value.
//!
//! Tiers are cumulative (a GPU hold also counts as a CPU and a DISK hold): a worker holds
//! depth `d` "at class `c`" when its best tier there is `c` or better. Each (worker, class)
//! pair is bisected on its own, but all pairs share the reads.

use crate::event::{Tier, WorkerId};
use crate::scope::BlockKey;

/// A set of tiers, one bit per [`Tier`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct TierMask(pub u8);

impl TierMask {
    /// The empty set.
    pub const EMPTY: TierMask = TierMask(0);

    /// The set of one tier.
    pub fn of(tier: Tier) -> TierMask {
        TierMask(1 << tier as u8)
    }

    /// This set plus `tier`.
    pub fn with(self, tier: Tier) -> TierMask {
        TierMask(self.0 | 1 << tier as u8)
    }

    /// This set without `tier`.
    pub fn without(self, tier: Tier) -> TierMask {
        TierMask(self.0 & !(1 << tier as u8))
    }

    /// Whether `tier` is in the set.
    pub fn contains(self, tier: Tier) -> bool {
        self.0 & (1 << tier as u8) != 0
    }

    /// Whether no tier is in the set.
    pub fn is_empty(self) -> bool {
        self.0 & 0b111 == 0
    }

    /// The best (fastest) tier in the set.
    pub fn best(self) -> Option<Tier> {
        Tier::ALL.into_iter().find(|&t| self.contains(t))
    }
}

/// Who holds one block: the view the walk reads.
///
/// `K` is what names a block: a [`BlockKey`] for the collector's index, a depth into one
/// prompt for the filter's lazily hashed view.
pub trait HolderView<K: Copy = BlockKey> {
    /// Appends every worker holding `key`, with the tiers it holds it in, to `out`.
    fn holders(&self, key: K, out: &mut Vec<(WorkerId, TierMask)>);

    /// Like [`HolderView::holders`], but only the holders among `workers` are needed (others
    /// may be appended too: the walk ignores them). A view that can look workers up faster
    /// than it lists a block's holders overrides this.
    fn holders_among(&self, key: K, workers: &[WorkerId], out: &mut Vec<(WorkerId, TierMask)>) {
        let _ = workers;
        self.holders(key, out);
    }
}

/// One worker's match: the number of leading query blocks it holds, per cumulative tier class
/// (`blocks[Tier::Gpu as usize]` ≤ `blocks[Tier::Cpu]` ≤ `blocks[Tier::Disk]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerMatch {
    /// The worker.
    pub worker: WorkerId,
    /// Leading blocks held per cumulative tier class: GPU, CPU, DISK.
    pub blocks: [u32; 3],
}

impl WorkerMatch {
    /// The longest match over all tiers, in blocks.
    pub fn longest(&self) -> u32 {
        self.blocks[Tier::Disk as usize]
    }
}

/// Counts of the walk, for metrics and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WalkStats {
    /// Holder reads made.
    pub reads: u32,
}

/// Finds every worker's longest prefix match of `keys` (a query's block keys, in order).
/// Workers holding none of the first block are not reported. Results are sorted by worker.
pub fn longest_matches<K: Copy>(
    view: &impl HolderView<K>,
    keys: &[K],
    stats: &mut WalkStats,
) -> Vec<WorkerMatch> {
    let mut matches: Vec<WorkerMatch> = Vec::new();
    if keys.is_empty() {
        return matches;
    }
    let mut buf = Vec::new();
    view.holders(keys[0], &mut buf);
    stats.reads += 1;
    if buf.is_empty() {
        return matches;
    }
    buf.sort_unstable_by_key(|(w, _)| *w);
    buf.dedup_by(|a, b| {
        // The same worker reported twice (several tier entries): merge the masks.
        if a.0 == b.0 {
            b.1 = TierMask(a.1 .0 | b.1 .0);
            true
        } else {
            false
        }
    });
    let mut candidates: Vec<Candidate> = Vec::with_capacity(buf.len() * 3);
    for &(worker, mask) in &buf {
        let idx = matches.len();
        matches.push(WorkerMatch {
            worker,
            blocks: [0; 3],
        });
        for class in Tier::ALL {
            if holds_at(mask, class) {
                matches[idx].blocks[class as usize] = 1;
                candidates.push(Candidate {
                    idx: idx as u32,
                    class,
                });
            }
        }
    }
    if keys.len() > 1 {
        // Worker ids are small and dense (the collector interns them): a flat array finds a
        // holder's match in one step.
        let max_worker = matches
            .iter()
            .map(|m| m.worker.0 as usize)
            .max()
            .unwrap_or(0);
        let mut slot_of = vec![u32::MAX; max_worker + 1];
        for (i, m) in matches.iter().enumerate() {
            slot_of[m.worker.0 as usize] = i as u32;
        }
        let marks = vec![TierMask::EMPTY; matches.len()];
        let mut walk = Walk {
            view,
            keys,
            matches: &mut matches,
            slot_of,
            buf,
            marks,
            workers: Vec::new(),
            stats,
        };
        walk.bisect(1, keys.len() - 1, &mut candidates);
    }
    matches
}

#[derive(Clone, Copy)]
struct Candidate {
    idx: u32,
    class: Tier,
}

/// Whether a hold in `mask` counts at cumulative class `class`.
fn holds_at(mask: TierMask, class: Tier) -> bool {
    mask.best().is_some_and(|best| best <= class)
}

struct Walk<'a, V, K> {
    view: &'a V,
    keys: &'a [K],
    matches: &'a mut Vec<WorkerMatch>,
    /// Worker id → index in `matches` (`u32::MAX`: not a candidate).
    slot_of: Vec<u32>,
    buf: Vec<(WorkerId, TierMask)>,
    /// Per match, the tiers the current read found it holding; cleared after each read.
    marks: Vec<TierMask>,
    /// The current candidates' workers, for [`HolderView::holders_among`].
    workers: Vec<WorkerId>,
    stats: &'a mut WalkStats,
}

impl<K: Copy, V: HolderView<K>> Walk<'_, V, K> {
    /// Every candidate is known to hold depth `lo - 1`; finds which of `lo..=hi` they hold.
    fn bisect(&mut self, lo: usize, hi: usize, candidates: &mut [Candidate]) {
        if candidates.is_empty() || lo > hi {
            return;
        }
        let mid = lo + (hi - lo) / 2;
        self.buf.clear();
        self.workers.clear();
        self.workers.extend(
            candidates
                .iter()
                .map(|c| self.matches[c.idx as usize].worker),
        );
        self.view
            .holders_among(self.keys[mid], &self.workers, &mut self.buf);
        self.stats.reads += 1;
        for &(worker, mask) in &self.buf {
            if let Some(&i) = self
                .slot_of
                .get(worker.0 as usize)
                .filter(|&&i| i != u32::MAX)
            {
                self.marks[i as usize] = TierMask(self.marks[i as usize].0 | mask.0);
            }
        }
        // Partition in place: holders of `mid` to the front.
        let mut split = 0;
        for i in 0..candidates.len() {
            let c = candidates[i];
            if holds_at(self.marks[c.idx as usize], c.class) {
                self.matches[c.idx as usize].blocks[c.class as usize] = mid as u32 + 1;
                candidates.swap(split, i);
                split += 1;
            }
        }
        for &(worker, _) in &self.buf {
            if let Some(&i) = self
                .slot_of
                .get(worker.0 as usize)
                .filter(|&&i| i != u32::MAX)
            {
                self.marks[i as usize] = TierMask::EMPTY;
            }
        }
        let (deeper, shallower) = candidates.split_at_mut(split);
        self.bisect(mid + 1, hi, deeper);
        if mid > lo {
            self.bisect(lo, mid - 1, shallower);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Worker w holds the first `depth[w]` keys in tier `tier[w]`.
    struct Chains {
        keys: Vec<BlockKey>,
        holds: Vec<(WorkerId, usize, Tier)>,
    }

    impl HolderView for Chains {
        fn holders(&self, key: BlockKey, out: &mut Vec<(WorkerId, TierMask)>) {
            let d = self.keys.iter().position(|&k| k == key).unwrap();
            for &(w, depth, tier) in &self.holds {
                if d < depth {
                    out.push((w, TierMask::of(tier)));
                }
            }
        }
    }

    #[test]
    fn bisection_finds_each_workers_depth_in_log_reads() {
        let keys: Vec<BlockKey> = (0..512).map(BlockKey).collect();
        let holds = vec![
            (WorkerId(0), 512, Tier::Gpu),
            (WorkerId(1), 300, Tier::Cpu),
            (WorkerId(2), 1, Tier::Disk),
            (WorkerId(3), 0, Tier::Gpu),
        ];
        let view = Chains {
            keys: keys.clone(),
            holds,
        };
        let mut stats = WalkStats::default();
        let got: HashMap<u32, [u32; 3]> = longest_matches(&view, &keys, &mut stats)
            .into_iter()
            .map(|m| (m.worker.0, m.blocks))
            .collect();
        assert_eq!(got[&0], [512, 512, 512]);
        assert_eq!(got[&1], [0, 300, 300]);
        assert_eq!(got[&2], [0, 0, 1]);
        assert!(!got.contains_key(&3));
        assert!(stats.reads <= 3 * 10 + 1, "reads: {}", stats.reads);
    }
}
