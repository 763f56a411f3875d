//! The feed: the compact binary delta stream the collector serves at `GET /v1/feed` and the
//! filter's sync lease holder pulls. Defined once here: the collector calls [`Page::encode`],
//! the filter calls [`Page::decode`].
//!
//! # Protocol
//!
//! The filter asks `GET /v1/feed?epoch=E&since=C` with the epoch and cursor of the last page
//! it applied (neither on its first pull). The collector answers one page:
//!
//! - if `E` is its own epoch and `C` is still in its bounded log: the deltas after `C`;
//! - otherwise a full snapshot, which starts with a page flagged [`Page::RESET`]: the reader
//!   starts a fresh index (worker table, block sizes, aliases and blocks) and builds it from
//!   that page and the ones after it, switching it in once it has caught up.
//!
//! [`Page::MORE`] says more is ready now: ask again at once with the page's `cursor`. A
//! collector restart brings a new epoch, so a reader never mixes two collectors' cursors.
//!
//! # Handover between replicas of one stream (version 3)
//!
//! Collectors that build their index from the same NATS JetStream stream apply the same
//! messages in the same order, so "every message up to stream sequence S" names the same
//! index content on each of them even though their cursors do not. A reader that asks with
//! `v=3` gets, on every page that ends at a log position, an [`Op::Stream`] naming the stream
//! and the last sequence whose changes the page completes. After a failover it asks the other
//! replica with its old epoch and cursor plus `stream=X&seq=S`; a replica of stream `X` that
//! has applied `S` and still logs from there answers a [`Page::HANDOVER`] page instead of a
//! snapshot: its complete worker table, block sizes and aliases, its own epoch, and the
//! cursor just after `S`. The reader checks the table against its own (the same worker in
//! every slot), then follows the new replica from that cursor; the changes it already had
//! after `S` come again and apply as no-ops (adds and removals are idempotent and arrive in
//! the same order). A table that differs, or any doubt, falls back to a snapshot. A replica
//! that has not yet reached `S` answers an empty page in the reader's own epoch and cursor:
//! nothing new, ask again.
//!
//! # Wire format, version 4 (versions 1 to 3 are still read: 3 is 4 without op 8, 2 is 3
//! without op 7 and flag `HANDOVER`, 1 is 2 without op 6; a page is written in the lowest
//! version that carries it)
//!
//! All integers little-endian; `varint` is LEB128 (at most 10 bytes); `str` is a varint length
//! and UTF-8 bytes, at most [`MAX_STR`] long.
//!
//! ```text
//! magic   b"KVRF"
//! version u8 = 2
//! flags   u8        bit 0 RESET, bit 1 MORE, bit 2 HANDOVER (v3); other bits must be 0
//! epoch   u64
//! cursor  u64       pass back as `since`
//! count   varint    number of ops, then each op as a tag byte and its fields:
//!   1 Worker    id varint, live u8 (0|1), dp_rank varint, instance_id str, address str,
//!               tenant str, model str
//!   2 WorkerGone id varint
//!   3 BlockSize tenant str, model str, block_size varint (>= 1)
//!   4 Alias     tenant str, served str, model str, lora str ("" = none)
//!   5 Blocks    worker varint, tier u8 (0 GPU, 1 CPU, 2 DISK), added u8 (0|1),
//!               n varint, n × BlockKey u64
//!   6 Load      worker varint, requests varint, prefill_tokens varint, decode_tokens varint,
//!               engine u8 (0 none, 1 fresh, 2 stale), then unless none: waiting varint,
//!               running varint, kv_permille varint (<= 1000), age_ms varint
//!   7 Stream    stream u64, seq varint (v3)
//!   8 Held      worker varint, shard varint, key u64, blocks varint (>= 1), ttl_ms varint (v4)
//! ```
//!
//! `Load` ops are not index changes: the collector appends one per worker with fleet load to
//! every page it serves, computed at serve time (the fleet's in-flight totals over all
//! gateways' `POST /v1/load` reports, and the engine's own last `/metrics` sample). They are
//! never in its log, so a reader takes the latest as the current picture.
//!
//! `Held` ops (version 4, for a reader that names itself with `gateway=ID`) are another
//! gateway's recent decisions: that gateway sent a request whose prompt's first `blocks`
//! blocks end in `key` to `worker`, and counts the worker as holding them for `ttl_ms` more
//! (its speculative table, `shard` of it). Gateways post them with their load reports; the
//! collector hands each to every other gateway once. A reader adds them to its own
//! speculative table, so a sibling prompt arriving through another gateway before the
//! engine's KV events follows the first (Dynamo's router replicas share their active
//! sequences for the same reason). Never logged, like `Load`.
//!
//! Block removals are already expanded by the collector's cascade: a removed block arrives
//! with every descendant the worker lost with it, so the reader never walks a tree. A worker
//! that goes away first loses its blocks (as `Blocks` removals), then gets a `WorkerGone`.

use crate::codec::{put_str_varint, put_varint, CodecError, Reader};
use crate::engine::EngineLoad;
use crate::event::{Tier, WorkerId};
use crate::scope::BlockKey;

/// Response header of `/v1/feed?gateway=ID`: the gateway whose own load report the page's
/// load totals leave out (that gateway adds its live books instead). Absent: the totals hold
/// every gateway's report.
pub const LOAD_EXCLUDES_HEADER: &str = "x-kvroute-load-excludes";

/// Response header of `/v1/feed?gateway=ID`: `index/count`, the reading gateway's place among
/// the live gateway replicas (ids in byte order, the reader counted even before its first
/// report). Replicas use it to prefer disjoint shares of the engines ([`crate::router`]).
pub const REPLICA_HEADER: &str = "x-kvroute-replica";

/// The first four bytes of every page.
pub const MAGIC: [u8; 4] = *b"KVRF";
/// The newest format version this code reads and writes.
pub const VERSION: u8 = 4;
/// The oldest format version this code still reads.
pub const MIN_VERSION: u8 = 1;
/// Longest string the format carries (instance ids, addresses, names).
pub const MAX_STR: usize = 4096;
const HEADER_LEN: usize = 4 + 1 + 1 + 8 + 8;

/// An engine's own report of its load, as of `age_ms` before the page was served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct EngineSample {
    /// The engine's figures.
    pub load: EngineLoad,
    /// Age of the sample when the page was served.
    pub age_ms: u32,
    /// The collector marks it stale (the engine stopped answering): do not trust it.
    pub stale: bool,
}

/// One change of the index, as the filter needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// A worker was registered or changed (address, liveness). `tenant` and `model` are its
    /// registration's: only workers of a request's model are candidates for it.
    Worker {
        /// The worker (the filter's slot).
        id: WorkerId,
        /// Whether it takes requests.
        live: bool,
        /// Its data-parallel rank within its instance.
        dp_rank: u32,
        /// The engine instance it belongs to.
        instance_id: String,
        /// Where the instance takes requests (`host:port`).
        address: String,
        /// Its registration's tenant.
        tenant: String,
        /// Its registration's model (empty: any).
        model: String,
    },
    /// A worker's slot is free again.
    WorkerGone {
        /// The worker gone.
        id: WorkerId,
    },
    /// The block size of `(tenant, model)`.
    BlockSize {
        /// The tenant.
        tenant: String,
        /// The model.
        model: String,
        /// Tokens per block.
        block_size: u32,
    },
    /// A served model name (a LoRA adapter's, say) resolves to `(model, lora)`.
    Alias {
        /// The tenant.
        tenant: String,
        /// The name clients send.
        served: String,
        /// The base model.
        model: String,
        /// The LoRA adapter, if any.
        lora: Option<String>,
    },
    /// Blocks a worker gained (`added`) or lost in `tier`.
    Blocks {
        /// The worker.
        worker: WorkerId,
        /// The tier.
        tier: Tier,
        /// Gained (`true`) or lost.
        added: bool,
        /// The blocks.
        keys: Vec<BlockKey>,
    },
    /// The fleet's in-flight load on a worker, over every gateway, and its engine's sample.
    Load {
        /// The worker.
        worker: WorkerId,
        /// Requests in flight.
        requests: u64,
        /// Uncached prefill tokens not yet prefilled.
        prefill_tokens: u64,
        /// Decode tokens still to generate.
        decode_tokens: u64,
        /// The engine's own report, if the collector has one.
        engine: Option<EngineSample>,
    },
    /// The stream position the page's cursor completes (see the module's "Handover"): the
    /// collector's stream and the last stream sequence whose changes are all before the
    /// cursor. Not an index change; appended when served, like `Load`.
    Stream(StreamMark),
    /// Another gateway's recent decision (version 4; see the module's `Held`): `worker`
    /// taken to hold the blocks up to `key`, `blocks` of them, for `ttl_ms`. Appended when
    /// served, like `Load`.
    Held {
        /// The worker the request went to.
        worker: WorkerId,
        /// The speculative table shard the prompt belongs to (by its first block).
        shard: u32,
        /// The key of the prompt's first `blocks` blocks.
        key: BlockKey,
        /// How many leading blocks `key` covers (at least 1).
        blocks: u32,
        /// How long the holder counts as holding them from now, ms.
        ttl_ms: u32,
    },
}

/// A position in the event stream a collector builds its index from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct StreamMark {
    /// The stream's identity (its name and creation time, hashed; never 0).
    pub stream: u64,
    /// A stream sequence number.
    pub seq: u64,
}

impl Op {
    /// Bytes this op takes on the wire (upper bound), for paging.
    pub fn encoded_len(&self) -> usize {
        let s = |s: &str| 10 + s.len();
        1 + match self {
            Op::Worker {
                instance_id,
                address,
                tenant,
                model,
                ..
            } => 10 + 1 + 10 + s(instance_id) + s(address) + s(tenant) + s(model),
            Op::WorkerGone { .. } => 10,
            Op::BlockSize { tenant, model, .. } => s(tenant) + s(model) + 10,
            Op::Alias {
                tenant,
                served,
                model,
                lora,
            } => s(tenant) + s(served) + s(model) + s(lora.as_deref().unwrap_or("")),
            Op::Blocks { keys, .. } => 10 + 2 + 10 + 8 * keys.len(),
            Op::Load { .. } => 4 * 10 + 1 + 4 * 10,
            Op::Stream(_) => 8 + 10,
            Op::Held { .. } => 3 * 10 + 8 + 10,
        }
    }
}

/// One response of `/v1/feed`.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Page {
    /// [`Page::RESET`], [`Page::MORE`] and [`Page::HANDOVER`] bits.
    pub flags: u8,
    /// The index incarnation the cursor belongs to (a collector restart changes it).
    pub epoch: u64,
    /// Where the next pull resumes (`since`).
    pub cursor: u64,
    /// The changes, in order.
    pub ops: Vec<Op>,
}

/// Why a page could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FeedError {
    /// The page ends inside a value, at this byte.
    #[error("feed page truncated at byte {0}")]
    Truncated(usize),
    /// The page does not start with [`MAGIC`].
    #[error("not a feed page (bad magic)")]
    BadMagic,
    /// A format version this code does not read.
    #[error("unsupported feed version {0}")]
    Version(u8),
    /// Flag bits this code does not know.
    #[error("unknown flag bits {0:#04x}")]
    Flags(u8),
    /// An op tag this code does not know.
    #[error("unknown op tag {tag} at byte {at}")]
    Tag {
        /// The tag.
        tag: u8,
        /// Its offset.
        at: usize,
    },
    /// A value out of its range.
    #[error("bad value at byte {at}: {what}")]
    Value {
        /// Its offset.
        at: usize,
        /// What was wrong.
        what: &'static str,
    },
    /// Bytes after the last op.
    #[error("{0} trailing bytes after the last op")]
    Trailing(usize),
}

impl Page {
    /// Flag: a full snapshot starts with this page.
    pub const RESET: u8 = 1;
    /// Flag: more is ready, pull again at once.
    pub const MORE: u8 = 2;
    /// Flag (version 3): another replica of the reader's stream takes over its cursor; the
    /// page holds this collector's complete worker table, block sizes and aliases.
    pub const HANDOVER: u8 = 4;

    /// Whether a full snapshot starts with this page.
    pub fn is_reset(&self) -> bool {
        self.flags & Self::RESET != 0
    }

    /// Whether more is ready at once.
    pub fn has_more(&self) -> bool {
        self.flags & Self::MORE != 0
    }

    /// Whether another replica of the reader's stream takes over its cursor.
    pub fn is_handover(&self) -> bool {
        self.flags & Self::HANDOVER != 0
    }

    /// The page's stream position, if it carries one.
    pub fn stream_mark(&self) -> Option<StreamMark> {
        self.ops.iter().rev().find_map(|op| match op {
            Op::Stream(m) => Some(*m),
            _ => None,
        })
    }

    /// The lowest format version that carries this page.
    fn version(&self) -> u8 {
        if self.ops.iter().any(|o| matches!(o, Op::Held { .. })) {
            4
        } else if self.is_handover() || self.ops.iter().any(|o| matches!(o, Op::Stream(_))) {
            3
        } else {
            2
        }
    }

    /// Appends the encoded page to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&MAGIC);
        out.push(self.version());
        out.push(self.flags);
        out.extend_from_slice(&self.epoch.to_le_bytes());
        out.extend_from_slice(&self.cursor.to_le_bytes());
        put_varint(out, self.ops.len() as u64);
        for op in &self.ops {
            match op {
                Op::Worker {
                    id,
                    live,
                    dp_rank,
                    instance_id,
                    address,
                    tenant,
                    model,
                } => {
                    out.push(1);
                    put_varint(out, id.0 as u64);
                    out.push(*live as u8);
                    put_varint(out, *dp_rank as u64);
                    put_str_varint(out, instance_id, MAX_STR);
                    put_str_varint(out, address, MAX_STR);
                    put_str_varint(out, tenant, MAX_STR);
                    put_str_varint(out, model, MAX_STR);
                }
                Op::WorkerGone { id } => {
                    out.push(2);
                    put_varint(out, id.0 as u64);
                }
                Op::BlockSize {
                    tenant,
                    model,
                    block_size,
                } => {
                    out.push(3);
                    put_str_varint(out, tenant, MAX_STR);
                    put_str_varint(out, model, MAX_STR);
                    put_varint(out, *block_size as u64);
                }
                Op::Alias {
                    tenant,
                    served,
                    model,
                    lora,
                } => {
                    out.push(4);
                    put_str_varint(out, tenant, MAX_STR);
                    put_str_varint(out, served, MAX_STR);
                    put_str_varint(out, model, MAX_STR);
                    put_str_varint(out, lora.as_deref().unwrap_or(""), MAX_STR);
                }
                Op::Blocks {
                    worker,
                    tier,
                    added,
                    keys,
                } => {
                    out.push(5);
                    put_varint(out, worker.0 as u64);
                    out.push(*tier as u8);
                    out.push(*added as u8);
                    put_varint(out, keys.len() as u64);
                    for key in keys {
                        out.extend_from_slice(&key.0.to_le_bytes());
                    }
                }
                Op::Load {
                    worker,
                    requests,
                    prefill_tokens,
                    decode_tokens,
                    engine,
                } => {
                    out.push(6);
                    put_varint(out, worker.0 as u64);
                    put_varint(out, *requests);
                    put_varint(out, *prefill_tokens);
                    put_varint(out, *decode_tokens);
                    match engine {
                        None => out.push(0),
                        Some(e) => {
                            out.push(if e.stale { 2 } else { 1 });
                            put_varint(out, e.load.waiting as u64);
                            put_varint(out, e.load.running as u64);
                            put_varint(out, e.load.kv_permille.min(1000) as u64);
                            put_varint(out, e.age_ms as u64);
                        }
                    }
                }
                Op::Stream(m) => {
                    out.push(7);
                    out.extend_from_slice(&m.stream.to_le_bytes());
                    put_varint(out, m.seq);
                }
                Op::Held {
                    worker,
                    shard,
                    key,
                    blocks,
                    ttl_ms,
                } => {
                    out.push(8);
                    put_varint(out, worker.0 as u64);
                    put_varint(out, *shard as u64);
                    out.extend_from_slice(&key.0.to_le_bytes());
                    put_varint(out, (*blocks).max(1) as u64);
                    put_varint(out, *ttl_ms as u64);
                }
            }
        }
    }

    /// The encoded page.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            HEADER_LEN + 10 + self.ops.iter().map(Op::encoded_len).sum::<usize>(),
        );
        self.encode(&mut out);
        out
    }

    /// Appends `ops` to an encoded page without decoding it: the header is kept, the op count
    /// rewritten, the new ops encoded after the old ones. For ops computed when a cached page
    /// is served (`Load`, `Stream`). The version byte is raised to what the new ops need.
    /// `None` when `page` is not a page of version 2 or later.
    pub fn append_ops(page: &[u8], ops: &[Op]) -> Option<Vec<u8>> {
        let version = *page.get(4)?;
        if page.get(..4)? != MAGIC || !(2..=VERSION).contains(&version) {
            return None;
        }
        let mut r = Reader::new(page.get(HEADER_LEN..)?);
        let count = r.varint().ok()?;
        let body = page.get(HEADER_LEN + r.position()..)?;
        let extra = Page {
            ops: ops.to_vec(),
            ..Page::default()
        }
        .to_bytes();
        let mut er = Reader::new(extra.get(HEADER_LEN..)?);
        er.varint().ok()?;
        let extra_ops = extra.get(HEADER_LEN + er.position()..)?;
        let mut out = Vec::with_capacity(page.len() + extra_ops.len() + 10);
        out.extend_from_slice(page.get(..HEADER_LEN)?);
        out[4] = version.max(*extra.get(4)?);
        put_varint(&mut out, count + ops.len() as u64);
        out.extend_from_slice(body);
        out.extend_from_slice(extra_ops);
        Some(out)
    }

    /// Decodes one page. Never panics: any malformed input is an error.
    pub fn decode(bytes: &[u8]) -> Result<Page, FeedError> {
        let mut r = Reader::new(bytes);
        if r.take(4)? != MAGIC {
            return Err(FeedError::BadMagic);
        }
        let version = r.u8()?;
        if !(MIN_VERSION..=VERSION).contains(&version) {
            return Err(FeedError::Version(version));
        }
        let flags = r.u8()?;
        let known = if version >= 3 {
            Self::RESET | Self::MORE | Self::HANDOVER
        } else {
            Self::RESET | Self::MORE
        };
        if flags & !known != 0 {
            return Err(FeedError::Flags(flags));
        }
        let epoch = r.u64()?;
        let cursor = r.u64()?;
        let count = r.varint()?;
        // Each op takes at least two bytes: a count past that is a lie, not an allocation.
        if count > (r.remaining() / 2) as u64 {
            return Err(FeedError::Value {
                at: r.position(),
                what: "op count exceeds page size",
            });
        }
        let mut ops = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let at = r.position();
            let op = match r.u8()? {
                1 => Op::Worker {
                    id: WorkerId(r.u32_varint()?),
                    live: r.bool()?,
                    dp_rank: r.u32_varint()?,
                    instance_id: r.str_varint(MAX_STR)?,
                    address: r.str_varint(MAX_STR)?,
                    tenant: r.str_varint(MAX_STR)?,
                    model: r.str_varint(MAX_STR)?,
                },
                2 => Op::WorkerGone {
                    id: WorkerId(r.u32_varint()?),
                },
                3 => {
                    let tenant = r.str_varint(MAX_STR)?;
                    let model = r.str_varint(MAX_STR)?;
                    let at = r.position();
                    let block_size = r.u32_varint()?;
                    if block_size == 0 {
                        return Err(FeedError::Value {
                            at,
                            what: "block size 0",
                        });
                    }
                    Op::BlockSize {
                        tenant,
                        model,
                        block_size,
                    }
                }
                4 => {
                    let tenant = r.str_varint(MAX_STR)?;
                    let served = r.str_varint(MAX_STR)?;
                    let model = r.str_varint(MAX_STR)?;
                    let lora = r.str_varint(MAX_STR)?;
                    Op::Alias {
                        tenant,
                        served,
                        model,
                        lora: (!lora.is_empty()).then_some(lora),
                    }
                }
                5 => {
                    let worker = WorkerId(r.u32_varint()?);
                    let at = r.position();
                    let tier =
                        Tier::from_u8(r.u8()?).ok_or(FeedError::Value { at, what: "tier" })?;
                    let added = r.bool()?;
                    let at = r.position();
                    let n = r.varint()?;
                    if n > (r.remaining() / 8) as u64 {
                        return Err(FeedError::Value {
                            at,
                            what: "block count exceeds page size",
                        });
                    }
                    let keys = r
                        .take(n as usize * 8)?
                        .chunks_exact(8)
                        .map(|c| BlockKey(u64::from_le_bytes(c.try_into().unwrap_or([0; 8]))))
                        .collect();
                    Op::Blocks {
                        worker,
                        tier,
                        added,
                        keys,
                    }
                }
                6 if version >= 2 => {
                    let worker = WorkerId(r.u32_varint()?);
                    let requests = r.varint()?;
                    let prefill_tokens = r.varint()?;
                    let decode_tokens = r.varint()?;
                    let at = r.position();
                    let engine = match r.u8()? {
                        0 => None,
                        flag @ (1 | 2) => {
                            let waiting = r.u32_varint()?;
                            let running = r.u32_varint()?;
                            let at = r.position();
                            let kv = r.varint()?;
                            if kv > 1000 {
                                return Err(FeedError::Value {
                                    at,
                                    what: "kv usage over 1000 per mille",
                                });
                            }
                            Some(EngineSample {
                                load: EngineLoad {
                                    waiting,
                                    running,
                                    kv_permille: kv as u16,
                                },
                                age_ms: r.u32_varint()?,
                                stale: flag == 2,
                            })
                        }
                        _ => {
                            return Err(FeedError::Value {
                                at,
                                what: "engine sample flag",
                            })
                        }
                    };
                    Op::Load {
                        worker,
                        requests,
                        prefill_tokens,
                        decode_tokens,
                        engine,
                    }
                }
                7 if version >= 3 => Op::Stream(StreamMark {
                    stream: r.u64()?,
                    seq: r.varint()?,
                }),
                8 if version >= 4 => {
                    let worker = WorkerId(r.u32_varint()?);
                    let shard = r.u32_varint()?;
                    let key = BlockKey(r.u64()?);
                    let at = r.position();
                    let blocks = r.u32_varint()?;
                    if blocks == 0 {
                        return Err(FeedError::Value {
                            at,
                            what: "held blocks 0",
                        });
                    }
                    Op::Held {
                        worker,
                        shard,
                        key,
                        blocks,
                        ttl_ms: r.u32_varint()?,
                    }
                }
                tag => return Err(FeedError::Tag { tag, at }),
            };
            ops.push(op);
        }
        if r.remaining() != 0 {
            return Err(FeedError::Trailing(r.remaining()));
        }
        Ok(Page {
            flags,
            epoch,
            cursor,
            ops,
        })
    }
}

impl From<CodecError> for FeedError {
    fn from(e: CodecError) -> Self {
        match e {
            CodecError::Truncated(at) => FeedError::Truncated(at),
            CodecError::Value { at, what } => FeedError::Value { at, what },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_str() -> impl Strategy<Value = String> {
        "[a-z0-9:._/-]{0,24}"
    }

    fn arb_op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (
                any::<u32>(),
                any::<bool>(),
                any::<u32>(),
                arb_str(),
                arb_str(),
                (arb_str(), arb_str()),
            )
                .prop_map(
                    |(id, live, dp_rank, instance_id, address, (tenant, model))| Op::Worker {
                        id: WorkerId(id),
                        live,
                        dp_rank,
                        instance_id,
                        address,
                        tenant,
                        model
                    }
                ),
            any::<u32>().prop_map(|id| Op::WorkerGone { id: WorkerId(id) }),
            (arb_str(), arb_str(), 1u32..).prop_map(|(tenant, model, block_size)| Op::BlockSize {
                tenant,
                model,
                block_size
            }),
            (
                arb_str(),
                arb_str(),
                arb_str(),
                proptest::option::of("[a-z]{1,8}")
            )
                .prop_map(|(tenant, served, model, lora)| Op::Alias {
                    tenant,
                    served,
                    model,
                    lora
                }),
            (
                any::<u32>(),
                0u8..3,
                any::<bool>(),
                proptest::collection::vec(any::<u64>(), 0..40)
            )
                .prop_map(|(w, t, added, keys)| Op::Blocks {
                    worker: WorkerId(w),
                    tier: Tier::from_u8(t).unwrap(),
                    added,
                    keys: keys.into_iter().map(BlockKey).collect()
                }),
            (
                any::<u32>(),
                (any::<u64>(), any::<u64>(), any::<u64>()),
                proptest::option::of((
                    any::<u32>(),
                    any::<u32>(),
                    0u16..=1000,
                    any::<u32>(),
                    any::<bool>()
                ))
            )
                .prop_map(|(w, (requests, prefill_tokens, decode_tokens), e)| {
                    Op::Load {
                        worker: WorkerId(w),
                        requests,
                        prefill_tokens,
                        decode_tokens,
                        engine: e.map(|(waiting, running, kv_permille, age_ms, stale)| {
                            EngineSample {
                                load: EngineLoad {
                                    waiting,
                                    running,
                                    kv_permille,
                                },
                                age_ms,
                                stale,
                            }
                        }),
                    }
                }),
            (1u64.., any::<u64>()).prop_map(|(stream, seq)| Op::Stream(StreamMark { stream, seq })),
            (
                any::<u32>(),
                any::<u32>(),
                any::<u64>(),
                1u32..,
                any::<u32>()
            )
                .prop_map(|(w, shard, key, blocks, ttl_ms)| Op::Held {
                    worker: WorkerId(w),
                    shard,
                    key: BlockKey(key),
                    blocks,
                    ttl_ms,
                }),
        ]
    }

    fn arb_page() -> impl Strategy<Value = Page> {
        (
            0u8..8,
            any::<u64>(),
            any::<u64>(),
            proptest::collection::vec(arb_op(), 0..20),
        )
            .prop_map(|(flags, epoch, cursor, ops)| Page {
                flags,
                epoch,
                cursor,
                ops,
            })
    }

    proptest! {
        #[test]
        fn pages_round_trip(page in arb_page()) {
            let bytes = page.to_bytes();
            prop_assert!(bytes.len() <= HEADER_LEN + 10 + page.ops.iter().map(Op::encoded_len).sum::<usize>());
            prop_assert_eq!(Page::decode(&bytes), Ok(page));
        }

        #[test]
        fn truncated_pages_are_errors(page in arb_page(), cut in any::<prop::sample::Index>()) {
            let bytes = page.to_bytes();
            let cut = cut.index(bytes.len());
            prop_assert!(Page::decode(&bytes[..cut]).is_err());
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = Page::decode(&bytes);
            let mut framed = MAGIC.to_vec();
            framed.push(VERSION);
            framed.extend_from_slice(&bytes);
            let _ = Page::decode(&framed);
        }

        #[test]
        fn corrupted_pages_never_panic(page in arb_page(), at in any::<prop::sample::Index>(), byte in any::<u8>()) {
            let mut bytes = page.to_bytes();
            let at = at.index(bytes.len());
            bytes[at] = byte;
            let _ = Page::decode(&bytes);
        }
    }

    #[test]
    fn version_one_pages_still_decode_but_carry_no_load() {
        let page = Page {
            flags: 0,
            epoch: 3,
            cursor: 9,
            ops: vec![Op::WorkerGone { id: WorkerId(1) }],
        };
        let mut bytes = page.to_bytes();
        bytes[4] = 1;
        assert_eq!(Page::decode(&bytes), Ok(page));
        let load = Page {
            ops: vec![Op::Load {
                worker: WorkerId(0),
                requests: 1,
                prefill_tokens: 2,
                decode_tokens: 3,
                engine: None,
            }],
            ..Page::default()
        };
        let mut bytes = load.to_bytes();
        assert_eq!(Page::decode(&bytes), Ok(load));
        bytes[4] = 1;
        assert!(matches!(
            Page::decode(&bytes),
            Err(FeedError::Tag { tag: 6, .. })
        ));
    }

    #[test]
    fn pages_are_written_in_the_lowest_version_that_carries_them() {
        let plain = Page {
            flags: Page::MORE,
            epoch: 3,
            cursor: 9,
            ops: vec![Op::WorkerGone { id: WorkerId(1) }],
        };
        assert_eq!(
            plain.to_bytes()[4],
            2,
            "a version-2 reader must still read it"
        );
        let mark = Op::Stream(StreamMark { stream: 7, seq: 41 });
        let marked = Page::append_ops(&plain.to_bytes(), std::slice::from_ref(&mark)).unwrap();
        assert_eq!(marked[4], 3);
        let decoded = Page::decode(&marked).unwrap();
        assert_eq!(
            decoded.stream_mark(),
            Some(StreamMark { stream: 7, seq: 41 })
        );
        let handover = Page {
            flags: Page::HANDOVER,
            ..Page::default()
        };
        let bytes = handover.to_bytes();
        assert_eq!(bytes[4], 3);
        assert!(Page::decode(&bytes).unwrap().is_handover());
        // Neither the flag nor the op exists in version 2.
        let mut old = bytes.clone();
        old[4] = 2;
        assert!(matches!(Page::decode(&old), Err(FeedError::Flags(_))));
        let mut old = marked.clone();
        old[4] = 2;
        assert!(matches!(
            Page::decode(&old),
            Err(FeedError::Tag { tag: 7, .. })
        ));
        let booked = Op::Held {
            worker: WorkerId(2),
            shard: 5,
            key: BlockKey(99),
            blocks: 4,
            ttl_ms: 1500,
        };
        let shared = Page::append_ops(&marked, std::slice::from_ref(&booked)).unwrap();
        assert_eq!(shared[4], 4);
        assert_eq!(Page::decode(&shared).unwrap().ops.last(), Some(&booked));
        let mut old = shared.clone();
        old[4] = 3;
        assert!(matches!(
            Page::decode(&old),
            Err(FeedError::Tag { tag: 8, .. })
        ));
    }

    #[test]
    fn a_booking_of_no_blocks_is_refused() {
        let mut bytes = Page {
            ops: vec![Op::Held {
                worker: WorkerId(0),
                shard: 0,
                key: BlockKey(1),
                blocks: 1,
                ttl_ms: 0,
            }],
            ..Page::default()
        }
        .to_bytes();
        // Tag, worker, shard, key (8), then the block count.
        let at = bytes.len() - 2;
        assert_eq!(bytes[at], 1);
        bytes[at] = 0;
        assert!(matches!(
            Page::decode(&bytes),
            Err(FeedError::Value {
                what: "held blocks 0",
                ..
            })
        ));
    }

    proptest! {
        #[test]
        fn appended_ops_decode_after_the_page_ones(page in arb_page(), extra in proptest::collection::vec(arb_op(), 0..5)) {
            let bytes = Page::append_ops(&page.to_bytes(), &extra).unwrap();
            let mut want = page;
            want.ops.extend(extra);
            prop_assert_eq!(Page::decode(&bytes), Ok(want));
        }
    }

    #[test]
    fn a_kv_usage_over_a_thousand_per_mille_is_refused() {
        let mut bytes = Page {
            ops: vec![Op::Load {
                worker: WorkerId(0),
                requests: 0,
                prefill_tokens: 0,
                decode_tokens: 0,
                engine: Some(EngineSample {
                    load: EngineLoad {
                        kv_permille: 1000,
                        ..EngineLoad::default()
                    },
                    ..EngineSample::default()
                }),
            }],
            ..Page::default()
        }
        .to_bytes();
        // The kv varint (1000 = e8 07) sits after waiting 0 and running 0; make it 1001.
        let at = bytes.len() - 3;
        assert_eq!(&bytes[at..at + 2], &[0xe8, 0x07]);
        bytes[at] = 0xe9;
        assert!(matches!(
            Page::decode(&bytes),
            Err(FeedError::Value {
                what: "kv usage over 1000 per mille",
                ..
            })
        ));
    }

    #[test]
    fn bad_headers_are_named() {
        assert_eq!(Page::decode(b"XXXX"), Err(FeedError::BadMagic));
        let mut bytes = Page::default().to_bytes();
        bytes[4] = 9;
        assert_eq!(Page::decode(&bytes), Err(FeedError::Version(9)));
        let mut bytes = Page::default().to_bytes();
        bytes[5] = 0x80;
        assert_eq!(Page::decode(&bytes), Err(FeedError::Flags(0x80)));
        let mut bytes = Page::default().to_bytes();
        bytes.push(0);
        assert_eq!(Page::decode(&bytes), Err(FeedError::Trailing(1)));
    }
}
