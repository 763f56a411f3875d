//! Engine block hashes: opaque ids as the real engines compute them, so that a collector fed
//! by the simulator cannot lean on them (it must recompute the contract hashes from the
//! events' `token_ids`, as ARCHITECTURE.md requires).
//!
//! - vLLM (≥ 0.10.2): a sha256 chain over `(parent digest, block tokens, extra keys)` seeded by
//!   `NONE_HASH`; the event carries the low 64 bits, the digest's last 8 bytes big-endian
//!   (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, the default). vLLM pickles or CBOR-encodes the
//!   tuple; the simulator hashes the raw bytes instead (the values are opaque either way) and
//!   mixes a per-engine seed into `NONE_HASH`, as vLLM < 0.29 did with its random seed.
//! - SGLang (≥ 0.5.8): `sha256(prior digest ‖ page tokens as u32 LE)`, the first page without a
//!   prior digest; the event carries the digest's first 8 bytes big-endian as a signed i64.

use kvroute::event::EngineHash;
use sha2::{Digest, Sha256};

/// How an engine hashes its blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HashScheme {
    /// vLLM: sha256 chain from `NONE_HASH`; low 64 bits on the wire.
    Vllm {
        /// `NONE_HASH`, the parent digest of the first block.
        none_hash: [u8; 32],
    },
    /// SGLang: sha256 chain, first 8 bytes as a signed i64 on the wire (kept as its bits).
    Sglang,
}

impl HashScheme {
    /// vLLM's scheme with `NONE_HASH = sha256("vllm-none-hash" ‖ seed)`.
    pub fn vllm(seed: &str) -> HashScheme {
        let mut h = Sha256::new();
        h.update(b"vllm-none-hash");
        h.update(seed.as_bytes());
        HashScheme::Vllm {
            none_hash: h.finalize().into(),
        }
    }

    /// The chained digests and wire hashes of every full block of `tokens`.
    pub fn hashes(&self, tokens: &[u32], block_size_tokens: usize) -> Vec<EngineHash> {
        let mut out = Vec::with_capacity(tokens.len() / block_size_tokens.max(1));
        if block_size_tokens == 0 {
            return out;
        }
        let mut parent: Option<[u8; 32]> = match self {
            HashScheme::Vllm { none_hash } => Some(*none_hash),
            HashScheme::Sglang => None,
        };
        for block in tokens.chunks_exact(block_size_tokens) {
            let mut h = Sha256::new();
            if let Some(p) = &parent {
                h.update(p);
            }
            for t in block {
                h.update(t.to_le_bytes());
            }
            let digest: [u8; 32] = h.finalize().into();
            out.push(self.wire(&digest));
            parent = Some(digest);
        }
        out
    }

    fn wire(&self, digest: &[u8; 32]) -> EngineHash {
        let mut b = [0u8; 8];
        match self {
            HashScheme::Vllm { .. } => b.copy_from_slice(&digest[24..]),
            HashScheme::Sglang => b.copy_from_slice(&digest[..8]),
        }
        EngineHash(u64::from_be_bytes(b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sglang_hashes_match_the_real_engine() {
        // Check values from running SGLang 0.5.23 (kv_events.md §3): pages [1,2,3,4], [5,6,7,8].
        let h = HashScheme::Sglang.hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_eq!(h[0].0 as i64, -3_488_128_144_981_237_669);
        assert_eq!(h[1].0 as i64, 5_674_439_469_042_975_057);
    }

    #[test]
    fn vllm_hashes_chain_and_depend_on_the_seed() {
        let a = HashScheme::vllm("a").hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 4);
        let b = HashScheme::vllm("b").hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_eq!(a.len(), 2);
        assert_ne!(a, b);
        let c = HashScheme::vllm("a").hashes(&[9, 9, 9, 9, 5, 6, 7, 8], 4);
        assert_ne!(a[1], c[1], "a block's hash depends on its prefix");
    }
}
