//! kvroute's proxy-wasm HTTP filter: token ids in, longest cached prefix found, upstream
//! chosen, inside Envoy (`kvroute_filter.wasm`) and Higress (`kvroute_filter_higress.wasm`,
//! cargo feature `higress`).
//!
//! Glue only: every decision is a call into the core (`kvroute`): token intake
//! ([`kvroute::intake`]), the shared-data layout and its sync ([`kvroute::bucket`]), hashing,
//! the longest-match walk ([`kvroute::lookup`]) and the choice ([`kvroute::select`]).
//!
//! # Request path
//!
//! 1. Request headers: remove any client-sent destination header; read the configured
//!    header / metadata sources in order. If a body source comes first for some value and the
//!    request has a JSON body, pause (this needs `allow_on_headers_stop_iteration: true` in
//!    Envoy ≥ 1.35, or the ABI 0.2.100 marker in Higress) and buffer the body up to
//!    `max_body_bytes` (past it: continue unrouted, `too_large`).
//! 2. At the end of the body, scan it once for the needed fields.
//! 3. Local mode: sequence hashes → block keys → bisection over the shared-data buckets →
//!    per-instance candidates with in-flight load → `select::pick` → headers; remote mode: a
//!    `/query` callout, then the same choice.
//! 4. `on_log`: release the in-flight load taken at routing, whatever the outcome.
//!
//! Every failure fails open: the request continues without the route header and a counter
//! says why. Nothing here panics: host calls go through [`host`], which never unwraps.
//!
//! # Sync (local mode)
//!
//! On each tick one VM holds the lease in shared data and pulls `/v1/feed` from the
//! collector cluster; [`kvroute::bucket::apply_page`] writes the pages into the bounded
//! keyspace. Pages marked `MORE` are pulled at once until `max_blocks_per_tick` block holds
//! were applied in this tick. Any VM takes over a lapsed lease.

mod config;
mod host;
mod http;
mod root;

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use kvroute::bucket::{Keys, Meta};
use kvroute::select::SplitMix64;
use proxy_wasm::traits::RootContext;
use proxy_wasm::types::MetricType;

pub use config::{parse, parse_plugin, Config, ConfigError, Mode, Plugin, Source};

proxy_wasm::main! {{
    host::init_logging();
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(root::Root::new()) });
}}

/// Why a request was (not) routed. Each has a counter `kvroute.requests.<name>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Routed,
    NoTokens,
    NoModel,
    NoMatch,
    StaleIndex,
    CollectorError,
    BadBody,
    TooLarge,
    BadHeader,
}

impl Outcome {
    pub const ALL: [Outcome; 9] = [
        Outcome::Routed,
        Outcome::NoTokens,
        Outcome::NoModel,
        Outcome::NoMatch,
        Outcome::StaleIndex,
        Outcome::CollectorError,
        Outcome::BadBody,
        Outcome::TooLarge,
        Outcome::BadHeader,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Routed => "routed",
            Outcome::NoTokens => "no_tokens",
            Outcome::NoModel => "no_model",
            Outcome::NoMatch => "no_match",
            Outcome::StaleIndex => "stale_index",
            Outcome::CollectorError => "collector_error",
            Outcome::BadBody => "bad_body",
            Outcome::TooLarge => "too_large",
            Outcome::BadHeader => "bad_header",
        }
    }
}

/// Metric ids of one VM.
#[derive(Debug, Default)]
pub(crate) struct Metrics {
    pub requests: [Option<u32>; 9],
    pub matched_ratio_pct: Option<u32>,
    pub lookup_reads: Option<u32>,
    pub sync_lag_ms: Option<u32>,
    pub feed_bytes: Option<u32>,
    pub feed_pages: Option<u32>,
    pub feed_errors: Option<u32>,
    pub bucket_full: Option<u32>,
    pub load_errors: Option<u32>,
    pub resyncs: Option<u32>,
}

impl Metrics {
    fn define() -> Metrics {
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

/// An instance (one `instance_id`) and its worker slots.
#[derive(Clone, Debug, Default)]
pub(crate) struct Instance {
    pub id: String,
    pub address: String,
    /// `(slot, dp_rank)` of its live workers.
    pub slots: Vec<(u32, u32)>,
}

/// The active generation's meta, decoded once per change, with workers grouped by instance.
#[derive(Debug, Default)]
pub(crate) struct MetaCache {
    pub key: Option<(u8, u32, u32)>,
    pub meta: Meta,
    pub instances: Vec<Instance>,
    /// Slot → index into `instances` (`u32::MAX`: none).
    pub slot_instance: Vec<u32>,
}

impl MetaCache {
    pub fn rebuild(&mut self, key: (u8, u32, u32), meta: Meta) {
        self.instances.clear();
        self.slot_instance.clear();
        self.slot_instance.resize(meta.workers.len(), u32::MAX);
        for (slot, w) in meta.workers.iter().enumerate() {
            let Some(w) = w else { continue };
            if !w.live {
                continue;
            }
            let idx = match self.instances.iter().position(|i| i.id == w.instance_id) {
                Some(i) => i,
                None => {
                    self.instances.push(Instance {
                        id: w.instance_id.clone(),
                        address: w.address.clone(),
                        slots: Vec::new(),
                    });
                    self.instances.len() - 1
                }
            };
            if let Some(inst) = self.instances.get_mut(idx) {
                inst.slots.push((slot as u32, w.dp_rank));
            }
            if let Some(s) = self.slot_instance.get_mut(slot) {
                *s = idx as u32;
            }
        }
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
    pub keys: Vec<kvroute::scope::BlockKey>,
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
    pub fn config(&self) -> &Config {
        &self.plugin.global
    }
}

pub(crate) type VmRef = Rc<Vm>;
