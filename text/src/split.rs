//! A fast, exact encoder for byte-level BPE tokenizers of the GPT-4 family (Qwen2/3, Llama 3,
//! ...): the `Split` pre-tokenizer's regex run by the `regex` crate's automata instead of
//! `fancy-regex`'s backtracking, then the model's own BPE per piece, with a cache of pieces.
//!
//! Why: `fancy-regex` needs backtracking only for one look-ahead, `\s+(?!\S)`, and spends
//! about 20 ms splitting an 8k-token prompt — most of the time of a text `/query`. The regex
//! without it (`...|\s+`) is a plain automaton; the look-ahead becomes one rule on the match
//! (a whitespace run of two or more characters followed by a non-space gives its last
//! character back to the next piece). Everything else is `tokenizers`' own code: the
//! normalizer, the byte-to-character table, the BPE model with its merges.
//!
//! Used only where exact ([`FastPath::build`] checks the tokenizer's shape, then a probe
//! corpus against the library's own pipeline); tests compare both on random text.

use std::sync::RwLock;

use hashbrown::HashMap;
use serde_json::Value;
use tokenizers::{Model, ModelWrapper, NormalizedString, Normalizer};

/// The look-ahead alternatives every supported pattern ends with, and their replacement.
const LOOKAHEAD_TAIL: &str = r"|\s+(?!\S)|\s+";
const PLAIN_TAIL: &str = r"|\s+";

/// Most pieces kept in the cache before it starts over (a piece is a word, a number, a run of
/// punctuation or of spaces: a language's working vocabulary fits many times over).
const MAX_CACHED_PIECES: usize = 200_000;

/// Pieces longer than this are not cached (a long run of one character, a base64 blob).
const MAX_CACHED_PIECE_BYTES: usize = 64;

pub(crate) struct FastPath {
    split: regex::Regex,
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
        let pattern = split_pattern(&serde_json::to_value(inner.get_pre_tokenizer()?).ok()?)?;
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
            split: regex::Regex::new(&pattern).ok()?,
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
            for piece in self.pieces_of(text) {
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

    /// The pre-tokenizer's pieces of `text`.
    fn pieces_of<'t>(&'t self, text: &'t str) -> Pieces<'t> {
        Pieces {
            split: &self.split,
            text,
            at: 0,
            base: 0,
            matches: self.split.find_iter(text),
            pending: None,
        }
    }
}

/// The regex's matches with the look-ahead rule, and any text between matches as a piece of
/// its own (`Isolated`). One pass of `find_iter`, restarted only where the rule gives a
/// character back (rare in prose; the regex has no look-around, so a restart on a suffix of
/// the text finds what a search from that offset would).
struct Pieces<'t> {
    split: &'t regex::Regex,
    text: &'t str,
    /// The start of what is not yet a piece.
    at: usize,
    /// The offset of the text `matches` runs on.
    base: usize,
    matches: regex::Matches<'t, 't>,
    /// A match found after a gap, whose turn comes after the gap's.
    pending: Option<(usize, usize)>,
}

impl<'t> Iterator for Pieces<'t> {
    type Item = &'t str;

    fn next(&mut self) -> Option<&'t str> {
        let text = self.text;
        loop {
            let found = self.pending.take().or_else(|| {
                self.matches
                    .next()
                    .map(|m| (self.base + m.start(), self.base + m.end()))
            });
            let Some((start, mut end)) = found else {
                let rest = &text[self.at..];
                self.at = text.len();
                return (!rest.is_empty()).then_some(rest);
            };
            if start == end {
                continue;
            }
            if start > self.at {
                self.pending = Some((start, end));
                let gap = &text[self.at..start];
                self.at = start;
                return Some(gap);
            }
            let piece = &text[start..end];
            // Only the final `\s+` alternative matches whitespace alone without ending in a
            // line break (`\s*[\r\n]+` ends in one; every other alternative holds a non-space).
            if let Some(last) = piece.chars().next_back() {
                let followed_by_text = text[end..]
                    .chars()
                    .next()
                    .is_some_and(|c| !c.is_whitespace());
                if followed_by_text
                    && last != '\n'
                    && last != '\r'
                    && piece.len() > last.len_utf8()
                    && piece.chars().all(char::is_whitespace)
                {
                    end -= last.len_utf8();
                    self.base = end;
                    self.matches = self.split.find_iter(&text[end..]);
                }
            }
            self.at = end;
            return Some(&text[start..end]);
        }
    }
}

/// The regex of a `Sequence[Split(Isolated), ByteLevel(no prefix space, no regex)]`
/// pre-tokenizer whose pattern ends with `\s+(?!\S)|\s+`, rewritten without the look-ahead.
fn split_pattern(pre: &Value) -> Option<String> {
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
    let pattern = split["pattern"]["Regex"].as_str()?;
    let head = pattern.strip_suffix(LOOKAHEAD_TAIL)?;
    let plain = format!("{head}{PLAIN_TAIL}");
    // No anchor or word boundary either (a search restarted on a suffix must find what a
    // search from that offset would); look-arounds and back-references do not parse at all.
    let hir = regex_syntax::parse(&plain).ok()?;
    hir.properties().look_set().is_empty().then_some(plain)
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
    fn only_the_supported_shape_gets_a_pattern() {
        let pre = |pattern: &str, use_regex: bool| {
            serde_json::json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": use_regex}
            ]})
        };
        assert_eq!(
            split_pattern(&pre(r"\p{L}+|\s+(?!\S)|\s+", false)).as_deref(),
            Some(r"\p{L}+|\s+")
        );
        assert_eq!(split_pattern(&pre(r"\p{L}+|\s+", false)), None);
        assert_eq!(
            split_pattern(&pre(r"(?=a)\p{L}+|\s+(?!\S)|\s+", false)),
            None
        );
        assert_eq!(split_pattern(&pre(r"\b\p{L}+|\s+(?!\S)|\s+", false)), None);
        assert_eq!(split_pattern(&pre(r"^\p{L}+|\s+(?!\S)|\s+", false)), None);
        assert_eq!(
            split_pattern(&pre(r"[^\r\n]?\p{L}+|\s+(?!\S)|\s+", false)).as_deref(),
            Some(r"[^\r\n]?\p{L}+|\s+")
        );
        assert_eq!(split_pattern(&pre(r"\p{L}+|\s+(?!\S)|\s+", true)), None);
        assert_eq!(
            split_pattern(&serde_json::json!({"type": "ByteLevel"})),
            None
        );
    }
}
