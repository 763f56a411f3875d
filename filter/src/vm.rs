//! What one VM shares between its root and HTTP contexts.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use kvroute::mirror::{Depth, Keys, Meta};
use kvroute::route::Roster;
use kvroute::select::SplitMix64;
use proxy_wasm::types::MetricType;

use crate::host;
use crate::{Outcome, Plugin};

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
    pub bucket_full: Option<u32>,
    pub load_errors: Option<u32>,
    pub resyncs: Option<u32>,
    pub speculative_evictions: Option<u32>,
    pub load_reports: Option<u32>,
    pub load_report_errors: Option<u32>,
    pub leaks_repaired: Option<u32>,
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
            bucket_full: c("kvroute.bucket_full"),
            load_errors: c("kvroute.load_errors"),
            resyncs: c("kvroute.resyncs"),
            speculative_evictions: c("kvroute.speculative_evictions"),
            load_reports: c("kvroute.load_reports"),
            load_report_errors: c("kvroute.load_report_errors"),
            leaks_repaired: c("kvroute.leaks_repaired"),
            ..Metrics::default()
        };
        for (i, o) in Outcome::ALL.iter().enumerate() {
            m.requests[i] = c(&format!("kvroute.requests.{}", o.as_str()));
        }
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
}

impl MetaCache {
    pub fn rebuild(&mut self, key: (u8, u32, u32), meta: Meta) {
        self.roster = Roster::from_meta(&meta);
        self.meta = meta;
        self.key = Some(key);
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
    pub scratch: RefCell<Scratch>,
}

impl Vm {
    pub fn config(&self) -> &crate::Config {
        &self.plugin.global
    }
}

pub(crate) type VmRef = Rc<Vm>;
