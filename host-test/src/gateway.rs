//! The gateway: N worker VMs of one module sharing one `vm_id`, the streams, callouts, clock
//! and shared state around them, and what a test reads back. Loading is in
//! [`crate::builder`], requests in [`crate::request`], and running the VMs in
//! [`crate::driver`] (streams) and [`crate::runtime`] (everything else).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use wasmtime::{Linker, Module};

use crate::abi::{LogLevel, MetricKind};
use crate::headers::Headers;
use crate::model::{Abi, HostOptions, CLOCK_ORIGIN_NANOS};
use crate::shared::{ClusterTarget, Shared};
use crate::state::HostState;
use crate::stream::Stream;
use crate::types::{Callout, CalloutReply, HostError, LogEntry, Outcome, RequestId, Response};
use crate::vm::Vm;

/// Finished requests kept for [`Gateway::outcome`]; older ones are forgotten, so a benchmark
/// can run millions of requests in bounded memory.
pub const MAX_FINISHED_REQUESTS: usize = 4096;

/// The request as it reached the upstream, given to the upstream responder.
#[derive(Clone, Debug)]
pub struct UpstreamRequest {
    /// Worker VM that handled it.
    pub worker: usize,
    /// Headers as they left the filter.
    pub headers: Headers,
    /// Body as it left the filter.
    pub body: Vec<u8>,
    /// Trailers, if any.
    pub trailers: Option<Headers>,
}

type Upstream = Box<dyn FnMut(&UpstreamRequest) -> Response + Send>;

/// A set of worker VMs running one module, and the streams, callouts, clock and shared state
/// around them. See the crate docs for an overview.
pub struct Gateway {
    pub(crate) module: Module,
    pub(crate) linker: Linker<HostState>,
    pub(crate) abi: Abi,
    pub(crate) opts: Arc<HostOptions>,
    pub(crate) shared: Shared,
    pub(crate) vms: Vec<Option<Vm>>,
    pub(crate) allow_on_headers_stop_iteration: bool,
    pub(crate) buffer_limit_bytes: usize,
    pub(crate) streams: BTreeMap<RequestId, Stream>,
    pub(crate) by_ctx: HashMap<(usize, u32), RequestId>,
    pub(crate) next_request: u64,
    pub(crate) next_worker: usize,
    pub(crate) upstream: Upstream,
    pub(crate) errors: Vec<HostError>,
    pub(crate) restarts: usize,
    pub(crate) fuel_total: u64,
    /// Streams with something to do (a continue, a local reply, a reset, a new request).
    pub(crate) dirty: BTreeSet<RequestId>,
    /// Finished streams, oldest first, kept for [`Gateway::outcome`] up to a bound.
    pub(crate) finished: VecDeque<RequestId>,
}

impl Gateway {
    /// Number of worker VMs.
    pub fn worker_count(&self) -> usize {
        self.vms.len()
    }

    /// Sets what the upstream answers to requests that reach it. Default: `200`, no body.
    pub fn set_upstream(&mut self, f: impl FnMut(&UpstreamRequest) -> Response + Send + 'static) {
        self.upstream = Box::new(f);
    }

    /// Declares a cluster whose callouts a closure answers (right after the callback that
    /// dispatched them returns).
    pub fn cluster(
        &mut self,
        name: &str,
        handler: impl FnMut(&Callout) -> CalloutReply + Send + 'static,
    ) {
        self.shared
            .lock()
            .clusters
            .insert(name.into(), ClusterTarget::Handler(Box::new(handler)));
    }

    /// Declares a cluster whose callouts are forwarded over HTTP/1.1 to a loopback server.
    /// A callout with a timeout waits at most that long (then `504`, as Envoy answers).
    pub fn cluster_forward(&mut self, name: &str, addr: std::net::SocketAddr) {
        self.shared
            .lock()
            .clusters
            .insert(name.into(), ClusterTarget::Forward(addr));
    }

    /// Declares a cluster whose callouts stay pending until [`Gateway::reply`] or a timeout.
    pub fn cluster_manual(&mut self, name: &str) {
        self.shared
            .lock()
            .clusters
            .insert(name.into(), ClusterTarget::Manual);
    }

    /// Callouts dispatched and not answered yet, in worker and token order.
    pub fn pending_callouts(&self) -> Vec<Callout> {
        self.vms
            .iter()
            .flatten()
            .flat_map(|vm| {
                vm.store
                    .data()
                    .calls
                    .values()
                    .map(|c| c.callout.clone())
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Every callout dispatched so far, in order.
    pub fn callouts(&self) -> Vec<Callout> {
        self.shared.lock().callouts.clone()
    }

    /// Test-clock time since its origin (2026-01-01T00:00:00Z).
    pub fn now(&self) -> Duration {
        Duration::from_nanos(self.now_nanos() - CLOCK_ORIGIN_NANOS)
    }

    /// Test-clock time in nanoseconds since the Unix epoch (what the module sees).
    pub fn now_nanos(&self) -> u64 {
        self.shared.lock().now_nanos
    }

    /// Tick period a worker's root context asked for (`None`: no ticks).
    pub fn tick_period(&self, worker: usize) -> Option<Duration> {
        let vm = self.vms.get(worker)?.as_ref()?;
        let ms = vm.store.data().tick_period_ms;
        (ms > 0).then(|| Duration::from_millis(ms as u64))
    }

    /// A shared-data value and its CAS.
    pub fn shared_data(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.shared
            .lock()
            .shared_data
            .map
            .get(key.as_bytes())
            .map(|e| (e.value.clone(), e.cas))
    }

    /// Writes shared data unconditionally (as another VM would).
    pub fn set_shared_data(&mut self, key: &str, value: impl AsRef<[u8]>) {
        let _ = self
            .shared
            .lock()
            .shared_data
            .set(key.as_bytes(), value.as_ref(), 0);
    }

    /// Writes many entries at once (bench and test setup).
    pub fn prefill_shared_data<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        &mut self,
        entries: impl IntoIterator<Item = (K, V)>,
    ) {
        let mut inner = self.shared.lock();
        for (k, v) in entries {
            let _ = inner.shared_data.set(k.as_ref(), v.as_ref(), 0);
        }
    }

    /// Number of shared-data keys, emptied ("removed") ones included: Envoy never deletes one.
    pub fn shared_data_len(&self) -> usize {
        self.shared.lock().shared_data.map.len()
    }

    /// Shared-data keys, sorted (lossy UTF-8).
    pub fn shared_data_keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self
            .shared
            .lock()
            .shared_data
            .map
            .keys()
            .map(|k| String::from_utf8_lossy(k).into_owned())
            .collect();
        keys.sort();
        keys
    }

    /// Total bytes of shared-data keys and values.
    pub fn shared_data_bytes(&self) -> usize {
        self.shared
            .lock()
            .shared_data
            .map
            .iter()
            .map(|(k, e)| k.len() + e.value.len())
            .sum()
    }

    /// Items waiting in a shared queue.
    pub fn queue_len(&self, queue: &str) -> Option<usize> {
        let inner = self.shared.lock();
        let token = inner.queues.resolve(&self.opts.vm_id, queue)?;
        inner.queues.by_token.get(&token).map(|q| q.items.len())
    }

    /// Value of a counter or gauge.
    pub fn metric(&self, name: &str) -> Option<u64> {
        self.shared
            .lock()
            .metrics
            .iter()
            .find(|m| m.name == name && m.kind != MetricKind::Histogram)
            .map(|m| m.value)
    }

    /// Values recorded into a histogram.
    pub fn histogram(&self, name: &str) -> Option<Vec<u64>> {
        self.shared
            .lock()
            .metrics
            .iter()
            .find(|m| m.name == name && m.kind == MetricKind::Histogram)
            .map(|m| m.samples.clone())
    }

    /// Every metric: name, kind, value (histograms: their sample count).
    pub fn metrics(&self) -> Vec<(String, MetricKind, u64)> {
        self.shared
            .lock()
            .metrics
            .iter()
            .map(|m| {
                let v = if m.kind == MetricKind::Histogram {
                    m.samples.len() as u64
                } else {
                    m.value
                };
                (m.name.clone(), m.kind, v)
            })
            .collect()
    }

    /// Every captured log line, in order.
    pub fn logs(&self) -> Vec<LogEntry> {
        self.shared.lock().logs.clone()
    }

    /// Messages logged at exactly this level.
    pub fn logs_at(&self, level: LogLevel) -> Vec<String> {
        self.shared
            .lock()
            .logs
            .iter()
            .filter(|l| l.level == level)
            .map(|l| l.message.clone())
            .collect()
    }

    /// Whether any log line contains `needle`.
    pub fn log_contains(&self, needle: &str) -> bool {
        self.shared
            .lock()
            .logs
            .iter()
            .any(|l| l.message.contains(needle))
    }

    /// Forgets captured logs.
    pub fn clear_logs(&mut self) {
        self.shared.lock().logs.clear();
    }

    /// Sets a property every stream sees (`route_name`, `["metadata", ...]` paths, ...).
    pub fn set_property(&mut self, path: &[&str], value: impl AsRef<[u8]>) {
        let path = path.iter().map(|s| s.to_string()).collect();
        self.shared
            .lock()
            .properties
            .insert(path, value.as_ref().to_vec());
    }

    /// Registers a foreign function (`proxy_call_foreign_function`); unknown names get NotFound.
    pub fn foreign_function(
        &mut self,
        name: &str,
        f: impl FnMut(&[u8]) -> Result<Vec<u8>, u32> + Send + 'static,
    ) {
        self.shared.lock().foreign.insert(name.into(), Box::new(f));
    }

    /// Every foreign function call: name and arguments.
    pub fn foreign_calls(&self) -> Vec<(String, Vec<u8>)> {
        self.shared.lock().foreign_calls.clone()
    }

    /// Higress: the endpoints `proxy_get_upstream_hosts` returns, as `(address, JSON info)`.
    pub fn set_upstream_hosts<A: Into<String>, I: Into<String>>(
        &mut self,
        hosts: impl IntoIterator<Item = (A, I)>,
    ) {
        self.shared.lock().upstream_hosts = hosts
            .into_iter()
            .map(|(a, i)| (a.into(), i.into()))
            .collect();
    }

    /// Hostcalls made so far by every VM, by import name: every proxy-wasm import but
    /// logging, no WASI call. A VM recreated after a trap starts again from 0.
    pub fn hostcalls(&self) -> BTreeMap<&'static str, u64> {
        let mut out = BTreeMap::new();
        for vm in self.vms.iter().flatten() {
            for (name, n) in &vm.store.data().hostcalls {
                *out.entry(*name).or_default() += n;
            }
        }
        out
    }

    /// Traps that happened outside a request (ticks, queues, callbacks of root contexts) and
    /// VM restarts that failed, in order.
    pub fn errors(&self) -> &[HostError] {
        &self.errors
    }

    /// How many times a VM was recreated after a trap.
    pub fn restarts(&self) -> usize {
        self.restarts
    }

    /// Whether a worker VM is running (false: it trapped and could not be recreated).
    pub fn worker_alive(&self, worker: usize) -> bool {
        self.vms.get(worker).is_some_and(Option::is_some)
    }

    /// Fuel consumed by every callback so far (0 with fuel off).
    pub fn fuel_total(&self) -> u64 {
        self.fuel_total
    }

    /// The current outcome of a request.
    ///
    /// # Panics
    /// If `id` is not a request of this gateway, or one of the finished requests older than
    /// the last [`MAX_FINISHED_REQUESTS`].
    pub fn outcome(&self, id: RequestId) -> Outcome {
        let st = self.streams.get(&id).expect("unknown request id");
        Outcome {
            id,
            worker: st.worker,
            context_id: st.ctx,
            state: st.state.clone(),
            request_headers: st.req.out_headers.clone(),
            request_body: st.req.out_body.clone(),
            request_trailers: st.req.out_trailers.clone(),
            local_response: st.local.clone(),
            response: st.final_response.clone(),
            override_host: st.override_host.clone(),
            properties: st.properties.clone(),
            fuel: st.fuel,
        }
    }
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("mode", &self.opts.mode)
            .field("vm_id", &self.opts.vm_id)
            .field("workers", &self.vms.len())
            .field("streams", &self.streams.len())
            .field("restarts", &self.restarts)
            .finish_non_exhaustive()
    }
}
