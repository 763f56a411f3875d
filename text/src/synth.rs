//! Deterministic text for replaying token-id traces as text.
//!
//! The Mooncake trace names each 512-token block by a `hash_id`; [`block_text`] turns an id
//! into text of exactly [`BLOCK_TOKENS`] Qwen3 tokens: words drawn from [`WORDS`] (each one
//! token with its leading space) by a generator seeded by the id. Equal ids give equal text, and
//! since the pre-tokenizer never joins a space-led word with what precedes it, the tokens of
//! concatenated blocks are the concatenation of the blocks' tokens: requests whose `hash_ids`
//! share a prefix get texts (and token ids) sharing exactly that prefix. Written out here (not
//! taken from a crate) so the texts never change under a dependency upgrade.

/// Qwen3 tokens per block of [`block_text`] (the Mooncake trace's block size).
pub const BLOCK_TOKENS: usize = 512;

/// Common English words that the Qwen3 tokenizer encodes as one token each with a leading
/// space (checked by the test `synth_words_are_one_qwen3_token_each`).
pub const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "time", "people", "year",
    "way", "day", "man", "thing", "woman", "life", "child", "world", "school", "state",
    "family", "student", "group", "country", "problem", "hand", "part", "place", "case", "week",
    "company", "system", "program", "question", "work", "government", "number", "night",
    "point", "home", "water", "room", "mother", "area", "money", "story", "fact", "month",
    "lot", "right", "study", "book", "eye", "job", "word", "business", "issue", "side", "kind",
    "head", "house", "service", "friend", "father", "power", "hour", "game", "line", "end",
    "member", "law", "car", "city", "community", "name", "president", "team", "minute", "idea",
    "kid", "body", "information", "back", "parent", "face", "others", "level", "office",
    "door", "health", "person", "art", "war", "history", "party", "result", "change",
    "morning", "reason", "research", "girl", "guy", "moment", "air", "teacher", "force",
    "education", "good", "new", "first", "last", "long", "great", "little", "own", "other",
    "old", "big", "high", "different", "small", "large", "next", "early", "young", "important",
    "few", "public", "bad", "same", "able", "make", "know", "take", "see", "come", "think",
    "look", "want", "give", "use", "find", "tell", "ask", "seem", "feel", "try", "leave",
    "call", "keep", "let", "begin", "help", "show", "hear", "play", "run", "move", "like",
    "live", "believe", "hold", "bring", "happen", "write", "provide", "sit", "stand", "lose",
    "pay", "meet", "include", "continue", "set", "learn", "lead", "understand", "watch",
    "follow", "stop", "create", "speak", "read", "allow", "add", "spend", "grow", "open",
    "walk", "win", "offer", "remember", "love", "consider", "appear", "buy", "wait", "serve",
    "die", "send", "expect", "build", "stay", "fall", "cut", "reach", "kill", "remain",
    "cache", "prefix", "block", "token", "engine", "route", "model", "request", "server",
];

/// Text of [`BLOCK_TOKENS`] Qwen3 tokens for one trace `hash_id`: space-led words, so blocks
/// concatenate without changing each other's tokens.
pub fn block_text(hash_id: u64) -> String {
    // Distinct per id, and never the all-zero state.
    let mut state = hash_id ^ 0x6b76_726f_7574_6521;
    let mut out = String::with_capacity(BLOCK_TOKENS * 7);
    for _ in 0..BLOCK_TOKENS {
        let pick = splitmix64(&mut state);
        // Multiply-shift: an unbiased-enough index without a modulo.
        let index = ((pick >> 32) * WORDS.len() as u64) >> 32;
        out.push(' ');
        out.push_str(WORDS[index as usize]);
    }
    out
}

/// The text of a whole trace request: its blocks' texts in order.
pub fn trace_text(hash_ids: &[u64]) -> String {
    let mut out = String::with_capacity(hash_ids.len() * BLOCK_TOKENS * 7);
    for &id in hash_ids {
        out.push_str(&block_text(id));
    }
    out
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
