//! The in-memory prefix index the collector keeps: KV events in, longest matches out.
//!
//! One concern: the index's data structure (arena, per-worker trees, holder table) and the
//! operations that must keep its invariants together: apply, cascade, lookup, dump.
//!
//! # Layout
//!
//! Every (block, worker) hold is one `Node` in one arena. A node knows its worker, its scope,
//! its engine hash, its [`BlockKey`] and its place in the worker's tree (parent, first child,
//! siblings). Each worker's `by_engine` table holds only `u32` node indices and hashes through
//! the arena: an engine hash → the worker's node, to resolve parents and removals, which
//! engines name by their own hashes.
//!
//! Who holds a block is kept apart, in `Holders`: a block key → its holders, packed and
//! contiguous, so that a lookup reads one table slot and one short array per depth instead of
//! chasing nodes across the arena.
//!
//! # Semantics
//!
//! - A stored chain's scope is the worker's `(tenant, model)` with the event's LoRA name and
//!   cache salt; a chain with a parent inherits the parent's scope instead.
//! - A chain whose parent the worker does not hold is an orphan: counted, not guessed.
//! - Storing an engine hash the worker already holds adds the event's tier and otherwise
//!   changes nothing (idempotent); the chain continues from the existing node.
//! - Removing a tier from a block removes it from the block's descendants too; a block left
//!   with no tier is dropped with its whole subtree. So the index stays prefix-closed per
//!   worker: holding block `i` of a chain means holding blocks `0..i`.
//! - Each hold has a *class*: the worst of its own best tier and its parent's class. Classes
//!   only worsen along a chain, which keeps per-class matching prefix-closed for the bisection
//!   in [`lookup`]. [`Change`]s and [`HolderView`] speak in classes.
//! - A worker holds at most `max_blocks_per_worker` blocks; stores past that are counted and
//!   dropped, which bounds memory under an event flood.

use hashbrown::{HashMap, HashTable};
use serde::{Deserialize, Serialize};

use crate::event::{EngineHash, KvEvent, StoredBlock, Tier, WorkerId};
use crate::hash::{self, SeqHash};
use crate::lookup::{self, HolderView, TierMask, WalkStats, WorkerMatch};
use crate::scope::{BlockKey, ScopeId};

const NIL: u32 = u32::MAX;
/// `parent` of a node in the free list.
const FREE: u32 = u32::MAX - 1;

/// Limits of the index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexConfig {
    /// Most blocks one worker may hold; stores past it are dropped (counted).
    pub max_blocks_per_worker: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            max_blocks_per_worker: 1 << 22,
        }
    }
}

/// A change of who holds what, as the feed carries it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Change {
    /// The worker.
    pub worker: WorkerId,
    /// The hold's class (see the module doc).
    pub tier: Tier,
    /// Gained (`true`) or lost.
    pub added: bool,
    /// The block.
    pub key: BlockKey,
}

/// What one `apply` did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApplyStats {
    /// Blocks stored.
    pub stored: u64,
    /// Stores of blocks the worker already held in that tier.
    pub duplicates: u64,
    /// Removals of blocks the worker held (descendants dropped with them not counted).
    pub removed: u64,
    /// Removals of engine hashes the worker does not hold.
    pub unknown_removals: u64,
    /// Blocks whose parent the worker does not hold.
    pub orphans: u64,
    /// Blocks dropped because the worker is at its cap.
    pub capped: u64,
    /// Blocks whose token count is not the worker's block size.
    pub bad_blocks: u64,
    /// Events for a worker the index does not know.
    pub unknown_worker: u64,
    /// Blocks dropped by `AllBlocksCleared`.
    pub cleared: u64,
}

impl ApplyStats {
    /// Adds `o` to these counts.
    pub fn add(&mut self, o: &ApplyStats) {
        self.stored += o.stored;
        self.duplicates += o.duplicates;
        self.removed += o.removed;
        self.unknown_removals += o.unknown_removals;
        self.orphans += o.orphans;
        self.capped += o.capped;
        self.bad_blocks += o.bad_blocks;
        self.unknown_worker += o.unknown_worker;
        self.cleared += o.cleared;
    }
}

/// Sizes of the index, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Workers known.
    pub workers: usize,
    /// Distinct block keys.
    pub blocks: usize,
    /// (block, worker) holds.
    pub holds: usize,
    /// Scopes with at least one block.
    pub scopes: usize,
}

#[derive(Clone, Copy, Debug)]
struct Node {
    key: BlockKey,
    engine: EngineHash,
    parent: u32,
    first_child: u32,
    next_sibling: u32,
    worker: WorkerId,
    scope: u32,
    tiers: TierMask,
    class: Tier,
}

#[derive(Clone, Debug)]
struct Worker {
    tenant: String,
    model: String,
    block_size: u32,
    by_engine: HashTable<u32>,
    /// Blocks the index is sized for (its engine's cache size; 0 until known).
    capacity: usize,
}

#[derive(Clone, Copy, Debug)]
struct ScopeSlot {
    id: ScopeId,
    seed: u64,
    nodes: u32,
}

/// The prefix index: who holds which blocks, per worker, per tier class.
#[derive(Clone, Debug, Default)]
pub struct Index {
    config: IndexConfig,
    nodes: Vec<Node>,
    free: Vec<u32>,
    holders: Holders,
    workers: Vec<Option<Worker>>,
    scopes: Vec<ScopeSlot>,
    scope_ids: HashMap<ScopeId, u32>,
    free_scopes: Vec<u32>,
    holds: usize,
    /// Sum of the workers' `capacity`.
    capacity: usize,
}

/// Block keys are uniform hashes, but engines' own hashes need not be (a simulator may number
/// them, SGLang chains them): a full 64-bit finalizer (murmur3's fmix64) spreads any of them
/// over the bits hashbrown uses.
#[inline]
fn mix(mut v: u64) -> u64 {
    v ^= v >> 33;
    v = v.wrapping_mul(0xff51_afd7_ed55_8ccd);
    v ^= v >> 33;
    v = v.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    v ^ (v >> 33)
}

/// A known worker's slot. A free function over the field, not a method, so that callers can
/// hold `nodes` (the hasher of its table) at the same time.
fn worker_mut(workers: &mut [Option<Worker>], worker: WorkerId) -> Option<&mut Worker> {
    workers.get_mut(worker.0 as usize).and_then(Option::as_mut)
}

impl Index {
    /// An empty index.
    pub fn new(config: IndexConfig) -> Index {
        Index {
            config,
            ..Index::default()
        }
    }

    /// Its limits.
    pub fn config(&self) -> IndexConfig {
        self.config
    }

    /// Registers a worker with its base scope. Registering a known worker again changes
    /// nothing but its names if they match; the caller checks conflicts (it owns the registry).
    pub fn add_worker(&mut self, worker: WorkerId, tenant: &str, model: &str, block_size: u32) {
        let idx = worker.0 as usize;
        if self.workers.len() <= idx {
            self.workers.resize_with(idx + 1, || None);
        }
        if self.workers[idx].is_none() {
            self.workers[idx] = Some(Worker {
                tenant: tenant.to_owned(),
                model: model.to_owned(),
                block_size,
                by_engine: HashTable::new(),
                capacity: 0,
            });
        }
    }

    /// Whether `worker` is known.
    pub fn has_worker(&self, worker: WorkerId) -> bool {
        self.worker(worker).is_some()
    }

    /// Drops a worker and everything it held.
    pub fn remove_worker(&mut self, worker: WorkerId, changes: &mut Vec<Change>) {
        self.clear_worker(worker, changes);
        if let Some(slot) = self.workers.get_mut(worker.0 as usize) {
            if let Some(w) = slot.take() {
                self.capacity -= w.capacity;
            }
        }
    }

    /// Drops everything a worker holds, keeping its registration.
    pub fn clear_worker(&mut self, worker: WorkerId, changes: &mut Vec<Change>) -> u64 {
        let Some(w) = worker_mut(&mut self.workers, worker) else {
            return 0;
        };
        let held: Vec<u32> = w.by_engine.iter().copied().collect();
        w.by_engine.clear();
        for &n in &held {
            self.release(n, changes);
        }
        held.len() as u64
    }

    /// Makes room for `additional` more blocks of `worker` (arena, holder table and the
    /// worker's own table), so that storing them rehashes nothing. A table that must grow
    /// rehashes every entry it holds at once; a caller applying a big batch in slices calls
    /// this before the first slice, so no slice takes that cost while readers wait.
    /// Unknown workers reserve nothing.
    pub fn reserve(&mut self, worker: WorkerId, additional: usize) {
        let nodes = &self.nodes;
        let Some(w) = worker_mut(&mut self.workers, worker) else {
            return;
        };
        w.by_engine
            .reserve(additional, |&n| mix(nodes[n as usize].engine.0));
        // Freed arena slots are reused before the arena grows.
        self.nodes
            .reserve(additional.saturating_sub(self.free.len()));
        self.holders.table.reserve(additional, |e| mix(e.key.0));
    }

    /// Sizes the index for `worker` holding up to `blocks` blocks (its engine's cache size,
    /// capped at `max_blocks_per_worker`): the worker's own table now, the arena and the holder
    /// table for every sized worker together. A hash table that runs out of room doubles in
    /// one step (a new table beside the old while every entry moves), so an index left to
    /// grow steps up in memory, and stalls a slice of ingest, whenever the fleet's block count
    /// sets a new high; sized for the fleet, it never moves to a bigger table in service.
    ///
    /// The tables get room for twice what they will hold. Evictions leave deleted slots
    /// behind, and when those use up the free ones, hashbrown cleans them in place only if the
    /// table is at most half full; fuller, it moves to a table twice the size. A full cache
    /// that keeps evicting would take that step sooner or later; taken here, it is taken once,
    /// at start. The holder table is sized as if no two engines shared a block (its bound):
    /// 40–80 bytes of table a block (tables come in powers of two), beside its 40-byte node.
    /// Returns whether the size changed; unknown workers are not sized.
    pub fn set_capacity(&mut self, worker: WorkerId, blocks: usize) -> bool {
        let blocks = self.capped(blocks);
        let nodes = &self.nodes;
        let Some(w) = worker_mut(&mut self.workers, worker) else {
            return false;
        };
        if w.capacity == blocks {
            return false;
        }
        self.capacity = self.capacity - w.capacity + blocks;
        w.capacity = blocks;
        let room = |len: usize, holds: usize| holds.saturating_mul(2).saturating_sub(len);
        w.by_engine.reserve(room(w.by_engine.len(), blocks), |&n| {
            mix(nodes[n as usize].engine.0)
        });
        // Freed arena slots are reused before the arena grows, so its length only passes the
        // fleet's capacity if some worker holds more than its engine said.
        self.nodes
            .reserve_exact(self.capacity.saturating_sub(self.nodes.len()));
        self.holders
            .table
            .reserve(room(self.holders.table.len(), self.capacity), |e| {
                mix(e.key.0)
            });
        true
    }

    /// The size [`Index::set_capacity`] gave `worker` (`None`: unknown worker).
    pub fn capacity(&self, worker: WorkerId) -> Option<usize> {
        self.worker(worker).map(|w| w.capacity)
    }

    /// Whether [`Index::set_capacity`] with `blocks` would change anything: a check under a
    /// read lock before taking the write lock.
    pub fn needs_capacity(&self, worker: WorkerId, blocks: usize) -> bool {
        self.capacity(worker)
            .is_some_and(|c| c != self.capped(blocks))
    }

    fn capped(&self, blocks: usize) -> usize {
        blocks.min(self.config.max_blocks_per_worker)
    }

    /// Number of blocks a worker holds.
    pub fn worker_blocks(&self, worker: WorkerId) -> usize {
        self.worker(worker).map_or(0, |w| w.by_engine.len())
    }

    /// Its sizes.
    pub fn stats(&self) -> IndexStats {
        IndexStats {
            workers: self.workers.iter().flatten().count(),
            blocks: self.holders.len(),
            holds: self.holds,
            scopes: self.scope_ids.len(),
        }
    }

    /// Applies one event of `worker`, appending the resulting holder changes to `changes`.
    pub fn apply(
        &mut self,
        worker: WorkerId,
        event: &KvEvent,
        changes: &mut Vec<Change>,
    ) -> ApplyStats {
        let mut stats = ApplyStats::default();
        if self.worker(worker).is_none() {
            stats.unknown_worker += 1;
            return stats;
        }
        match event {
            KvEvent::BlockStored {
                parent,
                blocks,
                tier,
                lora_name,
                cache_salt,
            } => self.store(
                worker,
                *parent,
                blocks,
                *tier,
                lora_name.as_deref(),
                cache_salt.as_deref(),
                changes,
                &mut stats,
            ),
            KvEvent::BlockRemoved { hashes, tier } => {
                for &h in hashes {
                    match self.find_engine(worker, h) {
                        Some(n) => {
                            stats.removed += 1;
                            self.remove_tier(n, *tier, changes);
                        }
                        None => stats.unknown_removals += 1,
                    }
                }
            }
            KvEvent::AllBlocksCleared => {
                stats.cleared += self.clear_worker(worker, changes);
            }
        }
        stats
    }

    /// Every worker's longest match of a query's block keys.
    pub fn lookup(&self, keys: &[BlockKey]) -> Vec<WorkerMatch> {
        lookup::longest_matches(self, keys, &mut WalkStats::default())
    }

    /// Calls `f` for every hold, as the feed's full snapshot needs.
    pub fn for_each_hold(&self, mut f: impl FnMut(WorkerId, Tier, BlockKey)) {
        for node in &self.nodes {
            if node.parent != FREE {
                f(node.worker, node.class, node.key);
            }
        }
    }

    /// The whole index as plain data, parents before children, for `--state-dir`.
    pub fn export(&self) -> IndexDump {
        IndexDump {
            version: 1,
            workers: self
                .worker_ids()
                .filter_map(|w| self.export_worker(w))
                .collect(),
        }
    }

    /// The workers [`Index::export_worker`] has a dump for, in id order.
    pub fn worker_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.workers
            .iter()
            .enumerate()
            .filter(|(_, w)| w.is_some())
            .map(|(idx, _)| idx as u32)
    }

    /// One worker's part of [`Index::export`]; `None` for a worker the index does not have.
    /// A caller writing a large index out can take one worker at a time, so that it never
    /// holds a copy of the whole index.
    pub fn export_worker(&self, worker: u32) -> Option<WorkerDump> {
        let w = self.workers.get(worker as usize)?.as_ref()?;
        let mut nodes = Vec::with_capacity(w.by_engine.len());
        // Roots first, then each node's children after it: a pre-order walk.
        let mut stack: Vec<u32> = w
            .by_engine
            .iter()
            .copied()
            .filter(|&n| self.nodes[n as usize].parent == NIL)
            .collect();
        while let Some(n) = stack.pop() {
            let node = &self.nodes[n as usize];
            let scope = &self.scopes[node.scope as usize];
            nodes.push(NodeDump {
                engine: node.engine.0,
                parent: (node.parent != NIL).then(|| self.nodes[node.parent as usize].engine.0),
                key: node.key.0,
                scope: scope.id.0,
                seed: scope.seed,
                tiers: node.tiers.0,
            });
            let mut c = node.first_child;
            while c != NIL {
                stack.push(c);
                c = self.nodes[c as usize].next_sibling;
            }
        }
        Some(WorkerDump {
            worker,
            tenant: w.tenant.clone(),
            model: w.model.clone(),
            block_size: w.block_size,
            nodes,
        })
    }

    /// Rebuilds an index from [`Index::export`]'s output. Nodes whose parent is missing are
    /// skipped, so a damaged dump yields a smaller index, never an inconsistent one.
    pub fn import(config: IndexConfig, dump: &IndexDump) -> Index {
        let mut index = Index::new(config);
        let mut changes = Vec::new();
        for w in &dump.workers {
            let worker = WorkerId(w.worker);
            index.add_worker(worker, &w.tenant, &w.model, w.block_size);
            for n in &w.nodes {
                let parent = match n.parent {
                    Some(p) => match index.find_engine(worker, EngineHash(p)) {
                        Some(p) => p,
                        None => continue,
                    },
                    None => NIL,
                };
                if index.find_engine(worker, EngineHash(n.engine)).is_some() {
                    continue;
                }
                let scope = index.intern_scope(ScopeId(n.scope), n.seed);
                let tiers = TierMask(n.tiers & 0b111);
                let Some(best) = tiers.best() else { continue };
                let node = index.insert(
                    worker,
                    EngineHash(n.engine),
                    BlockKey(n.key),
                    parent,
                    scope,
                    best,
                    &mut changes,
                );
                index.nodes[node as usize].tiers = tiers;
                changes.clear();
            }
        }
        index
    }

    fn worker(&self, worker: WorkerId) -> Option<&Worker> {
        self.workers.get(worker.0 as usize).and_then(Option::as_ref)
    }

    fn find_engine(&self, worker: WorkerId, engine: EngineHash) -> Option<u32> {
        let nodes = &self.nodes;
        self.worker(worker)?
            .by_engine
            .find(mix(engine.0), |&n| nodes[n as usize].engine == engine)
            .copied()
    }

    #[allow(clippy::too_many_arguments)]
    fn store(
        &mut self,
        worker: WorkerId,
        parent: Option<EngineHash>,
        blocks: &[StoredBlock],
        tier: Tier,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
        changes: &mut Vec<Change>,
        stats: &mut ApplyStats,
    ) {
        let Some(w) = self.worker(worker) else { return };
        let block_size = w.block_size as usize;
        let root_scope = ScopeId::of(&w.tenant, &w.model, lora_name, cache_salt);
        let (mut parent_node, mut scope) = match parent {
            Some(p) => match self.find_engine(worker, p) {
                Some(n) => (n, self.nodes[n as usize].scope),
                None => {
                    stats.orphans += blocks.len() as u64;
                    return;
                }
            },
            None => (
                NIL,
                self.intern_scope(root_scope, hash::seed(lora_name, cache_salt)),
            ),
        };
        let interned = scope;
        let ScopeSlot {
            id: mut scope_id,
            mut seed,
            ..
        } = self.scopes[scope as usize];
        let mut parent_seq: Option<SeqHash> = None;
        if parent_node != NIL {
            parent_seq = Some(self.seq_of(parent_node));
        }
        for (i, block) in blocks.iter().enumerate() {
            if !block.is_whole(block_size) {
                stats.bad_blocks += (blocks.len() - i) as u64;
                break;
            }
            if let Some(n) = self.find_engine(worker, block.hash) {
                if self.nodes[n as usize].tiers.contains(tier) {
                    stats.duplicates += 1;
                } else {
                    stats.stored += 1;
                    self.add_tier(n, tier, changes);
                }
                // The chain goes on below a block the worker holds: it inherits that block's
                // scope, as below any parent.
                parent_node = n;
                parent_seq = Some(self.seq_of(n));
                scope = self.nodes[n as usize].scope;
                (scope_id, seed) = (
                    self.scopes[scope as usize].id,
                    self.scopes[scope as usize].seed,
                );
                continue;
            }
            if self.worker_blocks(worker) >= self.config.max_blocks_per_worker {
                stats.capped += (blocks.len() - i) as u64;
                break;
            }
            let b = block
                .block_hash
                .unwrap_or_else(|| hash::block_hash(&block.tokens, seed));
            let seq = hash::chain(parent_seq, b);
            let node = self.insert(
                worker,
                block.hash,
                scope_id.key(seq),
                parent_node,
                scope,
                tier,
                changes,
            );
            stats.stored += 1;
            parent_node = node;
            parent_seq = Some(seq);
        }
        self.release_scope_if_unused(interned);
    }

    /// Links a new node for `worker` and records its hold.
    #[allow(clippy::too_many_arguments)]
    fn insert(
        &mut self,
        worker: WorkerId,
        engine: EngineHash,
        key: BlockKey,
        parent: u32,
        scope: u32,
        tier: Tier,
        changes: &mut Vec<Change>,
    ) -> u32 {
        let parent_class = if parent == NIL {
            Tier::Gpu
        } else {
            self.nodes[parent as usize].class
        };
        let class = parent_class.max(tier);
        let first_sibling = if parent == NIL {
            NIL
        } else {
            self.nodes[parent as usize].first_child
        };
        let node = Node {
            key,
            engine,
            parent,
            first_child: NIL,
            next_sibling: first_sibling,
            worker,
            scope,
            tiers: TierMask::of(tier),
            class,
        };
        let n = match self.free.pop() {
            Some(n) => {
                self.nodes[n as usize] = node;
                n
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        if parent != NIL {
            self.nodes[parent as usize].first_child = n;
        }
        self.scopes[scope as usize].nodes += 1;
        let nodes = &self.nodes;
        if let Some(w) = self.workers[worker.0 as usize].as_mut() {
            w.by_engine
                .insert_unique(mix(engine.0), n, |&m| mix(nodes[m as usize].engine.0));
        }
        self.holders.add(key, worker, class);
        self.holds += 1;
        changes.push(Change {
            worker,
            tier: class,
            added: true,
            key,
        });
        n
    }

    /// Adds a tier to a hold; a better class flows down to the descendants.
    fn add_tier(&mut self, n: u32, tier: Tier, changes: &mut Vec<Change>) {
        let node = &mut self.nodes[n as usize];
        node.tiers = node.tiers.with(tier);
        // Only `n`'s own tiers changed: below a descendant whose class stays, nothing moves.
        self.refresh_classes(n, false, changes);
    }

    /// Removes `tier` from `n` and its subtree; drops holds left without a tier, with their
    /// subtrees.
    fn remove_tier(&mut self, n: u32, tier: Tier, changes: &mut Vec<Change>) {
        let subtree = self.subtree(n);
        for &m in &subtree {
            let node = &mut self.nodes[m as usize];
            node.tiers = node.tiers.without(tier);
        }
        for &m in &subtree {
            // Pre-order: a parent is decided before its children. A dropped parent has
            // already released its whole subtree, marking those nodes free.
            if self.nodes[m as usize].parent == FREE {
                continue;
            }
            if self.nodes[m as usize].tiers.is_empty() {
                self.drop_subtree(m, changes);
            }
        }
        if self.nodes[n as usize].parent != FREE {
            // Every node of the subtree lost the tier, so a descendant's class can move under
            // an ancestor whose class stayed: the whole subtree is looked at.
            self.refresh_classes(n, true, changes);
        }
    }

    /// Recomputes classes below and at `n`, emitting a change for each hold whose class moved.
    /// With `whole`, every node of the subtree is looked at (their own tiers changed);
    /// without, a node whose class stays ends the walk below it.
    fn refresh_classes(&mut self, n: u32, whole: bool, changes: &mut Vec<Change>) {
        let mut stack = vec![n];
        while let Some(m) = stack.pop() {
            let node = self.nodes[m as usize];
            let parent_class = if node.parent == NIL {
                Tier::Gpu
            } else {
                self.nodes[node.parent as usize].class
            };
            let Some(best) = node.tiers.best() else {
                continue;
            };
            let class = parent_class.max(best);
            if class == node.class && m != n && !whole {
                continue;
            }
            if class != node.class {
                self.holders.remove(node.key, node.worker, node.class);
                self.holders.add(node.key, node.worker, class);
                changes.push(Change {
                    worker: node.worker,
                    tier: node.class,
                    added: false,
                    key: node.key,
                });
                changes.push(Change {
                    worker: node.worker,
                    tier: class,
                    added: true,
                    key: node.key,
                });
                self.nodes[m as usize].class = class;
            }
            let mut c = node.first_child;
            while c != NIL {
                stack.push(c);
                c = self.nodes[c as usize].next_sibling;
            }
        }
    }

    /// `n` and its descendants, parents before children.
    fn subtree(&self, n: u32) -> Vec<u32> {
        let mut out = Vec::new();
        let mut stack = vec![n];
        while let Some(m) = stack.pop() {
            out.push(m);
            let mut c = self.nodes[m as usize].first_child;
            while c != NIL {
                stack.push(c);
                c = self.nodes[c as usize].next_sibling;
            }
        }
        out
    }

    /// Unlinks `n` from its parent and frees it with every descendant.
    fn drop_subtree(&mut self, n: u32, changes: &mut Vec<Change>) {
        self.unlink_from_parent(n);
        for m in self.subtree(n) {
            let worker = self.nodes[m as usize].worker;
            let engine = self.nodes[m as usize].engine;
            let nodes = &self.nodes;
            if let Some(w) = self.workers[worker.0 as usize].as_mut() {
                if let Ok(e) = w
                    .by_engine
                    .find_entry(mix(engine.0), |&x| nodes[x as usize].engine == engine)
                {
                    e.remove();
                }
            }
            self.release(m, changes);
        }
    }

    /// Children are a singly linked list (a back link would cost every node 8 bytes with
    /// padding): unlinking walks the siblings before `n`. Engines evict tail first, so the
    /// blocks removed are mostly leaves under parents with few children.
    fn unlink_from_parent(&mut self, n: u32) {
        let Node {
            parent,
            next_sibling,
            ..
        } = self.nodes[n as usize];
        if parent == NIL {
            return;
        }
        let first = self.nodes[parent as usize].first_child;
        if first == n {
            self.nodes[parent as usize].first_child = next_sibling;
            return;
        }
        let mut cur = first;
        while cur != NIL {
            let next = self.nodes[cur as usize].next_sibling;
            if next == n {
                self.nodes[cur as usize].next_sibling = next_sibling;
                return;
            }
            cur = next;
        }
    }

    /// Frees one node whose worker-table entry is already gone and whose tree links the
    /// caller tears down (or drops whole, when the worker's every node goes).
    fn release(&mut self, n: u32, changes: &mut Vec<Change>) {
        let node = self.nodes[n as usize];
        changes.push(Change {
            worker: node.worker,
            tier: node.class,
            added: false,
            key: node.key,
        });
        self.holders.remove(node.key, node.worker, node.class);
        self.holds -= 1;
        let scope = node.scope;
        self.scopes[scope as usize].nodes -= 1;
        self.release_scope_if_unused(scope);
        self.nodes[n as usize].parent = FREE;
        self.nodes[n as usize].first_child = NIL;
        self.free.push(n);
    }

    /// The sequence hash a hold's key was made from.
    fn seq_of(&self, n: u32) -> SeqHash {
        let node = &self.nodes[n as usize];
        self.scopes[node.scope as usize].id.seq(node.key)
    }

    fn intern_scope(&mut self, id: ScopeId, seed: u64) -> u32 {
        if let Some(&s) = self.scope_ids.get(&id) {
            return s;
        }
        let slot = ScopeSlot { id, seed, nodes: 0 };
        let s = match self.free_scopes.pop() {
            Some(s) => {
                self.scopes[s as usize] = slot;
                s
            }
            None => {
                self.scopes.push(slot);
                (self.scopes.len() - 1) as u32
            }
        };
        self.scope_ids.insert(id, s);
        s
    }

    fn release_scope_if_unused(&mut self, s: u32) {
        let slot = self.scopes[s as usize];
        if slot.nodes == 0 && self.scope_ids.remove(&slot.id).is_some() {
            self.free_scopes.push(s);
        }
    }
}

impl HolderView for Index {
    fn holders(&self, key: BlockKey, out: &mut Vec<(WorkerId, TierMask)>) {
        self.holders.get(key, out);
    }

    fn holders_among(
        &self,
        key: BlockKey,
        workers: &[WorkerId],
        out: &mut Vec<(WorkerId, TierMask)>,
    ) {
        self.holders.get_among(key, workers, out);
    }
}

/// Block key → holders. A key with one holder keeps it inline in its table slot; a key with
/// more points into `lists`, a sorted array of packed `worker << 2 | class` words, so that a
/// walk with few candidates left can look them up instead of scanning every holder.
#[derive(Clone, Debug, Default)]
struct Holders {
    table: HashTable<KeyHolders>,
    lists: Vec<Vec<u32>>,
    free_lists: Vec<u32>,
}

#[derive(Clone, Copy, Debug)]
struct KeyHolders {
    key: BlockKey,
    /// Bit 63 set: index into `lists`; clear: one holder, `worker << 2 | class`.
    slot: u64,
}

const LIST: u64 = 1 << 63;

fn pack(worker: WorkerId, class: Tier) -> u32 {
    worker.0 << 2 | class as u32
}

fn unpack(word: u32) -> (WorkerId, TierMask) {
    (
        WorkerId(word >> 2),
        TierMask::of(Tier::from_u8((word & 3) as u8).unwrap_or(Tier::Disk)),
    )
}

impl Holders {
    fn len(&self) -> usize {
        self.table.len()
    }

    fn add(&mut self, key: BlockKey, worker: WorkerId, class: Tier) {
        let word = pack(worker, class);
        match self.table.find_mut(mix(key.0), |e| e.key == key) {
            Some(e) if e.slot & LIST != 0 => {
                let list = &mut self.lists[(e.slot & !LIST) as usize];
                let at = list.partition_point(|&w| w < word);
                list.insert(at, word);
            }
            Some(e) => {
                let first = e.slot as u32;
                let pair = [first.min(word), first.max(word)];
                let list = match self.free_lists.pop() {
                    Some(l) => {
                        self.lists[l as usize].extend(pair);
                        l
                    }
                    None => {
                        self.lists.push(pair.to_vec());
                        (self.lists.len() - 1) as u32
                    }
                };
                e.slot = LIST | list as u64;
            }
            None => {
                self.table.insert_unique(
                    mix(key.0),
                    KeyHolders {
                        key,
                        slot: word as u64,
                    },
                    |e| mix(e.key.0),
                );
            }
        }
    }

    fn remove(&mut self, key: BlockKey, worker: WorkerId, class: Tier) {
        let word = pack(worker, class);
        let Ok(entry) = self.table.find_entry(mix(key.0), |e| e.key == key) else {
            return;
        };
        let slot = entry.get().slot;
        if slot & LIST == 0 {
            if slot as u32 == word {
                entry.remove();
            }
            return;
        }
        let l = (slot & !LIST) as usize;
        let list = &mut self.lists[l];
        if let Ok(i) = list.binary_search(&word) {
            list.remove(i);
        }
        if list.len() == 1 {
            // Back inline: one holder needs no list.
            let last = list[0];
            list.clear();
            if list.capacity() > 8 {
                list.shrink_to_fit();
            }
            self.free_lists.push(l as u32);
            entry.into_mut().slot = last as u64;
        }
    }

    fn get(&self, key: BlockKey, out: &mut Vec<(WorkerId, TierMask)>) {
        let Some(e) = self.table.find(mix(key.0), |e| e.key == key) else {
            return;
        };
        if e.slot & LIST == 0 {
            out.push(unpack(e.slot as u32));
        } else {
            out.extend(
                self.lists[(e.slot & !LIST) as usize]
                    .iter()
                    .map(|&w| unpack(w)),
            );
        }
    }

    fn get_among(&self, key: BlockKey, workers: &[WorkerId], out: &mut Vec<(WorkerId, TierMask)>) {
        let Some(e) = self.table.find(mix(key.0), |e| e.key == key) else {
            return;
        };
        if e.slot & LIST == 0 {
            out.push(unpack(e.slot as u32));
            return;
        }
        let list = &self.lists[(e.slot & !LIST) as usize];
        // A binary search per worker beats a scan only when the candidates are few.
        if workers.len() * 4 >= list.len() {
            out.extend(list.iter().map(|&w| unpack(w)));
            return;
        }
        for &worker in workers {
            let mut at = list.partition_point(|&w| w >> 2 < worker.0);
            while let Some(&w) = list.get(at).filter(|&&w| w >> 2 == worker.0) {
                out.push(unpack(w));
                at += 1;
            }
        }
    }
}

/// [`Index::export`]'s plain-data form.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexDump {
    /// Dump format version.
    pub version: u32,
    /// Every worker and its blocks.
    pub workers: Vec<WorkerDump>,
}

/// One worker of a dump.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerDump {
    /// The worker id.
    pub worker: u32,
    /// Its tenant.
    pub tenant: String,
    /// Its model.
    pub model: String,
    /// Its block size.
    pub block_size: u32,
    /// Parents before children.
    pub nodes: Vec<NodeDump>,
}

/// One held block of a dump.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeDump {
    /// The engine's hash.
    pub engine: u64,
    /// The engine hash of its parent, if any.
    pub parent: Option<u64>,
    /// Its block key.
    pub key: u64,
    /// Its scope id.
    pub scope: u64,
    /// Its hash seed.
    pub seed: u64,
    /// Its tiers (a tier mask).
    pub tiers: u8,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(first: u64, n: usize) -> KvEvent {
        KvEvent::BlockStored {
            parent: None,
            blocks: (0..n as u64)
                .map(|i| StoredBlock {
                    hash: EngineHash(first + i),
                    tokens: vec![(first + i) as u32; 4],
                    block_hash: None,
                })
                .collect(),
            tier: Tier::Gpu,
            lora_name: None,
            cache_salt: None,
        }
    }

    fn capacities(index: &Index, w: WorkerId) -> (usize, usize, usize) {
        (
            index.nodes.capacity(),
            index.holders.table.capacity(),
            index.worker(w).map_or(0, |w| w.by_engine.capacity()),
        )
    }

    /// Bytes held by the arena and the two tables (a table's `capacity` also falls as deleted
    /// slots pile up, though nothing is freed or allocated).
    fn allocations(index: &Index, w: WorkerId) -> (usize, usize, usize) {
        (
            index.nodes.capacity() * std::mem::size_of::<Node>(),
            index.holders.table.allocation_size(),
            index.worker(w).map_or(0, |w| w.by_engine.allocation_size()),
        )
    }

    #[test]
    fn reserved_room_takes_the_blocks_without_growing_any_table() {
        let mut index = Index::new(IndexConfig::default());
        let (a, b) = (WorkerId(0), WorkerId(1));
        index.add_worker(a, "t", "m", 4);
        index.add_worker(b, "t", "m", 4);
        let mut changes = Vec::new();
        index.apply(a, &chain(1, 100), &mut changes);
        index.reserve(b, 50_000);
        let reserved = capacities(&index, b);
        assert!(reserved.1 >= 50_100 && reserved.2 >= 50_000, "{reserved:?}");
        // In pieces, as the slices of a batch go in.
        for k in 0..10 {
            index.apply(b, &chain(1_000_000 + k * 5_000, 5_000), &mut changes);
        }
        assert_eq!(capacities(&index, b), reserved);
        assert_eq!(index.worker_blocks(b), 50_000);
        assert_eq!(index.stats().blocks, 50_100);
        // Nothing to reserve for a worker the index does not know.
        index.reserve(WorkerId(7), 1 << 20);
        assert_eq!(capacities(&index, b), reserved);
    }

    #[test]
    fn an_index_sized_for_its_fleet_fills_and_churns_without_growing_a_table() {
        let mut index = Index::new(IndexConfig {
            max_blocks_per_worker: 30_000,
        });
        let workers = [WorkerId(0), WorkerId(1), WorkerId(2)];
        for w in workers {
            index.add_worker(w, "t", "m", 4);
        }
        // Left to grow, filling the caches doubles the tables on the way.
        let mut grown = index.clone();
        let mut changes = Vec::new();
        for (i, &w) in workers.iter().enumerate() {
            grown.apply(w, &chain(1_000_000 * i as u64, 20_000), &mut changes);
        }
        assert_ne!(
            allocations(&grown, WorkerId(2)),
            allocations(&index, WorkerId(2))
        );

        for w in workers {
            assert!(index.set_capacity(w, 20_000));
        }
        assert!(
            !index.set_capacity(WorkerId(1), 20_000),
            "the same size again"
        );
        assert!(
            !index.set_capacity(WorkerId(9), 20_000),
            "an unknown worker"
        );
        assert_eq!(index.capacity(WorkerId(1)), Some(20_000));
        let sized: Vec<_> = workers.iter().map(|&w| allocations(&index, w)).collect();
        let size = std::mem::size_of::<Node>();
        assert!(
            sized[0].0 >= 60_000 * size && sized[0].1 >= 60_000 * 16,
            "{sized:?}"
        );
        assert!(sized.iter().all(|c| c.2 >= 20_000 * 4), "{sized:?}");
        // Full caches of distinct blocks (chains of 10), then churn: evictions and stores for
        // ten times the caches' size, and an engine restarted empty and refilled.
        let chain_at = |w: usize, k: u64| 10_000_000 * w as u64 + 10 * k;
        for (i, &w) in workers.iter().enumerate() {
            for k in 0..2_000 {
                index.apply(w, &chain(chain_at(i, k), 10), &mut changes);
            }
        }
        for round in 0..100u64 {
            for (i, &w) in workers.iter().enumerate() {
                let (old, new) = (round * 200, 2_000 + round * 200);
                for k in 0..200 {
                    let hashes = (0..10).map(|j| EngineHash(chain_at(i, old + k) + j));
                    let removed = KvEvent::BlockRemoved {
                        hashes: hashes.collect(),
                        tier: Tier::Gpu,
                    };
                    index.apply(w, &removed, &mut changes);
                    index.apply(w, &chain(chain_at(i, new + k), 10), &mut changes);
                }
            }
            changes.clear();
        }
        assert_eq!(index.stats().blocks, 60_000);
        index.clear_worker(WorkerId(1), &mut changes);
        index.apply(WorkerId(1), &chain(70_000_000, 20_000), &mut changes);
        assert_eq!(index.stats().blocks, 60_000);
        let after: Vec<_> = workers.iter().map(|&w| allocations(&index, w)).collect();
        assert_eq!(after, sized);

        // An engine's word is capped by the index's limit; a removed worker gives its room back.
        assert!(index.set_capacity(WorkerId(0), usize::MAX));
        assert_eq!(index.capacity(WorkerId(0)), Some(30_000));
        assert!(
            !index.needs_capacity(WorkerId(0), usize::MAX),
            "capped the same way"
        );
        assert!(index.needs_capacity(WorkerId(0), 20_000));
        assert!(
            !index.needs_capacity(WorkerId(9), 20_000),
            "an unknown worker"
        );
        assert_eq!(index.capacity, 70_000);
        index.remove_worker(WorkerId(0), &mut changes);
        assert_eq!(
            (index.capacity, index.capacity(WorkerId(0))),
            (40_000, None)
        );
    }

    #[test]
    fn blocks_given_by_their_hash_key_as_their_tokens_would() {
        let mut index = Index::new(IndexConfig::default());
        let (a, b) = (WorkerId(0), WorkerId(1));
        index.add_worker(a, "t", "m", 4);
        index.add_worker(b, "t", "m", 4);
        let mut changes = Vec::new();
        index.apply(a, &chain(1, 3), &mut changes);
        // The same three blocks as Dynamo reports them: other engine hashes, no tokens, the
        // contract hash of each block's tokens.
        let hashed = KvEvent::BlockStored {
            parent: None,
            blocks: (1..4u64)
                .map(|i| StoredBlock {
                    hash: EngineHash(100 + i),
                    tokens: Vec::new(),
                    block_hash: Some(hash::block_hash(&[i as u32; 4], hash::BASE_SEED)),
                })
                .collect(),
            tier: Tier::Gpu,
            lora_name: None,
            cache_salt: None,
        };
        let stats = index.apply(b, &hashed, &mut changes);
        assert_eq!((stats.stored, stats.bad_blocks), (3, 0));
        let mut keys = [Vec::new(), Vec::new()];
        index.for_each_hold(|w, _, k| keys[w.0 as usize].push(k.0));
        keys.iter_mut().for_each(|k| k.sort_unstable());
        assert_eq!(keys[0].len(), 3);
        assert_eq!(keys[0], keys[1]);
        // Without tokens and without a hash, a block is no whole block.
        let empty = KvEvent::BlockStored {
            parent: None,
            blocks: vec![StoredBlock {
                hash: EngineHash(9),
                tokens: Vec::new(),
                block_hash: None,
            }],
            tier: Tier::Gpu,
            lora_name: None,
            cache_salt: None,
        };
        assert_eq!(index.apply(b, &empty, &mut changes).bad_blocks, 1);
    }
}
