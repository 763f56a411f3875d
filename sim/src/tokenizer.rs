//! The deterministic toy tokenizer, the trace's token generator, and [`TextTokenizer`]: the
//! engine's choice between the toy and a model's real tokenizer (`--tokenizer DIR`).
//!
//! Text prompts are whitespace-separated words `t<id>`; each maps back to exactly the token
//! id `<id>`, so a router that only sees text (sglang-router's `cache_aware`) and one that sees
//! token ids route on exactly the same token streams. Any other word is hashed (FNV-1a) into
//! the vocabulary, so arbitrary text still tokenizes deterministically.
//!
//! Trace blocks: the Mooncake trace gives one `hash_id` per 512-token block; [`block_tokens`]
//! turns an id into 512 pseudo-random token ids seeded by the id (splitmix64), so equal ids
//! give equal tokens at any block size dividing 512. The generator is written out here rather
//! than taken from a crate so the token streams never change under a dependency upgrade.

use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

/// How an engine turns text into token ids.
///
/// `Toy` (the default) keeps the `t<id>` words the routing benchmark depends on; `Real` is a
/// model's Hugging Face tokenizer and chat template, the same code and files the collector
/// uses, so text routed exactly by the collector lands on the blocks the engine computes.
#[derive(Clone, Debug, Default)]
pub enum TextTokenizer {
    #[default]
    Toy,
    Real(Arc<kvroute_text::Tokenizer>),
}

impl TextTokenizer {
    /// Loads the real tokenizer in `dir` (`tokenizer.json`, `tokenizer_config.json`).
    ///
    /// # Errors
    /// The directory does not hold a loadable tokenizer.
    pub fn from_dir(dir: &Path) -> Result<TextTokenizer, kvroute_text::LoadError> {
        kvroute_text::Tokenizer::from_dir(dir).map(|t| TextTokenizer::Real(Arc::new(t)))
    }

    /// A completions prompt's ids (the real tokenizer adds its special tokens, as vLLM does).
    ///
    /// # Errors
    /// The prompt is over the size limit (real tokenizer only).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, kvroute_text::TextError> {
        match self {
            TextTokenizer::Toy => Ok(encode(text)),
            TextTokenizer::Real(t) => t.encode(text),
        }
    }

    /// A chat's ids: the OpenAI `messages` rendered by the chat template and encoded without
    /// adding special tokens (vLLM's chat path). The toy renders `role: content` lines.
    ///
    /// # Errors
    /// Messages that are not text chat messages, limits, template errors.
    pub fn encode_chat(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, kvroute_text::TextError> {
        match self {
            TextTokenizer::Toy => {
                let messages =
                    kvroute_text::parse_messages(messages, &kvroute_text::Limits::default())?;
                let mut text = String::new();
                for m in &messages {
                    text.push_str(&m.role);
                    text.push_str(": ");
                    text.push_str(&m.content);
                    text.push('\n');
                }
                Ok(encode(&text))
            }
            TextTokenizer::Real(t) => {
                let messages = kvroute_text::parse_messages(messages, t.limits())?;
                t.encode_chat(&messages, add_generation_prompt)
            }
        }
    }

    /// Whether this is a real tokenizer (its work is worth a blocking thread).
    pub fn is_real(&self) -> bool {
        matches!(self, TextTokenizer::Real(_))
    }
}

/// Vocabulary size used for generated and hashed tokens (Llama 3's 128,256 entries).
pub const VOCAB_SIZE: u32 = 128_256;

/// Tokens per trace `hash_id` (the Mooncake trace's block size).
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// Tokenizes `text`: `t<id>` words give `<id>`, other words a hash into the vocabulary.
pub fn encode(text: &str) -> Vec<u32> {
    text.split_whitespace().map(word_to_token).collect()
}

fn word_to_token(word: &str) -> u32 {
    if let Some(digits) = word.strip_prefix('t') {
        if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
            if let Ok(id) = digits.parse::<u32>() {
                return id;
            }
        }
    }
    let mut h: u32 = 0x811c_9dc5;
    for b in word.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h % VOCAB_SIZE
}

/// Renders token ids as the text [`encode`] maps back to the same ids.
pub fn decode(tokens: &[u32]) -> String {
    let mut out = String::with_capacity(tokens.len() * 7);
    for (i, t) in tokens.iter().enumerate() {
        if i > 0 {
            out.push(' ');
        }
        out.push('t');
        out.push_str(&t.to_string());
    }
    out
}

/// splitmix64: one step of the generator.
#[inline]
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Appends the 512 tokens of trace block `hash_id` to `out`.
pub fn block_tokens(hash_id: u64, out: &mut Vec<u32>) {
    let mut state = hash_id ^ 0x6b76_726f_7574_6521; // "kvroute!"
    out.reserve(TRACE_BLOCK_TOKENS);
    for _ in 0..TRACE_BLOCK_TOKENS {
        out.push((splitmix64(&mut state) % u64::from(VOCAB_SIZE)) as u32);
    }
}

/// The prompt of a trace request: the tokens of its `hash_ids`, cut to `input_length`
/// (the last block may be partial; `input_length` is authoritative). If `input_length` is
/// longer than the blocks, the rest is filled from a block seeded by the request index, so
/// it is unique to the request.
pub fn trace_prompt(hash_ids: &[u64], input_length: usize, request_index: u64) -> Vec<u32> {
    let mut out = Vec::with_capacity(input_length.max(hash_ids.len() * TRACE_BLOCK_TOKENS));
    for &id in hash_ids {
        if out.len() >= input_length {
            break;
        }
        block_tokens(id, &mut out);
    }
    let mut filler = 0u64;
    while out.len() < input_length {
        block_tokens(
            u64::MAX - request_index.wrapping_mul(1 << 20) - filler,
            &mut out,
        );
        filler += 1;
    }
    out.truncate(input_length);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_round_trips_token_ids() {
        let ids = vec![0, 1, 42, 128_255, 7, 7];
        assert_eq!(encode(&decode(&ids)), ids);
        assert_eq!(encode("  t5\tt6\nt7 "), vec![5, 6, 7]);
    }

    #[test]
    fn other_words_hash_deterministically_into_the_vocabulary() {
        let a = encode("hello world t");
        assert_eq!(a, encode("hello  world t"));
        assert!(a.iter().all(|&t| t < VOCAB_SIZE));
        assert_ne!(a[0], a[1]);
    }

    #[test]
    fn equal_hash_ids_give_equal_tokens() {
        let a = trace_prompt(&[1, 2, 3], 1200, 0);
        let b = trace_prompt(&[1, 2, 9], 1500, 1);
        assert_eq!(a.len(), 1200);
        assert_eq!(a[..1024], b[..1024]);
        assert_ne!(a[1024..1200], b[1024..1200]);
        let mut one = Vec::new();
        block_tokens(1, &mut one);
        assert_eq!(one[..], a[..512]);
        assert!(a.iter().all(|&t| t < VOCAB_SIZE));
    }

    #[test]
    fn short_hash_ids_are_filled_per_request() {
        let a = trace_prompt(&[1], 700, 3);
        let b = trace_prompt(&[1], 700, 4);
        assert_eq!(a[..512], b[..512]);
        assert_ne!(a[512..], b[512..]);
    }
}
