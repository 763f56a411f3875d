//! Stage 2 of the data path: one msgpack `EventBatch` payload → normalized
//! [`KvEvent`]s, for every format of ARCHITECTURE.md, "KV events":
//!
//! - the batch is an array `[ts, events]` (vLLM 0.9.0) or `[ts, events, dp_rank]` (vLLM ≥ 0.9.1,
//!   every SGLang); `dp_rank` is an int or nil;
//! - events are tagged arrays `["BlockStored", field, ...]` (vLLM ≤ 0.23, SGLang ≤ 0.5.18,
//!   llm-d-inference-sim) read by position with length guards, or maps with a `"type"` key
//!   (vLLM ≥ 0.24, SGLang ≥ 0.5.20) read by name, unknown keys ignored;
//! - any integer width, fixmap/map16/map32 and fixarray/array16/array32 headers;
//! - engine hashes as u64, i64 (kept as their two's-complement bits) or bin (the last 8 bytes
//!   read big-endian, left-padded when shorter: what vLLM's int conversion and llm-d do).
//!
//! The bytes are read with [`crate::msgpack`]'s bounded reader instead of building an
//! `rmpv::Value` tree: nothing is allocated but the tokens and hashes the index needs.
//! Arbitrary bytes give a [`DecodeError`], never a panic.
//!
//! What is dropped on purpose, and counted in [`DecodeStats`]: events of other KV-cache groups
//! (`group_idx` ≠ 0, or a `kv_cache_spec_kind` other than full or MLA attention), events with an
//! unknown tag. Events that name a LoRA only by `lora_id` are kept as "no LoRA" and counted.

use kvroute::event::{EngineHash, KvEvent, StoredBlock, Tier};

use crate::msgpack::{is_array, is_map, Reader};
pub use crate::msgpack::{DecodeError, MAX_DEPTH};

/// Counts of what one batch contained besides the events it returns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeStats {
    /// Events of another KV-cache group or attention kind (hybrid and sliding-window models).
    pub skipped_other_group: u32,
    /// Events with a tag that is none of `BlockStored`, `BlockRemoved`, `AllBlocksCleared`.
    pub skipped_unknown: u32,
    /// `BlockStored` events naming a LoRA adapter only by `lora_id` (vLLM < 0.14): kept, without
    /// a LoRA scope.
    pub lora_id_only: u32,
}

/// One decoded batch.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Batch {
    /// Publisher wall-clock time, seconds.
    pub ts: f64,
    /// The engine's data-parallel rank when the batch names one; it overrides the registered one.
    pub dp_rank: Option<u32>,
    pub events: Vec<KvEvent>,
    pub stats: DecodeStats,
}

/// Decodes one `EventBatch` payload (the third ZMQ frame).
///
/// Each `BlockStored` block gets the tokens of its engine block: `token_ids` split by the
/// event's `block_size`, the last block taking a shorter remainder (SGLang's partial last
/// page). Tokens past `len(block_hashes) × block_size` are dropped.
///
/// # Errors
/// Any malformed payload, or a known event with a field of the wrong type: the whole batch is
/// refused, since applying part of it could leave a chain half-linked.
pub fn decode(payload: &[u8]) -> Result<Batch, DecodeError> {
    let mut r = Reader::new(payload);
    let at = r.at();
    let n = r.array_len()?;
    if !(2..=16).contains(&n) {
        return Err(DecodeError::Value {
            at,
            what: "batch length",
        });
    }
    let ts = r.f64()?;
    let mut batch = Batch {
        ts,
        ..Batch::default()
    };
    let count = r.array_len()?;
    batch.events.reserve(count.min(1024));
    for _ in 0..count {
        if let Some(ev) = event(&mut r, &mut batch.stats)? {
            batch.events.push(ev);
        }
    }
    if n >= 3 {
        let at = r.at();
        batch.dp_rank = match r.opt_int()? {
            None => None,
            Some(v) => Some(u32::try_from(v).map_err(|_| DecodeError::Value {
                at,
                what: "dp_rank",
            })?),
        };
        for _ in 3..n {
            r.skip(0)?;
        }
    }
    if r.at() != payload.len() {
        return Err(DecodeError::Value {
            at: r.at(),
            what: "trailing bytes after the batch",
        });
    }
    Ok(batch)
}

/// The fields of a `BlockStored`/`BlockRemoved`, gathered from either event shape.
#[derive(Default)]
struct Fields {
    hashes: Vec<EngineHash>,
    parent: Option<EngineHash>,
    tokens: Vec<u32>,
    block_size: Option<i128>,
    lora_id: Option<i128>,
    medium: Option<String>,
    lora_name: Option<String>,
    cache_salt: Option<String>,
    group_idx: Option<i128>,
    kind_ok: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Tag {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

fn tag_of(s: &str) -> Tag {
    match s {
        "BlockStored" | "BlockStoredWithMetadata" => Tag::Stored,
        "BlockRemoved" => Tag::Removed,
        "AllBlocksCleared" => Tag::Cleared,
        _ => Tag::Unknown,
    }
}

fn event(r: &mut Reader<'_>, stats: &mut DecodeStats) -> Result<Option<KvEvent>, DecodeError> {
    let mut f = Fields {
        kind_ok: true,
        ..Fields::default()
    };
    let mut extra_keys: Option<Vec<ExtraKey>> = None;
    let tag = match r.peek()? {
        m if is_array(m) => {
            let n = r.array_len()?;
            if n == 0 {
                return Err(DecodeError::Value {
                    at: r.at(),
                    what: "empty event",
                });
            }
            let tag = tag_of(r.str()?);
            // Positional layouts (kv_events.md §1.2, §3, §5b):
            //   BlockStored  [tag, hashes, parent, tokens, block_size, lora_id, medium,
            //                 lora_name | sglang-metadata-map, extra_keys, group_idx,
            //                 kv_cache_spec_kind, sliding_window]
            //   BlockRemoved [tag, hashes, medium, group_idx]
            for i in 1..n {
                match (tag, i) {
                    (Tag::Stored, 1) | (Tag::Removed, 1) => f.hashes = r.hashes()?,
                    (Tag::Stored, 2) => f.parent = r.opt_hash()?,
                    (Tag::Stored, 3) => f.tokens = r.tokens()?,
                    (Tag::Stored, 4) => f.block_size = r.opt_int()?,
                    (Tag::Stored, 5) => f.lora_id = r.opt_int()?,
                    (Tag::Stored, 6) | (Tag::Removed, 2) => {
                        f.medium = r.opt_str()?.map(str::to_owned)
                    }
                    (Tag::Stored, 7) => {
                        if is_map(r.peek()?) {
                            // SGLang 0.5.18 `BlockStoredWithMetadata`: {"cache_salt": s}.
                            let m = r.map_len()?;
                            for _ in 0..m {
                                let key = r.str()?;
                                if key == "cache_salt" {
                                    f.cache_salt = r.opt_str()?.map(str::to_owned);
                                } else {
                                    r.skip(1)?;
                                }
                            }
                        } else {
                            f.lora_name = r.opt_str()?.map(str::to_owned);
                        }
                    }
                    (Tag::Stored, 8) => extra_keys = r.extra_keys()?,
                    (Tag::Stored, 9) | (Tag::Removed, 3) => f.group_idx = r.opt_int()?,
                    (Tag::Stored, 10) => f.kind_ok = kind_ok(r.opt_str()?),
                    _ => r.skip(1)?,
                }
            }
            tag
        }
        m if is_map(m) => {
            let n = r.map_len()?;
            let mut tag = None;
            for _ in 0..n {
                let key = r.str()?;
                match key {
                    "type" => tag = Some(tag_of(r.str()?)),
                    "block_hashes" => f.hashes = r.hashes()?,
                    "parent_block_hash" => f.parent = r.opt_hash()?,
                    "token_ids" => f.tokens = r.tokens()?,
                    "block_size" => f.block_size = r.opt_int()?,
                    "lora_id" => f.lora_id = r.opt_int()?,
                    "medium" => f.medium = r.opt_str()?.map(str::to_owned),
                    "lora_name" => f.lora_name = r.opt_str()?.map(str::to_owned),
                    "cache_salt" => f.cache_salt = r.opt_str()?.map(str::to_owned),
                    "extra_keys" => extra_keys = r.extra_keys()?,
                    "group_idx" => f.group_idx = r.opt_int()?,
                    "kv_cache_spec_kind" => f.kind_ok = kind_ok(r.opt_str()?),
                    _ => r.skip(1)?,
                }
            }
            tag.ok_or(DecodeError::Value {
                at: r.at(),
                what: "map event without \"type\"",
            })?
        }
        _ => {
            return Err(DecodeError::Type {
                at: r.at(),
                expected: "event array or map",
            })
        }
    };
    let at = r.at();
    if tag == Tag::Unknown {
        stats.skipped_unknown += 1;
        return Ok(None);
    }
    if tag != Tag::Cleared && (f.group_idx.is_some_and(|g| g != 0) || !f.kind_ok) {
        stats.skipped_other_group += 1;
        return Ok(None);
    }
    let tier = Tier::from_medium(f.medium.as_deref());
    Ok(Some(match tag {
        Tag::Cleared => KvEvent::AllBlocksCleared,
        Tag::Removed => KvEvent::BlockRemoved {
            hashes: f.hashes,
            tier,
        },
        Tag::Stored => {
            let lora_name = f.lora_name.filter(|s| !s.is_empty());
            if lora_name.is_none() && f.lora_id.is_some_and(|id| id != 0) {
                stats.lora_id_only += 1;
            }
            let cache_salt = f
                .cache_salt
                .filter(|s| !s.is_empty())
                .or_else(|| extra_keys.and_then(|keys| salt_of(keys, lora_name.as_deref())));
            let blocks = split_blocks(f.hashes, f.tokens, f.block_size, at)?;
            KvEvent::BlockStored {
                parent: f.parent,
                blocks,
                tier,
                lora_name,
                cache_salt,
            }
        }
        Tag::Unknown => unreachable!("handled above"),
    }))
}

/// Kinds of KV-cache group whose blocks are a plain token prefix (what the index models).
fn kind_ok(kind: Option<&str>) -> bool {
    matches!(kind, None | Some("full_attention") | Some("mla_attention"))
}

/// Splits an event's tokens among its hashes, `block_size` tokens each.
fn split_blocks(
    hashes: Vec<EngineHash>,
    tokens: Vec<u32>,
    block_size: Option<i128>,
    at: usize,
) -> Result<Vec<StoredBlock>, DecodeError> {
    let n = hashes.len();
    if n == 0 {
        return Ok(Vec::new());
    }
    let bs = match block_size {
        Some(bs) if bs >= 1 && bs <= u32::MAX as i128 => bs as usize,
        // Older SGLang could omit it: one page per hash, tokens evenly spread.
        None if tokens.len().is_multiple_of(n) && !tokens.is_empty() => tokens.len() / n,
        _ => {
            return Err(DecodeError::Value {
                at,
                what: "block_size",
            })
        }
    };
    // The last block may be short (a partial SGLang page), never empty.
    if tokens.len() <= (n - 1) * bs {
        return Err(DecodeError::Value {
            at,
            what: "fewer token_ids than block_hashes",
        });
    }
    let mut blocks = Vec::with_capacity(n);
    let mut rest = &tokens[..];
    for hash in hashes {
        let take = bs.min(rest.len());
        blocks.push(StoredBlock {
            hash,
            tokens: rest[..take].to_vec(),
            block_hash: None,
        });
        rest = &rest[take..];
    }
    Ok(blocks)
}

/// One element of the first block's `extra_keys` tuple, as far as the salt is concerned.
enum ExtraKey {
    Str(String),
    /// A tagged pair such as `("cache_salt", s)` or an untagged `(mm_hash, offset)`.
    Pair(Option<String>, Option<String>),
    Other,
}

/// vLLM sends `cache_salt` only in the first block's `extra_keys`. On the wire the tuple is
/// untagged (`lora_name`, `(mm_id, offset)` pairs, the salt string, prompt-embed digests as
/// bytes), while newer code may carry tagged pairs: take a `("cache_salt", s)` pair when there
/// is one, otherwise the last plain string that is not the LoRA name.
fn salt_of(keys: Vec<ExtraKey>, lora_name: Option<&str>) -> Option<String> {
    let mut plain = None;
    let mut prev_tag = false;
    for key in keys {
        match key {
            ExtraKey::Pair(Some(t), Some(s)) if t == "cache_salt" => {
                return Some(s).filter(|s| !s.is_empty())
            }
            ExtraKey::Str(s) if prev_tag => return Some(s).filter(|s| !s.is_empty()),
            ExtraKey::Str(s) if s == "cache_salt" => prev_tag = true,
            ExtraKey::Str(s) if Some(s.as_str()) != lora_name && !s.is_empty() => plain = Some(s),
            _ => prev_tag = false,
        }
    }
    plain
}

/// The event-shaped values: engine hashes, token lists, `extra_keys`.
impl Reader<'_> {
    /// An engine hash: u64, i64 (two's-complement bits) or bin (last 8 bytes, big-endian).
    fn hash(&mut self) -> Result<EngineHash, DecodeError> {
        let at = self.at();
        if let Some(v) = self.int()? {
            return Ok(EngineHash(v as u64));
        }
        if let Some(bytes) = self.bin()? {
            let tail = &bytes[bytes.len().saturating_sub(8)..];
            return Ok(EngineHash(
                tail.iter().fold(0u64, |acc, &b| acc << 8 | b as u64),
            ));
        }
        Err(DecodeError::Type {
            at,
            expected: "block hash (int or bytes)",
        })
    }

    /// A parent hash; nil, and the llm-d-inference-sim's `0`, mean none.
    fn opt_hash(&mut self) -> Result<Option<EngineHash>, DecodeError> {
        if self.peek()? == 0xc0 {
            self.u8()?;
            return Ok(None);
        }
        Ok(Some(self.hash()?).filter(|h| h.0 != 0))
    }

    fn hashes(&mut self) -> Result<Vec<EngineHash>, DecodeError> {
        let n = self.array_len()?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.hash()?);
        }
        Ok(out)
    }

    /// Token ids: u32s, or SGLang EAGLE bigram pairs `[a, b]`, of which the first is the token.
    fn tokens(&mut self) -> Result<Vec<u32>, DecodeError> {
        let n = self.array_len()?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let at = self.at();
            // Fast path: positive fixint, the common case for small vocabularies' first ids.
            let m = self.peek()?;
            let v = if m <= 0x7f {
                self.u8()?;
                m as i128
            } else if is_array(m) {
                let k = self.array_len()?;
                if k == 0 {
                    return Err(DecodeError::Value {
                        at,
                        what: "empty token pair",
                    });
                }
                let first = self.int()?.ok_or(DecodeError::Type {
                    at,
                    expected: "token id",
                })?;
                for _ in 1..k {
                    self.skip(1)?;
                }
                first
            } else {
                self.int()?.ok_or(DecodeError::Type {
                    at,
                    expected: "token id",
                })?
            };
            out.push(u32::try_from(v).map_err(|_| DecodeError::Value {
                at,
                what: "token id out of u32 range",
            })?);
        }
        Ok(out)
    }

    /// `extra_keys`: nil, or one entry per block; only the first block's entry matters.
    fn extra_keys(&mut self) -> Result<Option<Vec<ExtraKey>>, DecodeError> {
        if self.peek()? == 0xc0 {
            self.u8()?;
            return Ok(None);
        }
        let n = self.array_len()?;
        let mut first = None;
        for i in 0..n {
            if i > 0 || !is_array(self.peek()?) {
                self.skip(1)?;
                continue;
            }
            let k = self.array_len()?;
            let mut keys = Vec::with_capacity(k.min(16));
            for _ in 0..k {
                let m = self.peek()?;
                if let Some(s) = self.str_bytes()? {
                    keys.push(ExtraKey::Str(String::from_utf8_lossy(s).into_owned()));
                } else if is_array(m) {
                    let len = self.array_len()?;
                    let mut parts = [None, None];
                    for j in 0..len {
                        match (self.str_bytes()?, parts.get_mut(j)) {
                            (Some(s), Some(slot)) => {
                                *slot = Some(String::from_utf8_lossy(s).into_owned())
                            }
                            (Some(_), None) => {}
                            (None, _) => self.skip(2)?,
                        }
                    }
                    let [a, b] = parts;
                    keys.push(ExtraKey::Pair(a, b));
                } else {
                    self.skip(1)?;
                    keys.push(ExtraKey::Other);
                }
            }
            first = Some(keys);
        }
        Ok(first)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn vllm_033_map_event_with_map16_header() {
        let b = decode(&unhex("93cb3ff800000000000091de0008a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cfb9807785afee48bb07b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c000")).unwrap();
        assert_eq!(b.ts, 1.5);
        assert_eq!(b.dp_rank, Some(0));
        assert_eq!(
            b.events,
            vec![KvEvent::BlockStored {
                parent: None,
                blocks: vec![
                    StoredBlock {
                        hash: EngineHash(13366815110101616827),
                        tokens: vec![1, 2, 3, 4],
                        block_hash: None
                    },
                    StoredBlock {
                        hash: EngineHash(7),
                        tokens: vec![5, 6, 7, 8],
                        block_hash: None
                    },
                ],
                tier: Tier::Gpu,
                lora_name: None,
                cache_salt: None,
            }]
        );
    }

    #[test]
    fn salt_comes_from_first_blocks_extra_keys() {
        let keys = vec![
            ExtraKey::Str("lora-a".into()),
            ExtraKey::Pair(Some("mm".into()), None),
            ExtraKey::Str("s1".into()),
        ];
        assert_eq!(salt_of(keys, Some("lora-a")).as_deref(), Some("s1"));
        let keys = vec![ExtraKey::Str("lora-a".into())];
        assert_eq!(salt_of(keys, Some("lora-a")), None);
        let keys = vec![
            ExtraKey::Pair(Some("cache_salt".into()), Some("s2".into())),
            ExtraKey::Str("x".into()),
        ];
        assert_eq!(salt_of(keys, None).as_deref(), Some("s2"));
        let keys = vec![
            ExtraKey::Str("cache_salt".into()),
            ExtraKey::Str("s3".into()),
        ];
        assert_eq!(salt_of(keys, None).as_deref(), Some("s3"));
    }

    #[test]
    fn bad_payloads_are_errors() {
        assert!(matches!(decode(&[]), Err(DecodeError::Truncated { at: 0 })));
        assert!(matches!(decode(&[0xc1]), Err(DecodeError::Type { .. })));
        // An array header claiming 4 billion events in a 10-byte payload.
        assert!(matches!(
            decode(&unhex(
                "93cb3ff8000000000000dd ffffffff".replace(' ', "").as_str()
            )),
            Err(DecodeError::Truncated { .. })
        ));
        // Trailing garbage.
        let mut ok = unhex("92cb3ff800000000000090");
        assert!(decode(&ok).is_ok());
        ok.push(0);
        assert!(matches!(decode(&ok), Err(DecodeError::Value { .. })));
    }

    /// A tiny msgpack writer for hand-made events.
    enum V {
        Nil,
        U(u64, u8),
        I(i64, u8),
        S(&'static str),
        B(Vec<u8>),
        A(Vec<V>),
        M(Vec<(&'static str, V)>, bool),
    }

    fn enc(v: &V, w: &mut Vec<u8>) {
        match v {
            V::Nil => w.push(0xc0),
            V::U(x, 0) => w.push(*x as u8),
            V::U(x, m) => {
                w.push(*m);
                let n = 1usize << (m - 0xcc);
                w.extend_from_slice(&x.to_be_bytes()[8 - n..]);
            }
            V::I(x, m) => {
                w.push(*m);
                let n = 1usize << (m - 0xd0);
                w.extend_from_slice(&x.to_be_bytes()[8 - n..]);
            }
            V::S(s) => {
                w.push(0xa0 | s.len() as u8);
                w.extend_from_slice(s.as_bytes());
            }
            V::B(b) => {
                w.push(0xc4);
                w.push(b.len() as u8);
                w.extend_from_slice(b);
            }
            V::A(items) => {
                w.push(0xdc);
                w.extend_from_slice(&(items.len() as u16).to_be_bytes());
                items.iter().for_each(|i| enc(i, w));
            }
            V::M(items, wide) => {
                if *wide {
                    w.push(0xdf);
                    w.extend_from_slice(&(items.len() as u32).to_be_bytes());
                } else {
                    w.push(0x80 | items.len() as u8);
                }
                for (k, v) in items {
                    enc(&V::S(k), w);
                    enc(v, w);
                }
            }
        }
    }

    fn batch_of(events: Vec<V>) -> Vec<u8> {
        let mut w = Vec::new();
        enc(&V::A(vec![V::U(1, 0), V::A(events), V::U(2, 0xcd)]), &mut w);
        w
    }

    fn map_stored(extra: Vec<(&'static str, V)>) -> V {
        let mut fields = vec![
            ("type", V::S("BlockStored")),
            ("block_hashes", V::A(vec![V::U(9, 0xce)])),
            ("parent_block_hash", V::Nil),
            (
                "token_ids",
                V::A(vec![
                    V::U(1, 0),
                    V::U(300, 0xcd),
                    V::U(70_000, 0xce),
                    V::U(5, 0xcf),
                ]),
            ),
            ("block_size", V::U(4, 0xcc)),
            ("medium", V::S("CPU_PINNED")),
        ];
        fields.extend(extra);
        V::M(fields, true)
    }

    #[test]
    fn other_groups_and_kinds_are_skipped_and_counted() {
        let b = decode(&batch_of(vec![
            map_stored(vec![("group_idx", V::U(1, 0))]),
            map_stored(vec![("kv_cache_spec_kind", V::S("sliding_window"))]),
            map_stored(vec![
                ("group_idx", V::U(0, 0)),
                ("kv_cache_spec_kind", V::S("full_attention")),
            ]),
            V::A(vec![
                V::S("BlockRemoved"),
                V::A(vec![V::I(-5, 0xd0)]),
                V::S("GPU"),
                V::U(2, 0),
            ]),
            V::M(vec![("type", V::S("SomethingNew"))], false),
        ]))
        .unwrap();
        assert_eq!(b.stats.skipped_other_group, 3);
        assert_eq!(b.stats.skipped_unknown, 1);
        assert_eq!(b.events.len(), 1);
        assert_eq!(b.dp_rank, Some(2));
        match &b.events[0] {
            KvEvent::BlockStored { blocks, tier, .. } => {
                assert_eq!(
                    blocks[0].tokens,
                    vec![1, 300, 70_000, 5],
                    "every integer width"
                );
                assert_eq!(*tier, Tier::Cpu);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn lora_id_only_is_counted_and_names_no_lora() {
        let b = decode(&batch_of(vec![map_stored(vec![
            ("lora_id", V::U(3, 0)),
            ("lora_name", V::Nil),
        ])]))
        .unwrap();
        assert_eq!(b.stats.lora_id_only, 1);
        assert!(matches!(
            &b.events[0],
            KvEvent::BlockStored {
                lora_name: None,
                ..
            }
        ));
    }

    #[test]
    fn salts_from_vllm_extra_keys_and_sglang_fields() {
        let extra = V::A(vec![
            V::A(vec![
                V::S("my-lora"),
                V::A(vec![V::S("mmhash"), V::U(0, 0)]),
                V::S("salty"),
            ]),
            V::Nil,
        ]);
        let b = decode(&batch_of(vec![map_stored(vec![
            ("lora_name", V::S("my-lora")),
            ("extra_keys", extra),
        ])]))
        .unwrap();
        assert!(
            matches!(&b.events[0], KvEvent::BlockStored { cache_salt: Some(s), lora_name: Some(l), .. } if s == "salty" && l == "my-lora")
        );
        // SGLang 0.5.20+ map field.
        let b = decode(&batch_of(vec![map_stored(vec![(
            "cache_salt",
            V::S("s2"),
        )])]))
        .unwrap();
        assert!(
            matches!(&b.events[0], KvEvent::BlockStored { cache_salt: Some(s), .. } if s == "s2")
        );
        // SGLang 0.5.18 BlockStoredWithMetadata: trailing {"cache_salt": s}.
        let ev = V::A(vec![
            V::S("BlockStored"),
            V::A(vec![V::I(-7, 0xd3)]),
            V::Nil,
            V::A(vec![V::U(1, 0), V::U(2, 0)]),
            V::U(2, 0),
            V::Nil,
            V::S("GPU"),
            V::M(vec![("cache_salt", V::S("s3"))], false),
        ]);
        let b = decode(&batch_of(vec![ev])).unwrap();
        match &b.events[0] {
            KvEvent::BlockStored {
                cache_salt, blocks, ..
            } => {
                assert_eq!(cache_salt.as_deref(), Some("s3"));
                assert_eq!(
                    blocks[0].hash,
                    EngineHash(-7i64 as u64),
                    "i64 hashes keep their bits"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn byte_hashes_take_the_last_8_bytes_big_endian_left_padded() {
        let long: Vec<u8> = (1..=32).collect();
        let ev = V::M(
            vec![
                ("type", V::S("BlockRemoved")),
                ("block_hashes", V::A(vec![V::B(long), V::B(vec![1, 2])])),
            ],
            false,
        );
        let b = decode(&batch_of(vec![ev])).unwrap();
        assert_eq!(
            b.events[0],
            KvEvent::BlockRemoved {
                hashes: vec![EngineHash(0x191a_1b1c_1d1e_1f20), EngineHash(0x0102)],
                tier: Tier::Gpu
            }
        );
    }

    #[test]
    fn sglang_partial_last_page_keeps_its_tokens() {
        let ev = V::A(vec![
            V::S("BlockStored"),
            V::A(vec![V::U(1, 0), V::U(2, 0)]),
            V::Nil,
            V::A(vec![
                V::U(1, 0),
                V::U(2, 0),
                V::U(3, 0),
                V::U(4, 0),
                V::U(5, 0),
            ]),
            V::U(3, 0),
        ]);
        let b = decode(&batch_of(vec![ev])).unwrap();
        match &b.events[0] {
            KvEvent::BlockStored { blocks, .. } => {
                assert_eq!(blocks[0].tokens, vec![1, 2, 3]);
                assert_eq!(blocks[1].tokens, vec![4, 5]);
            }
            other => panic!("{other:?}"),
        }
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn arbitrary_tails_of_a_batch_header_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut framed = unhex("93cb3ff8000000000000");
            framed.extend_from_slice(&bytes);
            let _ = decode(&framed);
        }

        #[test]
        fn corrupted_vectors_never_panic(at in any::<prop::sample::Index>(), byte in any::<u8>()) {
            let mut bytes = unhex("93cb4000000000000000919cab426c6f636b53746f72656491cfcb73eeaed59c009dcfb9807785afee48bb94090a0b0c04c0a3475055c091c000ae66756c6c5f617474656e74696f6ec0c0");
            let i = at.index(bytes.len());
            bytes[i] = byte;
            let _ = decode(&bytes);
        }
    }
}
