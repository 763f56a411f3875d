//! The collector's state and every change to it: the worker table (registrations, interning to
//! [`WorkerId`]), block sizes, aliases, the [`Index`], the SGLang re-chunkers and the feed log.
//!
//! One [`Hub`] sits behind one `std::sync::RwLock` (see `lib.rs`). Every method is synchronous
//! and quick, so the lock is never held across an `.await`. Each worker's batches come from its
//! one subscriber task, in sequence order, so events of one engine are applied in order; the
//! lock serializes the engines between them.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};

use kvroute::event::{KvEvent, WorkerId};
use kvroute::feed::Op;
use kvroute::hash;
use kvroute::index::{Change, Index, IndexConfig, IndexDump};
use kvroute::scope::{BlockKey, BlockSizes, ModelKey, Scope, DEFAULT_TENANT};
use serde::{Deserialize, Serialize};

use crate::chunk::{ChunkStats, Chunker};
use crate::decode::Batch;
use crate::feedlog::{FeedLog, Reply};
use crate::metrics::{EventLabels, Metrics, WorkerLabels};
use kvroute::api::{InstanceMatch, QueryResponse, RegisterRequest, UnregisterRequest};

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

/// Live status of a worker, as `/workers` shows it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct WorkerStatus {
    pub connected: bool,
    pub last_seq: Option<u64>,
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

    fn labels(&self) -> WorkerLabels {
        WorkerLabels::new(&self.reg.instance_id, self.dp_rank())
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

/// The persisted state (`--state-dir`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StateFile {
    pub version: u32,
    pub workers: Vec<SavedWorker>,
    pub aliases: Vec<SavedAlias>,
    pub index: IndexDump,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SavedWorker {
    pub id: u32,
    pub reg: RegisterRequest,
    pub source: Option<u32>,
    pub last_seq: Option<u64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SavedAlias {
    pub tenant: String,
    pub served: String,
    pub model: String,
    pub lora: Option<String>,
}

/// Hub settings (from [`crate::config::Config`]).
#[derive(Clone, Copy, Debug)]
pub struct HubConfig {
    pub max_blocks_per_worker: usize,
    pub max_pages_per_worker: usize,
    pub default_serving_port: Option<u16>,
    pub max_query_tokens: usize,
    pub feed_log_entries: usize,
    pub max_feed_bytes: usize,
}

#[derive(Debug)]
pub struct Hub {
    config: HubConfig,
    pub index: Index,
    workers: Vec<Option<WorkerInfo>>,
    by_name: HashMap<(String, u32), WorkerId>,
    sizes: BlockSizes,
    /// Workers per (tenant, model): a model's block size is forgotten with its last worker.
    model_workers: HashMap<ModelKey, usize>,
    /// (tenant, served name) → (model, LoRA).
    aliases: BTreeMap<(String, String), (String, Option<String>)>,
    chunkers: HashMap<WorkerId, Chunker>,
    pub feed: FeedLog,
    changes: Vec<Change>,
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
            chunkers: HashMap::new(),
            feed: FeedLog::new(epoch, config.feed_log_entries, config.max_feed_bytes),
            changes: Vec::new(),
        }
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

    /// Validates and normalizes a registration: names, endpoint, serving address.
    ///
    /// # Errors
    /// [`HubError::BadRequest`] naming the field.
    pub fn normalize(&self, mut req: RegisterRequest) -> Result<RegisterRequest, HubError> {
        let bad = |m: String| HubError::BadRequest(m);
        check_name("instance_id", &req.instance_id, false)?;
        check_name("model_name", &req.model_name, false)?;
        if let Some(t) = &req.tenant_id {
            check_name("tenant_id", t, true)?;
        }
        for (field, v) in [
            ("lora_name", &req.lora_name),
            ("cache_salt", &req.cache_salt),
        ] {
            if let Some(v) = v {
                check_name(field, v, true)?;
            }
        }
        if req.block_size == 0 {
            return Err(bad("block_size must be at least 1".into()));
        }
        let host = endpoint_host(&req.endpoint)
            .map_err(|m| bad(format!("endpoint {:?}: {m}", req.endpoint)))?;
        if let Some(r) = &req.replay_endpoint {
            endpoint_host(r).map_err(|m| bad(format!("replay_endpoint {r:?}: {m}")))?;
        }
        let address = match &req.address {
            Some(a) => a
                .parse::<SocketAddr>()
                .map_err(|_| bad(format!("address {a:?} is not an ip:port literal (Envoy's override_host needs an IP)")))?,
            None => match (host.parse::<IpAddr>(), self.config.default_serving_port) {
                (Ok(ip), Some(port)) if !ip.is_unspecified() => SocketAddr::new(ip, port),
                _ => req.instance_id.parse::<SocketAddr>().map_err(|_| {
                    bad("no serving address: give \"address\" as ip:port, or an endpoint with an IP and \
                         --default-serving-port, or an instance_id that is ip:port"
                        .into())
                })?,
            },
        };
        req.address = Some(address.to_string());
        req.tenant_id = Some(
            req.tenant_id
                .filter(|t| !t.is_empty())
                .unwrap_or_else(|| DEFAULT_TENANT.to_owned()),
        );
        req.dp_rank = Some(req.dp_rank.unwrap_or(0));
        req.lora_name = req.lora_name.filter(|s| !s.is_empty());
        req.cache_salt = req.cache_salt.filter(|s| !s.is_empty());
        Ok(req)
    }

    /// Registers a worker.
    ///
    /// # Errors
    /// Bad input (400), the same worker registered differently or another block size for the
    /// model (409).
    pub fn register(&mut self, req: RegisterRequest) -> Result<Registered, HubError> {
        let req = self.normalize(req)?;
        let dp = req.dp_rank.unwrap_or(0);
        if let Some(&id) = self.by_name.get(&(req.instance_id.clone(), dp)) {
            let existing = self.worker(id).expect("interned worker exists");
            if existing.source.is_none() && existing.reg == req {
                return Ok(Registered::Same(id));
            }
            if existing.source.is_some() && same_but_dp(&existing.reg, &req) {
                // A worker first seen through a batch's dp rank, now registered itself.
                let w = self.worker_mut(id).expect("exists");
                w.source = None;
                w.reg = req;
                return Ok(Registered::New(id));
            }
            return Err(HubError::Conflict(format!(
                "worker {:?} dp_rank {dp} is already registered with other settings",
                req.instance_id
            )));
        }
        let model = ModelKey::new(req.tenant_id.as_deref().unwrap_or(""), &req.model_name);
        let first_of_model = self.sizes.get(&model).is_none();
        self.sizes
            .register(&model, req.block_size)
            .map_err(|e| HubError::Conflict(e.to_string()))?;
        let id = self.insert_worker(req, None).inspect_err(|_| {
            if first_of_model {
                self.sizes.remove(&model);
            }
        })?;
        Ok(Registered::New(id))
    }

    fn insert_worker(
        &mut self,
        req: RegisterRequest,
        source: Option<WorkerId>,
    ) -> Result<WorkerId, HubError> {
        let slot = match self.workers.iter().position(Option::is_none) {
            Some(s) => s,
            None if self.workers.len() < MAX_WORKERS => {
                self.workers.push(None);
                self.workers.len() - 1
            }
            None => return Err(HubError::Conflict(format!("at most {MAX_WORKERS} workers"))),
        };
        let id = WorkerId(slot as u32);
        let tenant = req
            .tenant_id
            .clone()
            .unwrap_or_else(|| DEFAULT_TENANT.to_owned());
        let model = ModelKey::new(&tenant, &req.model_name);
        let count = self.model_workers.entry(model.clone()).or_insert(0);
        *count += 1;
        if *count == 1 {
            self.feed.push_op(Op::BlockSize {
                tenant: tenant.clone(),
                model: req.model_name.clone(),
                block_size: req.block_size,
            });
        }
        self.index
            .add_worker(id, &tenant, &req.model_name, req.block_size);
        if let Some(lora) = req.lora_name.clone() {
            self.add_alias(&tenant, &lora, &req.model_name, Some(&lora));
        }
        self.by_name
            .insert((req.instance_id.clone(), req.dp_rank.unwrap_or(0)), id);
        let info = WorkerInfo {
            id,
            reg: req,
            source,
            status: WorkerStatus::default(),
        };
        self.feed.push_op(worker_op(&info));
        self.workers[slot] = Some(info);
        Ok(id)
    }

    fn add_alias(&mut self, tenant: &str, served: &str, model: &str, lora: Option<&str>) {
        let key = (tenant.to_owned(), served.to_owned());
        let value = (model.to_owned(), lora.map(str::to_owned));
        if self.aliases.get(&key) != Some(&value) {
            self.aliases.insert(key, value);
            self.feed.push_op(Op::Alias {
                tenant: tenant.to_owned(),
                served: served.to_owned(),
                model: model.to_owned(),
                lora: lora.map(str::to_owned),
            });
        }
    }

    /// Unregisters the matching workers (all dp ranks when none is named) and the workers
    /// derived from their publishers. Returns the removed registered workers (their
    /// subscribers must stop).
    ///
    /// # Errors
    /// [`HubError::NotFound`] when nothing matches.
    pub fn unregister(&mut self, req: &UnregisterRequest) -> Result<Vec<WorkerId>, HubError> {
        let tenant = req
            .tenant_id
            .as_deref()
            .filter(|t| !t.is_empty())
            .unwrap_or(DEFAULT_TENANT);
        let targets: Vec<WorkerId> = self
            .workers()
            .filter(|w| {
                w.source.is_none()
                    && w.reg.instance_id == req.instance_id
                    && w.reg.model_name == req.model_name
                    && w.tenant() == tenant
                    && req.dp_rank.is_none_or(|d| d == w.dp_rank())
            })
            .map(|w| w.id)
            .collect();
        if targets.is_empty() {
            return Err(HubError::NotFound(format!(
                "no worker {:?} of model {:?} (tenant {tenant:?}){}",
                req.instance_id,
                req.model_name,
                req.dp_rank
                    .map(|d| format!(" with dp_rank {d}"))
                    .unwrap_or_default()
            )));
        }
        for &id in &targets {
            let derived: Vec<WorkerId> = self
                .workers()
                .filter(|w| w.source == Some(id))
                .map(|w| w.id)
                .collect();
            for d in derived {
                self.remove_worker(d);
            }
            self.remove_worker(id);
        }
        Ok(targets)
    }

    fn remove_worker(&mut self, id: WorkerId) {
        let Some(info) = self.workers.get_mut(id.0 as usize).and_then(Option::take) else {
            return;
        };
        self.changes.clear();
        self.index.remove_worker(id, &mut self.changes);
        for c in self.changes.drain(..) {
            self.feed.push_change(c);
        }
        self.chunkers.remove(&id);
        self.feed.push_op(Op::WorkerGone { id });
        self.by_name
            .remove(&(info.reg.instance_id.clone(), info.dp_rank()));
        let model = ModelKey::new(info.tenant(), &info.reg.model_name);
        if let Some(n) = self.model_workers.get_mut(&model) {
            *n -= 1;
            if *n == 0 {
                self.model_workers.remove(&model);
                self.sizes.remove(&model);
                self.aliases
                    .retain(|(t, _), (m, _)| !(t == &model.tenant && m == &model.model));
            }
        }
    }

    /// The worker a batch from `source`'s publisher belongs to: the batch's dp rank overrides
    /// the registered one, naming (and creating, from the source's registration) a sibling.
    pub fn resolve(&mut self, source: WorkerId, dp_rank: Option<u32>) -> Option<WorkerId> {
        let info = self.worker(source)?;
        let dp = match dp_rank {
            Some(d) if d != info.dp_rank() => d,
            _ => return Some(source),
        };
        if let Some(&id) = self.by_name.get(&(info.reg.instance_id.clone(), dp)) {
            return Some(id);
        }
        let mut reg = info.reg.clone();
        reg.dp_rank = Some(dp);
        self.insert_worker(reg, Some(source)).ok()
    }

    /// Workers fed by `source`'s publisher: itself and those named by its batches' dp ranks.
    fn family(&self, source: WorkerId) -> Vec<WorkerId> {
        self.workers()
            .filter(|w| w.id == source || w.source == Some(source))
            .map(|w| w.id)
            .collect()
    }

    /// Drops every block of `source`'s publisher (engine restart, or disconnected too long).
    pub fn clear_blocks(&mut self, source: WorkerId) -> u64 {
        let mut n = 0;
        for id in self.family(source) {
            self.changes.clear();
            n += self.index.clear_worker(id, &mut self.changes);
            for c in self.changes.drain(..) {
                self.feed.push_change(c);
            }
            if let Some(c) = self.chunkers.get_mut(&id) {
                c.clear();
            }
        }
        n
    }

    /// Records the publisher's liveness and tells the feed.
    pub fn set_connected(&mut self, source: WorkerId, connected: bool) {
        for id in self.family(source) {
            let Some(w) = self.worker_mut(id) else {
                continue;
            };
            if w.status.connected != connected {
                w.status.connected = connected;
                let op = worker_op(w);
                self.feed.push_op(op);
            }
        }
    }

    /// Applies one decoded batch from `source`'s publisher, sequence number `seq`.
    pub fn apply_batch(&mut self, source: WorkerId, seq: u64, batch: Batch, metrics: &Metrics) {
        let Some(worker) = self.resolve(source, batch.dp_rank) else {
            return;
        };
        let Some(info) = self.worker(worker) else {
            return;
        };
        let labels = info.labels();
        let block_size = info.reg.block_size;
        let salt = info.reg.cache_salt.clone();
        let tenant = info.tenant().to_owned();
        let model = info.reg.model_name.clone();
        metrics.skip("other_kv_group", batch.stats.skipped_other_group as u64);
        metrics.skip("unknown_event_type", batch.stats.skipped_unknown as u64);
        metrics.skip("lora_id_only", batch.stats.lora_id_only as u64);
        let mut counts = [0u64; 3];
        let mut total = kvroute::index::ApplyStats::default();
        let mut chunk_stats = ChunkStats::default();
        for mut event in batch.events {
            let ty = match &event {
                KvEvent::BlockStored { .. } => 0,
                KvEvent::BlockRemoved { .. } => 1,
                KvEvent::AllBlocksCleared => 2,
            };
            counts[ty] += 1;
            if let KvEvent::BlockStored {
                parent,
                lora_name,
                cache_salt,
                ..
            } = &mut event
            {
                if parent.is_none() && cache_salt.is_none() {
                    cache_salt.clone_from(&salt);
                }
                if let Some(lora) = lora_name.as_deref() {
                    if !self
                        .aliases
                        .contains_key(&(tenant.clone(), lora.to_owned()))
                    {
                        let lora = lora.to_owned();
                        self.add_alias(&tenant, &lora, &model, Some(&lora));
                    }
                }
            }
            let chunker = self.chunkers.get(&worker);
            let wants = match chunker {
                Some(c) => c.wants(block_size, &event),
                None => matches!(&event, KvEvent::BlockStored { blocks, .. }
                    if blocks.iter().any(|b| b.tokens.len() != block_size as usize)),
            };
            let event = if wants {
                let max_pages = self.config.max_pages_per_worker;
                let c = self
                    .chunkers
                    .entry(worker)
                    .or_insert_with(|| Chunker::new(block_size, max_pages));
                match c.apply(event, &mut chunk_stats) {
                    Some(e) => e,
                    None => continue,
                }
            } else {
                event
            };
            self.changes.clear();
            let stats = self.index.apply(worker, &event, &mut self.changes);
            total.add(&stats);
            for c in self.changes.drain(..) {
                self.feed.push_change(c);
            }
        }
        for (i, ty) in ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
            .into_iter()
            .enumerate()
        {
            if counts[i] > 0 {
                metrics
                    .events
                    .get_or_create(&EventLabels {
                        instance: labels.instance.clone(),
                        dp: labels.dp.clone(),
                        r#type: ty,
                    })
                    .inc_by(counts[i]);
            }
        }
        if total.orphans > 0 {
            metrics.orphans.get_or_create(&labels).inc_by(total.orphans);
        }
        metrics.skip("capped", total.capped + chunk_stats.capped);
        metrics.skip("bad_block_size", total.bad_blocks);
        metrics.skip("unknown_removal", total.unknown_removals);
        let ids = if worker == source {
            &[worker][..]
        } else {
            &[worker, source][..]
        };
        for &id in ids {
            if let Some(w) = self.worker_mut(id) {
                if id == source {
                    w.status.last_seq = Some(seq);
                    w.status.batches += 1;
                }
                if id == worker {
                    w.status.events += counts.iter().sum::<u64>();
                    w.status.orphans += total.orphans;
                }
            }
        }
    }

    /// Resolves a request's model name (a served LoRA name resolves through the aliases) to
    /// its scope and block size.
    ///
    /// # Errors
    /// [`HubError::NotFound`] for a model no worker serves.
    pub fn scope_for(
        &self,
        model_name: &str,
        tenant: Option<&str>,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Result<(Scope, u32), HubError> {
        let tenant = tenant.filter(|t| !t.is_empty()).unwrap_or(DEFAULT_TENANT);
        let key = ModelKey::new(tenant, model_name);
        if let Some(bs) = self.sizes.get(&key) {
            return Ok((Scope::new(tenant, model_name, lora_name, cache_salt), bs));
        }
        if let Some((model, lora)) = self
            .aliases
            .get(&(tenant.to_owned(), model_name.to_owned()))
        {
            if let Some(bs) = self.sizes.get(&ModelKey::new(tenant, model)) {
                let lora = lora_name.filter(|l| !l.is_empty()).or(lora.as_deref());
                return Ok((Scope::new(tenant, model, lora, cache_salt), bs));
            }
        }
        Err(HubError::NotFound(format!(
            "unknown model {model_name:?} for tenant {tenant:?}"
        )))
    }

    /// `/query`: every instance's longest prefix match of `tokens`.
    ///
    /// # Errors
    /// Unknown model, too many tokens.
    pub fn query_tokens(
        &self,
        tokens: &[u32],
        model_name: &str,
        tenant: Option<&str>,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Result<QueryResponse, HubError> {
        self.check_len("token_ids", tokens.len())?;
        let (scope, bs) = self.scope_for(model_name, tenant, lora_name, cache_salt)?;
        let seqs = hash::sequence_hashes(tokens, bs as usize, scope.seed())
            .map_err(|e| HubError::BadRequest(e.to_string()))?;
        let id = scope.id();
        let keys: Vec<BlockKey> = seqs.into_iter().map(|s| id.key(s)).collect();
        Ok(self.answer(&keys, bs))
    }

    /// `/query_by_hash`: local block hashes (chained here) or sequence hashes.
    ///
    /// # Errors
    /// Unknown model, too many hashes, neither or both lists given.
    pub fn query_hashes(
        &self,
        block_hashes: Option<&[u64]>,
        seq_hashes: Option<&[u64]>,
        model_name: &str,
        tenant: Option<&str>,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Result<QueryResponse, HubError> {
        let seqs: Vec<hash::SeqHash> = match (block_hashes, seq_hashes) {
            (Some(b), None) => {
                self.check_len("block_hashes", b.len())?;
                let blocks: Vec<hash::BlockHash> = b.iter().map(|&h| hash::BlockHash(h)).collect();
                hash::sequence_hashes_of_blocks(&blocks)
            }
            (None, Some(s)) => {
                self.check_len("seq_hashes", s.len())?;
                s.iter().map(|&h| hash::SeqHash(h)).collect()
            }
            _ => {
                return Err(HubError::BadRequest(
                    "give exactly one of block_hashes and seq_hashes".into(),
                ))
            }
        };
        let (scope, bs) = self.scope_for(model_name, tenant, lora_name, cache_salt)?;
        let id = scope.id();
        let keys: Vec<BlockKey> = seqs.into_iter().map(|s| id.key(s)).collect();
        Ok(self.answer(&keys, bs))
    }

    fn check_len(&self, field: &str, n: usize) -> Result<(), HubError> {
        if n > self.config.max_query_tokens {
            return Err(HubError::TooLarge(format!(
                "{field} has {n} entries, more than the limit of {}",
                self.config.max_query_tokens
            )));
        }
        Ok(())
    }

    fn answer(&self, keys: &[BlockKey], bs: u32) -> QueryResponse {
        let mut instances: BTreeMap<String, InstanceMatch> = BTreeMap::new();
        let bs64 = bs as u64;
        for m in self.index.lookup(keys) {
            let Some(w) = self.worker(m.worker) else {
                continue;
            };
            let e = instances
                .entry(w.reg.instance_id.clone())
                .or_insert_with(|| InstanceMatch {
                    address: w.address().to_owned(),
                    ..InstanceMatch::default()
                });
            let [gpu, cpu, disk] = m.blocks.map(|b| b as u64 * bs64);
            e.gpu = e.gpu.max(gpu);
            e.cpu = e.cpu.max(cpu);
            e.disk = e.disk.max(disk);
            let longest = m.longest() as u64 * bs64;
            e.longest_matched = e.longest_matched.max(longest);
            let d = e.dp.entry(w.dp_rank().to_string()).or_insert(0);
            *d = (*d).max(longest);
        }
        QueryResponse {
            block_size: bs,
            query_blocks: keys.len() as u32,
            instances,
        }
    }

    /// `/workers`.
    pub fn worker_views(&self) -> Vec<WorkerView> {
        self.workers()
            .map(|w| WorkerView {
                worker_id: w.id.0,
                instance_id: w.reg.instance_id.clone(),
                dp_rank: w.dp_rank(),
                tenant_id: w.tenant().to_owned(),
                model_name: w.reg.model_name.clone(),
                block_size: w.reg.block_size,
                endpoint: w.reg.endpoint.clone(),
                replay_endpoint: w.reg.replay_endpoint.clone(),
                address: w.address().to_owned(),
                lora_name: w.reg.lora_name.clone(),
                registered: w.source.is_none(),
                blocks: self.index.worker_blocks(w.id) as u64,
                status: w.status.clone(),
            })
            .collect()
    }

    /// Answers a feed request when the reply is ready, or `None` when a snapshot must first be
    /// built with [`Hub::build_snapshot`] (which needs the write lock).
    pub fn feed_reply(&self, epoch: Option<u64>, since: Option<u64>) -> Option<bytes::Bytes> {
        match self.feed.reply(epoch, since) {
            Reply::Page(b) => Some(b),
            Reply::NeedSnapshot => None,
        }
    }

    /// Builds the feed's full snapshot from the current state.
    pub fn build_snapshot(&mut self) {
        let mut table: Vec<Op> = self.workers().map(worker_op).collect();
        for (model, bs) in self.sizes.iter() {
            table.push(Op::BlockSize {
                tenant: model.tenant.clone(),
                model: model.model.clone(),
                block_size: bs,
            });
        }
        for ((tenant, served), (model, lora)) in &self.aliases {
            table.push(Op::Alias {
                tenant: tenant.clone(),
                served: served.clone(),
                model: model.clone(),
                lora: lora.clone(),
            });
        }
        let index = &self.index;
        self.feed.build_snapshot(table, |f| index.for_each_hold(f));
    }

    /// Updates the size gauges.
    pub fn update_gauges(&self, metrics: &Metrics) {
        let s = self.index.stats();
        metrics.blocks.set(s.blocks as i64);
        metrics.holders.set(s.holds as i64);
        metrics.workers.set(self.workers().count() as i64);
        metrics
            .connected
            .set(self.workers().filter(|w| w.status.connected).count() as i64);
        metrics.feed_log_entries.set(self.feed.len() as i64);
    }

    /// The state to persist.
    pub fn export(&self) -> StateFile {
        StateFile {
            version: 1,
            workers: self
                .workers()
                .map(|w| SavedWorker {
                    id: w.id.0,
                    reg: w.reg.clone(),
                    source: w.source.map(|s| s.0),
                    last_seq: w.status.last_seq,
                })
                .collect(),
            aliases: self
                .aliases
                .iter()
                .map(|((tenant, served), (model, lora))| SavedAlias {
                    tenant: tenant.clone(),
                    served: served.clone(),
                    model: model.clone(),
                    lora: lora.clone(),
                })
                .collect(),
            index: self.index.export(),
        }
    }

    /// Loads a persisted state into this (empty) hub. Returns the registered workers with the
    /// sequence number to replay from.
    ///
    /// # Errors
    /// A state that contradicts itself (two workers in one slot, a bad registration).
    pub fn import(&mut self, state: StateFile) -> Result<Vec<(WorkerId, Option<u64>)>, HubError> {
        if state.version != 1 {
            return Err(HubError::BadRequest(format!(
                "state version {} is not 1",
                state.version
            )));
        }
        let mut out = Vec::new();
        let mut saved = state.workers;
        saved.sort_by_key(|w| w.id);
        for w in saved {
            let id = w.id as usize;
            if id >= MAX_WORKERS {
                return Err(HubError::BadRequest(format!("worker id {id} out of range")));
            }
            if self.workers.len() <= id {
                self.workers.resize(id + 1, None);
            }
            if self.workers[id].is_some() {
                return Err(HubError::BadRequest(format!("worker id {id} saved twice")));
            }
            let reg = self.normalize(w.reg)?;
            let model = ModelKey::new(reg.tenant_id.as_deref().unwrap_or(""), &reg.model_name);
            self.sizes
                .register(&model, reg.block_size)
                .map_err(|e| HubError::BadRequest(e.to_string()))?;
            *self.model_workers.entry(model).or_insert(0) += 1;
            self.by_name.insert(
                (reg.instance_id.clone(), reg.dp_rank.unwrap_or(0)),
                WorkerId(w.id),
            );
            let status = WorkerStatus {
                last_seq: w.last_seq,
                ..WorkerStatus::default()
            };
            self.workers[id] = Some(WorkerInfo {
                id: WorkerId(w.id),
                reg,
                source: w.source.map(WorkerId),
                status,
            });
            if w.source.is_none() {
                out.push((WorkerId(w.id), w.last_seq));
            }
        }
        for a in state.aliases {
            self.aliases.insert((a.tenant, a.served), (a.model, a.lora));
        }
        self.index = Index::import(self.index.config(), &state.index);
        // Workers the dump lacks (none had blocks) still need their scope in the index.
        for w in self.workers.iter().flatten() {
            if !self.index.has_worker(w.id) {
                self.index
                    .add_worker(w.id, w.tenant(), &w.reg.model_name, w.reg.block_size);
            }
        }
        Ok(out)
    }
}

fn worker_op(w: &WorkerInfo) -> Op {
    Op::Worker {
        id: w.id,
        live: w.status.connected,
        dp_rank: w.dp_rank(),
        instance_id: w.reg.instance_id.clone(),
        address: w.address().to_owned(),
        tenant: w.tenant().to_owned(),
        model: w.reg.model_name.clone(),
    }
}

fn same_but_dp(a: &RegisterRequest, b: &RegisterRequest) -> bool {
    a.instance_id == b.instance_id
        && a.model_name == b.model_name
        && a.tenant_id == b.tenant_id
        && a.block_size == b.block_size
        && a.address == b.address
}

fn check_name(field: &str, v: &str, may_be_empty: bool) -> Result<(), HubError> {
    if !may_be_empty && v.trim().is_empty() {
        return Err(HubError::BadRequest(format!("{field} must not be empty")));
    }
    if v.len() > MAX_NAME_BYTES {
        return Err(HubError::BadRequest(format!(
            "{field} is longer than {MAX_NAME_BYTES} bytes"
        )));
    }
    Ok(())
}

/// The host of a `tcp://host:port` endpoint the collector can connect to.
fn endpoint_host(endpoint: &str) -> Result<&str, String> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or("must be tcp://host:port")?;
    let (host, port) = rest.rsplit_once(':').ok_or("must be tcp://host:port")?;
    port.parse::<u16>()
        .map_err(|_| format!("port {port:?} is not a number"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() || host == "*" {
        return Err(
            "must name a host to connect to (the collector connects; the engine binds)".into(),
        );
    }
    Ok(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hub(port: Option<u16>) -> Hub {
        Hub::new(
            HubConfig {
                max_blocks_per_worker: 1000,
                max_pages_per_worker: 1000,
                default_serving_port: port,
                max_query_tokens: 1000,
                feed_log_entries: 1000,
                max_feed_bytes: 1 << 20,
            },
            1,
        )
    }

    fn reg(instance: &str, endpoint: &str) -> RegisterRequest {
        RegisterRequest {
            instance_id: instance.into(),
            endpoint: endpoint.into(),
            replay_endpoint: None,
            model_name: "m".into(),
            tenant_id: None,
            block_size: 4,
            dp_rank: None,
            lora_name: None,
            cache_salt: None,
            address: None,
        }
    }

    #[test]
    fn serving_address_derivation_rules() {
        let h = hub(Some(8000));
        assert_eq!(
            h.normalize(reg("a", "tcp://10.0.0.5:5557"))
                .unwrap()
                .address
                .as_deref(),
            Some("10.0.0.5:8000")
        );
        let h = hub(None);
        assert_eq!(
            h.normalize(reg("10.0.0.7:9000", "tcp://engine:5557"))
                .unwrap()
                .address
                .as_deref(),
            Some("10.0.0.7:9000")
        );
        assert!(matches!(
            h.normalize(reg("a", "tcp://10.0.0.5:5557")),
            Err(HubError::BadRequest(_))
        ));
        let h = hub(Some(8000));
        assert!(
            h.normalize(reg("a", "tcp://engine.local:5557")).is_err(),
            "a host name gives no IP"
        );
        let mut r = reg("a", "tcp://engine:5557");
        r.address = Some("engine:8000".into());
        assert!(h.normalize(r).is_err(), "address must be an IP literal");
        assert!(
            h.normalize(reg("1.2.3.4:5", "tcp://*:5557")).is_err(),
            "cannot connect to *"
        );
    }

    #[test]
    fn batch_dp_rank_names_a_sibling_worker() {
        let mut h = hub(Some(8000));
        let Registered::New(a) = h.register(reg("a", "tcp://10.0.0.5:5557")).unwrap() else {
            panic!()
        };
        let b = h.resolve(a, Some(2)).unwrap();
        assert_ne!(a, b);
        assert_eq!(h.worker(b).unwrap().dp_rank(), 2);
        assert_eq!(h.resolve(a, Some(2)), Some(b));
        assert_eq!(h.resolve(a, None), Some(a));
        let removed = h
            .unregister(&UnregisterRequest {
                instance_id: "a".into(),
                model_name: "m".into(),
                tenant_id: None,
                dp_rank: None,
            })
            .unwrap();
        assert_eq!(removed, vec![a]);
        assert_eq!(h.workers().count(), 0);
    }
}
