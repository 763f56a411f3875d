//! The state every task shares: the hub behind its one lock, the fleet's load, the metrics,
//! the tokenizers, and the `--state-dir` snapshots read and written from it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Instant;

use kvroute::event::WorkerId;
use tokio::task::JoinHandle;
use tracing::{error, info, warn};

use crate::config::Config;
use crate::decode::Batch;
use crate::fleet::{Fleet, FleetConfig};
use crate::hub::{Hub, HubConfig, IngestJob, IngestReport, EVENT_TYPES};
use crate::metrics::{EventLabels, Metrics, WorkerLabels};
use crate::state;
use crate::text;

/// Everything the HTTP handlers and the subscriber tasks share.
#[derive(Debug)]
pub struct Shared {
    pub config: Config,
    /// The one lock of the collector's state. `std` lock: every critical section is short and
    /// synchronous, never across an `.await`.
    pub hub: RwLock<Hub>,
    pub metrics: Metrics,
    /// Gateways' load reports and engines' samples. Lock order: this, then `hub`.
    pub fleet: Mutex<Fleet>,
    /// Each `--tokenizer` model's tokenizer, loaded once.
    pub tokenizers: text::Tokenizers,
    pub(crate) subscribers: Mutex<HashMap<WorkerId, JoinHandle<()>>>,
    /// Bumped after every change the subscribers make, so tests and tools can wait for one.
    changed: tokio::sync::watch::Sender<u64>,
    /// When each batch still being applied (by source) started: `/health` degrades on old ones.
    ingesting: Mutex<HashMap<WorkerId, Instant>>,
    /// Why the state file was not loaded, when it was not: `/health` says so.
    state_problem: Mutex<Option<String>>,
    /// Set when an unreadable state file could not be moved aside: snapshots would overwrite
    /// it, so none is written.
    save_blocked: AtomicBool,
    /// What the alarms saw at their last evaluation.
    pub alarms: crate::alarm::Alarms,
    /// The NATS event bus (`--nats`), when it is on.
    pub bus: Option<Arc<crate::bus::handle::Bus>>,
}

/// The axum state.
pub type AppState = Arc<Shared>;

impl Shared {
    /// A collector state with an empty index and a fresh feed epoch.
    pub fn new(config: Config) -> AppState {
        let hub = Hub::new(hub_config(&config), new_epoch());
        let (changed, _) = tokio::sync::watch::channel(0);
        let fleet = Mutex::new(Fleet::new(FleetConfig {
            gateway_timeout: config.gateway_timeout,
            max_gateways: config.max_gateways,
            engine_stale: config.engine_stale,
            truth: config.truth,
        }));
        let tokenizers = text::Tokenizers::new(&config.tokenizers, config.text_limits);
        let bus = config.nats.clone().map(crate::bus::handle::Bus::new);
        if let (Some(bus), Some(dir)) = (&bus, &config.state_dir) {
            // A process restarted on its state keeps its engines (and its snapshot of them).
            bus.ownership
                .set_member(crate::bus::ownership::member_of_state_dir(dir));
        }
        Arc::new(Shared {
            tokenizers,
            config,
            hub: RwLock::new(hub),
            metrics: Metrics::new(),
            fleet,
            subscribers: Mutex::new(HashMap::new()),
            changed,
            ingesting: Mutex::new(HashMap::new()),
            state_problem: Mutex::new(None),
            save_blocked: AtomicBool::new(false),
            alarms: crate::alarm::Alarms::default(),
            bus,
        })
    }

    pub fn read(&self) -> RwLockReadGuard<'_, Hub> {
        self.hub.read().unwrap_or_else(|e| e.into_inner())
    }

    pub fn write(&self) -> RwLockWriteGuard<'_, Hub> {
        self.hub.write().unwrap_or_else(|e| e.into_inner())
    }

    pub fn fleet(&self) -> MutexGuard<'_, Fleet> {
        self.fleet.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn notify(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A receiver that sees a new value after every applied batch or status change.
    pub fn subscribe_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Waits until `cond` holds for the hub, or `deadline` passes; returns whether it held.
    pub async fn wait_until(
        &self,
        deadline: std::time::Duration,
        mut cond: impl FnMut(&Hub) -> bool,
    ) -> bool {
        let mut rx = self.subscribe_changes();
        let until = tokio::time::Instant::now() + deadline;
        loop {
            if cond(&self.read()) {
                return true;
            }
            match tokio::time::timeout_at(until, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => return cond(&self.read()),
            }
        }
    }

    /// Applies one decoded batch from `source`'s publisher, in slices of at most
    /// `--ingest-slice-blocks` blocks with the lock released in between, so queries and other
    /// engines go on while a huge batch is applied; then counts what it did. Returns that.
    pub async fn apply_batch(&self, source: WorkerId, seq: u64, batch: Batch) -> IngestReport {
        self.run_job(IngestJob::new(source, seq, batch)).await
    }

    /// [`Shared::apply_batch`] for a batch from an engine's publisher: `payload_hash` (xxh3
    /// of the message's payload) is kept with its sequence number, so a reconnection can tell
    /// the same engine from a restarted one.
    pub async fn apply_engine_batch(
        &self,
        source: WorkerId,
        seq: u64,
        payload_hash: u64,
        batch: Batch,
    ) -> IngestReport {
        self.run_job(IngestJob::new(source, seq, batch).with_payload_hash(payload_hash))
            .await
    }

    async fn run_job(&self, mut job: IngestJob) -> IngestReport {
        let source = job.source();
        lock(&self.ingesting).insert(source, Instant::now());
        while !self.write().ingest(&mut job) {
            // Let the readers and writers that queued on the lock in before the next slice.
            // A yield alone lets this thread take the lock straight back before the woken
            // readers run; the shortest timer sleep does not.
            tokio::time::sleep(std::time::Duration::from_micros(100)).await;
        }
        lock(&self.ingesting).remove(&source);
        self.count(&job.report);
        job.report
    }

    /// [`Shared::apply_batch`] for callers outside an async runtime (benchmarks, tools).
    pub fn apply_batch_blocking(&self, source: WorkerId, seq: u64, batch: Batch) -> IngestReport {
        let mut job = IngestJob::new(source, seq, batch);
        lock(&self.ingesting).insert(source, Instant::now());
        while !self.write().ingest(&mut job) {
            std::thread::yield_now();
        }
        lock(&self.ingesting).remove(&source);
        self.count(&job.report);
        job.report
    }

    fn count(&self, r: &IngestReport) {
        let m = &self.metrics;
        m.skip("other_kv_group", r.decode.skipped_other_group as u64);
        m.skip("unknown_event_type", r.decode.skipped_unknown as u64);
        m.skip("lora_id_only", r.decode.lora_id_only as u64);
        m.skip("capped", r.apply.capped + r.chunk.capped);
        m.skip("bad_block_size", r.apply.bad_blocks);
        m.skip("unknown_removal", r.apply.unknown_removals);
        for (limit, n) in r.limits.iter() {
            m.limit(limit.as_str(), n);
        }
        m.ingest_slices.inc_by(r.slices as u64);
        if r.worker.is_none() {
            return;
        }
        let labels = WorkerLabels::new(&r.instance, r.dp_rank);
        for (ty, &n) in EVENT_TYPES.into_iter().zip(&r.events) {
            if n > 0 {
                m.events
                    .get_or_create(&EventLabels {
                        instance: labels.instance.clone(),
                        dp: labels.dp.clone(),
                        r#type: ty,
                    })
                    .inc_by(n);
            }
        }
        if r.apply.orphans > 0 {
            m.orphans.get_or_create(&labels).inc_by(r.apply.orphans);
        }
    }

    /// Why the collector is degraded, if it is: an old batch still applying, a state file
    /// that was not loaded. Also sets the ingest lag gauge.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        let oldest = lock(&self.ingesting).values().min().map(Instant::elapsed);
        let lag = oldest.unwrap_or_default();
        self.metrics.ingest_lag_seconds.set(lag.as_secs_f64());
        if lag > self.config.ingest_lag_degraded {
            out.push(format!(
                "ingest lags: a batch has been applying for {:.1} s",
                lag.as_secs_f64()
            ));
        }
        if let Some(p) = lock(&self.state_problem).clone() {
            out.push(p);
        }
        if let Some(bus) = &self.bus {
            out.extend(bus.problems());
        }
        out
    }
}

pub(crate) fn hub_config(c: &Config) -> HubConfig {
    HubConfig {
        max_blocks_per_worker: c.max_blocks_per_worker,
        max_pages_per_worker: c.max_pages_per_worker,
        default_serving_port: c.default_serving_port,
        max_query_tokens: c.max_query_tokens,
        feed_log_entries: c.feed_log_entries,
        max_feed_bytes: c.max_feed_bytes,
        limits: c.limits,
    }
}

/// A feed epoch no earlier run had: the start time in nanoseconds.
fn new_epoch() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1)
}

/// Loads `--state-dir`'s state into `shared`. A file that cannot be read or used is moved
/// aside (never overwritten later), reported and counted; the collector then starts empty.
pub(crate) fn load_state(shared: &AppState, dir: &std::path::Path) -> Vec<(WorkerId, Option<u64>)> {
    let problem = match state::load(dir) {
        Ok(None) => return Vec::new(),
        Ok(Some(saved)) => {
            let mut hub = Hub::new(hub_config(&shared.config), shared.read().feed.epoch());
            match hub.import(saved) {
                Ok(workers) => {
                    info!(dir = %dir.display(), workers = workers.len(), "state loaded");
                    *shared.write() = hub;
                    return workers;
                }
                Err(e) => format!("state file inconsistent ({e})"),
            }
        }
        Err(e) => format!("state file unreadable ({e})"),
    };
    let problem = match state::move_aside(dir) {
        Ok(p) => format!("{problem}; moved aside to {}", p.display()),
        Err(e) => {
            // Keep the original whatever happens: no snapshot is written over it.
            shared.save_blocked.store(true, Ordering::Relaxed);
            format!("{problem}; not moved aside ({e}), so no state will be saved")
        }
    };
    error!(dir = %dir.display(), "{problem}; starting without it");
    shared.metrics.state_rejected.inc();
    *lock(&shared.state_problem) = Some(problem);
    Vec::new()
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(crate) async fn save_state(shared: &AppState, dir: &std::path::Path) {
    if shared.save_blocked.load(Ordering::Relaxed) {
        return;
    }
    // Read before the export: the snapshot holds at least the stream up to it.
    let cursor = shared.bus.as_ref().map(|b| b.applied());
    // The registrations now; each worker's blocks under a read lock of their own while the
    // file is written, so neither a copy of the whole index nor one long hold of the lock.
    let head = shared.read().export_head();
    let dir = dir.to_owned();
    let cursor_dir = dir.clone();
    let from = shared.clone();
    let saved = move || state::save_streamed(&dir, &head, |w| from.read().export_blocks(w));
    match tokio::task::spawn_blocking(saved).await {
        Ok(Ok(bytes)) => {
            tracing::debug!(bytes, "state saved");
            if let Some(seq) = cursor.filter(|&s| s > 0) {
                crate::bus::handle::save_cursor(cursor_dir, seq).await;
            }
        }
        Ok(Err(e)) => warn!(error = %e, "state snapshot not written"),
        Err(e) => warn!(error = %e, "state snapshot task failed"),
    }
}
