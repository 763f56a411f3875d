//! Re-chunking engine pages into blocks of the registered size.
//!
//! SGLang reports its radix tree per page (`page_size` tokens, 1 by default), and the last page
//! of a node can be partial. The index and the hashing contract work on blocks of the
//! registered `block_size`. A [`Chunker`] keeps, per worker, what each page left over:
//!
//! - a block is **stored** when all its tokens are: the page that completes it emits it, with a
//!   synthetic [`EngineHash`] derived from that page's hash and the block's place in the page;
//! - a block is **removed** when any of its pages is: every page remembers the blocks it has a
//!   part in, and removing the page removes them (the index's cascade then drops descendants).
//!
//! Pages of exactly `block_size` tokens whose parent is a block boundary never reach the
//! chunker (see [`Chunker::wants`]): vLLM, and SGLang with `page_size == block_size`, pass
//! straight through. A parent the chunker never saw is taken to be such a pass-through block.
//!
//! Bound: at most `max_pages` page records per worker; pages past it are dropped and counted
//! (their blocks are then missing from the index, which only costs matches).

use hashbrown::HashMap;
use kvroute::event::{EngineHash, KvEvent, StoredBlock, Tier};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of synthetic block hashes, so they do not follow any engine's scheme.
const SYNTH_SEED: u64 = 0x6368_756e_6b65_6431; // "chunked1"

#[derive(Clone, Debug, Default)]
struct PageRecord {
    /// Tokens after the last block boundary, up to the end of this page (fewer than a block).
    tail: Vec<u32>,
    /// The last complete block at or before the end of this page.
    last_block: Option<EngineHash>,
    /// Pages (this one included) holding the tokens of `tail`.
    pending: Vec<EngineHash>,
    /// Synthetic blocks this page has tokens in.
    blocks: Vec<EngineHash>,
}

/// Counts of what the chunker could not do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChunkStats {
    /// Pages dropped because the worker is at `max_pages`.
    pub capped: u64,
}

/// Per-worker page state. See the module doc.
#[derive(Debug)]
pub struct Chunker {
    block_size: usize,
    max_pages: usize,
    pages: HashMap<EngineHash, PageRecord>,
}

impl Chunker {
    pub fn new(block_size: u32, max_pages: usize) -> Chunker {
        Chunker {
            block_size: block_size.max(1) as usize,
            max_pages,
            pages: HashMap::new(),
        }
    }

    /// Number of pages remembered.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// Whether `event` needs re-chunking: a page that is not one whole block, or a parent
    /// page that ended inside a block.
    pub fn wants(&self, block_size: u32, event: &KvEvent) -> bool {
        match event {
            KvEvent::BlockStored { parent, blocks, .. } => {
                blocks.iter().any(|b| !b.is_whole(block_size as usize))
                    || parent.is_some_and(|p| self.pages.contains_key(&p))
            }
            KvEvent::BlockRemoved { hashes, .. } => {
                !self.pages.is_empty() && hashes.iter().any(|h| self.pages.contains_key(h))
            }
            KvEvent::AllBlocksCleared => !self.pages.is_empty(),
        }
    }

    /// Turns one page-level event into block-level events (none, when no block completes).
    pub fn apply(&mut self, event: KvEvent, stats: &mut ChunkStats) -> Option<KvEvent> {
        match event {
            KvEvent::BlockStored {
                parent,
                blocks,
                tier,
                lora_name,
                cache_salt,
            } => {
                let blocks = self.store(parent, blocks, stats)?;
                Some(KvEvent::BlockStored {
                    parent: blocks.0,
                    blocks: blocks.1,
                    tier,
                    lora_name,
                    cache_salt,
                })
            }
            KvEvent::BlockRemoved { hashes, tier } => Some(self.remove(hashes, tier)),
            KvEvent::AllBlocksCleared => {
                self.pages.clear();
                Some(KvEvent::AllBlocksCleared)
            }
        }
    }

    /// Forgets everything (engine restart, worker dropped).
    pub fn clear(&mut self) {
        self.pages.clear();
    }

    #[allow(clippy::type_complexity)]
    fn store(
        &mut self,
        parent: Option<EngineHash>,
        pages: Vec<StoredBlock>,
        stats: &mut ChunkStats,
    ) -> Option<(Option<EngineHash>, Vec<StoredBlock>)> {
        let bs = self.block_size;
        let (mut tail, mut last, mut pending) = match parent {
            None => (Vec::new(), None, Vec::new()),
            Some(p) => match self.pages.get(&p) {
                Some(r) => (r.tail.clone(), r.last_block, r.pending.clone()),
                // Not a page we re-chunked: a whole block that passed through.
                None => (Vec::new(), Some(p), Vec::new()),
            },
        };
        let chain_parent = last;
        let mut out = Vec::new();
        for page in pages {
            if self.pages.len() >= self.max_pages && !self.pages.contains_key(&page.hash) {
                stats.capped += 1;
                break;
            }
            let mut own = Vec::new();
            let mut rest = &page.tokens[..];
            let mut idx = 0u64;
            pending.push(page.hash);
            while !rest.is_empty() {
                let take = (bs - tail.len()).min(rest.len());
                tail.extend_from_slice(&rest[..take]);
                rest = &rest[take..];
                if tail.len() == bs {
                    let hash = synth(page.hash, idx);
                    idx += 1;
                    for p in pending.drain(..) {
                        if p == page.hash {
                            continue;
                        }
                        if let Some(r) = self.pages.get_mut(&p) {
                            if !r.blocks.contains(&hash) {
                                r.blocks.push(hash);
                            }
                        }
                    }
                    own.push(hash);
                    out.push(StoredBlock {
                        hash,
                        tokens: std::mem::take(&mut tail),
                        block_hash: None,
                    });
                    last = Some(hash);
                    if !rest.is_empty() {
                        pending.push(page.hash);
                    }
                }
            }
            let record = PageRecord {
                tail: tail.clone(),
                last_block: last,
                pending: pending.clone(),
                blocks: own,
            };
            self.pages.insert(page.hash, record);
        }
        (!out.is_empty()).then_some((chain_parent, out))
    }

    fn remove(&mut self, hashes: Vec<EngineHash>, tier: Tier) -> KvEvent {
        let mut out = Vec::with_capacity(hashes.len());
        for h in hashes {
            match self.pages.remove(&h) {
                Some(r) => out.extend(r.blocks),
                None => out.push(h),
            }
        }
        out.sort_unstable();
        out.dedup();
        KvEvent::BlockRemoved { hashes: out, tier }
    }
}

fn synth(page: EngineHash, idx: u64) -> EngineHash {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&page.0.to_le_bytes());
    buf[8..].copy_from_slice(&idx.to_le_bytes());
    EngineHash(xxh3_64_with_seed(&buf, SYNTH_SEED))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(parent: Option<u64>, pages: &[(u64, &[u32])]) -> KvEvent {
        KvEvent::BlockStored {
            parent: parent.map(EngineHash),
            blocks: pages
                .iter()
                .map(|(h, t)| StoredBlock {
                    hash: EngineHash(*h),
                    tokens: t.to_vec(),
                    block_hash: None,
                })
                .collect(),
            tier: Tier::Gpu,
            lora_name: None,
            cache_salt: None,
        }
    }

    fn blocks_of(ev: &KvEvent) -> (Option<EngineHash>, Vec<Vec<u32>>) {
        match ev {
            KvEvent::BlockStored { parent, blocks, .. } => {
                (*parent, blocks.iter().map(|b| b.tokens.clone()).collect())
            }
            _ => panic!("not a store"),
        }
    }

    #[test]
    fn single_token_pages_make_a_block_when_the_last_token_arrives() {
        let mut c = Chunker::new(4, 1000);
        let mut st = ChunkStats::default();
        let ev = stored(None, &[(1, &[10]), (2, &[11]), (3, &[12])]);
        assert!(c.wants(4, &ev));
        assert_eq!(c.apply(ev, &mut st), None, "3 of 4 tokens: no block yet");
        let ev = stored(Some(3), &[(4, &[13]), (5, &[14])]);
        assert!(c.wants(4, &ev));
        let out = c.apply(ev, &mut st).unwrap();
        let (parent, blocks) = blocks_of(&out);
        assert_eq!(parent, None);
        assert_eq!(blocks, vec![vec![10, 11, 12, 13]]);
        // Page 5 started the second block; 3 more tokens finish it, as a child of the first.
        let out = c
            .apply(stored(Some(5), &[(6, &[15, 16, 17])]), &mut st)
            .unwrap();
        let first = match &c
            .apply(
                stored(None, &[(1, &[10]), (2, &[11]), (3, &[12]), (4, &[13])]),
                &mut st,
            )
            .unwrap()
        {
            KvEvent::BlockStored { blocks, .. } => blocks[0].hash,
            _ => unreachable!(),
        };
        let (parent, blocks) = blocks_of(&out);
        assert_eq!(parent, Some(first));
        assert_eq!(blocks, vec![vec![14, 15, 16, 17]]);
    }

    #[test]
    fn removing_any_page_removes_every_block_it_is_part_of() {
        let mut c = Chunker::new(2, 1000);
        let mut st = ChunkStats::default();
        let out = c
            .apply(
                stored(None, &[(1, &[1]), (2, &[2]), (3, &[3]), (4, &[4])]),
                &mut st,
            )
            .unwrap();
        let hashes: Vec<EngineHash> = match out {
            KvEvent::BlockStored { blocks, .. } => blocks.iter().map(|b| b.hash).collect(),
            _ => unreachable!(),
        };
        assert_eq!(hashes.len(), 2);
        // Page 3 is the first page of block 2.
        let removed = c.apply(
            KvEvent::BlockRemoved {
                hashes: vec![EngineHash(3)],
                tier: Tier::Gpu,
            },
            &mut st,
        );
        assert_eq!(
            removed,
            Some(KvEvent::BlockRemoved {
                hashes: vec![hashes[1]],
                tier: Tier::Gpu
            })
        );
        // Page 2 is the last page of block 1, which it completed.
        let removed = c.apply(
            KvEvent::BlockRemoved {
                hashes: vec![EngineHash(2)],
                tier: Tier::Gpu,
            },
            &mut st,
        );
        assert_eq!(
            removed,
            Some(KvEvent::BlockRemoved {
                hashes: vec![hashes[0]],
                tier: Tier::Gpu
            })
        );
    }

    #[test]
    fn a_page_spanning_blocks_and_a_partial_last_page() {
        let mut c = Chunker::new(4, 1000);
        let mut st = ChunkStats::default();
        // SGLang page size 3 with a partial last page of 2 tokens: 3 + 3 + 2 = 8 tokens, 2 blocks.
        let out = c
            .apply(
                stored(None, &[(1, &[1, 2, 3]), (2, &[4, 5, 6]), (3, &[7, 8])]),
                &mut st,
            )
            .unwrap();
        assert_eq!(blocks_of(&out).1, vec![vec![1, 2, 3, 4], vec![5, 6, 7, 8]]);
        // Page 2 has tokens in both blocks.
        match c
            .apply(
                KvEvent::BlockRemoved {
                    hashes: vec![EngineHash(2)],
                    tier: Tier::Gpu,
                },
                &mut st,
            )
            .unwrap()
        {
            KvEvent::BlockRemoved { hashes, .. } => assert_eq!(hashes.len(), 2),
            _ => unreachable!(),
        }
    }

    #[test]
    fn whole_block_pages_pass_through_and_unknown_parents_are_block_boundaries() {
        let c = Chunker::new(4, 1000);
        assert!(!c.wants(4, &stored(None, &[(1, &[1, 2, 3, 4])])));
        let mut c = Chunker::new(4, 1000);
        let mut st = ChunkStats::default();
        let out = c
            .apply(stored(Some(99), &[(1, &[1, 2]), (2, &[3, 4])]), &mut st)
            .unwrap();
        assert_eq!(
            blocks_of(&out),
            (Some(EngineHash(99)), vec![vec![1, 2, 3, 4]])
        );
    }

    #[test]
    fn pages_past_the_cap_are_counted() {
        let mut c = Chunker::new(4, 2);
        let mut st = ChunkStats::default();
        assert_eq!(
            c.apply(stored(None, &[(1, &[1]), (2, &[2]), (3, &[3])]), &mut st),
            None
        );
        assert_eq!(st.capped, 1);
        assert_eq!(c.len(), 2);
    }
}
