//! The Dynamo reader (`--dynamo-namespace NS`, issue 23): the KV events an NVIDIA Dynamo
//! deployment already publishes on NATS Core, into the index, so kvroute can score and route a
//! Dynamo fleet without touching its engines.
//!
//! # What Dynamo publishes (the facts this module relies on)
//!
//! Checked against a real ai-dynamo 1.6.1 worker (`ai-dynamo` and `ai-dynamo-runtime` 1.6.1
//! from PyPI, its mocker engine on CPU, `DYN_EVENT_PLANE=nats`, `DYN_REQUEST_PLANE=nats` and
//! `tcp`),
//! whose messages and query answers are in `testdata/dynamo/` byte for byte, and run by
//! `make test-dynamo-interop` (`collector/tests/dynamo_interop.py`):
//!
//! - The subject is `namespace.<ns>.component.<component>.endpoint.<endpoint>.kv-events`
//!   (`generate` for the mocker), every segment percent-encoded outside `[A-Za-z0-9_-]`.
//!   Dynamo's 2026 main line before the endpoint joined it (read at 0e8f30094624,
//!   `lib/runtime/src/transports/event_plane/`) used `namespace.<ns>.component.<c>.kv-events`;
//!   releases before the event plane published a JSON `RouterEvent` on `...kv_events`.
//! - A message is the msgpack `EventEnvelope { publisher_id, sequence (from 0), published_at,
//!   topic, payload }`, written with field names; `payload` is a msgpack *array* of
//!   `RouterEvent { worker_id, storage_tier, residency_domain: "worker", event: KvCacheEvent
//!   { event_id, data, dp_rank } }` (one, or a removal and a store together). Event ids start
//!   at 1 and go up by one per worker and dp rank. Shapes in [`wire`]; the earlier single
//!   event in the envelope and the JSON forms are read too.
//! - `KvCacheStoredBlockData { block_hash, tokens_hash, mm_extra_info }`: `tokens_hash` is
//!   `LocalBlockHash`, xxh3-64 of the block's tokens as little-endian u32 under seed 1337 (a
//!   LoRA or cache namespace folded into the seed); `block_hash` the engine's own hash
//!   (`lib/kv-router/src/protocols.rs`, read at 038eab23a6b6).
//! - Every worker runs a local indexer and answers a KV query (`WorkerKvQueryRequest
//!   { worker_id, dp_rank, start_event_id, end_event_id, supports_tree_dump_failed, kind }`)
//!   on its request plane, at endpoint `worker_kv_query_source_<publisher id, hex>`: Dynamo's
//!   router asks it on a jump in event ids. On the NATS request plane that endpoint is the
//!   NATS subject `<ns>_<component>.worker_kv_query_source_<publisher id>-<worker id>` (hex),
//!   answered over a TCP connection back to the asker ([`recovery`] has the exchange). On the
//!   TCP request plane (`DYN_REQUEST_PLANE=tcp`, Dynamo's default) the worker's address is
//!   only in Dynamo's discovery: with file discovery (`DYN_FILE_KV`) a JSON record per
//!   endpoint instance, `v1/instances/<ns>%2F<c>%2F<endpoint>%2F<worker id, hex>`, whose
//!   `transport.tcp` is `<host>:<port>/<endpoint path>` ([`discovery`]); the request is a
//!   length-prefixed message to that address naming the path ([`tcp`]), the answer comes back
//!   as on the NATS plane (checked against 1.6.1's mocker with `DYN_REQUEST_PLANE=tcp`,
//!   `testdata/dynamo/tcp_request_plane_1.6.1.txt`). With etcd discovery (`ETCD_ENDPOINTS`,
//!   Dynamo's default outside Kubernetes) the same record is the value of the etcd key
//!   `v1/instances/<ns>/<c>/<endpoint>/<worker id, hex>` (unescaped), under the worker's
//!   lease, read through etcd's JSON gateway ([`etcd`]; checked against 1.6.1's mocker and
//!   etcd 3.4, `testdata/dynamo/etcd_discovery_1.6.1.txt`). Kubernetes discovery is not read.
//!
//! # What this reader does
//!
//! - **Subscribes** (NATS Core, the `--nats` server) to `--dynamo-subject`, by default both
//!   `namespace.<NS>.component.<C>.endpoint.*.kv-events` and
//!   `namespace.<NS>.component.<C>.kv-events` ([`naming::subjects`]), `*` for the component
//!   when none is given: every worker of the namespace, whichever of the two namings its
//!   release uses.
//! - **Bounds** each message before decoding: over `--dynamo-max-message-bytes` it is counted
//!   `too_large` and skipped; a message that does not decode is counted `undecodable` and
//!   skipped. Then each of its events is taken in order and counted (`applied`, `duplicate`,
//!   `gap`, `foreign`). Counts are `kvroute_bus_messages_total{dir="dynamo",outcome}`.
//! - **Registers** each Dynamo worker `(worker_id, dp_rank)` on its first event: instance id
//!   the worker id in decimal (what Dynamo's `/query` and its standalone indexer call a
//!   worker), `--dynamo-model`, `--dynamo-block-size`, `--dynamo-tenant`, and
//!   `--dynamo-address` as the serving address. A Dynamo fleet's worker ids are drawn by its
//!   runtime at every start and never configured, so an operator could not `/register` them
//!   ahead. The registration opens no socket (its endpoint is the placeholder [`ENDPOINT`])
//!   and is not published on the bus registry: every collector with `--dynamo-namespace` reads
//!   the subject itself (NATS Core fans it out to each). At most `--dynamo-max-workers` at
//!   once: a new worker past that unregisters the one heard from least recently (`evicted`).
//!   A worker id already registered otherwise (`/register` with other settings) is refused
//!   (`refused`) and its events skipped.
//! - **Keys blocks on Dynamo's `tokens_hash`**: it is kvroute's contract block hash
//!   (ARCHITECTURE.md, "Hashing"; `kvroute::hash`), so the index chains it as it would the
//!   hash of the tokens ([`kvroute::event::StoredBlock::block_hash`]) and a request the filter
//!   hashes from token ids matches blocks a Dynamo worker reported. A LoRA's or a cache
//!   namespace's blocks carry a hash under Dynamo's seed for them while the event names
//!   neither, so they land in the base scope where no request matches them: only base-model
//!   prefixes match. Multimodal blocks likewise (their hash folds in the images), and the
//!   blocks of Eagle speculative-decoding workers (hashed over one token more).
//! - **Applies** through [`Shared::apply_batch`], the path of ZMQ batches and of the stream.
//! - **Gaps**: per worker and dp rank, the next event id is applied; one at or below the last
//!   is stale (`duplicate`, skipped, as Dynamo's router does). A jump (`gap`), or a worker's
//!   first event past id 1 (this collector started or forgot the worker after it published),
//!   starts a KV query with `--dynamo-recovery nats` (the default) or `tcp` ([`recovery`];
//!   with `--dynamo-discovery-dir` or `--dynamo-discovery-etcd` the worker's record picks the
//!   request plane, what it said counted under `{dir="dynamo_discovery"}`: `tcp`, `other_transport`, `missing`,
//!   `malformed`): the missing
//!   range for a jump, the whole cache (a tree dump) for a first sight. The worker's events
//!   wait meanwhile ([`MAX_HELD`] at most; [`MAX_QUERIES`] queries at once). The missing
//!   events are applied in order (`recovered`), or the dump replaces what the worker held
//!   (`dumped`); then the waiting events, by the same rules. Without an answer (`off`, no
//!   subject to ask on, too many queries, too many events waiting, no responder, timeout,
//!   refusal, an answer too large or malformed, each counted under
//!   `kvroute_bus_messages_total{dir="dynamo_recovery",outcome}`) a jump clears the worker's
//!   blocks (what was missed may have removed blocks it still appears to hold, and routing on
//!   blocks an engine dropped costs more than routing on too few), counted in the worker's
//!   `gaps` and `kvroute_sequence_gaps_total`; the event is applied either way.
//! - `residency_domain: cache_owner` events (a shared cache pool, not the worker's own) are
//!   counted `foreign` and skipped.
//! - With `--state-dir`, Dynamo workers restored from the snapshot are unregistered at start:
//!   the events published while the collector was down are gone (NATS Core keeps none), so
//!   their blocks cannot be trusted; they register again on their next event, and with the
//!   KV query on, their cache comes back whole as a tree dump.

pub mod discovery;
pub mod etcd;
pub mod naming;
pub mod recovery;
pub mod tcp;
pub mod wire;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use kvroute::api::{RegisterRequest, UnregisterRequest};
use kvroute::event::{KvEvent, StoredBlock, WorkerId};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use self::recovery::{Failure, Query, Recovery};
use self::wire::{Answer, EventData, RouterEvent};
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

/// The `dir` label of the KV queries' outcomes.
const RECOVERY_DIR: &str = "dynamo_recovery";

/// The `dir` label of what discovery said of the workers asked ([`discovery::Lookup`]).
const DISCOVERY_DIR: &str = "dynamo_discovery";

/// Longest pause between two attempts to subscribe.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// KV queries in flight at once; a gap past that clears the worker as without queries.
pub const MAX_QUERIES: usize = 16;

/// Events of one worker held back while its query is in flight; one more gives the query up.
pub const MAX_HELD: usize = 4096;

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

/// Where an event came from: what its worker's KV query subject is built from.
#[derive(Debug, Clone)]
struct Source {
    subject: String,
    publisher_id: Option<u64>,
}

/// A worker whose KV query is in flight.
#[derive(Debug)]
struct Held {
    token: u64,
    /// A gap (its blocks are cleared if the query fails) rather than a first sight.
    gap: bool,
    source: Source,
    /// Its events since, in order of arrival.
    events: Vec<RouterEvent>,
}

/// A finished query.
struct Done {
    key: (u64, u32),
    token: u64,
    range: Option<(u64, u64)>,
    result: Result<Answer, Failure>,
    /// What discovery said of the worker, when it was looked up.
    looked_up: Option<&'static str>,
}

/// The reader's state: one entry per Dynamo worker it registered, at most `max_workers` (the
/// least recently heard is evicted past that), and the workers whose KV query is in flight.
pub struct Reader {
    config: DynamoConfig,
    known: HashMap<(u64, u32), Known>,
    messages: u64,
    recovery: Option<Arc<Recovery>>,
    held: HashMap<(u64, u32), Held>,
    tokens: u64,
    queries: JoinSet<Done>,
}

impl Reader {
    pub fn new(config: DynamoConfig, recovery: Option<Arc<Recovery>>) -> Reader {
        Reader {
            config,
            known: HashMap::new(),
            messages: 0,
            recovery,
            held: HashMap::new(),
            tokens: 0,
            queries: JoinSet::new(),
        }
    }

    /// Applies one NATS message from `subject`; bad input costs that message only, counted.
    pub async fn on_message(&mut self, shared: &Arc<Shared>, subject: &str, payload: &[u8]) {
        self.messages += 1;
        if payload.len() > self.config.max_message_bytes {
            count(&shared.metrics, DIR, "too_large");
            return;
        }
        let msg = match wire::decode(payload) {
            Ok(m) => m,
            Err(e) => {
                debug!(error = %e, "dynamo: undecodable message");
                count(&shared.metrics, DIR, "undecodable");
                return;
            }
        };
        let source = Source {
            subject: subject.to_owned(),
            publisher_id: msg.publisher_id,
        };
        self.feed(shared, &source, msg.events.into()).await;
    }

    /// Takes `events` in order. A worker's query given up on the way (too much held back)
    /// puts its held events back at the front, the first one applied whatever its id.
    async fn feed(
        &mut self,
        shared: &Arc<Shared>,
        source: &Source,
        mut events: VecDeque<RouterEvent>,
    ) {
        while let Some(ev) = events.pop_front() {
            if let Some(given_up) = self.on_event(shared, source, ev).await {
                let Held {
                    gap, events: held, ..
                } = given_up;
                let mut held: VecDeque<RouterEvent> = held.into();
                if let Some(first) = held.pop_front() {
                    self.fall_back(shared, gap, first).await;
                }
                while let Some(e) = held.pop_back() {
                    events.push_front(e);
                }
            }
        }
    }

    /// One event, by its worker's event id; returns a query given up (see [`Reader::feed`]).
    async fn on_event(
        &mut self,
        shared: &Arc<Shared>,
        source: &Source,
        ev: RouterEvent,
    ) -> Option<Held> {
        if ev.data == EventData::Foreign {
            count(&shared.metrics, DIR, "foreign");
            return None;
        }
        let id = self.resolve(shared, ev.worker_id, ev.dp_rank)?;
        let key = (ev.worker_id, ev.dp_rank);
        if let Some(h) = self.held.get_mut(&key) {
            if h.events.len() < MAX_HELD {
                h.events.push(ev);
                return None;
            }
            // Holding more would be unbounded: the query's answer will be dropped.
            count(&shared.metrics, RECOVERY_DIR, "overflow");
            let mut h = self.held.remove(&key)?;
            h.events.push(ev);
            return Some(h);
        }
        let last = self.known.get(&key).and_then(|k| k.last);
        match last {
            Some(last) if ev.event_id <= last => {
                count(&shared.metrics, DIR, "duplicate");
                return None;
            }
            Some(last) if ev.event_id > last.saturating_add(1) => {
                count(&shared.metrics, DIR, "gap");
                let range = (last + 1, ev.event_id - 1);
                warn!(
                    worker = ev.worker_id,
                    dp = ev.dp_rank,
                    last,
                    event_id = ev.event_id,
                    "dynamo: event id gap"
                );
                match self.ask(shared, source, Some(range), ev) {
                    Ok(()) => return None,
                    Err(ev) => {
                        self.fall_back(shared, true, ev).await;
                        return None;
                    }
                }
            }
            // Ids start at 1: a first event past it means the collector came in late (or
            // forgot the worker), and the worker's cache holds what it missed.
            None if ev.event_id > 1 => match self.ask(shared, source, None, ev) {
                Ok(()) => return None,
                Err(ev) => {
                    self.fall_back(shared, false, ev).await;
                    return None;
                }
            },
            _ => {}
        }
        self.apply(shared, id, key, ev).await;
        count(&shared.metrics, DIR, "applied");
        None
    }

    /// Starts the KV query for `ev`'s worker, holding `ev` back; gives `ev` back when no query
    /// can be made (off, too many in flight, no subject to ask on), counted.
    fn ask(
        &mut self,
        shared: &Arc<Shared>,
        source: &Source,
        range: Option<(u64, u64)>,
        ev: RouterEvent,
    ) -> Result<(), RouterEvent> {
        let Some(recovery) = self.recovery.clone() else {
            return Err(ev);
        };
        if self.held.len() >= MAX_QUERIES {
            count(&shared.metrics, RECOVERY_DIR, "busy");
            return Err(ev);
        }
        let endpoint = source
            .publisher_id
            .and_then(|p| naming::query_endpoint(&source.subject, p, ev.worker_id));
        let Some(endpoint) = endpoint else {
            count(&shared.metrics, RECOVERY_DIR, "unaddressable");
            return Err(ev);
        };
        let key = (ev.worker_id, ev.dp_rank);
        self.tokens += 1;
        let token = self.tokens;
        let query = Query {
            endpoint,
            worker_id: ev.worker_id,
            dp_rank: ev.dp_rank,
            range,
        };
        debug!(
            worker = ev.worker_id,
            dp = ev.dp_rank,
            ?range,
            "dynamo: KV query"
        );
        self.queries.spawn(async move {
            let (result, looked_up) = recovery.query(query).await;
            Done {
                key,
                token,
                range,
                result,
                looked_up,
            }
        });
        self.held.insert(
            key,
            Held {
                token,
                gap: range.is_some(),
                source: source.clone(),
                events: vec![ev],
            },
        );
        Ok(())
    }

    /// A query's answer: applied, then the worker's held events in order.
    async fn on_done(&mut self, shared: &Arc<Shared>, done: Done) {
        let Done {
            key,
            token,
            range,
            result,
            looked_up,
        } = done;
        if let Some(outcome) = looked_up {
            count(&shared.metrics, DISCOVERY_DIR, outcome);
        }
        if self.held.get(&key).is_none_or(|h| h.token != token) {
            // Given up meanwhile.
            return;
        }
        let Some(held) = self.held.remove(&key) else {
            return;
        };
        let id = self.current(shared, key);
        let outcome = match (id, result) {
            (None, _) => Err("unregistered"),
            (Some(id), Ok(Answer::Events { events, .. })) => {
                self.replay(shared, id, key, range, events).await
            }
            (Some(id), Ok(Answer::TreeDump { events, last })) => {
                self.dump(shared, id, key, events, last).await;
                Ok("dumped")
            }
            (Some(_), Ok(Answer::Refused(_))) => Err(Failure::Refused.outcome()),
            (Some(_), Err(f)) => Err(f.outcome()),
        };
        let mut events: VecDeque<RouterEvent> = held.events.into();
        match outcome {
            Ok(outcome) => {
                info!(
                    worker = key.0,
                    dp = key.1,
                    outcome,
                    "dynamo: KV query answered"
                );
                count(&shared.metrics, RECOVERY_DIR, outcome);
            }
            Err(outcome) => {
                warn!(
                    worker = key.0,
                    dp = key.1,
                    outcome,
                    "dynamo: KV query failed; the worker's blocks go by its events alone"
                );
                count(&shared.metrics, RECOVERY_DIR, outcome);
                if let Some(first) = events.pop_front() {
                    self.fall_back(shared, held.gap, first).await;
                }
            }
        }
        self.feed(shared, &held.source, events).await;
    }

    /// The missed events of `range` applied in order; anything short of all of them fails.
    async fn replay(
        &mut self,
        shared: &Arc<Shared>,
        id: WorkerId,
        key: (u64, u32),
        range: Option<(u64, u64)>,
        events: Vec<RouterEvent>,
    ) -> Result<&'static str, &'static str> {
        let Some((_, end)) = range else {
            return Err(Failure::BadAnswer.outcome());
        };
        for ev in events {
            let last = self.known.get(&key).and_then(|k| k.last).unwrap_or(0);
            if (ev.worker_id, ev.dp_rank) != key || ev.event_id <= last || ev.event_id > end {
                continue;
            }
            if ev.event_id != last + 1 {
                return Err(Failure::BadAnswer.outcome());
            }
            self.apply(shared, id, key, ev).await;
        }
        let last = self.known.get(&key).and_then(|k| k.last);
        if last == Some(end) {
            Ok("recovered")
        } else {
            Err(Failure::BadAnswer.outcome())
        }
    }

    /// The worker's whole cache: what it held is replaced, then it is at event id `last`.
    async fn dump(
        &mut self,
        shared: &Arc<Shared>,
        id: WorkerId,
        key: (u64, u32),
        events: Vec<RouterEvent>,
        last: u64,
    ) {
        shared.write().clear_blocks(id);
        for ev in events {
            if (ev.worker_id, ev.dp_rank) != key || ev.data == EventData::Foreign {
                continue;
            }
            // The dump's event ids are positions in it: the worker stands at `last`.
            let Some(batch) = batch_of(ev) else {
                continue;
            };
            shared.apply_batch(id, last, batch).await;
        }
        if let Some(k) = self.known.get_mut(&key) {
            k.last = Some(last);
        }
        shared.notify();
    }

    /// Without an answer: on a gap the worker's blocks are cleared (what was missed may have
    /// removed blocks it still appears to hold, and routing on blocks an engine dropped costs
    /// more than routing on too few), counted; then `ev` is applied whatever its id.
    async fn fall_back(&mut self, shared: &Arc<Shared>, gap: bool, ev: RouterEvent) {
        let key = (ev.worker_id, ev.dp_rank);
        let Some(id) = self.current(shared, key) else {
            return;
        };
        if gap {
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
        self.apply(shared, id, key, ev).await;
        count(&shared.metrics, DIR, "applied");
    }

    /// Applies one event of worker `id` and moves its last event id there.
    async fn apply(
        &mut self,
        shared: &Arc<Shared>,
        id: WorkerId,
        key: (u64, u32),
        ev: RouterEvent,
    ) {
        if let Some(k) = self.known.get_mut(&key) {
            k.last = Some(ev.event_id);
        }
        let event_id = ev.event_id;
        let Some(batch) = batch_of(ev) else {
            return;
        };
        shared.apply_batch(id, event_id, batch).await;
        shared.notify();
    }

    /// The kvroute worker of a key this reader registered, if it is still that registration.
    fn current(&mut self, shared: &Arc<Shared>, key: (u64, u32)) -> Option<WorkerId> {
        let k = self.known.get(&key)?;
        let current = shared
            .read()
            .worker(k.id)
            .is_some_and(|w| w.generation == k.generation);
        if current {
            Some(k.id)
        } else {
            self.known.remove(&key);
            None
        }
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

/// Runs for as long as the collector does: subscribes to the Dynamo subjects (again after an
/// error; the client itself resubscribes after a reconnect), applies every message and the
/// KV queries' answers, and serves the answers' listener.
pub async fn run(shared: Arc<Shared>, bus: Arc<Bus>, client: async_nats::Client) {
    let Some(config) = bus.config.dynamo.clone() else {
        return;
    };
    forget_restored(&shared);
    let recovery = match &config.recovery {
        Some(rc) => match Recovery::bind(client.clone(), rc.clone(), &bus.config.url).await {
            Ok(r) => {
                info!(listen = %r.advertised(), "dynamo: KV queries on a gap, answers to this address");
                if let Some(dir) = &rc.discovery_dir {
                    // Not fatal: the workers may create it later; each query looks again.
                    let is_dir = tokio::fs::metadata(dir).await.is_ok_and(|m| m.is_dir());
                    if !is_dir {
                        warn!(dir = %dir.display(), "dynamo: --dynamo-discovery-dir is not a directory (yet)");
                    }
                }
                if let Some(url) = &rc.discovery_etcd {
                    info!(%url, "dynamo: workers' KV query endpoints looked up in etcd");
                }
                Some(Arc::new(r))
            }
            Err(e) => {
                warn!(error = %e, "dynamo: cannot listen for KV query answers; a gap clears the worker");
                None
            }
        },
        None => None,
    };
    let serve = recovery.clone().map(Recovery::serve);
    let read = read(shared, client, config, recovery);
    match serve {
        Some(serve) => {
            tokio::join!(serve, read);
        }
        None => read.await,
    }
}

async fn read(
    shared: Arc<Shared>,
    client: async_nats::Client,
    config: DynamoConfig,
    recovery: Option<Arc<Recovery>>,
) {
    let subjects = config.subjects.clone();
    let mut reader = Reader::new(config, recovery);
    let mut backoff = Duration::from_millis(100);
    loop {
        let mut subs = Vec::new();
        for subject in &subjects {
            match client.subscribe(subject.clone()).await {
                Ok(sub) => subs.push(sub),
                Err(e) => {
                    warn!(subject = %subject, error = %e, "dynamo: cannot subscribe; retrying");
                    break;
                }
            }
        }
        if subs.len() == subjects.len() {
            backoff = Duration::from_millis(100);
            info!(subjects = ?subjects, "dynamo: reading KV events");
            let mut merged = futures_util::stream::select_all(subs);
            loop {
                tokio::select! {
                    msg = merged.next() => match msg {
                        Some(msg) => reader.on_message(&shared, msg.subject.as_str(), &msg.payload).await,
                        None => break,
                    },
                    Some(done) = reader.queries.join_next(), if !reader.queries.is_empty() => {
                        if let Ok(done) = done {
                            reader.on_done(&shared, done).await;
                        }
                    }
                }
            }
            debug!("dynamo: subscription ended");
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}
