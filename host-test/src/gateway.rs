//! The gateway: N worker VMs of one module sharing one `vm_id`, and the driver that moves
//! streams through them the way Envoy's filter manager does.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use wasmtime::{Config, Engine, Linker, Module, OptLevel};

use crate::abi::{LogLevel, MetricKind};
use crate::headers::Headers;
use crate::shared::{ClusterTarget, Shared};
use crate::types::*;
use crate::vm::{self, Abi, CallResponse, Deferred, HostOptions, HostState, StreamEvent, Vm};

/// The test clock starts at 2026-01-01T00:00:00Z (nanoseconds since the Unix epoch).
pub(crate) const CLOCK_ORIGIN_NANOS: u64 = 1_767_225_600_000_000_000;

/// Envoy's default request buffer limit (`per_connection_buffer_limit_bytes`, 1 MiB).
pub const DEFAULT_BUFFER_LIMIT_BYTES: usize = 1024 * 1024;

/// Finished requests kept for [`Gateway::outcome`]; older ones are forgotten, so a benchmark
/// can run millions of requests in bounded memory.
pub const MAX_FINISHED_REQUESTS: usize = 4096;

/// Which proxy the host imitates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// Stock Envoy (≥ 1.35): ABI 0.2.1 imports only.
    #[default]
    Envoy,
    /// Higress: also `proxy_set_upstream_override_host` and `proxy_get_upstream_hosts`, and the
    /// ABI 0.2.100 marker lets a `Pause` from headers keep the body flowing.
    Higress,
}

enum Source {
    Path(PathBuf),
    Bytes(Vec<u8>),
}

/// Settings for [`Gateway`]; start with [`Gateway::builder`] or [`Gateway::builder_bytes`].
pub struct GatewayBuilder {
    source: Source,
    opts: HostOptions,
    workers: usize,
    allow_on_headers_stop_iteration: bool,
    buffer_limit_bytes: usize,
    properties: Vec<(Vec<String>, Vec<u8>)>,
    log_level: LogLevel,
}

impl GatewayBuilder {
    fn new(source: Source) -> Self {
        GatewayBuilder {
            source,
            opts: HostOptions {
                mode: Mode::Envoy,
                vm_id: "kvroute".into(),
                root_id: String::new(),
                plugin_name: "kvroute".into(),
                plugin_config: Vec::new(),
                vm_config: Vec::new(),
                env: Vec::new(),
                fuel: true,
                fuel_per_call: vm::DEFAULT_FUEL_PER_CALL,
            },
            workers: 1,
            allow_on_headers_stop_iteration: false,
            buffer_limit_bytes: DEFAULT_BUFFER_LIMIT_BYTES,
            properties: Vec::new(),
            log_level: LogLevel::Info,
        }
    }

    /// Plugin configuration (`proxy_on_configure`), e.g. the filter's JSON. Default: empty.
    pub fn config(mut self, config: impl AsRef<[u8]>) -> Self {
        self.opts.plugin_config = config.as_ref().to_vec();
        self
    }

    /// VM configuration (`proxy_on_vm_start`). Default: empty.
    pub fn vm_config(mut self, config: impl AsRef<[u8]>) -> Self {
        self.opts.vm_config = config.as_ref().to_vec();
        self
    }

    /// Number of worker VMs (Envoy runs one per worker thread). Default 1.
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = n.max(1);
        self
    }

    /// Envoy or Higress. Default Envoy.
    pub fn mode(mut self, mode: Mode) -> Self {
        self.opts.mode = mode;
        self
    }

    /// Shorthand for `mode(Mode::Higress)`.
    pub fn higress(self) -> Self {
        self.mode(Mode::Higress)
    }

    /// Envoy's `allow_on_headers_stop_iteration` (≥ 1.35). Default false, as in Envoy: a
    /// `Pause` from headers then stops the body too until the filter continues.
    pub fn allow_on_headers_stop_iteration(mut self, allow: bool) -> Self {
        self.allow_on_headers_stop_iteration = allow;
        self
    }

    /// Request buffer limit in bytes: a body buffered past it gets `413`. Default 1 MiB.
    pub fn buffer_limit_bytes(mut self, bytes: usize) -> Self {
        self.buffer_limit_bytes = bytes;
        self
    }

    /// `vm_id`: the shared-data and queue namespace. Default `kvroute`.
    pub fn vm_id(mut self, vm_id: &str) -> Self {
        self.opts.vm_id = vm_id.into();
        self
    }

    /// `root_id` (property `plugin_root_id`). Default empty.
    pub fn root_id(mut self, root_id: &str) -> Self {
        self.opts.root_id = root_id.into();
        self
    }

    /// Plugin name (property `plugin_name`). Default `kvroute`.
    pub fn plugin_name(mut self, name: &str) -> Self {
        self.opts.plugin_name = name.into();
        self
    }

    /// An environment variable the module sees through WASI (`vm_config.environment_variables`).
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.opts.env.push((key.into(), value.into()));
        self
    }

    /// A property visible from the start (`proxy_on_configure` included).
    pub fn property(mut self, path: &[&str], value: impl AsRef<[u8]>) -> Self {
        self.properties.push((
            path.iter().map(|s| s.to_string()).collect(),
            value.as_ref().to_vec(),
        ));
        self
    }

    /// Level `proxy_get_log_level` reports. Every line is captured whatever the level.
    pub fn log_level(mut self, level: LogLevel) -> Self {
        self.log_level = level;
        self
    }

    /// Count fuel (≈ wasm instructions) per callback. Default on; off runs ~10–30% faster.
    pub fn fuel(mut self, on: bool) -> Self {
        self.opts.fuel = on;
        self
    }

    /// Fuel budget of one callback (default 2·10¹⁰): a callback that needs more traps, so a
    /// runaway loop fails the request instead of hanging the test.
    pub fn fuel_per_call(mut self, fuel: u64) -> Self {
        self.opts.fuel_per_call = fuel;
        self
    }

    /// Compiles (cached per path and fuel setting), checks imports and ABI, and starts every
    /// worker VM.
    ///
    /// # Errors
    /// [`HostError::Read`], [`HostError::Compile`], [`HostError::UnknownImport`],
    /// [`HostError::UnknownAbi`], [`HostError::Instantiate`], a trap during start, or
    /// [`HostError::ConfigurationRejected`] when `proxy_on_configure` returns false.
    pub fn build(self) -> Result<Gateway, HostError> {
        let engine = engine(self.opts.fuel);
        let module = match &self.source {
            Source::Path(p) => compile_path(&engine, p, self.opts.fuel)?,
            Source::Bytes(b) => {
                Module::new(&engine, b).map_err(|e| HostError::Compile(format!("{e:?}")))?
            }
        };
        vm::check_imports(&module, self.opts.mode)?;
        let abi = vm::check_abi(&module, self.opts.mode)?;
        let mut linker = Linker::new(&engine);
        vm::link(&mut linker, self.opts.mode).map_err(|e| HostError::Instantiate(e.to_string()))?;
        let shared = Shared::default();
        {
            let mut inner = shared.lock();
            inner.now_nanos = CLOCK_ORIGIN_NANOS;
            inner.log_level = Some(self.log_level);
            inner.properties.extend(self.properties);
        }
        let mut gw = Gateway {
            module,
            linker,
            abi,
            opts: Arc::new(self.opts),
            shared,
            vms: Vec::new(),
            allow_on_headers_stop_iteration: self.allow_on_headers_stop_iteration,
            buffer_limit_bytes: self.buffer_limit_bytes,
            streams: BTreeMap::new(),
            by_ctx: HashMap::new(),
            next_request: 1,
            next_worker: 0,
            upstream: Box::new(|_| Response::new(200)),
            errors: Vec::new(),
            restarts: 0,
            fuel_total: 0,
            dirty: BTreeSet::new(),
            finished: VecDeque::new(),
        };
        gw.add_workers(self.workers)?;
        Ok(gw)
    }
}

fn engine(fuel: bool) -> Engine {
    static ENGINES: OnceLock<[Engine; 2]> = OnceLock::new();
    let engines = ENGINES.get_or_init(|| {
        let make = |fuel: bool| {
            let mut c = Config::new();
            c.consume_fuel(fuel);
            c.cranelift_opt_level(OptLevel::Speed);
            Engine::new(&c).expect("wasmtime engine")
        };
        [make(false), make(true)]
    });
    engines[fuel as usize].clone()
}

/// Compiling the filter takes a while; tests load the same file many times.
fn compile_path(engine: &Engine, path: &Path, fuel: bool) -> Result<Module, HostError> {
    type Cache = Mutex<HashMap<(PathBuf, bool), (SystemTime, u64, Module)>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let read_err = |e: std::io::Error| HostError::Read {
        path: path.display().to_string(),
        reason: e.to_string(),
    };
    let meta = std::fs::metadata(path).map_err(read_err)?;
    let stamp = (meta.modified().map_err(read_err)?, meta.len());
    let key = (path.to_path_buf(), fuel);
    let cache = CACHE.get_or_init(Default::default);
    if let Some((t, len, m)) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        if (*t, *len) == stamp {
            return Ok(m.clone());
        }
    }
    let bytes = std::fs::read(path).map_err(read_err)?;
    let module = Module::new(engine, &bytes).map_err(|e| HostError::Compile(format!("{e:?}")))?;
    cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, (stamp.0, stamp.1, module.clone()));
    Ok(module)
}

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

/// A property path and value.
type Property = (Vec<String>, Vec<u8>);

type Upstream = Box<dyn FnMut(&UpstreamRequest) -> Response + Send>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Request,
    Response,
}

#[derive(Default)]
struct Dir {
    headers: Option<Headers>,
    headers_delivered: bool,
    chunks: VecDeque<Vec<u8>>,
    trailers: Option<Headers>,
    trailers_delivered: bool,
    /// The filter holds this direction (returned Pause and did not continue yet).
    held: bool,
    /// Held with StopAllIterationAndWatermark: no callback until the filter continues.
    stop_all: bool,
    /// `proxy_continue_stream` arrived.
    resume: bool,
    out_headers: Option<Headers>,
    out_body: Vec<u8>,
    out_trailers: Option<Headers>,
}

impl Dir {
    fn new(headers: Headers, body: Vec<Vec<u8>>, trailers: Option<Headers>) -> Dir {
        Dir {
            headers: Some(headers),
            chunks: body.into_iter().filter(|c| !c.is_empty()).collect(),
            trailers,
            ..Dir::default()
        }
    }

    fn end_of_stream(&self) -> bool {
        self.chunks.is_empty() && (self.trailers.is_none() || self.trailers_delivered)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Request,
    AwaitingResponse,
    Response,
    Done,
}

struct Stream {
    worker: usize,
    ctx: u32,
    phase: Phase,
    state: StreamState,
    req: Dir,
    resp: Dir,
    hold_response: bool,
    canned_response: Option<Response>,
    local: Option<LocalResponse>,
    /// A local reply sent during the response phase replaces the response outright.
    response_override: Option<Response>,
    reset: bool,
    fuel: u64,
    final_response: Option<Response>,
    override_host: Option<String>,
    properties: Vec<(Vec<String>, Vec<u8>)>,
}

impl Stream {
    fn dir(&mut self, side: Side) -> &mut Dir {
        match side {
            Side::Request => &mut self.req,
            Side::Response => &mut self.resp,
        }
    }
}

enum Flow {
    Waiting,
    Complete,
    Ended,
}

/// A set of worker VMs running one module, and the streams, callouts, clock and shared state
/// around them. See the crate docs for an overview.
pub struct Gateway {
    module: Module,
    linker: Linker<HostState>,
    abi: Abi,
    opts: Arc<HostOptions>,
    shared: Shared,
    vms: Vec<Option<Vm>>,
    allow_on_headers_stop_iteration: bool,
    buffer_limit_bytes: usize,
    streams: BTreeMap<RequestId, Stream>,
    by_ctx: HashMap<(usize, u32), RequestId>,
    next_request: u64,
    next_worker: usize,
    upstream: Upstream,
    errors: Vec<HostError>,
    restarts: usize,
    fuel_total: u64,
    /// Streams with something to do (a continue, a local reply, a reset, a new request).
    dirty: BTreeSet<RequestId>,
    /// Finished streams, oldest first, kept for [`Gateway::outcome`] up to a bound.
    finished: VecDeque<RequestId>,
}

impl Gateway {
    /// Loads a `.wasm` (or `.wat`) file with this plugin configuration, in Envoy mode, one
    /// worker. Shorthand for `Gateway::builder(path).config(config).build()`.
    ///
    /// # Errors
    /// As [`GatewayBuilder::build`].
    pub fn load(path: impl AsRef<Path>, config: impl AsRef<[u8]>) -> Result<Gateway, HostError> {
        Self::builder(path).config(config).build()
    }

    /// Loads a module from bytes (binary or text format).
    ///
    /// # Errors
    /// As [`GatewayBuilder::build`].
    pub fn load_bytes(
        wasm: impl AsRef<[u8]>,
        config: impl AsRef<[u8]>,
    ) -> Result<Gateway, HostError> {
        Self::builder_bytes(wasm).config(config).build()
    }

    /// Settings for a module file.
    pub fn builder(path: impl AsRef<Path>) -> GatewayBuilder {
        GatewayBuilder::new(Source::Path(path.as_ref().to_path_buf()))
    }

    /// Settings for a module given as bytes (binary or text format).
    pub fn builder_bytes(wasm: impl AsRef<[u8]>) -> GatewayBuilder {
        GatewayBuilder::new(Source::Bytes(wasm.as_ref().to_vec()))
    }

    /// Grows to `n` worker VMs (each starts and is configured like the first).
    ///
    /// # Panics
    /// If a new VM fails to start; use [`Gateway::try_workers`] to get the error.
    pub fn workers(self, n: usize) -> Self {
        match self.try_workers(n) {
            Ok(gw) => gw,
            Err(e) => panic!("starting worker VMs failed: {e}"),
        }
    }

    /// Grows to `n` worker VMs.
    ///
    /// # Errors
    /// The first VM start failure.
    pub fn try_workers(mut self, n: usize) -> Result<Self, HostError> {
        let missing = n.saturating_sub(self.vms.len());
        self.add_workers(missing)?;
        Ok(self)
    }

    fn add_workers(&mut self, n: usize) -> Result<(), HostError> {
        for _ in 0..n {
            let worker = self.vms.len();
            let vm = self.start_vm(worker)?;
            self.vms.push(Some(vm));
            self.settle();
        }
        Ok(())
    }

    fn start_vm(&self, worker: usize) -> Result<Vm, HostError> {
        Vm::start(
            &self.module,
            &self.linker,
            self.opts.clone(),
            self.shared.clone(),
            worker,
        )
    }

    /// Number of worker VMs.
    pub fn worker_count(&self) -> usize {
        self.vms.len()
    }

    /// Starts a request; finish it with [`RequestBuilder::send`] or [`RequestBuilder::start`].
    pub fn request(&mut self) -> RequestBuilder<'_> {
        RequestBuilder::new(self)
    }

    /// Sets what the upstream answers to requests that reach it. Default: `200`, no body.
    pub fn set_upstream(&mut self, f: impl FnMut(&UpstreamRequest) -> Response + Send + 'static) {
        self.upstream = Box::new(f);
    }

    // ---- clusters and callouts ----

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

    /// Answers a pending callout and runs everything that follows. Returns false if no such
    /// callout is pending (answered, timed out, or cancelled with its stream).
    pub fn reply(&mut self, id: CalloutId, reply: CalloutReply) -> bool {
        let pending = self
            .vms
            .get(id.worker)
            .and_then(|v| v.as_ref())
            .is_some_and(|vm| vm.store.data().calls.contains_key(&id.token));
        if !pending {
            return false;
        }
        match reply {
            CalloutReply::Response(r) => self.deliver_callout(id, Some(r)),
            CalloutReply::Reset => self.deliver_callout(id, None),
            CalloutReply::NoReply => {}
        }
        self.settle();
        true
    }

    fn deliver_callout(&mut self, id: CalloutId, response: Option<Response>) {
        let Some(Some(vm)) = self.vms.get_mut(id.worker) else {
            return;
        };
        let Some(call) = vm.store.data_mut().calls.remove(&id.token) else {
            return;
        };
        let context = call.callout.context_id;
        let alive = context == vm.root_id() || vm.store.data().contexts.contains_key(&context);
        if !alive {
            return;
        }
        let response = response.map(|r| CallResponse {
            headers: r.headers_with_status(),
            body: r.body,
            trailers: r.trailers.unwrap_or_default(),
        });
        let result = vm.on_http_call_response(context, id.token, response);
        self.account(id.worker, context, result.as_ref().copied().unwrap_or(0));
        match result {
            Ok(_) => self.apply_deferred(id.worker, None),
            Err(e) => self.fail_vm(id.worker, e),
        }
    }

    // ---- clock ----

    /// Moves the test clock forward, firing due ticks (on every VM with a tick period) and
    /// callout timeouts in time order.
    pub fn advance(&mut self, by: Duration) {
        let target = self.now_nanos() + by.as_nanos() as u64;
        loop {
            let mut next: Option<u64> = None;
            for vm in self.vms.iter().flatten() {
                let s = vm.store.data();
                let times = s
                    .next_tick_nanos
                    .into_iter()
                    .chain(s.calls.values().filter_map(|c| c.deadline_nanos));
                for t in times {
                    next = Some(next.map_or(t, |n: u64| n.min(t)));
                }
            }
            let Some(t) = next.filter(|t| *t <= target) else {
                break;
            };
            self.shared.lock().now_nanos = self.now_nanos().max(t);
            for w in 0..self.vms.len() {
                let due: Vec<u32> = match &self.vms[w] {
                    Some(vm) => vm
                        .store
                        .data()
                        .calls
                        .iter()
                        .filter(|(_, c)| c.deadline_nanos.is_some_and(|d| d <= t))
                        .map(|(k, _)| *k)
                        .collect(),
                    None => continue,
                };
                for token in due {
                    // Envoy's router answers a timed-out callout itself.
                    let timeout = Response::new(504)
                        .header("content-length", "24")
                        .header("content-type", "text/plain")
                        .body("upstream request timeout");
                    self.deliver_callout(CalloutId { worker: w, token }, Some(timeout));
                }
            }
            for w in 0..self.vms.len() {
                let Some(vm) = self.vms[w].as_mut() else {
                    continue;
                };
                let s = vm.store.data_mut();
                if s.next_tick_nanos.is_some_and(|n| n <= t) {
                    s.next_tick_nanos = Some(t + s.tick_period_ms as u64 * 1_000_000);
                    let result = vm.on_tick();
                    self.fuel_total += result.as_ref().copied().unwrap_or(0);
                    match result {
                        Ok(_) => self.apply_deferred(w, None),
                        Err(e) => self.fail_vm(w, e),
                    }
                }
            }
            self.settle();
        }
        self.shared.lock().now_nanos = target;
        self.settle();
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

    // ---- shared state ----

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

    /// Enqueues onto a shared queue of this gateway's `vm_id`, as another plugin would; the
    /// owner VM gets `proxy_on_queue_ready`. Returns false if no such queue is registered.
    pub fn enqueue(&mut self, queue: &str, value: impl AsRef<[u8]>) -> bool {
        {
            let mut inner = self.shared.lock();
            let Some(token) = inner.queues.resolve(&self.opts.vm_id, queue) else {
                return false;
            };
            let q = inner
                .queues
                .by_token
                .get_mut(&token)
                .expect("resolved queue");
            q.items.push_back(value.as_ref().to_vec());
            let ready = (q.owner_vm, q.owner_root, token);
            inner.queue_ready.push(ready);
        }
        self.settle();
        true
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

    /// Runs `proxy_on_foreign_function(root, function_id, args)` on a worker.
    ///
    /// # Errors
    /// A trap (the VM is then recreated) or a failed VM.
    pub fn call_on_foreign_function(
        &mut self,
        worker: usize,
        function_id: u32,
        args: &[u8],
    ) -> Result<(), HostError> {
        let Some(Some(vm)) = self.vms.get_mut(worker) else {
            return Err(HostError::VmFailed(worker));
        };
        let r = vm.on_foreign_function(function_id, args.to_vec());
        let out = match r {
            Ok(fuel) => {
                self.fuel_total += fuel;
                self.apply_deferred(worker, None);
                Ok(())
            }
            Err(e) => {
                self.fail_vm(worker, e.clone());
                Err(e)
            }
        };
        self.settle();
        out
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

    // ---- streams ----

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

    /// Answers a request held with [`RequestBuilder::hold_response`] once it reached the
    /// upstream. Returns false if it is not waiting for a response.
    pub fn respond(&mut self, id: RequestId, response: Response) -> bool {
        match self.streams.get_mut(&id) {
            Some(st) if st.phase == Phase::AwaitingResponse => {
                st.canned_response = Some(response);
                st.hold_response = false;
                self.dirty.insert(id);
            }
            _ => return false,
        }
        self.settle();
        true
    }

    /// Resets a stream from the client side (Envoy: downstream reset): `on_log`, `on_done`,
    /// `on_delete` run and pending callouts of the stream are cancelled.
    pub fn reset(&mut self, id: RequestId) {
        if let Some(st) = self.streams.get_mut(&id) {
            if st.phase != Phase::Done {
                st.reset = true;
                self.dirty.insert(id);
            }
        }
        self.settle();
    }

    fn start_request(&mut self, spec: RequestSpec) -> RequestId {
        let id = RequestId(self.next_request);
        self.next_request += 1;
        let worker = spec.worker.unwrap_or_else(|| {
            let w = self.next_worker % self.vms.len();
            self.next_worker += 1;
            w
        });
        let mut st = Stream {
            worker,
            ctx: 0,
            phase: Phase::Request,
            state: StreamState::RequestPaused,
            req: Dir::new(spec.headers, spec.body, spec.trailers),
            resp: Dir::default(),
            hold_response: spec.hold_response,
            canned_response: spec.response,
            local: None,
            response_override: None,
            reset: false,
            fuel: 0,
            final_response: None,
            override_host: None,
            properties: Vec::new(),
        };
        let Some(Some(vm)) = self.vms.get_mut(worker) else {
            st.phase = Phase::Done;
            st.state = StreamState::Failed(HostError::VmFailed(worker));
            self.streams.insert(id, st);
            self.retire(id);
            return id;
        };
        let created = vm.create_http_context(spec.properties);
        let ctx = match &created {
            Ok((ctx, _)) | Err((ctx, _)) => *ctx,
        };
        st.ctx = ctx;
        self.by_ctx.insert((worker, ctx), id);
        self.streams.insert(id, st);
        self.dirty.insert(id);
        match created {
            Ok((_, fuel)) => self.account(worker, ctx, fuel),
            Err((_, e)) => {
                self.fail_vm(worker, e);
                return id;
            }
        }
        self.settle();
        id
    }

    fn account(&mut self, worker: usize, ctx: u32, fuel: u64) {
        self.fuel_total += fuel;
        if let Some(id) = self.by_ctx.get(&(worker, ctx)) {
            if let Some(st) = self.streams.get_mut(id) {
                st.fuel += fuel;
            }
        }
    }

    /// Runs everything that can run: dirty streams, queue notifications, callouts a cluster
    /// answers by itself. Deterministic order.
    fn settle(&mut self) {
        loop {
            if let Some(id) = self.dirty.pop_first() {
                self.drive(id);
                continue;
            }
            let ready = std::mem::take(&mut self.shared.lock().queue_ready);
            if !ready.is_empty() {
                for (worker, root, token) in ready {
                    let Some(Some(vm)) = self.vms.get_mut(worker) else {
                        continue;
                    };
                    let r = vm.on_queue_ready(root, token);
                    self.fuel_total += r.as_ref().copied().unwrap_or(0);
                    match r {
                        Ok(_) => self.apply_deferred(worker, None),
                        Err(e) => self.fail_vm(worker, e),
                    }
                }
                continue;
            }
            if self.answer_one_callout() {
                continue;
            }
            break;
        }
    }

    /// Asks a cluster's handler (or forwards) for the first pending callout not asked yet.
    fn answer_one_callout(&mut self) -> bool {
        let mut found = None;
        'outer: for (w, vm) in self.vms.iter_mut().enumerate() {
            let Some(vm) = vm else { continue };
            for (token, call) in vm.store.data_mut().calls.iter_mut() {
                if call.consulted {
                    continue;
                }
                call.consulted = true;
                found = Some((
                    CalloutId {
                        worker: w,
                        token: *token,
                    },
                    call.callout.clone(),
                ));
                break 'outer;
            }
        }
        let Some((id, callout)) = found else {
            return false;
        };
        let reply = {
            let mut inner = self.shared.lock();
            match inner.clusters.get_mut(&callout.cluster) {
                Some(ClusterTarget::Handler(h)) => h(&callout),
                Some(ClusterTarget::Forward(addr)) => crate::http::forward(*addr, &callout),
                Some(ClusterTarget::Manual) | None => CalloutReply::NoReply,
            }
        };
        match reply {
            CalloutReply::Response(r) => self.deliver_callout(id, Some(r)),
            CalloutReply::Reset => self.deliver_callout(id, None),
            CalloutReply::NoReply => {}
        }
        true
    }

    /// Applies a VM's effects queued during its last call. `current`: the stream and side whose
    /// callback just ran (a continue during it turns its Pause into Continue, as Envoy's
    /// after-call action does).
    fn apply_deferred(&mut self, worker: usize, current: Option<(RequestId, Side)>) {
        let Some(Some(vm)) = self.vms.get_mut(worker) else {
            return;
        };
        let deferred = std::mem::take(&mut vm.store.data_mut().deferred);
        // Override host and properties are read back into the stream after every call.
        let snapshots: Vec<(u32, Option<Vec<u8>>, Vec<Property>)> = vm
            .store
            .data()
            .contexts
            .iter()
            .map(|(id, c)| (*id, c.override_host.clone(), c.set_properties.clone()))
            .collect();
        for (ctx, host, props) in snapshots {
            if let Some(st) = self
                .by_ctx
                .get(&(worker, ctx))
                .and_then(|id| self.streams.get_mut(id))
            {
                st.override_host = host.map(|h| String::from_utf8_lossy(&h).into_owned());
                st.properties = props;
            }
        }
        for d in deferred {
            let ctx = match &d {
                Deferred::Continue { context, .. }
                | Deferred::Close { context, .. }
                | Deferred::Local { context, .. } => *context,
            };
            let Some(&id) = self.by_ctx.get(&(worker, ctx)) else {
                continue;
            };
            let Some(st) = self.streams.get_mut(&id) else {
                continue;
            };
            if st.phase == Phase::Done {
                continue;
            }
            match d {
                Deferred::Continue { stream, .. } => {
                    let side = if stream == crate::abi::stream::REQUEST {
                        Side::Request
                    } else {
                        Side::Response
                    };
                    let in_callback = current == Some((id, side));
                    let phase_ok = match side {
                        Side::Request => st.phase == Phase::Request,
                        Side::Response => st.phase == Phase::Response,
                    };
                    let dir = st.dir(side);
                    if phase_ok && (dir.held || in_callback) {
                        dir.resume = true;
                        self.dirty.insert(id);
                    }
                }
                Deferred::Close { .. } => {
                    st.reset = true;
                    self.dirty.insert(id);
                }
                Deferred::Local { response, .. } => self.local_reply(id, response),
            }
        }
    }

    fn local_reply(&mut self, id: RequestId, local: LocalResponse) {
        let Some(st) = self.streams.get_mut(&id) else {
            return;
        };
        if st.local.is_some() && st.phase == Phase::Response {
            return;
        }
        let mut response = Response::new(local.status);
        if !local.body.is_empty() {
            response
                .headers
                .add("content-length", &local.body.len().to_string());
            response.headers.add("content-type", "text/plain");
        }
        for (k, v) in local.headers.iter_bytes() {
            response.headers.set_bytes(k, v);
        }
        response.body = local.body.clone();
        st.local = Some(local);
        self.dirty.insert(id);
        match st.phase {
            // The request is abandoned; the reply goes through the response callbacks.
            Phase::Request | Phase::AwaitingResponse => {
                st.phase = Phase::Response;
                st.resp = Dir::new(response.headers_with_status(), vec![response.body], None);
            }
            Phase::Response => st.response_override = Some(response),
            Phase::Done => {}
        }
    }

    fn drive(&mut self, id: RequestId) {
        loop {
            let Some(st) = self.streams.get_mut(&id) else {
                return;
            };
            if st.phase == Phase::Done {
                return;
            }
            if st.reset {
                self.finish(id, StreamState::Reset);
                return;
            }
            match st.phase {
                Phase::Request => match self.pump(id, Side::Request) {
                    Err(()) => return,
                    Ok(Flow::Waiting) => {
                        self.set_state(id, StreamState::RequestPaused);
                        return;
                    }
                    Ok(Flow::Complete) => {
                        let st = self.streams.get_mut(&id).expect("stream");
                        if st.phase == Phase::Request {
                            st.phase = Phase::AwaitingResponse;
                        }
                    }
                    Ok(Flow::Ended) => {}
                },
                Phase::AwaitingResponse => {
                    if st.hold_response && st.canned_response.is_none() {
                        self.set_state(id, StreamState::AwaitingResponse);
                        return;
                    }
                    let response = match st.canned_response.take() {
                        Some(r) => r,
                        None => {
                            let req = UpstreamRequest {
                                worker: st.worker,
                                headers: st.req.out_headers.clone().unwrap_or_default(),
                                body: st.req.out_body.clone(),
                                trailers: st.req.out_trailers.clone(),
                            };
                            (self.upstream)(&req)
                        }
                    };
                    let st = self.streams.get_mut(&id).expect("stream");
                    st.resp = Dir::new(
                        response.headers_with_status(),
                        vec![response.body],
                        response.trailers,
                    );
                    st.phase = Phase::Response;
                }
                Phase::Response => match self.pump(id, Side::Response) {
                    Err(()) => return,
                    Ok(Flow::Waiting) => {
                        self.set_state(id, StreamState::ResponsePaused);
                        return;
                    }
                    Ok(Flow::Complete) | Ok(Flow::Ended) => {
                        let st = self.streams.get_mut(&id).expect("stream");
                        if st.reset {
                            continue;
                        }
                        let response = match st.response_override.take() {
                            Some(r) => r,
                            None => {
                                let mut headers = st.resp.out_headers.clone().unwrap_or_default();
                                let status = headers
                                    .get(":status")
                                    .and_then(|s| s.parse().ok())
                                    .unwrap_or(200);
                                headers.remove(":status");
                                Response {
                                    status,
                                    headers,
                                    body: st.resp.out_body.clone(),
                                    trailers: st.resp.out_trailers.clone(),
                                }
                            }
                        };
                        st.final_response = Some(response);
                        self.finish(id, StreamState::Complete);
                        return;
                    }
                },
                Phase::Done => return,
            }
        }
    }

    fn set_state(&mut self, id: RequestId, state: StreamState) {
        if let Some(st) = self.streams.get_mut(&id) {
            st.state = state;
        }
    }

    /// Runs the callbacks of one direction as far as they go. `Err(())`: the VM trapped (the
    /// stream is already marked failed).
    fn pump(&mut self, id: RequestId, side: Side) -> Result<Flow, ()> {
        let passthrough = self.allow_on_headers_stop_iteration || self.abi == Abi::V0_2_100;
        loop {
            let st = self.streams.get_mut(&id).expect("stream");
            let expected = if side == Side::Request {
                Phase::Request
            } else {
                Phase::Response
            };
            if st.phase != expected || st.reset || st.response_override.is_some() {
                return Ok(Flow::Ended);
            }
            let (worker, ctx) = (st.worker, st.ctx);
            let dir = st.dir(side);
            if dir.held {
                if std::mem::take(&mut dir.resume) {
                    let was_stop_all = std::mem::take(&mut dir.stop_all);
                    self.release(id, side);
                    if was_stop_all {
                        // Envoy buffered what arrived meanwhile and hands it over as one chunk.
                        let dir = self.streams.get_mut(&id).expect("stream").dir(side);
                        let merged: Vec<u8> = dir.chunks.drain(..).flatten().collect();
                        if !merged.is_empty() {
                            dir.chunks.push_back(merged);
                        }
                    }
                    continue;
                }
                if dir.stop_all {
                    return Ok(Flow::Waiting);
                }
            }
            // The next event of this direction.
            let (event, a, b) = if !dir.headers_delivered {
                dir.headers_delivered = true;
                let headers = dir.headers.take().unwrap_or_default();
                let n = headers.len() as i32;
                let eos = dir.end_of_stream() as i32;
                let vm = self.vms[worker].as_mut().expect("live vm");
                let c = vm.store.data_mut().contexts.get_mut(&ctx).expect("context");
                match side {
                    Side::Request => c.request_headers = Some(headers),
                    Side::Response => c.response_headers = Some(headers),
                }
                let event = if side == Side::Request {
                    StreamEvent::RequestHeaders
                } else {
                    StreamEvent::ResponseHeaders
                };
                (event, n, eos)
            } else if let Some(chunk) = dir.chunks.pop_front() {
                let eos = dir.end_of_stream() as i32;
                let vm = self.vms[worker].as_mut().expect("live vm");
                let c = vm.store.data_mut().contexts.get_mut(&ctx).expect("context");
                let body = match side {
                    Side::Request => &mut c.request_body,
                    Side::Response => &mut c.response_body,
                };
                body.extend_from_slice(&chunk);
                let event = if side == Side::Request {
                    StreamEvent::RequestBody
                } else {
                    StreamEvent::ResponseBody
                };
                (event, body.len() as i32, eos)
            } else if dir.trailers.is_some() && !dir.trailers_delivered {
                dir.trailers_delivered = true;
                let trailers = dir.trailers.clone().unwrap_or_default();
                let n = trailers.len() as i32;
                let vm = self.vms[worker].as_mut().expect("live vm");
                let c = vm.store.data_mut().contexts.get_mut(&ctx).expect("context");
                match side {
                    Side::Request => c.request_trailers = Some(trailers),
                    Side::Response => c.response_trailers = Some(trailers),
                }
                let event = if side == Side::Request {
                    StreamEvent::RequestTrailers
                } else {
                    StreamEvent::ResponseTrailers
                };
                (event, n, 0)
            } else if dir.held {
                return Ok(Flow::Waiting);
            } else {
                self.release(id, side);
                return Ok(Flow::Complete);
            };

            let vm = self.vms[worker].as_mut().expect("live vm");
            let result = vm.on_stream_event(event, ctx, a, b);
            let called = match result {
                Ok(c) => c,
                Err(e) => {
                    self.fail_vm(worker, e);
                    return Err(());
                }
            };
            self.account(worker, ctx, called.fuel);
            self.apply_deferred(worker, Some((id, side)));
            let st = self.streams.get_mut(&id).expect("stream");
            if st.phase != expected || st.reset || st.response_override.is_some() {
                return Ok(Flow::Ended);
            }
            let dir = st.dir(side);
            let resumed = std::mem::take(&mut dir.resume);
            if called.value == 0 || resumed {
                self.release(id, side);
                continue;
            }
            dir.held = true;
            match event {
                StreamEvent::RequestHeaders | StreamEvent::ResponseHeaders => {
                    dir.stop_all = !passthrough
                }
                StreamEvent::RequestBody => {
                    // StopIterationAndBuffer: Envoy's request buffer limit answers 413.
                    let vm = self.vms[worker].as_ref().expect("live vm");
                    let buffered = vm
                        .store
                        .data()
                        .contexts
                        .get(&ctx)
                        .map_or(0, |c| c.request_body.len());
                    if buffered > self.buffer_limit_bytes {
                        self.local_reply(
                            id,
                            LocalResponse {
                                status: 413,
                                details: "request_payload_too_large".into(),
                                headers: Headers::new(),
                                body: b"Payload Too Large".to_vec(),
                                grpc_status: -1,
                                from_filter: false,
                            },
                        );
                        return Ok(Flow::Ended);
                    }
                }
                _ => {}
            }
        }
    }

    /// Everything the filter held in this direction goes on (upstream or to the client).
    fn release(&mut self, id: RequestId, side: Side) {
        let st = self.streams.get_mut(&id).expect("stream");
        let (worker, ctx) = (st.worker, st.ctx);
        let Some(Some(vm)) = self.vms.get_mut(worker) else {
            return;
        };
        let Some(c) = vm.store.data_mut().contexts.get_mut(&ctx) else {
            return;
        };
        let (headers, body, trailers) = match side {
            Side::Request => (&c.request_headers, &mut c.request_body, &c.request_trailers),
            Side::Response => (
                &c.response_headers,
                &mut c.response_body,
                &c.response_trailers,
            ),
        };
        let dir = st.dir(side);
        dir.held = false;
        if dir.out_headers.is_none() {
            dir.out_headers = Some(headers.clone().unwrap_or_default());
        }
        dir.out_body.append(body);
        if dir.trailers_delivered && dir.out_trailers.is_none() {
            dir.out_trailers = trailers.clone();
        }
    }

    /// Keeps a finished stream for [`Gateway::outcome`], forgetting the oldest past the bound.
    fn retire(&mut self, id: RequestId) {
        self.dirty.remove(&id);
        self.finished.push_back(id);
        while self.finished.len() > MAX_FINISHED_REQUESTS {
            if let Some(old) = self.finished.pop_front() {
                self.streams.remove(&old);
            }
        }
    }

    fn finish(&mut self, id: RequestId, state: StreamState) {
        let st = self.streams.get_mut(&id).expect("stream");
        st.phase = Phase::Done;
        st.state = state;
        let (worker, ctx) = (st.worker, st.ctx);
        self.retire(id);
        let Some(Some(vm)) = self.vms.get_mut(worker) else {
            return;
        };
        let result = vm.end_context(ctx);
        match result {
            Ok(fuel) => {
                self.account(worker, ctx, fuel);
                self.apply_deferred(worker, None);
                self.by_ctx.remove(&(worker, ctx));
            }
            Err(e) => self.fail_vm(worker, e),
        }
    }

    /// A trap kills the VM, as in Envoy; here the failure goes to every open stream of that
    /// VM and a fresh VM takes its place (Envoy's `failure_policy: FAIL_RELOAD`).
    fn fail_vm(&mut self, worker: usize, error: HostError) {
        self.errors.push(error.clone());
        let victims: Vec<RequestId> = self
            .streams
            .iter()
            .filter(|(_, s)| s.worker == worker && s.phase != Phase::Done)
            .map(|(id, _)| *id)
            .collect();
        for id in victims {
            let st = self.streams.get_mut(&id).expect("stream");
            st.phase = Phase::Done;
            st.state = StreamState::Failed(error.clone());
            self.retire(id);
        }
        // A stream that was finishing fails in its own on_log/on_done: it is still mapped.
        let finishing: Vec<RequestId> = self
            .by_ctx
            .iter()
            .filter(|((w, _), _)| *w == worker)
            .map(|(_, id)| *id)
            .collect();
        for id in finishing {
            if let Some(st) = self.streams.get_mut(&id) {
                st.state = StreamState::Failed(error.clone());
            }
        }
        self.by_ctx.retain(|(w, _), _| *w != worker);
        self.vms[worker] = None;
        match self.start_vm(worker) {
            Ok(vm) => {
                self.vms[worker] = Some(vm);
                self.restarts += 1;
            }
            Err(e) => self.errors.push(e),
        }
    }
}

struct RequestSpec {
    headers: Headers,
    body: Vec<Vec<u8>>,
    trailers: Option<Headers>,
    worker: Option<usize>,
    properties: HashMap<Vec<String>, Vec<u8>>,
    response: Option<Response>,
    hold_response: bool,
}

/// Builds one request. Defaults: `GET` (`POST` once a body is set), path `/`, authority
/// `localhost`, scheme `http`; a body adds `content-length`; the body arrives as one chunk;
/// round-robin over workers; the upstream answers with [`Gateway::set_upstream`]'s responder.
pub struct RequestBuilder<'g> {
    gw: &'g mut Gateway,
    method: Option<String>,
    path: String,
    authority: String,
    scheme: String,
    headers: Headers,
    body: Option<Vec<u8>>,
    chunk_size: Option<usize>,
    chunks: Option<Vec<Vec<u8>>>,
    trailers: Option<Headers>,
    worker: Option<usize>,
    properties: HashMap<Vec<String>, Vec<u8>>,
    response: Option<Response>,
    hold_response: bool,
}

impl<'g> RequestBuilder<'g> {
    fn new(gw: &'g mut Gateway) -> Self {
        RequestBuilder {
            gw,
            method: None,
            path: "/".into(),
            authority: "localhost".into(),
            scheme: "http".into(),
            headers: Headers::new(),
            body: None,
            chunk_size: None,
            chunks: None,
            trailers: None,
            worker: None,
            properties: HashMap::new(),
            response: None,
            hold_response: false,
        }
    }

    /// `:method`.
    pub fn method(mut self, method: &str) -> Self {
        self.method = Some(method.into());
        self
    }

    /// `:path`.
    pub fn path(mut self, path: &str) -> Self {
        self.path = path.into();
        self
    }

    /// `:authority`.
    pub fn authority(mut self, authority: &str) -> Self {
        self.authority = authority.into();
        self
    }

    /// Adds a header (name lower-cased).
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.add(name, value);
        self
    }

    /// Adds a header with a byte value (not necessarily UTF-8).
    pub fn header_bytes(mut self, name: &str, value: &[u8]) -> Self {
        self.headers.add_bytes(name.as_bytes(), value);
        self
    }

    /// Sets the body.
    pub fn body(mut self, body: impl Into<Vec<u8>>) -> Self {
        self.body = Some(body.into());
        self
    }

    /// Sets a JSON body and `content-type: application/json`.
    ///
    /// # Panics
    /// If `value` does not serialize.
    pub fn json_body<T: serde::Serialize + ?Sized>(mut self, value: &T) -> Self {
        self.body = Some(serde_json::to_vec(value).expect("serializable body"));
        self.headers.set("content-type", "application/json");
        self
    }

    /// Delivers the body in chunks of this many bytes (Envoy delivers what the network gives).
    pub fn chunk_size(mut self, bytes: usize) -> Self {
        self.chunk_size = Some(bytes.max(1));
        self
    }

    /// Delivers the body as exactly these chunks (overrides [`RequestBuilder::body`]).
    pub fn body_chunks(mut self, chunks: Vec<Vec<u8>>) -> Self {
        self.chunks = Some(chunks);
        self
    }

    /// Adds a request trailer.
    pub fn trailer(mut self, name: &str, value: &str) -> Self {
        self.trailers
            .get_or_insert_with(Headers::new)
            .add(name, value);
        self
    }

    /// Sends to this worker VM instead of round-robin.
    pub fn worker(mut self, worker: usize) -> Self {
        self.worker = Some(worker);
        self
    }

    /// A property of this request only (metadata, filter state set by an earlier filter...).
    pub fn property(mut self, path: &[&str], value: impl AsRef<[u8]>) -> Self {
        self.properties.insert(
            path.iter().map(|s| s.to_string()).collect(),
            value.as_ref().to_vec(),
        );
        self
    }

    /// What the upstream answers to this request.
    pub fn upstream_response(mut self, response: Response) -> Self {
        self.response = Some(response);
        self
    }

    /// Keeps the stream open once the request reached the upstream, until
    /// [`Gateway::respond`] (to observe state held while requests are in flight).
    pub fn hold_response(mut self) -> Self {
        self.hold_response = true;
        self
    }

    fn into_spec(self) -> (&'g mut Gateway, RequestSpec) {
        let chunks = match (self.chunks, &self.body) {
            (Some(c), _) => c,
            (None, Some(b)) => match self.chunk_size {
                Some(n) => b.chunks(n).map(<[u8]>::to_vec).collect(),
                None => vec![b.clone()],
            },
            (None, None) => Vec::new(),
        };
        let has_body = chunks.iter().any(|c| !c.is_empty());
        let mut headers = Headers::new();
        let method = self.method.unwrap_or_else(|| {
            if has_body {
                "POST".into()
            } else {
                "GET".into()
            }
        });
        headers.add(":method", &method);
        headers.add(":scheme", &self.scheme);
        headers.add(":authority", &self.authority);
        headers.add(":path", &self.path);
        for (k, v) in self.headers.iter_bytes() {
            headers.add_bytes(k, v);
        }
        if has_body && !headers.contains("content-length") {
            let len: usize = chunks.iter().map(Vec::len).sum();
            headers.add("content-length", &len.to_string());
        }
        let spec = RequestSpec {
            headers,
            body: chunks,
            trailers: self.trailers,
            worker: self.worker,
            properties: self.properties,
            response: self.response,
            hold_response: self.hold_response,
        };
        (self.gw, spec)
    }

    /// Runs the request as far as it goes (callouts answered by their cluster included) and
    /// returns its outcome. A paused request can go on later: [`Gateway::reply`],
    /// [`Gateway::advance`], then [`Gateway::outcome`].
    pub fn send(self) -> Outcome {
        let (gw, spec) = self.into_spec();
        let id = gw.start_request(spec);
        gw.outcome(id)
    }

    /// Like [`RequestBuilder::send`] but returns the id only.
    pub fn start(self) -> RequestId {
        let (gw, spec) = self.into_spec();
        gw.start_request(spec)
    }
}

/// Path of a module built by `cargo build --release --target wasm32-wasip1` in this
/// workspace: `$CARGO_TARGET_DIR/wasm32-wasip1/release/<name>.wasm` when `CARGO_TARGET_DIR`
/// is set (relative to the workspace root if relative), else `<workspace>/target/...`.
pub fn wasm_path(name: &str) -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf();
    let target = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => workspace.join(dir),
        None => workspace.join("target"),
    };
    target
        .join("wasm32-wasip1")
        .join("release")
        .join(format!("{name}.wasm"))
}

/// [`wasm_path`], checked to exist.
///
/// # Errors
/// [`HostError::MissingFixture`], whose message says to run `make wasm`.
pub fn built_wasm(name: &str) -> Result<PathBuf, HostError> {
    let path = wasm_path(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(HostError::MissingFixture {
            path: path.display().to_string(),
        })
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

impl std::fmt::Debug for GatewayBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewayBuilder")
            .field("mode", &self.opts.mode)
            .field("workers", &self.workers)
            .field(
                "allow_on_headers_stop_iteration",
                &self.allow_on_headers_stop_iteration,
            )
            .field("buffer_limit_bytes", &self.buffer_limit_bytes)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for RequestBuilder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestBuilder")
            .field("path", &self.path)
            .field("headers", &self.headers)
            .finish_non_exhaustive()
    }
}
