//! The fast path (split without backtracking, the model's BPE per piece) against the library's own
//! pipeline, on text built to hit every branch of the pre-tokenizer's pattern.

use proptest::prelude::*;

use crate::qwen3;

/// Characters of every class the pattern tells apart: ASCII and other letters, digits of
/// several scripts, spaces of several kinds, line breaks, apostrophes with contraction
/// letters, punctuation, marks, emoji.
const ALPHABET: &[&str] = &[
    "a", "Z", "s", "S", "t", "re", "ve", "m", "ll", "d", "'", "’", "7", "42", "٣", "Ⅷ", " ", " ",
    "  ", "\t", "\n", "\r\n", "\r", "\u{a0}", "\u{3000}", "\u{2003}", ".", ",", "!?", "(", ")",
    "-", "_", "#", "é", "e\u{301}", "\u{301}", "ß", "中", "文", "한", "ж", "👍", "👍🏽", "\u{200d}",
    "\u{0}", "\u{7f}", "\u{ad}", "$",
];

fn text() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(ALPHABET), 0..80).prop_map(|parts| parts.concat())
}

#[test]
fn qwen3_takes_the_fast_split() {
    assert!(qwen3().splits_fast());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn fast_split_encodes_exactly_as_the_library(text in text()) {
        let fast = qwen3().encode_raw(&text, false).unwrap();
        let library = qwen3().encode_uncached(&text, false).unwrap();
        prop_assert_eq!(fast, library, "{:?}", text);
    }
}

#[test]
fn whitespace_runs_before_text_give_their_last_space_to_the_word() {
    // Spelled out for the look-ahead the automaton has no syntax for.
    for text in [
        "a   b",
        "a \t b",
        "x\u{3000}\u{3000}y",
        "  1",
        " 1",
        "a  \n  b",
        "end   ",
    ] {
        assert_eq!(
            qwen3().encode_raw(text, false).unwrap(),
            qwen3().encode_uncached(text, false).unwrap(),
            "{text:?}"
        );
    }
}
