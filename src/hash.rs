//! The hashing contract shared with NVIDIA Dynamo's KV router (ARCHITECTURE.md, "Hashing contract").
//!
//! A block is `block_size` consecutive `u32` tokens, hashed as little-endian bytes with xxh3-64
//! under a seed that folds in the LoRA name and cache salt. Sequence hashes chain the block
//! hashes so that equal sequence hashes mean equal prefixes. A trailing partial block is never
//! hashed.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The base seed of the contract.
pub const BASE_SEED: u64 = 1337;

/// Contract hash of one block's tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

/// Chained hash of a whole prefix, ending at one block: the key the index is built on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqHash(pub u64);

/// Why tokens could not be hashed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HashError {
    /// A block size of 0 tokens.
    #[error("block size must be at least 1 token")]
    ZeroBlockSize,
}

/// The seed of a scope: 1337, plus xxh3(lora_name, 0) and xxh3(cache_salt, 1) when given.
/// An empty string counts as absent, as in Dynamo.
pub fn seed(lora_name: Option<&str>, cache_salt: Option<&str>) -> u64 {
    let mut seed = BASE_SEED;
    if let Some(lora) = lora_name.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(lora.as_bytes(), 0));
    }
    if let Some(salt) = cache_salt.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(salt.as_bytes(), 1));
    }
    seed
}

/// The contract's fingerprint, as gateways and the collector tell each other (the
/// `gateway_mismatch` alarm): `xxh3-1337-` and the sequence hash of a fixed probe (tokens
/// 0..32 in blocks of 16, LoRA `"l"`, salt `"s"`) in hex. A build that hashes otherwise
/// fingerprints otherwise.
pub fn contract() -> String {
    let probe: [u32; 32] = core::array::from_fn(|i| i as u32);
    let seed = seed(Some("l"), Some("s"));
    let mut s = None;
    for block in probe.chunks_exact(16) {
        s = Some(chain(s, block_hash(block, seed)));
    }
    format!("xxh3-1337-{:016x}", s.map_or(0, |s| s.0))
}

/// The hash of one full block of tokens.
#[inline]
pub fn block_hash(block: &[u32], seed: u64) -> BlockHash {
    BlockHash(with_le_bytes(block, |bytes| xxh3_64_with_seed(bytes, seed)))
}

/// Chains one more block onto a prefix.
#[inline]
pub fn chain(parent: Option<SeqHash>, block: BlockHash) -> SeqHash {
    match parent {
        None => SeqHash(block.0),
        Some(parent) => {
            let mut buf = [0u8; 16];
            buf[..8].copy_from_slice(&parent.0.to_le_bytes());
            buf[8..].copy_from_slice(&block.0.to_le_bytes());
            SeqHash(xxh3_64_with_seed(&buf, BASE_SEED))
        }
    }
}

/// The block hashes of the full blocks of a token slice, one per step.
#[derive(Clone, Debug)]
pub struct BlockHashes<'a> {
    blocks: core::slice::ChunksExact<'a, u32>,
    seed: u64,
}

impl<'a> BlockHashes<'a> {
    /// The block hashes of `tokens` in blocks of `block_size` (at least 1) tokens.
    pub fn new(tokens: &'a [u32], block_size: usize, seed: u64) -> Self {
        BlockHashes {
            blocks: tokens.chunks_exact(block_size.max(1)),
            seed,
        }
    }
}

impl Iterator for BlockHashes<'_> {
    type Item = BlockHash;

    #[inline]
    fn next(&mut self) -> Option<BlockHash> {
        self.blocks.next().map(|b| block_hash(b, self.seed))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.blocks.size_hint()
    }
}

impl ExactSizeIterator for BlockHashes<'_> {}

/// Sequence hashes chained over block hashes, computed one step at a time: the one place
/// the chain is computed, so a caller that stops early (the filter's lazy view) hashes only
/// the blocks it looked at.
#[derive(Clone, Debug)]
pub struct Chained<I> {
    blocks: I,
    parent: Option<SeqHash>,
}

impl<I: Iterator<Item = BlockHash>> Iterator for Chained<I> {
    type Item = SeqHash;

    #[inline]
    fn next(&mut self) -> Option<SeqHash> {
        let block = self.blocks.next()?;
        let seq = match self.parent {
            Some(parent) => chain(Some(parent), block),
            None => SeqHash(block.0),
        };
        self.parent = Some(seq);
        Some(seq)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.blocks.size_hint()
    }
}

impl<I: ExactSizeIterator<Item = BlockHash>> ExactSizeIterator for Chained<I> {}

/// The lazy sequence hashes of a token slice.
pub type SeqHashes<'a> = Chained<BlockHashes<'a>>;

/// Block hashes of the full blocks of `tokens`, lazily.
///
/// # Errors
/// [`HashError::ZeroBlockSize`].
pub fn iter_block_hashes(
    tokens: &[u32],
    block_size: usize,
    seed: u64,
) -> Result<BlockHashes<'_>, HashError> {
    if block_size == 0 {
        return Err(HashError::ZeroBlockSize);
    }
    Ok(BlockHashes::new(tokens, block_size, seed))
}

/// Sequence hashes of the full blocks of `tokens`, lazily.
///
/// # Errors
/// [`HashError::ZeroBlockSize`].
pub fn iter_sequence_hashes(
    tokens: &[u32],
    block_size: usize,
    seed: u64,
) -> Result<SeqHashes<'_>, HashError> {
    iter_block_hashes(tokens, block_size, seed).map(chained)
}

/// Chains block hashes into sequence hashes, lazily.
pub fn chained<I: IntoIterator<Item = BlockHash>>(blocks: I) -> Chained<I::IntoIter> {
    Chained {
        blocks: blocks.into_iter(),
        parent: None,
    }
}

/// Block hashes of every full block of `tokens`.
///
/// # Errors
/// [`HashError::ZeroBlockSize`].
pub fn block_hashes(
    tokens: &[u32],
    block_size: usize,
    seed: u64,
) -> Result<Vec<BlockHash>, HashError> {
    Ok(iter_block_hashes(tokens, block_size, seed)?.collect())
}

/// Sequence hashes of every full block of `tokens`, appended to `out` (cleared first), so a
/// caller on a hot path can reuse one buffer.
///
/// # Errors
/// [`HashError::ZeroBlockSize`].
pub fn sequence_hashes_into(
    tokens: &[u32],
    block_size: usize,
    seed: u64,
    out: &mut Vec<SeqHash>,
) -> Result<(), HashError> {
    let seqs = iter_sequence_hashes(tokens, block_size, seed)?;
    out.clear();
    out.reserve(seqs.len());
    for seq in seqs {
        out.push(seq);
    }
    Ok(())
}

/// Sequence hashes of every full block of `tokens`.
///
/// # Errors
/// [`HashError::ZeroBlockSize`].
pub fn sequence_hashes(
    tokens: &[u32],
    block_size: usize,
    seed: u64,
) -> Result<Vec<SeqHash>, HashError> {
    Ok(iter_sequence_hashes(tokens, block_size, seed)?.collect())
}

/// Sequence hashes from already computed block hashes (Dynamo-style `/query_by_hash`).
pub fn sequence_hashes_of_blocks(blocks: &[BlockHash]) -> Vec<SeqHash> {
    chained(blocks.iter().copied()).collect()
}

/// Runs `f` on the little-endian bytes of `tokens`: a free reinterpretation on little-endian
/// targets (x86_64, wasm32), a copy elsewhere.
#[inline]
fn with_le_bytes<R>(tokens: &[u32], f: impl FnOnce(&[u8]) -> R) -> R {
    #[cfg(target_endian = "little")]
    {
        f(bytemuck::cast_slice(tokens))
    }
    #[cfg(not(target_endian = "little"))]
    {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        f(&bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_block_size_is_an_error() {
        assert_eq!(
            sequence_hashes(&[1, 2, 3], 0, BASE_SEED),
            Err(HashError::ZeroBlockSize)
        );
        assert_eq!(
            block_hashes(&[1], 0, BASE_SEED),
            Err(HashError::ZeroBlockSize)
        );
    }

    #[test]
    fn empty_names_are_no_names() {
        assert_eq!(seed(Some(""), Some("")), BASE_SEED);
        assert_ne!(seed(Some("a"), None), BASE_SEED);
        assert_ne!(seed(Some("a"), None), seed(None, Some("a")));
    }

    #[test]
    fn sequence_hashes_chain_block_hashes() {
        let tokens: Vec<u32> = (0..64).collect();
        let blocks = block_hashes(&tokens, 16, BASE_SEED).unwrap();
        assert_eq!(
            sequence_hashes(&tokens, 16, BASE_SEED).unwrap(),
            sequence_hashes_of_blocks(&blocks)
        );
    }

    #[test]
    fn the_lazy_chain_matches_a_hand_chained_one() {
        let tokens: Vec<u32> = (0..50).collect();
        let mut parent = None;
        let mut want = Vec::new();
        for b in tokens.chunks_exact(16) {
            let s = chain(parent, block_hash(b, 7));
            want.push(s);
            parent = Some(s);
        }
        let it = iter_sequence_hashes(&tokens, 16, 7).unwrap();
        assert_eq!(it.len(), 3, "the trailing partial block is not hashed");
        assert_eq!(it.collect::<Vec<_>>(), want);
        assert_eq!(
            iter_sequence_hashes(&tokens, 16, 7).unwrap().nth(1),
            Some(want[1])
        );
    }
}
