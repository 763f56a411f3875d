//! A fast, exact encoder for byte-level BPE tokenizers of the GPT-4 family (Qwen2/3, Llama 3,
//! ...): the `Split` pre-tokenizer without backtracking ([`crate::pretokenize`]), then the
//! model's own BPE per piece, with a cache of pieces. Everything but the split is
//! `tokenizers`' own code: the normalizer, the byte-to-character table, the BPE merges.
//!
//! Used only where exact ([`FastPath::build`] checks the tokenizer's shape, then a probe
//! corpus against the library's own pipeline); tests compare both on random text.

use std::sync::RwLock;

use hashbrown::HashMap;
use serde_json::Value;
use tokenizers::{Model, ModelWrapper, NormalizedString, Normalizer};

use crate::pretokenize::Splitter;

/// Most pieces kept in the cache before it starts over (a piece is a word, a number, a run of
/// punctuation or of spaces: a language's working vocabulary fits many times over).
const MAX_CACHED_PIECES: usize = 200_000;

/// Pieces longer than this are not cached (a long run of one character, a base64 blob).
const MAX_CACHED_PIECE_BYTES: usize = 64;

pub(crate) struct FastPath {
    split: Splitter,
    nfc: bool,
    /// Byte `b` as the character byte-level BPE writes for it, UTF-8 encoded.
    byte_chars: Vec<String>,
    pieces: RwLock<HashMap<Box<str>, Box<[u32]>>>,
}

impl FastPath {
    /// A fast path for `inner`, or `None` when its pipeline is not the supported shape or the
    /// probe corpus comes out differently from the library's.
    pub(crate) fn build(inner: &tokenizers::Tokenizer) -> Option<FastPath> {
        let nfc = match inner.get_normalizer().map(serde_json::to_value) {
            None => false,
            Some(Ok(v)) if v["type"] == "NFC" => true,
            Some(_) => return None,
        };
        let split = split_pattern(&serde_json::to_value(inner.get_pre_tokenizer()?).ok()?)?;
        let ModelWrapper::BPE(bpe) = inner.get_model() else {
            return None;
        };
        // Affixes written as empty strings (Qwen's files) are no affixes.
        let affix = |a: &Option<String>| a.as_deref().is_some_and(|s| !s.is_empty());
        if bpe.dropout.is_some_and(|p| p > 0.0)
            || bpe.byte_fallback
            || affix(&bpe.continuing_subword_prefix)
            || affix(&bpe.end_of_word_suffix)
        {
            return None;
        }
        let fast = FastPath {
            split,
            nfc,
            byte_chars: byte_chars(),
            pieces: RwLock::new(HashMap::new()),
        };
        let agrees = PROBES.iter().all(|probe| {
            let ours = fast.encode(inner, probe).ok();
            let theirs = inner.encode_fast(*probe, false).ok();
            ours.is_some() && ours.as_deref() == theirs.as_ref().map(|e| e.get_ids())
        });
        fast.pieces.write().ok()?.clear();
        agrees.then_some(fast)
    }

    /// The ids of `text` (no added tokens in it: the segmenter cut those out), exactly as
    /// `inner.encode_fast(text, false)`.
    pub(crate) fn encode(
        &self,
        inner: &tokenizers::Tokenizer,
        text: &str,
    ) -> tokenizers::Result<Vec<u32>> {
        let normalized;
        let text = if self.nfc && !text.is_ascii() {
            // NFC leaves ASCII alone; anything else goes through the library's normalizer.
            let mut n = NormalizedString::from(text);
            if let Some(normalizer) = inner.get_normalizer() {
                normalizer.normalize(&mut n)?;
            }
            normalized = n;
            normalized.get()
        } else {
            text
        };
        let model = inner.get_model();
        let mut out = Vec::with_capacity(text.len() / 4);
        let mut fresh: Vec<(Box<str>, Box<[u32]>)> = Vec::new();
        {
            let cache = self.pieces.read().unwrap_or_else(|e| e.into_inner());
            let mut mapped = String::new();
            for piece in self.split.pieces(text) {
                if let Some(ids) = cache.get(piece) {
                    out.extend_from_slice(ids);
                    continue;
                }
                mapped.clear();
                for b in piece.bytes() {
                    mapped.push_str(&self.byte_chars[usize::from(b)]);
                }
                let start = out.len();
                out.extend(model.tokenize(&mapped)?.into_iter().map(|t| t.id));
                if piece.len() <= MAX_CACHED_PIECE_BYTES {
                    fresh.push((piece.into(), out[start..].into()));
                }
            }
        }
        if !fresh.is_empty() {
            let mut cache = self.pieces.write().unwrap_or_else(|e| e.into_inner());
            if cache.len() + fresh.len() > MAX_CACHED_PIECES {
                cache.clear();
            }
            cache.extend(fresh);
        }
        Ok(out)
    }
}

/// The splitter of a `Sequence[Split(Isolated), ByteLevel(no prefix space, no regex)]`
/// pre-tokenizer whose pattern [`Splitter::new`] takes.
fn split_pattern(pre: &Value) -> Option<Splitter> {
    let steps = match pre["type"].as_str()? {
        "Sequence" => pre["pretokenizers"].as_array()?,
        _ => return None,
    };
    let [split, byte_level] = steps.as_slice() else {
        return None;
    };
    let ok_split =
        split["type"] == "Split" && split["behavior"] == "Isolated" && split["invert"] == false;
    let ok_bytes = byte_level["type"] == "ByteLevel"
        && byte_level["add_prefix_space"] == false
        && byte_level["use_regex"] == false;
    if !(ok_split && ok_bytes) {
        return None;
    }
    Splitter::new(split["pattern"]["Regex"].as_str()?)
}

/// GPT-2's byte-to-character table, as `tokenizers`' `ByteLevel` builds it: printable bytes
/// stand for themselves, the others move up past U+0100 in order.
fn byte_chars() -> Vec<String> {
    let printable = |b: u32| {
        (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    let mut next = 0x100;
    (0u32..256)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            char::from_u32(c).map(String::from).unwrap_or_default()
        })
        .collect()
}

/// Text the fast path must encode exactly as the library before it is used: every branch of
/// the pattern, whitespace runs before text, numbers and line breaks, non-ASCII letters, marks,
/// and text that NFC changes.
const PROBES: &[&str] = &[
    "Hello, world! It's 2026; we'll see.",
    "a  b   c\t\td \n\n e\r\n f  \n",
    "   leading and trailing   ",
    "x = 12345 + 6.78e9 // 0xFF",
    "I'M SHOUTING, YOU'RE TOO",
    "def f(x):\n    return x**2\n\n\n",
    "naïve café — «quotes» 「日本語」 中文测试 한국어",
    "e\u{301} vs \u{e9}, A\u{30a}ngstro\u{308}m",
    "\u{3000}\u{3000}wide\u{a0}\u{a0}space ١٢٣ ⅷ",
    "emoji 👍🏽 and ZWJ 👨‍👩‍👧 mixed",
    "tabs\t\t\tend\t",
    "!!!???...\n\n---\r\n",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_table_is_gpt2s() {
        let t = byte_chars();
        assert_eq!(t[usize::from(b'a')], "a");
        assert_eq!(t[usize::from(b' ')], "\u{120}");
        assert_eq!(t[usize::from(b'\n')], "\u{10a}");
        assert_eq!(t[0], "\u{100}");
        assert_eq!(t[0xAD], "\u{143}");
    }

    #[test]
    fn only_the_supported_shape_gets_a_splitter() {
        let pre = |split: &str, use_regex: bool| {
            serde_json::json!({"type": "Sequence", "pretokenizers": [
                {"type": split, "pattern": {"Regex": r"\p{L}+|\s+(?!\S)|\s+"}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": use_regex}
            ]})
        };
        assert!(split_pattern(&pre("Split", false)).is_some());
        assert!(split_pattern(&pre("Split", true)).is_none());
        assert!(split_pattern(&pre("Punctuation", false)).is_none());
        assert!(split_pattern(&serde_json::json!({"type": "ByteLevel"})).is_none());
    }
}
