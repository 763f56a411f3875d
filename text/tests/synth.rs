//! The trace text generator: one token per word, 512 tokens per block, prefix sharing kept.

use kvroute_text::synth::{block_text, trace_text, BLOCK_TOKENS, WORDS};

use crate::qwen3;

#[test]
fn synth_words_are_one_qwen3_token_each() {
    for word in WORDS {
        let ids = qwen3().encode(&format!(" {word}")).unwrap();
        assert_eq!(ids.len(), 1, "{word:?} -> {ids:?}");
    }
}

#[test]
fn a_block_is_exactly_512_tokens_and_deterministic() {
    for id in [0u64, 1, 42, u64::MAX] {
        let text = block_text(id);
        assert_eq!(text, block_text(id));
        assert_eq!(
            qwen3().encode(&text).unwrap().len(),
            BLOCK_TOKENS,
            "id {id}"
        );
    }
    assert_ne!(block_text(1), block_text(2));
}

#[test]
fn shared_hash_id_prefixes_give_shared_token_prefixes() {
    let a = qwen3().encode(&trace_text(&[7, 8, 9])).unwrap();
    let b = qwen3().encode(&trace_text(&[7, 8, 10])).unwrap();
    assert_eq!(a.len(), 3 * BLOCK_TOKENS);
    assert_eq!(a[..2 * BLOCK_TOKENS], b[..2 * BLOCK_TOKENS]);
    assert_ne!(a[2 * BLOCK_TOKENS..], b[2 * BLOCK_TOKENS..]);
    // Concatenation does not change a block's tokens.
    let alone = qwen3().encode(&block_text(8)).unwrap();
    assert_eq!(a[BLOCK_TOKENS..2 * BLOCK_TOKENS], alone[..]);
}
