//! The hub's plain types: errors, worker records, settings, and what an ingest slice did.

use kvroute::api::RegisterRequest;
use kvroute::event::WorkerId;
use kvroute::scope::DEFAULT_TENANT;
use serde::{Deserialize, Serialize};

/// Longest instance id, model name, tenant, LoRA name or salt accepted (the feed's own limit
/// is 4096 bytes).
pub const MAX_NAME_BYTES: usize = 1024;

/// Most workers at once: worker ids index the filter's fixed slot table.
pub const MAX_WORKERS: usize = 4096;

/// Why a request was refused; the API maps each kind to a status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HubError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    TooLarge(String),
}

/// The state of a worker's KV event stream.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum EventStream {
    /// Never connected since registration (events off, a typo, a firewall): the engine is
    /// routed with an empty cache, by load and text approximate mode.
    #[default]
    Never,
    Connected,
    /// Was connected and dropped; past `keep_disconnected` the worker is taken as down.
    Dropped,
}

/// Live status of a worker, as `/workers` shows it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct WorkerStatus {
    pub connected: bool,
    #[serde(default)]
    pub event_stream: EventStream,
    /// The stream dropped longer than `keep_disconnected` ago: evidence the engine is down.
    #[serde(default)]
    pub stream_expired: bool,
    /// Its `/metrics` answered once and has failed for longer than `engine_down`. Evidence
    /// of down only while no event stream is connected: a live stream is the engine itself
    /// speaking, and a broken metrics endpoint alone must not take a serving engine away.
    #[serde(default)]
    pub metrics_down: bool,
    pub last_seq: Option<u64>,
    /// xxh3 of the payload of the batch at `last_seq` (ZMQ sources): on reconnection the
    /// batch the engine replays at that number must be the same one, or the engine restarted
    /// while nobody listened (see `zmq`). Kept in the state file, not shown on `/workers`.
    #[serde(skip)]
    pub last_hash: Option<u64>,
    pub batches: u64,
    pub events: u64,
    pub gaps: u64,
    pub replays: u64,
    pub restarts: u64,
    pub decode_errors: u64,
    pub orphans: u64,
}

/// One worker `(instance_id, dp_rank)`.
#[derive(Clone, Debug)]
pub struct WorkerInfo {
    pub id: WorkerId,
    /// The registration, normalized: tenant, dp rank and address filled in.
    pub reg: RegisterRequest,
    /// Set when the worker was not registered but named by the dp rank of batches coming from
    /// the publisher registered as `source`.
    pub source: Option<WorkerId>,
    pub status: WorkerStatus,
    /// Distinguishes this worker from a later one in the same slot, so that a batch applied in
    /// slices stops when its worker went away between two of them.
    pub generation: u64,
}

impl WorkerStatus {
    /// A routing candidate: registered and no evidence it is down. Not "connected": an
    /// engine that never sent an event is routed with an empty cache.
    pub fn is_routable(&self) -> bool {
        let down_by_metrics = self.metrics_down && !self.connected;
        !self.stream_expired && !down_by_metrics
    }
}

impl WorkerInfo {
    pub fn tenant(&self) -> &str {
        self.reg.tenant_id.as_deref().unwrap_or(DEFAULT_TENANT)
    }

    pub fn dp_rank(&self) -> u32 {
        self.reg.dp_rank.unwrap_or(0)
    }

    pub fn address(&self) -> &str {
        self.reg.address.as_deref().unwrap_or("")
    }
}

/// `GET /workers` entry.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct WorkerView {
    pub worker_id: u32,
    pub instance_id: String,
    pub dp_rank: u32,
    pub tenant_id: String,
    pub model_name: String,
    pub block_size: u32,
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub address: String,
    pub lora_name: Option<String>,
    /// Registered directly (false: named by a batch's dp rank).
    pub registered: bool,
    pub blocks: u64,
    /// The engine's KV cache size in blocks (`vllm:cache_config_info{num_gpu_blocks}`), which
    /// the index is sized for; absent until its metrics page said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_blocks: Option<u64>,
    /// [`WorkerStatus::is_routable`].
    #[serde(default)]
    pub routable: bool,
    #[serde(flatten)]
    pub status: WorkerStatus,
}

/// What registering did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Registered {
    /// A new worker: start its subscriber.
    New(WorkerId),
    /// The same registration again: nothing changed.
    Same(WorkerId),
}

/// Hub settings (from [`crate::config::Config`]).
#[derive(Clone, Copy, Debug)]
pub struct HubConfig {
    /// Block budget of one registration, shared by all its dp ranks.
    pub max_blocks_per_worker: usize,
    pub max_pages_per_worker: usize,
    pub default_serving_port: Option<u16>,
    pub max_query_tokens: usize,
    pub feed_log_entries: usize,
    pub max_feed_bytes: usize,
    /// See [`Limits`].
    pub limits: Limits,
}

/// Caps on what engines' events may create, per registration and in all. Every refusal is
/// counted by [`Limit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Served names one registration's events may add (LoRA names).
    pub aliases_per_worker: usize,
    /// Served names in all, registered ones included.
    pub aliases: usize,
    /// dp ranks one registration's batches may name besides its own.
    pub dp_ranks_per_worker: usize,
    /// Workers named by batches' dp ranks in all; the rest of the slots stay for `/register`.
    pub dp_workers: usize,
    /// SGLang page records in all (each worker also has `max_pages_per_worker`).
    pub pages: usize,
    /// Most blocks applied per hold of the lock: a bigger batch is applied in slices.
    pub slice_blocks: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            aliases_per_worker: 64,
            aliases: 16_384,
            dp_ranks_per_worker: 64,
            dp_workers: 1024,
            pages: 1 << 24,
            slice_blocks: 1 << 13,
        }
    }
}

/// A cap that refused something, as the `reason` label of `kvroute_limited`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Limit {
    AliasesPerWorker,
    Aliases,
    /// The name is a registered model's: an alias never shadows one.
    AliasIsModel,
    /// The name is already another model's alias.
    AliasTaken,
    DpRanksPerWorker,
    DpWorkers,
    /// The registration's dp ranks together hold their block budget.
    Blocks,
    Pages,
}

impl Limit {
    pub const ALL: [Limit; 8] = [
        Limit::AliasesPerWorker,
        Limit::Aliases,
        Limit::AliasIsModel,
        Limit::AliasTaken,
        Limit::DpRanksPerWorker,
        Limit::DpWorkers,
        Limit::Blocks,
        Limit::Pages,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Limit::AliasesPerWorker => "aliases_per_worker",
            Limit::Aliases => "aliases",
            Limit::AliasIsModel => "alias_is_model",
            Limit::AliasTaken => "alias_taken",
            Limit::DpRanksPerWorker => "dp_ranks_per_worker",
            Limit::DpWorkers => "dp_workers",
            Limit::Blocks => "blocks_per_registration",
            Limit::Pages => "pages",
        }
    }
}

/// Refusals by [`Limit`], to be counted by the caller.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimitCounts([u64; Limit::ALL.len()]);

impl LimitCounts {
    pub fn hit(&mut self, limit: Limit, n: u64) {
        self.0[limit as usize] += n;
    }

    pub fn get(&self, limit: Limit) -> u64 {
        self.0[limit as usize]
    }

    pub fn add(&mut self, o: &LimitCounts) {
        for (a, b) in self.0.iter_mut().zip(o.0) {
            *a += b;
        }
    }

    /// Each limit hit, with its count.
    pub fn iter(&self) -> impl Iterator<Item = (Limit, u64)> + '_ {
        Limit::ALL
            .into_iter()
            .map(|l| (l, self.get(l)))
            .filter(|&(_, n)| n > 0)
    }
}

/// See [`Hub::feed_handover`](super::Hub::feed_handover).
#[derive(Debug)]
pub enum HandoverReply {
    /// A [`Page::HANDOVER`](kvroute::feed::Page::HANDOVER) page: the reader goes on from this replica's log.
    Taken(bytes::Bytes),
    /// Nothing new yet: the reader keeps its position and asks again.
    Wait(bytes::Bytes),
}
