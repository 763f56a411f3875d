//! Approximate prefix routing for text requests: no tokenizer, no collector. The filter
//! remembers which engine it sent each text prefix to and sends a later request sharing that
//! prefix to the same engine (as sglang-router's `cache_aware` and the Gateway API Inference
//! Extension do).
//!
//! - **Canonical text**: a completions `prompt` string as is; chat `messages` joined role by
//!   role, each message `role + "\n" + text + "\u{1e}"` (U+001E, record separator), where
//!   `text` is a string `content`, or the `text` of each `{"type": "text"}` part joined with
//!   `"\n"`; a `null` or absent content is empty (an assistant turn with only tool calls).
//!   Any other content (an image part, a number) is [`TextError::NotText`]: its tokens cannot
//!   be guessed. Appending a turn appends to the text, so a conversation's next turn shares
//!   the previous turn's text as a prefix.
//! - **Blocks**: the text cut into blocks of `block_chars` characters (Unicode scalar values,
//!   not bytes, so a multi-byte character never splits); a trailing partial block is never
//!   hashed, as with token blocks.
//! - **Chain hash**: `h[0] = xxh3_64(block 0 bytes, seed)`, `h[i] = xxh3_64(block i bytes,
//!   h[i-1])`, where `seed` is the request's [`ScopeId`] mixed with a text-domain constant:
//!   tenants, models and salts never share an entry, and no text key equals a token key.
//! - **Table**: in shared data, `shards` values of [`SHARD_ENTRIES`] fixed entries each (the
//!   speculative table's encoding, [`spec_insert`]: key, worker slot, depth, expiry; an
//!   insert takes the same key, a free or expired entry, or evicts the entry expiring
//!   first). A request records its chain at the depths of [`stored_depths`] (powers of two
//!   and the last block), so a prompt of `n` blocks writes `log2(n) + 2` entries at most;
//!   a hash picks its shard, so writes of unrelated prompts rarely touch the same value.
//!   Each shard is written with compare-and-swap: on a conflict (another VM wrote the shard
//!   meanwhile) the shard is read again and the entries re-applied, a few times at most;
//!   a record that still loses costs only a future hit, never a wrong answer.
//!
//! Everything here is pure: shared data is reached through [`Store`].

use std::borrow::Cow;

use serde::Deserialize;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::mirror::{spec_entry, spec_insert, stored_depths, Insert, Store, StoreError};
use crate::scope::{BlockKey, ScopeId};

/// Entries of one shard value (12 KiB of shared data).
pub const SHARD_ENTRIES: u32 = 512;

/// Characters per token assumed when text stands in for tokens in the cost (prefill work
/// booked, the decision's block size): about four for English text with common tokenizers.
pub const CHARS_PER_TOKEN: u32 = 4;

/// Mixed into the scope id so text chains never equal token keys.
const TEXT_DOMAIN: u64 = 0x7465_7874_6b76_7274;

/// The chain hash of the text prefix ending at one character block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TextHash(pub u64);

/// Why a request's text cannot be read.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TextError {
    /// The prompt string's escapes or bytes are not valid UTF-8 text.
    #[error("prompt is not valid UTF-8 text")]
    BadPrompt,
    /// `messages` is not an array of message objects with string roles.
    #[error("messages: {0}")]
    BadMessages(String),
    /// Message `0` has content that is not text.
    #[error("message {0} has content that is not text")]
    NotText(usize),
    /// More messages than allowed.
    #[error("more than {0} messages")]
    TooManyMessages(usize),
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(default, borrow)]
    content: Option<Content<'a>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Parts(Vec<Part<'a>>),
    Other(serde::de::IgnoredAny),
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(default, rename = "type", borrow)]
    kind: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
}

/// Writes the canonical text of a completions prompt: the raw bytes between the quotes of
/// its JSON string (`escaped` when they hold backslash escapes) into `out` (cleared first).
///
/// # Errors
/// [`TextError::BadPrompt`] for invalid UTF-8 or a bad escape.
pub fn prompt_text(raw: &[u8], escaped: bool, out: &mut String) -> Result<(), TextError> {
    out.clear();
    if escaped {
        *out = crate::intake::unescape(raw).ok_or(TextError::BadPrompt)?;
    } else {
        out.push_str(std::str::from_utf8(raw).map_err(|_| TextError::BadPrompt)?);
    }
    Ok(())
}

/// Writes the canonical text of a chat `messages` array (its raw JSON) into `out` (cleared
/// first), in the form of the module documentation.
///
/// # Errors
/// [`TextError`] for anything but an array of at most `max_messages` messages with string
/// roles and text content.
pub fn messages_text(raw: &[u8], max_messages: usize, out: &mut String) -> Result<(), TextError> {
    out.clear();
    let messages: Vec<Message<'_>> =
        serde_json::from_slice(raw).map_err(|e| TextError::BadMessages(e.to_string()))?;
    if messages.len() > max_messages {
        return Err(TextError::TooManyMessages(max_messages));
    }
    for (i, m) in messages.iter().enumerate() {
        out.push_str(&m.role);
        out.push('\n');
        match &m.content {
            None => {}
            Some(Content::Text(t)) => out.push_str(t),
            Some(Content::Parts(parts)) => {
                for (k, p) in parts.iter().enumerate() {
                    let (Some("text"), Some(t)) = (p.kind.as_deref(), p.text.as_deref()) else {
                        return Err(TextError::NotText(i));
                    };
                    if k > 0 {
                        out.push('\n');
                    }
                    out.push_str(t);
                }
            }
            Some(Content::Other(_)) => return Err(TextError::NotText(i)),
        }
        out.push('\u{1e}');
    }
    Ok(())
}

/// The chain seed of a scope's text.
pub fn text_seed(scope: ScopeId) -> u64 {
    scope.0 ^ TEXT_DOMAIN
}

/// Chain hashes of the full `block_chars`-character blocks of `text`, at most `max_blocks`
/// of them, into `out` (cleared first). Returns the number of characters in `text`.
pub fn chain_hashes(
    text: &str,
    block_chars: usize,
    seed: u64,
    max_blocks: usize,
    out: &mut Vec<TextHash>,
) -> usize {
    out.clear();
    let block_chars = block_chars.max(1);
    let bytes = text.as_bytes();
    let mut prev = seed;
    let mut chars = 0;
    let mut start = 0;
    for (at, _) in text.char_indices() {
        if chars > 0 && chars % block_chars == 0 {
            if out.len() >= max_blocks {
                return chars + text.get(at..).map_or(0, |t| t.chars().count());
            }
            prev = xxh3_64_with_seed(bytes.get(start..at).unwrap_or_default(), prev);
            out.push(TextHash(prev));
            start = at;
        }
        chars += 1;
    }
    if chars > 0 && chars % block_chars == 0 && out.len() < max_blocks {
        prev = xxh3_64_with_seed(bytes.get(start..).unwrap_or_default(), prev);
        out.push(TextHash(prev));
    }
    chars
}

/// The bounded table of recorded text prefixes in shared data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TextTable {
    /// Key prefix of the shard values (`{prefix}/{shard:x}`).
    pub prefix: String,
    /// Number of shard values.
    pub shards: u32,
    /// Entry lifetime in milliseconds.
    pub ttl_ms: u64,
}

/// What one lookup found: per worker slot, the deepest recorded prefix (in blocks).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TextMatch {
    /// `(worker slot, blocks)`, one per slot, deepest first.
    pub holders: Vec<(u32, u32)>,
    /// Shard values read.
    pub reads: u32,
}

/// What one record did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recorded {
    /// Live entries of other prefixes overwritten.
    pub evicted: u32,
    /// Shard writes lost to other writers after every retry.
    pub lost: u32,
    /// Compare-and-swap conflicts retried.
    pub retries: u32,
}

impl TextTable {
    /// A table of `max_entries` (rounded up to whole shards) under `prefix`.
    pub fn new(prefix: &str, max_entries: u32, ttl_ms: u64) -> TextTable {
        TextTable {
            prefix: prefix.to_owned(),
            shards: max_entries.div_ceil(SHARD_ENTRIES).max(1),
            ttl_ms,
        }
    }

    /// The shard of a hash: its high bits (the entry within a shard comes from its low bits).
    fn shard(&self, h: TextHash) -> u32 {
        ((h.0 >> 32) % u64::from(self.shards)) as u32
    }

    /// The shared-data key of shard `i`.
    pub fn shard_key(&self, i: u32) -> String {
        format!("{}/{i:x}", self.prefix)
    }

    /// The recorded holders of `hashes`' prefixes: walks the stored depths from the shallowest
    /// and stops at the first one nobody holds (a cold prompt costs one read).
    pub fn lookup<S: Store>(&self, store: &S, hashes: &[TextHash], now_ms: u64) -> TextMatch {
        self.lookup_since(store, hashes, now_ms, 0)
    }

    /// [`TextTable::lookup`] of the entries recorded at or after `since_ms` only: the
    /// decisions so recent that the engines' own KV events may not show them yet.
    pub fn lookup_since<S: Store>(
        &self,
        store: &S,
        hashes: &[TextHash],
        now_ms: u64,
        since_ms: u64,
    ) -> TextMatch {
        let mut m = TextMatch::default();
        let mut cached: Option<(u32, Vec<u8>)> = None;
        let n = u32::try_from(hashes.len()).unwrap_or(u32::MAX);
        for d in stored_depths(n) {
            let Some(&h) = hashes.get(d as usize - 1) else {
                break;
            };
            let shard = self.shard(h);
            if cached.as_ref().map(|c| c.0) != Some(shard) {
                m.reads += 1;
                let value = store
                    .get(&self.shard_key(shard))
                    .ok()
                    .and_then(|(v, _)| v)
                    .unwrap_or_default();
                cached = Some((shard, value));
            }
            let table = cached.as_ref().map_or(&[][..], |c| c.1.as_slice());
            let recorded = |expires: u64| expires.saturating_sub(self.ttl_ms) >= since_ms;
            let Some((slot, held, _)) =
                spec_entry(table, BlockKey(h.0), now_ms).filter(|e| recorded(e.2))
            else {
                break;
            };
            let depth = held.min(d);
            match m.holders.iter_mut().find(|x| x.0 == slot) {
                Some(x) => x.1 = x.1.max(depth),
                None => m.holders.push((slot, depth)),
            }
        }
        m.holders.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        m
    }

    /// Records that `slot` was sent the prefixes of `hashes`, one compare-and-swap write per
    /// shard touched.
    pub fn record<S: Store>(
        &self,
        store: &S,
        hashes: &[TextHash],
        slot: u32,
        now_ms: u64,
        retries: u32,
    ) -> Recorded {
        let mut out = Recorded::default();
        let n = u32::try_from(hashes.len()).unwrap_or(u32::MAX);
        let mut entries: Vec<(u32, TextHash, u32)> = stored_depths(n)
            .filter_map(|d| hashes.get(d as usize - 1).map(|h| (self.shard(*h), *h, d)))
            .collect();
        entries.sort_by_key(|e| e.0);
        for group in entries.chunk_by(|a, b| a.0 == b.0) {
            let key = self.shard_key(group[0].0);
            let mut done = false;
            for attempt in 0..retries.max(1) {
                let Ok((value, cas)) = store.get(&key) else {
                    break;
                };
                let mut table = value.unwrap_or_default();
                let mut evicted = 0;
                for &(_, h, d) in group {
                    let r = spec_insert(
                        &mut table,
                        SHARD_ENTRIES,
                        BlockKey(h.0),
                        slot,
                        d,
                        now_ms,
                        self.ttl_ms,
                    );
                    if r == Insert::Evicted {
                        evicted += 1;
                    }
                }
                match store.set(&key, &table, cas) {
                    Ok(()) => {
                        out.evicted += evicted;
                        done = true;
                        break;
                    }
                    Err(StoreError::CasMismatch) if attempt + 1 < retries => out.retries += 1,
                    Err(_) => break,
                }
            }
            if !done {
                out.lost += 1;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mirror::MemStore;
    use proptest::prelude::*;

    fn hashes(text: &str, block: usize) -> Vec<TextHash> {
        let mut out = Vec::new();
        chain_hashes(text, block, text_seed(ScopeId(1)), 1 << 20, &mut out);
        out
    }

    #[test]
    fn messages_join_role_by_role() {
        let mut s = String::new();
        let raw = br#"[{"role":"system","content":"Be brief."},
            {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b\u00e9"}]},
            {"role":"assistant","content":null,"tool_calls":[{"id":"x"}]},
            {"role":"tool","content":"42","name":"calc"}]"#;
        messages_text(raw, 10, &mut s).unwrap();
        assert_eq!(
            s,
            "system\nBe brief.\u{1e}user\na\nbé\u{1e}assistant\n\u{1e}tool\n42\u{1e}"
        );
        // The next turn's text starts with this turn's.
        let mut first = String::new();
        messages_text(br#"[{"role":"user","content":"hi"}]"#, 10, &mut first).unwrap();
        messages_text(
            br#"[{"role":"user","content":"hi"},{"role":"assistant","content":"yo"}]"#,
            10,
            &mut s,
        )
        .unwrap();
        assert!(s.starts_with(&first));
    }

    #[test]
    fn content_that_is_not_text_is_refused() {
        let mut s = String::new();
        for (raw, want) in [
            (
                &br#"[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]"#[..],
                TextError::NotText(0),
            ),
            (
                br#"[{"role":"user","content":"a"},{"role":"user","content":5}]"#,
                TextError::NotText(1),
            ),
            (
                br#"[{"role":"user","content":[{"type":"text","text":7}]}]"#,
                TextError::NotText(0),
            ),
        ] {
            assert_eq!(messages_text(raw, 10, &mut s), Err(want));
        }
        for raw in [
            &br#"{"role":"user"}"#[..],
            br#"[{"content":"no role"}]"#,
            br#"[{"role":5}]"#,
            b"[\"\xff\"]",
        ] {
            assert!(matches!(
                messages_text(raw, 10, &mut s),
                Err(TextError::BadMessages(_))
            ));
        }
        let many = format!("[{}]", [r#"{"role":"user","content":"x"}"#; 11].join(","));
        assert_eq!(
            messages_text(many.as_bytes(), 10, &mut s),
            Err(TextError::TooManyMessages(10))
        );
        assert_eq!(
            prompt_text(b"a\\ud800", true, &mut s),
            Err(TextError::BadPrompt)
        );
        assert_eq!(
            prompt_text(b"\xff", false, &mut s),
            Err(TextError::BadPrompt)
        );
        prompt_text(b"a\\nb", true, &mut s).unwrap();
        assert_eq!(s, "a\nb");
    }

    #[test]
    fn blocks_are_characters_and_partial_blocks_are_not_hashed() {
        assert_eq!(hashes("abc", 4).len(), 0);
        assert_eq!(hashes("abcd", 4).len(), 1);
        assert_eq!(hashes("abcdefghi", 4).len(), 2);
        // Four two-byte characters are one block of four characters.
        let mut out = Vec::new();
        assert_eq!(chain_hashes("éééé", 4, 0, 10, &mut out), 4);
        assert_eq!(out.len(), 1);
        assert_eq!(chain_hashes("abcdefgh", 4, 0, 1, &mut out), 8);
        assert_eq!(out.len(), 1, "max_blocks");
        // Scopes never share a chain.
        let mut other = Vec::new();
        chain_hashes("abcd", 4, text_seed(ScopeId(2)), 10, &mut other);
        assert_ne!(hashes("abcd", 4), other);
        assert_ne!(hashes("abcdefgh", 4)[1], hashes("abcdxfgh", 4)[1]);
    }

    #[test]
    fn the_longest_recorded_prefix_wins_and_entries_expire() {
        let store = MemStore::new();
        let t = TextTable::new("kv/text", 1024, 1000);
        let a = hashes(&"a".repeat(40), 4); // 10 blocks
        let b = hashes(&("a".repeat(20) + &"b".repeat(20)), 4); // shares 5 blocks
        assert_eq!(t.lookup(&store, &a, 0).holders, []);
        let r = t.record(&store, &a, 3, 0, 8);
        assert_eq!(r, Recorded::default());
        assert_eq!(t.lookup(&store, &a, 10).holders, [(3, 10)]);
        // b shares a's first 5 blocks: the stored depths 1, 2, 4 of them.
        assert_eq!(t.lookup(&store, &b, 10).holders, [(3, 4)]);
        t.record(&store, &b[..2], 5, 10, 8);
        assert_eq!(t.lookup(&store, &a, 20).holders, [(3, 10), (5, 2)]);
        assert_eq!(
            t.lookup_since(&store, &a, 20, 5).holders,
            [(5, 2)],
            "recorded at 10"
        );
        assert_eq!(t.lookup_since(&store, &a, 20, 11).holders, []);
        assert_eq!(
            t.lookup(&store, &a, 1000).holders,
            [(5, 2)],
            "a's entries expired"
        );
        assert_eq!(t.lookup(&store, &a, 5000).holders, []);
    }

    #[test]
    fn a_flood_keeps_the_table_bounded_and_counts_evictions() {
        let store = MemStore::new();
        let t = TextTable::new("kv/text", 2048, 60_000);
        assert_eq!(t.shards, 4);
        let mut evicted = 0;
        for i in 0..2000 {
            let h = hashes(&format!("{i:08}{}", "x".repeat(120)), 8); // 16 blocks, 5 depths
            evicted += t.record(&store, &h, i % 7, i as u64, 8).evicted;
        }
        assert_eq!(store.key_count(), 4, "one value per shard, never more");
        assert!(store.value_bytes() <= 4 * (1 + 512 * 24));
        assert!(evicted >= 10_000 - 2048, "evictions counted: {evicted}");
        // The latest prompt is still there.
        let h = hashes(&format!("{:08}{}", 1999, "x".repeat(120)), 8);
        assert_eq!(t.lookup(&store, &h, 2000).holders, [(1999 % 7, 16)]);
    }

    /// A store whose next writes fail the compare-and-swap, as when another VM wins.
    struct Racy {
        inner: MemStore,
        fail: std::cell::Cell<u32>,
    }

    impl Store for Racy {
        fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, u32), StoreError> {
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
            if self.fail.get() > 0 {
                self.fail.set(self.fail.get() - 1);
                return Err(StoreError::CasMismatch);
            }
            self.inner.set(key, value, cas)
        }
    }

    #[test]
    fn conflicts_are_retried_then_given_up() {
        let t = TextTable::new("kv/text", 512, 1000);
        let h = hashes(&"z".repeat(32), 4);
        let racy = Racy {
            inner: MemStore::new(),
            fail: std::cell::Cell::new(2),
        };
        let r = t.record(&racy, &h, 1, 0, 8);
        assert_eq!((r.retries, r.lost), (2, 0));
        assert_eq!(t.lookup(&racy, &h, 1).holders, [(1, 8)]);
        racy.fail.set(100);
        let r = t.record(&racy, &h, 2, 0, 3);
        assert_eq!((r.retries, r.lost), (2, 1));
        assert_eq!(t.lookup(&racy, &h, 1).holders, [(1, 8)], "unchanged");
    }

    proptest! {
        #[test]
        fn shared_prefixes_share_hashes(
            common in "\\PC{0,200}",
            a in "\\PC{0,100}",
            b in "\\PC{0,100}",
            block in 1usize..40,
        ) {
            let (ha, hb) = (hashes(&(common.clone() + &a), block), hashes(&(common.clone() + &b), block));
            let k = common.chars().count() / block;
            prop_assert_eq!(&ha[..k], &hb[..k]);
            // Where the texts differ inside a block, the hashes differ from there on.
            let (ta, tb): (Vec<char>, Vec<char>) = ((common.clone() + &a).chars().collect(), (common + &b).chars().collect());
            for i in 0..ha.len().min(hb.len()) {
                let same = ta[..(i + 1) * block] == tb[..(i + 1) * block];
                prop_assert_eq!(ha[i] == hb[i], same);
            }
        }

        #[test]
        fn the_table_never_grows(n in 1u32..300, entries in 1u32..3000) {
            let store = MemStore::new();
            let t = TextTable::new("p", entries, 1_000_000);
            for i in 0..n {
                let h = hashes(&format!("{i}-{}", "q".repeat(64)), 4);
                t.record(&store, &h, i, u64::from(i), 8);
            }
            prop_assert!(store.key_count() as u32 <= t.shards);
            prop_assert!(store.value_bytes() <= t.shards as usize * (1 + SHARD_ENTRIES as usize * 24));
        }

        #[test]
        fn any_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut s = String::new();
            let _ = messages_text(&bytes, 100, &mut s);
            let _ = prompt_text(&bytes, true, &mut s);
            let _ = prompt_text(&bytes, false, &mut s);
        }
    }
}
