//! Prometheus metrics (`GET /metrics`, text format) with the `prometheus-client` crate.
//!
//! Every metric is an atomic: the ingest path updates them while it holds the hub's lock
//! without further locking. Per-worker families are labelled `instance` and `dp`; their
//! cardinality is bounded by the registered workers.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabels {
    pub instance: String,
    pub dp: String,
}

impl WorkerLabels {
    pub fn new(instance: &str, dp: u32) -> WorkerLabels {
        WorkerLabels {
            instance: instance.to_owned(),
            dp: dp.to_string(),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabels {
    pub instance: String,
    pub dp: String,
    pub r#type: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

/// Messages of the NATS bus (`--nats`): `dir` `in` (the index role) or `out` (the publisher),
/// and what became of them.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BusLabels {
    pub dir: &'static str,
    pub outcome: &'static str,
}

/// Every `outcome` label of [`Metrics::replays`].
pub const REPLAY_OUTCOMES: [&str; 4] = ["ok", "timeout", "error", "restarted"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub instance: String,
    pub dp: String,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabels {
    pub endpoint: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FeedLabels {
    pub kind: &'static str,
}

/// A raised alarm: which (`engine_silent`, ...) and what about (`instance/dp`, ...).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AlarmLabels {
    pub alarm: &'static str,
    pub subject: String,
}

/// A scope of the truth check: `(tenant, model)`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    pub tenant: String,
    pub model: String,
}

type RatioFamily<L> = Family<L, Gauge<f64, std::sync::atomic::AtomicU64>>;

/// `/tokenize` and text `/query` requests: which endpoint, which input (`prompt`, `messages`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TextLabels {
    pub endpoint: &'static str,
    pub input: &'static str,
}

type HistogramFamily = Family<EndpointLabels, Histogram, fn() -> Histogram>;

fn query_histogram() -> Histogram {
    // 10 µs .. ~0.33 s.
    Histogram::new(exponential_buckets(10e-6, 2.0, 16))
}

/// Every metric the collector exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// NATS bus messages by direction and outcome (`published`, `retried`, `outbox_full`,
    /// `too_large`, `applied`, `duplicate`, `gap`, `undecodable`, `unknown_worker`, ...).
    pub bus_messages: Family<BusLabels, Counter>,
    /// KV events applied, by type and worker.
    pub events: Family<EventLabels, Counter>,
    /// Batches (ZMQ messages) received, by worker.
    pub batches: Family<WorkerLabels, Counter>,
    /// Payloads that did not decode, or messages not of 3 frames with an 8-byte seq.
    pub decode_errors: Family<WorkerLabels, Counter>,
    /// Events and blocks left out, by reason.
    pub skipped: Family<ReasonLabels, Counter>,
    /// Sequence gaps seen.
    pub gaps: Family<WorkerLabels, Counter>,
    /// Replays through the engine's ROUTER socket, by outcome.
    pub replays: Family<OutcomeLabels, Counter>,
    /// Stored blocks whose parent the worker does not hold.
    pub orphans: Family<WorkerLabels, Counter>,
    /// Engine restarts detected (sequence back to 0).
    pub restarts: Family<WorkerLabels, Counter>,
    /// Distinct blocks in the index.
    pub blocks: Gauge,
    /// (block, worker) holds in the index.
    pub holders: Gauge,
    /// Workers known (registered and derived from batches' dp ranks).
    pub workers: Gauge,
    /// Workers whose publisher is connected.
    pub connected: Gauge,
    /// Workers that are routing candidates (no evidence they are down).
    pub routable: Gauge,
    /// Workers without a connected KV event stream (never connected, or dropped).
    pub without_events: Gauge,
    /// Entries in the feed log.
    pub feed_log_entries: Gauge,
    /// Latency of `/query` and `/query_by_hash`, seconds.
    pub query_seconds: HistogramFamily,
    /// `/v1/feed` requests by kind (delta, snapshot, handover, wait).
    pub feed_requests: Family<FeedLabels, Counter>,
    /// Bytes served by `/v1/feed`.
    pub feed_bytes: Counter,
    /// Other gateways' routing decisions handed to gateways on their feed pages (op `Held`).
    pub feed_held: Counter,
    /// Engine connections libzmq dropped for a protocol error (a frame over
    /// `--max-zmq-message-bytes`, malformed ZMTP), by worker.
    pub zmq_protocol_errors: Family<WorkerLabels, Counter>,
    /// HTTP connections refused at the `--max-connections` cap.
    pub http_connections_refused: Counter,
    /// HTTP connections waiting on their client closed to make room for a newcomer.
    pub http_connections_shed: Counter,
    /// The connection cap in force (`--max-connections` or derived from descriptors).
    pub http_max_connections: Gauge,
    /// Of the cap, slots kept for proven gateway connections.
    pub http_reserved_connections: Gauge,
    /// Things an engine's events would have created past a cap, by reason.
    pub limited: Family<ReasonLabels, Counter>,
    /// Served names (aliases) known.
    pub aliases: Gauge,
    /// SGLang page records held.
    pub pending_pages: Gauge,
    /// Age of the oldest batch still being applied, seconds (0 when none).
    pub ingest_lag_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// Lock holds taken to apply batches (a big batch takes several).
    pub ingest_slices: Counter,
    /// State files refused on start (unreadable or inconsistent) and moved aside.
    pub state_rejected: Counter,
    /// Text requests (`/tokenize`, `/query` with `prompt` or `messages`).
    pub text_requests: Family<TextLabels, Counter>,
    /// Text requests refused, by kind (`no_tokenizer`, `too_large`, `bad_messages`, ...).
    pub text_errors: Family<ReasonLabels, Counter>,
    /// Time to render and tokenize one text request, seconds.
    pub tokenize_seconds: Histogram,
    /// Tokenizers loaded (each model's once).
    pub tokenizers_loaded: Counter,
    /// Gateway load reports accepted (`POST /v1/load`).
    pub load_reports: Counter,
    /// Gateway load reports refused, by reason.
    pub load_refused: Family<ReasonLabels, Counter>,
    /// Gateways whose load report is live.
    pub fleet_gateways: Gauge,
    /// 1 for each raised alarm (see `alarm`); a cleared alarm's series is removed.
    pub alarm: Family<AlarmLabels, Gauge>,
    /// Alarms raised at the last evaluation.
    pub alarms_raised: Gauge,
    /// Gateways dropped for not reporting within the timeout.
    pub gateways_expired: Counter,
    /// Engine `/metrics` scrapes that gave a sample.
    pub engine_scrapes: Counter,
    /// Engine `/metrics` scrapes that failed or were cut off, by reason.
    pub engine_scrape_failures: Family<ReasonLabels, Counter>,
    /// The truth check over its window, per worker: tokens kvroute predicted as cached.
    pub truth_predicted_tokens: Family<WorkerLabels, Gauge>,
    /// ... the engine's reported reuse on those requests (absent without engine figures).
    pub truth_engine_tokens: Family<WorkerLabels, Gauge>,
    /// ... predicted / engine (absent while the engine reused nothing).
    pub truth_ratio: RatioFamily<WorkerLabels>,
    /// ... the same per `(tenant, model)`.
    pub truth_model_ratio: RatioFamily<ModelLabels>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Drops every series labelled with a worker that is gone, so registrations that come and
    /// go (or an engine's flood of dp ranks) do not grow the registry without end.
    pub fn forget_worker(&self, instance: &str, dp: u32) {
        let w = WorkerLabels::new(instance, dp);
        for family in [
            &self.batches,
            &self.decode_errors,
            &self.gaps,
            &self.orphans,
            &self.restarts,
            &self.zmq_protocol_errors,
        ] {
            family.remove(&w);
        }
        for outcome in REPLAY_OUTCOMES {
            self.replays.remove(&OutcomeLabels {
                instance: w.instance.clone(),
                dp: w.dp.clone(),
                outcome,
            });
        }
        for r#type in crate::hub::EVENT_TYPES {
            self.events.remove(&EventLabels {
                instance: w.instance.clone(),
                dp: w.dp.clone(),
                r#type,
            });
        }
    }

    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("kvroute");
        let m = Metrics {
            registry: Registry::default(),
            bus_messages: Family::default(),
            events: Family::default(),
            batches: Family::default(),
            decode_errors: Family::default(),
            skipped: Family::default(),
            gaps: Family::default(),
            replays: Family::default(),
            orphans: Family::default(),
            restarts: Family::default(),
            blocks: Gauge::default(),
            holders: Gauge::default(),
            workers: Gauge::default(),
            connected: Gauge::default(),
            routable: Gauge::default(),
            without_events: Gauge::default(),
            feed_log_entries: Gauge::default(),
            query_seconds: Family::new_with_constructor(query_histogram as fn() -> Histogram),
            feed_requests: Family::default(),
            feed_bytes: Counter::default(),
            feed_held: Counter::default(),
            zmq_protocol_errors: Family::default(),
            http_connections_refused: Counter::default(),
            http_connections_shed: Counter::default(),
            http_max_connections: Gauge::default(),
            http_reserved_connections: Gauge::default(),
            limited: Family::default(),
            aliases: Gauge::default(),
            pending_pages: Gauge::default(),
            ingest_lag_seconds: Gauge::default(),
            ingest_slices: Counter::default(),
            state_rejected: Counter::default(),
            text_requests: Family::default(),
            text_errors: Family::default(),
            tokenize_seconds: query_histogram(),
            tokenizers_loaded: Counter::default(),
            load_reports: Counter::default(),
            load_refused: Family::default(),
            fleet_gateways: Gauge::default(),
            alarm: Family::default(),
            alarms_raised: Gauge::default(),
            gateways_expired: Counter::default(),
            engine_scrapes: Counter::default(),
            engine_scrape_failures: Family::default(),
            truth_predicted_tokens: Family::default(),
            truth_engine_tokens: Family::default(),
            truth_ratio: Family::default(),
            truth_model_ratio: Family::default(),
        };
        registry.register(
            "bus_messages",
            "NATS bus messages, by direction (in, out) and outcome",
            m.bus_messages.clone(),
        );
        registry.register(
            "events",
            "KV events applied, by type and worker",
            m.events.clone(),
        );
        registry.register(
            "batches",
            "Event batches received, by worker",
            m.batches.clone(),
        );
        registry.register(
            "decode_errors",
            "Messages that did not decode, by worker",
            m.decode_errors.clone(),
        );
        registry.register(
            "skipped",
            "Events or blocks left out, by reason",
            m.skipped.clone(),
        );
        registry.register(
            "sequence_gaps",
            "Sequence gaps seen, by worker",
            m.gaps.clone(),
        );
        registry.register(
            "replays",
            "Replays through the engine's replay socket, by outcome",
            m.replays.clone(),
        );
        registry.register(
            "orphans",
            "Stored blocks whose parent the worker does not hold",
            m.orphans.clone(),
        );
        registry.register(
            "engine_restarts",
            "Engine restarts detected (sequence back to 0)",
            m.restarts.clone(),
        );
        registry.register(
            "index_blocks",
            "Distinct blocks in the index",
            m.blocks.clone(),
        );
        registry.register(
            "index_holders",
            "(block, worker) holds in the index",
            m.holders.clone(),
        );
        registry.register("workers", "Workers known", m.workers.clone());
        registry.register(
            "workers_connected",
            "Workers whose publisher is connected",
            m.connected.clone(),
        );
        registry.register(
            "workers_routable",
            "Workers that are routing candidates: registered and no evidence they are down",
            m.routable.clone(),
        );
        registry.register(
            "workers_without_events",
            "Workers without a connected KV event stream: routed with an empty cache",
            m.without_events.clone(),
        );
        registry.register(
            "feed_log_entries",
            "Entries in the feed log",
            m.feed_log_entries.clone(),
        );
        registry.register(
            "query_duration_seconds",
            "Latency of /query and /query_by_hash",
            m.query_seconds.clone(),
        );
        registry.register(
            "feed_requests",
            "/v1/feed requests by kind",
            m.feed_requests.clone(),
        );
        registry.register(
            "feed_bytes",
            "Bytes served by /v1/feed",
            m.feed_bytes.clone(),
        );
        registry.register(
            "feed_held",
            "Other gateways' routing decisions handed to gateways on their feed pages",
            m.feed_held.clone(),
        );
        registry.register(
            "zmq_protocol_errors",
            "Engine connections dropped for a protocol error (frame over the size limit, malformed ZMTP), by worker",
            m.zmq_protocol_errors.clone(),
        );
        registry.register(
            "http_connections_refused",
            "HTTP connections refused at the connection cap",
            m.http_connections_refused.clone(),
        );
        registry.register(
            "http_connections_shed",
            "HTTP connections waiting on their client (a head, a body, an idle keep-alive) closed at the connection cap to make room for a newcomer",
            m.http_connections_shed.clone(),
        );
        registry.register(
            "http_max_connections",
            "HTTP connection cap in force (--max-connections, or derived from the descriptor limit)",
            m.http_max_connections.clone(),
        );
        registry.register(
            "http_reserved_connections",
            "Of the HTTP connection cap, slots kept for connections answered 2xx on /v1/feed, /query or /v1/load",
            m.http_reserved_connections.clone(),
        );
        registry.register(
            "limited",
            "Things engines' events would have created past a cap (aliases, dp ranks, blocks, pages), by reason",
            m.limited.clone(),
        );
        registry.register("aliases", "Served names (aliases) known", m.aliases.clone());
        registry.register(
            "pending_pages",
            "SGLang page records held by the re-chunkers",
            m.pending_pages.clone(),
        );
        registry.register(
            "ingest_lag_seconds",
            "Age of the oldest batch still being applied",
            m.ingest_lag_seconds.clone(),
        );
        registry.register(
            "ingest_slices",
            "Lock holds taken to apply batches",
            m.ingest_slices.clone(),
        );
        registry.register(
            "state_rejected",
            "State files refused on start and moved aside",
            m.state_rejected.clone(),
        );
        registry.register(
            "text_requests",
            "Text requests (/tokenize, /query with prompt or messages), by endpoint and input",
            m.text_requests.clone(),
        );
        registry.register(
            "text_errors",
            "Text requests refused, by kind",
            m.text_errors.clone(),
        );
        registry.register(
            "tokenize_duration_seconds",
            "Time to render and tokenize one text request",
            m.tokenize_seconds.clone(),
        );
        registry.register(
            "tokenizers_loaded",
            "Tokenizers loaded (once per model)",
            m.tokenizers_loaded.clone(),
        );
        registry.register(
            "load_reports",
            "Gateway load reports accepted",
            m.load_reports.clone(),
        );
        registry.register(
            "load_reports_refused",
            "Gateway load reports refused, by reason",
            m.load_refused.clone(),
        );
        registry.register(
            "fleet_gateways",
            "Gateways whose load report is live",
            m.fleet_gateways.clone(),
        );
        registry.register(
            "alarm",
            "1 while an alarm is raised, by alarm and subject (cleared ones are removed)",
            m.alarm.clone(),
        );
        registry.register(
            "alarms_raised",
            "Alarms raised at the last evaluation (/health or /metrics)",
            m.alarms_raised.clone(),
        );
        registry.register(
            "fleet_gateways_expired",
            "Gateways dropped for not reporting within the timeout",
            m.gateways_expired.clone(),
        );
        registry.register(
            "engine_scrapes",
            "Engine /metrics scrapes that gave a sample",
            m.engine_scrapes.clone(),
        );
        registry.register(
            "engine_scrape_failures",
            "Engine /metrics scrapes that failed or were cut off, by reason",
            m.engine_scrape_failures.clone(),
        );
        registry.register(
            "truth_predicted_tokens",
            "Tokens kvroute predicted as cached for the requests it routed to the worker, over the truth window",
            m.truth_predicted_tokens.clone(),
        );
        registry.register(
            "truth_engine_tokens",
            "Tokens the engine reports it reused on those requests (its hit rate times their prompt tokens), over the truth window",
            m.truth_engine_tokens.clone(),
        );
        registry.register(
            "truth_ratio",
            "Predicted over engine-reported reuse per worker over the truth window (1 when kvroute's hashes describe the engine's cache)",
            m.truth_ratio.clone(),
        );
        registry.register(
            "truth_model_ratio",
            "Predicted over engine-reported reuse per tenant and model over the truth window",
            m.truth_model_ratio.clone(),
        );
        Metrics { registry, ..m }
    }

    pub fn skip(&self, reason: &'static str, n: u64) {
        if n > 0 {
            self.skipped
                .get_or_create(&ReasonLabels { reason })
                .inc_by(n);
        }
    }

    pub fn limit(&self, reason: &'static str, n: u64) {
        if n > 0 {
            self.limited
                .get_or_create(&ReasonLabels { reason })
                .inc_by(n);
        }
    }

    /// The text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
