//! The hub's query job: `/query`, `/query_by_hash`, `/workers`, the feed's replies and
//! snapshots, and the size gauges.

use std::collections::BTreeMap;

use kvroute::api::{InstanceMatch, QueryResponse};
use kvroute::feed::{Op, Page, StreamMark};
use kvroute::hash;
use kvroute::scope::{BlockKey, ModelKey, Scope, DEFAULT_TENANT};

use super::store::{worker_op, Hub};
use super::types::{HandoverReply, HubError, WorkerView};
use crate::feedlog::{Handover, Reply};
use crate::metrics::Metrics;

impl Hub {
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
        if let Some(a) = self
            .aliases
            .get(&(tenant.to_owned(), model_name.to_owned()))
        {
            if let Some(bs) = self.sizes.get(&ModelKey::new(tenant, &a.model)) {
                let lora = lora_name.filter(|l| !l.is_empty()).or(a.lora.as_deref());
                return Ok((Scope::new(tenant, &a.model, lora, cache_salt), bs));
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
                cache_blocks: self
                    .index
                    .capacity(w.id)
                    .filter(|&c| c > 0)
                    .map(|c| c as u64),
                routable: w.status.is_routable(),
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

    /// The answer to a reader of another replica of this index's stream that has applied it up
    /// to `at` and followed that replica's `epoch` to `since`: a handover page, an empty page
    /// in the reader's own epoch when this replica has not yet reached its position, or `None`
    /// (a snapshot; also for a reader of this replica's own epoch, which needs no handover).
    pub fn feed_handover(
        &self,
        epoch: u64,
        since: u64,
        at: StreamMark,
        now: std::time::Instant,
    ) -> Option<HandoverReply> {
        if epoch == self.feed.epoch() {
            return None;
        }
        Some(match self.feed.handover(at, now)? {
            Handover::From(cursor) => HandoverReply::Taken(bytes::Bytes::from(
                Page {
                    flags: Page::HANDOVER
                        | if cursor < self.feed.head() {
                            Page::MORE
                        } else {
                            0
                        },
                    epoch: self.feed.epoch(),
                    cursor,
                    ops: self.table_ops(),
                }
                .to_bytes(),
            )),
            Handover::Wait => HandoverReply::Wait(bytes::Bytes::from(
                Page {
                    flags: 0,
                    epoch,
                    cursor: since,
                    ops: Vec::new(),
                }
                .to_bytes(),
            )),
        })
    }

    /// The worker table, block sizes and aliases as feed ops: a snapshot's first ops.
    fn table_ops(&self) -> Vec<Op> {
        let mut table: Vec<Op> = self.workers().map(worker_op).collect();
        for (model, bs) in self.sizes.iter() {
            table.push(Op::BlockSize {
                tenant: model.tenant.clone(),
                model: model.model.clone(),
                block_size: bs,
            });
        }
        for ((tenant, served), a) in &self.aliases {
            table.push(Op::Alias {
                tenant: tenant.clone(),
                served: served.clone(),
                model: a.model.clone(),
                lora: a.lora.clone(),
            });
        }
        table
    }

    /// Builds the feed's full snapshot from the current state.
    pub fn build_snapshot(&mut self) {
        let table = self.table_ops();
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
        metrics
            .routable
            .set(self.workers().filter(|w| w.status.is_routable()).count() as i64);
        metrics
            .without_events
            .set(self.workers().filter(|w| !w.status.connected).count() as i64);
        metrics.feed_log_entries.set(self.feed.len() as i64);
        metrics.aliases.set(self.aliases.len() as i64);
        metrics.pending_pages.set(self.pending_pages() as i64);
    }
}
