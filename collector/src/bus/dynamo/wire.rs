//! One Dynamo KV event message off NATS, decoded: the event plane's envelope around an array
//! of `RouterEvent`s (or one), or a bare `RouterEvent` in JSON as older Dynamo releases
//! published it; and the data frames of a worker's answer to a KV query.
//!
//! # Layout
//!
//! What a Dynamo worker publishes (checked against ai-dynamo 1.6.1, `testdata/dynamo/`; see
//! [`super`]):
//!
//! - **event plane, msgpack** (`DYN_EVENT_PLANE=nats`): a msgpack *map*, the `EventEnvelope`
//!   written with field names (`rmp_serde::to_vec_named`): `{"publisher_id": u64, "sequence":
//!   u64, "published_at": u64 (ms), "topic": str, "payload": bin}`; in 1.6.1 `payload` is a
//!   msgpack array of `RouterEvent`s, with field names too; earlier, one `RouterEvent`;
//! - **JSON** (Dynamo before the event plane, `component.publish`): the `RouterEvent` itself as
//!   a JSON object; also the first event plane's JSON `NatsEnvelope`
//!   `{"publisher_id", "sequence", "published_at", "payload": [bytes as numbers]}` around a
//!   JSON `RouterEvent`.
//!
//! A `RouterEvent` is
//! `{"worker_id": u64, "storage_tier": "device"|"host_pinned"|"disk"|"external" (absent:
//! device), "residency_domain"?: "worker"|"cache_owner", "event": KvCacheEvent,
//! "state_source"?: ..}`; a `KvCacheEvent` is `{"event_id": u64, "data": KvCacheEventData,
//! "dp_rank": u32 (absent: 0)}`; `data` is serde's external tagging of
//! `Stored(KvCacheStoreData) | Removed(KvCacheRemoveData) | Cleared`: `{"stored": {...}}`,
//! `{"removed": {...}}`, and `"cleared"` (`rmp-serde` 1 writes a unit variant as its name and
//! a newtype variant as a one-key map, as JSON does; a map `{"cleared": nil}` is taken too).
//! A store is `{"parent_hash": u64|nil, "start_position"?: u32|nil, "blocks":
//! [{"block_hash": u64, "tokens_hash": u64, "mm_extra_info"?: ..}]}`, a removal
//! `{"block_hashes": [u64]}`.
//! `block_hash` is the engine's own hash (kvroute's [`EngineHash`]), `tokens_hash` the hash of
//! the block's tokens under the contract kvroute shares with Dynamo (its `BlockHash`).
//! Unknown keys are skipped; structs written positionally (msgpack arrays) are not read.
//!
//! A KV query's answer frame is `{"data": WorkerKvQueryResponse, "complete_final": bool}`,
//! the response externally tagged: `{"Events": {"events": [RouterEvent], "last_event_id"}}`,
//! `{"TreeDump": {"events", "last_event_id", "reset_scope"}}` (the events' ids are positions
//! in the dump), `{"TooNew": {..}}`, `{"InvalidRange": {..}}`, `{"Error": str}` or
//! `TreeDumpFailed` ([`decode_query_frame`]).
//!
//! The caller bounds the message's size before calling [`decode`]; inside it, every msgpack
//! length is checked against the bytes that remain before anything is reserved
//! ([`crate::msgpack`]), and JSON allocates at most in proportion to the message.

use kvroute::event::{EngineHash, Tier};
use kvroute::hash::BlockHash;
use serde::Deserialize;

use crate::msgpack::{self, Reader};

/// One decoded `RouterEvent`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouterEvent {
    /// Dynamo's worker id (its runtime's instance id).
    pub worker_id: u64,
    /// Data-parallel rank of the worker that emitted it.
    pub dp_rank: u32,
    /// The worker's event id: consecutive per (worker, dp rank).
    pub event_id: u64,
    /// Where the blocks are.
    pub tier: Tier,
    /// What happened.
    pub data: EventData,
}

/// What a `RouterEvent` says happened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventData {
    /// A chain of blocks stored below `parent`: each the engine's hash and the contract
    /// hash of its tokens.
    Stored {
        parent: Option<EngineHash>,
        blocks: Vec<(EngineHash, BlockHash)>,
    },
    /// Blocks evicted, by the engine's hashes.
    Removed(Vec<EngineHash>),
    /// The worker's cache was dropped.
    Cleared,
    /// An event of a cache that is not the worker's own (`residency_domain: cache_owner`, a
    /// shared pool a worker is attached to): nothing kvroute's per-worker index can hold.
    Foreign,
}

/// Why a message is not a `RouterEvent`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// Malformed msgpack.
    #[error("msgpack: {0}")]
    Msgpack(#[from] msgpack::DecodeError),
    /// Malformed JSON, or JSON of another shape.
    #[error("JSON: {0}")]
    Json(String),
    /// A required field is absent.
    #[error("no {0}")]
    Missing(&'static str),
    /// A field with a value Dynamo does not send.
    #[error("bad {0}")]
    Bad(&'static str),
}

/// One decoded NATS message: the events it carries and, in an event-plane envelope, the
/// publisher that sent it (the worker's KV query endpoint is named after it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub publisher_id: Option<u64>,
    pub events: Vec<RouterEvent>,
}

/// Decodes one NATS message of a Dynamo KV event subject.
///
/// # Errors
/// Anything that is not one of the shapes in the module doc.
pub fn decode(payload: &[u8]) -> Result<Message, WireError> {
    match payload.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => decode_json(payload),
        _ => decode_msgpack(&mut Reader::new(payload), true),
    }
}

/// A msgpack envelope (when `envelope` allows one), an array of `RouterEvent`s or one bare
/// `RouterEvent`.
fn decode_msgpack(r: &mut Reader<'_>, envelope: bool) -> Result<Message, WireError> {
    if msgpack::is_array(r.peek()?) {
        return Ok(Message {
            publisher_id: None,
            events: event_array(r)?,
        });
    }
    let fields = r.map_len()?;
    let mut ev = EventFields::default();
    let (mut publisher_id, mut payload) = (None, None);
    for _ in 0..fields {
        match r.str()? {
            // Envelopes nest once: the payload of an envelope is events, never an envelope.
            "payload" if envelope => {
                let at = r.at();
                payload = Some(r.bin()?.ok_or(msgpack::DecodeError::Type {
                    at,
                    expected: "bin",
                })?);
            }
            "publisher_id" if envelope => publisher_id = Some(uint(r, "publisher_id")?),
            key => ev.field(r, key)?,
        }
    }
    if let Some(inner) = payload {
        let mut m = decode_msgpack(&mut Reader::new(inner), false)?;
        m.publisher_id = publisher_id;
        return Ok(m);
    }
    Ok(Message {
        publisher_id: None,
        events: vec![ev.finish()?],
    })
}

/// A msgpack array of `RouterEvent` maps.
pub(crate) fn event_array(r: &mut Reader<'_>) -> Result<Vec<RouterEvent>, WireError> {
    let n = r.array_len()?;
    // An event is a map of at least two fields with their names: 20 bytes at the very least.
    let n = r.checked_len(n as u64, 20, r.at())?;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let fields = r.map_len()?;
        let mut ev = EventFields::default();
        for _ in 0..fields {
            let key = r.str()?;
            ev.field(r, key)?;
        }
        v.push(ev.finish()?);
    }
    Ok(v)
}

/// The fields of one `RouterEvent` map as they are read.
#[derive(Default)]
struct EventFields {
    worker_id: Option<u64>,
    tier: Option<Tier>,
    foreign: bool,
    event: Option<(u64, u32, EventData)>,
}

impl EventFields {
    fn field(&mut self, r: &mut Reader<'_>, key: &str) -> Result<(), WireError> {
        match key {
            "worker_id" => self.worker_id = Some(uint(r, "worker_id")?),
            "storage_tier" => self.tier = Some(tier_of(r.str()?)?),
            "residency_domain" => self.foreign = foreign_domain(r.str()?)?,
            "event" => self.event = Some(kv_event(r)?),
            _ => r.skip(0)?,
        }
        Ok(())
    }

    fn finish(self) -> Result<RouterEvent, WireError> {
        let (event_id, dp_rank, data) = self.event.ok_or(WireError::Missing("event"))?;
        Ok(RouterEvent {
            worker_id: self.worker_id.ok_or(WireError::Missing("worker_id"))?,
            dp_rank,
            event_id,
            tier: self.tier.unwrap_or(Tier::Gpu),
            data: if self.foreign {
                EventData::Foreign
            } else {
                data
            },
        })
    }
}

/// What one data frame of a worker's answer to a KV query says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// The events of the range asked for, in order; `last` is the worker's newest event id.
    Events { events: Vec<RouterEvent>, last: u64 },
    /// The worker's whole cache as stores (their event ids are positions, not event ids),
    /// as of event id `last`: what the worker held before is replaced.
    TreeDump { events: Vec<RouterEvent>, last: u64 },
    /// The worker could not answer: `TooNew`, `InvalidRange`, `TreeDumpFailed` or `Error`.
    Refused(&'static str),
}

/// One data frame of the answer: `{"data"?: WorkerKvQueryResponse, "complete_final": bool}`
/// (the last frame carries only `complete_final: true`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueryFrame {
    pub answer: Option<Answer>,
    pub complete_final: bool,
}

/// Decodes one data frame of a worker's KV query answer (msgpack with field names; the
/// response enum externally tagged, `{"Events": {"events", "last_event_id"}}`, ...).
///
/// # Errors
/// Anything of another shape.
pub fn decode_query_frame(body: &[u8]) -> Result<QueryFrame, WireError> {
    let mut r = Reader::new(body);
    let fields = r.map_len()?;
    let mut frame = QueryFrame {
        answer: None,
        complete_final: false,
    };
    for _ in 0..fields {
        match r.str()? {
            "complete_final" => {
                frame.complete_final = match r.u8()? {
                    0xc3 => true,
                    0xc2 => false,
                    _ => return Err(WireError::Bad("complete_final")),
                }
            }
            "data" if msgpack::is_map(r.peek()?) => {
                if r.map_len()? != 1 {
                    return Err(WireError::Bad("data (one variant)"));
                }
                let variant = r.str()?;
                frame.answer = Some(match variant {
                    "Events" | "TreeDump" => {
                        let (events, last) = answer_events(&mut r)?;
                        if variant == "Events" {
                            Answer::Events { events, last }
                        } else {
                            Answer::TreeDump { events, last }
                        }
                    }
                    _ => {
                        r.skip(0)?;
                        Answer::Refused(refusal(variant)?)
                    }
                });
            }
            "data" => frame.answer = Some(Answer::Refused(refusal(r.str()?)?)),
            _ => r.skip(0)?,
        }
    }
    Ok(frame)
}

fn refusal(variant: &str) -> Result<&'static str, WireError> {
    Ok(match variant {
        "TooNew" => "TooNew",
        "InvalidRange" => "InvalidRange",
        "TreeDumpFailed" => "TreeDumpFailed",
        "Error" => "Error",
        _ => return Err(WireError::Bad("data variant")),
    })
}

/// `{"events": [RouterEvent], "last_event_id": u64, ..}`.
fn answer_events(r: &mut Reader<'_>) -> Result<(Vec<RouterEvent>, u64), WireError> {
    let fields = r.map_len()?;
    let (mut events, mut last) = (None, None);
    for _ in 0..fields {
        match r.str()? {
            "events" => events = Some(event_array(r)?),
            "last_event_id" => last = Some(uint(r, "last_event_id")?),
            _ => r.skip(0)?,
        }
    }
    Ok((
        events.ok_or(WireError::Missing("events"))?,
        last.ok_or(WireError::Missing("last_event_id"))?,
    ))
}

/// `{"event_id", "data", "dp_rank"}`.
fn kv_event(r: &mut Reader<'_>) -> Result<(u64, u32, EventData), WireError> {
    let fields = r.map_len()?;
    let (mut id, mut dp, mut data) = (None, 0u32, None);
    for _ in 0..fields {
        match r.str()? {
            "event_id" => id = Some(uint(r, "event_id")?),
            "dp_rank" => {
                dp = u32::try_from(uint(r, "dp_rank")?).map_err(|_| WireError::Bad("dp_rank"))?
            }
            "data" => data = Some(event_data(r)?),
            _ => r.skip(0)?,
        }
    }
    Ok((
        id.ok_or(WireError::Missing("event_id"))?,
        dp,
        data.ok_or(WireError::Missing("data"))?,
    ))
}

/// The externally tagged `KvCacheEventData`.
fn event_data(r: &mut Reader<'_>) -> Result<EventData, WireError> {
    if msgpack::is_map(r.peek()?) {
        if r.map_len()? != 1 {
            return Err(WireError::Bad("data (one variant)"));
        }
        return match r.str()? {
            "stored" => stored(r),
            "removed" => removed(r),
            "cleared" => {
                r.skip(0)?;
                Ok(EventData::Cleared)
            }
            _ => Err(WireError::Bad("data variant")),
        };
    }
    match r.str()? {
        "cleared" => Ok(EventData::Cleared),
        _ => Err(WireError::Bad("data variant")),
    }
}

fn stored(r: &mut Reader<'_>) -> Result<EventData, WireError> {
    let fields = r.map_len()?;
    let (mut parent, mut blocks) = (None, None);
    for _ in 0..fields {
        match r.str()? {
            "parent_hash" => {
                parent = r
                    .opt_int()?
                    .map(|v| hash_of(v, "parent_hash"))
                    .transpose()?
            }
            "blocks" => {
                // Each block is a map of at least two fields: 3 bytes at the very least.
                let n = r.array_len()?;
                let n = r.checked_len(n as u64, 3, r.at())?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(block(r)?);
                }
                blocks = Some(v);
            }
            _ => r.skip(0)?,
        }
    }
    Ok(EventData::Stored {
        parent: parent.map(EngineHash),
        blocks: blocks.ok_or(WireError::Missing("blocks"))?,
    })
}

fn block(r: &mut Reader<'_>) -> Result<(EngineHash, BlockHash), WireError> {
    let fields = r.map_len()?;
    let (mut engine, mut tokens) = (None, None);
    for _ in 0..fields {
        match r.str()? {
            "block_hash" => engine = Some(hash(r, "block_hash")?),
            "tokens_hash" => tokens = Some(hash(r, "tokens_hash")?),
            _ => r.skip(0)?,
        }
    }
    Ok((
        EngineHash(engine.ok_or(WireError::Missing("block_hash"))?),
        BlockHash(tokens.ok_or(WireError::Missing("tokens_hash"))?),
    ))
}

fn removed(r: &mut Reader<'_>) -> Result<EventData, WireError> {
    let fields = r.map_len()?;
    let mut hashes = None;
    for _ in 0..fields {
        match r.str()? {
            "block_hashes" => {
                let n = r.array_len()?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(EngineHash(hash(r, "block_hashes")?));
                }
                hashes = Some(v);
            }
            _ => r.skip(0)?,
        }
    }
    Ok(EventData::Removed(
        hashes.ok_or(WireError::Missing("block_hashes"))?,
    ))
}

fn uint(r: &mut Reader<'_>, what: &'static str) -> Result<u64, WireError> {
    match r.int()? {
        Some(v) => u64::try_from(v).map_err(|_| WireError::Bad(what)),
        None => Err(WireError::Bad(what)),
    }
}

/// A 64-bit hash: Dynamo writes them as u64; an i64 (a Python publisher's) keeps its bits.
fn hash(r: &mut Reader<'_>, what: &'static str) -> Result<u64, WireError> {
    hash_of(r.int()?.ok_or(WireError::Bad(what))?, what)
}

fn hash_of(v: i128, what: &'static str) -> Result<u64, WireError> {
    if v < 0 {
        i64::try_from(v)
            .map(|v| v as u64)
            .map_err(|_| WireError::Bad(what))
    } else {
        u64::try_from(v).map_err(|_| WireError::Bad(what))
    }
}

/// Dynamo's `StorageTier` names. External (a shared pool outside the worker) is the farthest
/// tier kvroute has: disk.
fn tier_of(s: &str) -> Result<Tier, WireError> {
    match s {
        "device" => Ok(Tier::Gpu),
        "host_pinned" => Ok(Tier::Cpu),
        "disk" | "external" => Ok(Tier::Disk),
        _ => Err(WireError::Bad("storage_tier")),
    }
}

/// Whether `residency_domain` names a cache that is not the worker's own.
fn foreign_domain(s: &str) -> Result<bool, WireError> {
    match s {
        "worker" => Ok(false),
        "cache_owner" => Ok(true),
        _ => Err(WireError::Bad("residency_domain")),
    }
}

/// The JSON forms: a `RouterEvent`, or the first event plane's `NatsEnvelope` around one.
#[derive(Deserialize)]
struct JsonTop {
    publisher_id: Option<u64>,
    worker_id: Option<u64>,
    storage_tier: Option<String>,
    residency_domain: Option<String>,
    event: Option<JsonKvEvent>,
    payload: Option<Vec<u8>>,
}

#[derive(Deserialize)]
struct JsonKvEvent {
    event_id: u64,
    data: JsonData,
    #[serde(default)]
    dp_rank: u32,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum JsonData {
    Stored(JsonStore),
    Removed(JsonRemove),
    Cleared,
}

#[derive(Deserialize)]
struct JsonStore {
    parent_hash: Option<u64>,
    blocks: Vec<JsonBlock>,
}

#[derive(Deserialize)]
struct JsonBlock {
    block_hash: u64,
    tokens_hash: u64,
}

#[derive(Deserialize)]
struct JsonRemove {
    block_hashes: Vec<u64>,
}

fn decode_json(payload: &[u8]) -> Result<Message, WireError> {
    let top: JsonTop =
        serde_json::from_slice(payload).map_err(|e| WireError::Json(e.to_string()))?;
    if let Some(inner) = top.payload {
        // The envelope's payload is the event itself, never another envelope.
        let inner: JsonTop =
            serde_json::from_slice(&inner).map_err(|e| WireError::Json(e.to_string()))?;
        if inner.payload.is_some() {
            return Err(WireError::Bad("payload (nested envelope)"));
        }
        return Ok(Message {
            publisher_id: top.publisher_id,
            events: vec![json_event(inner)?],
        });
    }
    Ok(Message {
        publisher_id: None,
        events: vec![json_event(top)?],
    })
}

fn json_event(top: JsonTop) -> Result<RouterEvent, WireError> {
    let event = top.event.ok_or(WireError::Missing("event"))?;
    let tier = top.storage_tier.as_deref().map_or(Ok(Tier::Gpu), tier_of)?;
    let foreign = top
        .residency_domain
        .as_deref()
        .map_or(Ok(false), foreign_domain)?;
    let data = match event.data {
        _ if foreign => EventData::Foreign,
        JsonData::Stored(s) => EventData::Stored {
            parent: s.parent_hash.map(EngineHash),
            blocks: s
                .blocks
                .into_iter()
                .map(|b| (EngineHash(b.block_hash), BlockHash(b.tokens_hash)))
                .collect(),
        },
        JsonData::Removed(r) => {
            EventData::Removed(r.block_hashes.into_iter().map(EngineHash).collect())
        }
        JsonData::Cleared => EventData::Cleared,
    };
    Ok(RouterEvent {
        worker_id: top.worker_id.ok_or(WireError::Missing("worker_id"))?,
        dp_rank: event.dp_rank,
        event_id: event.event_id,
        tier,
        data,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// msgpack writers for hand-built messages: a str, a uint (u64 form), a map header.
    fn s(out: &mut Vec<u8>, v: &str) {
        assert!(v.len() < 32);
        out.push(0xa0 | v.len() as u8);
        out.extend_from_slice(v.as_bytes());
    }
    fn u(out: &mut Vec<u8>, v: u64) {
        out.push(0xcf);
        out.extend_from_slice(&v.to_be_bytes());
    }
    fn map(out: &mut Vec<u8>, n: u8) {
        out.push(0x80 | n);
    }

    /// A `RouterEvent` storing two blocks, as `rmp_serde::to_vec_named` writes it.
    fn stored_event() -> Vec<u8> {
        let mut m = Vec::new();
        map(&mut m, 3);
        s(&mut m, "worker_id");
        u(&mut m, 7);
        s(&mut m, "storage_tier");
        s(&mut m, "host_pinned");
        s(&mut m, "event");
        map(&mut m, 3);
        s(&mut m, "event_id");
        u(&mut m, 42);
        s(&mut m, "data");
        map(&mut m, 1);
        s(&mut m, "stored");
        map(&mut m, 3);
        s(&mut m, "parent_hash");
        m.push(0xc0);
        s(&mut m, "start_position");
        m.push(0xc0);
        s(&mut m, "blocks");
        m.push(0x92);
        for (e, t) in [(11u64, 21u64), (12, 22)] {
            map(&mut m, 3);
            s(&mut m, "block_hash");
            u(&mut m, e);
            s(&mut m, "tokens_hash");
            u(&mut m, t);
            s(&mut m, "mm_extra_info");
            m.push(0xc0);
        }
        s(&mut m, "dp_rank");
        m.push(0x01);
        m
    }

    fn envelope(payload: &[u8]) -> Vec<u8> {
        let mut m = Vec::new();
        map(&mut m, 5);
        s(&mut m, "publisher_id");
        u(&mut m, 99);
        s(&mut m, "sequence");
        u(&mut m, 3);
        s(&mut m, "published_at");
        u(&mut m, 1_700_000_000_000);
        s(&mut m, "topic");
        s(&mut m, "kv-events");
        s(&mut m, "payload");
        m.push(0xc5);
        m.extend_from_slice(&(payload.len() as u16).to_be_bytes());
        m.extend_from_slice(payload);
        m
    }

    #[test]
    fn an_enveloped_msgpack_store_decodes() {
        let want = RouterEvent {
            worker_id: 7,
            dp_rank: 1,
            event_id: 42,
            tier: Tier::Cpu,
            data: EventData::Stored {
                parent: None,
                blocks: vec![
                    (EngineHash(11), BlockHash(21)),
                    (EngineHash(12), BlockHash(22)),
                ],
            },
        };
        assert_eq!(
            decode(&envelope(&stored_event())),
            Ok(Message {
                publisher_id: Some(99),
                events: vec![want.clone()]
            })
        );
        // The bare event too.
        assert_eq!(
            decode(&stored_event()).map(|m| m.events),
            Ok(vec![want.clone()])
        );
        // And an array of them, bare or in an envelope (ai-dynamo 1.6.1 sends an array).
        let mut arr = vec![0x92];
        arr.extend(stored_event());
        arr.extend(stored_event());
        assert_eq!(
            decode(&envelope(&arr)).map(|m| m.events),
            Ok(vec![want.clone(), want.clone()])
        );
        assert_eq!(decode(&arr).map(|m| m.events.len()), Ok(2));
        assert_eq!(decode(&envelope(&[0x90])).map(|m| m.events), Ok(vec![]));
    }

    #[test]
    fn cleared_comes_as_a_string_or_a_one_key_map() {
        for data in [&b"\xa7cleared"[..], &b"\x81\xa7cleared\xc0"[..]] {
            let mut m = Vec::new();
            map(&mut m, 2);
            s(&mut m, "worker_id");
            u(&mut m, 1);
            s(&mut m, "event");
            map(&mut m, 2);
            s(&mut m, "event_id");
            u(&mut m, 0);
            s(&mut m, "data");
            m.extend_from_slice(data);
            let e = decode(&envelope(&m)).unwrap().events.remove(0);
            assert_eq!(
                (e.data, e.dp_rank, e.tier),
                (EventData::Cleared, 0, Tier::Gpu)
            );
        }
    }

    #[test]
    fn json_router_events_and_envelopes_decode() {
        let json = r#"{"worker_id":5,"event":{"event_id":9,"data":{"removed":{"block_hashes":[1,18446744073709551615]}},"dp_rank":0}}"#;
        let want = RouterEvent {
            worker_id: 5,
            dp_rank: 0,
            event_id: 9,
            tier: Tier::Gpu,
            data: EventData::Removed(vec![EngineHash(1), EngineHash(u64::MAX)]),
        };
        let one = |v: RouterEvent, p| Message {
            publisher_id: p,
            events: vec![v],
        };
        assert_eq!(decode(json.as_bytes()), Ok(one(want.clone(), None)));
        let env = format!(
            r#"{{"publisher_id":1,"sequence":0,"published_at":0,"payload":{:?}}}"#,
            json.as_bytes()
        );
        assert_eq!(decode(env.as_bytes()), Ok(one(want, Some(1))));
        let owner = r#"{"worker_id":5,"residency_domain":"cache_owner","storage_tier":"disk","event":{"event_id":1,"data":"cleared"}}"#;
        assert_eq!(
            decode(owner.as_bytes()).unwrap().events[0].data,
            EventData::Foreign
        );
    }

    #[test]
    fn bad_messages_are_errors() {
        let mut lying = Vec::new();
        map(&mut lying, 1);
        s(&mut lying, "event");
        lying.extend_from_slice(&[0xdf, 0xff, 0xff, 0xff, 0xff]);
        let cases: Vec<Vec<u8>> = vec![
            Vec::new(),
            b"\xc1".to_vec(),
            b"{not json".to_vec(),
            br#"{"worker_id":1}"#.to_vec(),
            br#"{"worker_id":1,"storage_tier":"moon","event":{"event_id":1,"data":"cleared"}}"#
                .to_vec(),
            lying,
            // An envelope inside an envelope.
            envelope(&envelope(&stored_event())),
            // Truncated.
            envelope(&stored_event())[..40].to_vec(),
            // An array that claims more events than it has bytes for.
            envelope(&[0xdd, 0x7f, 0xff, 0xff, 0xff]),
        ];
        for c in cases {
            assert!(decode(&c).is_err(), "{c:?}");
        }
    }

    /// `### ...` sections of a testdata/dynamo file: each one's `key: value` lines.
    fn sections(text: &str) -> Vec<std::collections::HashMap<&str, &str>> {
        text.split("\n### ")
            .skip(1)
            .map(|sec| {
                sec.lines()
                    .skip(1)
                    .filter_map(|l| l.split_once(": "))
                    .collect()
            })
            .collect()
    }

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// The decoded form a vector file gives for one `RouterEvent` (Python's msgpack reading).
    fn expected(v: &serde_json::Value) -> RouterEvent {
        let ev = &v["event"];
        let data = &ev["data"];
        let u = |v: &serde_json::Value| v.as_u64().unwrap();
        RouterEvent {
            worker_id: u(&v["worker_id"]),
            dp_rank: u(&ev["dp_rank"]) as u32,
            event_id: u(&ev["event_id"]),
            tier: Tier::Gpu,
            data: if let Some(st) = data.get("stored") {
                EventData::Stored {
                    parent: st["parent_hash"].as_u64().map(EngineHash),
                    blocks: st["blocks"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|b| {
                            (
                                EngineHash(u(&b["block_hash"])),
                                BlockHash(u(&b["tokens_hash"])),
                            )
                        })
                        .collect(),
                }
            } else {
                EventData::Removed(
                    data["removed"]["block_hashes"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|h| EngineHash(u(h)))
                        .collect(),
                )
            },
        }
    }

    #[test]
    fn ai_dynamo_1_6_1_messages_decode_byte_for_byte() {
        let text = include_str!("../../../../testdata/dynamo/kv_events_1.6.1.txt");
        let vectors = sections(text);
        assert_eq!(vectors.len(), 4);
        let mut kinds = Vec::new();
        for v in vectors {
            let want: serde_json::Value = serde_json::from_str(v["decoded"]).unwrap();
            let got = decode(&unhex(v["hex"])).unwrap();
            assert_eq!(got.publisher_id, want["publisher_id"].as_u64());
            let events: Vec<RouterEvent> = want["payload"]
                .as_array()
                .unwrap()
                .iter()
                .map(expected)
                .collect();
            assert_eq!(got.events, events);
            kinds.push(got.events.len());
        }
        // Three one-event arrays, then a removal and a store in one message.
        assert_eq!(kinds, [1, 1, 1, 2]);
    }

    #[test]
    fn ai_dynamo_1_6_1_query_answers_decode() {
        let text = include_str!("../../../../testdata/dynamo/worker_kv_query_1.6.1.txt");
        let mut seen = Vec::new();
        for v in sections(text) {
            let frames: serde_json::Value = serde_json::from_str(v["frames"]).unwrap();
            let stream = unhex(v["stream"]);
            // The framing: 24 bytes (header length, body length, checksum; big-endian u64s).
            let (mut at, mut answers) = (0, Vec::new());
            for f in frames.as_array().unwrap() {
                let len = |i: usize| {
                    u64::from_be_bytes(stream[at + i..at + i + 8].try_into().unwrap()) as usize
                };
                let (hl, bl) = (len(0), len(8));
                at += 24;
                assert_eq!(f["header"].is_null(), hl == 0);
                at += hl;
                if bl > 0 {
                    let frame = decode_query_frame(&stream[at..at + bl]).unwrap();
                    assert_eq!(frame.complete_final, f["body"]["complete_final"] == true);
                    answers.extend(frame.answer);
                }
                at += bl;
            }
            assert_eq!(at, stream.len());
            let data = &frames[2]["body"]["data"];
            let want = if let Some(e) = data.get("Events") {
                Answer::Events {
                    events: e["events"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(expected)
                        .collect(),
                    last: e["last_event_id"].as_u64().unwrap(),
                }
            } else if let Some(e) = data.get("TreeDump") {
                Answer::TreeDump {
                    events: e["events"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(expected)
                        .collect(),
                    last: e["last_event_id"].as_u64().unwrap(),
                }
            } else {
                let name = data.as_object().unwrap().keys().next().unwrap().clone();
                Answer::Refused(refusal(&name).unwrap())
            };
            assert_eq!(answers, std::slice::from_ref(&want));
            seen.push(match want {
                Answer::Events { events, last } => format!("events {} last {last}", events.len()),
                Answer::TreeDump { events, last } => format!("dump {} last {last}", events.len()),
                Answer::Refused(r) => r.to_owned(),
            });
        }
        assert_eq!(
            seen,
            [
                "events 2 last 3",
                "dump 4 last 3",
                "TooNew",
                "InvalidRange",
                "Error"
            ]
        );
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn cut_or_flipped_messages_never_panic(cut in 0usize..300, flip in 0usize..300, bit in 0u8..8) {
            let mut m = envelope(&stored_event());
            if flip < m.len() {
                m[flip] ^= 1 << bit;
            }
            m.truncate(cut.min(m.len()));
            let _ = decode(&m);
        }

        #[test]
        fn arbitrary_query_frames_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_query_frame(&bytes);
        }
    }
}
