//! The hub's ingest job: one engine batch into the index, in slices of bounded size.
//!
//! A batch becomes an [`IngestJob`]; [`Hub::ingest`] applies at most
//! [`Limits::slice_blocks`](super::types::Limits) blocks of it per call, so the caller can
//! release the lock between calls and let queries and other engines through. What happened is
//! returned in the job's [`IngestReport`]: the caller counts it (metrics are not the hub's job).
//!
//! What a slice costs a waiting reader was measured with `kvroute-bench ingest-stall` (one
//! 3.5M-block batch): the hash tables' growth (one slice rehashing millions of entries, up to
//! 235 ms), cutting a slice off the front of one huge event (a memmove of the whole rest,
//! ~5 ms a slice) and the blocks themselves (~1 µs each on a busy 2-core machine, so 8 ms for
//! 8,192). Hence: the index makes room before the first slice, big events are cut into
//! [`PIECE_BLOCKS`] pieces when the job is made (outside the lock), and a slice also ends
//! once it has held the lock for [`SLICE_TIME`].

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvroute::event::{KvEvent, WorkerId};
use kvroute::index::ApplyStats;

use super::store::Hub;
use super::types::{Limit, LimitCounts};
use crate::chunk::{ChunkStats, Chunker};
use crate::decode::{Batch, DecodeStats};

/// Most blocks (or hashes) of one event applied in one go: a bigger event is cut into pieces
/// of this size when its job is made, so that a slice can stop between pieces.
pub const PIECE_BLOCKS: usize = 512;

/// Longest a slice keeps applying pieces: it stops at the first piece boundary past this, or
/// at `slice_blocks` blocks, whichever comes first.
pub const SLICE_TIME: Duration = Duration::from_millis(2);

/// Event type names, indexing [`IngestReport::events`].
pub const EVENT_TYPES: [&str; 3] = ["BlockStored", "BlockRemoved", "AllBlocksCleared"];

/// What applying one batch did, for the caller to count.
#[derive(Clone, Debug, Default)]
pub struct IngestReport {
    /// The worker the batch was for (its dp rank's), once resolved; `None` when refused.
    pub worker: Option<WorkerId>,
    /// That worker's instance id and dp rank, for metric labels.
    pub instance: String,
    pub dp_rank: u32,
    /// Events by type, in [`EVENT_TYPES`] order.
    pub events: [u64; 3],
    /// What the decoder left out.
    pub decode: DecodeStats,
    pub apply: ApplyStats,
    pub chunk: ChunkStats,
    pub limits: LimitCounts,
    /// Lock holds it took.
    pub slices: u32,
}

/// One batch being applied. See the module doc.
#[derive(Debug)]
pub struct IngestJob {
    source: WorkerId,
    seq: u64,
    dp_rank: Option<u32>,
    events: VecDeque<KvEvent>,
    /// `(worker, generation)` of the source and of the target once resolved.
    source_gen: Option<u64>,
    target: Option<(WorkerId, u64)>,
    done: bool,
    /// Whether the index has made room for the batch (see `Hub::reserve_for`).
    reserved: bool,
    /// xxh3 of the batch's payload as the engine sent it (ZMQ sources), kept with `seq`.
    payload_hash: Option<u64>,
    pub report: IngestReport,
}

impl IngestJob {
    pub fn new(source: WorkerId, seq: u64, batch: Batch) -> IngestJob {
        let mut report = IngestReport {
            decode: batch.stats,
            ..IngestReport::default()
        };
        for e in &batch.events {
            report.events[event_type(e)] += 1;
        }
        let mut events = VecDeque::with_capacity(batch.events.len());
        for e in batch.events {
            into_pieces(e, PIECE_BLOCKS, &mut events);
        }
        IngestJob {
            source,
            seq,
            dp_rank: batch.dp_rank,
            events,
            source_gen: None,
            target: None,
            done: false,
            reserved: false,
            payload_hash: None,
            report,
        }
    }

    /// Records the hash of the payload the batch was decoded from with its sequence number.
    pub fn with_payload_hash(mut self, hash: u64) -> IngestJob {
        self.payload_hash = Some(hash);
        self
    }

    /// The worker whose publisher sent the batch.
    pub fn source(&self) -> WorkerId {
        self.source
    }

    pub fn is_done(&self) -> bool {
        self.done
    }
}

fn event_type(e: &KvEvent) -> usize {
    match e {
        KvEvent::BlockStored { .. } => 0,
        KvEvent::BlockRemoved { .. } => 1,
        KvEvent::AllBlocksCleared => 2,
    }
}

/// Blocks (or hashes) an event carries: its weight against a slice.
fn weight(e: &KvEvent) -> usize {
    match e {
        KvEvent::BlockStored { blocks, .. } => blocks.len(),
        KvEvent::BlockRemoved { hashes, .. } => hashes.len(),
        KvEvent::AllBlocksCleared => 1,
    }
}

/// Appends `e` to `out` in pieces of at most `piece` blocks (or hashes), each store chained
/// below the previous piece's last block, so applying them in order equals applying `e`.
/// Linear in the event's size, where cutting pieces off its front one by one is quadratic.
fn into_pieces(e: KvEvent, piece: usize, out: &mut VecDeque<KvEvent>) {
    if weight(&e) <= piece {
        out.push_back(e);
        return;
    }
    match e {
        KvEvent::BlockStored {
            mut parent,
            blocks,
            tier,
            lora_name,
            cache_salt,
        } => {
            let mut rest = blocks.into_iter();
            loop {
                let head: Vec<_> = rest.by_ref().take(piece).collect();
                let Some(last) = head.last().map(|b| b.hash) else {
                    break;
                };
                out.push_back(KvEvent::BlockStored {
                    parent: parent.replace(last),
                    blocks: head,
                    tier,
                    lora_name: lora_name.clone(),
                    cache_salt: cache_salt.clone(),
                });
            }
        }
        KvEvent::BlockRemoved { hashes, tier } => {
            for h in hashes.chunks(piece) {
                out.push_back(KvEvent::BlockRemoved {
                    hashes: h.to_vec(),
                    tier,
                });
            }
        }
        KvEvent::AllBlocksCleared => out.push_back(KvEvent::AllBlocksCleared),
    }
}

/// Cuts the first `n` blocks (or hashes) off `e` as an event of their own; the rest stays in
/// `e`, chained below the last block cut, so applying both in order equals applying `e`.
fn split_front(e: &mut KvEvent, n: usize) -> KvEvent {
    match e {
        KvEvent::BlockStored {
            parent,
            blocks,
            tier,
            lora_name,
            cache_salt,
        } => {
            let head: Vec<_> = blocks.drain(..n).collect();
            let head_parent = std::mem::replace(parent, head.last().map(|b| b.hash));
            KvEvent::BlockStored {
                parent: head_parent,
                blocks: head,
                tier: *tier,
                lora_name: lora_name.clone(),
                cache_salt: cache_salt.clone(),
            }
        }
        KvEvent::BlockRemoved { hashes, tier } => KvEvent::BlockRemoved {
            hashes: hashes.drain(..n).collect(),
            tier: *tier,
        },
        KvEvent::AllBlocksCleared => KvEvent::AllBlocksCleared,
    }
}

impl Hub {
    /// Applies a whole batch at once, for an owner of the hub that holds no shared lock
    /// (tests, benchmarks); the collector goes through [`Hub::ingest`] slice by slice.
    pub fn apply_batch(&mut self, source: WorkerId, seq: u64, batch: Batch) -> IngestReport {
        let mut job = IngestJob::new(source, seq, batch);
        while !self.ingest(&mut job) {}
        job.report
    }

    /// Applies the next slice of `job` (at most `slice_blocks` blocks). Returns whether the job
    /// is done; call again (after releasing the lock, ideally) until it is. A job whose
    /// worker went away between slices ends there.
    pub fn ingest(&mut self, job: &mut IngestJob) -> bool {
        if job.done {
            return true;
        }
        job.report.slices += 1;
        let Some((worker, tenant, model, block_size)) = self.start_slice(job) else {
            job.done = true;
            job.events.clear();
            return true;
        };
        let max = self.config.limits.slice_blocks.max(1);
        let budget = self.config.max_blocks_per_worker;
        if !job.reserved {
            job.reserved = true;
            self.reserve_for(job, worker, max, budget);
        }
        // Blocks the registration's other dp ranks hold: they share one budget with `worker`.
        let family = self.family(job.source);
        let siblings = family.len() > 1;
        let others: usize = family
            .iter()
            .filter(|&&id| id != worker)
            .map(|&id| self.index.worker_blocks(id))
            .sum();
        let mut pages = self.pending_pages();
        let mut used = 0;
        let started = Instant::now();
        while let Some(mut event) = job.events.pop_front() {
            let w = weight(&event);
            let room = max - used;
            if w > room {
                if used > 0 && room < max / 2 {
                    // Start the next slice with it rather than cutting it small.
                    job.events.push_front(event);
                    break;
                }
                let head = split_front(&mut event, room);
                job.events.push_front(event);
                event = head;
            }
            used += weight(&event);
            self.ingest_event(
                job,
                worker,
                &tenant,
                &model,
                block_size,
                event,
                &mut pages,
                siblings.then_some(others),
                budget,
            );
            if used >= max || started.elapsed() >= SLICE_TIME {
                break;
            }
        }
        if job.events.is_empty() {
            self.finish(job, worker);
            job.done = true;
        }
        job.done
    }

    /// Before the first slice of a batch bigger than one slice: room in the index for the
    /// blocks it stores (within the worker's budget). Growing a hash table rehashes all it
    /// holds in one go; measured on a 3.5M-block batch (`kvroute-bench ingest-stall`), the
    /// slices that crossed a table's 7/8 load held the lock 100 to 235 ms, against ~8 ms for
    /// the others. Reserved up front, the index never grows mid-batch.
    fn reserve_for(&mut self, job: &IngestJob, worker: WorkerId, slice: usize, budget: usize) {
        let stores: usize = job
            .events
            .iter()
            .filter(|e| matches!(e, KvEvent::BlockStored { .. }))
            .map(weight)
            .sum();
        if stores <= slice {
            return;
        }
        let room = budget.saturating_sub(self.index.worker_blocks(worker));
        self.index.reserve(worker, stores.min(room));
    }

    /// Checks the job's workers are still the ones it started with (resolving the target on
    /// the first slice). Returns the target with its tenant, model and block size.
    fn start_slice(&mut self, job: &mut IngestJob) -> Option<(WorkerId, String, String, u32)> {
        let source = self.worker(job.source)?;
        let source_gen = source.generation;
        if *job.source_gen.get_or_insert(source_gen) != source_gen {
            return None;
        }
        let worker = match job.target {
            Some((id, generation)) => {
                if self.worker(id)?.generation != generation {
                    return None;
                }
                id
            }
            None => {
                let id = match self.resolve(job.source, job.dp_rank) {
                    Ok(id) => id,
                    Err(limit) => {
                        if let Some(l) = limit {
                            job.report.limits.hit(l, 1);
                        }
                        // Refused, but seen: the sequence number moves on.
                        self.finish(job, job.source);
                        job.report.worker = None;
                        return None;
                    }
                };
                let info = self.worker(id)?;
                job.target = Some((id, info.generation));
                job.report.worker = Some(id);
                job.report.instance.clone_from(&info.reg.instance_id);
                job.report.dp_rank = info.dp_rank();
                // A root block without a salt of its own gets the registration's.
                let salt = info.reg.cache_salt.clone();
                if salt.is_some() {
                    for e in &mut job.events {
                        if let KvEvent::BlockStored {
                            parent: None,
                            cache_salt: s @ None,
                            ..
                        } = e
                        {
                            s.clone_from(&salt);
                        }
                    }
                }
                id
            }
        };
        let info = self.worker(worker)?;
        Some((
            worker,
            info.tenant().to_owned(),
            info.reg.model_name.clone(),
            info.reg.block_size,
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn ingest_event(
        &mut self,
        job: &mut IngestJob,
        worker: WorkerId,
        tenant: &str,
        model: &str,
        block_size: u32,
        mut event: KvEvent,
        pages: &mut usize,
        shared_budget: Option<usize>,
        budget: usize,
    ) {
        if let KvEvent::BlockStored {
            lora_name: Some(lora),
            ..
        } = &event
        {
            let lora = lora.clone();
            if let Err(l) = self.add_alias(tenant, &lora, model, Some(job.source)) {
                job.report.limits.hit(l, 1);
            }
        }
        let wants = match self.chunkers.get(&worker) {
            Some(c) => c.wants(block_size, &event),
            None => matches!(&event, KvEvent::BlockStored { blocks, .. }
                if blocks.iter().any(|b| !b.is_whole(block_size as usize))),
        };
        if wants {
            let is_store = matches!(event, KvEvent::BlockStored { .. });
            if is_store && *pages >= self.config.limits.pages {
                job.report.limits.hit(Limit::Pages, weight(&event) as u64);
                return;
            }
            let max_pages = self.config.max_pages_per_worker;
            let c = self
                .chunkers
                .entry(worker)
                .or_insert_with(|| Chunker::new(block_size, max_pages));
            let before = c.len();
            let out = c.apply(event, &mut job.report.chunk);
            *pages = (*pages + c.len()).saturating_sub(before);
            match out {
                Some(e) => event = e,
                None => return,
            }
        }
        if let (Some(others), KvEvent::BlockStored { blocks, .. }) = (shared_budget, &mut event) {
            let room = budget.saturating_sub(others + self.index.worker_blocks(worker));
            if blocks.len() > room {
                job.report
                    .limits
                    .hit(Limit::Blocks, (blocks.len() - room) as u64);
                blocks.truncate(room);
            }
        }
        self.changes.clear();
        let stats = self.index.apply(worker, &event, &mut self.changes);
        job.report.apply.add(&stats);
        self.flush_changes();
    }

    /// The batch is through: the source's sequence number and both workers' counts.
    fn finish(&mut self, job: &IngestJob, worker: WorkerId) {
        let events: u64 = job.report.events.iter().sum();
        let orphans = job.report.apply.orphans;
        if let Some(w) = self.worker_mut(job.source) {
            w.status.last_seq = Some(job.seq);
            w.status.last_hash = job.payload_hash;
            w.status.batches += 1;
        }
        if job.report.worker.is_some() {
            if let Some(w) = self.worker_mut(worker) {
                w.status.events += events;
                w.status.orphans += orphans;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use kvroute::event::{EngineHash, StoredBlock, Tier};

    use super::*;

    #[test]
    fn big_events_become_chained_pieces_in_order() {
        let store = KvEvent::BlockStored {
            parent: Some(EngineHash(7)),
            blocks: (0..1300)
                .map(|i| StoredBlock {
                    hash: EngineHash(100 + i),
                    tokens: vec![1; 4],
                    block_hash: None,
                })
                .collect(),
            tier: Tier::Cpu,
            lora_name: Some("l".into()),
            cache_salt: None,
        };
        let remove = KvEvent::BlockRemoved {
            hashes: (0..600).map(EngineHash).collect(),
            tier: Tier::Gpu,
        };
        let mut out = VecDeque::new();
        into_pieces(store, 512, &mut out);
        into_pieces(remove, 512, &mut out);
        into_pieces(KvEvent::AllBlocksCleared, 512, &mut out);
        let shapes: Vec<(Option<u64>, usize, u64)> = out
            .iter()
            .map(|e| match e {
                KvEvent::BlockStored { parent, blocks, .. } => {
                    (parent.map(|p| p.0), blocks.len(), blocks[0].hash.0)
                }
                KvEvent::BlockRemoved { hashes, .. } => (None, hashes.len(), hashes[0].0),
                KvEvent::AllBlocksCleared => (None, 0, 0),
            })
            .collect();
        assert_eq!(
            shapes,
            [
                (Some(7), 512, 100),
                (Some(611), 512, 612),
                (Some(1123), 276, 1124),
                (None, 512, 0),
                (None, 88, 512),
                (None, 0, 0),
            ]
        );
    }
}
