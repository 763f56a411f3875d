//! Per-phase timing of the request path, measured inside the real host (Envoy's V8, Higress,
//! the test host), off by default.
//!
//! Why inside the host: the host bench runs the filter in wasmtime, whose code generation,
//! host calls and shared-data map differ from Envoy's V8; `make bench-latency` sees only
//! Envoy's whole process. With timing on, each phase of a request reads the host clock
//! (`proxy_get_current_time_nanoseconds`) at its end and records the time since the previous
//! mark into a histogram metric `kvroute.timing.<phase>_ns` (nanoseconds, so a sub-µs phase is
//! not rounded to 0; Envoy keeps the exact sum and count: `_sum / _count` is the mean).
//!
//! Turned on by the VM configuration (`vm_config.configuration`, `{"timing": true}`), not the
//! plugin configuration: it is a property of the measurement run, for every plugin and route
//! the VM serves, and it must cost nothing when off (no clock read, no metric defined).
//!
//! In timing mode the whole prompt is hashed before the lookup, so hashing and the lookup are
//! two phases; without it the lookup hashes lazily, only as deep as it looks. A fully matched
//! prompt (the benches') does the same work either way.

use proxy_wasm::types::MetricType;

use crate::host;

/// A timed phase of one request (its value is its index in [`Phase::ALL`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Phase {
    /// Request headers: the header and metadata sources read, the body asked for.
    HeaderIntake,
    /// The buffered body copied from the host into the VM (`proxy_get_buffer_bytes`): what
    /// any filter that reads the body pays, apart from what it does with it.
    BodyCopy,
    /// The body scanned for its fields, token ids parsed.
    BodyIntake,
    /// Sequence hashes of the prompt's full blocks.
    Hash,
    /// The sync state read, the VM's cache of the meta and worker table checked against it
    /// (and refreshed when the index moved), the model's scope: shared-data crossings
    /// mostly.
    State,
    /// The bisection over the buckets and the speculative holders.
    Lookup,
    /// The load picture read and the decision (`router::route`).
    Decision,
    /// The speculative entry written and the request booked.
    Books,
    /// The destination (and dp-rank) headers set.
    HeaderSet,
    /// The two releases of the books (first response bytes, end of the request).
    Release,
}

impl Phase {
    /// Every phase, in metric-id order.
    pub const ALL: [Phase; 10] = [
        Phase::HeaderIntake,
        Phase::BodyCopy,
        Phase::BodyIntake,
        Phase::Hash,
        Phase::State,
        Phase::Lookup,
        Phase::Decision,
        Phase::Books,
        Phase::HeaderSet,
        Phase::Release,
    ];

    /// The histogram's name.
    pub fn metric(self) -> &'static str {
        match self {
            Phase::HeaderIntake => "kvroute.timing.header_intake_ns",
            Phase::BodyCopy => "kvroute.timing.body_copy_ns",
            Phase::BodyIntake => "kvroute.timing.body_intake_ns",
            Phase::Hash => "kvroute.timing.hash_ns",
            Phase::State => "kvroute.timing.state_ns",
            Phase::Lookup => "kvroute.timing.lookup_ns",
            Phase::Decision => "kvroute.timing.decision_ns",
            Phase::Books => "kvroute.timing.books_ns",
            Phase::HeaderSet => "kvroute.timing.header_set_ns",
            Phase::Release => "kvroute.timing.release_ns",
        }
    }
}

/// A host call timed on its own, once per request in timing mode, so that a phase's time can
/// be split into the host calls it makes and the filter's own work: how much a crossing costs
/// where the filter runs, rather than inferred from phase totals.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Probe {
    /// `proxy_get_current_time_nanoseconds`.
    Clock,
    /// `proxy_get_header_map_value` of `:path` (present in every request; its value copied
    /// into the VM).
    Header,
    /// `proxy_get_header_map_pairs`: the request's whole header map.
    HeaderMap,
    /// `proxy_get_shared_data` of the sync state (about 100 bytes).
    SharedRead,
    /// `proxy_remove_header_map_value` of a header no request has: a crossing that returns
    /// nothing into the VM, as a write does.
    HeaderRemove,
}

impl Probe {
    /// Every probe, in metric-id order.
    pub const ALL: [Probe; 5] = [
        Probe::Clock,
        Probe::Header,
        Probe::HeaderMap,
        Probe::SharedRead,
        Probe::HeaderRemove,
    ];

    /// Calls timed per probe: the span between two clock reads holds this many, so the clock
    /// reads at its ends weigh 1/`CALLS` of a call.
    pub const CALLS: u64 = 8;

    /// The histogram's name: nanoseconds per call.
    pub fn metric(self) -> &'static str {
        match self {
            Probe::Clock => "kvroute.timing.call_clock_ns",
            Probe::Header => "kvroute.timing.call_header_ns",
            Probe::HeaderMap => "kvroute.timing.call_header_map_ns",
            Probe::SharedRead => "kvroute.timing.call_shared_read_ns",
            Probe::HeaderRemove => "kvroute.timing.call_header_remove_ns",
        }
    }
}

/// The header [`Probe::HeaderRemove`] removes: no client sends it, so removing it changes
/// nothing.
const PROBE_ABSENT_HEADER: &str = "x-kvroute-timing-probe-absent";

/// The VM configuration's keys.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct VmConfig {
    #[serde(default)]
    timing: bool,
}

/// Whether the VM configuration turns timing on. Empty (Envoy's default) is off; anything
/// but a JSON object of known keys is an error naming what is wrong.
pub(crate) fn parse_vm_config(raw: &[u8]) -> Result<bool, String> {
    if raw.iter().all(u8::is_ascii_whitespace) {
        return Ok(false);
    }
    serde_json::from_slice::<VmConfig>(raw)
        .map(|c| c.timing)
        .map_err(|e| format!("invalid kvroute VM configuration: {e}"))
}

/// The histograms of one VM; every id is `None` when timing is off.
#[derive(Debug, Default)]
pub(crate) struct Timing {
    ids: [Option<u32>; Phase::ALL.len()],
    probe_ids: [Option<u32>; Probe::ALL.len()],
    on: bool,
}

impl Timing {
    /// Defines the histograms when `on`; off defines nothing.
    pub fn define(on: bool) -> Timing {
        let mut t = Timing {
            on,
            ..Timing::default()
        };
        if on {
            for (i, p) in Phase::ALL.iter().enumerate() {
                t.ids[i] = host::define_metric(MetricType::Histogram, p.metric());
            }
            for (i, p) in Probe::ALL.iter().enumerate() {
                t.probe_ids[i] = host::define_metric(MetricType::Histogram, p.metric());
            }
        }
        t
    }

    /// A stopwatch started now (a no-op one when timing is off).
    pub fn start(&self) -> Stopwatch {
        let mut w = Stopwatch::default();
        self.restart(&mut w);
        w
    }

    /// Marks now without charging the time since the last mark to any phase: the request
    /// waited (for its body, a callout), it did not run.
    pub fn restart(&self, watch: &mut Stopwatch) {
        if self.on {
            watch.last = host::now_ns();
        }
    }

    /// Whether timing is on.
    pub fn on(&self) -> bool {
        self.on
    }

    /// Charges the time since `watch`'s last mark to `phase`, and marks now.
    pub fn lap(&self, watch: &mut Stopwatch, phase: Phase) {
        if !self.on {
            return;
        }
        let now = host::now_ns();
        let i = phase as usize;
        // The host clock is the wall clock: a step back charges 0, never a huge value.
        if let Some(a) = watch.acc.get_mut(i) {
            *a = a.saturating_add(now.saturating_sub(watch.last));
        }
        watch.touched |= 1 << i;
        watch.last = now;
    }

    /// Times [`Probe::CALLS`] calls of each [`Probe`] and records nanoseconds per call, then
    /// marks `watch` anew so that no phase is charged for them. Request headers only (the
    /// header probes need them); nothing when timing is off.
    pub fn probe(&self, watch: &mut Stopwatch, state_key: &str) {
        if !self.on {
            return;
        }
        for (i, p) in Probe::ALL.iter().enumerate() {
            let t0 = host::now_ns();
            for _ in 0..Probe::CALLS {
                match p {
                    Probe::Clock => {
                        core::hint::black_box(host::now_ns());
                    }
                    Probe::Header => {
                        core::hint::black_box(host::get_header(
                            proxy_wasm::types::MapType::HttpRequestHeaders,
                            ":path",
                        ));
                    }
                    Probe::HeaderMap => {
                        core::hint::black_box(host::get_headers(
                            proxy_wasm::types::MapType::HttpRequestHeaders,
                        ));
                    }
                    Probe::SharedRead => {
                        core::hint::black_box(kvroute::mirror::Store::get(
                            &host::HostStore,
                            state_key,
                        ))
                        .ok();
                    }
                    Probe::HeaderRemove => {
                        core::hint::black_box(host::remove_header(
                            proxy_wasm::types::MapType::HttpRequestHeaders,
                            PROBE_ABSENT_HEADER,
                        ));
                    }
                }
            }
            let per_call = host::now_ns().saturating_sub(t0) / Probe::CALLS;
            host::record_metric(self.probe_ids.get(i).copied().flatten(), per_call);
        }
        self.restart(watch);
    }

    /// Records each phase `watch` charged since the last flush, one sample each: a phase
    /// reached in two pieces (the lookup before and after hashing) is one sample, so every
    /// histogram's count is the number of requests that went through that phase.
    pub fn flush(&self, watch: &mut Stopwatch) {
        if !self.on {
            return;
        }
        for (i, id) in self.ids.iter().enumerate() {
            if watch.touched & (1 << i) != 0 {
                host::record_metric(*id, watch.acc.get(i).copied().unwrap_or(0));
            }
        }
        watch.touched = 0;
        watch.acc = [0; Phase::ALL.len()];
    }
}

/// A request's phase times so far (ns) and its last mark; all zero when timing is off.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Stopwatch {
    last: u64,
    acc: [u64; Phase::ALL.len()],
    touched: u16,
}
