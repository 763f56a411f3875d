//! What one VM shares between its root and HTTP contexts.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use kvroute::mirror::{Depth, Keys, Meta, Store, SyncState};
use kvroute::router::Roster;
use kvroute::select::SplitMix64;
use proxy_wasm::types::MetricType;

use crate::config::Plugin;
use crate::host;
use crate::outcome::Outcome;

/// Metric ids of one VM.
#[derive(Debug, Default)]
pub(crate) struct Metrics {
    pub requests: [Option<u32>; Outcome::ALL.len()],
    pub matched_ratio_pct: Option<u32>,
    pub lookup_reads: Option<u32>,
    pub sync_lag_ms: Option<u32>,
    pub feed_bytes: Option<u32>,
    pub feed_pages: Option<u32>,
    pub feed_errors: Option<u32>,
    pub collector_failovers: Option<u32>,
    pub bucket_full: Option<u32>,
    pub load_errors: Option<u32>,
    pub resyncs: Option<u32>,
    /// Feed cursors taken over by another collector of the same stream (no snapshot).
    pub handovers: Option<u32>,
    pub speculative_evictions: Option<u32>,
    /// Other gateways' decisions added to the speculative table (feed op `Held`).
    pub peer_holds: Option<u32>,
    pub load_reports: Option<u32>,
    pub load_report_errors: Option<u32>,
    pub leaks_repaired: Option<u32>,
    /// Shared-data writes refused for a stale CAS token (each one a retry or a lost write).
    pub cas_mismatches: Option<u32>,
    pub text: TextMetrics,
}

/// Counters of the text path (`kvroute.text.*`).
#[derive(Debug, Default)]
pub(crate) struct TextMetrics {
    /// Decided on the collector's tokenized answer.
    pub exact: Option<u32>,
    /// Decided in approximate mode.
    pub approx: Option<u32>,
    /// The collector has no tokenizer for the model (404).
    pub no_tokenizer: Option<u32>,
    /// Callouts not made: the model is known to have no tokenizer.
    pub callouts_skipped: Option<u32>,
    /// The text callout failed: timeout, reset, another status, a bad answer.
    pub exact_errors: Option<u32>,
    /// Recorded prefixes of other prompts overwritten in the bounded table.
    pub evictions: Option<u32>,
    /// Table writes lost to other writers after every retry.
    pub lost_writes: Option<u32>,
}

impl Metrics {
    pub fn define() -> Metrics {
        let c = |n: &str| host::define_metric(MetricType::Counter, n);
        let mut m = Metrics {
            matched_ratio_pct: host::define_metric(
                MetricType::Histogram,
                "kvroute.matched_token_ratio_pct",
            ),
            lookup_reads: host::define_metric(MetricType::Histogram, "kvroute.lookup_reads"),
            sync_lag_ms: host::define_metric(MetricType::Gauge, "kvroute.sync_lag_ms"),
            feed_bytes: c("kvroute.feed_bytes"),
            feed_pages: c("kvroute.feed_pages"),
            feed_errors: c("kvroute.feed_errors"),
            collector_failovers: c("kvroute.collector_failovers"),
            bucket_full: c("kvroute.bucket_full"),
            load_errors: c("kvroute.load_errors"),
            resyncs: c("kvroute.resyncs"),
            handovers: c("kvroute.feed_handovers"),
            speculative_evictions: c("kvroute.speculative_evictions"),
            peer_holds: c("kvroute.peer_holds"),
            load_reports: c("kvroute.load_reports"),
            load_report_errors: c("kvroute.load_report_errors"),
            leaks_repaired: c("kvroute.leaks_repaired"),
            cas_mismatches: c("kvroute.cas_mismatches"),
            text: TextMetrics {
                exact: c("kvroute.text.exact"),
                approx: c("kvroute.text.approx"),
                no_tokenizer: c("kvroute.text.no_tokenizer"),
                callouts_skipped: c("kvroute.text.callouts_skipped"),
                exact_errors: c("kvroute.text.exact_errors"),
                evictions: c("kvroute.text.evictions"),
                lost_writes: c("kvroute.text.lost_writes"),
            },
            ..Metrics::default()
        };
        for (i, o) in Outcome::ALL.iter().enumerate() {
            m.requests[i] = c(&format!("kvroute.requests.{}", o.as_str()));
        }
        host::count_cas_mismatches(m.cas_mismatches);
        m
    }

    pub fn count(&self, o: Outcome) {
        let i = Outcome::ALL.iter().position(|x| *x == o).unwrap_or(0);
        host::increment_metric(self.requests.get(i).copied().flatten(), 1);
    }
}

/// The active generation's meta, decoded once per change, with workers grouped by instance.
#[derive(Debug, Default)]
pub(crate) struct MetaCache {
    /// `(generation, stamp, meta version)` the cache was built from.
    pub key: Option<(u8, u32, u32)>,
    pub meta: Meta,
    pub roster: Roster,
    /// Bucket values read under the current sync state (`kvroute::mirror::BucketCache`).
    pub buckets: kvroute::mirror::BucketCache,
}

impl MetaCache {
    /// Rebuilds the cache when the active generation's meta changed since it was built.
    pub fn refresh(&mut self, store: &impl Store, keys: &Keys, state: &SyncState) {
        let key = (state.gen, state.stamp, state.meta_version);
        if self.key == Some(key) {
            return;
        }
        let meta = store
            .get(keys.meta(state.gen))
            .ok()
            .and_then(|(v, _)| v)
            .and_then(|v| Meta::decode(&v, state.stamp))
            .unwrap_or_default();
        self.roster = Roster::from_meta(&meta);
        self.meta = meta;
        self.key = Some(key);
    }
}

/// Models the collector said it has no tokenizer for, each until a time (ms): their text
/// requests go straight to approximate mode. Bounded: the entry expiring first makes room.
#[derive(Debug, Default)]
pub(crate) struct NoTokenizer {
    models: Vec<(String, u64)>,
}

impl NoTokenizer {
    /// Most models remembered.
    pub const MAX: usize = 64;

    pub fn contains(&self, model: &str, now: u64) -> bool {
        self.models
            .iter()
            .any(|(m, until)| m == model && *until > now)
    }

    pub fn insert(&mut self, model: &str, until: u64) {
        if let Some(e) = self.models.iter_mut().find(|(m, _)| m == model) {
            e.1 = until;
            return;
        }
        if self.models.len() >= Self::MAX {
            if let Some(i) = (0..self.models.len()).min_by_key(|i| self.models[*i].1) {
                self.models.swap_remove(i);
            }
        }
        self.models.push((model.to_owned(), until));
    }
}

/// Per-request scratch buffers, reused so the warm request path allocates nothing per token
/// or per block.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    pub body_tokens: Vec<u32>,
    pub str_tokens: Vec<u32>,
    pub seqs: Vec<kvroute::hash::SeqHash>,
    pub depths: Vec<Depth>,
    pub found: Vec<kvroute::intake::Found>,
    /// A text request's canonical text.
    pub text: String,
}

/// What one VM shares between its root and HTTP contexts.
#[derive(Debug)]
pub(crate) struct Vm {
    pub plugin: Plugin,
    pub keys: Keys,
    pub metrics: Metrics,
    pub vm_id: Cell<u64>,
    pub rng: RefCell<SplitMix64>,
    pub cache: RefCell<MetaCache>,
    /// The sync state and fleet totals this VM read last, reused for `index.reuse_ms`.
    pub recent: RefCell<kvroute::mirror::Recent>,
    pub scratch: RefCell<Scratch>,
    pub no_tokenizer: RefCell<NoTokenizer>,
    /// Where text prefixes were sent (approximate mode), in shared data under `keys`.
    pub text_table: kvroute::approx::TextTable,
    /// Per-phase timing histograms (off unless the VM configuration turns them on).
    pub timing: crate::timing::Timing,
}

impl Vm {
    pub fn config(&self) -> &crate::config::Config {
        &self.plugin.global
    }

    /// The sync state at `now` (host ms): this VM's read of the last `index.reuse_ms`, else
    /// read from shared data.
    pub fn state(&self, now: u64) -> Result<SyncState, kvroute::mirror::StoreError> {
        let reuse = crate::config::millis(self.config().reuse);
        match self.recent.try_borrow_mut() {
            Ok(mut r) => r.state(&host::HostStore, &self.keys, now, reuse),
            Err(_) => kvroute::mirror::read_state(&host::HostStore, &self.keys).map(|(s, _)| s),
        }
    }

    /// The fleet totals at `now`, reused like [`Vm::state`].
    pub fn fleet(&self, now: u64) -> Rc<kvroute::mirror::Fleet> {
        let reuse = crate::config::millis(self.config().reuse);
        match self.recent.try_borrow_mut() {
            Ok(mut r) => r.fleet(&host::HostStore, &self.keys, now, reuse),
            Err(_) => Rc::new(kvroute::mirror::read_fleet(&host::HostStore, &self.keys)),
        }
    }

    /// The next request reads the state and the fleet totals again: this VM wrote them, or
    /// may have.
    pub fn forget_recent(&self) {
        if let Ok(mut r) = self.recent.try_borrow_mut() {
            r.forget();
        }
    }
}

pub(crate) type VmRef = Rc<Vm>;
