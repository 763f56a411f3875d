//! Loading: [`GatewayBuilder`] compiles the module (cached), checks its imports and ABI,
//! links the hostcalls and starts the worker VMs; and where `make wasm` puts built modules.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::SystemTime;

use wasmtime::{Config, Engine, Linker, Module, OptLevel};

use crate::abi::LogLevel;
use crate::gateway::Gateway;
use crate::hostcalls;
use crate::model::{HostOptions, Mode, CLOCK_ORIGIN_NANOS, DEFAULT_FUEL_PER_CALL};
use crate::shared::Shared;
use crate::types::{HostError, Response};
use crate::vm;

/// Envoy's default request buffer limit (`per_connection_buffer_limit_bytes`, 1 MiB).
pub const DEFAULT_BUFFER_LIMIT_BYTES: usize = 1024 * 1024;

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
                fuel_per_call: DEFAULT_FUEL_PER_CALL,
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
        hostcalls::link(&mut linker, self.opts.mode)
            .map_err(|e| HostError::Instantiate(e.to_string()))?;
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
