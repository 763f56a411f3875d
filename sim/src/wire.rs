//! KV events on the wire, byte for byte as the real engines publish them
//! (ARCHITECTURE.md, "KV events"): the msgpack batch, the replay reply shapes, and the
//! dp-rank port offset.
//!
//! # Layout
//!
//! A PUB message is 3 frames `[topic, seq u64 BE, payload]`; `payload` is the batch, a msgpack
//! array `[ts float64, events, dp_rank]`. msgspec's habits are reproduced: integers in their
//! smallest form (`cf` only above `u32::MAX`), negative SGLang hashes as signed ints, floats
//! always float64 (`cb`), strings as fixstr.
//!
//! | format | events | `BlockStored` |
//! |---|---|---|
//! | `vllm-0.33` | map, `"type"` first | map16 header (`de 00 nn`: 15 declared fields + tag), keys `type, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name` then the optional `extra_keys, group_idx, kv_cache_spec_kind` |
//! | `vllm-0.23` | array, tag first, every field present | 12 elements: tag, hashes, parent, tokens, block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window |
//! | `sglang` (0.5.23) | fixmap | `type, block_hashes (i64), parent_block_hash, token_ids, block_size, lora_id, medium` |
//! | `sglang-0.5.18` | array, tag first | 7 elements: tag, hashes (i64), parent, tokens, block_size, lora_id, medium |
//!
//! `BlockRemoved`: vLLM 0.33 map `{type, block_hashes, medium[, group_idx]}`, vLLM 0.23 array
//! `[tag, hashes, medium, group_idx]`, SGLang map `{type, block_hashes, medium}`, SGLang 0.5.18
//! array `[tag, hashes, medium]`. `AllBlocksCleared`: `{type}` or `[tag]`.
//!
//! `medium` is the event's tier (`GPU`, `CPU`, `DISK`). vLLM carries a LoRA adapter in
//! `lora_name` and a cache salt as the first block's `extra_keys` (`[[salt], None, …]`); SGLang
//! carries neither.
//!
//! Replay (ROUTER, as a DEALER sees it), [`ReplayShape`]: vLLM ≤ 0.25 `["", seq, payload]` per
//! batch and end marker `["", ff×8, ""]`; vLLM ≥ 0.26 and SGLang 0.5.23 `["", topic, seq,
//! payload]` and `["", "", ff×8, ""]`.

use std::fmt;
use std::str::FromStr;

use bytes::Bytes;
use kvroute::event::{EngineHash, KvEvent, StoredBlock, Tier};

use crate::cache::CacheEvent;

/// A real engine's event format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventFormat {
    /// vLLM 0.26–0.33: map events, new replay shape.
    Vllm033,
    /// vLLM 0.22–0.23: array events, old replay shape.
    Vllm023,
    /// SGLang 0.5.23: map events, signed i64 hashes, new replay shape.
    Sglang,
    /// SGLang ≤ 0.5.18: positional array events (7 fields), signed i64 hashes. Its replay
    /// shape is not pinned by a capture; the new one is used.
    SglangLegacy,
}

impl EventFormat {
    pub const ALL: [EventFormat; 4] = [
        EventFormat::Vllm033,
        EventFormat::Vllm023,
        EventFormat::Sglang,
        EventFormat::SglangLegacy,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EventFormat::Vllm033 => "vllm-0.33",
            EventFormat::Vllm023 => "vllm-0.23",
            EventFormat::Sglang => "sglang",
            EventFormat::SglangLegacy => "sglang-0.5.18",
        }
    }

    /// Whether the engine is SGLang (its block hashes, signed hashes, coalesced removals).
    pub fn is_sglang(self) -> bool {
        matches!(self, EventFormat::Sglang | EventFormat::SglangLegacy)
    }

    /// The replay reply shape this engine version uses.
    pub fn replay_shape(self) -> ReplayShape {
        match self {
            EventFormat::Vllm023 => ReplayShape::Old,
            _ => ReplayShape::New,
        }
    }
}

/// How the replay ROUTER frames its replies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReplayShape {
    /// vLLM ≤ 0.25: `["", seq, payload]`, end `["", ff×8, ""]`.
    Old,
    /// vLLM ≥ 0.26, SGLang 0.5.23: `["", topic, seq, payload]`, end `["", "", ff×8, ""]`.
    New,
}

impl fmt::Display for EventFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for EventFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        EventFormat::ALL
            .into_iter()
            .find(|f| f.as_str() == s)
            .ok_or_else(|| {
                format!("unknown event format {s:?} (vllm-0.33, vllm-0.23, sglang, sglang-0.5.18)")
            })
    }
}

/// One event as it goes on the wire (after SGLang's coalescing).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireEvent {
    BlockStored {
        hashes: Vec<EngineHash>,
        parent: Option<EngineHash>,
        token_ids: Vec<u32>,
        block_size: usize,
        /// Sent as `medium`.
        tier: Tier,
        /// vLLM only.
        lora_name: Option<String>,
        /// vLLM only, in the first block's `extra_keys`.
        cache_salt: Option<String>,
    },
    BlockRemoved {
        hashes: Vec<EngineHash>,
        tier: Tier,
    },
    AllBlocksCleared,
}

impl WireEvent {
    /// A GPU `BlockStored` without LoRA or salt, what the simulated engine stores.
    pub fn stored(
        hashes: Vec<EngineHash>,
        parent: Option<EngineHash>,
        token_ids: Vec<u32>,
        block_size: usize,
    ) -> WireEvent {
        WireEvent::BlockStored {
            hashes,
            parent,
            token_ids,
            block_size,
            tier: Tier::Gpu,
            lora_name: None,
            cache_salt: None,
        }
    }

    /// A GPU `BlockRemoved`.
    pub fn removed(hashes: Vec<EngineHash>) -> WireEvent {
        WireEvent::BlockRemoved {
            hashes,
            tier: Tier::Gpu,
        }
    }
}

/// The core's view of an event, as an engine would send it: `block_size` is the first
/// block's length, the tokens are the blocks' tokens in order.
impl From<&KvEvent> for WireEvent {
    fn from(e: &KvEvent) -> WireEvent {
        match e {
            KvEvent::BlockStored {
                parent,
                blocks,
                tier,
                lora_name,
                cache_salt,
            } => WireEvent::BlockStored {
                hashes: blocks.iter().map(|b| b.hash).collect(),
                parent: *parent,
                token_ids: blocks
                    .iter()
                    .flat_map(|b| b.tokens.iter().copied())
                    .collect(),
                block_size: blocks.first().map_or(0, |b| b.tokens.len()),
                tier: *tier,
                lora_name: lora_name.clone(),
                cache_salt: cache_salt.clone(),
            },
            KvEvent::BlockRemoved { hashes, tier } => WireEvent::BlockRemoved {
                hashes: hashes.clone(),
                tier: *tier,
            },
            KvEvent::AllBlocksCleared => WireEvent::AllBlocksCleared,
        }
    }
}

/// A GPU `BlockStored` of consecutive blocks of `tokens` (`block_size` each) with engine
/// hashes `first_hash, first_hash + 1, …`: the shape tests and benchmarks publish.
pub fn stored(parent: Option<u64>, first_hash: u64, tokens: &[u32], block_size: usize) -> KvEvent {
    KvEvent::BlockStored {
        parent: parent.map(EngineHash),
        blocks: tokens
            .chunks(block_size.max(1))
            .zip(first_hash..)
            .map(|(t, h)| StoredBlock {
                hash: EngineHash(h),
                tokens: t.to_vec(),
                block_hash: None,
            })
            .collect(),
        tier: Tier::Gpu,
        lora_name: None,
        cache_salt: None,
    }
}

/// Encodes core events as one batch (see [`encode_batch`]).
pub fn encode_events(
    format: EventFormat,
    extras: Extras,
    ts: f64,
    events: &[KvEvent],
    dp_rank: Option<u32>,
) -> Vec<u8> {
    let wire: Vec<WireEvent> = events.iter().map(WireEvent::from).collect();
    encode_batch(format, extras, ts, &wire, dp_rank)
}

/// Fields a real engine fills beyond the mandatory ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extras {
    /// vLLM ≥ 0.17: `extra_keys = [None] * n`, `group_idx = 0`, `kv_cache_spec_kind =
    /// "full_attention"` on `BlockStored`, `group_idx = 0` on `BlockRemoved` (what vLLM's
    /// block pool sets for a plain full-attention model). Off: only the mandatory fields, as
    /// in the reference vectors built by hand.
    pub vllm_group_fields: bool,
}

impl Extras {
    /// What a real engine of `format` sends.
    pub fn engine(format: EventFormat) -> Extras {
        Extras {
            vllm_group_fields: !format.is_sglang(),
        }
    }
}

/// Turns cache changes into wire events: SGLang merges consecutive removals (its
/// `KVCacheEventRecorder` coalesces them); vLLM sends one removal per evicted block.
pub fn to_wire(format: EventFormat, block_size: usize, events: &[CacheEvent]) -> Vec<WireEvent> {
    let mut out: Vec<WireEvent> = Vec::with_capacity(events.len());
    for e in events {
        match e {
            CacheEvent::BlockStored {
                parent,
                hashes,
                token_ids,
            } => out.push(WireEvent::stored(
                hashes.clone(),
                *parent,
                token_ids.clone(),
                block_size,
            )),
            CacheEvent::BlockRemoved { hash } => {
                if format.is_sglang() {
                    if let Some(WireEvent::BlockRemoved { hashes, .. }) = out.last_mut() {
                        hashes.push(*hash);
                        continue;
                    }
                }
                out.push(WireEvent::removed(vec![*hash]))
            }
            CacheEvent::AllBlocksCleared => out.push(WireEvent::AllBlocksCleared),
        }
    }
    out
}

/// Encodes one batch `[ts, events, dp_rank]`.
pub fn encode_batch(
    format: EventFormat,
    extras: Extras,
    ts: f64,
    events: &[WireEvent],
    dp_rank: Option<u32>,
) -> Vec<u8> {
    let mut w = Vec::with_capacity(64 + events.len() * 64);
    put_array(&mut w, 3);
    rmp::encode::write_f64(&mut w, ts).expect("vec write");
    put_array(&mut w, events.len() as u32);
    for e in events {
        match format {
            EventFormat::Vllm033 => vllm033_event(&mut w, extras, e),
            EventFormat::Vllm023 => vllm023_event(&mut w, extras, e),
            EventFormat::Sglang => sglang_event(&mut w, e),
            EventFormat::SglangLegacy => sglang_legacy_event(&mut w, e),
        }
    }
    match dp_rank {
        Some(r) => put_uint(&mut w, u64::from(r)),
        None => put_nil(&mut w),
    }
    w
}

fn vllm033_event(w: &mut Vec<u8>, x: Extras, e: &WireEvent) {
    match e {
        WireEvent::BlockStored {
            hashes,
            parent,
            token_ids,
            block_size,
            tier,
            lora_name,
            cache_salt,
        } => {
            let n = if x.vllm_group_fields {
                11
            } else {
                8 + usize::from(cache_salt.is_some())
            };
            // msgspec picks the header from the declared field count (15 + tag > 15): map16.
            w.push(0xde);
            w.extend_from_slice(&(n as u16).to_be_bytes());
            put_str(w, "type");
            put_str(w, "BlockStored");
            put_str(w, "block_hashes");
            put_hashes(w, hashes, false);
            put_str(w, "parent_block_hash");
            put_opt_hash(w, *parent, false);
            put_str(w, "token_ids");
            put_tokens(w, token_ids);
            put_str(w, "block_size");
            put_uint(w, *block_size as u64);
            put_str(w, "lora_id");
            put_nil(w);
            put_str(w, "medium");
            put_str(w, medium(*tier));
            put_str(w, "lora_name");
            put_opt_str(w, lora_name.as_deref());
            if x.vllm_group_fields || cache_salt.is_some() {
                put_str(w, "extra_keys");
                put_extra_keys(w, hashes.len(), cache_salt.as_deref());
            }
            if x.vllm_group_fields {
                put_str(w, "group_idx");
                put_uint(w, 0);
                put_str(w, "kv_cache_spec_kind");
                put_str(w, "full_attention");
            }
        }
        WireEvent::BlockRemoved { hashes, tier } => {
            put_map(w, if x.vllm_group_fields { 4 } else { 3 });
            put_str(w, "type");
            put_str(w, "BlockRemoved");
            put_str(w, "block_hashes");
            put_hashes(w, hashes, false);
            put_str(w, "medium");
            put_str(w, medium(*tier));
            if x.vllm_group_fields {
                put_str(w, "group_idx");
                put_uint(w, 0);
            }
        }
        WireEvent::AllBlocksCleared => {
            put_map(w, 1);
            put_str(w, "type");
            put_str(w, "AllBlocksCleared");
        }
    }
}

fn vllm023_event(w: &mut Vec<u8>, x: Extras, e: &WireEvent) {
    match e {
        WireEvent::BlockStored {
            hashes,
            parent,
            token_ids,
            block_size,
            tier,
            lora_name,
            cache_salt,
        } => {
            put_array(w, 12);
            put_str(w, "BlockStored");
            put_hashes(w, hashes, false);
            put_opt_hash(w, *parent, false);
            put_tokens(w, token_ids);
            put_uint(w, *block_size as u64);
            put_nil(w); // lora_id
            put_str(w, medium(*tier));
            put_opt_str(w, lora_name.as_deref());
            if x.vllm_group_fields || cache_salt.is_some() {
                put_extra_keys(w, hashes.len(), cache_salt.as_deref());
            } else {
                put_nil(w);
            }
            if x.vllm_group_fields {
                put_uint(w, 0);
                put_str(w, "full_attention");
            } else {
                put_nil(w);
                put_nil(w);
            }
            put_nil(w); // kv_cache_spec_sliding_window
        }
        WireEvent::BlockRemoved { hashes, tier } => {
            put_array(w, 4);
            put_str(w, "BlockRemoved");
            put_hashes(w, hashes, false);
            put_str(w, medium(*tier));
            if x.vllm_group_fields {
                put_uint(w, 0);
            } else {
                put_nil(w);
            }
        }
        WireEvent::AllBlocksCleared => {
            put_array(w, 1);
            put_str(w, "AllBlocksCleared");
        }
    }
}

fn sglang_event(w: &mut Vec<u8>, e: &WireEvent) {
    match e {
        WireEvent::BlockStored {
            hashes,
            parent,
            token_ids,
            block_size,
            tier,
            ..
        } => {
            put_map(w, 7);
            put_str(w, "type");
            put_str(w, "BlockStored");
            put_str(w, "block_hashes");
            put_hashes(w, hashes, true);
            put_str(w, "parent_block_hash");
            put_opt_hash(w, *parent, true);
            put_str(w, "token_ids");
            put_tokens(w, token_ids);
            put_str(w, "block_size");
            put_uint(w, *block_size as u64);
            put_str(w, "lora_id");
            put_nil(w);
            put_str(w, "medium");
            put_str(w, medium(*tier));
        }
        WireEvent::BlockRemoved { hashes, tier } => {
            put_map(w, 3);
            put_str(w, "type");
            put_str(w, "BlockRemoved");
            put_str(w, "block_hashes");
            put_hashes(w, hashes, true);
            put_str(w, "medium");
            put_str(w, medium(*tier));
        }
        WireEvent::AllBlocksCleared => {
            put_map(w, 1);
            put_str(w, "type");
            put_str(w, "AllBlocksCleared");
        }
    }
}

fn sglang_legacy_event(w: &mut Vec<u8>, e: &WireEvent) {
    match e {
        WireEvent::BlockStored {
            hashes,
            parent,
            token_ids,
            block_size,
            tier,
            ..
        } => {
            put_array(w, 7);
            put_str(w, "BlockStored");
            put_hashes(w, hashes, true);
            put_opt_hash(w, *parent, true);
            put_tokens(w, token_ids);
            put_uint(w, *block_size as u64);
            put_nil(w); // lora_id
            put_str(w, medium(*tier));
        }
        WireEvent::BlockRemoved { hashes, tier } => {
            put_array(w, 3);
            put_str(w, "BlockRemoved");
            put_hashes(w, hashes, true);
            put_str(w, medium(*tier));
        }
        WireEvent::AllBlocksCleared => {
            put_array(w, 1);
            put_str(w, "AllBlocksCleared");
        }
    }
}

/// The `medium` string of a tier.
fn medium(tier: Tier) -> &'static str {
    match tier {
        Tier::Gpu => "GPU",
        Tier::Cpu => "CPU",
        Tier::Disk => "DISK",
    }
}

fn put_opt_str(w: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => put_str(w, s),
        None => put_nil(w),
    }
}

/// vLLM's `extra_keys`: one entry per block, `[salt]` on the first when salted, else `None`.
fn put_extra_keys(w: &mut Vec<u8>, blocks: usize, salt: Option<&str>) {
    put_array(w, blocks as u32);
    for i in 0..blocks {
        match salt {
            Some(s) if i == 0 => {
                put_array(w, 1);
                put_str(w, s);
            }
            _ => put_nil(w),
        }
    }
}

fn put_array(w: &mut Vec<u8>, n: u32) {
    rmp::encode::write_array_len(w, n).expect("vec write");
}

fn put_map(w: &mut Vec<u8>, n: u32) {
    rmp::encode::write_map_len(w, n).expect("vec write");
}

fn put_nil(w: &mut Vec<u8>) {
    rmp::encode::write_nil(w).expect("vec write");
}

fn put_str(w: &mut Vec<u8>, s: &str) {
    rmp::encode::write_str(w, s).expect("vec write");
}

/// Smallest unsigned form, as msgspec writes a non-negative Python int.
fn put_uint(w: &mut Vec<u8>, v: u64) {
    rmp::encode::write_uint(w, v).expect("vec write");
}

/// Smallest signed form for negatives, smallest unsigned form otherwise (msgspec).
fn put_int(w: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        put_uint(w, v as u64);
    } else {
        rmp::encode::write_sint(w, v).expect("vec write");
    }
}

fn put_hash(w: &mut Vec<u8>, h: EngineHash, signed: bool) {
    if signed {
        put_int(w, h.0 as i64);
    } else {
        put_uint(w, h.0);
    }
}

fn put_opt_hash(w: &mut Vec<u8>, h: Option<EngineHash>, signed: bool) {
    match h {
        Some(h) => put_hash(w, h, signed),
        None => put_nil(w),
    }
}

fn put_hashes(w: &mut Vec<u8>, hashes: &[EngineHash], signed: bool) {
    put_array(w, hashes.len() as u32);
    for &h in hashes {
        put_hash(w, h, signed);
    }
}

fn put_tokens(w: &mut Vec<u8>, tokens: &[u32]) {
    put_array(w, tokens.len() as u32);
    for &t in tokens {
        put_uint(w, u64::from(t));
    }
}

/// The end-of-replay sequence number (`-1` as a signed 64-bit int).
pub const REPLAY_END_SEQ: [u8; 8] = [0xff; 8];

/// The frames of one replayed batch, after the ROUTER's `[identity, ""]`.
pub fn replay_reply(shape: ReplayShape, topic: &Bytes, seq: u64, payload: &Bytes) -> Vec<Bytes> {
    let seq = Bytes::copy_from_slice(&seq.to_be_bytes());
    match shape {
        ReplayShape::New => vec![topic.clone(), seq, payload.clone()],
        ReplayShape::Old => vec![seq, payload.clone()],
    }
}

/// The frames of the end marker, after the ROUTER's `[identity, ""]`.
pub fn replay_end(shape: ReplayShape) -> Vec<Bytes> {
    let seq = Bytes::from_static(&REPLAY_END_SEQ);
    match shape {
        ReplayShape::New => vec![Bytes::new(), seq, Bytes::new()],
        ReplayShape::Old => vec![seq, Bytes::new()],
    }
}

/// vLLM's `offset_endpoint_port`: rank 0 keeps the endpoint; `tcp://` endpoints add the rank
/// to the port (port 0, "pick one", stays 0); `inproc://` endpoints get a `_dp<rank>` suffix.
///
/// # Errors
/// Other transports with a rank above 0 (vLLM raises `ValueError`), or an unparsable port.
pub fn offset_endpoint_port(endpoint: &str, dp_rank: u32) -> Result<String, String> {
    if endpoint.is_empty() || dp_rank == 0 {
        return Ok(endpoint.to_string());
    }
    if endpoint.contains("inproc") {
        return Ok(format!("{endpoint}_dp{dp_rank}"));
    }
    if endpoint.contains("tcp") {
        let (host, port) = endpoint
            .rsplit_once(':')
            .ok_or_else(|| format!("no port in {endpoint:?}"))?;
        let port: u32 = port
            .parse()
            .map_err(|_| format!("bad port in {endpoint:?}"))?;
        if port == 0 {
            return Ok(endpoint.to_string());
        }
        return Ok(format!("{host}:{}", port + dp_rank));
    }
    Err("Invalid endpoint: must contain 'inproc' or 'tcp'".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_offsets_follow_vllm() {
        assert_eq!(
            offset_endpoint_port("tcp://*:5557", 3).unwrap(),
            "tcp://*:5560"
        );
        assert_eq!(
            offset_endpoint_port("tcp://*:5557", 0).unwrap(),
            "tcp://*:5557"
        );
        assert_eq!(
            offset_endpoint_port("inproc://cache", 2).unwrap(),
            "inproc://cache_dp2"
        );
        assert_eq!(
            offset_endpoint_port("tcp://127.0.0.1:0", 2).unwrap(),
            "tcp://127.0.0.1:0"
        );
        assert!(offset_endpoint_port("ipc:///tmp/x", 1).is_err());
    }

    #[test]
    fn sglang_coalesces_removals_vllm_does_not() {
        let ev = [
            CacheEvent::BlockRemoved {
                hash: EngineHash(1),
            },
            CacheEvent::BlockRemoved {
                hash: EngineHash(2),
            },
            CacheEvent::BlockStored {
                parent: None,
                hashes: vec![EngineHash(3)],
                token_ids: vec![1, 2],
            },
            CacheEvent::BlockRemoved {
                hash: EngineHash(4),
            },
        ];
        assert_eq!(to_wire(EventFormat::Vllm033, 2, &ev).len(), 4);
        let s = to_wire(EventFormat::Sglang, 2, &ev);
        assert_eq!(s.len(), 3);
        assert_eq!(s[0], WireEvent::removed(vec![EngineHash(1), EngineHash(2)]));
    }

    #[test]
    fn formats_parse_by_name() {
        for f in EventFormat::ALL {
            assert_eq!(f.as_str().parse::<EventFormat>().unwrap(), f);
        }
        assert!("vllm-0.9".parse::<EventFormat>().is_err());
    }
}
