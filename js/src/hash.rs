//! The hashing contract (`kvroute::hash`): block hashes, sequence hashes and the scope seed.
//!
//! Hashes are `u64`, so they leave as `BigUint64Array` (one `bigint` each), bit for bit what
//! the filter and the collector compute; a decimal string of one is what `/query_by_hash`
//! takes.

use kvroute::hash::{self as core, BlockHash};
use wasm_bindgen::prelude::*;

use crate::args;

/// The seed of a scope: 1337 plus xxh3 of the LoRA name (seed 0) and of the cache salt
/// (seed 1) when given; an empty string counts as absent.
#[wasm_bindgen(js_name = hashSeed)]
pub fn hash_seed(lora_name: Option<String>, cache_salt: Option<String>) -> u64 {
    core::seed(lora_name.as_deref(), cache_salt.as_deref())
}

/// Block hashes of every full block of `tokens` (a trailing partial block is not hashed).
///
/// Throws when `blockSize` is not an integer from 1 to 2^32 − 1.
#[wasm_bindgen(js_name = blockHashes)]
pub fn block_hashes(
    tokens: &[u32],
    block_size: f64,
    lora_name: Option<String>,
    cache_salt: Option<String>,
) -> Result<Vec<u64>, JsError> {
    let size = block_size_of(block_size)?;
    let seed = core::seed(lora_name.as_deref(), cache_salt.as_deref());
    Ok(core::iter_block_hashes(tokens, size, seed)?
        .map(|b| b.0)
        .collect())
}

/// Sequence hashes (the chained prefix hashes the index is keyed by) of every full block of
/// `tokens`.
///
/// Throws when `blockSize` is not an integer from 1 to 2^32 − 1.
#[wasm_bindgen(js_name = sequenceHashes)]
pub fn sequence_hashes(
    tokens: &[u32],
    block_size: f64,
    lora_name: Option<String>,
    cache_salt: Option<String>,
) -> Result<Vec<u64>, JsError> {
    let size = block_size_of(block_size)?;
    let seed = core::seed(lora_name.as_deref(), cache_salt.as_deref());
    Ok(core::iter_sequence_hashes(tokens, size, seed)?
        .map(|s| s.0)
        .collect())
}

/// Sequence hashes chained from block hashes already computed (Dynamo-style
/// `/query_by_hash` input).
#[wasm_bindgen(js_name = sequenceHashesOfBlocks)]
pub fn sequence_hashes_of_blocks(block_hashes: &[u64]) -> Vec<u64> {
    core::chained(block_hashes.iter().map(|&b| BlockHash(b)))
        .map(|s| s.0)
        .collect()
}

fn block_size_of(block_size: f64) -> Result<usize, JsError> {
    let size = args::integer(block_size, "blockSize", 1, u64::from(u32::MAX)).map_err(args::js)?;
    // u32 fits usize on wasm32 and on every native target this builds for.
    Ok(usize::try_from(size).unwrap_or(usize::MAX))
}
