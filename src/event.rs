//! Normalized KV-cache events: what every engine format (vLLM array and map events, SGLang)
//! decodes into, and what the index applies. Event names follow the engines':
//! `BlockStored`, `BlockRemoved`, `AllBlocksCleared`.

use crate::hash::BlockHash;

/// A block hash as the engine reports it (vLLM: the low 64 bits of a sha256 digest; SGLang: its
/// own chain). Opaque: it is used only to find a block's parent and to remove it, never to match
/// prefixes. Byte-string hashes are folded to 64 bits by the decoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineHash(pub u64);

/// A worker: one `(instance_id, dp_rank)`, interned by the collector to a small dense id that
/// is reused after the worker unregisters, so the filter can keep a fixed-size slot table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(pub u32);

/// Where a cached block lives. Per-tier match lengths are cumulative, as in Dynamo: a GPU hit
/// also counts as a CPU and a DISK hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Tier {
    /// GPU memory.
    Gpu = 0,
    /// CPU memory.
    Cpu = 1,
    /// Disk or remote storage.
    Disk = 2,
}

impl Tier {
    /// Every tier, fastest first.
    pub const ALL: [Tier; 3] = [Tier::Gpu, Tier::Cpu, Tier::Disk];

    /// Maps an engine's `medium` string: nil and `GPU` are GPU; `CPU` and `CPU_PINNED` are
    /// CPU; everything else (`DISK`, `STORAGE`, `EXTERNAL`, unknown names) is DISK.
    pub fn from_medium(medium: Option<&str>) -> Tier {
        match medium {
            None => Tier::Gpu,
            Some(m) if m.eq_ignore_ascii_case("GPU") => Tier::Gpu,
            Some(m) if m.eq_ignore_ascii_case("CPU") || m.eq_ignore_ascii_case("CPU_PINNED") => {
                Tier::Cpu
            }
            Some(_) => Tier::Disk,
        }
    }

    /// The tier of wire value `v`.
    pub fn from_u8(v: u8) -> Option<Tier> {
        match v {
            0 => Some(Tier::Gpu),
            1 => Some(Tier::Cpu),
            2 => Some(Tier::Disk),
            _ => None,
        }
    }

    /// The lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Gpu => "gpu",
            Tier::Cpu => "cpu",
            Tier::Disk => "disk",
        }
    }
}

/// One stored block: the engine's hash and its tokens (exactly one block's worth once the
/// collector has re-chunked engine pages to the registered block size), or instead of the
/// tokens their contract hash when the source sends only that.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredBlock {
    /// The engine's hash of the block.
    pub hash: EngineHash,
    /// The block's tokens; empty when `block_hash` is given.
    pub tokens: Vec<u32>,
    /// The contract hash of the block's tokens ([`crate::hash::block_hash`]), when the source
    /// sends it instead of the tokens: NVIDIA Dynamo's `RouterEvent` carries a block's
    /// `tokens_hash` (xxh3-64 of its tokens, seed 1337: the same contract), never its tokens.
    /// The index then keys the block on it as it would on the hash of `tokens`.
    pub block_hash: Option<BlockHash>,
}

impl StoredBlock {
    /// Whether this is one whole block of `block_size` tokens: its tokens are exactly that
    /// many, or the source gave the hash of a whole block.
    pub fn is_whole(&self, block_size: usize) -> bool {
        self.block_hash.is_some() || self.tokens.len() == block_size
    }
}

/// A normalized KV event of one worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// A chain of blocks was stored, each the child of the one before; the first is the child
    /// of `parent` (or a root). `lora_name` and `cache_salt` name the scope of a root chain;
    /// a chain with a parent inherits the parent's scope (vLLM sends the salt only with the
    /// first block of a prompt).
    BlockStored {
        /// The block the first stored block follows, if any.
        parent: Option<EngineHash>,
        /// The blocks, in order.
        blocks: Vec<StoredBlock>,
        /// Where they are stored.
        tier: Tier,
        /// LoRA adapter they were computed with, if any.
        lora_name: Option<String>,
        /// Cache salt, if any.
        cache_salt: Option<String>,
    },
    /// Blocks were evicted from `tier`; each removal also drops the worker's descendants.
    BlockRemoved {
        /// The engine's hashes of the removed blocks.
        hashes: Vec<EngineHash>,
        /// The tier they left.
        tier: Tier,
    },
    /// The engine dropped its whole cache.
    AllBlocksCleared,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn media_map_to_three_tiers() {
        assert_eq!(Tier::from_medium(None), Tier::Gpu);
        assert_eq!(Tier::from_medium(Some("GPU")), Tier::Gpu);
        assert_eq!(Tier::from_medium(Some("CPU_PINNED")), Tier::Cpu);
        assert_eq!(Tier::from_medium(Some("CPU")), Tier::Cpu);
        for disk in ["DISK", "STORAGE", "EXTERNAL", "weird"] {
            assert_eq!(Tier::from_medium(Some(disk)), Tier::Disk);
        }
    }
}
