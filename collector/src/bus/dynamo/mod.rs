//! The Dynamo reader (`--dynamo-namespace NS`, issue 23): the KV events an NVIDIA Dynamo
//! deployment already publishes on NATS Core, into the index, so kvroute can score and route a
//! Dynamo fleet without touching its engines.
//!
//! # What Dynamo publishes (the facts this module relies on)
//!
//! Read in `ai-dynamo/dynamo` (no code copied; files and the commits they were read at, all
//! from its 2026 main line, whose workspace version reads 1.2.0 at 0230a315ea6a and whose
//! msgpack is `rmp-serde` 1):
//!
//! - `lib/kv-router/src/protocols.rs` (038eab23a6b6): `KV_EVENT_SUBJECT = "kv-events"`; the
//!   `RouterEvent { worker_id, storage_tier, residency_domain?, event: KvCacheEvent
//!   { event_id, data, dp_rank }, state_source? }` family; `KvCacheStoredBlockData
//!   { block_hash, tokens_hash, mm_extra_info }`, where `tokens_hash` is `LocalBlockHash`:
//!   xxh3-64 of the block's tokens as little-endian u32 under seed 1337 (with a LoRA or cache
//!   namespace folded into the seed), and `block_hash` the engine's own hash. Shapes in
//!   [`wire`].
//! - `lib/llm/src/kv_router/publisher/sinks.rs` (833037a8d607): a worker publishes each
//!   `RouterEvent` on its own through the event plane (`EventPublisher::publish`), or, in the
//!   legacy durable mode, to JetStream (`NatsQueue`).
//! - `lib/runtime/src/transports/event_plane/mod.rs` (0e8f30094624), `codec.rs`
//!   (bf0be57c8cf2), `traits.rs` (331ac67bd472), and the discovery module's `EventScope`: the
//!   subject is `namespace.<ns>.component.<component>.kv-events`, every segment
//!   percent-encoded outside `[A-Za-z0-9_-]`; on NATS the message is the msgpack
//!   `EventEnvelope { publisher_id, sequence, published_at, topic, payload }` with the msgpack
//!   `RouterEvent` as `payload`, both written with field names. Older releases published the
//!   JSON `RouterEvent` on `namespace.<ns>.component.<component>.kv_events`
//!   (`--dynamo-subject` names it; [`wire`] reads both encodings).
//! - Pull request ai-dynamo/dynamo#4921 (2025-12): with every worker's local indexer on,
//!   workers publish on NATS Core instead of JetStream; event ids are consecutive per worker,
//!   and on a jump the router asks the worker's local indexer for the missing range.
//!   `lib/llm/src/kv_router/indexer/recovery/worker_query_transport.rs` (5c97a400342b): that
//!   query (`WorkerKvQueryRequest { worker_id, dp_rank, start_event_id, end_event_id,
//!   supports_tree_dump_failed, kind }`) now travels on Dynamo's *request plane*: addressed to
//!   the worker's discovered instance through `AddressedPushRouter`, TCP by default, answered
//!   as a response stream. Not a NATS request/reply a client can make without Dynamo's
//!   runtime, so it is not made here (below).
//! - `lib/llm/src/kv_router/indexer/recovery/worker_query_state.rs` (02d6b3f471b3) and
//!   `subscriber.rs` (073c558e6cdd): Dynamo's router follows event ids per `(worker id, dp
//!   rank)`; an id at or below the last applied is stale and ignored, a jump starts the
//!   recovery query; JetStream (`--durable-kv-events`) is deprecated in favour of this mode.
//!
//! # What this reader does
//!
//! - **Subscribes** (NATS Core, the `--nats` server) to `--dynamo-subject`, by default
//!   `namespace.<NS>.component.<C>.kv-events`, `*` for the component when none is given: every
//!   worker of the namespace.
//! - **Bounds** each message before decoding: over `--dynamo-max-message-bytes` it is counted
//!   `too_large` and skipped; a message that does not decode is counted `undecodable` and
//!   skipped. Counts are `kvroute_bus_messages_total{dir="dynamo",outcome}`.
//! - **Registers** each Dynamo worker `(worker_id, dp_rank)` on its first event: instance id
//!   the worker id in decimal (what Dynamo's `/query` and its standalone indexer call a
//!   worker), `--dynamo-model`, `--dynamo-block-size`, `--dynamo-tenant`, and
//!   `--dynamo-address` as the serving address. A Dynamo fleet's worker ids are drawn by its
//!   runtime at every start and never configured, so an operator could not `/register` them
//!   ahead (Dynamo's router learns them from its discovery plane, etcd or Kubernetes, which
//!   kvroute does not read; the events name them too). The registration opens no socket
//!   (its endpoint is the placeholder [`ENDPOINT`]) and is not published on the bus registry:
//!   every collector with `--dynamo-namespace` reads the subject itself (NATS Core fans it out
//!   to each). At most `--dynamo-max-workers` at once: a new worker past that unregisters the
//!   one heard from least recently (`evicted`). A worker id already registered otherwise
//!   (`/register` with other settings) is refused (`refused`) and its events skipped.
//! - **Keys blocks on Dynamo's `tokens_hash`**: it is kvroute's contract block hash
//!   (ARCHITECTURE.md, "Hashing"; `kvroute::hash`), so the index chains it as it would the
//!   hash of the tokens ([`kvroute::event::StoredBlock::block_hash`]) and a request the filter
//!   hashes from token ids matches blocks a Dynamo worker reported. A LoRA's or a cache
//!   namespace's blocks carry a hash under Dynamo's seed for them while the event names
//!   neither, so they land in the base scope where no request matches them: only base-model
//!   prefixes match. Multimodal blocks likewise (their hash folds in the images), and the
//!   blocks of Eagle speculative-decoding workers (hashed over one token more).
//! - **Applies** through [`Shared::apply_batch`], the path of ZMQ batches and of the stream.
//! - **Gaps**: per worker and dp rank, event ids go up by one. The next one is applied; one at
//!   or below the last is stale (`duplicate`, skipped, as Dynamo's router does); a jump is a
//!   gap: counted (`gap`, the
//!   worker's `gaps` and `kvroute_gaps_total`), the worker's blocks are cleared (what was
//!   missed may have removed blocks it still appears to hold, and routing on blocks an engine
//!   dropped costs more than routing on too few), and the event is applied. Dynamo's
//!   replay-buffer query is not made (above); its blocks come back as the worker stores them.
//! - `residency_domain: cache_owner` events (a shared cache pool, not the worker's own) are
//!   counted `foreign` and skipped.
//! - With `--state-dir`, Dynamo workers restored from the snapshot are unregistered at start:
//!   the events published while the collector was down are gone (NATS Core keeps none), so
//!   their blocks cannot be trusted; they register again on their next event.

pub mod naming;
pub mod wire;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use kvroute::api::{RegisterRequest, UnregisterRequest};
use kvroute::event::{KvEvent, StoredBlock, WorkerId};
use tracing::{debug, info, warn};

use self::wire::{EventData, RouterEvent};
use super::settings::DynamoConfig;
use super::{count, Bus};
use crate::decode::{Batch, DecodeStats};
use crate::hub::Registered;
use crate::metrics::WorkerLabels;
use crate::shared::Shared;

/// The endpoint of a Dynamo worker's registration: no socket is opened for it (the reader
/// registers without starting a subscriber); a valid `tcp://host:port` because registrations
/// need one.
pub const ENDPOINT: &str = "tcp://0.0.0.0:0";

/// The `dir` label of this reader's counts.
const DIR: &str = "dynamo";

/// Longest pause between two attempts to subscribe.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// A Dynamo worker this reader registered.
#[derive(Debug, Clone, Copy)]
struct Known {
    id: WorkerId,
    generation: u64,
    /// The last event id applied.
    last: Option<u64>,
    /// When it was last heard from, in messages: the least recent is evicted first.
    heard: u64,
}

/// The reader's state: one entry per Dynamo worker it registered, at most `max_workers` (the
/// least recently heard is evicted past that).
#[derive(Debug)]
pub struct Reader {
    config: DynamoConfig,
    known: HashMap<(u64, u32), Known>,
    messages: u64,
}

impl Reader {
    pub fn new(config: DynamoConfig) -> Reader {
        Reader {
            config,
            known: HashMap::new(),
            messages: 0,
        }
    }

    /// Applies one NATS message; bad input costs that message only, counted.
    pub async fn on_message(&mut self, shared: &Arc<Shared>, payload: &[u8]) {
        self.messages += 1;
        if payload.len() > self.config.max_message_bytes {
            count(&shared.metrics, DIR, "too_large");
            return;
        }
        let ev = match wire::decode(payload) {
            Ok(e) => e,
            Err(e) => {
                debug!(error = %e, "dynamo: undecodable message");
                count(&shared.metrics, DIR, "undecodable");
                return;
            }
        };
        if ev.data == EventData::Foreign {
            count(&shared.metrics, DIR, "foreign");
            return;
        }
        let Some(id) = self.resolve(shared, ev.worker_id, ev.dp_rank) else {
            return;
        };
        let key = (ev.worker_id, ev.dp_rank);
        let last = self.known.get(&key).and_then(|k| k.last);
        match last {
            Some(last) if ev.event_id <= last => {
                count(&shared.metrics, DIR, "duplicate");
                return;
            }
            Some(last) if ev.event_id > last.saturating_add(1) => {
                warn!(
                    worker = ev.worker_id,
                    dp = ev.dp_rank,
                    last,
                    event_id = ev.event_id,
                    "dynamo: event id gap; the worker's blocks are cleared"
                );
                count(&shared.metrics, DIR, "gap");
                let instance = ev.worker_id.to_string();
                shared
                    .metrics
                    .gaps
                    .get_or_create(&WorkerLabels::new(&instance, ev.dp_rank))
                    .inc();
                let mut hub = shared.write();
                hub.clear_blocks(id);
                if let Some(w) = hub.worker_mut(id) {
                    w.status.gaps += 1;
                }
            }
            _ => {}
        }
        if let Some(k) = self.known.get_mut(&key) {
            k.last = Some(ev.event_id);
        }
        let event_id = ev.event_id;
        let Some(batch) = batch_of(ev) else {
            return;
        };
        shared.apply_batch(id, event_id, batch).await;
        count(&shared.metrics, DIR, "applied");
        shared.notify();
    }

    /// The kvroute worker of Dynamo's `(worker_id, dp_rank)`, registered on first sight.
    fn resolve(&mut self, shared: &Arc<Shared>, worker_id: u64, dp_rank: u32) -> Option<WorkerId> {
        let key = (worker_id, dp_rank);
        let tick = self.messages;
        if let Some(k) = self.known.get_mut(&key) {
            let current = shared
                .read()
                .worker(k.id)
                .is_some_and(|w| w.generation == k.generation);
            if current {
                k.heard = tick;
                return Some(k.id);
            }
            // Unregistered meanwhile (`/unregister`, or the slot went to another worker).
            self.known.remove(&key);
        }
        let req = RegisterRequest {
            instance_id: worker_id.to_string(),
            endpoint: ENDPOINT.to_owned(),
            replay_endpoint: None,
            model_name: self.config.model.clone(),
            tenant_id: self.config.tenant.clone(),
            block_size: self.config.block_size,
            dp_rank: Some(dp_rank),
            lora_name: None,
            cache_salt: None,
            address: Some(self.config.address.to_string()),
        };
        // Registered directly in the hub: no subscriber, nothing published on the bus.
        let mut hub = shared.write();
        let id = match hub.register(req) {
            Ok(Registered::New(id)) => {
                info!(
                    worker = worker_id,
                    dp = dp_rank,
                    "dynamo: worker registered"
                );
                count(&shared.metrics, DIR, "registered");
                id
            }
            Ok(Registered::Same(id)) => id,
            Err(e) => {
                drop(hub);
                debug!(worker = worker_id, dp = dp_rank, error = %e, "dynamo: worker not registered");
                count(&shared.metrics, DIR, "refused");
                return None;
            }
        };
        hub.set_connected(id, true);
        let generation = hub.worker(id).map_or(0, |w| w.generation);
        drop(hub);
        // Room is made once the new worker is in: a worker the hub refuses evicts nobody.
        if self.known.len() >= self.config.max_workers {
            self.evict(shared);
        }
        shared.notify();
        self.known.insert(
            key,
            Known {
                id,
                generation,
                last: None,
                heard: tick,
            },
        );
        Some(id)
    }

    /// Unregisters the worker heard from least recently.
    fn evict(&mut self, shared: &Arc<Shared>) {
        let Some((&key, _)) = self.known.iter().min_by_key(|(_, k)| k.heard) else {
            return;
        };
        self.known.remove(&key);
        let (worker_id, dp_rank) = key;
        info!(
            worker = worker_id,
            dp = dp_rank,
            "dynamo: least recently heard worker unregistered (--dynamo-max-workers)"
        );
        let _ = shared.unregister_local(&self.unregister_request(worker_id, dp_rank));
        count(&shared.metrics, DIR, "evicted");
    }

    fn unregister_request(&self, worker_id: u64, dp_rank: u32) -> UnregisterRequest {
        UnregisterRequest {
            instance_id: worker_id.to_string(),
            model_name: self.config.model.clone(),
            tenant_id: self.config.tenant.clone(),
            dp_rank: Some(dp_rank),
        }
    }
}

/// The normalized batch of one Dynamo event; `None` for a shared pool's event, which no
/// worker of the index holds.
fn batch_of(ev: RouterEvent) -> Option<Batch> {
    let event = match ev.data {
        EventData::Stored { parent, blocks } => KvEvent::BlockStored {
            parent,
            blocks: blocks
                .into_iter()
                .map(|(hash, block)| StoredBlock {
                    hash,
                    tokens: Vec::new(),
                    block_hash: Some(block),
                })
                .collect(),
            tier: ev.tier,
            lora_name: None,
            cache_salt: None,
        },
        EventData::Removed(hashes) => KvEvent::BlockRemoved {
            hashes,
            tier: ev.tier,
        },
        EventData::Cleared => KvEvent::AllBlocksCleared,
        EventData::Foreign => return None,
    };
    Some(Batch {
        ts: 0.0,
        dp_rank: None,
        events: vec![event],
        stats: DecodeStats::default(),
    })
}

/// Unregisters the Dynamo workers a `--state-dir` snapshot brought back (see the module doc).
fn forget_restored(shared: &Arc<Shared>) {
    let restored: Vec<UnregisterRequest> = shared
        .read()
        .workers()
        .filter(|w| w.source.is_none() && w.reg.endpoint == ENDPOINT)
        .map(|w| UnregisterRequest {
            instance_id: w.reg.instance_id.clone(),
            model_name: w.reg.model_name.clone(),
            tenant_id: w.reg.tenant_id.clone(),
            dp_rank: Some(w.dp_rank()),
        })
        .collect();
    for req in &restored {
        if shared.unregister_local(req).is_ok() {
            info!(instance = %req.instance_id, dp = ?req.dp_rank, "dynamo: restored worker dropped; it registers again on its next event");
        }
    }
    if !restored.is_empty() {
        shared.notify();
    }
}

/// Runs for as long as the collector does: subscribes to the Dynamo subject (again after an
/// error; the client itself resubscribes after a reconnect) and applies every message.
pub async fn run(shared: Arc<Shared>, bus: Arc<Bus>, client: async_nats::Client) {
    let Some(config) = bus.config.dynamo.clone() else {
        return;
    };
    forget_restored(&shared);
    let subject = config.subject.clone();
    let mut reader = Reader::new(config);
    let mut backoff = Duration::from_millis(100);
    loop {
        match client.subscribe(subject.clone()).await {
            Ok(mut sub) => {
                backoff = Duration::from_millis(100);
                info!(subject = %subject, "dynamo: reading KV events");
                while let Some(msg) = sub.next().await {
                    reader.on_message(&shared, &msg.payload).await;
                }
                debug!(subject = %subject, "dynamo: subscription ended");
            }
            Err(e) => warn!(subject = %subject, error = %e, "dynamo: cannot subscribe; retrying"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}
