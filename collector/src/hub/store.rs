//! The [`Hub`] itself: the tables every job of the hub shares, and their accessors.
//!
//! One [`Hub`] sits behind one `std::sync::RwLock` (see `lib.rs`). Every method is synchronous
//! and bounded: a big engine batch is applied in slices (`ingest.rs`), so the lock is never
//! held across an `.await` nor for long. Each worker's batches come from its one subscriber
//! task, in sequence order, so events of one engine are applied in order; the lock serializes
//! the engines between them.

use std::collections::{BTreeMap, HashMap};

use kvroute::event::WorkerId;
use kvroute::feed::Op;
use kvroute::index::{Change, Index, IndexConfig};
use kvroute::scope::{BlockSizes, ModelKey};

use super::types::{HubConfig, WorkerInfo};
use crate::chunk::Chunker;
use crate::feedlog::FeedLog;

/// What a served name resolves to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Alias {
    pub model: String,
    pub lora: Option<String>,
    /// The registration whose events taught it (it goes with that registration), or `None`
    /// for a registration's own `lora_name` (it goes with the model's last worker).
    pub owner: Option<WorkerId>,
}

#[derive(Debug)]
pub struct Hub {
    pub(crate) config: HubConfig,
    pub index: Index,
    pub(crate) workers: Vec<Option<WorkerInfo>>,
    pub(crate) by_name: HashMap<(String, u32), WorkerId>,
    pub(crate) sizes: BlockSizes,
    /// Workers per (tenant, model): a model's block size is forgotten with its last worker.
    pub(crate) model_workers: HashMap<ModelKey, usize>,
    /// (tenant, served name) → what it resolves to.
    pub(crate) aliases: BTreeMap<(String, String), Alias>,
    /// Aliases learned from each registration's events.
    pub(crate) learned: HashMap<WorkerId, usize>,
    /// Workers named by batches' dp ranks, in all.
    pub(crate) derived: usize,
    pub(crate) chunkers: HashMap<WorkerId, Chunker>,
    pub feed: FeedLog,
    pub(crate) changes: Vec<Change>,
    pub(crate) next_generation: u64,
}

impl Hub {
    pub fn new(config: HubConfig, epoch: u64) -> Hub {
        Hub {
            config,
            index: Index::new(IndexConfig {
                max_blocks_per_worker: config.max_blocks_per_worker,
            }),
            workers: Vec::new(),
            by_name: HashMap::new(),
            sizes: BlockSizes::default(),
            model_workers: HashMap::new(),
            aliases: BTreeMap::new(),
            learned: HashMap::new(),
            derived: 0,
            chunkers: HashMap::new(),
            feed: FeedLog::new(epoch, config.feed_log_entries, config.max_feed_bytes),
            changes: Vec::new(),
            next_generation: 1,
        }
    }

    pub fn config(&self) -> &HubConfig {
        &self.config
    }

    pub fn worker(&self, id: WorkerId) -> Option<&WorkerInfo> {
        self.workers.get(id.0 as usize).and_then(Option::as_ref)
    }

    pub fn worker_mut(&mut self, id: WorkerId) -> Option<&mut WorkerInfo> {
        self.workers.get_mut(id.0 as usize).and_then(Option::as_mut)
    }

    pub fn workers(&self) -> impl Iterator<Item = &WorkerInfo> {
        self.workers.iter().flatten()
    }

    /// Served names known (registered LoRA names and those learned from events).
    pub fn alias_count(&self) -> usize {
        self.aliases.len()
    }

    /// What `served` resolves to in `tenant`: `(model, lora)`.
    pub fn alias(&self, tenant: &str, served: &str) -> Option<(&str, Option<&str>)> {
        self.aliases
            .get(&(tenant.to_owned(), served.to_owned()))
            .map(|a| (a.model.as_str(), a.lora.as_deref()))
    }

    /// SGLang page records held, in all.
    pub fn pending_pages(&self) -> usize {
        self.chunkers.values().map(Chunker::len).sum()
    }

    /// Workers fed by `source`'s publisher: itself and those named by its batches' dp ranks.
    pub(crate) fn family(&self, source: WorkerId) -> Vec<WorkerId> {
        self.workers()
            .filter(|w| w.id == source || w.source == Some(source))
            .map(|w| w.id)
            .collect()
    }

    /// Moves the index's pending holder changes into the feed log.
    pub(crate) fn flush_changes(&mut self) {
        for c in self.changes.drain(..) {
            self.feed.push_change(c);
        }
    }
}

pub(crate) fn worker_op(w: &WorkerInfo) -> Op {
    Op::Worker {
        id: w.id,
        live: w.status.is_routable(),
        dp_rank: w.dp_rank(),
        instance_id: w.reg.instance_id.clone(),
        address: w.address().to_owned(),
        tenant: w.tenant().to_owned(),
        model: w.reg.model_name.clone(),
    }
}
