//! The paged KV cache of one simulated engine, as vLLM v1's `BlockPool` manages it. Pure: no
//! I/O, no clock; every change it makes is returned as a [`CacheEvent`], in the order the
//! engine would publish it.
//!
//! - Memory is `capacity_blocks` physical blocks of `block_size_tokens` tokens.
//! - A request's prompt reuses the longest prefix of cached *full* blocks (at most
//!   `prompt_len - 1` tokens: the last prompt token is always computed, as in vLLM).
//! - Its new full prompt blocks are cached (one [`CacheEvent::BlockStored`] per run); its
//!   partial last block and its output tokens take blocks that are never cached (the
//!   simulator's output tokens are arbitrary, so caching them would match nothing).
//! - Blocks whose reference count drops to 0 stay cached in a free queue; new blocks are taken
//!   from the front of that queue, evicting whatever was cached there
//!   ([`CacheEvent::BlockRemoved`], one hash per event as vLLM emits them). A finished request
//!   frees its blocks tail first (vLLM frees `reversed(blocks)`), so a request's last blocks
//!   are evicted before its first ones, and older requests' blocks before newer ones.
//! - A hit on a free cached block takes it out of the queue (`touch`).
//! - A block whose hash is already cached in another physical block (only possible for the
//!   block the last-token rule forces to be recomputed) is not cached a second time. vLLM 0.33
//!   keeps both copies and announces each; here the index sees one block per hash, which keeps
//!   "the events equal the cache's contents" exact.
//!
//! Every map here is bounded by `capacity_blocks` (blocks, hashes, free queue) or by the number
//! of running requests, which the engine bounds with its concurrency limit.

use std::collections::{BTreeMap, HashMap};

use kvroute::event::EngineHash;

use crate::engine_hash::HashScheme;

/// Size of the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheConfig {
    /// Tokens per block (vLLM `--block-size`, default 16).
    pub block_size_tokens: usize,
    /// Physical blocks of KV memory.
    pub capacity_blocks: usize,
}

/// A change of the cache's contents, in publication order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// A run of newly cached blocks, each the child of the one before; the first is the child
    /// of `parent` (`None`: the run starts at block 0).
    BlockStored {
        parent: Option<EngineHash>,
        hashes: Vec<EngineHash>,
        token_ids: Vec<u32>,
    },
    /// One cached block was evicted.
    BlockRemoved { hash: EngineHash },
    /// The whole prefix cache was dropped.
    AllBlocksCleared,
}

/// A running request's handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// What admitting a request did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admission {
    pub request: RequestId,
    /// Prompt tokens served from the cache (a multiple of the block size).
    pub cached_tokens: usize,
    /// Changes to publish, evictions first.
    pub events: Vec<CacheEvent>,
}

/// Why a request cannot be admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// Not enough free blocks now; retry after a request finishes.
    #[error("{needed} free blocks needed, {free} free")]
    NotEnoughFree { needed: usize, free: usize },
    /// The request needs more blocks than the whole cache has.
    #[error("request needs {needed} blocks, capacity is {capacity}")]
    TooLarge { needed: usize, capacity: usize },
}

#[derive(Clone, Debug, Default)]
struct Block {
    hash: Option<EngineHash>,
    ref_cnt: u32,
    /// Position in the free queue while `ref_cnt == 0`.
    free_stamp: Option<u64>,
}

/// The cache. See the module docs.
#[derive(Debug)]
pub struct KvCache {
    cfg: CacheConfig,
    scheme: HashScheme,
    blocks: Vec<Block>,
    by_hash: HashMap<EngineHash, usize>,
    /// Free queue: stamp → block; the smallest stamp is evicted first.
    free: BTreeMap<u64, usize>,
    next_stamp: u64,
    running: HashMap<RequestId, Vec<usize>>,
    /// Deferred admissions: the first prompt block not cached yet (bounded like `running`).
    uncommitted: HashMap<RequestId, usize>,
    next_request: u64,
}

impl KvCache {
    /// An empty cache: every block free, in index order.
    pub fn new(cfg: CacheConfig, scheme: HashScheme) -> KvCache {
        assert!(
            cfg.block_size_tokens > 0,
            "block size must be at least 1 token"
        );
        let mut cache = KvCache {
            cfg,
            scheme,
            blocks: vec![Block::default(); cfg.capacity_blocks],
            by_hash: HashMap::new(),
            free: BTreeMap::new(),
            next_stamp: 0,
            running: HashMap::new(),
            uncommitted: HashMap::new(),
            next_request: 0,
        };
        for b in 0..cfg.capacity_blocks {
            cache.push_free(b);
        }
        cache
    }

    pub fn config(&self) -> CacheConfig {
        self.cfg
    }

    /// The engine hashes of `prompt`'s full blocks.
    pub fn engine_hashes(&self, prompt: &[u32]) -> Vec<EngineHash> {
        self.scheme.hashes(prompt, self.cfg.block_size_tokens)
    }

    /// Prompt tokens a request would get from the cache now (read-only; the oracle uses it).
    pub fn cached_prefix_tokens(&self, prompt: &[u32]) -> usize {
        let hashes = self.engine_hashes(prompt);
        self.cached_prefix_tokens_hashed(&hashes, prompt.len())
    }

    /// [`KvCache::cached_prefix_tokens`] with the prompt's hashes computed by the caller
    /// (outside whatever lock guards the cache).
    pub fn cached_prefix_tokens_hashed(&self, hashes: &[EngineHash], prompt_len: usize) -> usize {
        self.hit_blocks(hashes, prompt_len) * self.cfg.block_size_tokens
    }

    /// Blocks matched, capped so at least the last prompt token is computed.
    fn hit_blocks(&self, hashes: &[EngineHash], prompt_len: usize) -> usize {
        let max_hit = prompt_len.saturating_sub(1) / self.cfg.block_size_tokens;
        hashes
            .iter()
            .take(max_hit)
            .take_while(|h| self.by_hash.contains_key(h))
            .count()
    }

    /// Blocks a request with `prompt_len` prompt and `output_tokens` output tokens takes.
    pub fn blocks_needed(&self, prompt_len: usize, output_tokens: usize) -> usize {
        (prompt_len + output_tokens).div_ceil(self.cfg.block_size_tokens)
    }

    /// Admits a request: reuses cached blocks, allocates the rest (evicting from the free
    /// queue's front), caches its new full prompt blocks.
    ///
    /// # Errors
    /// [`AdmitError::TooLarge`] if the request can never fit, [`AdmitError::NotEnoughFree`] if
    /// it does not fit now (nothing is changed then).
    pub fn try_admit(
        &mut self,
        prompt: &[u32],
        output_tokens: usize,
    ) -> Result<Admission, AdmitError> {
        let hashes = self.engine_hashes(prompt);
        self.try_admit_hashed(prompt, &hashes, output_tokens)
    }

    /// [`KvCache::try_admit`] with `hashes == self.engine_hashes(prompt)` computed by the
    /// caller, outside whatever lock guards the cache.
    ///
    /// # Errors
    /// As [`KvCache::try_admit`].
    pub fn try_admit_hashed(
        &mut self,
        prompt: &[u32],
        hashes: &[EngineHash],
        output_tokens: usize,
    ) -> Result<Admission, AdmitError> {
        let bs = self.cfg.block_size_tokens;
        let (hit, ids, mut events) = self.allocate(prompt.len(), hashes, output_tokens)?;
        // Cache the new full prompt blocks, in runs of consecutive newly cached blocks.
        let mut run: Option<(Option<EngineHash>, Vec<EngineHash>, Vec<u32>)> = None;
        for (i, &h) in hashes.iter().enumerate().skip(hit) {
            if self.by_hash.contains_key(&h) {
                if let Some((parent, hs, toks)) = run.take() {
                    events.push(CacheEvent::BlockStored {
                        parent,
                        hashes: hs,
                        token_ids: toks,
                    });
                }
                continue;
            }
            let b = ids[i];
            self.blocks[b].hash = Some(h);
            self.by_hash.insert(h, b);
            let (_, hs, toks) = run.get_or_insert_with(|| {
                (i.checked_sub(1).map(|p| hashes[p]), Vec::new(), Vec::new())
            });
            hs.push(h);
            toks.extend_from_slice(&prompt[i * bs..(i + 1) * bs]);
        }
        if let Some((parent, hs, toks)) = run {
            events.push(CacheEvent::BlockStored {
                parent,
                hashes: hs,
                token_ids: toks,
            });
        }
        let request = RequestId(self.next_request);
        self.next_request += 1;
        self.running.insert(request, ids);
        Ok(Admission {
            request,
            cached_tokens: hit * bs,
            events,
        })
    }

    /// [`KvCache::try_admit_hashed`] for an engine that computes prompts in chunks over
    /// several steps: the blocks are allocated (evictions in the returned events) but the new
    /// full prompt blocks are cached only as [`KvCache::commit`] reports them computed, as vLLM
    /// caches a block once its KV exists. A request admitted meanwhile cannot hit work that is
    /// not done yet.
    ///
    /// # Errors
    /// As [`KvCache::try_admit`].
    pub fn try_admit_deferred(
        &mut self,
        prompt: &[u32],
        hashes: &[EngineHash],
        output_tokens: usize,
    ) -> Result<Admission, AdmitError> {
        let (hit, ids, events) = self.allocate(prompt.len(), hashes, output_tokens)?;
        let request = RequestId(self.next_request);
        self.next_request += 1;
        self.running.insert(request, ids);
        self.uncommitted.insert(request, hit);
        Ok(Admission {
            request,
            cached_tokens: hit * self.cfg.block_size_tokens,
            events,
        })
    }

    /// Caches the full prompt blocks of a deferred admission that lie within its first
    /// `computed_tokens` tokens and are not cached yet; returns their `BlockStored` runs. A
    /// hash another block caches already is skipped, as in [`KvCache::try_admit`]. `prompt`
    /// and `hashes` are the admission's. Unknown or immediate admissions change nothing.
    pub fn commit(
        &mut self,
        request: RequestId,
        prompt: &[u32],
        hashes: &[EngineHash],
        computed_tokens: usize,
    ) -> Vec<CacheEvent> {
        let bs = self.cfg.block_size_tokens;
        let (Some(&from), Some(ids)) = (self.uncommitted.get(&request), self.running.get(&request))
        else {
            return Vec::new();
        };
        let to = (computed_tokens / bs).min(hashes.len()).min(ids.len());
        if to <= from {
            return Vec::new();
        }
        let ids: Vec<usize> = ids[from..to].to_vec();
        let mut events = Vec::new();
        let mut run: Option<(Option<EngineHash>, Vec<EngineHash>, Vec<u32>)> = None;
        for (i, &b) in (from..to).zip(&ids) {
            let h = hashes[i];
            if self.by_hash.contains_key(&h) {
                if let Some((parent, hs, toks)) = run.take() {
                    events.push(CacheEvent::BlockStored {
                        parent,
                        hashes: hs,
                        token_ids: toks,
                    });
                }
                continue;
            }
            self.blocks[b].hash = Some(h);
            self.by_hash.insert(h, b);
            let (_, hs, toks) = run.get_or_insert_with(|| {
                (i.checked_sub(1).map(|p| hashes[p]), Vec::new(), Vec::new())
            });
            hs.push(h);
            toks.extend_from_slice(&prompt[i * bs..(i + 1) * bs]);
        }
        if let Some((parent, hs, toks)) = run {
            events.push(CacheEvent::BlockStored {
                parent,
                hashes: hs,
                token_ids: toks,
            });
        }
        self.uncommitted.insert(request, to);
        events
    }

    /// Grows a running request's blocks to hold `tokens` tokens (its KV as decoding goes on),
    /// taking fresh blocks from the free queue's front and evicting what was cached there.
    /// The new blocks are never cached: they hold output tokens. Unknown ids change nothing.
    ///
    /// # Errors
    /// [`AdmitError::NotEnoughFree`] when the free queue is too short (nothing is changed).
    pub fn try_grow(
        &mut self,
        request: RequestId,
        tokens: usize,
    ) -> Result<Vec<CacheEvent>, AdmitError> {
        let need = tokens.div_ceil(self.cfg.block_size_tokens);
        let Some(have) = self.running.get(&request).map(Vec::len) else {
            return Ok(Vec::new());
        };
        if need <= have {
            return Ok(Vec::new());
        }
        let fresh = need - have;
        if self.free.len() < fresh {
            return Err(AdmitError::NotEnoughFree {
                needed: fresh,
                free: self.free.len(),
            });
        }
        let mut events = Vec::new();
        let mut new_ids = Vec::with_capacity(fresh);
        for _ in 0..fresh {
            new_ids.push(self.take_fresh(&mut events));
        }
        if let Some(ids) = self.running.get_mut(&request) {
            ids.extend(new_ids);
        }
        Ok(events)
    }

    /// Blocks a running request holds (0 if unknown).
    pub fn request_blocks(&self, request: RequestId) -> usize {
        self.running.get(&request).map_or(0, Vec::len)
    }

    /// Takes the free queue's front block for a request, evicting its hash.
    /// Takes a reference on the prompt's cached leading blocks and allocates the rest (the
    /// evictions go into the returned events): `(hit blocks, block ids in prompt order,
    /// events)`. Nothing changes on an error.
    fn allocate(
        &mut self,
        prompt_len: usize,
        hashes: &[EngineHash],
        output_tokens: usize,
    ) -> Result<(usize, Vec<usize>, Vec<CacheEvent>), AdmitError> {
        let total = self.blocks_needed(prompt_len, output_tokens);
        if total > self.cfg.capacity_blocks {
            return Err(AdmitError::TooLarge {
                needed: total,
                capacity: self.cfg.capacity_blocks,
            });
        }
        let hit = self.hit_blocks(hashes, prompt_len);
        let hit_ids: Vec<usize> = hashes[..hit].iter().map(|h| self.by_hash[h]).collect();
        let hit_free = hit_ids
            .iter()
            .filter(|&&b| self.blocks[b].ref_cnt == 0)
            .count();
        let fresh = total - hit;
        if self.free.len() < fresh + hit_free {
            return Err(AdmitError::NotEnoughFree {
                needed: fresh + hit_free,
                free: self.free.len(),
            });
        }
        // Touch the hits first so the allocation below cannot evict them.
        for &b in &hit_ids {
            self.take_ref(b);
        }
        let mut events = Vec::new();
        let mut ids = hit_ids;
        for _ in 0..fresh {
            ids.push(self.take_fresh(&mut events));
        }
        Ok((hit, ids, events))
    }

    fn take_fresh(&mut self, events: &mut Vec<CacheEvent>) -> usize {
        let (_, b) = self
            .free
            .pop_first()
            .expect("caller checked the free count");
        self.blocks[b].free_stamp = None;
        if let Some(old) = self.blocks[b].hash.take() {
            self.by_hash.remove(&old);
            events.push(CacheEvent::BlockRemoved { hash: old });
        }
        self.blocks[b].ref_cnt = 1;
        b
    }

    /// Releases a finished request's blocks, tail first. Unknown ids are ignored.
    pub fn finish(&mut self, request: RequestId) {
        self.uncommitted.remove(&request);
        if let Some(ids) = self.running.remove(&request) {
            for &b in ids.iter().rev() {
                let block = &mut self.blocks[b];
                block.ref_cnt -= 1;
                if block.ref_cnt == 0 {
                    self.push_free(b);
                }
            }
        }
    }

    /// Drops every cached hash (vLLM `reset_prefix_cache`). Like vLLM, refuses while requests
    /// run (returns `None`); otherwise returns the event to publish.
    pub fn clear(&mut self) -> Option<CacheEvent> {
        if !self.running.is_empty() {
            return None;
        }
        for b in &mut self.blocks {
            b.hash = None;
        }
        self.by_hash.clear();
        self.free.clear();
        for b in 0..self.cfg.capacity_blocks {
            self.blocks[b].free_stamp = None;
            self.push_free(b);
        }
        Some(CacheEvent::AllBlocksCleared)
    }

    /// Every cached hash (for tests and the oracle).
    pub fn cached_hashes(&self) -> impl Iterator<Item = EngineHash> + '_ {
        self.by_hash.keys().copied()
    }

    /// Number of cached blocks.
    pub fn cached_blocks(&self) -> usize {
        self.by_hash.len()
    }

    /// Blocks referenced by running requests.
    pub fn used_blocks(&self) -> usize {
        self.cfg.capacity_blocks - self.free.len()
    }

    /// Free blocks (cached or not).
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Number of running requests.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    fn take_ref(&mut self, b: usize) {
        let block = &mut self.blocks[b];
        if block.ref_cnt == 0 {
            if let Some(stamp) = block.free_stamp.take() {
                self.free.remove(&stamp);
            }
        }
        block.ref_cnt += 1;
    }

    fn push_free(&mut self, b: usize) {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        self.blocks[b].free_stamp = Some(stamp);
        self.free.insert(stamp, b);
    }
}

/// Splits one admission's events into scheduler steps of at most `max_blocks` blocks each,
/// as vLLM publishes them: one batch per step, and a step allocates and caches at most
/// `max_num_batched_tokens / block_size` blocks (8,192 / 16 = 512 by default). Long
/// `BlockStored` runs are cut into pieces chained by their parents; order is kept.
pub fn split_steps(events: Vec<CacheEvent>, max_blocks: usize) -> Vec<Vec<CacheEvent>> {
    let max_blocks = max_blocks.max(1);
    let mut out: Vec<Vec<CacheEvent>> = Vec::new();
    let mut cur: Vec<CacheEvent> = Vec::new();
    let mut used = 0usize;
    let flush = |cur: &mut Vec<CacheEvent>, used: &mut usize, out: &mut Vec<Vec<CacheEvent>>| {
        if !cur.is_empty() {
            out.push(std::mem::take(cur));
        }
        *used = 0;
    };
    for e in events {
        match e {
            CacheEvent::BlockStored {
                parent,
                hashes,
                token_ids,
            } => {
                let bs = token_ids.len() / hashes.len().max(1);
                let mut parent = parent;
                let mut start = 0;
                while start < hashes.len() {
                    if used == max_blocks {
                        flush(&mut cur, &mut used, &mut out);
                    }
                    let n = (max_blocks - used).min(hashes.len() - start);
                    cur.push(CacheEvent::BlockStored {
                        parent,
                        hashes: hashes[start..start + n].to_vec(),
                        token_ids: token_ids[start * bs..(start + n) * bs].to_vec(),
                    });
                    parent = Some(hashes[start + n - 1]);
                    used += n;
                    start += n;
                }
            }
            other => {
                if used == max_blocks {
                    flush(&mut cur, &mut used, &mut out);
                }
                cur.push(other);
                used += 1;
            }
        }
    }
    flush(&mut cur, &mut used, &mut out);
    out
}

#[cfg(test)]
mod tests {
    //! The cache against a naive reference model: the same rules, written with vectors and
    //! linear scans, compared after every step of random operation sequences.
    use super::*;
    use proptest::prelude::*;

    const BS: usize = 2;

    fn cache(capacity: usize) -> KvCache {
        KvCache::new(
            CacheConfig {
                block_size_tokens: BS,
                capacity_blocks: capacity,
            },
            HashScheme::vllm("t"),
        )
    }

    /// The reference: `free` is a plain vector (front evicted first), `cached` a list of
    /// (hash, block) pairs.
    struct Reference {
        scheme: HashScheme,
        capacity: usize,
        refs: Vec<u32>,
        hash_of: Vec<Option<EngineHash>>,
        free: Vec<usize>,
        running: Vec<(RequestId, Vec<usize>)>,
        next: u64,
    }

    impl Reference {
        fn new(capacity: usize) -> Reference {
            Reference {
                scheme: HashScheme::vllm("t"),
                capacity,
                refs: vec![0; capacity],
                hash_of: vec![None; capacity],
                free: (0..capacity).collect(),
                running: Vec::new(),
                next: 0,
            }
        }

        fn find(&self, h: EngineHash) -> Option<usize> {
            (0..self.capacity).find(|&b| self.hash_of[b] == Some(h))
        }

        /// Returns (cached tokens, stored hashes in order, removed hashes in order) or None.
        fn admit(
            &mut self,
            prompt: &[u32],
            out: usize,
        ) -> Option<(usize, Vec<EngineHash>, Vec<EngineHash>)> {
            let hashes = self.scheme.hashes(prompt, BS);
            let max_hit = (prompt.len() - 1) / BS;
            let mut hit = 0;
            while hit < max_hit.min(hashes.len()) && self.find(hashes[hit]).is_some() {
                hit += 1;
            }
            let total = (prompt.len() + out).div_ceil(BS);
            let hit_blocks: Vec<usize> = hashes[..hit]
                .iter()
                .map(|&h| self.find(h).unwrap())
                .collect();
            let hit_free = hit_blocks.iter().filter(|&&b| self.refs[b] == 0).count();
            if total > self.capacity || self.free.len() < total - hit + hit_free {
                return None;
            }
            for &b in &hit_blocks {
                if self.refs[b] == 0 {
                    self.free.retain(|&x| x != b);
                }
                self.refs[b] += 1;
            }
            let mut removed = Vec::new();
            let mut ids = hit_blocks;
            for _ in hit..total {
                let b = self.free.remove(0);
                if let Some(h) = self.hash_of[b].take() {
                    removed.push(h);
                }
                self.refs[b] = 1;
                ids.push(b);
            }
            let mut stored = Vec::new();
            for i in hit..hashes.len() {
                if self.find(hashes[i]).is_none() {
                    self.hash_of[ids[i]] = Some(hashes[i]);
                    stored.push(hashes[i]);
                }
            }
            let id = RequestId(self.next);
            self.next += 1;
            self.running.push((id, ids));
            Some((hit * BS, stored, removed))
        }

        fn finish(&mut self, id: RequestId) {
            if let Some(pos) = self.running.iter().position(|(r, _)| *r == id) {
                let (_, ids) = self.running.remove(pos);
                for &b in ids.iter().rev() {
                    self.refs[b] -= 1;
                    if self.refs[b] == 0 {
                        self.free.push(b);
                    }
                }
            }
        }

        fn cached(&self) -> Vec<EngineHash> {
            let mut v: Vec<_> = self.hash_of.iter().flatten().copied().collect();
            v.sort();
            v
        }
    }

    fn prompt(prefix: u8, len: usize) -> Vec<u32> {
        // Prompts share prefixes: token i of prefix family p is p*10 + (i / 3) for the first
        // half, so families with equal p collide often.
        (0..len)
            .map(|i| {
                if i < len / 2 {
                    u32::from(prefix)
                } else {
                    (i as u32) * 100 + u32::from(prefix)
                }
            })
            .collect()
    }

    fn split(events: &[CacheEvent]) -> (Vec<EngineHash>, Vec<EngineHash>) {
        let mut stored = Vec::new();
        let mut removed = Vec::new();
        for e in events {
            match e {
                CacheEvent::BlockStored {
                    hashes, token_ids, ..
                } => {
                    assert_eq!(token_ids.len(), hashes.len() * BS);
                    stored.extend(hashes);
                }
                CacheEvent::BlockRemoved { hash } => removed.push(*hash),
                CacheEvent::AllBlocksCleared => panic!("no clear expected"),
            }
        }
        (stored, removed)
    }

    #[derive(Clone, Debug)]
    enum Op {
        Admit { family: u8, len: usize, out: usize },
        Finish { nth: usize },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..4, 1usize..12, 0usize..3).prop_map(|(family, len, out)| Op::Admit {
                family,
                len,
                out
            }),
            (0usize..8).prop_map(|nth| Op::Finish { nth }),
        ]
    }

    proptest! {
        #[test]
        fn cache_matches_the_reference_model(ops in proptest::collection::vec(op(), 1..60), capacity in 1usize..12) {
            let mut real = cache(capacity);
            let mut model = Reference::new(capacity);
            let mut running: Vec<RequestId> = Vec::new();
            for op in ops {
                match op {
                    Op::Admit { family, len, out } => {
                        let p = prompt(family, len);
                        let got = real.try_admit(&p, out);
                        let want = model.admit(&p, out);
                        match (got, want) {
                            (Ok(adm), Some((cached, stored, removed))) => {
                                prop_assert_eq!(adm.cached_tokens, cached);
                                let (s, r) = split(&adm.events);
                                prop_assert_eq!(s, stored);
                                prop_assert_eq!(r, removed);
                                running.push(adm.request);
                            }
                            (Err(_), None) => {}
                            (got, want) => prop_assert!(false, "real {:?} vs model {:?}", got, want),
                        }
                    }
                    Op::Finish { nth } => {
                        if !running.is_empty() {
                            let id = running.remove(nth % running.len());
                            real.finish(id);
                            model.finish(id);
                        }
                    }
                }
                let mut cached: Vec<_> = real.cached_hashes().collect();
                cached.sort();
                prop_assert_eq!(cached, model.cached());
                prop_assert!(real.cached_blocks() <= capacity);
                prop_assert_eq!(real.free_blocks(), model.free.len());
            }
        }
    }

    #[test]
    fn second_request_reuses_full_blocks_but_recomputes_the_last_token() {
        let mut c = cache(16);
        let p: Vec<u32> = (0..8).collect(); // 4 full blocks
        let a = c.try_admit(&p, 0).unwrap();
        assert_eq!(a.cached_tokens, 0);
        assert_eq!(a.events.len(), 1);
        c.finish(a.request);
        let b = c.try_admit(&p, 0).unwrap();
        assert_eq!(
            b.cached_tokens, 6,
            "the last block is recomputed: at most len-1 tokens hit"
        );
        assert!(
            b.events.is_empty(),
            "the recomputed block's hash is already cached"
        );
        let mut longer = p.clone();
        longer.extend([100, 101, 102]);
        let d = c.try_admit(&longer, 0).unwrap();
        assert_eq!(d.cached_tokens, 8);
        let hashes = c.engine_hashes(&longer);
        assert_eq!(
            d.events,
            vec![CacheEvent::BlockStored {
                parent: Some(hashes[3]),
                hashes: vec![hashes[4]],
                token_ids: vec![100, 101]
            }]
        );
    }

    #[test]
    fn eviction_takes_the_tail_of_the_oldest_request_first() {
        let mut c = cache(4);
        let a: Vec<u32> = vec![1, 1, 2, 2];
        let b: Vec<u32> = vec![3, 3, 4, 4];
        let ra = c.try_admit(&a, 0).unwrap();
        let rb = c.try_admit(&b, 0).unwrap();
        c.finish(ra.request);
        c.finish(rb.request);
        let ha = c.engine_hashes(&a);
        let hb = c.engine_hashes(&b);
        // Free queue now: a[1], a[0], b[1], b[0].
        let x = c.try_admit(&[9, 9], 0).unwrap();
        assert_eq!(x.events[0], CacheEvent::BlockRemoved { hash: ha[1] });
        let y = c.try_admit(&[8, 8], 0).unwrap();
        assert_eq!(y.events[0], CacheEvent::BlockRemoved { hash: ha[0] });
        // b is still whole, a is gone.
        assert_eq!(c.cached_prefix_tokens(&[3, 3, 4, 4, 5]), 4);
        assert_eq!(c.cached_prefix_tokens(&[1, 1, 2, 2, 5]), 0);
        let _ = hb;
    }

    #[test]
    fn a_hit_moves_blocks_out_of_the_eviction_queue() {
        let mut c = cache(4);
        let a = c.try_admit(&[1, 1, 2, 2], 0).unwrap();
        let b = c.try_admit(&[3, 3, 4, 4], 0).unwrap();
        c.finish(a.request);
        c.finish(b.request);
        // Queue: a[1], a[0], b[1], b[0]. Reusing a[0] takes it out; the new request's
        // one fresh block evicts a[1]; when it finishes, a[0] goes to the back.
        let again = c.try_admit(&[1, 1, 7], 0).unwrap();
        assert_eq!(again.cached_tokens, 2);
        c.finish(again.request);
        let big = c.try_admit(&[5, 5, 6, 6], 0).unwrap();
        let removed = big
            .events
            .iter()
            .filter(|e| matches!(e, CacheEvent::BlockRemoved { .. }))
            .count();
        assert_eq!(removed, 2, "b[1] and b[0] go; the recently used a[0] stays");
        assert_eq!(c.cached_prefix_tokens(&[1, 1, 9]), 2);
    }

    #[test]
    fn capacity_is_never_exceeded_and_running_blocks_are_never_evicted() {
        let mut c = cache(3);
        let a = c.try_admit(&[1, 1, 2, 2], 1).unwrap(); // 3 blocks: whole cache
        assert_eq!(
            c.try_admit(&[5, 5], 0),
            Err(AdmitError::NotEnoughFree { needed: 1, free: 0 })
        );
        assert_eq!(
            c.try_admit(&[5; 8], 0),
            Err(AdmitError::TooLarge {
                needed: 4,
                capacity: 3
            })
        );
        assert_eq!(c.cached_blocks(), 2);
        c.finish(a.request);
        assert_eq!(c.free_blocks(), 3);
        assert!(c.try_admit(&[5, 5], 0).is_ok());
    }

    #[test]
    fn clear_drops_everything_but_only_when_idle() {
        let mut c = cache(4);
        let a = c.try_admit(&[1, 1, 2, 2], 0).unwrap();
        assert_eq!(c.clear(), None);
        c.finish(a.request);
        assert_eq!(c.clear(), Some(CacheEvent::AllBlocksCleared));
        assert_eq!(c.cached_blocks(), 0);
        assert_eq!(c.cached_prefix_tokens(&[1, 1, 2, 2, 3]), 0);
    }

    #[test]
    fn steps_cap_blocks_per_batch_and_chain_split_runs() {
        let h = |i: u64| EngineHash(i);
        let ev = vec![
            CacheEvent::BlockRemoved { hash: h(100) },
            CacheEvent::BlockRemoved { hash: h(101) },
            CacheEvent::BlockStored {
                parent: Some(h(9)),
                hashes: vec![h(1), h(2), h(3)],
                token_ids: vec![1, 1, 2, 2, 3, 3],
            },
        ];
        let steps = split_steps(ev.clone(), 2);
        assert_eq!(
            steps,
            vec![
                vec![ev[0].clone(), ev[1].clone()],
                vec![CacheEvent::BlockStored {
                    parent: Some(h(9)),
                    hashes: vec![h(1), h(2)],
                    token_ids: vec![1, 1, 2, 2]
                }],
                vec![CacheEvent::BlockStored {
                    parent: Some(h(2)),
                    hashes: vec![h(3)],
                    token_ids: vec![3, 3]
                }],
            ]
        );
        assert_eq!(split_steps(ev.clone(), 100), vec![ev]);
        assert!(split_steps(Vec::new(), 4).is_empty());
    }

    #[test]
    fn deferred_admission_caches_blocks_only_as_they_are_committed() {
        let mut c = cache(10);
        let p = prompt(1, 9); // 4 full blocks of 2 and one token
        let hashes = c.engine_hashes(&p);
        let a = c.try_admit_deferred(&p, &hashes, 0).unwrap();
        assert!(a.events.is_empty(), "nothing evicted, nothing stored yet");
        assert_eq!(c.cached_prefix_tokens(&p), 0, "no hit on uncomputed blocks");
        let ev = c.commit(a.request, &p, &hashes, 5);
        assert_eq!(
            ev,
            vec![CacheEvent::BlockStored {
                parent: None,
                hashes: hashes[..2].to_vec(),
                token_ids: p[..4].to_vec(),
            }]
        );
        assert_eq!(c.cached_prefix_tokens(&p), 4);
        let ev = c.commit(a.request, &p, &hashes, 9);
        assert_eq!(
            ev,
            vec![CacheEvent::BlockStored {
                parent: Some(hashes[1]),
                hashes: hashes[2..4].to_vec(),
                token_ids: p[4..8].to_vec(),
            }]
        );
        assert!(c.commit(a.request, &p, &hashes, 9).is_empty(), "once");
        // A second request hits the committed blocks; its own copy of nothing is stored.
        let b = c.try_admit_deferred(&p, &hashes, 0).unwrap();
        assert_eq!(b.cached_tokens, 8);
        assert!(c.commit(b.request, &p, &hashes, 9).is_empty());
    }

    #[test]
    fn grow_takes_uncached_blocks_evicting_and_fails_when_full() {
        let mut c = cache(4);
        let old = prompt(2, 5);
        let a = c.try_admit(&old, 0).unwrap();
        c.finish(a.request);
        let p = prompt(3, 3);
        let b = c.try_admit(&p, 0).unwrap();
        assert_eq!(c.request_blocks(b.request), 2);
        assert!(
            c.try_grow(b.request, 4).unwrap().is_empty(),
            "fits in 2 blocks"
        );
        // The free queue's front is the old request's tail, then its first block.
        let ev = c.try_grow(b.request, 6).unwrap();
        assert_eq!(ev.len(), 1, "{ev:?}");
        assert_eq!(c.request_blocks(b.request), 3);
        assert_eq!(
            c.try_grow(b.request, 10),
            Err(AdmitError::NotEnoughFree { needed: 2, free: 1 })
        );
        assert_eq!(c.request_blocks(b.request), 3, "unchanged on failure");
        assert_eq!(c.used_blocks(), 3);
    }
}
